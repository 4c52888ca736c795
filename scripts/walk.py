"""Walk the code as a reader does, from one function, and count the rooms (modules) entered.

    python scripts/walk.py                       # from ddpkit.launch.supervisor:launch
    python scripts/walk.py ddpkit.rank.bootstrap:main --path
    python scripts/walk.py torch.distributed.launcher.api:launch_agent \
        --src "$(python -c 'import torch, os; print(os.path.dirname(torch.__path__[0]))')" \
        --package torch/distributed

The walk is static: every ddpkit function a function calls (in source order) is read the first
time it is met, depth first; the module each function lives in is its room. Consecutive
functions of one room are one stay. A stay in a room already left is a return: a reader who
must go back to a module to follow the code. The figure issue 36 asks for is returns / stays
(at most 40% for `launch(cfg)`).

Calls are resolved from the imports: `module.function`, a name imported from a module, a
class (its __init__), `self.method`, and `obj.method` where only one class in ddpkit defines a
method of that name. Unresolved calls (the standard library, torch, attributes of unknown
objects) are not followed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


@dataclass
class Module:
    name: str
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # local name -> "module" or "module:fn"


def module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load(src: Path = SRC, root: str = "ddpkit") -> dict[str, Module]:
    """Every module under `src / root` (a package's folder), by its dotted name."""
    modules: dict[str, Module] = {}
    for path in sorted((src / root).rglob("*.py")):
        name = module_name(path, src)
        found = Module(name)
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module is not None
                or (isinstance(node, ast.ImportFrom) and node.level)
            ):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    found.names[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        found.names[alias.asname] = alias.name
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                found.names.setdefault(node.name, f"{name}.{node.name}")
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.functions[f"{node.name}.{item.name}"] = item
        modules[name] = found
    return modules


class Walker:
    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self.seen: set[tuple[str, str]] = set()
        self.order: list[tuple[str, str]] = []
        self.callers: list[frozenset[str]] = []  # for each of order, the rooms on the stack
        self._stack: list[str] = []
        methods: dict[str, list[tuple[str, str]]] = {}
        for m in modules.values():
            for fn in m.functions:
                if "." in fn:
                    methods.setdefault(fn.split(".", 1)[1], []).append((m.name, fn))
        self.unique_methods = {k: v[0] for k, v in methods.items() if len(v) == 1}

    def target(self, dotted: str) -> tuple[str, str] | None:
        """A dotted name ("pkg.mod.fn", "pkg.mod.Class") as (module, function)."""
        if dotted in self.modules:
            return None  # a module, not a callable
        head, _, tail = dotted.rpartition(".")
        if head in self.modules:
            m = self.modules[head]
            if tail in m.functions:
                return head, tail
            if f"{tail}.__init__" in m.functions:
                return head, f"{tail}.__init__"
            if f"{tail}.__post_init__" in m.functions:
                return head, f"{tail}.__post_init__"
            if tail in m.names and m.names[tail] != dotted:  # re-exported
                return self.target(m.names[tail])
        return None

    def resolve(self, module: Module, cls: str | None, call: ast.Call) -> tuple[str, str] | None:
        f = call.func
        if isinstance(f, ast.Name):
            if f.id in module.functions:
                return module.name, f.id
            if f"{f.id}.__init__" in module.functions:
                return module.name, f"{f.id}.__init__"
            if f.id in module.names:
                return self.target(module.names[f.id])
            return None
        if isinstance(f, ast.Attribute):
            v = f.value
            if isinstance(v, ast.Name):
                if v.id in ("self", "cls") and cls and f"{cls}.{f.attr}" in module.functions:
                    return module.name, f"{cls}.{f.attr}"
                if v.id in module.names and module.names[v.id] in self.modules:
                    return self.target(f"{module.names[v.id]}.{f.attr}")
                if v.id in module.names:  # Class.method
                    dotted = module.names[v.id]
                    head, _, klass = dotted.rpartition(".")
                    if head in self.modules and f"{klass}.{f.attr}" in self.modules[head].functions:
                        return head, f"{klass}.{f.attr}"
                if f"{v.id}.{f.attr}" in module.functions:
                    return module.name, f"{v.id}.{f.attr}"
            unique = self.unique_methods.get(f.attr)
            if unique is not None and not f.attr.startswith("__") and self.sees(module, unique[0]):
                return unique
        return None

    def sees(self, module: Module, other: str) -> bool:
        """Whether `module` can hold an object of `other`'s classes: it is `other`, or it
        imports `other` or a name from it."""
        if other == module.name:
            return True
        return any(
            dotted == other or dotted.rpartition(".")[0] == other
            for dotted in module.names.values()
        )

    def walk(self, where: tuple[str, str]) -> None:
        if where in self.seen or where[0] not in self.modules:
            return
        self.seen.add(where)
        self.order.append(where)
        self.callers.append(frozenset(self._stack))
        module = self.modules[where[0]]
        node = module.functions.get(where[1])
        if node is None:
            return
        cls = where[1].split(".")[0] if "." in where[1] else None
        self._stack.append(where[0])
        for call in calls_in_order(node):
            found = self.resolve(module, cls, call)
            if found is not None:
                self.walk(found)
        self._stack.pop()


def calls_in_order(node: ast.AST) -> list[ast.Call]:
    """The calls in a function's body in the order a reader meets them."""
    found: list[ast.Call] = []

    class Visit(ast.NodeVisitor):
        def visit_Call(self, call: ast.Call) -> None:
            self.generic_visit(call)  # arguments are evaluated first
            found.append(call)

    for stmt in getattr(node, "body", []):
        Visit().visit(stmt)
    return found


def stays(order: list[tuple[str, str]]) -> list[str]:
    rooms: list[str] = []
    for module, _ in order:
        if not rooms or rooms[-1] != module:
            rooms.append(module)
    return rooms


def reentries(order: list[tuple[str, str]], callers: list[frozenset[str]]) -> int:
    """Returns to a room none of whose functions is still being read: the reader goes back to
    a module for a new reason (the coupling issue 36 is about), not to finish a caller."""
    left: set[str] = set()
    count = 0
    previous = None
    for (module, _), on_stack in zip(order, callers, strict=True):
        if module != previous:
            if module in left and module not in on_stack:
                count += 1
            if previous is not None:
                left.add(previous)
            previous = module
    return count


def window_figures(order: list[tuple[str, str]], size: int) -> list[tuple[float, int]]:
    """For each run of `size` consecutive functions of the walk, its returns / stays, with the
    index of its first function: a reader's cost over one sitting, not over the whole walk."""
    figures: list[tuple[float, int]] = []
    for start in range(max(1, len(order) - size + 1)):
        rooms = stays(order[start : start + size])
        figures.append((1 - len(set(rooms)) / len(rooms), start))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("start", nargs="?", default="ddpkit.launch.supervisor:launch")
    parser.add_argument("--path", action="store_true", help="print every stay in order")
    parser.add_argument("--most", type=int, default=8, help="rooms returned to most")
    parser.add_argument("--src", type=Path, default=SRC, help="the folder packages are under")
    parser.add_argument("--package", default="ddpkit", help="the package (folder) walked")
    parser.add_argument(
        "--window", type=int, default=0, help="also the figure over every N consecutive functions"
    )
    args = parser.parse_args()
    module, _, function = args.start.partition(":")
    walker = Walker(load(args.src, args.package))
    walker.walk((module, function))
    if not walker.order:
        print(f"no function {args.start}", file=sys.stderr)
        return 2
    rooms = stays(walker.order)
    distinct = len(set(rooms))
    returns = len(rooms) - distinct
    if args.path:
        for room in rooms:
            print(f"  {room}")
    print(
        f"{args.start}: {len(walker.order)} functions, {len(rooms)} stays in {distinct} rooms, "
        f"{returns} returns to rooms already left ({returns / len(rooms):.0%} of stays)"
    )
    again = reentries(walker.order, walker.callers)
    print(
        f"of the returns, {returns - again} go back to a caller still being read and {again} "
        f"re-enter a room no caller is in ({again / len(rooms):.0%} of stays)"
    )
    counts = Counter(rooms)
    most = [f"{room} x{n}" for room, n in counts.most_common(args.most) if n > 1]
    if most:
        print("visited most: " + ", ".join(most))
    if args.window:
        figures = window_figures(walker.order, args.window)
        ranked = sorted(f for f, _ in figures)
        worst, at = max(figures)
        part = walker.order[at : at + args.window]
        rooms = stays(part)
        shown = Counter(rooms).most_common(4)
        print(
            f"windows of {args.window} functions: median {ranked[len(ranked) // 2]:.0%}, "
            f"worst {worst:.0%} (functions {at + 1}-{at + len(part)}, from {part[0][0]}:"
            f"{part[0][1]}; " + ", ".join(f"{r} x{n}" for r, n in shown) + ")"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The house's layout as a fact: the layers in the tree and who may import whom.

    common/   torch-free code both sides share (never imports torch at import time, nor any
              layer above it)
    train/    the library a script imports (torch); may use common/ and rank/ (what it tells
              the launcher goes through rank/)
    rank/     the worker's bootstrap and records; never imports launch/
    launch/   the launcher; never imports rank/, train/ or doctor/ (it meets the ranks only
              through common/protocol.py)

At the package root only the public modules: `ddpkit` itself, `ddpkit.errors`, `ddpkit.env`.
No module grows past 500 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parents[2] / "src" / "ddpkit"


def imports_of(folder: str, top_level_only: bool = False) -> dict[str, set[str]]:
    """Every module's imports (by file, relative to the folder), recursively."""
    found = {}
    for path in (SRC / folder).rglob("*.py"):
        tree = ast.parse(path.read_text())
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        names = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        found[str(path.relative_to(SRC / folder))] = names
    return found


def offenders(folder: str, forbidden: tuple[str, ...], top_level_only: bool = False) -> dict:
    return {
        module: bad
        for module, names in imports_of(folder, top_level_only).items()
        if (bad := sorted(n for n in names if n.startswith(forbidden)))
    }


def test_the_launcher_never_imports_the_rank_side_the_training_library_or_the_doctor():
    assert not offenders("launch", ("ddpkit.rank", "ddpkit.train", "ddpkit.doctor"))


def test_the_rank_side_never_imports_the_launcher():
    assert not offenders("rank", ("ddpkit.launch",))


def test_common_code_imports_no_layer_above_it_and_no_torch_at_import_time():
    above = ("ddpkit.launch", "ddpkit.rank", "ddpkit.train", "ddpkit.cli", "ddpkit.doctor")
    assert not offenders("common", above)
    assert not offenders("common", ("torch",), top_level_only=True)


def test_importing_every_common_module_leaves_torch_unimported():
    modules = [f"ddpkit.common.{p.stem}" for p in (SRC / "common").glob("*.py")]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules)
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_training_library_tells_the_launcher_things_only_through_the_rank_side():
    assert not offenders("train", ("ddpkit.launch",))


def test_the_package_root_holds_only_the_public_modules():
    root = {p.name for p in SRC.glob("*.py")}
    assert root == {
        "__init__.py",
        "__main__.py",
        "_version.py",
        "errors.py",
        "env.py",
        "spawning.py",
    }


def test_no_module_is_longer_than_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}  # fmt: skip
    assert not long


def test_the_frames_module_knows_where_ddpkit_and_its_bootstrap_are():
    from ddpkit.common import frames

    assert str(SRC.resolve()) + "/" == frames.DDPKIT_DIR
    assert Path(frames.BOOTSTRAP).is_file()
    assert frames.is_library(str(SRC / "train" / "session.py"))
    assert not frames.is_library(str(SRC / "examples" / "digits.py"))


def _module_graph() -> dict[str, set[str]]:
    """ddpkit's modules and the ddpkit modules each imports (anywhere in it, lazily too)."""
    names = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                found |= {base, *(f"{base}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {n for n in found if n in names and n != name}
    return graph


def test_no_two_modules_import_each_other_even_through_others():
    graph = _module_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    packages = {n for n in graph if (SRC.parent / n.replace(".", "/") / "__init__.py").exists()}
    cycles = sorted(
        f"{a} <-> {b}"
        for a in graph
        for b in graph[a] - packages
        if a not in packages and reaches(b, a)
    )
    assert not cycles


def test_the_launchers_folders_read_bottom_up():
    # base/ (what every part names) <- peers/ (the other nodes) <- hang/, speed/ (the watches)
    # <- the loop at launch/'s root
    below = {
        "launch/base": ("ddpkit.launch.base",),
        "launch/peers": ("ddpkit.launch.base", "ddpkit.launch.peers"),
        "launch/hang": ("ddpkit.launch.base", "ddpkit.launch.peers", "ddpkit.launch.hang"),
        "launch/speed": ("ddpkit.launch.base", "ddpkit.launch.peers", "ddpkit.launch.speed"),
    }
    for folder, allowed in below.items():
        wrong = {
            module: bad
            for module, names in imports_of(folder).items()
            if (
                bad := sorted(
                    n for n in names if n.startswith("ddpkit.launch.") and not n.startswith(allowed)
                )
            )
        }
        assert not wrong, folder

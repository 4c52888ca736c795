"""`ddpkit doctor train.py`, the mistakes that show only once a launcher starts the script:
a world size written in it, a collective only some ranks call (`if rank == 0: dist.barrier()`),
a checkpoint every rank writes to one file, a breakpoint() (which only the rank with the
terminal can answer), a MASTER_PORT of its own. Read from the syntax tree, never run."""

from __future__ import annotations

import ast
from collections.abc import Callable

from ddpkit.common import protocol
from ddpkit.common.branches import parents, rank_branch, under_rank_test
from ddpkit.doctor.checks import Finding

# collectives every rank must call (point-to-point calls pair up across a branch by design)
EVERY_RANK = tuple(
    c
    for c in protocol.COLLECTIVES
    if c not in ("send", "recv", "isend", "irecv", "batch_isend_irecv")
)
DISTRIBUTED = ("init_process_group", "DistributedDataParallel", "DDP", "fully_shard", "setup")


def scan(tree: ast.Module, at: Callable[[ast.AST], str]) -> list[Finding]:
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    text_of = {id(c): ast.unparse(c.func) for c in calls}
    up = parents(tree)
    found: list[Finding] = []
    found += _world_size(tree, calls, text_of, at)
    found += _collective_on_some_ranks(calls, text_of, up, at)
    distributed = any(text_of[id(c)].split(".")[-1] in DISTRIBUTED for c in calls)
    if distributed:
        found += _save_on_every_rank(calls, text_of, up, at)
    found += _breakpoints(calls, text_of, at)
    found += _own_port(tree, at)
    return found


def _world_size(tree, calls, text_of, at) -> list[Finding]:
    literal: dict[str, int] = {}  # names bound to an int literal: world_size = 4
    for node in ast.walk(tree):
        bound = node.value if isinstance(node, ast.Assign) else None
        if isinstance(bound, ast.Constant) and type(bound.value) is int:
            for target in node.targets:  # type: ignore[attr-defined]
                if isinstance(target, ast.Name):
                    literal[target.id] = bound.value
    found: list[Finding] = []
    for call in calls:
        if not text_of[id(call)].endswith("init_process_group"):
            continue
        given = next((k.value for k in call.keywords if k.arg == "world_size"), None)
        if given is None and len(call.args) > 3:
            given = call.args[3]
        value: int | None = None
        if isinstance(given, ast.Constant) and isinstance(given.value, int):
            value = given.value
        elif isinstance(given, ast.Name) and given.id in literal:
            value = literal[given.id]
        if value is not None and value != -1:
            found.append(
                Finding(
                    "error",
                    "script",
                    f"world_size={value} is written in the script",
                    "started with any other number of ranks, init waits for ranks that never "
                    "come (ddpkit run refuses it at once)",
                    "leave world_size out of init_process_group (it reads WORLD_SIZE), or pass "
                    "int(os.environ['WORLD_SIZE']); choose the ranks with ddpkit run -n N",
                    at(call),
                )
            )
    return found


def _collective(text: str) -> str | None:
    """'barrier' for dist.barrier / torch.distributed.barrier / a bare barrier imported."""
    parts = text.split(".")
    name = parts[-1]
    if name not in EVERY_RANK:
        return None
    if len(parts) == 1 or parts[-2] in ("dist", "distributed", "torch.distributed"):
        return name
    return None


def _collective_on_some_ranks(calls, text_of, up, at) -> list[Finding]:
    found = []
    for call in calls:
        name = _collective(text_of[id(call)])
        branch = rank_branch(call, up) if name else None
        if branch is None:
            continue
        # the same collective in the other branch is every rank calling it
        other = [n for part in branch.orelse for n in ast.walk(part) if isinstance(n, ast.Call)]
        if any(_collective(ast.unparse(n.func)) == name for n in other):
            continue
        test = ast.unparse(branch.test)
        found.append(
            Finding(
                "error",
                "script",
                f"{name}() is called only where `{test}`",
                "every rank must call each collective; the ranks that skip it never join, and "
                "the ones in it wait forever (ddpkit run names it as a hang)",
                f"call {name}() on every rank (outside the `if`), or drop it",
                at(call),
            )
        )
    return found


def _save_on_every_rank(calls, text_of, up, at) -> list[Finding]:
    for call in calls:
        if text_of[id(call)] not in ("torch.save", "save") or under_rank_test(call, up):
            continue
        path = ast.unparse(call.args[1]) if len(call.args) > 1 else ""
        if "rank" in path.lower():  # a file of each rank's own
            continue
        return [
            Finding(
                "warning",
                "script",
                "torch.save runs on every rank",
                "every rank writes the same file at once: a torn or half-written checkpoint, "
                "N times the I/O",
                "save on one rank (if rank == 0: ...), or s.save(obj, path), which writes "
                "once, atomically",
                at(call),
            )
        ]
    return []


def _breakpoints(calls, text_of, at) -> list[Finding]:
    for call in calls:
        if text_of[id(call)] in ("breakpoint", "pdb.set_trace", "ipdb.set_trace"):
            return [
                Finding(
                    "info",
                    "script",
                    f"{text_of[id(call)]}() is in the script",
                    "under a launcher only one rank has the terminal: elsewhere the debugger "
                    "reads nothing and the rank stops (BdbQuit)",
                    "ddpkit run gives the terminal to rank 0; --stdin N to debug rank N (the "
                    "hang watch leaves a rank at its prompt alone)",
                    at(call),
                )
            ]
    return []


def _own_port(tree, at) -> list[Finding]:
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            target = node.targets[0]
        if (
            target is not None
            and ast.unparse(target.value) == "os.environ"
            and isinstance(target.slice, ast.Constant)
            and target.slice.value in ("MASTER_PORT", "MASTER_ADDR")
        ):
            return [
                Finding(
                    "warning",
                    "script",
                    f"the script sets {target.slice.value} itself",
                    "a port written in the script clashes with the next job on the machine "
                    "(EADDRINUSE), and 'localhost' is not node 0 for another node; ddpkit run "
                    "puts its own back and says so",
                    "drop it: the launcher sets MASTER_ADDR/MASTER_PORT for every rank "
                    "(choose the port with ddpkit run --master-port)",
                    at(node),
                )
            ]
    return []

"""Ranks that wait in different collectives: a broadcast where the others all-reduce, the same
collective with other shapes, or one collective more on some ranks (their sequence numbers
differ). Each waits for a partner call that never comes, so the job hangs (gloo, NCCL) or
aborts (gloo's size check). No timeout fixes that: the verdict names each group's call (op,
sequence number and shapes from the progress record and the flight recorder, where they
have them) and the branch in the script that sent the ranks different ways.

`find` is pure (a table in tests/unit/test_hang_verdict.py); `branch_at` reads the script.
"""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddpkit.common.branches import names_a_rank
from ddpkit.common.ranges import ranks_text
from ddpkit.launch.base.snapshot import Snapshot


@dataclass(frozen=True)
class Call:
    """The collective a rank waits in, as far as the evidence says."""

    rank: int
    op: str
    site: str = ""  # 'train.py:42'
    shapes: str = ""  # '[8] [8]', '' when unknown
    seq: int | None = None  # the collective's sequence number in its group, None when unknown


@dataclass(frozen=True)
class Mismatch:
    line: str  # 'the ranks called different collectives: ...'
    odd: list[int]  # the ranks of the smaller group
    sites: list[str]  # the smaller group's site first, then the others'


def find(calls: list[Call]) -> Mismatch | None:
    """Whether ranks that all wait in a collective wait in different ones, and how."""
    if len(calls) < 2:
        return None
    kind = ""
    key: Callable[[Call], tuple[object, ...]] = lambda c: (c.op,)  # noqa: E731
    if len({c.op for c in calls}) > 1:
        kind = "different collectives"
    elif len({c.shapes for c in calls if c.shapes}) > 1 and all(c.shapes for c in calls):
        kind = f"{calls[0].op} with different shapes"
        key = lambda c: (c.op, c.shapes)  # noqa: E731
    elif len({c.seq for c in calls}) > 1 and all(c.seq is not None for c in calls):
        kind = f"different numbers of collectives (each waits in another {calls[0].op})"
        key = lambda c: (c.op, c.seq)  # noqa: E731
    if not kind:
        return None
    groups: dict[tuple[object, ...], list[Call]] = {}
    for call in sorted(calls, key=lambda c: c.rank):
        groups.setdefault(key(call), []).append(call)
    ordered = sorted(groups.values(), key=lambda g: (len(g), -g[0].rank))
    parts = [_group_text(group) for group in ordered]
    return Mismatch(
        f"the ranks called {kind}: " + "; ".join(parts),
        [c.rank for c in ordered[0]],
        [g[0].site for g in ordered if g[0].site],
    )


def _group_text(group: list[Call]) -> str:
    first = group[0]
    ranks = [c.rank for c in group]
    who = f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)}"
    seq = f" #{first.seq}" if first.seq is not None else ""
    shapes = f" of {first.shapes}" if first.shapes else ""
    site = f" at {first.site}" if first.site else ""
    return f"{who} {first.op}{seq}{shapes}{site}"


FIX = (
    "every rank must call the same collectives, in the same order, with the same shapes; a "
    "collective inside a branch that only some ranks take (if rank == 0: ...) waits forever"
)


def fix_line(mismatch: Mismatch, roots: list[Path]) -> str:
    """The fix, with the branch that sent the ranks different ways where it can be found."""
    for site in mismatch.sites:
        branch = branch_at(site, roots)
        if branch:
            return f"{FIX}: look at the branch at {branch}"
    return FIX


def branch_at(site: str, roots: list[Path]) -> str:
    """'train.py:40 (`if rank == 0:`)': the innermost if/else around the line of `site` whose
    test reads a rank (a branch on anything else does not send ranks different ways), in the
    file of that name under one of `roots`; '' when none is found."""
    name, _, line = site.partition(":")
    number = int(line.split()[0]) if line.split() and line.split()[0].isdigit() else 0
    path = _locate(name, tuple(roots))
    if path is None or not number:
        return ""
    try:
        source = path.read_text()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return ""
    around = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and node.lineno <= number <= (node.end_lineno or 0)
    ]
    # a test that names a rank (if rank == 0, if master_process, if s.is_main)
    on_rank = [n for n in around if names_a_rank(n.test)]
    best = max(on_rank, key=lambda node: node.lineno, default=None)
    if best is None:
        return ""
    text = source.splitlines()[best.lineno - 1].strip()
    return f"{name}:{best.lineno} (`{text}`)"


@functools.lru_cache(maxsize=64)
def _locate(name: str, roots: tuple[Path, ...]) -> Path | None:
    """The file called `name` in one of `roots` (or one folder below), the first found."""
    for root in roots:
        for candidate in (root / name, *root.glob(f"*/{name}")):
            if candidate.is_file():
                return candidate
    for root in roots:
        if os.path.basename(str(root)) == name and root.is_file():
            return root
    return None


MISMATCH_WORDS = (
    "mismatch between collectives",
    "collective mismatch",
    "Received data size doesn't match",
    "op.preamble.length <= op.nbytes",  # gloo before torch 2.5: sizes differ across ranks
)


def said_to_differ(said: Sequence[str], snap: Snapshot) -> Mismatch | None:
    """When torch or gloo says collectives differ, which rank called what, from where (each
    rank's progress record), instead of a wall of fingerprints."""
    if not any(word in line for line in said for word in MISMATCH_WORDS):
        return None
    calls = [
        Call(v.rank, v.record.op, v.record.site, v.record.shapes)
        for v in snap.ranks
        if v.record is not None and v.record.op
    ]
    found = find(calls)
    if found is not None:
        return found
    text = "; ".join(f"rank {c.rank} called {c.op} with shape {c.shapes} ({c.site})" for c in calls)
    return Mismatch(
        "the ranks called different collectives" + (f": {text}" if text else ""),
        [],
        [c.site for c in calls],
    )

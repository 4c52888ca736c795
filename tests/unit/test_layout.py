"""The house's layout as a fact: the launcher and the rank side meet only in ddpkit.protocol
(and the torch-free shared modules), never import each other, and no module grows past 500
lines."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[2] / "src" / "ddpkit"


def imports_of(folder: str) -> dict[str, set[str]]:
    found = {}
    for path in (SRC / folder).glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        found[path.name] = names
    return found


def test_the_launcher_never_imports_the_rank_side():
    for module, names in imports_of("launch").items():
        assert not [n for n in names if n.startswith("ddpkit.rank")], module


def test_the_rank_side_never_imports_the_launcher():
    for module, names in imports_of("rank").items():
        assert not [n for n in names if n.startswith("ddpkit.launch")], module


def test_no_module_is_longer_than_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}  # fmt: skip
    assert not long

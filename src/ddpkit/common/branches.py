"""Branches on the rank, read from a script's syntax tree: the hang doctor points at the one
that sent ranks different ways, the script doctor at a collective only some ranks call.
Nothing here imports torch."""

from __future__ import annotations

import ast

RANK_WORDS = ("rank", "main", "master", "leader")  # rank == 0, master_process, s.is_main


def names_a_rank(test: ast.expr) -> bool:
    """The test reads a variable, attribute or function named like a rank (a string that
    merely contains the word does not count)."""
    for node in ast.walk(test):
        name = (
            node.id if isinstance(node, ast.Name) else node.attr
            if isinstance(node, ast.Attribute) else ""
        )  # fmt: skip
        if any(word in name.lower() for word in RANK_WORDS):
            return True
    return False


def parents(tree: ast.AST) -> dict[int, ast.AST]:
    """id(node) -> its parent, for walking up from a node."""
    found: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            found[id(child)] = node
    return found


def rank_branch(node: ast.AST, up: dict[int, ast.AST]) -> ast.If | None:
    """The innermost `if` on the rank whose body (not its else) holds `node`."""
    child, parent = node, up.get(id(node))
    while parent is not None:
        if isinstance(parent, ast.If) and names_a_rank(parent.test) and child in parent.body:
            return parent
        child, parent = parent, up.get(id(parent))
    return None


def under_rank_test(node: ast.AST, up: dict[int, ast.AST]) -> bool:
    """Somewhere above `node` an `if` on the rank decides whether it runs (either branch)."""
    parent = up.get(id(node))
    while parent is not None:
        if isinstance(parent, ast.If) and names_a_rank(parent.test):
            return True
        parent = up.get(id(parent))
    return False

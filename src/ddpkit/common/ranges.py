"""Rank lists as people write them: 0-3,5,7-9. One formatter for every report and error."""

from __future__ import annotations

from collections.abc import Iterable


def ranks_text(ranks: Iterable[int]) -> str:
    """'0-3,5,7-9' for [0, 1, 2, 3, 5, 7, 8, 9]; runs of 3 or more become a range."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(r) for r in ordered[i : j + 1])
        i = j + 1
    return ",".join(parts)

"""What the docs promise about options is what the code does: every `ddpkit run` option is in
docs/launcher.md's table with its variable and, where it is a number or a word, its default."""

from __future__ import annotations

import re
from pathlib import Path

from ddpkit.launch import config

DOCS = Path(__file__).parents[2] / "docs"


def _table() -> dict[str, tuple[str, str]]:
    rows = {}
    text = (DOCS / "launcher.md").read_text()
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) != 4 or not cells[1].startswith("`DDPKIT_"):
            continue
        flag = re.search(r"--([\w-]+)", cells[0])
        variable = re.match(r"`([A-Z_]+)", cells[1])
        if flag and variable:
            rows[flag.group(1)] = (variable.group(1), cells[2])
    return rows


def test_every_option_is_documented_with_its_variable():
    rows = _table()
    for flag in [*config.OPTIONS, *config.SWITCHES]:
        assert flag in rows, f"--{flag} is missing from docs/launcher.md"
        assert rows[flag][0] == config.variable(flag)


def test_documented_defaults_are_the_codes():
    rows = _table()
    for flag, (default, _) in config.OPTIONS.items():
        documented = rows[flag][1].strip("`").split()[0] if rows[flag][1] else ""
        if default is not None and re.fullmatch(r"[\w.]+", default):
            assert documented == default, f"--{flag}: docs say {documented!r}, code {default!r}"


def test_the_documented_liveness_constants_are_the_codes():
    from ddpkit.launch.peers import liveness, nodes

    text = (DOCS / "launcher.md").read_text()
    assert f"| beat | {liveness.BEAT:g} s |" in text
    assert f"gives up after {nodes.CALL_LIMIT:g} s" in text

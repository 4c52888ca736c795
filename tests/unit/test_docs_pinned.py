"""What the docs promise about options is what the code does: every `ddpkit run` option is in
docs/launcher.md's table with its variable and, where it is a number or a word, its default."""

from __future__ import annotations

import re
from pathlib import Path

from ddpkit.launch.base import config

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


def test_the_docs_speak_to_the_user_not_of_their_making():
    # docs/ is for the user: no issue or session numbers, no test or result paths (those are
    # the project's own record, in benchmarks/); the architecture page is the developers' map
    said = []
    for page in sorted(DOCS.glob("*.md")):
        if page.name == "architecture.md":
            continue
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if re.search(r"\b(issue|session) \d+|\btests/|\bresults/", line, re.IGNORECASE):
                said.append(f"{page.name}:{number}: {line.strip()[:90]}")
    assert not said, "\n".join(said)


EXAMPLES = Path(__file__).parents[2] / "examples"


def _snippets(page: Path, after: str = "") -> list[str]:
    text = page.read_text()
    text = text[text.index(after) :] if after else text
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _in_order(lines: list[str], source: list[str]) -> bool:
    at = 0
    for line in lines:
        while at < len(source) and source[at] != line:
            at += 1
        if at == len(source):
            return False
        at += 1
    return True


def test_the_docs_snippets_are_taken_from_the_examples_that_run():
    # each ddpkit snippet of the README and the walk from one GPU is in a file of examples/,
    # line for line and in order (tests/e2e/test_examples.py runs those files)
    sources = {
        p.name: [x.strip() for x in p.read_text().splitlines()] for p in EXAMPLES.glob("*.py")
    }
    snippets = _snippets(DOCS.parent / "README.md")[:1] + _snippets(
        DOCS / "from-one-gpu-to-many.md", after="## The same script with ddpkit"
    )
    assert len(snippets) == 5
    for snippet in snippets:
        lines = [x.strip() for x in snippet.splitlines() if x.strip()]
        assert any(_in_order(lines, source) for source in sources.values()), snippet

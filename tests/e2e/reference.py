"""The run a stopped and resumed job is compared with: the same script with the same argv at the
same world size, run once to the end on real gloo ranks that the suite's forkserver forks with
torch already imported (tests/groups/harness.py), not under `ddpkit run`. Its steps are bit for
bit a launched run's: the tests compare the launched job's own first steps with it too, so a
difference between the two ways of starting ranks fails there. A rank started this way costs a
fork instead of importing torch (4-6 CPU-s on the 2-core CI machine)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from tests.groups.harness import run_ranks


def _script_output(rank: int, world: int, tmp: Path, script: str, argv: list[str]) -> str:
    """Run `script argv` as Python runs a script (its folder first on sys.path, as __main__)
    and return what it printed."""
    out = tmp / f"stdout{rank}.txt"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stdout.flush()
    os.dup2(fd, 1)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            raise
    finally:
        sys.stdout.flush()
    return out.read_text()


def never_stopped(script: str, argv: list[str], world: int, tmp: Path) -> str:
    """Every rank's output of a run of `script argv` on `world` ranks that nothing stopped."""
    tmp.mkdir(parents=True, exist_ok=True)
    return "".join(run_ranks(_script_output, world, tmp, script, argv, timeout=180))

"""Run a ddpkit job as a child process and read the one JSON result line rank 0 prints.

Used by `ddpkit doctor` (its smoke test) and `ddpkit bench ddp` (one job per GPU count): the
job runs through `ddpkit run`, so it inherits every guarantee of the launcher; this adds a hard
bound on the whole run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.common import protocol


@dataclass
class JobResult:
    result: dict[str, Any] | None  # the JSON after the marker, when the job printed it
    exit_code: int | None  # None: stopped at the bound
    output: str  # the last lines of stdout and stderr, for an error message
    # NCCL's transport as the launcher found it: {"line": ..., "slow": [{"what", "fix"}]}
    transport: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.result is not None


def run_job(run_args: list[str], marker: str, bound: float) -> JobResult:
    """`ddpkit run RUN_ARGS`, at most `bound` seconds; rank 0's `MARKER {json}` line, and
    NCCL's transport as the launcher found it (written where it was asked to)."""
    cmd = [sys.executable, "-m", "ddpkit", "run", *run_args]
    with tempfile.TemporaryDirectory(prefix="ddpkit-subjob-") as folder:
        told = Path(folder) / "transport.json"
        env = {**os.environ, protocol.TRANSPORT_TO: str(told)}
        found = _run(cmd, env, marker, bound)
        with contextlib.suppress(OSError, ValueError):
            found.transport = json.loads(told.read_text())
    return found


def _run(cmd: list[str], env: dict[str, str], marker: str, bound: float) -> JobResult:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=bound, env=env)
    except subprocess.TimeoutExpired as err:
        seen = err.stderr or ""
        text = seen.decode(errors="replace") if isinstance(seen, bytes) else seen
        return JobResult(None, None, text[-1500:])
    line = next((x for x in out.stdout.splitlines() if f"{marker} " in x), None)
    result = json.loads(line.split(f"{marker} ", 1)[1]) if line else None
    tail = "\n".join((out.stdout + out.stderr).splitlines()[-15:])
    return JobResult(result, out.returncode, tail)

"""Run a ddpkit job as a child process and read the one JSON result line rank 0 prints.

Used by `ddpkit doctor` (its smoke test) and `ddpkit bench ddp` (one job per GPU count): the
job runs through `ddpkit run`, so it inherits every guarantee of the launcher; this adds a hard
bound on the whole run.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.launch.base.rundir import base_folder
from ddpkit.launch.speed.step_watch import TRANSPORT_FILE


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
    what the launcher wrote of NCCL's transport in the run's folder."""
    run_id = f"subjob{uuid.uuid4().hex[:12]}"
    cmd = [sys.executable, "-m", "ddpkit", "run", "--run-id", run_id, *run_args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=bound)
    except subprocess.TimeoutExpired as err:
        seen = err.stderr or ""
        text = seen.decode(errors="replace") if isinstance(seen, bytes) else seen
        return JobResult(None, None, text[-1500:])
    line = next((x for x in out.stdout.splitlines() if f"{marker} " in x), None)
    result = json.loads(line.split(f"{marker} ", 1)[1]) if line else None
    tail = "\n".join((out.stdout + out.stderr).splitlines()[-15:])
    transport: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, ConfigError):
        folder = base_folder(None) / run_id
        transport = json.loads((folder / TRANSPORT_FILE).read_text())
    return JobResult(result, out.returncode, tail, transport)

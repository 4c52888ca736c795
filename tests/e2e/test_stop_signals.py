"""A stop signal to `ddpkit run` at a random moment: every rank saves at the same step, the job
ends within its grace, nothing is left running, and the summary says the ranks stopped on
their own. Three random moments here, one per signal (each run of 3 ranks costs ~13 CPU-s of
the suite's budget); tests/groups/test_stop_flag.py stops 16 more at random moments on real
gloo ranks without a launcher, and benchmarks/stop_signal_stress.py runs a hundred end to end
(100 of 100 passed, benchmarks/results/cpu-stop_signal_stress.txt)."""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

from tests.e2e.helpers import SCRIPTS, bound, gone_within, start

pytestmark = pytest.mark.timeout(600)
SCRIPT = str(SCRIPTS / "stops_cleanly.py")


def stop_once(tmp_path, sig: int, delay: float, ranks: int = 3) -> tuple[int, str, float]:
    """One job stopped by `sig` `delay` s after every rank first read s.stop_requested:
    (exit code, output, seconds from the signal to the last process gone)."""
    job = start(["-n", str(ranks), SCRIPT, str(tmp_path / "state")], tmp_path)
    job.wait_for("step 20 ", timeout=bound(120))  # past the first read on every rank
    time.sleep(delay)
    os.kill(job.proc.pid, sig)
    took = gone_within(job, bound(30))
    code = job.finish(5)
    return code, job.stdout + job.stderr, took


def test_a_stop_signal_at_random_moments_saves_every_rank_at_the_same_step(tmp_path):
    plan = random.Random(os.getpid())
    for run in range(3):
        sig = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)[run % 3]
        delay = plan.uniform(0.0, 1.0)
        where = tmp_path / f"run{run}"
        where.mkdir()
        code, out, took = stop_once(where, sig, delay)
        what = f"run {run}, {signal.Signals(sig).name} after {delay:.2f} s:\n{out}"
        saved = {int(r): int(n) for r, n in re.findall(r"rank (\d) saved at step (\d+)", out)}
        assert sorted(saved) == [0, 1, 2], f"not every rank saved: {what}"
        assert len(set(saved.values())) == 1, f"ranks saved at different steps: {what}"
        assert code == 128 + sig, what
        assert "stopped by ddpkit" not in out, what
        assert re.search(r"ranks? 0-2 saved and exited|every rank ended on its own", out), what
        assert took < bound(10), f"took {took:.1f} s: {what}"

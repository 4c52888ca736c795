"""A stop signal to `ddpkit run` at a random moment: every rank saves at the same step, the job
ends within its grace, nothing is left running, and the summary says the ranks stopped on
their own. One random moment and signal here (each run of 3 ranks costs ~13 CPU-s of the
suite's budget); tests/groups/test_stop_flag.py stops 16 more at random moments on real
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


def test_a_stop_signal_at_a_random_moment_saves_every_rank_at_the_same_step(tmp_path):
    # one job, one of the three signals: that every rank agrees on the step at any moment is
    # proven on real groups by tests/groups/test_stop_flag.py (16 moments), and 100 times a
    # signal by benchmarks/stop_signal_stress.py (its results in benchmarks/RESULTS.md)
    plan = random.Random(os.getpid())
    for run in range(1):
        sig = plan.choice((signal.SIGTERM, signal.SIGINT, signal.SIGUSR1))  # noqa: S311
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


def test_a_sigterm_to_timeout_which_sends_it_twice_saves_every_rank_of_4(tmp_path):
    # `timeout 3600 ddpkit run ...` in a job script: timeout passes its SIGTERM to ddpkit and
    # again to its process group, ddpkit in it; the repeat is the same request, not a kill
    job = start(["-n", "4", SCRIPT, str(tmp_path / "state")], tmp_path, wrapper=["timeout", "3600"])
    job.wait_for("step 20 ", timeout=bound(120))
    time.sleep(random.uniform(0.0, 1.0))
    os.kill(job.proc.pid, signal.SIGTERM)
    took = gone_within(job, bound(30))
    out = job.stdout + job.stderr
    saved = {int(r): int(n) for r, n in re.findall(r"rank (\d) saved at step (\d+)", out)}
    assert sorted(saved) == [0, 1, 2, 3], f"not every rank saved:\n{out}"
    assert len(set(saved.values())) == 1, out
    assert job.finish(5) == 128 + signal.SIGTERM, out
    assert re.search(r"ranks 0-3 saved and exited|every rank ended on its own", out), out
    assert "killed" not in out, out
    assert took < bound(10)


def test_a_second_sigterm_moments_later_is_the_same_request(tmp_path):
    # by hand, 20 ms to 0.5 s apart (each was a kill at once): every rank still saves
    for run, gap in enumerate((0.02, random.uniform(0.1, 0.5))):
        where = tmp_path / f"run{run}"
        where.mkdir()
        job = start(["-n", "3", SCRIPT, str(where / "state")], where)
        job.wait_for("step 20 ", timeout=bound(120))
        os.kill(job.proc.pid, signal.SIGTERM)
        time.sleep(gap)
        if job.proc.poll() is None:
            os.kill(job.proc.pid, signal.SIGTERM)
        gone_within(job, bound(30))
        out = job.stdout + job.stderr
        saved = {int(r): int(n) for r, n in re.findall(r"rank (\d) saved at step (\d+)", out)}
        assert sorted(saved) == [0, 1, 2], f"second SIGTERM {gap:.2f} s later:\n{out}"
        assert len(set(saved.values())) == 1, out
        assert job.finish(5) == 128 + signal.SIGTERM, out

"""A restart takes warm spares (ddpkit.launch.spares): with --max-restarts, once the ranks have
done their first step one spare per rank imports what they imported and waits; at a failure
each takes its rank's place, and the job goes on exactly as a cold restart would. Spares are
listed by `ddpkit ps` as such, and none outlives the job: not at its end, not after Ctrl+C, not
after the launcher is SIGKILLed. The script is the pytorch/examples ddp-tutorial-series trainer
(tests/e2e/scripts/snapshot_trainer.py), 3 ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import SCRIPTS, bound, gone_within, start

pytestmark = pytest.mark.timeout(240)
SCRIPT = str(SCRIPTS / "snapshot_trainer.py")
STEP = re.compile(r"\] step (\d+) loss (\S+)")
DEBUG = {"DDPKIT_LOG_LEVEL": "debug"}


def trainer(tmp_path, *extra, epochs="1", sleep="0.15"):
    args = ["-n", "3", "--max-restarts", "1", SCRIPT, epochs, "1", "--batch_size", "4",
            "--snapshot_path", str(tmp_path / "state"), "--save_steps", "10", "--augment",
            "--sleep", sleep, *extra]  # fmt: skip
    return start(args, tmp_path, env=DEBUG)


def losses(text: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for step, loss in STEP.findall(text):
        found.setdefault(int(step), []).append(loss)
    return found


def ps_rows(run_id: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "ddpkit", "ps", "--json"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    return [r for r in json.loads(done.stdout) if r["job"] == run_id]


def rows_once_the_spares_are_up(run_id: str, timeout: float) -> list[dict]:
    """`ddpkit ps`'s rows once the three spares show as spares: a spare names itself as its
    first act (until then, a few milliseconds, or more on a loaded machine, ps shows it as
    another worker of its rank), and the launcher logs them as it starts them."""
    deadline = time.monotonic() + timeout
    while True:
        rows = ps_rows(run_id)
        if sum(r["role"] == "spare" for r in rows) == 3 or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_a_restart_takes_the_warm_spares_and_goes_on_bit_identical(tmp_path):
    never = start(["-n", "3", SCRIPT, "1", "1", "--batch_size", "4", "--augment",
                   "--snapshot_path", str(tmp_path / "never")], tmp_path)  # fmt: skip
    assert never.finish(120) == 0, never.stderr
    job = trainer(tmp_path, "--fail_rank", "1", "--fail_step", "18")
    assert job.finish(120) == 0, job.stderr
    for rank in range(3):
        assert f"rank {rank} started warm" in job.stderr, job.stderr
    assert re.search(r"resumed after step 17 in [\d.]+ s, 0 steps lost", job.stderr)
    got = losses(job.stdout)
    assert all(len(v) == 1 for v in got.values()), "no step done twice"
    assert got == losses(never.stdout)
    assert not job.survivors()


def test_ps_lists_the_spares_and_ctrl_c_ends_them_with_the_job(tmp_path):
    job = trainer(tmp_path, epochs="3", sleep="0.2")
    try:
        job.wait_for("spares for attempt 1", timeout=bound(60))
        roles = sorted(
            (r["role"], r["rank"]) for r in rows_once_the_spares_are_up(job.run_id, bound(15))
        )
        assert roles == [("launcher", ""), ("spare", "0"), ("spare", "1"), ("spare", "2"),
                         ("worker", "0"), ("worker", "1"), ("worker", "2")]  # fmt: skip
        os.kill(job.proc.pid, signal.SIGINT)
        gone_within(job, bound(30))
        assert job.proc.returncode == 130
    finally:
        if job.proc.poll() is None:
            job.proc.kill()


def test_a_sigkilled_launcher_takes_its_spares_with_it(tmp_path):
    job = trainer(tmp_path, epochs="3", sleep="0.2")
    try:
        job.wait_for("spares for attempt 1", timeout=bound(60))
        rows = rows_once_the_spares_are_up(job.run_id, bound(15))
        spares = [r["pid"] for r in rows if r["role"] == "spare"]
        assert len(spares) == 3
        job.proc.kill()
        gone_within(job, bound(15), extra_pids=spares)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()

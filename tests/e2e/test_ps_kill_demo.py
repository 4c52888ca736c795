"""ddpkit ps and ddpkit kill, on real processes (ddpkit demo: test_console.py, in a terminal)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.helpers import SCRIPTS, bound, gone_within, start

pytestmark = pytest.mark.timeout(180)


def ddpkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args], capture_output=True, text=True, timeout=60
    )


def test_ps_lists_the_launcher_and_every_rank_of_a_running_job(tmp_path):
    job = start(["-n", "2", str(SCRIPTS / "phases.py"), "before-init"], tmp_path)
    try:
        job.wait_for("[rank 1] ready")
        rows = json.loads(ddpkit("ps", "--json").stdout)
        mine = [r for r in rows if r["job"] == job.run_id]
        roles = sorted((r["role"], r["rank"]) for r in mine)
        assert roles == [("launcher", ""), ("worker", "0"), ("worker", "1")]
        assert not any(r["orphan"] for r in mine)
        table = ddpkit("ps").stdout
        assert job.run_id in table
        assert "RANK" in table
    finally:
        job.proc.terminate()
        gone_within(job, 15)


def test_ps_flags_a_hand_started_rank_whose_parent_is_gone_as_an_orphan(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}
    # a parent that starts the "rank" and exits at once, as a killed launcher would
    parent = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)'], start_new_session=True, "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    orphan = int(parent.stdout)
    try:
        rows = json.loads(ddpkit("ps", "--json").stdout)
        row = next(r for r in rows if r["pid"] == orphan)
        assert row["orphan"]
        assert row["job"] == "env:1"
        assert "ORPHAN" in ddpkit("ps").stdout
        out = ddpkit("kill", str(orphan), "--grace", "1")
        assert out.returncode == 0
        assert str(orphan) in out.stdout
        assert (
            not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        )
    finally:
        if psutil.pid_exists(orphan):
            psutil.Process(orphan).kill()


def test_kill_ends_a_whole_job_tree_even_processes_that_ignore_sigterm(tmp_path):
    job = start(["-n", "2", "--grace", "60", str(SCRIPTS / "stubborn.py"), str(tmp_path)], tmp_path)
    job.wait_for("[rank 0] ready")
    job.wait_for("[rank 1] ready")
    pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pids-{r}").read_text().split()]
    started = time.monotonic()
    out = ddpkit("kill", job.run_id, "--grace", "1")
    assert out.returncode == 0, out.stderr
    assert "ended" in out.stdout
    gone_within(job, 15, extra_pids=pids)
    assert time.monotonic() - started < bound(30)


def test_kill_of_an_unknown_job_is_a_clear_error():
    out = ddpkit("kill", "no-such-job")
    assert out.returncode == 2
    assert "no job 'no-such-job'" in out.stderr


def test_an_option_variable_does_not_make_a_process_part_of_a_job():
    # DDPKIT_RUN_ID is the --run-id option's variable, not the mark of a job's process
    env = {**os.environ, "DDPKIT_RUN_ID": "optjob"}
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    try:
        rows = json.loads(ddpkit("ps", "--json").stdout)
        assert not [r for r in rows if r["pid"] == bystander.pid]
        out = ddpkit("kill", "optjob", "--grace", "1")
        assert out.returncode == 2
        assert "no job 'optjob'" in out.stderr
        assert bystander.poll() is None, "ddpkit kill ended a process that is not a job's"
    finally:
        bystander.kill()
        bystander.wait()

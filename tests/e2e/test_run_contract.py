"""What a script sees under ddpkit run, and what the user sees of it."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
import uuid

import pytest

from ddpkit.common.procs import is_alive, processes_of_job
from tests.e2e.helpers import SCRIPTS, bound, start

pytestmark = pytest.mark.timeout(120)

TORCHRUN_VARIABLES = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
]


def test_workers_get_every_variable_torchrun_sets(tmp_path):
    job = start(
        ["-n", "2", str(SCRIPTS / "env_dump.py"), str(tmp_path)],
        tmp_path,
        env={"OMP_NUM_THREADS": ""},
    )
    assert job.finish() == 0
    envs = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in (0, 1)]
    for rank, env in enumerate(envs):
        missing = [v for v in TORCHRUN_VARIABLES if v not in env]
        assert not missing
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RUN_ID"] == job.run_id
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_omp_num_threads_is_set_when_unset_and_kept_when_set(tmp_path):
    job = start(
        ["-n", "2", str(SCRIPTS / "env_dump.py"), str(tmp_path)],
        tmp_path,
        env={"OMP_NUM_THREADS": "7"},
    )
    assert job.finish() == 0
    assert json.loads((tmp_path / "env-0.json").read_text())["OMP_NUM_THREADS"] == "7"


def test_cuda_visible_devices_is_passed_through(tmp_path):
    job = start(
        ["-n", "cpu", str(SCRIPTS / "env_dump.py"), str(tmp_path)],
        tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert job.finish() == 0
    assert json.loads((tmp_path / "env-1.json").read_text())["CUDA_VISIBLE_DEVICES"] == ""


def test_output_is_prefixed_by_rank_and_logged_per_rank_in_private_files(tmp_path):
    job = start(["-n", "2", str(SCRIPTS / "env_dump.py"), str(tmp_path)], tmp_path)
    assert job.finish() == 0
    assert "[rank 0] hello from rank 0" in job.stdout
    assert "[rank 1] to stderr from rank 1" in job.stderr
    run_dir = job.log_dir / job.run_id
    assert str(run_dir) in job.stderr, "the run folder is named at start"
    assert f"every rank exited 0; logs in {run_dir}" in job.err[-1], "and again at the end"
    assert (job.log_dir / "latest").is_symlink(), "latest points at the newest run"
    assert (job.log_dir / "latest").resolve() == run_dir.resolve()
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "rank0.log").stat().st_mode) == 0o600
    log = (run_dir / "rank1.log").read_text()
    assert "hello from rank 1" in log
    assert "to stderr from rank 1" in log


def test_ranks_filter_what_reaches_the_console_but_not_the_logs(tmp_path):
    job = start(["-n", "2", "--ranks", "1", str(SCRIPTS / "env_dump.py"), str(tmp_path)], tmp_path)
    assert job.finish() == 0
    assert "[rank 1] hello" in job.stdout
    assert "[rank 0]" not in job.stdout
    assert "hello from rank 0" in (job.log_dir / job.run_id / "rank0.log").read_text()


def test_a_module_runs_with_dash_m(tmp_path):
    job = start(["-n", "2", "-m", "json.tool", "--help"], tmp_path)
    assert job.finish() == 0
    assert "[rank 1] usage:" in job.stdout


def test_a_program_runs_with_no_python(tmp_path):
    job = start(["-n", "2", "--no-python", "sh", "-c", "echo rank=$RANK"], tmp_path)
    assert job.finish() == 0
    assert "[rank 0] rank=0" in job.stdout
    assert "[rank 1] rank=1" in job.stdout


def test_max_restarts_restarts_the_group_and_the_example_resumes(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    job = start(
        [
            "-n",
            "2",
            "--max-restarts",
            "1",
            "--grace",
            "1",
            "-m",
            "ddpkit.examples.digits",
            "--epochs",
            "3",
            "--checkpoint",
            str(ckpt),
            "--fail-at-epoch",
            "1",
        ],
        tmp_path,
    )
    assert job.finish(120) == 0
    assert "planted failure at epoch 1" in job.stderr
    assert "ddpkit: attempt 1 of 2: the job failed" in job.stderr
    assert "exit code:" not in job.stderr, "an attempt that is restarted is not the job's end"
    assert "restarting the whole group (1 of 1)" in job.stderr
    assert "resumed from" in job.stdout
    assert "at epoch 1" in job.stdout
    assert "held-out accuracy" in job.stdout
    assert not job.survivors()


def test_without_restarts_the_same_failure_ends_the_job(tmp_path):
    job = start(
        [
            "-n",
            "2",
            "--grace",
            "1",
            "-m",
            "ddpkit.examples.digits",
            "--epochs",
            "3",
            "--fail-at-epoch",
            "0",
        ],
        tmp_path,
    )
    started = time.monotonic()
    assert job.finish(120) == 1
    assert "root cause: rank 1" in job.stderr
    assert time.monotonic() - started < bound(60)


def test_a_plain_torch_script_forms_one_group_whose_store_rank_0_serves(tmp_path):
    """A script with no ddpkit in it (init_process_group, all_reduce) forms one group of 3.
    Rank 0 serves the job's store on the socket the launcher binds (no race for the port),
    so the launcher needs no torch: a third of a 2-rank job's CPU (benchmarks/job_cost.py)."""
    run_id = "plain" + uuid.uuid4().hex[:6]
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpkit", "run", "-n", "3", "--run-id",
         run_id, "--log-dir", str(tmp_path / "logs"), str(SCRIPTS / "world.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for rank in range(3):
        assert f"rank {rank} of 3 sum 3" in out.stdout
    assert not [p for p in processes_of_job(run_id) if is_alive(p)]
    launcher = [line for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert launcher, "importtime's lines are the launcher's own (the ranks' are prefixed)"
    assert not [line for line in launcher if " torch" in line], "the launcher imported torch"

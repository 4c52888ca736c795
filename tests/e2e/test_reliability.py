"""Reliability and safety, as an attacker of the launcher would try it: a table of bad inputs
(each refused with exit 2, its words and a fix, in about a second, nothing started), exit codes
through setup(), `ddpkit kill`'s limits, private log folders, full disks, leftovers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.helpers import SCRIPTS, bound, gone_within, start

pytestmark = pytest.mark.timeout(120)
DDPKIT = [sys.executable, "-m", "ddpkit"]
LONG = "a" * 300

# (arguments of `ddpkit run`, extra environment, the words the error must contain)
BAD_INPUTS = [
    (["--init-timeout", "inf", "t.py"], {}, "--init-timeout 'inf' is not a finite number"),
    (["--init-timeout", "1e300", "t.py"], {}, "--init-timeout '1e300' is more than"),
    (["--init-timeout", "abc", "t.py"], {}, "--init-timeout 'abc' is not a number"),
    (["--grace", "nan", "t.py"], {}, "--grace 'nan' is not a finite number"),
    (["--grace", "inf", "t.py"], {}, "--grace 'inf' is not a finite number"),
    (["--grace", "-1", "t.py"], {}, "--grace '-1' must be at least 0"),
    (["--hang-timeout", "nan", "t.py"], {}, "--hang-timeout 'nan' is not a finite number"),
    (["--node-timeout", "0", "t.py"], {}, "--node-timeout '0' must be at least 1"),
    (["--max-restarts", "-1", "t.py"], {}, "--max-restarts '-1' must be at least 0"),
    (["--log-dir", "afile", "t.py"], {}, "exists and is not a folder"),
    (["--log-dir", "/proc/nope/x", "t.py"], {}, "cannot create the log folder /proc/nope/x"),
    (["--log-dir", "/sys/nope", "t.py"], {}, "cannot create the log folder /sys/nope"),
    (["--log-dir", LONG, "t.py"], {}, "File name too long"),
    (["--run-id", "a/b", "t.py"], {}, "--run-id 'a/b' is not a job id"),
    (["--run-id", "../x", "t.py"], {}, "--run-id '../x' is not a job id"),
    (["--run-id", "/abs", "t.py"], {}, "--run-id '/abs' is not a job id"),
    (["--run-id", "r" * 300, "t.py"], {}, "is not a job id"),
    (["--ranks", "-1", "t.py"], {}, "--ranks '-1' is not a list of ranks of this job"),
    (["--ranks", "7", "t.py"], {}, "--ranks '7' is not a list of ranks of this job (0 to 1)"),
    (["--ranks", ",", "t.py"], {}, "--ranks ',' is not a list of ranks"),
    (["--ranks", "0,x", "t.py"], {}, "--ranks '0,x' is not a list of ranks"),
    (["--stdin", "rank0", "t.py"], {}, "--stdin 'rank0' is not a rank, none or auto"),
    (["-n", "0", "t.py"], {}, "must be at least 1"),
    (["-n", "99999999999999999999", "t.py"], {}, "CPU processes on"),
    (["-n", "64", "t.py"], {}, "DDPKIT_NPROC_LIMIT=64"),
    (["-n", "gpu", "t.py"], {"CUDA_VISIBLE_DEVICES": ""}, "no GPU is visible"),
    (["--master-port", "99999", "t.py"], {}, "is not a TCP port"),
    (["--master-port", "x", "t.py"], {}, "--master-port 'x' is not a number"),
    (["--nnodes", "0", "t.py"], {}, "--nnodes '0' must be at least 1"),
    (["--nnodes", "3:2", "--rdzv", "h:1", "t.py"], {}, "MIN is larger than MAX"),
    (["--nnodes", "2", "t.py"], {}, "needs to know how the nodes meet"),
    (["--nnodes", "2", "--rdzv", "nohost", "t.py"], {}, "is not HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "9", "t.py"], {}, "node ranks run"),
    (
        ["--nnodes", "2", "--node-rank", "1", "--master-addr", "nosuchhost.invalid"]
        + ["--master-port", "29999", "t.py"],
        {},
        "--master-addr 'nosuchhost.invalid' does not name a machine",
    ),
    (["--no-python", "./notexec.sh"], {}, "is not executable"),
    (["--no-python", "no-such-program-xyz"], {}, "not found on PATH"),
    (["-m", "missing_module_xyz"], {}, "no module 'missing_module_xyz'"),
    (["-m", "bad name"], {}, "is not a module name"),
    (["missing.py"], {}, "script 'missing.py' not found"),
    ([], {}, "no script to run"),
    (["--frobnicate", "t.py"], {}, "ddpkit run does not know --frobnicate"),
    (["--rdzv-conf", "x=1", "--nnodes", "2", "--rdzv", "h:1", "t.py"], {}, "known key"),
    (["t.py"], {"SLURM_PROCID": "0", "SLURM_NNODES": "abc"}, "SLURM_NNODES='abc'"),
    (
        ["t.py"],
        {"SLURM_PROCID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "abc"},
        "SLURM_NTASKS='abc'",
    ),
    (
        ["t.py"],
        {"SLURM_PROCID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "abc"},
        "SLURM_NODEID='abc'",
    ),
    (
        ["t.py"],
        {"SLURM_PROCID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2"}
        | {"SLURM_JOB_NODELIST": "n[1-x]"},
        "SLURM_JOB_NODELIST='n[1-x]' is not a SLURM host list",
    ),
    (
        ["t.py"],
        {"SLURM_PROCID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "4"},
        "needs exactly one task per node",
    ),
    (["--numa-binding", "node", "t.py"], {}, "has no ddpkit equivalent"),
    (["--redirects", "9", "t.py"], {}, "is not 0-3"),
    (["--signals-to-handle", "SIGNOPE", "t.py"], {}, "is not a signal"),
    (["--monitor-interval", "0", "t.py"], {}, "is not between 0.01 and 60"),
    (["--use-local-rank-arg=--lr", "t.py"], {}, "the argument is --local-rank or --local_rank"),
    (["--standalone", "--nnodes", "2", "--rdzv", "h:1", "t.py"], {}, "--standalone is one node"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    here = tmp_path_factory.mktemp("bad")
    (here / "t.py").write_text("print('started')\n")
    (here / "afile").write_text("")
    (here / "notexec.sh").write_text("#!/bin/sh\n")
    return here


def refused(folder: Path, args: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    """`ddpkit run ARGS` as a user runs it: exit code, stderr, seconds taken."""
    began = time.monotonic()
    out = subprocess.run(
        [*DDPKIT, "run", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=folder,
        env={**os.environ, **env},
    )
    assert "started" not in out.stdout, "nothing may start"
    return out.returncode, out.stderr, time.monotonic() - began


@pytest.mark.parametrize(("args", "env", "says"), BAD_INPUTS, ids=lambda v: str(v)[:40])
def test_bad_input_is_refused_at_once_with_its_words_and_a_fix(
    folder, args, env, says, monkeypatch, capsys
):
    # the command line is read in this process (ddpkit.cli.main, as `ddpkit run` calls it);
    # what the options accept and the launcher refuses later (a host that does not resolve, a
    # log folder it cannot make) runs as the user runs it, in a process of its own
    from ddpkit.cli import main
    from ddpkit.cli import run as run_command

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(folder)
    accepted = []
    monkeypatch.setattr(run_command, "start", lambda cfg: accepted.append(cfg) or 0)
    code, said, took = main(["run", *args]), capsys.readouterr().err, 0.0
    if accepted:
        code, said, took = refused(folder, args, env)
    assert code == 2, said
    assert says in said
    assert "fix:" in said
    assert "Traceback" not in said
    assert took < bound(8), f"took {took:.1f} s"


def test_bad_input_on_the_command_line_is_refused_by_the_command_itself(folder):
    code, said, took = refused(folder, ["--grace", "nan", "t.py"], {})
    assert code == 2, said
    assert "--grace 'nan' is not a finite number" in said
    assert "fix:" in said
    assert "Traceback" not in said
    assert took < bound(8), f"took {took:.1f} s"


@pytest.mark.parametrize("style", ["with", "plain"])
def test_a_ranks_exit_code_through_setup_is_the_jobs(tmp_path, style):
    job = start(["-n", "2", "--grace", "2", str(SCRIPTS / "exits.py"), "3", style], tmp_path)
    assert job.finish(60) == 3, job.stderr
    assert "root cause: rank 1 exited with code 3 (SystemExit: sys.exit(3))" in job.stderr
    assert not job.survivors()


def test_a_rank_that_never_calls_setup_is_named_within_the_init_timeout(tmp_path):
    began = time.monotonic()
    job = start(["-n", "2", "--init-timeout", "5", str(SCRIPTS / "late_rank.py")], tmp_path)
    assert job.finish(60) == 1
    # the 5 s timeout, the start and the stop: 9 s idle, 21 s seen with the 2 cores shared by
    # four jobs; the default init timeout (300 s) is what a launcher that waited would show
    assert time.monotonic() - began < bound(30)
    assert "rank 1 never reached init_process_group; rank 0 waited" in job.stderr
    assert not job.survivors()


def test_save_on_a_full_disk_fails_on_every_rank_and_leaves_no_temporary_file(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        job = start(["-n", "2", str(SCRIPTS / "saves_to.py"), str(disk / "ckpt.pt"), "4"],
                    tmp_path)  # fmt: skip
        assert job.finish(60) == 1
        assert "rank 0 could not write the checkpoint" in job.stderr
        assert "No space left on device" in job.stderr
        assert "saved" not in job.stdout
        assert list(disk.iterdir()) == [], "no temporary file is left behind"
        assert not job.survivors()
    finally:
        subprocess.run(["umount", str(disk)])


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    import ddpkit.train.checkpoint as checkpoint

    stale = tmp_path / ".ckpt.pt.abc123.tmp"
    stale.write_bytes(b"x" * 1000)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    checkpoint.write_atomic({"a": 1}, tmp_path / "ckpt.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_a_daemon_that_drops_its_environment_does_not_outlive_the_job(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    job = start(["-n", "1", str(SCRIPTS / "daemon.py"), str(pid_file)], tmp_path)
    assert job.finish(60) == 0
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + bound(5)  # its reaper (init) may take a moment
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _default_base() -> Path:
    import tempfile

    return Path(tempfile.gettempdir()) / f"ddpkit-{os.getuid()}"


@pytest.mark.parametrize("problem", ["world-writable", "symlink", "file", "other-owner"])
def test_a_log_base_someone_else_can_touch_is_refused(tmp_path, problem):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    base = tmp_path / f"ddpkit-{os.getuid()}"
    if problem == "world-writable":
        base.mkdir(mode=0o777)
        base.chmod(0o777)
    elif problem == "symlink":
        (tmp_path / "theirs").mkdir()
        base.symlink_to(tmp_path / "theirs")
    elif problem == "file":
        base.write_text("")
    else:
        base.mkdir(mode=0o700)
        os.chown(base, 12345, 12345)
    out = subprocess.run(
        [*DDPKIT, "run", "-n", "1", str(SCRIPTS / "world.py")],
        capture_output=True, text=True, timeout=30, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert f"the log folder {base}" in out.stderr
    assert "fix:" in out.stderr
    assert "rank 0 of 1" not in out.stdout


def test_two_jobs_with_one_run_id_get_folders_of_their_own(tmp_path):
    # (that the folders are private: test_run_contract.py, which reads a job's logs)
    argv = ["-n", "1", str(SCRIPTS / "env_dump.py"), str(tmp_path)]
    jobs = [start(argv, tmp_path, run_id="same") for _ in "ab"]
    assert [j.finish(60) for j in jobs] == [0, 0]
    folders = [p for p in (tmp_path / "logs").iterdir() if not p.is_symlink()]
    assert len(folders) == 2


def test_old_run_folders_beyond_the_newest_50_are_removed(tmp_path):
    from ddpkit.launch.base import rundir

    old = time.time() - 30 * 86400
    for i in range(60):
        run = tmp_path / f"run{i:02d}"
        run.mkdir()
        (run / "rank0.log").write_text("x")
        os.utime(run, (old + i, old + i))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "rank0.log").write_text("x")
    removed = rundir.prune(tmp_path)
    assert len(removed) == 11
    assert fresh.exists()
    assert not (tmp_path / "run00").exists()
    assert (tmp_path / "run59").exists()


def test_a_run_that_prunes_old_run_folders_says_how_many_went(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    old = time.time() - 2 * 3600
    for i in range(5):
        run = logs / f"old{i}"
        run.mkdir()
        (run / "rank0.log").write_text("x")
        os.utime(run, (old + i, old + i))
    job = start(["-n", "1", str(SCRIPTS / "env_dump.py"), str(tmp_path)], tmp_path,
                env={"DDPKIT_KEEP_RUNS": "3"})  # fmt: skip
    assert job.finish(60) == 0, job.stderr
    # at its start the new run's folder holds no log yet: the newest 3 before it stay
    assert f"removed 2 old run folder(s) from {logs}, keeping the newest 3" in job.stderr
    assert sorted(p.name for p in logs.iterdir() if p.name.startswith("old")) == [
        "old2", "old3", "old4"
    ]  # fmt: skip


def test_stacks_without_a_running_job_says_what_it_reads_and_where_ended_jobs_are():
    env = {k: v for k, v in os.environ.items() if not k.startswith("_DDPKIT")}
    # the other tests' jobs run beside this one: in a PID namespace of its own (root, as CI
    # is) ddpkit sees no process but its own, as on a machine where no job runs
    alone = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        alone = []
    out = subprocess.run(
        [*alone, *DDPKIT, "stacks"], capture_output=True, text=True, timeout=60, env=env
    )
    if not alone and (out.returncode == 0 or "jobs are running" in out.stderr):
        pytest.skip("another test's job is running on this machine (no PID namespace here)")
    assert out.returncode == 2
    assert "no training job is running on this machine" in out.stderr
    assert "start one with `ddpkit run ...`" in out.stderr
    assert "name one" not in out.stderr


def ddpkit(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*DDPKIT, *args], capture_output=True, text=True, timeout=60, **kw)


def test_kill_refuses_a_process_that_is_not_a_training_job():
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        out = ddpkit("kill", str(bystander.pid), "--grace", "1")
        assert out.returncode == 2
        assert "is not a training job ddpkit can identify" in out.stderr
        assert f"ddpkit kill --force {bystander.pid}" in out.stderr
        assert bystander.poll() is None
        out = ddpkit("kill", "--force", str(bystander.pid), "--grace", "1")
        assert out.returncode == 0
        assert bystander.wait(10) is not None
    finally:
        if bystander.poll() is None:
            bystander.kill()
            bystander.wait()


@pytest.mark.parametrize("pid", ["1", "self"])
def test_kill_never_targets_init_or_its_own_ancestors(pid):
    target = str(os.getpid()) if pid == "self" else pid
    out = ddpkit("kill", "--force", target)
    assert out.returncode == 2
    assert "ending it would end this session" in out.stderr


def test_kill_as_another_user_says_what_it_could_not_end_and_fails():
    if os.geteuid() != 0 or subprocess.run(["id", "nobody"], capture_output=True).returncode:
        pytest.skip("needs root and the user nobody")
    probe = ["su", "-s", "/bin/sh", "nobody", "-c", f"{sys.executable} -c 'import ddpkit'"]
    reachable = subprocess.run(probe, capture_output=True).returncode == 0
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        if reachable:
            line = f"{sys.executable} -m ddpkit kill --force --grace 1 {victim.pid}"
            command = ["su", "-s", "/bin/sh", "nobody", "-c", line]
        else:  # the venv's python lies in a folder nobody cannot enter (CI's, under /root)
            command = [sys.executable, str(SCRIPTS / "kill_as_nobody.py"), str(victim.pid)]
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"could not end 1 process(es): {victim.pid} (owned by root, not nobody)" in (
            out.stdout
        )
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_sigterm_while_workers_start_stops_at_once(tmp_path):
    job = start(
        ["-n", "16", "--grace", "1", str(SCRIPTS / "phases.py"), "before-init"],
        tmp_path,
        env={"DDPKIT_NPROC_LIMIT": "16"},
    )
    job.wait_for("ddpkit: run")
    job.proc.send_signal(signal.SIGTERM)
    assert gone_within(job, bound(30)) < bound(20)

"""ddpkit run's guarantees when things go wrong: each test ends with nothing left running."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest

from tests.e2e.helpers import SCRIPTS, bound, gone_within, start

pytestmark = pytest.mark.timeout(120)


def test_a_failing_rank_stops_the_others_and_its_exit_code_is_returned(tmp_path):
    job = start(["-n", "3", "--grace", "2", str(SCRIPTS / "crash.py")], tmp_path)
    assert job.finish() == 3
    assert "root cause: rank 1 exited with code 3" in job.stderr
    assert "rank 1 is about to fail" in job.stderr.split("root cause")[1], "stderr tail missing"
    assert not job.survivors()


def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(tmp_path):
    job = start(["-n", "2", "--grace", "2", str(SCRIPTS / "killed.py")], tmp_path)
    assert job.finish() == 128 + signal.SIGKILL
    assert "root cause: rank 1 died of SIGKILL" in job.stderr
    assert not job.survivors()


def test_the_root_cause_is_the_rank_that_failed_first_not_its_victim(tmp_path):
    job = start(["-n", "2", "--grace", "2", str(SCRIPTS / "raises.py")], tmp_path)
    assert job.finish() == 1
    assert (
        "root cause: rank 1 exited with code 1 (ValueError: planted failure in rank 1)"
        in job.stderr
    )
    report = (job.log_dir / job.run_id / "report.txt").read_text()
    assert "planted failure in rank 1" in report
    # the victim's own traceback is in its log, one line of it on the console
    victim = [line for line in job.err if line.startswith("[rank 0] ")]
    if victim:  # rank 0 may be stopped before its connection error is raised
        assert len(victim) == 1, job.stderr
        assert "(this rank waited for a peer; the report names the rank at fault" in victim[0]
        log = (job.log_dir / job.run_id / "rank0.log").read_text()
        assert "Traceback (most recent call last)" in log
    assert "[rank 0] Traceback" not in job.stderr
    assert not job.survivors()


def test_a_distributed_sampler_without_set_epoch_is_said_once(tmp_path):
    job = start(["-n", "2", str(SCRIPTS / "no_set_epoch.py")], tmp_path)
    assert job.finish(bound(60)) == 0, job.stderr
    said = [line for line in job.err if "set_epoch(epoch) is never called" in line]
    assert len(said) == 1, job.stderr
    assert said[0].startswith(
        "[rank 0] ddpkit: a DistributedSampler starts another pass at epoch 0"
    )
    assert not job.survivors()


@pytest.mark.parametrize(
    ("phase", "sig"),
    [
        # Ctrl+C where Python cannot raise KeyboardInterrupt (blocked in C++: init's store
        # wait, a collective): the launcher must end the rank itself within grace; SIGTERM,
        # whose default action ends a process wherever it is, where Python runs
        ("before-init", signal.SIGTERM),
        ("in-init", signal.SIGINT),
        ("training", signal.SIGTERM),
        ("collective", signal.SIGINT),
    ],
)
def test_ctrl_c_or_sigterm_in_any_phase_stops_everything_within_grace(tmp_path, phase, sig):
    grace = 2
    job = start(["-n", "2", "--grace", str(grace), str(SCRIPTS / "phases.py"), phase], tmp_path)
    job.wait_for("ready")
    time.sleep(0.3)
    job.proc.send_signal(sig)
    took = gone_within(job, grace + 10)
    assert job.proc.returncode == 128 + sig
    said = job.stdout + job.stderr
    assert "ddpkit/rank/" not in said, "ddpkit's frames are trimmed"
    assert "runpy" not in said
    # SIGKILL comes at `grace`; after it the kernel tears down processes that hold torch and
    # the launcher reports: 0.1-0.5 s idle, up to 2.2 s seen with CI's other worker on both cores
    assert took < bound(grace + 3), f"took {took:.1f} s"


def test_sigterm_while_the_hang_report_is_collected_stops_everything_within_grace(tmp_path):
    # rank 1 holds the GIL: the report waits for its flight recorder's answer (up to 8 s)
    grace = 2
    args = ["-n", "2", "--grace", str(grace), "--hang-timeout", "2"]
    job = start([*args, str(SCRIPTS / "holds_the_gil.py")], tmp_path)
    job.wait_for("[rank 1] ready")
    stacks = job.log_dir / job.run_id / "state0" / "rank1.stacks"
    deadline = time.monotonic() + bound(30)
    while not (stacks.exists() and stacks.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stacks.exists(), "the hang report never asked for stacks"
    job.proc.send_signal(signal.SIGTERM)
    took = gone_within(job, grace + 15)
    assert job.proc.returncode == 128 + signal.SIGTERM, job.stderr
    assert took < bound(grace + 2), f"took {took:.1f} s"


def test_an_unresolvable_master_addr_is_refused_at_once_naming_the_host(tmp_path):
    (tmp_path / "train.py").write_text("print('should not run')\n")
    started = time.monotonic()
    job = start(["-n", "2", "--master-addr", "nosuchhost.invalid", "train.py"], tmp_path)
    assert job.finish(60) == 2
    assert time.monotonic() - started < bound(10)
    assert "--master-addr 'nosuchhost.invalid' does not name a machine" in job.stderr
    assert "Traceback" not in job.stderr
    assert "should not run" not in job.stdout
    assert not (job.log_dir / job.run_id).exists(), "a run was started"


def test_a_master_addr_of_another_machine_for_one_node_is_refused_at_once(tmp_path):
    (tmp_path / "train.py").write_text("print('should not run')\n")
    job = start(["-n", "2", "--master-addr", "198.18.0.99", "train.py"], tmp_path)
    assert job.finish(60) == 2
    assert "'198.18.0.99' is not an address of this machine" in job.stderr
    assert "leave --master-addr out" in job.stderr
    assert not (job.log_dir / job.run_id).exists(), "a run was started"


def test_a_second_ctrl_c_kills_at_once(tmp_path):
    job = start(["-n", "2", "--grace", "60", str(SCRIPTS / "ignore_all.py")], tmp_path)
    # each rank ignores SIGINT once it has said so: a Ctrl+C before that is a KeyboardInterrupt
    # (CI: rank 1's "ready" came first, and a bare "ready" matched it)
    job.wait_for("[rank 0] ready")
    job.wait_for("[rank 1] ready")
    job.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    job.proc.send_signal(signal.SIGINT)
    took = gone_within(job, 20)
    assert took < bound(5), f"took {took:.1f} s with a 60 s grace"
    job.finish(5)
    assert "ranks 0,1 killed at once on a second Ctrl+C" in job.stderr, job.stderr


def test_a_sigkilled_launcher_leaves_no_worker_child_or_loader_process(tmp_path):
    job = start(["-n", "2", "--grace", "30", str(SCRIPTS / "stubborn.py"), str(tmp_path)], tmp_path)
    job.wait_for("[rank 0] ready")
    job.wait_for("[rank 1] ready")
    pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pids-{r}").read_text().split()]
    assert len(pids) >= 2 * 5, "expected rank, 2 children, 2 loader workers per rank"
    os.kill(job.proc.pid, signal.SIGKILL)
    took = gone_within(job, 15, extra_pids=pids)
    assert took < bound(5), f"took {took:.1f} s"


def test_a_rank_that_never_reaches_init_is_named(tmp_path):
    job = start(
        ["-n", "3", "--init-timeout", "3", "--grace", "1", str(SCRIPTS / "phases.py"), "in-init"],
        tmp_path,
    )
    started = time.monotonic()
    assert job.finish(60) == 1
    assert "rank 1 never reached init_process_group" in job.stderr
    assert "rank 0,2 waited" in job.stderr
    assert re.search(r"rank 1 is .* at phases\.py:\d+", job.stderr), "where rank 1 is instead"
    assert time.monotonic() - started < bound(30)
    assert not job.survivors()


def test_a_busy_master_port_names_the_port_and_its_holder(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        job = start(["-n", "2", "--master-port", str(port), str(SCRIPTS / "world.py")], tmp_path)
        assert job.finish() == 1
    finally:
        holder.close()
    assert f"port {port} on 127.0.0.1 is already in use by pid {os.getpid()}" in job.stderr
    assert "fix:" in job.stderr
    assert "Traceback" not in job.stderr
    assert not (job.log_dir / job.run_id).exists(), "a run was started"


def test_a_privileged_port_gets_a_warning_with_the_fix(tmp_path):
    job = start(
        ["-n", "1", "--master-port", "1010", str(SCRIPTS / "env_dump.py"), str(tmp_path)], tmp_path
    )
    code = job.finish()
    # root may bind it, and the job runs after the warning; anyone else gets the clear error
    assert code == 0 if os.geteuid() == 0 else code == 1, job.stderr
    assert "privileged port" in job.stderr
    assert "above 1024" in job.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["missing.py"], "script 'missing.py' not found"),
        (["-n", "0", "x.py"], "must be at least 1"),
        (["--frobnicate", "x.py"], "ddpkit run does not know --frobnicate"),
        (["-n", "gpu", "x.py"], "no GPU is visible"),
    ],
)
def test_bad_input_is_a_clear_error_and_starts_nothing(tmp_path, args, says):
    (tmp_path / "x.py").write_text("print('should not run')\n")
    job = start(args, tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert job.finish() == 2
    assert says in job.stderr
    assert "should not run" not in job.stdout
    assert not job.log_dir.exists()

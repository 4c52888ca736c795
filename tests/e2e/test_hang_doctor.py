"""The hang doctor on real gloo ranks: the verdict names the right rank and file:line, the
report comes within hang-timeout + 10 s of the stall, and nothing survives."""

from __future__ import annotations

import re
import time

import pytest

from tests.e2e.helpers import SCRIPTS, bound, gone_within, start

pytestmark = pytest.mark.timeout(120)
HANG_TIMEOUT = 3
HANG_EXIT = 124
_SOURCE = (SCRIPTS / "hangs.py").read_text().splitlines()


def at(marker: str) -> str:
    """hangs.py:N of the line carrying `# @marker`."""
    return f"hangs.py:{next(i for i, t in enumerate(_SOURCE, 1) if t.endswith('# @' + marker))}"


def run_hang(tmp_path, case: str, *extra: str, n: int = 2, script=SCRIPTS / "hangs.py"):
    job = start(
        [
            "-n",
            str(n),
            "--hang-timeout",
            str(HANG_TIMEOUT),
            "--grace",
            "1",
            str(script),
            case,
            *extra,
        ],
        tmp_path,
    )
    job.wait_for("stall")
    stalled = time.monotonic()
    code = job.finish(HANG_TIMEOUT + 60)
    took = time.monotonic() - stalled
    verdict = next((line for line in job.stderr.splitlines() if "root cause:" in line), "")
    assert not job.survivors()
    return code, verdict, took, job


def test_a_rank_sleeping_before_a_collective_is_named(tmp_path):
    code, verdict, took, _ = run_hang(tmp_path, "sleep", n=3)
    assert code == HANG_EXIT
    assert f"ranks 0,2 wait in all_reduce ({at('sleep-collective')})" in verdict
    assert f"rank 1 is elsewhere: stuck_here ({at('stuck-here')})" in verdict
    assert took < bound(HANG_TIMEOUT + 10)


@pytest.mark.parametrize("folder", ["ddpkit"])  # torch, runpy: test_hang_verdict.py
def test_the_verdict_names_user_lines_in_a_project_folder_named_like_a_library(tmp_path, folder):
    project = tmp_path / folder / "launch"  # .../ddpkit/launch/hangs.py: still the user's
    project.mkdir(parents=True)
    (project / "hangs.py").write_text((SCRIPTS / "hangs.py").read_text())
    code, verdict, _, _ = run_hang(tmp_path, "sleep", script=project / "hangs.py")
    assert code == HANG_EXIT
    assert f"rank 0 waits in all_reduce ({at('sleep-collective')})" in verdict
    assert f"rank 1 is elsewhere: stuck_here ({at('stuck-here')})" in verdict


def test_a_collective_called_only_on_rank_0_is_named_as_a_mismatch_with_its_branch(tmp_path):
    code, verdict, took, job = run_hang(tmp_path, "only-rank-0")
    assert code == HANG_EXIT
    assert "the ranks called different collectives: " in verdict
    # the sequence numbers come from the flight recorder, which gloo has from torch 2.5 on
    seq = r"(#1 )?"
    assert re.search(rf"rank 0 all_reduce {seq}of \[4\] at {at('rank-0-only')}", verdict), verdict
    assert re.search(rf"rank 1 barrier {seq}at {at('others-barrier')}", verdict), verdict
    branch = int(at("rank-0-only").split(":")[1]) - 1
    assert f"look at the branch at hangs.py:{branch} (`if rank == 0:`)" in job.stderr
    assert "raise --hang-timeout" not in job.stderr, "no timeout fixes a mismatch"
    assert took < bound(HANG_TIMEOUT + 10)


def test_a_barrier_skipped_by_one_rank_is_named(tmp_path):
    code, verdict, took, _ = run_hang(tmp_path, "skipped-barrier", n=3)
    assert code == HANG_EXIT
    assert f"ranks 0,2 wait in barrier ({at('skipped-barrier')})" in verdict
    assert f"rank 1 is elsewhere: stuck_here ({at('stuck-here')})" in verdict
    assert took < bound(HANG_TIMEOUT + 10)


def test_a_rank_stuck_in_a_dataloader_worker_is_named(tmp_path):
    code, verdict, took, job = run_hang(tmp_path, "loader")
    assert code == HANG_EXIT
    assert f"rank 0 waits in all_reduce ({at('loader-collective')})" in verdict
    assert f"rank 1 waits for a DataLoader batch ({at('loader-loop')})" in verdict
    assert took < bound(HANG_TIMEOUT + 10)


def test_mismatched_shapes_name_each_ranks_call(tmp_path):
    code, verdict, took, job = run_hang(tmp_path, "shapes")
    assert code != 0
    site = at("shapes-collective")
    assert (
        f"the ranks called all_reduce with different shapes: rank 1 all_reduce of [5] at {site}; "
        f"rank 0 all_reduce of [4] at {site}"
    ) in verdict
    assert (
        "fix: every rank must call the same collectives, in the same order, with the same "
        "shapes" in job.stderr
    )
    assert took < bound(HANG_TIMEOUT + 10)


def test_check_collectives_names_the_first_divergence(tmp_path):
    job = start(
        ["-n", "2", "--check-collectives", "--grace", "1", str(SCRIPTS / "hangs.py"), "shapes"],
        tmp_path,
    )
    assert job.finish(60) == 1
    site = at("shapes-collective")
    assert f"rank 1 all_reduce of [5] at {site}; rank 0 all_reduce of [4] at {site}" in job.stderr
    assert "Detected mismatch" in job.stderr
    assert not job.survivors()


def test_a_long_computation_is_not_a_hang(tmp_path):
    job = start(
        [
            "-n",
            "2",
            "--hang-timeout",
            str(HANG_TIMEOUT),
            "--grace",
            "1",
            str(SCRIPTS / "hangs.py"),
            "compute",
            str(HANG_TIMEOUT * 3),
        ],
        tmp_path,
    )
    assert job.finish(60) == 0, job.stderr
    assert job.stdout.count("finished") == 2


def test_stacks_shows_every_rank_of_a_hung_job_and_hang_timeout_zero_stops_nothing(tmp_path):
    import subprocess
    import sys

    job = start(
        [
            "-n",
            "2",
            "--hang-timeout",
            "0",
            "--grace",
            "1",
            str(SCRIPTS / "hangs.py"),
            "only-rank-0",
        ],
        tmp_path,
    )
    job.wait_for("stall")
    stalled = time.monotonic()
    time.sleep(1.5)
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit", "stacks", job.run_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    expected = (
        f"rank 0 waits in all_reduce ({at('rank-0-only')}); "
        f"rank 1 waits in barrier ({at('others-barrier')})"
    )
    assert expected in out.stdout
    assert job.proc.poll() is None, "stacks must not stop the job"
    # --hang-timeout 0 turns the doctor off: a real hang three timeouts long, and no verdict
    time.sleep(max(0.0, stalled + 3 * HANG_TIMEOUT - time.monotonic()))
    assert job.proc.poll() is None, "the doctor is off: nothing ends the job"
    assert "root cause" not in job.stderr, job.stderr
    job.proc.terminate()
    gone_within(job, 15)

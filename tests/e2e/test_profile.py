"""`ddpkit profile` on a running job and `ddpkit run --profile-steps` (issue 39), on real gloo
ranks: the same steps recorded on every rank with torch's profiler, no change to the script (a
plain DDP loop as the PyTorch tutorial writes it: tests/e2e/scripts/uneven.py), the job going
on; the breakdown names the rank slowed on purpose and the op it spends its time in; bad input
ends in a clear message with the job untouched."""

from __future__ import annotations

import gzip
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.common import protocol
from tests.e2e.helpers import SCRIPTS, start

pytestmark = pytest.mark.timeout(240)
UNEVEN = str(SCRIPTS / "uneven.py")


def profile(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "profile", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def events(trace: Path) -> list[dict]:
    with gzip.open(trace, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_records_the_same_steps_of_every_rank_and_names_the_slowed_one_and_its_op(
    tmp_path,
):
    # rank 1's forward does extra matmuls from the second phase on: it holds the others back
    # compute phases enough for a slow machine: the job is ended once it went on past the
    # recording
    phases = ["even", *["compute:3"] * 6]
    job = start(["-n", "3", UNEVEN, *phases, "--phase", "150", "--io", "0.01"], tmp_path)
    job.wait_for("extra", timeout=120)
    done = profile(job.run_id, "--steps", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout
    assert "the others wait for rank 1: its compute time stands out" in said, said
    top_of_rank_1 = said.split("meanwhile it spends most in ")[1].split(" ")[0]
    assert top_of_rank_1 in ("aten::mm", "aten::tanh"), said  # the extra matmuls
    (folder,) = (tmp_path / "logs" / job.run_id).glob("profile-*")
    summaries = [json.loads((folder / f"rank{r}.summary.json").read_text()) for r in range(3)]
    assert len({json.dumps(s["plan"]) for s in summaries}) == 1, "one plan: the same steps"
    assert [s["recorded"] for s in summaries] == [5, 5, 5]
    for rank in range(3):
        names = {e.get("name") for e in events(folder / f"rank{rank}.trace.json.gz")}
        assert "gloo:all_reduce" in names, "DDP's collectives"
        assert "aten::addmm" in names, "the model's ops"
    merged = events(folder / "merged.trace.json.gz")
    processes = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert {p.split(":")[0] for p in processes} == {"rank 0", "rank 1", "rank 2"}
    body = said.split("\n", 1)[1].strip()
    assert body.startswith((folder / "breakdown.txt").read_text().strip())
    assert f"this breakdown is in {folder / 'breakdown.txt'}" in body, "where it is, said"
    plan = summaries[0]["plan"]
    state = tmp_path / "logs" / job.run_id / "state0"
    deadline = time.monotonic() + 60
    while protocol.read_steps(state, 0).count <= plan["first"] + plan["steps"] + 5:
        assert job.proc.poll() is None, job.stderr
        assert time.monotonic() < deadline, "the job kept training after the recording"
        time.sleep(0.2)
    job.proc.terminate()
    job.finish(60)
    assert not job.survivors()


def test_profile_steps_records_from_the_start_and_prints_the_breakdown(tmp_path):
    job = start(["-n", "2", "--profile-steps", "5-8", UNEVEN, "even", "--phase", "30"], tmp_path)
    assert job.finish(120) == 0, job.stderr
    assert "ddpkit: steps 5-8 recorded on 2 rank(s)" in job.stderr, job.stderr
    assert "top ops by own time over the recorded steps (an op's own time leaves out" in job.stderr
    assert re.search(r"rank 0: .*; all \d+ ops together \d+%", job.stderr), job.stderr
    assert "USDT:" not in job.stdout + job.stderr, "kineto's trace points stay in the logs"
    folder = tmp_path / "logs" / job.run_id / "profile-5-8"
    assert f"drawn in {folder / 'breakdown.png'}" in job.stderr, "a file written is said"
    assert (folder / "breakdown.png").exists()
    assert sorted(p.name for p in folder.glob("rank*.trace.json.gz")) == [
        "rank0.trace.json.gz",
        "rank1.trace.json.gz",
    ]
    assert not job.survivors()


def test_steps_past_the_jobs_end_are_said_not_recorded(tmp_path):
    job = start(["-n", "2", "--profile-steps", "500-505", UNEVEN, "even", "--phase", "20"],
                tmp_path)  # fmt: skip
    assert job.finish(120) == 0, job.stderr
    assert re.search(r"--profile-steps 500-505: the job's last step was \d+: nothing recorded",
                     job.stderr), job.stderr  # fmt: skip
    assert not job.survivors()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--steps", "0"], "--steps 0 is not 1 to 100"),
        (["--steps", "500"], "--steps 500 is not 1 to 100 (every op of every recorded step"),
        (["--at", "0"], "--at 0: steps are numbered from 1"),
        (["nosuchjob"], "no job 'nosuchjob' on this machine"),
    ],
)
def test_bad_input_is_refused_with_a_fix_and_the_job_goes_on(tmp_path, args, words):
    job = start(["-n", "2", UNEVEN, "hold", "--phase", "2000", "--io", "0.02"], tmp_path)
    job.wait_for("hold", timeout=120)
    done = profile(*args, timeout=60) if args[0] == "nosuchjob" else profile(job.run_id, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert words in done.stderr, done.stderr
    assert "fix:" in done.stderr
    assert "Traceback" not in done.stderr
    assert job.proc.poll() is None, "the job is untouched"
    job.proc.terminate()
    job.finish(60)
    assert not job.survivors()


def test_a_job_without_optimizer_steps_is_said_so(tmp_path):
    job = start(["-n", "2", str(SCRIPTS / "phases.py"), "training"], tmp_path)
    job.wait_for("ready", timeout=120)
    done = profile(job.run_id)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "has timed no optimizer step yet" in done.stderr, done.stderr
    assert job.proc.poll() is None, "the job is untouched"
    job.proc.terminate()
    job.finish(60)
    assert not job.survivors()


def test_ctrl_c_cuts_the_recording_at_the_next_step_and_the_job_goes_on(tmp_path):
    # steps of 0.1 s: the 100 steps asked for take 10 s, and the cut after a few comes well
    # before them even on a loaded machine (at 0.05 s, CI beside other work once saw all 100)
    job = start(["-n", "2", UNEVEN, "even", "--phase", "100000", "--io", "0.1"], tmp_path)
    try:
        state = tmp_path / "logs" / job.run_id / "state0"
        deadline = time.monotonic() + 120

        def steps_of(rank: int) -> int:  # a rank that has timed no step yet has no file
            timed = protocol.read_steps(state, rank)
            return 0 if timed is None else timed.count

        while min(steps_of(0), steps_of(1)) < 5:
            assert time.monotonic() < deadline, job.stderr
            time.sleep(0.2)
        asked = subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "profile", job.run_id, "--steps", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        first = None
        seen: list[tuple[float, int, bool]] = []  # (time, rank 0's steps, marker): said on failure
        while first is None or steps_of(0) < first + 5:
            marked = (state / "rank0.profiling").exists()
            seen.append((round(time.monotonic() % 1000, 2), steps_of(0), marked))
            assert asked.poll() is None, (asked.communicate(), first, seen[-40:])
            assert time.monotonic() < deadline + 60
            if first is None and marked:
                first = steps_of(0)
            time.sleep(0.1)
        asked.send_signal(signal.SIGINT)  # as Ctrl+C in the terminal
        out, err = asked.communicate(timeout=30)
        assert asked.returncode == 130, out + err
        said = r"stopped \(Ctrl\+C\) at step (\d+): the ranks stop recording at step (\d+)"
        assert re.search(said, out), out + err
        summaries = []  # the ranks make the folder when they stop, at their next step
        while len(summaries) < 2:
            assert time.monotonic() < deadline + 120, job.stderr
            found = (tmp_path / "logs" / job.run_id).glob("profile-*/rank*.summary.json")
            summaries = [json.loads(p.read_text()) for p in found]
            time.sleep(0.2)
        for summary in summaries:
            assert 5 <= summary["recorded"] < 100, summary  # cut, not the 100 asked for
            assert not summary["ended_early"]
        assert not (state / "rank0.profiling").exists(), "the memory watch's mark is gone"
        assert job.proc.poll() is None, "the job goes on"
    finally:  # a failed assertion must not leave the job running
        job.proc.terminate()
        job.finish(60)
    assert not job.survivors()

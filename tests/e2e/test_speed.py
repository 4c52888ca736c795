"""Why is it slow (issue 22), on CPU ranks: a script written as the PyTorch DDP tutorial writes
it (no ddpkit in it), its rank 1 slowed on purpose in phases, is timed with no code change; the
straggler is named while the job runs (rank, cause, factor), an even job gets no verdict, the
end of the job prints each rank's figures, and `ddpkit top` shows the job without touching it.

Faults: rank 1's data loading slowed (a sleep in `__getitem__`), its compute slowed 1.5x (extra
matmuls in its forward), a CPU hog on its core; no fault. One job of 3 ranks goes through its
phases (each 250 steps, the same step on every rank); 2 ranks are slowed by the hog here and
across nodes (tests/multinode/test_nodes.py). The rule at other world sizes, an even one's
median among them, is a decision: tests/unit/test_straggler.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e import terminal
from tests.e2e.helpers import SCRIPTS, bound, start

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "uneven.py")
WINDOW = ["--straggler-window", "30"]
COMPUTE = re.compile(r"straggler: rank 1 \(.*\) computes (\d+\.\d+)x the median rank")


def top_reads_it_as_json_and_as_a_live_table_and_never_touches_it(job, world, tmp_path) -> None:
    """`ddpkit top --once --json` and the live table (160 and 80 columns) on a running job."""
    deadline = time.monotonic() + bound(60)
    rows: list = []
    while time.monotonic() < deadline and len(rows) < world:
        out = subprocess.run(
            [sys.executable, "-m", "ddpkit", "top", job.run_id, "--once", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode == 2 and "no job" in out.stderr:  # its ranks are not up yet
            time.sleep(0.5)
            continue
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)["ranks"]
        time.sleep(1)
    assert [r["rank"] for r in rows] == list(range(world))
    for r in rows:
        assert r["median_s"] > 0
        assert abs(sum(r["split"].values()) - 1) < 0.01
        assert set(r["split"]) == {"data", "compute", "comm", "host"}
        assert r["facts"]["host"]["cores"] >= 1
    assert job.proc.poll() is None, "top --once must not stop the job"
    if terminal.available() is not None:
        return  # the live table needs a terminal
    with contextlib.ExitStack() as terms:  # each terminal closed, whatever fails
        term = terms.enter_context(
            contextlib.closing(
                terminal.Terminal([sys.executable, "-m", "ddpkit", "top", job.run_id], tmp_path)
            )
        )
        deadline = time.monotonic() + bound(60)
        screen = ""
        while time.monotonic() < deadline and not re.search(r"│\s+1 │", screen):
            time.sleep(0.5)
            screen = term.screen()
        assert re.search(r"│\s+1 │", screen), f"no row of rank 1:\n{screen}"
        assert f"job {job.run_id}" in screen
        first = term.screen()
        time.sleep(2.5)
        assert term.screen() != first, f"the table refreshes (at least once a second):\n{first}"
        term.keys("q")
        assert term.exit_code(20) == 0
        assert job.proc.poll() is None, "quitting top never touches the job"
        # an 80-column terminal: short headers, every value whole, one line per rank
        narrow = terms.enter_context(
            contextlib.closing(
                terminal.Terminal(
                    [sys.executable, "-m", "ddpkit", "top", job.run_id], tmp_path, width=80
                )
            )
        )
        screen = narrow.wait_for("split %", timeout=bound(30))
        rows = [line for line in screen.splitlines() if re.match(r"\s+\d\s+\d", line)]
        assert len(rows) == world, f"one line per rank:\n{screen}"
        assert "…" not in screen, f"a value cut short:\n{screen}"
        narrow.keys("q")
        assert narrow.exit_code(20) == 0


def verdicts(text: str) -> list[str]:
    return [line for line in text.splitlines() if "straggler:" in line]


@pytest.mark.parametrize(
    ("world", "phases"), [(3, ["even", "data", "even", "compute:1.5", "wait:2"])]
)
def test_the_slowed_rank_is_named_with_its_cause_an_even_phase_with_none_and_top_shows_it(
    tmp_path, world, phases
):
    job = start(["-n", str(world), *WINDOW, SCRIPT, *phases, "--phase", "250"], tmp_path)
    began = time.monotonic()
    try:
        top_reads_it_as_json_and_as_a_live_table_and_never_touches_it(job, world, tmp_path)
    except BaseException:
        job.proc.terminate()
        job.finish(60)
        raise
    first_fault = next(p for p in phases if p != "even")
    job.wait_for(f"[rank 0] phase {first_fault}", timeout=bound(120))
    assert not verdicts(job.stderr), f"a verdict on an even job of {world} ranks:\n{job.stderr}"
    assert job.finish(240) == 0, job.stderr
    said = verdicts(job.stderr)
    if "data" in phases:
        data = [v for v in said if "waits for data" in v]
        assert data, job.stderr
        assert data[0].startswith("ddpkit: straggler: rank 1 (")
        assert "raise num_workers" in data[0]
    if "compute:1.5" in phases:
        found = [COMPUTE.search(v) for v in said]
        factors = [float(m.group(1)) for m in found if m]
        assert factors, job.stderr
        # the fault is sized from rank 1's step time in the even phase as the script measures
        # it, which the machine's load moves: 1.53x alone, 1.91x and 1.93x beside the suite's
        # three workers on 2 cores. What is checked: the factor is above the 1.2 threshold and
        # within 1.5x of the fault's own 1.5 (a mixed-up part or unit would be far outside)
        assert 1.2 <= factors[0] <= 1.5 * 1.5, f"factor {factors[0]} for a 1.5x fault\n{said}"
    if "wait:2" in phases:  # asleep, not computing: said so, from its own CPU use
        waits = [v for v in said if "its extra time is not spent computing" in v]
        assert waits, job.stderr
        assert "but its main thread asked for" in waits[0]
        assert "computes" not in waits[0]
    if phases.index(first_fault) < len(phases) - 1 and phases[-1] != "even":
        assert "rank 1 is back at the job's pace" in job.stderr
    assert not [v for v in said if "rank 1" not in v], "only rank 1 was slowed"
    assert "set_epoch(epoch) is never called" not in job.stderr, "it calls set_epoch"
    assert time.monotonic() - began < bound(200)
    assert "step times per rank" in job.stderr
    assert (job.log_dir / job.run_id / "steps.png").stat().st_size > 1000, "matplotlib: a plot"
    report = json.loads((job.log_dir / job.run_id / "speed.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == list(range(world))
    assert report["slowest"]["rank"] == 1
    assert not job.survivors()


@pytest.mark.skipif((psutil.cpu_count() or 1) < 2, reason="needs 2 cores to pin to")
@pytest.mark.skipif(os.geteuid() != 0, reason="sets priorities below nice 0 (root, as CI)")
def test_a_cpu_hog_on_rank_1s_core_is_named_with_its_pid(tmp_path):
    # ranks that compute (a wide model, no sleep): a core shared with a hog halves rank 1's pace.
    # The hogs are on core 1 before the job starts, and the ranks are pinned at their first
    # step: no window of rank 1's steps comes before the hogs (with an even phase first, the
    # suite's own load once made rank 1 a straggler before them: CI, session 24).
    hog_code = "import os\nos.sched_setaffinity(0, {1})\nos.nice(-5)\nwhile True: pass"
    hogs = [
        subprocess.Popen([sys.executable, "-c", hog_code], start_new_session=True) for _ in range(2)
    ]
    job = None
    try:
        for h in hogs:
            _autogroup_nice(h.pid, -20)
            _wait_pinned(h.pid, {1}, bound(30))
        phases = ["hold"] * 41
        args = ["--phase", "150", "--io", "0", "--batch", "64", "--hidden", "1024"]
        job = start(["-n", "2", *WINDOW, SCRIPT, *phases, *args], tmp_path)
        job.wait_for("[rank 1] hold", timeout=bound(120))
        ranks = [p for p in psutil.process_iter(["environ"]) if _rank_of(p, job.run_id) is not None]
        assert len(ranks) == 2
        # each rank (every thread of it) on a core of its own; rank 0 before the suite's other
        # work on core 0, rank 1 behind the two hogs on core 1 (~10% of it): a straggler however
        # busy the machine is. Where the kernel groups processes by session (autogroup, on by
        # default), nice acts only inside a group: the groups' own nice is set too.
        for p in ranks:
            rank = _rank_of(p, job.run_id)
            for thread in p.threads():
                os.sched_setaffinity(thread.id, {rank})
                if rank == 0:
                    os.setpriority(os.PRIO_PROCESS, thread.id, -10)
            _autogroup_nice(p.pid, -10)
        try:
            job.wait_for("straggler: rank 1", timeout=bound(90))
        except AssertionError as missed:  # what the launcher saw, for whoever reads the failure
            seen = subprocess.run(
                [sys.executable, "-m", "ddpkit", "top", job.run_id, "--once", "--json"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            load = os.getloadavg()
            raise AssertionError(f"{missed}\nload {load}\ntop: {seen.stdout[-3000:]}") from None
        line = next(v for v in verdicts(job.stderr) if "rank 1" in v)
        assert "computes" in line, job.stderr
        assert any(f"pid {h.pid}" in line for h in hogs), job.stderr
        # rank 0 may be named too when the machine is busy with others' work (the suite runs
        # in two workers on two cores): then with its own evidence, never the hog on core 1
        for other in (v for v in verdicts(job.stderr) if "straggler: rank 0 " in v):
            assert not any(f"pid {h.pid}" in other for h in hogs), other
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        if job is not None:
            job.proc.terminate()
            job.finish(60)
    assert job is not None
    assert not job.survivors()


def _wait_pinned(pid: int, cores: set[int], timeout: float) -> None:
    """Until the process has set its affinity to `cores` (its interpreter is up)."""
    deadline = time.monotonic() + timeout
    while set(psutil.Process(pid).cpu_affinity()) != cores:
        assert time.monotonic() < deadline, f"pid {pid} never pinned itself to {cores}"
        time.sleep(0.05)


def _autogroup_nice(pid: int, nice: int) -> None:
    """The nice of the process's scheduling group (its session's), where the kernel has them."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def _rank_of(proc: psutil.Process, run_id: str) -> int | None:
    try:
        env = proc.info["environ"] or {}
    except (psutil.Error, KeyError):
        return None
    launcher = env.get("_DDPKIT_LAUNCHER_PID")
    if env.get("_DDPKIT_JOB") == run_id and launcher and proc.ppid() == int(launcher):
        return int(env["RANK"])  # the rank itself, not a child it forked
    return None


def test_top_without_a_job_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("_DDPKIT")}
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit", "top", "nosuchjob", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert "no job 'nosuchjob'" in out.stderr or "no training job is running" in out.stderr

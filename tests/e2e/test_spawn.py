"""`ddpkit.spawn(fn, args, nprocs)` from a script, as mp.spawn's users call it: PyTorch's DDP
tutorial (multigpu.py) runs by changing its one import line; a rank raising, a hang, Ctrl+C and
the caller SIGKILLed behave as under `ddpkit run` (the verdict printed, the call raising what
carries the root cause and the exit code, nothing left); options come from keyword arguments
and DDPKIT_<OPTION>; a call ddpkit cannot serve is refused before any rank starts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.helpers import SCRIPTS, bound

pytestmark = pytest.mark.timeout(180)
TUTORIAL = SCRIPTS / "tutorial" / "multigpu.py"
TRAIN = SCRIPTS / "spawned" / "train.py"


def left_of(script: Path) -> list[psutil.Process]:
    """Processes still running the copy of the script (its ranks name it on their command
    line), after a moment for the kernel to reap them."""
    time.sleep(0.3)
    found = []
    for p in psutil.process_iter():
        try:
            if str(script) in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def ran(tmp_path: Path, mode: str, code: int) -> tuple[str, str]:
    """train.py run to its end in `mode` by a caller that exits `code`: its stdout, stderr."""
    proc = caller(copy(tmp_path, TRAIN), mode)
    out, err = proc.communicate(timeout=bound(90))
    assert proc.returncode == code, out + err
    return out, err


def caller(script: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    environ = {**os.environ, "DDPKIT_LOG_DIR": str(script.parent / "logs"), **(env or {})}
    return subprocess.Popen(
        [sys.executable, str(script), *args], cwd=script.parent, env=environ,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def copy(tmp_path: Path, source: Path) -> Path:
    target = tmp_path / source.name
    shutil.copy(source, target)
    return target


def test_the_tutorial_runs_under_ddpkit_by_changing_its_import_line(tmp_path):
    script = tmp_path / "multigpu.py"
    source = TUTORIAL.read_text()
    assert "import torch.multiprocessing as mp\n" in source
    script.write_text(
        source.replace("import torch.multiprocessing as mp\n", "import ddpkit as mp\n")
    )
    out, err = caller(script, "2", "1").communicate(timeout=bound(90))
    assert "[rank 1] [GPU1] Epoch 1 | Steps: 4" in out, out + err
    assert "[rank 0] Epoch 1 | Training checkpoint saved at checkpoint.pt" in out
    assert re.search(r"ddpkit: done in [\d.]+ s: every rank exited 0", err), err
    assert not left_of(script)


def test_the_ranks_get_fn_args_and_the_callers_argv_and_the_caller_goes_on(tmp_path):
    script = copy(tmp_path, TRAIN)
    proc = caller(script, "ok", "3")
    out, err = proc.communicate(timeout=bound(90))
    assert proc.returncode == 0, out + err
    for rank in range(3):  # the script's own class (Settings) reached every rank
        assert f"[rank {rank}] rank {rank} of 3 stepped, argv ['ok', '3']" in out
    assert out.count("caller pid") == 1, "the main block ran once, in the caller only"
    assert out.rstrip().endswith("the caller goes on after the job")
    assert not left_of(script)


def test_a_failed_rank_is_restarted_with_max_restarts_and_the_job_goes_on(tmp_path):
    out, err = ran(tmp_path, "flaky", 0)  # max_restarts=1 given to ddpkit.spawn
    assert "rank 1 exited with code 1 (ValueError: a bad batch" in err, err
    assert "ddpkit: restarting the whole group (1 of 1)" in err, err
    assert out.rstrip().endswith("the caller goes on after the job")


def test_ddpkit_setup_inside_the_function_works_as_in_a_script(tmp_path):
    out, _ = ran(tmp_path, "setup", 0)
    assert "[rank 1] rank 1: setup gave rank 1 of 2" in out, out


def test_a_rank_raising_raises_what_carries_the_root_cause_and_nothing_is_left(tmp_path):
    out, err = ran(tmp_path, "caught", 0)
    caught = re.search(r"caught: exit code (\d+); root cause: (.*); fix: .*; run dir (\S+)", out)
    assert caught, out + err
    assert caught.group(1) == "1"
    assert caught.group(2).startswith("rank 1 exited with code 1 (ValueError: a bad batch"), out
    assert "train.py:" in caught.group(2), "its line"
    assert (Path(caught.group(3)) / "report.txt").exists()
    assert "root cause: rank 1" in err, "the report, as ddpkit run prints it"
    assert not left_of(tmp_path / TRAIN.name)


def test_uncaught_the_failure_is_said_in_a_line_without_a_traceback(tmp_path):
    out, err = ran(tmp_path, "raises", 1)
    assert re.search(r"error: the job ended with exit code 1: rank 1 exited with code 1 "
                     r"\(ValueError", err), err  # fmt: skip
    assert "Traceback" not in err.split("error: the job ended")[1], "no traceback of spawn's"
    assert "the caller goes on" not in out


def test_a_hang_is_named_and_raises_with_its_exit_code_options_from_keywords(tmp_path):
    out, err = ran(tmp_path, "hangs", 1)  # hang_timeout=3 given to ddpkit.spawn
    assert "ddpkit: the job hung" in err
    assert re.search(r"rank 1 is elsewhere: main \(train\.py:\d+\)", err), err
    assert "error: the job ended with exit code 124: no rank made progress" in err
    assert not left_of(tmp_path / TRAIN.name)


def started(script: Path, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """The caller of `train.py forever`, its output in a file, once every rank has stepped."""
    out = script.parent / "out.txt"
    environ = {**os.environ, "DDPKIT_LOG_DIR": str(script.parent / "logs"), **(env or {})}
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(script), "forever"], cwd=script.parent,
                                env=environ, stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + bound(60)
    while out.read_text().count("stepped") < 2:
        assert time.monotonic() < deadline, out.read_text()
        assert proc.poll() is None, out.read_text()
        time.sleep(0.1)
    return proc, out


def test_ctrl_c_ends_every_rank_and_the_call_raises_keyboard_interrupt(tmp_path):
    script = copy(tmp_path, TRAIN)
    proc, out = started(script, env={"DDPKIT_GRACE": "2"})
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=bound(30))
    said = out.read_text()
    assert proc.returncode == -signal.SIGINT, said  # as Python ends on Ctrl+C
    assert "ddpkit: the job was stopped" in said
    assert "ranks 0,1 ended on KeyboardInterrupt" in said, said
    assert "KeyboardInterrupt: stopped by SIGINT" in said
    assert not left_of(script)


def test_ddpkit_ps_and_stacks_see_the_spawned_job_its_caller_as_the_launcher(tmp_path):
    script = copy(tmp_path, TRAIN)
    proc, _ = started(script)
    try:
        ps = subprocess.run([sys.executable, "-m", "ddpkit", "ps"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
        table = [line.split() for line in ps.stdout.splitlines()[1:]]
        job = next(row[0] for row in table if row[3] == str(proc.pid))  # the caller's job
        rows = [row for row in table if row[0] == job]
        roles = sorted((row[1], row[2]) for row in rows)
        assert roles == [("launcher", "-"), ("worker", "0"), ("worker", "1")], ps.stdout
        # the ranks' command is the script, not the bootstrap (cut to 80 characters)
        assert f"python {script} (ddpkit.spawn: main)"[:80] in ps.stdout, ps.stdout
        stacks = subprocess.run([sys.executable, "-m", "ddpkit", "stacks", job],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert stacks.returncode == 0, stacks.stderr
        assert re.search(r"rank 1 .* main at train\.py:\d+", stacks.stdout), stacks.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=bound(30))
    assert not left_of(script)


def test_the_caller_sigkilled_leaves_no_rank_behind(tmp_path):
    script = copy(tmp_path, TRAIN)
    proc, _ = started(script)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + bound(10)
    while left_of(script) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left_of(script)


def test_a_call_that_cannot_be_served_is_refused_before_any_rank_starts(tmp_path):
    script = tmp_path / "lambda.py"
    script.write_text("import ddpkit\nddpkit.spawn(lambda rank: None, nprocs=2)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "error: ddpkit.spawn needs a function defined at the top of a script" in out.stderr
    assert "Traceback" not in out.stderr
    unknown = tmp_path / "unknown.py"
    unknown.write_text("import ddpkit\n\ndef main(rank):\n    pass\n\n"
                       "ddpkit.spawn(main, nprocs=2, hang_timout=5)\n")  # fmt: skip
    out = subprocess.run([sys.executable, str(unknown)], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "hang_timout" in out.stderr
    assert "fix: give ddpkit run's options by their flag's name" in out.stderr

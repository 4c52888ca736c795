"""`ddpkit run` as a terminal, a pipe and a shell script see it: ordered output, nothing lost,
closed pipes and full disks, progress bars, Ctrl+C and forwarded signals, __file__, stdin, and
torchrun's command lines. Terminal behaviour is read off a real terminal (tmux)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e import terminal
from tests.e2e.helpers import SCRIPTS, bound, start

pytestmark = pytest.mark.timeout(120)
DDPKIT = [sys.executable, "-m", "ddpkit"]
needs_tmux = pytest.mark.skipif(terminal.available() is not None, reason=str(terminal.available()))


def shell(line: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_output_into_a_pipe_that_closes_ends_the_job_within_seconds(tmp_path):
    py = sys.executable
    began = time.monotonic()
    out = shell(
        f"{py} -m ddpkit run -n 2 --run-id headjob --log-dir logs "
        f"{SCRIPTS / 'chatty.py'} 10000000 | head -3; echo rc=${{PIPESTATUS[0]}} >&2",
        tmp_path,
    )
    assert time.monotonic() - began < bound(30)
    assert len(out.stdout.splitlines()) == 3
    assert "rc=1" in out.stderr, out.stderr
    assert "the console's output was closed" in out.stderr
    assert not [p for p in psutil.process_iter() if _job(p) == "headjob"]


def _job(p: psutil.Process) -> str | None:
    try:
        return p.environ().get("_DDPKIT_JOB")
    except psutil.Error:
        return None


def test_the_end_of_the_output_reaches_a_slow_console_and_the_log(tmp_path):
    job = start(["-n", "2", str(SCRIPTS / "chatty.py"), "5243"], tmp_path)
    time.sleep(3)  # nothing reads the console meanwhile: its pipe fills, the ranks wait
    assert job.finish(60) == 0
    for rank in (0, 1):
        assert job.stdout.count(f"[rank {rank}] ") == 5244  # 5243 lines and "done"
        log = next((tmp_path / "logs").glob(f"*/rank{rank}.log")).read_text()
        assert log.count("\n") == 5244
        assert log.endswith("done\n")


def test_stdout_and_stderr_keep_their_order_in_the_log_and_the_console(tmp_path):
    out = shell(
        f"{sys.executable} -m ddpkit run -n 1 --log-dir logs {SCRIPTS / 'ordered.py'} 2>&1",
        tmp_path,
    )
    expected = [f"{kind} {i}" for i in range(200) for kind in ("out", "err")]
    console = [line.removeprefix("[rank 0] ") for line in out.stdout.splitlines()]
    shown = [line for line in console if re.fullmatch(r"(out|err) \d+", line)]
    assert shown == expected
    assert console.index("last line before the error") < console.index(
        "Traceback (most recent call last):"
    )
    log = next((tmp_path / "logs").glob("*/rank0.log")).read_text().splitlines()
    assert [line for line in log if re.fullmatch(r"(out|err) \d+", line)] == expected
    assert log.index("last line before the error") < log.index("Traceback (most recent call last):")


def test_stderr_still_goes_to_stderr(tmp_path):
    job = start(["-n", "1", str(SCRIPTS / "ordered.py")], tmp_path)
    assert job.finish(60) == 1
    assert "[rank 0] err 5" in job.stderr
    assert "[rank 0] err 5" not in job.stdout
    assert "[rank 0] out 5" in job.stdout
    assert "[rank 0] RuntimeError: the end" in job.stderr


def test_a_line_without_end_costs_linear_time_and_bounded_memory(tmp_path):
    size = 64 * 2**20
    line, took = _launcher_peak(tmp_path / "long", f"sys.stdout.buffer.write(b'y' * {size})", 1)
    # the same launcher printing one short line, for as long; private anonymous memory (the
    # heap), not RSS: the pages of torch's libraries that the launcher touches (it serves the
    # job's store) vary by tens of MiB between runs of the CUDA build
    short, _ = _launcher_peak(tmp_path / "short", "print('y')", took)
    grew = (line - short) / 2**20
    assert grew < 16, f"the launcher held {grew:.0f} MiB more for a 64 MiB line"
    assert next((tmp_path / "long" / "logs").glob("*/rank0.log")).stat().st_size == size


def _launcher_peak(folder: Path, code: str, sleep: float) -> tuple[int, float]:
    """The launcher's largest private anonymous memory (RssAnon) while it runs a rank that
    executes `code` and then sleeps, and how long the job took."""
    folder.mkdir()
    script = folder / "rank.py"
    script.write_text(f"import sys, time\n{code}\ntime.sleep({sleep})\n")
    job = start(["-n", "1", str(script)], folder)
    launcher = psutil.Process(job.proc.pid)
    peak = 0
    began = time.monotonic()
    while job.proc.poll() is None:
        try:
            peak = max(peak, _anonymous_bytes(launcher.pid))
        except (psutil.Error, OSError):
            break
        time.sleep(0.05)
    assert job.finish(60) == 0
    took = time.monotonic() - began
    assert took < bound(30)
    return peak, took


def _anonymous_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    kib = next((line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:")), 0)
    return int(kib) * 1024


def test_a_full_log_disk_warns_once_and_the_console_goes_on(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = subprocess.run(
            [*DDPKIT, "run", "-n", "1", "--log-dir", str(disk), str(SCRIPTS / "chatty.py"), "5000"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("[rank 0] ") == 5001, "every line reached the console"
        assert out.stderr.count("log cannot be written (") == 1
        assert "No space left on device" in out.stderr
    finally:
        subprocess.run(["umount", str(disk)])


def test_the_demo_trains_to_its_accuracy_with_one_clean_line_per_epoch_in_a_terminal(tmp_path):
    # on CPU ranks wherever it runs; in a real terminal where tmux is installed (CI), else
    # through pipes, where only the training and its report are checked
    demo = ["env", "CUDA_VISIBLE_DEVICES=", *DDPKIT, "demo", "--epochs", "3"]
    demo += ["--log-dir", str(tmp_path)]
    in_terminal = terminal.available() is None
    if in_terminal:
        term = terminal.Terminal(demo, tmp_path)
        try:
            assert term.exit_code(150) == 0, term.screen()
            screen = term.screen()
        finally:
            term.close()
    else:
        out = subprocess.run(demo, capture_output=True, text=True, timeout=150, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        screen = out.stdout + out.stderr
    assert "digits: 1437 train / 360 held-out images, 2 rank(s), backend gloo" in screen
    assert re.search(r"ddpkit demo: the script is \S+/ddpkit/examples/digits\.py", screen)
    accuracy = float(screen.split("held-out accuracy: ")[1].split()[0])
    assert accuracy > 0.85, screen
    assert "summary: 2 rank(s), backend gloo" in screen
    assert "samples/s" in screen
    assert "straggler" not in screen, "an even job: no verdict"
    assert "step times per rank" in screen, "each rank's steps, timed with no code change"
    if not in_terminal:
        return
    lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
    for epoch in range(3):
        mine = [line for line in lines if f"epoch {epoch}: train loss" in line]
        assert len(mine) == 1, screen
        assert re.fullmatch(rf"\[rank 0\] epoch {epoch}: train loss \d\.\d+", mine[0]), mine
    assert not [line for line in lines if line.count("[rank") > 1], screen
    assert not [line for line in lines if line in ("[rank 0]", "[rank 1]")], screen


def test_tqdm_write_lands_on_its_own_line(tmp_path):
    script = tmp_path / "bar.py"
    script.write_text(
        "import os, time\nfrom tqdm import tqdm\n"
        "if os.environ['RANK'] == '0':\n"
        "    for i in tqdm(range(3), desc='steps'):\n"
        "        tqdm.write(f'note {i}'); time.sleep(0.05)\n"
    )
    out = shell(f"{sys.executable} -m ddpkit run -n 2 {script} 2>&1", tmp_path)
    assert out.returncode == 0
    shown = out.stdout.replace("\r", "\n").splitlines()
    for i in range(3):
        assert f"[rank 0] note {i}" in shown, out.stdout


def test_a_progress_bar_in_a_log_is_a_line_now_and_then_and_its_last_state(tmp_path):
    # issue 21: `ddpkit run ... > train.log` held a line per redraw plus blank erasure lines,
    # or one run-on line of carriage-return segments
    script = tmp_path / "bars.py"
    script.write_text(
        "import os, time\nfrom tqdm import tqdm\n"
        "if os.environ['RANK'] == '0':\n"
        "    for i in tqdm(range(16), desc='slow', mininterval=0.05):\n"
        "        time.sleep(0.5)\n"
        "    for epoch in range(3):\n"
        "        for i in tqdm(range(40), desc=f'epoch {epoch}', leave=False):\n"
        "            time.sleep(0.01)\n"
        "        print(f'epoch {epoch} done', flush=True)\n"
    )
    out = shell(f"{sys.executable} -m ddpkit run -n 2 {script} > train.log 2>&1", tmp_path)
    assert out.returncode == 0
    log = (tmp_path / "train.log").read_bytes().decode()
    assert "\r" not in log, "no carriage return reaches a log"
    lines = log.splitlines()
    assert not [line for line in lines if line.strip() in ("[rank 0]", "[rank 1]")], log
    assert not [line for line in lines if line.count("[rank") > 1], log
    slow = [line for line in lines if line.startswith("[rank 0] slow:")]
    assert slow[0].startswith("[rank 0] slow:   0%"), log
    assert "16/16" in slow[-1], "the bar's last state is kept"
    # 8 s: a middle state comes between 5 and 7.5 s even when the first one was read late
    assert 3 <= len(slow) <= 5, f"a state every {5} s of an 8 s bar, not every redraw:\n{log}"
    for epoch in range(3):
        epoch_lines = [line for line in lines if line.startswith(f"[rank 0] epoch {epoch}:")]
        assert 1 <= len(epoch_lines) <= 2, log
        assert f"[rank 0] epoch {epoch} done" in lines


def test_ctrl_c_runs_every_ranks_except_keyboardinterrupt_and_finally(tmp_path):
    job = start(["-n", "2", "--grace", "10", str(SCRIPTS / "saves_on_ctrl_c.py"), str(tmp_path)],
                tmp_path)  # fmt: skip
    job.wait_for("[rank 0] training")
    job.wait_for("[rank 1] training")
    job.proc.send_signal(signal.SIGINT)
    assert job.finish(30) == 130
    for rank in (0, 1):
        assert (tmp_path / f"saved-{rank}").exists()
        assert (tmp_path / f"finally-{rank}").exists()
    assert "the job was stopped" in job.stderr
    assert "the job failed" not in job.stderr
    assert not job.survivors()


# SIGUSR1 as well, end to end: the SLURM pre-emption test (scancel --signal=USR1 reaches every
# rank through srun and the launcher), tests/multinode/test_slurm.py
@pytest.mark.parametrize("name", ["SIGHUP", "SIGUSR2", "SIGQUIT"])
def test_signals_are_forwarded_to_every_rank(tmp_path, name):
    job = start(["-n", "2", str(SCRIPTS / "on_signal.py"), str(tmp_path), name], tmp_path)
    job.wait_for("[rank 0] ready")
    job.wait_for("[rank 1] ready")
    sig = getattr(signal, name)
    job.proc.send_signal(sig)
    assert job.finish(30) == 128 + sig
    assert (tmp_path / f"{name}-0").exists()
    assert (tmp_path / f"{name}-1").exists()
    assert not job.survivors()


def test_the_stack_dump_never_fires_the_scripts_own_sigusr1_handler(tmp_path):
    job = start(["-n", "2", "--hang-timeout", "3", "--grace", "1", str(SCRIPTS / "on_signal.py"),
                 str(tmp_path), "SIGUSR1", "hang"], tmp_path)  # fmt: skip
    assert job.finish(60) == 124
    assert not list(tmp_path.glob("SIGUSR1-*")), "ddpkit's stack request reached the handler"
    assert "rank 0 waits in all_reduce (on_signal.py:" in job.stderr
    assert "rank 1 is elsewhere" in job.stderr


def test_file_is_absolute_and_argv0_is_as_given(tmp_path):
    (tmp_path / "data.txt").write_text("42")
    (tmp_path / "next_to_file.py").write_text((SCRIPTS / "next_to_file.py").read_text())
    job = start(["-n", "1", "next_to_file.py", "fail"], tmp_path)
    assert job.finish(30) == 1
    assert "[rank 0] read 42 argv0=next_to_file.py abs=True" in job.stdout
    assert f'File "{tmp_path / "next_to_file.py"}", line' in job.stderr


def test_stdin_reaches_the_rank_that_asks(tmp_path):
    out = shell(
        f"echo Ada | {sys.executable} -m ddpkit run -n 2 --stdin 0 {SCRIPTS / 'reads_stdin.py'}",
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "[rank 0] your name? hello Ada" in out.stdout
    assert "[rank 1] rank 1 has no stdin" in out.stdout


@needs_tmux
def test_a_rank_at_a_breakpoint_answers_in_a_terminal_and_is_never_called_hung(tmp_path):
    # rank 1 (not the terminal's default rank) at its prompt for longer than --hang-timeout:
    # said once, on a line of its own, the prompt shown again; the job is left alone
    command = [*DDPKIT, "run", "-n", "2", "--stdin", "1", "--hang-timeout", "3",
               str(SCRIPTS / "debugs.py")]  # fmt: skip
    term = terminal.Terminal(command, tmp_path)
    try:
        term.wait_for("(Pdb)")
        screen = term.wait_for("rank 1 is at a prompt (a debugger's or input()): not a hang", 30)
        time.sleep(4)  # past another hang timeout
        screen = term.screen()
        assert "\nddpkit: rank 1 is at a prompt" in screen, "on a line of its own"
        assert screen.rstrip().endswith("[rank 1] (Pdb)"), "the prompt, shown again"
        assert "hung" not in screen
        assert screen.count("is at a prompt (a debugger") == 1
        term.keys("p x * 7", "Enter")
        term.wait_for("[rank 1] tensor([42.])")
        deadline = time.monotonic() + 10
        while term.screen().count("(Pdb)") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # the next prompt, before typing the next command
        term.keys("c", "Enter")
        assert term.exit_code(60) == 0
        assert "[rank 0] after 42.0" in term.screen()
    finally:
        term.close()


@needs_tmux
def test_a_rank_waiting_in_input_for_a_person_is_never_called_hung(tmp_path):
    # rank 0 asks for a name and the person takes longer than --hang-timeout to answer
    command = [*DDPKIT, "run", "-n", "2", "--hang-timeout", "3", str(SCRIPTS / "reads_stdin.py")]
    term = terminal.Terminal(command, tmp_path)
    try:
        term.wait_for("your name?")
        term.wait_for("rank 0 is at a prompt (a debugger's or input()): not a hang", 30)
        time.sleep(4)  # past another hang timeout
        assert "hung" not in term.screen()
        term.keys("Ada", "Enter")
        term.wait_for("[rank 0] hello Ada")
    finally:
        term.close()


def test_a_breakpoint_on_a_rank_without_the_terminal_says_how_to_give_it_one(tmp_path):
    job = start(["-n", "2", "--grace", "1", str(SCRIPTS / "debugs.py")], tmp_path)
    assert job.finish(60) == 1
    assert "root cause: rank 1 exited with code 1 (BdbQuit" in job.stderr
    assert "rerun with --stdin 1 to debug rank 1 at its prompt" in job.stderr
    assert not job.survivors()


def test_a_hand_written_child_doing_io_is_progress_not_a_hang(tmp_path):
    job = start(["-n", "2", "--hang-timeout", "4", str(SCRIPTS / "downloading.py"), "12",
                 str(tmp_path)], tmp_path)  # fmt: skip
    assert job.finish(60) == 0, job.stderr
    assert job.stdout.count("finished") == 2
    assert re.search(r"rank 0 has done no collective for \d+ s but its process tree "
                     r"read/wrote \d+ MB: not a hang", job.stderr), job.stderr  # fmt: skip


def test_every_hang_verdict_says_how_to_raise_the_timeout(tmp_path):
    job = start(["-n", "2", "--hang-timeout", "3", "--grace", "1", str(SCRIPTS / "hangs.py"),
                 "sleep"], tmp_path)  # fmt: skip
    assert job.finish(60) == 124
    assert "raise --hang-timeout (now 3 s); --hang-timeout 0 turns the watch off" in job.stderr


def test_torchs_own_rank_prefix_is_not_doubled(tmp_path):
    job = start(["-n", "2", "--grace", "1", str(SCRIPTS / "raises.py")], tmp_path)
    job.finish(60)
    assert "[rank1]:" not in job.stdout + job.stderr
    assert "[rank 1] ValueError: planted failure in rank 1" in job.stderr


def test_the_launcher_does_not_put_itself_on_the_workers_pythonpath(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [*DDPKIT, "run", "-n", "1", str(SCRIPTS / "env_dump.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "PYTHONPATH" not in json.loads((tmp_path / "env-0.json").read_text())


def test_torchs_record_decorator_writes_its_error_file(tmp_path):
    job = start(["-n", "1", str(SCRIPTS / "records.py")], tmp_path)
    assert job.finish(60) == 1
    error_file = job.log_dir / job.run_id / "state0" / "rank0.torch-error.json"
    assert "recorded failure" in error_file.read_text()
    assert "root cause: rank 0 exited with code 1 (ValueError: recorded failure)" in job.stderr


TORCHRUN_README_LINES = [
    # pytorch/examples, distributed/ddp-tutorial-series: README
    "--standalone --nproc_per_node=2 {multigpu} 2 1",
    # nanoGPT: README, "Reproducing GPT-2", with a config of our own
    "--standalone --nproc_per_node=2 train.py config/train_tiny.py",
    # torchrun's own docs: a single-node job with options
    "--nnodes=1 --nproc-per-node=2 --max-restarts=0 --rdzv-backend=c10d --rdzv-id=job7 "
    "--monitor-interval=0.1 --redirects=0 --tee=3 --role=trainer --start-method=spawn "
    "{multigpu} 1 1",
]


@pytest.mark.parametrize("line", TORCHRUN_README_LINES)
def test_torchrun_command_lines_from_readmes_run_unchanged(tmp_path, line):
    (tmp_path / "config").mkdir()
    for name in ("train.py", "configurator.py", "config/train_tiny.py"):
        (tmp_path / name).write_text((SCRIPTS / "nanogpt" / name).read_text())
    multigpu = Path(__file__).parents[1] / "multinode" / "scripts" / "multinode.py"
    words = line.format(multigpu=multigpu).split()
    out = subprocess.run(
        [*DDPKIT, "run", *words], capture_output=True, text=True, timeout=100, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "iter 0: loss" in out.stdout or "] done" in out.stdout


def test_use_local_rank_arg_passes_it_as_torch_distributed_launch_did(tmp_path):
    job = start(["-n", "2", "--use-local-rank-arg", str(SCRIPTS / "launch_style.py"),
                 "--epochs", "3"], tmp_path)  # fmt: skip
    assert job.finish(60) == 0
    assert "[rank 1] local_rank=1 epochs=3" in job.stdout
    assert "[rank 0] local_rank=0 epochs=3" in job.stdout


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--numa-binding", "node"], "torchrun's --numa-binding has no ddpkit equivalent"),
        (["--rdzv-backend", "etcd"], "ddpkit meets through torch elastic's c10d rendezvous"),
        (["--redirects", "9"], "--redirects '9' is not 0-3"),
        (["--frobnicate"], "ddpkit run does not know --frobnicate"),
    ],
)
def test_torchrun_flags_without_a_ddpkit_feature_say_what_to_do(tmp_path, flags, says):
    out = subprocess.run(
        [*DDPKIT, "run", *flags, str(SCRIPTS / "world.py")],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2
    assert says in out.stderr
    assert "fix:" in out.stderr


def test_redirects_keep_a_ranks_output_in_its_log_only(tmp_path):
    job = start(["-n", "2", "--redirects", "1:3", str(SCRIPTS / "world.py")], tmp_path)
    assert job.finish(60) == 0
    assert "[rank 0] rank 0 of 2" in job.stdout
    assert "[rank 1]" not in job.stdout
    assert "rank 1 of 2" in next((tmp_path / "logs").glob("*/rank1.log")).read_text()

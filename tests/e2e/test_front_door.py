"""The front door: the classic guide's habits, tried as its reader tries them. A rank started by
hand without its peers says within a second what it waits for, ends on Ctrl+C at once in
ddpkit's words (a real terminal), and keeps the stated timeout."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e import terminal
from tests.e2e.helpers import SCRIPTS, bound, start

pytestmark = pytest.mark.timeout(200)
BY_HAND = str(SCRIPTS / "joins_by_hand.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def called_setup_at(screen: str) -> float:
    found = re.search(r"calling setup at (\d+\.\d+)", screen)
    assert found, screen
    return float(found.group(1))


@pytest.mark.skipif(terminal.available() is not None, reason=str(terminal.available()))
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_started_by_hand_says_what_it_waits_for_and_ctrl_c_ends_it_at_once(tmp_path, rank):
    port = free_port()
    command = [
        "env",
        f"RANK={rank}",
        "WORLD_SIZE=2",
        f"MASTER_PORT={port}",
        sys.executable,
        BY_HAND,
    ]
    term = terminal.Terminal(command, tmp_path)
    try:
        screen = term.wait_for("Ctrl+C stops it", bound(30))
        said_after = time.time() - called_setup_at(screen)
        assert said_after < bound(2), f"said {said_after:.1f} s after setup() was called"
        if rank == 1:
            assert f"rank 1 of 2 waits for rank 0 to listen at 127.0.0.1:{port}" in screen
        else:
            assert f"rank 0 of 2 listens on 127.0.0.1:{port} and waits for rank 1" in screen
        assert "RANK and WORLD_SIZE set by hand" in screen
        assert "it waits up to 300 s" in screen
        pressed = time.monotonic()
        term.keys("C-c")
        code = term.exit_code(bound(10))
        took = time.monotonic() - pressed
        screen = term.screen()
    finally:
        term.close()
    assert took < bound(1.5), f"Ctrl+C took {took:.1f} s"
    assert code == 130, screen
    assert "error: interrupted at setup()" in screen
    assert "fix: start every rank at once with a launcher: `ddpkit run -n 2" in screen
    assert "Traceback" not in screen, "ddpkit's words, no traceback"
    assert "TCP client" not in screen, "none of torch's C++ lines"
    assert "frame #" not in screen


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_started_by_hand_keeps_the_stated_init_timeout(tmp_path, rank):
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "DDPKIT_INIT_TIMEOUT": "4",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    # the wait's end is when its error is said (the process's own exit after it is not the
    # wait: on a loaded machine it took seconds more)
    proc = subprocess.Popen([sys.executable, BY_HAND], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)  # fmt: skip
    assert proc.stderr is not None
    said_at, lines = 0.0, []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("error:") and not said_at:
            said_at = time.time()
    stdout = proc.stdout.read() if proc.stdout is not None else ""
    assert proc.wait(bound(60)) == 1, "".join(lines)
    out = subprocess.CompletedProcess(proc.args, 1, stdout, "".join(lines))
    took = said_at - called_setup_at(out.stdout)
    assert 4 <= took < 4 + bound(2), f"4 s asked, {took:.1f} s taken"
    if rank == 1:
        assert "error: rank 1 could not reach rank 0 at 127.0.0.1" in out.stderr
    else:
        assert "error: 1 of 2 ranks arrived at init within 4 s; missing: rank 1" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "frame #" not in out.stderr, out.stderr


GUIDE = SCRIPTS / "guide" / "train.py"


def ddpkit_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddpkit", *args]


def apply_fixes(lines: list[str], fixes: list[tuple[int, str]]) -> list[str]:
    """Do what the fix lines' code says, as their reader does: a statement replaces its line, a
    keyword the same keyword, an assignment the same name's; a name that is new is assigned
    first thing in main()."""
    new_names = []
    for where, code in sorted(fixes, reverse=True):
        line = lines[where - 1]
        indent = line[: len(line) - len(line.lstrip())]
        keyword = re.match(r"(\w+)=[^=]", code)
        assigned = re.match(r"(\w+) = ", code)
        if code.startswith("if "):
            lines[where - 1] = indent + code
        elif keyword:
            given = rf"{keyword.group(1)}=(\[[^\]]*\]|\"[^\"]*\"|'[^']*')"
            lines[where - 1] = re.sub(given, code, line)
        elif assigned and re.match(rf"\s*{assigned.group(1)} = ", line):
            lines[where - 1] = indent + code
        elif assigned:
            new_names.append(code)
    first = next(i for i, x in enumerate(lines) if x.startswith("def main"))
    return lines[: first + 1] + ["    " + code for code in new_names] + lines[first + 1 :]


def test_the_guides_script_without_a_gpu_runs_after_the_doctors_fixes_in_one_round(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(GUIDE.read_text())
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    doctor = subprocess.run(ddpkit_command("doctor", "--json", "--no-smoke", "train.py"),
                            env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=bound(120))  # fmt: skip
    assert doctor.returncode == 1, doctor.stderr
    found = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "script"]
    named = sorted(int(f["where"].split(":")[1]) for f in found if f["level"] == "error")
    # set_device(rank % num_gpus), nccl, device = 'cuda', device_ids=[rank]: every line that
    # fails on this machine, before any of them has failed
    assert named == [16, 17, 18, 21], json.dumps(found, indent=1)
    fixes = [(int(f["where"].split(":")[1]), code) for f in found
             for code in re.findall(r"`([^`]+)`", f["fix"])]  # fmt: skip
    script.write_text("\n".join(apply_fixes(script.read_text().splitlines(), fixes)) + "\n")
    again = subprocess.run(ddpkit_command("doctor", "--no-smoke", "train.py"), env=env,
                           cwd=tmp_path, capture_output=True, text=True,
                           timeout=bound(120))  # fmt: skip
    assert "ERROR" not in again.stdout, script.read_text() + again.stdout
    run = subprocess.run(
        ddpkit_command("run", "--nproc_per_node=2", "--master_port=1010", "train.py"),
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=bound(120),
    )  # fmt: skip
    assert run.returncode == 0, script.read_text() + run.stdout + run.stderr
    assert "saved model.pt" in run.stdout
    assert (tmp_path / "model.pt").exists()


def test_a_plain_dataloader_that_every_rank_iterates_whole_is_said_once_with_the_fix(tmp_path):
    job = start(["-n", "2", str(SCRIPTS / "forgets_the_sampler.py")], tmp_path)
    assert job.finish(bound(90)) == 0, job.stderr
    said = [line for line in job.stderr.splitlines() if "iterates the whole data set" in line]
    assert len(said) == 1, job.stderr
    assert "the DataLoader iterated at forgets_the_sampler.py:22 (RandomSampler over 96" in said[0]
    assert "each rank iterates all 24 batches where its share is about 12" in said[0]
    assert "use s.loader(dataset, batch_size=...)" in said[0]
    assert "sampler=DistributedSampler(dataset)" in said[0]
    assert not job.survivors()


def test_s_loader_and_an_evaluation_on_rank_0_alone_are_not_called_unsharded(tmp_path):
    job = start(["-n", "2", str(SCRIPTS / "forgets_the_sampler.py"), "--fixed"], tmp_path)
    assert job.finish(bound(90)) == 0, job.stderr
    assert "epoch 1: 24 steps" in job.stdout, "s.loader: 12 steps an epoch on each of 2 ranks"
    assert "iterates the whole data set" not in job.stderr


TUTORIAL = SCRIPTS / "tutorial" / "multigpu.py"


def test_the_tutorials_mp_spawn_under_ddpkit_run_is_named_a_double_launch_and_both_ways_out_work(
    tmp_path,
):
    job = start(["-n", "2", str(TUTORIAL), "2", "1"], tmp_path)
    assert job.finish(bound(90)) == 1, job.stderr
    assert re.search(r"root cause: rank [01] exited with code 1 \(DoubleLaunchError: "
                     r"mp\.spawn\(main, nprocs=2\) at multigpu\.py:\d+ starts ranks of its own",
                     job.stderr), job.stderr  # fmt: skip
    assert "EADDRINUSE" not in job.stderr
    assert "ddpkit kill" not in job.stderr, "never: kill the job being reported"
    fix = re.search(r"fix: (.*)", job.stderr).group(1)
    assert "`python multigpu.py ...` (mp.spawn starts the ranks)" in fix
    assert not job.survivors()
    # way out 1: the script as it is, mp.spawn its launcher
    alone = subprocess.run([sys.executable, str(TUTORIAL), "2", "1"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=bound(90))  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    assert "[GPU1] Epoch 1 | Steps: 4" in alone.stdout
    # way out 2: ddpkit run starts the ranks; the fix's call replaces mp.spawn
    call = re.search(r"`(main\(int\(os\.environ\['LOCAL_RANK'\]\), "
                     r"int\(os\.environ\['WORLD_SIZE'\]\)), \.\.\.\)`", fix)  # fmt: skip
    assert call, fix
    source = TUTORIAL.read_text()
    spawned = re.search(
        r"mp\.spawn\(\s*main,\s*args=\(world_size, (args\..*?)\),\s*nprocs=world_size,?\s*\)",
        source,
        re.S,
    )
    edited = tmp_path / "multigpu.py"
    edited.write_text(source.replace(spawned.group(0), f"{call.group(1)}, {spawned.group(1)})"))
    job = start(["-n", "2", str(edited), "2", "1"], tmp_path)
    assert job.finish(bound(90)) == 0, edited.read_text() + job.stderr
    assert "[rank 1] [GPU1] Epoch 1 | Steps: 4" in job.stdout
    assert "MASTER_PORT" in job.stderr, "the script's own port replaced, and said"


@pytest.mark.skipif(terminal.available() is not None, reason=str(terminal.available()))
def test_after_ctrl_c_the_summary_is_what_a_person_reads_not_every_ranks_traceback(tmp_path):
    command = [sys.executable, "-m", "ddpkit", "run", "--log-dir", str(tmp_path), "-n", "3",
               str(SCRIPTS / "reduces_forever.py")]  # fmt: skip
    term = terminal.Terminal(command, tmp_path)
    try:
        for rank in range(3):
            term.wait_for(f"[rank {rank}] training", bound(60))
        time.sleep(1)
        term.keys("C-c")
        code = term.exit_code(bound(30))
        screen = term.screen()
    finally:
        term.close()
    after = screen.split("[rank 2] training")[-1].split("[rank 0] training")[-1]
    after = after[after.index("ddpkit: the job was stopped") :] if "ddpkit:" in after else after
    assert code == 130, screen
    assert "Traceback" not in screen, "each rank's traceback is in its log"
    assert "GLHF" not in screen
    assert "root cause: stopped by SIGINT, forwarded to every rank: ranks 0-2 ended on " in after
    assert "KeyboardInterrupt, as a script does on Ctrl+C (traceback in their logs)" in after
    logs = [p for p in tmp_path.glob("*/rank*.log") if p.parent.name != "latest"]
    assert len(logs) == 3
    assert all("KeyboardInterrupt" in log.read_text() for log in logs), "kept in the logs"


def test_a_rank_that_raises_is_shown_once_and_its_victims_are_named_victims(tmp_path):
    job = start(["-n", "3", str(SCRIPTS / "raises.py")], tmp_path)
    assert job.finish(bound(60)) == 1, job.stderr
    assert job.stderr.count("ValueError: planted failure in rank 1") == 2, job.stderr  # + cause
    assert job.stderr.count("Traceback (most recent call last)") == 1, job.stderr
    assert "root cause: rank 1 exited with code 1 (ValueError: planted failure in rank 1)" in (
        job.stderr
    )
    assert "other ranks: 0,2 lost the connection when rank 1 failed (victim, not cause)" in (
        job.stderr
    ), job.stderr
    assert "failed the same way" not in job.stderr


def test_model_module_at_world_size_one_ends_with_the_fix_line_run_without_ddpkit_run(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPTS / "module_habit.py")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=bound(60))  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "AttributeError: 'Sequential' object has no attribute 'module'" in out.stderr
    last = out.stderr.rstrip().splitlines()[-1].removeprefix("[rank0]: ")  # torch's own prefix
    assert last.startswith("ddpkit: fix: `model.module` is DDP's: with one process s.wrap"), last
    assert "use ddpkit.unwrap(model)" in out.stderr


@pytest.mark.skipif(terminal.available() is not None, reason=str(terminal.available()))
def test_a_persons_second_ctrl_c_in_a_terminal_kills_at_once_and_the_report_says_so(tmp_path):
    command = [sys.executable, "-m", "ddpkit", "run", "--log-dir", str(tmp_path), "-n", "2",
               "--grace", "60", str(SCRIPTS / "ignore_all.py")]  # fmt: skip
    term = terminal.Terminal(command, tmp_path)
    try:
        term.wait_for("[rank 0] ready", bound(60))
        term.wait_for("[rank 1] ready", bound(60))
        term.keys("C-c")
        time.sleep(0.6)  # a person's second press, not an echo of the first
        pressed = time.monotonic()
        term.keys("C-c")
        code = term.exit_code(bound(30))
        took = time.monotonic() - pressed
        screen = term.screen()
    finally:
        term.close()
    assert took < bound(5), f"{took:.1f} s with a 60 s grace"
    assert code == 130, screen
    assert "ranks 0,1 killed at once on a second Ctrl+C" in screen

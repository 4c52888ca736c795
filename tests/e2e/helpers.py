"""Start `ddpkit run` as a user would (its own session, real signals), read its output as it
comes, and find any process of the job that survived."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from ddpkit.common.procs import is_alive, processes_of_job

SCRIPTS = Path(__file__).parent / "scripts"
# every wall-clock bound in the tests is scaled by this (a slower machine: DDPKIT_TEST_SLOW=2)
SLOW = float(os.environ.get("DDPKIT_TEST_SLOW", "1"))


def bound(seconds: float) -> float:
    """A time limit a test asserts, scaled for the machine it runs on."""
    return seconds * SLOW


@dataclass
class Job:
    proc: subprocess.Popen
    run_id: str
    log_dir: Path
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.out + self.err):
                return
            if self.proc.poll() is not None:
                time.sleep(0.2)
                if any(text in line for line in self.out + self.err):
                    return
                raise AssertionError(
                    f"ddpkit run exited ({self.proc.returncode}) before "
                    f"{text!r}:\n{self.stdout}\n{self.stderr}"
                )
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout} s:\n{self.stdout}\n{self.stderr}")

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"ddpkit run still running after {timeout} s:\n{self.stdout}\n{self.stderr}"
            ) from None
        finally:
            time.sleep(0.1)  # let the reader threads take the last lines

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def survivors(self, extra_pids: list[int] = ()) -> list[psutil.Process]:
        left = [p for p in processes_of_job(self.run_id) if is_alive(p)]
        for pid in extra_pids:
            try:
                p = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
            if is_alive(p) and p.pid not in {q.pid for q in left}:
                left.append(p)
        return left


def _read(pipe, sink: list[str]) -> None:
    for line in iter(pipe.readline, ""):
        sink.append(line)
    pipe.close()


def start(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    command: str = "run",
    run_id: str | None = None,
    cgroup: Path | None = None,
    wrapper: list[str] = (),
) -> Job:
    """`cgroup`: the launcher starts inside it, as a pod's or a SLURM job's does. `wrapper`: a
    command the launcher runs under, as a job script writes it (`timeout 3600 ddpkit run ...`):
    the Job's process is then the wrapper's."""
    run_id = run_id or "t" + uuid.uuid4().hex[:8]
    log_dir = cwd / "logs"
    extra = (
        ["--run-id", run_id, "--log-dir", str(log_dir)]
        if command == "run"
        else ["--log-dir", str(log_dir)]
    )
    cmd = [*wrapper, sys.executable, "-m", "ddpkit", command, *extra, *args]
    if cgroup is not None:
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
    environment = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    job = Job(proc, run_id, log_dir)
    for pipe, sink in ((proc.stdout, job.out), (proc.stderr, job.err)):
        threading.Thread(target=_read, args=(pipe, sink), daemon=True).start()
    return job


@contextlib.contextmanager
def memory_limited_cgroup(limit: int) -> Iterator[Path]:
    """A memory cgroup of `limit` bytes for the test's job, removed once its processes are gone;
    the test is skipped where none can be made."""
    cgroup = memory_cgroup_for_test()
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here (needs root and the memory controller)")
    try:
        limit_memory(cgroup, limit)
        yield cgroup
    finally:
        remove_cgroup(cgroup)


def memory_cgroup_for_test() -> Path | None:
    """A child of this process's memory cgroup, where one can be made (root, cgroup v1 or v2
    with the memory controller), else None."""
    from ddpkit.common.host_memory import memory_cgroup

    parent = memory_cgroup()
    if parent is None or os.geteuid() != 0:
        return None
    child = parent / f"ddpkit-test-{uuid.uuid4().hex[:6]}"
    try:
        child.mkdir()
    except OSError:
        return None
    return child


def limit_memory(cgroup: Path, limit: int) -> None:
    for name in ("memory.max", "memory.limit_in_bytes"):  # cgroup v2, v1
        if (cgroup / name).exists():
            (cgroup / name).write_text(str(limit))
            return


def remove_cgroup(cgroup: Path) -> None:
    """Once its processes are gone (the kernel takes a moment to empty it)."""
    for _ in range(50):
        try:
            cgroup.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def gone_within(job: Job, timeout: float, extra_pids: list[int] = ()) -> float:
    """Seconds until the launcher and every process of its job are gone (fails past timeout)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if job.proc.poll() is not None and not job.survivors(extra_pids):
            return time.monotonic() - started
        time.sleep(0.05)
    left = job.survivors(extra_pids)
    for p in left:
        p.kill()
    if job.proc.poll() is None:
        job.proc.kill()
    raise AssertionError(
        f"still alive after {timeout} s: launcher="
        f"{job.proc.poll() is None}, {[(p.pid, p.name()) for p in left]}"
    )

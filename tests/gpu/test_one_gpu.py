"""On a machine with a GPU (the lent H200): setup, the example, the demo and the launcher's
guarantees with NCCL ranks. Run with `python -m pytest -m gpu tests/gpu`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import SCRIPTS, gone_within, start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NCCL_LOOP = """import os, time, torch, torch.distributed as dist
import ddpkit
s = ddpkit.setup()
x = torch.randn(4096, 4096, device=s.device)
print(f"ready backend={s.backend} device={s.device}", flush=True)
step = 0
while True:
    y = x @ x
    dist.all_reduce(y)
    torch.cuda.synchronize()
    step += 1
"""
NCCL_CRASH = """import torch, ddpkit
s = ddpkit.setup()
torch.ones(1, device=s.device)
raise RuntimeError("planted failure on the GPU rank")
"""


def python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env
    )


def gpu_pids() -> set[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    # this test process may hold a GPU itself (in-process tests): only other processes count
    return {int(p) for p in out.split() if p.strip().isdigit()} - {os.getpid()}


def test_setup_alone_uses_nccl_on_the_gpu():
    out = python("import ddpkit\ns = ddpkit.setup()\nprint(s.backend, s.device, s.world_size)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["nccl", "cuda:0", "1"]


def test_wrap_returns_the_model_itself_at_world_size_1_on_the_gpu():
    out = python(
        "import ddpkit, torch\nwith ddpkit.setup() as s:\n"
        "    m = torch.nn.Linear(4, 4)\n    w = s.wrap(m)\n"
        "    print(w is m, next(w.parameters()).device)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "cuda:0"]


def test_the_example_trains_on_one_gpu_with_nccl():
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit.examples.digits", "--epochs", "4"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert "backend nccl, device cuda:0" in out.stdout
    assert float(out.stdout.split("held-out accuracy: ")[1].split()[0]) > 0.9


def test_demo_runs_one_nccl_rank_per_gpu(tmp_path):
    job = start(["--epochs", "3"], tmp_path, command="demo")
    assert job.finish(240) == 0, job.stderr
    assert f"{torch.cuda.device_count()} rank(s), backend nccl" in job.stdout
    print(job.stdout[-600:])


def test_more_ranks_than_gpus_is_refused(tmp_path):
    n = torch.cuda.device_count() + 1
    job = start(["-n", str(n), str(SCRIPTS / "world.py")], tmp_path)
    assert job.finish() == 2
    assert "GPU(s) are visible" in job.stderr


def test_cpu_ranks_run_beside_the_gpu_with_gloo(tmp_path):
    job = start(["-n", "cpu", str(SCRIPTS / "world.py")], tmp_path)
    assert job.finish() == 0
    assert "rank 1 of 2 sum 2" in job.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_stopping_the_launcher_mid_training_frees_the_gpu(tmp_path, sig):
    (tmp_path / "loop.py").write_text(NCCL_LOOP)
    job = start(["-n", "1", "--grace", "3", str(tmp_path / "loop.py")], tmp_path)
    job.wait_for("ready backend=nccl", 240)
    time.sleep(1)
    worker_pids = {p.pid for p in job.survivors()}
    assert worker_pids & gpu_pids(), "the rank should hold the GPU"
    job.proc.send_signal(sig) if sig != signal.SIGKILL else os.kill(job.proc.pid, sig)
    took = gone_within(job, 20)
    time.sleep(1)
    assert not worker_pids & gpu_pids(), "a rank still holds the GPU"
    print(f"{signal.Signals(sig).name}: all gone in {took:.2f} s")


def test_a_failing_gpu_rank_is_reported_with_its_traceback(tmp_path):
    (tmp_path / "crash.py").write_text(NCCL_CRASH)
    job = start(["-n", "1", str(tmp_path / "crash.py")], tmp_path)
    assert job.finish(120) == 1
    assert "root cause: rank 0 exited with code 1 (RuntimeError: planted failure" in job.stderr
    assert not job.survivors()


def test_bench_ddp_says_how_busy_the_gpu_is_and_when_the_host_sets_the_pace(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "bench",
            "ddp",
            "--model",
            "tiny",
            "--gpus",
            "1",
            "--steps",
            "10",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr
    busy = json.loads((tmp_path / "r.json").read_text())["rows"][0]["gpu_busy"]
    print(f"tiny model, 1 GPU: GPU busy {busy:.2f} of the step")
    assert 0 < busy <= 1
    assert busy < 0.9, "a 3-layer MLP at batch 8 cannot keep an H200 busy"
    assert "the host sets the pace" in out.stdout

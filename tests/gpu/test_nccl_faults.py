"""NCCL faults on every visible GPU (2 or more): a stalled rank, a crash mid-training, Ctrl+C
mid-collective. Each is torn down and leaves no process (nvidia-smi shows none of the job's
pids)."""

from __future__ import annotations

import signal
import time

import pytest

from tests.e2e.helpers import gone_within, start
from tests.gpu.test_one_gpu import gpu_pids

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

STALL = """import time, torch, torch.distributed as dist
import ddpkit
s = ddpkit.setup()
def stuck_here():
    time.sleep(600)
x = torch.ones(1 << 20, device=s.device)
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
print("stall", flush=True)
if s.rank == 1:
    stuck_here()
dist.all_reduce(x)
torch.cuda.synchronize()
"""
TRAIN = """import os, time, torch, ddpkit
s = ddpkit.setup(seed=0)
model = s.wrap(torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                   torch.nn.Linear(4096, 1024)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
crash_at = int(os.environ.get("CRASH_AT", "-1"))
step = 0
while True:
    loss = model(torch.randn(64, 1024, device=s.device)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    step += 1
    if step == 20:
        print("training", flush=True)
    if step == crash_at and s.rank == 1:
        raise RuntimeError("planted crash on rank 1")
"""


def test_a_stalled_nccl_rank_is_named_by_the_hang_doctor(tmp_path):
    (tmp_path / "stall.py").write_text(STALL)
    job = start(
        ["-n", "gpu", "--hang-timeout", "6", "--grace", "2", str(tmp_path / "stall.py")], tmp_path
    )
    job.wait_for("stall", 240)
    began = time.monotonic()
    assert job.finish(120) == 124, job.stderr
    took = time.monotonic() - began
    print(job.stderr[-2500:])
    print(f"stall to report: {took:.1f} s")
    assert "rank 1 is elsewhere: stuck_here (stall.py:5)" in job.stderr
    waiting = [r for r in range(GPUS) if r != 1]
    who = f"ranks {','.join(map(str, waiting))} wait" if len(waiting) > 1 else "rank 0 waits"
    assert f"{who} in all_reduce (stall.py:13)" in job.stderr
    assert not job.survivors()


def test_a_rank_crashing_mid_training_on_nccl_stops_the_job(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    job = start(
        ["-n", "gpu", "--grace", "3", str(tmp_path / "train.py")], tmp_path, env={"CRASH_AT": "200"}
    )
    began = time.monotonic()
    assert job.finish(180) == 1, job.stderr
    print(f"crash run: {time.monotonic() - began:.1f} s in all")
    assert (
        "root cause: rank 1 exited with code 1 (RuntimeError: planted crash on rank 1)"
        in job.stderr
    )
    assert not job.survivors()
    time.sleep(1)
    assert not gpu_pids()


def test_ctrl_c_mid_collective_on_nccl_frees_every_gpu(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    job = start(["-n", "gpu", "--grace", "3", str(tmp_path / "train.py")], tmp_path)
    job.wait_for("training", 240)
    job.proc.send_signal(signal.SIGINT)
    took = gone_within(job, 20)
    print(f"Ctrl+C mid-training to all gone: {took:.2f} s")
    assert job.proc.returncode == 130
    time.sleep(1)
    assert not gpu_pids()

"""The NCCL flight recorder through ddpkit (world size 1 proves the plumbing)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.helpers import start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DUMP = """import os, pickle, torch, torch.distributed as dist
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
import ddpkit
from ddpkit.launch.hang import flight_dumps
from ddpkit.rank.flight_answers import dump
s = ddpkit.setup()
for _ in range(3):
    dist.all_reduce(torch.ones(1024, device=s.device))
torch.cuda.synchronize()
d = pickle.loads(dump(backend="nccl"))
print("keys", sorted(d))
print("entries", len(d.get("entries", [])))
for line in flight_dumps.summarize(d):
    print("fr", line)
print("pending", flight_dumps.pending(d))
"""
STALL = """import time, torch, torch.distributed as dist
import ddpkit
s = ddpkit.setup()
for _ in range(3):
    dist.all_reduce(torch.ones(1024, device=s.device))
torch.cuda.synchronize()
print("stall", flush=True)
time.sleep(600)
"""


def test_a_flight_recorder_dump_lists_the_nccl_collectives():
    out = subprocess.run([sys.executable, "-c", DUMP], capture_output=True, text=True, timeout=240)
    print(out.stdout, out.stderr[-2000:])
    assert out.returncode == 0
    assert int(out.stdout.split("entries ")[1].split()[0]) >= 3
    assert "all_reduce completed" in out.stdout
    assert "pending None" in out.stdout


def test_the_hang_verdict_on_an_nccl_rank_shows_its_last_collectives(tmp_path):
    (tmp_path / "stall.py").write_text(STALL)
    job = start(
        ["-n", "1", "--hang-timeout", "4", "--grace", "1", str(tmp_path / "stall.py")], tmp_path
    )
    assert job.finish(120) == 124
    print(job.stderr[-1500:])
    assert "rank 0 is elsewhere: <module> (stall.py:8)" in job.stderr
    assert "flight recorder: #" in job.stderr
    assert "all_reduce completed" in job.stderr
    assert not job.survivors()

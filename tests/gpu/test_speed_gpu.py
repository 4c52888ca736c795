"""The speed doctor on a GPU (issue 22): every step of an NCCL rank timed with CUDA events, the
GPU's NVML facts in `ddpkit top --once --json`, NCCL's transport line for one GPU, the end of
job summary, and a graphed step (s.graph) marking its own steps. Every visible GPU is used."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

TRAIN = """import sys, time, torch
from torch import nn
import ddpkit
seconds = float(sys.argv[1])
with ddpkit.setup(seed=0) as s:
    model = s.wrap(nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(256, 4096, device=s.device)
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        with s.autocast():
            loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    s.print(f"done {loss.item():.4f}")
"""


def test_an_nccl_job_is_timed_shown_in_top_with_nvml_and_summarised(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    job = start(["-n", str(GPUS), str(tmp_path / "train.py"), "25"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        rows: list = []
        while time.monotonic() < deadline:
            out = subprocess.run(
                [sys.executable, "-m", "ddpkit", "top", job.run_id, "--once", "--json"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if out.returncode == 0:
                rows = json.loads(out.stdout)["ranks"]
                if len(rows) == GPUS and all(r["facts"].get("gpu") for r in rows):
                    break
            time.sleep(1)
        print(json.dumps(rows, indent=1)[:3000])
        assert len(rows) == GPUS
        for r in rows:
            gpu = r["facts"]["gpu"]
            for key in ("sm_mhz", "temp_c", "power_w", "util", "mem_used_mib", "mem_total_mib"):
                assert gpu.get(key) is not None, key
            assert r["gpu"].startswith("GPU ")
            assert r["split"]["compute"] > 0.3, "the GPU's own work dominates this step"
    finally:
        assert job.finish(200) == 0, job.stderr
    print(job.stderr[-2500:])
    transport = [x for x in job.stderr.splitlines() if "NCCL transport:" in x]
    assert transport, job.stderr
    if GPUS == 1:
        assert "one rank: no data moves" in transport[0]
    assert "step times per rank" in job.stderr
    assert "straggler:" not in job.stderr, "an even job gets no verdict"
    assert (job.log_dir / job.run_id / "speed.json").exists()
    assert list((job.log_dir / job.run_id).glob("nccl-*.log")), "NCCL's log is in the run folder"
    assert not job.survivors()


GRAPHED = """import torch
from torch import nn
import ddpkit
with ddpkit.setup(seed=0, graphs=True) as s:
    model = s.wrap(nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()
    graphed = s.graph(step, torch.randn(64, 1024, device=s.device), model=model, optimizer=opt)
    for _ in range(300):
        out = graphed(torch.randn(64, 1024, device=s.device))
    s.print(f"done {out.item():.4f}")
"""


def test_graphed_steps_are_timed_and_the_capture_is_not_disturbed(tmp_path):
    (tmp_path / "graphed.py").write_text(GRAPHED)
    job = start(["-n", str(GPUS), str(tmp_path / "graphed.py")], tmp_path)
    assert job.finish(200) == 0, job.stderr
    assert "[rank 0] done" in job.stdout
    from ddpkit.common import protocol

    record = protocol.read_steps(job.log_dir / job.run_id / "state0", 0)
    assert record is not None
    assert record.count >= 300, f"{record.count} steps timed of 300 replays and the warm-up"
    assert record.gpu, "the GPU's UUID is in the record"
    assert not job.survivors()

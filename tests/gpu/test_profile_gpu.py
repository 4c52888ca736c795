"""`ddpkit run --profile-steps` on GPUs (issue 39): every visible GPU a rank, the traces hold
the model's CUDA kernels and, at 2+ GPUs, NCCL's; the breakdown's top ops are GPU time."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.e2e.helpers import start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

TRAIN = """import torch
from torch import nn
import ddpkit
with ddpkit.setup(seed=0) as s:
    model = s.wrap(nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(256, 4096, device=s.device)
    for _ in range(40):
        loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    s.print(f"done {loss.item():.4f}")
"""


def test_profile_steps_on_gpus_records_cuda_and_nccl_kernels(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = start(["-n", "gpu", "--profile-steps", "10-14", str(script)], tmp_path)
    assert job.finish(240) == 0, job.stderr
    assert f"steps 10-14 recorded on {GPUS} rank(s)" in job.stderr, job.stderr
    assert "(GPU time, share of the steps)" in job.stderr
    folder = tmp_path / "logs" / job.run_id / "profile-10-14"
    for rank in range(GPUS):
        with gzip.open(folder / f"rank{rank}.trace.json.gz", "rt") as f:
            kernels = {e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"}
        assert any("gemm" in k.lower() or "sm90" in k.lower() for k in kernels), kernels
        if GPUS > 1:
            assert any(k.lower().startswith("nccl") for k in kernels), kernels
    assert not job.survivors()

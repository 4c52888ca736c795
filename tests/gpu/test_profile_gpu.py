"""`ddpkit run --profile-steps` on GPUs (issue 39): every visible GPU a rank, the traces hold
the model's CUDA kernels and, at 2+ GPUs, NCCL's; the breakdown's top ops are GPU time."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.e2e.helpers import start
from tests.gpu.test_speed_gpu import TRAIN  # trains for argv[1] seconds

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_profile_steps_on_gpus_records_cuda_and_nccl_kernels(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = start(["-n", "gpu", "--profile-steps", "10-14", str(script), "4"], tmp_path)
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

"""`ddpkit.spawn` on the GPU (issue: launching from Python and notebooks): a function defined at
the prompt (no file, as in a notebook's kernel) runs forked on NCCL at world size 1 when the
parent has not touched CUDA; once it has, the call is refused before any rank starts, with the
fix. `python -c` stands in for the kernel (its __main__ has no file either)."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TRAIN = """
import torch, torch.distributed as dist, ddpkit
def train(rank):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    t = torch.ones(1, device="cuda") * 7
    dist.all_reduce(t)
    print("nccl sum", t.item(), flush=True)
    dist.destroy_process_group()
"""


def prompt(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=150, cwd=tmp_path)  # fmt: skip


def test_a_function_from_the_prompt_runs_forked_on_nccl(tmp_path):
    done = prompt(TRAIN + "ddpkit.spawn(train, nprocs=1)\n", tmp_path)
    print(done.stdout[-1500:], done.stderr[-1500:])
    assert done.returncode == 0, done.stderr
    assert "[rank 0] nccl sum 7.0" in done.stdout


def test_cuda_used_in_the_kernel_first_is_refused_before_any_rank_starts(tmp_path):
    done = prompt(TRAIN + "torch.ones(1).cuda()\nddpkit.spawn(train, nprocs=1)\n", tmp_path)
    print(done.stderr[-1500:])
    assert done.returncode == 1
    assert "CUDA is already initialised in it: a forked process cannot use CUDA" in done.stderr
    assert "fix: restart the kernel and call ddpkit.spawn before" in done.stderr
    assert "ddpkit: run " not in done.stderr, "no rank started"

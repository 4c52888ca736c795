"""A rank's summary of its recording (ddpkit.rank.profiling.summarise), from torch's real
profiler in this process: the top ops are ops, not the spans code names around them."""

from __future__ import annotations

import time

import torch
import torch.profiler


def test_a_named_span_with_python_inside_is_not_a_top_op_and_the_matmul_is():
    a = torch.randn(256, 256)
    with torch.profiler.profile() as recorded:
        for _ in range(3):
            # as DDP's forward: a record_function span whose own time is Python, around real ops
            with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
                time.sleep(0.02)
                for _ in range(4):
                    a = torch.tanh(a @ a)
    from ddpkit.rank.profiling import summarise

    top = [name for name, _, _ in summarise(recorded)["top"]]
    assert "DistributedDataParallel.forward" not in top, top
    assert top[0] in ("aten::mm", "aten::matmul", "aten::tanh"), top

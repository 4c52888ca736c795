"""The memory doctor's decisions from plain figures: the out-of-memory verdict and the fixes it
computes (ddpkit.launch.memory), a leak and a peak that stands out (ddpkit.launch.speed.memory).
The same end to end: tests/e2e/test_memory.py; on a GPU: tests/gpu/test_memory_gpu.py."""

from __future__ import annotations

from ddpkit.launch import memory
from ddpkit.launch.speed.memory import MemoryWatch

GIB = 2**30


def gpu_oom(**changes):
    facts = {
        "kind": "cuda", "device": 0, "asked": 2 * GIB, "total": 80 * GIB, "free": 1 * GIB,
        "allocated": 74 * GIB, "reserved": 76 * GIB, "others": 2 * GIB, "params": 6 * GIB,
        "grads": 6 * GIB, "optimizer": 12 * GIB, "batch": 32, "world_size": 4,
    }  # fmt: skip
    return facts | changes


def test_the_verdict_names_the_rank_the_line_the_size_and_where_the_memory_went():
    line, fix = memory.verdict(gpu_oom(), rank=2, site="train.py:42 in step")
    assert line.startswith(
        "rank 2 ran out of GPU memory at train.py:42 in step: asked for 2.00 GiB"
    )
    assert "GPU 0 (80.00 GiB), torch 74.00 GiB allocated (76.00 GiB reserved)" in line
    assert "other processes 2.00 GiB, free 1.00 GiB" in line
    assert "parameters 6.00 GiB, gradients 6.00 GiB, optimizer state 12.00 GiB" in line
    assert "the rest (activations, workspaces) 50.00 GiB" in line


def test_the_fix_is_the_micro_batch_that_fits_and_keeps_the_batch():
    # room for activations: 72 - 24 - 2 = 46 GiB; the step wanted 50 + 2 = 52 GiB at 32
    assert memory.fit_micro_batch(gpu_oom()) == 16
    _, fix = memory.verdict(gpu_oom(), 2, "")
    assert "micro-batches of 16 with s.accumulate(model, every=2) keep the batch of 32" in fix
    assert "s.wrap(model, shard=True) holds parameters, gradients and optimizer state of " in fix
    assert "6.00 GiB per rank at world size 4 instead of 24.00 GiB" in fix


def test_a_batch_whose_activations_fit_nowhere_gets_no_micro_batch():
    assert memory.fit_micro_batch(gpu_oom(params=60 * GIB, rest=0)) is None
    assert memory.fit_micro_batch(gpu_oom(batch=None)) is None


def test_a_process_capped_below_its_gpu_is_judged_by_its_cap():
    # set_per_process_memory_fraction: torch's message says "4.00 GiB allowed"
    from ddpkit.rank.memory import allowed_bytes

    message = "CUDA out of memory. Tried to allocate 512.00 MiB. ... 4.00 GiB allowed; Of the"
    assert allowed_bytes(message, 80 * GIB) == 4 * GIB
    capped = gpu_oom(allowed=40 * GIB, others=0)
    line, _ = memory.verdict(capped, 0, "")
    assert "GPU 0 (80.00 GiB, 40.00 GiB allowed to this process)" in line
    # room: 36 - 24 = 12 GiB for the 52 GiB the step wanted at 32: 4 per micro-batch of 4
    assert memory.fit_micro_batch(capped) == 4


def test_the_host_verdict_speaks_of_the_process_and_the_machine():
    facts = {"kind": "cpu", "asked": 1024 * GIB, "total": 24 * GIB, "free": 20 * GIB,
             "allocated": GIB // 2, "reserved": GIB // 2, "params": 2**20, "grads": 0,
             "optimizer": 0, "batch": 64, "world_size": 3}  # fmt: skip
    line, _ = memory.verdict(facts, 1, "oom.py:12 in <module>")
    assert line.startswith("rank 1 ran out of host memory at oom.py:12 in <module>: asked")
    assert "the host (24.00 GiB), the rank's process 512 MiB, free 20.00 GiB" in line
    assert "the rest (libraries, activations)" in line


def test_a_rank_whose_memory_grows_every_step_is_said_once_with_its_rate():
    watch = MemoryWatch()
    for second in range(40):
        steps = second * 20
        watch.take(0, steps, (GIB, GIB, 2 * GIB), 0)
        watch.take(1, steps, (GIB + steps * 2**20, GIB + steps * 2**20, 4 * GIB), 0)
    assert len(watch.notes) == 1
    assert watch.notes[0].startswith(
        "memory: rank 1's GPU memory (allocated by torch) grows 1.0 MiB a step"
    )


def test_a_steady_rank_and_noise_are_no_leak():
    watch = MemoryWatch()
    for second in range(40):
        wobble = (second % 3) * 8 * 2**20  # allocations that come and go
        watch.take(0, second * 20, (GIB + wobble, GIB + 16 * 2**20, 2 * GIB), 0)
    assert watch.notes == []


def test_a_peak_that_stands_out_is_said_once_and_an_even_job_says_nothing():
    even = MemoryWatch()
    for rank in range(4):
        even.take(rank, 10, (GIB, 3 * GIB, 4 * GIB), 0)
    even.look()
    assert even.notes == []
    uneven = MemoryWatch()
    for rank in range(4):
        uneven.take(rank, 10, (GIB, (6 if rank == 0 else 3) * GIB, 8 * GIB), 0)
    uneven.look()
    uneven.look()
    assert len(uneven.notes) == 1
    assert uneven.notes[0].startswith("memory: rank 0's peak 6.0 GiB stands out (the others 3.0")
    assert "CUDA context" in uneven.notes[0]

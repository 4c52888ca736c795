"""The memory doctor's decisions from plain figures: the out-of-memory verdict and the fixes it
computes (ddpkit.launch.oom_verdict), a leak and a peak that stands out
(ddpkit.launch.speed.memory_growth).
The same end to end: tests/e2e/test_memory.py; on a GPU: tests/gpu/test_memory_gpu.py."""

from __future__ import annotations

from ddpkit.launch import oom_verdict
from ddpkit.launch.speed.memory_growth import MemoryWatch

GIB = 2**30


def gpu_oom(**changes):
    facts = {
        "kind": "cuda", "device": 0, "asked": 2 * GIB, "total": 80 * GIB, "free": 1 * GIB,
        "allocated": 74 * GIB, "reserved": 76 * GIB, "others": 2 * GIB, "params": 6 * GIB,
        "grads": 6 * GIB, "optimizer": 12 * GIB, "batch": 32, "world_size": 4,
    }  # fmt: skip
    return facts | changes


def test_the_verdict_names_the_rank_the_line_the_size_and_where_the_memory_went():
    line, fix = oom_verdict.verdict(gpu_oom(), rank=2, site="train.py:42 in step")
    assert line.startswith("rank 2 ran out of GPU memory at train.py:42 in step: asked for 2 GiB")
    assert "GPU 0 (80 GiB), torch 74 GiB allocated (76 GiB reserved)" in line
    assert "other processes 2 GiB, free 1 GiB" in line
    assert "parameters 6 GiB, gradients 6 GiB, optimizer state 12 GiB" in line
    assert "the rest (activations, workspaces) 50 GiB" in line


def test_sizes_read_as_a_person_reads_them():
    from ddpkit.common.units import size

    assert size(4 * 2**40) == "4 TiB"
    assert size(4096 * GIB) == "4 TiB"
    assert size(int(1.54 * GIB)) == "1.54 GiB"
    assert size(474 * 2**20) == "474 MiB"
    assert size(int(1023.9 * 2**20)) == "1 GiB"
    assert size(300) == "300 bytes"
    assert size(None) == "?"


def test_the_fix_is_the_micro_batch_that_fits_with_what_it_frees():
    # room for activations: 72 - 24 - 2 = 46 GiB; the step wanted 50 + 2 = 52 GiB at 32
    assert oom_verdict.fit_micro_batch(gpu_oom()) == 16
    _, fix = oom_verdict.verdict(gpu_oom(), 2, "")
    assert (
        "micro-batches of 16 instead of 32 free about 26 GiB (1.62 GiB of activations per " in fix
    )
    assert "s.accumulate(model, every=2) keeps the batch of 32 per rank" in fix
    # 6 GiB missing: sharding at 4 ranks frees 18 GiB of the model's 24 GiB, so it is offered
    assert "s.wrap(model, shard=True) frees about 18 GiB per rank" in fix


def test_a_fix_that_cannot_free_what_is_missing_is_not_offered():
    # nanoGPT under a 5.59 GiB cap: 474 MiB of parameters, no gradients or optimizer state yet
    # (the first forward), 4.13 GiB of activations, asked for 1.54 GiB more
    facts = gpu_oom(total=80 * GIB, allowed=int(5.59 * GIB), others=0, asked=int(1.54 * GIB),
                    allocated=int(4.6 * GIB), reserved=int(4.8 * GIB), params=474 * 2**20,
                    grads=0, optimizer=0, grads_expected=474 * 2**20,
                    optimizer_expected=948 * 2**20, batch=48, batch_from="forward",
                    world_size=1, phase="forward", blocks=12, fp32=True)  # fmt: skip
    _, fix = oom_verdict.verdict(facts, 0, "model.py:182 in forward")
    assert "shard=True" not in fix, "the model's 1.85 GiB of state cannot free 3.8 GiB"
    # 5.68 GiB of activations wanted, 3.18 GiB of room after the model's 1.85 GiB at its peak
    assert "micro-batches of 24 instead of 48 free about 2.84 GiB" in fix
    assert "the failing forward's batch of 48" in fix
    assert "activation checkpointing of the model's 12 blocks" in fix
    assert "bf16 autocast" in fix


def test_when_no_single_fix_is_enough_the_verdict_says_what_is_missing():
    # 72 GiB of activations at a batch of 1 in 66 GiB of room: 6 GiB missing, and sharding the
    # model's 4 GiB of state over 4 ranks frees only 3 GiB
    facts = gpu_oom(params=2 * GIB, grads=2 * GIB, optimizer=0, batch=1, world_size=4,
                    fp32=False, blocks=0)  # fmt: skip
    _, fix = oom_verdict.verdict(facts, 0, "")
    assert fix.startswith("no single change frees the 6 GiB missing (72 GiB of activations"), fix
    assert (
        "even all of these together fall short: s.wrap(model, shard=True) frees about 3 GiB" in fix
    )


def test_memory_that_grew_every_step_is_the_root_cause_not_the_last_allocation():
    line, fix = oom_verdict.verdict(
        gpu_oom(),
        1,
        "train.py:40 in step",
        growth="15 MiB a step, from 1 GiB to 5 GiB over 270 steps",
    )
    assert "after its memory grew step after step (15 MiB a step" in line
    assert fix.startswith("find what keeps memory every step")
    assert "shard=True" not in fix
    assert "micro-batches" not in fix


def test_a_request_larger_than_the_whole_device_gets_no_batch_advice():
    facts = {"kind": "cpu", "asked": 9313 * GIB, "total": int(23.5 * GIB),
             "free": 20 * GIB, "allocated": GIB, "reserved": GIB, "params": 2**20,
             "grads": 0, "optimizer": 0, "batch": 64, "world_size": 3,
             "bound": "the machine", "bound_kind": "machine"}  # fmt: skip
    line, fix = oom_verdict.verdict(facts, 1, "oom.py:12 in <module>")
    assert "asked for 9.09 TiB" in line
    assert fix.startswith("one allocation of 9.09 TiB is more than the machine's memory (23.5 GiB)")
    assert "check the size computed at oom.py:12" in fix
    assert "smaller batch" not in fix


def test_the_host_verdict_names_the_limit_that_bounds_the_process():
    facts = {"kind": "cpu", "asked": 2 * GIB, "total": 8 * GIB, "free": GIB // 4,
             "allocated": 7 * GIB, "reserved": 7 * GIB, "params": 2**20, "grads": 0,
             "optimizer": 0, "batch": 64, "world_size": 3,
             "bound": "the address-space limit (RLIMIT_AS: ulimit -v)",
             "bound_kind": "address_space"}  # fmt: skip
    line, _ = oom_verdict.verdict(facts, 1, "oom.py:12 in <module>")
    assert "the host's address-space limit (RLIMIT_AS: ulimit -v) (8 GiB)" in line
    assert "free 256 MiB" in line
    _, fix = oom_verdict.verdict({**facts, "asked": 9 * GIB}, 1, "oom.py:12 in <module>")
    assert "raise the limit (ulimit -v)" in fix


def test_a_batch_whose_activations_fit_nowhere_gets_no_micro_batch():
    assert oom_verdict.fit_micro_batch(gpu_oom(params=60 * GIB, rest=0)) is None
    assert oom_verdict.fit_micro_batch(gpu_oom(batch=None)) is None


def test_a_process_capped_below_its_gpu_is_judged_by_its_cap():
    # set_per_process_memory_fraction: torch's message says "4.00 GiB allowed"
    from ddpkit.rank.oom_facts import allowed_bytes

    message = "CUDA out of memory. Tried to allocate 512.00 MiB. ... 4.00 GiB allowed; Of the"
    assert allowed_bytes(message, 80 * GIB) == 4 * GIB
    capped = gpu_oom(allowed=40 * GIB, others=0)
    line, _ = oom_verdict.verdict(capped, 0, "")
    assert "GPU 0 (80 GiB, 40 GiB allowed to this process)" in line
    # room: 36 - 24 = 12 GiB for the 52 GiB the step wanted at 32: 4 per micro-batch of 4
    assert oom_verdict.fit_micro_batch(capped) == 4


def test_the_host_verdict_speaks_of_the_process_and_the_machine():
    facts = {"kind": "cpu", "asked": 1024 * GIB, "total": 24 * GIB, "free": 20 * GIB,
             "allocated": GIB // 2, "reserved": GIB // 2, "params": 2**20, "grads": 0,
             "optimizer": 0, "batch": 64, "world_size": 3}  # fmt: skip
    line, _ = oom_verdict.verdict(facts, 1, "oom.py:12 in <module>")
    assert line.startswith("rank 1 ran out of host memory at oom.py:12 in <module>: asked")
    assert "the host (24 GiB), the rank's process 512 MiB, free 20 GiB" in line
    assert "the rest (libraries, activations)" in line


def test_a_rank_whose_memory_grows_every_step_is_said_once_with_its_rate():
    watch = MemoryWatch()
    for second in range(40):
        steps = second * 20
        watch.take(0, steps, (GIB, GIB, 2 * GIB), 0)
        watch.take(1, steps, (GIB + steps * 2**20, GIB + steps * 2**20, 4 * GIB), 0)
    assert len(watch.notes) == 1
    assert watch.notes[0].startswith(
        "memory: rank 1's GPU memory (allocated by torch) grows 1 MiB a step"
    )


def test_memory_a_recording_profiler_holds_is_no_leak():
    # `ddpkit profile`: the resident memory grows with every recorded step's events, then
    # stays where the allocator left it
    watch = MemoryWatch()
    rss = GIB
    for second in range(60):
        recording = 10 <= second < 40
        rss += 8 * 2**20 if recording else 0
        watch.take(0, second * 20, None, rss, profiling=recording)
    assert watch.notes == []
    unmarked = MemoryWatch()  # the same samples without the mark: the rule would say a leak
    rss = GIB
    for second in range(60):
        rss += 8 * 2**20 if 10 <= second < 40 else 0
        unmarked.take(0, second * 20, None, rss)
    assert len(unmarked.notes) == 1
    assert "grows" in unmarked.notes[0]


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
    assert uneven.notes[0].startswith("memory: rank 0's peak 6 GiB stands out (the others 3 GiB")
    assert "CUDA context" in uneven.notes[0]


def test_memory_that_grew_at_every_step_read_before_an_oom_is_named_as_growth():
    from types import SimpleNamespace

    from ddpkit.launch import oom_verdict
    from ddpkit.rank import oom_facts, runtime, steps

    timing = runtime.current().part(steps.Timing)

    mib = 2**20
    rising = [(n, (100 + 400 * n) * mib) for n in range(1, 11)]  # 400 MiB more every step
    timing.clock = SimpleNamespace(memory_series=rising)  # type: ignore[assignment]
    grew = oom_facts.growth_before()
    assert grew == [1, 10, 500 * mib, 4100 * mib]
    assert oom_verdict.grew_before({"grew": grew}) == (
        "400 MiB a step, from 500 MiB to 4 GiB over 9 steps"
    )
    level = [(n, 2000 * mib + (n % 2) * mib) for n in range(1, 11)]  # a step's own rise and fall
    timing.clock = SimpleNamespace(memory_series=level)  # type: ignore[assignment]
    assert oom_facts.growth_before() is None
    timing.clock = SimpleNamespace(memory_series=rising[:3])  # type: ignore[assignment]
    assert oom_facts.growth_before() is None, "too few steps to call it growth"

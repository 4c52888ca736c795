"""The memory doctor on a GPU (issue 29's proof, world size 1; more ranks where more GPUs are
lent): a real CUDA out-of-memory under a per-process cap, the verdict's figures against torch's
own (`torch.cuda.memory_stats()` and the model's tensors, printed by the script as it fails);
`--memory-snapshot` leaves the failing rank's allocator history and a plot in the run folder;
s.fit halves a micro-batch that does not fit and its losses equal a run started at the half.

Run with `python -m pytest -m gpu tests/gpu/test_memory_gpu.py` (benchmarks/gpu.sh tests)."""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path

import pytest

from tests.e2e.helpers import start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SCRIPT = str(Path(__file__).parent / "scripts" / "gpu_memory.py")


def gib(n: int) -> str:
    from ddpkit.launch.oom_verdict import gib

    return gib(n)


def run_folder(stderr: str) -> Path:
    return Path(re.search(r"logs in (\S+)", stderr).group(1))


def test_a_real_cuda_oom_is_named_with_torchs_own_figures(tmp_path):
    job = start(["-n", "1", SCRIPT, "oom"], tmp_path)
    assert job.finish(240) == 1, job.stderr
    stats = dict(re.findall(r"(\w+)=(\d+)", re.search(r"stats (.*)", job.stdout).group(1)))
    stats = {k: int(v) for k, v in stats.items()}
    cause = re.search(r"root cause: (.*)", job.stderr).group(1)
    print(f"\nverdict: {cause}\nfix: {re.search(r'fix: (.*)', job.stderr).group(1)}")
    print(f"torch: {stats}")
    from ddpkit.rank.oom_facts import asked_bytes

    asked = asked_bytes(job.stderr)  # torch's own message, in the rank's traceback
    assert asked, job.stderr
    assert cause.startswith("rank 0 ran out of GPU memory at gpu_memory.py:"), cause
    assert f"asked for {gib(asked)}" in cause, cause
    assert f"torch {gib(stats['allocated'])} allocated ({gib(stats['reserved'])} reserved)" in (
        cause
    )
    assert "allowed to this process" in cause, cause
    assert f"parameters {gib(stats['params'])}" in cause
    assert f"gradients {gib(stats['grads'])}" in cause
    assert f"optimizer state {gib(stats['optimizer'])}" in cause
    assert stats["optimizer"] > 0, "the OOM came after Adam's first step"
    assert "micro-batches of" in job.stderr
    assert "s.accumulate(model, every=" in job.stderr
    assert not job.survivors()


def test_memory_that_grew_every_step_is_the_root_cause_of_the_oom_on_the_gpu(tmp_path):
    job = start(["-n", "1", SCRIPT, "leak"], tmp_path)
    assert job.finish(240) == 1, job.stderr
    cause = re.search(r"root cause: (.*)", job.stderr).group(1)
    fix = re.search(r"fix: (.*)", job.stderr).group(1)
    print(f"\nverdict: {cause}\nfix: {fix}")
    assert any("memory: rank 0's GPU memory (allocated by torch) grows" in line
               for line in job.err), job.stderr  # fmt: skip
    assert cause.startswith("rank 0 ran out of GPU memory at gpu_memory.py:"), cause
    assert "after its memory grew step after step (" in cause
    assert fix.startswith("find what keeps memory every step"), fix
    assert "shard=True" not in fix
    assert not job.survivors()


def test_a_gpt_outgrowing_its_gpu_gets_only_fixes_that_free_what_it_asked(tmp_path):
    # issue 35: nanoGPT's GPT at a growing batch under a 5.59 GiB cap was offered sharding its
    # 474 MiB of parameters, which cannot free what the step asked
    gpt = str(Path(__file__).parent / "scripts" / "gpt_grows.py")
    job = start(["-n", "1", gpt], tmp_path)
    assert job.finish(240) == 1, job.stderr
    batch = int(re.findall(r"batch (\d+)", job.stdout)[-1])
    cause = re.search(r"root cause: (.*)", job.stderr).group(1)
    fix = re.search(r"fix: (.*)", job.stderr).group(1)
    print(f"\nbatch {batch}\nverdict: {cause}\nfix: {fix}")
    assert cause.startswith("rank 0 ran out of GPU memory at "), cause
    assert "parameters " in cause
    assert not fix.startswith("no single change"), fix
    offered = fix.split("; or ")
    assert all(re.search(r"frees? (about|the) ", f) for f in offered), fix
    assert f"the failing forward's batch of {batch}" in fix, "the batch read from model(X)"
    assert "activation checkpointing of the model's 12 blocks" in fix
    assert not job.survivors()


def test_memory_snapshot_leaves_the_history_and_a_plot_in_the_run_folder(tmp_path):
    job = start(["-n", "1", "--memory-snapshot", SCRIPT, "oom"], tmp_path)
    assert job.finish(240) == 1, job.stderr
    snapshot = Path(re.search(r"memory snapshot: (\S+)", job.stderr).group(1))
    assert snapshot.is_relative_to(run_folder(job.stderr))
    with snapshot.open("rb") as f:
        history = pickle.load(f)
    events = [e for trace in history["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" for e in events), "the allocator's events were recorded"
    plots = list(snapshot.parent.glob("*memory.png"))
    assert plots, list(snapshot.parent.iterdir())
    assert plots[0].stat().st_size > 10_000, plots
    print(f"\nsnapshot {snapshot.stat().st_size} bytes, {len(events)} events; plot {plots[0]}")
    assert not job.survivors()


def losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"loss step (\d+) = (\S+)", text)}


def test_a_micro_batch_that_does_not_fit_is_halved_and_trains_as_the_half_would(tmp_path):
    fitted = start(["-n", "1", SCRIPT, "fit", str(tmp_path / "a"), "--steps", "4"], tmp_path)
    assert fitted.finish(240) == 0, fitted.stderr
    small = start(
        ["-n", "1", SCRIPT, "fit", str(tmp_path / "b"), "--steps", "4", "--micro", "8192"],
        tmp_path,
    )
    assert small.finish(240) == 0, small.stderr
    said = [line for line in fitted.err if "ran out of memory at micro-batch" in line]
    assert said == ["[rank 0] ddpkit: rank 0 ran out of memory at micro-batch 16384: every rank "
                    "now runs 2 x 8192\n"], fitted.stderr  # fmt: skip
    got, expected = losses(fitted.stdout), losses(small.stdout)
    assert sorted(got) == [1, 2, 3, 4]
    assert sorted(expected) == [1, 2, 3, 4]
    print(f"\nfitted {got}\nsmall  {expected}")
    for step, value in got.items():  # the same micro-batches: equal up to summation order
        assert math.isclose(value, expected[step], rel_tol=1e-5), (step, value, expected[step])
    assert "micro-batch 8192" in fitted.stdout
    assert not fitted.survivors()
    assert not small.survivors()

"""DDP's first step in a process sums gradients as every later step does
(ddpkit.train.bucket_layout), on real gloo groups of 3 and 4 ranks, where a sum's order shows in
its last bits: a fresh DDP made from a checkpoint (a resume) gives bit for bit the gradients of
the DDP that never stopped, with s.wrap and with a DDP the script built itself and gave to
s.load_state."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from torch import nn

from tests.groups.harness import run_ranks


def _model(width: int = 300) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def _digest(model: nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.grad.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> str:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return _digest(model)


def _fresh_against_continuing(rank, world, tmp, how, bucket_cap_mb, width=300):
    import io
    import sys

    from torch.nn.parallel import DistributedDataParallel

    import ddpkit

    err, sys.stderr = sys.stderr, io.StringIO()  # what the layout check would say
    try:
        with ddpkit.setup(seed=0) as s:
            caps = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}

            def wrapped(module: nn.Module) -> nn.Module:
                if how == "s.wrap":
                    return s.wrap(module, **caps)
                ddp = DistributedDataParallel(module, **caps)
                s.load_state(tmp / "nothing", model=ddp)  # as a resumable script does first
                return ddp

            g = torch.Generator().manual_seed(rank)
            batches = [
                (torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
                for _ in range(4)
            ]
            continuing = wrapped(_model(width))
            for x, y in batches[:3]:
                _step(continuing, x, y)
            fresh = wrapped(copy.deepcopy(ddpkit.unwrap(continuing)))  # the resumed process
            digests = [_step(m, *batches[3]) for m in (continuing, fresh)]
            digests.append(_step(fresh, *batches[2]))  # a rebuilt step of the fresh one
            return digests, sys.stderr.getvalue()
    finally:
        sys.stderr = err


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("how", ["s.wrap", "own DDP"])
def test_a_fresh_ddp_sums_its_first_step_as_the_ddp_that_never_stopped(tmp_path, world, how):
    for (continuing, fresh, _), said in run_ranks(
        _fresh_against_continuing, world, tmp_path, how, 0.1
    ):
        assert fresh == continuing, "the resumed step's gradients differ in their bits"
        assert "rebuilt its gradient buckets unlike" not in said, said


def test_with_one_bucket_for_all_the_first_step_is_lined_up_too(tmp_path):
    # s.wrap's default 100 MB bucket holds this model whole: one bucket, in gradient order
    for (continuing, fresh, _), said in run_ranks(
        _fresh_against_continuing, 3, tmp_path, "s.wrap", 100
    ):
        assert fresh == continuing
        assert not said


def test_ddps_own_default_buckets_with_their_small_first_one_are_lined_up_too(tmp_path):
    # bucket_cap_mb left out: DDP's 25 MB buckets after a 1 MB first one (this model: 1.5 MB)
    for (continuing, fresh, _), said in run_ranks(
        _fresh_against_continuing, 3, tmp_path, "own DDP", None, 600
    ):
        assert fresh == continuing
        assert "rebuilt its gradient buckets unlike" not in said, said


def _own_hook_after_wrap(rank, world, tmp):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        model = s.wrap(nn.Linear(4, 2))
        seen = []

        def halving_hook(state, bucket):
            seen.append(bucket.buffer().numel())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer().mul_(0.5))
            return fut

        model.register_comm_hook(None, halving_hook)  # the script's own: it reduces now
        model(torch.ones(1, 4)).sum().backward()
        model(torch.ones(1, 4)).sum().backward()
        twin = copy.deepcopy(model)  # a copy is plain DDP, with a reducer of its own
        return seen, model.module.bias.grad.tolist(), type(twin).__name__


def test_a_hook_the_script_registers_after_wrap_replaces_the_reduction(tmp_path):
    for seen, bias_grad, twin in run_ranks(_own_hook_after_wrap, 2, tmp_path):
        assert seen == [10, 10], "the script's hook got DDP's own bucket each step"
        assert bias_grad == [0.75, 0.75], "(1 halved + 1) halved: the hook ran both steps"
        assert twin == "DistributedDataParallel"

"""Sharded training (`s.wrap(model, shard=True)`, FSDP2) on real gloo groups of 2 and 3 ranks,
checked against DDP, never against itself: the same losses (bit for bit at 2 ranks, where a sum
of two does not depend on its order), each rank holding 1/N of every parameter, the clip norm,
gradient accumulation, the full state dict for export, exact resume at the same world size and
a resume at another (saved by 2 ranks, loaded by 3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.train.sharding import NEEDS_ON_GLOO, torch_version
from tests.groups.harness import run_ranks

pytestmark = pytest.mark.skipif(
    torch_version() < NEEDS_ON_GLOO,
    reason=f"sharding on gloo needs torch {NEEDS_ON_GLOO}; this is {torch.__version__} "
    "(the ConfigError that says so is tested in tests/unit/test_sharding_checks.py)",
)
STEPS = 60


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Tiny(nn.Module):
    """A small transformer-shaped model: an embedding, repeated blocks, a head."""

    def __init__(self, width: int = 24, layers: int = 3, vocab: int = 37) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x).flatten(0, 1)


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randint(0, 37, (4, 9), generator=g), torch.randint(0, 37, (36,), generator=g))
        for _ in range(n)
    ]


def _train(rank, world, tmp, shard, steps, every=1, clip=None):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(0)
        model = s.wrap(Tiny(), shard=shard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, norms = [], []
        for x, y in batches(rank, steps * every):
            with s.accumulate(model, every=every) as step:
                loss = nn.functional.cross_entropy(model(x), y)
                (loss / every).backward()
            if step.sync:
                if clip is not None:
                    norms.append(float(s.clip(model, clip)))
                opt.step()
                opt.zero_grad()
            losses.append(s.reduce(loss.item()))
        return losses, norms, s.full_state_dict(model)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_training_follows_ddp(tmp_path, world):
    ddp = run_ranks(_train, world, tmp_path, False, STEPS)
    sharded = run_ranks(_train, world, tmp_path, True, STEPS)
    for (d_loss, _, _), (s_loss, _, _) in zip(ddp, sharded, strict=True):
        if world == 2:
            assert s_loss == d_loss, "2 ranks: the same sums, bit for bit"
        else:
            assert s_loss == pytest.approx(d_loss, rel=1e-4, abs=1e-6)
    full_ddp, full_sharded = ddp[0][2], sharded[0][2]
    assert sorted(full_ddp) == sorted(full_sharded), "the export names match the plain model's"
    for name, value in full_ddp.items():
        assert type(full_sharded[name]) is torch.Tensor, "plain tensors: torch.save-loadable"
        assert torch.allclose(full_sharded[name], value, rtol=1e-3, atol=1e-5), name
    assert all(state == {} for _, _, state in sharded[1:]), "rank 0 alone holds the export"


def test_clip_norm_and_accumulation_equal_ddps(tmp_path):
    ddp = run_ranks(_train, 2, tmp_path, False, 10, 2, 0.5)
    sharded = run_ranks(_train, 2, tmp_path, True, 10, 2, 0.5)
    for (d_loss, d_norm, _), (s_loss, s_norm, _) in zip(ddp, sharded, strict=True):
        assert len(s_norm) == 10
        assert s_norm == pytest.approx(d_norm, rel=1e-5), "the global norm over every shard"
        assert s_loss == pytest.approx(d_loss, rel=1e-5)


def _shards(rank, world, tmp):
    from torch.distributed.tensor import DTensor

    import ddpkit

    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(0)
        whole = {n: p.shape for n, p in Tiny().named_parameters()}
        model = s.wrap(Tiny(), shard=True)
        held = {}
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            held[name] = (tuple(p.shape), tuple(p.to_local().shape))
        return whole, held


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_holds_one_nth_of_every_parameter(tmp_path, world):
    results = run_ranks(_shards, world, tmp_path)
    whole = results[0][0]
    for name, shape in whole.items():
        rows = [held[name][1][0] if held[name][1] else 0 for _, held in results]
        assert sum(rows) == shape[0], f"{name}: the shards make the whole"
        assert max(rows) <= -(-shape[0] // world), f"{name}: 1/{world} each, up to one row"
        assert all(held[name][0] == tuple(shape) for _, held in results)


def _save_then_continue(rank, world, tmp, stop_at, steps):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(0)
        model = s.wrap(Tiny(), shard=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        resumed = s.load_state(tmp / "state", model=model, optimizer=opt, rng=False)
        start = stop_at if resumed else 0
        losses = []
        for i, (x, y) in enumerate(batches(rank, steps)):
            if i < start:
                continue
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if not resumed and i + 1 == stop_at:
                s.save_state(tmp / "state", model=model, optimizer=opt)
                return losses, None
        return losses, s.full_state_dict(model)


def test_a_sharded_state_resumes_bit_exact_at_the_same_world_size(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    never = run_ranks(_save_then_continue, 2, tmp_path / "a", 10**6, 20)
    first = run_ranks(_save_then_continue, 2, tmp_path / "b", 8, 20)
    files = sorted(p.name for p in (tmp_path / "b" / "state").glob("state-*/sharded/*"))
    assert any(f.endswith(".distcp") for f in files), files
    second = run_ranks(_save_then_continue, 2, tmp_path / "b", 8, 20)
    for (whole, _), (before, _), (after, _) in zip(never, first, second, strict=True):
        assert before + after == whole


def _model_and_optimizer_state(rank, world, tmp, save):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import ddpkit

    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(1)
        model = s.wrap(Tiny(), shard=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if save:
            for x, y in batches(rank, 5):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            s.save_state(tmp / "state", model=model, optimizer=opt)
        else:
            assert s.load_state(tmp / "state", model=model, optimizer=opt, rng=False)
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim = get_optimizer_state_dict(model, opt, options=options)
        return s.full_state_dict(model), optim


def test_a_state_saved_by_2_ranks_loads_into_3_with_the_same_model_and_optimizer(tmp_path):
    saved = run_ranks(_model_and_optimizer_state, 2, tmp_path, True)[0]
    loaded = run_ranks(_model_and_optimizer_state, 3, tmp_path, False)[0]
    for name, value in saved[0].items():
        assert torch.equal(loaded[0][name], value), name
    for key, value in saved[1]["state"].items():
        for field, tensor in value.items():
            assert torch.equal(
                torch.as_tensor(loaded[1]["state"][key][field]), torch.as_tensor(tensor)
            )


def _save_a_sharded_state_dict(rank, world, tmp):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(0)
        model = s.wrap(Tiny(), shard=True)
        s.save(model.state_dict(), tmp / "model.pt")  # as a DDP script saves: every rank calls
        return s.full_state_dict(model)


def test_saving_a_sharded_state_dict_writes_the_whole_model_in_plain_tensors(tmp_path):
    whole = run_ranks(_save_a_sharded_state_dict, 2, tmp_path)[0]
    saved = torch.load(tmp_path / "model.pt", weights_only=True)  # no ddpkit, no process group
    plain = Tiny()
    plain.load_state_dict(saved)  # loads into the unsharded model
    assert sorted(saved) == sorted(whole)
    for name, value in whole.items():
        assert type(saved[name]) is torch.Tensor
        assert torch.equal(saved[name], value), name


def _sharded_with_loader(rank, world, tmp, save):
    """Saved by 2 ranks after 2 steps of a loader over 24 token rows; loaded by 3 (the random
    streams re-seeded, rng=True as a script leaves it): the loader's rest of the epoch."""
    from torch.utils.data import TensorDataset

    import ddpkit

    g = torch.Generator().manual_seed(3)
    rows = TensorDataset(torch.randint(0, 37, (24, 9), generator=g), torch.arange(24))
    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(1)
        model = s.wrap(Tiny(), shard=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = s.loader(rows, batch_size=3)
        seen = []
        if save:
            for step, (tokens, index) in enumerate(loader):
                model(tokens).sum().backward()
                opt.step()
                opt.zero_grad()
                seen += [i for got in s.gather(index) for i in got.tolist()]
                if step == 1:
                    s.save_state(tmp / "state", model=model, optimizer=opt, loader=loader)
                    return seen, s.full_state_dict(model)
        assert s.load_state(tmp / "state", model=model, optimizer=opt, loader=loader)
        for _, index in loader:
            seen += [i for got in s.gather(index) for i in got.tolist()]
        return seen, s.full_state_dict(model)


def test_a_sharded_model_and_its_loader_saved_by_2_ranks_go_on_at_3(tmp_path):
    before, saved = run_ranks(_sharded_with_loader, 2, tmp_path, True)[0]
    after, loaded = run_ranks(_sharded_with_loader, 3, tmp_path, False)[0]
    assert len(before) == 12, "2 steps of 2 ranks x 3"
    assert sorted(before + after) == list(range(24)), "every row of the epoch once"
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name

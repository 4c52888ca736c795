"""Resume at another world size (issue 37) on real gloo ranks: a job stopped at 4 ranks in the
middle of an epoch goes on at 3, 2, 1 and 6 with every sample of the epoch seen once, and with
the global batch kept every later step's loss is the never-stopped 4-rank run's (within 1e-5:
the reduction's order changes); at 4 it stays bit-identical. Random streams are re-seeded;
bad requests fail with a CheckpointError and change nothing."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.groups.harness import RankError, run_ranks

pytestmark = pytest.mark.timeout(240)
EPOCHS = 2


def dataset(length: int) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(length, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(length, 1, generator=g)
    return TensorDataset(x, y, torch.arange(length))


def _train(rank, world, tmp, length, batch, stop_after, keep_batch="global"):
    """Trains EPOCHS epochs (resuming from tmp/state when it holds one); stops after
    `stop_after` global steps with a save. Rank 0 returns each step's global loss, the samples
    each epoch saw (every rank's), the random draws after the load, and the batch size."""
    import torch.distributed as dist

    import ddpkit

    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(0)
        model = s.wrap(nn.Linear(4, 1))  # no dropout: the loss depends on the data alone
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = s.loader(dataset(length), batch_size=batch, keep_batch=keep_batch)
        progress = {"step": 0}
        s.load_state(tmp / "state", model=model, optimizer=opt, loader=loader, progress=progress)
        draws = (torch.rand(()).item(), torch.randint(0, 10**9, ()).item())
        losses, seen = {}, {}
        while loader.epoch < EPOCHS:
            for x, y, index in loader:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total = torch.stack([loss.detach() * len(x), torch.tensor(float(len(x)))])
                dist.all_reduce(total)  # the global batch's mean loss
                progress["step"] += 1
                losses[progress["step"]] = (total[0] / total[1]).item()
                for got in s.gather(index):
                    seen.setdefault(loader.epoch, []).extend(got.tolist())
                if progress["step"] == stop_after:
                    s.save_state(tmp / "state", model=model, optimizer=opt, loader=loader,
                                 progress=progress)  # fmt: skip
                    return losses, seen, draws, loader.batch_size
        return losses, seen, draws, loader.batch_size


def never_stopped(tmp, length=48, batch=3, world=4):
    (tmp / "never").mkdir()
    return run_ranks(_train, world, tmp / "never", length, batch, -1)[0][0]  # rank 0's losses


def stopped_then_resumed(tmp, worlds, stops, length=48, batch=3, keep_batch="global"):
    """One chain: the first run at worlds[0] stops after stops[0] steps, each next resumes at
    its world size and stops after its step (-1: runs to the end). Rank 0's results of each."""
    (tmp / "chain").mkdir()
    return [
        run_ranks(_train, world, tmp / "chain", length, batch, stop, keep_batch)[0]
        for world, stop in zip(worlds, stops, strict=True)
    ]


def seen_per_epoch(runs) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = {}
    for _, run_seen, _, _ in runs:
        for epoch, samples in run_seen.items():
            seen.setdefault(epoch, []).extend(samples)
    return seen


def losses_of(runs) -> dict[int, float]:
    return {step: loss for losses, _, _, _ in runs for step, loss in losses.items()}


@pytest.mark.parametrize("world", [3, 2, 1, 6])
def test_a_4_rank_job_stopped_mid_epoch_goes_on_at_another_world_size(tmp_path, world):
    expected = never_stopped(tmp_path)
    runs = stopped_then_resumed(tmp_path, [4, world], [2, -1])  # stopped at sample 24 of 48
    for epoch, samples in seen_per_epoch(runs).items():
        assert sorted(samples) == list(range(48)), f"epoch {epoch}: every sample once"
    found = losses_of(runs)
    assert sorted(found) == sorted(expected) == list(range(1, 9))
    for step, loss in expected.items():
        assert found[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    assert runs[1][3] == 12 // world, "the global batch of 12 is kept"


def test_at_the_same_world_size_the_resume_stays_bit_identical(tmp_path):
    expected = never_stopped(tmp_path)
    found = losses_of(stopped_then_resumed(tmp_path, [4, 4], [3, -1]))
    assert found == expected


def test_a_chain_of_stops_at_several_sizes_sees_every_sample_once(tmp_path):
    expected = never_stopped(tmp_path)
    # 4 ranks stop after 1 step (sample 12), 3 after 3 (36), 6 after 5 (epoch 1, sample 12)
    runs = stopped_then_resumed(tmp_path, [4, 3, 6, 4], [1, 3, 5, -1])
    for epoch, samples in seen_per_epoch(runs).items():
        assert sorted(samples) == list(range(48)), f"epoch {epoch}: every sample once"
    found = losses_of(runs)
    for step, loss in expected.items():
        assert found[step] == pytest.approx(loss, rel=1e-5), f"step {step}"


def test_random_streams_are_re_seeded_the_same_way_each_time(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = stopped_then_resumed(tmp_path / "a", [4, 3], [2, -1])
    second = stopped_then_resumed(tmp_path / "b", [4, 3], [2, -1])
    assert first[1][2] == second[1][2], "the same (seed, state, rank): the same draws"
    assert first[1][2] != first[0][2]


def test_a_length_that_does_not_divide_pads_as_distributed_sampler_does(tmp_path):
    # 50 samples at 4 ranks: the epoch's order is padded to 52; stopped at 24, the 28 left are
    # padded to 30 for 3 ranks (2 samples seen twice, as DistributedSampler pads)
    runs = stopped_then_resumed(tmp_path, [4, 3], [2, -1], length=50)
    epoch0 = seen_per_epoch(runs)[0]
    assert set(epoch0) == set(range(50)), "every sample seen"
    assert len(epoch0) == 24 + 30
    assert len(epoch0) - len(set(epoch0)) <= (4 - 1) + (3 - 1), "only padding repeats"


def test_per_rank_batch_kept_when_asked_says_the_new_global_batch(tmp_path):
    runs = stopped_then_resumed(tmp_path, [4, 3], [2, -1], keep_batch="per_rank")
    assert runs[1][3] == 3
    said = (tmp_path / "chain" / "stderr0.txt").read_text()
    assert "was saved by 4 ranks; this job has 3" in said
    assert "global batch 9 (was 12: keep_batch='per_rank')" in said
    assert "re-seeds them from (seed 0, state 1, its rank)" in said
    assert sorted(seen_per_epoch(runs)[0]) == list(range(48))


def _load_into(rank, world, tmp, length):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(5)
        model = s.wrap(nn.Linear(4, 1))
        before = [p.detach().clone() for p in model.parameters()]
        loader = s.loader(dataset(length), batch_size=1)
        try:
            s.load_state(tmp / "state", model=model, loader=loader)
        finally:
            unchanged = all(
                torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            )
            (tmp / f"unchanged{rank}").write_text(str(unchanged))


def digest(folder) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize(
    ("length", "world", "says"),
    [
        (48, 6, "has 4 samples of epoch 0 left and this job has 6 ranks"),
        (40, 2, "was over a dataset of 48 samples; this one has 40"),
    ],
)
def test_a_bad_resume_is_a_checkpoint_error_and_changes_nothing(tmp_path, length, world, says):
    stopped_then_resumed(tmp_path, [4], [11], batch=1)  # 44 of 48 samples taken
    before = digest(tmp_path / "chain" / "state")
    errors = run_ranks(_load_into, world, tmp_path / "chain", length, expect_errors=True)
    assert all(isinstance(e, RankError) and e.type == "CheckpointError" for e in errors)
    assert says in errors[0].message
    assert digest(tmp_path / "chain" / "state") == before
    assert all((tmp_path / "chain" / f"unchanged{r}").read_text() == "True" for r in range(world))

"""An epoch's global order dealt to the ranks (ddpkit.train.dealing): DistributedSampler's order
exactly at any size, and the rest of an epoch dealt to another number of ranks from any place,
each sample once (padding only where the rest does not divide)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from torch.utils.data import DistributedSampler

from ddpkit.train.dealing import DealtSampler


def shares(sampler_of, world: int) -> list[list[int]]:
    return [list(sampler_of(rank)) for rank in range(world)]


@pytest.mark.parametrize(
    ("length", "world", "drop_last", "shuffle"),
    [
        case
        for case in itertools.product(
            [1, 5, 12, 13, 97], [1, 2, 3, 4, 6], [False, True], [False, True]
        )
        if not (case[2] and case[0] < case[1])  # drop_last with fewer samples than ranks: none
    ],
)
def test_each_rank_gets_what_distributed_sampler_gives_it(length, world, drop_last, shuffle):
    for epoch in (0, 3):
        for rank in range(world):
            torch_own = DistributedSampler(range(length), world, rank, shuffle, 7, drop_last)
            dealt = DealtSampler(length, rank, world, 7, shuffle, drop_last)
            torch_own.set_epoch(epoch)
            dealt.set_epoch(epoch)
            assert list(dealt) == list(torch_own)
            assert len(dealt) == len(torch_own) == dealt.epoch_length()


def dealt_at(world: int, epoch: int, position: int, begun_at: int, **kw) -> list[list[int]]:
    def one(rank: int) -> DealtSampler:
        sampler = DealtSampler(kw.get("length", 48), rank, world, 7,
                               drop_last=kw.get("drop_last", False))  # fmt: skip
        sampler.resume_at(epoch, position, begun_at)
        sampler.set_epoch(epoch)
        assert len(sampler) == len(list(sampler)), "len without making the order"
        return sampler

    return shares(one, world)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 6, 8])
@pytest.mark.parametrize("position", [0, 12, 24, 36, 48])
def test_the_rest_of_an_epoch_goes_to_any_number_of_ranks_each_sample_once(world, position):
    order = DealtSampler(48, 0, 4, 7).order()
    rest = [i for share in dealt_at(world, 0, position, 4) for i in share]
    left, pad = 48 - position, (-(48 - position)) % world
    assert len(rest) == left + pad, "padding only to a multiple of the ranks"
    counts = Counter(rest)
    assert set(counts) - set(order[position:]) <= set(order[:pad]), "pads: the epoch's first"
    assert all(counts[i] >= 1 for i in order[position:]), "every sample left is dealt"
    assert sum(counts.values()) - len(counts) <= pad, "only the padding repeats"


def test_a_rank_takes_every_worlds_th_position_of_the_rest():
    order = DealtSampler(48, 0, 4, 7).order()
    per_rank = dealt_at(3, 0, 12, 4)
    assert per_rank == [order[12 + r :: 3] for r in range(3)]


def test_with_drop_last_the_rest_is_cut_to_a_multiple_of_the_ranks():
    per_rank = dealt_at(5, 0, 12, 4, drop_last=True)
    assert [len(p) for p in per_rank] == [7] * 5  # 36 left: 35 dealt


def test_the_epoch_after_a_resume_is_an_ordinary_epoch_at_the_new_size():
    sampler = DealtSampler(50, 1, 3, 7)
    sampler.resume_at(0, 24, 4)
    sampler.set_epoch(0)
    assert (sampler.begun_at, sampler.start) == (4, 24)
    sampler.set_epoch(1)
    torch_own = DistributedSampler(range(50), 3, 1, True, 7)
    torch_own.set_epoch(1)
    assert list(sampler) == list(torch_own)


def test_evaluation_deals_each_sample_once_without_padding():
    per_rank = shares(lambda r: DealtSampler(10, r, 4, shuffle=False, even=False), 4)
    assert per_rank == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]

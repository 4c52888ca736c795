"""The straggler rule (pure logic) and the step record's ring, read as the launcher reads it."""

from __future__ import annotations

import pytest

from ddpkit.common import protocol
from ddpkit.launch.speed.straggler import SUSTAIN, Episodes, RankSummary, find


def rank(r: int, data=0.002, compute=0.030, comm=0.010, other=0.0, steps=50) -> RankSummary:
    total = data + compute + comm + other
    return RankSummary(r, "node0", steps, total, data, compute, comm, other)


def test_an_even_job_has_no_straggler():
    assert find([rank(0), rank(1, compute=0.031), rank(2, compute=0.029)], 1.2) is None


def test_a_rank_slow_in_its_own_compute_is_named_with_the_factor():
    # every rank's step is as long (they wait for rank 1), but rank 1's own time is not
    slow = [rank(0, comm=0.025), rank(1, compute=0.045, comm=0.010), rank(2, comm=0.025)]
    found = find(slow, 1.2)
    assert found is not None
    assert (found.rank, found.part) == (1, "compute")
    assert found.factor == pytest.approx(1.5)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_at_any_world_size_the_slow_rank_alone_is_named_against_the_median(world):
    # an even world has two middle ranks: the median is theirs, never the slow rank's own time
    even = [rank(r, comm=0.025) for r in range(world)]
    assert find(even, 1.2) is None
    slow = [*even[:1], rank(1, compute=0.045, comm=0.010), *even[2:]]
    found = find(slow, 1.2)
    assert found is not None
    assert (found.rank, found.part) == (1, "compute")
    assert found.factor == pytest.approx(1.5)


def test_a_rank_waiting_for_data_is_named_with_its_share_of_the_step():
    found = find([rank(0, comm=0.030), rank(1, data=0.032, comm=0.0)], 1.2)
    assert found is not None
    assert (found.rank, found.part) == (1, "data")
    assert found.share == pytest.approx(0.032 / 0.062)


def test_a_small_excess_or_a_turned_off_threshold_or_too_few_steps_names_nobody():
    assert find([rank(0, compute=0.001), rank(1, compute=0.0015)], 1.2) is None  # <5% of a step
    slow = [rank(0), rank(1, compute=0.060)]
    assert find(slow, 0) is None
    assert find([rank(0, steps=3), rank(1, compute=0.060, steps=3)], 1.2) is None


def test_an_episode_starts_after_sustained_evidence_and_ends_once():
    episodes = Episodes(1.2)
    slow = find([rank(0), rank(1, compute=0.060)], 1.2)
    seen = [episodes.update(slow)[0] for _ in range(SUSTAIN)]
    assert seen == [""] * (SUSTAIN - 1) + ["start"]
    assert episodes.update(slow) == ("", None), "one line per episode"
    assert episodes.update(None)[0] == "", "one even evaluation does not end it"
    ends = [episodes.update(None)[0] for _ in range(SUSTAIN)]
    assert ends.count("end") == 1


def test_one_slow_evaluation_is_not_an_episode():
    episodes = Episodes(1.2)
    slow = find([rank(0), rank(1, compute=0.060)], 1.2)
    assert [episodes.update(x)[0] for x in (slow, None, slow, None, slow)] == [""] * 5


def test_the_step_ring_gives_what_is_new_and_survives_wrapping(tmp_path):
    writer = protocol.StepWriter(protocol.state_path(tmp_path, 0, protocol.STEPS), "GPU-x")
    for n in range(1, 11):
        writer.write(protocol.Step(n, float(n), 0.1, 0.01, 0.05, 0.04, 0.0))
    first = protocol.read_steps(tmp_path, 0)
    assert (first.count, first.gpu) == (10, "GPU-x")
    assert [s.number for s in first.steps] == list(range(1, 11))
    assert [s.number for s in protocol.read_steps(tmp_path, 0, since=7).steps] == [8, 9, 10]
    for n in range(11, protocol.STEP_RING + 20):
        writer.write(protocol.Step(n, float(n), 0.1, 0.01, 0.05, 0.04, 0.0))
    late = protocol.read_steps(tmp_path, 0, since=10)
    numbers = [s.number for s in late.steps]
    assert numbers[-1] == protocol.STEP_RING + 19
    assert numbers == list(range(numbers[0], numbers[-1] + 1)), "oldest first, none twice"
    assert len(numbers) < protocol.STEP_RING, "what the ring no longer holds is not invented"

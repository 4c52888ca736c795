"""The straggler rule (pure logic) and the step record's ring, read as the launcher reads it."""

from __future__ import annotations

import pytest

from ddpkit.common import protocol
from ddpkit.launch.speed.straggler import SUSTAIN, Episodes, Finding, RankSummary, find


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


def test_the_same_rank_held_back_for_another_cause_starts_a_new_episode_without_an_end():
    episodes = Episodes(1.2)
    computes = find([rank(0), rank(1, compute=0.060)], 1.2)
    assert [episodes.update(computes)[0] for _ in range(SUSTAIN)][-1] == "start"
    sleeps = Finding(rank=1, part="wait", factor=2.0, share=0.6, others_share=0.3, own_factor=2.0)
    # the cause flickers at the change (a loaded machine): only a sustained new cause counts
    seen = [episodes.update(x) for x in (sleeps, computes, *[sleeps] * SUSTAIN)]
    assert [what for what, _ in seen] == [""] * (SUSTAIN + 1) + ["start"], "never 'end'"
    assert seen[-1][1] == sleeps
    assert episodes.current == sleeps


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


# -- the words (issue 35): one factor in the line and the end table, a waiting rank is not
# computing, a fact of the whole host is no evidence against one rank, an even job says nothing


def cpu(r: int, share: float, host: str = "node0", steal: float = 0.0, demand: float | None = None,
        queued: float = 0.0, **parts) -> RankSummary:  # fmt: skip
    s = rank(r, **parts)
    facts = {"cpu_share": share, "cpu_demand": share if demand is None else demand,
             "cpu_queued": queued,
             "host": {"steal_percent": steal, "cores": 2, "load1": 1.0}}  # fmt: skip
    return RankSummary(s.rank, host, s.steps, s.total, s.data, s.compute, s.comm, s.other,
                       facts=facts)  # fmt: skip


def test_a_rank_that_sleeps_is_said_to_wait_not_to_compute():
    from ddpkit.launch.speed.verdicts import verdict

    # the others wait blocked in gloo (as little CPU as the sleeper): judged on rank 1 alone
    ranks = [cpu(0, 0.1, comm=0.040), cpu(1, 0.1, compute=0.070, comm=0.002),
             cpu(2, 0.1, comm=0.040)]  # fmt: skip
    found = find(ranks, 1.2)
    assert found.part == "wait", "another cause than computing: an episode of its own"
    line = verdict(found, {s.rank: s for s in ranks}, 50)
    assert "computes" not in line
    assert (
        f"takes {found.own_factor:.2f}x the median rank's own time per step, but its main "
        "thread asked for 10% of a core (others 10%): its extra time is not spent computing "
        "for the last 50 steps"
    ) in line
    assert "it waits on something else (a sleep, a lock" in line


def test_a_rank_starved_of_cpu_still_computes():
    # a CPU hog on its core: it ran 40% of a core but asked for a whole one (run queue)
    ranks = [cpu(0, 0.6, comm=0.025), cpu(1, 0.4, demand=1.0, compute=0.045, comm=0.010),
             cpu(2, 0.6, comm=0.025)]  # fmt: skip
    assert find(ranks, 1.2).part == "compute"


def test_a_rank_whose_main_thread_waits_on_its_own_starved_threads_still_computes():
    # behind a hog: its main thread blocks on gloo's thread (asks for little) while that thread
    # queues for the core (CI: called idle, 58% asked)
    ranks = [cpu(0, 0.6, comm=0.025), cpu(1, 0.3, demand=0.3, queued=0.6, compute=0.045,
             comm=0.010), cpu(2, 0.6, comm=0.025)]  # fmt: skip
    assert find(ranks, 1.2).part == "compute"


def test_on_a_loaded_machine_where_every_rank_queues_a_sleeping_rank_still_waits():
    # CI's 2 cores under other tests: every rank's threads queue; rank 1 sleeps
    ranks = [cpu(0, 0.1, queued=0.5, comm=0.040), cpu(1, 0.1, queued=0.4, compute=0.070,
             comm=0.002), cpu(2, 0.1, queued=0.6, comm=0.040)]  # fmt: skip
    assert find(ranks, 1.2).part == "wait"


def test_a_computing_rank_gives_the_factor_of_its_own_time_as_the_end_table_does():
    from ddpkit.launch.speed.verdicts import verdict

    ranks = [
        cpu(0, 0.6, comm=0.025),
        cpu(1, 0.9, compute=0.045, comm=0.010),
        cpu(2, 0.6, comm=0.025),
    ]
    found = find(ranks, 1.2)
    line = verdict(found, {s.rank: s for s in ranks}, 50)
    assert f"computes 1.50x the median rank ({found.own_factor:.2f}x its own time per step)" in line


def test_cpu_steal_on_the_host_every_rank_shares_is_no_evidence():
    from ddpkit.launch.speed.verdicts import verdict

    ranks = [cpu(0, 0.6, steal=7, comm=0.025), cpu(1, 0.9, steal=7, compute=0.045, comm=0.010)]
    shared = verdict(find(ranks, 1.2), {s.rank: s for s in ranks}, 50)
    assert "steal" not in shared
    ranks = [cpu(0, 0.6, comm=0.025), cpu(1, 0.9, "node1", steal=30, compute=0.045, comm=0.01)]
    alone = verdict(find(ranks, 1.2), {s.rank: s for s in ranks}, 50)
    assert "CPU steal 30% on node1" in alone


def report(own: list[float], hosts: int = 1, memory: bool = True) -> dict:
    from ddpkit.launch.speed.memory_growth import describe  # noqa: F401 - the column's own words

    rows = [
        {"rank": r, "host": f"node{r % hosts}", "steps": 96, "median_s": 0.0352,
         "p90_s": 0.0414, "total_s": 3.4, "own_median": o,
         "split": {"data": 0.03, "compute": 0.67, "comm": 0.30, "host": 0.0},
         "memory": {"resident": 2**30, "peak": 2**30} if memory else {}}
        for r, o in enumerate(own)
    ]  # fmt: skip
    return {"ranks": rows, "slowest": {"rank": 1, "own_over_median": max(own) / min(own),
            "cost_s": 6.0, "cost_share": 0.3}, "threshold": 1.2}  # fmt: skip


def test_the_end_table_fits_80_columns_and_counts_every_optimizer_step():
    from ddpkit.launch.speed.verdicts import summary_text

    text = summary_text(report([0.02, 0.03, 0.02]), width=80)
    shown = ("ddpkit: " + text).splitlines()  # as the launcher prints it
    assert max(len(line) for line in shown) <= 80, text
    assert "    96 " in text
    assert "host  " not in text.splitlines()[1][:20], "one host: no host column"
    wide = summary_text(report([0.02, 0.03, 0.02], hosts=2), width=160)
    assert "p90" in wide
    assert "node1" in wide


def test_an_even_job_gets_no_slowest_line():
    from ddpkit.launch.speed.verdicts import summary_text

    assert "slowest" not in summary_text(report([0.0200, 0.0202]), width=100)
    assert "slowest: rank 1 (1.50x" in summary_text(report([0.02, 0.03]), width=100)


def test_the_step_count_is_every_optimizer_step_the_first_included():
    from ddpkit.launch.speed.step_watch import Track

    track = Track(0, 1, 50)
    track.take([protocol.Step(n, 0.0, 0.01, 0, 0.01, 0, 0) for n in range(1, 96)])
    assert track.taken == 96, "record 1 is the second optimizer step: the first starts the clock"

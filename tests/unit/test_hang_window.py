"""How soon a stall is a hang (ddpkit.launch.hang.window, through the watch's step function
progress_watch.judge): with the defaults, a job of short steps whose ranks all stand still is
hung after --hang-min (20 s); a job whose own steps or quiet stretches are long gets more;
--hang-timeout bounds it; NCCL's first collective waits for the bound; work is never cut.
Each test drives the watch one look a second over made-up views of 3 ranks (the real ranks:
tests/e2e/test_hang_in_seconds.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ddpkit.common import protocol
from ddpkit.launch.base.snapshot import RankView, Snapshot
from ddpkit.launch.hang.progress_watch import Seen, Watch, judge
from ddpkit.launch.hang.window import Learned, Window, learn, window

T0 = 1000.0
WAITING = protocol.Record(5, 0, T0, True, "all_reduce", ticked=T0)


def timed(t: int, step_every: float) -> protocol.StepRecord | None:
    """The step ring's steps that ended in the second before look `t`, each `step_every` s."""
    ended = range(int((t - 1) / step_every) + 1, int(t / step_every) + 1) if t else range(0)
    steps = [protocol.Step(n, T0 + t, step_every, 0.0, step_every, 0.0, 0.0) for n in ended]
    return protocol.StepRecord(ended.stop - 1 if t else 0, "", steps) if steps else None


def ticking(record: protocol.Record, t: float) -> protocol.Record:
    """The record with a fresh tick (the rank's Python threads run)."""
    return protocol.Record(**{**record.__dict__, "ticked": T0 + t})


def hung_at(
    views: Callable[[int], tuple[RankView, ...]],
    seconds: int = 400,
    watch: Watch | None = None,
    seen: Callable[[int], Seen] = lambda t: Seen(),
) -> int | None:
    """The first look (seconds from the start) the watch finds a hang, or None."""
    watch = watch or Watch(timeout=300.0)
    for t in range(seconds):
        snap = Snapshot(views(t), wall=T0 + t, mono=T0 + t, sampled=True)
        watch, found = judge(watch, snap, seen(t))
        if found.hung:
            return t
    return None


def job(steps_until: int, step_every: float, then: Callable[[int, int], RankView]):
    """Ranks that step every `step_every` s (each step completes a collective and burns CPU)
    until `steps_until`, then do what `then(rank, t)` says."""

    def views(t: int) -> tuple[RankView, ...]:
        if t < steps_until:
            n = int(t / step_every)
            record = ticking(protocol.Record(n + 1, 0, T0 + t, False), t)
            return tuple(
                RankView(r, 100 + r, phase="ready", cpu=float(t), io=0, record=record,
                         steps=timed(t, step_every))
                for r in range(3)
            )  # fmt: skip
        return tuple(then(r, t) for r in range(3))

    return views


def waiting(rank: int, t: int, cpu: float = 0.0) -> RankView:
    record = ticking(WAITING, t)
    return RankView(rank, 100 + rank, phase="ready", cpu=cpu, io=0, record=record)


def asleep(rank: int, t: int) -> RankView:
    """Rank 1 sleeps outside any collective; the others wait for it in all_reduce."""
    if rank != 1:
        return waiting(rank, t, cpu=10.0)
    record = ticking(protocol.Record(5, 0, 0.0, False), t)
    return RankView(1, 101, phase="ready", cpu=10.0, io=0, record=record)


def test_a_job_of_short_steps_whose_ranks_stand_still_is_hung_after_hang_min():
    at = hung_at(job(10, 0.5, asleep))
    assert at in (30, 31), at


@pytest.mark.parametrize("step_every", [40.0, 60.0])
def test_a_job_of_long_steps_is_given_three_of_its_longest_steps(step_every):
    # steps of 40 and 60 s: 120 and 180 s of standing still are still those steps' business
    at = hung_at(job(int(step_every * 4) + 1, step_every, asleep), seconds=800)
    stood = at - (int(step_every * 4) + 1)
    assert 3 * step_every - 1 <= stood <= 3 * step_every + 2, stood


def test_hang_timeout_bounds_the_learned_window():
    at = hung_at(job(241, 60.0, asleep), seconds=800, watch=Watch(timeout=100.0))
    assert at - 241 in range(99, 102)


def test_a_lower_hang_timeout_than_hang_min_is_the_window():
    assert hung_at(job(10, 0.5, asleep), watch=Watch(timeout=3.0)) in (13, 14)


def test_nccl_ranks_waiting_in_their_first_collective_are_given_the_bound():
    # NCCL connects the ranks inside the first collective: no collective completed yet
    first = protocol.Record(0, 0, T0, True, "all_reduce", ticked=T0)

    def views(t):
        group = ("nccl", 600.0)
        return tuple(
            RankView(r, 100 + r, phase="ready", cpu=0.0, io=0, record=ticking(first, t),
                     group=group)
            for r in range(3)
        )  # fmt: skip

    assert hung_at(views) in (300, 301)


def test_a_quiet_stretch_the_job_came_back_from_is_doubled_into_the_window():
    learned = Learned()
    for stall in (0.0, 39.0, 0.0):
        learned = learn(learned, [], stall, worked=True, met=True, completed=True)
    assert learned.quiet == (39.0,)
    assert window(learned, 20.0, 300.0, nccl=False).seconds == 78.0


def test_only_the_recent_steps_count():
    learned = learn(Learned(), [100.0], 0.0, True, True, True)  # one slow step (a first save)
    assert window(learned, 20.0, 300.0, nccl=False).seconds == 300.0
    for _ in range(59):
        learned = learn(learned, [1.0], 0.0, True, True, True)
    assert window(learned, 20.0, 300.0, nccl=False).seconds == 20.0


def test_each_step_is_the_slowest_ranks():
    from ddpkit.launch.hang.progress_watch import slowest_steps

    def ring(*totals):
        return protocol.StepRecord(
            len(totals),
            "",
            [protocol.Step(n, T0, total, 0, total, 0, 0) for n, total in enumerate(totals, 1)],
        )

    views = (
        RankView(0, 100, steps=ring(0.1, 0.2)),
        RankView(1, 101, steps=ring(0.3, 0.1)),
        RankView(2, 102),
    )
    assert slowest_steps(Snapshot(views)) == [0.3, 0.2]


def test_a_rank_waiting_for_its_gpu_is_counted_from_when_its_wait_began():
    # rank 0 stands in one sync call from t=12 (its tick thread says since when); NVML says
    # its GPU is busy from t=14 (GPU_STILL later): the stall counts from 12, not 14
    def views(t):
        if t < 12:
            return job(12, 0.5, asleep)(t)
        still = protocol.Record(30, 0, 0.0, False, ticked=T0 + t, still=T0 + 12, gpu="GPU-0")
        cpu = float(t)  # CUDA's wait spins a core
        return (RankView(0, 100, phase="ready", cpu=cpu, io=0, record=still),
                waiting(1, t), waiting(2, t))  # fmt: skip

    at = hung_at(views, seen=lambda t: Seen(on_gpu=frozenset({0}) if t >= 14 else frozenset()))
    assert at in (32, 33), at


WORK: dict[str, Callable[[int, int], RankView]] = {
    # rank 0 computes alone (an evaluation) while ranks 1 and 2 wait for it
    "computing": lambda r, t: waiting(r, t, cpu=float(t) if r == 0 else 1.0)
    if r
    else RankView(0, 100, phase="ready", cpu=float(t), io=0,
                  record=ticking(protocol.Record(5, 0, 0.0, False), t)),
    # rank 0 writes a checkpoint at 1 MB/s to a slow disk while the others wait
    "writing": lambda r, t: RankView(r, 100 + r, phase="ready", cpu=1.0,
                                     io=t * 1_000_000 if r == 0 else 0,
                                     record=ticking(protocol.Record(5, 0, 0.0, False), t)
                                     if r == 0 else ticking(WAITING, t)),
    # a person at rank 0's debugger prompt
    "debugged": lambda r, t: RankView(r, 100 + r, phase="ready", cpu=1.0, io=0,
                                      record=ticking(protocol.Record(5, 0, 0.0, False,
                                                                     prompt=r == 0), t)),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(WORK))
def test_work_that_keeps_the_others_waiting_is_never_cut(kind):
    assert hung_at(job(10, 0.5, WORK[kind]), seconds=400) is None


def test_the_verdict_says_what_its_timing_rests_on():
    learned = Learned(steps=(0.04, 0.05), met=True)
    said = window(learned, 20.0, 300.0, nccl=False).basis()
    assert said == "a hang after 20 s (--hang-min): its steps took at most 0.05 s (the last 50)"
    assert (
        Window(300, 20, 300, step=200.0).basis().startswith("a hang after 300 s (--hang-timeout)")
    )
    connecting = window(Learned(met=True), 20, 300, nccl=True).basis()
    assert "no NCCL collective had completed yet" in connecting
    assert "not every rank had finished init" in window(Learned(), 20, 300, nccl=False).basis()


def test_ranks_waiting_for_one_that_never_finished_init_are_given_the_bound():
    # init's own watch (--init-timeout) names a rank that never arrives; the hang watch waits
    def views(t):
        return (
            waiting(0, t),
            waiting(1, t),
            RankView(2, 102, phase="init", cpu=0.0, io=0, record=ticking(WAITING, t)),
        )

    assert hung_at(views) in (300, 301)

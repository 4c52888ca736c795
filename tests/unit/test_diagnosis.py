"""The diagnosis's tables, one row each: the facts of an attempt (made-up ranks as one look of
the launcher sees them) and the cause the first row that holds names, with its rank and fix.
A new verdict is one row in ddpkit.launch.diagnosis and one row here; the last test checks
that every row of the tables has its row here."""

from __future__ import annotations

import signal
import time

import pytest

from ddpkit.common import protocol
from ddpkit.launch import diagnosis
from ddpkit.launch.base.place import Doing, Place
from ddpkit.launch.base.snapshot import RankView, Snapshot
from ddpkit.launch.diagnosis import Kind
from ddpkit.launch.hang.mismatch import Mismatch
from ddpkit.launch.hang.window import Window
from ddpkit.launch.observe import InitWait

NOW = time.time()
LOST = "Connection closed by peer [127.0.0.1]:1234"  # a victim's words (torch's)


def error(message: str, at: float = NOW, kind: str = "RuntimeError", fix: str = ""):
    return protocol.ErrorRecord(at, kind, message, fix=fix)


def steps(n: int) -> protocol.StepRecord:
    return protocol.StepRecord(n, "", [])


def snap(*ranks: RankView) -> Snapshot:
    return Snapshot(tuple(ranks), wall=NOW + 5)


def waiting_victims(*ranks: int, **extra) -> list[RankView]:
    return [
        RankView(r, 100 + r, 1, NOW + 0.3, error=error(LOST, NOW + 0.2), **extra) for r in ranks
    ]


class Oom:
    """The kernel's OOM-kill counter, as OomWatch reads it: it went up, or not."""

    def __init__(self, killed: bool) -> None:
        self._killed = killed

    def killed(self, pids) -> bool:
        return self._killed

    def text(self, rss: int) -> str:
        return "was killed by the kernel's OOM killer: the machine ran out of memory"


FAILED_ROWS = {
    Kind.UNEVEN_COLLECTIVES: (
        snap(
            RankView(
                0, 100, 0, NOW, ended=(0, NOW), record=protocol.Record(finished=9), steps=steps(5)
            ),
            *waiting_victims(1, 2, record=protocol.Record(finished=8), steps=steps(5)),
        ),
        None,
        None,
        (0, "look for one inside a branch that only some ranks take"),
    ),
    Kind.RAN_OUT_OF_BATCHES: (
        snap(
            RankView(2, 102, 0, NOW, ended=(0, NOW), steps=steps(4)),
            *waiting_victims(0, 1, steps=steps(5)),
        ),
        None,
        None,
        (2, "give every rank the same number of batches"),
    ),
    Kind.KEPT_WAITING: (
        snap(RankView(1, 101), *waiting_victims(0, 2)),
        {1: Place(Doing.ELSEWHERE, "train.py:21", func="evaluate")},
        None,
        (1, "raise the process group's timeout"),
    ),
    Kind.GPU_OUT_OF_MEMORY: (
        snap(
            RankView(
                1,
                101,
                1,
                NOW,
                error=error("CUDA out of memory", kind="OutOfMemoryError"),
                memory={"kind": "cuda", "asked": 2**30, "total": 2**34, "free": 2**20},
            ),
            RankView(0, 100, -signal.SIGTERM, NOW + 1),
        ),
        None,
        None,
        (1, ""),
    ),
    Kind.KILLED_BY_OOM: (
        snap(
            RankView(0, 100, -signal.SIGKILL, NOW, rss=2**30),
            RankView(1, 101, -signal.SIGTERM, NOW + 1),
        ),
        None,
        Oom(killed=True),
        (0, "use less host memory per rank"),
    ),
    Kind.FATAL_SIGNAL: (
        snap(RankView(2, 102, -signal.SIGSEGV, NOW), RankView(0, 100, -signal.SIGTERM, NOW + 1)),
        None,
        Oom(killed=False),
        (2, ""),
    ),
    Kind.RAISED: (
        snap(
            RankView(
                1, 101, 1, NOW, error=error("bad sample 17", kind="ValueError", fix="skip it")
            ),
            *waiting_victims(0, 2),
        ),
        None,
        None,
        (1, "skip it"),
    ),
    Kind.EXITED: (
        snap(RankView(0, 100, 3, NOW), RankView(1, 101, -signal.SIGTERM, NOW + 1)),
        None,
        Oom(killed=False),
        (0, ""),
    ),
}


@pytest.mark.parametrize("kind", list(FAILED_ROWS), ids=lambda k: k.name)
def test_each_row_of_a_failure_names_its_cause_rank_and_fix(kind):
    seen, places, oom, (rank, fix) = FAILED_ROWS[kind]
    cause = diagnosis.failed(diagnosis.Failure(seen, oom, None, lambda alive: places or {}))
    assert cause.kind is kind
    assert cause.rank == rank
    assert fix in cause.fix
    if kind in diagnosis.WAITED_FOR:
        assert rank not in cause.victims, "the rank at fault is no victim"
        assert cause.victims


WAITING = Place(Doing.WAITS_IN, "t.py:9", op="all_reduce")
HUNG_ROWS = {
    Kind.HUNG_IN_DIFFERENT_COLLECTIVES: (
        {0: WAITING, 1: Place(Doing.WAITS_IN, "t.py:12", op="broadcast")},
        Mismatch(
            "rank 1 waits in broadcast (t.py:12); rank 0 in all_reduce (t.py:9)", [1], ["t.py:12"]
        ),
        "every rank must call the same collectives",
    ),
    Kind.GPU_NEVER_FINISHED: (
        {0: WAITING, 1: Place(Doing.WAITS_FOR_GPU, seconds=40, gpu=0, busy=100)},
        None,
        "a GPU kernel never finished",
    ),
    Kind.HUNG_AFTER_A_RANK_ENDED: (
        {0: WAITING, 1: Place(Doing.EXITED, code=0)},
        None,
        "uneven inputs",
    ),
    Kind.HUNG: (
        {0: WAITING, 1: Place(Doing.ELSEWHERE, "t.py:3", func="f")},
        None,
        "--hang-timeout",
    ),
}


@pytest.mark.parametrize("kind", list(HUNG_ROWS), ids=lambda k: k.name)
def test_each_row_of_a_hang_names_its_cause_and_fix(kind):
    where, differ, fix = HUNG_ROWS[kind]
    cause = diagnosis.hung(
        diagnosis.Hang(where, "v", "", stall=60, window=Window(60, 20, 60), differ=differ)
    )
    assert cause.kind is kind
    assert fix in cause.fix
    assert cause.exit_code == diagnosis.HANG_EXIT_CODE


INIT_ROWS = {
    Kind.MISSING_AT_INIT: (InitWait([0], [1, 2], 30, 30), "never reached init_process_group", ""),
    Kind.INIT_NEVER_COMPLETED: (
        InitWait([0, 1], [], 30, 30),
        "did not complete",
        "let ddpkit run give init its world size",
    ),
}


@pytest.mark.parametrize("kind", list(INIT_ROWS), ids=lambda k: k.name)
def test_each_row_of_ranks_that_never_met_names_its_cause_and_fix(kind):
    init, said, fix = INIT_ROWS[kind]
    cause = diagnosis.never_met(init, "details")
    assert cause.kind is kind
    assert said in cause.summary
    assert fix in cause.fix


def test_every_row_of_the_tables_has_its_row_here():
    rows = {rule.kind for rule in (*diagnosis.FAILED, *diagnosis.HUNG)}
    rows |= {Kind.MISSING_AT_INIT, Kind.INIT_NEVER_COMPLETED}
    tested = {*FAILED_ROWS, *HUNG_ROWS, *INIT_ROWS}
    assert rows == tested
    assert set(Kind) - tested == {Kind.COLLECTIVES_DIFFER}, "said by the ranks: test_run_failures"

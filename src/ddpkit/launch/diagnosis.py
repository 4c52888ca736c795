"""Why an attempt failed, hung or never met, decided in one place: tables of rules, each row a
predicate over the attempt's facts, the cause it names and the words and fix that say it. The
first row that holds gives the one record, a `Cause`, which the report renders
(ddpkit.launch.report); nothing else decides a cause or picks a fix. A new verdict is one row
here, and its test one row of tests/unit/test_diagnosis.py.

The facts are values: a snapshot of the ranks (exit codes, error records, progress and step
records), each rank's `Place` when a rule needs it (its stacks are dumped only then), the
kernel's OOM-kill count, the collectives the ranks waited in. The words a rank's death is said
in (its error's own text, the line a signal hit, the OOM killer) are ddpkit.launch.causes's.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.common.ranges import ranks_text
from ddpkit.launch import causes, oom_verdict
from ddpkit.launch.base.place import Doing, Place
from ddpkit.launch.base.snapshot import RankView, Snapshot
from ddpkit.launch.hang import mismatch
from ddpkit.launch.hang.window import Window
from ddpkit.launch.observe import InitWait, waited

HANG_EXIT_CODE = 124  # as GNU timeout's


class Kind(Enum):
    # a rank failed
    RAN_OUT_OF_BATCHES = "a rank ended while the others waited for it"
    UNEVEN_COLLECTIVES = "the ranks called different numbers of collectives"
    KEPT_WAITING = "a rank kept the others waiting past the group's timeout"
    GPU_OUT_OF_MEMORY = "out of GPU memory"
    KILLED_BY_OOM = "the kernel's OOM killer"
    FATAL_SIGNAL = "a fatal signal"
    RAISED = "an uncaught error"
    EXITED = "an exit code, or a signal"
    # the ranks said their collectives differ (read after they ended)
    COLLECTIVES_DIFFER = "the ranks called different collectives"
    # the job hung
    HUNG_IN_DIFFERENT_COLLECTIVES = "hung in different collectives"
    GPU_NEVER_FINISHED = "a GPU kernel never finished"
    HUNG_AFTER_A_RANK_ENDED = "a rank ended while the others wait"
    HUNG = "no rank made progress"
    # init
    MISSING_AT_INIT = "ranks never reached init"
    INIT_NEVER_COMPLETED = "init never completed"


@dataclass(frozen=True)
class Cause:
    """The one record of why: the rank at fault (None: no one rank), the words, the fix."""

    kind: Kind
    rank: int | None
    summary: str
    fix: str = ""
    exit_code: int = 1
    victims: tuple[int, ...] = ()  # ranks that failed only because of the rank at fault
    victim: bool = False  # the rank's own error says a peer failed first: maybe elsewhere
    details: str = ""


@dataclass(frozen=True)
class Rule:
    kind: Kind
    holds: Callable[..., bool]
    says: Callable[..., tuple[str, str]]  # (summary, fix)


def first_rule(rules: Sequence[Rule], facts: object) -> Rule:
    return next(rule for rule in rules if rule.holds(facts))


# -- a rank failed ----------------------------------------------------------------------------


@dataclass
class Failure:
    """The facts of an attempt in which ranks exited non-zero. `places_of` dumps the stacks of
    the ranks it is given (asked only by a rule that needs them)."""

    snap: Snapshot
    oom: causes.OomWatch | None = None
    growth: Callable[[int], str | None] | None = None
    places_of: Callable[[list[int]], dict[int, Place]] | None = None

    @cached_property
    def errors(self) -> dict[int, protocol.ErrorRecord]:
        return {w.rank: w.error for w in self.snap.failed_ranks if w.error is not None}

    @cached_property
    def only_waited(self) -> bool:
        """Every failed rank failed waiting for a peer: the cause is a rank they waited for."""
        failed = self.snap.failed_ranks
        return bool(failed) and all(waited(w.error) for w in failed)

    @cached_property
    def victims(self) -> list[int]:
        return sorted(w.rank for w in self.snap.failed_ranks)

    @cached_property
    def ended_early(self) -> list[int]:
        """Ranks that exited 0 before the first failed rank gave up waiting."""
        if not self.only_waited:
            return []
        first = min(e.time for e in self.errors.values())
        return sorted(
            w.rank for w in self.snap.ranks if w.exit_code == 0 and _ended_at(w) <= first + 0.5
        )

    @cached_property
    def collectives(self) -> dict[int, int] | None:
        counts = _counts(self.snap.ranks, _collectives)
        return counts if counts is not None and len(set(counts.values())) > 1 else None

    @cached_property
    def steps(self) -> dict[int, int] | None:
        return _counts(self.snap.ranks, _steps)

    @property
    def same_steps(self) -> bool:
        steps = self.steps
        if not steps:
            return False
        return len(set(steps.values())) == 1 and bool(next(iter(steps.values())))

    @cached_property
    def busy(self) -> tuple[int, Place] | None:
        """The live rank the failed ones waited for: one that is not itself waiting (a rank
        with a place before one that gave no stack: it may be exiting)."""
        alive = [w.rank for w in self.snap.ranks if w.exit_code is None and w.error is None]
        if not self.only_waited or self.ended_early or not alive or self.places_of is None:
            return None
        places = self.places_of(alive)
        busy = [r for r, place in places.items() if not place.waits]
        if not busy:
            return None
        busy.sort(key=lambda r: (places[r].doing is Doing.NO_STACK, r))
        return busy[0], places[busy[0]]

    @cached_property
    def root_and_others_killed(self) -> tuple[RankView, list[RankView]]:
        """The first to fail (a rank whose error says a peer failed first counts last; of
        ranks that failed the same way at once, the lowest; of ranks the OOM killer ended at
        once, the one that held most), and the others SIGKILLed with it."""
        failed, errors = self.snap.failed_ranks, self.errors
        root = min(failed, key=lambda w: self._order(w))
        first = errors.get(root.rank)
        if first is not None:
            same = [
                w
                for w in failed
                if (e := errors.get(w.rank)) is not None
                and causes.same_error(e, first)
                and e.time - first.time < causes.SAME_MOMENT
            ]
            root = min(same, key=lambda w: w.rank)
        if self.oom is not None and root.exit_code == -signal.SIGKILL and root.rank not in errors:
            return causes.the_one_that_held_most(root, failed, errors, self.oom)
        return root, []

    def _order(self, w: RankView) -> tuple[bool, float]:
        error = self.errors.get(w.rank)
        if error is None:
            return False, w.ended_wall
        return any(word in error.message for word in protocol.VICTIM_WORDS), error.time

    @property
    def root(self) -> RankView:
        return self.root_and_others_killed[0]

    @property
    def root_error(self) -> protocol.ErrorRecord | None:
        return self.errors.get(self.root.rank)

    @property
    def root_code(self) -> int:
        return self.root.code or 0

    @cached_property
    def killed_by_oom(self) -> bool:
        code, error = self.root_code, self.root_error
        killed = {self.root.pid} if code == -signal.SIGKILL else causes.killed_worker_pids(error)
        return bool(killed) and self.oom is not None and self.oom.killed(killed)

    @property
    def out_of_gpu_memory(self) -> bool:
        return self.root_error is not None and self.root.memory is not None


def _exit_words(f: Failure) -> str:
    """'rank 1 exited with code 1 (ValueError: bad sample 17) at train.py:41'."""
    root, code, error = f.root, f.root_code, f.root_error
    said = f"rank {root.rank} {causes.describe_exit(root.exit_code)}"
    if root.exit_code is None:  # it hung on after its error (tearing down NCCL, say)
        said = f"rank {root.rank} failed (code {code}) and had not exited after its error"
    if code < 0 and -code in causes.FATAL and (site := causes.fault_site(root.fault)):
        said += f" at {site}"
    return said + _error_words(error)


def _error_words(error: protocol.ErrorRecord | None) -> str:
    if error is None:
        return ""
    site = causes.error_site(error)
    return f" ({causes.error_text(error)})" + (f" at {site}" if site else "")


def _ran_out(f: Failure) -> tuple[str, str]:
    steps, counts = f.steps, f.collectives
    also = f" or called different numbers of collectives ({_per_rank(counts)})" if counts else ""
    ran = f" ({_per_rank(steps)} steps)" if steps and len(set(steps.values())) > 1 else ""
    return (
        f"{_ended(f)}: the ranks ran different numbers of steps{ran} (uneven inputs){also}",
        "give every rank the same number of batches: s.loader(...) shards evenly (its "
        "DistributedSampler pads), or DistributedSampler(drop_last=True), or run the loop "
        "inside torch.distributed.algorithms.Join([model]) for inputs that stay uneven"
        + ("; and the same collectives on every rank" if counts else ""),
    )


def _uneven_collectives(f: Failure) -> tuple[str, str]:
    steps, counts = f.steps or {}, f.collectives or {}
    return (
        f"{_ended(f)}: every rank ran {next(iter(steps.values()))} steps, but the ranks "
        f"called different numbers of collectives ({_per_rank(counts)})",
        "every rank must call the same collectives in the same order; look for one inside a "
        "branch that only some ranks take (if rank == 0: ...)",
    )


def _ended(f: Failure) -> str:
    ranks, victims = f.ended_early, f.victims
    return (
        f"rank{_s(ranks)} {ranks_text(ranks)} ended (exit code 0) while rank{_s(victims)} "
        f"{ranks_text(victims)} still waited for {'them' if len(ranks) > 1 else 'it'}"
        f"{_victims_place(f.snap.only(victims))}"
    )


def _kept_waiting(f: Failure) -> tuple[str, str]:
    assert f.busy is not None
    rank, place = f.busy
    at = f" ({place.site})" if place.site else ""
    timed_out = any("imed out" in e.message for e in f.errors.values())  # torch's words
    how = "timed out waiting for it" if timed_out else "lost their connection waiting for it"
    victims = f.victims
    return (
        f"rank {rank} kept the others waiting: it {place.past()}{at} when rank{_s(victims)} "
        f"{ranks_text(victims)} {how}{_victims_place(f.snap.only(victims))}",
        f"if rank {rank} legitimately takes this long, raise the process group's timeout "
        "(ddpkit.setup(timeout=...), init_process_group(timeout=...)); or let every rank do "
        "its share of that work, so none waits alone",
    )


def _gpu_out_of_memory(f: Failure) -> tuple[str, str]:
    root, error, facts = f.root, f.root_error, f.root.memory
    assert error is not None
    assert facts is not None
    grew = f.growth(root.rank) if f.growth is not None else None
    grew = grew or oom_verdict.grew_before(facts)  # a leak faster than the launcher's watch
    summary, fix = oom_verdict.verdict(facts, root.rank, causes.error_site(error), grew)
    if root.memory_snapshot:
        state_dir = f.snap.state_dir
        fix += (
            "\n  memory snapshot: "
            f"{protocol.state_path(state_dir, root.rank, protocol.MEMORY_SNAPSHOT)} (open it in "
            "https://pytorch.org/memory_viz); plot: "
            f"{protocol.state_path(state_dir, root.rank, protocol.MEMORY_PLOT)}"
        )
    return summary, fix


def _killed_by_oom(f: Failure) -> tuple[str, str]:
    assert f.oom is not None
    root, others = f.root_and_others_killed
    said = f"rank {root.rank} {f.oom.text(root.rss)}"
    for other in others:
        held = causes.gib(other.rss)
        said += f"; rank {other.rank} was SIGKILLed the same moment (it held {held})"
    return said + _error_words(f.root_error), causes.OOM_FIX


def _exited(f: Failure) -> tuple[str, str]:
    error = f.root_error
    return _exit_words(f), error.fix if error is not None else ""


def _uneven(f: Failure) -> bool:
    return bool(f.ended_early and f.collectives) and f.same_steps


def _fatal(f: Failure) -> bool:
    return f.root_code < 0 and -f.root_code in causes.FATAL


# in order: the rank others waited for, when every failed rank only waited; then the first
# rank to fail, by what ended it
FAILED: tuple[Rule, ...] = (
    Rule(Kind.UNEVEN_COLLECTIVES, _uneven, _uneven_collectives),
    Rule(Kind.RAN_OUT_OF_BATCHES, lambda f: bool(f.ended_early), _ran_out),
    Rule(Kind.KEPT_WAITING, lambda f: f.busy is not None, _kept_waiting),
    Rule(Kind.GPU_OUT_OF_MEMORY, lambda f: f.out_of_gpu_memory, _gpu_out_of_memory),
    Rule(Kind.KILLED_BY_OOM, lambda f: f.killed_by_oom, _killed_by_oom),
    Rule(Kind.FATAL_SIGNAL, _fatal, _exited),
    Rule(Kind.RAISED, lambda f: f.root_error is not None, _exited),
    Rule(Kind.EXITED, lambda f: True, _exited),
)  # fmt: skip
WAITED_FOR = (Kind.UNEVEN_COLLECTIVES, Kind.RAN_OUT_OF_BATCHES, Kind.KEPT_WAITING)


def failed(f: Failure) -> Cause:
    """Why ranks exited non-zero: the first row of FAILED that holds."""
    rule = first_rule(FAILED, f)
    summary, fix = rule.says(f)
    code = causes.exit_code_of(f.root_code)
    if rule.kind in WAITED_FOR:  # the rank they waited for is the cause; they, its victims
        rank = f.ended_early[0] if f.ended_early else f.busy[0] if f.busy else f.root.rank
        victims = tuple(f.victims)
        return Cause(rule.kind, rank, summary, fix, code, victims, details=_victim_lines(f))
    victim = f._order(f.root)[0] is True
    return Cause(rule.kind, f.root.rank, summary, fix, code, victim=victim)


def _victim_lines(f: Failure) -> str:
    lines = []
    for rank in f.victims:
        error = f.snap.of(rank).error
        if error is not None:
            message = error.message.strip().splitlines()[-1] if error.message else ""
            lines.append(f"  victim: rank {rank}: {error.type}: {causes.short(message)}")
    return "\n".join(lines)


# -- the ranks said their collectives differ (their output, read after they ended) -------------


def after_the_end(
    summary: str, said: Sequence[str], snap: Snapshot, roots: Sequence[Path]
) -> tuple[str, str] | None:
    """(summary, fix) once the ranks' last words are read, when torch said collectives
    differ: which rank called what, where the first report named only who failed first."""
    differ = mismatch.said_to_differ(said, snap)
    if differ is None:
        return None
    return f"{differ.line} (first reported: {summary})", mismatch.fix_line(differ, list(roots))


# -- the job hung -----------------------------------------------------------------------------


@dataclass
class Hang:
    """Every rank's place through a hang, and the collectives they wait in when they differ."""

    places: dict[int, Place]
    verdict: str  # the places said as one line (ddpkit.launch.hang.places.verdict)
    details: str
    stall: float
    window: Window
    differ: mismatch.Mismatch | None = None
    roots: Sequence[Path] = ()

    def doing(self, doing: Doing, code: int | None = None) -> bool:
        places = self.places.values()
        return any(p.doing is doing and (code is None or p.code == code) for p in places)


def _hang_advice(h: Hang) -> str:
    flag, now = h.window.flag()
    return (
        f"if a rank legitimately does no work this long (a sleep, a poll of a slow service), "
        f"raise {flag} (now {now:g} s); --hang-timeout 0 turns the watch off"
    )


def _stalled(h: Hang) -> str:
    return f"no rank made progress for {h.stall:.0f} s: {h.verdict}"


HUNG: tuple[Rule, ...] = (
    Rule(
        Kind.HUNG_IN_DIFFERENT_COLLECTIVES,
        lambda h: h.differ is not None,
        lambda h: (
            f"{h.differ.line} (no rank made progress for {h.stall:.0f} s)",
            mismatch.fix_line(h.differ, list(h.roots)),
        ),
    ),
    Rule(
        Kind.GPU_NEVER_FINISHED,
        lambda h: h.doing(Doing.WAITS_FOR_GPU),
        lambda h: (
            _stalled(h),
            "a GPU kernel never finished: a custom kernel that deadlocks or spins on a flag "
            "that never comes, an out-of-bounds index in a kernel, or a wedged GPU "
            "(nvidia-smi; the kernel log's Xid errors: dmesg | grep -i xid); "
            "CUDA_LAUNCH_BLOCKING=1 names the kernel; " + _hang_advice(h),
        ),
    ),
    Rule(
        Kind.HUNG_AFTER_A_RANK_ENDED,
        lambda h: h.doing(Doing.EXITED, code=0),
        lambda h: (
            _stalled(h),
            "a rank ended while the others still wait for it: the ranks ran different "
            "numbers of steps (uneven inputs); give every rank the same number of batches "
            "(s.loader, DistributedSampler(drop_last=True), or torch's Join); " + _hang_advice(h),
        ),
    ),
    Rule(Kind.HUNG, lambda h: True, lambda h: (_stalled(h), _hang_advice(h))),
)


def hung(h: Hang) -> Cause:
    rule = first_rule(HUNG, h)
    summary, fix = rule.says(h)
    when = f"  when: no rank did work for {h.stall:.0f} s; {h.window.basis()}"
    return Cause(rule.kind, None, summary, fix, HANG_EXIT_CODE, details="\n".join(
        line for line in (when, h.details) if line))  # fmt: skip


# -- the ranks never met at init --------------------------------------------------------------

INIT_FIX = (
    "let ddpkit run give init its world size, rank and address (init_process_group(backend) "
    "alone, or ddpkit.setup()); a script's own store or init_method='file://...' must be the "
    "same for every rank and fresh; raise --init-timeout if init is this slow at this scale"
)


def never_met(init: InitWait | None, details: str) -> Cause:
    """Ranks that never reached init while others waited there, or every rank in an init that
    never completed."""
    missing = init.missing if init is not None else []
    line = init.line if init is not None else "a rank never reached init"
    if missing:  # no one rank's output to show: where the missing ranks are is the details
        return Cause(Kind.MISSING_AT_INIT, None, line, details=details)
    return Cause(Kind.INIT_NEVER_COMPLETED, None, line, INIT_FIX, details=details)


# -- counting what the ranks did --------------------------------------------------------------


def _collectives(view: RankView) -> int | None:
    """Collectives the rank called through torch.distributed's Python functions (the one it
    waits in counted), from its progress record."""
    record = view.record
    if record is None:
        return None
    return record.finished + (1 if record.in_collective else 0)


def _steps(view: RankView) -> int | None:
    return view.steps.count if view.steps is not None else None


def _counts(
    workers: tuple[RankView, ...], count: Callable[[RankView], int | None]
) -> dict[int, int] | None:
    """rank -> a count, when every rank has one."""
    found = {w.rank: n for w in workers if (n := count(w)) is not None}
    return found if len(found) == len(workers) else None


def _per_rank(counts: dict[int, int]) -> str:
    """'rank 1: 6, ranks 0,2: 5'."""
    groups: dict[int, list[int]] = {}
    for rank, n in sorted(counts.items()):
        groups.setdefault(n, []).append(rank)
    return ", ".join(
        f"rank{_s(ranks)} {ranks_text(ranks)}: {n}"
        for n, ranks in sorted(groups.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    )


def _ended_at(w: RankView) -> float:
    """When a rank ended: as it said itself (the launcher may notice a while later)."""
    return w.ended[1] if w.ended is not None else w.ended_wall


def _victims_place(victims: tuple[RankView, ...]) -> str:
    """' in all_reduce (train.py:42)', from the victims' progress records."""
    for view in victims:
        record = view.record
        if record is not None and record.op:
            return f" in {record.op} ({record.site})"
    return ""


def _s(ranks: list[int]) -> str:
    return "s" if len(ranks) > 1 else ""

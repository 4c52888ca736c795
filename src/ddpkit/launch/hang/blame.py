"""The rank at fault when the first failure is a rank that waited: for a peer that had already
ended (uneven inputs: it ran out of batches and exited 0 while the others were mid-step), or
for a peer that was still working when the process group's timeout ran out (an evaluation on
one rank, a slow save). The ranks that failed waiting are listed as its victims.

`find_culprit` decides from a snapshot of the ranks (exit codes, error records, progress and
step records; taken with the step rings read); `places_of` is asked for the places of live ranks
only when the decision needs them (it dumps their stacks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ddpkit.common import protocol
from ddpkit.common.ranges import ranks_text
from ddpkit.launch.base.place import Doing, Place
from ddpkit.launch.base.snapshot import RankView, Snapshot

WAITING_WORDS = protocol.WAITING_WORDS  # a rank failed waiting for a peer


def waited(error: protocol.ErrorRecord | None) -> bool:
    return error is not None and any(word in error.message for word in WAITING_WORDS)


@dataclass(frozen=True)
class Culprit:
    rank: int
    summary: str  # the root cause line
    fix: str
    victims: list[int]


def find_culprit(
    snap: Snapshot,
    places_of: Callable[[list[int]], dict[int, Place]],
) -> Culprit | None:
    """The rank the failed ranks waited for, when every failed rank failed waiting."""
    workers = snap.ranks
    failed = snap.exited_nonzero
    errors = {w.rank: w.error for w in failed}
    if not failed or not all(waited(errors[w.rank]) for w in failed):
        return None
    first = min(e.time for e in errors.values() if e is not None)
    victims = sorted(w.rank for w in failed)
    where = _victims_place(snap.only(victims))
    early = [w for w in workers if w.exit_code == 0 and _ended_at(w) <= first + 0.5]
    if early:
        ranks = sorted(w.rank for w in early)
        ended = (
            f"rank{_s(ranks)} {ranks_text(ranks)} ended (exit code 0) while rank{_s(victims)} "
            f"{ranks_text(victims)} still waited for {_them(ranks)}{where}"
        )
        counts = _counts(workers, _collectives)
        if counts is not None and len(set(counts.values())) < 2:
            counts = None  # the same number on every rank (or none counted): nothing to say
        steps = _counts(workers, _steps)
        if counts and steps and len(set(steps.values())) == 1 and next(iter(steps.values())):
            return Culprit(
                ranks[0],
                f"{ended}: every rank ran {next(iter(steps.values()))} steps, but the ranks "
                f"called different numbers of collectives ({_per_rank(counts)})",
                "every rank must call the same collectives in the same order; look for one "
                "inside a branch that only some ranks take (if rank == 0: ...)",
                victims,
            )
        also = (
            f" or called different numbers of collectives ({_per_rank(counts)})" if counts else ""
        )
        ran = f" ({_per_rank(steps)} steps)" if steps and len(set(steps.values())) > 1 else ""
        return Culprit(
            ranks[0],
            f"{ended}: the ranks ran different numbers of steps{ran} (uneven inputs){also}",
            "give every rank the same number of batches: s.loader(...) shards evenly (its "
            "DistributedSampler pads), or DistributedSampler(drop_last=True), or run the loop "
            "inside torch.distributed.algorithms.Join([model]) for inputs that stay uneven"
            + ("; and the same collectives on every rank" if counts else ""),
            victims,
        )
    # a live rank that recorded an error is failing too, only slower to exit
    alive = [w.rank for w in workers if w.exit_code is None and w.error is None]
    if not alive:
        return None
    places = places_of(alive)
    busy = [r for r, place in places.items() if not place.waits]
    if not busy:
        return None
    # a rank with a place before one that gave no stack (it may be exiting)
    busy.sort(key=lambda r: (places[r].doing is Doing.NO_STACK, r))
    place = places[busy[0]]
    at = f" ({place.site})" if place.site else ""
    timed_out = any("imed out" in (e.message if e else "") for e in errors.values())
    how = "timed out waiting for it" if timed_out else "lost their connection waiting for it"
    return Culprit(
        busy[0],
        f"rank {busy[0]} kept the others waiting: it {place.past()}{at} when rank{_s(victims)} "
        f"{ranks_text(victims)} {how}{where}",
        f"if rank {busy[0]} legitimately takes this long, raise the process group's timeout "
        "(ddpkit.setup(timeout=...), init_process_group(timeout=...)); or let every rank do "
        "its share of that work, so none waits alone",
        victims,
    )


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


def _them(ranks: list[int]) -> str:
    return "them" if len(ranks) > 1 else "it"

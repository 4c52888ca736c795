"""Which rank holds the job back, and why: decided from sustained, relative evidence.

In synchronous data parallelism every step waits for the slowest rank, so every rank's step
takes as long; what differs is how long each spends on its own (waiting for data, computing,
the host's own time) before it waits for the others. A rank whose own time stays above
`threshold` times the median of the other ranks' is a straggler; the part of the step that is
slow is the one whose excess over the other ranks' explains most of the difference.

The decision is taken every evaluation (2 s) over each rank's last `window` steps (medians,
so one slow step does not count), and only after `SUSTAIN` evaluations in a row agree (an
episode starts); the episode ends after `SUSTAIN` in a row without it. The excess must also be
at least MIN_EXCESS of the step (a 1 ms difference on a 2 ms step is noise, not a straggler).
Pure functions of summaries: the launcher feeds them (ddpkit.launch.speed.step_watch).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ddpkit.launch.speed.evidence import RankFacts

PARTS = ("data", "compute", "host")  # the rank's own time; comm is waiting for the others
IDLE_SHARE = 0.5  # of the step its 'compute' takes: a CPU rank demanding less of a core waits
STARVED = 0.25  # cores' worth of run-queue wait beyond the others': a rank starved, not idle
SUSTAIN = 3  # evaluations in a row that start or end an episode
MIN_EXCESS = 0.05  # of the median step: the smallest excess called a straggler
MIN_STEPS = 8  # steps in a rank's window before it is judged


@dataclass(frozen=True)
class RankSummary:
    """One rank's last steps, as medians (seconds), and the facts beside them."""

    rank: int
    host: str
    steps: int  # steps in the window
    total: float
    data: float
    compute: float
    comm: float
    other: float  # the host's own time ("host" in the step record)
    total_p90: float = 0.0
    gpu: str = ""  # e.g. "GPU 3"
    facts: RankFacts = field(default_factory=RankFacts)  # NVML and host evidence

    @property
    def own(self) -> float:
        return self.data + self.compute + self.other

    def part(self, name: str) -> float:
        return {"data": self.data, "compute": self.compute, "host": self.other}[name]


@dataclass(frozen=True)
class Finding:
    rank: int
    part: str  # data, compute, host, or wait (its compute time spent asleep or blocked)
    factor: float  # the rank's part over the median of the others'
    share: float  # the part's share of the rank's step
    others_share: float  # the same for the median other rank
    own_factor: float  # the rank's own time over the median of the others'


def find(summaries: list[RankSummary], threshold: float) -> Finding | None:
    """The straggler now, if one rank's own time stands out (None for an even job)."""
    judged = [s for s in summaries if s.steps >= MIN_STEPS]
    if threshold <= 0 or len(judged) < 2:
        return None
    slowest = max(judged, key=lambda s: s.own)
    others = [s for s in judged if s is not slowest]
    own_median = statistics.median(s.own for s in others)
    step = statistics.median(s.total for s in judged)
    excess = slowest.own - own_median
    if own_median <= 0 or step <= 0:
        return None
    if slowest.own < threshold * own_median or excess < MIN_EXCESS * step:
        return None
    medians = {p: statistics.median(s.part(p) for s in others) for p in PARTS}
    part = max(PARTS, key=lambda p: slowest.part(p) - medians[p])
    if part == "compute" and idle(slowest, others):
        part = "wait"  # its 'compute' time went to sleeping or blocking: another cause
    mine = slowest.part("compute" if part == "wait" else part)
    medians["wait"] = medians["compute"]
    return Finding(
        rank=slowest.rank,
        part=part,
        factor=mine / medians[part] if medians[part] > 0 else float("inf"),
        share=mine / slowest.total if slowest.total > 0 else 0.0,
        others_share=statistics.median(
            s.part("compute" if part == "wait" else part) / s.total for s in others if s.total > 0
        )
        if any(s.total > 0 for s in others)
        else 0.0,
        own_factor=slowest.own / own_median,
    )


def idle(me: RankSummary, others: list[RankSummary]) -> bool:
    """A CPU rank whose extra 'compute' (the rest of its step, over the other ranks') was not
    spent computing: its main thread asked the kernel (running, or queued to run) for less
    than half of that extra time beyond what the others' main threads asked for (a sleep, a
    lock, a file, a subprocess). Compared with the others, since every rank's 'compute' may
    hold sleeps of its own (a loop that waits on a file each step); from demand, not CPU
    used, so a rank starved by a CPU hog or a loaded machine still computes; as does one whose
    main thread blocks on its own threads while they queue for a core (gloo's, doing its
    all-reduce, behind a hog: CI saw such a rank called idle). Its threads' run-queue wait
    is compared with the others' too: on a loaded machine every rank's threads queue."""
    queued = me.facts.get("cpu_queued")
    queues = [float(q) for o in others if (q := o.facts.get("cpu_queued")) is not None]
    if queued is not None and queues and float(queued) - statistics.median(queues) >= STARVED:
        return False
    demand = me.facts.get("cpu_demand")
    theirs = [float(d) for o in others if (d := o.facts.get("cpu_demand")) is not None]
    if me.facts.get("gpu") or demand is None or not theirs or me.total <= 0:
        return False
    extra = (me.compute - statistics.median(o.compute for o in others)) / me.total
    return extra >= 0.1 and float(demand) - statistics.median(theirs) < IDLE_SHARE * extra


@dataclass
class Episodes:
    """Turns evaluations into episodes: a line when one starts, a line when it ends. The same
    rank held back for another cause (its loader, then its compute) is a new episode that
    starts as the old one ends, not the rank being back at the job's pace."""

    threshold: float
    current: Finding | None = None
    _streak: int = 0
    _candidate: int | None = None
    _new_part: str | None = None  # the current rank's other cause, in a row `_changed` times
    _changed: int = 0

    def update(self, finding: Finding | None) -> tuple[str, Finding | None]:
        """("start", finding), ("end", the ended finding) or ("", None)."""
        if self.current is None:
            if finding is not None and finding.rank == self._candidate:
                self._streak += 1
            else:
                self._candidate = finding.rank if finding is not None else None
                self._streak = 1 if finding is not None else 0
            if self._streak >= SUSTAIN and finding is not None:
                self.current, self._streak = finding, 0
                return "start", finding
            return "", None
        if finding is not None and finding.rank == self.current.rank:
            if finding.part == self.current.part:
                self.current, self._streak, self._changed = finding, 0, 0
                return "", None
            # another cause is another episode
            self._changed = self._changed + 1 if finding.part == self._new_part else 1
            self._new_part = finding.part
        else:
            self._changed, self._new_part = 0, None
        self._streak += 1
        if self._changed >= SUSTAIN and finding is not None:
            self.current, self._streak, self._changed, self._new_part = finding, 0, 0, None
            return "start", finding
        if self._streak >= SUSTAIN:
            ended, self.current, self._streak = self.current, None, 0
            self._candidate = None
            return "end", ended
        return "", None

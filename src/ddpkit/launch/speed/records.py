"""The speed doctor's records, as they are written in JSON: a rank's row in `speed-live.json`
(what `ddpkit top` reads, each second) and in `speed.json` (the job's end), the memory figures
beside them, and the end report. Types only: the speed watch builds them, the end table and
`ddpkit top` read them."""

from __future__ import annotations

from typing import TypedDict

from ddpkit.launch.speed.evidence import RankFacts


class MemoryFigures(TypedDict, total=False):
    """A rank's memory, in bytes: on a GPU allocated, peak and reserved; on the CPU resident
    and peak. Empty before the first step that measured it."""

    allocated: int
    peak: int
    reserved: int
    resident: int


class Split(TypedDict):
    """Shares of a step's time (they add up to 1)."""

    data: float
    compute: float
    comm: float
    host: float


class LiveRow(TypedDict):
    rank: int
    host: str
    gpu: str
    steps: int  # steps in the window
    last_s: float
    median_s: float
    p90_s: float
    steps_per_s: float
    split: Split
    straggler: bool
    facts: RankFacts
    memory: MemoryFigures


class JobRow(TypedDict):
    rank: int
    host: str
    steps: int  # optimizer steps (the medians are over the timed ones)
    median_s: float
    p90_s: float
    total_s: float
    own_median: float
    split: Split
    memory: MemoryFigures


class Slowest(TypedDict):
    rank: int
    own_over_median: float | None
    cost_s: float
    cost_share: float


class Episode(TypedDict, total=False):
    """A straggler episode's start or end, as it was said."""

    start: float
    end: float
    rank: int
    line: str


class SpeedReport(TypedDict):
    """speed.json."""

    ranks: list[JobRow]
    slowest: Slowest
    episodes: list[Episode]
    threshold: float

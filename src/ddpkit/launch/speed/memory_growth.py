"""Memory per rank while the job runs (the memory doctor's watch): on a GPU, what torch holds
at each step's end (allocated, the peak so far, reserved: from the rank's step record); on the
CPU, the rank's process tree's resident memory (sampled by the hang watch). It says, once each:

* a rank whose peak stands out from the others' (`rank 0's peak 12.3 GiB stands out: the others
  9.1 GiB`), often another rank's CUDA context made on GPU 0;
* a rank whose memory grows step after step (a leak: `rank 2's GPU memory grows 12 MiB a step
  ...`), judged on a straight-line fit over the last LEAK_WINDOW samples.

`figures(rank)` is what the end table, `ddpkit top` and speed.json show.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

from ddpkit.common.units import size
from ddpkit.launch.speed.records import MemoryFigures

LEAK_WINDOW = 15  # samples (one a second) a leak is judged on
LEAK_MIN_BYTES = 64 * 2**20  # growth over the window below this is noise
LEAK_MIN_FIT = 0.9  # how straight the growth must be (R squared)
STANDOUT = 1.25  # a peak this many times the others' median stands out
STANDOUT_MIN_BYTES = 512 * 2**20


@dataclass
class RankMemory:
    gpu: bool = False
    now: int = 0  # bytes: allocated at the last step's end (GPU) or resident (CPU)
    peak: int = 0
    reserved: int = 0
    series: collections.deque[tuple[int, int]] = field(
        default_factory=lambda: collections.deque(maxlen=LEAK_WINDOW)
    )  # (steps done, bytes)
    said_leak: bool = False
    grew: str = ""  # the leak as said: '12 MiB a step, from 1.2 GiB to 2.4 GiB over 100 steps'


class MemoryWatch:
    def __init__(self) -> None:
        self.ranks: dict[int, RankMemory] = {}
        self.notes: list[str] = []
        self.said_standout = False

    def take(
        self,
        rank: int,
        steps: int,
        gpu: tuple[int, int, int] | None,
        rss: int,
        profiling: bool = False,
    ) -> None:
        """One sample of a rank: its step count and its memory (GPU figures, or None on the
        CPU, where the process tree's resident bytes count). While its profiler records
        (`ddpkit profile`), the memory it holds for its events is no leak: the growth is judged
        on the samples after the recording."""
        mine = self.ranks.setdefault(rank, RankMemory())
        if profiling:
            mine.series.clear()
        if gpu is not None and any(gpu):
            allocated, peak, reserved = gpu
            mine.gpu = True
            mine.now, mine.peak, mine.reserved = allocated, max(mine.peak, peak), reserved
        elif rss:
            mine.now, mine.peak = rss, max(mine.peak, rss)
        else:
            return
        if profiling:
            return
        if not mine.series or mine.series[-1][0] != steps:
            mine.series.append((steps, mine.now))
        self._look_for_a_leak(rank, mine)

    def look(self) -> None:
        """Once per job: a rank whose peak stands out from the others'."""
        if self.said_standout or len(self.ranks) < 2:
            return
        peaks = {r: m.peak for r, m in self.ranks.items() if m.peak}
        for rank, peak in peaks.items():
            others = [p for r, p in peaks.items() if r != rank]
            typical = statistics.median(others) if others else 0
            if typical and peak > STANDOUT * typical and peak - typical > STANDOUT_MIN_BYTES:
                self.said_standout = True
                gpu = self.ranks[rank].gpu
                why = (
                    " (another rank's CUDA context on this GPU? each rank calls "
                    "torch.cuda.set_device(LOCAL_RANK) before anything touches CUDA; "
                    "ddpkit.setup() does)"
                    if gpu
                    else ""
                )
                self.notes.append(
                    f"memory: rank {rank}'s peak {size(peak)} stands out (the others "
                    f"{size(typical)}){why}"
                )
                return

    def _look_for_a_leak(self, rank: int, mine: RankMemory) -> None:
        if mine.said_leak or len(mine.series) < LEAK_WINDOW:
            return
        xs = [float(s) for s, _ in mine.series]
        ys = [float(b) for _, b in mine.series]
        grown = ys[-1] - ys[0]
        if grown < LEAK_MIN_BYTES or xs[-1] <= xs[0]:
            return
        slope, fit = _line(xs, ys)
        if slope <= 0 or fit < LEAK_MIN_FIT:
            return
        mine.said_leak = True
        what = "GPU memory (allocated by torch)" if mine.gpu else "resident memory"
        mine.grew = (
            f"{size(slope)} a step, from {size(ys[0])} to {size(ys[-1])} over "
            f"{int(xs[-1] - xs[0])} steps"
        )
        self.notes.append(
            f"memory: rank {rank}'s {what} grows {size(slope)} a step, from {size(ys[0])} "
            f"to {size(ys[-1])} over the last {int(xs[-1] - xs[0])} steps: something keeps "
            "a tensor every step (a loss kept for logging without .item(), a list that grows, "
            "an evaluation outside torch.no_grad(), a graph kept by retain_graph)"
        )

    def growth(self, rank: int) -> str | None:
        """The rank's memory growth as the leak notice said it, if it was said."""
        mine = self.ranks.get(rank)
        return mine.grew if mine is not None and mine.grew else None

    def figures(self, rank: int) -> MemoryFigures:
        mine = self.ranks.get(rank)
        if mine is None:
            return {}
        if mine.gpu:
            return {"allocated": mine.now, "peak": mine.peak, "reserved": mine.reserved}
        return {"resident": mine.now, "peak": mine.peak}


def describe(figures: MemoryFigures) -> str:
    """'peak 3.1/4.0 GiB' (GPU: peak allocated / reserved) or 'rss 1.2 GiB' (CPU)."""
    if not figures:
        return "-"
    if "reserved" in figures:
        return f"{_gib(figures['peak'], unit=False)}/{_gib(figures['reserved'])}"
    return f"rss {_gib(figures['peak'])}"


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, R squared) of the least-squares line through the points."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    syy = sum((y - my) ** 2 for y in ys)
    if not sxx or not syy:
        return 0.0, 0.0
    slope = sxy / sxx
    return slope, (sxy * sxy) / (sxx * syy)


def _gib(n: float, unit: bool = True) -> str:
    return f"{n / 2**30:.1f}" + (" GiB" if unit else "")


def _size(n: float) -> str:
    return size(n)

"""How long a stall must last to be a hang: as soon as is safe for this job, learned from it.

A stall is time in which no rank did work (ddpkit.launch.hang.progress_watch says what work
is). A job of short steps that stalls for `--hang-min` seconds (20 by default) is hung. A job
whose own steps are long, or that came back by itself from long quiet stretches before, is
given more: STEPS_AHEAD times its longest recent step, QUIET_AHEAD times its longest quiet
stretch that ended in work. `--hang-timeout` bounds it all from above. Only the bound applies
until every rank has finished init_process_group (the init watch and --init-timeout have
that), and on NCCL until the first collective completed (NCCL connects the ranks inside it:
minutes on thousands of GPUs).

Pure: `learn` takes what one look saw and returns the next state; `window` says the seconds
and what they rest on, for the verdict to say.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

STEPS_AHEAD = 3.0  # a stall this many times the job's longest recent step
QUIET_AHEAD = 2.0  # a stall this many times the longest quiet stretch the job came back from
RECENT = 50  # the steps and the quiet stretches remembered
QUIET_WORTH = 1.0  # a quiet stretch shorter than this (a look or two) is no evidence


@dataclass(frozen=True)
class Learned:
    """What the job showed of itself so far."""

    steps: tuple[float, ...] = ()  # seconds of each recent step (optimizer step to step)
    quiet: tuple[float, ...] = ()  # seconds of each recent quiet stretch that ended in work
    met: bool = False  # every rank finished init_process_group
    connected: bool = False  # a collective completed: NCCL's ranks are connected


@dataclass(frozen=True)
class Window:
    """The stall that makes a hang, and what it rests on."""

    seconds: float
    least: float  # --hang-min
    bound: float  # --hang-timeout
    step: float | None = None  # the job's longest recent step, once one was timed
    quiet: float | None = None  # its longest quiet stretch that ended in work, if any
    # why only the bound applies: "init" (a rank had not finished init_process_group),
    # "nccl" (no NCCL collective had completed), or "" (it does not)
    before: str = ""

    def flag(self) -> tuple[str, float]:
        """The option that set the window, and its value: the one to raise."""
        if self.seconds >= self.bound:
            return "--hang-timeout", self.bound
        return "--hang-min", self.least

    def basis(self) -> str:
        """'a hang after 20 s: this job's steps take at most 0.05 s, ...' for the report."""
        if self.before == "init":
            return (
                f"a hang after {self.seconds:g} s (--hang-timeout): not every rank had finished "
                "init_process_group"
            )
        if self.before == "nccl":
            return (
                f"a hang after {self.seconds:g} s (--hang-timeout): no NCCL collective had "
                "completed yet, and NCCL connects the ranks inside the first one"
            )
        learned = []
        if self.step is not None:
            learned.append(f"its steps took at most {_secs(self.step)} (the last {RECENT})")
        if self.quiet is not None:
            learned.append(f"its longest quiet stretch that ended in work was {_secs(self.quiet)}")
        why = "; ".join(learned) if learned else "no step of it was timed yet"
        if self.seconds >= self.bound:
            rule = "--hang-timeout"
        elif self.seconds <= self.least:
            rule = "--hang-min"
        else:
            rule = "learned from this job"
        return f"a hang after {self.seconds:.0f} s ({rule}): {why}"


def _secs(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.0f} s"


def learn(
    before: Learned, steps: list[float], stall: float, worked: bool, met: bool, completed: bool
) -> Learned:
    """The next state: `steps` the seconds of the steps timed since the last look (the
    slowest rank's, step by step), `stall` the quiet stretch up to this look, `worked`
    whether a rank worked in it, `met` whether every rank has finished init, `completed`
    whether a rank has completed a collective."""
    learned = replace(before, met=before.met or met, connected=before.connected or completed)
    if worked and stall >= QUIET_WORTH:
        learned = replace(learned, quiet=(*learned.quiet, stall)[-RECENT:])
    if steps:
        learned = replace(learned, steps=(*learned.steps, *steps)[-RECENT:])
    return learned


def window(learned: Learned, least: float, bound: float, nccl: bool) -> Window:
    """The stall that makes a hang now."""
    if not learned.met:
        return Window(bound, least, bound, before="init")
    if nccl and not learned.connected:
        return Window(bound, least, bound, before="nccl")
    step = max(learned.steps) if learned.steps else None
    quiet = max(learned.quiet) if learned.quiet else None
    wanted = max(least, STEPS_AHEAD * (step or 0.0), QUIET_AHEAD * (quiet or 0.0))
    return Window(min(bound, wanted), least, bound, step, quiet)

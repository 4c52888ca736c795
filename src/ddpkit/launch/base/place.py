"""Where a rank is, as a value: what it does there (`Doing`, with its details) and the line of
code. The hang doctor decides a place from a rank's stack and records (`places.where`); the
diagnosis's rules and the other nodes read the value, never its words. The words are made
here, once, for the line that says them: a verdict groups ranks by them ('ranks 0,2 wait in
all_reduce'), a culprit's line puts them in the past ('it was at evaluate').
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class Doing(Enum):
    EXITED = "exited"  # code
    WAITS_IN = "waits in"  # op: a collective, or FSDP's own ("FSDP's all-gather")
    IN_INIT = "in init"  # init_process_group
    WAITS_FOR_BATCH = "waits for a batch"  # a DataLoader's
    IN_BACKWARD = "in backward"  # a live job's rank computing gradients
    ELSEWHERE = "elsewhere"  # func: in the script's own code
    STOPPED = "stopped"  # pid: SIGSTOP, SIGTSTP, Ctrl+Z
    TRACED = "traced"  # tracer: stopped by a debugger
    AT_PROMPT = "at a prompt"  # a debugger's (pdb)
    HOLDS_GIL = "holds the GIL"  # seconds, func: C code that never lets Python run
    WAITS_FOR_GPU = "waits for its GPU"  # seconds, gpu and busy (None: NVML absent)
    NO_STACK = "no stack"  # the rank did not answer
    NODE_SILENT = "node silent"  # its node did not say where its ranks are


# the places where a rank waits for something else (a peer, its loader, its GPU): not the
# rank that keeps the others waiting
WAITING = frozenset({Doing.WAITS_IN, Doing.IN_INIT, Doing.WAITS_FOR_BATCH, Doing.WAITS_FOR_GPU})

_SAID_WITH_IS = frozenset({Doing.IN_BACKWARD, Doing.STOPPED, Doing.TRACED, Doing.AT_PROMPT})


@dataclass(frozen=True)
class Place:
    doing: Doing
    site: str = ""  # 'train.py:42', or a framework's line and the script's that called it
    op: str = ""  # WAITS_IN
    func: str = ""  # ELSEWHERE; HOLDS_GIL: the C function called
    code: int | None = None  # EXITED
    pid: int = 0  # STOPPED: the pid `kill -CONT` takes
    tracer: str = ""  # TRACED: '77 (gdb)'
    seconds: float = 0.0  # HOLDS_GIL, WAITS_FOR_GPU: how long so far
    gpu: int | None = None  # WAITS_FOR_GPU: its index, when NVML reads it
    busy: int = 0  # WAITS_FOR_GPU: its utilisation, percent

    @property
    def waits(self) -> bool:
        return self.doing in WAITING

    @property
    def stopped(self) -> bool:
        """A stopped process runs no handler: it answers no question."""
        return self.doing in (Doing.STOPPED, Doing.TRACED)

    @property
    def collective(self) -> str | None:
        """The collective a waiting rank is in (for a mismatch): None elsewhere."""
        return self.op if self.doing is Doing.WAITS_IN else None

    def at(self, site: str) -> Place:
        return Place(**{**asdict(self), "site": site})

    def words(self, ranks: int = 1) -> str:
        """What the rank does, with a verb for one rank or several: 'waits in all_reduce'."""
        one = ranks == 1
        is_, has, verb_s = ("is", "has", "s") if one else ("are", "have", "")
        d = self.doing
        if d is Doing.EXITED:
            return f"{has} exited (code {self.code})"
        if d is Doing.WAITS_IN:
            return f"wait{verb_s} in {self.op}"
        if d is Doing.IN_INIT:
            return f"wait{verb_s} in init_process_group"
        if d is Doing.WAITS_FOR_BATCH:
            return f"wait{verb_s} for a DataLoader batch"
        if d is Doing.IN_BACKWARD:
            return f"{is_} in backward"
        if d is Doing.ELSEWHERE:
            return f"{is_} elsewhere: {self.func}"
        if d is Doing.STOPPED:
            return f"{is_} stopped (SIGSTOP, SIGTSTP or Ctrl+Z; `kill -CONT {self.pid}` resumes it)"
        if d is Doing.TRACED:
            return f"{is_} stopped by a debugger: pid {self.tracer} traces it"
        if d is Doing.AT_PROMPT:
            return f"{is_} at a prompt (a debugger's or input())"
        if d is Doing.HOLDS_GIL:
            called = f": {self.func}" if self.func else ""
            return f"hold{verb_s} the GIL in C code for {self.seconds:.0f} s{called}"
        if d is Doing.WAITS_FOR_GPU:
            if self.gpu is None:
                return (
                    f"wait{verb_s} for its GPU, for {self.seconds:.0f} s with no step ended (its "
                    "utilisation is unknown here: pip install nvidia-ml-py)"
                )
            return (
                f"wait{verb_s} for GPU {self.gpu}, busy for {self.seconds:.0f} s with no step "
                f"ended ({self.busy}% utilised)"
            )
        if d is Doing.NODE_SILENT:
            return "did not answer"
        return "gave no stack"

    def past(self) -> str:
        """What the rank was doing, for the line that names it: 'was at evaluate'."""
        if self.doing is Doing.ELSEWHERE:
            return f"was at {self.func}"
        if self.doing in _SAID_WITH_IS:
            return "was" + self.words().removeprefix("is")
        return self.words()

    def as_json(self) -> dict[str, Any]:
        """For another node (the hang report gathers every node's places)."""
        return {**asdict(self), "doing": self.doing.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Place:
        return cls(**{**data, "doing": Doing(data["doing"])})

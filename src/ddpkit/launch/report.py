"""What happened to a job, in a few lines: the root-cause rank, how it ended, and its last
words (stderr tail), followed by the other ranks and where the logs are.

Which rank is the root cause, why, and the fix are decided by the rules of
ddpkit.launch.diagnosis (a `Cause`); this module writes the outcome down, once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.common.ranges import ranks_text
from ddpkit.launch import diagnosis
from ddpkit.launch.base.rundir import open_private
from ddpkit.launch.base.snapshot import Snapshot
from ddpkit.launch.base.worker import Worker
from ddpkit.launch.causes import describe_exit
from ddpkit.launch.diagnosis import HANG_EXIT_CODE, Cause, Kind
from ddpkit.launch.peers.liveness import Abort


@dataclass(frozen=True)
class Ended:
    """How a job ended: its exit code, its run folder and the outcome reported (None when it
    ended before any attempt started)."""

    exit_code: int
    run_dir: Path | None = None
    outcome: Outcome | None = None


@dataclass(frozen=True)
class Outcome:
    ok: bool
    exit_code: int
    summary: str = ""
    interrupted: bool = False
    root_rank: int | None = None
    details: str = ""
    restartable: bool = True  # --max-restarts may start the group again after this
    from_node: int | None = None  # another node said why (its Abort); None: this node knows
    victim: bool = False  # every failed rank lost a peer: the cause may be on another node
    membership: bool = False  # nodes joined (--nnodes MIN:MAX): a new round, not a failure
    grace: float = 0.0  # seconds the ranks were given to end after the launcher's signal
    fix: str = ""  # what the user can do, when ddpkit knows
    victims: list[int] | None = None  # ranks that failed only because of the root cause
    kind: Kind | None = None  # the diagnosis's row, when it named the cause
    title: str = ""  # 'the job failed', once finalized
    lines: tuple[str, ...] = ()  # the report's lines under its title

    @classmethod
    def success(cls) -> Outcome:
        return cls(ok=True, exit_code=0)

    @classmethod
    def interrupted_by(cls, name: str, code: int) -> Outcome:
        return cls(
            ok=False,
            exit_code=code,
            interrupted=True,
            restartable=False,
            summary=f"stopped by {name}",
        )

    @classmethod
    def of(cls, cause: Cause) -> Outcome:
        """A failure, a hang or ranks that never met, as ddpkit.launch.diagnosis named it."""
        return cls(
            ok=False,
            exit_code=cause.exit_code,
            summary=cause.summary,
            root_rank=cause.rank,
            details=cause.details,
            victim=cause.victim,
            fix=cause.fix,
            victims=list(cause.victims) or None,
            kind=cause.kind,
        )

    @classmethod
    def launcher_failure(cls, summary: str) -> Outcome:
        return cls(ok=False, exit_code=1, summary=summary)

    @classmethod
    def node_lost(cls, summary: str, goes_on: bool = False) -> Outcome:
        """Another node is gone (or node 0 is, to this node): the job ends, or, with --nnodes
        MIN:MAX and enough nodes left, the others meet again without it (a restart)."""
        return cls(ok=False, exit_code=1, summary=summary, restartable=goes_on)

    @classmethod
    def other_node(cls, abort: Abort) -> Outcome:
        """Another node stopped the job and published why (a `liveness.Abort`)."""
        return cls(
            ok=False,
            exit_code=abort.code,
            summary=abort.why,
            restartable=abort.restart,
            from_node=abort.node,
            membership=abort.membership,
        )

    def finalize(
        self,
        workers: list[Worker],
        snap: Snapshot,
        run_dir: Path,
        roots: Sequence[Path] = (),
        grace: float = 0.0,
    ) -> Outcome:
        """The outcome as reported, written down once the outputs are closed (the console's
        text and run_dir/report.txt): `snap`, the ranks as they ended; `roots`, where the
        script's files are (to find the branch of a collective mismatch); `grace`, what the
        ranks were given to end after the launcher's signal."""
        if self.ok:
            return self
        summary, fix = self.summary, self.fix
        said = [line for w in workers for line in w.output.last_lines]
        refined = diagnosis.after_the_end(summary, said, snap, [*roots, Path.cwd()])
        if refined is not None:
            summary, fix = refined
        if self.interrupted and self.from_node is None:
            summary = f"{summary}, forwarded to every rank: {how_ranks_ended(workers, grace)}"
        title = "the job hung" if self.exit_code == HANG_EXIT_CODE else "the job failed"
        if self.interrupted:
            title = "the job was stopped"
        elif self.from_node is not None:
            title += f" on node {self.from_node}"
        lines = [f"  root cause: {summary}"]
        if fix:
            lines.append(f"  fix: {fix}")
        if self.details:
            lines.append(self.details)
        lines += self._ranks_lines(workers, snap)
        logs_lost = [w.output.log_error for w in workers if w.output.log_error]
        if logs_lost:
            lines.append("  logs cut short: " + "; ".join(logs_lost))
        lines.append(f"  logs: {run_dir}")
        done = replace(self, summary=summary, fix=fix, grace=grace, title=title, lines=tuple(lines))
        try:
            with os.fdopen(open_private(run_dir / "report.txt"), "w") as f:
                f.write(done.text.lstrip("\n") + "\n")
        except OSError as err:  # a full disk must not hide the report on the console
            lines.append(f"  (report.txt not written: {err.strerror or err})")
            done = replace(done, lines=tuple(lines))
        return done

    def _ranks_lines(self, workers: list[Worker], snap: Snapshot) -> list[str]:
        """The root rank's last lines (when its traceback was not shown already) and how the
        other ranks ended."""
        lines = []
        root = next((w for w in workers if w.rank == self.root_rank), None)
        root_error = snap.of(root.rank).error if root is not None else None
        shown_above = root_error is not None and root_error.type != "SystemExit"
        if root is not None and not shown_above:  # a traceback is shown once, where it was said
            tail = list(root.output.last_lines)[-15:]
            if tail:
                lines.append(f"  last lines of rank {root.rank}'s output:")
                lines.extend(f"    | {line}" for line in tail)
        others: dict[str, list[int]] = {}
        for w in workers:
            if w is not root and not self.interrupted and w.rank not in (self.victims or ()):
                what = "stopped by ddpkit" if w.stopped else describe_exit(w.exit_code)
                error = snap.of(w.rank).error
                if root is not None and error and lost_a_peer(error.message):
                    what = f"lost the connection when rank {root.rank} failed (victim, not cause)"
                elif root_error and error and error.type == root_error.type:
                    what = f"failed the same way ({error.type})"
                others.setdefault(what, []).append(w.rank)
        if others:
            lines.append(
                "  other ranks: "
                + "; ".join(f"{ranks_text(ranks)} {what}" for what, ranks in others.items())
            )
        return lines

    @property
    def text(self) -> str:
        """The report as said at the job's end ("" before it is finalized)."""
        return self.render() if self.title else ""

    def render(self, attempt: str = "") -> str:
        """The report as said: at the job's end with its exit code; `attempt` ('attempt 1 of
        3') for a failure the job restarts after, which ends nothing yet."""
        head = f"ddpkit: {attempt}: {self.title}" if attempt else f"ddpkit: {self.title}"
        tail = [] if attempt else [f"  exit code: {self.exit_code}"]
        return "\n".join(["", head, *self.lines, *tail])


def lost_a_peer(message: str) -> bool:
    """A rank's error that says a peer went away (a victim's words, not a cause)."""
    return any(word in message for word in protocol.VICTIM_WORDS)


def how_ranks_ended(workers: list[Worker], grace: float) -> str:
    """After a forwarded stop signal: which ranks ended on their own (saved and left, or as
    the signal told them) and which the launcher killed when the grace was over."""
    if workers and all(w.exit_code == 0 for w in workers):
        return "every rank ended on its own (exit code 0)"
    groups: dict[str, list[int]] = {}
    for w in workers:
        if w.killed_at_once:
            what = "killed at once on a second Ctrl+C"
        elif w.stopped:
            what = f"had not ended after {grace:g} s: killed"
        elif w.exit_code == 0:
            what = "ended on its own (exit code 0)"
        elif w.exit_code == -signal.SIGINT:
            what = "ended on KeyboardInterrupt, as a script does on Ctrl+C (traceback in its log)"
        else:
            what = describe_exit(w.exit_code)
        groups.setdefault(what, []).append(w.rank)
    parts = []
    for what, ranks in groups.items():
        plural = len(ranks) > 1
        if plural:
            what = what.replace("its own", "their own").replace("in its log", "in their logs")
        parts.append(f"rank{'s' if plural else ''} {ranks_text(ranks)} {what}")
    return "; ".join(parts)

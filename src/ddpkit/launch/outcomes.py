"""What each verdict of the launcher makes: the outcome, with the evidence its report needs.

`COLLECTORS` is the table the supervisor consults when the step function says `Collect(verdict)`:
a verdict's collector waits for nothing it does not need (a stop signal cuts every wait short),
asks the ranks only what the report shows (their stacks in a hang, the places of live ranks a
failed rank waited for) and reads the ranks only through snapshots.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ddpkit.launch import causes, diagnosis, observe, report
from ddpkit.launch.base.config import LaunchConfig
from ddpkit.launch.base.decide import Verdict
from ddpkit.launch.base.output import CONSOLE
from ddpkit.launch.base.place import Place
from ddpkit.launch.base.snapshot import Reader, Snapshot
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.base.worker import Signals, Worker
from ddpkit.launch.hang import across_nodes, mismatch, places
from ddpkit.launch.hang.window import Window
from ddpkit.launch.peers.liveness import BEAT, Abort
from ddpkit.launch.peers.peers import Peers, wait_for_word

log = logging.getLogger(__name__)


@dataclass
class Scene:
    """What the collectors look at: the job's settings, its signals, this attempt's ranks."""

    cfg: LaunchConfig
    signals: Signals
    workers: list[Worker]
    reader: Reader
    peers: Peers
    growth: Callable[[int], str | None]  # the memory doctor's growth line for a rank
    # the steps a look read go to the speed watch, whoever looked: a look consumes them
    took_steps: Callable[[Snapshot], None] = lambda snap: None
    stall: float = 0.0  # seconds no rank made progress (the hang watch's)
    window: Window | None = None  # the stall that made it a hang, and what that rests on

    @property
    def wait(self) -> Wait:
        return Wait(self.signals.reason)

    def look(self, steps: bool | None = False, usage: bool | None = False) -> Snapshot:
        """Reap the workers that exited and look at every rank (a rank stuck after its error,
        while none exited non-zero, is failed in the snapshot with the code it chose)."""
        observe.reap(self.workers)
        return self._read(steps, usage)

    def _read(self, steps: bool | None, usage: bool | None) -> Snapshot:
        snap = self.reader.look(self.workers, steps=steps, usage=usage)
        if snap.stepped:
            self.took_steps(snap)
        return snap


def interrupted(scene: Scene) -> report.Outcome:
    name = signal.Signals(scene.signals.last).name
    return report.Outcome.interrupted_by(name, 128 + scene.signals.last)


def rank_failed(scene: Scene) -> report.Outcome:
    """Why ranks failed (ddpkit.launch.diagnosis), or another node's word when every failed
    rank lost a peer and the cause may be there."""
    snap = scene.look(steps=True)

    def places_of(ranks: list[int]) -> dict[int, Place]:
        return places.collect(scene.look().narrowed(ranks), hung=False, wait=scene.wait)[0]

    facts = diagnosis.Failure(snap, causes.OomWatch(), scene.growth, places_of)
    cause = diagnosis.failed(facts)
    log.debug("failed ranks %s; %s: rank %s", observe.failed(snap), cause.kind.name, cause.rank)
    if scene.peers.multi_node and cause.victim:  # the cause may be another node's
        word = wait_for_word(scene.peers, scene.wait, scene.cfg.node_timeout + BEAT)
        if isinstance(word, Abort):
            return report.Outcome.other_node(word)
        if isinstance(word, str):
            return report.Outcome.node_lost(word, scene.peers.lost_goes_on())
    return report.Outcome.of(cause)


def console_closed(scene: Scene) -> report.Outcome:
    return report.Outcome.launcher_failure(f"{CONSOLE.closed}; the job is stopped")


def other_node(scene: Scene) -> report.Outcome:
    word = scene.peers.word()
    if word is None:  # said, then taken back (a membership change already handled)
        lost = scene.peers.lost()
        goes_on = lost is not None and scene.peers.lost_goes_on()
        return report.Outcome.node_lost(lost or "another node stopped the job", goes_on)
    return report.Outcome.other_node(word)


def node_lost(scene: Scene) -> report.Outcome:
    peers = scene.peers
    return report.Outcome.node_lost(peers.lost() or "a node is gone", peers.lost_goes_on())


def success(scene: Scene) -> report.Outcome:
    return report.Outcome.success()


def hung(scene: Scene) -> report.Outcome:
    """The hang report: every rank's place (every node's, from node 0). A stop signal while it
    is collected cuts its waits short, so the launcher still ends within its grace."""
    found = places.evidence(scene.look(), wait=scene.wait)
    every, hosts, details = across_nodes.everywhere(
        scene.peers, found.places, found.details, scene.cfg.nproc_per_node, scene.wait
    )
    if scene.signals.count:
        return interrupted(scene)
    calls = places.calls_of(every, found.calls)
    facts = diagnosis.Hang(
        every,
        places.verdict(every, hosts),
        details,
        scene.stall,
        scene.window or Window(scene.cfg.hang_timeout, scene.cfg.hang_min, scene.cfg.hang_timeout),
        mismatch.find(calls) if calls else None,
        script_roots(scene.cfg),
    )
    return report.Outcome.of(diagnosis.hung(facts))


def missing_at_init(scene: Scene) -> report.Outcome:
    """Ranks that never reached init while others waited there (or every rank in an init that
    never completed): where the missing ranks are instead, as the hang doctor shows them."""
    snap = scene.look()
    missing = observe.missing_at_init(snap, scene.cfg.init_timeout)
    absent = [v.rank for v in snap.ranks if v.absent]
    shown = snap.narrowed(absent) if absent else snap
    details = places.collect(shown, False, scene.wait)[1]
    return report.Outcome.of(diagnosis.never_met(missing, details))


COLLECTORS: dict[Verdict, Callable[[Scene], report.Outcome]] = {
    Verdict.INTERRUPTED: interrupted,
    Verdict.RANK_FAILED: rank_failed,
    Verdict.CONSOLE_CLOSED: console_closed,
    Verdict.OTHER_NODE: other_node,
    Verdict.NODE_LOST: node_lost,
    Verdict.SUCCESS: success,
    Verdict.HUNG: hung,
    Verdict.MISSING_AT_INIT: missing_at_init,
}


def script_roots(cfg: LaunchConfig) -> list[Path]:
    """Where the script's files are: its folder, and the folder the job started in."""
    roots = [Path.cwd()]
    if cfg.kind == "script" or (cfg.kind == "function" and cfg.target.endswith(".py")):
        roots.insert(0, Path(cfg.target).resolve().parent)
    return roots

"""The hang watch's I/O, around its step function (`progress_watch.judge`, pure): the flight
recorders' answers read when a poll is due, NVML asked about ranks that stand still on a GPU,
the other nodes told of this node's progress, the recorders asked again for the next poll."""

from __future__ import annotations

from pathlib import Path

from ddpkit.launch.base.snapshot import Snapshot
from ddpkit.launch.hang import flight_dumps, places
from ddpkit.launch.hang.progress_watch import Finding, Seen, Watch, judge
from ddpkit.launch.peers.peers import Peers


def look(watch: Watch, snap: Snapshot, state_dir: Path, peers: Peers) -> tuple[Watch, Finding]:
    """One look of the hang watch: its next state and what it found."""
    if watch.timeout <= 0 or not snap.sampled:
        return watch, Finding()
    due = watch.flight_due(snap)
    seen = Seen(
        {v.rank: flight_dumps.answer(state_dir, v.rank) for v in snap.running if v.answers and due},
        frozenset(v.rank for v in snap.running if places.gpu_wait(v.record) is not None),
        peers.last_remote_progress(),
        peers.leads,
    )
    watch, found = judge(watch, snap, seen)
    if found.progressed:
        peers.progressed()
    for rank in found.ask_flight:
        flight_dumps.ask(state_dir, rank)
    return watch, found

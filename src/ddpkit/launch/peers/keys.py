"""The keys the nodes of one job use in its store once they have met (the meeting's own keys
are `ddpkit.launch.peers.nodes`'s). Each round's keys live under its prefix (a restart is a new
round on the same store, with static nodes).

Who writes what: every node its own `beat/N`, `progress/N` and `done/N` counters; any node the
`abort` record (why the job stops, signed with the job's token). A feature's keys are its own
module's (the hang doctor's places, the speed doctor's summaries, `ddpkit profile`'s plans)."""

from __future__ import annotations

ABORT = "abort"
COUNTERS = ("beat", "progress", "done")  # per node, made by node 0 before anyone reads them


def beat(node: int) -> str:
    return f"beat/{node}"


def progress(node: int) -> str:
    return f"progress/{node}"


def done(node: int) -> str:
    return f"done/{node}"


def counter(kind: str, node: int) -> str:
    return f"{kind}/{node}"

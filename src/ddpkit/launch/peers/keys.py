"""The keys the nodes of one job use in its store once they have met (the meeting's own keys
are `ddpkit.launch.peers.nodes`'s). Each round's keys live under its prefix (a restart is a new
round on the same store, with static nodes).

Who writes what: every node its own `beat/N`, `progress/N` and `done/N` counters, its
`node/N` registration and, when asked, its `places/N` (a hang) and `speed/N` (step
summaries); node 0 `run_id` and the `hang/ask` question; the node where `ddpkit profile` ran
the `profile/ask` plan, and every other node its ranks' answers to it (`profile/ID/armed/N`,
`profile/ID/done/N`); `ready`, once (compare-and-set), node 0
when the round is whole or any node that finds it came apart; any node the `abort` record (why
the job stops, signed with the job's token)."""

from __future__ import annotations

ABORT = "abort"
HANG_ASK = "hang/ask"
PROFILE_ASK = "profile/ask"  # the newest `ddpkit profile` plan (JSON), any node's
COUNTERS = ("beat", "progress", "done")  # per node, made by node 0 before anyone reads them


def beat(node: int) -> str:
    return f"beat/{node}"


def progress(node: int) -> str:
    return f"progress/{node}"


def done(node: int) -> str:
    return f"done/{node}"


def places(node: int) -> str:
    return f"hang/places/{node}"


def speed(node: int) -> str:
    return f"speed/{node}"


def counter(kind: str, node: int) -> str:
    return f"{kind}/{node}"


def profile_armed(plan: str, node: int) -> str:
    return f"profile/{plan}/armed/{node}"


def profile_done(plan: str, node: int) -> str:
    return f"profile/{plan}/done/{node}"

"""Asking one node's ranks to record a plan of steps with torch's profiler (`ddpkit profile`)
and reading what they wrote back: the one way, used by the command on its own node and by each
launcher for its ranks when the plan comes from another node (ddpkit.launch.peers.profile_relay).

A rank is armed through a plan file and the ask-and-answer helper (ddpkit.launch.base.asking); it
answers whether it will record (a rank already past the first step will not, and says so). At
the plan's last step, or when it ends, each rank writes its summary (rank<N>.profile-done)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.common import protocol
from ddpkit.launch.base import asking
from ddpkit.launch.base.wait import Wait

JsonDict = dict[str, Any]  # a plan, a rank's answer to one, or its summary (JSON)
ARM_WITHIN = 3.0  # seconds for every rank to answer the plan (they poll every 0.2 s)


def arm(plan: JsonDict, state_dirs: dict[int, Path], pids: dict[int, int]) -> dict[int, JsonDict]:
    """Hand every rank the plan and ask it to arm: rank -> its answer ({"armed": bool, "why"})."""
    for rank, state_dir in state_dirs.items():
        path = protocol.state_path(state_dir, rank, protocol.PROFILE_PLAN)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(plan))
        tmp.replace(path)
    question = asking.Question(protocol.PROFILE_ARMED, protocol.PROFILE_REQUEST)
    answers: dict[int, JsonDict] = {}
    for state_dir in set(state_dirs.values()):
        ranks = {r: pids[r] for r, d in state_dirs.items() if d == state_dir}
        answers.update(asking.collect(question, state_dir, ranks, Wait(), ARM_WITHIN, json.loads))
    return {r: answers.get(r, {"armed": False, "why": "no answer"}) for r in state_dirs}


def armed_file(folder: Path, node: int) -> Path:
    """Another node's ranks' answers to the plan, as its launcher sent them (profile_relay)."""
    return folder / f"node{node}.armed.json"


def done_file(folder: Path, node: int) -> Path:
    """Another node's end of the recording: its host, its traces' folder, ranks that ended."""
    return folder / f"node{node}.done.json"


@dataclass
class Progress:
    """Where the recording of one plan stands on this node, at one look."""

    done: dict[int, JsonDict] = field(default_factory=dict)  # rank -> its summary
    pending: list[int] = field(default_factory=list)  # still recording (or not yet begun)
    ended: list[int] = field(default_factory=list)  # ended without a summary


def look(plan_id: str, state_dirs: dict[int, Path], pids: dict[int, int]) -> Progress:
    seen = Progress()
    for rank, state_dir in state_dirs.items():
        try:
            done = json.loads(
                protocol.state_path(state_dir, rank, protocol.PROFILE_DONE).read_text()
            )
        except (OSError, ValueError):
            done = {}
        if done.get("plan", {}).get("id") == plan_id:
            seen.done[rank] = done
        elif _gone(pids[rank]):
            seen.ended.append(rank)
        else:
            seen.pending.append(rank)
    return seen


def _gone(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return True

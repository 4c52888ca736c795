"""`ddpkit profile` across nodes: the command runs on one node and records every node's ranks.

The command arms its own node's ranks and hands the plan to its launcher (ASK_FILE in the run
folder). That launcher puts it in the job's store (`profile/ask`); every other node's launcher
reads it at its next beat (`PlansChannel`, carried by ddpkit.launch.peers.liveness), arms its
own ranks with it (their traces go into its own run folder, under the same folder name) and puts
back their answers and, at the end, their summaries and timed steps. The first launcher writes
those into the recording's folder (`node<N>.armed.json`, `rank<R>.summary.json`,
`node<N>.done.json`), where the command reads them as it reads its own ranks'.

Each side runs in a thread of its own with its own bounded store client: the launcher's loop
never waits on another node. A node that does not answer is named by the command."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.launch.base import profile_ask
from ddpkit.launch.base.profile_ask import JsonDict, armed_file, done_file
from ddpkit.launch.peers.nodes import CALL_LIMIT, NodeGroup
from ddpkit.launch.peers.peers import Peers
from ddpkit.launch.peers.store import BoundedStore, StoreUnreachableError

ASK_FILE = "profile-ask.json"  # in the run folder: the command's plan for the other nodes
POLL = 0.25
log = logging.getLogger(__name__)

# this module's keys in the job's store: the newest plan (JSON, any node's), and each node's
# answers to it
ASK_KEY = "profile/ask"


def armed_key(plan: str, node: int) -> str:
    return f"profile/{plan}/armed/{node}"


def done_key(plan: str, node: int) -> str:
    return f"profile/{plan}/done/{node}"


class PlansChannel:
    """`ddpkit profile`'s plans published by any node, newest last, heard by the beat thread
    for the launcher's loop."""

    def __init__(self) -> None:
        self.asks: list[str] = []
        self._seen: str | None = None

    def beat(self, store: BoundedStore, node: int, beats: int) -> None:
        if store.has(ASK_KEY):
            text = store.get(ASK_KEY)
            if text != self._seen:
                self._seen = text
                self.asks.append(text)

    def asked(self) -> str | None:
        return self.asks.pop(0) if self.asks else None


def take(
    run_dir: Path, node: NodeGroup, peers: Peers, state_dir: Path, pids: dict[int, int]
) -> None:
    """The launcher's part, at each look: pass this node's command's plan on; arm this node's
    ranks with another node's."""
    ask = run_dir / ASK_FILE
    if ask.exists():
        with contextlib.suppress(OSError, ValueError):
            plan = json.loads(ask.read_text())
            ask.unlink()
            if node.multi_node and node.store is not None:
                _thread(_spread, node, plan)
    channel = peers.channel(PlansChannel)
    text = channel.asked() if channel is not None else None
    if text is not None:
        with contextlib.suppress(ValueError):
            plan = json.loads(text)
            if plan.get("origin") != node.group_rank:
                _thread(_answer, node, plan, run_dir, state_dir, dict(pids))


def _thread(target: Callable[..., None], *args: object) -> None:
    threading.Thread(target=target, args=args, daemon=True, name="ddpkit-profile").start()


def _client(node: NodeGroup) -> BoundedStore:
    assert node.store is not None
    return BoundedStore(node.store_addr, node.master_port, CALL_LIMIT, node.store.prefix)


def _deadline(plan: JsonDict) -> float:
    return time.monotonic() + float(plan.get("timeout", 600)) + 30


def _spread(node: NodeGroup, plan: JsonDict) -> None:
    """The command's node: publish the plan; copy every other node's answers into the folder."""
    folder = Path(plan["folder"])
    store = _client(node)
    armed = {n for n in range(node.nnodes) if n != node.group_rank}
    done = set(armed)
    try:
        store.set(ASK_KEY, json.dumps(plan))
        deadline = _deadline(plan)
        while (armed or done) and time.monotonic() < deadline:
            for n in sorted(armed):
                if store.has(armed_key(plan["id"], n)):
                    _write(armed_file(folder, n), store.get(armed_key(plan["id"], n)))
                    armed.discard(n)
            for n in sorted(done - armed):
                if store.has(done_key(plan["id"], n)):
                    record = json.loads(store.get(done_key(plan["id"], n)))
                    for rank, summary in record.pop("summaries").items():
                        _write(folder / f"rank{rank}.summary.json", json.dumps(summary))
                    _write(done_file(folder, n), json.dumps(record))
                    done.discard(n)
            time.sleep(POLL)
    except StoreUnreachableError as err:
        log.debug("profile %s: the store went away (%s)", plan["id"], err)
    finally:
        store.close()


def _answer(
    node: NodeGroup, plan: JsonDict, run_dir: Path, state_dir: Path, pids: dict[int, int]
) -> None:
    """Another node's plan: arm this node's ranks, say how that went, then send their summaries."""
    relayed = ("origin", "timeout")  # for the launchers, not the ranks
    mine = {k: v for k, v in plan.items() if k not in relayed}
    mine["folder"] = str(run_dir / Path(plan["folder"]).name)
    state_dirs = dict.fromkeys(pids, state_dir)
    me = node.group_rank
    store = _client(node)
    try:
        answers = profile_ask.arm(mine, state_dirs, pids)
        armed = {"host": node.host, "answers": {str(r): a for r, a in answers.items()}}
        store.set(armed_key(plan["id"], me), json.dumps(armed))
        deadline = _deadline(plan)
        seen = profile_ask.look(plan["id"], state_dirs, pids)
        while seen.pending and time.monotonic() < deadline:
            time.sleep(POLL)
            seen = profile_ask.look(plan["id"], state_dirs, pids)
        summaries = {str(r): _with_steps(s, state_dir, r) for r, s in seen.done.items()}
        record: JsonDict = {"host": node.host, "folder": mine["folder"], "summaries": summaries,
                  "ended": seen.ended, "pending": seen.pending}  # fmt: skip
        store.set(done_key(plan["id"], me), json.dumps(record))
    except StoreUnreachableError as err:
        log.debug("profile %s: the store went away (%s)", plan["id"], err)
    finally:
        store.close()


def _with_steps(summary: JsonDict, state_dir: Path, rank: int) -> JsonDict:
    """The summary with the rank's timed steps of the recording and as many before it (the
    breakdown's parts; the command cannot read another node's step records)."""
    first, count = summary["plan"]["first"], summary["plan"]["steps"]
    record = protocol.read_steps(state_dir, rank, since=0)
    rows = []
    if record is not None:
        rows = [list(astuple(s)) for s in record.steps
                if first - count < s.number <= first + count]  # fmt: skip
    return {**summary, "timed_steps": rows}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)

"""The last completed step, kept for a failure (issue 38, first part): when a peer fails, the
surviving ranks of a replicated job write the state of the last completed step, so the
restarted job's `s.load_state` goes on from there and no step is lost.

What is kept, and when. The objects are the ones the script last passed to `s.save_state` or
`s.load_state`. A step's boundary is the first batch an `s.loader` hands out after an
optimizer step (or after that call): the step before it is complete (its optimizer step, its
scheduler step, the counters the loop bumps) and the next has not begun. There each rank takes
a cheap snapshot: its random streams, every loader's place, copies of the dicts and of the
small stateful objects (schedulers, scalers, `s.fit`), and the model's buffers (a forward
updates BatchNorm's). The parameters and the optimizer need no copy: nothing changes them until
the next optimizer step begins, which closes the window. Whatever else the loop does inside the
window (its epoch-end work after the last batch, a scheduler stepped early, counters bumped)
changes only what the snapshot holds a copy of, so the resumed loop does it again exactly.

On a failure that waited for a peer (the bootstrap's error hook), or when the launcher asks
(a peer failed and this rank may never hear of it: under NCCL its collective with the lost peer
never returns; a dead peer's DataLoader workers hold its connections open), inside the window
this rank writes its part of a state in save_state's layout (ddpkit.train.state): its own
`rankN.pt`, and `shared.pt` by the first survivor to claim it, who also writes the parts of
this node's ranks that have none from the random streams each left in its file at the boundary
(ddpkit.train.rng_file), waits a moment for other nodes' parts and finishes the folder
atomically (COMPLETE, then the rename). A rank whose part is still missing (its node was lost)
is re-seeded at load with a notice. Outside the window nothing is written and the last regular
save is used.

`DDPKIT_NO_RESCUE=1` turns it off (nothing kept, no hook runs): for a step the host sets
that is so short (under ~20 ms) that the snapshot's ~0.1 ms shows (docs/recovery.md).

Asked by the launcher, the rank's answering thread does the writing (ddpkit.rank.answering):
the script's thread may be blocked in C code. It first stops the script's thread at its next
hook, for good (a step must not begin while the state is written; the launcher ends the process
once it has its answer), and under NCCL aborts the communicators (torch's abort), so that the
copies the write makes do not queue behind a collective that never ends.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddpkit.rank import runtime
from ddpkit.train import step_count
from ddpkit.train.placement import Placement

PARTS_WAIT = 3.0  # seconds the claiming survivor waits for the other survivors' parts
OFF = "DDPKIT_NO_RESCUE"  # =1: nothing kept, no hook's cost; a failure resumes from the last save


@dataclass
class Kept:
    """What a failure would write, and whether it can be vouched for now."""

    path: Path
    objects: dict[str, Any]
    place: Placement
    open: bool = False  # inside the window: the live parameters are the last step's
    # an optimizer step since the last boundary (the next fetch is one); none at first: until
    # the next step the state on disk (just saved or loaded) is this very one
    stepped: bool = False
    after_step: bytes | None = None  # the streams as the last optimizer step left them
    snapshot: dict[str, Any] = field(default_factory=dict)
    boundaries: int = 0
    base: int = 0  # the newest state when remembered: with `boundaries`, names a rescue
    # what each boundary copies: (name, how, target); worked out once, the boundary is hot
    plan: list[tuple[str, str, Any]] = field(default_factory=list)
    loaders: tuple[int, ...] = ()  # the ids of the s.loaders among the objects


@dataclass
class Rescue:
    """This rank's rescue, a part of its runtime (ddpkit.rank.runtime)."""

    kept: Kept | None = None
    live: Any = None  # a quick_rng.LiveStreams, made at the first snapshot
    file: Any = None  # this rank's rng_file.RngFile; False outside a run or when it cannot be made
    hooks: list[Any] = field(default_factory=list)  # its subscriptions to the step hub
    # the script's hooks and a rescue on the launcher's request, one at a time; once a rescue
    # has begun (halted) the script's thread waits in its next hook until the launcher ends
    # the process
    guard: threading.Lock = field(default_factory=threading.Lock)
    halted: bool = False
    once: threading.Lock = field(default_factory=threading.Lock)  # one rescue per process
    said: tuple[str, bool] | None = None  # what the rescue did, once it ran
    rescued: bool = False
    serving: bool = False  # the launcher's requests are answered (a rank of ddpkit run)
    buffer_lists: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def _part() -> Rescue:
    return runtime.current().part(Rescue)


def remember(path: str | os.PathLike[str], objects: Mapping[str, Any], place: Placement) -> None:
    """s.save_state / s.load_state: these objects are what a failure would write."""
    r = _part()
    from ddpkit.train.state import kind_of, sharded_part

    kinds = {name: kind_of(name, obj) for name, obj in objects.items()}
    if os.environ.get(OFF, "") not in ("", "0"):
        r.kept = None  # the user turned it off: a host-bound step too short for its cost
        return
    if place.world_size < 2 or sharded_part(objects, kinds) is not None:
        r.kept = None  # one rank has no peer; a lost shard has no replica to write it from
        return
    from ddpkit.train.state import latest_seq

    root = Path(path)
    base = latest_seq(root) if root.is_dir() else 0
    r.kept = Kept(root, dict(objects), place, base=base, plan=_plan(objects, kinds))
    r.kept.loaders = tuple(id(target) for _, how, target in r.kept.plan if how == "loader")
    r.buffer_lists.clear()  # walked again at the next boundary: the objects may be new
    if not r.hooks:
        from ddpkit.rank import failure

        if after_peer_failure not in failure.AFTER_A_PEER:
            failure.AFTER_A_PEER.append(after_peer_failure)
        hub = runtime.current().steps
        r.hooks += [hub.before(_step_begins), hub.after(_step_ended)]
    _serve_requests()


def forget() -> None:
    """Nothing kept, no rescue done, no hook left on the step hub: as a new process."""
    r = _part()
    r.close()
    r.kept, r.halted, r.rescued, r.said = None, False, False, None


def _enter() -> None:
    """Take the guard for one of the script's hooks. Once a rescue has begun the script's
    thread stays here: the launcher ends the process when the state is written."""
    r = _part()
    r.guard.acquire()
    if r.halted:
        r.guard.release()
        while True:
            time.sleep(3600)


def _step_begins(optimizer: Any) -> None:
    r = _part()
    if r.kept is None:
        return
    _enter()
    try:
        if r.kept is not None:
            r.kept.open = False
    finally:
        r.guard.release()


def _step_ended(optimizer: Any) -> None:
    r = _part()
    kept = r.kept
    if kept is None:
        return
    _enter()
    try:
        kept.stepped = True
        if _streams_file():  # in case this rank dies before its next fetch (rng_file)
            kept.after_step = _streams().payload()
            r.file.put(kept.base, kept.boundaries + 1, kept.after_step, fetched=False)
    finally:
        r.guard.release()


def before_fetch(loader: Any) -> None:
    """An s.loader is about to fetch a batch: at a step's boundary, take the snapshot."""
    r = _part()
    kept = r.kept
    if kept is None or not kept.stepped or id(loader) not in kept.loaders:
        return
    _enter()
    try:
        kept.stepped = False
        kept.snapshot = snap = _snapshot(kept.plan)
        kept.boundaries += 1
        after, kept.after_step = kept.after_step, None
        snap["moved"] = after is None or after != snap["streams"]
        if _streams_file():
            if snap["moved"]:
                r.file.put(kept.base, kept.boundaries, snap["streams"])
            else:
                r.file.mark_fetched(kept.boundaries)
        kept.open = True
    finally:
        r.guard.release()


def _serve_requests() -> None:
    """A rank of `ddpkit run` answers the launcher's request to write (once per process)."""
    from ddpkit.common import protocol

    r, here = _part(), runtime.current()
    if r.serving or not here.is_rank():  # outside a run, or a child of the rank
        return
    from ddpkit.rank import answering

    r.serving = True
    answering.answer(
        here.state_dir, here.rank or "0", protocol.RESCUE_REQUEST, protocol.RESCUE_DONE,
        _on_request,
    )  # fmt: skip
    here.path(protocol.RESCUE_READY).touch()


def _on_request() -> bytes:
    """The launcher's request, on the answering thread: a peer failed. Stop the script's thread
    at its next hook, abort NCCL, write; the answer is what was done, in words."""
    r = _part()
    with r.guard:
        r.halted = True
    kept = r.kept
    if kept is not None and kept.place.backend == "nccl":
        _abort_nccl(kept.place)
    did = after_peer_failure()
    if did is not None:
        from ddpkit.rank import failure

        failure.say(*did)
    said = r.said or ("nothing to write: no state of a completed step is kept", False)
    return said[0].encode()


def _abort_nccl(place: Placement) -> None:
    """The copies the write makes would queue behind the collective with the lost peer, which
    never ends: abort the communicators first (torch's abort). The device is per thread."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        torch.cuda.set_device(place.device)
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            abort()


def _streams_file() -> bool:
    """This rank keeps its streams in a file its node's survivors read (a rank of ddpkit run)."""
    r = _part()
    if r.file is None:
        from ddpkit.train import rng_file

        r.file = rng_file.mine() or False
    return bool(r.file)


def _streams() -> Any:
    r = _part()
    if r.live is None:
        from ddpkit.train.quick_rng import LiveStreams

        r.live = LiveStreams()
    return r.live


def _plan(objects: Mapping[str, Any], kinds: Mapping[str, str]) -> list[tuple[str, str, Any]]:
    from ddpkit.train.state import unwrapped

    plan = []
    for name, obj in objects.items():
        if kinds[name] in ("loader", "dict"):
            plan.append((name, kinds[name], obj))
        elif isinstance(unwrapped(obj), torch.nn.Module):
            plan.append((name, "buffers", unwrapped(obj)))
        elif not isinstance(obj, torch.optim.Optimizer):  # the optimizer's window is the step
            plan.append((name, "small", obj))
    return plan


def _snapshot(plan: list[tuple[str, str, Any]]) -> dict[str, Any]:
    snap: dict[str, Any] = {"loaders": {}, "small": {}, "buffers": {}, "dicts": {}}
    for name, how, target in plan:
        if how == "loader":
            snap["loaders"][name] = target.resume_state()
        elif how == "dict":
            snap["dicts"][name] = _copy(dict(target))
        elif how == "buffers":
            snap["buffers"][name] = _buffers_now(name, target)
        else:
            snap["small"][name] = _copy(target.state_dict())
    snap["streams"] = _streams().payload()
    snap["steps"] = step_count.done()
    return snap


def _copy(value: Any) -> Any:
    """A copy to keep: the pickled bytes (half of pickle's round trip, the hot half; `_kept_value`
    loads them at a rescue), or where pickle refuses (a lambda in a dict) copy's own deep copy."""
    try:
        return _Pickled(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
    except Exception:
        return copy.deepcopy(value)


@dataclass(frozen=True)
class _Pickled:
    data: bytes


def _kept_value(value: Any) -> Any:
    return pickle.loads(value.data) if isinstance(value, _Pickled) else value  # noqa: S301 (ours)


@dataclass
class _Buffers:
    """One model's buffers and their copies at the last boundary. Walking a model's modules
    costs ~1 us each (190 us for a ResNet-50's 159 buffers) and a copy per buffer is a kernel
    launch each: the list is walked once per `remember` and copied in one foreach call."""

    names: list[str]
    live: list[torch.Tensor]
    copies: list[torch.Tensor]


def _buffers_now(name: str, model: torch.nn.Module) -> _Buffers:
    r = _part()
    held = r.buffer_lists.get(name)
    if held is None:
        named = list(model.named_buffers())
        live = [b.detach() for _, b in named]
        held = _Buffers([n for n, _ in named], live, [b.clone() for b in live])
        r.buffer_lists[name] = held
    elif held.live:
        torch._foreach_copy_(held.copies, held.live)
    return held


def _write_part(tmp: Path, rank: int, part: dict[str, Any]) -> None:
    """rankN.pt whole or not at all: the rank itself and the claimer may both write it."""
    from ddpkit.train import state

    partial = tmp / f"rank{rank}.pt.{os.getpid()}.partial"
    state.write(partial, part)
    os.replace(partial, tmp / f"rank{rank}.pt")


def _parts_of_the_fallen(tmp: Path, kept: Kept, snap: dict[str, Any]) -> list[int]:
    """A rank of this node that wrote no part yet (the one that failed, one still blocked): its
    part from the streams it left in its file at this boundary. Its loaders stood where every
    rank's did."""
    from ddpkit.train import rng_file, state

    fallen = []
    for rank in range(kept.place.world_size):
        part = tmp / f"rank{rank}.pt"
        where = rng_file.of_rank(rank)
        if part.exists() or where is None:
            continue
        streams = rng_file.read(where, kept.base, kept.boundaries, fetched=snap["moved"])
        if streams is not None:
            _write_part(tmp, rank, {"format": state.FORMAT, "rank": rank,
                                    "world_size": kept.place.world_size, "rng": streams,
                                    "loaders": snap["loaders"]})  # fmt: skip
            fallen.append(rank)
    return fallen


def _buffers_at_boundary(name: str, model: torch.nn.Module, held: _Buffers) -> dict[str, Any]:
    """The buffers as they stood at the boundary; raises if the model replaced one since the
    list was walked (its boundary value was not copied)."""
    now = dict(model.named_buffers())
    for key, live in zip(held.names, held.live, strict=True):
        if key not in now or now[key].data_ptr() != live.data_ptr():
            raise RuntimeError(f"{name}'s buffer {key} was replaced during the step")
    return dict(zip(held.names, held.copies, strict=True))


def after_peer_failure() -> tuple[str, bool] | None:
    """This rank failed waiting for a peer: write its part of the last step's state (and, if
    it claims it first, the shared part). What it did, in words, and whether the console
    should hear it; None when nothing was kept, or when it was done already (the error hook
    and the launcher's request may both come). Never raises: the error that brought us here
    is what the rank reports."""
    r = _part()
    with r.once:
        if r.rescued:
            return None
        r.rescued = True
        with r.guard:
            r.halted = True  # no step begins while the state is written
        r.said = _rescue()
        return r.said


def _rescue() -> tuple[str, bool] | None:
    r = _part()
    kept = r.kept
    if kept is None:
        return None
    if kept.boundaries == 0 and not kept.stepped:
        return "the state saved or loaded last is the last completed step: nothing to add", False
    if not kept.open or not kept.snapshot:
        return "no state of the last step kept: the failure came outside a step's window", False
    try:
        return _write(kept)
    except Exception as err:  # a rescue that cannot be written leaves the last regular save
        return f"no state of the last step written ({type(err).__name__}: {err})", True


def _write(kept: Kept) -> tuple[str, bool]:
    from ddpkit.train import state
    from ddpkit.train.quick_rng import streams_of

    place, snap, root = kept.place, kept.snapshot, kept.path
    buffers = {  # first: a buffer replaced since the walk leaves nothing to vouch for
        name_: _buffers_at_boundary(name_, state.unwrapped(kept.objects[name_]), held)
        for name_, held in snap["buffers"].items()
    }
    name = f".rescue-{kept.base:08d}-{kept.boundaries}"  # the same on every rank
    tmp, done = root / f"{name}.tmp", root / f"{name}.done"
    if done.exists():  # a survivor finished it while this rank was slower
        return f"rank {place.rank}: the state of the last step was written without its part", False
    tmp.mkdir(parents=True, exist_ok=True)
    mine = {
        "format": state.FORMAT,
        "rank": place.rank,
        "world_size": place.world_size,
        "rng": streams_of(snap["streams"]),
        "loaders": snap["loaders"],
    }
    _write_part(tmp, place.rank, mine)
    try:
        os.close(os.open(tmp / "shared.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return f"rank {place.rank} kept its part of the state of the last completed step", False
    if done.exists():  # this rank made the folder again after the claimer had finished it
        shutil.rmtree(tmp, ignore_errors=True)
        return f"rank {place.rank}: the state of the last step was written without its part", False
    stateful = {}
    for name_, obj in kept.objects.items():
        if state.kind_of(name_, obj) != "stateful":
            continue
        if name_ in snap["small"]:
            stateful[name_] = _kept_value(snap["small"][name_])
            continue
        live = state.unwrapped(obj).state_dict()
        if name_ in snap["buffers"]:  # the buffers as they stood at the boundary
            live = {**live, **{k: v for k, v in buffers[name_].items() if k in live}}
        stateful[name_] = live
    shared = {
        "format": state.FORMAT,
        "world_size": place.world_size,
        "time": time.time(),
        "stateful": stateful,
        "sharded": [],
        "dicts": {n: _kept_value(d) for n, d in snap["dicts"].items()},
        "rescued": {"by": place.rank, "boundary": kept.boundaries},
        "steps": snap["steps"],
    }
    state.write(tmp / "shared.pt", shared)
    # this node's ranks without a part, from their streams' files at once: a rank left can be
    # blocked on a peer that waits for this one to end; only other nodes' parts are waited for
    fallen = _parts_of_the_fallen(tmp, kept, snap)
    deadline = time.monotonic() + PARTS_WAIT
    while time.monotonic() < deadline and len(list(tmp.glob("rank*.pt"))) < place.world_size:
        time.sleep(0.05)
    (tmp / "shared.claim").unlink()
    (tmp / state.DONE).write_text(f"{place.world_size}\n")
    final = root / f"{state.STATE_PREFIX}{state.latest_seq(root) + 1:08d}"
    with contextlib.suppress(OSError):
        state.fsync_dir(tmp)
    done.touch()  # before the rename: a rank later than that finds it and adds nothing
    os.replace(tmp, final)
    with contextlib.suppress(OSError):
        state.fsync_dir(root)
    parts = sorted(int(p.stem[4:]) for p in final.glob("rank*.pt") if int(p.stem[4:]) not in fallen)
    text = (
        f"rank {place.rank} wrote the state of the last completed step to {final} (the parts "
        f"of ranks {','.join(map(str, parts))}"
    )
    for rank in fallen:
        text += f"; rank {rank}'s from the random streams it left at that step"
    text += ")"
    return text, True

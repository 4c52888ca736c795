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

On a failure that waited for a peer (the bootstrap's error hook) inside the window, this rank
writes its part of a state in save_state's layout (ddpkit.train.state): its own `rankN.pt`, and
`shared.pt` by the first survivor to claim it, who then waits a moment for the others' parts
and finishes the folder atomically (COMPLETE, then the rename). A rank whose part is missing
(the one that failed) is re-seeded at load with a notice. Outside the window nothing is
written and the last regular save is used.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddpkit.train.placement import Placement

PARTS_WAIT = 3.0  # seconds the claiming survivor waits for the other survivors' parts


@dataclass
class Kept:
    """What a failure would write, and whether it can be vouched for now."""

    path: Path
    objects: dict[str, Any]
    place: Placement
    open: bool = False  # inside the window: the live parameters are the last step's
    stepped: bool = True  # an optimizer step since the last boundary (the next fetch is one)
    snapshot: dict[str, Any] = field(default_factory=dict)
    boundaries: int = 0
    base: int = 0  # the newest state when remembered: with `boundaries`, names a rescue


_kept: Kept | None = None
_hooks: list[Any] = []


def remember(path: str | os.PathLike[str], objects: Mapping[str, Any], place: Placement) -> None:
    """s.save_state / s.load_state: these objects are what a failure would write."""
    global _kept
    from ddpkit.train.state import kind_of, sharded_part

    kinds = {name: kind_of(name, obj) for name, obj in objects.items()}
    if place.world_size < 2 or sharded_part(objects, kinds) is not None:
        _kept = None  # one rank has no peer; a lost shard has no replica to write it from
        return
    from ddpkit.train.state import latest_seq

    root = Path(path)
    base = latest_seq(root) if root.is_dir() else 0
    _kept = Kept(root, dict(objects), place, base=base)
    if not _hooks:
        import torch.optim.optimizer as optimizer_module

        from ddpkit.rank import failure

        failure.AFTER_A_PEER.append(after_peer_failure)
        _hooks.append(optimizer_module.register_optimizer_step_pre_hook(_step_begins))
        _hooks.append(optimizer_module.register_optimizer_step_post_hook(_step_ended))


def forget() -> None:
    global _kept
    _kept = None


def _step_begins(*_: Any) -> None:
    if _kept is not None:
        _kept.open = False


def _step_ended(*_: Any) -> None:
    if _kept is not None:
        _kept.stepped = True


def before_fetch(loader: Any) -> None:
    """An s.loader is about to fetch a batch: at a step's boundary, take the snapshot."""
    kept = _kept
    if kept is None or not kept.stepped or not any(o is loader for o in kept.objects.values()):
        return
    kept.stepped = False
    kept.snapshot = _snapshot(kept.objects)
    kept.boundaries += 1
    kept.open = True


def _snapshot(objects: Mapping[str, Any]) -> dict[str, Any]:
    from ddpkit.train.state import kind_of, rng_state, unwrapped

    loaders, small, buffers, dicts = {}, {}, {}, {}
    for name, obj in objects.items():
        kind = kind_of(name, obj)
        if kind == "loader":
            loaders[name] = obj.resume_state()
        elif kind == "dict":
            dicts[name] = copy.deepcopy(dict(obj))
        elif isinstance(unwrapped(obj), torch.nn.Module):
            buffers[name] = {k: b.detach().clone() for k, b in unwrapped(obj).named_buffers()}
        elif not isinstance(obj, torch.optim.Optimizer):
            small[name] = copy.deepcopy(obj.state_dict())
    return {
        "rng": rng_state(),
        "loaders": loaders,
        "small": small,
        "buffers": buffers,
        "dicts": dicts,
    }


def after_peer_failure() -> tuple[str, bool] | None:
    """This rank failed waiting for a peer: write its part of the last step's state (and, if
    it claims it first, the shared part). What it did, in words, and whether the console
    should hear it; None when nothing was kept. Never raises: the error that brought us here
    is what the rank reports."""
    kept = _kept
    if kept is None:
        return None
    if not kept.open or not kept.snapshot:
        return "no state of the last step kept: the failure came outside a step's window", False
    try:
        return _write(kept)
    except Exception as err:  # a rescue that cannot be written leaves the last regular save
        return f"no state of the last step written ({type(err).__name__}: {err})", True


def _write(kept: Kept) -> tuple[str, bool]:
    from ddpkit.train import state

    place, snap, root = kept.place, kept.snapshot, kept.path
    name = f".rescue-{kept.base:08d}-{kept.boundaries}"  # the same on every rank
    tmp, done = root / f"{name}.tmp", root / f"{name}.done"
    if done.exists():  # a survivor finished it while this rank was slower
        return f"rank {place.rank}: the state of the last step was written without its part", False
    tmp.mkdir(parents=True, exist_ok=True)
    mine = {
        "format": state.FORMAT,
        "rank": place.rank,
        "world_size": place.world_size,
        "rng": snap["rng"],
        "loaders": snap["loaders"],
    }
    state.write(tmp / f"rank{place.rank}.pt", mine)
    try:
        os.close(os.open(tmp / "shared.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return f"rank {place.rank} kept its part of the state of the last completed step", False
    stateful = {}
    for name_, obj in kept.objects.items():
        if state.kind_of(name_, obj) != "stateful":
            continue
        if name_ in snap["small"]:
            stateful[name_] = snap["small"][name_]
            continue
        live = state.unwrapped(obj).state_dict()
        if name_ in snap["buffers"]:  # the buffers as they stood at the boundary
            live = {**live, **{k: v for k, v in snap["buffers"][name_].items() if k in live}}
        stateful[name_] = live
    shared = {
        "format": state.FORMAT,
        "world_size": place.world_size,
        "time": time.time(),
        "stateful": stateful,
        "sharded": [],
        "dicts": snap["dicts"],
        "rescued": {"by": place.rank, "boundary": kept.boundaries},
    }
    state.write(tmp / "shared.pt", shared)
    deadline = time.monotonic() + PARTS_WAIT
    while time.monotonic() < deadline and len(list(tmp.glob("rank*.pt"))) < place.world_size - 1:
        time.sleep(0.05)
    (tmp / "shared.claim").unlink()
    (tmp / state.DONE).write_text(f"{place.world_size}\n")
    final = root / f"{state.STATE_PREFIX}{state.latest_seq(root) + 1:08d}"
    with contextlib.suppress(OSError):
        state.fsync_dir(tmp)
    os.replace(tmp, final)
    done.touch()
    with contextlib.suppress(OSError):
        state.fsync_dir(root)
    parts = sorted(int(p.stem[4:]) for p in final.glob("rank*.pt"))
    text = (
        f"rank {place.rank} wrote the state of the last completed step to {final} (the parts "
        f"of ranks {','.join(map(str, parts))})"
    )
    return text, True

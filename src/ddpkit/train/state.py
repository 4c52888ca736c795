"""Training state that survives a stop: `s.save_state(path, **objects)` and
`s.load_state(path, **objects)`, so that a resumed run is the run that never stopped.

Layout (a folder per save, made atomic by a rename once every rank has written its part):

    path/state-00000012/shared.pt     rank 0: model, optimizer, schedules, scaler, dicts
    path/state-00000012/rank0.pt ...  each rank: its RNG states, its loaders' positions
    path/state-00000012/COMPLETE      written last: a state without it is never loaded
    path/state-00000012/sharded/      a sharded (FSDP2) model and its optimizers: every rank
                                      writes its own shard (torch.distributed.checkpoint)

A save killed midway leaves `path/.state-*.tmp` (ignored, removed by the next save) and the
previous state loadable. `keep` states are kept, the older removed. Everything is read with
weights_only=True. Everything loads after a change of world size: the model/optimizer part as
it is (a sharded model's too: torch.distributed.checkpoint reshards it); each s.loader's place
in its epoch, which is the job's (ddpkit.train.dealing), from rank 0's part; each rank's random
streams, which cannot follow, are re-seeded from (seed, state number, rank), said in one
notice. No rank ever gathers a whole sharded model.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from ddpkit.errors import CheckpointError
from ddpkit.train import comm, step_count
from ddpkit.train.placement import Placement
from ddpkit.train.seeding import mix, seed_everything

STATE_PREFIX = "state-"
DONE = "COMPLETE"
FORMAT = 1


def unwrapped(obj: Any) -> Any:
    from ddpkit.train.wrapping import unwrap

    return unwrap(obj) if isinstance(obj, torch.nn.Module) else obj


def kind_of(name: str, obj: Any) -> str:
    if hasattr(obj, "resume_state") and hasattr(obj, "restore"):  # an s.loader
        return "loader"
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return "stateful"
    if isinstance(obj, dict):
        return "dict"
    raise CheckpointError(
        f"save_state({name}=...) got a {type(obj).__name__}: it has no state_dict() and is not "
        "a dict",
        fix="pass modules, optimizers, schedulers, scalers, s.loader(...)s and dicts",
    )


# -- RNG -----------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's random states: Python, numpy (when installed), torch CPU, every GPU."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = cast(Any, np.random.get_state())
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- save ----------------------------------------------------------------------------------


def save_state(
    path: str | os.PathLike[str],
    objects: Mapping[str, Any],
    place: Placement,
    keep: int = 2,
) -> Path:
    """Collective. Returns the state's folder."""
    rank, world_size = place.rank, place.world_size
    if keep < 1:
        raise CheckpointError(f"save_state(keep={keep}) keeps nothing", fix="keep=1 or more")
    root = Path(path)
    kinds = {name: kind_of(name, obj) for name, obj in objects.items()}
    error = None
    seq = 0
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            seq = latest_seq(root) + 1
            tmp = root / f".{STATE_PREFIX}{seq:08d}.tmp"
            tmp.mkdir()
        except OSError as err:
            error = f"{root}: {err.strerror or err}"
    seq, error = comm.broadcast((seq, error), place)
    _fail_if(error)
    tmp = root / f".{STATE_PREFIX}{seq:08d}.tmp"
    error = None
    sharded = sharded_part(objects, kinds)
    try:
        if sharded is not None:  # collective: each rank writes its shard
            _save_sharded(tmp / "sharded", objects, sharded)
        mine = {
            "format": FORMAT,
            "rank": rank,
            "world_size": world_size,
            "rng": rng_state(),
            "loaders": {n: o.resume_state() for n, o in objects.items() if kinds[n] == "loader"},
        }
        write(tmp / f"rank{rank}.pt", mine)
        if rank == 0:
            shared = {
                "format": FORMAT,
                "world_size": world_size,
                "time": time.time(),
                "stateful": {
                    n: unwrapped(o).state_dict()
                    for n, o in objects.items()
                    if kinds[n] == "stateful" and not (sharded and n in sharded)
                },
                "sharded": sharded or [],
                "dicts": {n: dict(o) for n, o in objects.items() if kinds[n] == "dict"},
                "steps": step_count.done(),
            }
            write(tmp / "shared.pt", shared)
    except Exception as err:  # torch.save says ENOSPC as a RuntimeError
        from ddpkit.train.checkpoint import why

        error = f"rank {rank}: {why(err)}"
    errors = comm.gather(error, place)
    _fail_if(next((e for e in errors if e), None))
    final = root / f"{STATE_PREFIX}{seq:08d}"
    if rank == 0:
        try:
            (tmp / DONE).write_text(f"{world_size}\n")
            fsync_dir(tmp)
            os.replace(tmp, final)
            fsync_dir(root)
            _prune(root, keep)
        except OSError as err:
            error = f"{final}: {err.strerror or err}"
    _fail_if(comm.broadcast(error, place))
    return final


def write(target: Path, obj: Any) -> None:
    with open(target, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _states(root: Path) -> list[Path]:
    """Complete states, oldest first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.name.startswith(STATE_PREFIX) and p.name[len(STATE_PREFIX) :].isdigit()
    ]
    return sorted((p for p in found if (p / DONE).exists()), key=lambda p: p.name)


def latest_seq(root: Path) -> int:
    seqs = [
        int(p.name.split("-")[-1].split(".")[0])
        for p in root.iterdir()
        if STATE_PREFIX in p.name and p.name.split("-")[-1].split(".")[0].isdigit()
    ]
    return max(seqs, default=0)


def _remove_stale(root: Path) -> None:
    for p in root.glob(f".{STATE_PREFIX}*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    for old in _states(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# -- load ----------------------------------------------------------------------------------


def load_state(
    path: str | os.PathLike[str],
    objects: Mapping[str, Any],
    place: Placement,
    rng: bool = True,
) -> bool:
    """Collective. False when `path` holds no complete state (a first run)."""
    rank, world_size, device = place.rank, place.world_size, place.device
    kinds = {name: kind_of(name, obj) for name, obj in objects.items()}
    for obj in objects.values():
        _line_up_buckets(obj)
    states = _states(Path(path))
    if not states:
        return False
    folder = states[-1]
    shared = _read(folder / "shared.pt", device)
    saved_world = int(shared["world_size"])
    loaders = {n: objects[n] for n, k in kinds.items() if k == "loader"}
    part: dict[str, Any] = {}
    lost = False  # a state a survivor wrote after a failure lacks the failed rank's part
    if rng or loaders:
        # at the same world size each rank reads its own part; at another, rank 0's: the
        # loaders' positions are the job's (the same on every rank), random states re-derived
        source = folder / f"rank{rank if saved_world == world_size else 0}.pt"
        parts = sorted(folder.glob("rank*.pt"))
        lost = not source.exists() and bool(parts) and "rescued" in shared
        part = _read(parts[0] if lost else source, torch.device("cpu"))
    positions = {}
    for name, loader in loaders.items():  # every check before anything is changed
        if name not in part["loaders"]:
            raise _missing(folder, name)
        positions[name] = {"world": saved_world, **part["loaders"][name]}
        loader.check_restore(positions[name], name)
    sharded = list(shared.get("sharded") or [])
    if sharded:
        mine_sharded = sharded_part(objects, kinds) or []
        if sorted(mine_sharded) != sorted(sharded):
            raise CheckpointError(
                f"{folder} holds the sharded model and optimizers {sharded}; this call gives "
                f"{mine_sharded or 'none'}",
                fix="pass the same names as at save_state (the model wrapped with shard=True)",
            )
        _load_sharded(folder / "sharded", objects, sharded)
    for name, kind in kinds.items():
        obj = objects[name]
        if name in sharded:
            continue
        if kind == "stateful":
            if name not in shared["stateful"]:
                raise _missing(folder, name)
            unwrapped(obj).load_state_dict(shared["stateful"][name])
        elif kind == "dict":
            if name not in shared["dicts"]:
                raise _missing(folder, name)
            obj.clear()
            obj.update(shared["dicts"][name])
    followed = [(name, loaders[name].restore(positions[name])) for name in loaders]
    if rng and saved_world == world_size and not lost:
        set_rng_state(part["rng"])
    elif rng:
        reseed(place.seed, _seq_of(folder), rank)
        if lost and saved_world == world_size:
            print(
                f"ddpkit: rank {rank}'s random state went with it when it failed ({folder.name} "
                f"was written by the ranks left); re-seeded from (seed, {_seq_of(folder)}, rank)",
                file=sys.stderr,
                flush=True,
            )
    if saved_world != world_size and place.is_main:
        _say_followed(folder, saved_world, world_size, followed, rng, place.seed)
    step_count.resumed_at(int(shared.get("steps", 0)), "rescued" in shared)
    return True


def reseed(seed: int, state: int, rank: int) -> None:
    """Every random stream of this process from (seed, state, rank): Python, numpy, torch's
    CPU generator and every GPU's. What a rank's saved streams become at another world size."""
    seed_everything(mix(seed, state, rank))


def _seq_of(folder: Path) -> int:
    return int(folder.name[len(STATE_PREFIX) :])


def _say_followed(
    folder: Path,
    saved: int,
    world: int,
    followed: list[tuple[str, str | None]],
    rng: bool,
    seed: int,
) -> None:
    lines = [f"ddpkit: {folder.name} was saved by {saved} ranks; this job has {world}:"]
    lines += [f"  {name!r} {said}" for name, said in followed if said]
    if rng:
        lines.append(
            "  each rank's random streams (Python, numpy, torch, CUDA) cannot follow: every "
            f"rank re-seeds them from (seed {seed}, state {_seq_of(folder)}, its rank)"
        )
    print("\n".join(lines), file=sys.stderr, flush=True)


def _line_up_buckets(obj: Any) -> None:
    """A DDP the script built itself sums its first step as its later ones from here on, as
    s.wrap's does (ddpkit.train.bucket_layout): in the first run and the resumed one alike, since
    both call load_state before training."""
    from ddpkit.train import bucket_layout

    ddp = bucket_layout.find_ddp(obj)
    if ddp is not None:
        bucket_layout.install(ddp)


# -- a sharded model (FSDP2): torch.distributed.checkpoint, one shard per rank -----------------


def sharded_part(objects: Mapping[str, Any], kinds: Mapping[str, str]) -> list[str] | None:
    """Names of the sharded model and of the optimizers that go with it, or None."""
    from ddpkit.train.sharding import is_sharded

    models = [n for n, o in objects.items() if kinds[n] == "stateful" and is_sharded(o)]
    if not models:
        return None
    if len(models) > 1:
        raise CheckpointError(
            f"save_state got {len(models)} sharded models ({', '.join(models)})",
            fix="save one sharded model (and its optimizers) per state folder",
        )
    optimizers = [n for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)]
    return models + optimizers


def _split(objects: Mapping[str, Any], names: list[str]) -> tuple[Any, list[Any]]:
    return unwrapped(objects[names[0]]), [objects[n] for n in names[1:]]


def _save_sharded(folder: Path, objects: Mapping[str, Any], names: list[str]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizers = _split(objects, names)
    model_state, optim_state = get_state_dict(model, optimizers)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))


def _load_sharded(folder: Path, objects: Mapping[str, Any], names: list[str]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizers = _split(objects, names)
    model_state, optim_state = get_state_dict(model, optimizers)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except Exception as err:
        raise CheckpointError(
            f"{folder} could not be read: {type(err).__name__}: {str(err)[:200]}",
            fix="the state is damaged or from another model; remove its folder to resume "
            "from the one before",
        ) from err
    set_state_dict(
        model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def _read(file: Path, device: torch.device) -> Any:
    try:
        return torch.load(file, map_location=device, weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"{file} could not be read: {err}",
            fix="the state is damaged; remove its folder to resume from the one before",
        ) from err


def _missing(folder: Path, name: str) -> CheckpointError:
    return CheckpointError(
        f"{folder} holds no {name!r}", fix=f"save it with s.save_state(path, {name}=...) first"
    )


def _fail_if(error: str | None) -> None:
    if error:
        raise CheckpointError(
            f"the training state could not be saved: {error}",
            fix="check free space and permissions of that folder; the previous state is intact",
        )

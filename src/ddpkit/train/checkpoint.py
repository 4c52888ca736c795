"""Checkpoints that survive a crash mid-write and load onto the right device.

`save` is collective: rank 0 writes to a temporary file beside the target, fsyncs it, renames it
over the target (atomic on POSIX) and fsyncs the folder, then broadcasts whether it worked, so
every rank returns or every rank raises the same CheckpointError (a full disk never leaves the
others waiting). A save killed midway leaves the previous checkpoint intact, and its temporary
file is removed by the next save. `load` reads with weights_only=True unless the caller opts
out.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import CheckpointError
from ddpkit.train.placement import Placement


def save(obj: Any, path: str | os.PathLike[str], place: Placement) -> None:
    """Collective: rank 0 writes `obj` atomically; every rank returns once it is on disk
    (or every rank raises if writing failed)."""
    from ddpkit.train import comm, sharding

    error = None
    if sharding.has_dtensors(obj):  # a sharded state_dict(): every rank gives its shards
        obj = sharding.full_tensors(obj)
    if place.is_main:
        try:
            write_atomic(obj, path)
        except Exception as err:  # torch.save says ENOSPC as a RuntimeError
            error = f"{path}: {why(err)}"
    error = comm.broadcast(error, place)
    if error is not None:
        raise CheckpointError(
            f"rank 0 could not write the checkpoint {error}",
            fix="check free space and permissions of that folder",
        )


def write_atomic(obj: Any, path: str | os.PathLike[str]) -> Path:
    """torch.save `obj` to `path` so that readers see the old file or the new one, never half."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # as torch.save(obj, path) would make it
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def _umask() -> int:
    """The process's umask (mkstemp makes 0600 files whatever it is)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


STALE = 60.0  # seconds: a temporary file not written to for this long belongs to a dead save


def _remove_stale_temporaries(target: Path) -> None:
    """What a save killed midway left beside `target` (as large as the checkpoint)."""
    now = time.time()
    for tmp in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE:
                tmp.unlink()
        except OSError:
            pass


def why(err: BaseException) -> str:
    """A short reason for a failed write: the OS error where there is one."""
    for cause in (err, err.__cause__, err.__context__):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    text = str(err)
    if "No space left" in text or "error code: 28" in text or "errno 28" in text.lower():
        return "No space left on device"
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:200]


def read(path: str | os.PathLike[str], device: torch.device, weights_only: bool = True) -> Any:
    """torch.load `path` onto `device`; a missing or unreadable file is a CheckpointError."""
    source = Path(path)
    if not source.is_file():
        raise CheckpointError(
            f"no checkpoint at {source}",
            fix="check the path, or save one first with s.save(obj, path)",
        )
    try:
        return torch.load(source, map_location=device, weights_only=weights_only)
    except Exception as err:
        if weights_only and "weights_only" in str(err):
            raise CheckpointError(
                f"{source} holds objects that weights_only=True refuses to unpickle",
                fix="if you trust the file, load it with s.load(path, weights_only=False)",
            ) from err
        raise CheckpointError(
            f"{source} could not be read: {err}",
            fix="the file is damaged or not a torch checkpoint",
        ) from err

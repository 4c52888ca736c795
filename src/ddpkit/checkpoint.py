"""Checkpoints that survive a crash mid-write and load onto the right device.

`save` is collective: rank 0 writes to a temporary file beside the target, fsyncs it, renames it
over the target (atomic on POSIX) and fsyncs the folder; the others wait at a barrier. A save
killed midway leaves the previous checkpoint intact. `load` reads with weights_only=True unless
the caller opts out.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import CheckpointError


def write_atomic(obj: Any, path: str | os.PathLike[str]) -> Path:
    """torch.save `obj` to `path` so that readers see the old file or the new one, never half."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
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

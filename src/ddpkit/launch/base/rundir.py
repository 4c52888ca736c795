"""Where a run's files live, kept private and kept in check.

The base folder is `--log-dir`, or `$TMPDIR/ddpkit-$UID`. The default base is made 0700 by
this user and refused when it is not that: another user's, writable by others, or a symlink
(on a shared machine someone else could otherwise read the logs, or swap a run folder for a
link to theirs). Each run gets a folder of its own, made with O_EXCL semantics (two jobs with
the same run id never share one), mode 0700; logs and reports inside are 0600.

Retention (docs/launcher.md, "Output and files"): at each start, run folders beyond the newest
KEEP (DDPKIT_KEEP_RUNS) are removed from the base folder, except those written in the last
hour (a job that may still run), and the launcher says how many went. `latest` in the base
folder links to the newest run's folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from ddpkit.errors import ConfigError, LaunchError

KEEP = 50
KEEP_YOUNGER = 3600.0  # a folder written this recently may be a running job's


def base_folder(log_dir: Path | None) -> Path:
    """The folder run folders go in, created if needed; a ConfigError when it cannot be."""
    if log_dir is not None:
        _create(log_dir, given=True)
        return log_dir
    base = Path(tempfile.gettempdir()) / f"ddpkit-{os.getuid()}"
    _create(base, given=False)
    info = os.lstat(base)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    elif info.st_uid != os.getuid():
        problem = f"belongs to another user (uid {info.st_uid})"
    elif info.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem:
        raise LaunchError(
            f"the log folder {base} {problem}: another local user could read or swap your "
            "logs, so ddpkit will not use it",
            fix=f"remove {base} if it is yours and stray, or pass --log-dir to a folder of yours",
        )
    return base


def _create(folder: Path, given: bool) -> None:
    try:
        folder.mkdir(mode=0o700, parents=given, exist_ok=True)
    except FileExistsError:
        raise ConfigError(
            f"the log folder {folder} exists and is not a folder",
            fix="pass --log-dir to a folder (or a path that does not exist yet)",
        ) from None
    except OSError as err:
        raise ConfigError(
            f"cannot create the log folder {str(folder)[:200]}: {err.strerror}",
            fix="pass --log-dir to a folder you can write",
        ) from None
    if not folder.is_dir():
        raise ConfigError(
            f"the log folder {folder} is not a folder",
            fix="pass --log-dir to a folder (or a path that does not exist yet)",
        )


def make(base: Path, name: str) -> Path:
    """A new, private folder for this run; never one that exists (same run id twice: a
    suffix)."""
    for attempt in range(1000):
        folder = base / (name if attempt == 0 else f"{name}-{attempt + 1}")
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        except OSError as err:
            raise ConfigError(
                f"cannot create the run folder {folder}: {err.strerror}",
                fix="pass --log-dir to a folder you can write",
            ) from None
        return folder
    raise LaunchError(f"1000 run folders named {name} in {base}", fix="pass another --run-id")


LATEST = "latest"


def mark_latest(base: Path, folder: Path) -> None:
    """base/latest -> this run's folder (a relative link, replaced atomically), so the newest
    run is always at one path: `less /tmp/ddpkit-$UID/latest/rank0.log`."""
    link = base / LATEST
    staging = base / f".{LATEST}.{os.getpid()}"
    try:
        os.symlink(folder.name, staging)
        os.replace(staging, link)
    except OSError:  # a read-only or odd file system: the run goes on without it
        with contextlib.suppress(OSError):
            os.unlink(staging)


def open_private(path: Path) -> int:
    """A file descriptor for appending to a new private file (0600), never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
    return os.open(path, flags, 0o600)


def keep_runs() -> int:
    """How many run folders to keep: DDPKIT_KEEP_RUNS, else KEEP (a bad value: KEEP)."""
    raw = os.environ.get("DDPKIT_KEEP_RUNS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else KEEP


def prune(base: Path, keep: int | None = None, younger: float = KEEP_YOUNGER) -> list[Path]:
    """Remove this user's run folders beyond the newest `keep` that are older than
    `younger` seconds. Only folders that look like runs (a rank log or a state folder)."""
    keep = keep_runs() if keep is None else keep
    runs = []
    for entry in base.iterdir():
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if any(entry.glob("rank*.log")) or any(entry.glob("state*")):
            runs.append((info.st_mtime, entry))
    runs.sort(reverse=True)
    removed = []
    now = time.time()
    for mtime, entry in runs[keep:]:
        if now - mtime > younger:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed

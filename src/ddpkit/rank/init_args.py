"""The script's own arguments to `init_process_group`, against what `ddpkit run` gave the rank.

Scripts written for `mp.spawn` or copied from a tutorial pass their own `world_size`, `rank`,
`init_method`, or set `MASTER_ADDR`/`MASTER_PORT` themselves. Under a launcher those
disagree with the job: a world size larger than the ranks started waits forever in init; a
hard-coded port clashes with the next job (EADDRINUSE); `localhost` cannot reach node 0 from
another node. What ddpkit does (docs/launcher.md, "The script's own init arguments"):

* a `world_size` or `rank` (argument, or the variable set by the script) that is not the
  launcher's is an error at once, naming the argument, where the script set it, what the
  launcher gave, and the fix: the job cannot be what the script means;
* a rendezvous address (`MASTER_ADDR`/`MASTER_PORT` set by the script, a `tcp://` or `env://`
  init_method) that is not the launcher's is replaced by the launcher's, and said once: the
  script asked for "the ranks meet", and the launcher's address is where they meet, with no
  port to clash (`--master-port` chooses it).

Where the script set a variable is known from a hook on `os.putenv` (what `os.environ[...] =`
calls) for the four variables only, installed before the script runs.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

from ddpkit.common.frames import is_library
from ddpkit.errors import DdpkitError

WATCHED = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
# what the launcher gave this rank, read before the script runs
LAUNCHER: dict[str, str] = {}
SET_AT: dict[str, str] = {}  # variable -> 'file:line' where the script last set it


class InitMismatchError(DdpkitError):
    """The script's init arguments disagree with the job ddpkit run started."""


def remember_launcher() -> None:
    """Keep the launcher's values and start watching where the script sets them."""
    LAUNCHER.update({k: os.environ[k] for k in WATCHED if k in os.environ})
    if "LOCAL_RANK" in os.environ:
        LAUNCHER["LOCAL_RANK"] = os.environ["LOCAL_RANK"]
    original = os.putenv

    def putenv(key: Any, value: Any) -> None:
        original(key, value)
        name = key.decode() if isinstance(key, bytes) else str(key)
        if name in WATCHED:
            SET_AT[name] = script_site(sys._getframe(1))

    os.putenv = putenv


def script_site(frame: types.FrameType | None) -> str:
    """'file.py:12' of the innermost frame outside torch, ddpkit and Python."""
    while frame is not None and is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


@dataclass(frozen=True)
class Checked:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    notes: list[str]  # what was replaced by the launcher's, to be said once


def check(init: Any, args: tuple[Any, ...], kwargs: dict[str, Any], site: str) -> Checked:
    """The call's arguments, with the rendezvous replaced by the launcher's where the script's
    differs; raises InitMismatchError for a world size or rank the job does not have."""
    if not LAUNCHER.get("WORLD_SIZE") or not LAUNCHER.get("RANK"):
        return Checked(args, kwargs, [])
    try:
        bound = inspect.signature(init).bind_partial(*args, **kwargs)
    except TypeError:  # torch will say what is wrong with the call itself
        return Checked(args, kwargs, [])
    given = dict(bound.arguments)
    store = given.get("store")
    method = given.get("init_method")
    _check_number("world_size", "WORLD_SIZE", given, site)
    _check_number("rank", "RANK", given, site)
    notes: list[str] = []
    if store is None and (method is None or str(method).startswith(("env://", "tcp://"))):
        notes = _use_launchers_rendezvous(given, site)
    if not notes:
        return Checked(args, kwargs, [])
    return Checked((), given, notes)


def _launcher_words() -> str:
    world, rank = LAUNCHER["WORLD_SIZE"], LAUNCHER["RANK"]
    local = LAUNCHER.get("LOCAL_RANK")
    return f"ddpkit run started {world} rank(s); this is rank {rank}" + (
        f" (local rank {local})" if local is not None and local != rank else ""
    )


def _check_number(arg: str, variable: str, given: dict[str, Any], site: str) -> None:
    launcher = int(LAUNCHER[variable])
    value = given.get(arg)
    if value is not None and int(value) != -1:
        if int(value) == launcher:
            return
        where, said = site, f"init_process_group({arg}={value})"
    else:
        env = os.environ.get(variable)
        if env is None or env == LAUNCHER[variable]:
            return
        where, said = SET_AT.get(variable, "?"), f"{variable}={env} set by the script"
        value = env
    if arg == "world_size":
        fix = (
            "leave world_size out of init_process_group (it reads WORLD_SIZE, which ddpkit "
            f"run sets), or pass int(os.environ['WORLD_SIZE']); to run {value} ranks: "
            f"ddpkit run -n {value}"
        )
    else:
        fix = (
            "leave rank out of init_process_group (it reads RANK), or pass "
            "int(os.environ['RANK']); LOCAL_RANK is the rank on this node (the GPU to use), "
            "RANK the rank in the whole job"
        )
    raise InitMismatchError(
        f"{said} at {where}, but {_launcher_words()}: the job would wait at init for ranks "
        "that do not exist" + ("" if arg == "world_size" else " or two ranks with one number"),
        fix,
    )


def _use_launchers_rendezvous(given: dict[str, Any], site: str) -> list[str]:
    """Put the launcher's MASTER_ADDR/MASTER_PORT back where the script changed them, and an
    init_method pointing elsewhere to env://; the notes say what was replaced."""
    notes = []
    method = str(given.get("init_method") or "")
    if method.startswith("tcp://"):
        address = method[len("tcp://") :].split("?")[0].split("/")[0]
        host, _, port = address.rpartition(":")
        ours = f"{LAUNCHER.get('MASTER_ADDR')}:{LAUNCHER.get('MASTER_PORT')}"
        if address != ours:
            given["init_method"] = "env://"
            notes.append(f"init_method='{method}' ({site})")
            for name, value in (("MASTER_ADDR", host), ("MASTER_PORT", port)):
                if value:
                    os.environ[name] = LAUNCHER.get(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        now, launcher = os.environ.get(name), LAUNCHER.get(name)
        if launcher is not None and now is not None and now != launcher:
            notes.append(f"{name}={now} ({SET_AT.get(name, '?')})")
            where = SET_AT.get(name)
            os.environ[name] = launcher
            if where is not None:  # the script's line, not ddpkit's putting it back
                SET_AT[name] = where
    return notes


def replaced_line(notes: list[str]) -> str:
    """The one line that says what was replaced."""
    ours = f"{LAUNCHER.get('MASTER_ADDR')}:{LAUNCHER.get('MASTER_PORT')}"
    return (
        f"the script sets {', '.join(notes)}; ddpkit run's ranks meet at {ours}, so that is "
        "used (a port written in the script clashes with the next job on this machine; "
        "another node cannot reach localhost): drop those lines, or choose the port with "
        "ddpkit run --master-port"
    )

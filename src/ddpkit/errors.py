"""Errors a user can cause, each carrying a one-line fix.

Every ddpkit error is a `DdpkitError`: `str(err)` says what happened and why, `err.fix` says
what to do. The CLI prints both without a traceback; `install_excepthook` does the same for
scripts that call `ddpkit.setup()`.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Callable
from types import TracebackType


class DdpkitError(Exception):
    """Base of every error a user can cause. `exit_code` is 2 for usage/config, 1 for runtime."""

    exit_code = 1

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix

    def render(self) -> str:
        text = f"error: {self}"
        if self.fix:
            text += f"\nfix: {self.fix}"
        return text


class ConfigError(DdpkitError):
    """Bad input: a flag, an argument or a file the user named."""

    exit_code = 2


class EnvError(ConfigError):
    """A distributed environment variable is malformed or contradicts another."""


class InitTimeoutError(DdpkitError):
    """Peers did not arrive at process-group init within the timeout."""


class InitInterrupted(KeyboardInterrupt):
    """Ctrl+C while `setup()` waited for its peers: a KeyboardInterrupt (the process ends as
    one does), said in ddpkit's words with the fix, without a traceback."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix

    def render(self) -> str:
        return DdpkitError.render(self)  # type: ignore[arg-type]


class LaunchError(DdpkitError):
    """The launcher could not start or keep the job running."""


class CheckpointError(DdpkitError):
    """A checkpoint could not be read or written."""


def debug_enabled() -> bool:
    return os.environ.get("DDPKIT_DEBUG", "") not in ("", "0")


def debug_note(where: str, err: BaseException) -> None:
    """An error a diagnostic swallowed on purpose (it must not break what it serves), shown
    under DDPKIT_DEBUG=1 so that it can still be seen."""
    if debug_enabled():
        print(f"ddpkit: debug: {where}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)


_interrupted: list[BaseException] = []


def _end_as_interrupted() -> None:
    """Python ends a process that an uncaught KeyboardInterrupt stopped by SIGINT (130 in a
    shell), but only for the exact class; a Ctrl+C that `InitInterrupted` said ends the same
    way. Registered when ddpkit is imported, so that it runs after the script's own atexit
    functions."""
    if _interrupted:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


atexit.register(_end_as_interrupted)


def end_as_interrupted(value: InitInterrupted) -> None:
    """At exit, end by SIGINT as an uncaught KeyboardInterrupt does (after it was said)."""
    _interrupted.append(value)


def install_excepthook(
    fix_for: Callable[[BaseException, TracebackType | None], str] | None = None,
) -> None:
    """Print an uncaught DdpkitError as `error:` / `fix:` lines instead of a traceback; after
    any other error's traceback, `fix_for`'s line where it has one (a script run without
    `ddpkit run`, whose report would say it)."""
    previous = sys.excepthook
    if getattr(previous, "_ddpkit", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, DdpkitError | InitInterrupted) and not debug_enabled():
            print(value.render(), file=sys.stderr, flush=True)
            if isinstance(value, InitInterrupted):
                end_as_interrupted(value)
            return
        previous(kind, value, tb)
        fix = fix_for(value, tb) if fix_for is not None else ""
        if fix:
            print(f"ddpkit: fix: {fix}", file=sys.stderr, flush=True)

    hook._ddpkit = True  # type: ignore[attr-defined]
    sys.excepthook = hook

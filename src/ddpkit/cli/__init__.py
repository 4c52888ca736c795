"""The `ddpkit` command: a tiny dispatcher over one module per subcommand.

Each command module exposes `add_parser(sub)` and `run(args) -> int`, and imports torch only
inside `run`, so `ddpkit --help` stays fast. `main()` turns a DdpkitError into `error:` and
`fix:` lines and an exit code (2 usage/config, 1 runtime); tracebacks only with --debug or
DDPKIT_DEBUG=1. `entry()` is the command itself (`ddpkit`, `python -m ddpkit`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ddpkit._version import __version__
from ddpkit.errors import DdpkitError, debug_enabled

COMMANDS = ("run", "demo", "doctor", "bench", "ps", "kill", "stacks", "top", "profile")
# the commands that are a launcher: by the time they return, every process of the job has
# ended, its files are closed and the launcher's watchdog has been told it is done
LAUNCHERS = ("run", "demo")
_command: str | None = None  # the command main() ran last


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"error: {message}\nfix: see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ddpkit",
        description="Multi-GPU PyTorch training that works the first time.",
        epilog="Start here: `ddpkit demo`; then `ddpkit run -n gpu train.py`.",
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument(
        "--log-level",
        dest="global_log_level",
        metavar="LEVEL",
        help="ddpkit's own log on stderr: debug, info, warning (default), error; also "
        "DDPKIT_LOG_LEVEL",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"ddpkit.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    target: list[str] | None = None
    if "run" in words:  # the script's own arguments must not meet argparse
        from ddpkit.cli.run import split_argv

        at = words.index("run")
        own, target = split_argv(words[at + 1 :])
        words = [*words[: at + 1], *own]
    args, extra = parser.parse_known_args(words)
    if extra:
        where = f"ddpkit {args.command}" if args.command else "ddpkit"
        fix = f"see `{where} --help`"
        if args.command == "run":
            from ddpkit.launch.base.mistakes import OTHER_LAUNCHERS, fix_for_option

            known = [w for w in extra if w.split("=", 1)[0] in OTHER_LAUNCHERS]
            fix = fix_for_option(known[0]) if known else fix
        print(f"error: {where} does not know {' '.join(extra)}\nfix: {fix}", file=sys.stderr)
        return 2
    if target is not None and args.command == "run":
        args.target = target
    global _command
    _command = args.command
    if args.command is None:
        parser.print_help()
        return 2
    if args.debug:
        os.environ["DDPKIT_DEBUG"] = "1"
    level = getattr(args, "log_level", None) or args.global_log_level
    level = level or os.environ.get("DDPKIT_LOG_LEVEL") or ""
    if level.lower() not in ("", *LOG_LEVELS):
        print(
            f"error: --log-level {level} is not a level\n"
            f"fix: one of {', '.join(LOG_LEVELS)} (DDPKIT_LOG_LEVEL takes the same)",
            file=sys.stderr,
        )
        return 2
    _log_to_stderr("debug" if debug_enabled() else level.lower() or "warning")
    try:
        return int(args.handler(args))
    except DdpkitError as err:
        if debug_enabled():
            raise
        print(err.render(), file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt:
        return 130


class _Said(logging.Formatter):
    """'ddpkit: warning: ...', as the rest of ddpkit's own lines on stderr read."""

    def format(self, record: logging.LogRecord) -> str:
        where = record.name.removeprefix("ddpkit.")
        if record.levelno >= logging.WARNING:
            return f"ddpkit: {record.levelname.lower()}: {record.getMessage()}"
        return f"ddpkit: {record.levelname.lower()} [{where}]: {record.getMessage()}"


LOG_LEVELS = ("debug", "info", "warning", "error")


class _ToConsole(logging.Handler):
    """Log lines go through the launcher's console (ddpkit.launch.base.output) once it is in use,
    so they never cut a rank's line or a debugger's prompt; before, to stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        console = sys.modules.get("ddpkit.launch.base.output")
        if console is not None:
            console.CONSOLE.say(text)  # type: ignore[attr-defined]
            return
        with contextlib.suppress(OSError, ValueError):
            print(text, file=sys.stderr, flush=True)


def _log_to_stderr(level: str) -> None:
    """The one place handlers are configured: ddpkit's loggers (`ddpkit.<module>`) to stderr
    at `level` (--log-level, DDPKIT_LOG_LEVEL; everything with --debug)."""
    root = logging.getLogger("ddpkit")
    if not root.handlers:
        handler = _ToConsole()
        handler.setFormatter(_Said())
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(getattr(logging, level.upper()))


def entry() -> NoReturn:
    """The `ddpkit` command: main(), then exit. A launcher that imported torch would spend
    about a second more tearing the interpreter down (measured on the 2-core CI machine under
    load: SIGTERM to exit 1.3 s, of which 0.95 s after the launcher was done), with nothing
    left to do: it leaves at once, its output flushed (os._exit)."""
    code = main()
    if _command in LAUNCHERS and "torch" in sys.modules:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing more can be said
                stream.flush()
        os._exit(code)
    sys.exit(code)

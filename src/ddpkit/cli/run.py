"""`ddpkit run`: start N workers of a script the way torchrun would, and never leave one behind."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from ddpkit.launch.base import config, mistakes, torchrun_flags

USAGE = "ddpkit run [options] script.py [args] | -m module [args] | --no-python cmd [args]"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="launch a training script on N processes (like torchrun)",
        usage=USAGE,
        description=__doc__,
    )
    config.add_options(p, os.environ)
    config.add_switches(p, os.environ)
    torchrun_flags.add_flags(p, os.environ)
    p.add_argument("-m", "--module", metavar="MODULE", help="run a module, like python -m")
    p.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="run the target as a program, not with python",
    )
    p.set_defaults(handler=run, target=[])


FLAGS_WITHOUT_VALUE = {
    "--no-python",
    "--no_python",
    "-h",
    "--help",
    "--use-env",
    "--use_env",
    "--use-local-rank-arg",
    "--use_local_rank_arg",
    *torchrun_flags.SWITCHES,
    *(f"--{s}" for s in config.SWITCHES),
}


def split_argv(words: list[str]) -> tuple[list[str], list[str]]:
    """ddpkit's options vs the script and its arguments: everything from the script name (or
    the word after -m) on belongs to the script, even words that look like options."""
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return words[:i], words[i + 1 :]
        if word in ("-m", "--module"):
            return words[: i + 2], words[i + 2 :]
        if word.startswith("-m") and not word.startswith("--") or word.startswith("--module="):
            return words[: i + 1], words[i + 1 :]
        if not word.startswith("-"):
            return words[:i], words[i:]
        i += 1 if "=" in word or word in FLAGS_WITHOUT_VALUE else 2
    return words, []


if TYPE_CHECKING:
    from ddpkit.launch.report import Ended


def run(args: argparse.Namespace) -> int:
    cfg = config.from_args(args)
    return start(cfg)


def start(cfg: config.LaunchConfig) -> int:
    """Warn about a privileged port and what in the environment will not do what was meant,
    then hand over to the supervisor (which imports torch); the exit code."""
    return start_job(cfg).exit_code


def start_job(cfg: config.LaunchConfig) -> Ended:
    """`start`, saying how the job ended (for ddpkit.spawn)."""
    from ddpkit.launch.base import ports

    warnings = [
        ports.warn_privileged(cfg.master_port),
        *mistakes.environment_warnings(os.environ),
        *mistakes.rendezvous_warnings(os.environ, cfg.master_addr, cfg.master_port),
    ]
    for warning in filter(None, warnings):
        print(f"ddpkit: warning: {warning}", file=sys.stderr, flush=True)
    from ddpkit.launch.supervisor import launch_job

    return launch_job(cfg)

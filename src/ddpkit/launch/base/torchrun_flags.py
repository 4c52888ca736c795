"""torchrun's command line, understood by `ddpkit run`: every flag of torch 2.11's
`torchrun --help`, with torchrun's meaning where ddpkit has the feature, and a clear error naming
what to do instead where it has not. A README's `torchrun --standalone --nproc_per_node=4
train.py` becomes `ddpkit run --standalone --nproc_per_node=4 train.py` unchanged.

Spellings that are ddpkit options under another name (`--rdzv-endpoint` is `--rdzv`,
`--rdzv-id` is `--run-id`, `--shutdown-timeout` is `--grace`) are aliases, added where the
options are (`ALIASES`). The rest are here.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.errors import ConfigError

# ddpkit option -> torchrun's other names for it
ALIASES: dict[str, tuple[str, ...]] = {
    "rdzv": ("--rdzv-endpoint", "--rdzv_endpoint"),
    "run-id": ("--rdzv-id", "--rdzv_id"),
    "grace": ("--shutdown-timeout", "--shutdown_timeout"),
}

# torchrun flags with no ddpkit feature: flag -> what to do instead
UNSUPPORTED: dict[str, str] = {
    "event-log-handler": "leave it out: ddpkit writes each run's report to report.txt in the "
    "run folder (--log-dir)",
    "logs-specs": "leave it out: ddpkit writes one log per rank in the run folder (--log-dir)",
    "numa-binding": "leave it out, or bind inside the script (os.sched_setaffinity) or with "
    "numactl in a wrapper (--no-python)",
    "virtual-local-rank": "leave it out: each rank sees every visible GPU and uses "
    "cuda:LOCAL_RANK (ddpkit.setup() sets it)",
    "duplicate-stdout-filters": "leave it out: every rank's output is in its log "
    "(rankN.log); filter those with grep",
    "duplicate-stderr-filters": "leave it out: every rank's output is in its log "
    "(rankN.log); filter those with grep",
}
STREAMS = {"0": frozenset(), "1": frozenset({1}), "2": frozenset({2}), "3": frozenset({1, 2})}
SIGNALS_DEFAULT = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
# flags of this module that take no value (for splitting ddpkit's options from the script's)
SWITCHES = ("--standalone", "--run-path", "--run_path")


@dataclass(frozen=True)
class TorchrunOptions:
    """What torchrun's own flags asked for, checked."""

    monitor_interval: float = 0.05
    role: str = "default"
    hidden: tuple[tuple[int, frozenset[int]], ...] = ()  # (local rank or -1: all, streams)
    local_ranks: frozenset[int] | None = None  # --local-ranks-filter
    signals: tuple[int, ...] = ()  # --signals-to-handle (empty: ddpkit's default)
    local_rank_arg: str | None = None  # "--local-rank": passed to the script as an argument


def add_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """torchrun's own flags, each also read from PET_<NAME> as torchrun reads it."""
    env = {} if environ is None else environ
    group = parser.add_argument_group(
        "torchrun's flags",
        "accepted as torchrun takes them, also from torchrun's PET_<NAME> variables "
        "(docs/launcher.md, 'torchrun's flags')",
    )

    def flag(name: str, **kw: object) -> None:
        spellings = dict.fromkeys((f"--{name}", f"--{name.replace('-', '_')}"))
        pet = "PET_" + name.upper().replace("-", "_")
        if kw.get("action") == "store_true":  # torchrun's check_env: PET_X=1 turns it on
            kw["default"] = env.get(pet, "0").strip() not in ("", "0")
        elif pet in env:
            kw["default"] = env[pet]
        group.add_argument(*spellings, **kw)  # type: ignore[arg-type]

    flag("rdzv-backend", metavar="NAME", help="c10d or static (both what ddpkit does)")
    flag("standalone", action="store_true", help="one node, a free port (ddpkit's default)")
    flag("monitor-interval", metavar="S", help="seconds between the launcher's looks at the ranks")
    flag("start-method", metavar="M", help="spawn, fork or forkserver (scripts always start anew)")
    flag("role", metavar="NAME", help="ROLE_NAME of the workers (default: default)")
    flag("run-path", action="store_true", help="run the target as a script (the default)")
    group.add_argument("-r", "--redirects", metavar="0-3", help="streams only in the logs: 1 "
                       "stdout, 2 stderr, 3 both; per local rank as 0:3,1:2",
                       default=env.get("PET_REDIRECTS"))  # fmt: skip
    group.add_argument("-t", "--tee", metavar="0-3", help="streams to the console and the logs "
                       "(ddpkit always writes both)", default=env.get("PET_TEE"))  # fmt: skip
    flag("local-ranks-filter", metavar="R,..", help="local ranks whose output reaches the console")
    flag("signals-to-handle", metavar="SIG,..", help="signals forwarded to every rank")
    flag(
        "use-local-rank-arg",
        nargs="?",
        const="--local-rank",
        metavar="SPELLING",
        help="pass --local-rank=N to the script, as torch.distributed.launch did "
        "(or --local_rank with --use-local-rank-arg=--local_rank)",
    )
    group.add_argument("--use-env", "--use_env", action="store_true", help=argparse.SUPPRESS)
    for name in UNSUPPORTED:
        flag(name, metavar="X", help=argparse.SUPPRESS)


def from_args(args: argparse.Namespace) -> TorchrunOptions:
    for name, instead in UNSUPPORTED.items():
        if getattr(args, name.replace("-", "_"), None) is not None:
            raise ConfigError(f"torchrun's --{name} has no ddpkit equivalent", fix=instead)
    backend = args.rdzv_backend
    if backend is not None and backend not in ("c10d", "static"):
        raise ConfigError(
            f"--rdzv-backend {backend!r}: ddpkit meets through torch elastic's c10d rendezvous",
            fix="use --rdzv-backend c10d (or leave it out) with --rdzv-endpoint HOST:PORT",
        )
    if args.start_method not in (None, "spawn", "fork", "forkserver"):
        raise ConfigError(
            f"--start-method {args.start_method!r} is not spawn, fork or forkserver",
            fix="leave it out: ddpkit starts each rank as a new process running the script",
        )
    interval = 0.05 if args.monitor_interval is None else _seconds(args.monitor_interval)
    return TorchrunOptions(
        monitor_interval=interval,
        role=args.role or "default",
        hidden=_redirects(args.redirects) if args.redirects else (),
        local_ranks=_local_ranks(args.local_ranks_filter) if args.local_ranks_filter else None,
        signals=_signals(args.signals_to_handle) if args.signals_to_handle else (),
        local_rank_arg=_spelling(args.use_local_rank_arg),
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.01 <= value <= 60:
        raise ConfigError(
            f"--monitor-interval {text!r} is not between 0.01 and 60 seconds",
            fix="e.g. --monitor-interval 0.1, or leave it out",
        )
    return value


def _redirects(text: str) -> tuple[tuple[int, frozenset[int]], ...]:
    """torchrun's "3" (every local rank) or "0:3,1:2" (per local rank)."""
    pairs = []
    for part in text.split(","):
        rank, sep, value = part.strip().rpartition(":")
        if value not in STREAMS or (sep and not rank.isdigit()):
            raise ConfigError(
                f"--redirects {text!r} is not 0-3, or LOCAL_RANK:0-3,...",
                fix="e.g. --redirects 3 (output only in the logs) or --redirects 0:0,1:3",
            )
        pairs.append((int(rank) if sep else -1, STREAMS[value]))
    return tuple(pairs)


def _local_ranks(text: str) -> frozenset[int]:
    try:
        return frozenset(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter {text!r} is not a list of local ranks", fix="e.g. 0 or 0,1"
        ) from None


def _signals(text: str) -> tuple[int, ...]:
    found = []
    for name in text.split(","):
        name = name.strip().upper()
        try:
            found.append(int(signal.Signals[name if name.startswith("SIG") else "SIG" + name]))
        except KeyError:
            raise ConfigError(
                f"--signals-to-handle {text!r}: {name!r} is not a signal",
                fix=f"e.g. --signals-to-handle {SIGNALS_DEFAULT}",
            ) from None
    if signal.SIGKILL in found or signal.SIGSTOP in found:
        raise ConfigError(
            "--signals-to-handle: SIGKILL and SIGSTOP cannot be caught",
            fix=f"e.g. --signals-to-handle {SIGNALS_DEFAULT}",
        )
    return tuple(found)


def _spelling(value: str | None) -> str | None:
    if value in (None, "--local-rank", "--local_rank"):
        return value
    raise ConfigError(
        f"--use-local-rank-arg={value}: the argument is --local-rank or --local_rank",
        fix="--use-local-rank-arg (passes --local-rank=N) or --use-local-rank-arg=--local_rank",
    )

"""argv (and DDPKIT_* variables) -> a checked, frozen LaunchConfig. Nothing starts here.

Every flag can come from an environment variable named DDPKIT_<FLAG> (dashes as
underscores, e.g. DDPKIT_NPROC_PER_NODE=2); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from ddpkit.env import LOOPBACK, _int, slurm_hosts, slurm_port
from ddpkit.errors import ConfigError
from ddpkit.gpus import visible_gpu_count
from ddpkit.launch import torchrun_flags
from ddpkit.launch.torchrun_flags import TorchrunOptions

TargetKind = Literal["script", "module", "command"]
DAY, WEEK = 86400.0, 7 * 86400.0  # the longest grace, and the longest timeouts
MAX_NODES = 100_000
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
__all__ = ["LaunchConfig", "add_options", "add_switches", "build", "from_args", "replace"]

# flag -> (default, help); the environment variable is DDPKIT_ + flag in upper snake case.
OPTIONS: dict[str, tuple[str | None, str]] = {
    "nproc-per-node": (
        "auto",
        "processes on this node: N, gpu (one per visible GPU), cpu "
        "(2 CPU processes on gloo) or auto (gpu when there are GPUs, else cpu)",
    ),
    "nnodes": ("1", "number of nodes, or MIN:MAX for elastic membership with --rdzv"),
    "node-rank": (None, "this node's rank, with --master-addr (static multi-node)"),
    "rdzv": (None, "HOST:PORT of torch elastic's c10d rendezvous, for multi-node"),
    "rdzv-conf": (
        None,
        "settings of the rendezvous as KEY=VALUE,... (torchrun's): join_timeout, "
        "last_call_timeout, close_timeout, keep_alive_interval, keep_alive_max_attempt",
    ),
    "master-addr": (
        None,
        "node 0's address as the other nodes reach it: static multi-node (default: loopback), "
        "or with --rdzv to override what node 0 finds",
    ),
    "local-addr": (
        None,
        "this node's address as the other nodes reach it, if it becomes node 0 (default: the "
        "address on the route to the rendezvous host)",
    ),
    "master-port": ("0", "port of the job's store; 0 picks a free one without a race"),
    "max-restarts": ("0", "restart the whole group this many times after a failure"),
    "node-timeout": (
        "10",
        "seconds another node's launcher may not answer before the job stops on every node",
    ),
    "grace": ("5", "seconds between SIGTERM and SIGKILL when stopping workers"),
    "init-timeout": ("300", "seconds a rank may wait at init for a peer that never arrives"),
    "log-dir": (None, "folder for this run's logs (default: a new 0700 folder in /tmp)"),
    "ranks": (None, "only these ranks' output on the console, e.g. 0 or 0,2 (logs get all)"),
    "run-id": (None, "job id (default: random); shown by `ddpkit ps`"),
    "stdin": (
        "auto",
        "the rank that reads this terminal's input (breakpoint(), input()): a rank, none, or "
        "auto (rank 0 when stdin is a terminal)",
    ),
    "hang-timeout": (
        "300",
        "seconds without progress on every rank before the job is called "
        "hung, its stacks shown and it is stopped; 0 turns this off",
    ),
}
# flag -> help; DDPKIT_<FLAG>=1 turns it on
SWITCHES: dict[str, str] = {
    "check-collectives": "check that every rank calls the same collective with the same "
    "shapes, and name the first divergence (TORCH_DISTRIBUTED_DEBUG=DETAIL; slower)",
}


@dataclass(frozen=True)
class LaunchConfig:
    kind: TargetKind
    target: str
    args: tuple[str, ...]
    nproc_per_node: int
    backend: str  # "nccl", "gloo" or "auto": what the workers are told (DDPKIT_BACKEND)
    nnodes: int = 1  # the most nodes
    min_nodes: int = 1  # the fewest nodes that start the job (--nnodes MIN:MAX)
    node_rank: int | None = None
    rdzv: str | None = None
    master_addr: str = LOOPBACK
    master_port: int = 0
    max_restarts: int = 0
    node_timeout: float = 10.0
    local_addr: str | None = None
    rdzv_conf: tuple[tuple[str, str], ...] = ()  # torch elastic's rendezvous settings
    grace: float = 5.0
    init_timeout: float = 300.0
    log_dir: Path | None = None
    ranks: frozenset[int] | None = None
    stdin: str = "auto"  # "auto", "none" or a rank number
    run_id: str = ""
    omp_threads: int | None = None
    run_id_given: bool = False
    master_addr_given: bool = False
    hang_timeout: float = 300.0
    check_collectives: bool = False
    torchrun: TorchrunOptions = TorchrunOptions()  # what torchrun's own flags asked for
    raw_output: bool = False  # no [rank N] prefix (ddpkit bench prints nccl-tests' table)
    track: bool = True  # per-collective records and the flight recorder (hang doctor)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def add_options(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    for flag, (default, text) in OPTIONS.items():
        var = variable(flag)
        names = [f"--{flag}"]
        if flag == "nproc-per-node":
            names = ["-n", "--nproc-per-node", "--nproc_per_node"]
        elif "-" in flag:
            names.append(f"--{flag.replace('-', '_')}")  # torchrun's spelling
        names += torchrun_flags.ALIASES.get(flag, ())
        parser.add_argument(
            *names,
            dest=flag.replace("-", "_"),
            metavar=flag.split("-")[-1].upper(),
            default=environ.get(var, default),
            help=f"{text} [${var}]",
        )


def add_switches(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    for flag, text in SWITCHES.items():
        var = variable(flag)
        on = environ.get(var, "") not in ("", "0")
        parser.add_argument(f"--{flag}", action="store_true", default=on, help=f"{text} [${var}=1]")


def variable(flag: str) -> str:
    """The environment variable an option is also read from: DDPKIT_<OPTION>."""
    return "DDPKIT_" + flag.upper().replace("-", "_")


def build(
    kind: TargetKind,
    target: str,
    args: tuple[str, ...] | list[str] = (),
    environ: Mapping[str, str] | None = None,
    **options: object,
) -> LaunchConfig:
    """The LaunchConfig `ddpkit run` would make with these options (by their dest name, e.g.
    nproc_per_node="cpu"); every other option from its DDPKIT_<OPTION> variable or default.
    For the commands that launch a job themselves (demo, bench, doctor)."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {
        flag.replace("-", "_"): env.get(variable(flag), default)
        for flag, (default, _) in OPTIONS.items()
    }
    values.update(
        {flag.replace("-", "_"): env.get(variable(flag), "") not in ("", "0") for flag in SWITCHES}
    )
    unknown = set(options) - set(values)
    if unknown:
        raise TypeError(f"unknown launch options: {sorted(unknown)}")
    values.update({k: v for k, v in options.items() if v is not None})
    namespace = argparse.Namespace(
        **values,
        module=target if kind == "module" else None,
        no_python=kind == "command",
        target=list(args) if kind == "module" else [target, *args],
    )
    return from_args(namespace, env)


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    env = os.environ if environ is None else environ
    torchrun = torchrun_flags.from_args(args) if hasattr(args, "rdzv_backend") else None
    kind, target, rest = _target(args)
    min_nodes, nnodes, node_rank, master_addr, master_port = _nodes(args, env)
    nproc, backend = _nproc(args.nproc_per_node, env)
    max_restarts = _number(args.max_restarts, "--max-restarts", int, minimum=0, maximum=1000)
    if min_nodes != nnodes and not args.rdzv:
        raise ConfigError(
            f"--nnodes {min_nodes}:{nnodes} (elastic membership) needs --rdzv",
            fix="add --rdzv HOST:PORT (the same on every node), or give one node count",
        )
    if getattr(args, "standalone", False) and nnodes > 1:
        raise ConfigError(
            f"--standalone is one node, and --nnodes says {nnodes}",
            fix="leave out --standalone, and give --rdzv-endpoint HOST:PORT on every node",
        )
    if nnodes > 1 and not args.rdzv and node_rank is None:
        raise ConfigError(
            f"--nnodes {nnodes} needs to know how the nodes meet",
            fix="add --rdzv HOST:PORT (same on every node), or --node-rank K "
            "and --master-addr HOST",
        )
    return LaunchConfig(
        kind=kind,
        target=target,
        args=rest,
        nproc_per_node=nproc,
        backend=backend,
        nnodes=nnodes,
        min_nodes=min_nodes,
        node_rank=node_rank,
        rdzv=_endpoint(args.rdzv) if args.rdzv else None,
        rdzv_conf=_rdzv_conf(args.rdzv_conf) if args.rdzv_conf else (),
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=max_restarts,
        node_timeout=_number(args.node_timeout, "--node-timeout", float, minimum=1, maximum=DAY),
        local_addr=args.local_addr or None,
        grace=_number(args.grace, "--grace", float, minimum=0, maximum=DAY),
        init_timeout=_number(args.init_timeout, "--init-timeout", float, minimum=0.1, maximum=WEEK),
        log_dir=Path(args.log_dir).expanduser() if args.log_dir else None,
        ranks=_ranks(args.ranks, nproc * nnodes) if args.ranks else None,
        stdin=_stdin(args.stdin),
        run_id=_run_id(args.run_id) if args.run_id else uuid.uuid4().hex[:8],
        omp_threads=None if "OMP_NUM_THREADS" in env else _omp_threads(nproc),
        run_id_given=bool(args.run_id),
        master_addr_given=bool(args.master_addr),
        hang_timeout=_number(args.hang_timeout, "--hang-timeout", float, minimum=0, maximum=WEEK),
        check_collectives=bool(getattr(args, "check_collectives", False)),
        torchrun=torchrun or TorchrunOptions(),
    )


def _target(args: argparse.Namespace) -> tuple[TargetKind, str, tuple[str, ...]]:
    words = list(args.target)
    if args.module:
        _check_module(args.module)
        return "module", args.module, tuple(words)
    if not words:
        raise ConfigError(
            "no script to run", fix="ddpkit run [options] train.py [args], or -m package.module"
        )
    first, rest = words[0], tuple(words[1:])
    if args.no_python:
        found = shutil.which(first) or (first if Path(first).is_file() else None)
        if found is None:
            raise ConfigError(
                f"command {first!r} not found on PATH", fix="give the full path, or install it"
            )
        if not os.access(found, os.X_OK):
            raise ConfigError(
                f"{first!r} is not executable",
                fix=f"chmod +x {first}, or run it with its interpreter",
            )
        return "command", first, rest
    if first.startswith("-"):
        raise ConfigError(
            f"unknown option {first!r} before the script",
            fix="see `ddpkit run --help`; options go before the script name",
        )
    if not Path(first).is_file():
        raise ConfigError(
            f"script {first!r} not found (looked in {Path.cwd()})",
            fix="check the path; to run a module use -m package.module",
        )
    return "script", str(Path(first)), rest


def _nproc(value: str, env: Mapping[str, str]) -> tuple[int, str]:
    gpus = visible_gpu_count(dict(env))
    word = str(value).strip().lower()
    if word == "auto":
        word = "gpu" if gpus else "cpu"
    if word == "cpu":
        return 2, "gloo"
    if word == "gpu":
        if not gpus:
            shown = env.get("CUDA_VISIBLE_DEVICES", "<unset>")
            raise ConfigError(
                "-n gpu asks for one process per GPU, and no GPU is visible "
                f"(CUDA_VISIBLE_DEVICES={shown})",
                fix="use -n cpu (or a number) to run on the CPU with gloo",
            )
        return gpus, "nccl"
    n = _number(value, "-n/--nproc-per-node", int, minimum=1, allowed="a number, gpu, cpu or auto")
    limit = _nproc_limit(env)
    if not gpus and n > limit:
        cores = _cores()
        raise ConfigError(
            f"-n {n} starts {n} CPU processes on {cores} core(s); past {limit} they only "
            "fight for the cores and memory (each rank holds its own torch)",
            fix=f"use at most -n {limit}, or set DDPKIT_NPROC_LIMIT={n} if you mean it",
        )
    if gpus and n > gpus:
        raise ConfigError(
            f"-n {n} starts {n} processes but only {gpus} GPU(s) are visible; with nccl each "
            "rank needs its own GPU",
            fix=f"use -n {gpus} (or -n gpu), or -n cpu to run CPU processes on gloo",
        )
    return n, "auto" if gpus else "gloo"


def _nodes(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[int, int, int | None, str, int]:
    low, sep, high = str(args.nnodes).partition(":")
    nnodes = _number(high if sep else low, "--nnodes", int, minimum=1, maximum=MAX_NODES)
    min_nodes = _number(low, "--nnodes", int, minimum=1, maximum=MAX_NODES) if sep else nnodes
    if min_nodes > nnodes:
        raise ConfigError(
            f"--nnodes {args.nnodes}: MIN is larger than MAX", fix="e.g. --nnodes 2:4"
        )
    node_rank = (
        None
        if args.node_rank is None
        else _number(args.node_rank, "--node-rank", int, minimum=0, maximum=MAX_NODES)
    )
    master_addr = args.master_addr or LOOPBACK
    master_port = _number(args.master_port, "--master-port", int, minimum=0)
    if master_port > 65535:
        raise ConfigError(
            f"--master-port {master_port} is not a TCP port (1-65535)",
            fix="use a port above 1024, or leave it out",
        )
    slurm_nodes = _int(env, "SLURM_NNODES", minimum=1, default=1) if "SLURM_PROCID" in env else 1
    if slurm_nodes > 1 and nnodes == 1 and not args.rdzv:
        # `srun ddpkit run ...`: one launcher per node, nodes and rank 0's host from SLURM.
        tasks = _int(env, "SLURM_NTASKS", minimum=1, default=slurm_nodes)
        if tasks != slurm_nodes:
            raise ConfigError(
                f"srun started {tasks} tasks on {slurm_nodes} nodes; ddpkit run starts the "
                "processes of a node itself, so it needs exactly one task per node",
                fix="srun --ntasks-per-node=1 ddpkit run -n gpu train.py",
            )
        nnodes, node_rank = slurm_nodes, _int(env, "SLURM_NODEID", minimum=0, default=0)
        min_nodes = nnodes
        master_addr = args.master_addr or slurm_hosts(env)[0]
        master_port = master_port or slurm_port(env)
    if nnodes > 1 and node_rank is not None:
        if node_rank >= nnodes:
            raise ConfigError(
                f"--node-rank {node_rank} but --nnodes {nnodes}",
                fix=f"node ranks run from 0 to {nnodes - 1}",
            )
        if not master_port:
            raise ConfigError(
                "static multi-node needs a fixed --master-port on every node",
                fix="add --master-port P (the same on every node)",
            )
    return min_nodes, nnodes, node_rank, master_addr, master_port


def _endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv {text!r} is not HOST:PORT", fix="e.g. --rdzv node0:29400")
    return text


RDZV_SETTINGS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "timeout",
    "is_host",
)


def _rdzv_conf(text: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not part.strip():
            continue
        if not sep or key not in RDZV_SETTINGS or not value.strip():
            raise ConfigError(
                f"--rdzv-conf {text!r}: {part.strip()!r} is not KEY=VALUE with a known key",
                fix=f"keys: {', '.join(RDZV_SETTINGS)}; e.g. --rdzv-conf last_call_timeout=5",
            )
        pairs.append((key, value.strip()))
    return tuple(pairs)


def _stdin(text: str) -> str:
    word = str(text).strip().lower()
    if word in ("auto", "none") or (word.isdigit() and len(word) < 7):
        return word
    raise ConfigError(
        f"--stdin {text!r} is not a rank, none or auto", fix="e.g. --stdin 0, or --stdin none"
    )


def _ranks(text: str, world: int) -> frozenset[int]:
    try:
        ranks = frozenset(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        ranks = frozenset({-1})
    if not ranks or min(ranks) < 0 or max(ranks) >= world:
        raise ConfigError(
            f"--ranks {text!r} is not a list of ranks of this job (0 to {world - 1})",
            fix="e.g. --ranks 0 or --ranks 0,1",
        )
    return ranks


def _run_id(text: str) -> str:
    if not RUN_ID.fullmatch(text) or ".." in text:
        raise ConfigError(
            f"--run-id {text[:80]!r} is not a job id: letters, digits, '.', '_' and '-', "
            "at most 64, starting with a letter or digit",
            fix="e.g. --run-id exp42-lr3e-4",
        )
    return text


def _number(
    value: object,
    flag: str,
    kind: type,
    minimum: float,
    allowed: str = "",
    maximum: float | None = None,
) -> Any:
    """A finite number of `kind` in [minimum, maximum], or a ConfigError naming the flag."""
    try:
        number = kind(str(value).strip()) if kind is float else kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(
            f"{flag} {value!r} is not {allowed or 'a number'}",
            fix=f"see `ddpkit run --help` for {flag}",
        ) from None
    if kind is float and not math.isfinite(number):
        raise ConfigError(
            f"{flag} {value!r} is not a finite number of seconds",
            fix=f"give {flag} a number of seconds" + (" (0: off)" if "hang" in flag else ""),
        )
    if number < minimum:
        raise ConfigError(
            f"{flag} {value!r} must be at least {minimum:g}",
            fix=f"see `ddpkit run --help` for {flag}",
        )
    if maximum is not None and number > maximum:
        raise ConfigError(
            f"{flag} {value!r} is more than {maximum:g}",
            fix=f"use a value up to {maximum:g}",
        )
    return number


def _cores() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def _nproc_limit(env: Mapping[str, str]) -> int:
    """CPU processes per node: 4 per core (at least 8), or DDPKIT_NPROC_LIMIT."""
    raw = env.get("DDPKIT_NPROC_LIMIT", "").strip()
    if raw:
        return int(_number(raw, "DDPKIT_NPROC_LIMIT", int, minimum=1, maximum=100_000))
    return max(8, 4 * _cores())


def _check_module(name: str) -> None:
    """`-m NAME`: its top-level package must be importable where the ranks start (the current
    folder first). Found without importing anything."""
    import importlib.machinery

    top = name.split(".")[0]
    if not top.isidentifier() or not all(p.isidentifier() for p in name.split(".")):
        raise ConfigError(f"-m {name!r} is not a module name", fix="e.g. -m package.train")
    if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None and (
        top not in sys.builtin_module_names
    ):
        raise ConfigError(
            f"-m {name}: no module {top!r} in the current folder or on the Python path",
            fix="check the name, run from the folder that holds it, or install its package",
        )


def _omp_threads(nproc: int) -> int:
    return max(1, _cores() // nproc)

"""argv (and DDPKIT_* and PET_* variables) -> a checked, frozen LaunchConfig. Nothing starts
here.

Every flag can come from an environment variable named DDPKIT_<FLAG> (dashes as
underscores, e.g. DDPKIT_NPROC_PER_NODE=2); a flag on the command line wins. The options
torchrun has are also read, as torchrun reads them, from PET_<TORCHRUN'S NAME> (PET_NNODES,
PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT, PET_RDZV_ENDPOINT...):
what Kubernetes jobs (Kubeflow's PyTorchJob and Trainer) set for torchrun. Command line first,
then DDPKIT_<FLAG>, then PET_*, then the default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from ddpkit.common.gpus import visible_gpu_count
from ddpkit.env import LOOPBACK, _int, slurm_hosts, slurm_port
from ddpkit.errors import ConfigError
from ddpkit.launch.base import torchrun_flags, values
from ddpkit.launch.base.mistakes import fix_for_option, is_python, launcher_flags_after
from ddpkit.launch.base.torchrun_flags import TorchrunOptions

TargetKind = Literal["script", "module", "command", "function"]  # function: ddpkit.spawn
DAY, WEEK = 86400.0, 7 * 86400.0  # the longest grace, and the longest timeouts
MAX_NODES = 100_000
__all__ = ["LaunchConfig", "add_options", "add_switches", "build", "from_args", "replace"]

# flag -> (default, help); the environment variable is DDPKIT_ + flag in upper snake case.
OPTIONS: dict[str, tuple[str | None, str]] = {
    "nproc-per-node": (
        "auto",
        "processes on this node: N, gpu (one per visible GPU), cpu "
        "(2 CPU processes on gloo) or auto (gpu when there are GPUs, else cpu)",
    ),
    "nnodes": (
        "1",
        "number of nodes, or MIN:MAX for elastic membership with --rdzv (nodes may join; with "
        "--max-restarts the nodes left go on after a loss)",
    ),
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
        "the most seconds with no progress on any rank before the job is called hung, its "
        "stacks shown and it is stopped; 0 turns the hang watch off",
    ),
    "hang-min": (
        "20",
        "the soonest (seconds with no progress on any rank) a job is called hung; a job whose "
        "own steps are long, or that came back from long quiet stretches, gets more (3 times "
        "its longest recent step, twice its longest quiet stretch), up to --hang-timeout",
    ),
    "straggler-threshold": (
        "1.2",
        "a rank whose own time per step (data, compute, host) stays this many times the "
        "median rank's is named as a straggler; 0 turns the verdicts off",
    ),
    "straggler-window": ("50", "steps of each rank a straggler verdict looks at"),
    "profile-steps": (
        None,
        "record these steps of every rank with torch's profiler, e.g. 20-25 (numbered as "
        "`ddpkit top` shows them): a trace per rank, a merged one and where each step goes, in "
        "the run folder and printed (also on a running job: `ddpkit profile`)",
    ),
    "log-level": (
        "warning",
        "the launcher's own log on stderr (ddpkit.<module>): debug shows each decision as it "
        "is made (phases, actions, verdicts); info, warning, error",
    ),
}
# ddpkit option -> torchrun's name for it, read from PET_<NAME> as torchrun does
TORCHRUN_NAMES: dict[str, str] = {
    "nproc-per-node": "nproc_per_node",
    "nnodes": "nnodes",
    "node-rank": "node_rank",
    "rdzv": "rdzv_endpoint",
    "rdzv-conf": "rdzv_conf",
    "master-addr": "master_addr",
    "master-port": "master_port",
    "local-addr": "local_addr",
    "max-restarts": "max_restarts",
    "run-id": "rdzv_id",
    "log-dir": "log_dir",
}
# flag -> help; DDPKIT_<FLAG>=1 turns it on
SWITCHES: dict[str, str] = {
    "memory-snapshot": "on an out-of-memory error, the failing GPU rank's allocator history "
    "(its last 100000 events: open it in pytorch.org/memory_viz) and a plot of its memory, in the "
    "run folder",
    "no-spares": "start each restart cold: no warm spares (with --max-restarts, one process per "
    "local rank imports torch while the job trains, ~0.3 GB of host memory each, and takes its "
    "rank's place at a restart, seconds sooner)",
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
    hang_min: float = 20.0
    straggler_threshold: float = 1.2
    straggler_window: int = 50
    check_collectives: bool = False
    memory_snapshot: bool = False
    spares: bool = True  # warm spares for restarts (ddpkit.launch.spares); --no-spares
    profile_steps: tuple[int, int] | None = None  # --profile-steps A-B: the first and last
    torchrun: TorchrunOptions = TorchrunOptions()  # what torchrun's own flags asked for
    raw_output: bool = False  # no [rank N] prefix (ddpkit bench prints nccl-tests' table)
    track: bool = True  # per-collective records and the flight recorder (hang doctor)
    # ddpkit.spawn of a function defined in a notebook: each rank is a fork of this process
    # that runs entry(*arguments) (ddpkit.launch.forked); None: ranks are started commands
    forked: tuple[Callable[..., Any], tuple[Any, ...]] | None = None

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
        pet = f" or ${pet_variable(flag)}" if flag in TORCHRUN_NAMES else ""
        shown = f"; default {default}" if default is not None else ""
        parser.add_argument(
            *names,
            dest=flag.replace("-", "_"),
            metavar=flag.split("-")[-1].upper(),
            default=from_environment(flag, environ, default),
            help=f"{text} [${var}{pet}{shown}]",
        )


def add_switches(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    for flag, text in SWITCHES.items():
        var = variable(flag)
        on = environ.get(var, "") not in ("", "0")
        parser.add_argument(f"--{flag}", action="store_true", default=on, help=f"{text} [${var}=1]")


def variable(flag: str) -> str:
    """The environment variable an option is also read from: DDPKIT_<OPTION>."""
    return "DDPKIT_" + flag.upper().replace("-", "_")


def pet_variable(flag: str) -> str:
    """torchrun's variable for an option it has (PET_NNODES), as torchrun reads it."""
    return "PET_" + TORCHRUN_NAMES[flag].upper()


def from_environment(flag: str, environ: Mapping[str, str], default: str | None) -> str | None:
    """An option's value when the command line does not give it: DDPKIT_<OPTION>, then
    torchrun's PET_<NAME>, then the default."""
    value = environ.get(variable(flag))
    if value is None and flag in TORCHRUN_NAMES:
        value = environ.get(pet_variable(flag))
    return default if value is None else value


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
        flag.replace("-", "_"): from_environment(flag, env, default)
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
    max_restarts = values.number(args.max_restarts, "--max-restarts", int, minimum=0, maximum=1000)
    if min_nodes != nnodes and not args.rdzv:
        raise ConfigError(
            f"--nnodes {min_nodes}:{nnodes} (elastic membership) needs --rdzv",
            fix="add --rdzv HOST:PORT (the same on every node), or give one node count",
        )
    threshold = str(args.straggler_threshold).strip()
    if (
        threshold not in ("0", "0.0")
        and values.number(threshold, "--straggler-threshold", float, minimum=0) <= 1
    ):
        raise ConfigError(
            f"--straggler-threshold {threshold} is not above 1: it is a factor over the median "
            "rank's time",
            fix="e.g. --straggler-threshold 1.2 (a rank 20% slower), or 0 to turn verdicts off",
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
        rdzv=values.endpoint(args.rdzv) if args.rdzv else None,
        rdzv_conf=values.rdzv_conf(args.rdzv_conf) if args.rdzv_conf else (),
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=max_restarts,
        node_timeout=values.number(
            args.node_timeout, "--node-timeout", float, minimum=1, maximum=DAY
        ),
        local_addr=args.local_addr or None,
        grace=values.number(args.grace, "--grace", float, minimum=0, maximum=DAY),
        init_timeout=values.number(
            args.init_timeout, "--init-timeout", float, minimum=0.1, maximum=WEEK
        ),
        log_dir=Path(args.log_dir).expanduser() if args.log_dir else None,
        ranks=values.ranks(args.ranks, nproc * nnodes) if args.ranks else None,
        stdin=values.stdin(args.stdin),
        run_id=values.run_id(args.run_id) if args.run_id else uuid.uuid4().hex[:8],
        omp_threads=None if "OMP_NUM_THREADS" in env else _omp_threads(nproc),
        run_id_given=bool(args.run_id),
        master_addr_given=bool(args.master_addr),
        hang_timeout=values.number(
            args.hang_timeout, "--hang-timeout", float, minimum=0, maximum=WEEK
        ),
        hang_min=values.number(args.hang_min, "--hang-min", float, minimum=1, maximum=WEEK),
        straggler_threshold=values.number(
            args.straggler_threshold, "--straggler-threshold", float, minimum=0, maximum=100
        ),
        straggler_window=values.number(
            args.straggler_window, "--straggler-window", int, minimum=4, maximum=100_000
        ),
        check_collectives=bool(getattr(args, "check_collectives", False)),
        memory_snapshot=bool(getattr(args, "memory_snapshot", False)),
        spares=not getattr(args, "no_spares", False),
        profile_steps=values.step_range(args.profile_steps) if args.profile_steps else None,
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
            fix=fix_for_option(first),
        )
    if is_python(first):
        script = f" {rest[0]}" if rest else " train.py"
        raise ConfigError(
            f"{first!r} is the interpreter, not a script: ddpkit run starts Python itself",
            fix=f"drop it: ddpkit run [options]{script} ...",
        )
    if not Path(first).is_file():
        raise ConfigError(
            f"script {first!r} not found (looked in {Path.cwd()})",
            fix="check the path; to run a module use -m package.module",
        )
    misplaced = launcher_flags_after(first, rest)
    if misplaced is not None:
        raise ConfigError(misplaced[0], fix=misplaced[1])
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
    n = values.number(
        value, "-n/--nproc-per-node", int, minimum=1, allowed="a number, gpu, cpu or auto"
    )
    limit = _nproc_limit(env)
    if not gpus and n > limit:
        cores = values.cores()
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
    nnodes = values.number(high if sep else low, "--nnodes", int, minimum=1, maximum=MAX_NODES)
    min_nodes = values.number(low, "--nnodes", int, minimum=1, maximum=MAX_NODES) if sep else nnodes
    if min_nodes > nnodes:
        raise ConfigError(
            f"--nnodes {args.nnodes}: MIN is larger than MAX", fix="e.g. --nnodes 2:4"
        )
    node_rank = (
        None
        if args.node_rank is None
        else values.number(args.node_rank, "--node-rank", int, minimum=0, maximum=MAX_NODES)
    )
    master_addr = args.master_addr or LOOPBACK
    master_port = values.number(args.master_port, "--master-port", int, minimum=0)
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


def _nproc_limit(env: Mapping[str, str]) -> int:
    """CPU processes per node: 4 per core (at least 8), or DDPKIT_NPROC_LIMIT."""
    raw = env.get("DDPKIT_NPROC_LIMIT", "").strip()
    if raw:
        return int(values.number(raw, "DDPKIT_NPROC_LIMIT", int, minimum=1, maximum=100_000))
    return max(8, 4 * values.cores())


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
    return max(1, values.cores() // nproc)

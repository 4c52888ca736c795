"""The distributed environment: read from the launcher's variables, checked, frozen.

`read_env()` understands what torchrun (and `ddpkit run`) set, what SLURM's `srun` sets and what
Open MPI's `mpirun` sets, and returns one `DistEnv`. A malformed or contradictory value raises
`EnvError` naming the variable, its value and the fix; nothing here waits or touches the network,
and torch is not imported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ddpkit.common import protocol
from ddpkit.errors import EnvError

Launcher = Literal["ddpkit", "torchrun", "env", "slurm", "mpi", "none"]

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29500
LAUNCH_FIX = "unset it and start the script with a launcher: `ddpkit run -n 2 train.py`"


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job. `launcher` says which variables it came from:
    ddpkit / torchrun (their variables), env (torchrun's names exported by hand), slurm, mpi,
    or none (a plain `python train.py`: one process)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: int = DEFAULT_PORT
    launcher: Launcher = "none"

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Parse the launcher's variables in `environ` (default: os.environ) into a DistEnv."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env or "LOCAL_RANK" in env:
        return _read_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _read_mpi(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _read_slurm(env)
    return DistEnv()


def check_gpu_fit(env: DistEnv, visible_gpus: int) -> None:
    """Fail when this rank's LOCAL_RANK has no GPU of its own (needed for nccl)."""
    if env.local_rank >= visible_gpus:
        raise EnvError(
            f"LOCAL_RANK={env.local_rank} but only {visible_gpus} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "with nccl every local rank needs its own GPU",
            fix=f"start at most {visible_gpus} process(es) per node (`ddpkit run -n gpu`), "
            "or use backend='gloo' to share GPUs/CPU",
        )


# -- torchrun / ddpkit run / hand-exported ---------------------------------------------------


def _read_torchrun(env: Mapping[str, str]) -> DistEnv:
    if "RANK" in env:
        _int(env, "RANK", minimum=0)  # "RANK=0,1" is the first thing to say, if it is so
    if "RANK" not in env or "WORLD_SIZE" not in env:
        have, missing = ("WORLD_SIZE", "RANK") if "RANK" not in env else ("RANK", "WORLD_SIZE")
        if "RANK" not in env and "WORLD_SIZE" not in env:
            have, missing = "LOCAL_RANK", "RANK and WORLD_SIZE"
        raise EnvError(
            f"{have}={env.get(have)!r} is set but {missing} is not; a process needs both its "
            "RANK and the WORLD_SIZE to join a job",
            fix=f"set both, or {LAUNCH_FIX}",
        )
    world_size = _int(env, "WORLD_SIZE", minimum=1)
    rank = _rank(env, "RANK", world_size)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", minimum=1, default=world_size)
    if local_world_size > world_size:
        raise EnvError(
            f"LOCAL_WORLD_SIZE={local_world_size} is larger than WORLD_SIZE={world_size}",
            fix=f"LOCAL_WORLD_SIZE counts the processes on this node; {LAUNCH_FIX}",
        )
    # Hand-exported single-node jobs often omit LOCAL_RANK: on one node it equals RANK.
    default_local = rank if local_world_size == world_size else None
    local_rank = _rank(env, "LOCAL_RANK", local_world_size, default=default_local)
    node_rank = _int(env, "GROUP_RANK", minimum=0, default=rank // local_world_size)
    if protocol.JOB in env:
        launcher: Launcher = "ddpkit"
    elif "TORCHELASTIC_RUN_ID" in env:
        launcher = "torchrun"
    else:
        launcher = "env"
    single_node = local_world_size == world_size
    addr, port = _master(env, required=world_size > 1 and not single_node)
    return DistEnv(rank, local_rank, world_size, local_world_size, node_rank, addr, port, launcher)


# -- SLURM srun -------------------------------------------------------------------------------


def _read_slurm(env: Mapping[str, str]) -> DistEnv:
    world_size = _int(env, "SLURM_NTASKS", minimum=1)
    rank = _rank(env, "SLURM_PROCID", world_size)
    node_rank = _int(env, "SLURM_NODEID", minimum=0, default=0)
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node:
        counts = expand_tasks_per_node(per_node)
        name = "SLURM_NTASKS_PER_NODE" if "SLURM_NTASKS_PER_NODE" in env else "SLURM_TASKS_PER_NODE"
        if not counts or min(counts) < 1:
            raise EnvError(
                f"{name}={per_node!r} is not a task count list like '2(x3),1'",
                fix="run the job step with srun, which sets it",
            )
        local_world_size = counts[node_rank] if node_rank < len(counts) else counts[-1]
    else:
        local_world_size = world_size
    local_rank = _rank(env, "SLURM_LOCALID", local_world_size, default=rank % local_world_size)
    if "MASTER_ADDR" in env:
        addr, port = _master(env, required=False)
    else:
        first, count = slurm_hosts(env)
        addr = first if count > 1 else LOOPBACK
        port = slurm_port(env)
    return DistEnv(rank, local_rank, world_size, local_world_size, node_rank, addr, port, "slurm")


def slurm_port(env: Mapping[str, str]) -> int:
    """The port every task of a SLURM job derives alike (as Lightning does): 15000 + the last
    4 digits of the job id, unless MASTER_PORT says otherwise."""
    if "MASTER_PORT" in env:
        return _port(env)
    job = env.get("SLURM_JOB_ID", "")
    return 15000 + int(job[-4:]) if job.isdigit() else DEFAULT_PORT


def slurm_hosts(env: Mapping[str, str]) -> tuple[str, int]:
    """(first host, number of hosts) of the job's node list, checked, never expanded whole."""
    name = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    text = env.get(name, "")
    if not text:
        return LOOPBACK, 0
    items = _hostlist_items(text, name)
    first_prefix, first_ranges, first_suffix = items[0]
    if first_ranges:
        lo, _, width = first_ranges[0]
        first = f"{first_prefix}{lo:0{width}d}{first_suffix}"
    else:
        first = first_prefix + first_suffix
    count = sum(sum(hi - lo + 1 for lo, hi, _ in ranges) if ranges else 1 for _, ranges, _ in items)
    return first, count


MAX_HOSTS = 1_000_000


def expand_hostlist(text: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """SLURM's compressed host list, e.g. 'gpu[01-03,7],cpu1' -> gpu01 gpu02 gpu03 gpu7 cpu1."""
    hosts: list[str] = []
    items = _hostlist_items(text, name)
    if sum(sum(h - lo + 1 for lo, h, _ in r) if r else 1 for _, r, _ in items) > MAX_HOSTS:
        raise EnvError(f"{name}={text!r} names more than {MAX_HOSTS} hosts", fix=LAUNCH_FIX)
    for prefix, ranges, suffix in items:
        if not ranges:
            hosts.append(prefix + suffix)
        for lo, hi, width in ranges:
            hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(lo, hi + 1))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE, e.g. '2(x3),1' -> [2, 2, 2, 1]; [] when malformed."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m or len(counts) > MAX_HOSTS:
            return []
        counts.extend([int(m.group(1))] * min(int(m.group(2) or 1), MAX_HOSTS))
    return counts


def _hostlist_items(text: str, name: str) -> list[tuple[str, list[tuple[int, int, int]], str]]:
    """(prefix, [(lo, hi, width)], suffix) per item of a SLURM host list; EnvError if bad."""
    items = []
    bad = EnvError(
        f"{name}={text!r} is not a SLURM host list like 'gpu[01-04,7],cpu1'",
        fix="run under srun/sbatch, which set it, or unset it",
    )
    for prefix, body, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)", text):
        ranges = []
        if body:
            for part in body.split(","):
                lo, _, hi = part.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
                    raise bad
                ranges.append((int(lo), int(hi or lo), len(lo)))
        items.append((prefix.strip(), ranges, suffix))
    if not items or "[" in text and not any(r for _, r, _ in items):
        raise bad
    return items


# -- Open MPI mpirun ------------------------------------------------------------------------------


def _read_mpi(env: Mapping[str, str]) -> DistEnv:
    world_size = _int(env, "OMPI_COMM_WORLD_SIZE", minimum=1)
    rank = _rank(env, "OMPI_COMM_WORLD_RANK", world_size)
    local_world_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1, default=world_size)
    local_rank = _rank(
        env, "OMPI_COMM_WORLD_LOCAL_RANK", local_world_size, default=rank % local_world_size
    )
    single_node = local_world_size == world_size
    addr, port = _master(env, required=not single_node)
    node_rank = rank // local_world_size
    return DistEnv(rank, local_rank, world_size, local_world_size, node_rank, addr, port, "mpi")


# -- value checks ---------------------------------------------------------------------------


SLURM_FIX = "run the job step with srun (which sets it), or unset it"


def _int(
    env: Mapping[str, str],
    name: str,
    minimum: int,
    default: int | None = None,
    fix: str | None = None,
) -> int:
    fix = fix or (SLURM_FIX if name.startswith("SLURM_") else LAUNCH_FIX)
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(f"{name} is not set", fix=f"set {name}, or {fix}")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        several = "," in raw or " " in raw.strip()
        why = (
            "one integer per process is needed, and a launcher sets a different one in each"
            if several
            else "it must be an integer"
        )
        raise EnvError(f"{name}={raw!r} is not one integer: {why}", fix=fix) from None
    if value < minimum:
        raise EnvError(f"{name}={raw!r} is below {minimum}", fix=fix)
    return value


def _rank(env: Mapping[str, str], name: str, size: int, default: int | None = None) -> int:
    value = _int(env, name, minimum=0, default=default)
    if value >= size:
        size_name = "WORLD_SIZE" if "LOCAL" not in name else "LOCAL_WORLD_SIZE"
        raise EnvError(
            f"{name}={value} but the job has only {size} process(es) ({size_name}={size}); "
            f"ranks run from 0 to {size - 1}",
            fix=LAUNCH_FIX,
        )
    return value


def _port(env: Mapping[str, str]) -> int:
    raw = env["MASTER_PORT"]
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise EnvError(
            f"MASTER_PORT={raw!r} is not a TCP port (1-65535)",
            fix="pick a free port above 1024, or let `ddpkit run` choose one",
        )
    return port


def _master(env: Mapping[str, str], required: bool) -> tuple[str, int]:
    if required and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
        missing = "MASTER_ADDR" if "MASTER_ADDR" not in env else "MASTER_PORT"
        raise EnvError(
            f"{missing} is not set, and this job spans several nodes, so ranks cannot find rank 0",
            fix="set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port, or use "
            "`ddpkit run --nnodes N --rdzv HOST:PORT`",
        )
    addr = env.get("MASTER_ADDR") or LOOPBACK
    port = _port(env) if "MASTER_PORT" in env else DEFAULT_PORT
    return addr, port

"""nccl-tests' flags, with their meanings and defaults, parsed into a checked BenchConfig.

Sizes take K, M and G suffixes as powers of 1024 (as nccl-tests does). Bad values are a
ConfigError (exit 2) that names the flag.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.errors import ConfigError

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "alltoall",
    "sendrecv",
)
OPS = ("sum", "prod", "max", "min", "avg")
DTYPES = ("float", "half", "bfloat16", "double", "int32", "int64", "int8", "uint8")
AGGREGATES = {0: "rank 0", 1: "average", 2: "minimum", 3: "maximum"}


@dataclass(frozen=True)
class BenchConfig:
    collective: str
    min_bytes: int = 32 * 1024 * 1024
    max_bytes: int = 32 * 1024 * 1024
    step_bytes: int = 1024 * 1024
    step_factor: int = 1
    iters: int = 20
    warmup_iters: int = 1
    check: int = 1
    op: str = "sum"
    dtype: str = "float"
    root: int = 0
    average: int = 1
    blocking: int = 0
    graph: int = 0
    json: str | None = None
    csv: str | None = None
    plot: str | None = None
    peak: str = "auto"

    def dtypes(self) -> tuple[str, ...]:
        """The types to run, in nccl-tests' order for `-d all`."""
        return DTYPES if self.dtype == "all" else (self.dtype,)

    def ops(self, gpu: bool) -> tuple[str, ...]:
        """The reductions to run: `-o all` is every one the backend has (gloo: no avg)."""
        if self.op != "all":
            return (self.op,)
        return OPS if gpu else tuple(op for op in OPS if op != "avg")

    def sizes(self) -> list[int]:
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size = size * self.step_factor if self.step_factor > 1 else size + self.step_bytes
        return sizes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_size(text: str, flag: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), re.I)
    if not m:
        raise ConfigError(f"{flag} {text!r} is not a size", fix=f"e.g. {flag} 8, 64K, 256M, 1G")
    return int(m.group(1)) * 1024 ** "_KMG".index(m.group(2).upper() or "_")


def add_flags(p: argparse.ArgumentParser) -> None:
    """nccl-tests' flags, and where the ranks run (this node's count; several nodes)."""
    p.add_argument("-b", "--minbytes", default="32M", help="smallest size (default 32M)")
    p.add_argument("-e", "--maxbytes", default="32M", help="largest size (default 32M)")
    p.add_argument("-i", "--stepbytes", default="1M", help="size increment (default 1M)")
    p.add_argument("-f", "--stepfactor", default="1", help="size multiplier (overrides -i)")
    p.add_argument("-n", "--iters", default="20", help="timed iterations (default 20)")
    p.add_argument("-w", "--warmup_iters", default="1", help="warm-up iterations (default 1)")
    p.add_argument("-c", "--check", default="1", help="check results: 0 or 1 (default 1)")
    p.add_argument("-o", "--op", default="sum", help=f"reduction: {', '.join(OPS)} or all")
    p.add_argument("-d", "--datatype", default="float", help=f"type: {', '.join(DTYPES)} or all")
    p.add_argument("-r", "--root", default="0", help="root rank (broadcast, reduce)")
    p.add_argument(
        "-a",
        "--average",
        default="1",
        help="time across ranks: 0 rank 0, 1 avg, 2 min, 3 max (default 1)",
    )
    p.add_argument("-z", "--blocking", default="0", help="1: synchronize after every call")
    p.add_argument(
        "-G",
        "--cudagraph",
        default="0",
        help="capture the timed loop in a CUDA graph and replay it N times",
    )
    p.add_argument(
        "-g",
        "--ngpus",
        default="auto",
        help="ranks on this node: GPUs, or CPU processes (gloo) without GPUs",
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--csv", metavar="FILE", help="write the results as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size (matplotlib)")
    p.add_argument(
        "--peak", default="auto", help="link peak in GB/s one-way, or auto (NVLink/PCIe via NVML)"
    )
    nodes = p.add_argument_group("several nodes", "run the same command on every node")
    nodes.add_argument("--nnodes", default="1", help="number of nodes (default 1)")
    nodes.add_argument("--rdzv", help="HOST:PORT of the rendezvous, as `ddpkit run --rdzv`")
    nodes.add_argument("--node-rank", help="this node's rank, for static nodes")
    nodes.add_argument("--master-addr", help="node 0's address, for static nodes")
    nodes.add_argument("--master-port", default="0", help="the job's store port")


def add_ddp_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="gpt, resnet, tiny or MODULE:FACTORY (default: gpt on GPUs, tiny on CPU)"
    )
    p.add_argument("--gpus", help="rank counts, e.g. 1,2,4,8 (default: 1, 2, 4 ... all)")
    p.add_argument("--batch", type=int, default=8, help="batch per rank (default 8)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument(
        "--precision", help="bf16 (autocast) or fp32 (default: bf16 on GPUs, fp32 on CPU)"
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot throughput and efficiency")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also time the step captured as a CUDA graph (s.graph), interleaved (GPUs)",
    )
    p.add_argument(
        "--frameworks",
        action="store_true",
        help="also time Accelerate and Lightning Fabric (when installed), "
        "interleaved in the same jobs",
    )
    p.add_argument(
        "--shard",
        action="store_true",
        help="DDP against sharded (FSDP2, s.wrap(shard=True)): step time, peak memory and "
        "bytes held per GPU, per GPU count (GPUs; docs/sharding.md)",
    )
    p.add_argument(
        "--grow",
        action="store_true",
        help="with --shard: also find the largest model of the family each trains here",
    )
    p.add_argument("--layers", type=int, default=12, help="with --shard: the GPT's layers")


def from_args(args: argparse.Namespace, world: int, gpu: bool) -> BenchConfig:
    cfg = BenchConfig(
        collective=args.collective,
        min_bytes=parse_size(args.minbytes, "-b"),
        max_bytes=parse_size(args.maxbytes, "-e"),
        step_bytes=parse_size(args.stepbytes, "-i"),
        step_factor=_int(args.stepfactor, "-f", 1),
        iters=_int(args.iters, "-n", 1),
        warmup_iters=_int(args.warmup_iters, "-w", 0),
        check=_choice(args.check, "-c", (0, 1)),
        op=_word(args.op, "-o", (*OPS, "all")),
        dtype=_word(args.datatype, "-d", (*DTYPES, "all")),
        root=_int(args.root, "-r", 0),
        average=_choice(args.average, "-a", tuple(AGGREGATES)),
        blocking=_choice(args.blocking, "-z", (0, 1)),
        graph=_int(args.cudagraph, "-G", 0),
        json=args.json,
        csv=args.csv,
        plot=args.plot,
        peak=str(args.peak),
    )
    if cfg.min_bytes > cfg.max_bytes:
        raise ConfigError(
            f"-b {args.minbytes} is larger than -e {args.maxbytes}",
            fix="the smallest size must not exceed the largest",
        )
    if cfg.step_factor == 1 and cfg.step_bytes == 0:
        raise ConfigError("-i 0 with -f 1 never reaches -e", fix="give -f 2 or a -i above 0")
    if cfg.root >= world:
        raise ConfigError(
            f"-r {cfg.root} but only {world} rank(s)", fix=f"roots run from 0 to {world - 1}"
        )
    if cfg.graph and not gpu:
        raise ConfigError(
            "-G (CUDA graphs) needs GPUs, and this run is on the CPU",
            fix="leave out -G on CPU-only machines",
        )
    if cfg.op == "avg" and not gpu:
        raise ConfigError(
            "-o avg needs NCCL; gloo has no average reduction", fix="use -o sum on CPU (gloo)"
        )
    if cfg.peak != "auto":
        _float(cfg.peak, "--peak")
    if cfg.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--plot needs matplotlib, which is not installed", fix="pip install 'ddpkit[plot]'"
            ) from None
    return cfg


def _int(value: str, flag: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not an integer", fix=f"e.g. {flag} 2") from None
    if number < minimum:
        raise ConfigError(
            f"{flag} {value!r} must be at least {minimum}",
            fix=f"see `ddpkit bench --help` for {flag}",
        )
    return number


def _choice(value: str, flag: str, allowed: tuple[int, ...]) -> int:
    number = _int(value, flag, min(allowed))
    if number not in allowed:
        raise ConfigError(
            f"{flag} {value!r} is not one of {list(allowed)}",
            fix=f"see `ddpkit bench --help` for {flag}",
        )
    return number


def _word(value: str, flag: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(
            f"{flag} {value!r} is not one of: {', '.join(allowed)}", fix=f"e.g. {flag} {allowed[0]}"
        )
    return value


def _float(value: str, flag: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if number <= 0:
        raise ConfigError(
            f"{flag} {value!r} is not a bandwidth in GB/s", fix=f"e.g. {flag} 450, or {flag} auto"
        )
    return number

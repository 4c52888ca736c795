"""`ddpkit bench COLLECTIVE [nccl-tests flags]`: NVIDIA nccl-tests' measurement from Python,
with no build: `ddpkit bench all_reduce -b 8 -e 256M -f 2 -g 2`; `ddpkit bench all` times every
collective in turn in one job. `ddpkit bench ddp`: training throughput and scaling efficiency
(docs/bench-ddp.md)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ddpkit.bench.options import COLLECTIVES, add_ddp_flags, add_flags

    p = sub.add_parser(
        "bench", help="time collectives like nccl-tests (all_reduce_perf ...)", description=__doc__
    )
    kinds = p.add_subparsers(dest="collective", metavar="COLLECTIVE", parser_class=type(p))
    kinds.required = True
    for name in COLLECTIVES:
        one = kinds.add_parser(name, help=f"time {name} (nccl-tests' {_perf(name)})")
        add_flags(one)
        one.set_defaults(handler=run)
    every = kinds.add_parser(
        "all", help="time every collective above in turn, as running each nccl-tests binary"
    )
    add_flags(every)
    every.set_defaults(handler=run)
    ddp = kinds.add_parser("ddp", help="training throughput and scaling efficiency per GPU count")
    add_ddp_flags(ddp)
    ddp.set_defaults(handler=run_ddp)


def _perf(name: str) -> str:
    return {"alltoall": "alltoall_perf", "sendrecv": "sendrecv_perf"}.get(name, f"{name}_perf")


def run_ddp(args: argparse.Namespace) -> int:
    from ddpkit.bench import ddp

    return ddp.run(args)


def run(args: argparse.Namespace) -> int:
    from ddpkit.bench import options
    from ddpkit.cli.run import start
    from ddpkit.launch.base import config

    launch = config.build(
        "module",
        "ddpkit.bench.worker",
        nproc_per_node=args.ngpus,
        hang_timeout="0",  # a benchmark sits in collectives by design
        nnodes=args.nnodes,
        rdzv=args.rdzv,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    world = launch.nproc_per_node * launch.nnodes
    cfg = options.from_args(args, world=world, gpu=launch.backend != "gloo")
    # no per-call tracking or flight recorder: they would be part of what is timed
    launch = config.replace(
        launch,
        args=(json.dumps(cfg.to_dict()),),
        raw_output=True,
        ranks=frozenset({0}),
        track=False,
    )
    return start(launch)

"""`ddpkit bench COLLECTIVE [nccl-tests flags]`: NVIDIA nccl-tests' measurement from Python,
with no build: `ddpkit bench all_reduce -b 8 -e 256M -f 2 -g 2`."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time collectives like nccl-tests (all_reduce_perf ...)", description=__doc__
    )
    from ddpkit.bench.options import add_flags

    add_flags(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.collective == "ddp":
        from ddpkit.bench import ddp

        return ddp.run(args)
    from ddpkit.bench import options
    from ddpkit.cli.run import start
    from ddpkit.launch import config

    ns = argparse.Namespace(**{k.replace("-", "_"): v for k, (v, _) in config.OPTIONS.items()})
    ns.nproc_per_node = args.ngpus
    ns.hang_timeout = "0"  # a benchmark sits in collectives by design
    ns.module, ns.no_python, ns.target = "ddpkit.bench.worker", False, []
    launch = config.from_args(ns)
    cfg = options.from_args(args, world=launch.nproc_per_node, gpu=launch.backend != "gloo")
    # no per-call tracking or flight recorder: they would be part of what is timed
    launch = config.replace(
        launch,
        args=(json.dumps(cfg.to_dict()),),
        raw_output=True,
        ranks=frozenset({0}),
        track=False,
    )
    return start(launch)

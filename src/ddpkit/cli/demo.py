"""`ddpkit demo`: the bundled example (digits classification on real data that ships with
ddpkit) on every visible GPU, or on 2 CPU processes."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train the bundled example on all GPUs (or 2 CPU procs)", description=__doc__
    )
    p.add_argument(
        "-n", "--nproc-per-node", default="auto", help="processes: N, gpu, cpu or auto (default)"
    )
    p.add_argument("--epochs", type=int, default=8, help="training epochs (default 8)")
    p.add_argument("--log-dir", default=None, help="folder for this run's logs")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import importlib.util
    import sys

    from ddpkit.cli.run import start
    from ddpkit.launch.base import config

    spec = importlib.util.find_spec("ddpkit.examples.digits")  # its path, without running it
    where = spec.origin if spec is not None and spec.origin else "ddpkit/examples/digits.py"
    print(
        f"ddpkit demo: the script is {where} (a copy is a start for your own; run it as "
        "`ddpkit run -n 2 -m ddpkit.examples.digits`)",
        file=sys.stderr,
        flush=True,
    )

    cfg = config.build(
        "module",
        "ddpkit.examples.digits",
        ["--epochs", str(args.epochs)],
        nproc_per_node=args.nproc_per_node,
        log_dir=args.log_dir,
    )
    return start(cfg)

"""`ddpkit bench ddp --shard`: DDP against sharded (FSDP2) per GPU count, one job each
(`ddpkit.bench.shard_worker`): the median step time, the peak memory, and the bytes each GPU
holds for parameters, gradients and optimizer state, against 1/N of DDP's; with `--grow`, the
largest model of the bench's GPT family each trains here. The goals (docs/sharding.md): held
bytes within 10% of 1/N of DDP's, step time at most 1.15x DDP's where DDP fits."""

from __future__ import annotations

import json
from typing import Any

from ddpkit.errors import ConfigError, LaunchError

BOUND = 900.0
SLOWER = 1.15  # the goal: a sharded step at most this much longer than DDP's
HOST = 0.8  # a step whose host time is this share of it waits on the host


def run_shard(args: Any, counts: list[int], gpus: int) -> int:
    if not gpus:
        raise ConfigError(
            "--shard measures GPU memory, and no GPU is visible",
            fix="run it on GPUs; on CPUs, tests/groups/test_sharding.py checks the shards",
        )
    if args.layers < 1:
        raise ConfigError(f"--layers {args.layers} must be at least 1", fix="e.g. --layers 12")
    cfg = {
        "layers": args.layers,
        "width": 768,
        "heads": 12,
        "seq": 1024,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": 3,
        "grow": bool(args.grow),
        "max_layers": 1024,
        "force": True,
    }
    print(
        f"# ddpkit bench ddp --shard: GPT {args.layers} layers x 768, batch {args.batch} per "
        f"rank, bf16, AdamW, {args.steps} steps per variant, ranks {','.join(map(str, counts))}",
        flush=True,
    )
    print(
        f"# {'ranks':>5} {'variant':>8} {'step ms':>9} {'vs DDP':>7} {'peak MiB':>9} "
        f"{'held MiB':>9} {'held x N / DDP':>14}",
        flush=True,
    )
    results = []
    for n in counts:
        found = _job(n, cfg)
        results.append(found)
        ddp, sharded = found["rows"]["ddp"], found["rows"]["sharded"]
        for name, row in (("ddp", ddp), ("sharded", sharded)):
            if row is None:
                print(f"  {n:>5} {name:>8} {'does not fit':>9}", flush=True)
                continue
            vs = row["step_ms"] / ddp["step_ms"] if ddp else float("nan")
            share = row["held_mib"] * n / ddp["held_mib"] if ddp else float("nan")
            print(
                f"  {n:>5} {name:>8} {row['step_ms']:9.2f} {vs:7.3f} {row['peak_mib']:9.0f} "
                f"{row['held_mib']:9.0f} {share:14.3f}",
                flush=True,
            )
        note = host_bound(n, ddp, sharded)
        if note:
            print(note, flush=True)
        if found["grown"]:
            print(
                f"# {n} rank(s): the largest GPT that trains here has "
                f"{found['grown']['ddp']} layers with DDP, {found['grown']['sharded']} sharded",
                flush=True,
            )
        if n == 1:
            print(
                "# 1 rank: the sharded run is FSDP2 on a mesh of one GPU (its machinery, no "
                "memory to save); s.wrap(shard=True) returns the model itself at world size 1",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "ddpkit.bench.shard/1", "config": cfg, "runs": results}, f)
    return 0


def host_bound(n: int, ddp: dict | None, sharded: dict | None) -> str:
    """Why the sharded step misses the goal, when the host's time to issue it is the reason."""
    if not ddp or not sharded or "host_ms" not in sharded:
        return ""
    if (
        sharded["step_ms"] <= SLOWER * ddp["step_ms"]
        or sharded["host_ms"] < HOST * sharded["step_ms"]
    ):
        return ""
    return (
        f"# {n} rank(s): the host takes {sharded['host_ms']:.1f} ms to issue a sharded step of "
        f"{sharded['step_ms']:.1f} ms: FSDP2's per-unit hooks, not the GPU, set its pace; a larger "
        f"--batch per rank (or fewer, larger units) hides them"
    )


def _job(n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from ddpkit.launch.subjob import run_job

    job = run_job(
        ["-n", str(n), "--ranks", "0", "--hang-timeout", "0", "-m", "ddpkit.bench.shard_worker",
         json.dumps(cfg)],
        "DDPKIT_SHARD_BENCH",
        BOUND,
    )  # fmt: skip
    if not job.ok or job.result is None:
        raise LaunchError(
            f"the {n}-rank sharding job failed (exit {job.exit_code}):\n{job.output}",
            fix="see the output above; `ddpkit doctor` checks the machine",
        )
    return job.result

"""`ddpkit bench ddp`: training throughput per GPU count, weak-scaling efficiency, exposed
communication, and `s.wrap` against hand-written DDP, each GPU count one job through ddpkit's
launcher.

efficiency(N) = throughput(N) / (N x throughput(1)) with a fixed per-GPU batch; exposed
communication = median step time with gradient sync minus under no_sync (what the overlap
failed to hide); wrap/raw = median step of `s.wrap(model)` / of `DistributedDataParallel(model)`,
the two interleaved step by step in the same job; GPU busy = the fraction of s.wrap's step
with a compute kernel running (torch.profiler; `ddpkit.bench.busy`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ddpkit.common.gpus import visible_gpu_count
from ddpkit.errors import ConfigError, LaunchError

BOUND = 600  # seconds one GPU count may take
HOST_BOUND = 0.9  # below this GPU-busy fraction of the step, say the host sets the pace


def parse_counts(text: str | None, gpus: int) -> list[int]:
    if text is None:
        if not gpus:
            return [1, 2]
        counts, n = [1], 2
        while n <= gpus:
            counts.append(n)
            n *= 2
        return counts if counts[-1] == gpus else [*counts, gpus]
    try:
        counts = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise ConfigError(
            f"--gpus {text!r} is not a list of counts", fix="e.g. --gpus 1,2,4,8"
        ) from None
    if not counts or counts[0] < 1:
        raise ConfigError(f"--gpus {text!r} must list counts of at least 1", fix="e.g. --gpus 1,2")
    if gpus and counts[-1] > gpus:
        raise ConfigError(
            f"--gpus {text} asks for {counts[-1]} GPUs; {gpus} are visible",
            fix=f"use counts up to {gpus}",
        )
    return counts


def run(args: Any) -> int:
    gpus = visible_gpu_count()
    counts = parse_counts(args.gpus, gpus)
    if getattr(args, "shard", False):
        from ddpkit.bench.shard import run_shard

        return run_shard(args, counts, gpus)
    model = args.model or ("gpt" if gpus else "tiny")
    args.precision = args.precision or ("bf16" if gpus else "fp32")
    if args.precision not in ("bf16", "fp32"):
        raise ConfigError(
            f"--precision {args.precision!r} is not bf16 or fp32",
            fix="use --precision bf16 (GPUs) or fp32",
        )
    if args.batch < 1 or args.steps < 2:
        raise ConfigError(
            "--batch must be at least 1 and --steps at least 2", fix="e.g. --batch 8 --steps 20"
        )
    from ddpkit.bench.models import resolve

    resolve(model)  # a bad MODULE:FACTORY fails here, before any job starts
    cfg = {
        "model": model,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": 3,
        "precision": args.precision,
        "compile": args.compile,
        "frameworks": ["accelerate", "fabric"] if args.frameworks else [],
        "graphs": bool(args.graphs),
    }
    if args.graphs and not gpus:
        raise ConfigError(
            "--graphs needs GPUs: CUDA graphs capture GPU work", fix="leave out --graphs on CPU"
        )
    print(
        f"# ddpkit bench ddp: model {model}, batch {args.batch} per rank, {args.precision}, "
        f"{args.steps} interleaved steps per variant, ranks {','.join(map(str, counts))}",
        flush=True,
    )
    print(
        f"# {'ranks':>5} {'step ms':>9} {'IQR':>6} {'samples/s':>10} {'tokens/s':>10} "
        f"{'efficiency':>10} {'exposed ms':>10} {'peak MiB':>9} {'wrap/raw':>8} {'GPU busy':>8}",
        flush=True,
    )
    rows: list[Any] = []
    for n in counts:
        row = _one_job(n, cfg)
        base = rows[0]["samples_per_s"] if rows else row["samples_per_s"]
        first = rows[0]["ranks"] if rows else n
        row["efficiency"] = row["samples_per_s"] / (base * n / first)
        rows.append(row)
        tokens = f"{row['tokens_per_s']:.0f}" if row["tokens_per_s"] else "-"
        peak = str(row["peak_mib"]) if row["peak_mib"] is not None else "-"
        busy = f"{row['gpu_busy']:.2f}" if row["gpu_busy"] is not None else "-"
        print(
            f"  {n:>5} {row['step_ms']:9.2f} {row['step_iqr_ms']:6.2f} "
            f"{row['samples_per_s']:10.1f} {tokens:>10} {row['efficiency']:10.3f} "
            f"{row['exposed_comm_ms']:10.2f} {peak:>9} {row['wrap_over_raw']:8.3f} {busy:>8}",
            flush=True,
        )
    if args.graphs:
        _print_graphed(rows, "", lambda row: row["variants"], "graphed_efficiency")
    if args.graphs and all(row["back_to_back"] for row in rows):
        steady = "back_to_back_graphed_efficiency"
        _print_graphed(rows, "back to back: ", lambda row: row["back_to_back"], steady)
    for row in rows:
        others = ", ".join(
            f"{k} {v['over_raw']:.3f}" for k, v in row["variants"].items() if k != "wrap"
        )
        missing = "".join(f"; {k} unavailable ({v})" for k, v in row["unavailable"].items())
        print(
            f"# {row['ranks']} rank(s), step time / raw DDP's: wrap {row['wrap_over_raw']:.3f}, "
            f"{others}{missing}",
            flush=True,
        )
    host_bound = [r for r in rows if r["gpu_busy"] is not None and r["gpu_busy"] < HOST_BOUND]
    if host_bound:
        worst = min(host_bound, key=lambda r: r["gpu_busy"])
        print(
            f"# the GPU computes only {worst['gpu_busy']:.0%} of the step at {worst['ranks']} "
            "rank(s): the host sets the pace, and a synchronous step waits for the slowest "
            "rank's host; a larger --batch per GPU shows the scaling of GPU-bound steps "
            "(docs/bench-ddp.md)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "ddpkit.bench.ddp/1", "config": cfg, "rows": rows}, f, indent=2)
    if args.plot:
        _plot(args.plot, model, rows)
    return 0


def _one_job(n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from ddpkit.launch.subjob import run_job

    job = run_job(
        [
            "-n",
            str(n),
            "--ranks",
            "0",
            "--hang-timeout",
            "0",
            "-m",
            "ddpkit.bench.ddp_worker",
            json.dumps(cfg),
        ],
        "DDPKIT_DDP_BENCH",
        BOUND,
    )
    if job.exit_code is None:
        raise LaunchError(
            f"the {n}-rank job did not finish in {BOUND} s",
            fix="use fewer --steps or a smaller --batch",
        )
    if not job.ok or job.result is None:
        raise LaunchError(
            f"the {n}-rank job failed (exit {job.exit_code}):\n{job.output}",
            fix="see the output above; `ddpkit doctor` checks the machine",
        )
    return job.result


def _plot(path: str, model: str, rows: list[dict[str, Any]]) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib", fix="pip install 'ddpkit[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ranks = [r["ranks"] for r in rows]
    left.plot(ranks, [r["samples_per_s"] for r in rows], marker="o", label="s.wrap")
    left.plot(
        ranks,
        [rows[0]["samples_per_s"] * n / ranks[0] for n in ranks],
        "--",
        color="gray",
        label="linear",
    )
    left.set_xlabel("ranks")
    left.set_ylabel("samples/s")
    left.legend()
    right.plot(ranks, [r["efficiency"] for r in rows], marker="o")
    for axes in (left, right):
        axes.set_xticks(ranks)
    right.set_ylim(0, 1.05)
    right.set_xlabel("ranks")
    right.set_ylabel("weak-scaling efficiency")
    fig.suptitle(f"ddpkit bench ddp: {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_graphed(
    rows: list[dict[str, Any]],
    title: str,
    timings: Callable[[dict[str, Any]], dict[str, Any]],
    efficiency_key: str,
) -> None:
    """One table of the graphed step against the eager one (`timings(row)` holds both), with
    the graphed efficiency against the first row's graphed step (a fixed batch per GPU)."""
    print(
        f"# {title}{'ranks':>5} {'graphed ms':>10} {'p90/med':>7} {'eager ms':>9} {'p90/med':>7} "
        f"{'graphed eff':>11} {'graphed/eager':>13}",
        flush=True,
    )
    base = timings(rows[0])["graphed"]["step_ms"]
    for row in rows:
        g, e = timings(row)["graphed"], timings(row)["wrap"]
        row[efficiency_key] = base / g["step_ms"]
        print(
            f"  {' ' * len(title)}{row['ranks']:>5} {g['step_ms']:10.2f} "
            f"{g['p90_over_median']:7.3f} {e['step_ms']:9.2f} {e['p90_over_median']:7.3f} "
            f"{row[efficiency_key]:11.3f} {g['step_ms'] / e['step_ms']:13.3f}",
            flush=True,
        )

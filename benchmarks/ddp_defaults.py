"""Which DDP options should `s.wrap` set? Every candidate trains the same model in the same
job, step by step interleaved with the others (process-to-process noise is +-15% here,
in-job interleaving is not), on 1 GPU and on all GPUs. Also Accelerate and Lightning Fabric.

Usage: python benchmarks/ddp_defaults.py [--model gpt] [--steps 20] [--batch 8]
Prints each variant's median step time over raw DDP's (below 1 is faster) per rank count,
and writes ddp_defaults.json into $OUT (or the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ddpkit.launch.subjob import run_job

CANDIDATES = {
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "bucket_cap_mb=100": {"bucket_cap_mb": 100},
    "bucket_cap_mb=100+gbv": {"bucket_cap_mb": 100, "gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ranks", default="1,2")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    results = []
    for n in [int(r) for r in args.ranks.split(",")]:
        cfg = {
            "model": args.model,
            "batch": args.batch,
            "steps": args.steps,
            "warmup": 3,
            "precision": "bf16",
            "compile": False,
            "extra_ddp": CANDIDATES,
            "frameworks": ["accelerate", "fabric"],
        }
        job = run_job(
            ["-n", str(n), "--ranks", "0", "--hang-timeout", "0", "-m",
             "ddpkit.bench.ddp_worker", json.dumps(cfg)],
            "DDPKIT_DDP_BENCH",
            560,
        )  # fmt: skip
        if not job.ok or job.result is None:
            print(f"{n} rank(s): failed\n{job.output}")
            continue
        row = job.result
        results.append(row)
        print(
            f"\n{n} rank(s), {args.model}, batch {args.batch}/rank, bf16: raw DDP "
            f"{row['raw_ddp_step_ms']:.2f} ms/step; exposed comm {row['exposed_comm_ms']:.2f} ms"
        )
        print(f"  {'variant':<24} {'step ms':>8} {'IQR':>6} {'/ raw':>7}")
        for name, v in row["variants"].items():
            print(f"  {name:<24} {v['step_ms']:8.2f} {v['iqr_ms']:6.2f} {v['over_raw']:7.3f}")
        for name, why in row["unavailable"].items():
            print(f"  {name:<24} unavailable: {why}")
    (out / "ddp_defaults.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

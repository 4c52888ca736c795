"""Put `ddpkit bench` JSON results beside nccl-tests outputs (shared/anchors) and print ratios.

Usage: python benchmarks/bench_vs_nccl_tests.py RESULTS_DIR ANCHOR_DIR
RESULTS_DIR holds NAME.json from `ddpkit bench ... --json`; ANCHOR_DIR holds nt_NAME.txt.
For each pair: busbw at 32M, 128M and 512M (ratio ddpkit/nccl-tests; 1.00 = equal), and the
time of the smallest size. Prints a table; writes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SIZES = {"32M": 32 << 20, "128M": 128 << 20, "512M": 512 << 20}


def anchor_rows(path: Path) -> dict[int, dict[str, float]]:
    rows = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split()
        rows[int(f[0])] = {
            "oop_time": float(f[5]),
            "oop_busbw": float(f[7]),
            "ip_time": float(f[9]),
            "ip_busbw": float(f[11]),
        }
    return rows


def main(results: Path, anchors: Path) -> None:
    print(
        f"{'run':<22} {'place':<5} "
        + " ".join(f"{k + ' busbw':>22}" for k in SIZES)
        + f" {'smallest: time us':>24}"
    )
    for result in sorted(results.glob("*.json")):
        anchor = anchors / f"nt_{result.stem}.txt"
        if not anchor.exists():
            continue
        ours = {r["size"]: r for r in json.loads(result.read_text())["rows"]}
        theirs = anchor_rows(anchor)
        for place in ("oop", "ip"):
            cells = []
            for size in SIZES.values():
                a, b = (
                    ours.get(size, {}).get(place, {}).get("busbw"),
                    theirs.get(size, {}).get(f"{place}_busbw"),
                )
                cells.append(f"{a:7.1f}/{b:7.1f}={a / b:5.2f}" if a and b else f"{'-':>22}")
            smallest = min(set(ours) & set(theirs)) if set(ours) & set(theirs) else None
            tail = "-"
            if smallest is not None:
                a, b = ours[smallest][place]["time_us"], theirs[smallest][f"{place}_time"]
                tail = f"{smallest}B {a:6.2f}/{b:6.2f}={a / b:5.2f}"
            print(
                f"{result.stem:<22} {place:<5} "
                + " ".join(f"{c:>22}" for c in cells)
                + f" {tail:>24}"
            )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

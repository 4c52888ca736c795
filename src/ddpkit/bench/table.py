"""nccl-tests 2.19's text layout, and the JSON, CSV and PNG forms of the same results."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.bench.options import BenchConfig

HEADER = [
    "#                                                              out-of-place      "
    "                 in-place          ",
    "#       size         count      type   redop    root     time   algbw   busbw  #wrong"
    "     time   algbw   busbw  #wrong ",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)        "
    "     (us)  (GB/s)  (GB/s)         ",
]


@dataclass
class Placement:
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None  # None: not checked (N/A), or -c 0


@dataclass
class Row:
    size: int
    count: int
    type: str
    redop: str
    root: int
    oop: Placement
    ip: Placement


def preamble(cfg: BenchConfig, n: int, devices: list[dict[str, Any]], versions: str) -> str:
    step = f"{cfg.step_factor}(factor)" if cfg.step_factor > 1 else f"{cfg.step_bytes}(bytes)"
    lines = [
        f"# ddpkit bench (nccl-tests 2.19 layout) {versions}",
        f"# Collective test starting: {cfg.collective}_perf",
        f"# nThread 1 nGpus {n} minBytes {cfg.min_bytes} maxBytes {cfg.max_bytes} step: {step} "
        f"warmup iters: {cfg.warmup_iters} iters: {cfg.iters} agg iters: 1 validation: "
        f"{cfg.check} graph: {cfg.graph} unalign: 0",
        "#",
        "# Using devices",
    ]
    for d in devices:
        # a CPU rank has no device number: nccl-tests' column says which CPU process it is
        where = f"device {d['device']:2d} [{d['bus']}]" if d["device"] >= 0 else "on the CPU"
        lines.append(
            f"#  Rank {d['rank']:2d} Group  0 Pid {d['pid']:6d} on {d['host']:>10s} "
            f"{where} {d['name'] if d['device'] >= 0 else ''}".rstrip()
        )
    lines.append("#")
    return "\n".join(lines + HEADER)


def _time(us: float) -> str:
    return f"{us:7.2f}" if us < 1e4 else f"{us:7.0f}"


def format_row(row: Row) -> str:
    text = f"{row.size:12d}  {row.count:12d}  {row.type:>8s}  {row.redop:>6s}  {row.root:6d}"
    for p in (row.oop, row.ip):
        wrong = "N/A" if p.wrong is None else str(p.wrong)
        text += f"  {_time(p.time_us)}  {p.algbw:6.2f}  {p.busbw:6.2f}  {wrong:>6s}"
    return text


def avg_busbw(rows: list[Row]) -> float:
    values = [p.busbw for r in rows for p in (r.oop, r.ip)]
    return statistics.mean(values) if values else 0.0


def footer(cfg: BenchConfig, rows: list[Row], peak: dict[str, Any] | None) -> str:
    lines = ["# Out of bounds values : 0 OK", f"# Avg bus bandwidth    : {avg_busbw(rows):g} ", "#"]
    if peak and rows:
        best = max(max(r.oop.busbw, r.ip.busbw) for r in rows)
        lines.append(
            f"# Peak busbw           : {best:.2f} GB/s = {best / peak['gbps']:.2f} of "
            f"the {peak['gbps']:g} GB/s one-way peak ({peak['link']})"
        )
        lines.append("#")
    lines += [f"# Collective test concluded: {cfg.collective}_perf", "#"]
    return "\n".join(lines)


def wrong_total(rows: list[Row]) -> int:
    return sum(p.wrong or 0 for r in rows for p in (r.oop, r.ip))


def write_json(
    path: str,
    cfg: BenchConfig,
    rows: list[Row],
    devices: list[dict[str, Any]],
    peak: dict[str, Any] | None,
    versions: dict[str, str],
) -> None:
    data: dict[str, Any] = {
        "schema": "ddpkit.bench/1",
        "collective": cfg.collective,
        "config": cfg.to_dict(),
        "versions": versions,
        "devices": devices,
        "peak": peak,
        "rows": [asdict(r) for r in rows],
        "avg_busbw": avg_busbw(rows),
        "wrong": wrong_total(rows),
    }
    if peak:
        for row in data["rows"]:
            for placement in ("oop", "ip"):
                row[placement]["peak_fraction"] = row[placement]["busbw"] / peak["gbps"]
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def write_csv(path: str, rows: list[Row]) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(
            ["size", "count", "type", "redop", "root"]
            + [
                f"{p}_{field}"
                for p in ("oop", "ip")
                for field in ("time_us", "algbw", "busbw", "wrong")
            ]
        )
        for r in rows:
            out.writerow(
                [r.size, r.count, r.type, r.redop, r.root]
                + [
                    v
                    for p in (r.oop, r.ip)
                    for v in (p.time_us, p.algbw, p.busbw, "N/A" if p.wrong is None else p.wrong)
                ]
            )


def write_plot(
    path: str, cfg: BenchConfig, rows: list[Row], n: int, peak: dict[str, Any] | None
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:  # -d all / -o all: one curve per type and reduction
        groups.setdefault((r.type, r.redop), []).append(r)
    for (type_name, redop), group in groups.items():
        sizes = [r.size for r in group]
        for placement, label in (("oop", "out-of-place"), ("ip", "in-place")):
            if len(groups) > 1:
                if placement == "ip":
                    continue  # many curves: out of place only, as nccl-tests' first columns
                label = f"{type_name} {redop}"
            busbw = [getattr(r, placement).busbw for r in group]
            ax.plot(sizes, busbw, marker="o", label=label)
    if peak:
        ax.axhline(
            peak["gbps"],
            color="gray",
            linestyle="--",
            label=f"peak {peak['gbps']:g} GB/s ({peak['link']})",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    graph = f", CUDA graph x{cfg.graph}" if cfg.graph else ""
    ax.set_title(f"{cfg.collective}, {n} rank(s), {cfg.dtype}{graph}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

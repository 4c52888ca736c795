"""What the speed doctor says: the straggler line (the rank, the part of its step that is
slow, the factor of its own time the end table also gives, the evidence from NVML and the
host, what to do) and the end table of every rank's step times, fitted to the terminal."""

from __future__ import annotations

import shutil
import statistics
import textwrap
from collections.abc import Callable

from ddpkit.launch.speed.memory_growth import describe
from ddpkit.launch.speed.records import JobRow, SpeedReport
from ddpkit.launch.speed.straggler import Finding, RankSummary


def verdict(finding: Finding, summaries: dict[int, RankSummary], window: int) -> str:
    """`straggler: rank 3 (node1, GPU 3) computes 1.42x the median rank (1.30x its own time
    per step) for the last 50 steps: <evidence>; <what to do>`. The factor of the rank's own
    time is the one the end table gives."""
    me = summaries[finding.rank]
    where = ", ".join(x for x in (me.host, me.gpu) if x)
    others = [s for s in summaries.values() if s.rank != finding.rank]
    own = f"{finding.own_factor:.2f}x its own time per step"
    if finding.part == "data":
        what = (
            f"waits for data {finding.share:.0%} of each step (others {finding.others_share:.0%})"
        )
        advice = "raise num_workers or check that node's disk"
    elif finding.part == "wait":
        demand = float(me.facts.get("cpu_demand") or 0.0)
        theirs = [float(d) for o in others if (d := o.facts.get("cpu_demand")) is not None]
        typical = statistics.median(theirs) if theirs else 0.0
        what = (
            f"takes {finding.own_factor:.2f}x the median rank's own time per step, but its "
            f"main thread asked for {demand:.0%} of a core (others {typical:.0%}): its extra "
            "time is not spent computing"
        )
        advice = (
            "it waits on something else (a sleep, a lock, a file, a subprocess, another "
            "machine): `ddpkit stacks` shows where it is"
        )
    elif finding.part == "compute":
        what = f"computes {finding.factor:.2f}x the median rank ({own})"
        advice = ""
    else:
        what = f"spends {finding.factor:.2f}x the median rank's host time outside the GPU ({own})"
        advice = "the host cannot feed its GPU: check that node's CPU load"
    facts, fix = evidence_words(me, others, finding.part, cpu_said=finding.part == "wait")
    advice = fix or advice
    line = f"straggler: rank {finding.rank} ({where}) {what} for the last {me.steps} steps"
    if facts:
        line += f": {facts}"
    line += "; the job runs at its pace"
    return line + (f"; {advice}" if advice else "")


def evidence_words(
    me: RankSummary, others: list[RankSummary], part: str, cpu_said: bool = False
) -> tuple[str, str]:
    """(the evidence, what to do) for a slow rank, from NVML and the host's facts. A fact of
    the whole host (CPU steal, load, memory) is evidence only where no other rank shares the
    host: it slows them all alike, so it cannot be why one rank is slower."""
    said, fixes = [], []
    gpu = me.facts.get("gpu") or {}
    if gpu:
        clocks = [c for o in others if (c := o.facts.get("gpu", {}).get("sm_mhz"))]
        if gpu.get("sm_mhz") and clocks:
            said.append(
                f"{me.gpu or 'its GPU'} runs at {gpu['sm_mhz']} MHz "
                f"(others {statistics.median(clocks):.0f} MHz)"
            )
        if gpu.get("throttle"):
            said.append(
                f"{' and '.join(gpu['throttle'])} at {gpu.get('temp_c', '?')} C, "
                f"{gpu.get('power_w', 0):.0f} W"
            )
            fixes.append("check that GPU's cooling and power (nvidia-smi -q -d PERFORMANCE)")
        for p in gpu.get("other_processes", [])[:2]:
            said.append(f"another process uses it: pid {p['pid']} ({p['name']}, {p['mib']} MiB)")
            fixes.append(f"stop pid {p['pid']} or move it to another GPU")
    share = me.facts.get("cpu_share")
    shares = [float(x) for o in others if (x := o.facts.get("cpu_share")) is not None]
    if not gpu and share is not None and shares and part != "data" and not cpu_said:
        typical = statistics.median(shares) * 100
        said.append(f"its process ran {share * 100:.0f}% of a core (others {typical:.0f}%)")
        busy = me.facts.get("competitors") or []
        for b in busy[:2]:
            said.append(f"pid {b['pid']} ({b['name']}) uses {b['percent']:.0f}% of its core(s)")
        if busy:
            fixes.append(f"stop pid {busy[0]['pid']} or give the job cores of its own")
    alone = all(o.host != me.host for o in others)
    host = (me.facts.get("host") or {}) if alone else {}
    if host.get("steal_percent", 0) >= 5:
        said.append(f"CPU steal {host['steal_percent']:.0f}% on {me.host} (a busy VM host)")
    if host.get("load1") and host.get("cores") and host["load1"] > 1.5 * host["cores"]:
        said.append(f"load {host['load1']:.1f} on {host['cores']} cores")
    if host.get("mem_percent", 0) >= 95:
        said.append(f"memory {host['mem_percent']:.0f}% used")
    return "; ".join(said), "; ".join(dict.fromkeys(fixes))


def summary_text(report: SpeedReport, width: int | None = None) -> str:
    """The end table, fitted to `width` columns (the terminal's; 100 when not a terminal): a
    host column only for a job on several hosts, p90 and memory where they fit. The slowest
    rank is said only when it stands out (at the straggler threshold, 1.2 when off)."""
    if width is None:
        width = shutil.get_terminal_size((100, 24)).columns
    ranks = report["ranks"]
    hosts = len({r["host"] for r in ranks}) > 1
    memory = any(r.get("memory") for r in ranks)
    columns: list[tuple[str, int, Callable[[JobRow], str]]] = [
        ("rank", 4, lambda r: f"{r['rank']}")
    ]
    if hosts:
        columns.append(("host", 12, lambda r: r["host"][:12]))
    columns += [
        ("steps", 6, lambda r: f"{r['steps']}"),
        ("median", 8, lambda r: f"{r['median_s'] * 1e3:.1f}ms"),
        ("p90", 8, lambda r: f"{r['p90_s'] * 1e3:.1f}ms"),
        ("data", 5, lambda r: f"{r['split']['data']:.0%}"),
        ("compute", 7, lambda r: f"{r['split']['compute']:.0%}"),
        ("comm", 5, lambda r: f"{r['split']['comm']:.0%}"),
        ("host", 5, lambda r: f"{r['split']['host']:.0%}"),
    ]
    if memory:
        columns.append(("memory", 14, lambda r: describe(r.get("memory") or {})))

    def size() -> int:
        return 2 + sum(w + 2 for _, w, _ in columns)

    for drop in ("p90", "memory"):  # what goes first when the line would wrap
        if size() > width:
            columns = [c for c in columns if c[0] != drop]
    lines = ["step times per rank and where they went:"]
    lines.append("  " + "  ".join(f"{name:>{w}}" for name, w, _ in columns))
    for r in ranks:
        lines.append("  " + "  ".join(f"{get(r):>{w}}" for _, w, get in columns))
    slow = report["slowest"]
    bar = report.get("threshold") or 1.2
    factor = slow["own_over_median"]
    if len(ranks) > 1 and factor and factor >= bar:
        said = (
            f"slowest: rank {slow['rank']} ({factor:.2f}x the median rank's own time); at "
            f"the median rank's pace the job would have been {slow['cost_s']:.1f} s "
            f"({slow['cost_share']:.0%}) shorter"
        )
        lines += textwrap.wrap(said, width - 1, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)

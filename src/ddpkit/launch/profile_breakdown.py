"""What a recording of the same steps on every rank says (`ddpkit profile`, `--profile-steps`):
a breakdown per rank (printed, and drawn as breakdown.png where matplotlib is installed), the
rank the others wait for with what it does meanwhile, the top ops, the recording's cost, and
one merged trace of every rank.

Per rank, over the recorded steps: the step time, and its parts from the rank's step record
(ddpkit.rank.steps: data, compute, communication the rank waited for, and the host's own time,
which on a GPU is the GPU idle); communication overlapped is the communication the profiler
saw (gloo's spans on the CPU, NCCL's kernels on a GPU) less the part waited for. The rank the
others wait for is the one whose own time (data + compute + host) stands out, as the speed
doctor decides (ddpkit.launch.speed.straggler), named with its slow part and its top op.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.common import protocol

MERGE_LIMIT = 256 * 2**20  # bytes of traces, compressed, beyond which none is merged
STANDS_OUT = 1.1  # own time over the others' median that names the rank they wait for


@dataclass
class RankRecording:
    rank: int
    summary: dict[str, Any]
    steps: list[protocol.Step] = field(default_factory=list)  # the recorded ones
    before: list[protocol.Step] = field(default_factory=list)  # as many just before

    def total(self, part: str) -> float:
        return float(sum(getattr(s, part) for s in self.steps))


def once_written(
    run_dir: Path,
    steps: tuple[int, int],
    ranks: list[int],
    timed_steps: Callable[[int], protocol.StepRecord | None],
    at_end: bool,
) -> str | None:
    """`ddpkit run --profile-steps A-B`: what to say once every rank of this node has written
    its recording (or at the job's end, what was written, or that nothing was); None while it
    is not time yet, or once said (breakdown.txt is written with it)."""
    folder = run_dir / f"profile-{steps[0]}-{steps[1]}"
    if (folder / "breakdown.txt").exists():
        return None
    written = [r for r in ranks if (folder / f"rank{r}.summary.json").exists()]
    if not written and at_end:
        counted = [timed_steps(r) for r in ranks]
        last = max((ring.count for ring in counted if ring is not None), default=0)
        return (
            f"--profile-steps {steps[0]}-{steps[1]}: the job's last step was {last}: nothing "
            "recorded (`ddpkit top` shows a job's steps as it runs)"
        )
    if not written or (len(written) < len(ranks) and not at_end):
        return None
    try:
        merged = merge(folder)
        rings = {r: timed_steps(r) for r in ranks}
        timed = {r: ring.steps for r, ring in rings.items() if ring is not None}
        recordings = read(folder, timed)
        said = write(recordings, folder, merged)
    except (OSError, ValueError) as err:
        said = f"the recording of steps {steps[0]}-{steps[1]} could not be read: {err}"
    return said


def write(recordings: list[RankRecording], folder: Path, merged: Path | None) -> str:
    """The breakdown's text, written to breakdown.txt and drawn in breakdown.png (where
    matplotlib is installed), with a last line that says where they are."""
    said = text(recordings, folder, merged)
    (folder / "breakdown.txt").write_text(said + "\n")
    drawn = plot(recordings, folder / "breakdown.png")
    return (
        said
        + f"\nthis breakdown is in {folder / 'breakdown.txt'}"
        + (f", drawn in {folder / 'breakdown.png'}" if drawn else "")
    )


def read(folder: Path, timed: dict[int, list[protocol.Step]]) -> list[RankRecording]:
    """Each rank's summary from the folder and its steps: `timed[rank]` (its step ring, read
    by the caller) for this node's ranks, the ones its launcher sent with the summary for
    another node's."""
    found = []
    for path in sorted(folder.glob("rank*.summary.json"), key=lambda p: int(p.name[4:-13])):
        summary = json.loads(path.read_text())
        rank = int(summary["rank"])
        recording = RankRecording(rank, summary)
        plan = summary["plan"]
        first, last = plan["first"], plan["first"] + plan["steps"]
        steps = timed.get(rank)
        if steps is None:  # another node's rank
            steps = [protocol.Step(*row) for row in summary.get("timed_steps", [])]
        recording.steps = [s for s in steps if first < s.number <= last]
        span = last - first
        recording.before = [s for s in steps if first - span < s.number <= first]
        found.append(recording)
    return found


def waited_for(recordings: list[RankRecording]) -> tuple[int, str] | None:
    """(rank, its part that stands out) when one rank's own time holds the others back."""
    timed = [r for r in recordings if r.steps]
    if len(timed) < 2:
        return None
    own = {r.rank: r.total("data") + r.total("compute") + r.total("host") for r in timed}
    slowest = max(timed, key=lambda r: own[r.rank])
    others = [r for r in timed if r is not slowest]
    median = statistics.median(own[r.rank] for r in others)
    if median <= 0 or own[slowest.rank] < STANDS_OUT * median:
        return None
    parts = ("data", "compute", "host")
    excess = {p: slowest.total(p) - statistics.median(r.total(p) for r in others) for p in parts}
    return slowest.rank, max(parts, key=lambda p: excess[p])


def text(recordings: list[RankRecording], folder: Path, merged: Path | None) -> str:
    """The breakdown as printed."""
    if not recordings:
        return "no rank wrote a recording"
    plan = recordings[0].summary["plan"]
    first, last = plan["first"] + 1, plan["first"] + plan["steps"]
    if all(r.summary.get("ended_early") and not r.summary.get("recorded") for r in recordings):
        return f"the job ended before step {first + 1} ended: steps {first}-{last} not recorded"
    lines = [f"steps {first}-{last} recorded on {len(recordings)} rank(s); traces in {folder}"]
    for path in sorted(folder.glob("node*.done.json")):  # other nodes' (peers.profile_relay)
        node, other = path.name[4:].split(".")[0], json.loads(path.read_text())
        lines.append(f"node {node} ({other['host']}) keeps its ranks' traces: {other['folder']}")
    lines.append(
        f"{'rank':>4}  {'step ms':>8}  {'compute':>7}  {'data':>5}  {'comm waited':>11}  "
        f"{'comm overlapped':>15}  {'host/idle':>9}"
    )
    for r in recordings:
        if r.summary.get("missed"):
            lines.append(f"{r.rank:>4}  missed the first step (it was at step {r.summary['now']})")
            continue
        n = len(r.steps)
        wall = r.total("total")
        if not n or wall <= 0:
            lines.append(f"{r.rank:>4}  no timed step in the recording")
            continue
        waited = r.total("comm")
        overlapped = max(0.0, float(r.summary.get("comm_s", 0.0)) - waited)
        lines.append(
            f"{r.rank:>4}  {wall / n * 1e3:>8.2f}  {r.total('compute') / wall:>7.0%}  "
            f"{r.total('data') / wall:>5.0%}  {waited / wall:>11.0%}  "
            f"{overlapped / n * 1e3:>12.2f} ms  {r.total('host') / wall:>9.0%}"
        )
    found = waited_for(recordings)
    if found is not None:
        rank, part = found
        slow = next(r for r in recordings if r.rank == rank)
        top = _top_line(slow, 1, own_only=True)
        lines.append(
            f"the others wait for rank {rank}: its {part} time stands out"
            + (f"; meanwhile it spends most in {top}" if top else "")
        )
    elif len(recordings) > 1:
        lines.append("no rank holds the others back: their own times are within 10%")
    lines.append(
        "top ops by own time over the recorded steps (an op's own time leaves out the Python "
        "and framework code between ops, which the compute share above includes):"
    )
    for r in recordings:
        line = _top_line(r, 5)
        if line:
            lines.append(f"  rank {r.rank}: {line}")
    lines.append(_cost_line(recordings))
    for r in recordings:
        if r.summary.get("ended_early"):
            lines.append(
                f"rank {r.rank} ended during the recording: {r.summary.get('recorded', 0)} of "
                f"{plan['steps']} steps recorded"
            )
        if r.summary.get("trace_error"):
            lines.append(f"rank {r.rank} could not write its trace: {r.summary['trace_error']}")
    if merged is not None:
        whose = "this node's ranks" if any(folder.glob("node*.done.json")) else "every rank"
        lines.append(
            f"{whose} on one timeline: {merged} (open it in ui.perfetto.dev or chrome://tracing;"
            " each rank's own trace also opens in TensorBoard's profiler)"
        )
    return "\n".join(lines)


def is_communication(op: str) -> bool:
    """A collective's op (c10d's call, gloo's and NCCL's own spans and kernels): time the rank
    waits or sends, not time of its own."""
    return op.startswith(("c10d::", "gloo:", "record_param_comms")) or op.lower().startswith("nccl")


def _top_line(r: RankRecording, count: int, own_only: bool = False) -> str:
    """'aten::mm 2.3 ms (16%), ...': each op's own time over the recorded steps, and its share
    of them (the steps' wall time; the profiler's span where no step was timed). `own_only`:
    the rank's own work, collectives left out (a slow rank's own time is what holds the
    others back; on a loaded CPU its all-reduce can still be its biggest op)."""
    rows = [
        row for row in r.summary.get("top") or [] if not (own_only and is_communication(row[0]))
    ]
    wall = r.total("total") or float(r.summary.get("seconds", 0.0)) or 1.0
    where = ("GPU" if r.summary.get("device") == "gpu" else "CPU") + " time, share of the steps"
    shown = [
        f"{name} {seconds * 1e3:.1f} ms ({seconds / wall:.0%})" for name, seconds, _ in rows[:count]
    ]
    if not shown:
        return ""
    line = ", ".join(shown) + f" ({where})"
    every, ops = float(r.summary.get("ops_s", 0.0)), int(r.summary.get("ops", 0))
    if count > 1 and every > 0 and ops > count:
        # the top few can be a small share of a step that computes most of its time: the rest
        # is other ops, and Python and the framework between them (not an op's own time)
        line += f"; all {ops} ops together {every / wall:.0%}"
    return line


def _cost_line(recordings: list[RankRecording]) -> str:
    export = max(float(r.summary.get("export_s", 0.0)) for r in recordings)
    during = [s.total for r in recordings for s in r.steps]
    before = [s.total for r in recordings for s in r.before]
    line = f"the recording's cost: writing its trace held a rank up to {export:.2f} s at its end"
    if during and before and statistics.median(before) > 0:
        ratio = statistics.median(during) / statistics.median(before)
        line += f"; steps while recording took {ratio:.2f}x the steps before"
    return line


def merge(folder: Path) -> Path | None:
    """One trace of every rank (each rank's processes renamed 'rank N: ...', timestamps on one
    base), when the ranks' traces are small enough to merge."""
    traces = sorted(folder.glob("rank*.trace.json.gz"), key=lambda p: int(p.name[4:].split(".")[0]))
    if not traces or sum(p.stat().st_size for p in traces) > MERGE_LIMIT:
        return None
    loaded = []
    for path in traces:
        with gzip.open(path, "rt") as f:
            loaded.append((int(path.name[4:].split(".")[0]), json.load(f)))
    base = min(int(t.get("baseTimeNanoseconds", 0)) for _, t in loaded)
    events: list[dict[str, Any]] = []
    for rank, trace in loaded:
        shift = (int(trace.get("baseTimeNanoseconds", 0)) - base) / 1e3
        pids: dict[Any, int] = {}
        for e in trace.get("traceEvents", []):
            if "pid" in e:
                e["pid"] = pids.setdefault(e["pid"], rank * 1000 + len(pids))
            if "ts" in e and shift:
                e["ts"] = float(e["ts"]) + shift
            if e.get("ph") == "M" and e.get("name") == "process_name":
                e["args"] = {"name": f"rank {rank}: {e.get('args', {}).get('name', '')}"}
            if e.get("ph") == "M" and e.get("name") == "process_sort_index":
                e["args"] = {"sort_index": e["pid"]}
            events.append(e)
    out = folder / "merged.trace.json.gz"
    with gzip.open(out, "wt") as f:
        json.dump({"traceEvents": events, "baseTimeNanoseconds": base}, f)
    return out


PARTS = (("compute", "tab:blue"), ("data", "tab:orange"), ("comm", "tab:red"), ("host", "tab:gray"))


def plot(recordings: list[RankRecording], path: Path) -> bool:
    """Each rank's step, in ms, split into its parts (where matplotlib is installed)."""
    shown = [r for r in recordings if r.steps]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not shown:
        return False
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(shown)))
    for row, r in enumerate(shown):
        left = 0.0
        for part, colour in PARTS:
            width = r.total(part) / len(r.steps) * 1e3
            label = {"comm": "comm waited", "host": "host/idle"}.get(part, part)
            ax.barh(row, width, left=left, color=colour, label=label if row == 0 else None)
            left += width
    longest = max(r.total("total") / len(r.steps) for r in shown) * 1e3
    ax.set_xlim(0, longest * 1.05)
    ax.set_yticks(range(len(shown)), [f"rank {r.rank}" for r in shown])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (the recorded steps' mean)")
    ax.legend(fontsize="small", ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

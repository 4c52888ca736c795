"""The speed doctor in the launcher: every rank's steps, read from its step record
(ddpkit.rank.steps), a straggler verdict while the job runs, a live file for `ddpkit top`, and a
summary when the job ends.

Each second the watch reads the steps each rank wrote since the last read. Every EVALUATE_EVERY
seconds it summarises each rank's last `window` steps (medians), gathers the evidence (NVML for
the rank's GPU, the host's load, the rank's share of a core) and asks ddpkit.launch.speed.straggler
who holds the job back. One node, or node 0 of several (each other node sends its ranks'
summaries through the job's store, ddpkit.launch.peers.liveness), decides and says so on stderr:
once when an episode starts, once when it ends. `run_dir/speed-live.json` holds what
`ddpkit top` shows; at the end `run_dir/speed.json` holds the job's per-rank figures and
`run_dir/steps.png` (where matplotlib is installed) each rank's step times.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

from ddpkit.common import nccl_transport, procs, protocol
from ddpkit.launch.base.snapshot import Snapshot
from ddpkit.launch.peers.peers import NoPeers, Peers
from ddpkit.launch.speed import across_nodes, evidence, straggler
from ddpkit.launch.speed.evidence import HostFacts, RankFacts
from ddpkit.launch.speed.memory_growth import MemoryWatch
from ddpkit.launch.speed.records import Episode, JobRow, LiveRow, MemoryFigures, SpeedReport
from ddpkit.launch.speed.straggler import Finding, RankSummary
from ddpkit.launch.speed.verdicts import summary_text, verdict

EVALUATE_EVERY = 2.0
LIVE_EVERY = 1.0
KEEP = 20000  # steps kept per rank for the summary and the plot (thinned beyond)
DEFAULT_THRESHOLD = 1.2
DEFAULT_WINDOW = 50


STALL_S, STALL_STEPS = 2.0, 5.0  # no step ended for this long (and this many steps): a stall


def stalled(tracks: Iterable[Track], now: float) -> bool:
    """No rank of this node has ended a step for STALL_STEPS of its recent steps' time (and at
    least STALL_S): a hang in the making, the hang watch's to judge. A straggler verdict then
    would name whichever rank the load slowed last, not the rank that stopped (seen under load:
    rank 0 named just before the hang verdict on rank 1, which slept)."""
    windows = [list(t.window) for t in tracks if t.window]
    if not windows:
        return False
    recent = [s.total for w in windows for s in w[-8:]]
    last = max(w[-1].end for w in windows)
    return now - last > max(STALL_S, STALL_STEPS * statistics.median(recent))


class Track:
    """One rank's steps as the launcher has read them."""

    def __init__(self, rank: int, pid: int, window: int) -> None:
        self.rank, self.pid = rank, pid
        self.read = 0
        self.gpu = ""
        self.window: collections.deque[protocol.Step] = collections.deque(maxlen=window)
        self.kept: list[tuple[float, float, float, float, float]] = []  # total, data, ...
        self.every = 1  # keep one step in `every` (thinned as the job grows)
        self.seen = 0
        # optimizer steps taken: the first starts the clock, so step record N is the N+1th
        self.taken = 0

    def take(self, steps: list[protocol.Step]) -> None:
        for s in steps:
            self.window.append(s)
            self.seen += 1
            self.taken = max(self.taken, s.number + 1)
            if self.seen % self.every == 0:
                self.kept.append((s.total, s.data, s.compute, s.comm, s.host))
                if len(self.kept) >= KEEP:
                    self.kept, self.every = self.kept[::2], self.every * 2

    def summary(self, host: str, facts: RankFacts) -> RankSummary | None:
        if not self.window:
            return None
        w = list(self.window)
        med = {
            k: statistics.median(getattr(s, k) for s in w) for k in protocol.Step.__annotations__
        }
        totals = sorted(s.total for s in w)
        return RankSummary(
            rank=self.rank,
            host=host,
            steps=len(w),
            total=med["total"],
            data=med["data"],
            compute=med["compute"],
            comm=med["comm"],
            other=med["host"],
            total_p90=totals[min(len(totals) - 1, int(0.9 * len(totals)))],
            gpu=f"GPU {facts['gpu']['index']}" if "index" in facts.get("gpu", {}) else "",
            facts=facts,
        )


TRANSPORT_FILE = "transport.json"  # in the run folder: NCCL's transport and its slow paths


class SpeedWatch:
    def __init__(
        self,
        run_dir: Path,
        threshold: float = DEFAULT_THRESHOLD,
        window: int = DEFAULT_WINDOW,
        host: str = "",
        peers: Peers | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.threshold, self.window = threshold, window
        self.host = host or os.uname().nodename
        self.peers: Peers = peers if peers is not None else NoPeers()  # the job's other nodes
        self.tracks: dict[int, Track] = {}
        self.memory = MemoryWatch()  # the memory doctor's figures and notes
        self.episodes = straggler.Episodes(threshold)
        self.notes: list[str] = []
        self.gpus = evidence.Gpus()
        self.hostinfo = evidence.Host()
        self.next_eval = self.next_live = 0.0
        self.started = time.time()
        self.summaries: dict[int, RankSummary] = {}
        self.history: list[Episode] = []  # episodes, for speed.json
        self.transport: str | None = None  # NCCL's, once its log says it is connected

    def watch(self, pids: dict[int, int]) -> None:
        """The ranks of this node to follow (rank -> pid), once they started."""
        self.tracks = {rank: Track(rank, pid, self.window) for rank, pid in pids.items()}

    # -- while the job runs ---------------------------------------------------------------

    def sample(self, snap: Snapshot) -> None:
        """Judge and show the steps taken so far (`take` got them from every look)."""
        now = snap.mono
        if now >= self.next_eval:
            self.next_eval = now + EVALUATE_EVERY
            self._evaluate()
        if now >= self.next_live:
            self.next_live = now + LIVE_EVERY
            self._write_live()

    def take(self, snap: Snapshot) -> None:
        """The steps each rank wrote since the last read (the snapshot read them): every look
        that read them hands them here, so none is lost to a look made for something else."""
        for view in snap.ranks:
            record, track = view.steps, self.tracks.get(view.rank)
            if record is None or track is None:
                continue
            track.gpu = record.gpu
            track.take(record.steps)
            track.read = record.count
            memory = record.memory if record.gpu else None
            self.memory.take(view.rank, record.count, memory, view.rss, view.profiling)
        self.memory.look()
        self.notes.extend(self.memory.notes)
        self.memory.notes.clear()

    def _facts(self, track: Track, job: set[int], host: HostFacts) -> RankFacts:
        facts: RankFacts = {"host": host}
        share = self.hostinfo.cpu_share(track.pid)
        if share is not None:
            facts["cpu_share"] = share
        demand = self.hostinfo.cpu_demand(track.pid)
        if demand is not None:
            facts["cpu_demand"] = demand
        queued = self.hostinfo.cpu_queued(track.pid)
        if queued is not None:
            facts["cpu_queued"] = queued
        if track.gpu:
            facts["gpu"] = self.gpus.facts(track.gpu, job)
        return facts

    def local_summaries(self) -> list[RankSummary]:
        job = self._job_pids()
        host = self.hostinfo.facts()  # once: the host's CPU use since the last evaluation
        found = []
        for track in self.tracks.values():
            summary = track.summary(self.host, self._facts(track, job, host))
            if summary is not None:
                found.append(summary)
        return found

    def _job_pids(self) -> set[int]:
        import psutil

        pids: set[int] = set()
        for track in self.tracks.values():
            try:
                pids.update(p.pid for p in procs.tree(track.pid))
            except psutil.Error:
                continue
        return pids

    def _check_transport(self) -> None:
        """Once NCCL has connected: which transport it chose, and any slower path taken."""
        if self.transport is not None or not nccl_transport.complete(self.run_dir):
            return
        found = nccl_transport.read(self.run_dir, self.host)
        self.transport = found.line() if found.ranks != 1 else "one rank: no data moves"
        self.notes.append(f"NCCL transport: {self.transport}")
        from ddpkit.common.network import infiniband_devices

        said = nccl_transport.warnings(
            found,
            nvlinked=self._nvlinked(),
            infiniband=infiniband_devices(),
            interfaces=nccl_transport.interface_speeds(),
        )
        self.notes.extend(f"warning: {slow}" for slow in said)
        # the same as values: in the run folder, and where a program that ran this job asked
        # (`ddpkit doctor`'s smoke test)
        record = json.dumps({"line": self.transport, "slow": [asdict(slow) for slow in said]})
        asked = os.environ.get(protocol.TRANSPORT_TO)
        for path in (self.run_dir / TRANSPORT_FILE, *([Path(asked)] if asked else [])):
            with contextlib.suppress(OSError):
                path.write_text(record)

    def _nvlinked(self) -> bool:
        """This machine's GPUs have active NVLinks (NVML)."""
        from ddpkit.common.gpus import link_peak

        peak = link_peak(0) or {}
        return bool(peak) and str(peak.get("link", "")).startswith("NVLink")

    def _evaluate(self) -> None:
        self._check_transport()
        mine = self.local_summaries()
        for s in mine:
            self.summaries[s.rank] = s
        if not self.peers.leads:  # node 0 decides, from every node's summaries
            across_nodes.send(self.peers, json.dumps([asdict(s) for s in mine]))
            return
        for text in across_nodes.from_others(self.peers):
            for item in json.loads(text):
                self.summaries[int(item["rank"])] = RankSummary(**item)
        if self.threshold <= 0 or stalled(self.tracks.values(), time.time()):
            return
        every = list(self.summaries.values())
        what, finding = self.episodes.update(straggler.find(every, self.threshold))
        if what == "start" and finding is not None:
            self._add_competitors(finding)
            line = verdict(finding, self.summaries, self.window)
            self.notes.append(line)
            self.history.append({"start": time.time(), "rank": finding.rank, "line": line})
        elif what == "end" and finding is not None:
            line = (
                f"straggler: rank {finding.rank} is back at the job's pace "
                f"(its own time within {self.threshold:g}x the median rank's)"
            )
            self.notes.append(line)
            self.history.append({"end": time.time(), "rank": finding.rank, "line": line})

    def _add_competitors(self, finding: Finding) -> None:
        """A local rank slow on the CPU: the processes busy on its cores, as evidence."""
        track = self.tracks.get(finding.rank)
        me = self.summaries.get(finding.rank)
        if track is None or me is None or track.gpu or finding.part != "compute":
            return
        busy = evidence.competitors(track.pid, self._job_pids())
        if busy:
            self.summaries[finding.rank] = replace(me, facts={**me.facts, "competitors": busy})

    def _write_live(self) -> None:
        if not self.summaries:
            return
        current = self.episodes.current
        rows = [
            live_row(
                s,
                current is not None and current.rank == s.rank,
                self.tracks.get(s.rank),
                self.memory.figures(s.rank),
            )
            for s in sorted(self.summaries.values(), key=lambda s: s.rank)
        ]
        body = {"time": time.time(), "window": self.window, "ranks": rows}
        tmp = self.run_dir / ".speed-live.json.tmp"
        try:
            tmp.write_text(json.dumps(body))
            tmp.replace(self.run_dir / "speed-live.json")
        except OSError:
            pass

    # -- at the end -----------------------------------------------------------------------

    def finish(self, last: Snapshot) -> str:
        """The job's per-rank summary (text for the console, "" for a job of a few steps);
        speed.json and steps.png in the run folder. `last`: the ranks as they ended, with the
        steps they wrote since the last look."""
        self.take(last)
        self._check_transport()  # a short job may end before an evaluation read it
        self.gpus.close()
        rows: list[JobRow] = []
        for track in sorted(self.tracks.values(), key=lambda t: t.rank):
            if len(track.kept) < straggler.MIN_STEPS:
                continue
            rows.append(whole_job_row(track, self.host, self.memory.figures(track.rank)))
        if not rows:
            return ""
        slowest = max(rows, key=lambda r: r["own_median"])
        # the median of the other ranks', as the straggler verdict has it
        others = [r["own_median"] for r in rows if r is not slowest] or [slowest["own_median"]]
        typical = statistics.median(others)
        cost = max(0.0, slowest["own_median"] - typical) * slowest["steps"]
        total = max(r["total_s"] for r in rows)
        report: SpeedReport = {
            "ranks": rows,
            "slowest": {
                "rank": slowest["rank"],
                "own_over_median": slowest["own_median"] / typical if typical else None,
                "cost_s": cost,
                "cost_share": cost / total if total else 0.0,
            },
            "episodes": self.history,
            "threshold": self.threshold,
        }
        try:
            (self.run_dir / "speed.json").write_text(json.dumps(report, indent=1))
            plot(self.tracks, self.run_dir / "steps.png")
        except OSError:
            pass
        return summary_text(report)


def live_row(s: RankSummary, slow: bool, track: Track | None, memory: MemoryFigures) -> LiveRow:
    whole = (s.data + s.compute + s.comm + s.other) or 1.0
    last = track.window[-1].total if track is not None and track.window else s.total
    return {
        "rank": s.rank,
        "host": s.host,
        "gpu": s.gpu,
        "steps": s.steps,
        "last_s": last,
        "median_s": s.total,
        "p90_s": s.total_p90,
        "steps_per_s": 1.0 / s.total if s.total > 0 else 0.0,
        "split": {
            "data": s.data / whole,
            "compute": s.compute / whole,
            "comm": s.comm / whole,
            "host": s.other / whole,
        },
        "straggler": slow,
        "facts": s.facts,
        "memory": memory,
    }


def whole_job_row(track: Track, host: str, memory: MemoryFigures) -> JobRow:
    totals = sorted(k[0] for k in track.kept)
    sums = [sum(k[i] for k in track.kept) for i in range(5)]
    whole = sums[0] or 1.0
    own = sorted(k[1] + k[2] + k[4] for k in track.kept)
    return {
        "rank": track.rank,
        "host": host,
        "steps": track.taken,  # optimizer steps (the medians are over the timed ones)
        "median_s": statistics.median(totals),
        "p90_s": totals[min(len(totals) - 1, int(0.9 * len(totals)))],
        "total_s": sums[0] * track.every,
        "own_median": statistics.median(own),
        "split": {
            "data": sums[1] / whole,
            "compute": sums[2] / whole,
            "comm": sums[3] / whole,
            "host": sums[4] / whole,
        },
        "memory": memory,
    }


SPIKE = 3.0  # a step this many times its rank's median is marked on steps.png


def plot(tracks: dict[int, Track], path: Path) -> None:
    """Each rank's step time over the job in a panel of its own (one scale for all), its median
    dashed, each step over SPIKE times the median marked and the largest labelled; the scale
    stops above the ordinary steps so that one long step does not flatten the rest (where
    matplotlib is installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shown = [t for t in sorted(tracks.values(), key=lambda t: t.rank) if t.kept]
    if not shown:
        return
    every_ms = sorted(k[0] * 1e3 for t in shown for k in t.kept)
    ordinary = every_ms[min(len(every_ms) - 1, int(len(every_ms) * 0.98))]
    top = max(ordinary * 1.3, statistics.median(every_ms) * SPIKE * 1.2)
    fig, axes = plt.subplots(
        len(shown), 1, figsize=(8, 1.2 + 1.15 * len(shown)), sharex=True, sharey=True,
        squeeze=False,
    )  # fmt: skip
    for ax, track in zip(axes[:, 0], shown, strict=True):
        steps = [i * track.every for i in range(len(track.kept))]
        ms = [k[0] * 1e3 for k in track.kept]
        typical = statistics.median(ms)
        ax.plot(steps, [min(m, top) for m in ms], lw=0.8)
        ax.axhline(typical, ls="--", lw=0.7, color="grey")
        spikes = [(x, m) for x, m in zip(steps, ms, strict=True) if m > SPIKE * typical]
        if spikes:
            ax.plot([x for x, _ in spikes], [min(m, top) for _, m in spikes], "v", color="red",
                    ms=4)  # fmt: skip
            x, m = max(spikes, key=lambda p: p[1])
            ax.annotate(f"{m:.0f} ms", (x, min(m, top)), fontsize="x-small", color="red",
                        xytext=(3, -9), textcoords="offset points")  # fmt: skip
        ax.set_ylabel(f"rank {track.rank}\nms", fontsize="small")
        ax.text(0.995, 0.93, f"median {typical:.1f} ms; {len(spikes)} step(s) over {SPIKE:g}x",
                transform=ax.transAxes, ha="right", va="top", fontsize="x-small")  # fmt: skip
        ax.set_ylim(0, top)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(
        f"step time per rank (dashed: its median; red: a step over {SPIKE:g}x it)",
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

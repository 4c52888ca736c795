"""One rank of `ddpkit bench`: `python -m ddpkit.bench.worker CONFIG_JSON`, started by the
launcher. Rank 0 prints nccl-tests' table as it goes and writes the files; every rank exits 7
when a result was wrong (as nccl-tests does), else 0.

Timing follows nccl-tests: warm-up, a barrier, then -n calls back to back, synchronised once at
the end (every call with -z 1), measured with CUDA events on GPUs and a monotonic clock on CPU;
time is the average per call, aggregated across ranks by -a. With -G N the -n calls are
captured once in a CUDA graph and the graph is replayed N times, so small sizes measure the
collective rather than Python's ~20 us per call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.bench import collectives, table
from ddpkit.bench.options import COLLECTIVES, BenchConfig
from ddpkit.common.gpus import link_peak

WRONG_EXIT = 7


def main(config_json: str) -> int:
    cfg = BenchConfig(**json.loads(config_json))
    with ddpkit.setup() as s:
        n, rank, device = s.world_size, s.rank, s.device
        devices = s.gather(_device_facts(rank, device))
        peak = _peak(cfg, device) if n > 1 or cfg.peak != "auto" else None
        versions = {"torch": torch.__version__, "backend": s.backend}
        if s.backend == "nccl":
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        wrong = 0
        # `all`: each collective in turn, as running every nccl-tests binary one after another
        every = cfg.collective == "all"
        for name in COLLECTIVES if every else (cfg.collective,):
            one = dataclasses.replace(cfg, collective=name)
            wrong += _one_collective(one, every, s, devices, peak, versions)
        if wrong:
            if s.is_main:
                print(
                    f"error: {wrong} element(s) differ from the exact result; the transport "
                    "or the reduction is broken\nfix: run `ddpkit doctor` and check the "
                    "links and drivers",
                    file=sys.stderr,
                    flush=True,
                )
            return WRONG_EXIT
    return 0


def _one_collective(
    cfg: BenchConfig,
    every: bool,
    s: ddpkit.Session,
    devices: list[dict[str, Any]],
    peak: dict[str, Any] | None,
    versions: dict[str, str],
) -> int:
    """One collective's whole table, as its nccl-tests binary prints it, and its files (named
    after it when `every` collective runs); returns the wrong elements."""
    n, rank, device = s.world_size, s.rank, s.device
    if s.is_main:
        text = " ".join(f"{k}={v}" for k, v in versions.items())
        print(table.preamble(cfg, n, devices, text), flush=True)
    rows = []
    # as nccl-tests: every type, within it every reduction, within that every size
    ops = cfg.ops(device.type == "cuda") if collectives.uses_op(cfg.collective) else ("sum",)
    for type_name in cfg.dtypes():
        for op in ops:
            for size in cfg.sizes():
                row = _row(cfg, size, type_name, op, n, rank, device)
                rows.append(row)
                if s.is_main:
                    print(table.format_row(row), flush=True)
    if s.is_main:
        print(table.footer(cfg, rows, peak), flush=True)
        _write_files(cfg, rows, devices, peak, versions, n, every)
    return table.wrong_total(rows)


def _row(
    cfg: BenchConfig, size: int, type_name: str, op: str, n: int, rank: int, device: torch.device
) -> table.Row:
    """One line of the table: the collective at one size, type and reduction, out of place
    and in place, timed, aggregated across ranks and checked."""
    dtype = collectives.DTYPES[type_name]
    count, shown = collectives.counts(cfg.collective, size, n, dtype)
    cases = collectives.build(cfg.collective, count, n, rank, dtype, device, op, cfg.root)
    placements = {}
    for name, case in cases.items():
        us = _aggregate(_time(case, cfg, device), cfg.average, device)
        wrong = _check(case, device) if cfg.check else 0
        algbw = shown / us / 1e3 if us > 0 else 0.0
        placements[name] = table.Placement(
            us, algbw, algbw * collectives.bus_factor(cfg.collective, n), wrong
        )
    return table.Row(
        shown,
        count,
        type_name,
        op if collectives.uses_op(cfg.collective) else "none",
        cfg.root if collectives.uses_root(cfg.collective) else -1,
        placements["oop"],
        placements["ip"],
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(case: collectives.Case, cfg: BenchConfig, device: torch.device) -> float:
    """Average microseconds per call on this rank."""
    for _ in range(cfg.warmup_iters):
        case.run()
    _sync(device)
    graph = None
    if cfg.graph:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(cfg.iters):
                case.run()
        graph.replay()  # warm the graph once
        _sync(device)
    dist.barrier()
    calls = cfg.iters * (cfg.graph or 1)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _loop(case, cfg, graph, device)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / calls
    began = time.perf_counter()
    _loop(case, cfg, graph, device)
    return (time.perf_counter() - began) * 1e6 / calls


def _loop(case: collectives.Case, cfg: BenchConfig, graph: Any, device: torch.device) -> None:
    if graph is not None:
        for _ in range(cfg.graph):
            graph.replay()
        return
    for _ in range(cfg.iters):
        case.run()
        if cfg.blocking:
            _sync(device)


def _aggregate(us: float, how: int, device: torch.device) -> float:
    t = torch.tensor([us], dtype=torch.float64, device=device)
    if how == 0:
        dist.broadcast(t, src=0)
        return float(t.item())
    op = {1: dist.ReduceOp.SUM, 2: dist.ReduceOp.MIN, 3: dist.ReduceOp.MAX}[how]
    dist.all_reduce(t, op=op)
    return float(t.item()) / (dist.get_world_size() if how == 1 else 1)


def _check(case: collectives.Case, device: torch.device) -> int | None:
    case.reset()
    _sync(device)
    dist.barrier()
    case.run()
    _sync(device)
    wrong = case.wrong()
    if (
        os.environ.get("DDPKIT_BENCH_PLANT_WRONG") == "1"
        and dist.get_rank() == 0
        and wrong is not None
    ):
        wrong += 1  # a planted wrong element: tests prove that wrong data is counted
    flag = torch.tensor([-1 if wrong is None else wrong], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX if wrong is None else dist.ReduceOp.SUM)
    return None if wrong is None else int(flag.item())


def _device_facts(rank: int, device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()[:10]}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        ids = [int(getattr(props, f"pci_{k}_id", 0)) for k in ("domain", "bus", "device")]
        bus = f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}"
        return {**facts, "device": device.index, "bus": bus, "name": props.name}
    return {**facts, "device": -1, "bus": "cpu", "name": platform.processor() or "CPU"}


def _peak(cfg: BenchConfig, device: torch.device) -> dict[str, Any] | None:
    if cfg.peak != "auto":
        return {"gbps": float(cfg.peak), "link": "given with --peak"}
    if device.type != "cuda":
        return None
    return link_peak(device.index)


def _write_files(
    cfg: BenchConfig,
    rows: list[table.Row],
    devices: list[dict[str, Any]],
    peak: dict[str, Any] | None,
    versions: dict[str, str],
    n: int,
    every: bool,
) -> None:
    if cfg.json:
        table.write_json(
            _named(cfg.json, cfg.collective, every), cfg, rows, devices, peak, versions
        )
    if cfg.csv:
        table.write_csv(_named(cfg.csv, cfg.collective, every), rows)
    if cfg.plot:
        table.write_plot(_named(cfg.plot, cfg.collective, every), cfg, rows, n, peak)


def _named(path: str, collective: str, every: bool) -> str:
    """Under `ddpkit bench all` each collective writes its own file: r.json becomes
    r.all_reduce.json."""
    if not every:
        return path
    stem, dot, suffix = path.rpartition(".")
    if dot and "/" not in suffix:
        return f"{stem}.{collective}.{suffix}"
    return f"{path}.{collective}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

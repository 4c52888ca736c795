"""`ddpkit top [JOB]`: a live table of every rank of a running job: step times, steps per second,
where each step goes, the rank's GPU (utilisation, memory, clock, temperature, power) and host
(CPU, memory), the straggler marked. It reads what the job's launcher writes each second
(`speed-live.json` in the run folder; on node 0 of several nodes it holds every node's ranks)
and never touches the job. `q` or Ctrl+C quits; `--once` prints one table, `--once --json`
the same as JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError

LIVE = "speed-live.json"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "top", help="live step times of every rank of a running job", description=__doc__
    )
    p.add_argument("job", nargs="?", help="job id from `ddpkit ps` (default: the only job)")
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.add_argument("--json", action="store_true", help="with --once: the table as JSON")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.json and not args.once:
        raise ConfigError("--json prints one table", fix="use `ddpkit top --once --json`")
    if not 0.1 <= args.interval <= 60:
        raise ConfigError(
            f"--interval {args.interval:g} is not between 0.1 and 60 seconds",
            fix="e.g. --interval 1 (the default)",
        )
    job, run_dir = find_run(args.job)
    if args.once:
        status = read(run_dir)
        if args.json:
            print(json.dumps({"job": job, **status}, indent=1))
        else:
            from rich.console import Console

            # a pipe or a file gets the whole table, not one cut to 80 columns
            console = Console(width=None if sys.stdout.isatty() else 160)
            console.print(table(job, status, console.width))
        return 0
    return live(job, run_dir, args.interval)


def find_run(job: str | None) -> tuple[str, Path]:
    """The job (named, or the only one) and its run folder on this machine."""
    import psutil

    from ddpkit.common import protocol
    from ddpkit.common.procs import job_workers

    job, mine = job_workers(job, "top")
    for p in mine:
        with contextlib.suppress(psutil.Error):
            state_dir = psutil.Process(p.pid).environ().get(protocol.STATE_DIR)
            if state_dir:
                return job, Path(state_dir).parent
    raise ConfigError(
        f"job {job!r} was not started by `ddpkit run`: its ranks' steps are not timed",
        fix="start it with `ddpkit run` (torchrun's flags work unchanged)",
    )


def read(run_dir: Path) -> dict[str, Any]:
    """What the launcher wrote last: {"time", "window", "ranks": [...]}, or no ranks yet."""
    try:
        return json.loads((run_dir / LIVE).read_text())
    except (OSError, ValueError):
        return {"time": None, "window": None, "ranks": []}


# (wide header, narrow header); the narrow ones and the columns' order fit 80 columns
COLUMNS = {
    "rank": ("rank", "rank"),
    "host": ("host", "host"),
    "steps": ("step ms last/median/p90", "ms median"),
    "rate": ("steps/s", "st/s"),
    "split": ("data/compute/comm/host", "split %"),
    "held": ("held: peak/reserved or rss", "held"),
    "gpu": ("GPU", "GPU"),
    "util": ("util", "util"),
    "memory": ("memory", "mem GiB"),
    "clock": ("clock", "clock"),
    "temp": ("temp", "temp"),
    "power": ("power", "power"),
    "cpu": ("host CPU/mem", "CPU/mem"),
}
WIDE = 130  # a terminal at least this wide gets every column with its long header
NARROW_DROPS = ("clock", "power", "temp")  # the first to go where space is short


def table(job: str, status: dict[str, Any], width: int = WIDE) -> Any:
    """The ranks as a rich Table for a terminal `width` columns wide: every column on a wide
    one; on a narrow one short headers, one step time (the median) instead of three, and
    neither GPU clock, temperature nor power. Columns with nothing to show (no GPU, one host)
    are left out."""
    from rich.table import Table

    wide = width >= WIDE
    ranks = status.get("ranks") or []
    age = time.time() - status["time"] if status.get("time") else None
    caption = f"job {job}"
    if status.get("window"):
        window = status["window"]
        caption += f": medians of each rank's last {window} steps" if wide else f", {window} steps"
    if age is not None and age > 5:
        caption += f" (as of {age:.0f} s ago)"
    if not wide:
        caption += "; split % = data/compute/comm/host"
    rows = [_row(r, wide) for r in ranks]
    keep = [
        name
        for name in COLUMNS
        if (wide or name not in NARROW_DROPS)
        and (not rows or name == "rank" or any(row[name] not in ("", "-") for row in rows))
        and not (name == "host" and len({row["host"] for row in rows}) <= 1 and not wide)
    ]
    from rich import box

    t = Table(
        title=caption,
        title_justify="left",
        header_style="bold",
        box=box.SQUARE if wide else box.SIMPLE_HEAD,  # narrow: no column borders
    )
    for name in keep:
        header = COLUMNS[name][0 if wide else 1]
        t.add_column(header, justify="left" if name in ("host", "gpu") else "right")
    if not rows:
        t.add_row("-", "waiting for the first steps", *[""] * (len(keep) - 2))
    for row in rows:
        t.add_row(*(row[name] for name in keep))
    return t


def _row(r: dict[str, Any], wide: bool) -> dict[str, str]:
    facts = r.get("facts") or {}
    gpu = facts.get("gpu") or {}
    host = facts.get("host") or {}
    split = r.get("split") or {}
    times = (r["last_s"], r["median_s"], r["p90_s"]) if wide else (r["median_s"],)
    parts = [f"{split.get(k, 0) * 100:.0f}" for k in ("data", "compute", "comm", "host")]
    mark = "straggler" if wide else "slow"
    sep = " / " if wide else "/"
    return {
        "rank": f"[bold red]{r['rank']} {mark}[/]" if r.get("straggler") else str(r["rank"]),
        "host": str(r.get("host", "")),
        "steps": " / ".join(f"{t * 1e3:.1f}" for t in times),
        "rate": f"{r['steps_per_s']:.1f}",
        "held": held(r.get("memory") or {}),
        "split": sep.join(parts) + (" %" if wide else "%"),
        "gpu": str(r.get("gpu") or "-") if wide else _short_gpu(r.get("gpu")),
        "util": _pct(gpu.get("util")),
        "memory": _mem(gpu, wide),
        "clock": f"{gpu['sm_mhz']} MHz" if gpu.get("sm_mhz") else "-",
        "temp": f"{gpu['temp_c']} C" if gpu.get("temp_c") is not None else "-",
        "power": f"{gpu['power_w']:.0f} W" if gpu.get("power_w") is not None else "-",
        "cpu": f"{_pct(host.get('cpu_percent'))}{sep}{_pct(host.get('mem_percent'))}",
    }


def held(figures: dict[str, Any]) -> str:
    """What the rank holds: torch's peak allocated / reserved GPU memory, or its resident
    memory on the CPU (ddpkit.launch.speed.memory_growth)."""
    if not figures:
        return "-"
    if "reserved" in figures:
        return f"{figures['peak'] / 2**30:.1f}/{figures['reserved'] / 2**30:.1f} GiB"
    return f"rss {figures['peak'] / 2**30:.1f} GiB"


def _short_gpu(name: Any) -> str:
    """'0 NVIDIA H200' -> '0 H200': the index and the model's last word."""
    if not name:
        return "-"
    words = str(name).split()
    return f"{words[0]} {words[-1]}" if len(words) > 2 else str(name)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _mem(gpu: dict[str, Any], wide: bool = True) -> str:
    if gpu.get("mem_used_mib") is None:
        return "-"
    used, total = gpu["mem_used_mib"] / 1024, gpu.get("mem_total_mib", 0) / 1024
    return f"{used:.1f}/{total:.0f} GiB" if wide else f"{used:.0f}/{total:.0f}"


def live(job: str, run_dir: Path, interval: float) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        with keys() as pressed, Live(console=console, auto_refresh=False) as view:
            while True:
                view.update(table(job, read(run_dir), console.width), refresh=True)
                if "q" in pressed(interval).lower():
                    return 0
                if not (run_dir / LIVE).exists() and not run_dir.exists():
                    return 0
    except KeyboardInterrupt:
        return 0


@contextlib.contextmanager
def keys() -> Iterator[Any]:
    """`pressed(timeout)`: the keys typed within timeout seconds ("" when stdin is no
    terminal); the terminal is put back as it was."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:

        def waited(timeout: float) -> str:
            time.sleep(timeout)
            return ""

        yield waited
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def pressed(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 32).decode(errors="replace") if ready else ""

    try:
        yield pressed
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)

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
            Console(width=None if sys.stdout.isatty() else 160).print(table(job, status))
        return 0
    return live(job, run_dir, args.interval)


def find_run(job: str | None) -> tuple[str, Path]:
    """The job (named, or the only one) and its run folder on this machine."""
    import psutil

    from ddpkit import protocol
    from ddpkit.procs import job_workers

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


def table(job: str, status: dict[str, Any]) -> Any:
    from rich.table import Table

    ranks = status.get("ranks") or []
    age = time.time() - status["time"] if status.get("time") else None
    caption = f"job {job}"
    if status.get("window"):
        caption += f": medians of each rank's last {status['window']} steps"
    if age is not None and age > 5:
        caption += f" (as of {age:.0f} s ago)"
    t = Table(title=caption, title_justify="left", header_style="bold")
    for name in ("rank", "host", "step ms last/median/p90", "steps/s", "data/compute/comm/host",
                 "GPU", "util", "memory", "clock", "temp", "power", "host CPU/mem"):  # fmt: skip
        t.add_column(name, justify="left" if name in ("host", "GPU") else "right")
    if not ranks:
        t.add_row("-", "waiting for the first steps", *[""] * 10)
    for r in ranks:
        facts = r.get("facts") or {}
        gpu = facts.get("gpu") or {}
        host = facts.get("host") or {}
        split = r.get("split") or {}
        slow = r.get("straggler")
        t.add_row(
            f"[bold red]{r['rank']} straggler[/]" if slow else str(r["rank"]),
            str(r.get("host", "")),
            f"{r['last_s'] * 1e3:.1f} / {r['median_s'] * 1e3:.1f} / {r['p90_s'] * 1e3:.1f}",
            f"{r['steps_per_s']:.1f}",
            " / ".join(f"{split.get(k, 0) * 100:.0f}" for k in ("data", "compute", "comm", "host"))
            + " %",
            str(r.get("gpu") or "-"),
            _pct(gpu.get("util")),
            _mem(gpu),
            f"{gpu['sm_mhz']} MHz" if gpu.get("sm_mhz") else "-",
            f"{gpu['temp_c']} C" if gpu.get("temp_c") is not None else "-",
            f"{gpu['power_w']:.0f} W" if gpu.get("power_w") is not None else "-",
            f"{_pct(host.get('cpu_percent'))} / {_pct(host.get('mem_percent'))}",
        )
    return t


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _mem(gpu: dict[str, Any]) -> str:
    if gpu.get("mem_used_mib") is None:
        return "-"
    return f"{gpu['mem_used_mib'] / 1024:.1f}/{gpu.get('mem_total_mib', 0) / 1024:.0f} GiB"


def live(job: str, run_dir: Path, interval: float) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        with keys() as pressed, Live(console=console, auto_refresh=False) as view:
            while True:
                view.update(table(job, read(run_dir)), refresh=True)
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

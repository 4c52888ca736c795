"""The hang window under load, many times: no false verdict allowed, every hang named in seconds.

Each round starts, side by side and with no flag but `-n 3`: the four kinds of work that keep
the others waiting longer than --hang-min (one rank computing, every rank warming up before
its first step, rank 0 writing a checkpoint to a slow disk, a child process downloading: each
40 s), and one hang of the zoo (a different one each round). Meanwhile LOAD processes spin a
core each, so the ranks get a share of a core, as on a busy machine. A work job called hung is
a false verdict; a hang's time is from its stall to its verdict.

    python benchmarks/hang_window_stress.py --rounds 10 --load 2 --out benchmarks/results/x

Prints one line per round and a table last; writes the table to OUT/hang_window_stress.txt.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "e2e" / "scripts"
HANGS = str(SCRIPTS / "hangs.py")
WORK = {
    "computing": [HANGS, "compute", "40"],
    "warming up": [HANGS, "warm-up", "40"],
    "slow save": [HANGS, "slow-save", "40", "{folder}"],
    "downloading": [str(SCRIPTS / "downloading.py"), "40", "{folder}"],
}
ZOO = {  # name -> (arguments, the line it prints as it stalls, the verdict's words)
    "asleep": ([HANGS, "sleep"], "stall", "rank 1 is elsewhere"),
    "rank 0 only": ([HANGS, "only-rank-0"], "stall", "called different collectives"),
    "extra barrier": ([HANGS, "skipped-barrier"], "stall", "rank 1 is elsewhere"),
    "loader": ([HANGS, "loader"], "stall", "waits for a DataLoader batch"),
    "GIL": ([str(SCRIPTS / "holds_the_gil.py")], "[rank 1] ready", "holds the GIL"),
}


class Job:
    def __init__(self, args: list[str], folder: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "run", "-n", "3", "--grace", "2",
             "--log-dir", str(folder / "logs"), *args],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)

    def text(self) -> str:
        return "".join(line for _, line in list(self.lines))


def one_round(n: int, zoo: str, base: Path) -> tuple[dict[str, int], float | None, str]:
    folder = base / f"round{n}"
    jobs = {}
    for name, args in WORK.items():
        here = folder / name.replace(" ", "-")
        here.mkdir(parents=True)
        jobs[name] = Job([a.format(folder=here) for a in args], here)
    here = folder / "zoo"
    here.mkdir()
    args, marker, words = ZOO[zoo]
    hang = Job(args, here)
    try:
        codes = {name: job.proc.wait(240) for name, job in jobs.items()}
        hang.proc.wait(240)
    finally:
        for job in [*jobs.values(), hang]:
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()
    time.sleep(0.2)
    false = {name: jobs[name].text().count("the job hung") for name in jobs}
    for name, job in jobs.items():
        if codes[name] != 0:
            false[name] = max(false[name], 1)
            print(f"  {name} exited {codes[name]}:\n{job.text()[-1500:]}")
    stalled, said = hang.first(marker), hang.first("root cause:")
    took = said - stalled if stalled is not None and said is not None else None
    named = bool(re.search(re.escape(words), hang.text()))
    return false, took, "" if named else hang.text()[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ddpkit-hang-window-"))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    false_total, runs, times, misnamed = 0, 0, [], 0
    try:
        for n in range(args.rounds):
            zoo = list(ZOO)[n % len(ZOO)]
            began = time.monotonic()
            false, took, wrong = one_round(n, zoo, base)
            false_total += sum(false.values())
            runs += len(false)
            if took is not None:
                times.append(took)
            misnamed += bool(wrong)
            said = f"{took:.1f} s" if took is not None else "never"
            print(f"round {n}: work false verdicts {sum(false.values())}/{len(false)}; "
                  f"hang '{zoo}' named after {said}{' WRONG' if wrong else ''} "
                  f"({time.monotonic() - began:.0f} s)", flush=True)  # fmt: skip
            if wrong:
                print(wrong)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    left = []  # any process still working in the rounds' folders
    for p in psutil.process_iter():
        try:
            if p.cwd().startswith(str(base)):
                left.append(p)
        except psutil.Error:
            continue
    table = [
        f"hang window under load: {args.rounds} rounds, {args.load} spinning process(es) on "
        f"{os.cpu_count()} cores, defaults (no flag but -n 3)",
        f"work jobs (40 s of waiting for one that works): {runs}, false verdicts: {false_total}",
        f"hangs: {len(times)} named of {args.rounds}, {misnamed} with the wrong words; from "
        f"stall to verdict: median {statistics.median(times):.1f} s, max {max(times):.1f} s"
        if times
        else "hangs: none named",
        f"processes left: {len(left)}",
    ]
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hang_window_stress.txt").write_text("\n".join(table) + "\n")
    return 1 if false_total or misnamed or len(times) < args.rounds or left else 0


if __name__ == "__main__":
    sys.exit(main())

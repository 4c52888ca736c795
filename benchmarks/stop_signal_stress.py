"""A stop signal to `ddpkit run` at a random moment, many times over (issue 27: 100 runs before
the stop flag is called done): SIGTERM, SIGINT and SIGUSR1 in turn, each at a random delay
after every rank has read s.stop_requested, to a 3-rank job of tests/e2e/scripts/
stops_cleanly.py (the docs' pattern with a cheap step). A run passes when every rank saved at
the same step, the launcher exited with 128+signal within 10 s of the signal, the summary says
the ranks ended on their own, and no process of the job is left.

    python benchmarks/stop_signal_stress.py [--runs 100] [--ranks 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ddpkit.common.procs import is_alive, processes_of_job

SCRIPT = Path(__file__).parents[1] / "tests" / "e2e" / "scripts" / "stops_cleanly.py"
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def one_run(ranks: int, sig: int, delay: float, folder: Path) -> tuple[bool, str, float]:
    run_id = "s" + uuid.uuid4().hex[:8]
    cmd = [sys.executable, "-m", "ddpkit", "run", "--run-id", run_id, "--log-dir",
           str(folder / "logs"), "-n", str(ranks), str(SCRIPT), str(folder / "state")]  # fmt: skip
    out = folder / "out.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while "step 20 " not in out.read_text() and time.monotonic() < deadline:
            if proc.poll() is not None:
                return False, "ended before step 20:\n" + out.read_text()[-2000:], 0.0
            time.sleep(0.02)
        time.sleep(delay)
        sent = time.monotonic()
        os.kill(proc.pid, sig)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        took = time.monotonic() - sent
    text = out.read_text()
    left = [p for p in processes_of_job(run_id) if is_alive(p)]
    for p in left:
        p.kill()
    saved = dict(re.findall(r"rank (\d+) saved at step (\d+)", text))
    problems = []
    if sorted(map(int, saved)) != list(range(ranks)):
        problems.append(f"saved: {saved}")
    elif len(set(saved.values())) != 1:
        problems.append(f"saved at different steps: {saved}")
    if code != 128 + sig:
        problems.append(f"exit code {code}")
    if "every rank ended on its own" not in text:
        problems.append("summary does not say every rank ended on its own")
    if took > 10:
        problems.append(f"took {took:.1f} s")
    if left:
        problems.append(f"left running: {[p.pid for p in left]}")
    return not problems, "; ".join(problems) + ("\n" + text[-1500:] if problems else ""), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    plan = random.Random(int(time.time()))
    tally: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    times: list[float] = []
    failures = []
    for run in range(args.runs):
        sig = SIGNALS[run % 3]
        delay = plan.uniform(0.0, 1.5)
        with tempfile.TemporaryDirectory() as folder:
            ok, why, took = one_run(args.ranks, sig, delay, Path(folder))
        name = signal.Signals(sig).name
        tally[name]["pass" if ok else "fail"] += 1
        times.append(took)
        if not ok:
            failures.append(f"run {run} {name} after {delay:.2f} s: {why}")
        print(f"run {run:3d} {name:8s} delay {delay:.2f} s: {'pass' if ok else 'FAIL'} "
              f"({took:.2f} s)", flush=True)  # fmt: skip
    lines = [f"# s.stop_requested under a stop signal at a random moment: {args.runs} runs, "
             f"{args.ranks} ranks, {time.strftime('%Y-%m-%d')}",
             f"{'signal':<8} {'pass':>5} {'fail':>5}"]  # fmt: skip
    for name in ("SIGTERM", "SIGINT", "SIGUSR1"):
        lines.append(f"{name:<8} {tally[name]['pass']:>5} {tally[name]['fail']:>5}")
    times.sort()
    lines.append(f"signal to last process gone: median {times[len(times) // 2]:.2f} s, "
                 f"max {times[-1]:.2f} s")  # fmt: skip
    lines += failures
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

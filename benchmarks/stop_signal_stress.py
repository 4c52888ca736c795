"""A stop signal to `ddpkit run` at a random moment, many times over (issue 27: 100 runs before
the stop flag is called done): SIGTERM, SIGINT and SIGUSR1 in turn, each at a random delay
after every rank has read s.stop_requested, to a 3-rank job of tests/e2e/scripts/
stops_cleanly.py (the docs' pattern with a cheap step). A run passes when every rank saved at
the same step, the launcher exited with 128+signal within 10 s of the signal, the summary says
the ranks ended on their own, and no process of the job is left.

`--again`: the same signal is sent a second time, 10-600 ms after the first (coreutils'
`timeout` passes its SIGTERM to ddpkit and again to ddpkit's process group; a scheduler may
signal a job step and its processes): one request, so every rank must still save. SIGTERM and
SIGUSR1 only (SIGINT again after 0.3 s is a person's second Ctrl+C, which kills at once).

`--around-a-failure`: SIGTERM and SIGINT in turn at a random moment while a rank's failure is
settled and reported (tests/e2e/scripts/runs_out.py: rank 0 runs out of batches and ends, the
others fail waiting for it). A run passes when the launcher exits within 10 s of the signal,
with 128+signal, or 1 where the failure was reported first (or killed by the signal once that
report is whole: it came as the launcher returned), and no process of the job is left.

    python benchmarks/stop_signal_stress.py [--runs 100] [--ranks 3] [--around-a-failure]
        [--max-restarts 1] [--again] [--out FILE]
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

SCRIPTS = Path(__file__).parents[1] / "tests" / "e2e" / "scripts"
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def signal_job(
    script: list[str],
    ranks: int,
    mark: str,
    sig: int,
    delay: float,
    folder: Path,
    launcher: tuple[str, ...] = (),
    again: float | None = None,
) -> tuple[int | None, str, float, list]:
    """`ddpkit run -n RANKS SCRIPT`, signalled `delay` s after its output shows `mark` (at once
    if it ends first): (exit code, None if it never showed the mark; output; seconds from the
    signal to the launcher's end; the job's processes left, killed since)."""
    run_id = "s" + uuid.uuid4().hex[:8]
    cmd = [sys.executable, "-m", "ddpkit", "run", "--run-id", run_id, "--log-dir",
           str(folder / "logs"), "-n", str(ranks), *launcher, *script]  # fmt: skip
    out = folder / "out.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while mark not in out.read_text() and time.monotonic() < deadline:
            if proc.poll() is not None:
                return None, f"ended before {mark!r}:\n" + out.read_text()[-2000:], 0.0, []
            time.sleep(0.01)
        time.sleep(delay)
        sent = time.monotonic()
        if proc.poll() is None:
            os.kill(proc.pid, sig)
        if again is not None:
            time.sleep(again)
            if proc.poll() is None:
                os.kill(proc.pid, sig)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        took = time.monotonic() - sent
    left = [p for p in processes_of_job(run_id) if is_alive(p)]
    for p in left:
        p.kill()
    return code, out.read_text(), took, left


def stopped_run(
    ranks: int,
    sig: int,
    delay: float,
    folder: Path,
    launcher: tuple[str, ...] = (),
    again: float | None = None,
) -> tuple[bool, str, float]:
    """Signalled after every rank read s.stop_requested: every rank saved at the same step."""
    script = [str(SCRIPTS / "stops_cleanly.py"), str(folder / "state")]
    code, text, took, left = signal_job(
        script, ranks, "step 20 ", sig, delay, folder, launcher, again
    )
    if code is None:
        return False, text, took
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


def failure_run(ranks: int, sig: int, delay: float, folder: Path) -> tuple[bool, str, float]:
    """Signalled while rank 0's early end fails the others: stopped or reported, in time."""
    script = [str(SCRIPTS / "runs_out.py"), "0"]
    code, text, took, left = signal_job(script, ranks, "finished its 6 batches", sig, delay, folder)
    if code is None:
        return False, text, took
    problems = []
    # a signal in the launcher's last moment, its report written and its handlers given back,
    # ends it as the signal would end any process: acceptable with the report whole
    reported = "\n  exit code: " in text
    if code not in (1, 128 + sig) and not (code == -sig and reported):
        problems.append(f"exit code {code}")
    if took > 10:
        problems.append(f"took {took:.1f} s")
    if left:
        problems.append(f"left running: {[p.pid for p in left]}")
    return not problems, "; ".join(problems) + ("\n" + text[-1500:] if problems else ""), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--around-a-failure", action="store_true")
    parser.add_argument("--again", action="store_true", help="the same signal twice")
    parser.add_argument("--out", type=Path, default=None)
    spares = "passed to ddpkit run: with 1 the job has warm spares (made at its first step)"
    parser.add_argument("--max-restarts", type=int, default=0, help=spares)
    args = parser.parse_args()
    signals = SIGNALS[:2] if args.around_a_failure else SIGNALS
    if args.again:
        signals = (signal.SIGTERM, signal.SIGUSR1)
    plan = random.Random(int(time.time()))
    tally: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    times: list[float] = []
    failures = []
    for run in range(args.runs):
        sig = signals[run % len(signals)]
        delay = plan.uniform(0.0, 1.5)
        with tempfile.TemporaryDirectory() as folder:
            if args.around_a_failure:
                ok, why, took = failure_run(args.ranks, sig, delay, Path(folder))
            else:
                launcher = ("--max-restarts", str(args.max_restarts))
                again = plan.uniform(0.01, 0.6) if args.again else None
                ok, why, took = stopped_run(args.ranks, sig, delay, Path(folder), launcher, again)
        name = signal.Signals(sig).name
        tally[name]["pass" if ok else "fail"] += 1
        times.append(took)
        if not ok:
            failures.append(f"run {run} {name} after {delay:.2f} s: {why}")
        print(f"run {run:3d} {name:8s} delay {delay:.2f} s: {'pass' if ok else 'FAIL'} "
              f"({took:.2f} s)", flush=True)  # fmt: skip
    what = "a rank's failure" if args.around_a_failure else "s.stop_requested"
    if args.again:
        what += " (each signal sent twice, 10-600 ms apart)"
    lines = [f"# {what} under a stop signal at a random moment: {args.runs} runs, "
             f"{args.ranks} ranks, {time.strftime('%Y-%m-%d')}",
             f"{'signal':<8} {'pass':>5} {'fail':>5}"]  # fmt: skip
    for name in (signal.Signals(sig).name for sig in signals):
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

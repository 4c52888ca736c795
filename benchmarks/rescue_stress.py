"""A rank SIGKILLed at a random moment of training, many times over (issue 38: every run either
resumes bit-identical with no step lost, or from the last regular save with its reason). The
job: tests/e2e/scripts/snapshot_trainer.py (the ddp-tutorial trainer), 3 gloo ranks, 2 epochs
of 20 steps, a save every 10 steps, `--max-restarts 1`; a random rank is killed a random
moment into training (0.05 s to 0.8 s + 40 steps' --sleep: inside a forward, a backward's
all-reduce, an optimizer step, the loss's all-reduce, a save, the loader or the pause between
steps; the restart takes the warm spares, ready or still importing). Each run draws its
DataLoader workers from --workers (with workers, the killed rank's forked workers hold its
connections: the ranks left never hear of it until the launcher asks them to write).

A run passes when the restarted job ends 0, every step's global loss (its last value in the
run's history) equals the never-failed run's bit for bit, nothing is left running, and it
resumed either from the state of the last step every rank completed, no step trained twice
(`rescued`), or from a regular save, the rank's log saying why nothing newer was kept
(`regular`: the steps since that save are trained again). Every step draws from every random
stream (--augment), so a rank whose streams were not restored shows.

    python benchmarks/rescue_stress.py [--runs 50] [--seed 0] [--sleep 0.01] [--workers 0,2]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ddpkit.common.procs import is_alive, processes_of_job

SCRIPT = Path(__file__).parents[1] / "tests" / "e2e" / "scripts" / "snapshot_trainer.py"
STEP = re.compile(r"\] step (\d+) loss (\S+)")
RESUMED = re.compile(r"Resuming training from snapshot at Epoch \d step (\d+)")
DONE_FIRST = re.compile(r"rank \d+ attempt 0 epoch \d step (\d+) samples")  # after all-reduce


def job(folder: Path, name: str, sleep: float, *extra: str) -> tuple[int, str, str, str]:
    run_id = "r" + uuid.uuid4().hex[:8]
    cmd = [sys.executable, "-m", "ddpkit", "run", "--run-id", run_id, "--log-dir",
           str(folder / "logs"), "-n", "3", "--max-restarts", "1", str(SCRIPT), "2", "1",
           "--batch_size", "4", "--snapshot_path", str(folder / name), "--save_steps", "10",
           "--sleep", str(sleep), "--augment", *extra]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in processes_of_job(run_id) if is_alive(p)]:
        time.sleep(0.1)
    left = [p for p in processes_of_job(run_id) if is_alive(p)]
    for p in left:
        p.kill()
    logs = "".join(f.read_text() for f in (folder / "logs" / run_id).glob("rank*.log"))
    return done.returncode, done.stdout, done.stderr + ("LEFT RUNNING" if left else ""), logs


def losses(text: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for step, loss in STEP.findall(text):
        found.setdefault(int(step), []).append(loss)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sleep", type=float, default=0.01, help="seconds per step: 0.1 lets "
                        "the warm spares finish their imports before most kills")  # fmt: skip
    parser.add_argument("--workers", default="0,2", help="DataLoader workers, one drawn a run")
    args = parser.parse_args()
    choices = [int(w) for w in args.workers.split(",")]
    rng = random.Random(args.seed)
    counts: collections.Counter[str] = collections.Counter()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        code, out, err, _ = job(Path(tmp), "never", args.sleep)
        assert code == 0, err
        expected = {step: [loss] for step, [loss] in losses(out).items()}
        assert sorted(expected) == list(range(1, 41)), sorted(expected)
    for n in range(args.runs):
        rank, moment = rng.randrange(3), round(rng.uniform(0.05, 0.8 + 40 * args.sleep), 3)
        workers = rng.choice(choices)
        with tempfile.TemporaryDirectory() as tmp:
            began = time.monotonic()
            code, out, err, logs = job(Path(tmp), "state", args.sleep, "--fail_rank", str(rank),
                                       "--kill_after", str(moment), "-j", str(workers))  # fmt: skip
            seconds = time.monotonic() - began
        got = losses(out)
        resumed = RESUMED.search(out)
        what = f"rank {rank} killed at {moment:.3f} s (-j {workers})"
        if "restarting the whole group" not in err or (resumed and resumed[1] == "40"):
            kind, detail = "no failure", "the kill came after the last step"
        elif code != 0 or "LEFT RUNNING" in err:
            kind, detail = "FAILED", f"exit {code}\n{err[-3000:]}"
        elif {step: v[-1:] for step, v in got.items()} != expected:  # the run's history
            wrong = sorted(k for k in expected if got.get(k, [None])[-1:] != expected[k])
            kind, detail = "FAILED", f"losses differ from the never-failed run's at {wrong}"
        elif "wrote the state of the last completed step" in err and resumed is not None:
            done = max(int(k) for k in DONE_FIRST.findall(out))
            twice = sorted(k for k, v in got.items() if len(v) > 1)
            said = re.search(r"resumed after step (\d+) in ([\d.]+) s, 0 steps lost", err)
            kind = "FAILED" if twice or not said else "rescued"
            detail = f"resumed at step {resumed[1]}, {done - int(resumed[1])} step(s) lost"
            detail += f", restarted in {said[2]} s" if said else "; NO RECOVERY LINE"
            detail += f"; steps trained twice: {twice}" if twice else ""
        else:
            why = re.search(r"ddpkit: (no state of the last step[^\n]*|the state saved or "
                            r"loaded last is the last completed step[^\n]*)", logs)  # fmt: skip
            kind = "regular"
            at = f"resumed at step {resumed[1]}" if resumed else "started over (no state yet)"
            detail = f"{at}: {why[1] if why else 'no rank kept one'}"
        counts[kind] += 1
        line = f"run {n + 1:3d}: {kind:10s} {seconds:5.1f} s  {what}; {detail}"
        print(line, flush=True)
        lines.append(line)
    summary = f"{args.runs} runs: " + "  ".join(
        f"{k}: {counts[k]}" for k in ("rescued", "regular", "no failure", "FAILED")
    )
    print(summary)
    if args.out:
        args.out.write_text("\n".join([*lines, summary]) + "\n")
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

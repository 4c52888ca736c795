"""How fast a chatty rank can print through its launcher: each rank prints LINES lines of 100
bytes and times itself; the rate per rank (MB/s) is compared, in the same run, for

  * direct:   the same N processes writing straight to a file each (no launcher),
  * ddpkit:   `ddpkit run -n N` with its console sent to a file,
  * torchrun: `torchrun --nproc-per-node N` with its console sent to a file.

Goal (issue 14): ddpkit gives each rank at least half the direct rate, at 2 and 8 ranks.
Each rank starts printing 2 s after it starts, once the launchers have finished starting.
Run: python benchmarks/output_throughput.py [--lines 200000] [--ranks 2,8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PRINTER = """import os, sys, time
time.sleep(2)  # steady state: the launchers have finished starting (ddpkit imports torch)
lines, out = int(sys.argv[1]), sys.argv[2]
rank = os.environ.get("RANK", sys.argv[3] if len(sys.argv) > 3 else "0")
line = "x" * 99
began = time.perf_counter()
for _ in range(lines):
    print(line)
sys.stdout.flush()
took = time.perf_counter() - began
with open(os.path.join(out, f"rate-{rank}"), "w") as f:
    f.write(str(lines * 100 / took / 1e6))
"""


def rates(folder: Path) -> list[float]:
    return [float(p.read_text()) for p in folder.glob("rate-*")]


def measure(kind: str, ranks: int, lines: int, work: Path) -> float:
    out = work / f"{kind}-{ranks}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    script = work / "printer.py"
    sink = open(out / "console.txt", "wb")  # noqa: SIM115 - closed below
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # launchers decide
    try:
        if kind == "direct":
            procs = [
                subprocess.Popen(
                    [sys.executable, str(script), str(lines), str(out), str(r)],
                    stdout=open(out / f"direct-{r}.txt", "wb"),  # noqa: SIM115
                    env=env,
                )
                for r in range(ranks)
            ]
            for p in procs:
                p.wait()
        else:
            launcher = (
                [sys.executable, "-m", "ddpkit", "run", "-n", str(ranks), "--hang-timeout", "0"]
                if kind == "ddpkit"
                else ["torchrun", "--nproc-per-node", str(ranks)]
            )
            subprocess.run(
                [*launcher, str(script), str(lines), str(out)],
                stdout=sink,
                stderr=subprocess.DEVNULL,
                env=env,
                check=True,
            )
    finally:
        sink.close()
    found = rates(out)
    assert len(found) == ranks, f"{kind}: {len(found)} of {ranks} ranks reported"
    return statistics.median(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--ranks", default="2,8")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddpkit-output-"))
    (work / "printer.py").write_text(PRINTER)
    print(f"{'ranks':>5} {'kind':<9} {'MB/s per rank (median of runs)':>31} {'of direct':>9}")
    try:
        for ranks in (int(r) for r in args.ranks.split(",")):
            results = {}
            for kind in ("direct", "ddpkit", "torchrun"):
                results[kind] = statistics.median(
                    measure(kind, ranks, args.lines, work) for _ in range(args.repeat)
                )
            for kind, rate in results.items():
                print(f"{ranks:>5} {kind:<9} {rate:>31.1f} {rate / results['direct']:>9.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What `ddpkit.spawn` costs against `torch.multiprocessing.spawn`: PyTorch's DDP tutorial
(tests/e2e/scripts/tutorial/multigpu.py, gloo on the CPU) run whole both ways, alternating,
from `python multigpu.py EPOCHS 1` to its exit; and the same for a function defined at the
prompt (`python -c`, as in a notebook: ddpkit forks the ranks there, mp.spawn's fork method).

    python benchmarks/spawn_vs_mp_spawn.py --runs 5

Prints the medians and their ratios; the last lines are the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "tests" / "e2e" / "scripts" / "tutorial" / "multigpu.py"
PROMPT = """
import os, torch, torch.distributed as dist
def train(rank, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(1)
    for _ in range(20):
        dist.all_reduce(t)
    dist.destroy_process_group()
if __name__ == "__main__":
    LAUNCH
"""
LAUNCHES = {
    "mp.spawn": "import torch.multiprocessing as mp; mp.start_processes(train, args=(2,), "
    "nprocs=2, start_method='fork')",
    "ddpkit.spawn": "import ddpkit; ddpkit.spawn(train, args=(2,), nprocs=2)",
}


def timed(cmd: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "DDPKIT_LOG_DIR": str(cwd / "logs")}
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddpkit-spawn-bench-"))
    source = TUTORIAL.read_text()
    scripts = {
        "mp.spawn": work / "mp_spawn.py",
        "ddpkit.spawn": work / "ddpkit_spawn.py",
    }
    scripts["mp.spawn"].write_text(source)
    scripts["ddpkit.spawn"].write_text(
        source.replace("import torch.multiprocessing as mp\n", "import ddpkit as mp\n")
    )
    times: dict[str, list[float]] = {f"{k} (script)": [] for k in scripts}
    times |= {f"{k} (prompt, fork)": [] for k in LAUNCHES}
    for run in range(args.runs):
        for name, script in scripts.items():
            times[f"{name} (script)"].append(
                timed([sys.executable, str(script), str(args.epochs), "1"], work)
            )
        for name, launch in LAUNCHES.items():
            code = PROMPT.replace("LAUNCH", launch).replace('if __name__ == "__main__":\n    ', "")
            times[f"{name} (prompt, fork)"].append(timed([sys.executable, "-c", code], work))
        print(f"run {run}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
              flush=True)  # fmt: skip
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nspawn against mp.spawn, 2 gloo ranks, {args.runs} alternating runs, medians:")
    for kind in ("script", "prompt, fork"):
        ours, theirs = med[f"ddpkit.spawn ({kind})"], med[f"mp.spawn ({kind})"]
        print(f"  {kind}: ddpkit.spawn {ours:.2f} s, mp.spawn {theirs:.2f} s, "
              f"ratio {ours / theirs:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

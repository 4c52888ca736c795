"""What the hang doctor's flight-recorder polling costs a training step. `ddpkit run` keeps
the flight recorder on (TORCH_FR_BUFFER_SIZE=2000) and, with --hang-timeout set (the default),
polls each NCCL rank every 2 s; the rank answers from a thread. This job measures, after the
ring has filled, each kind of answer's own time (the status poll the watch uses now, and the
full dump with the collectives it used before and the hang report still uses), and the median
and p90 step time with one started at the beginning of the step, interleaved with plain steps.

Run: ddpkit run -n N --hang-timeout 0 benchmarks/flight_dump_cost.py [--model gpt] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
from torch import nn

import ddpkit
from ddpkit.bench.models import resolve
from ddpkit.rank import flight_answers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # as ddpkit run with the hang watch
    with ddpkit.setup(seed=0) as s:
        model_, make_batch = resolve(args.model)()
        model = s.wrap(model_)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = make_batch(args.batch, s.device)
        cuda = s.device.type == "cuda"

        def step() -> None:
            with torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        for _ in range(max(20, 2100 // 10)):  # fill the recorder's ring (~10 entries a step)
            step()
        sync()
        kinds = {"status poll": False, "full dump": True}
        own_ms: dict[str, list[float]] = {k: [] for k in kinds}
        try:
            for _ in range(5):
                for kind, full in kinds.items():
                    began = time.perf_counter()
                    flight_answers.dump(full, s.backend)
                    own_ms[kind].append((time.perf_counter() - began) * 1e3)
        except Exception as err:  # a torch without the recorder
            s.print(f"no flight recorder here: {err}")
            return
        names = ["plain", *kinds]
        times: dict[str, list[float]] = {k: [] for k in names}
        for i in range(args.steps):
            for name in names if i % 2 == 0 else reversed(names):
                sync()
                began = time.perf_counter()
                worker = None
                if name in kinds:
                    worker = threading.Thread(
                        target=flight_answers.dump, args=(kinds[name], s.backend)
                    )
                    worker.start()
                step()
                sync()
                times[name].append((time.perf_counter() - began) * 1e3)
                if worker:
                    worker.join()
        s.print(f"{'answer':<12} {'own ms':>7} {'step median':>12} {'p90':>8} {'per 2 s':>8}")
        plain = s.reduce(statistics.median(times["plain"]), op="max")
        for name in names:
            median = s.reduce(statistics.median(times[name]), op="max")
            p90 = s.reduce(statistics.quantiles(times[name], n=10)[-1], op="max")
            own = s.reduce(statistics.median(own_ms[name]), op="max") if name in kinds else 0.0
            share = (median - plain) / 2000 * 100
            s.print(f"{name:<12} {own:7.2f} {median:12.2f} {p90:8.2f} {share:7.3f}%")


if __name__ == "__main__":
    main()

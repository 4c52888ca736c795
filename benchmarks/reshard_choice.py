"""Which reshard_after_forward s.wrap(shard=True) uses, from measurement: the GPT-2-small shape,
bf16, AdamW, FSDP2 with the three choices (every unit and the root reshard after forward; all
but the last unit; none), each step timed (synchronised, median after warm-up) and its peak
memory read, in one run on the GPUs at hand.

    ddpkit run -n gpu benchmarks/reshard_choice.py      # one GPU: a mesh of one (forced)

Resharding frees each unit's gathered parameters after its forward and gathers them again in
backward: less memory, one more all-gather per unit. The last unit's parameters are needed at
once by backward, so resharding it buys nothing but the gather (torchtitan keeps it).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch import nn

import ddpkit
from ddpkit.bench.models import gpt

CHOICES = {"all": None, "all but the last unit": "last", "none": False}


def shard(model: nn.Module, s, choice) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ddpkit.train.sharding import units

    mesh = init_device_mesh("cuda", (s.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = units(model, True)
    for i, block in enumerate(blocks):
        reshard = choice is None or (choice == "last" and i < len(blocks) - 1)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=choice is not False)
    return model


def main() -> None:
    with ddpkit.setup(seed=0) as s:
        rows = []
        for name, choice in CHOICES.items():
            with torch.device(s.device):
                model, make = gpt()
            model = shard(model, s, choice)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            x, y = make(8, s.device)
            times = []
            torch.cuda.reset_peak_memory_stats()
            for i in range(25):
                torch.cuda.synchronize()
                began = time.perf_counter()
                loss = nn.functional.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
                if i >= 5:
                    times.append(time.perf_counter() - began)
            rows.append(
                (name, statistics.median(times) * 1e3, torch.cuda.max_memory_allocated() / 2**30)
            )
            del model, opt
            gc.collect()
            torch.cuda.empty_cache()
        s.print(f"# reshard_after_forward on {s.world_size} GPU(s), GPT-2-small shape, batch 8")
        s.print(f"{'choice':>24} {'step ms':>9} {'peak GiB':>9}")
        for name, ms, gib in rows:
            s.print(f"{name:>24} {ms:9.2f} {gib:9.2f}")


if __name__ == "__main__":
    main()

"""Memory mistakes in a DDP loop, chosen by argv[1]:

oom RANK    rank RANK asks for more host memory than the machine has (the CPU allocator
            fails: a real "DefaultCPUAllocator: can't allocate memory")
leak        rank 1 keeps 2 MiB every step (as a script that keeps tensors for logging),
            and prints `leaking` once it starts; 20 s later its address space is capped
            just above what it holds (as `ulimit -v` caps a job), so the leak runs it out of
            memory a few steps later
"""

import resource
import sys
import time

import torch
from torch import nn

import ddpkit

mode = sys.argv[1]
with ddpkit.setup(seed=0) as s:
    model = s.wrap(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.Adam(model.parameters())
    data = torch.utils.data.TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    kept = []
    began = 0.0
    for _epoch in range(1000):
        for step, (x, y) in enumerate(s.loader(data, batch_size=32)):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mode == "oom" and step == 3 and s.rank == int(sys.argv[2]):
                torch.empty(2**40, dtype=torch.uint8)  # 1 TiB
            if mode == "leak" and s.rank == 1:
                kept.append(torch.ones(2**19))  # 2 MiB a step
                if len(kept) == 1:
                    print("leaking", flush=True)
                    began = time.monotonic()
                elif began and time.monotonic() - began > 20:
                    began = 0
                    with open("/proc/self/status") as f:
                        mapped = next(int(line.split()[1]) for line in f if "VmSize" in line)
                    limit = (mapped + 64 * 1024) * 1024
                    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
            time.sleep(0.02)

"""A training loop whose GPU stops finishing, the way a deadlocked custom kernel or a wedged GPU
does: at step 3, one rank launches a kernel that spins (torch.cuda._sleep), then syncs on its
loss. argv: MODE RANK [BACKEND]

forever RANK   the kernel never ends (a hang the launcher must name, on rank RANK)
queued RANK    the same, with an all_reduce of the loss queued behind the kernel
seconds:S      a kernel of about S seconds on every rank: long, but it ends (no hang)

Run as a user runs a plain script: `ddpkit run -n N --hang-timeout 20 gpu_hang.py forever 1`;
with BACKEND gloo several ranks share one GPU (the others wait in a CPU all_reduce)."""

import os
import sys
import time

import torch
import torch.distributed as dist

mode, odd = sys.argv[1], int(sys.argv[2])
backend = sys.argv[3] if len(sys.argv) > 3 else "nccl"
rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local % torch.cuda.device_count())
torch.cuda.set_device(device)
dist.init_process_group(backend)

# cycles per second of _sleep on this GPU, measured
torch.cuda._sleep(1000)
torch.cuda.synchronize()
began = time.perf_counter()
torch.cuda._sleep(100_000_000)
torch.cuda.synchronize()
rate = 100_000_000 / (time.perf_counter() - began)

model = torch.nn.Linear(256, 256).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(8):
    loss = model(torch.randn(64, 256, device=device)).pow(2).mean()
    if step == 3 and mode in ("forever", "queued") and rank == odd:
        torch.cuda._sleep(1 << 62)  # never ends in any job's lifetime
        if mode == "queued":
            dist.all_reduce(loss.detach().clone())
    if step == 3 and mode.startswith("seconds:"):
        torch.cuda._sleep(int(float(mode.split(":")[1]) * rate))
    value = loss.item()  # the host waits here for the GPU
    opt.zero_grad()
    loss.backward()
    opt.step()
    shared = torch.tensor([value]) if backend == "gloo" else torch.tensor([value], device=device)
    dist.all_reduce(shared)
    print(f"step {step} loss {value:.4f}", flush=True)
dist.destroy_process_group()

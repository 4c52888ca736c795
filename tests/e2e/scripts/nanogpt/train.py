"""A training script with nanoGPT's habits: globals as config, a configurator exec'd from the
working directory, DDP detected from RANK, per-rank seeds instead of a sampler, gradient sync
only on the last micro-step, master_process printing. Run as nanoGPT's README says:

    torchrun --standalone --nproc_per_node=2 train.py config/train_tiny.py
"""

import os
import time

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# default config values
out_dir = "out"
batch_size = 12
block_size = 64
max_iters = 20
log_interval = 5
gradient_accumulation_steps = 4
learning_rate = 6e-4
backend = "nccl"
device = "cuda"
compile = True
config_keys = [
    k
    for k, v in globals().items()
    if not k.startswith("_") and isinstance(v, int | float | bool | str)
]
exec(open("configurator.py").read())  # overrides from command line or config file
config = {k: globals()[k] for k in config_keys}

ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
torch.manual_seed(1337 + seed_offset)
vocab = 65
data = torch.randint(0, vocab, (4096,), generator=torch.Generator().manual_seed(0))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


model = nn.Sequential(nn.Embedding(vocab, 32), nn.Linear(32, vocab)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
if compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model

X, Y = get_batch()
t0 = time.time()
for iter_num in range(max_iters):
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        logits = model(X)
        loss = nn.functional.cross_entropy(logits.view(-1, vocab), Y.view(-1))
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {(time.time() - t0) * 1000:.2f}ms")
if ddp:
    destroy_process_group()

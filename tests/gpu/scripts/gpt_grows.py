"""nanoGPT's habit under a GPU that is too small: GPT-2-small's shape (fp32, AdamW, untied head),
batches from a get_batch() of its own (no DataLoader), the batch size raised step after step
as a user tuning it does, under a 5.59 GiB cap (torch.cuda.set_per_process_memory_fraction, as
a smaller GPU). Prints `batch N` before each step; the OOM goes on, uncaught, to the launcher.

    ddpkit run -n 1 gpt_grows.py
"""

import torch
import torch.nn.functional as F

from ddpkit.bench.models import gpt

torch.cuda.set_device(0)
total = torch.cuda.mem_get_info()[1]
torch.cuda.set_per_process_memory_fraction(5.59 * 2**30 / total)
model, _ = gpt(seq=256)
model = model.cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)


def get_batch(batch_size):
    idx = torch.randint(0, 50304, (batch_size, 257), device="cuda")
    return idx[:, :-1], idx[:, 1:].reshape(-1)


for batch_size in range(4, 4096, 4):
    print(f"batch {batch_size}", flush=True)
    X, Y = get_batch(batch_size)
    logits = model(X)
    loss = F.cross_entropy(logits, Y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()

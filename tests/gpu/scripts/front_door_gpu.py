"""Two mistakes a one-GPU script brings to the GPU, as users write them. argv[1]:

assert  a language model's batch with a token id one past the embedding's end: CUDA's
        device-side assert, surfaced at `loss.item()`, lines after its cause
leak    an evaluation kept with its graph every step (`val_losses.append(model(x_val).mean())`
        outside torch.no_grad(), never .item()): memory grows until it runs out within a dozen
        steps, under a 3 GiB cap (torch.cuda.set_per_process_memory_fraction, as a smaller GPU)

    ddpkit run -n 1 front_door_gpu.py assert|leak
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

case = sys.argv[1]
torch.cuda.set_device(0)
device = "cuda"
vocab = 1000


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(vocab, 256)
        self.body = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        self.head = nn.Linear(256, vocab)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


model = TinyLM().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
if case == "leak":
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(3 * 2**30 / total)
val_losses = []
for step in range(1000):
    high = vocab + 1 if case == "assert" and step == 3 else vocab  # the tokenizer's extra id
    ids = torch.randint(0, high, (32, 128), device=device)
    ids[0, 0] = high - 1
    targets = torch.randint(0, vocab, (32, 128), device=device)
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if case == "leak":
        x_val = torch.randint(0, vocab, (256, 128), device=device)
        val_losses.append(model(x_val).mean())  # kept with its graph and activations
    print(f"step {step} loss {loss.item():.3f}", flush=True)

"""Two DDP mistakes from the forums, chosen by argv[1]: `unused` (a head built but never used in
the loss: DDP's 'Expected to have finished reduction'), `differs` (rank 1 builds its auxiliary
head with another size: DDP's shape check)."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

case = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()


class Net(nn.Module):
    def __init__(self, aux_width):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.aux = nn.Linear(4, aux_width)

    def forward(self, x):
        out = self.head(self.body(x))
        if case == "unused":
            return out
        return out + self.aux(x).sum(1, keepdim=True)


model = DDP(Net(2 if case == "differs" and rank == 1 else 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()

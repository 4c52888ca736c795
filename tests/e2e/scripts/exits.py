"""Rank 1 ends with sys.exit(argv[1]) after setup() (inside `with` when argv[2] == "with");
rank 0 goes on to a collective, as a real script would."""

import sys

import torch
import torch.distributed as dist

import ddpkit

code, style = int(sys.argv[1]), sys.argv[2]
if style == "with":
    with ddpkit.setup() as s:
        if s.rank == 1:
            sys.exit(code)
        dist.all_reduce(torch.ones(1))
else:
    s = ddpkit.setup()
    if s.rank == 1:
        sys.exit(code)
    dist.all_reduce(torch.ones(1))

"""One rank (argv[1], default 1) stuck in C code that holds the GIL and burns a core: a
catastrophic regex (`(a+)+$` against 'aaa...b' backtracks for ages). The others wait for it in
all_reduce."""

import os
import re
import sys

import torch
import torch.distributed as dist

stuck = int(sys.argv[1]) if len(sys.argv) > 1 else 1
dist.init_process_group("gloo")
print("ready", flush=True)
if int(os.environ["RANK"]) == stuck:
    re.match(r"(a+)+$", "a" * 64 + "b")
dist.all_reduce(torch.ones(1))

"""Rank argv[2] (default 1) dies in native code after init: argv[1] is `segfault` (a read of
address 0 through ctypes, as a buggy extension does), `abort` (a C abort()), or `loader` (a
DataLoader worker raises ValueError in __getitem__). The others wait in all_reduce."""

import ctypes
import os
import sys

import torch
import torch.distributed as dist


class Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            raise ValueError(f"sample {i} is corrupt")
        return torch.ones(2)


def read_null():
    return ctypes.string_at(0)


how = sys.argv[1]
culprit = int(sys.argv[2]) if len(sys.argv) > 2 else 1
dist.init_process_group("gloo")
print("ready", flush=True)
if int(os.environ["RANK"]) == culprit:
    if how == "segfault":
        read_null()
    elif how == "abort":
        os.abort()
    else:
        for _ in torch.utils.data.DataLoader(Broken(), batch_size=2, num_workers=2):
            pass
dist.all_reduce(torch.ones(1))

"""A training loop's shape with no end: a collective each step, then a little host work. A
Ctrl+C finds each rank either inside the all_reduce or between two."""

import time

import torch

import ddpkit

s = ddpkit.setup()
print("training", flush=True)
x = torch.ones(1000)
while True:
    s.reduce(x.sum())
    time.sleep(0.001)

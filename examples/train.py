"""A one-GPU training script made multi-GPU with ddpkit: handwritten digits (real data that
ships with ddpkit, no download), a small MLP, one script for any number of processes.

    python examples/train.py              # one process (CPU or one GPU), never blocks
    ddpkit run -n 2 examples/train.py     # two processes (gloo on CPU when there is no GPU)
    ddpkit run -n gpu examples/train.py   # one process per visible GPU, nccl
"""

import torch
from torch import nn

import ddpkit
from ddpkit.examples.digits import load_digits, split

train_set, test_set = split(*load_digits())  # 1437 training and 360 held-out 8x8 images
loss_fn = nn.CrossEntropyLoss()


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


with ddpkit.setup(seed=0) as s:
    model = s.wrap(build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = s.loader(train_set, batch_size=32, shuffle=True)
    for epoch in range(10):
        for x, y in s.progress(loader, desc=f"epoch {epoch}"):
            loss = loss_fn(model(x.to(s.device)), y.to(s.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        s.print(f"epoch {epoch}: loss {s.reduce(loss.item()):.4f}")
        s.save(ddpkit.unwrap(model).state_dict(), "ckpt.pt")

    test = s.loader(test_set, batch_size=256, eval=True, to_device=True)
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in test)
    accuracy = s.reduce(correct, op="sum") / len(test_set)
    s.print(f"held-out accuracy: {accuracy:.3f}")

"""Graphed against eager on this job's GPUs (1 or more): the same model from the same seed,
the same batches; prints `case NAME eager=[...] graphed=[...]` with every step's loss as
exact floats, for the GPU tests to compare. Cases: plain AdamW, a StepLR schedule, bf16
autocast with clipping, gradient accumulation inside one graphed step, SGD fused."""

import contextlib
import hashlib
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch import nn

import ddpkit

STEPS = 20
torch.use_deterministic_algorithms(True)


def build(s, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)
    )
    return s.wrap(model)


def batches(s, n, micro=1):
    g = torch.Generator(device="cpu").manual_seed(100 + s.rank)
    out = []
    for _ in range(n):
        x = torch.randn(micro, 32, 256, generator=g).to(s.device)
        y = torch.randint(0, 10, (micro, 32), generator=g).to(s.device)
        out.append((x.squeeze(0), y.squeeze(0)) if micro == 1 else (x, y))
    return out


def run(s, case, graphed):
    model = build(s)
    # the same optimizer for both runs: state and learning rate on the GPU, as graphs need
    if case == "sgd_fused":
        lr = torch.tensor(0.05, device=s.device)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, fused=True)
    else:
        lr = torch.tensor(1e-3, device=s.device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=True, foreach=True)
    sched = (
        torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.3)
        if case in ("step_lr", "sgd_fused")
        else None
    )
    micro = 4 if case == "accumulate" else 1
    data = batches(s, STEPS, micro)

    def step(x, y):
        if case == "accumulate":  # 4 micro-batches, all-reduce on the last only
            total = 0
            for i in range(micro):
                sync = i == micro - 1
                quiet = not sync and hasattr(model, "no_sync")
                ctx = model.no_sync() if quiet else contextlib.nullcontext()
                with ctx:
                    loss = nn.functional.cross_entropy(model(x[i]), y[i]) / micro
                    loss.backward()
                total = total + loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return total
        with s.autocast() if case == "bf16_clip" else contextlib.nullcontext():
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if case == "bf16_clip":
            s.clip(model, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=case != "sgd_fused")
        return loss.detach()

    losses = []
    call = s.graph(step, *data[0], model=model, optimizer=opt) if graphed else step
    for x, y in data:
        losses.append(float(call(x, y)))
        if sched is not None:
            sched.step()
    weights = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    return losses, hashlib.sha256(weights.cpu().numpy().tobytes()).hexdigest()[:16]


with ddpkit.setup(graphs=True, precision="bf16") as s:
    for case in sys.argv[1:] or ["plain", "step_lr", "bf16_clip", "accumulate", "sgd_fused"]:
        eager, eager_w = run(s, case, graphed=False)
        again, again_w = run(s, case, graphed=False)
        graphed, graphed_w = run(s, case, graphed=True)
        print(f"case {case} rank {s.rank} eager={eager!r} graphed={graphed!r}", flush=True)
        print(
            f"weights {case} rank {s.rank} eager={eager_w} again={again_w} graphed={graphed_w} "
            f"eager_repeats={eager == again}",
            flush=True,
        )

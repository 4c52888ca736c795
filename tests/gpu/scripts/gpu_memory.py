"""Memory on one GPU, for tests/gpu/test_memory_gpu.py, by argv[1]:

oom         a real CUDA out-of-memory at the second step: a model of 4 x Linear(2048, 2048)
            with AdamW takes one step on a batch of 16384; the process is then capped
            (torch.cuda.set_per_process_memory_fraction, as if the GPU were that small) halfway
            between that step's peak and that peak plus Adam's state, which the next step also
            holds. As it fails, torch's own figures are printed (`stats allocated=N reserved=N
            params=N grads=N optimizer=N`) and the error goes on, uncaught, to the launcher.
leak        an evaluation outside torch.no_grad() kept every step (its graph and activations,
            about 4 MiB, stay alive), capped 1.5 GiB above the first step's peak: GPU memory
            grows until the allocator fails, about 40 s later (prints `leaking` once it starts)
fit STATE [--micro N] [--steps N]
            the same model through s.fit, capped at CAP_MIB from the start, batches of 16384:
            a micro-batch of 16384 needs about 1.4 GiB and does not fit, 8192 needs about
            0.9 GiB and does. Prints `loss step S = <exact value>` every step.
"""

import argparse

import torch
from torch import nn

import ddpkit

CAP_MIB = 1100
WIDTH = 2048

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["oom", "fit", "leak"])
parser.add_argument("state", nargs="?")
parser.add_argument("--micro", type=int, default=None)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=16384)
args = parser.parse_args()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Vectors(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, WIDTH, generator=g)
        self.y = torch.randint(0, WIDTH, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


with ddpkit.setup(seed=0) as s:
    total = torch.cuda.mem_get_info()[1]
    if args.mode == "fit":
        torch.cuda.set_per_process_memory_fraction(CAP_MIB * 2**20 / total)
    layers = [m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    model = s.wrap(nn.Sequential(*layers[:-1]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = s.loader(Vectors(4 * args.batch), batch_size=args.batch, to_device=True)
    if args.mode == "leak":
        import time

        kept = []
        probe = torch.randn(128, WIDTH, device=s.device)
        for step in range(100_000):
            x, y = probe, torch.zeros(128, dtype=torch.long, device=s.device)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            kept.append(model(probe))  # "evaluation", outside no_grad, kept for logging
            if step == 0:
                cap = torch.cuda.max_memory_allocated() + 3 * 2**29
                torch.cuda.set_per_process_memory_fraction(cap / total)
                print("leaking", flush=True)
            time.sleep(0.1)
    if args.mode == "oom":
        for step, (x, y) in enumerate(loader):
            opt.zero_grad(set_to_none=True)
            try:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
            except torch.OutOfMemoryError:
                params = list(model.parameters())
                grads = [p.grad for p in params if p.grad is not None]
                state = [v for per in opt.state.values() for v in per.values()]
                stats = torch.cuda.memory_stats()
                print(
                    f"stats allocated={stats['allocated_bytes.all.current']} "
                    f"reserved={stats['reserved_bytes.all.current']} params={nbytes(params)} "
                    f"grads={nbytes(grads)} optimizer={nbytes(state)} step={step}",
                    flush=True,
                )
                raise
            opt.step()
            print(f"step {step} fits", flush=True)
            if step == 0:
                adam = nbytes(v for per in opt.state.values() for v in per.values())
                cap = torch.cuda.max_memory_allocated() + adam // 2
                torch.cuda.set_per_process_memory_fraction(cap / total)
                print(f"capped at {cap}", flush=True)
        raise SystemExit("every step fitted: the cap is too large for this test")
    fit = s.fit(model, opt, micro_batch=args.micro)
    progress = {"step": 0}
    s.load_state(args.state, model=model, optimizer=opt, fit=fit, loader=loader, progress=progress)
    while progress["step"] < args.steps:
        for x, y in loader:
            loss = fit.step(lambda x, y: nn.functional.cross_entropy(model(x), y), x, y)
            progress["step"] += 1
            print(f"loss step {progress['step']} = {loss.item()!r}", flush=True)
            if progress["step"] >= args.steps:
                break
    print(f"micro-batch {fit.micro}", flush=True)

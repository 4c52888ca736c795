"""Sharding (FSDP2) on NCCL with the GPUs at hand. With one GPU `s.wrap(shard=True)` returns the
model itself (nothing to shard), so FSDP2 runs on a mesh of that one GPU, forced through
ddpkit.train.sharding: its all-gathers and reduce-scatters go through NCCL, its checkpoints through
torch.distributed.checkpoint; with two or more GPUs every rank holds 1/N. Each case is checked
against the plain model, never against itself."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

SCRIPT = """import sys, torch
from torch import nn
import ddpkit
from ddpkit.train import sharding

def model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(4)],
                         nn.Linear(512, 10))

def train(m, s, steps=30):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator(device=s.device).manual_seed(s.rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 512, device=s.device, generator=g)
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(s.reduce(loss.item()))
    return losses, opt

with ddpkit.setup(seed=0, precision="fp32") as s:
    plain, _ = train(s.wrap(model()), s)
    if s.world_size == 1:  # force FSDP2 on a mesh of this one GPU
        sharded_model = sharding.shard(model().to(s.device), True, s.place, "fp32")
    else:
        sharded_model = s.wrap(model(), shard=True)
    assert sharding.is_sharded(sharded_model)
    sharded, opt = train(sharded_model, s)
    s.save_state(sys.argv[1], model=sharded_model, optimizer=opt)
    fresh = sharding.shard(model().to(s.device), True, s.place, "fp32")
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert s.load_state(sys.argv[1], model=fresh, optimizer=opt2, rng=False)
    a, b = s.full_state_dict(sharded_model), s.full_state_dict(fresh)
    same = all(torch.equal(a[k], b[k]) for k in a)
    held = sum(p.to_local().numel() for p in sharded_model.parameters())
    whole = sum(p.numel() for p in model().parameters())
    gap = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(sharded, plain))
    s.print(f"RESULT world={s.world_size} max_rel_gap={gap:.3g} restored={same} "
            f"held={held} whole={whole}", flush=True)
"""


def test_fsdp2_on_nccl_trains_as_the_plain_model_and_its_state_round_trips(tmp_path):
    (tmp_path / "shard.py").write_text(SCRIPT)
    job = start(["-n", str(GPUS), str(tmp_path / "shard.py"), str(tmp_path / "state")], tmp_path)
    assert job.finish(240) == 0, job.stderr[-3000:]
    line = next(x for x in job.stdout.splitlines() if "RESULT" in x)
    print(line)
    fields = dict(kv.split("=") for kv in line.split("RESULT ")[1].split())
    assert float(fields["max_rel_gap"]) < 1e-4, "sharded losses follow the plain model's"
    assert fields["restored"] == "True"
    held, whole = int(fields["held"]), int(fields["whole"])
    assert held <= -(-whole // GPUS) + 4 * 512, f"each rank holds 1/{GPUS} (up to a row each)"
    assert list((tmp_path / "state").glob("state-*/sharded/*.distcp"))
    assert not job.survivors()

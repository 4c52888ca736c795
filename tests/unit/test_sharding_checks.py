"""What `s.wrap(shard=...)` decides before anything is sharded: which modules become units, and
the torch it needs (a ConfigError naming the version and the fix)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.train import sharding


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # repeated, but inside

    def forward(self, x):
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # mixed classes


def test_repeated_blocks_are_the_units_and_never_one_inside_another():
    net = Net()
    assert sharding.units(net, True) == list(net.layers)


def test_units_can_be_named_by_class_or_picked_by_a_callable():
    net = Net()
    assert sharding.units(net, [nn.Embedding]) == [net.embed]
    assert sharding.units(net, lambda m: m is net.head) == [net.head]
    with pytest.raises(ConfigError, match="not True, a list of module classes or a callable"):
        sharding.units(net, ["Block"])


@pytest.mark.parametrize(
    ("version", "backend", "says"),
    [
        ("2.4.0+cu121", "nccl", "needs torch 2.6 or newer on nccl"),
        ("2.9.1", "gloo", "needs torch 2.11 or newer on gloo"),
    ],
)
def test_an_older_torch_is_a_config_error_naming_the_version_and_the_fix(
    monkeypatch, version, backend, says
):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(ConfigError, match=says) as err:
        sharding.check_torch(backend)
    assert version in str(err.value)
    assert "pip install" in err.value.fix


def test_on_this_torch_shard_true_at_world_size_1_is_the_model_itself_or_a_clear_error():
    with ddpkit.setup() as s:
        model = nn.Linear(2, 2)
        if sharding.torch_version() < sharding.NEEDS_ON_GLOO:
            with pytest.raises(ConfigError, match="needs torch"):
                s.wrap(model, shard=True)
        else:
            assert s.wrap(model, shard=True) is model
        with pytest.raises(ConfigError, match="takes no DDP options"):
            s.wrap(model, shard=True, bucket_cap_mb=10)


def test_bench_says_a_sharded_step_is_bound_by_the_host_only_when_that_is_why_it_is_slow():
    from ddpkit.bench.shard import host_bound

    ddp = {"step_ms": 36.4, "host_ms": 28.0}
    # measured on one H200 at batch 8: FSDP2's hooks take 91 of its 99 ms
    note = host_bound(1, ddp, {"step_ms": 98.9, "host_ms": 91.3})
    assert "host takes 91.3 ms to issue a sharded step of 98.9 ms" in note
    assert "--batch" in note
    assert host_bound(1, ddp, {"step_ms": 40.0, "host_ms": 39.0}) == "", "within the goal"
    assert host_bound(1, ddp, {"step_ms": 98.9, "host_ms": 20.0}) == "", "the GPU sets the pace"
    assert host_bound(1, ddp, None) == "", "did not fit"

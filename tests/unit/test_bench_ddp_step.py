"""The timed training step of `ddpkit bench ddp`."""

import torch
from torch import nn

from ddpkit.bench.ddp_worker import _Trainer


def test_a_step_without_gradient_sync_still_runs_the_optimizer():
    # exposed communication = step with sync - step without: both must do the same other work
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    trainer = _Trainer(model, torch.device("cpu"), "fp32")
    trainer.step(torch.randn(8, 4), torch.randint(0, 3, (8,)), sync=False)
    assert not torch.equal(model.weight, before)
    assert model.weight.grad is None

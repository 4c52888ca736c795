"""The rank's runtime (ddpkit.rank.runtime): the environment read once, every part's state in
one object, one optimizer-step hub that the step count, the rescue, the stop flag and the step
timing subscribe to, and a reset that leaves nothing registered with torch."""

from __future__ import annotations

import multiprocessing
import os

import pytest

torch = pytest.importorskip("torch")
import torch.optim.optimizer as optimizer_module  # noqa: E402

from ddpkit.common import protocol  # noqa: E402
from ddpkit.rank import runtime  # noqa: E402
from ddpkit.train import rescue, step_count  # noqa: E402
from ddpkit.train.placement import Placement  # noqa: E402


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def torch_hooks() -> int:
    """How many global optimizer hooks torch holds, before and after steps."""
    return len(optimizer_module._global_optimizer_pre_hooks) + len(
        optimizer_module._global_optimizer_post_hooks
    )


@pytest.fixture
def a_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.STATE_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(protocol.RANK_PID, str(os.getpid()))
    return runtime.reset()


def test_the_environment_is_read_once_into_the_runtime(a_rank, monkeypatch):
    assert a_rank.is_rank()
    assert a_rank.path(protocol.PROGRESS) == protocol.state_path(
        a_rank.state_dir, "1", protocol.PROGRESS
    )
    monkeypatch.setenv("RANK", "7")
    assert runtime.current().rank == "1", "read at start, not at each use"


def _is_rank_in_child(queue) -> None:
    queue.put(runtime.current().is_rank())


def test_a_child_forked_from_the_rank_is_not_the_rank(a_rank):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_is_rank_in_child, args=(queue,))
    child.start()
    said = queue.get(timeout=30)
    child.join(30)
    assert said is False


def test_every_part_that_follows_steps_shares_one_pair_of_torch_hooks(a_rank):
    before = torch_hooks()
    step_count.install()
    rescue.remember(a_rank.state_dir + "/ckpt", {"n": {}}, Placement(rank=0, world_size=2))
    a_rank.steps.after(lambda optimizer: None)
    assert torch_hooks() == before + 2
    runtime.reset()
    assert torch_hooks() == before, "a reset leaves nothing registered with torch"


def test_the_first_optimizer_that_steps_is_the_jobs_for_every_part(a_rank):
    step_count.install()
    seen = []
    a_rank.steps.after(lambda o: seen.append(a_rank.steps.counts(o)))
    gen, disc = optimizer(), optimizer()
    for _ in range(2):
        gen.step()
        disc.step()
    assert seen == [True, False, True, False]
    assert step_count.done() == 2


def test_forgetting_the_rescue_takes_its_hooks_off_the_hub(a_rank):
    hub = a_rank.steps
    rescue.remember(a_rank.state_dir + "/ckpt", {"n": {}}, Placement(rank=0, world_size=2))
    assert len(hub._before) == 1
    assert len(hub._after) == 1
    rescue.forget()
    assert not hub._before
    assert not hub._after

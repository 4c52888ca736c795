"""The job's step count across restarts (ddpkit.train.step_count): one optimizer's steps
counted, on from the loaded state's, and kept in the rank's mapped record for the launcher."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from ddpkit.common import protocol  # noqa: E402
from ddpkit.rank import runtime  # noqa: E402
from ddpkit.train import step_count  # noqa: E402
from tests.unit.snapshots import look, worker  # noqa: E402


@pytest.fixture
def counting(tmp_path, monkeypatch):
    """A fresh count in a process that is a rank of ddpkit run (its record in tmp_path)."""
    monkeypatch.setenv(protocol.STATE_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv(protocol.RANK_PID, str(os.getpid()))
    runtime.reset()  # the environment read again, as a new rank reads it
    step_count.install()
    return tmp_path


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_the_first_optimizer_that_steps_marks_the_steps(counting):
    gen, disc = optimizer(), optimizer()
    for _ in range(3):
        gen.step()
        disc.step()
    assert step_count.done() == 3


def test_the_count_goes_on_from_the_loaded_states(counting):
    opt = optimizer()
    opt.step()
    step_count.resumed_at(14, rescued=True)
    opt.step()
    assert step_count.done() == 15


def counted(state):
    """Rank 2's count as the launcher's snapshot reads it."""
    return look(state, [worker(2)]).of(2).count


def test_the_launcher_reads_the_count_and_the_first_steps_end(counting):
    opt = optimizer()
    step_count.resumed_at(14, rescued=True)
    assert counted(counting).done == 0
    opt.step()
    opt.step()
    record = counted(counting)
    assert (record.base, record.done, record.loaded, record.rescued) == (14, 2, True, True)
    assert record.first_end > 0

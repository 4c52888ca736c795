"""s.loader's seeding: once per batch, for torch's, numpy's and Python's generators; the
training loop's own generators put back exactly; ddpkit's own time counted as the host's,
never as the user's data time."""

from __future__ import annotations

import random

import numpy as np
import torch

import ddpkit
from ddpkit.common import protocol
from ddpkit.rank import steps


class ThreeGenerators(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([torch.rand(()).item(), np.random.rand(), random.random()])


def test_every_generator_is_seeded_per_batch_whatever_the_workers():
    with ddpkit.setup(seed=7) as s:
        alone = [b.tolist() for b in s.loader(ThreeGenerators(), batch_size=4)]
        workers = [b.tolist() for b in s.loader(ThreeGenerators(), batch_size=4, num_workers=2)]
        again = [b.tolist() for b in s.loader(ThreeGenerators(), batch_size=4)]
    assert alone == workers == again
    rows = [row for batch in alone for row in batch]
    assert len({tuple(r) for r in rows}) == len(rows), "every sample draws anew"


def test_the_loops_own_generators_are_put_back_exactly():
    with ddpkit.setup(seed=1) as s:
        random.gauss(0, 1)  # leaves a cached second value in Python's generator
        torch_state, python_state, numpy_state = (
            torch.get_rng_state(),
            random.getstate(),
            np.random.get_state(),
        )
        for _ in s.loader(ThreeGenerators(), batch_size=5):
            pass
        assert torch.equal(torch_state, torch.get_rng_state())
        assert random.getstate() == python_state
        after = np.random.get_state()
        assert np.array_equal(after[1], numpy_state[1])
        assert after[2] == numpy_state[2]


def test_ddpkits_seeding_time_is_the_hosts_not_the_users_data(tmp_path):
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.1)
    record = tmp_path / "steps"
    remove = steps.timed_here(record)
    try:
        with ddpkit.setup(seed=0) as s:
            for seeded in (False, True):
                for batch in s.loader(ThreeGenerators(), batch_size=4, seeded=seeded):
                    param.grad = batch.sum(0)
                    opt.step()
    finally:
        remove()
    timed = _read(record)  # 12 optimizer steps: 11 timed (the first only starts the clock)
    plain, seeded = timed[:5], timed[5:]  # the 6th ends at the first seeded batch
    assert all(step.host == 0.0 for step in plain), "nothing of ddpkit's to count"
    assert all(step.host > 0.0 for step in seeded), "seeding time counted as the host's"
    assert all(step.data >= 0.0 for step in timed)


def _read(path):
    folder = path.parent
    link = protocol.state_path(folder, "r", protocol.STEPS)
    link.write_bytes(path.read_bytes())
    return protocol.read_steps(folder, "r").steps

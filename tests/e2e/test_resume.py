"""A saved state at another world size: the replicated part (model, optimizer) loads, the
per-rank part (RNG, loader position) says why it cannot. Exactness of stop and resume at 1 to
4 ranks: test_resume_sizes.py."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import SCRIPTS, start

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(SCRIPTS / "resumable.py")


def test_a_state_written_by_other_world_size_loads_the_model_but_not_the_ranks_part(tmp_path):
    from pathlib import Path

    import torch

    import ddpkit
    from ddpkit.errors import CheckpointError

    state = tmp_path / "state"
    job = start(["-n", "2", SCRIPT, str(state), "--epochs", "1", "--save-every", "8"], tmp_path)
    assert job.finish(120) == 0
    with ddpkit.setup() as s:  # one process now
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2)
        )
        with pytest.raises(CheckpointError, match="saved by 2 ranks and this job has 1"):
            s.load_state(state, model=model)
        assert s.load_state(state, model=model, rng=False)
        assert s.load_state(Path(tmp_path / "nothing"), model=model) is False

"""A state saved by 2 ranks loads into one plain process: the model as it was, each rank's
random streams re-seeded with a notice (no error); the loader's place follows
(tests/groups/test_resize.py, test_resume_resized.py). Exactness of stop and resume at 1 to 4
ranks: test_resume_sizes.py."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import SCRIPTS, start

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(SCRIPTS / "resumable.py")


def test_a_state_written_by_2_ranks_loads_into_one_process_and_says_what_was_re_seeded(
    tmp_path, capfd
):
    from pathlib import Path

    import torch

    import ddpkit

    state = tmp_path / "state"
    job = start(["-n", "2", SCRIPT, str(state), "--epochs", "1", "--save-every", "8"], tmp_path)
    assert job.finish(120) == 0
    with ddpkit.setup() as s:  # one process now
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2)
        )
        assert s.load_state(state, model=model)
        said = capfd.readouterr().err
        assert "was saved by 2 ranks; this job has 1" in said
        assert "re-seeds them from (seed" in said
        assert s.load_state(state, model=model, rng=False)
        assert "re-seeds" not in capfd.readouterr().err
        assert s.load_state(Path(tmp_path / "nothing"), model=model) is False

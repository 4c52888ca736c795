"""s.graph on GPUs: graphed steps give the eager run's losses bit for bit (deterministic
kernels, no random numbers in the step), on 1 GPU and on every visible GPU with NCCL; a
schedule's learning-rate changes reach the graph; the boundaries are clear errors; a stall in
a replay is named by the hang watch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.e2e.helpers import start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SCRIPT = str(Path(__file__).parent / "scripts" / "graphed.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CASES = ["plain", "step_lr", "bf16_clip", "accumulate", "sgd_fused"]


def run_cases(tmp_path, n: int) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    job = start(["-n", str(n), SCRIPT, *CASES], tmp_path)
    assert job.finish(300) == 0, job.stdout + job.stderr
    found = {}
    for case, rank, eager, graphed in re.findall(
        r"case (\w+) rank (\d+) eager=(\[.*?\]) graphed=(\[.*?\])", job.stdout
    ):
        found[(case, int(rank))] = (ast.literal_eval(eager), ast.literal_eval(graphed))
    return found


@pytest.mark.parametrize("n", sorted({1, GPUS}))
def test_graphed_losses_equal_eager_losses_bit_for_bit(tmp_path, n):
    found = run_cases(tmp_path, n)
    assert sorted(found) == sorted((c, r) for c in CASES for r in range(n))
    for (case, rank), (eager, graphed) in found.items():
        assert len(eager) == 20
        assert graphed == eager, f"{case} rank {rank}"


def test_a_changed_shape_after_capture_is_a_clear_error():
    import ddpkit
    from ddpkit.errors import ConfigError

    with ddpkit.setup() as s:
        model = s.wrap(torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), capturable=True)

        def step(x):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        graphed = s.graph(step, torch.ones(4, 8, device=s.device), model=model, optimizer=opt)
        graphed(torch.ones(4, 8, device=s.device))
        with pytest.raises(ConfigError, match=r"shape \[3, 8\].*after capture with \[4, 8\]"):
            graphed(torch.ones(3, 8, device=s.device))
        with pytest.raises(ConfigError, match="keeps its step counters on the host"):
            s.graph(step, torch.ones(4, 8, device=s.device),
                    optimizer=torch.optim.AdamW(model.parameters()))  # fmt: skip

        def syncs(x):
            return float(model(x).sum())  # .item(): cannot be captured

        with pytest.raises(ConfigError, match="could not be captured"):
            s.graph(syncs, torch.ones(4, 8, device=s.device), warmup=1)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_a_stall_inside_a_replay_is_caught_and_named(tmp_path):
    source = Path(__file__).parent / "scripts" / "graph_stall.py"
    line = next(i for i, t in enumerate(source.read_text().splitlines(), 1) if "@replay" in t)
    job = start(["-n", "2", "--hang-timeout", "10", "--grace", "2", str(source)], tmp_path)
    job.wait_for("stall", timeout=200)
    assert job.finish(120) == 124, job.stderr
    assert f"rank 0 waits in graph replay (graph_stall.py:{line})" in job.stderr, job.stderr
    assert "rank 1 is elsewhere" in job.stderr

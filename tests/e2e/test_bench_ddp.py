"""ddpkit bench ddp on CPU (gloo) with the tiny model: 1 and 2 ranks end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)
FIELDS = {
    "ranks",
    "backend",
    "params",
    "step_ms",
    "step_iqr_ms",
    "raw_ddp_step_ms",
    "no_sync_step_ms",
    "exposed_comm_ms",
    "wrap_over_raw",
    "samples_per_s",
    "tokens_per_s",
    "peak_mib",
    "gpu_busy",
    "wrapped_as",
    "efficiency",
    "variants",
    "back_to_back",
    "unavailable",
}


def bench_ddp(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(cwd or ""), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "bench", "ddp", *args],
        capture_output=True,
        text=True,
        timeout=290,
        cwd=cwd,
        env=env,
    )


def test_one_and_two_ranks_give_consistent_json(tmp_path):
    out = bench_ddp("--gpus", "1,2", "--steps", "4", "--json", "r.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["ranks"] for r in rows] == [1, 2]
    assert all(set(r) == FIELDS for r in rows)
    assert rows[0]["wrapped_as"] == "Sequential", "s.wrap at world size 1 is the model itself"
    assert rows[1]["wrapped_as"] == "DistributedDataParallel"
    assert rows[1]["efficiency"] == pytest.approx(
        rows[1]["samples_per_s"] / (2 * rows[0]["samples_per_s"])
    )
    assert rows[1]["samples_per_s"] == pytest.approx(8 * 2 / (rows[1]["step_ms"] / 1e3))
    assert rows[0]["exposed_comm_ms"] == 0.0
    assert all(r["back_to_back"] == {} for r in rows), "measured with --graphs on GPUs only"
    assert all(r["wrap_over_raw"] > 0 for r in rows)
    assert "# ddpkit bench ddp: model tiny" in out.stdout


def test_a_users_own_model_factory_is_measured(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def build():\n"
        "    model = torch.nn.Linear(32, 4)\n"
        "    return model, lambda n, d: (torch.randn(n, 32, device=d),"
        " torch.randint(0, 4, (n,), device=d))\n"
    )
    out = bench_ddp(
        "--model", "mymodels:build", "--gpus", "2", "--steps", "3", "--json", "r.json", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["params"] == 32 * 4 + 4


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "nosuchmodel"], "neither gpt, resnet, tiny nor MODULE:FACTORY"),
        (["--model", "nosuchmodule:build"], "No module named"),
        (["--gpus", "one"], "is not a list of counts"),
        (["--gpus", "0"], "must list counts of at least 1"),
        (["--precision", "fp8"], "is not bf16 or fp32"),
        (["--steps", "1"], "--steps at least 2"),
    ],
)
def test_bad_options_are_refused_with_exit_2(args, says):
    out = bench_ddp(*args)
    assert out.returncode == 2
    assert says in out.stderr

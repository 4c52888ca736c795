"""The frameworks users already train with, unchanged under `ddpkit run` (issue 21): PyTorch
Lightning's Trainer, Hugging Face's Trainer and an Accelerate script, tiny models built in the
scripts (no download), 2 gloo ranks. Each trains (and two of its steps are recorded with
`--profile-steps`, issue 39); a stall inside it is named at the user's line
(with the framework's line and the script's line that called into it for the waiting rank);
a crash names the rank and its exception; nothing is left running.

The frameworks come with the `frameworks` extra; CI installs it on the newest torch (.ci/run).
Where one is not installed its tests skip, saying so."""

from __future__ import annotations

import importlib.util

import pytest

from tests.e2e.helpers import SCRIPTS, start

pytestmark = pytest.mark.timeout(240)
HERE = SCRIPTS / "frameworks"


def needs(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"{module} is not installed (pip install -e '.[frameworks]')",
    )


FRAMEWORKS = [
    pytest.param(
        "lightning_train.py", (), "trained: loss", marks=needs("lightning"), id="lightning"
    ),
    pytest.param(
        "hf_train.py",
        ("{tmp}/out",),
        "trained: 12 steps",
        marks=needs("transformers"),
        id="hf-trainer",
    ),  # fmt: skip
    pytest.param("accelerate_train.py", (), "trained", marks=needs("accelerate"), id="accelerate"),
]
# where rank 1 stalls: (the script's line, its function)
STALLS = {
    "lightning_train.py": ("lightning_train.py:27", "training_step"),
    "hf_train.py": ("hf_train.py:35", "on_step_end"),
    "accelerate_train.py": ("accelerate_train.py:33", "main"),
}
CRASHES = {
    "lightning_train.py": "ValueError: bad batch 3 on purpose",
    "hf_train.py": "RuntimeError: callback failed at step 3 on purpose",
    "accelerate_train.py": "ValueError: bad batch 3 on purpose",
}


def run(tmp_path, script: str, extra: tuple[str, ...], launcher=(), script_args=()):
    words = [a.format(tmp=tmp_path) for a in extra]
    argv = ["-n", "2", "--grace", "2", *launcher, str(HERE / script), *words, *script_args]
    return start(argv, tmp_path)


@pytest.mark.parametrize(("script", "extra", "says"), FRAMEWORKS)
def test_it_trains_on_two_ranks_and_its_steps_are_profiled(tmp_path, script, extra, says):
    # the framework's own optimizer steps are the steps: recorded with no change to it
    job = run(tmp_path, script, extra, ["--profile-steps", "3-4"])
    assert job.finish(200) == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert f"[rank 0] {says}" in job.stdout + job.stderr
    assert "Traceback" not in job.stderr
    assert "ddpkit: steps 3-4 recorded on 2 rank(s)" in job.stderr, job.stderr[-3000:]
    assert "  rank 1: " in job.stderr.split("top ops by own time")[1]
    assert not job.survivors()


@pytest.mark.parametrize(("script", "extra", "says"), FRAMEWORKS)
def test_a_stall_inside_it_is_named_at_the_users_line(tmp_path, script, extra, says):
    job = run(tmp_path, script, extra, ["--hang-timeout", "4"], ["--stall-at", "3"])
    assert job.finish(200) == 124, job.stderr[-3000:]
    line = next(x for x in job.stderr.splitlines() if "root cause:" in x)
    site, func = STALLS[script]
    assert f"rank 1 is elsewhere: {func} ({site})" in line, line
    waiting = line.split("rank 0 ", 1)[1]
    assert waiting.startswith("waits in "), line
    assert f" from {script}:" in waiting.split(";")[0], "the framework's line and the script's"
    assert not job.survivors()


@pytest.mark.parametrize(("script", "extra", "says"), FRAMEWORKS)
def test_a_crash_inside_it_names_the_rank_and_its_exception(tmp_path, script, extra, says):
    job = run(tmp_path, script, extra, script_args=["--crash-at", "3"])
    assert job.finish(200) == 1, job.stderr[-3000:]
    assert f"root cause: rank 1 exited with code 1 ({CRASHES[script]})" in job.stderr
    assert not job.survivors()

"""What a recording says (ddpkit.launch.profile_breakdown) from made-up step records and
summaries, and --profile-steps' range (pure logic; the recording itself on real ranks:
tests/e2e/test_profile.py)."""

from __future__ import annotations

import gzip
import json

import pytest

from ddpkit.common.protocol import Step
from ddpkit.errors import ConfigError
from ddpkit.launch import profile_breakdown as pb
from ddpkit.launch.base.values import step_range

PLAN = {"first": 9, "steps": 3, "folder": "f", "shapes": False, "stack": False, "id": "x"}


def recording(rank, compute, data=0.001, comm=0.002, host=0.0, top=(("aten::mm", 0.01, 3),)):
    total = compute + data + comm + host
    steps = [Step(n, 0.0, total, data, compute, comm, host) for n in (10, 11, 12)]
    summary = {"rank": rank, "plan": PLAN, "recorded": 3, "top": [list(t) for t in top],
               "comm_s": 0.009, "device": "cpu", "export_s": 0.05}  # fmt: skip
    return pb.RankRecording(rank, summary, steps, before=steps)


@pytest.mark.parametrize(
    ("text", "expected"), [("20-25", (20, 25)), ("7", (7, 7)), (" 3-3 ", (3, 3))]
)
def test_profile_steps_takes_a_range_or_one_step(text, expected):
    assert step_range(text) == expected


@pytest.mark.parametrize("text", ["0-3", "5-2", "a-b", "1-2000", ""])
def test_a_range_that_is_not_one_is_refused_with_an_example(text):
    with pytest.raises(ConfigError, match="--profile-steps"):
        step_range(text)


def test_the_rank_whose_own_time_stands_out_is_the_one_the_others_wait_for():
    slow = recording(1, compute=0.030, top=(("aten::tanh", 0.05, 9), ("aten::mm", 0.02, 9)))
    found = pb.waited_for([recording(0, 0.010), slow, recording(2, 0.011)])
    assert found == (1, "compute")
    said = pb.text([recording(0, 0.010), slow, recording(2, 0.011)], pb.Path("f"), None)
    assert "the others wait for rank 1: its compute time stands out; meanwhile it spends " \
        "most in aten::tanh 50.0 ms" in said  # fmt: skip


def test_the_slow_ranks_op_named_is_its_own_work_not_its_all_reduce():
    # a loaded CPU: the slow rank's all-reduce can be its biggest op, and is not what it adds
    top = (("c10d::allreduce_", 0.066, 9), ("aten::tanh", 0.056, 9), ("gloo:all_reduce", 0.04, 9))
    slow = recording(1, compute=0.030, top=top)
    said = pb.text([recording(0, 0.010), slow, recording(2, 0.011)], pb.Path("f"), None)
    assert "meanwhile it spends most in aten::tanh 56.0 ms" in said, said
    assert "rank 1: c10d::allreduce_ 66.0 ms" in said, "the top ops still list every op"


def test_an_even_job_names_no_rank():
    recordings = [recording(0, 0.010), recording(1, 0.0105), recording(2, 0.0102)]
    assert pb.waited_for(recordings) is None
    assert "no rank holds the others back" in pb.text(recordings, pb.Path("f"), None)


def test_the_breakdown_row_splits_the_step_and_the_overlapped_communication():
    said = pb.text([recording(0, compute=0.007, data=0.001, comm=0.002)], pb.Path("f"), None)
    # 10 ms steps: 70% compute, 10% data, 20% waited; 9 ms of comm seen, 6 ms waited: 1 ms/step
    assert "   0     10.00      70%    10%          20%          1.00 ms         0%" in said, said


def test_the_merged_trace_puts_every_ranks_processes_on_one_timeline(tmp_path):
    for rank, base in ((0, 1_000_000_000), (1, 1_000_500_000)):
        trace = {"baseTimeNanoseconds": base, "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 4242, "args": {"name": "python"}},
            {"ph": "X", "name": "aten::mm", "pid": 4242, "tid": 1, "ts": 10.0, "dur": 5.0},
            {"ph": "X", "name": "kernel", "pid": 0, "tid": 7, "ts": 12.0, "dur": 1.0},
        ]}  # fmt: skip
        with gzip.open(tmp_path / f"rank{rank}.trace.json.gz", "wt") as f:
            json.dump(trace, f)
    merged = pb.merge(tmp_path)
    with gzip.open(merged, "rt") as f:
        events = json.load(f)["traceEvents"]
    names = sorted(e["args"]["name"] for e in events if e.get("name") == "process_name")
    assert names == ["rank 0: python", "rank 1: python"]
    assert len({e["pid"] for e in events}) == 4, "each rank's CPU and GPU its own process"
    mm = sorted(e["ts"] for e in events if e["name"] == "aten::mm")
    assert mm == [10.0, 510.0], "rank 1's base is 500 us later"

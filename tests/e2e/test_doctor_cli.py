"""ddpkit doctor as a command: exit codes, JSON schema, and the smoke test on CPU (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)
SCHEMA_KEYS = {"schema", "facts", "findings", "smoke", "script", "summary"}
FINDING_KEYS = {"level", "check", "what", "why", "fix", "where"}


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=230,
        env={**base, "CUDA_VISIBLE_DEVICES": "", **env},
    )


def test_the_smoke_test_runs_a_real_all_reduce_and_exits_0():
    out = doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "smoke test   all_reduce on 2 rank(s) (gloo): correct" in out.stdout
    assert "ddpkit doctor: 0 error(s)" in out.stdout


def test_one_rank_moves_no_data_so_the_smoke_test_claims_no_bandwidth():
    # issue 21: one GPU printed "256 MiB in 28 us, busbw 9676.56 GB/s"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit.doctor.smoke"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 0, out.stderr
    smoke = json.loads(out.stdout.split("DDPKIT_SMOKE ", 1)[1].splitlines()[0])
    assert smoke["ranks"] == 1
    assert smoke["wrong"] == 0
    assert smoke["busbw_gbps"] is None
    assert smoke["time_us"] is None

    from ddpkit.cli.doctor import render
    from ddpkit.doctor.facts import gather

    text = render(gather(), [], {"ok": True, **smoke}, 0, 0)
    assert "one rank moves no data, so no bandwidth is measured" in text
    assert "GB/s" not in text


def test_json_is_the_documented_schema_a_warning_exits_0_and_strict_makes_it_1():
    out = doctor("--json", "--no-smoke", NCCL_DEBUGG="INFO")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert set(data) == SCHEMA_KEYS
    assert data["schema"] == "ddpkit.doctor/1"
    assert data["smoke"] is None
    assert all(set(f) == FINDING_KEYS for f in data["findings"])
    assert data["summary"] == {"errors": 0, "warnings": 1}
    assert {"python", "torch", "gpus", "shm_bytes", "variables", "interfaces"} <= set(data["facts"])
    assert doctor("--no-smoke", "--strict", NCCL_DEBUGG="INFO").returncode == 1


def test_an_error_exits_1():
    assert doctor("--no-smoke", RANK="0,1", WORLD_SIZE="2").returncode == 1


def test_bad_usage_exits_2(tmp_path):
    out = doctor("--no-smoke", str(tmp_path / "missing.py"))
    assert out.returncode == 2
    assert "cannot read" in out.stderr


def test_a_failing_smoke_test_is_an_error_with_what_was_seen_and_leaves_nothing():
    import uuid

    import psutil

    # every process the doctor starts inherits this variable: the check sees only those, not
    # another training job that may be running on the machine
    mark = uuid.uuid4().hex
    out = doctor(GLOO_SOCKET_IFNAME="nosuchif0", TEST_PROCESS_MARK=mark)
    assert out.returncode == 1
    assert "matches no network interface" in out.stdout
    assert "smoke test   FAILED" in out.stdout
    assert "  | " in out.stdout, "the smoke test's own output is shown"
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TEST_PROCESS_MARK") == mark:
                left.append(p)
        except psutil.Error:
            continue
    assert not left

"""setup()'s own inputs: a bad backend or timeout, from the call or the environment, is a
ConfigError naming the value, raised before anything waits or listens."""

from __future__ import annotations

import math

import pytest

import ddpkit
from ddpkit.errors import ConfigError


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("DDPKIT_BACKEND", "foo", "DDPKIT_BACKEND='foo' is not one of auto, nccl, gloo"),
        ("DDPKIT_INIT_TIMEOUT", "abc", "DDPKIT_INIT_TIMEOUT='abc' is not a number of seconds"),
        ("DDPKIT_INIT_TIMEOUT", "nan", "DDPKIT_INIT_TIMEOUT='nan'"),
        ("DDPKIT_INIT_TIMEOUT", "inf", "DDPKIT_INIT_TIMEOUT='inf'"),
        ("DDPKIT_INIT_TIMEOUT", "-1", "DDPKIT_INIT_TIMEOUT='-1'"),
    ],
)
def test_a_bad_variable_is_named_with_its_value(monkeypatch, variable, value, says):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as err:
        ddpkit.setup()
    assert says in str(err.value)
    assert err.value.fix


@pytest.mark.parametrize("timeout", ["30", -5, 0, math.inf, math.nan, True, 10**12])
def test_a_bad_timeout_argument_is_refused(timeout):
    with pytest.raises(ConfigError) as err:
        ddpkit.setup(timeout=timeout)
    assert "setup(timeout=" in str(err.value)


def test_a_bad_backend_argument_is_refused():
    with pytest.raises(ConfigError, match="is not one of"):
        ddpkit.setup(backend="mpi-please")


def test_the_backend_variable_is_read_in_any_case(monkeypatch):
    monkeypatch.setenv("DDPKIT_BACKEND", "GLOO")
    with ddpkit.setup() as s:
        assert s.backend == "gloo"


def test_a_backend_the_script_names_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv("DDPKIT_BACKEND", "nccl")  # would fail here: no GPU
    with ddpkit.setup(backend="gloo") as s:
        assert s.backend == "gloo"


SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0"}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"SLURM_TASKS_PER_NODE": "0"}, "SLURM_TASKS_PER_NODE='0' is not a task count list"),
        ({"SLURM_NODELIST": "n[1-x]"}, "SLURM_NODELIST='n[1-x]' is not a SLURM host list"),
        ({"SLURM_NODELIST": "n[5-1]"}, "SLURM_NODELIST='n[5-1]' is not a SLURM host list"),
    ],
)
def test_bad_slurm_variables_are_named_under_setup(monkeypatch, extra, says):
    for name, value in {**SLURM, **extra}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        ddpkit.setup()
    assert says in str(err.value)


def test_a_huge_node_list_is_read_without_building_it():
    import time

    from ddpkit.env import slurm_hosts

    began = time.monotonic()
    assert slurm_hosts({"SLURM_NODELIST": "n[1-99999999]"}) == ("n1", 99999999)
    assert time.monotonic() - began < 0.5

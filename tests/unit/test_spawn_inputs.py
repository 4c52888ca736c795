"""What `ddpkit.spawn` refuses before any rank starts, each with its fix (the jobs it starts:
tests/e2e/test_spawn.py)."""

from __future__ import annotations

import threading

import pytest

import ddpkit
from ddpkit.common import protocol
from ddpkit.errors import ConfigError


def main(rank: int) -> None:  # a function a rank can find again
    pass


def test_a_call_inside_a_rank_of_a_job_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(protocol.STATE_DIR, str(tmp_path))
    with pytest.raises(ConfigError, match="inside a rank of a job") as refused:
        ddpkit.spawn(main, nprocs=2)
    assert "python script.py" in refused.value.fix


def test_a_function_a_new_process_cannot_find_again_is_refused():
    def inner(rank):
        pass

    for each in (lambda rank: None, inner):
        with pytest.raises(ConfigError, match="needs a function defined at the top"):
            ddpkit.spawn(each, nprocs=2)


def test_args_pickle_cannot_carry_are_refused_naming_the_error():
    with pytest.raises(ConfigError, match="could not pickle args") as refused:
        ddpkit.spawn(main, args=(threading.Lock(),), nprocs=2)
    assert "open files, locks and lambdas cannot go" in refused.value.fix


def test_an_option_ddpkit_run_does_not_have_is_refused_naming_it():
    with pytest.raises(ConfigError, match="hang_timout") as refused:
        ddpkit.spawn(main, nprocs=2, hang_timout=5)
    assert "ddpkit run --help" in refused.value.fix


def test_a_bad_option_value_is_refused_as_ddpkit_run_refuses_it():
    with pytest.raises(ConfigError, match="--hang-timeout"):
        ddpkit.spawn(main, nprocs=2, hang_timeout="soon")

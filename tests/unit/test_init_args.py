"""The script's own init arguments against what `ddpkit run` gave the rank (issue 35): a world
size or rank the job does not have is an error naming the argument, where the script set it,
what the launcher gave and the fix; a rendezvous address of the script's own is replaced by
the launcher's and said once. Checked against torch's real `init_process_group` signature."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from ddpkit.rank import init_args
from ddpkit.rank.init_args import InitMismatchError, check


@pytest.fixture
def launched(monkeypatch):
    """A rank 1 of 2 as ddpkit run starts it (127.0.0.1:41234), with the putenv hook."""
    given = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "41234"}  # fmt: skip
    for key, value in given.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(init_args, "LAUNCHER", {})
    monkeypatch.setattr(init_args, "SET_AT", {})
    monkeypatch.setattr(os, "putenv", os.putenv)  # the hook is undone after the test
    init_args.remember_launcher()
    return given


def test_the_launchers_own_values_pass_untouched(launched):
    done = check(dist.init_process_group, ("gloo",), {"rank": 1, "world_size": 2}, "t.py:3")
    assert done.args == ("gloo",)
    assert done.kwargs == {"rank": 1, "world_size": 2}
    assert done.notes == []


def test_a_world_size_written_in_the_script_is_an_error_naming_it_and_the_fix(launched):
    with pytest.raises(InitMismatchError) as err:
        check(dist.init_process_group, ("gloo",), {"rank": 1, "world_size": 4}, "classic.py:20")
    assert str(err.value).startswith(
        "init_process_group(world_size=4) at classic.py:20, but ddpkit run started 2 rank(s); "
        "this is rank 1"
    )
    assert "to run 4 ranks: ddpkit run -n 4" in err.value.fix


def test_the_local_rank_passed_as_rank_is_an_error_that_tells_the_two_apart(launched, monkeypatch):
    monkeypatch.setitem(init_args.LAUNCHER, "RANK", "3")  # rank 3 of 4: local rank 1 on node 1
    monkeypatch.setitem(init_args.LAUNCHER, "WORLD_SIZE", "4")
    with pytest.raises(InitMismatchError) as err:
        check(dist.init_process_group, ("nccl", "env://", None, 4, 1), {}, "train.py:11")
    assert "init_process_group(rank=1) at train.py:11" in str(err.value)
    assert "this is rank 3 (local rank 1)" in str(err.value)
    assert "LOCAL_RANK is the rank on this node" in err.value.fix


def test_a_world_size_variable_set_by_the_script_is_named_where_it_was_set(launched):
    os.environ["WORLD_SIZE"] = "8"  # through the hook, as `os.environ[...] = ` in a script
    with pytest.raises(InitMismatchError) as err:
        check(dist.init_process_group, ("gloo",), {}, "t.py:9")
    assert str(err.value).startswith("WORLD_SIZE=8 set by the script at test_init_args.py:")


def test_the_scripts_own_port_is_replaced_by_the_launchers_and_said(launched):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    done = check(dist.init_process_group, ("gloo",), {}, "t.py:9")
    assert os.environ["MASTER_PORT"] == "41234"
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    line = init_args.replaced_line(done.notes)
    assert line.startswith("the script sets MASTER_ADDR=localhost (test_init_args.py:")
    assert "MASTER_PORT=12355 (test_init_args.py:" in line
    assert "ddpkit run's ranks meet at 127.0.0.1:41234, so that is used" in line
    assert "ddpkit run --master-port" in line


def test_a_tcp_init_method_elsewhere_becomes_the_launchers_address(launched):
    done = check(dist.init_process_group, ("gloo", "tcp://10.0.0.1:23456"), {}, "t.py:9")
    assert done.kwargs["init_method"] == "env://"
    assert done.notes == ["init_method='tcp://10.0.0.1:23456' (t.py:9)"]


def test_a_file_init_method_or_a_store_of_the_scripts_own_is_left_alone(launched):
    store = dist.HashStore()
    assert check(dist.init_process_group, ("gloo",), {"store": store}, "t.py:9").notes == []
    done = check(dist.init_process_group, ("gloo", "file:///tmp/x"), {}, "t.py:9")
    assert done.notes == []
    assert done.args == ("gloo", "file:///tmp/x")

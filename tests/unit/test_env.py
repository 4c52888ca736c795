"""ddpkit.env: every launcher's variables, and every malformed value, named with a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpkit.env import DistEnv, check_gpu_fit, expand_hostlist, expand_tasks_per_node, read_env
from ddpkit.errors import EnvError

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> dict[str, str]:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    data.pop("_source")
    return data


def test_no_launcher_variables_is_one_process():
    assert read_env({}) == DistEnv(launcher="none")


def test_torchrun_variables_are_read():
    env = read_env(fixture("torchrun_rank1_of_4"))
    assert env == DistEnv(
        rank=1,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=0,
        master_addr="node0.cluster",
        master_port=29500,
        launcher="torchrun",
    )
    assert env.nnodes == 2


def test_ddpkit_run_variables_are_read_as_ddpkit():
    env = read_env(fixture("ddpkit_rank0_of_2"))
    assert (env.launcher, env.rank, env.world_size, env.master_port) == ("ddpkit", 0, 2, 41234)


def test_slurm_srun_variables_are_read():
    env = read_env(fixture("slurm_srun_rank5_of_8"))
    assert env == DistEnv(
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        master_addr="gpu07",
        master_port=15000 + 3456,
        launcher="slurm",
    )


def test_slurm_master_port_and_addr_can_be_overridden():
    env = read_env(
        {**fixture("slurm_srun_rank5_of_8"), "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456"}
    )
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 23456)


def test_open_mpi_variables_are_read():
    env = read_env(fixture("openmpi_rank3_of_4"))
    assert env == DistEnv(
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        master_addr="a",
        master_port=29500,
        launcher="mpi",
    )


def test_torchrun_variables_win_over_slurm_under_srun_torchrun():
    env = read_env({**fixture("slurm_srun_rank5_of_8"), **fixture("torchrun_rank1_of_4")})
    assert env.launcher == "torchrun"
    assert env.rank == 1


def test_hand_exported_single_node_job_needs_no_local_rank_or_master():
    env = read_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert (env.launcher, env.local_rank, env.master_addr) == ("env", 1, "127.0.0.1")


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("node[1-3,7],login", ["node1", "node2", "node3", "node7", "login"]),
        ("a[001-002]-ib", ["a001-ib", "a002-ib"]),
        ("single", ["single"]),
    ],
)
def test_slurm_host_lists_expand(text, hosts):
    assert expand_hostlist(text) == hosts


def test_slurm_tasks_per_node_expands_repeats():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("two") == []


@pytest.mark.parametrize(
    ("variables", "names", "fix_word"),
    [
        ({"RANK": "0,1", "WORLD_SIZE": "2"}, "RANK='0,1' is not one integer", "ddpkit run"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not one integer", "ddpkit run"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is below 0", "ddpkit run"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 but the job has only 2", "ddpkit run"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' is below 1", "ddpkit run"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' is set but RANK is not", "set both"),
        ({"RANK": "0"}, "RANK='0' is set but WORLD_SIZE is not", "set both"),
        ({"LOCAL_RANK": "0"}, "LOCAL_RANK='0' is set but RANK and WORLD_SIZE", "set both"),
        (
            {
                "RANK": "0",
                "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2",
                "LOCAL_RANK": "2",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
            },
            "LOCAL_RANK=2 but",
            "ddpkit run",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
            "MASTER_PORT='70000' is not",
            "free port",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "x"},
            "MASTER_PORT='x' is not",
            "free port",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"},
            "MASTER_ADDR is not set",
            "--rdzv",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"},
            "LOCAL_WORLD_SIZE=4 is larger",
            "ddpkit run",
        ),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, "SLURM_PROCID=3 but", "ddpkit run"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2,x"},
            "SLURM_TASKS_PER_NODE='2,x'",
            "srun",
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            "MASTER_ADDR is not set",
            "MASTER_ADDR",
        ),
    ],
)
def test_malformed_values_name_variable_value_and_fix(variables, names, fix_word):
    with pytest.raises(EnvError) as caught:
        read_env(variables)
    assert names in str(caught.value)
    assert fix_word in caught.value.fix
    assert caught.value.exit_code == 2


def test_local_rank_beyond_visible_gpus_is_an_error_for_nccl():
    env = read_env({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2"})
    check_gpu_fit(env, visible_gpus=3)
    with pytest.raises(EnvError) as caught:
        check_gpu_fit(env, visible_gpus=2)
    assert "LOCAL_RANK=2 but only 2 GPU(s) are visible" in str(caught.value)
    assert "-n gpu" in caught.value.fix

"""ddpkit run's options: checked before anything starts."""

from __future__ import annotations

import argparse

import pytest

from ddpkit.cli.run import split_argv
from ddpkit.errors import ConfigError
from ddpkit.launch.base import config, mistakes


def parse(words: list[str], environ: dict[str, str] | None = None) -> config.LaunchConfig:
    parser = argparse.ArgumentParser()
    config.add_options(parser, environ or {})
    config.add_switches(parser, environ or {})
    parser.add_argument("-m", "--module")
    parser.add_argument("--no-python", action="store_true")
    own, target = split_argv(words)
    args = parser.parse_args(own)
    args.target = target
    return config.from_args(args, environ or {})


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n: int) -> None:
        monkeypatch.setattr(config, "visible_gpu_count", lambda env=None: n)

    set_count(0)
    return set_count


def test_script_arguments_are_passed_untouched(script, gpus):
    cfg = parse(["-n", "2", script, "--lr", "3", "-n", "9"])
    assert (cfg.kind, cfg.target, cfg.args, cfg.nproc_per_node) == (
        "script",
        "train.py",
        ("--lr", "3", "-n", "9"),
        2,
    )


def test_module_and_its_arguments(gpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("")
    cfg = parse(["-m", "pkg.train", "--epochs", "1"])
    assert (cfg.kind, cfg.target, cfg.args) == ("module", "pkg.train", ("--epochs", "1"))


def test_split_argv_stops_at_the_script():
    assert split_argv(["--grace=1", "-n", "2", "t.py", "--grace", "9"]) == (
        ["--grace=1", "-n", "2"],
        ["t.py", "--grace", "9"],
    )
    assert split_argv(["-mpkg", "x"]) == (["-mpkg"], ["x"])


def test_auto_is_two_cpu_processes_on_gloo_without_gpus(script, gpus):
    cfg = parse([script])
    assert (cfg.nproc_per_node, cfg.backend) == (2, "gloo")


def test_auto_is_one_process_per_gpu_with_nccl(script, gpus):
    gpus(4)
    assert (parse([script]).nproc_per_node, parse([script]).backend) == (4, "nccl")


def test_more_processes_than_gpus_is_refused(script, gpus):
    gpus(2)
    with pytest.raises(ConfigError) as caught:
        parse(["-n", "3", script])
    assert "only 2 GPU(s)" in str(caught.value)
    assert "-n cpu" in caught.value.fix


def test_gpu_without_gpus_is_refused(script, gpus):
    with pytest.raises(ConfigError, match="no GPU is visible"):
        parse(["-n", "gpu", script])


@pytest.mark.parametrize(
    ("words", "says"),
    [
        (["-n", "0", "train.py"], "-n/--nproc-per-node '0' must be at least 1"),
        (["-n", "many", "train.py"], "is not a number, gpu, cpu or auto"),
        (["missing.py"], "script 'missing.py' not found"),
        ([], "no script to run"),
        (["--grace", "-1", "train.py"], "--grace '-1' must be at least 0"),
        (["--master-port", "99999", "train.py"], "is not a TCP port"),
        (["--nnodes", "2", "train.py"], "needs to know how the nodes meet"),
        (["--rdzv", "nohost", "--nnodes", "2", "train.py"], "is not HOST:PORT"),
        (["--ranks", "0,x", "train.py"], "is not a list of ranks"),
        (["--nnodes", "3:2", "--rdzv", "h:1", "train.py"], "MIN is larger than MAX"),
        (["--nnodes", "1:2", "--node-rank", "0", "--master-port", "9", "train.py"], "needs --rdzv"),
        (["--rdzv", "h:1", "--nnodes", "2", "--rdzv-conf", "x=1", "train.py"], "known key"),
        (["--node-timeout", "0.2", "train.py"], "--node-timeout '0.2' must be at least 1"),
        (["--no-python", "no-such-program-xyz"], "not found on PATH"),
    ],
)
def test_bad_input_is_a_config_error_with_a_fix(script, gpus, words, says):
    with pytest.raises(ConfigError) as caught:
        parse(words)
    assert says in str(caught.value)
    assert caught.value.fix


def test_flags_come_from_environment_variables(script, gpus):
    cfg = parse(
        [script], {"DDPKIT_GRACE": "1.5", "DDPKIT_NPROC_PER_NODE": "3", "DDPKIT_RANKS": "0"}
    )
    assert (cfg.grace, cfg.nproc_per_node, cfg.ranks) == (1.5, 3, frozenset({0}))


def test_command_line_wins_over_environment(script, gpus):
    assert parse(["--grace", "2", script], {"DDPKIT_GRACE": "9"}).grace == 2


def test_omp_threads_split_the_cores_unless_set(script, gpus):
    assert parse(["-n", "1", script]).omp_threads >= 1
    assert parse([script], {"OMP_NUM_THREADS": "4"}).omp_threads is None


def test_srun_gives_nodes_rank_and_master_from_slurm(script, gpus):
    slurm = {
        "SLURM_PROCID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[3-4]",
        "SLURM_JOB_ID": "77",
    }
    cfg = parse([script], slurm)
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (2, 1, "gpu3", 15077)


def test_srun_with_several_tasks_per_node_is_refused(script, gpus):
    slurm = {"SLURM_PROCID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "8", "SLURM_NODEID": "0"}
    with pytest.raises(ConfigError, match="exactly one task per node"):
        parse([script], slurm)


def test_privileged_port_gets_a_warning():
    from ddpkit.launch.base.ports import warn_privileged

    assert "privileged" in warn_privileged(1010)
    assert warn_privileged(29500) is None
    assert warn_privileged(0) is None


def test_hang_doctor_options(script, gpus):
    assert parse([script]).hang_timeout == 300
    assert parse(["--hang-timeout", "0", script]).hang_timeout == 0
    assert parse(["--check-collectives", script]).check_collectives
    assert parse([script], {"DDPKIT_CHECK_COLLECTIVES": "1"}).check_collectives
    assert not parse([script], {"DDPKIT_CHECK_COLLECTIVES": "0"}).check_collectives


def test_a_module_that_is_nowhere_is_refused_before_anything_starts(gpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no module 'nopkg_xyz'"):
        parse(["-m", "nopkg_xyz.train"])


KUBEFLOW = {  # what a PyTorchJob / Trainer pod sets for torchrun (node 1 of 2)
    "PET_NNODES": "2",
    "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "3",
    "PET_MASTER_ADDR": "job-master-0",
    "PET_MASTER_PORT": "23456",
}


def test_torchruns_pet_variables_configure_a_kubernetes_pod_as_torchrun_reads_them(script, gpus):
    cfg = parse([script], KUBEFLOW)
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node) == (2, 1, 3)
    assert (cfg.master_addr, cfg.master_port) == ("job-master-0", 23456)
    assert cfg.master_addr_given


def test_a_flag_and_then_ddpkits_variable_win_over_pet_variables(script, gpus):
    environ = {**KUBEFLOW, "DDPKIT_NPROC_PER_NODE": "2"}
    assert parse([script], environ).nproc_per_node == 2
    assert parse(["-n", "1", script], environ).nproc_per_node == 1
    assert parse(["--nnodes", "1", script], environ).nnodes == 1


def test_pet_variables_reach_torchruns_own_flags_too(script, gpus):
    from ddpkit.launch.base import torchrun_flags

    def with_torchrun_flags(environ: dict[str, str]) -> config.LaunchConfig:
        parser = argparse.ArgumentParser()
        config.add_options(parser, environ)
        torchrun_flags.add_flags(parser, environ)
        parser.add_argument("-m", "--module")
        parser.add_argument("--no-python", action="store_true")
        args = parser.parse_args([])
        args.target = [script]
        return config.from_args(args, environ)

    with pytest.raises(ConfigError, match="--rdzv-backend 'etcd'"):
        with_torchrun_flags({"PET_RDZV_BACKEND": "etcd"})
    cfg = with_torchrun_flags({"PET_STANDALONE": "1", "PET_MONITOR_INTERVAL": "0.5"})
    assert cfg.torchrun.monitor_interval == 0.5


def test_the_environment_for_commands_that_launch_jobs_reads_pet_variables_too(script, gpus):
    cfg = config.build("script", script, environ={"PET_NPROC_PER_NODE": "3"})
    assert cfg.nproc_per_node == 3


def test_the_interpreter_given_as_the_script_is_refused_with_the_command_to_use(script):
    with pytest.raises(ConfigError, match="'python' is the interpreter, not a script") as err:
        parse(["-n", "2", "python", script, "--epochs", "3"])
    assert err.value.fix == "drop it: ddpkit run [options] train.py ..."
    with pytest.raises(ConfigError, match="is the interpreter"):
        parse(["-n", "2", "/usr/bin/python3.11", script])


@pytest.mark.parametrize(
    ("flag", "meant"),
    [("--num_processes", "-n N"), ("--num_machines", "--nnodes N"), ("--gpus", "-n N")],
)
def test_another_launchers_flag_gets_a_pointer_to_ours(capsys, script, flag, meant):
    from ddpkit.cli import main

    assert main(["run", flag, "2", script]) == 2
    said = capsys.readouterr().err
    assert f"{flag} is another launcher's flag" in said
    assert f"ddpkit run says {meant}" in said


def test_rank_variables_and_misspellings_in_the_launchers_shell_are_warned_about():
    said = mistakes.environment_warnings(
        {"RANK": "0,1,2", "CUDA_VISIBLE_DIVICE": "0", "PATH": "/usr/bin", "HOME": "/root"}
    )
    assert said[0].startswith("RANK='0,1,2' is set in this shell; ddpkit run gives every rank")
    assert (
        "CUDA_VISIBLE_DIVICE is set and looks like a misspelling of CUDA_VISIBLE_DEVICES"
        in (said[1])
    )
    assert len(said) == 2
    assert mistakes.environment_warnings({"PATH": "/usr/bin", "OMP_NUM_THREADS": "4"}) == []


def test_a_master_port_or_address_in_the_launchers_shell_is_said_to_be_ignored():
    said = mistakes.rendezvous_warnings({"MASTER_PORT": "29500", "MASTER_ADDR": "10.1.2.3"},
                                        "127.0.0.1", 0)  # fmt: skip
    assert said[0].startswith("MASTER_PORT=29500 is set in this shell; ddpkit run gives every "
                              "rank the job's own (a free port it picks)")  # fmt: skip
    assert "--master-port 29500" in said[0]
    assert said[1].startswith("MASTER_ADDR=10.1.2.3 is set in this shell")
    # the same values as the job's, or loopback for loopback: nothing to say
    assert mistakes.rendezvous_warnings({"MASTER_PORT": "29500", "MASTER_ADDR": "localhost"},
                                        "127.0.0.1", 29500) == []  # fmt: skip


def test_a_rank_of_ddpkit_run_is_listed_by_its_script_not_the_bootstrap():
    from ddpkit.common.procs import shown_command

    words = ["/usr/bin/python3", "-m", "ddpkit.rank.bootstrap", "script", "train.py", "--lr", "3"]
    assert shown_command(words) == "python3 train.py --lr 3"
    module = ["python", "-m", "ddpkit.rank.bootstrap", "module", "pkg.train", "x"]
    assert shown_command(module) == "python -m pkg.train x"
    spawned = ["python", "-m", "ddpkit.rank.bootstrap", "function", "/w/t.py", "main", "/a.pk"]
    assert shown_command(spawned) == "python /w/t.py (ddpkit.spawn: main)"
    assert shown_command(["torchrun", "--nproc-per-node", "2", "t.py"]) == (
        "torchrun --nproc-per-node 2 t.py"
    )


def test_run_help_shows_each_options_default(capsys):
    from ddpkit.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for flag, (default, _) in config.OPTIONS.items():
        if default is not None:
            assert f"default {default}]" in shown, flag


def test_the_banded_edit_distance_equals_the_full_one_within_its_limit():
    import random

    from ddpkit.common.spelling import edit_distance

    def full(a: str, b: str) -> int:
        previous = list(range(len(b) + 1))
        for i, ca in enumerate(a, 1):
            current = [i]
            for j, cb in enumerate(b, 1):
                step = previous[j - 1] + (ca != cb)
                current.append(min(previous[j] + 1, current[j - 1] + 1, step))
            previous = current
        return previous[-1]

    rng = random.Random(0)
    for _ in range(5000):
        a, b = ("".join(rng.choice("AB_") for _ in range(rng.randint(0, 9))) for _ in "ab")
        limit = rng.randint(1, 3)
        expected = full(a, b)
        assert edit_distance(a, b) == expected
        assert edit_distance(a, b, limit) == (expected if expected <= limit else limit + 1)


@pytest.mark.parametrize(
    ("after", "fix"),
    [
        (["--nproc_per_node=3"], "`ddpkit run --nproc_per_node=3 short.py`"),
        (["--lr", "3", "--master-port", "1234"], "`ddpkit run --master-port 1234 short.py --lr 3`"),
        (
            ["--max-restarts=2", "--epochs", "1"],
            "`ddpkit run --max-restarts=2 short.py --epochs 1`",
        ),
    ],
)
def test_ddpkit_runs_own_options_after_the_script_are_an_error_with_the_order_fixed(
    tmp_path, monkeypatch, after, fix
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "short.py").write_text("print('hi')\n")
    with pytest.raises(ConfigError, match="comes after the script short.py") as raised:
        parse(["short.py", *after])
    assert raised.value.fix == f"put ddpkit run's options before the script: {fix}"


def test_an_option_the_script_reads_itself_is_the_scripts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "own.py").write_text("parser.add_argument('--nnodes', type=int)\n")
    assert parse(["own.py", "--nnodes", "2"]).args == ("--nnodes", "2")

"""Fix lines for the torch errors a user can fix, worked out from the real exceptions."""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpkit.rank.hints import fix_for


def raised(fn):
    try:
        fn()
    except BaseException as err:  # the exception as the rank's excepthook gets it
        return err, err.__traceback__
    raise AssertionError("it did not raise")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: nccl would start")
def test_nccl_where_there_is_no_gpu_says_use_gloo_or_setup():
    store = dist.HashStore()
    err, tb = raised(
        lambda: dist.init_process_group(
            "nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=5)
        )
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    assert fix_for(err, tb).startswith("this machine has no CUDA GPU for NCCL")
    assert "backend='gloo'" in fix_for(err, tb)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_rank_modulo_device_count_without_a_gpu_names_the_cause():
    rank = 1
    err, tb = raised(lambda: torch.cuda.set_device(rank % torch.cuda.device_count()))
    assert isinstance(err, ZeroDivisionError)
    assert fix_for(err, tb).startswith("the divisor is 0: torch.cuda.device_count() is 0, and")


def test_an_unrelated_error_gets_no_fix():
    err, tb = raised(lambda: {}["missing"])
    assert fix_for(err, tb) == ""
    err, tb = raised(lambda: 1 % 0)
    assert fix_for(err, tb) == "", "a ZeroDivisionError of the user's own is not about GPUs"


def test_a_broken_hint_never_hides_the_error(monkeypatch):
    import ddpkit.rank.hints as hints

    monkeypatch.setattr(hints, "_fix_for", lambda e, t: 1 / 0)
    err, tb = raised(lambda: sys.exit(3))
    assert fix_for(err, tb) == ""


def test_a_port_in_use_names_the_process_that_holds_it_and_the_fix():
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        store = lambda: dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))  # noqa: E731
        err, tb = raised(store)
        fix = fix_for(err, tb)
    finally:
        holder.close()
    assert fix.startswith(f"port {port} is held by pid ")
    assert "let ddpkit run choose the port" in fix
    assert "--master-port" in fix


def test_a_port_in_use_that_torch_does_not_name_is_read_from_the_scripts_store_call():
    # torch before 2.5 says EADDRINUSE without the port (libuv's words): the hint reads the
    # port argument of the script's own TCPStore call on the failing line
    from ddpkit.rank.hints import _port_of_call

    def TCPStore(*args):  # noqa: N802 - stands for torch's, which is C code with no locals
        raise RuntimeError("The server socket has failed to listen: EADDRINUSE")

    argv = ["train.py", "4321"]
    with pytest.raises(RuntimeError) as raised_here:
        TCPStore("127.0.0.1", int(argv[1]), 2, True)
    assert _port_of_call(raised_here.value.__traceback__) == 4321


# -- the classic guide's script on a machine with no GPU: each failure's fix, the first time --

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")


def guide_divides_by_the_gpus_it_counted():
    rank = 1
    num_gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank % num_gpus)


def docs_divide_by_n():
    n = torch.cuda.device_count()
    rank = 1
    return rank % n


def guide_moves_to_cuda():
    device = "cuda"
    return torch.nn.Linear(2, 2).to(device)


@no_gpu
@pytest.mark.parametrize("script", [guide_divides_by_the_gpus_it_counted, docs_divide_by_n])
def test_a_modulo_by_a_gpu_count_kept_in_a_name_is_followed_to_device_count(script):
    err, tb = raised(script)
    fix = fix_for(err, tb)
    assert fix.startswith("the divisor is 0: "), fix
    assert "= torch.cuda.device_count() at test_hints.py:" in fix
    assert "torch.cuda.set_device(local_rank)" in fix


@no_gpu
def test_set_device_without_a_gpu_says_set_it_only_where_there_is_one():
    err, tb = raised(lambda: torch.cuda.set_device(0))
    assert "if torch.cuda.is_available(): torch.cuda.set_device(local_rank)" in fix_for(err, tb)


@no_gpu
def test_work_sent_to_cuda_without_a_gpu_names_where_the_device_was_chosen():
    err, tb = raised(guide_moves_to_cuda)
    fix = fix_for(err, tb)
    assert fix.startswith("no GPU is visible here, and this line sends work to CUDA (device = "), (
        fix
    )
    assert "if torch.cuda.is_available() else torch.device('cpu')" in fix


def test_ddp_given_device_ids_for_a_cpu_model_says_pass_none_on_cpus():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        err, tb = raised(
            lambda: torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), device_ids=[0])
        )
    finally:
        dist.destroy_process_group()
    assert "device_ids=[local_rank] if torch.cuda.is_available() else None" in fix_for(err, tb)


def test_model_module_at_world_size_one_says_use_unwrap():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))  # what s.wrap gives back alone
    err, tb = raised(lambda: model.module)
    assert "use ddpkit.unwrap(model)" in fix_for(err, tb)


def test_a_port_held_by_the_job_itself_never_says_kill_that_job(monkeypatch):
    import socket

    from ddpkit.common import protocol
    from ddpkit.common.procs import port_taken_fix

    holder = socket.socket()  # this process: a rank of job j1 that holds the port
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        monkeypatch.setattr("ddpkit.common.procs._environ", lambda proc: {protocol.JOB: "j1"})
        monkeypatch.setenv(protocol.JOB, "j2")
        assert "`ddpkit kill j1` ends that job" in port_taken_fix(port), "another job's"
        monkeypatch.setenv(protocol.JOB, "j1")
        fix = port_taken_fix(port)
    finally:
        holder.close()
    assert "a process of this same job" in fix
    assert "ddpkit kill" not in fix


def test_a_device_side_assert_says_it_surfaced_late_and_how_to_get_the_real_line():
    err = RuntimeError(
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
        "reported at some other API call"
    )
    fix = fix_for(err, None)
    assert "the line named is where the error surfaced" in fix
    assert "CUDA_LAUNCH_BLOCKING=1" in fix

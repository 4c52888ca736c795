"""ddpkit.setup() and its helpers on real gloo process groups (2-3 ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn

from tests.groups.harness import RankError, run_ranks

pytestmark = pytest.mark.timeout(120)


def _reduce_uneven(rank, world, tmp):
    import ddpkit

    with ddpkit.setup() as s:
        values = {"loss": float(rank + 1), "count": rank * 10, "vec": torch.full((3,), rank * 1.0)}
        return {op: s.reduce(values, op=op) for op in ("mean", "sum", "max", "min")}


def test_reduce_returns_same_structure_on_every_rank(tmp_path):
    results = run_ranks(_reduce_uneven, 3, tmp_path)
    assert results[0]["sum"]["loss"] == 6.0
    assert results[0]["mean"]["loss"] == 2.0
    assert results[0]["max"]["count"] == 20
    assert isinstance(results[0]["max"]["count"], int)
    assert results[0]["min"]["vec"].tolist() == [0.0, 0.0, 0.0]
    assert results[0]["mean"]["vec"].tolist() == [1.0, 1.0, 1.0]
    assert all(r["sum"]["loss"] == results[0]["sum"]["loss"] for r in results)


def _gather_uneven(rank, world, tmp):
    import ddpkit

    with ddpkit.setup() as s:
        tensors = s.gather(torch.arange(rank + 1, dtype=torch.float32).reshape(rank + 1, 1))
        objects = s.gather({"rank": rank, "name": f"r{rank}"})
        return [t.tolist() for t in tensors], objects


def test_gather_takes_tensors_of_unequal_shapes_and_objects(tmp_path):
    results = run_ranks(_gather_uneven, 3, tmp_path)
    tensors, objects = results[2]
    assert tensors == [[[0.0]], [[0.0], [1.0]], [[0.0], [1.0], [2.0]]]
    assert [o["rank"] for o in objects] == [0, 1, 2]


def _gather_mismatched_dims(rank, world, tmp):
    import ddpkit

    with ddpkit.setup() as s:
        return s.gather(torch.zeros((2,) * (rank + 1)))


def test_gather_with_different_dimensions_is_an_error_not_a_hang(tmp_path):
    results = run_ranks(_gather_mismatched_dims, 2, tmp_path, expect_errors=True)
    assert all(
        isinstance(r, RankError) and "different numbers of dimensions" in r.message for r in results
    )


def _eval_pass(rank, world, tmp, n):
    import ddpkit

    with ddpkit.setup() as s:
        data = torch.utils.data.TensorDataset(torch.arange(n))
        seen = [int(x) for (batch,) in s.loader(data, batch_size=4, eval=True) for x in batch]
        total = s.reduce(len(seen), op="sum")
        return seen, total, s.gather(seen)


@pytest.mark.parametrize("n", [10, 11, 2])
def test_eval_loader_counts_each_sample_exactly_once(tmp_path, n):
    results = run_ranks(_eval_pass, 3, tmp_path, n)
    everything = sorted(i for seen, _, _ in results for i in seen)
    assert everything == list(range(n))
    assert all(total == n for _, total, _ in results)


def _train_epochs(rank, world, tmp):
    import ddpkit

    with ddpkit.setup(seed=3) as s:
        loader = s.loader(torch.utils.data.TensorDataset(torch.arange(20)), batch_size=5)
        return [[int(x) for (b,) in loader for x in b] for _ in range(2)]


def test_train_loader_shards_are_disjoint_and_reshuffled_each_epoch(tmp_path):
    r0, r1 = run_ranks(_train_epochs, 2, tmp_path)
    for epoch in (0, 1):
        assert not set(r0[epoch]) & set(r1[epoch])
        assert sorted(r0[epoch] + r1[epoch]) == list(range(20))
    assert r0[0] != r0[1], "set_epoch was not called: the same order every epoch"


def _accumulate(rank, world, tmp):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        model = s.wrap(nn.Linear(4, 1))
        calls = []

        def counting_hook(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, counting_hook)
        syncs = []
        for _step in range(6):
            with s.accumulate(model, every=3) as st:
                model(torch.randn(2, 4) + rank).sum().backward()
            syncs.append(st.sync)
        return syncs, len(calls)


def test_accumulate_syncs_gradients_only_every_k_micro_steps(tmp_path):
    results = run_ranks(_accumulate, 2, tmp_path)
    syncs, allreduces = results[0]
    assert syncs == [False, False, True, False, False, True]
    assert allreduces == 2


def _wrap_grads(rank, world, tmp):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        model = s.wrap(nn.Linear(4, 2))
        torch.manual_seed(rank)  # different data per rank
        model(torch.randn(8, 4)).pow(2).sum().backward()
        inner = ddpkit.unwrap(model)
        return type(model).__name__, type(inner).__name__, inner.weight.grad.clone()


def test_wrap_gives_ddp_whose_gradients_agree_across_ranks(tmp_path):
    (kind0, inner0, g0), (_, _, g1) = run_ranks(_wrap_grads, 2, tmp_path)
    assert kind0 == "DistributedDataParallel"
    assert inner0 == "Linear"
    assert torch.equal(g0, g1)


def _save_load(rank, world, tmp):
    import ddpkit

    with ddpkit.setup() as s:
        path = tmp / "ckpt" / "model.pt"
        s.save({"w": torch.arange(4.0), "step": 7}, path)
        loaded = s.load(path)
        return loaded["step"], loaded["w"].tolist(), sorted(p.name for p in path.parent.iterdir())


def test_save_then_load_round_trips_on_every_rank(tmp_path):
    for step, w, files in run_ranks(_save_load, 2, tmp_path):
        assert (step, w) == (7, [0.0, 1.0, 2.0, 3.0])
        assert files == ["model.pt"], "a temporary file was left beside the checkpoint"


def _missing_rank(rank, world, tmp):
    import ddpkit

    if rank == 2:
        return "never called setup"
    started = time.monotonic()
    try:
        ddpkit.setup(timeout=3)
    except ddpkit.DdpkitError as err:
        return str(err), err.fix, time.monotonic() - started
    return "setup returned"


def test_init_names_the_rank_that_never_arrived_within_the_timeout(tmp_path):
    results = run_ranks(_missing_rank, 3, tmp_path, timeout=60)
    for message, fix, waited in results[:2]:
        assert "2 of 3 ranks arrived" in message
        assert "missing: rank 2" in message
        assert fix
        assert waited < 30


def _adopt(rank, world, tmp):
    import torch.distributed as dist

    import ddpkit

    dist.init_process_group("gloo")
    s = ddpkit.setup()
    s.close()  # must not destroy a group the script created
    alive = dist.is_initialized()
    dist.destroy_process_group()
    return s.world_size, alive


def test_setup_adopts_a_group_the_script_already_created(tmp_path):
    assert run_ranks(_adopt, 2, tmp_path) == [(2, True), (2, True)]


def _main_first(rank, world, tmp):
    import ddpkit

    with ddpkit.setup() as s, s.main_first():
        marker = tmp / "made-by-main"
        if s.is_main:
            time.sleep(0.5)
            marker.write_text("x")
        return marker.exists()


def test_main_first_lets_rank_0_finish_before_the_others(tmp_path):
    assert run_ranks(_main_first, 2, tmp_path) == [True, True]


def _clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("SLURM_", "OMPI_", "TORCHELASTIC"))
    }


def test_plain_python_runs_as_one_process_without_blocking():
    code = (
        "import ddpkit, torch\ns = ddpkit.setup()\n"
        "print(s.world_size, s.backend, s.reduce(2.0),\n"
        "      s.wrap(torch.nn.Linear(2, 2)).__class__.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "gloo", "2.0", "Linear"]
    assert "running as a single process" in out.stderr


@pytest.mark.parametrize(
    ("variables", "says"),
    [
        ({"RANK": "0,1", "WORLD_SIZE": "2"}, "RANK='0,1' is not one integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 but the job has only 2 process(es)"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' is set but RANK is not"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ],
)
def test_malformed_environment_fails_at_once_with_a_fix_and_no_traceback(variables, says):
    out = subprocess.run(
        [sys.executable, "-c", "import ddpkit; ddpkit.setup()"],
        env={**_clean_env(), **variables},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert says in out.stderr
    assert "fix:" in out.stderr
    assert "Traceback" not in out.stderr


def _wrap_options(rank, world, tmp):
    import ddpkit

    with ddpkit.setup() as s:
        model = s.wrap(
            nn.Linear(4, 4), bucket_cap_mb=1, gradient_as_bucket_view=True, broadcast_buffers=False
        )
        return model.bucket_bytes_cap, model.gradient_as_bucket_view, model.broadcast_buffers


def test_wrap_passes_its_options_to_ddp(tmp_path):
    assert run_ranks(_wrap_options, 2, tmp_path) == [(2**20, True, False)] * 2


def _wrap_defaults(rank, world, tmp):
    import ddpkit

    with ddpkit.setup() as s:
        model = s.wrap(nn.Linear(4, 4))
        return model.bucket_bytes_cap, model.gradient_as_bucket_view


def test_wrap_sets_the_measured_ddp_defaults(tmp_path):
    assert run_ranks(_wrap_defaults, 2, tmp_path) == [(100 * 2**20, True)] * 2


def _broadcast_buffers_of(rank, world, tmp):
    import ddpkit

    with ddpkit.setup() as s:
        bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        other = nn.Linear(4, 4)
        other.register_buffer("scale", torch.ones(4))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            kept = s.wrap(bn).broadcast_buffers, s.wrap(other).broadcast_buffers
        return (*kept, [str(w.message)[:60] for w in said if "buffers" in str(w.message)])


def test_wrap_skips_broadcasting_buffers_only_when_all_are_batchnorm_statistics(tmp_path):
    # and quietly: torch 2.13 warns on every rank at DDP's old name for it
    assert run_ranks(_broadcast_buffers_of, 2, tmp_path) == [(False, True, [])] * 2


def _bn_training(rank, world, tmp, broadcast):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        kwargs = {} if broadcast is None else {"broadcast_buffers": broadcast}
        ddp = s.wrap(model, **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torch.manual_seed(rank)
        for _ in range(5):
            ddp(torch.randn(16, 4) * (rank + 1)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in ddpkit.unwrap(ddp).state_dict().items()}


def test_without_buffer_broadcast_rank_0_ends_with_the_same_weights_and_statistics(tmp_path):
    default = run_ranks(_bn_training, 2, tmp_path, None)
    broadcast = run_ranks(_bn_training, 2, tmp_path, True)
    for name, value in broadcast[0].items():
        assert torch.allclose(default[0][name], value), name
    # the other rank keeps its own running mean (its inputs are scaled differently)
    assert not torch.allclose(default[1]["1.running_mean"], broadcast[1]["1.running_mean"])


def _compressed(rank, world, tmp):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        model = s.wrap(nn.Linear(4, 2), compress="fp16")
        torch.manual_seed(rank)
        model(torch.randn(8, 4)).pow(2).sum().backward()
        return ddpkit.unwrap(model).weight.grad.clone()


def test_wrap_can_compress_gradients_and_ranks_still_agree(tmp_path):
    g0, g1 = run_ranks(_compressed, 2, tmp_path)
    assert torch.equal(g0, g1)


def _bf16_on_gloo(rank, world, tmp):
    import ddpkit

    with ddpkit.setup(seed=0) as s:
        try:
            s.wrap(nn.Linear(4, 2), compress="bf16")
        except ddpkit.DdpkitError as err:
            return err.render()
        return None


def test_wrap_refuses_bf16_compression_on_gloo_with_the_fix(tmp_path):
    messages = run_ranks(_bf16_on_gloo, 2, tmp_path)
    assert all(m is not None and "compress='fp16'" in m for m in messages)


def test_wrap_compile_returns_a_compiled_model_that_unwrap_sees_through():
    import ddpkit
    from ddpkit.env import DistEnv
    from ddpkit.train.placement import Placement
    from ddpkit.train.session import Session

    s = Session(DistEnv(), Placement(), owns_group=False)
    inner = nn.Linear(2, 2)
    compiled = s.wrap(inner, compile=True)
    assert compiled is not inner
    assert ddpkit.unwrap(compiled) is inner
    with pytest.raises(ddpkit.DdpkitError, match="compress='zip'"):
        s.wrap(inner, compress="zip")


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    import signal

    import psutil

    from ddpkit.train.checkpoint import read, write_atomic

    path = tmp_path / "ckpt.pt"
    write_atomic({"step": 1}, path)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import torch, sys\n"
                "from ddpkit.train.checkpoint import write_atomic\n"
                "write_atomic({'step': 2, 'w': torch.ones(400 * 2**20 // 4)}, sys.argv[1])\n"
            ),
            str(path),
        ]
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # kill it while the temporary file is being written
        partial = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        if partial and partial[0].stat().st_size > 0:
            break
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    assert partial, "the writer never started writing"
    assert read(path, torch.device("cpu")) == {"step": 1}
    assert not psutil.pid_exists(writer.pid) or psutil.Process(writer.pid).status() == "zombie"

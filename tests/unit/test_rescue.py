"""When the last completed step can be vouched for, and what a failure then writes
(ddpkit.train.rescue), on one process: a real s.loader, optimizer and scheduler, the placement
of rank 0 of 2 (the writing needs no process group). The whole path under `ddpkit run`, with
real failures: tests/e2e/test_zero_steps_lost.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ddpkit.train import rescue, state  # noqa: E402
from ddpkit.train.loaders import make_loader  # noqa: E402
from ddpkit.train.placement import Placement  # noqa: E402

PLACE = Placement(rank=0, world_size=2)


@pytest.fixture
def job(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = [(torch.randn(4), torch.randn(4)) for _ in range(16)]
    loader = make_loader(data, 2, Placement(rank=0, world_size=1))
    counters = {"step": 0}
    objects = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader,
               "counters": counters}  # fmt: skip
    rescue.remember(tmp_path / "ckpt", objects, PLACE)
    yield objects
    rescue.forget()


def train_step(objects, x, y):
    loss = ((objects["model"](x) - y) ** 2).mean()
    objects["optimizer"].zero_grad()
    loss.backward()
    objects["optimizer"].step()
    objects["scheduler"].step()
    objects["counters"]["step"] += 1


def test_a_boundary_is_the_first_fetch_after_an_optimizer_step(job):
    batches = iter(job["loader"])
    for _ in range(3):
        x, y = next(batches)
        x2, y2 = next(batches)  # two batches a step: gradient accumulation
        train_step(job, torch.cat([x, x2]), torch.cat([y, y2]))
    next(batches)
    assert rescue._part().kept.boundaries == 3  # one after each step; the first fetch is none


def test_before_the_first_step_the_state_just_saved_or_loaded_is_the_step(job):
    next(iter(job["loader"]))
    said, loud = rescue.after_peer_failure()
    assert said.startswith("the state saved or loaded last is the last completed step")
    assert not rescue._part().kept.path.exists(), "nothing written: the state on disk is this step"


def test_the_window_closes_when_the_optimizer_step_begins(job):
    batches = iter(job["loader"])
    train_step(job, *next(batches))
    x, y = next(batches)
    assert rescue._part().kept.open
    train_step(job, x, y)
    said, loud = rescue.after_peer_failure()
    assert "outside a step's window" in said
    assert not loud
    assert not rescue._part().kept.path.exists(), "nothing written"


def test_a_failure_inside_the_window_writes_the_boundarys_state_not_the_live_one(job, tmp_path):
    batches = iter(job["loader"])
    for _ in range(2):
        x, y = next(batches)
        train_step(job, x, y)
    x, y = next(batches)  # the boundary after step 2
    weights = {k: v.clone() for k, v in job["model"].state_dict().items()}
    job["model"].train()
    job["model"](x)  # a forward: BatchNorm's statistics move
    job["scheduler"].step()  # stepped early, and a counter bumped, inside the window
    job["counters"]["step"] += 100
    said, loud = rescue.after_peer_failure()
    assert loud
    assert "wrote the state of the last completed step" in said, said
    (folder,) = (tmp_path / "ckpt").glob("state-*")
    assert (folder / state.DONE).exists()
    assert (folder / "rank0.pt").exists()
    shared = torch.load(folder / "shared.pt", weights_only=True)
    assert shared["dicts"]["counters"] == {"step": 2}
    assert shared["stateful"]["scheduler"]["last_epoch"] == 2
    for name, value in shared["stateful"]["model"].items():
        assert torch.equal(value, weights[name]), name
    assert not list((tmp_path / "ckpt").glob(".rescue-*.tmp"))


def test_a_sharded_or_single_rank_job_is_not_armed(tmp_path):
    rescue.remember(tmp_path, {"counters": {}}, Placement(world_size=1))
    assert rescue._part().kept is None


def test_a_rescue_is_written_once_though_the_error_hook_and_the_launcher_both_ask(job, tmp_path):
    batches = iter(job["loader"])
    train_step(job, *next(batches))
    next(batches)  # inside the window
    said, loud = rescue.after_peer_failure()
    assert "wrote the state of the last completed step" in said
    assert rescue.after_peer_failure() is None, "the second asker adds nothing"
    assert rescue._on_request().decode() == said, "the launcher hears what was done"
    assert len(list((tmp_path / "ckpt").glob("state-*"))) == 1


def test_once_a_rescue_began_the_scripts_next_optimizer_step_waits(job):
    import threading

    batches = iter(job["loader"])
    train_step(job, *next(batches))
    x, y = next(batches)
    weights = [p.clone() for p in job["model"].parameters()]
    rescue._on_request()  # as the answering thread does, while the script computes
    script = threading.Thread(target=train_step, args=(job, x, y), daemon=True)
    script.start()
    script.join(1.0)
    assert script.is_alive(), "the optimizer step waits (the launcher ends the process)"
    assert all(map(torch.equal, weights, job["model"].parameters())), "no parameter moved"


def test_turned_off_by_its_variable_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPKIT_NO_RESCUE", "1")
    model = torch.nn.Linear(4, 4)
    rescue.remember(tmp_path, {"model": model, "counters": {}}, PLACE)
    assert rescue._part().kept is None
    monkeypatch.setenv("DDPKIT_NO_RESCUE", "0")
    rescue.remember(tmp_path, {"model": model, "counters": {}}, PLACE)
    assert rescue._part().kept is not None, "0 leaves it on"
    rescue.forget()

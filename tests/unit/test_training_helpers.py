"""The training-loop helpers on one process: autocast per precision, backward and step, clipping
that returns the norm before clipping, and loaders that move batches and resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import ConfigError


def test_autocast_is_off_on_cpu_by_default_and_bf16_when_asked():
    with ddpkit.setup() as s, s.autocast():
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
    with ddpkit.setup(precision="bf16") as s, s.autocast():
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16


def test_fp16_on_the_cpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="fp16 autocast needs a GPU"):
        ddpkit.setup(precision="fp16")


def test_backward_step_and_clip_train_a_model():
    with ddpkit.setup(seed=0) as s:
        model = s.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = (model(torch.ones(3, 4)) - 100).pow(2).mean()
        s.backward(loss)
        norm = s.clip(model, max_norm=1.0)
        assert norm > 1.0
        total = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        assert total == pytest.approx(1.0, rel=1e-5)
        before = model.weight.detach().clone()
        s.step(opt)
        assert not torch.equal(before, model.weight)


def test_a_loader_moves_batches_to_the_device_and_resumes_mid_epoch():
    data = TensorDataset(torch.arange(20.0))
    with ddpkit.setup(seed=3) as s:
        full = [b[0].tolist() for b in s.loader(data, batch_size=4, to_device=True)]
        loader = s.loader(data, batch_size=4, to_device=True)
        seen = []
        for i, (batch,) in enumerate(loader):
            assert batch.device == s.device
            seen.append(batch.tolist())
            if i == 1:
                state = loader.resume_state()
                break
        again = s.loader(data, batch_size=4)
        again.restore(state)
        rest = [b[0].tolist() for b in again]
        assert seen + rest == full, "the resumed pass continues at the next batch"
        assert (state["epoch"], state["batches"], state["position"]) == (0, 2, 8)
        after = again.resume_state()
        assert (after["epoch"], after["batches"], after["position"]) == (1, 0, 0)


def test_augmentation_randomness_does_not_depend_on_workers_or_resume():
    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.rand(())

    with ddpkit.setup(seed=5) as s:
        plain = [b.tolist() for b in s.loader(Noisy(), batch_size=3)]
        two = [b.tolist() for b in s.loader(Noisy(), batch_size=3, num_workers=2)]
        assert plain == two
        before = torch.get_rng_state()
        list(s.loader(Noisy(), batch_size=3))
        assert torch.equal(before, torch.get_rng_state()), "the loop's own RNG is left alone"


def test_a_graphed_step_on_the_cpu_runs_eagerly_with_one_warning():
    with ddpkit.setup(seed=0) as s:
        model = s.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        with pytest.warns(UserWarning, match="runs eagerly"):
            graphed = s.graph(step, torch.ones(2, 4), model=model, optimizer=opt)
        first, second = graphed(torch.ones(2, 4)), graphed(torch.ones(2, 4))
        assert first != second, "each call is a real training step"


def test_s_save_and_save_state_write_files_with_the_mode_torch_save_gives(tmp_path):
    import stat

    torch.save({"step": 1}, tmp_path / "plain.pt")
    with ddpkit.setup() as s:
        s.save({"step": 1}, tmp_path / "ckpt.pt")
        s.save_state(tmp_path / "state", model=torch.nn.Linear(2, 1))
    expected = stat.S_IMODE((tmp_path / "plain.pt").stat().st_mode)
    written = [tmp_path / "ckpt.pt", *(p for p in (tmp_path / "state").rglob("*") if p.is_file())]
    assert len(written) > 1
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in written} == {
        p.name: expected for p in written
    }

"""The random streams at a step's boundary, cheaply (ddpkit.train.quick_rng) and in a file the
node's survivors can read (ddpkit.train.rng_file): every take equals torch's own getters, a
stream that did not move is not copied again, and a file read back sets the streams so the
same numbers come next."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from ddpkit.train import rng_file, state  # noqa: E402
from ddpkit.train.quick_rng import QuickRng, as_saved  # noqa: E402


@pytest.fixture(autouse=True)
def seeded():
    random.seed(0)
    np.random.seed(0)  # no Gaussian cached
    torch.manual_seed(0)


def draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(1)


def test_a_take_is_what_the_getters_say_after_every_kind_of_draw():
    quick = QuickRng()
    for draw in (random.random, lambda: random.gauss(0, 1), np.random.rand, np.random.randn,
                 lambda: torch.rand(1)):  # fmt: skip
        draw()
        taken = quick.take()
        assert taken["python"] == random.getstate()
        assert repr(taken["numpy"]) == repr(np.random.get_state())
        assert torch.equal(taken["torch"], torch.get_rng_state())


def test_the_layout_check_passes_on_this_interpreter_and_numpy():
    quick = QuickRng()
    assert quick.python.fast, "else every take pays the getters' cost"
    assert quick.numpy.fast


def test_a_stream_that_did_not_move_is_the_last_takes_value():
    quick = QuickRng()
    first = quick.take()
    torch.rand(1)
    second = quick.take()
    assert second["python"] is first["python"]
    assert second["numpy"] is first["numpy"]


def test_numpys_cached_gaussian_is_never_taken_for_unmoved():
    # randn draws two and caches one: the next randn moves no word, only the cache
    quick = QuickRng()
    np.random.randn()
    before = quick.take()
    assert before["numpy"][3] == 1, "a Gaussian is cached"
    np.random.randn()
    after = quick.take()
    assert after["numpy"][3] == 0
    assert after["numpy"] is not before["numpy"]


def test_setting_a_take_gives_the_same_numbers_again():
    quick = QuickRng()
    draws()
    taken = as_saved(quick.take())
    expected = draws()
    draws()
    state.set_rng_state(taken)
    assert repr(draws()) == repr(expected)


def test_a_file_read_back_gives_the_same_numbers_again(tmp_path):
    quick = QuickRng()
    kept = rng_file.RngFile(tmp_path / "rank1.rng")
    for boundary in (1, 2, 3):
        draws()
        kept.write_taken(7, boundary, quick, quick.take())
    expected = draws()
    draws()
    streams = rng_file.read(tmp_path / "rank1.rng", 7, 3)
    assert streams is not None
    state.set_rng_state(streams)
    assert repr(draws()) == repr(expected)


def test_a_file_holds_the_last_two_boundaries_and_no_other(tmp_path):
    quick = QuickRng()
    kept = rng_file.RngFile(tmp_path / "rank0.rng")
    taken = quick.take()
    for boundary in (4, 5):
        kept.write(0, boundary, quick.python.words(), None, None, taken["torch"], [])
    path = tmp_path / "rank0.rng"
    assert rng_file.read(path, 0, 4) is not None
    assert rng_file.read(path, 0, 5) is not None
    assert rng_file.read(path, 0, 3) is None, "overwritten by 5"
    assert rng_file.read(path, 1, 5) is None, "another save's boundaries"


def test_a_copy_cut_off_in_the_middle_is_not_read(tmp_path):
    quick = QuickRng()
    kept = rng_file.RngFile(tmp_path / "rank0.rng")
    taken = quick.take()
    kept.write(0, 6, quick.python.words(), None, None, taken["torch"], [])
    kept.map[100:200] = b"\0" * 100  # as if killed while copying boundary 6 ...
    kept.map[0:8] = (8).to_bytes(8, "little")  # ... after its frame said 8
    assert rng_file.read(tmp_path / "rank0.rng", 0, 8) is None
    assert rng_file.read(tmp_path / "rank0.rng", 0, 6) is None


def test_outside_a_run_no_file_is_made(monkeypatch):
    monkeypatch.delenv("_DDPKIT_STATE_DIR", raising=False)
    assert rng_file.mine() is None


def test_a_copy_from_the_optimizer_step_is_read_only_when_the_fetch_moved_nothing(tmp_path):
    quick = QuickRng()
    kept = rng_file.RngFile(tmp_path / "rank0.rng")
    kept.write_taken(0, 9, quick, quick.take(), fetched=False)  # died before its next fetch
    assert rng_file.read(tmp_path / "rank0.rng", 0, 9) is not None
    assert rng_file.read(tmp_path / "rank0.rng", 0, 9, fetched=True) is None

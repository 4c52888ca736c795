"""The random streams at a step's boundary, cheaply (ddpkit.train.quick_rng) and in a file the
node's survivors can read (ddpkit.train.rng_file): every payload reads back as torch's own
getters say, equal payloads mean no stream moved, and a file read back sets the streams so the
same numbers come next."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from ddpkit.train import rng_file, state  # noqa: E402
from ddpkit.train.quick_rng import LiveStreams, streams_of  # noqa: E402


@pytest.fixture(autouse=True)
def seeded():
    random.seed(0)
    np.random.seed(0)  # no Gaussian cached
    torch.manual_seed(0)


def draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(1)


def test_a_payload_reads_back_as_the_getters_say_after_every_kind_of_draw():
    live = LiveStreams()
    for draw in (random.random, lambda: random.gauss(0, 1), np.random.rand, np.random.randn,
                 lambda: torch.rand(1)):  # fmt: skip
        draw()
        streams = streams_of(live.payload())
        assert streams["python"] == random.getstate()
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        assert streams["numpy"][0] == kind
        assert streams["numpy"][1].tolist() == keys.tolist()
        assert streams["numpy"][2:] == (pos, has_gauss, gauss)
        assert torch.equal(streams["torch"], torch.get_rng_state())


def test_the_layout_check_passes_on_this_interpreter_and_numpy():
    live = LiveStreams()
    assert live.python.fast, "else every payload pays the getters' cost"
    assert live.numpy.fast


def test_payloads_are_equal_exactly_when_no_stream_moved():
    live = LiveStreams()
    first = live.payload()
    assert live.payload() == first
    for draw in (random.random, np.random.rand, lambda: torch.rand(1)):
        draw()
        moved = live.payload()
        assert moved != first
        first = moved


def test_numpys_cached_gaussian_is_never_missed():
    # randn draws two and caches one: the next randn moves no word, only the cache
    live = LiveStreams()
    np.random.randn()
    before = live.payload()
    assert streams_of(before)["numpy"][3] == 1, "a Gaussian is cached"
    np.random.randn()
    after = live.payload()
    assert streams_of(after)["numpy"][3] == 0
    assert after != before


def test_setting_a_payload_gives_the_same_numbers_again():
    live = LiveStreams()
    draws()
    taken = streams_of(live.payload())
    expected = draws()
    draws()
    state.set_rng_state(taken)
    assert repr(draws()) == repr(expected)


def test_a_file_read_back_gives_the_same_numbers_again(tmp_path):
    live = LiveStreams()
    kept = rng_file.RngFile(tmp_path / "rank1.rng")
    for boundary in (1, 2, 3):
        draws()
        kept.put(7, boundary, live.payload())
    expected = draws()
    draws()
    streams = rng_file.read(tmp_path / "rank1.rng", 7, 3)
    assert streams is not None
    state.set_rng_state(streams)
    assert repr(draws()) == repr(expected)


def test_a_file_holds_the_last_two_boundaries_and_no_other(tmp_path):
    kept = rng_file.RngFile(tmp_path / "rank0.rng")
    payload = LiveStreams().payload()
    for boundary in (4, 5):
        kept.put(0, boundary, payload)
    path = tmp_path / "rank0.rng"
    assert rng_file.read(path, 0, 4) is not None
    assert rng_file.read(path, 0, 5) is not None
    assert rng_file.read(path, 0, 3) is None, "overwritten by 5"
    assert rng_file.read(path, 1, 5) is None, "another save's boundaries"


def test_a_copy_cut_off_in_the_middle_is_not_read(tmp_path):
    kept = rng_file.RngFile(tmp_path / "rank0.rng")
    kept.put(0, 6, LiveStreams().payload())
    kept.map[100:200] = b"\0" * 100  # as if killed while copying boundary 6 ...
    kept.map[0:8] = (8).to_bytes(8, "little")  # ... after its frame said 8
    assert rng_file.read(tmp_path / "rank0.rng", 0, 8) is None
    assert rng_file.read(tmp_path / "rank0.rng", 0, 6) is None


def test_a_slot_rewritten_for_the_same_boundary_is_unread_until_the_copy_is_whole(
    tmp_path, monkeypatch
):
    # the optimizer step wrote boundary 6; the fetch rewrites it (a stream moved) and is killed
    # after the new payload but before its end marker: the old end marker still says 6
    live = LiveStreams()
    kept = rng_file.RngFile(tmp_path / "rank0.rng")
    kept.put(0, 6, live.payload(), fetched=False)
    torch.rand(1)

    class KilledError(Exception):
        pass

    class EndMarkerNeverWritten:
        size = rng_file._END.size

        def pack_into(self, *_):
            raise KilledError

    monkeypatch.setattr(rng_file, "_END", EndMarkerNeverWritten())
    with pytest.raises(KilledError):
        kept.put(0, 6, live.payload())
    monkeypatch.undo()
    assert rng_file.read(tmp_path / "rank0.rng", 0, 6) is None


def test_outside_a_run_no_file_is_made(monkeypatch):
    monkeypatch.delenv("_DDPKIT_STATE_DIR", raising=False)
    assert rng_file.mine() is None


def test_a_copy_from_the_optimizer_step_is_read_only_when_the_fetch_moved_nothing(tmp_path):
    kept = rng_file.RngFile(tmp_path / "rank0.rng")
    kept.put(0, 9, LiveStreams().payload(), fetched=False)  # died before its next fetch
    assert rng_file.read(tmp_path / "rank0.rng", 0, 9) is not None
    assert rng_file.read(tmp_path / "rank0.rng", 0, 9, fetched=True) is None


def test_a_copy_marked_at_the_fetch_is_the_boundarys(tmp_path):
    kept = rng_file.RngFile(tmp_path / "rank0.rng")
    kept.put(0, 9, LiveStreams().payload(), fetched=False)
    kept.mark_fetched(9)  # the fetch found no stream moved
    assert rng_file.read(tmp_path / "rank0.rng", 0, 9, fetched=True) is not None

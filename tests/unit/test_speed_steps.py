"""Every step the ranks wrote reaches the speed doctor, whichever look read it: a look made for
something else (a collector's, the poll that saw the job end) consumes the steps it reads, and
the end table once came out empty when the last second's steps were read by such a look."""

from __future__ import annotations

import os

import pytest

from ddpkit.common import protocol
from ddpkit.launch import outcomes
from ddpkit.launch.base.snapshot import Reader
from ddpkit.launch.base.worker import Signals
from ddpkit.launch.peers.peers import NoPeers
from ddpkit.launch.speed.step_watch import SpeedWatch
from tests.unit.snapshots import worker
from tests.unit.test_launch_config import parse

STEPS = 40


def test_steps_read_by_a_look_made_for_something_else_reach_the_end_table(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    ranks = [worker(0, exit_code=0, ended=1.0), worker(1, exit_code=0, ended=1.0)]
    for w in ranks:
        w.proc.pid = os.getpid()  # a live process: the speed watch follows it
        writer = protocol.StepWriter(protocol.state_path(state, w.rank, protocol.STEPS))
        for n in range(1, STEPS + 1):
            writer.write(protocol.Step(n, 1000.0 + n, 0.010, 0.001, 0.008, 0.001, 0.0))
    speed = SpeedWatch(tmp_path, host="node0", peers=NoPeers())
    speed.watch({w.rank: w.proc.pid for w in ranks})
    reader = Reader(state)
    scene = outcomes.Scene(parse(["-n", "2", __file__]), Signals(), ranks, reader, NoPeers(),
                           speed.memory.growth, speed.take)  # fmt: skip
    scene.look(steps=True)  # the poll that saw every rank exit 0 read the steps; no sample
    table = speed.finish(reader.look(ranks, steps=True))  # as the supervisor ends an attempt
    assert "step times per rank" in table
    rows = [line.split() for line in table.splitlines()[2:4]]
    assert [row[0] for row in rows] == ["0", "1"], table
    assert all(int(row[1]) >= STEPS for row in rows), "every step counted"


def test_steps_png_draws_each_rank_in_its_own_panel_with_its_spikes_marked(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from types import SimpleNamespace

    import matplotlib.image
    import matplotlib.pyplot as plt

    from ddpkit.launch.speed import step_watch

    calm = [(0.004,)] * 100
    spiky = [(0.004,)] * 50 + [(0.040,)] + [(0.004,)] * 49
    tracks = {r: SimpleNamespace(rank=r, every=1, kept=k) for r, k in enumerate([calm, spiky])}
    drawn = []
    subplots = plt.subplots

    def keep(*args, **kwargs):
        fig, axes = subplots(*args, **kwargs)
        drawn.append(axes)
        return fig, axes

    monkeypatch.setattr(plt, "subplots", keep)
    step_watch.plot(tracks, tmp_path / "steps.png")
    (axes,) = drawn
    assert axes.shape == (2, 1), "a panel a rank"
    labels = [ax.texts[-1].get_text() for ax in axes[:, 0]]
    assert labels == ["median 4.0 ms; 0 step(s) over 3x", "median 4.0 ms; 1 step(s) over 3x"]
    assert [t.get_text() for t in axes[1, 0].texts[:-1]] == ["40 ms"], "the spike labelled"
    assert matplotlib.image.imread(tmp_path / "steps.png").shape[0] > 200


def test_no_straggler_is_judged_while_no_rank_ends_a_step_a_hang_in_the_making():
    from ddpkit.common.protocol import Step
    from ddpkit.launch.speed.step_watch import Track, stalled

    tracks = []
    for rank in range(3):
        track = Track(rank, pid=100 + rank, window=32)
        track.take([Step(n, 1000.0 + n * 0.1, 0.1, 0.0, 0.08, 0.02, 0.0) for n in range(20)])
        tracks.append(track)  # the last step ended at 1001.9
    assert not stalled(tracks, now=1002.5), "a step's time after the last: still training"
    assert stalled(tracks, now=1004.0), "2 s and 20 steps' time with no step ended"
    slow = Track(0, pid=100, window=32)  # steps of 10 s: 2 s without one is nothing
    slow.take([Step(n, 1000.0 + n * 10, 10.0, 0.0, 9.0, 1.0, 0.0) for n in range(10)])
    assert not stalled([slow], now=1100.0)
    assert stalled([slow], now=1150.0)

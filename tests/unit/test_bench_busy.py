"""The GPU-busy arithmetic of `ddpkit bench ddp`."""

from ddpkit.bench.busy import union_us


def test_overlapping_kernels_count_once_and_gaps_not_at_all():
    assert union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


def test_no_kernels_is_no_busy_time():
    assert union_us([]) == 0

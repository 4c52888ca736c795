"""How a process outside the job is charged for the rank's core (the straggler's evidence)."""

from __future__ import annotations

import pytest

from ddpkit.launch.speed.evidence import part_on


def test_a_process_pinned_to_the_ranks_core_is_charged_all_its_time():
    assert part_on({1}, {1}) == 1.0


def test_a_process_free_to_run_anywhere_is_charged_its_share_of_the_ranks_cores():
    # CI's failure: two unpinned busy processes (27% each over 2 cores) were cited before the
    # hog pinned beside rank 1; charged 13.5% each they fall below the 20% that is cited
    assert part_on({0, 1}, {1}) == pytest.approx(0.5)
    assert part_on({0, 1, 2, 3}, {2, 3}) == pytest.approx(0.5)


def test_a_process_on_other_cores_is_not_charged():
    assert part_on({0}, {1}) == 0.0
    assert part_on(set(), {1}) == 0.0

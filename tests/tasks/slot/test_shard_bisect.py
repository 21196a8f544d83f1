from __future__ import annotations

from tasks.slot.shard_bisect import plan_ranges


def test_with_nothing_finished_the_shard_is_cut_into_chunks() -> None:
    assert plan_ranges(10, [], None, 4) == ([(0, 4), (4, 8), (8, 10)], None)


def test_finished_ranges_are_kept_and_the_range_that_killed_the_worker_is_halved() -> None:
    work, poison = plan_ranges(12, [(0, 4)], (4, 8), 4)
    assert work == [(4, 6), (6, 8), (8, 12)]
    assert poison is None


def test_a_single_record_that_killed_the_worker_again_is_given_up_as_poison() -> None:
    work, poison = plan_ranges(8, [(0, 4), (4, 6)], (6, 7), 4)
    assert poison == (6, 7)
    assert work == [(7, 8)]


def test_the_gap_before_a_crashed_range_is_still_run() -> None:
    work, poison = plan_ranges(16, [(0, 2)], (8, 12), 4)
    assert work == [(2, 6), (6, 8), (8, 10), (10, 12), (12, 16)]
    assert poison is None

"""The knee finder on synthetic sweeps with known knees, and one with none."""

from __future__ import annotations

import pytest

from kvserve.bench.knee import find_knee

LEVELS = [1, 2, 4, 8, 16, 32]


def test_compute_knee_where_throughput_flattens_and_tpot_climbs() -> None:
    throughput = [10, 19, 36, 60, 64, 65]  # flattens after 8
    knee = find_knee(LEVELS, throughput, ttft_p99=[0.1, 0.1, 0.12, 0.15, 0.3, 0.6],
                     tpot_p99=[0.02, 0.021, 0.023, 0.03, 0.06, 0.12], kv_usage=[0.1] * 6, preemptions=[0] * 6)
    assert knee.level_index == 3 and LEVELS[knee.level_index] == 8 and knee.limiting_factor == "compute"


def test_queueing_knee_when_only_ttft_climbs() -> None:
    knee = find_knee(LEVELS, [10, 20, 40, 41, 41, 41], ttft_p99=[0.1, 0.1, 0.1, 0.5, 1.0, 2.0],
                     tpot_p99=[0.02] * 6, kv_usage=[0.2] * 6, preemptions=[0] * 6)
    assert knee.level_index == 2 and knee.limiting_factor == "queueing"


def test_kv_knee_when_the_pool_saturates_even_if_throughput_still_grows() -> None:
    knee = find_knee(LEVELS, [10, 20, 40, 80, 150, 200], ttft_p99=[0.1] * 6, tpot_p99=[0.02] * 6,
                     kv_usage=[0.1, 0.2, 0.4, 0.8, 0.97, 1.0], preemptions=[0, 0, 0, 0, 3, 9])
    assert knee.level_index == 3 and knee.limiting_factor == "kv memory" and "97%" in knee.reason


def test_no_knee_when_throughput_keeps_scaling() -> None:
    knee = find_knee(LEVELS, [10, 20, 39, 77, 150, 290], ttft_p99=[0.1] * 6, tpot_p99=[0.02] * 6,
                     kv_usage=[0.1] * 6, preemptions=[0] * 6)
    assert knee.level_index is None and knee.limiting_factor == "none"


def test_series_must_line_up() -> None:
    with pytest.raises(ValueError, match="one value per level"):
        find_knee([1, 2], [1.0], [0.1, 0.1], [0.1, 0.1], [0, 0], [0, 0])

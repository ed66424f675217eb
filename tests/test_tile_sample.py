"""A sample of the chunked cross-entropy's vocabulary tiles (looptrain.tile_sample): which tiles it computes, and
the seconds it records for the ones it skips, on a clock the test advances by hand."""

from __future__ import annotations

import time

import pytest

from looptrain import tile_sample


def test_a_sampled_loop_computes_the_first_two_tiles_and_every_nth_and_prices_the_rest_per_row(monkeypatch):
    """Eleven tiles of 10 rows and a last of 4, every 4th: tiles 0, 1, 5 and 9 are computed. The first costs 7 s
    (a new shape's first calls), the others 0.5 s a row: the 8 skipped tiles (74 rows, the last tile's 4 included)
    are recorded at 0.5 s a row, at the time the loop started; a loop of two tiles computes both and records
    nothing."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    tiles = [slice(start, min(start + 10, 114)) for start in range(0, 114, 10)]
    sample = tile_sample.TileSample(4)
    computed = []
    for index, rows in sample.loop(tiles):
        computed.append(index)
        now[0] += 7.0 if index == 0 else 0.5 * (rows.stop - rows.start)
    assert computed == [0, 1, 5, 9]
    assert sample.added == [(100.0, pytest.approx(0.5 * 74))]
    assert sample.seconds_within(100.0, 100.5) == pytest.approx(37.0)
    assert sample.seconds_within(99.0, 100.0) == 0.0 and sample.seconds_within(100.5, now[0]) == 0.0
    assert [index for index, _ in sample.loop(tiles[:2])] == [0, 1] and len(sample.added) == 1
    assert [index for index, _ in tile_sample.TileSample(1).loop(tiles)] == list(range(12))
    assert not sample.skips(2) and sample.skips(3) and not tile_sample.TileSample(1).skips(12)


def test_sampled_tiles_is_active_only_inside_its_block_and_refuses_an_empty_step():
    assert tile_sample.active() is None
    with tile_sample.sampled_tiles(8) as sample:
        assert tile_sample.active() is sample and sample.every == 8
    assert tile_sample.active() is None
    with pytest.raises(ValueError, match="every must be at least 1, got 0"):
        tile_sample.TileSample(0)

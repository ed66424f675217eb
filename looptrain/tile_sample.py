"""A sample of the chunked cross-entropy's vocabulary tiles, for a planner's probe on a CPU.

A causal LM's head and loss (`looptrain.lm_loss`) run tile by tile over the vocabulary, every tile the same shape
(the last may be narrower), at most one tile's logits at a time. What a tile costs is its rows' share of the head's
work; what the head holds at its peak is one tile, whichever. So a probe need not compute every tile: inside
`sampled_tiles`, each tile loop computes its first tile, its second and every `every`-th after (`TileSample.computes`)
and skips the others, and the seconds the skipped tiles would have taken are recorded (`TileSample.added`): the
computed tiles after the first at their seconds per vocabulary row (the first pays a new shape's first calls, and
counts as it was timed). The probe adds them to the micro-batch they fell in (`TileSample.seconds_within`). The loss
a sampled loop computes is not the model's (the skipped tiles are missing from each token's logsumexp): probes
train with the learning rate at 0, and only time and memory are read from them. A fresh head-weight gradient is
zeroed first where tiles are skipped, so that no row holds what was in memory before.

Timed on the CPU only, where the kernels run as they are called; the caller decides that.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class TileSample:
    """Which tiles a sampled tile loop computes, and the seconds its skipped tiles would have taken (`added`: (when
    the loop started, seconds), one per loop that skipped any)."""

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every = every
        self.added: list[tuple[float, float]] = []

    def computes(self, index: int) -> bool:
        """Whether the tile at `index` of a loop is computed: the first two, then every `every`-th."""
        return index <= 1 or (index - 1) % self.every == 0

    def skips(self, tiles: int) -> bool:
        """Whether a loop of `tiles` tiles skips any (`loop`)."""
        return tiles > 2 and self.every > 1

    def seconds_within(self, start: float, end: float) -> float:
        """The skipped tiles' seconds of the loops that started in [start, end)."""
        return sum(seconds for when, seconds in self.added if start <= when < end)

    def loop(self, tiles: Sequence[slice]) -> Iterator[tuple[int, slice]]:
        """The tiles of one loop to compute, as (index, rows), each timed while the caller computes it (between
        this generator's yields); once the loop is done, the skipped ones' seconds recorded, at the loop's start. A
        loop of at most two tiles computes them all."""
        if not self.skips(len(tiles)):
            yield from enumerate(tiles)
            return
        began, timed = time.perf_counter(), 0.0
        timed_rows = skipped_rows = 0
        for index, rows in enumerate(tiles):
            width = rows.stop - rows.start
            if not self.computes(index):
                skipped_rows += width
                continue
            started = time.perf_counter()
            yield index, rows
            if index:  # the first tile meets this shape's first calls: not a rate for the others
                timed += time.perf_counter() - started
                timed_rows += width
        self.added.append((began, timed / timed_rows * skipped_rows))


_ACTIVE: list[TileSample] = []


def active() -> TileSample | None:
    """The sample the chunked cross-entropy's tile loops follow now (None: every tile)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def sampled_tiles(every: int) -> Iterator[TileSample]:
    """Inside it, the chunked cross-entropy's forwards (and their backwards, wherever they run) compute a sample of
    their vocabulary tiles (`TileSample`); yields the sample, whose `added` seconds the caller adds back."""
    sample = TileSample(every)
    _ACTIVE.append(sample)
    try:
        yield sample
    finally:
        _ACTIVE.remove(sample)

"""A run's own windows and its estimate over them: the micro-batch shapes a run trains on and evaluates, and their
peaks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from looptrain.batches import token_pieces
from looptrain.estimation.estimator import bounding_windows, estimate_windows, widest
from looptrain.strategy import Strategy


def run_windows(sampler: Any, lengths: Sequence[int], collator: Any, accum_steps: int, epochs: int = 1,
                max_steps: int = 0, micro_batch_tokens: int = 0) -> list[list[tuple[int, int]]]:
    """The micro-batch shapes ``(rows, padded width)`` of every window a run trains on, in order.

    Read from the sampler's own epochs (`epoch_batches(epoch)`: no batch is built, no resume offset is
    consumed), cut into windows as the Loop cuts them (the last one of an epoch may be shorter; with
    `micro_batch_tokens`, each batch into its pieces, `looptrain.batches.token_pieces`), and stopped after
    `max_steps` windows when that is set. A collator that packs each batch's samples into rows (``--batch-packing on``:
    `looptrain.data.packing.BatchPackingCollator`, its ``row_lengths``) gives a batch's rows, cut as
    `split_by_tokens` cuts them.
    """
    def width(batch_lengths: Sequence[int]) -> int:
        return int(collator.batch_width(batch_lengths))

    rows_of = getattr(collator, "row_lengths", None)  # a collator that packs each batch (`BatchPackingCollator`)

    def micro_batches(batch: Sequence[int]) -> list[tuple[int, int]]:
        rows = [lengths[index] for index in batch]
        rows = list(rows_of(rows)) if rows_of is not None else rows
        pieces = (token_pieces(rows, micro_batch_tokens, lambda length: width([length]))
                  if micro_batch_tokens else [range(len(rows))])
        return [(len(piece), width([rows[row] for row in piece])) for piece in pieces]

    windows: list[list[tuple[int, int]]] = []
    for epoch in range(epochs):
        batches = sampler.epoch_batches(epoch)
        windows.extend([shape for batch in batches[start:start + accum_steps] for shape in micro_batches(batch)]
                       for start in range(0, len(batches), accum_steps))
        if 0 < max_steps <= len(windows):
            return windows[:max_steps]
    return windows


def evaluation_shapes(batches: Sequence[Sequence[int]], lengths: Sequence[int], collator: Any) -> list[tuple[int, int]]:
    """The evaluation batches' shapes ``(rows, padded width)`` whose peak is evaluation's: of every batch of
    `batches` (an evaluation loader's ``batch_sampler``: lists of indices), those no other batch covers in both rows
    and width (an evaluation forward's memory grows with both), widest first."""
    return widest({(len(batch), int(collator.batch_width([lengths[index] for index in batch])))
                    for batch in batches if len(batch)})


def run_batches_estimate(model: Any, settings: Strategy, windows: Sequence[Sequence[tuple[int, int]]], *,
                         fresh: bool = True, max_grad_norm=1.0, num_labels: int = 2, padded: bool = True,
                         device: str = "cpu") -> int:
    """`estimate_windows` of `settings` over the batches a run will see (`run_windows`), where it sees them.

    The run's peak, not the dataset's worst case: a length-grouped sampler gives its longest batch first,
    before any optimizer state exists, so pricing that batch beside the state (as the planner does, to be
    safe under a budget) describes a moment the run never has. `bounding_windows` keeps the few windows
    that decide it. A causal LM's micro-batches of more than one row are priced padded (`padded`, as
    `estimate` says): dynamic padding pads nearly every one of them. `device`: the run's (`estimate`'s).
    """
    return run_batches_peaks(model, settings, windows, fresh=fresh, max_grad_norm=max_grad_norm,
                             num_labels=num_labels, padded=padded, device=device)["peak_memory_bytes"]


def run_batches_peaks(model: Any, settings: Strategy, windows: Sequence[Sequence[tuple[int, int]]], *,
                      evaluation: Sequence[tuple[int, int]] = (), fresh: bool = True, max_grad_norm=1.0,
                      num_labels: int = 2, padded: bool = True, device: str = "cpu",
                      cache: bool | str = True) -> dict[str, int | None]:
    """`run_batches_estimate` with evaluation priced after the windows, at `evaluation`'s shapes
    (`evaluation_shapes`): ``training_peak_bytes``, ``evaluation_peak_bytes`` (None without evaluation) and
    ``peak_memory_bytes``, the higher of the two: the whole run's; ``kernel_scratch_bytes``, what RSS holds above
    that inside matmul kernels (`estimate`). `cache`: `estimate`'s (``"only"``: read the estimate cache, LookupError
    where it does not hold this estimate)."""
    result = estimate_windows(model, bounding_windows(windows, fresh=fresh), settings, num_labels=num_labels,
                              max_grad_norm=max_grad_norm, padded=padded, device=device, evaluation=evaluation,
                              cache=cache)
    return {key: result.get(key) for key in ("peak_memory_bytes", "training_peak_bytes", "evaluation_peak_bytes",
                                             "kernel_scratch_bytes")}

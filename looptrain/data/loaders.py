"""Loaders: the training and evaluation DataLoaders, and padding_stats to measure a batching plan."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from looptrain.data.collate import DynamicPaddingCollator
from looptrain.data.errors import DataError
from looptrain.data.samplers import (
    LengthGroupedSampler,
    RandomBatchSampler,
    ShardedBatchSampler,
    TokenBudgetBatchSampler,
    eval_batches,
)


def _dataset_lengths(dataset: Any) -> np.ndarray:
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        lengths = [len(dataset[index]["input_ids"]) for index in range(len(dataset))]
    return np.asarray(lengths, dtype=np.int64)


def make_train_loader(
    dataset: Any,
    batch_size: int,
    collator: Any,
    grouping: str = "random",
    max_tokens: int | None = None,
    seed: int = 0,
    num_workers: int = 0,
    *,
    drop_last: bool = False,
    max_batch_size: int | None = None,
    mega_batch_multiplier: int = 50,
    num_replicas: int | None = None,
    rank: int | None = None,
    pin_memory: bool = False,
) -> DataLoader:
    """Builds the training DataLoader for one of the three batching modes.

    Args:
        dataset: A :class:`TokenizedDataset` (or any dataset of dicts with ``input_ids``).
        batch_size: Samples per batch (ignored by ``"tokens"``, which uses ``max_batch_size``).
        collator: Usually a :class:`DynamicPaddingCollator`.
        grouping: ``"random"`` (shuffled batches), ``"length"`` (length-grouped) or ``"tokens"``
            (token budget; needs ``max_tokens``).
        max_tokens: Padded-token budget per batch for ``"tokens"``.
        seed: Sampler seed; call ``loader.batch_sampler.set_epoch(epoch)`` each epoch.
        num_workers: DataLoader worker processes.
        drop_last: Drop the last short batch (random and length modes).
        max_batch_size: Optional cap on samples per batch in ``"tokens"`` mode.
        mega_batch_multiplier: Sorting window in batches for ``"length"`` mode.
        num_replicas: World size (default: torch.distributed's, else 1).
        rank: This rank (default: torch.distributed's, else 0).
        pin_memory: Pin host memory for faster host-to-GPU copies.

    Returns:
        A DataLoader whose ``batch_sampler`` has ``set_epoch`` and ``skip_batches``.

    Raises:
        DataError: On an unknown grouping or ``"tokens"`` without ``max_tokens``.
    """
    if grouping == "random":
        sampler: ShardedBatchSampler = RandomBatchSampler(
            len(dataset), batch_size, seed=seed, drop_last=drop_last, num_replicas=num_replicas, rank=rank
        )
    elif grouping == "length":
        sampler = LengthGroupedSampler(
            _dataset_lengths(dataset), batch_size, seed=seed, mega_batch_multiplier=mega_batch_multiplier,
            drop_last=drop_last, num_replicas=num_replicas, rank=rank,
        )
    elif grouping == "tokens":
        if not max_tokens:
            raise DataError("grouping='tokens' needs max_tokens=N (--max-tokens)")
        sampler = TokenBudgetBatchSampler(
            _dataset_lengths(dataset), max_tokens, seed=seed, max_batch_size=max_batch_size,
            pad_to_multiple_of=getattr(collator, "pad_to_multiple_of", None),
            num_replicas=num_replicas, rank=rank,
        )
    else:
        raise DataError(f"grouping must be 'random', 'length' or 'tokens', got {grouping!r}")
    return DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collator, num_workers=num_workers, pin_memory=pin_memory
    )


def make_eval_loader(
    dataset: Any,
    batch_size: int,
    collator: Any,
    sort_by_length: bool = True,
    num_workers: int = 0,
    *,
    num_replicas: int | None = None,
    rank: int | None = None,
) -> DataLoader:
    """Builds an evaluation DataLoader; sorted by length (uniform padding) unless told otherwise.

    Predictions come out in batch order: use ``loader.batch_sampler`` (a list of index lists) to
    map them back. Under several ranks every sample is evaluated exactly once across ranks, and
    every rank runs the same number of batches (see :func:`eval_batches`).

    Args:
        dataset: A :class:`TokenizedDataset` (or any dataset of dicts with ``input_ids``).
        batch_size: Samples per batch.
        collator: Usually a :class:`DynamicPaddingCollator`.
        sort_by_length: Sort the samples by length, longest first; False keeps data order.
        num_workers: DataLoader worker processes.
        num_replicas: World size (default: torch.distributed's, else 1).
        rank: This rank (default: torch.distributed's, else 0).

    Returns:
        A DataLoader whose ``batch_sampler`` is this rank's list of batches.
    """
    lengths = _dataset_lengths(dataset) if sort_by_length else None
    batches = eval_batches(len(dataset), batch_size, lengths, num_replicas=num_replicas, rank=rank)
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collator, num_workers=num_workers)


def padding_stats(
    batches_or_sampler: Iterable[Sequence[int]],
    lengths: Sequence[int],
    padding: str = "dynamic",
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> tuple[dict[str, float], str]:
    """Counts real and padded tokens for a batching plan, without building any tensor.

    Args:
        batches_or_sampler: Lists of sample indices, a looptrain.data sampler (its current
            epoch is read with ``epoch_batches()``, leaving any resume offset untouched), or a
            DataLoader built on one (``make_train_loader``).
        lengths: Token count per sample.
        padding: ``"dynamic"`` or ``"max_length"``, as in the collator.
        max_length: Pad width for ``"max_length"``; a cap for ``"dynamic"``.
        pad_to_multiple_of: As in the collator.

    Returns:
        ``(stats, line)``: ``stats`` has ``num_batches``, ``num_samples``, ``real_tokens``,
        ``padded_tokens`` (tensor elements after padding, real ones included), ``padding_tokens``,
        ``padding_ratio`` (padded / real, 1.0 means no waste), ``mean_tokens_per_batch`` and
        ``max_tokens_per_batch``; ``line`` is a one-line summary for the log.
    """
    collator = DynamicPaddingCollator(0, padding=padding, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of)
    # A DataLoader is read through its batch sampler; our samplers without consuming a resume offset.
    source = getattr(batches_or_sampler, "batch_sampler", None) or batches_or_sampler
    batches = source.epoch_batches() if hasattr(source, "epoch_batches") else source
    lengths_array = np.asarray(lengths, dtype=np.int64)
    real = padded = largest = num_batches = num_samples = 0
    for batch in batches:
        batch_lengths = lengths_array[list(batch)]
        tokens = collator.batch_width(batch_lengths.tolist()) * len(batch_lengths)
        real += int(batch_lengths.sum())
        padded += tokens
        largest = max(largest, tokens)
        num_batches += 1
        num_samples += len(batch_lengths)
    stats = {
        "num_batches": num_batches,
        "num_samples": num_samples,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_tokens": padded - real,
        "padding_ratio": padded / real if real else float("nan"),
        "mean_tokens_per_batch": padded / num_batches if num_batches else 0.0,
        "max_tokens_per_batch": largest,
    }
    line = (
        f"padding ({padding}): {num_samples} samples in {num_batches} batches, {real:,} real tokens, "
        f"{padded:,} padded tokens (ratio {stats['padding_ratio']:.2f}x, "
        f"{100.0 * (padded - real) / max(padded, 1):.1f}% padding), "
        f"{stats['mean_tokens_per_batch']:.0f} tokens/batch mean, {largest} max"
    )
    return stats, line

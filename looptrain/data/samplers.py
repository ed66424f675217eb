"""Batch samplers: per-epoch deterministic, rank-sharded batches (random, length-grouped, token budget).

All of them share :class:`ShardedBatchSampler`'s interface: ``set_epoch(epoch)`` picks the epoch's
order, ``skip_batches(n)`` resumes in mid-epoch, ``epoch_batches()`` reads a whole epoch. The
evaluation batches (:func:`eval_batches`) come from the same sorting and rank-splitting helpers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from looptrain.data.errors import DataError


def _default_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class ShardedBatchSampler:
    """Shared machinery: per-epoch deterministic global batches, rank sharding, mid-epoch resume.

    Subclasses build the epoch's *global* batch list (identical on every rank, since it depends only
    on seed and epoch). This class then:

    1. makes the batch count a multiple of ``num_replicas`` so that every rank runs the same number of
       steps (``uneven="split"``: split the batches with the most samples in two, so every sample is
       still seen exactly once; ``uneven="drop"``: drop the last batches);
    2. groups consecutive batches ``num_replicas`` at a time (ranks at the same step get neighbouring
       batches: similar lengths, so no rank waits long for another in DDP) and shuffles the groups;
    3. on epoch 0, moves the group holding the longest batch to the front (an OOM shows at once);
    4. gives rank ``r`` the ``r``-th batch of every group, and skips ``skip_batches(n)`` batches.
    """

    shuffle_batch_order = True  # shuffle the order of the (groups of) batches each epoch

    def __init__(
        self,
        *,
        seed: int,
        shuffle: bool,
        num_replicas: int | None,
        rank: int | None,
        uneven: str,
        lengths: Sequence[int] | None,
        longest_first: bool,
    ):
        default_replicas, default_rank = _default_world()
        self.num_replicas = default_replicas if num_replicas is None else int(num_replicas)
        self.rank = default_rank if rank is None else int(rank)
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise DataError(
                f"rank must be in [0, num_replicas), got rank={self.rank}, num_replicas={self.num_replicas}"
            )
        if uneven not in ("split", "drop"):
            raise DataError(f"uneven must be 'split' or 'drop', got {uneven!r}")
        self.seed = int(seed)
        self.shuffle = shuffle
        self.uneven = uneven
        self.lengths = np.asarray(lengths, dtype=np.int64) if lengths is not None else None
        self.longest_first = longest_first and lengths is not None
        self.epoch = 0
        self._start_batch = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    # ---- subclass hook ----
    def _global_batches(self, rng: np.random.Generator) -> list[list[int]]:
        raise NotImplementedError

    # ---- public interface ----
    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next iteration yields (call before each epoch)."""
        self.epoch = int(epoch)

    def skip_batches(self, num_batches: int) -> None:
        """Makes the next iteration start at batch ``num_batches`` of the current epoch (resume).

        The offset applies to one iteration only; ``len()`` reports the remaining batches until then.
        """
        if num_batches < 0:
            raise DataError(f"cannot skip a negative number of batches ({num_batches})")
        self._start_batch = int(num_batches)

    def epoch_batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's full batch list for an epoch (the current one by default), without skipping."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._rank_batches(epoch))
        return self._cache[1]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches()
        start, self._start_batch = self._start_batch, 0  # the offset is for this one iteration
        for batch in batches[start:]:
            yield list(batch)

    def __len__(self) -> int:
        return max(len(self.epoch_batches()) - self._start_batch, 0)

    @property
    def batches_per_epoch(self) -> int:
        """Full number of batches per epoch on this rank, whatever the resume offset."""
        return len(self.epoch_batches())

    # ---- the shared pipeline ----
    def _rank_batches(self, epoch: int) -> list[list[int]]:
        # SeedSequence of (seed, epoch): distinct streams, no collision between seed 0/epoch 1 and seed 1/epoch 0.
        rng = np.random.default_rng([self.seed, epoch])
        batches = self._equalize(self._global_batches(rng))
        replicas = self.num_replicas
        groups = [batches[start : start + replicas] for start in range(0, len(batches), replicas)]
        if self.shuffle and self.shuffle_batch_order:
            order = rng.permutation(len(groups))
            groups = [groups[index] for index in order]
        if epoch == 0 and self.longest_first and groups:
            groups.insert(0, groups.pop(self._longest_group(groups)))
        return [group[self.rank] for group in groups]

    def _equalize(self, batches: list[list[int]]) -> list[list[int]]:
        replicas = self.num_replicas
        if replicas == 1 or len(batches) % replicas == 0:
            return batches
        if self.uneven == "drop":
            return batches[: len(batches) - len(batches) % replicas]
        return _split_until_divisible(batches, replicas)

    def _longest_group(self, groups: list[list[list[int]]]) -> int:
        assert self.lengths is not None

        def cost(group: list[list[int]]) -> tuple[int, int]:
            # Longest sequence first (attention memory grows with it), then most padded tokens.
            longest = max(int(self.lengths[batch].max()) for batch in group)
            padded = max(int(self.lengths[batch].max()) * len(batch) for batch in group)
            return longest, padded

        return max(range(len(groups)), key=lambda index: cost(groups[index]))


class RandomBatchSampler(ShardedBatchSampler):
    """Shuffled fixed-size batches with the same epoch / resume / rank interface as the others.

    Use as ``DataLoader(dataset, batch_sampler=RandomBatchSampler(len(dataset), 8))``.

    The samples are shuffled once and cut into consecutive batches, in that order: `k` consecutive
    batches of size `b` hold exactly the samples of one batch of size `k × b`. So batch 2 with
    accumulation 4 trains on the same windows as batch 8 (and N ranks × b as one rank × N·b).
    """

    shuffle_batch_order = False  # the samples are already in random order; a second shuffle would break the above

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        uneven: str = "split",
    ):
        """Builds the sampler.

        Args:
            num_samples: Data set size.
            batch_size: Samples per batch on each rank.
            shuffle: Shuffle samples (and batch order) each epoch; False gives sequential batches.
            seed: Base seed; the order depends only on (seed, epoch).
            drop_last: Drop the final short batch.
            num_replicas: World size (default: torch.distributed's, else 1).
            rank: This rank (default: torch.distributed's, else 0).
            uneven: How to make every rank run the same number of batches: ``"split"`` or ``"drop"``.
        """
        if batch_size < 1:
            raise DataError(f"batch_size must be positive, got {batch_size}")
        super().__init__(
            seed=seed, shuffle=shuffle, num_replicas=num_replicas, rank=rank, uneven=uneven,
            lengths=None, longest_first=False,
        )
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.drop_last = drop_last

    def _global_batches(self, rng: np.random.Generator) -> list[list[int]]:
        order = rng.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples)
        return _chunk(order.tolist(), self.batch_size, self.drop_last)


class LengthGroupedSampler(ShardedBatchSampler):
    """Uniform dynamic padding that still shuffles.

    Each epoch: shuffle all indices; cut them into mega-batches of
    ``mega_batch_multiplier × batch_size × num_replicas`` samples; sort each mega-batch by length
    (longest first); cut it into batches; shuffle the batches (in groups of ``num_replicas``). The
    longest batch comes first on epoch 0. Samples in a batch have similar lengths, so dynamic padding
    pads little, while the data order still changes every epoch.

    It is a *batch sampler*: ``DataLoader(dataset, batch_sampler=LengthGroupedSampler(...))``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        mega_batch_multiplier: int = 50,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        uneven: str = "split",
        longest_first: bool = True,
    ):
        """Builds the sampler.

        Args:
            lengths: Token count per sample (``TokenizedDataset.lengths``).
            batch_size: Samples per batch on each rank.
            shuffle: Shuffle (False: one global sort, longest batches first, for inference).
            seed: Base seed; the order depends only on (seed, epoch).
            mega_batch_multiplier: Batches per sorting window; larger pads less, shuffles less.
            drop_last: Drop the final short batch.
            num_replicas: World size (default: torch.distributed's, else 1).
            rank: This rank (default: torch.distributed's, else 0).
            uneven: ``"split"`` or ``"drop"``; see the class docstring of the shared base.
            longest_first: Put the longest batch first on epoch 0.
        """
        if batch_size < 1 or mega_batch_multiplier < 1:
            raise DataError(
                f"batch_size and mega_batch_multiplier must be positive, got {batch_size} and {mega_batch_multiplier}"
            )
        super().__init__(
            seed=seed, shuffle=shuffle, num_replicas=num_replicas, rank=rank, uneven=uneven,
            lengths=lengths, longest_first=longest_first,
        )
        self.batch_size = int(batch_size)
        self.mega_batch_multiplier = int(mega_batch_multiplier)
        self.drop_last = drop_last

    def _global_batches(self, rng: np.random.Generator) -> list[list[int]]:
        assert self.lengths is not None
        count = len(self.lengths)
        if not self.shuffle:
            return _chunk(_sort_by_length(np.arange(count), self.lengths), self.batch_size, self.drop_last)
        order = rng.permutation(count)
        window = self.mega_batch_multiplier * self.batch_size * self.num_replicas
        sorted_order: list[int] = []
        for start in range(0, count, window):
            sorted_order.extend(_sort_by_length(order[start : start + window], self.lengths))
        # Windows are multiples of batch_size, so only the very last batch can be short.
        return _chunk(sorted_order, self.batch_size, self.drop_last)


class TokenBudgetBatchSampler(ShardedBatchSampler):
    """Batches by padded-token budget: ``longest length in batch × batch size ≤ max_tokens``.

    Short samples get big batches, long ones small batches, so every step costs about the same
    memory. Each epoch: shuffle, cut into mega-batches of ``mega_batch_size`` samples, sort each by
    length (longest first), fill batches greedily up to the budget, shuffle the batches (in groups of
    ``num_replicas``); the longest batch first on epoch 0. A single sample longer than the budget gets
    a batch of its own (``oversized="own_batch"``, counted in ``num_oversized``) or raises
    (``oversized="error"``). The number of samples per batch varies: the loop's exact accumulation
    (Σloss / Σitems) weights them correctly.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        max_batch_size: int | None = None,
        mega_batch_size: int = 4096,
        pad_to_multiple_of: int | None = None,
        oversized: str = "own_batch",
        num_replicas: int | None = None,
        rank: int | None = None,
        uneven: str = "split",
        longest_first: bool = True,
    ):
        """Builds the sampler.

        Args:
            lengths: Token count per sample (``TokenizedDataset.lengths``).
            max_tokens: Padded-token budget per batch on each rank.
            shuffle: Shuffle (False: one global sort, for inference).
            seed: Base seed; the order depends only on (seed, epoch).
            max_batch_size: Optional cap on samples per batch.
            mega_batch_size: Samples per sorting window; larger pads less, shuffles less.
            pad_to_multiple_of: Budget with lengths rounded up like the collator rounds them.
            oversized: ``"own_batch"`` or ``"error"`` for a sample longer than ``max_tokens``.
            num_replicas: World size (default: torch.distributed's, else 1).
            rank: This rank (default: torch.distributed's, else 0).
            uneven: ``"split"`` or ``"drop"`` to give every rank the same number of batches.
            longest_first: Put the longest batch first on epoch 0.

        Raises:
            DataError: On a non-positive budget, or an oversized sample with ``oversized="error"``.
        """
        if max_tokens < 1:
            raise DataError(f"max_tokens must be positive, got {max_tokens}")
        if oversized not in ("own_batch", "error"):
            raise DataError(f"oversized must be 'own_batch' or 'error', got {oversized!r}")
        if max_batch_size is not None and max_batch_size < 1:
            raise DataError(f"max_batch_size must be positive, got {max_batch_size}")
        super().__init__(
            seed=seed, shuffle=shuffle, num_replicas=num_replicas, rank=rank, uneven=uneven,
            lengths=lengths, longest_first=longest_first,
        )
        assert self.lengths is not None
        self.max_tokens = int(max_tokens)
        self.max_batch_size = max_batch_size
        self.mega_batch_size = int(mega_batch_size)
        multiple = pad_to_multiple_of or 1
        self._budget_lengths = -(-self.lengths // multiple) * multiple
        oversized_indices = np.flatnonzero(self._budget_lengths > self.max_tokens)
        self.num_oversized = len(oversized_indices)
        if self.num_oversized and oversized == "error":
            first = int(oversized_indices[0])
            raise DataError(
                f"{self.num_oversized} sample(s) are longer than max_tokens={self.max_tokens} (e.g. sample {first} "
                f"with {int(self.lengths[first])} tokens); raise max_tokens, lower max_length, or pass "
                "oversized='own_batch'"
            )

    def _global_batches(self, rng: np.random.Generator) -> list[list[int]]:
        count = len(self._budget_lengths)
        if not self.shuffle:
            return self._fill(_sort_by_length(np.arange(count), self._budget_lengths))
        order = rng.permutation(count)
        batches: list[list[int]] = []
        for start in range(0, count, self.mega_batch_size):
            mega_batch = order[start : start + self.mega_batch_size]
            batches.extend(self._fill(_sort_by_length(mega_batch, self._budget_lengths)))
        return batches

    def _fill(self, sorted_indices: list[int]) -> list[list[int]]:
        # Sorted longest first, so the first sample of a batch sets its padded width.
        batches: list[list[int]] = []
        current: list[int] = []
        width = 0
        for index in sorted_indices:
            length = int(self._budget_lengths[index])
            full = self.max_batch_size is not None and len(current) >= self.max_batch_size
            if current and (max(width, length) * (len(current) + 1) > self.max_tokens or full):
                batches.append(current)
                current, width = [], 0
            current.append(index)
            width = max(width, length)
        if current:
            batches.append(current)
        return batches


def eval_batches(
    num_samples: int,
    batch_size: int,
    lengths: Sequence[int] | None = None,
    *,
    num_replicas: int | None = None,
    rank: int | None = None,
) -> list[list[int]]:
    """This rank's evaluation batches: every sample exactly once across ranks, as many batches on each.

    Order does not change metrics, so evaluation can sort globally and pad least. Under several
    ranks each takes every ``num_replicas``-th batch, after the largest batches are halved until
    every rank has as many.

    Args:
        num_samples: Data set size.
        batch_size: Samples per batch.
        lengths: Token count per sample. When given, batches are cut from the samples sorted by
            length, longest first (uniform padding); otherwise in data order.
        num_replicas: World size (default: torch.distributed's, else 1).
        rank: This rank (default: torch.distributed's, else 0).

    Returns:
        This rank's batches, as lists of sample indices.
    """
    default_replicas, default_rank = _default_world()
    num_replicas = default_replicas if num_replicas is None else int(num_replicas)
    rank = default_rank if rank is None else int(rank)
    if lengths is not None:
        order = _sort_by_length(np.arange(num_samples), np.asarray(lengths))
    else:
        order = list(range(num_samples))
    # Every rank runs the same number of eval batches: sharded models (FSDP2) gather parameters in every
    # forward, a collective that all ranks must join.
    batches = _split_until_divisible(_chunk(order, batch_size), num_replicas)
    return batches[rank::num_replicas]


def _split_until_divisible(batches: list[list[int]], replicas: int) -> list[list[int]]:
    """Halves the largest batches until their count divides by `replicas` (every sample kept once)."""
    if len(batches) % replicas == 0:
        return batches
    if sum(len(batch) for batch in batches) < replicas:
        raise DataError(
            f"{sum(len(batch) for batch in batches)} samples cannot give each of {replicas} ranks a batch; "
            "use fewer ranks or more data"
        )
    batches = list(batches)
    while len(batches) % replicas:
        largest = max(range(len(batches)), key=lambda index: len(batches[index]))
        batch = batches[largest]
        half = len(batch) // 2
        # Halves stay adjacent so the group structure (similar lengths) is preserved.
        batches[largest : largest + 1] = [batch[:half], batch[half:]]
    return batches


def _sort_by_length(indices: np.ndarray, lengths: np.ndarray) -> list[int]:
    # Stable sort keeps the shuffled order among equal lengths, so ties still vary by epoch.
    indices = np.asarray(indices)
    return indices[np.argsort(-lengths[indices], kind="stable")].tolist()


def _chunk(items: list[int], size: int, drop_last: bool = False) -> list[list[int]]:
    chunks = [items[start : start + size] for start in range(0, len(items), size)]
    if drop_last and chunks and len(chunks[-1]) < size:
        chunks.pop()
    return chunks

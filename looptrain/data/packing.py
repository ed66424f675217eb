"""Packing a causal LM's samples into rows: best-fit decreasing, no token attending across a sample boundary.

`pack_best_fit` groups sample indices into packs of at most ``capacity`` tokens; a `PackedDataset` is those packs
over a `TokenizedDataset` (indices into its token store, not a copy of the tokens); a `PackedCollator` pads packs into
a batch.

A packed row carries ``position_ids`` that restart at 0 at every sample and no ``attention_mask``: transformers then
derives a block-diagonal causal mask from the positions (``masking_utils.find_packed_sequence_indices``: a new
sequence wherever a position is not its predecessor's plus one), for sdpa, eager, flex and flash attention alike. It
does so only while the model holds no key/value cache, so a packed model runs with ``config.use_cache`` False
(`packing_problem` checks it). The padding that makes packs of one micro-batch as wide as the widest is one more run
of positions from 0: a sequence of its own that no real token attends to, labelled -100. Every sample's first label
is -100, so no sample's first token is predicted from the previous sample's last one: the unpacked run never scores a
first label either (the model shifts its labels), so the tokens scored are the same.
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from looptrain.data.collate import DynamicPaddingCollator
from looptrain.data.errors import DataError
from looptrain.data.store import IGNORE_INDEX, TokenizedDataset

# The attention implementations whose masks transformers builds from packed position_ids.
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: samples longest first (ties in index order), each into the open pack with the least
    room that still holds it, else into a new pack.

    Returns:
        The packs, each a list of sample indices in the order they were placed, in the order the packs were opened.

    Raises:
        DataError: A sample is longer than `capacity` (truncate at tokenization), or `capacity` < 1.
    """
    if capacity < 1:
        raise DataError(f"a pack holds at least one token (got capacity {capacity})")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > capacity:
        raise DataError(f"a sample of {int(lengths.max())} tokens does not fit a pack of {capacity}: tokenize with "
                        f"max_length={capacity} (truncation) or pack into longer rows")
    packs: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, pack index), sorted
    for index in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[index])
        slot = bisect.bisect_left(rooms, (length, -1))
        if slot < len(rooms):
            room, pack = rooms.pop(slot)
        else:
            room, pack = capacity, len(packs)
            packs.append([])
        packs[pack].append(index)
        bisect.insort(rooms, (room - length, pack))
    return packs


class PackedDataset(Dataset):
    """The samples of a causal LM's `TokenizedDataset` packed best-fit decreasing into rows of at most
    ``max_length`` tokens; an item is one pack.

    Attributes:
        source: The unpacked samples (their tokens are read from its store, never copied).
        packs: Sample indices of each pack.
        lengths: Tokens of each pack (int64), what the samplers and the estimate read as row lengths.
        num_scored: Tokens that carry a loss, the same as the source's.
    """

    def __init__(self, source: TokenizedDataset, max_length: int):
        if source.rows.trained is None:
            raise DataError("packing concatenates a causal LM's samples (token labels); this data set has one label "
                            "per sample: drop --packing")
        self.source, self.max_length = source, int(max_length)
        self.packs = pack_best_fit(source.lengths, self.max_length)
        self.lengths = np.array([int(source.lengths[pack].sum()) for pack in self.packs], dtype=np.int64)
        self.num_scored = source.num_scored
        self.num_truncated, self.num_dropped = source.num_truncated, source.num_dropped

    def __len__(self) -> int:
        return len(self.packs)

    @property
    def num_samples(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        rows = self.source.rows
        return concatenated([(rows.ids_of(sample), rows.labels_of(sample)) for sample in self.packs[index]])


def concatenated(samples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, list[int]]:
    """One packed row of (ids, labels) samples: their tokens end to end, each sample's first label -100 (never
    predicted from the previous sample's last token), ``position_ids`` restarting at 0 at every sample."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for sample_ids, sample_labels in samples:
        ids += sample_ids
        labels += [IGNORE_INDEX, *sample_labels[1:]]
        positions += range(len(sample_labels))
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


class PackedCollator:
    """Pads packs (items with ``position_ids``) into a batch of ``input_ids``, ``labels`` and ``position_ids``,
    without an ``attention_mask``: the padding is one more run of positions from 0, labelled -100. Items without
    ``position_ids`` (the unpacked evaluation set) are padded as `DynamicPaddingCollator` pads them.

    ``batch_width``, ``max_length`` and ``pad_to_multiple_of`` are `DynamicPaddingCollator`'s (the planner and the
    estimate read them).
    """

    def __init__(self, tokenizer_or_pad_id, max_length: int, pad_to_multiple_of: int | None = None):
        self.padded = DynamicPaddingCollator(tokenizer_or_pad_id, max_length=max_length,
                                             pad_to_multiple_of=pad_to_multiple_of)
        self.pad_id, self.padding = self.padded.pad_id, "dynamic"
        self.max_length, self.pad_to_multiple_of = max_length, pad_to_multiple_of

    def batch_width(self, lengths: Sequence[int]) -> int:
        return self.padded.batch_width(lengths)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise DataError("cannot collate an empty batch; check the batch sampler")
        if "position_ids" not in features[0]:
            return self.padded(features)
        width = self.batch_width([len(feature["input_ids"]) for feature in features])
        input_ids = torch.full((len(features), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.arange(width).repeat(len(features), 1)
        for row, feature in enumerate(features):
            length = len(feature["input_ids"])
            input_ids[row, :length] = torch.tensor(feature["input_ids"], dtype=torch.long)
            labels[row, :length] = torch.tensor(feature["labels"], dtype=torch.long)
            position_ids[row, :length] = torch.tensor(feature["position_ids"], dtype=torch.long)
            position_ids[row, length:] = torch.arange(width - length)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


class BatchPackingCollator:
    """``--batch-packing on``: each batch's samples packed among themselves, best-fit decreasing, into rows of at most
    ``max_length`` tokens (`pack_best_fit`), collated as `PackedCollator` collates packs.

    A batch holds the same samples as without it, so every micro-batch and every update sums the same tokens' losses
    over the same scored tokens: the run's math is the unpacked run's (docs/causal_lm.md). The rows of a batch cut by
    ``--micro-batch-tokens`` are cut as rows (`looptrain.batches.split_by_tokens` reads a packed row's length from its
    positions). `pad_id`, `max_length`, `pad_to_multiple_of` and `padding` are the unpacked collator's.
    """

    def __init__(self, collator: DynamicPaddingCollator):
        self.unpacked = collator
        self.packed = PackedCollator(collator.pad_id, collator.max_length, collator.pad_to_multiple_of)
        self.pad_id, self.padding = collator.pad_id, "dynamic"
        self.max_length, self.pad_to_multiple_of = collator.max_length, collator.pad_to_multiple_of

    def batch_width(self, lengths: Sequence[int]) -> int:
        return self.packed.batch_width(lengths)

    def row_lengths(self, lengths: Sequence[int]) -> list[int]:
        """The lengths of the rows a batch of samples this long packs into."""
        return [int(sum(lengths[index] for index in pack)) for pack in pack_best_fit(lengths, self.max_length)]

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise DataError("cannot collate an empty batch; check the batch sampler")
        packs = pack_best_fit([len(feature["input_ids"]) for feature in features], self.max_length)
        return self.packed([concatenated([(features[index]["input_ids"], features[index]["labels"])
                                          for index in pack]) for pack in packs])


def packing_problem(model: Any) -> str | None:
    """Why `model`'s attention cannot keep packed samples apart, in one line naming the fix; None when it can.

    Asked of the model itself, not of its class name: with its ``config.use_cache`` off (a key/value cache turns
    transformers' packed-sequence detection off), two 2-token samples packed into one row must give the second
    sample's logits it gets alone. That holds where the transformer builds its causal mask with transformers'
    ``create_causal_mask`` from the ``position_ids`` (Llama, Qwen2, GPT-2, ... in transformers 5), and not for
    BLOOM's ALiBi or a model that builds its own mask. Leaves ``config.use_cache`` off when it can.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its base
    name, config = type(base).__name__, getattr(base, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION:
        return (f"--packing needs attention that transformers masks from position_ids ({', '.join(PACKED_ATTENTION)});"
                f" {name} uses {implementation!r}: load it with attn_implementation='sdpa' or drop --packing")
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return f"--packing restarts position_ids at every sample, and {name} takes no position_ids: drop --packing"
    config.use_cache = False
    if not _keeps_samples_apart(base):
        return (f"--packing keeps samples apart through the causal mask transformers builds from position_ids, and "
                f"{name} does not build its mask that way: drop --packing (pad instead)")
    return None


def _keeps_samples_apart(model: Any) -> bool:
    """Whether the second of two packed samples gets the logits it gets alone (eval mode, no gradients)."""
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4]], device=device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1]], device=device)).logits[0, 2:]
            alone = model(input_ids=ids[:, 2:]).logits[0]
    finally:
        model.train(training)
    tolerance = 1e-3 if packed.dtype == torch.float32 else 3e-2  # a 16-bit model's logits: its own rounding
    return torch.allclose(packed.float(), alone.float(), rtol=tolerance,
                          atol=tolerance * float(alone.abs().max()) + 1e-5)

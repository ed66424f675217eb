"""Collation: DynamicPaddingCollator pads a list of unpadded samples into a batch of tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from looptrain.data.errors import DataError

IGNORE_INDEX = -100  # the label the loss skips: padding of token labels


class DynamicPaddingCollator:
    """Pads a list of unpadded samples into a batch of tensors.

    ``padding="dynamic"`` pads to the batch's own longest sequence (optionally rounded up to a
    multiple of ``pad_to_multiple_of``, for tensor cores, but never past ``max_length``);
    ``padding="max_length"`` pads every batch to ``max_length`` (the fixed-shape baseline).

    Returns from ``__call__`` a dict with ``input_ids`` and ``attention_mask`` (long,
    ``[batch, width]``), ``token_type_ids`` when the samples have them, and ``labels`` (long for int
    labels, float for float labels) when they have them. Padding is on the right.
    """

    def __init__(
        self,
        tokenizer_or_pad_id,
        padding: str = "dynamic",
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
    ):
        """Builds the collator.

        Args:
            tokenizer_or_pad_id: A tokenizer with a ``pad_token_id``, or the pad id itself.
            padding: ``"dynamic"`` or ``"max_length"``.
            max_length: Pad width for ``"max_length"``; a cap for ``"dynamic"``.
            pad_to_multiple_of: Round dynamic widths up to a multiple of this (8 suits fp16 tensor cores).

        Raises:
            DataError: On an unknown padding mode, ``"max_length"`` without ``max_length``, or a
                tokenizer without a pad token.
        """
        if padding not in ("dynamic", "max_length"):
            raise DataError(f"padding must be 'dynamic' or 'max_length', got {padding!r}")
        if padding == "max_length" and not max_length:
            raise DataError("padding='max_length' needs max_length=N (--max-length); or use padding='dynamic'")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise DataError(f"pad_to_multiple_of must be positive, got {pad_to_multiple_of}")
        if isinstance(tokenizer_or_pad_id, int):
            pad_id = tokenizer_or_pad_id
        else:
            pad_id = getattr(tokenizer_or_pad_id, "pad_token_id", None)
            if pad_id is None:
                raise DataError(
                    "the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos_token) "
                    "or pass the pad id to DynamicPaddingCollator"
                )
        self.pad_id = int(pad_id)
        self.padding = padding
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of

    def batch_width(self, lengths: Sequence[int]) -> int:
        """Width the batch of these sequence lengths is padded to."""
        if self.padding == "max_length":
            return int(self.max_length)
        width = int(max(lengths))  # a Python int also where the lengths are numpy's (TokenizedDataset.lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        if self.max_length:
            width = min(width, max(self.max_length, int(max(lengths))))
        return width

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise DataError("cannot collate an empty batch; check the batch sampler")
        sequences = [_as_list(feature["input_ids"]) for feature in features]
        lengths = [len(sequence) for sequence in sequences]
        width = self.batch_width(lengths)
        if max(lengths) > width:
            raise DataError(
                f"a sequence of {max(lengths)} tokens exceeds max_length={width}; "
                "tokenize with the same max_length (truncation) or raise max_length"
            )
        batch_size = len(features)
        input_ids = torch.full((batch_size, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
        has_token_types = "token_type_ids" in features[0]
        token_type_ids = torch.zeros((batch_size, width), dtype=torch.long) if has_token_types else None
        for row, (sequence, length) in enumerate(zip(sequences, lengths)):
            input_ids[row, :length] = torch.tensor(sequence, dtype=torch.long)
            attention_mask[row, :length] = 1
            if token_type_ids is not None:
                token_type_ids[row, :length] = torch.tensor(_as_list(features[row]["token_type_ids"]))
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            batch["token_type_ids"] = token_type_ids
        if "labels" in features[0] and _is_sequence(features[0]["labels"]):
            batch["labels"] = torch.full((batch_size, width), IGNORE_INDEX, dtype=torch.long)
            for row, feature in enumerate(features):
                token_labels = _as_list(feature["labels"])
                batch["labels"][row, :len(token_labels)] = torch.tensor(token_labels, dtype=torch.long)
        elif "labels" in features[0]:
            labels = [feature["labels"] for feature in features]
            dtype = torch.float32 if isinstance(labels[0], float) else torch.long
            batch["labels"] = torch.tensor(labels, dtype=dtype)
        return batch


def _is_sequence(value: Any) -> bool:
    """Token labels (a list, tuple or 1-D array per sample) rather than one label per sample."""
    return isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) == 1


def _as_list(values: Any) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)

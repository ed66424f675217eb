"""The token store: a tokenized data set's samples in flat numpy arrays (TokenizedDataset, TokenRows, TokenRowsBuilder).

A Python list spends an 8-byte pointer on every token and a 28-byte int object on every id past 256. The store keeps
all samples' ids end to end in one array (uint16 while every id fits, else int32) with one int64 offset a sample;
a causal LM's token labels as one bool a token, ``trained`` (its label is then its own id, else -100: the model
shifts the labels itself, so a label is always the id or ignored); token types as uint8. Samples come out as lists of
ints, as a tokenizer returns them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

IGNORE_INDEX = -100  # a label the loss skips (transformers' and torch's cross-entropy default)
_ID_DTYPES = (np.uint16, np.int32, np.int64)  # the narrowest that holds every id is kept
_TYPE_DTYPES = (np.uint8, np.int32, np.int64)
_PACK_TOKENS = 1 << 16  # tokens held as Python lists before they are packed into arrays


class TokenRows:
    """Samples of unpadded tokens in flat arrays: sample ``i`` is ``ids[offsets[i]:offsets[i + 1]]``.

    Attributes:
        ids: Every sample's token ids, end to end.
        offsets: int64, one more than there are samples: where each sample starts, and the end.
        trained: bool per token, or None: where the token's label is its id (elsewhere -100). None when the
            samples carry no token labels (a classifier's).
        token_types: The token type of each token, or None.
    """

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, trained: np.ndarray | None = None,
                 token_types: np.ndarray | None = None):
        self.ids, self.offsets, self.trained, self.token_types = ids, offsets, trained, token_types

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Token count of each sample (int64)."""
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold."""
        return sum(array.nbytes for array in (self.ids, self.offsets, self.trained, self.token_types)
                   if array is not None)

    def _span(self, index: int) -> slice:
        index = range(len(self))[index]  # negative indices count from the end; past the end is an IndexError
        return slice(int(self.offsets[index]), int(self.offsets[index + 1]))

    def ids_of(self, index: int) -> list[int]:
        return self.ids[self._span(index)].tolist()

    def labels_of(self, index: int) -> list[int]:
        """The sample's token labels: its id where trained, -100 elsewhere."""
        span = self._span(index)
        labels = self.ids[span].astype(np.int64)
        labels[~self.trained[span]] = IGNORE_INDEX
        return labels.tolist()

    def token_types_of(self, index: int) -> list[int]:
        return self.token_types[self._span(index)].tolist()


class TokenRowsBuilder:
    """Collects samples one at a time, as a tokenizer returns them (lists of ints), and packs them into flat arrays
    every few thousand tokens: the corpus is never held as Python lists. ``rows()`` concatenates the packs once. The
    ids are kept as uint16 until one does not fit (a vocabulary past 65,536), then as int32.

    Every sample comes with token labels, or none does (and the same for token types).
    """

    def __init__(self):
        self._ids = _Column(_ID_DTYPES)
        self._types = _Column(_TYPE_DTYPES)
        self._trained = _Column((np.bool_,))
        self._lengths = _Column((np.int64,))
        self._pending: tuple[list, list, list] = ([], [], [])
        self._pending_tokens = 0
        self._count = 0
        self._has: tuple[bool, bool] | None = None  # (token labels, token types), fixed by the first sample

    def __len__(self) -> int:
        return self._count

    def add(self, ids: Sequence[int], labels: Sequence[int] | None = None,
            token_types: Sequence[int] | None = None) -> None:
        """One sample: its ids, and (where the samples have them) its token labels (each the id or -100) and types.

        Raises:
            ValueError: When labels or types are given for some samples and not others, or differ in length
                from the ids.
        """
        has = (labels is not None, token_types is not None)
        if self._has is None:
            self._has = has
        if has != self._has:
            raise ValueError("every sample needs token labels (and token types) if any sample has them")
        for values in (labels, token_types):
            if values is not None and len(values) != len(ids):
                raise ValueError(f"a sample of {len(ids)} ids has {len(values)} token labels or types")
        for pending, values in zip(self._pending, (ids, labels, token_types)):
            if values is not None:
                pending.append(values)
        self._count += 1
        self._pending_tokens += len(ids)
        if self._pending_tokens >= _PACK_TOKENS:
            self._pack()

    def _pack(self) -> None:
        """The pending samples into arrays (checked: a label is its token's id or -100)."""
        ids_rows, label_rows, type_rows = self._pending
        if not ids_rows:
            return
        lengths = np.fromiter(map(len, ids_rows), dtype=np.int64, count=len(ids_rows))
        ids = _flat(ids_rows, int(lengths.sum()))
        self._ids.add(ids)
        self._lengths.add(lengths)
        if label_rows:
            labels = _flat(label_rows, len(ids))
            trained = labels != IGNORE_INDEX
            if not np.array_equal(labels[trained], ids[trained]):
                raise ValueError("a token label is neither its token's id nor -100; the store keeps causal-LM "
                                 "labels (the model shifts them itself), not labels of another kind")
            self._trained.add(trained)
        if type_rows:
            self._types.add(_flat(type_rows, len(ids)))
        self._pending = ([], [], [])
        self._pending_tokens = 0

    def rows(self) -> TokenRows:
        """The samples added so far, in flat arrays."""
        self._pack()
        has_labels, has_types = self._has or (False, False)
        lengths = self._lengths.array()
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return TokenRows(self._ids.array(), offsets, self._trained.array() if has_labels else None,
                         self._types.array() if has_types else None)

    def dataset(self, labels: Sequence[Any] | None = None, **details: Any) -> TokenizedDataset:
        """A TokenizedDataset of the samples added; ``labels``: one per sample (a classifier's), or None.
        ``details``: TokenizedDataset's keyword arguments (``num_truncated``, ``max_length``, ...)."""
        return TokenizedDataset(self.rows(), None, labels, **details)


class _Column:
    """One flat array built a pack at a time, in the narrowest of ``dtypes`` that holds every value so far."""

    def __init__(self, dtypes: tuple):
        self._dtypes = dtypes
        self._level = 0
        self._packs: list[np.ndarray] = []

    def add(self, values: np.ndarray) -> None:
        while values.size and self._level + 1 < len(self._dtypes) and not _fits(values, self._dtypes[self._level]):
            self._level += 1
            self._packs = [pack.astype(self._dtypes[self._level]) for pack in self._packs]
        self._packs.append(values.astype(self._dtypes[self._level]))

    def array(self) -> np.ndarray:
        array = np.concatenate(self._packs) if self._packs else np.zeros(0, dtype=self._dtypes[self._level])
        self._packs = [array]
        return array


def _fits(values: np.ndarray, dtype) -> bool:
    if dtype is np.bool_:
        return True
    limits = np.iinfo(dtype)
    return limits.min <= int(values.min()) and int(values.max()) <= limits.max


def _flat(rows: list[Sequence[int]], total: int) -> np.ndarray:
    """The rows end to end, as int64."""
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)


class _RowView(Sequence):
    """A read-only list of the samples' token lists (``TokenizedDataset.input_ids``), built per access."""

    def __init__(self, read: Callable[[int], list[int]], count: int):
        self._read, self._count = read, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._read(position) for position in range(*index.indices(self._count))]
        return self._read(index)

    def __eq__(self, other: object) -> bool:  # compares like the list of lists it stands for
        if isinstance(other, (list, tuple, _RowView)):
            return len(self) == len(other) and all(mine == theirs for mine, theirs in zip(self, other))
        return NotImplemented

    __hash__ = None  # like a list


class TokenizedDataset(Dataset):
    """Unpadded token ids per sample; ``__getitem__`` returns a dict of lists and the label (or token labels).

    The tokens live in a :class:`TokenRows` (``rows``). ``input_ids`` (and ``token_type_ids``, and a causal LM's
    ``labels``) read like lists of lists, built on access.

    Attributes:
        rows: The samples' tokens, in flat arrays.
        lengths: Token count of each sample, an int64 array (what the samplers and padding stats need).
        labels: One label per sample (a classifier's), the token labels of each sample (a causal LM's), or None.
        num_truncated: How many samples were cut at ``max_length``.
        num_dropped: How many samples were left out because truncation cut away every token they had to
            learn from (a causal LM's prompt/response sample whose prompt fills ``max_length``).
        max_length: The truncation length used.
        label_names: Carried over from the source data (None for numeric labels).
        num_scored: How many tokens carry a loss (a causal LM's labels other than -100, the first of each
            sample left out: the model shifts its labels); None for a classifier's data.
    """

    def __init__(
        self,
        input_ids: TokenRows | Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int]] | None,
        labels: Sequence[int] | Sequence[Sequence[int]] | None,
        *,
        num_truncated: int = 0,
        max_length: int | None = None,
        label_names: list[str] | None = None,
        num_dropped: int = 0,
        num_scored: int | None = None,
    ):
        """``input_ids``: a :class:`TokenRows` (then ``token_type_ids`` is None and ``labels`` one per sample or
        None), or lists of ids per sample, with ``token_type_ids`` and ``labels`` (one per sample, or token labels
        per sample: each the token's id or -100) alike, which are packed into a TokenRows."""
        if isinstance(input_ids, TokenRows):
            self.rows = input_ids
        else:
            token_labels = labels is not None and len(labels) > 0 and _is_sequence(labels[0])
            builder = TokenRowsBuilder()
            for index, ids in enumerate(input_ids):
                builder.add(ids, labels[index] if token_labels else None,
                            token_type_ids[index] if token_type_ids is not None else None)
            self.rows = builder.rows()
            labels = None if token_labels else labels
        self._sample_labels = labels
        self.lengths = self.rows.lengths
        self.num_truncated = num_truncated
        self.max_length = max_length
        self.label_names = label_names
        self.num_dropped = num_dropped
        self.num_scored = num_scored

    @property
    def input_ids(self) -> Sequence[list[int]]:
        return _RowView(self.rows.ids_of, len(self.rows))

    @property
    def token_type_ids(self) -> Sequence[list[int]] | None:
        return None if self.rows.token_types is None else _RowView(self.rows.token_types_of, len(self.rows))

    @property
    def labels(self) -> Sequence[Any] | None:
        if self.rows.trained is not None:
            return _RowView(self.rows.labels_of, len(self.rows))
        return self._sample_labels

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = self.rows.ids_of(index)
        # Unpadded, so the mask is all ones; built on demand instead of stored.
        item: dict[str, Any] = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if self.rows.token_types is not None:
            item["token_type_ids"] = self.rows.token_types_of(index)
        if self.rows.trained is not None:
            item["labels"] = self.rows.labels_of(index)
        elif self._sample_labels is not None:
            item["labels"] = self._sample_labels[index]
        return item


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) == 1

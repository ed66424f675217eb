"""Data pipeline: readers, fast tokenization, dynamic padding, length-grouped and token-budget batching.

The pieces, in the order a training run uses them:

1. :func:`read_classification_data` reads CSV / TSV / JSONL files (or any sequence of dicts, such
   as a ``datasets.Dataset``) into a small :class:`TextClassificationData`, mapping string labels to
   ids with a sorted, deterministic mapping.
2. :func:`load_tokenizer` loads a fast (Rust) tokenizer; :func:`tokenize` tokenizes in batches,
   truncates to ``max_length`` and does **not** pad, returning a :class:`TokenizedDataset`.
3. :class:`DynamicPaddingCollator` pads each batch to its own longest sequence (or to ``max_length``).
4. Three batch samplers share one interface (``set_epoch``, ``skip_batches``, ``state_dict``, rank
   sharding): :class:`RandomBatchSampler`, :class:`LengthGroupedSampler` (uniform dynamic padding
   that still shuffles) and :class:`TokenBudgetBatchSampler` (batches by padded-token budget).
5. :func:`padding_stats` measures how much padding a batching plan costs.

Every bad-input case raises :class:`DataError`, whose message names the problem and the fix.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "TextClassificationData",
    "read_classification_data",
    "load_tokenizer",
    "TokenizedDataset",
    "tokenize",
    "DynamicPaddingCollator",
    "ShardedBatchSampler",
    "RandomBatchSampler",
    "LengthGroupedSampler",
    "TokenBudgetBatchSampler",
    "make_train_loader",
    "make_eval_loader",
    "padding_stats",
]

SUPPORTED_EXTENSIONS = (".csv", ".tsv", ".jsonl")
_INTEGER_PATTERN = re.compile(r"^-?\d+$")


class DataError(ValueError):
    """Bad input data or data options; the message names the problem and the fix."""


# --------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------


@dataclass
class TextClassificationData:
    """Texts (or text pairs) and integer labels, as read from one file or sequence of rows.

    Attributes:
        texts: The first (or only) text of each sample.
        labels: Integer label ids, or None when the data has no label column.
        text_pairs: The second text of each sample for pair tasks, else None.
        label_names: Label name of each id (``label_names[id]``) when labels were strings, else None.
        source: Where the data came from (a path, or a short description), for error messages.
    """

    texts: list[str]
    labels: list[int] | None
    text_pairs: list[str] | None = None
    label_names: list[str] | None = None
    source: str = "<rows>"

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_labels(self) -> int | None:
        """Number of classes: len(label_names) for string labels, else max label + 1 (None if unlabeled)."""
        if self.label_names is not None:
            return len(self.label_names)
        if not self.labels:
            return None
        return max(self.labels) + 1

    @property
    def id2label(self) -> dict[int, str]:
        """The mapping to save in a model config as ``config.id2label``."""
        if self.label_names is not None:
            return dict(enumerate(self.label_names))
        return {index: str(index) for index in range(self.num_labels or 0)}

    @property
    def label2id(self) -> dict[str, int]:
        """The mapping to save in a model config as ``config.label2id``."""
        return {name: index for index, name in self.id2label.items()}


def read_classification_data(
    source: str | os.PathLike | Iterable[Mapping[str, Any]],
    text_column: str | tuple[str, str] = "text",
    label_column: str | None = "label",
    *,
    label_names: Sequence[str] | None = None,
    num_labels: int | None = None,
    encoding: str = "utf-8",
    encoding_errors: str = "strict",
    max_samples: int | None = None,
) -> TextClassificationData:
    """Reads a text-classification data set from CSV, TSV, JSONL, or a sequence of dicts.

    Args:
        source: A ``.csv``, ``.tsv`` or ``.jsonl`` path, or any iterable of dict-like rows (a
            ``datasets.Dataset``, a list of dicts).
        text_column: The text column, or a ``(first, second)`` pair of columns for pair tasks.
        label_column: The label column, or None for unlabeled data.
        label_names: A label mapping to reuse (``train.label_names``): pass it when reading eval data
            so that eval labels get the train ids. Every label must then be one of these names.
        num_labels: When given, numeric labels must lie in ``[0, num_labels)``.
        encoding: File encoding.
        encoding_errors: ``"strict"`` (undecodable bytes are an error naming file and line) or
            ``"replace"`` (they become U+FFFD).
        max_samples: Keep only the first this many rows.

    Returns:
        The texts, optional text pairs, integer labels and (for string labels) the label names in id
        order, sorted so that the mapping is deterministic.

    Raises:
        DataError: On a missing file or column, an empty file, a bad JSON line, a null or empty text,
            an unknown label or a label out of range.
    """
    text_columns = (text_column,) if isinstance(text_column, str) else tuple(text_column)
    if len(text_columns) not in (1, 2):
        raise DataError(f"text_column must be one column name or a pair of names, got {text_column!r}")
    wanted = text_columns + ((label_column,) if label_column is not None else ())

    if isinstance(source, (str, os.PathLike)):
        source_name = os.fspath(source)
        rows, columns = _read_file(source_name, encoding, encoding_errors)
    else:
        source_name = f"<{type(source).__name__}>"
        rows, columns = _read_sequence(source)
    _check_columns(columns, wanted, source_name)

    texts: list[str] = []
    text_pairs: list[str] | None = [] if len(text_columns) == 2 else None
    raw_labels: list[Any] = []
    for location, row in rows:
        if max_samples is not None and len(texts) >= max_samples:
            break
        texts.append(_text_value(row, text_columns[0], source_name, location))
        if text_pairs is not None:
            text_pairs.append(_text_value(row, text_columns[1], source_name, location))
        if label_column is not None:
            raw_labels.append(_label_value(row, label_column, source_name, location))
    if not texts:
        raise DataError(f"{source_name} has a header but no data rows; add rows or point to the right file")

    labels: list[int] | None = None
    names: list[str] | None = None
    if label_column is not None:
        labels, names = _map_labels(raw_labels, label_names, num_labels, source_name)
    return TextClassificationData(texts, labels, text_pairs, names, source_name)


# A row's location (line number in a file, index in a sequence) travels with it for error messages.
_Rows = Iterator[tuple[str, Mapping[str, Any]]]


def _read_file(path: str, encoding: str, encoding_errors: str) -> tuple[_Rows, list[str]]:
    extension = os.path.splitext(path)[1].lower()
    if extension not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{path}: unsupported file type {extension or '(none)'!r}; use one of "
            f"{', '.join(SUPPORTED_EXTENSIONS)} or pass a sequence of dicts"
        )
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}; check the path (--data / --eval-data)")
    text = _decode_file(path, encoding, encoding_errors)
    if not text.strip():
        raise DataError(f"{path} is empty; point to a file with a header and data rows")
    if extension == ".jsonl":
        return _jsonl_rows(text, path)
    return _delimited_rows(text, "\t" if extension == ".tsv" else ",", path)


def _decode_file(path: str, encoding: str, encoding_errors: str) -> str:
    with open(path, "rb") as handle:
        raw = handle.read()
    # utf-8-sig drops the byte-order mark Excel writes, which would otherwise glue onto the first column name.
    codec = "utf-8-sig" if encoding.lower().replace("_", "-") in ("utf-8", "utf8") else encoding
    try:
        return raw.decode(codec, errors=encoding_errors)
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise DataError(
            f"{path}:{line}: bytes {raw[error.start:error.end]!r} are not valid {encoding} ({error.reason}); "
            f"re-save the file as {encoding}, pass the right encoding=..., or pass encoding_errors='replace' "
            "(--encoding-errors replace)"
        ) from error


def _delimited_rows(text: str, delimiter: str, path: str) -> tuple[_Rows, list[str]]:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = _next_record(reader, path)
    if not header:
        raise DataError(f"{path} has no header row; the first line must name the columns")
    header = [name.strip() for name in header]

    def rows() -> _Rows:
        while (values := _next_record(reader, path)) is not None:
            if not values or all(not value.strip() for value in values):
                continue  # blank lines are formatting, not samples
            # Short rows leave missing columns as None, which the null-text check then reports.
            row = dict(zip(header, values))
            yield f"line {reader.line_num}", row

    return rows(), header


def _next_record(reader: Any, path: str) -> list[str] | None:
    """The next CSV record, None at the end; csv.Error (a field over csv.field_size_limit()) becomes DataError."""
    try:
        return next(reader, None)
    except csv.Error as error:
        raise DataError(
            f"{path}:{reader.line_num}: cannot parse this line ({error}); check its quotes, or split the field"
        ) from error


def _jsonl_rows(text: str, path: str) -> tuple[_Rows, list[str]]:
    # Only CR / LF end a line: str.splitlines() also splits at U+2028, U+0085 ..., legal inside JSON strings.
    lines = re.split(r"\r\n|\r|\n", text)
    first = next((number for number, line in enumerate(lines, 1) if line.strip()), None)
    columns = list(_parse_json_line(lines[first - 1], path, first).keys()) if first else []

    def rows() -> _Rows:
        for number, line in enumerate(lines, 1):
            if line.strip():
                yield f"line {number}", _parse_json_line(line, path, number)

    return rows(), columns


def _parse_json_line(line: str, path: str, number: int) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(
            f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno}); "
            "fix the line: JSONL needs one JSON object per line"
        ) from error
    except RecursionError as error:
        raise DataError(f"{path}:{number}: JSON nested too deeply to read; flatten the line") from error
    except ValueError as error:  # an integer longer than sys.get_int_max_str_digits()
        raise DataError(f"{path}:{number}: cannot read this JSON line ({error}); fix the value") from error
    if not isinstance(value, dict):
        raise DataError(f"{path}:{number}: expected a JSON object per line, got {type(value).__name__}")
    return value


def _read_sequence(source: Iterable[Mapping[str, Any]]) -> tuple[_Rows, list[str]]:
    column_names = getattr(source, "column_names", None)  # datasets.Dataset knows its columns up front
    iterator = iter(source)
    first = next(iterator, None)
    if first is None:
        raise DataError("the data sequence is empty; pass at least one row")
    if not isinstance(first, Mapping):
        raise DataError(f"rows must be dicts (column name -> value), got {type(first).__name__}")
    columns = list(column_names) if column_names is not None else list(first.keys())

    def rows() -> _Rows:
        yield "row 0", first
        for index, row in enumerate(iterator, 1):
            if not isinstance(row, Mapping):
                raise DataError(f"row {index}: rows must be dicts, got {type(row).__name__}")
            yield f"row {index}", row

    return rows(), columns


def _check_columns(columns: Sequence[str], wanted: Sequence[str], source_name: str) -> None:
    for name in wanted:
        if name in columns:
            continue
        close = difflib.get_close_matches(name, [str(column) for column in columns], n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise DataError(
            f"column {name!r} not found in {source_name}; available columns: "
            f"{', '.join(map(str, columns)) or '(none)'}.{hint} "
            "Pass the right name with text_column=/label_column= (--text-column / --label-column)."
        )


def _text_value(row: Mapping[str, Any], column: str, source_name: str, location: str) -> str:
    if column not in row:
        raise DataError(f"{source_name} {location}: column {column!r} is missing from this row; add it")
    value = row[column]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise DataError(f"{source_name} {location}: text column {column!r} is null; fill or drop the row")
    text = str(value)
    if not text.strip():
        raise DataError(f"{source_name} {location}: text column {column!r} is empty; fill or drop the row")
    return text


def _label_value(row: Mapping[str, Any], column: str, source_name: str, location: str) -> Any:
    value = row.get(column)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{source_name} {location}: label column {column!r} is empty; fill or drop the row")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # pandas-style exports write integer labels as 1.0
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise DataError(
            f"{source_name} {location}: label {value!r} in column {column!r} is a {type(value).__name__}; "
            "labels must be strings or integers"
        )
    return value.strip() if isinstance(value, str) else value


def _map_labels(
    raw_labels: list[Any],
    label_names: Sequence[str] | None,
    num_labels: int | None,
    source_name: str,
) -> tuple[list[int], list[str] | None]:
    if label_names is not None:
        # Eval data: reuse the train mapping so that ids mean the same class in both sets.
        label2id = {str(name): index for index, name in enumerate(label_names)}
        unseen = sorted({str(label) for label in raw_labels} - set(label2id))
        if unseen:
            raise DataError(
                f"{source_name}: label(s) {', '.join(map(repr, unseen))} not seen in the training data "
                f"(known: {', '.join(map(repr, label2id))}); fix the labels or add them to the training data"
            )
        return [label2id[str(label)] for label in raw_labels], list(map(str, label_names))

    if all(isinstance(label, int) or _INTEGER_PATTERN.match(label) for label in raw_labels):
        try:
            labels = [int(label) for label in raw_labels]
        except ValueError as error:  # more digits than sys.get_int_max_str_digits() converts
            raise DataError(f"{source_name}: an integer label is too long ({error}); fix the label") from error
        for index, label in enumerate(labels):
            if label < 0 or (num_labels is not None and label >= num_labels):
                upper = f"{num_labels - 1}" if num_labels is not None else "..."
                raise DataError(
                    f"{source_name}: label {label} (sample {index}) is out of range [0, {upper}]; "
                    "fix the label or raise num_labels"
                )
        return labels, None

    # String labels: sorted so the same label set always maps to the same ids.
    names = sorted({str(label) for label in raw_labels})
    if num_labels is not None and len(names) > num_labels:
        raise DataError(
            f"{source_name}: {len(names)} distinct labels ({', '.join(names)}) but num_labels={num_labels}; "
            "raise num_labels or fix the labels"
        )
    label2id = {name: index for index, name in enumerate(names)}
    return [label2id[str(label)] for label in raw_labels], names


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike, use_fast: bool = True, allow_slow: bool = False, **kwargs: Any):
    """Loads a tokenizer with ``AutoTokenizer``, insisting on a fast (Rust) one.

    Fast tokenizers batch-encode many times faster than Python ones and report truncation exactly.

    Args:
        path: A local directory or a hub id.
        use_fast: Ask for the fast tokenizer (transformers 5 always tries fast first).
        allow_slow: Accept a slow (Python) tokenizer when no fast one exists. ``use_fast=False``
            also counts as opting in.
        **kwargs: Passed to ``AutoTokenizer.from_pretrained``.

    Returns:
        The tokenizer.

    Raises:
        DataError: When the tokenizer cannot be loaded, or only a slow one exists and slow was not
            allowed.
    """
    from transformers import AutoTokenizer

    # Never None: transformers then asks "Do you wish to run the custom code? [y/N]" on stdin, and a "y"
    # runs code shipped with the checkpoint that nobody opted in to. Callers pass True to opt in.
    kwargs.setdefault("trust_remote_code", False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(path), use_fast=use_fast, **kwargs)
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):
            raise DataError(
                f"{os.fspath(path)!r} ships its own Python code (auto_map in its config), which is not run "
                "unless you ask: pass trust_remote_code=True (--trust-remote-code) only if you trust that code"
            ) from error
        raise DataError(
            f"could not load a tokenizer from {os.fspath(path)!r} ({error}); pass a directory with "
            "tokenizer files (tokenizer.json) or a hub id that is in the local cache"
        ) from error
    if not getattr(tokenizer, "is_fast", False) and use_fast and not allow_slow:
        raise DataError(
            f"only a slow (Python) tokenizer exists for {os.fspath(path)!r} ({type(tokenizer).__name__}); "
            "it is much slower for batch tokenization. Pass allow_slow=True to use it anyway, or save a "
            "tokenizer.json (fast tokenizer) beside the model"
        )
    return tokenizer


class TokenizedDataset(Dataset):
    """Unpadded token ids per sample; ``__getitem__`` returns a dict of lists and the label.

    Attributes:
        lengths: Token count of each sample (what the samplers and padding stats need).
        num_truncated: How many samples were cut at ``max_length``.
        max_length: The truncation length used.
        label_names: Carried over from the source data (None for numeric labels).
    """

    def __init__(
        self,
        input_ids: list[list[int]],
        token_type_ids: list[list[int]] | None,
        labels: list[int] | None,
        *,
        num_truncated: int = 0,
        max_length: int | None = None,
        label_names: list[str] | None = None,
    ):
        self.input_ids = input_ids
        self.token_type_ids = token_type_ids
        self.labels = labels
        self.lengths = [len(ids) for ids in input_ids]
        self.num_truncated = num_truncated
        self.max_length = max_length
        self.label_names = label_names

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = self.input_ids[index]
        # Unpadded, so the mask is all ones; built on demand instead of stored (saves a list per sample).
        item: dict[str, Any] = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if self.token_type_ids is not None:
            item["token_type_ids"] = self.token_type_ids[index]
        if self.labels is not None:
            item["labels"] = self.labels[index]
        return item


def tokenize(
    data: TextClassificationData,
    tokenizer,
    max_length: int,
    batch_size: int = 1000,
    progress: bool = True,
) -> TokenizedDataset:
    """Tokenizes texts (or text pairs) in batches, truncating to ``max_length`` and not padding.

    Padding is left to :class:`DynamicPaddingCollator`, so each batch is padded only as far as it
    needs. The number of truncated samples is logged and kept on the result (``num_truncated``).

    Args:
        data: What :func:`read_classification_data` returned.
        tokenizer: A Hugging Face tokenizer (fast ones report truncation without a second pass).
        max_length: Longest sequence, special tokens included.
        batch_size: Texts per tokenizer call.
        progress: Show a tqdm bar; it appears only for more than one batch on a terminal.

    Returns:
        A :class:`TokenizedDataset` with ``lengths`` and ``num_truncated``.

    Raises:
        DataError: When ``max_length`` or ``batch_size`` is not a positive integer.
    """
    from tqdm.auto import tqdm

    if not isinstance(max_length, int) or max_length < 1:
        raise DataError(f"max_length must be a positive integer, got {max_length!r}")
    if batch_size < 1:
        raise DataError(f"batch_size must be positive, got {batch_size}")
    is_fast = bool(getattr(tokenizer, "is_fast", False))
    input_ids: list[list[int]] = []
    token_type_ids: list[list[int]] = []
    num_truncated = 0
    total = len(data.texts)
    # disable=None lets tqdm hide itself on non-TTY outputs (logs, CI); small inputs never show a bar.
    disable = None if progress and total > batch_size else True
    with tqdm(total=total, desc="tokenizing", unit="samples", disable=disable) as bar:
        for start in range(0, total, batch_size):
            texts = data.texts[start : start + batch_size]
            pairs = data.text_pairs[start : start + batch_size] if data.text_pairs is not None else None
            encoded = tokenizer(
                texts, pairs, truncation=True, max_length=max_length, padding=False, return_attention_mask=False
            )
            if is_fast and encoded.encodings is not None:
                # The Rust tokenizer keeps what truncation cut in `overflowing`: an exact count for free.
                num_truncated += sum(1 for encoding in encoded.encodings if encoding.overflowing)
            else:
                full = tokenizer(texts, pairs, truncation=False, padding=False, return_attention_mask=False)
                num_truncated += sum(1 for ids in full["input_ids"] if len(ids) > max_length)
            input_ids.extend(encoded["input_ids"])
            if "token_type_ids" in encoded:
                token_type_ids.extend(encoded["token_type_ids"])
            bar.update(len(texts))
    if num_truncated:
        logger.info(
            "tokenize: %d of %d samples (%.1f%%) truncated to max_length=%d",
            num_truncated, total, 100.0 * num_truncated / max(total, 1), max_length,
        )
    return TokenizedDataset(
        input_ids,
        token_type_ids if len(token_type_ids) == len(input_ids) else None,
        data.labels,
        num_truncated=num_truncated,
        max_length=max_length,
        label_names=data.label_names,
    )


# --------------------------------------------------------------------------------------------------
# Collator
# --------------------------------------------------------------------------------------------------


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
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        if self.max_length:
            width = min(width, max(self.max_length, max(lengths)))
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
        if "labels" in features[0]:
            labels = [feature["labels"] for feature in features]
            dtype = torch.float32 if isinstance(labels[0], float) else torch.long
            batch["labels"] = torch.tensor(labels, dtype=dtype)
        return batch


def _as_list(values: Any) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


# --------------------------------------------------------------------------------------------------
# Batch samplers
# --------------------------------------------------------------------------------------------------


def _default_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class ShardedBatchSampler:
    """Shared machinery: per-epoch deterministic global batches, rank sharding, resume.

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
            raise DataError(f"rank must be in [0, num_replicas), got rank={self.rank}, num_replicas={self.num_replicas}")
        if uneven not in ("split", "drop"):
            raise DataError(f"uneven must be 'split' or 'drop', got {uneven!r}")
        self.seed = int(seed)
        self.shuffle = shuffle
        self.uneven = uneven
        self.lengths = np.asarray(lengths, dtype=np.int64) if lengths is not None else None
        self.longest_first = longest_first and lengths is not None
        self.epoch = 0
        self._start_batch = 0
        self._batches_yielded = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    # ---- subclass hook ----
    def _global_batches(self, rng: np.random.Generator) -> list[list[int]]:
        raise NotImplementedError

    # ---- public interface ----
    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next iteration yields (call before each epoch)."""
        self.epoch = int(epoch)
        self._batches_yielded = 0

    def skip_batches(self, num_batches: int) -> None:
        """Makes the next iteration start at batch ``num_batches`` of the current epoch (resume).

        The offset applies to one iteration only; ``len()`` reports the remaining batches until then.
        """
        if num_batches < 0:
            raise DataError(f"cannot skip a negative number of batches ({num_batches})")
        self._start_batch = int(num_batches)
        self._batches_yielded = int(num_batches)  # the position state_dict() reports until iteration starts

    def state_dict(self, batches_done: int | None = None) -> dict[str, int]:
        """Position to resume from: ``{"epoch", "batches_done", "seed", "num_replicas"}``.

        Args:
            batches_done: Batches of this epoch the loop has consumed. Pass it: with DataLoader
                workers the sampler runs ahead of the loop, so its own count is too high.
        """
        done = self._batches_yielded if batches_done is None else int(batches_done)
        return {"epoch": self.epoch, "batches_done": done, "seed": self.seed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restores ``state_dict()``: the next iteration yields exactly the remaining batches."""
        for key in ("seed", "num_replicas"):
            if key in state and int(state[key]) != getattr(self, key):
                raise DataError(
                    f"cannot resume: the checkpoint's sampler {key}={state[key]} differs from this run's "
                    f"{getattr(self, key)}; the batch order would change. Resume with the same {key}"
                )
        self.set_epoch(int(state["epoch"]))
        self.skip_batches(int(state["batches_done"]))

    def epoch_batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's full batch list for an epoch (the current one by default), without skipping."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._rank_batches(epoch))
        return self._cache[1]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches()
        start, self._start_batch = self._start_batch, 0  # the offset is for this one iteration
        self._batches_yielded = start
        for batch in batches[start:]:
            self._batches_yielded += 1
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
        batches = _chunk(order.tolist(), self.batch_size)
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches


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
            batches.extend(self._fill(_sort_by_length(order[start : start + self.mega_batch_size], self._budget_lengths)))
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


def _dataset_lengths(dataset: Any) -> list[int]:
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None:
        return list(lengths)
    return [len(dataset[index]["input_ids"]) for index in range(len(dataset))]


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
        A DataLoader whose ``batch_sampler`` has ``set_epoch``, ``skip_batches``, ``state_dict``.

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

    Order does not change metrics, so evaluation can sort globally and pad least. Predictions come
    out in batch order: use ``loader.batch_sampler`` (a list of index lists) to map them back.
    Under several ranks each takes every ``num_replicas``-th batch, after the largest batches are
    halved until every rank has as many: every sample is evaluated exactly once across ranks.

    Args:
        num_replicas: World size (default: torch.distributed's, else 1).
        rank: This rank (default: torch.distributed's, else 0).
    """
    default_replicas, default_rank = _default_world()
    num_replicas = default_replicas if num_replicas is None else int(num_replicas)
    rank = default_rank if rank is None else int(rank)
    if sort_by_length:
        batches = _chunk(_sort_by_length(np.arange(len(dataset)), np.asarray(_dataset_lengths(dataset))), batch_size)
    else:
        batches = _chunk(list(range(len(dataset))), batch_size)
    # Every rank runs the same number of eval batches: sharded models (FSDP2) gather parameters in every
    # forward, a collective that all ranks must join.
    batches = _split_until_divisible(batches, num_replicas)
    return DataLoader(dataset, batch_sampler=batches[rank::num_replicas], collate_fn=collator, num_workers=num_workers)


# --------------------------------------------------------------------------------------------------
# Padding statistics
# --------------------------------------------------------------------------------------------------


def padding_stats(
    batches_or_sampler: Iterable[Sequence[int]],
    lengths: Sequence[int],
    padding: str = "dynamic",
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> tuple[dict[str, float], str]:
    """Counts real and padded tokens for a batching plan, without building any tensor.

    Args:
        batches_or_sampler: Lists of sample indices, one of this module's samplers (its current
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

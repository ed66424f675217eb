"""Readers: data files, datasets' directories, cached Hub datasets and sequences of dicts into a checked
TextClassificationData.

Files: CSV, TSV, JSONL, a JSON array of objects, Parquet. Directories written by ``datasets``'
``save_to_disk`` and Hub datasets already in the local datasets cache are read with ``datasets`` (imported
only for them; Parquet needs only ``pyarrow``); ``path:split`` chooses a split. Every source then goes
through the same column and label checks. String labels map to ids with a sorted, deterministic mapping.
Input that would train on the wrong data raises :class:`DataError` naming the file (and line or row) and
the fix; input that is legal but may not be what the user meant adds a one-line notice to
``TextClassificationData.notices``.
"""

from __future__ import annotations

import contextlib
import csv
import difflib
import io
import json
import math
import os
import re
import reprlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from looptrain.data.errors import DataError

SUPPORTED_EXTENSIONS = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
_DATA_EXTRA = "pip install 'looptrain[data]'"  # datasets, which brings pyarrow
# What save_to_disk writes at the top of a DatasetDict's directory, and of a Dataset's.
_SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")
# A Hub dataset id: a name or namespace/name, without a file extension (which would make it a file name).
_HUB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# What may follow a dataset directory or Hub name after ':': a split, or (Hub) a configuration and a split.
_SELECTOR_PATTERN = re.compile(r"^[\w.-]+(:[\w.-]+)?$")
_ARROW_BATCH_ROWS = 4096  # rows converted to Python at a time from Parquet and datasets' Arrow tables
_INTEGER_PATTERN = re.compile(r"^-?\d+$")
# A number as spreadsheets and pandas write it: 0.5, +1, 1e-3, .5 (not nan / inf, which read as words).
_NUMBER_PATTERN = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_EXAMPLES_PER_KIND = 3  # label values quoted in a message, per kind


@dataclass
class TextClassificationData:
    """Texts (or text pairs) and integer labels, as read from one file or sequence of rows.

    Attributes:
        texts: The first (or only) text of each sample.
        labels: Integer label ids, or None when the data has no label column.
        text_pairs: The second text of each sample for pair tasks, else None.
        label_names: Label name of each id (``label_names[id]``) when labels were strings, else None.
        source: Where the data came from (a path, or a short description), for error messages.
        notices: One-line remarks on data that was read but may not be what the user meant (the
            command line prints them).
    """

    texts: list[str]
    labels: list[int] | None
    text_pairs: list[str] | None = None
    label_names: list[str] | None = None
    source: str = "<rows>"
    notices: list[str] = field(default_factory=list)

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
    """Reads a text-classification data set from a file, a datasets directory, a cached Hub dataset or dicts.

    Args:
        source: One of
            - a ``.csv``, ``.tsv``, ``.jsonl``, ``.json`` (an array of objects, or ``{"data": [...]}``) or
              ``.parquet`` path;
            - a directory written by ``datasets``' ``save_to_disk``: ``dir`` for a ``Dataset``,
              ``dir:split`` for a ``DatasetDict`` (``dir`` alone when it holds a single split);
            - a Hub dataset id already in the local datasets cache, never downloaded: ``name``,
              ``name:split`` or ``name:config:split`` (the split may be left out when there is one);
            - any iterable of dict-like rows (a ``datasets.Dataset``, a list of dicts).
        text_column: The text column, or a ``(first, second)`` pair of columns for pair tasks.
        label_column: The label column, or None for unlabeled data.
        label_names: A label mapping to reuse (``train.label_names``): pass it when reading eval data
            so that eval labels get the train ids. Every label must then be one of these names.
        num_labels: When given, numeric labels must lie in ``[0, num_labels)``. Pass it (or
            ``label_names``) when reading eval data: training data, read with neither, must hold
            at least two classes.
        encoding: File encoding.
        encoding_errors: ``"strict"`` (undecodable bytes are an error naming file and line) or
            ``"replace"`` (they become U+FFFD).
        max_samples: Keep only the first this many rows.

    Returns:
        The texts, optional text pairs, integer labels, (for string labels) the label names in id
        order, sorted so that the mapping is deterministic, and notices about the data.

    Raises:
        DataError: On a missing file or column, a directory not written by ``save_to_disk``, a split
            not chosen or not present, a Hub dataset not in the local cache, ``datasets`` or ``pyarrow``
            not installed (for the formats that need them), a repeated column, an empty file, bad
            JSON, a JSON file that is not an array of objects, an unreadable Parquet file, a null or
            empty text, integer ids mixed with class names, an unknown label, a label out of range,
            or (reading training data: neither ``label_names`` nor ``num_labels`` given) a single class.
    """
    text_columns = (text_column,) if isinstance(text_column, str) else tuple(text_column)
    if len(text_columns) not in (1, 2):
        raise DataError(f"text_column must be one column name or a pair of names, got {text_column!r}")
    wanted = text_columns + ((label_column,) if label_column is not None else ())

    rows, columns, source_name = _open_source(source, encoding, encoding_errors)
    _check_columns(columns, wanted, source_name)

    texts: list[str] = []
    text_pairs: list[str] | None = [] if len(text_columns) == 2 else None
    raw_labels: list[str | int] = []
    label_locations: list[str] = []
    for location, row in rows:
        if max_samples is not None and len(texts) >= max_samples:
            break
        texts.append(_text_value(row, text_columns[0], source_name, location))
        if text_pairs is not None:
            text_pairs.append(_text_value(row, text_columns[1], source_name, location))
        if label_column is not None:
            raw_labels.append(_label_value(row, label_column, source_name, location))
            label_locations.append(location)
    if not texts:
        raise DataError(f"{source_name} has a header but no data rows; add rows or point to the right file")

    labels: list[int] | None = None
    names: list[str] | None = None
    notices: list[str] = []
    if label_column is not None:
        if label_names is None:
            notices.extend(_check_label_kinds(raw_labels, label_locations, source_name))
        labels, names = _map_labels(raw_labels, label_names, num_labels, source_name)
        if label_names is None and num_labels is None and names is None:
            labels, names, notice = _ids_that_skip_a_class(labels, source_name)
            notices.extend([notice] if notice else [])
        if label_names is None and num_labels is None:
            # Training data defines the classes; eval data (read with the train mapping) may hold one.
            _check_several_classes(labels, names, label_column, source_name)
    return TextClassificationData(texts, labels, text_pairs, names, source_name, notices)


# A row's location (line number in a file, index in a sequence) travels with it for error messages.
_Rows = Iterator[tuple[str, Mapping[str, Any]]]


def _open_source(source: Any, encoding: str, encoding_errors: str) -> tuple[_Rows, list[str], str]:
    """The rows and columns of a path (any format `_read_path` reads) or of in-memory rows, and the source's name."""
    if isinstance(source, (str, os.PathLike)):
        source_name = os.fspath(source)
        return (*_read_path(source_name, encoding, encoding_errors), source_name)
    return (*_read_sequence(source), f"<{type(source).__name__}>")


def _read_path(spec: str, encoding: str, encoding_errors: str) -> tuple[_Rows, list[str]]:
    """A data file, a directory save_to_disk wrote (``dir[:split]``), or a cached Hub dataset (``name[:config]:split``).

    A Hub name is any path without a file extension that does not exist: ``name``, ``namespace/name``.
    """
    path, selector = _split_selector(spec)
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, name)) for name in _SAVED_DATASET_FILES):
            return _saved_dataset_rows(path, selector, spec)
        raise DataError(
            f"{path} is a directory, not a file; pass the path of a data file inside it, or a directory written by "
            "datasets' save_to_disk (--data / --eval-data)"
        )
    if selector is not None and os.path.isfile(path):
        raise DataError(f"{spec}: {path} is a file, and ':{selector}' chooses a split of a datasets directory or a Hub "
                        f"dataset; drop ':{selector}'")
    extension = os.path.splitext(path)[1].lower()
    if not extension and not os.path.exists(path) and _HUB_NAME_PATTERN.match(path):
        return _hub_dataset_rows(path, selector, spec)
    if extension not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{path}: unsupported file type {extension or '(none)'!r}; use one of "
            f"{', '.join(SUPPORTED_EXTENSIONS)}, a directory written by datasets' save_to_disk, a Hub dataset name, "
            "or pass a sequence of dicts"
        )
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}; check the path (--data / --eval-data)")
    if extension == ".parquet":
        return _parquet_rows(path)
    text = _decode_file(path, encoding, encoding_errors)
    if not text.strip():
        raise DataError(f"{path} is empty; point to a file with a header and data rows")
    if extension == ".jsonl":
        return _jsonl_rows(text, path)
    if extension == ".json":
        return _json_array_rows(text, path)
    return _delimited_rows(text, "\t" if extension == ".tsv" else ",", path)


def _split_selector(spec: str) -> tuple[str, str | None]:
    """``dir:test`` -> (``dir``, ``test``); a path that exists, or whose ':' starts no selector, is kept whole."""
    if os.path.exists(spec) or ":" not in spec:
        return spec, None
    path, selector = spec.split(":", 1)
    if not path or not _SELECTOR_PATTERN.match(selector):
        return spec, None
    return path, selector


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
            f"re-save the file as {encoding}, or replace the bad bytes with U+FFFD: --encoding-errors replace "
            "on the command line, encoding_errors='replace' in Python (where encoding=... also reads other "
            "encodings)"
        ) from error


def _delimited_rows(text: str, delimiter: str, path: str) -> tuple[_Rows, list[str]]:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = _next_record(reader, path)
    if not header:
        raise DataError(f"{path} has no header row; the first line must name the columns")
    header = [name.strip() for name in header]
    _check_header(header, delimiter, path)

    def rows() -> _Rows:
        while (values := _next_record(reader, path)) is not None:
            if not values or all(not value.strip() for value in values):
                continue  # blank lines are formatting, not samples
            # Short rows leave missing columns as None, which the null-text check then reports. A long row would
            # lose its extra fields silently: most often an unquoted comma inside a text, which split it.
            if len(values) > len(header) and any(value.strip() for value in values[len(header):]):
                raise DataError(
                    f"{path}:{reader.line_num}: {len(values)} fields but the header names {len(header)} columns; "
                    "quote a text that contains the separator (\"a, b\"), or add the missing column names"
                )
            row = dict(zip(header, values))
            yield f"line {reader.line_num}", row

    return rows(), header


# A .csv header read as one column because another character separates it: (that character, what it is
# called, what the file looks like, the fix).
_FOREIGN_SEPARATORS = (
    ("\t", "tabs", "tab-separated", "rename it to {stem}.tsv"),
    (";", "semicolons", "semicolon-separated (a spreadsheet's CSV in some locales)",
     "save it with commas as the separator, or with tabs as {stem}.tsv"),
)


def _check_header(header: list[str], delimiter: str, path: str) -> None:
    """Refuses a .csv header that another separator (tab, semicolon) holds together, and a column name given twice.

    Blank names (the empty cells trailing separators leave) cannot be asked for, so they may repeat.
    """
    if delimiter == "," and len(header) == 1:
        for separator, plural, kind, fix in _FOREIGN_SEPARATORS:
            if separator in header[0]:
                raise DataError(f"{path}: the header {header[0]!r} is one column that contains {plural}: the file "
                                f"looks {kind}; {fix.format(stem=os.path.splitext(path)[0])}")
    _check_unique_columns(header, path, "in the header")


def _check_unique_columns(columns: Sequence[str], path: str, where: str) -> None:
    """Refuses a column name given twice (a CSV header, a Parquet schema): only the last one would be read."""
    counts = Counter(name for name in columns if name)
    for name, count in counts.items():
        if count > 1:
            positions = [str(position) for position, column in enumerate(columns, 1) if column == name]
            raise DataError(
                f"{path}: column {name!r} appears {count} times {where} (columns {', '.join(positions)}); "
                "rename or remove the duplicates: only the last one would be read"
            )


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
        value = json.loads(line, object_pairs_hook=lambda pairs: _unique_keys(pairs, f"{path}:{number}"))
    except DataError:
        raise  # a repeated key: the message is complete (and DataError is a ValueError, caught below)
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


def _unique_keys(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    """Builds one JSON object, refusing a repeated key (json.loads alone keeps the last value)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        counts = Counter(key for key, _ in pairs)
        key = next(key for key, count in counts.items() if count > 1)
        raise DataError(
            f"{where}: key {key!r} appears {counts[key]} times in one JSON object; "
            "keep one: only the last one would be read"
        )
    return value


_JSON_SHAPE = 'a JSON array of objects ([{"text": ..., "label": ...}, ...]) or {"data": [...]}'


def _json_array_rows(text: str, path: str) -> tuple[_Rows, list[str]]:
    """A .json file: an array of objects, or an object whose "data" key holds one; its rows are numbered from 0."""
    try:
        value = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
    except DataError:
        raise  # a repeated key: the message is complete (and DataError is a ValueError, caught below)
    except json.JSONDecodeError as error:
        fix = ("the file holds several JSON values: for one object per line, rename it to "
               f"{os.path.splitext(path)[0]}.jsonl" if error.msg == "Extra data" else "fix the JSON")
        raise DataError(
            f"{path}:{error.lineno}: not valid JSON ({error.msg} at column {error.colno}); {fix}"
        ) from error
    except RecursionError as error:
        raise DataError(f"{path}: JSON nested too deeply to read; flatten the file") from error
    except ValueError as error:  # an integer longer than sys.get_int_max_str_digits()
        raise DataError(f"{path}: cannot read this JSON ({error}); fix the value") from error
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        found = (f"an object with the keys {', '.join(map(repr, value))}" if isinstance(value, dict)
                 else f"a {type(value).__name__}")
        raise DataError(f"{path}: expected {_JSON_SHAPE}, got {found}; for one object per line, name the file .jsonl")
    if not value:
        raise DataError(f"{path} holds an empty JSON array; add rows or point to the right file")
    if not isinstance(value[0], dict):
        raise DataError(f"{path}: expected {_JSON_SHAPE}, but row 0 is a {type(value[0]).__name__}")

    def rows() -> _Rows:
        for index, row in enumerate(value):
            if not isinstance(row, dict):
                raise DataError(f"{path} row {index}: expected a JSON object, got {type(row).__name__}")
            yield f"row {index}", row

    return rows(), list(value[0].keys())


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


def _parquet_rows(path: str) -> tuple[_Rows, list[str]]:
    """A .parquet file's rows, numbered from 0, read with pyarrow a batch at a time."""
    try:
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise DataError(f"reading {path} (Parquet) needs pyarrow: {_DATA_EXTRA} (or pip install pyarrow)") from error
    if os.path.getsize(path) == 0:
        raise DataError(f"{path} is empty; point to a Parquet file with rows")
    try:
        parquet_file = parquet.ParquetFile(path)
        columns, num_rows = list(parquet_file.schema_arrow.names), parquet_file.metadata.num_rows
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError, its IO errors are OSErrors
        raise DataError(f"{path}: not a readable Parquet file ({_one_line(error)}); write it again (pandas: "
                        "frame.to_parquet(path)), or give it the extension of its real format") from error
    _check_unique_columns(columns, path, "in the Parquet schema")
    if num_rows == 0:
        raise DataError(f"{path} has the columns {', '.join(columns)} but no rows; point to the right file")
    return _arrow_rows(parquet_file.iter_batches(batch_size=_ARROW_BATCH_ROWS), path), columns


def _arrow_rows(batches: Iterable[Any], source_name: str) -> _Rows:
    """The rows of Arrow record batches or tables (Parquet, datasets) as dicts, numbered from 0."""
    iterator = iter(batches)
    index = 0
    while True:
        try:
            batch = next(iterator, None)
        except (OSError, ValueError) as error:  # a truncated or corrupt file, found while reading it
            raise DataError(f"{source_name}: cannot read the rows from row {index} on ({_one_line(error)}); the "
                            "file may be truncated or corrupt: write it again") from error
        if batch is None:
            return
        for row in batch.to_pylist():
            yield f"row {index}", row
            index += 1


def _one_line(error: Exception) -> str:
    """An error message from pyarrow or datasets on one line (they may span several)."""
    return " ".join(str(error).split())


def _import_datasets(reading: str) -> Any:
    """The datasets package, or a DataError that says how to install it."""
    try:
        import datasets
    except ImportError as error:
        raise DataError(f"{reading} needs the datasets package: {_DATA_EXTRA} (or pip install datasets)") from error
    return datasets


def _saved_dataset_rows(path: str, split: str | None, spec: str) -> tuple[_Rows, list[str]]:
    """A directory written by save_to_disk: a Dataset (``path``) or a DatasetDict (``path:split``)."""
    datasets = _import_datasets(f"reading {path} (a directory written by save_to_disk)")
    try:
        loaded = datasets.load_from_disk(path)
    except (OSError, ValueError) as error:  # missing or corrupt arrow files, a bad dataset_info.json / state.json
        raise DataError(f"{path}: cannot read this datasets directory ({_one_line(error)}); write it again with "
                        "save_to_disk") from error
    return _dataset_rows(_choose_split(datasets, loaded, path, split, spec), spec)


def _hub_dataset_rows(name: str, selector: str | None, spec: str) -> tuple[_Rows, list[str]]:
    """A Hub dataset read from the local datasets cache with load_dataset in offline mode: nothing is downloaded."""
    datasets = _import_datasets(f"{name} is not a file or directory; reading it as a Hub dataset")
    config, _, split = (selector or "").rpartition(":")
    with _offline(datasets):
        try:
            loaded = datasets.load_dataset(name, config or None)
        except (ConnectionError, FileNotFoundError) as error:  # not in the cache: offline, the Hub is not asked
            raise DataError(
                f"{name} is not a file or directory, and the Hub dataset {name!r} is not in the local datasets cache "
                f"({datasets.config.HF_DATASETS_CACHE}); looptrain never downloads: check the path, or download the "
                f"dataset once while online: python -c \"import datasets; datasets.load_dataset('{name}')\" (the "
                "HF_DATASETS_CACHE variable sets where the cache is)"
            ) from error
        except ValueError as error:  # most often: several configurations in the cache, or not the one asked for
            raise DataError(f"{spec}: cannot read the Hub dataset {name!r} from the local cache ({_one_line(error)}); "
                            f"if it has several configurations, name one: {name}:CONFIG:SPLIT") from error
    return _dataset_rows(_choose_split(datasets, loaded, name, split or None, spec), spec)


@contextlib.contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """load_dataset as under HF_DATASETS_OFFLINE=1: it reads the local cache and never reaches the Hub.

    datasets and huggingface_hub read the variables once, when imported; their settings are switched for the call.
    """
    from unittest import mock

    import huggingface_hub.constants

    settings = [(module, name) for module in (datasets.config, huggingface_hub.constants)
                for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(module, name)]
    with contextlib.ExitStack() as stack:  # each setting put back as it was, however the block ends
        for module, name in settings:
            stack.enter_context(mock.patch.object(module, name, True))
        yield


def _choose_split(datasets: Any, loaded: Any, where: str, split: str | None, spec: str) -> Any:
    """The Dataset to read: ``loaded`` itself, or its split ``split`` (which may be left out when there is one)."""
    if not isinstance(loaded, datasets.DatasetDict):
        if split is not None:
            raise DataError(f"{spec}: {where} holds one data set, not splits; drop ':{split}'")
        return loaded
    splits = list(loaded)
    if not splits:
        raise DataError(f"{where} holds no splits; point to the right directory or dataset")
    if split is None and len(splits) == 1:
        return loaded[splits[0]]
    example = f"{where}:{'train' if 'train' in loaded else splits[0]}"
    if split is None:
        raise DataError(f"{where} holds the splits {', '.join(splits)}; choose one, e.g. {example} "
                        "(--data / --eval-data)")
    if split not in loaded:
        raise DataError(f"{spec}: {where} has no split {split!r}; its splits are {', '.join(splits)}, e.g. {example}")
    return loaded[split]


def _dataset_rows(dataset: Any, source_name: str) -> tuple[_Rows, list[str]]:
    """A datasets.Dataset's rows, numbered from 0, converted from Arrow a batch at a time."""
    columns = list(dataset.column_names)
    if dataset.num_rows == 0:
        raise DataError(f"{source_name} has the columns {', '.join(columns)} but no rows; point to the right split")
    return _arrow_rows(dataset.with_format("arrow").iter(batch_size=_ARROW_BATCH_ROWS), source_name), columns


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


def _label_value(row: Mapping[str, Any], column: str, source_name: str, location: str) -> str | int:
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


def _is_integer_id(label: str | int) -> bool:
    return isinstance(label, int) or bool(_INTEGER_PATTERN.match(label))


def _check_label_kinds(raw_labels: list[str | int], locations: list[str], source_name: str) -> list[str]:
    """Refuses integer ids mixed with class names; returns a notice when numbers become class names.

    All integer ids (``0``, ``"1"``) are used as ids. Otherwise every label is a class name, and
    if all of them look like numbers (``0.5``, ``+1``, ``2`` mixed with ``2.5``), a notice says so.
    """
    first_location: dict[str | int, str] = {}
    for label, location in zip(raw_labels, locations):
        first_location.setdefault(label, location)
    integer_ids = [label for label in first_location if _is_integer_id(label)]
    if len(integer_ids) == len(first_location):
        return []
    words = [label for label in first_location if not _is_integer_id(label) and not _NUMBER_PATTERN.match(label)]

    def examples(values: list[str | int]) -> str:
        return ", ".join(f"{reprlib.repr(value)} ({first_location[value]})" for value in values[:_EXAMPLES_PER_KIND])

    if integer_ids and words:
        raise DataError(
            f"{source_name}: the labels mix integer ids and class names: ids {examples(integer_ids)}; "
            f"names {examples(words)}. Use one kind in every row: integer ids 0..N-1, or class names"
        )
    if words:
        return []
    numbers = [label for label in first_location if not _is_integer_id(label)]
    num_classes = len({str(label) for label in raw_labels})
    return [
        f"{source_name}: the labels look numeric but are not all integer ids ({examples(numbers)}), so they are "
        f"treated as {num_classes} class names; looptrain fine-tunes classifiers, not regressors "
        "(write class ids as integers 0..N-1)"
    ]


def _map_labels(
    raw_labels: list[str | int],
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

    if all(_is_integer_id(label) for label in raw_labels):
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


def _ids_that_skip_a_class(labels: list[int], source_name: str) -> tuple[list[int], list[str] | None, str | None]:
    """Training ids that are not 0..N-1 (``1, 2``; ``0, 1000``) become class names, with a notice.

    Used as ids they would give the classifier a class that never occurs (ids 1 and 2 make a 3-class head),
    which every macro average then counts. As names, sorted by value, they map to ids 0..N-1 and back.
    """
    present = sorted(set(labels))
    if present == list(range(len(present))):
        return labels, None, None
    names = [str(value) for value in present]
    index = {value: position for position, value in enumerate(present)}
    shown = ", ".join(f"{value} -> {index[value]}" for value in present[:_EXAMPLES_PER_KIND + 2])
    more = ", ..." if len(present) > _EXAMPLES_PER_KIND + 2 else ""
    notice = (f"{source_name}: the integer labels are not the class ids 0..{len(present) - 1} "
              f"(they are {', '.join(names[:_EXAMPLES_PER_KIND + 2])}{more}), so they are read as {len(present)} "
              f"class names: {shown}{more} (id2label in the saved config maps them back)")
    return [index[value] for value in labels], names, notice


def _check_several_classes(labels: list[int], names: list[str] | None, label_column: str, source_name: str) -> None:
    """Refuses training data whose labels take a single value: a classifier needs two classes."""
    if len(set(labels)) > 1:
        return
    only = names[labels[0]] if names is not None else labels[0]
    raise DataError(
        f"{source_name}: every label in column {label_column!r} is {reprlib.repr(only)}, but a classifier needs "
        "at least two classes; point label_column= (--label-column) at the right column, or add samples of "
        "the other classes"
    )


# ---------------------------------------------------------------------- language-modelling data (causal LMs)
LM_KINDS = ("text", "prompt_response", "messages")


@dataclass
class LanguageModelingData:
    """Samples for a causal LM, as read from one source: plain texts, prompt/response pairs, or chats.

    Attributes:
        kind: ``"text"`` (loss on every token), ``"prompt_response"`` (loss on the response only) or
            ``"messages"`` (a chat rendered with the tokenizer's chat template; loss on the last assistant turn).
        texts: The text of each sample (``"text"``), or its prompt (``"prompt_response"``); empty for chats.
        responses: The response of each sample (``"prompt_response"``), else None.
        messages: The chat of each sample (``"messages"``: a list of ``{"role", "content"}`` dicts), else None.
        source: Where the data came from, for error messages.
        columns: The columns the samples were read from, in order (for the run's identity and messages).
        notices: One-line remarks on data that was read but may not be what the user meant.
    """

    kind: str
    texts: list[str]
    responses: list[str] | None = None
    messages: list[list[dict[str, str]]] | None = None
    source: str = "<rows>"
    columns: tuple[str, ...] = ()
    notices: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.messages) if self.messages is not None else len(self.texts)

    def select(self, indices: Iterable[int]) -> LanguageModelingData:
        """The samples at ``indices``, in that order (a split, or the first N)."""
        indices = list(indices)
        return LanguageModelingData(
            self.kind,
            [self.texts[i] for i in indices] if self.texts else [],
            None if self.responses is None else [self.responses[i] for i in indices],
            None if self.messages is None else [self.messages[i] for i in indices],
            self.source, self.columns, list(self.notices),
        )


def read_lm_data(
    source: str | os.PathLike | Iterable[Mapping[str, Any]],
    *,
    text_column: str = "text",
    prompt_column: str = "prompt",
    response_column: str = "response",
    messages_column: str = "messages",
    encoding: str = "utf-8",
    encoding_errors: str = "strict",
    max_samples: int | None = None,
) -> LanguageModelingData:
    """Reads a causal LM's data from any source :func:`read_classification_data` reads, picking the kind by columns.

    The first of these that the columns hold decides: a ``messages`` column (a chat per row: a list of
    ``{"role": ..., "content": ...}`` objects, or that list as a JSON string in a CSV/TSV cell), ``prompt``
    and ``response`` columns (the SFT convention: loss on the response only), a ``text`` column (loss on
    every token). Other columns are ignored.

    Args:
        source: A file, a ``save_to_disk`` directory, a cached Hub dataset or an iterable of dict rows, as in
            :func:`read_classification_data`.
        text_column: The plain-text column.
        prompt_column: The prompt column of prompt/response data.
        response_column: The response column of prompt/response data.
        messages_column: The chat column.
        encoding: File encoding.
        encoding_errors: ``"strict"`` or ``"replace"``, as in :func:`read_classification_data`.
        max_samples: Keep only the first this many rows.

    Returns:
        A :class:`LanguageModelingData` of the kind the columns chose.

    Raises:
        DataError: For every error :func:`read_classification_data` reports about the source itself; when the
            columns hold none of the three kinds (the message names the columns found and the fix); a prompt
            column without its response column (or the reverse); a null or empty text, prompt or response; a
            chat that is not a non-empty list of role/content objects.
    """
    rows, columns, source_name = _open_source(source, encoding, encoding_errors)
    kind, wanted = _lm_kind(columns, text_column, prompt_column, response_column, messages_column, source_name)

    texts: list[str] = []
    responses: list[str] | None = [] if kind == "prompt_response" else None
    chats: list[list[dict[str, str]]] | None = [] if kind == "messages" else None
    count = 0
    for location, row in rows:
        if max_samples is not None and count >= max_samples:
            break
        if chats is not None:
            chats.append(_messages_value(row, messages_column, source_name, location))
        else:
            texts.append(_text_value(row, wanted[0], source_name, location))
            if responses is not None:
                responses.append(_text_value(row, response_column, source_name, location))
        count += 1
    if not count:
        raise DataError(f"{source_name} has a header but no data rows; add rows or point to the right file")
    return LanguageModelingData(kind, texts, responses, chats, source_name, wanted)


def _lm_kind(columns: Sequence[str], text_column: str, prompt_column: str, response_column: str,
             messages_column: str, source_name: str) -> tuple[str, tuple[str, ...]]:
    """Which kind of LM data the columns hold, and its columns; a DataError naming the columns found otherwise."""
    if messages_column in columns:
        return "messages", (messages_column,)
    has_prompt, has_response = prompt_column in columns, response_column in columns
    if has_prompt and has_response:
        return "prompt_response", (prompt_column, response_column)
    found = ", ".join(map(repr, columns)) or "(none)"
    if has_prompt != has_response:
        present, missing = (prompt_column, response_column) if has_prompt else (response_column, prompt_column)
        raise DataError(
            f"{source_name} has a {present!r} column but no {missing!r} column (columns: {found}); prompt/response "
            f"data needs both (loss on the response only): add or rename the {missing!r} column "
            f"(--prompt-column / --response-column)"
        )
    if text_column in columns:
        return "text", (text_column,)
    close = difflib.get_close_matches(text_column, [str(c) for c in columns], n=1, cutoff=0.5)
    hint = f" Did you mean --text-column {close[0]}?" if close else ""
    raise DataError(
        f"{source_name} has the columns {found}, and a causal LM's data needs a {text_column!r} column (loss on "
        f"every token), {prompt_column!r} and {response_column!r} columns (loss on the response only), or a "
        f"{messages_column!r} column (chats rendered with the tokenizer's chat template); rename a column, or name "
        f"yours with --text-column / --prompt-column / --response-column / --messages-column.{hint}"
    )


def _messages_value(row: Mapping[str, Any], column: str, source_name: str, location: str) -> list[dict[str, str]]:
    """A row's chat: a non-empty list of ``{"role": str, "content": str}`` (a JSON string of one is parsed)."""
    where = f"{source_name} {location}: column {column!r}"
    value = row.get(column)
    if isinstance(value, str):  # a chat in a CSV / TSV cell is its JSON text
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError, ValueError) as error:
            raise DataError(f"{where} is a string that is not JSON ({_one_line(error)}); write the chat as a JSON "
                            '[{"role": "user", "content": "..."}, ...]') from error
    if not isinstance(value, list) or not value:
        raise DataError(f"{where} must hold a non-empty list of messages "
                        f'[{{"role": "user", "content": "..."}}, ...], got {reprlib.repr(value)}; fix or drop the row')
    chat = []
    for index, message in enumerate(value):
        if (not isinstance(message, Mapping) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise DataError(f"{where}, message {index}: expected an object with string 'role' and 'content', got "
                            f"{reprlib.repr(message)}; fix or drop the row")
        chat.append({"role": message["role"], "content": message["content"]})
    return chat

"""Sources: where a data set's rows come from, read into ``(location, row)`` pairs and the column names.

Files: CSV, TSV, JSONL, a JSON array of objects, Parquet. Directories written by ``datasets``'
``save_to_disk`` and Hub datasets already in the local datasets cache are read with ``datasets`` (imported
only for them; Parquet needs only ``pyarrow``); ``path:split`` chooses a split. A sequence of dicts is read as
it is. What cannot be read raises :class:`DataError` naming the file (and line or row) and the fix. What the rows
must hold (columns, labels, chats) is checked by the readers (`looptrain.data.readers`), the same for every source.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import io
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
_READ_BLOCK_BYTES = 1 << 20  # bytes decoded at a time when a CSV/TSV/JSONL file is checked

# A row's location (line number in a file, index in a sequence) travels with it for error messages.
Rows = Iterator[tuple[str, Mapping[str, Any]]]


def open_source(source: Any, encoding: str, encoding_errors: str) -> tuple[Rows, list[str], str]:
    """The rows and columns of a path (any format `_read_path` reads) or of in-memory rows, and the source's name."""
    if isinstance(source, (str, os.PathLike)):
        source_name = os.fspath(source)
        return (*_read_path(source_name, encoding, encoding_errors), source_name)
    return (*_read_sequence(source), f"<{type(source).__name__}>")


def _read_path(spec: str, encoding: str, encoding_errors: str) -> tuple[Rows, list[str]]:
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
    if extension == ".json":  # one JSON value: parsed whole
        text = _decode_file(path, encoding, encoding_errors)
        if not text.strip():
            raise DataError(f"{path} is empty; point to a file with a header and data rows")
        return _json_array_rows(text, path)
    _check_text_file(path, encoding, encoding_errors)
    if extension == ".jsonl":
        return _jsonl_rows(path, encoding, encoding_errors)
    return _delimited_rows(path, encoding, encoding_errors, "\t" if extension == ".tsv" else ",")


def _split_selector(spec: str) -> tuple[str, str | None]:
    """``dir:test`` -> (``dir``, ``test``); a path that exists, or whose ':' starts no selector, is kept whole."""
    if os.path.exists(spec) or ":" not in spec:
        return spec, None
    path, selector = spec.split(":", 1)
    if not path or not _SELECTOR_PATTERN.match(selector):
        return spec, None
    return path, selector


def _is_utf8(encoding: str) -> bool:
    return encoding.lower().replace("_", "-") in ("utf-8", "utf8", "utf-8-sig")


def _codec(encoding: str) -> str:
    # utf-8-sig drops the byte-order mark Excel writes, which would otherwise glue onto the first column name.
    return "utf-8-sig" if _is_utf8(encoding) else encoding


def _decode_file(path: str, encoding: str, encoding_errors: str) -> str:
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        return raw.decode(_codec(encoding), errors=encoding_errors)
    except UnicodeDecodeError as error:
        # error.object is what the codec decoded: without the BOM utf-8-sig skipped (which holds no newline).
        raise _undecodable(path, encoding, error.object.count(b"\n", 0, error.start) + 1, error) from error


def _undecodable(path: str, encoding: str, line: int, error: UnicodeDecodeError) -> DataError:
    return DataError(
        f"{path}:{line}: bytes {error.object[error.start:error.end]!r} are not valid {encoding} ({error.reason}); "
        f"re-save the file as {encoding}, or replace the bad bytes with U+FFFD: --encoding-errors replace "
        "on the command line, encoding_errors='replace' in Python (where encoding=... also reads other "
        "encodings)"
    )


def _check_text_file(path: str, encoding: str, encoding_errors: str) -> None:
    """Refuses, before any row is read, a file whose bytes are not valid ``encoding`` and a file with no text.

    A UTF-8 file is read a block at a time (and, with strict errors, decoded to its end). Other encodings are decoded
    whole: the incremental decoders of some (utf-16's) refuse what decoding the whole file accepts.
    """
    if _is_utf8(encoding):
        with _open_utf8(path) as handle:
            has_text = _scan_utf8(handle, path, encoding, encoding_errors)
    else:
        has_text = bool(_decode_file(path, encoding, encoding_errors).strip())
    if not has_text:
        raise DataError(f"{path} is empty; point to a file with a header and data rows")


def _scan_utf8(handle: io.BufferedReader, path: str, encoding: str, encoding_errors: str) -> bool:
    """Whether the file has text (not only whitespace); reads on to its end to find bad bytes where they are errors."""
    decoder = codecs.getincrementaldecoder("utf-8")(encoding_errors)
    newlines, has_text = 0, False
    while not (has_text and encoding_errors != "strict"):
        block = handle.read(_READ_BLOCK_BYTES)
        try:
            has_text = bool(decoder.decode(block, final=not block).strip()) or has_text
        except UnicodeDecodeError as error:
            # The decoder's input: the end of the blocks before (bytes of a character they split) and this one.
            held = error.object[:max(0, len(error.object) - len(block))]
            line = newlines - held.count(b"\n") + error.object.count(b"\n", 0, error.start) + 1
            raise _undecodable(path, encoding, line, error) from error
        newlines += block.count(b"\n")
        if not block:
            break
    return has_text


@contextlib.contextmanager
def _open_utf8(path: str) -> Iterator[io.BufferedReader]:
    """The file open in binary, past its UTF-8 byte-order mark if it has one (utf-8-sig's incremental decoder would
    keep a lone first byte of the mark to itself at the end of a file, where decoding the whole file reports it)."""
    with open(path, "rb") as handle:
        if handle.read(len(codecs.BOM_UTF8)) != codecs.BOM_UTF8:
            handle.seek(0)
        yield handle


@contextlib.contextmanager
def _open_text(path: str, encoding: str, encoding_errors: str) -> Iterator[io.TextIOBase]:
    """The file as text, UTF-8 decoded a buffer at a time (other encodings whole); only CR and LF end its lines
    (newline="", as csv needs)."""
    if not _is_utf8(encoding):
        yield io.StringIO(_decode_file(path, encoding, encoding_errors), newline="")
        return
    with _open_utf8(path) as handle:
        yield io.TextIOWrapper(handle, encoding="utf-8", errors=encoding_errors, newline="")


def _delimited_rows(path: str, encoding: str, encoding_errors: str, delimiter: str) -> tuple[Rows, list[str]]:
    with _open_text(path, encoding, encoding_errors) as handle:
        header = _next_record(csv.reader(handle, delimiter=delimiter), path)
    if not header:
        raise DataError(f"{path} has no header row; the first line must name the columns")
    header = [name.strip() for name in header]
    _check_header(header, delimiter, path)

    def rows() -> Rows:
        with _open_text(path, encoding, encoding_errors) as handle:
            reader = csv.reader(handle, delimiter=delimiter)
            _next_record(reader, path)  # the header
            yield from _records(reader, header, path)

    return rows(), header


def _records(reader: Any, header: list[str], path: str) -> Rows:
    """The data rows of a CSV/TSV reader past its header, as dicts."""
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
        yield f"line {reader.line_num}", dict(zip(header, values))


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


def _jsonl_rows(path: str, encoding: str, encoding_errors: str) -> tuple[Rows, list[str]]:
    """A .jsonl file's objects, read a line at a time; the columns are the first object's keys."""
    def lines() -> Iterator[tuple[int, str]]:
        # Only CR / LF end a line (str.splitlines() also splits at U+2028, U+0085 ..., legal inside JSON strings).
        with _open_text(path, encoding, encoding_errors) as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    yield number, line.rstrip("\r\n")

    with contextlib.closing(lines()) as numbered:
        first = next(numbered, None)
    columns = list(_parse_json_line(first[1], path, first[0]).keys()) if first else []

    def rows() -> Rows:
        for number, line in lines():
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


def _json_array_rows(text: str, path: str) -> tuple[Rows, list[str]]:
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

    def rows() -> Rows:
        for index, row in enumerate(value):
            if not isinstance(row, dict):
                raise DataError(f"{path} row {index}: expected a JSON object, got {type(row).__name__}")
            yield f"row {index}", row

    return rows(), list(value[0].keys())


def _read_sequence(source: Iterable[Mapping[str, Any]]) -> tuple[Rows, list[str]]:
    column_names = getattr(source, "column_names", None)  # datasets.Dataset knows its columns up front
    iterator = iter(source)
    first = next(iterator, None)
    if first is None:
        raise DataError("the data sequence is empty; pass at least one row")
    if not isinstance(first, Mapping):
        raise DataError(f"rows must be dicts (column name -> value), got {type(first).__name__}")
    columns = list(column_names) if column_names is not None else list(first.keys())

    def rows() -> Rows:
        yield "row 0", first
        for index, row in enumerate(iterator, 1):
            if not isinstance(row, Mapping):
                raise DataError(f"row {index}: rows must be dicts, got {type(row).__name__}")
            yield f"row {index}", row

    return rows(), columns


def _parquet_rows(path: str) -> tuple[Rows, list[str]]:
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
        raise DataError(f"{path}: not a readable Parquet file ({one_line(error)}); write it again (pandas: "
                        "frame.to_parquet(path)), or give it the extension of its real format") from error
    _check_unique_columns(columns, path, "in the Parquet schema")
    if num_rows == 0:
        raise DataError(f"{path} has the columns {', '.join(columns)} but no rows; point to the right file")
    return _arrow_rows(parquet_file.iter_batches(batch_size=_ARROW_BATCH_ROWS), path), columns


def _arrow_rows(batches: Iterable[Any], source_name: str) -> Rows:
    """The rows of Arrow record batches or tables (Parquet, datasets) as dicts, numbered from 0."""
    iterator = iter(batches)
    index = 0
    while True:
        try:
            batch = next(iterator, None)
        except (OSError, ValueError) as error:  # a truncated or corrupt file, found while reading it
            raise DataError(f"{source_name}: cannot read the rows from row {index} on ({one_line(error)}); the "
                            "file may be truncated or corrupt: write it again") from error
        if batch is None:
            return
        for row in batch.to_pylist():
            yield f"row {index}", row
            index += 1


def one_line(error: Exception) -> str:
    """An error message from pyarrow or datasets on one line (they may span several)."""
    return " ".join(str(error).split())


def _import_datasets(reading: str) -> Any:
    """The datasets package, or a DataError that says how to install it."""
    try:
        import datasets
    except ImportError as error:
        raise DataError(f"{reading} needs the datasets package: {_DATA_EXTRA} (or pip install datasets)") from error
    return datasets


def _saved_dataset_rows(path: str, split: str | None, spec: str) -> tuple[Rows, list[str]]:
    """A directory written by save_to_disk: a Dataset (``path``) or a DatasetDict (``path:split``)."""
    datasets = _import_datasets(f"reading {path} (a directory written by save_to_disk)")
    try:
        loaded = datasets.load_from_disk(path)
    except (OSError, ValueError) as error:  # missing or corrupt arrow files, a bad dataset_info.json / state.json
        raise DataError(f"{path}: cannot read this datasets directory ({one_line(error)}); write it again with "
                        "save_to_disk") from error
    return _dataset_rows(_choose_split(datasets, loaded, path, split, spec), spec)


def _hub_dataset_rows(name: str, selector: str | None, spec: str) -> tuple[Rows, list[str]]:
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
            raise DataError(f"{spec}: cannot read the Hub dataset {name!r} from the local cache ({one_line(error)}); "
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


def _dataset_rows(dataset: Any, source_name: str) -> tuple[Rows, list[str]]:
    """A datasets.Dataset's rows, numbered from 0, converted from Arrow a batch at a time."""
    columns = list(dataset.column_names)
    if dataset.num_rows == 0:
        raise DataError(f"{source_name} has the columns {', '.join(columns)} but no rows; point to the right split")
    return _arrow_rows(dataset.with_format("arrow").iter(batch_size=_ARROW_BATCH_ROWS), source_name), columns

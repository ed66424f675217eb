"""Readers: a data set's rows (`looptrain.data.sources`: files, datasets' directories, cached Hub datasets,
sequences of dicts) into a checked `TextClassificationData` or `LanguageModelingData`.

Every source goes through the same column and label checks. String labels map to ids with a sorted, deterministic
mapping. Input that would train on the wrong data raises :class:`DataError` naming the file (and line or row) and
the fix; input that is legal but may not be what the user meant adds a one-line notice to
``TextClassificationData.notices``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from looptrain.data.errors import DataError
from looptrain.data.sources import one_line, open_source

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

    rows, columns, source_name = open_source(source, encoding, encoding_errors)
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
            ``"messages"`` (a chat rendered with the tokenizer's chat template; loss on every assistant turn).
        texts: The text of each sample (``"text"``), or its prompt (``"prompt_response"``); empty for chats.
        responses: The response of each sample (``"prompt_response"``), else None.
        messages: The chat of each sample (``"messages"``: a list of ``{"role", "content"}`` dicts), else None.
        source: Where the data came from, for error messages.
        columns: The columns the samples were read from, in order (for the run's identity and messages).
        notices: One-line remarks on data that was read but may not be what the user meant.
        prompt_turns: Per chat, how many of its first messages are the prompt (conversational prompt/completion
            data); None for plain chats and the other kinds.
        tools: Per chat, the tool schemas passed as ``tools=`` to the chat template (None for a row without);
            None when the data has no tools column.
    """

    kind: str
    texts: list[str]
    responses: list[str] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    source: str = "<rows>"
    columns: tuple[str, ...] = ()
    notices: list[str] = field(default_factory=list)
    prompt_turns: list[int] | None = None
    tools: list[list[dict] | None] | None = None

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
            None if self.prompt_turns is None else [self.prompt_turns[i] for i in indices],
            None if self.tools is None else [self.tools[i] for i in indices],
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
    rows, columns, source_name = open_source(source, encoding, encoding_errors)
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
            raise DataError(f"{where} is a string that is not JSON ({one_line(error)}); write the chat as a JSON "
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

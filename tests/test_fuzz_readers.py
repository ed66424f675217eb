"""Fuzzing read_classification_data: malformed CSV / TSV / JSONL either loads consistently or raises DataError.

The contract under test (issue 8): whatever bytes a user points --data at, the reader never leaks a
UnicodeDecodeError, csv.Error, json.JSONDecodeError, KeyError, TypeError, IndexError, RecursionError or
a bare ValueError; the command line turns DataError into "finetune.py: error: ..." and anything else
into a traceback. Hypothesis is derandomized so CI runs the same examples every time.
"""

from __future__ import annotations

import csv
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from looptrain.data import DataError, read_classification_data

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

HUGE_FIELD = "x" * (csv.field_size_limit() + 10)  # past the csv module's field limit (131072 chars)
LONG_DIGITS = "7" * 5000  # past Python's 4300-digit limit for int(str) and json integers
BOM = "\ufeff"

# Cells that have broken readers before: separators, quotes, line breaks, BOMs, NULs, numbers, nulls.
NASTY_CELLS = st.sampled_from([
    "", " ", "good movie", "pos", "neg", "0", "1", "2", "-1", "1.0", "1e400", "nan", "NaN", "null", "None",
    '"', '""', '"unterminated', 'a"b', "a,b", "a\tb", "a\nb", "a\r\nb", "\r", "\x00", BOM, BOM + "text",
    "\u2028", "\x85", "\ud800", "é", "日本語", LONG_DIGITS, HUGE_FIELD, "text", "label",
])
CELLS = st.one_of(NASTY_CELLS, st.text(max_size=20))
COLUMN_NAMES = st.sampled_from(["text", "label", "Text", "labels", "txt", "", " text ", BOM + "text", "sentence"])

# JSON values of every type, including the ones a label or text cannot be.
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 5), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    CELLS,
)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(COLUMN_NAMES, inner, max_size=3), max_leaves=6)
JSON_OBJECTS = st.dictionaries(st.one_of(COLUMN_NAMES, st.text(max_size=5)), JSON_VALUES, max_size=4)


def json_line(value) -> str:
    # allow_nan: Python's json writes NaN / Infinity, which other tools reject but json.loads reads back.
    return json.dumps(value, ensure_ascii=False, allow_nan=True)


# Plausible cells, so that a good share of files load and the consistency checks run on them.
GOOD_TEXTS = st.sampled_from(["good movie", "bad plot", "great fun", "dull", "loved it, truly", 'said "hi"'])
GOOD_LABELS = st.sampled_from(["pos", "neg", "0", "1", "2", " pos "])
OVERSIZED = st.sampled_from([HUGE_FIELD, LONG_DIGITS])  # each broke a reader once: drawn often on purpose
TEXT_CELLS = st.one_of(GOOD_TEXTS, GOOD_TEXTS, CELLS, OVERSIZED)
LABEL_CELLS = st.one_of(GOOD_LABELS, GOOD_LABELS, CELLS, OVERSIZED)


def sometimes(draw) -> bool:
    """True one time in four: each fault is mixed into a quarter of the files."""
    return draw(st.sampled_from([False, False, False, True]))


@st.composite
def delimited_files(draw, delimiter: str) -> bytes:
    if sometimes(draw):
        header = draw(st.lists(COLUMN_NAMES, min_size=0, max_size=4))
    else:
        header = draw(st.sampled_from([["text", "label"], ["label", "text"], ["text", "label", "sentence"]]))
    clean = draw(st.booleans())  # half the files have only plausible cells, so that many of them load
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        row = [draw(GOOD_TEXTS if clean else TEXT_CELLS), draw(GOOD_LABELS if clean else LABEL_CELLS)]
        if "label" in header and header.index("label") == 0:
            row.reverse()
        if sometimes(draw):  # wrong column count: cells dropped or extra cells
            row = row[: draw(st.integers(0, 1))] if draw(st.booleans()) else row + draw(st.lists(CELLS, max_size=3))
        rows.append(row)
    if sometimes(draw):  # unquoted: separators, quotes and line breaks inside cells break the rows
        lines = [delimiter.join(header)] + [delimiter.join(row) for row in rows]
    else:
        lines = [_quoted(header, delimiter)] + [_quoted(row, delimiter) for row in rows]
    return _finish(draw, draw(st.sampled_from(["\n", "\r\n", "\r"])).join(lines))


def _quoted(cells: list[str], delimiter: str) -> str:
    return delimiter.join('"' + cell.replace('"', '""') + '"' for cell in cells)


GOOD_JSON_OBJECTS = st.fixed_dictionaries(
    {"text": GOOD_TEXTS, "label": st.one_of(GOOD_LABELS, st.integers(0, 2))},
    optional={"sentence": GOOD_TEXTS, "extra": JSON_VALUES},
)
ODD_JSON_OBJECTS = st.fixed_dictionaries(  # the right keys, values of any type (null, float, list, bool ...)
    {"text": st.one_of(GOOD_TEXTS, JSON_VALUES), "label": st.one_of(st.integers(-1, 3), JSON_VALUES)},
    optional={"sentence": JSON_VALUES},
)
JSON_LINES = st.one_of(
    GOOD_JSON_OBJECTS.map(json_line),
    ODD_JSON_OBJECTS.map(json_line),
    ODD_JSON_OBJECTS.map(json_line),
    JSON_OBJECTS.map(json_line),  # wrong or missing keys
    JSON_VALUES.map(json_line),  # a list, a string, a number, null: not an object
    CELLS,  # not JSON at all
    st.integers(1, 3000).map(lambda depth: "[" * depth * 10 + "]" * depth * 10),  # nesting past the recursion limit
    st.just('{"text": "ok", "label": ' + LONG_DIGITS + "}"),  # an integer json.loads refuses to convert
    st.just('{"text": "ok", "label": "' + LONG_DIGITS + '"}'),
    st.just(""),  # blank lines are skipped
)


@st.composite
def jsonl_files(draw) -> bytes:
    # Half the files hold only well-formed objects, so that many of them load.
    lines = draw(st.lists(st.one_of(GOOD_JSON_OBJECTS.map(json_line), st.just(""))
                          if draw(st.booleans()) else JSON_LINES,
                          max_size=6))
    return _finish(draw, draw(st.sampled_from(["\n", "\r\n"])).join(lines))


def _finish(draw, text: str) -> bytes:
    """Encodes, then maybe prepends a BOM, truncates mid-line, or splices in bytes that are not UTF-8."""
    raw = text.encode("utf-8", errors="surrogatepass")  # "\ud800" becomes bytes no strict decoder accepts
    if sometimes(draw):
        raw = BOM.encode() + raw
    if raw and sometimes(draw):
        raw = raw[: draw(st.integers(0, len(raw)))]
    if sometimes(draw):
        position = draw(st.integers(0, len(raw)))
        raw = (raw[:position] + draw(st.sampled_from([b"\xff", b"\xc3", b"\x80\x80", b"\xed\xa0\x80", b"\x00"]))
               + raw[position:])
    return raw


READ_OPTIONS = st.fixed_dictionaries({
    "text_column": st.sampled_from(["text", "text", "text", ("text", "sentence")]),
    "label_column": st.sampled_from(["label", "label", "label", None, "labels"]),
    "label_names": st.sampled_from([None, None, None, ["neg", "pos"], ["0", "1", "2"]]),
    "num_labels": st.sampled_from([None, None, 2, 3]),
    "encoding_errors": st.sampled_from(["strict", "replace"]),
    "max_samples": st.sampled_from([None, None, 1, 3]),
})


def check_reader(path, raw: bytes, options: dict) -> None:
    """Reads `raw` from `path`: either a consistent result or DataError; anything else fails the test."""
    path.write_bytes(raw)
    try:
        data = read_classification_data(path, **options)
    except DataError as error:
        assert str(error), "a DataError must say what is wrong"
        return
    pair = not isinstance(options["text_column"], str)
    assert len(data.texts) >= 1
    assert all(isinstance(notice, str) and "\n" not in notice for notice in data.notices)  # one line each
    if options["max_samples"] is not None:
        assert len(data.texts) <= options["max_samples"]
    assert all(isinstance(text, str) and text.strip() for text in data.texts)
    if pair:
        assert data.text_pairs is not None and len(data.text_pairs) == len(data.texts)
        assert all(isinstance(text, str) and text.strip() for text in data.text_pairs)
    else:
        assert data.text_pairs is None
    if options["label_column"] is None:
        assert data.labels is None
        return
    assert len(data.labels) == len(data.texts)
    assert all(type(label) is int for label in data.labels)
    num_labels = data.num_labels
    assert all(0 <= label < num_labels for label in data.labels)
    if options["label_names"] is not None:
        assert data.label_names == options["label_names"]
    elif options["num_labels"] is None:
        assert len(set(data.labels)) >= 2  # training data: a classifier needs two classes
    if options["num_labels"] is not None and options["label_names"] is None:
        # Numeric ids must lie below num_labels, and string labels may not outnumber it.
        assert all(label < options["num_labels"] for label in data.labels)
    if data.label_names is not None:
        assert len(data.id2label) == num_labels and len(set(data.label_names)) == num_labels


@FUZZ
@given(raw=delimited_files(","), options=READ_OPTIONS)
@example(raw=b"text,label\n" + HUGE_FIELD.encode() + b",pos\n", options={
    "text_column": "text", "label_column": "label", "label_names": None, "num_labels": None,
    "encoding_errors": "strict", "max_samples": None})
@example(raw=("text,label\ngood," + LONG_DIGITS + "\n").encode(), options={
    "text_column": "text", "label_column": "label", "label_names": None, "num_labels": None,
    "encoding_errors": "strict", "max_samples": None})
def test_fuzz_csv(tmp_path, raw, options):
    check_reader(tmp_path / "fuzz.csv", raw, options)


@FUZZ
@given(raw=delimited_files("\t"), options=READ_OPTIONS)
def test_fuzz_tsv(tmp_path, raw, options):
    check_reader(tmp_path / "fuzz.tsv", raw, options)


@FUZZ
@given(raw=jsonl_files(), options=READ_OPTIONS)
@example(raw=b'{"text": "ok", "label": 1}\n' + b"[" * 100_000, options={
    "text_column": "text", "label_column": "label", "label_names": None, "num_labels": None,
    "encoding_errors": "strict", "max_samples": None})
@example(raw=b'{"text": "ok", "label": ' + LONG_DIGITS.encode() + b"}\n", options={
    "text_column": "text", "label_column": "label", "label_names": None, "num_labels": None,
    "encoding_errors": "strict", "max_samples": None})
def test_fuzz_jsonl(tmp_path, raw, options):
    check_reader(tmp_path / "fuzz.jsonl", raw, options)


@FUZZ
@given(raw=st.binary(max_size=300), extension=st.sampled_from([".csv", ".tsv", ".jsonl"]), options=READ_OPTIONS)
def test_fuzz_random_bytes(tmp_path, raw, extension, options):
    check_reader(tmp_path / f"bytes{extension}", raw, options)


# The specific faults the fuzzers found, pinned with the message a user sees.
def test_field_over_the_csv_limit_names_the_line(tmp_path):
    path = tmp_path / "huge.csv"
    path.write_text("text,label\ngood,pos\n" + HUGE_FIELD + ",neg\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"huge\.csv:3: .*field larger than field limit"):
        read_classification_data(path)


def test_json_nested_past_the_recursion_limit_names_the_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "ok", "label": 1}\n' + "[" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"deep\.jsonl:2: .*nested too deeply"):
        read_classification_data(path)


@pytest.mark.parametrize("label", [LONG_DIGITS, f'"{LONG_DIGITS}"'])
def test_integer_label_too_long_to_convert(tmp_path, label):
    path = tmp_path / "digits.jsonl"
    path.write_text('{"text": "ok", "label": 1}\n{"text": "fine", "label": ' + label + "}\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"digits\.jsonl.*Exceeds the limit \(4300 digits\)"):
        read_classification_data(path)


def test_json_line_separator_inside_a_string_is_not_a_line_break(tmp_path):
    # U+2028 and U+0085 are legal unescaped inside JSON strings; str.splitlines() would cut the line there.
    path = tmp_path / "separators.jsonl"
    rows = [{"text": "one\u2028two", "label": "a"}, {"text": "three\x85four", "label": "b"}]
    path.write_text("\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n", encoding="utf-8")
    data = read_classification_data(path)
    assert data.texts == ["one\u2028two", "three\x85four"]
    assert data.labels == [0, 1]


def test_nan_and_infinite_labels_are_refused(tmp_path):
    for literal in ("NaN", "Infinity", "-Infinity", "1.5"):
        path = tmp_path / "float.jsonl"
        path.write_text('{"text": "ok", "label": ' + literal + "}\n", encoding="utf-8")
        with pytest.raises(DataError, match=r"labels must be strings or integers"):
            read_classification_data(path)

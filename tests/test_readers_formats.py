"""Parquet, JSON arrays, save_to_disk directories and cached Hub datasets read exactly like the same rows as CSV.

Every file, directory and cache here is written in the test with pyarrow and datasets themselves; nothing is
downloaded, and a guard on socket.connect proves that reading a Hub name never reaches the network.
"""

from __future__ import annotations

import csv
import json
import socket
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_readers import (
    CELLS,
    COLUMN_NAMES,
    FUZZ,
    GOOD_JSON_OBJECTS,
    GOOD_LABELS,
    GOOD_TEXTS,
    JSON_OBJECTS,
    JSON_VALUES,
    ODD_JSON_OBJECTS,
    READ_OPTIONS,
    _finish,
    check_reader,
    json_line,
    sometimes,
)

from looptrain.data import DataError, read_classification_data, sources

datasets = pytest.importorskip("datasets")
pyarrow = pytest.importorskip("pyarrow")
import pyarrow.parquet as parquet  # noqa: E402  (after the skip above)

HUB_NAME = "looptrain_reviews"
# Texts a hand-written reader gets wrong: separators, quotes, a newline, non-ASCII, a leading space.
ROWS = [
    {"text": "good, really good", "second": "a \"quoted\" word", "label": "pos"},
    {"text": "line one\nline two", "second": "café 😀", "label": "neg"},
    {"text": " dull", "second": "tab\there", "label": "neutral"},
    {"text": "fun", "second": "x", "label": "pos"},
]
# Integer labels that are not 0..N-1: read as class names, with a notice.
STAR_ROWS = [{"text": f"review {index}", "label": stars} for index, stars in enumerate([1, 2, 5, 2, 1])]


def write_csv(path, rows) -> str:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def write_parquet(path, rows) -> str:
    parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return str(path)


def write_json(path, value) -> str:
    path.write_text(json.dumps(value), encoding="utf-8")
    return str(path)


def cache_like_a_hub_download(cache_dir, name: str, splits: dict[str, list[dict]]) -> None:
    """Prepares `name` in the datasets cache as an online ``load_dataset(name)`` does: the Hub repository's data files
    (here Parquet files written locally) turned into Arrow by datasets' packaged Parquet builder, configured as the
    Hub module factory configures it. Only the download is skipped. (The builder refuses local files for a repo_id,
    so the name has no namespace; looptrain passes a namespaced name to load_dataset the same way.)"""
    from datasets.data_files import DataFilesDict
    from datasets.load import configure_builder_class
    from datasets.packaged_modules.parquet.parquet import Parquet, ParquetConfig

    repository = cache_dir.parent / f"hub-repository-{name}"
    repository.mkdir(parents=True)
    patterns = {split: [write_parquet(repository / f"{split}.parquet", rows)] for split, rows in splits.items()}
    config = ParquetConfig(name="default", data_files=DataFilesDict.from_patterns(patterns))
    builder_class = configure_builder_class(Parquet, builder_configs=[config], default_config_name="default",
                                            dataset_name=name)
    builder_class(cache_dir=str(cache_dir), dataset_name=name, hash="0123456789abcdef").download_and_prepare()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty datasets cache of this test's own: where HF_DATASETS_CACHE would point."""
    cache_dir = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache_dir)
    return cache_dir


@pytest.fixture
def no_network(monkeypatch):
    """Records, and refuses, every attempt to open a network connection."""
    attempts = []

    def refuse(sock, address):
        attempts.append(address)
        raise OSError(f"no network in tests ({address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def write_format(kind: str, directory, rows, hub_name: str = HUB_NAME) -> str:
    """`rows` written as `kind` into `directory` (or, for a Hub dataset, the datasets cache); returns what to pass as
    the source: a path, `dir:split` or `name:split`."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "parquet":
        return write_parquet(directory / "train.parquet", rows)
    if kind == "json array":
        return write_json(directory / "train.json", rows)
    if kind == 'json {"data": [...]}':
        return write_json(directory / "train.json", {"data": rows})
    if kind == "save_to_disk Dataset":
        datasets.Dataset.from_list(rows).save_to_disk(str(directory / "saved"))
        return str(directory / "saved")
    if kind == "save_to_disk DatasetDict":
        splits = datasets.DatasetDict(train=datasets.Dataset.from_list(rows), test=datasets.Dataset.from_list(rows[:1]))
        splits.save_to_disk(str(directory / "saved"))
        return str(directory / "saved") + ":train"
    if kind == "cached Hub dataset":
        cache_like_a_hub_download(datasets.config.HF_DATASETS_CACHE, hub_name, {"train": rows, "test": rows[:1]})
        return f"{hub_name}:train"
    raise AssertionError(kind)


FORMATS = ["parquet", "json array", 'json {"data": [...]}', "save_to_disk Dataset", "save_to_disk DatasetDict",
           "cached Hub dataset"]


def read_both(kind, tmp_path, rows, **options):
    source = write_format(kind, tmp_path, rows)
    return read_classification_data(source, **options), read_classification_data(
        write_csv(tmp_path / "train.csv", rows), **options)


def same_data(data, reference) -> None:
    assert (data.texts, data.text_pairs, data.labels, data.label_names) == (
        reference.texts, reference.text_pairs, reference.labels, reference.label_names)
    assert [notice.replace(data.source, "SOURCE") for notice in data.notices] == [
        notice.replace(reference.source, "SOURCE") for notice in reference.notices]


@pytest.mark.parametrize("kind", FORMATS)
def test_each_format_reads_exactly_like_the_same_rows_as_csv(kind, tmp_path, hub_cache, no_network):
    data, reference = read_both(kind, tmp_path, ROWS, text_column=("text", "second"))
    same_data(data, reference)
    assert data.texts[1] == "line one\nline two" and data.text_pairs[1] == "café 😀"
    assert data.label_names == ["neg", "neutral", "pos"] and data.labels == [2, 0, 1, 2]

    # Eval data: the training mapping applies the same way; max_samples keeps the first rows.
    eval_source = write_format(kind, tmp_path / "eval", ROWS[::-1], f"{HUB_NAME}_eval")
    eval_csv = write_csv(tmp_path / "eval.csv", ROWS[::-1])
    evaluation, reference = (read_classification_data(source, label_names=data.label_names, max_samples=2)
                             for source in (eval_source, eval_csv))
    same_data(evaluation, reference)
    assert evaluation.labels == [2, 1]
    assert no_network == []


@pytest.mark.parametrize("kind", FORMATS)
def test_integer_labels_and_their_notice_are_the_same_in_every_format(kind, tmp_path, hub_cache):
    data, reference = read_both(kind, tmp_path, STAR_ROWS)
    same_data(data, reference)
    assert data.label_names == ["1", "2", "5"] and data.labels == [0, 1, 2, 1, 0]
    assert len(data.notices) == 1 and "are not the class ids 0..2" in data.notices[0]


@pytest.mark.parametrize("kind", FORMATS)
def test_a_missing_column_lists_the_columns_there_are(kind, tmp_path, hub_cache):
    source = write_format(kind, tmp_path, ROWS)
    with pytest.raises(DataError, match=r"column 'txet' not found in .*; available columns: text, second, label\. "
                                        r"Did you mean 'text'\? Pass the right name .*\(--text-column"):
        read_classification_data(source, text_column="txet")


@pytest.mark.parametrize("kind", ["parquet", "json array", "save_to_disk Dataset"])
def test_a_null_or_empty_text_names_the_row(kind, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_ARROW_BATCH_ROWS", 2)  # the row count carries across Arrow batches
    rows = [{"text": f"text {index}", "label": index % 2} for index in range(5)] + [{"text": None, "label": 1}]
    source = write_format(kind, tmp_path, rows)
    with pytest.raises(DataError, match=r"row 5: text column 'text' is null; fill or drop the row"):
        read_classification_data(source)
    rows[5]["text"] = "  "
    source = write_format(kind, tmp_path / "again", rows)
    with pytest.raises(DataError, match=r"row 5: text column 'text' is empty; fill or drop the row"):
        read_classification_data(source)


def test_a_dataset_dict_directory_needs_its_split_named(tmp_path):
    directory = str(tmp_path / "reviews")
    test_rows = [{"text": "only pos", "label": "pos"}]
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS),
                         test=datasets.Dataset.from_list(test_rows)).save_to_disk(directory)
    with pytest.raises(DataError, match=r"reviews holds the splits train, test; choose one, e.g\. .*reviews:train "
                                        r"\(--data / --eval-data\)"):
        read_classification_data(directory)
    with pytest.raises(DataError, match=r"reviews has no split 'validation'; its splits are train, test, "
                                        r"e\.g\. .*reviews:train$"):
        read_classification_data(directory + ":validation")
    train = read_classification_data(directory + ":train")
    evaluation = read_classification_data(directory + ":test", label_names=train.label_names)
    assert evaluation.texts == ["only pos"] and evaluation.labels == [2] and evaluation.source == directory + ":test"

    # A DatasetDict of one split needs no name; a Dataset has no splits to name.
    datasets.DatasetDict(validation=datasets.Dataset.from_list(ROWS)).save_to_disk(str(tmp_path / "one-split"))
    assert read_classification_data(str(tmp_path / "one-split")).texts == [row["text"] for row in ROWS]
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "dataset"))
    with pytest.raises(DataError, match=r"dataset holds one data set, not splits; drop ':train'$"):
        read_classification_data(str(tmp_path / "dataset") + ":train")


def test_a_class_label_column_is_read_as_its_ids(tmp_path):
    features = datasets.Features(text=datasets.Value("string"), label=datasets.ClassLabel(names=["neg", "pos"]))
    rows = [{"text": "good", "label": 1}, {"text": "bad", "label": 0}]
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    data = read_classification_data(str(tmp_path / "saved"))
    assert data.labels == [1, 0] and data.label_names is None


def test_a_cached_hub_dataset_is_read_offline_even_when_the_session_is_online(tmp_path, hub_cache, no_network,
                                                                              monkeypatch):
    cache_like_a_hub_download(hub_cache, HUB_NAME, {"train": ROWS, "test": ROWS[:2]})
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # a user without HF_DATASETS_OFFLINE=1
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    test = read_classification_data(f"{HUB_NAME}:test")
    assert test.texts == [ROWS[0]["text"], ROWS[1]["text"]] and test.source == f"{HUB_NAME}:test"
    assert read_classification_data(f"{HUB_NAME}:default:test").texts == test.texts  # name:config:split
    assert no_network == []
    assert datasets.config.HF_HUB_OFFLINE is False and huggingface_hub.constants.HF_HUB_OFFLINE is False  # restored

    with pytest.raises(DataError, match=rf"{HUB_NAME} holds the splits train, test; choose one, e\.g\. "
                                        rf"{HUB_NAME}:train"):
        read_classification_data(HUB_NAME)
    with pytest.raises(DataError, match=rf"cannot read the Hub dataset '{HUB_NAME}' from the local cache \(Couldn't "
                                        r"find cache for .* config 'plain_text' Available configs in the cache: "
                                        rf"\['default'\]\); if it has several configurations, name one: "
                                        rf"{HUB_NAME}:CONFIG:SPLIT$"):
        read_classification_data(f"{HUB_NAME}:plain_text:train")


@pytest.mark.parametrize("name", ["looptrain-tests/absent", "absent"])
def test_a_dataset_not_in_the_cache_says_how_to_get_it_and_downloads_nothing(name, hub_cache, no_network,
                                                                             monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(DataError, match=rf"^{name} is not a file or directory, and the Hub dataset '{name}' is not in "
                                        rf"the local datasets cache \(.*datasets-cache\); looptrain never downloads: "
                                        r"check the path, or download the dataset once while online: python -c "
                                        rf"\"import datasets; datasets\.load_dataset\('{name}'\)\""):
        read_classification_data(f"{name}:train")
    assert no_network == []


@pytest.mark.parametrize("value, message", [
    ({"train": ROWS, "test": ROWS}, r"expected a JSON array of objects \(\[\{\"text\": \.\.\., \"label\": \.\.\.\}, "
                                    r"\.\.\.\]\) or \{\"data\": \[\.\.\.\]\}, got an object with the keys 'train', "
                                    r"'test'; for one object per line, name the file \.jsonl"),
    ("text", r"expected a JSON array of objects .*, got a str"),
    ([], r"holds an empty JSON array; add rows"),
    ([["good", "pos"]], r"expected a JSON array of objects .*, but row 0 is a list"),
    ([{"text": "good", "label": "pos"}, 3], r"train\.json row 1: expected a JSON object, got int"),
])
def test_a_json_file_of_another_shape_says_what_shape_is_expected(value, message, tmp_path):
    with pytest.raises(DataError, match=message):
        read_classification_data(write_json(tmp_path / "train.json", value))


def test_json_lines_in_a_json_file_and_repeated_keys_are_named(tmp_path):
    lines = tmp_path / "train.json"
    lines.write_text('{"text": "good", "label": "pos"}\n{"text": "bad", "label": "neg"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.json:2: not valid JSON \(Extra data at column 1\); the file holds "
                                        r"several JSON values: for one object per line, rename it to .*train\.jsonl$"):
        read_classification_data(str(lines))
    lines.write_text('[{"text": "good", "text": "bad", "label": "pos"}]', encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.json: key 'text' appears 2 times in one JSON object; keep one"):
        read_classification_data(str(lines))


def test_bad_parquet_files_are_named_with_the_fix(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.parquet is empty"):
        read_classification_data(str(empty))
    csv_in_disguise = tmp_path / "train.parquet"
    csv_in_disguise.write_text("text,label\ngood,pos\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.parquet: not a readable Parquet file \(.*\); write it again "
                                        r"\(pandas: frame\.to_parquet\(path\)\), or give it the extension of its real"):
        read_classification_data(str(csv_in_disguise))
    no_rows = str(tmp_path / "no-rows.parquet")
    parquet.write_table(pyarrow.table({"text": pyarrow.array([], pyarrow.string()),
                                       "label": pyarrow.array([], pyarrow.int64())}), no_rows)
    with pytest.raises(DataError, match=r"no-rows\.parquet has the columns text, label but no rows"):
        read_classification_data(no_rows)
    repeated = tmp_path / "repeated.parquet"
    parquet.write_table(pyarrow.Table.from_arrays([pyarrow.array(["a", "b"]), pyarrow.array(["c", "d"]),
                                                   pyarrow.array([0, 1])], names=["text", "text", "label"]), repeated)
    with pytest.raises(DataError, match=r"column 'text' appears 2 times in the Parquet schema \(columns 1, 2\); "
                                        r"rename or remove the duplicates"):
        read_classification_data(str(repeated))


def test_a_directory_or_a_split_that_is_not_a_datasets_directory_is_refused(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match=r"plain is a directory, not a file; pass the path of a data file inside it, "
                                        r"or a directory written by datasets' save_to_disk"):
        read_classification_data(str(tmp_path / "plain"))
    path = write_parquet(tmp_path / "train.parquet", ROWS)
    with pytest.raises(DataError, match=r"train\.parquet is a file, and ':train' chooses a split of a datasets "
                                        r"directory or a Hub dataset; drop ':train'$"):
        read_classification_data(path + ":train")


def test_without_the_packages_each_format_says_what_to_install(tmp_path, monkeypatch):
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_list(ROWS).save_to_disk(saved)
    parquet_path = write_parquet(tmp_path / "train.parquet", ROWS)
    csv_path = write_csv(tmp_path / "train.csv", ROWS)
    for module in ("datasets", "pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, module, None)  # `import` of it now raises ImportError
    install = r"pip install 'looptrain\[data\]' \(or pip install datasets\)"
    with pytest.raises(DataError, match=rf"reading .*saved \(a directory written by save_to_disk\) needs the datasets "
                                        rf"package: {install}"):
        read_classification_data(saved)
    with pytest.raises(DataError, match=rf"absent/reviews is not a file or directory; reading it as a Hub dataset "
                                        rf"needs the datasets package: {install}"):
        read_classification_data("absent/reviews")
    with pytest.raises(DataError, match=r"reading .*train\.parquet \(Parquet\) needs pyarrow: pip install "
                                        r"'looptrain\[data\]' \(or pip install pyarrow\)"):
        read_classification_data(parquet_path)
    assert read_classification_data(csv_path).texts == [row["text"] for row in ROWS]  # the others need neither


def test_the_command_line_trains_on_parquet_exactly_as_on_csv(model_dir, tmp_path):
    from test_finetune import assert_same, final_weights, run

    from conftest import write_csv as write_training_csv

    train_csv = write_training_csv(tmp_path / "train.csv", 16, seed=3)
    with open(train_csv, newline="", encoding="utf-8") as handle:
        train_parquet = write_parquet(tmp_path / "train.parquet", list(csv.DictReader(handle)))
    flags = ("--epochs", "1", "--batch-size", "8", "--eval-every", "no")
    assert run(model_dir, train_csv, tmp_path / "from-csv", *flags) == 0
    assert run(model_dir, train_parquet, tmp_path / "from-parquet", *flags) == 0
    assert_same(final_weights(tmp_path / "from-parquet"), final_weights(tmp_path / "from-csv"), rtol=0, atol=0)


# ------------------------------------------------------------------ fuzzing: only DataError, whatever the file holds
# The contract of tests/test_fuzz_readers.py, extended to .json and .parquet files.
JSON_ARRAY_ROWS = st.lists(st.one_of(GOOD_JSON_OBJECTS, ODD_JSON_OBJECTS, JSON_OBJECTS, JSON_VALUES), max_size=6)


@st.composite
def json_array_files(draw) -> bytes:
    # Half the files hold only well-formed objects, so that many of them load.
    rows = draw(st.lists(GOOD_JSON_OBJECTS, max_size=6) if draw(st.booleans()) else JSON_ARRAY_ROWS)
    value = draw(st.sampled_from([rows, rows, {"data": rows}, {"train": rows}, rows[0] if rows else None]))
    text = json_line(value)
    if sometimes(draw):  # several values (a JSONL file named .json), or nesting past the recursion limit
        text = draw(st.sampled_from([text + "\n" + text, "[" * 100_000 + text]))
    return _finish(draw, text)


@FUZZ
@given(raw=json_array_files(), options=READ_OPTIONS)
def test_fuzz_json_arrays(tmp_path, raw, options):
    check_reader(tmp_path / "fuzz.json", raw, options)


INT64 = st.integers(-(2**63), 2**63 - 1)
PLAIN_CELLS = CELLS.filter(lambda cell: "\ud800" not in cell)  # Arrow strings are UTF-8: no lone surrogates
# One type per column, as Parquet stores them, with nulls; labels of every type a label cannot be, too.
TEXT_VALUES = [st.one_of(GOOD_TEXTS, PLAIN_CELLS, st.none()), st.one_of(INT64, st.none()),
               st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(0, 3), max_size=2)]
LABEL_VALUES = [st.one_of(GOOD_LABELS, PLAIN_CELLS, st.none()), st.integers(-1, 3), INT64,
                st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.sampled_from([0.0, 1.0, 2.0])]


@st.composite
def parquet_files(draw) -> bytes:
    length = draw(st.integers(0, 6))
    names = (draw(st.lists(COLUMN_NAMES, min_size=1, max_size=4)) if sometimes(draw)
             else draw(st.sampled_from([["text", "label"], ["label", "text", "sentence"]])))
    columns = []
    for name in names:
        values = draw(st.sampled_from(LABEL_VALUES if name == "label" else TEXT_VALUES))
        columns.append(pyarrow.array(draw(st.lists(values, min_size=length, max_size=length))))
    sink = pyarrow.BufferOutputStream()
    parquet.write_table(pyarrow.Table.from_arrays(columns, names=names), sink, row_group_size=draw(st.integers(1, 4)))
    raw = sink.getvalue().to_pybytes()
    if sometimes(draw):  # truncated, or a byte overwritten: pages, metadata or the footer
        raw = raw[: draw(st.integers(0, len(raw)))]
    if raw and sometimes(draw):
        position = draw(st.integers(0, len(raw) - 1))
        raw = raw[:position] + bytes([draw(st.integers(0, 255))]) + raw[position + 1:]
    return raw


@FUZZ
@given(raw=parquet_files(), options=READ_OPTIONS)
def test_fuzz_parquet(tmp_path, raw, options):
    check_reader(tmp_path / "fuzz.parquet", raw, options)


def test_a_runs_identity_covers_the_files_of_a_saved_dataset_and_its_split(tmp_path):
    """--resume auto refuses a run whose save_to_disk data changed behind the same DIR:SPLIT, or another split."""
    import datasets

    from looptrain.cli import finetune

    directory = tmp_path / "saved"
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS),
                         test=datasets.Dataset.from_list(ROWS[:2])).save_to_disk(str(directory))

    def data_identity(source: str) -> dict:
        args = finetune.build_parser().parse_args(["--data", source, "--eval-data", f"{directory}:test"])
        return finetune.run_identity(args, str(tmp_path / "model"), 1)["data"]["train"]

    before = data_identity(f"{directory}:train")
    assert before["split"] == "train" and any(name.startswith("train/") for name in before["files"])
    assert data_identity(f"{directory}:test") != before  # another split is another run
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS[::-1]),
                         test=datasets.Dataset.from_list(ROWS[:2])).save_to_disk(str(tmp_path / "other"))
    for item in (tmp_path / "other" / "train").iterdir():  # new rows behind the same path
        (directory / "train" / item.name).write_bytes(item.read_bytes())
    assert data_identity(f"{directory}:train") != before

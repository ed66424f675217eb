"""The token store (looptrain.data.store) and the lazily read files (looptrain.data.sources).

The expectations are written out here: token labels as a causal LM's are (the id, or -100 on a prompt), padding
done by hand, the memory a read holds measured by tracemalloc.
"""

import json
import tracemalloc

import numpy as np
import pytest
import torch

from looptrain.data import (
    DynamicPaddingCollator,
    TokenizedDataset,
    TokenRowsBuilder,
    read_classification_data,
    read_lm_data,
    sources,
    tokenize,
)

# (prompt ids, response ids) of each sample: ids past 255 (a Python list's 28-byte ints), one sample all response.
SAMPLES = [([5, 300, 301], [7, 2]), ([], [9, 1000, 2]), ([40000, 12], [65535, 2])]


def expected_rows():
    ids = [prompt + response for prompt, response in SAMPLES]
    labels = [[-100] * len(prompt) + response for prompt, response in SAMPLES]
    return ids, labels


def lm_dataset():
    builder = TokenRowsBuilder()
    for ids, labels in zip(*expected_rows()):
        builder.add(ids, labels)
    return builder.dataset(num_truncated=1, max_length=8)


def test_store_holds_ids_and_labels_in_at_most_8_bytes_a_token_and_gives_them_back():
    dataset = lm_dataset()
    ids, labels = expected_rows()
    tokens = sum(map(len, ids))
    rows = dataset.rows
    assert rows.ids.dtype == np.uint16 and rows.trained.dtype == np.bool_
    assert (rows.ids.nbytes + rows.trained.nbytes) / tokens == 3 <= 8
    assert dataset.lengths.tolist() == [5, 3, 4] and dataset.num_truncated == 1 and len(dataset) == 3
    for index in range(3):
        assert dataset[index] == {"input_ids": ids[index], "attention_mask": [1] * len(ids[index]),
                                  "labels": labels[index]}
    assert list(dataset.input_ids) == ids and list(dataset.labels) == labels and dataset.labels[-1] == labels[2]


def test_ids_past_uint16_widen_the_store_to_int32():
    builder = TokenRowsBuilder()
    builder.add([1, 2, 3])
    builder.add([70000, 4])  # a vocabulary past 65,536
    dataset = builder.dataset(labels=[0, 1])
    assert dataset.rows.ids.dtype == np.int32 and dataset.rows.ids.nbytes / 5 == 4
    assert [dataset[index] for index in range(2)] == [
        {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "labels": 0},
        {"input_ids": [70000, 4], "attention_mask": [1, 1], "labels": 1}]


def test_lists_given_to_the_constructor_are_stored_the_same():
    dataset = TokenizedDataset([[2, 4, 3], [2, 5, 6, 3]], [[0, 0, 0], [0, 0, 1, 1]], [1, 0], label_names=["a", "b"])
    assert dataset.rows.token_types.dtype == np.uint8 and dataset.labels == [1, 0]
    assert dataset[1] == {"input_ids": [2, 5, 6, 3], "attention_mask": [1, 1, 1, 1],
                          "token_type_ids": [0, 0, 1, 1], "labels": 0}
    ids, labels = expected_rows()
    assert [TokenizedDataset(ids, None, labels)[index] for index in range(3)] == [lm_dataset()[i] for i in range(3)]


def test_a_label_that_is_not_its_tokens_id_is_refused():
    builder = TokenRowsBuilder()
    builder.add([5, 6], [5, 7])
    with pytest.raises(ValueError, match="neither its token's id nor -100"):
        builder.rows()
    with pytest.raises(ValueError, match="every sample needs token labels"):
        TokenizedDataset([[1, 2], [3]], None, [[1, 2], None])


def test_the_collator_pads_the_stores_samples_as_by_hand():
    dataset = lm_dataset()
    batch = DynamicPaddingCollator(0)([dataset[index] for index in range(3)])
    ids, labels = expected_rows()
    width = max(map(len, ids))
    assert batch["input_ids"].equal(torch.tensor([row + [0] * (width - len(row)) for row in ids]))
    assert batch["labels"].equal(torch.tensor([row + [-100] * (width - len(row)) for row in labels]))
    assert batch["attention_mask"].equal(torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids]))


def test_tokenize_stores_the_ids_the_tokenizer_returns(tiny_tokenizer):
    rows = [{"a": "good movie", "b": "fun", "label": 0}, {"a": "bad", "b": "dull", "label": 1}]
    data = read_classification_data(rows, ("a", "b"))
    dataset = tokenize(data, tiny_tokenizer, max_length=32, progress=False)
    expected = tiny_tokenizer(data.texts, data.text_pairs)["input_ids"]
    assert list(dataset.input_ids) == expected and dataset.labels == [0, 1]
    assert dataset.rows.ids.dtype == np.uint16


def test_a_jsonl_file_is_read_a_block_at_a_time_not_whole(tmp_path, monkeypatch):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "word " * 800}) + "\n"  # 4 kB a line
    path.write_text(line * 1000, encoding="utf-8")  # 4 MB
    monkeypatch.setattr(sources, "_READ_BLOCK_BYTES", 64 * 1024)
    tracemalloc.start()
    try:
        rows, columns, _ = sources.open_source(str(path), "utf-8", "strict")
        assert columns == ["text"] and sum(1 for _ in rows) == 1000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < path.stat().st_size / 8  # a block and a line, not the file
    assert read_lm_data(str(path), max_samples=2).texts == ["word " * 800] * 2

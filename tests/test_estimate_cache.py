"""The on-disk cache of estimates: a repeated estimate is read back, anything that changes the estimate misses."""

from __future__ import annotations

import json

import pytest
import torch

from looptrain.estimation import cache as estimate_cache
from looptrain.estimation import estimate, estimator, preset_config, run_batches_estimate
from looptrain.planning.book import EstimateBook
from looptrain.strategy import Strategy

BATCH, WIDTH = 2, 8


def bert_config(hidden: int = 32):
    from transformers import BertConfig

    return BertConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=37, max_position_embeddings=32, num_labels=2)


def bert_model(hidden: int = 32):
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(bert_config(hidden))


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A fresh cache directory for the test."""
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def computed(monkeypatch):
    """How many estimates were really computed (the estimator's uncached work, counted)."""
    calls = []
    work = estimator._estimate_windows

    def counting(*args, **kwargs):
        calls.append(args[2])
        return work(*args, **kwargs)

    monkeypatch.setattr(estimator, "_estimate_windows", counting)
    return calls


def _figures(result: dict) -> dict:
    """The estimate itself: all but the seconds (this call's, and computing it's) and where the result came from."""
    return {name: value for name, value in result.items()
            if name not in ("estimate_seconds", "compute_seconds", "from_cache")}


def _entries(root) -> list:
    return sorted((root / estimate_cache.KIND).glob("*.json"))


def test_a_repeated_estimate_is_read_from_the_cache(cache_root, computed):
    first = estimate(bert_config(), BATCH, WIDTH, optimizer="adafactor")
    second = estimate(bert_config(), BATCH, WIDTH, optimizer="adafactor")
    assert len(computed) == 1
    assert (first["from_cache"], second["from_cache"]) == (False, True)
    assert _figures(second) == _figures(first)
    assert second["peak_memory_bytes"] > 0
    entries = _entries(cache_root)
    assert len(entries) == 1
    assert json.loads(entries[0].read_text())["peak_memory_bytes"] == first["peak_memory_bytes"]
    # What computing it cost is kept: the planner charges a cached estimate at it, so a rerun decides as the first.
    assert second["compute_seconds"] == first["compute_seconds"] > 0


def test_a_repeated_estimate_of_a_model_is_read_from_the_cache(cache_root, computed):
    first = estimate(bert_model(), BATCH, WIDTH, precision="bf16")
    second = estimate(bert_model(), BATCH, WIDTH, precision="bf16")  # another object, the same model
    assert len(computed) == 1 and second["from_cache"]
    assert _figures(second) == _figures(first)


ROWS, LENGTH = 8, 32  # activations large enough beside the tiny weights that every change moves the peak
CONFIG_CHANGES = {
    "batch size": ({}, {"batch_size": ROWS + 1}),
    "seq len": ({}, {"seq_len": LENGTH - 8}),
    "precision": ({}, {"precision": "bf16"}),
    "optimizer": ({}, {"optimizer": "adafactor"}),
    "checkpointing": ({}, {"gradient_checkpointing": True}),
    "hidden size": ({}, {"hidden": 48}),
    "lora rank": ({}, {"lora_rank": 4}),
}


@pytest.mark.parametrize("change", CONFIG_CHANGES)
def test_a_change_of_the_inputs_misses_the_cache(cache_root, computed, change):
    def run(options: dict) -> dict:
        options = dict(options)
        config = bert_config(options.pop("hidden", 32))
        return estimate(config, options.pop("batch_size", ROWS), options.pop("seq_len", LENGTH), **options)

    base_options, changed_options = CONFIG_CHANGES[change]
    base = run(base_options)
    assert run(base_options)["from_cache"] and len(computed) == 1
    changed = run(changed_options)
    assert len(computed) == 2 and not changed["from_cache"]
    assert len(_entries(cache_root)) == 2
    assert changed["peak_memory_bytes"] != base["peak_memory_bytes"]


def _frozen_layer(model):
    for parameter in model.bert.encoder.layer[0].parameters():
        parameter.requires_grad_(False)
    return model


def _lora(model):
    from looptrain.lora import apply_lora

    return apply_lora(model, 4)


MODEL_CHANGES = {
    "frozen layer": _frozen_layer,
    "bf16 weights": lambda model: model.to(torch.bfloat16),
    "lora wrap": _lora,
}


@pytest.mark.parametrize("change", MODEL_CHANGES)
def test_a_change_of_the_model_misses_the_cache(cache_root, computed, change):
    if change == "lora wrap":
        pytest.importorskip("peft")
    base = estimate(bert_model(), BATCH, WIDTH)
    changed = estimate(MODEL_CHANGES[change](bert_model()), BATCH, WIDTH)
    assert len(computed) == 2 and not changed["from_cache"]
    assert changed["peak_memory_bytes"] < base["peak_memory_bytes"]  # each change stores less
    assert estimate(MODEL_CHANGES[change](bert_model()), BATCH, WIDTH)["from_cache"]
    assert len(computed) == 2


def test_the_key_holds_the_preset_the_padding_and_the_clipping():
    def key(model, windows=((BATCH, WIDTH),), **options):
        settings = {"num_labels": 2, "max_grad_norm": 1.0, "padded": False, **options}
        named = preset_config(model, settings["num_labels"]) if isinstance(model, str) else None
        return estimate_cache.key(model, [list(windows)], Strategy(), named_config=named, **settings)

    keys = {key("bert-base"), key("bert-large"), key("bert-base", padded=True), key("bert-base", max_grad_norm=None),
            key("bert-base", num_labels=3), key(bert_config()), key(bert_model()),
            key("bert-base", windows=[(BATCH, WIDTH), (BATCH, WIDTH)])}
    assert len(keys) == 8
    assert key("bert-base") == key("bert-base")
    assert key(object()) is None  # not describable: never cached
    assert estimate_cache.key("bert-base", [[(BATCH, WIDTH)]], Strategy(), num_labels=2, max_grad_norm=1.0,
                              padded=False) is None  # a name without the config it names


def test_the_key_of_a_module_without_a_config_holds_its_tree_and_settings():
    def key(model):
        return estimate_cache.key(model, [[(BATCH, WIDTH)]], Strategy(), num_labels=2, max_grad_norm=1.0,
                                  padded=False)

    def model(dropout: float = 0.1, hidden: int = 8):
        return torch.nn.Sequential(torch.nn.Embedding(16, hidden), torch.nn.Dropout(dropout),
                                   torch.nn.Linear(hidden, 16))

    flagged = model()
    flagged[2].checkpointed = True  # a plain attribute a forward may branch on
    tied = model()
    tied[2].weight = tied[0].weight  # tied input and output embeddings: one tensor, not two
    keys = [key(model()), key(model(dropout=0.2)), key(model(hidden=9)), key(flagged), key(tied)]
    assert key(model()) == keys[0]
    assert len(set(keys)) == 5


def test_caching_off_computes_every_time(monkeypatch, computed):
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", "off")
    results = [estimate(bert_config(), BATCH, WIDTH) for _ in range(2)]
    assert len(computed) == 2 and not any(result["from_cache"] for result in results)
    assert _figures(results[0]) == _figures(results[1])


def test_cache_false_bypasses_the_cache(cache_root, computed):
    estimate(bert_config(), BATCH, WIDTH)
    result = estimate(bert_config(), BATCH, WIDTH, cache=False)
    assert len(computed) == 2 and not result["from_cache"]
    assert len(_entries(cache_root)) == 1


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"peak_memory_bytes": 5}'])
def test_a_corrupt_entry_is_ignored_and_rewritten(cache_root, computed, content):
    first = estimate(bert_config(), BATCH, WIDTH)
    (entry,) = _entries(cache_root)
    entry.write_text(content)
    second = estimate(bert_config(), BATCH, WIDTH)
    assert len(computed) == 2 and not second["from_cache"]
    assert _figures(second) == _figures(first)
    assert json.loads(entry.read_text())["peak_memory_bytes"] == first["peak_memory_bytes"]
    assert estimate(bert_config(), BATCH, WIDTH)["from_cache"] and len(computed) == 2


def test_the_planner_counts_the_estimates_read_from_the_cache(cache_root, computed):
    lines: list[str] = []
    settings = Strategy(batch_size=BATCH, optimizer="adafactor")
    searches = [EstimateBook(bert_config(), WIDTH, echo=lines.append) for _ in range(2)]
    peaks = [search.peak(settings) for search in searches]
    assert peaks[0] == peaks[1] > 0
    assert [(search.count, search.cached) for search in searches] == [(1, 0), (1, 1)]
    assert len(computed) == 1
    assert not lines[0].endswith("(from the cache)") and lines[1].endswith("(from the cache)")


def test_a_runs_estimate_is_read_from_the_cache(cache_root, computed):
    windows = [[(BATCH, WIDTH)], [(BATCH, WIDTH - 2)], [(1, WIDTH)]]
    peaks = [run_batches_estimate(bert_model(), Strategy(), windows) for _ in range(2)]
    assert peaks[0] == peaks[1] > 0 and len(computed) == 1


def test_a_config_file_keys_by_its_content(cache_root, computed, tmp_path):
    path = tmp_path / "config.json"
    values = {**bert_config().to_dict(), "model_type": "bert"}
    path.write_text(json.dumps(values))
    first = estimate(str(path), BATCH, WIDTH)
    assert estimate(str(path), BATCH, WIDTH)["from_cache"] and len(computed) == 1
    path.write_text(json.dumps({**values, "intermediate_size": 64}))  # the same name, another model
    changed = estimate(str(path), BATCH, WIDTH)
    assert len(computed) == 2 and not changed["from_cache"]
    assert changed["parameters"] > first["parameters"]

"""Model FLOP utilisation: FLOPs per token counted by hand from the configs, the cached matmul peak, the summary."""

from __future__ import annotations

import json

import pytest
import torch

from looptrain import Loop, flops
from looptrain.config import ConfigError
from looptrain.freeze import freeze_embeddings, freeze_layers
from looptrain.run import MFU_KEYS
from looptrain.run_log import format_record

from conftest import make_tiny_bert, quiet_config, random_token_batches, task_batches

# The tiny BERT of conftest: hidden 32, intermediate 37, 2 layers, 3 labels.
HIDDEN, INTERMEDIATE, LAYERS, LABELS = 32, 37, 2, 3
BERT_LAYER = 4 * HIDDEN * HIDDEN + 2 * HIDDEN * INTERMEDIATE  # Q, K, V, attention output; 2 FFN
BERT_HEAD = HIDDEN * HIDDEN + HIDDEN * LABELS  # pooler, classifier
BERT_ATTENTION = LAYERS * 3 * 2 * 2 * HIDDEN  # QK^T and AV, 2 FLOPs per multiply-add, x3 for training


def test_tiny_bert_flops_per_token_by_hand():
    counted = flops.count_model_flops(make_tiny_bert())
    assert BERT_LAYER == 6464 and BERT_HEAD == 1120
    assert counted.dense == 6 * (LAYERS * BERT_LAYER + BERT_HEAD) == 84288  # the embeddings are lookups: not counted
    assert counted.attention == BERT_ATTENTION == 768
    assert flops.model_flops_per_token(make_tiny_bert(), 12) == 84288 + 768 * 12


def test_tiny_gpt2_with_its_tied_head_by_hand():
    from transformers import GPT2Config, GPT2LMHeadModel

    hidden, layers, vocab = 32, 2, 50
    model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=2, vocab_size=vocab, n_positions=64))
    # Per block: c_attn (32 -> 96), attention c_proj (32 -> 32), c_fc (32 -> 128), mlp c_proj (128 -> 32).
    block = hidden * 3 * hidden + hidden * hidden + hidden * 4 * hidden + 4 * hidden * hidden
    head = hidden * vocab  # lm_head, tied to wte: the lookup is free, the head's matmul is counted once
    counted = flops.count_model_flops(model)
    assert counted.dense == 6 * (layers * block + head) == 6 * 26176
    assert counted.attention == layers * 12 * hidden
    freeze_embeddings(model)  # the tied head freezes with wte: 4 per weight (its input's gradient is still needed)
    assert model.lm_head.weight.requires_grad is False
    assert flops.count_model_flops(model).dense == 6 * layers * block + 4 * head == 153856


def test_tiny_qwen2_with_grouped_query_attention_by_hand():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab = 32, 64, 2, 4, 2, 50
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                         tie_word_embeddings=False))
    head_dim = hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim  # q and o; k and v are narrower (GQA)
    mlp = 3 * hidden * intermediate  # gate, up, down
    counted = flops.count_model_flops(model)
    assert counted.dense == 6 * (layers * (attention + mlp) + hidden * vocab) == 120192
    assert counted.attention == layers * 12 * heads * head_dim == 768


def test_frozen_blocks_need_less():
    model = make_tiny_bert()
    freeze_layers(model, 1)  # the embeddings still train: the backward runs through block 0 (4 per weight)
    counted = flops.count_model_flops(model)
    assert counted.dense == 4 * BERT_LAYER + 6 * (BERT_LAYER + BERT_HEAD) == 71360
    assert counted.attention == BERT_ATTENTION
    freeze_embeddings(model)  # now nothing before block 1 trains: block 0 runs forward only (2 per weight)
    counted = flops.count_model_flops(model)
    assert counted.dense == 2 * BERT_LAYER + 6 * (BERT_LAYER + BERT_HEAD) == 58432
    assert counted.attention == 2 * 2 * HIDDEN + 3 * 2 * 2 * HIDDEN == 512


def test_a_plain_module_counts_its_matmul_weights():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    assert flops.count_model_flops(model) == flops.ModelFlops(6 * (8 * 16 + 16 * 3), 0.0)
    model[0].requires_grad_(False)  # before the first trainable layer: forward only
    assert flops.count_model_flops(model).dense == 2 * 8 * 16 + 6 * 16 * 3


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(device, dtype, seconds, size):
        calls.append(dtype)
        return 1e9 * len(calls)

    monkeypatch.setattr(flops, "_measure", fake_measure)
    return calls


def test_the_peak_is_measured_once_then_read_from_the_cache(fresh_cache):
    cpu = torch.device("cpu")
    first = flops.matmul_peak_flops(cpu, "fp32")
    second = flops.matmul_peak_flops(cpu, "fp32")
    assert fresh_cache == [torch.float32]
    assert first == second and first["flops_per_s"] == 1e9 and first["dtype"] == "fp32"
    assert torch.__version__ in first["key"] and str(torch.get_num_threads()) in first["device"]


def test_the_cache_key_names_dtype_and_capability(fresh_cache, monkeypatch):
    cpu = torch.device("cpu")
    fp32 = flops.matmul_peak_flops(cpu, "fp32")
    bf16 = flops.matmul_peak_flops(cpu, "bf16")
    assert fresh_cache == [torch.float32, torch.bfloat16] and bf16["flops_per_s"] == 2e9
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2-PRETEND")
    avx2 = flops.matmul_peak_flops(cpu, "fp32")
    assert len(fresh_cache) == 3 and avx2["key"] != fp32["key"] and "AVX2-PRETEND" in avx2["key"]
    assert len({fp32["key"], bf16["key"], avx2["key"]}) == 3


def test_a_cached_peak_a_run_beats_is_measured_again_once_and_the_better_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))
    rates = iter([1e9, 4e9, 2e9])  # first measurement beside other work, then a quiet one, then a busy one again
    monkeypatch.setattr(flops, "_measure", lambda device, dtype, seconds, size: next(rates))
    cpu = torch.device("cpu")
    assert flops.matmul_peak_flops(cpu, "fp32")["flops_per_s"] == 1e9
    assert flops.matmul_peak_flops(cpu, "fp32", at_least=0.9e9)["flops_per_s"] == 1e9  # not beaten: the cache
    assert flops.matmul_peak_flops(cpu, "fp32", at_least=3e9)["flops_per_s"] == 4e9  # beaten: measured again
    assert flops.matmul_peak_flops(cpu, "fp32", at_least=5e9)["flops_per_s"] == 4e9  # 2e9 measured, 4e9 kept
    assert flops.matmul_peak_flops(cpu, "fp32")["flops_per_s"] == 4e9


def test_the_cache_off_measures_every_time(fresh_cache, monkeypatch):
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", "off")
    flops.matmul_peak_flops(torch.device("cpu"), "fp32")
    flops.matmul_peak_flops(torch.device("cpu"), "fp32")
    assert len(fresh_cache) == 2


def test_a_real_short_measurement_is_a_positive_rate(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))
    peak = flops.matmul_peak_flops(torch.device("cpu"), "fp32", seconds=0.02, size=64)
    assert peak["size"] == 64 and 1e6 < peak["flops_per_s"] < 1e14


def _fit(batches, **fields) -> dict:
    model = make_tiny_bert()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return Loop(model, optimizer, batches, config=quiet_config(**fields)).fit()


def test_a_fit_reports_mfu_from_its_own_figures():
    lengths = [[12, 6, 9, 3], [5, 5, 11, 2], [7, 12, 1, 8]]
    summary = _fit(random_token_batches(lengths, vocab_size=35))
    tokens = sum(sum(row) for row in lengths)
    assert summary["train_tokens"] == tokens == 81 and summary["train_samples"] == 12
    per_token = 6 * (LAYERS * BERT_LAYER + BERT_HEAD) + BERT_ATTENTION * tokens / 12  # real tokens, mean real length
    assert summary["model_flops_per_token"] == pytest.approx(per_token, rel=1e-12)
    assert summary["model_flops_per_s"] == pytest.approx(per_token * summary["train_tokens_per_s"], rel=1e-3)
    assert summary["mfu"] == pytest.approx(summary["model_flops_per_s"] / summary["peak_flops_per_s"], rel=1e-12)
    assert 0 < summary["mfu"] <= 1
    assert summary["peak_flops_dtype"] == "fp32"
    assert torch.backends.cpu.get_cpu_capability() in summary["peak_flops_device"]


def test_a_run_that_beats_its_cached_peak_measures_it_again_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "_measure", lambda *args: 1.0)  # a peak measured while the cores were busy
    flops.matmul_peak_flops(torch.device("cpu"), "fp32")
    calls = []
    monkeypatch.setattr(flops, "_measure", lambda *args: calls.append(args) or 1e13)
    summary = _fit(task_batches(2, seed=0, rows=4), log_every=1)
    assert len(calls) == 1 and summary["peak_flops_per_s"] == 1e13 and 0 < summary["mfu"] < 1
    assert flops.matmul_peak_flops(torch.device("cpu"), "fp32")["flops_per_s"] == 1e13 and len(calls) == 1


def test_measure_mfu_off_leaves_the_figures_none(monkeypatch):
    monkeypatch.setattr(flops, "_measure", lambda *args: pytest.fail("measured with measure_mfu=False"))
    summary = _fit(task_batches(2, seed=0, rows=4), measure_mfu=False)
    assert {key: summary[key] for key in MFU_KEYS} == dict.fromkeys(MFU_KEYS)


def test_measure_mfu_must_be_a_bool():
    with pytest.raises(ConfigError, match="measure_mfu must be True or False"):
        quiet_config(measure_mfu="yes")


def test_the_log_line_and_the_table_show_mfu(tmp_path, capsys):
    summary = _fit(task_batches(2, seed=0, rows=4), log_every=1, output_dir=str(tmp_path))
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [event for event in events if event["event"] == "train"]
    assert len(train) == 2 and all(0 < event["mfu"] <= 1 for event in train)
    assert f"mfu={train[0]['mfu']:.1%}" in capsys.readouterr().out
    assert format_record({"mfu": 0.1234}) == "mfu=12.3%"
    from looptrain.cli.finetune import final_table

    table = final_table(summary, None, tmp_path)
    assert f"| MFU | {summary['mfu']:.1%} (" in table and "fp32 matmul peak" in table

"""The estimator on LoRA and QLoRA (peft, bitsandbytes 4-bit): against the tracker on real steps, and in bytes."""

from __future__ import annotations

import json
import re

import pytest
import torch

from looptrain import estimation
from looptrain.cli.estimate import main as estimate_main
from looptrain.fake import is_fake
from looptrain.lora import _quantized_4bit_bytes, apply_lora, default_targets

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

# The estimator drives the Loop's own update on fake tensors (QLoRA's 4-bit storage included): within 0.1% here.
TOLERANCE = 0.01
RANK = 4


def qwen2_config(hidden: int = 64):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0)


def causal_lm(hidden: int = 64):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(qwen2_config(hidden))


MIXES = {
    "lora + checkpointing": {"lora_rank": RANK, "gradient_checkpointing": True},
    "qlora": {"lora_rank": RANK, "qlora": True},
    "qlora + checkpointing": {"lora_rank": RANK, "qlora": True, "gradient_checkpointing": True},
}  # bf16 autocast is within 0.1% too; its first real 4-bit step compiles bitsandbytes' CPU kernels (seconds)


@pytest.mark.parametrize("mix", MIXES)
def test_estimate_matches_the_tracker_on_a_real_lora_step(mix):
    estimated = estimation.estimate(causal_lm(), 2, 16, **MIXES[mix])
    measured = estimation.measure(causal_lm(), 2, 16, **MIXES[mix])
    assert measured["memory_meter"] == "cpu_tensor_tracker" and measured["optimizer_steps"] == 2
    error = abs(estimated["peak_memory_bytes"] - measured["peak_memory_bytes"]) / measured["peak_memory_bytes"]
    assert error <= TOLERANCE, (mix, estimated["peak_memory_bytes"], measured["peak_memory_bytes"])


def gpt2_config(hidden: int = 64):
    """GPT-2: its projections are Conv1D (weight stored [in, out]), quantized as 4-bit Linears."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=256, n_embd=hidden, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)


def quantized_already(family: str):
    """A QLoRA model as a run holds it when it asks for its estimate: adapters on 4-bit weights (bitsandbytes'
    Params4bit, which cannot be copied into fake tensors)."""
    from transformers import AutoModelForCausalLM

    config = {"qwen2": qwen2_config, "gpt2": gpt2_config}[family]()
    torch.manual_seed(0)
    return apply_lora(AutoModelForCausalLM.from_config(config), RANK, qlora=True, compute_dtype=torch.float32), config


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_a_model_quantized_already_is_priced_as_its_config_and_as_the_tracker_measures(family, monkeypatch):
    """A run's own estimate and --memory-budget's plan price the wrapped model the run trains; on a QLoRA model that
    failed (a Params4bit cannot hold a FakeTensor: every QLoRA run said "no memory estimate"). Its 4-bit weights are
    priced by the bytes they store: the same estimate as from its config, within the tolerance of the real step."""
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", "off")  # computed, not read from a cache
    model, config = quantized_already(family)
    estimated = estimation.estimate(model, 2, 16, lora_rank=RANK, qlora=True)
    assert estimated == {**estimation.estimate(config, 2, 16, lora_rank=RANK, qlora=True),
                         **{key: estimated[key] for key in ("estimate_seconds", "compute_seconds")}}
    if family == "gpt2":  # Qwen2's QLoRA estimate is checked against the tracker above (MIXES["qlora"]); GPT-2's here
        measured = estimation.measure(quantized_already(family)[0], 2, 16, lora_rank=RANK, qlora=True)
        error = abs(estimated["peak_memory_bytes"] - measured["peak_memory_bytes"]) / measured["peak_memory_bytes"]
        assert error <= TOLERANCE, (estimated["peak_memory_bytes"], measured["peak_memory_bytes"])
    # The model priced stays as it was: its 4-bit weights real (every block Linear, or Conv1D, of 2 blocks).
    assert sum(type(module).__name__ == "Linear4bit" for module in model.modules()) == {"qwen2": 14, "gpt2": 8}[family]
    assert not any(is_fake(parameter) for parameter in model.parameters())


def test_lora_is_below_the_full_fine_tune_and_qlora_below_lora():
    # fp32 AdamW: 16 B per trained parameter before activations; LoRA trains 2% of them, QLoRA stores the frozen
    # block weights in ~0.5 B. A short sequence, where activations do not dominate.
    full = estimation.estimate(qwen2_config(128), 1, 16)
    lora = estimation.estimate(qwen2_config(128), 1, 16, lora_rank=RANK)
    qlora = estimation.estimate(qwen2_config(128), 1, 16, lora_rank=RANK, qlora=True)
    assert qlora["peak_memory_bytes"] < lora["peak_memory_bytes"] < 0.5 * full["peak_memory_bytes"]
    assert lora["memory_breakdown"]["grads"] + lora["memory_breakdown"]["optimizer_state"] < \
        0.1 * (full["memory_breakdown"]["grads"] + full["memory_breakdown"]["optimizer_state"])
    assert full["parameters"] < lora["parameters"] == qlora["parameters"]  # the adapters are parameters too


def test_qlora_params_are_the_4bit_storage_in_bytes():
    model = causal_lm()
    quantized = set(default_targets(model))
    modules = dict(model.named_modules())
    expected = 0
    for name, parameter in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        if module_name in quantized and kind == "weight":
            expected += _quantized_4bit_bytes(parameter.shape)  # packed NF4, absmaxes, offset, code tables
        else:
            expected += parameter.numel() * 4  # embedding, norms, biases: fp32 as they were
    expected += sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    for name in quantized:  # rank-r adapters in fp32: A is r x in, B is out x r
        expected += 4 * RANK * (modules[name].in_features + modules[name].out_features)
    estimated = estimation.estimate(qwen2_config(), 2, 32, lora_rank=RANK, qlora=True)
    assert estimated["memory_breakdown"]["params"] == expected
    # The same bytes bitsandbytes holds for a real layer; the same trained and total parameters as the real model.
    real = apply_lora(causal_lm(), RANK, qlora=True, compute_dtype=torch.float32)
    assert estimated["trainable_parameters"] == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert estimated["parameters"] == sum(p.numel() for p in model.parameters()) + sum(
        p.numel() for p in real.parameters() if p.requires_grad)  # 4-bit weights count as the weights they store
    weight = real.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight
    state = weight.quant_state
    held = [weight, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
    assert sum(t.untyped_storage().nbytes() for t in held) == _quantized_4bit_bytes(state.shape)


def test_the_command_line_answers_lora_from_a_config_as_json(tmp_path, capsys):
    model_dir = tmp_path / "qwen2"
    qwen2_config().save_pretrained(model_dir)
    assert estimate_main(["--model", str(model_dir), "--lora", "16", "--qlora", "--grad-checkpoint", "--seq-len",
                          "32", "--batch-size", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["memory_meter"] == "estimate_fake_tensor_tracker"
    assert 0 < result["trainable_parameters"] < result["parameters"]
    assert result["bytes_per_parameter"] == round(result["peak_memory_bytes"] / result["parameters"], 2)
    assert result["flags"][-3:] == ["--grad-checkpoint", "--lora", "16", "--qlora"][-3:]
    assert set(result["memory_breakdown"]) >= {"params", "grads", "optimizer_state", "activations_and_temps"}


def test_a_lora_classifier_estimate_keeps_every_fake_tensor_in_one_fake_mode(monkeypatch):
    """peft deep-copies the head a LoRA classifier trains (``modules_to_save``); a fake tensor's deepcopy copied its
    fake mode too, and the copy's storage weak references released the original's a second time (heap corruption,
    a segfault in a later estimate). The copied head's fakes stay in the estimate's mode."""
    from transformers import BertConfig

    from looptrain.estimation import estimator

    loops = []
    build = estimator._strategy_loop
    monkeypatch.setattr(estimator, "_strategy_loop", lambda *args, **kwargs: loops.append(build(*args, **kwargs))
                        or loops[-1])
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", "off")  # computed, not read from a cache
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=32, num_labels=2)
    estimation.estimate(config, 2, 8, lora_rank=RANK)
    names = {name for name, _ in loops[0].model.named_parameters()}
    assert any("modules_to_save" in name for name in names), sorted(names)  # the copied head is there
    modes = {id(parameter.fake_mode) for parameter in loops[0].model.parameters()}
    assert len(modes) == 1


def save_tiny_lm(directory, family: str):
    """A tiny GPT-2 or Llama causal LM (hidden 64, for bitsandbytes' CPU 4-bit kernels) and a word-level tokenizer."""
    from test_finetune_causal_lm import make_lm_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = make_lm_tokenizer()
    tokens = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.eos_token_id}
    config = gpt2_config() if family == "gpt2" else LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True)
    config.update(tokens)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def qlora_argv(tmp_path, family: str, *extra) -> list[str]:
    """A 2-update `--lora 4 --qlora` run of a tiny causal LM (`save_tiny_lm`) on 16 made-up texts."""
    from test_finetune_causal_lm import text_rows, write_jsonl

    model_dir = save_tiny_lm(tmp_path / family, family)
    train = write_jsonl(tmp_path / "train.jsonl", text_rows(16))
    return ["--task", "causal-lm", "--model", str(model_dir), "--data", str(train), "--output-dir",
            str(tmp_path / "run"), "--max-length", "32", "--batch-size", "4", "--max-steps", "2", "--eval-every", "no",
            "--precision", "fp32", "--device", "cpu", "--no-progress-bar", "--lora", "4", "--qlora", *extra]


@pytest.mark.parametrize("family, quantized", [("gpt2", 8), ("llama", 14)])
def test_a_qlora_run_says_how_many_layers_are_4bit_and_reports_its_estimate(family, quantized, tmp_path, capsys):
    """`--lora 4 --qlora` on GPT-2 said "4-bit NF4 base" over 0 quantized layers (its projections are Conv1D), and
    every QLoRA run said "notice: no memory estimate". GPT-2's 8 Conv1D layers are now 4-bit, the line counts the
    4-bit layers, and the run's estimate is reported with its error against the tracker's peak."""
    from looptrain.cli import finetune

    assert finetune.main(qlora_argv(tmp_path, family)) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^LoRA rank 4 \(alpha 8\) on {quantized} modules, frozen base, {quantized} of its layers in "
                     r"4-bit NF4: [0-9,]+ trainable", out, re.MULTILINE), out
    assert "no memory estimate" not in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # (measured - estimated) / estimated. Where the peak falls in a 4-bit forward (Llama's here) the estimate also
    # holds the weight bitsandbytes dequantizes inside that one op, which the process holds but the run's tracker
    # never sees (docs/lora.md): above the tracker by up to 2%, never below it by more than the tolerance.
    assert summary["estimated_peak_bytes"] > 0 and -2 * TOLERANCE <= summary["estimate_error"] <= TOLERANCE, summary

"""One block priced once: an estimate extrapolated from 2, 3 and 4 of N identical blocks is byte-exact against the
whole model's fake run (its peak, breakdown, phases' peaks and parameters), or says why it ran the whole model."""

from __future__ import annotations

import pytest

from looptrain import estimation
from looptrain.estimation import blocks
from looptrain.estimation import cache as estimate_cache
from looptrain.strategy import Strategy

FIGURES = ("peak_memory_bytes", "training_peak_bytes", "evaluation_peak_bytes", "memory_breakdown",
           "phase_peak_bytes", "parameters", "trainable_parameters")


def qwen2(layers: int = 5, **values):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=0,
                       max_position_embeddings=64, **values)


def llama(layers: int = 6):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, max_position_embeddings=64)


def gpt2(layers: int = 6):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=64, n_embd=16, n_layer=layers, n_head=2, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def bert(layers: int = 6):
    from transformers import BertConfig

    return BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def small_stacks(monkeypatch):
    """Stacks of 5-8 blocks extrapolated (the estimator keeps stacks of fewer than 16 whole: no time to save)."""
    monkeypatch.setattr(blocks, "FEWEST_BLOCKS", 5)


def _figures(result: dict) -> dict:
    return {name: result.get(name) for name in FIGURES}


def _both(model, batch_size: int = 1, seq_len: int = 8, **options) -> tuple[dict, dict]:
    extrapolated = estimation.estimate(model, batch_size, seq_len, cache=False, **options)
    whole = estimation.estimate(model, batch_size, seq_len, cache=False, extrapolate=False, **options)
    return extrapolated, whole


FAST = {  # in `make test`: the lowest settings of a causal LM (the default ones are in BROAD)
    "qwen2 bf16 weights + adafactor fused + checkpointing": (
        qwen2, {"weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True,
                "gradient_checkpointing": True}),
}
BROAD = {  # case: (config, levers, whether it extrapolates; where not, the whole model's run is the estimate)
    "qwen2 fp32 adamw": (qwen2, {}, True),
    "llama checkpointing + adamw": (llama, {"gradient_checkpointing": True}, True),
    "llama every other block checkpointed": (lambda: llama(8), {"gradient_checkpointing": True,
                                                                 "checkpoint_every": 2}, True),
    "llama adafactor fused into backward": (llama, {"optimizer": "adafactor", "optimizer_in_backward": True}, True),
    "llama adamw fused into backward, bf16 weights": (llama, {"optimizer_in_backward": True, "weights": "bf16"}, True),
    "llama chunked CE off, bf16 autocast": (llama, {"chunked_ce": "off", "precision": "bf16"}, True),
    "llama weights stepped by rows, bf16 weights + adafactor fused + checkpointing": (
        llama, {"weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True,
                "gradient_checkpointing": True, "step_by_rows": True}, True),
    "llama accumulation 2 + checkpointing": (llama, {"accum_steps": 2, "gradient_checkpointing": True}, True),
    "qwen2 frozen first layer": (lambda: qwen2(8), {"freeze_layers": 1}, True),
    "qwen2 adamw8bit": (qwen2, {"optimizer": "adamw8bit"}, True),
    # Falls back: the per-parameter ops of the first update's backward do not align (a final LayerNorm's like a
    # block's first one), or LoRA's backward ops inside a block repeat (q and v adapters alike).
    "llama LoRA": (lambda: llama(7), {"lora_rank": 4}, False),
    "gpt2 fp32 adamw": (gpt2, {}, False),
    "gpt2 bf16 weights + adafactor fused + checkpointing": (
        gpt2, {"weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True,
               "gradient_checkpointing": True}, False),
    "bert adamw": (bert, {}, False),
    "bert checkpointing + adafactor": (bert, {"gradient_checkpointing": True, "optimizer": "adafactor"}, False),
}


@pytest.mark.parametrize("case", list(FAST))
def test_an_extrapolated_estimate_is_the_whole_models_to_the_byte(case):
    make, options = FAST[case]
    extrapolated, whole = _both(make(), **options)
    assert extrapolated["extrapolated"] is True, extrapolated["extrapolation"]
    assert extrapolated["extrapolation"] == "blocks 2..4 of 5"
    assert whole["extrapolated"] is False and whole["extrapolation"] == "whole model: extrapolate=False"
    assert _figures(extrapolated) == _figures(whole)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BROAD))
def test_extrapolated_estimates_over_shapes_and_levers_are_the_whole_models_to_the_byte(case):
    make, options, extrapolates = BROAD[case]
    extrapolated, whole = _both(make(), batch_size=2, **options)
    assert extrapolated["extrapolated"] is extrapolates, extrapolated["extrapolation"]
    assert extrapolates or extrapolated["extrapolation"].startswith("whole model: the live bytes at ")
    assert _figures(extrapolated) == _figures(whole)


@pytest.mark.slow
def test_a_modules_estimate_and_a_windows_estimate_with_evaluation_extrapolate_exactly():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(llama())
    windows = [[(1, 12)], [(2, 8), (1, 12)]]
    options = {"evaluation": [(4, 12)], "padded": True, "cache": False}
    extrapolated = estimation.estimate_windows(model, windows, Strategy(optimizer="adafactor"), **options)
    whole = estimation.estimate_windows(model, windows, Strategy(optimizer="adafactor"), extrapolate=False, **options)
    assert extrapolated["extrapolated"] is True, extrapolated["extrapolation"]
    assert _figures(extrapolated) == _figures(whole)


def test_a_stack_that_cannot_be_extrapolated_says_why(monkeypatch):
    mixed = qwen2(6, use_sliding_window=True, sliding_window=4, max_window_layers=3)
    assert blocks.stack_blocks(mixed) == (0, "the blocks differ (the config's layer_types)")
    assert blocks.stack_blocks(qwen2(6)) == (6, None)
    assert blocks.depths(4, Strategy()) == (None, "4 blocks: too few to price 2, 3 and 4 of them")
    monkeypatch.setattr(blocks, "FEWEST_BLOCKS", 16)
    assert blocks.depths(12, Strategy()) == (None, "12 blocks: fewer than 16, where the whole model costs no more")
    monkeypatch.setattr(blocks, "FEWEST_BLOCKS", 5)
    assert blocks.depths(12, Strategy(gradient_checkpointing=True, checkpoint_every=2)) == ((2, 4, 6), None)
    assert blocks.depths(13, Strategy(gradient_checkpointing=True, checkpoint_every=2)) == ((3, 5, 7), None)
    assert blocks.depths(12, Strategy(freeze_layers=3)) == ((6, 7, 8), None)
    assert blocks.depths(12, Strategy(lora_rank=4)) == ((3, 4, 5), None)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(qwen2(6))
    assert blocks.stack_blocks(model) == (6, None)
    model.model.layers[3].mlp.up_proj.weight.requires_grad_(False)
    assert blocks.stack_blocks(model) == (0, "the blocks differ (their parameters, buffers or trainability)")


def test_a_short_stack_is_estimated_whole_and_says_so():
    result = estimation.estimate(qwen2(2), 1, 8, cache=False)
    assert result["extrapolated"] is False
    assert result["extrapolation"] == "whole model: 2 blocks: too few to price 2, 3 and 4 of them"


def test_align_maps_a_stacks_first_and_last_block_to_the_longer_stacks():
    # prefix P, blocks "ab" twice / three times, suffix "s"; events are ((op, bytes), phase).
    def events(text: str) -> list:
        return [((letter, 4), "forward") for letter in text]

    assert blocks.align(events("Pababs"), events("Pabababs")) == [0, 1, 2, 5, 6, 7]
    # an op whose size follows the depth (the stack of every parameter's norm) maps by its name
    short, long = events("Pababs"), events("Pabababs")
    short[-1], long[-1] = (("s", 8), "forward"), (("s", 12), "forward")
    assert blocks.align(short, long) == [0, 1, 2, 5, 6, 7]
    assert blocks.align(events("Pababs"), events("Pabxabs")) is None


def test_an_extrapolated_estimate_has_its_own_cache_key():
    config = qwen2(6)
    windows = [[(1, 8)], [(1, 8)]]

    def key(**options) -> str:
        return estimate_cache.key(config, windows, Strategy(), num_labels=2, max_grad_norm=1.0, padded=False,
                                  **options)

    assert key(extrapolated=True) != key(extrapolated=False) == key()


def test_a_fallen_back_estimate_is_cached_as_the_whole_models(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))

    def not_affine(*args, **kwargs):
        raise blocks.NotAffine("the live bytes at mm in forward do not grow by the same bytes per block")

    from looptrain.estimation import estimator

    monkeypatch.setattr(estimator, "extrapolated_result", not_affine)
    first = estimation.estimate(qwen2(6), 1, 8)
    assert first["extrapolated"] is False
    assert first["extrapolation"] == ("whole model: the live bytes at mm in forward do not grow by the same bytes "
                                      "per block")
    again = estimation.estimate(qwen2(6), 1, 8, extrapolate=False)
    assert again["from_cache"] is True and again["peak_memory_bytes"] == first["peak_memory_bytes"]
    assert len(list((tmp_path / estimate_cache.KIND).glob("*.json"))) == 2

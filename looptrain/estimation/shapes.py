"""The shapes an estimate prices: named model presets, configs, random batches, token windows, the ladder.

`preset_config` and `load_config` give a transformers config with no download; `is_causal_lm_config`
decides whether a config is estimated as a causal LM; `random_batch` is the batch of one shape that the
estimate (on fake tensors) and `measure` (for real) feed; `token_windows` cuts windows as the Loop cuts
them by tokens; `ladder` and `ACCURACY_MIXES` are the strategy mixes the tables and the accuracy check use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from looptrain.batches import token_pieces
from looptrain.strategy import Strategy

PRESETS = {
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                  "vocab_size": 30522},
    "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                   "vocab_size": 30522},
    "macbert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                      "intermediate_size": 4096, "vocab_size": 21128},
    # Decoder LMs (Qwen2Config numbers of the published checkpoints; tied input and output embeddings).
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "qwen2.5-3b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
                   "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
                   "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 32768, "tie_word_embeddings": False},
    # LlamaConfig numbers of Meta's published checkpoints (rope scaling left out: it changes no tensor's size).
    "llama-3.2-1b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True},
    "llama-3.2-3b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
                     "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True},
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False},
}


def preset_config(name: str, num_labels: int = 2):
    """The config of a named shape, no download: a ``BertConfig`` (bert-base, bert-large, macbert-large), a
    ``Qwen2Config`` (qwen2.5-0.5b, -1.5b, -3b, -7b) or a ``LlamaConfig`` (llama-3.2-1b, -3b, llama-3.1-8b): the
    decoders are estimated as causal LMs."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or pass --config / --model.")
    values = dict(PRESETS[name])
    return AutoConfig.for_model(values.pop("model_type", "bert"), num_labels=num_labels, **values)


def is_causal_lm_config(config: Any) -> bool:
    """Whether a transformers config describes a decoder-only causal LM (built with ``AutoModelForCausalLM``).

    True when it is not an encoder-decoder and either its ``architectures`` name a causal LM (``*ForCausalLM``,
    ``*LMHeadModel``), or it names no architecture and its model type has a causal-LM class but no masked-LM
    one (Qwen2, Llama, GPT-2, Mistral; not BERT, whose plain config stays a classifier).
    """
    from transformers.models.auto import modeling_auto

    if getattr(config, "is_encoder_decoder", False):
        return False
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
    model_type = getattr(config, "model_type", None)
    return (model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def load_config(path: str, num_labels: int = 2, trust_remote_code: bool = False):
    """A transformers config from a model directory or a config.json file (local only).

    A directory whose config ships its own code (an ``auto_map``) raises ValueError unless `trust_remote_code`:
    nothing asks "run the custom code?" on stdin.
    """
    from transformers import AutoConfig

    if os.path.isdir(path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    elif os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
        if "model_type" not in values:
            raise ValueError(f"{path} has no 'model_type'; add e.g. \"model_type\": \"bert\".")
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        raise ValueError(f"{path} is neither a model directory nor a config.json file.")
    config.num_labels = num_labels
    return config


def named_config(name: str, num_labels: int):
    """The config a preset name or a local path names."""
    return preset_config(name, num_labels) if name in PRESETS else load_config(name, num_labels)


def random_batch(batch_size: int, seq_len: int, vocab_size: int, num_labels: int, generator=None, *,
                 token_labels: bool = False, padded: bool = False) -> dict:
    """A batch of random token ids, every row `seq_len` long.

    Args:
        batch_size, seq_len: the batch's shape.
        vocab_size: token ids are drawn below it.
        num_labels: a sequence classifier's classes (one label per row).
        generator: the random generator (None: the global one).
        token_labels: a causal LM's batch: ``labels`` are the ``[batch_size, seq_len]`` token ids themselves
            (the model shifts them), every token scored; no attention mask (every row is whole).
        padded: with `token_labels`, a padded batch: its attention mask is kept, its rows after the first one
            token short (a real causal LM then builds the [rows, 1, seq, seq] mask and repeats GQA's KV heads).
    """
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    if token_labels and padded:
        attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        attention_mask[1:, -1] = 0
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "labels": input_ids.masked_fill(attention_mask == 0, -100)}
    if token_labels:
        # No attention mask: a real causal LM reads an all-ones mask's values and drops it (sdpa's is_causal path,
        # GQA's KV heads kept as they are); under fake tensors it cannot read them, and would build a
        # [rows, 1, seq, seq] mask and repeat the KV heads that the real run never does. No mask is that run.
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    return {"input_ids": input_ids, "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
            "labels": torch.randint(0, num_labels, (batch_size,), generator=generator)}


def token_windows(windows: Sequence[Sequence[tuple[int, int]]], strategy: Strategy) -> list[list[tuple[int, int]]]:
    """Windows of ``(rows, width)`` batches as the Loop cuts them with `strategy.micro_batch_tokens`, every row of
    a batch as wide as the batch (`looptrain.batches.token_pieces`: rows that fit the tokens together, then the
    rest)."""
    return [[(len(piece), width) for rows, width in window
             for piece in token_pieces([width] * rows, strategy.micro_batch_tokens)] for window in windows]


# The strategy mixes whose estimate tests/test_memory.py checks against a real Loop.fit (and
# scripts/estimate_accuracy.py tabulates): every lever, fp16 with its scaler, clipping and accumulation.
ACCURACY_MIXES = {
    "fp32 adamw": {},
    "bf16": {"precision": "bf16"},
    "checkpointing": {"gradient_checkpointing": True},
    "frozen encoder": {"freeze_encoder": True},
    "adafactor": {"optimizer": "adafactor"},
    "fused step": {"optimizer_in_backward": True},
    "foreach=False": {"foreach": False},
    "adamw8bit": {"optimizer": "adamw8bit"},
    "accumulation 4 + checkpointing": {"accum_steps": 4, "gradient_checkpointing": True},
    "adamw8bit fused step": {"optimizer": "adamw8bit", "optimizer_in_backward": True},
    "fp16 GradScaler + clipping + accumulation 3": {"precision": "fp16", "max_grad_norm": 0.5, "accum_steps": 3},
    "bf16 + checkpointing + frozen first layer + adafactor": {
        "precision": "bf16", "gradient_checkpointing": True, "freeze_layers": 1, "optimizer": "adafactor"},
    "no clipping + frozen embeddings + sgd": {"max_grad_norm": None, "freeze_embeddings": True, "optimizer": "sgd"},
    "bf16 weights": {"weights": "bf16"},
    "bf16 weights + fp32 grads + accumulation 3": {"weights": "bf16", "grad_dtype": "fp32", "accum_steps": 3},
    "bf16 weights + adamw8bit fused step": {"weights": "bf16", "optimizer": "adamw8bit", "optimizer_in_backward": True},
    "bf16 weights + adafactor fused step + checkpointing": {
        "weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True, "gradient_checkpointing": True},
}


def ladder(batch_size: int, seq_len: int) -> list[tuple[str, dict[str, Any]]]:
    """The strategy mixes of the ladder table: (label, ``estimate`` options) at one effective batch."""
    accumulated = {"batch_size": 1, "accum_steps": batch_size}
    checkpointed = {**accumulated, "gradient_checkpointing": True}
    return [
        (f"baseline: bs {batch_size}, fp32, AdamW", {}),
        (f"+ accumulation (bs 1 x {batch_size})", accumulated),
        ("+ gradient checkpointing", checkpointed),
        ("+ Adafactor", {**checkpointed, "optimizer": "adafactor"}),
        ("+ freeze encoder (head only)", {**checkpointed, "optimizer": "adafactor", "freeze_encoder": True}),
        (f"+ seq {seq_len // 2}",
         {**checkpointed, "optimizer": "adafactor", "freeze_encoder": True, "seq_len": seq_len // 2}),
        (f"bs {batch_size}, bf16 autocast", {"precision": "bf16"}),
        ("bs 1 x acc + ckpt, AdamW foreach=False", {**checkpointed, "foreach": False}),
        ("bs 1 x acc + ckpt, AdamW8bit", {**checkpointed, "optimizer": "adamw8bit"}),
        (f"bs {batch_size} + ckpt + bf16, AdamW8bit fused into backward",
         {"gradient_checkpointing": True, "precision": "bf16", "optimizer": "adamw8bit",
          "optimizer_in_backward": True}),
        (f"bs {batch_size} + ckpt + bf16, Adafactor fused into backward",
         {"gradient_checkpointing": True, "precision": "bf16", "optimizer": "adafactor",
          "optimizer_in_backward": True}),
        (f"bs {batch_size} + ckpt, bf16 weights, AdamW8bit fused",
         {"gradient_checkpointing": True, "weights": "bf16", "optimizer": "adamw8bit", "optimizer_in_backward": True}),
        (f"bs {batch_size} + ckpt, bf16 weights, Adafactor fused",
         {"gradient_checkpointing": True, "weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True}),
        ("bs 1 x acc + ckpt, bf16 weights, Adafactor", {**checkpointed, "weights": "bf16", "optimizer": "adafactor"}),
    ]

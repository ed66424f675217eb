"""Freezing: what gets frozen, that frozen weights never move, and the report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from looptrain.freeze import (
    embedding_modules,
    find_transformer_blocks,
    freeze,
    freeze_by_pattern,
    freeze_embeddings,
    freeze_encoder,
    freeze_layers,
    freeze_report,
    is_norm_module,
    trainable_parameters,
    unfreeze,
)
from looptrain.optim import build_optimizer

from conftest import SmallMLP, make_tiny_bert, random_token_batches


def _frozen_names(model):
    return {name for name, parameter in model.named_parameters() if not parameter.requires_grad}


def test_freeze_and_unfreeze_module_and_slice():
    model = make_tiny_bert(num_layers=3)
    freeze(model.bert.encoder.layer[:2])
    frozen = _frozen_names(model)
    assert frozen and all(name.startswith(("bert.encoder.layer.0.", "bert.encoder.layer.1.")) for name in frozen)
    unfreeze(model)
    assert not _frozen_names(model)


def test_freeze_embeddings_freezes_whole_embeddings_block():
    model = make_tiny_bert()
    names = freeze_embeddings(model)
    assert set(names) == {name for name, _ in model.bert.embeddings.named_parameters(prefix="bert.embeddings")}
    assert "bert.embeddings.LayerNorm.weight" in names
    assert "bert.embeddings.position_embeddings.weight" in names
    assert "bert.embeddings.token_type_embeddings.weight" in names


def test_freeze_embeddings_keep_norms_trainable():
    model = make_tiny_bert()
    freeze_embeddings(model, keep_norms_trainable=True)
    assert model.bert.embeddings.LayerNorm.weight.requires_grad
    assert not model.bert.embeddings.word_embeddings.weight.requires_grad


def test_freeze_embeddings_gpt2_style():
    from transformers import GPT2Config, GPT2Model

    model = GPT2Model(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    assert set(embedding_modules(model)) == {model.wte, model.wpe}
    assert set(freeze_embeddings(model)) == {"wte.weight", "wpe.weight"}


def test_freeze_layers_first_n_and_errors():
    model = make_tiny_bert(num_layers=3)
    names = freeze_layers(model, 2)
    assert names and all(name.startswith(("bert.encoder.layer.0.", "bert.encoder.layer.1.")) for name in names)
    assert all(parameter.requires_grad for parameter in model.bert.encoder.layer[2].parameters())
    with pytest.raises(ValueError, match="num_layers=4 but BertForSequenceClassification has 3"):
        freeze_layers(model, 4)
    with pytest.raises(ValueError, match="found no list of transformer blocks in SmallMLP"):
        freeze_layers(SmallMLP(), 1)


def test_find_transformer_blocks_generic():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    bert = make_tiny_bert(num_layers=2)
    assert find_transformer_blocks(bert) is bert.bert.encoder.layer
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    assert find_transformer_blocks(gpt2) is gpt2.transformer.h
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2)
    )
    assert find_transformer_blocks(llama) is llama.model.layers
    assert is_norm_module(llama.model.norm)  # LlamaRMSNorm: recognised though it subclasses nn.Module


def test_freeze_encoder_leaves_only_head():
    model = make_tiny_bert()
    freeze_encoder(model)
    assert {name for name, p in model.named_parameters() if p.requires_grad} == {"classifier.weight", "classifier.bias"}
    with pytest.raises(ValueError, match="SmallMLP has no separate base_model"):
        freeze_encoder(SmallMLP())


def test_freeze_by_pattern_glob_regex_and_typo():
    model = make_tiny_bert(num_layers=3)
    names = freeze_by_pattern(model, "bert.encoder.layer.[01].*")
    assert names and all(".layer.0." in name or ".layer.1." in name for name in names)
    unfreeze(model)
    names = freeze_by_pattern(model, [r"attention\.self\.query"], syntax="regex")
    assert len(names) == 6  # weight and bias in 3 layers
    names = freeze_by_pattern(model, "bert.encoder.*", keep_norms_trainable=True)
    assert not any("LayerNorm" in name for name in names)
    with pytest.raises(ValueError, match="matches no parameter"):
        freeze_by_pattern(model, "bert.encoder.layers.*")


def test_trainable_parameters():
    model = make_tiny_bert()
    freeze_encoder(model)
    assert trainable_parameters(model) == [model.classifier.weight, model.classifier.bias]


def test_frozen_weights_bitwise_unchanged_and_have_no_grad_or_state():
    model = make_tiny_bert(num_layers=2)
    freeze_embeddings(model)
    freeze_layers(model, 1)
    frozen_before = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    trainable_before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    optimizer = build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.1)
    for batch in random_token_batches([[5, 7], [6, 3], [8, 8]], vocab_size=model.config.vocab_size):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    parameters = dict(model.named_parameters())
    for name, before in frozen_before.items():
        assert torch.equal(parameters[name], before), name
        assert parameters[name].grad is None
        assert parameters[name] not in optimizer.state
    assert any(not torch.equal(parameters[name], before) for name, before in trainable_before.items())


def test_freeze_report_groups_compactly():
    model = make_tiny_bert(num_layers=3)
    freeze_embeddings(model)
    freeze_layers(model, 2)
    report = freeze_report(model)
    lines = report.splitlines()
    assert lines[0].startswith("BertForSequenceClassification:")
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in trainable_parameters(model))
    assert f"{trainable:,} of {total:,} parameters trainable" in lines[0]
    frozen_section = report.split("trainable:")[0]
    assert "bert.encoder.layer.0-1" in frozen_section and "bert.embeddings" in frozen_section
    assert "bert.encoder.layer.2 " in report.split("trainable:")[1]
    assert len(lines) < 25


def test_freeze_parameter_and_iterable_of_parameters():
    model = nn.Linear(2, 2)
    freeze([model.weight])
    assert not model.weight.requires_grad and model.bias.requires_grad
    freeze(model.bias)
    assert not trainable_parameters(model)

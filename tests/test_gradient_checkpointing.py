"""Gradient checkpointing: same grads as without, no reentrant warning, frozen blocks not recomputed."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from looptrain.freeze import freeze_embeddings, freeze_layers
from looptrain.gradient_checkpointing import (
    CheckpointedSequential,
    checkpointed_block_indices,
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
)

from conftest import make_tiny_bert, random_token_batches


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**batch).loss.backward()
    messages = [str(warning.message) for warning in caught]
    assert not [message for message in messages if "requires_grad" in message], messages
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _count_block_forwards(model):
    """Count runs of each block's attention submodule: a recomputed block runs it twice.

    (transformers checkpoints a layer's `forward`, not `__call__`, so hooks on the layer itself
    fire once; its submodules' hooks fire on every recomputation.)
    """
    counts = [0] * len(model.bert.encoder.layer)
    for index, block in enumerate(model.bert.encoder.layer):
        def hook(module, inputs, output, index=index):
            counts[index] += 1
        block.attention.register_forward_hook(hook)
    return counts


@pytest.mark.parametrize("frozen", [False, True])
def test_bert_checkpointed_grads_equal_plain(frozen):
    batch = random_token_batches([[6, 9, 4]], vocab_size=make_tiny_bert().config.vocab_size)[0]
    plain = make_tiny_bert(num_layers=3)
    checkpointed = make_tiny_bert(num_layers=3)
    if frozen:
        for model in (plain, checkpointed):
            freeze_embeddings(model)
            freeze_layers(model, 1)
    expected_blocks = [1, 2] if frozen else [0, 1, 2]
    assert enable_gradient_checkpointing(checkpointed) == expected_blocks
    assert checkpointed_block_indices(checkpointed) == expected_blocks

    expected = _grads(plain, batch)
    counts = _count_block_forwards(checkpointed)
    actual = _grads(checkpointed, batch)
    assert actual.keys() == expected.keys()
    if frozen:
        assert not any(name.startswith(("bert.embeddings", "bert.encoder.layer.0.")) for name in actual)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # Checkpointed blocks run forward twice (forward + recompute), the frozen leading block once.
    assert counts == ([1, 2, 2] if frozen else [2, 2, 2])


def test_frozen_block_after_trainable_embeddings_is_checkpointed():
    # Embeddings trainable, block 0 frozen: block 0 must backpropagate to the embeddings, so it
    # stores activations and is worth checkpointing.
    model = make_tiny_bert(num_layers=2)
    freeze_layers(model, 1)
    assert enable_gradient_checkpointing(model) == [0, 1]


def test_disable_restores_plain_forward():
    model = make_tiny_bert(num_layers=2)
    enable_gradient_checkpointing(model)
    disable_gradient_checkpointing(model)
    assert checkpointed_block_indices(model) == []
    counts = _count_block_forwards(model)
    _grads(model, random_token_batches([[5]], vocab_size=model.config.vocab_size)[0])
    assert counts == [1, 1]


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, inputs):
        self.calls += 1
        return torch.tanh(self.linear(inputs))


class Encoder(nn.Module):
    """A non-HF model with a `layers` ModuleList: blocks get an instance-level checkpointed forward."""

    def __init__(self, width=8, depth=4):
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, ids):
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden.square().mean()


def test_generic_block_model_checkpointed_grads_equal_plain():
    torch.manual_seed(0)
    model = Encoder()
    reference = Encoder()
    reference.load_state_dict(model.state_dict())
    for each in (model, reference):
        freeze_embeddings(each)
        freeze_layers(each, 1)
    assert enable_gradient_checkpointing(model) == [1, 2, 3]
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids).backward()
    assert not caught
    reference(ids).backward()
    assert [block.calls for block in model.layers] == [1, 2, 2, 2]
    for (name, actual), expected in zip(model.named_parameters(), reference.parameters()):
        if expected.grad is not None:
            torch.testing.assert_close(actual.grad, expected.grad, msg=name)
    disable_gradient_checkpointing(model)
    assert "forward" not in model.layers[0].__dict__ and checkpointed_block_indices(model) == []


@pytest.mark.parametrize("segments", [None, 2])
def test_checkpointed_sequential_grads_and_frozen_prefix(segments):
    torch.manual_seed(0)
    blocks = [Block(8) for _ in range(4)]
    reference = nn.Sequential(*[Block(8) for _ in range(4)])
    reference.load_state_dict(nn.Sequential(*blocks).state_dict())
    for module in (blocks[0], reference[0]):
        module.requires_grad_(False)
    wrapped = CheckpointedSequential(blocks, segments=segments)
    inputs = torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(inputs).sum().backward()
    assert not caught
    reference(inputs).sum().backward()
    for actual, expected in zip(wrapped.blocks, reference):
        if expected.linear.weight.grad is None:
            assert actual.linear.weight.grad is None
        else:
            torch.testing.assert_close(actual.linear.weight.grad, expected.linear.weight.grad)
    # Frozen prefix once; checkpointed segments twice; the last segment is never recomputed.
    expected_calls = [1, 2, 2, 1] if segments is None else [1, 2, 1, 1]
    assert [block.calls for block in wrapped.blocks] == expected_calls


def test_checkpointed_sequential_eval_runs_plain():
    wrapped = CheckpointedSequential(nn.Sequential(Block(4), Block(4))).eval()
    wrapped(torch.randn(2, 4)).sum().backward()
    assert [block.calls for block in wrapped.blocks] == [1, 1]


def test_errors():
    with pytest.raises(TypeError, match="CheckpointedSequential"):
        enable_gradient_checkpointing(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="segments=2 is only meaningful"):
        enable_gradient_checkpointing(make_tiny_bert(), segments=2)
    with pytest.raises(ValueError, match="segments must be >= 1"):
        CheckpointedSequential([nn.Linear(2, 2)], segments=0)


def test_every_second_block_is_checkpointed_with_the_same_grads_and_less_memory_than_none():
    batch = random_token_batches([[6, 9, 4]], vocab_size=make_tiny_bert().config.vocab_size)[0]
    plain, every_other = make_tiny_bert(num_layers=4), make_tiny_bert(num_layers=4)
    # From the first block: checkpointing the last one would recompute it at the peak and save nothing.
    assert enable_gradient_checkpointing(every_other, every=2) == [0, 2]
    expected = _grads(plain, batch)
    counts = _count_block_forwards(every_other)
    actual = _grads(every_other, batch)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert counts == [2, 1, 2, 1]  # half the recompute
    with pytest.raises(ValueError, match="every must be a positive integer"):
        enable_gradient_checkpointing(every_other, every=0)


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_checkpointing_every_k_blocks_trades_memory_monotonically():
    from transformers import BertConfig

    from looptrain import estimation

    config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64)
    peaks = [estimation.estimate(config, 16, 64, **options)["peak_memory_bytes"] for options in (
        {}, {"gradient_checkpointing": True, "checkpoint_every": 3},
        {"gradient_checkpointing": True, "checkpoint_every": 2}, {"gradient_checkpointing": True})]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > 2 * peaks[-1]

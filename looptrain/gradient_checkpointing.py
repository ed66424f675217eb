"""Activation (gradient) checkpointing: non-reentrant, and only where it saves memory.

Two entry points:

- `CheckpointedSequential` wraps an ``nn.Sequential`` (or a list of blocks) and runs it through
  ``torch.utils.checkpoint.checkpoint_sequential(..., use_reentrant=False)``.
- `enable_gradient_checkpointing(model)` turns checkpointing on, block by block, for a model whose
  blocks `looptrain.freeze.find_transformer_blocks` finds (Hugging Face encoders and decoders).

Why not ``model.gradient_checkpointing_enable()``: with frozen embeddings the first block's input
does not require grad. Reentrant checkpointing then drops the block's gradients and warns "None of
the inputs have requires_grad=True"; Hugging Face works around it with
``enable_input_require_grads()``, which makes the embedding output require grad, so every *frozen*
block stores activations for a backward pass that is of no use to it. Non-reentrant checkpointing
needs no such workaround: it records the graph for any parameter that requires grad. And a block
that neither owns a trainable parameter nor receives an input that requires grad (a frozen block
before the first trainable one) records no graph at all, so checkpointing it would only cost a
second forward. We therefore checkpoint a block exactly when a trainable parameter is in it or
before it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from looptrain.freeze import find_transformer_blocks

_ORIGINAL_FORWARD = "_looptrain_original_forward"


def _has_trainable_parameters(module: nn.Module) -> bool:
    return any(parameter.requires_grad for parameter in module.parameters())


class CheckpointedSequential(nn.Module):
    """An ``nn.Sequential`` whose trainable part is run under non-reentrant checkpointing.

    Leading modules without trainable parameters run normally (their input needs no grad, so they
    keep no activations); from the first trainable module on, the modules are split into
    `segments` segments and only each segment's input is kept, the rest being recomputed in
    backward. As in ``torch.utils.checkpoint.checkpoint_sequential``, the last segment is not
    checkpointed: backward starts there at once, so recomputing it would save nothing. In eval mode
    or under ``torch.no_grad()`` it is a plain ``nn.Sequential``.

    Args:
        modules: An ``nn.Sequential`` or an iterable of modules, applied in order.
        segments: Number of checkpoint segments for the trainable tail; ``None`` means one segment
            per module (the Hugging Face layout: keep each block's input only).
    """

    def __init__(self, modules: nn.Sequential | Iterable[nn.Module], segments: int | None = None):
        super().__init__()
        self.blocks = modules if isinstance(modules, nn.Sequential) else nn.Sequential(*modules)
        if segments is not None and segments < 1:
            raise ValueError(f"CheckpointedSequential: segments must be >= 1 or None, got {segments}.")
        self.segments = segments

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        blocks = list(self.blocks)
        if not (self.training and torch.is_grad_enabled()):
            for block in blocks:
                inputs = block(inputs)
            return inputs
        first_trainable = len(blocks)
        if inputs.requires_grad:
            first_trainable = 0
        else:
            for index, block in enumerate(blocks):
                if _has_trainable_parameters(block):
                    first_trainable = index
                    break
        for block in blocks[:first_trainable]:
            inputs = block(inputs)
        tail = blocks[first_trainable:]
        if not tail:
            return inputs
        segments = len(tail) if self.segments is None else min(self.segments, len(tail))
        return checkpoint_sequential(nn.Sequential(*tail), segments, inputs, use_reentrant=False)


def _checkpointed_forward(module: nn.Module, original_forward, *args, **kwargs):
    """Instance-level forward for blocks that are not Hugging Face GradientCheckpointingLayers."""
    if module.training and torch.is_grad_enabled():
        return checkpoint(original_forward, *args, use_reentrant=False, **kwargs)
    return original_forward(*args, **kwargs)


def _blocks_to_checkpoint(model: nn.Module, blocks: nn.ModuleList) -> list[bool]:
    """For each block: does it own a trainable parameter or follow one (in registration order)?

    Registration order is forward order for the architectures we support (embeddings, then the
    blocks in sequence). A frozen block after a trainable embedding still has to backpropagate to
    that embedding, so it keeps activations and is worth checkpointing.
    """
    trainable_seen = False
    seen_before: dict[int, bool] = {}
    for parameter in model.parameters():
        seen_before[id(parameter)] = trainable_seen
        trainable_seen = trainable_seen or parameter.requires_grad
    decisions = []
    for block in blocks:
        parameters = list(block.parameters())
        upstream_trainable = bool(parameters) and seen_before.get(id(parameters[0]), False)
        decisions.append(upstream_trainable or _has_trainable_parameters(block))
    return decisions


def _is_hf_checkpointing_layer(block: nn.Module) -> bool:
    try:  # transformers is optional for this module: plain PyTorch blocks work without it
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return False
    return isinstance(block, GradientCheckpointingLayer)


def enable_gradient_checkpointing(model: nn.Module, segments: int | None = None, every: int = 1) -> list[int]:
    """Turn on non-reentrant checkpointing for the blocks of `model` that need it.

    A block is checkpointed when it owns a trainable parameter or a trainable parameter comes
    before it (then its input requires grad and it would store activations). Frozen blocks before
    the first trainable parameter are left alone: they store nothing anyway. Call it *after*
    freezing, and again if you change what is frozen.

    Hugging Face blocks (``GradientCheckpointingLayer``, transformers >= 4.52) get
    ``gradient_checkpointing=True`` and ``torch.utils.checkpoint.checkpoint`` with
    ``use_reentrant=False``; other blocks get an instance-level checkpointed ``forward``. Never
    calls ``enable_input_require_grads()``.

    Args:
        model: A transformer (HF or not) whose block list `find_transformer_blocks` finds.
        segments: Must be ``None`` for block models: each checkpointed block is its own segment.
            Use `CheckpointedSequential` to choose segments for an ``nn.Sequential``.
        every: Checkpoint every `every`-th of the blocks that need it (1: all of them; 2: every other
            one, about half the activation saving for about half the recompute). The planner uses it
            as a lever between none and all.

    Returns:
        The indices of the checkpointed blocks.

    Raises:
        TypeError: If `model` is an ``nn.Sequential`` (wrap it in `CheckpointedSequential`).
        ValueError: If `segments` is given for a block model or no block list is found.
    """
    if isinstance(model, nn.Sequential):
        raise TypeError(
            "enable_gradient_checkpointing: got an nn.Sequential; wrap it instead: "
            "CheckpointedSequential(model, segments=...)."
        )
    if segments is not None:
        raise ValueError(
            f"enable_gradient_checkpointing: segments={segments} is only meaningful for "
            "CheckpointedSequential; transformer blocks are checkpointed one block per segment."
        )
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"enable_gradient_checkpointing: every must be a positive integer, got {every!r}.")
    blocks = find_transformer_blocks(model)
    disable_gradient_checkpointing(model)
    checkpoint_function = functools.partial(checkpoint, use_reentrant=False)
    checkpointed = []
    candidates = [index for index, wanted in enumerate(_blocks_to_checkpoint(model, blocks)) if wanted]
    chosen = set(candidates[::every])  # from the first: checkpointing the last block would save nothing at the peak
    for index, block in enumerate(blocks):
        if index not in chosen:
            continue
        checkpointed.append(index)
        if _is_hf_checkpointing_layer(block):
            block._gradient_checkpointing_func = checkpoint_function
            block.gradient_checkpointing = True
        else:
            original_forward = block.forward
            setattr(block, _ORIGINAL_FORWARD, original_forward)
            block.forward = functools.partial(_checkpointed_forward, block, original_forward)
    if checkpointed:
        # Model-level flags (GPT-2, LLaMA) make the model drop the KV cache while training, as HF's
        # own switch does; the blocks above decide what is recomputed.
        for module in model.modules():
            if (module not in blocks and hasattr(module, "gradient_checkpointing")
                    and not _is_hf_checkpointing_layer(module)):
                module.gradient_checkpointing = True
    return checkpointed


def disable_gradient_checkpointing(model: nn.Module) -> None:
    """Undo `enable_gradient_checkpointing` (and HF's own switch): every block runs plainly.

    Args:
        model: The model.
    """
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing") and isinstance(module.gradient_checkpointing, bool):
            module.gradient_checkpointing = False
        original_forward = module.__dict__.pop(_ORIGINAL_FORWARD, None)
        if original_forward is not None:
            del module.forward  # drop the instance attribute; the class's forward shows through


def checkpointed_block_indices(model: nn.Module) -> list[int]:
    """Indices of the blocks of `model` currently set to be checkpointed.

    Args:
        model: A model whose block list `find_transformer_blocks` finds.

    Returns:
        Sorted block indices.
    """
    blocks = find_transformer_blocks(model)
    return [
        index
        for index, block in enumerate(blocks)
        if getattr(block, "gradient_checkpointing", False) is True or _ORIGINAL_FORWARD in block.__dict__
    ]

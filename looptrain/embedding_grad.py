"""The input embedding's gradient, accumulated row by row: no vocabulary-sized temporary per micro-batch.

``nn.Embedding``'s backward returns a dense ``[vocab, hidden]`` gradient, zeros except the rows the
micro-batch's tokens use, and autograd then adds it into ``.grad``. Under gradient accumulation every
micro-batch after the first allocates, zeroes and adds that whole tensor again, for the few hundred rows a
micro-batch touches. It can be the peak of an accumulating run's backward (docs/memory.md, "The input
embedding's gradient, row by row", has the measurement).

`accumulate_embedding_rows` makes the model's input embedding add only those rows into ``.grad``. It
is the dense path's arithmetic in the dense path's order, so ``.grad`` is bitwise the same: per row,
the micro-batch's token gradients are summed from zero in token order (as
``embedding_dense_backward`` sums them), padding rows sum to zero, and that sum is added into
``.grad`` once (as autograd's ``grad += new``). The parameter's post-accumulate-grad hooks still run
(the fused step, the memory tracker and the planner's probes rely on them): torch 2.13's autograd runs them
itself after this backward, and where a torch would not, this path runs them.

Where it would not be exact it is not used, and the embedding runs as ``nn.Embedding``:

- not a CPU run, or the weight not fp32/fp64 (CUDA's ``index_add_`` adds in no fixed order; a bf16
  weight's gradient is accumulated by `looptrain.optim.bf16`);
- the weight tied to another module (an LM head) or carrying a tensor hook (``register_hook``):
  autograd must see its gradient;
- ``max_norm``, ``scale_grad_by_freq`` or ``sparse`` set, or a subclass of ``nn.Embedding``;
- under DDP or FSDP (their reducers wait for autograd's accumulation) or ``torch.compile``.

A model whose code reads the embedding's weight outside the module (``F.linear(h, emb.weight)``)
still gets the right gradient, the sum of both paths, though not in the dense path's rounding order.
Code that calls ``torch.autograd.grad`` on the weight gets nothing from this path: turn it off
(``LoopConfig(embedding_row_grads=False)``, ``--no-embedding-row-grads``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from looptrain.fake import is_fake
from looptrain.freeze import input_embeddings

_EXACT_DTYPES = (torch.float32, torch.float64)


def accumulate_embedding_rows(model: nn.Module, enabled: bool = True) -> nn.Embedding | None:
    """Make `model`'s input embedding accumulate its gradient row by row (see the module's docstring).

    The embedding becomes a `RowGradEmbedding` in place (its class is swapped: the same module, parameters and
    state dict). Returns it, or None where the model has no plain, untied ``nn.Embedding`` as its input embedding.
    Idempotent; ``enabled=False`` turns a `RowGradEmbedding` back into an ``nn.Embedding``. Whether a forward takes
    the row path is decided at each call (the weight's device, dtype, ``requires_grad`` and hooks may change over a
    run: unfreezing, a cast).
    """
    embedding = input_embeddings(model)
    plain = type(embedding) in (nn.Embedding, RowGradEmbedding)
    eligible = enabled and plain and embedding.max_norm is None and not embedding.scale_grad_by_freq \
        and not embedding.sparse and _uses(model, embedding.weight) == 1
    if plain and not eligible:
        embedding.__class__ = nn.Embedding
    if not eligible:
        return None
    _engine_runs_hooks()  # asked now, outside any backward
    embedding.__class__ = RowGradEmbedding
    return embedding


def _uses(model: nn.Module, parameter: nn.Parameter) -> int:
    """How many modules hold `parameter` (more than one: tied weights)."""
    return sum(held is parameter for module in model.modules() for held in module._parameters.values())


class RowGradEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose backward adds only the used rows into ``weight.grad`` where that is exact (CPU,
    fp32/fp64, grad enabled, no tensor hook on the weight), and is ``nn.Embedding``'s elsewhere.
    `accumulate_embedding_rows` makes one from a model's embedding."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (torch.is_grad_enabled() and weight.requires_grad and weight.device.type == "cpu"
                and weight.dtype in _EXACT_DTYPES and not weight._backward_hooks):
            return _RowGradEmbedding.apply(input, weight, self.padding_idx)
        return super().forward(input)


class _RowGradEmbedding(torch.autograd.Function):
    """``F.embedding`` whose backward adds the used rows into ``weight.grad`` and returns no gradient for it."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(input)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return nn.functional.embedding(input, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (input,) = ctx.saved_tensors
        add_rows(ctx.weight, input, grad_output, ctx.padding_idx)
        return None, None, None


def add_rows(weight: torch.Tensor, input: torch.Tensor, grad_output: torch.Tensor, padding_idx: int | None) -> None:
    """``weight.grad += embedding_dense_backward(grad_output, input)``, bitwise, touching only the used rows.

    Then the weight's post-accumulate-grad hooks run, as autograd's accumulation runs them.
    """
    hidden = weight.shape[-1]
    ids = input.reshape(-1)
    grads = grad_output.reshape(-1, hidden)
    if is_fake(ids):
        # The estimator's fake tensors hold no token ids: the most rows a micro-batch can use, one a token.
        rows, sums = ids, grads.new_zeros(grads.shape)
        sums.index_add_(0, torch.arange(ids.numel(), device=ids.device), grads)
    else:
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        sums = grads.new_zeros((rows.numel(), hidden))
        sums.index_add_(0, inverse, grads)  # each row's token gradients from zero, in token order
        if padding_idx is not None:
            sums[rows == padding_idx] = 0  # the padding row's gradient is zero, as in the dense backward
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    weight.grad.index_add_(0, rows, sums)
    hooks = weight._post_accumulate_grad_hooks  # what `register_post_accumulate_grad_hook` registered, in order
    if hooks and not _engine_runs_hooks():
        for hook in list(hooks.values()):
            hook(weight)


@functools.cache
def _engine_runs_hooks() -> bool:
    """Whether autograd runs a leaf's post-accumulate-grad hooks when the backward feeding it returns no gradient.

    torch 2.13's does (after `_RowGradEmbedding.backward`, with the rows already added): running them here too would
    step a fused optimizer twice. Asked once, of the engine itself, so that a torch that does not still runs them.
    """
    leaf = torch.zeros(1, requires_grad=True)
    calls = []
    leaf.register_post_accumulate_grad_hook(calls.append)
    with torch.enable_grad():
        _NoGradient.apply(leaf).sum().backward()
    return bool(calls)


class _NoGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return None

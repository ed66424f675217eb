"""Chunked cross-entropy: a causal LM's head and loss in tiles of the vocabulary, so the [tokens, vocab] logits
never exist.

A causal LM's own loss computes every position's logits (``[batch, length, vocab]``), upcasts them to fp32 and
keeps what cross-entropy needs for backward: for a 150k vocabulary at 2048 tokens, over a gigabyte each. Here the
model's decoder body runs to its last hidden states, the positions whose (shifted) label is -100 are dropped, and
`chunked_cross_entropy` computes the sum of cross-entropy with an autograd function that goes over the head's
weight by tiles of vocabulary rows, each tile's logits for all of the micro-batch's tokens at once (for blocks of
them where there are so many that a tile would be narrower than `MIN_TILE_ROWS`), folded into each token's
logsumexp; it saves the hidden states, the head's weight (and bias), the labels and the logsumexp, and backward
recomputes each tile's logits. At most one tile's logits exist at a time (`AUTO_CHUNK_LOGITS`, or the user's
``ce_chunk_tokens x vocab``), the head's weight is read once per block in forward and once in backward, and its
gradient's rows are written once per block. The math is the model's: the logits in the dtype the head would
compute them in (autocast's, else the weight's), the cross-entropy in fp32 as transformers takes it, and the
head's weight gradient returned to autograd, so tied input/output embeddings get the sum of both uses. For a tied
``nn.Embedding`` that sum is made in one tensor: during the training forward the lookup runs as `_TiedLookup`,
whose backward adds its rows into the head's weight gradient in place, so one ``[vocab, hidden]`` gradient exists
instead of three (the head's, held by autograd through the blocks' backward, the lookup's and their sum).

With ``step_by_rows`` and the fused step (`looptrain.optim.OptimizerInBackward`, which marks the weights it
takes by rows: `row_stepper`; the other linear layers' are `looptrain.optim.row_linear`'s), an untied head's
weight gradient is never formed: after the tiles' pass for the hidden states' gradient, the head is stepped by
chunks of vocabulary rows, each chunk's gradient rows computed by the same tiled backward (`_Tiles.weight_rows`);
and the untied input embedding's lookup runs as `_RowSteppedLookup`, whose backward steps the embedding by chunks
of rows from ``nn.Embedding``'s own dense backward over each chunk. See docs/memory.md ("Weights stepped by rows").

`ChunkedLMLoss.for_model` decides once, when the Loop is built, whether a model can be served exactly; where it
cannot (a head that is not a Linear, logit softcapping, no decoder body, a sharded head, a head that does more
than its Linear: checked on the first batch by comparing with the model's own logits) the model's own loss is
used, with a one-time notice. Under DDP the training forward runs through the wrapper (the model's own forward,
its head standing aside), so gradients are synced as usual. See docs/causal_lm.md ("Chunked cross-entropy").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from looptrain.batches import IGNORE_INDEX
from looptrain.fake import is_fake
from looptrain.optim.bf16 import priced_chunks
from looptrain.optim.in_backward import row_stepper
from looptrain.strategy import CHUNKED_CE_MODES, ConfigError
from looptrain.tile_sample import TileSample, active

# Batch keys the model's own forward takes for its loss or its head, never the decoder body's.
_HEAD_KEYS = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "return_dict")
AUTO_CHUNK_LOGITS = 2**23  # ce_chunk_tokens=0: a tile holds at most this many logits (32 MiB in fp32)
MIN_TILE_ROWS = 1024  # a tile of fewer vocabulary rows (for all of a micro-batch's tokens) splits the tokens too
_PROBE_TOKENS = 8  # the first batch's check runs the model on one row of this many tokens


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropy of ``hidden @ weight.T + bias`` against `labels`, one tile of vocabulary rows at a time.

    Forward: per block of tokens (`_tiling`: all of them, unless that would leave tiles under `MIN_TILE_ROWS`
    rows), each tile's logits for the block fold into each token's logsumexp, and the tile holding a token's label
    gives its target logit; only the logsumexp (one fp32 a token) is kept for backward, which is `_Tiles`'.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, max_logits, dtype, tied=None):
        _check_labels(labels, weight.shape[0])
        tiling = _tiling(hidden.shape[0], weight.shape[0], max_logits)
        sample = active()  # a probe's: a sample of the tiles, the others' seconds recorded (`looptrain.tile_sample`)
        normalisers = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for tokens in _slices(hidden, tiling[1]):
                hidden_d, labels_b = hidden[tokens].to(dtype), labels[tokens]
                lse = target = None
                for _, rows in _tile_loop(weight, tiling[0], sample):
                    logits = F.linear(hidden_d, *_rows_in_dtype(weight, bias, rows, dtype)).float()
                    tile_lse = torch.logsumexp(logits, dim=-1)
                    lse = tile_lse if lse is None else torch.logaddexp(lse, tile_lse)
                    column, inside = _in_rows(labels_b, rows, logits.shape[1])
                    picked = logits.gather(1, column[:, None])[:, 0]
                    target = torch.where(inside, picked, 0.0 if target is None else target)
                    del logits, tile_lse, picked
                normalisers[tokens] = lse
                total += torch.where(labels_b != IGNORE_INDEX, lse - target, 0.0).sum()
        ctx.save_for_backward(hidden, weight, bias, labels, normalisers)
        ctx.tiling, ctx.dtype, ctx.tied, ctx.sample = tiling, dtype, tied, sample
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, labels, normalisers = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        tied = ctx.tied if ctx.tied is not None and not ctx.tied.consumed else None
        # step_by_rows: the fused step takes the weight's gradient by rows of the vocabulary (`_Tiles.weight_rows`)
        stepper = row_stepper(weight) if needs_weight and ctx.tied is None else None
        grad_weight, fresh = None, False
        if needs_weight and stepper is None:
            grad_weight = tied.gradient if tied is not None else None
            if grad_weight is None:  # written by the first block of tokens (zeros where none, or tiles are skipped)
                skips = ctx.sample is not None and ctx.sample.skips(math.ceil(weight.shape[0] / ctx.tiling[0]))
                fill = torch.empty_like if hidden.shape[0] and not skips else torch.zeros_like
                grad_weight, fresh = fill(weight), True
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if needs_hidden else None
        grad_bias = torch.zeros_like(bias) if needs_bias else None
        tiles = _Tiles(hidden, weight, bias, labels, normalisers, grad_total, ctx.tiling, ctx.dtype, ctx.sample)
        with torch.autocast(hidden.device.type, enabled=False):
            tiles.backward(grad_hidden, grad_weight, grad_bias, fresh)
            if stepper is not None:  # after grad_hidden, which needs the weight before its step
                stepper(weight, tiles.weight_rows, ctx.tiling[0])
        if tied is not None and grad_weight is not None:  # the lookup's backward (next) adds its rows and returns it
            tied.gradient, grad_weight = grad_weight, None
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


class _Tiles:
    """The chunked cross-entropy's backward, by blocks of tokens and tiles of vocabulary rows (`_tiling`).

    A tile's gradient of the summed loss with respect to its logits is ``exp(logit - logsumexp)`` (the softmax, from
    the forward's logsumexp over the whole vocabulary) minus one at the tokens whose label is in the tile, times
    the loss's gradient where scored, in fp32, then in the logits' dtype (as autograd's ``.float()`` gives it back).
    `backward` runs every tile once: its rows of the weight's gradient written (or added), its part of the hidden
    states' gradient added; `weight_rows` gives any rows' gradient over every token, for the fused step by rows.
    """

    def __init__(self, hidden, weight, bias, labels, normalisers, grad_total, tiling, dtype,
                 sample: TileSample | None = None):
        # the weight as it is now: a step by rows swaps the parameter's .data while it runs
        self.hidden, self.weight, self.labels, self.normalisers = hidden, weight.detach(), labels, normalisers
        self.bias = bias.detach() if bias is not None else None
        self.scale = torch.where(labels != IGNORE_INDEX, grad_total.float(), 0.0)
        self.tiling, self.dtype, self.sample = tiling, dtype, sample

    def grad_logits(self, hidden_d: torch.Tensor, tokens: slice, rows: slice, head_rows: tuple) -> torch.Tensor:
        """d(loss)/d(logits) of the tokens `tokens` (their hidden states `hidden_d`) at the vocabulary rows `rows`
        (the head's rows there, `_rows_in_dtype`'s `head_rows`)."""
        grad = F.linear(hidden_d, *head_rows).float()
        scale = self.scale[tokens]
        grad.sub_(self.normalisers[tokens, None]).exp_().mul_(scale[:, None])
        column, inside = _in_rows(self.labels[tokens], rows, grad.shape[1])
        grad.scatter_add_(1, column[:, None], torch.where(inside, -scale, 0.0)[:, None])  # minus the one-hot's
        return grad.to(self.dtype)

    def backward(self, grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
                 grad_bias: torch.Tensor | None, fresh: bool) -> None:
        """Each tile once per block: `grad_hidden` (fp32) written, `grad_weight`'s rows written by the first block
        where `fresh` (else added), `grad_bias`'s added."""
        if grad_hidden is None and grad_weight is None and grad_bias is None:
            return
        for block, tokens in enumerate(_slices(self.hidden, self.tiling[1])):
            hidden_d = self.hidden[tokens].to(self.dtype)
            for index, rows in _tile_loop(self.weight, self.tiling[0], self.sample):
                head_rows = _rows_in_dtype(self.weight, self.bias, rows, self.dtype)
                grad = self.grad_logits(hidden_d, tokens, rows, head_rows)
                if grad_hidden is not None:
                    _add_product(grad_hidden[tokens], grad, head_rows[0], index == 0)
                if grad_weight is not None:
                    _add_product(grad_weight[rows], grad.t(), hidden_d, fresh and block == 0)
                if grad_bias is not None:
                    grad_bias[rows] += grad.sum(0).to(grad_bias.dtype)

    def weight_rows(self, rows: slice) -> torch.Tensor:
        """The weight's gradient rows `rows` over every token (`OptimizerInBackward.step_rows`' source)."""
        total, head_rows = None, _rows_in_dtype(self.weight, self.bias, rows, self.dtype)
        for tokens in _slices(self.hidden, self.tiling[1]):
            hidden_d = self.hidden[tokens].to(self.dtype)
            part = self.grad_logits(hidden_d, tokens, rows, head_rows).t() @ hidden_d
            total = part if total is None else total.float().add_(part)
        if total is None:
            return self.weight.new_zeros(self.weight[rows].shape, dtype=self.dtype)
        return total


def _tiling(tokens: int, vocab: int, max_logits: int) -> tuple[int, int]:
    """(vocabulary rows a tile, tokens a block): a tile's logits ``[block, rows]`` hold at most `max_logits`.

    A block is every token, unless its tiles would then be narrower than `MIN_TILE_ROWS` rows (or the whole
    vocabulary, if smaller): then as many tokens as keep tiles of that width within `max_logits`.
    """
    floor = min(vocab, MIN_TILE_ROWS)
    block = max(1, tokens) if tokens * floor <= max_logits else max(1, max_logits // floor)
    return max(1, min(vocab, max_logits // block)), block


def _slices(tensor: torch.Tensor, step: int) -> Iterator[slice]:
    """`tensor`'s rows by `step`; on the estimator's fake tensors the full slices between the first two and the last
    three are skipped (`looptrain.optim.bf16.priced_chunks`: each leaves what its neighbours leave, so the same
    bytes)."""
    return priced_chunks([slice(start, min(start + step, tensor.shape[0]))
                          for start in range(0, tensor.shape[0], step)], tensor)


def _tile_loop(weight: torch.Tensor, rows: int, sample: TileSample | None) -> Iterator[tuple[int, slice]]:
    """The vocabulary tiles of `rows` rows of `weight` to compute, as (index, rows): every one, or `sample`'s."""
    tiles = list(_slices(weight, rows))
    return enumerate(tiles) if sample is None else sample.loop(tiles)


def _rows_in_dtype(weight: torch.Tensor, bias: torch.Tensor | None, rows: slice, dtype: torch.dtype):
    return weight[rows].to(dtype), (bias[rows].to(dtype) if bias is not None else None)


def _in_rows(labels: torch.Tensor, rows: slice, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's column within the vocabulary rows `rows` (clamped into them), and whether it falls in them."""
    column = labels - rows.start
    return column.clamp(0, width - 1), (column >= 0) & (column < width)


def _add_product(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor, first: bool) -> None:
    """``total = left @ right`` where `first`, else ``total += left @ right``; without a temporary where the dtypes
    agree (else the product in `left`'s dtype, as autograd gives it, then into `total`)."""
    if total.dtype == left.dtype:
        if first:
            torch.mm(left, right, out=total)
        else:
            total.addmm_(left, right)
    elif first:
        total.copy_(left @ right)
    else:
        total += left @ right


def _check_labels(labels: torch.Tensor, vocab: int) -> None:
    """As ``F.cross_entropy``: a scored label outside the vocabulary is an error (not checked on fake tensors)."""
    if is_fake(labels) or not labels.numel():
        return
    outside = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
    if bool(outside.any()):
        raise IndexError(f"Target {int(labels[outside][0])} is out of bounds (vocabulary of {vocab}).")


class _TiedGradient:
    """The one ``[vocab, hidden]`` gradient of a tied embedding for one forward (see `_TiedLookup`)."""

    __slots__ = ("gradient", "consumed")

    def __init__(self) -> None:
        self.gradient: torch.Tensor | None = None  # the chunked head's weight gradient, once its backward ran
        self.consumed = False  # the lookup's backward ran: a head's backward after it returns its own gradient


class _TiedLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward adds its rows into the chunked head's gradient.

    The head's backward (`_ChunkedCrossEntropy` given the same `_TiedGradient`) runs first, since the loss
    consumes a function of this lookup's output; it leaves its weight gradient in ``tied.gradient`` and returns
    None for the weight. This backward index-adds the looked-up rows into that tensor in place (zeros when the
    head left none) and returns it: the tied parameter's gradient arrives once, whole, so autograd neither
    buffers the head's gradient through the blocks' backward nor adds two ``[vocab, hidden]`` tensors, and the
    tensor is handed over with no other reference (AccumulateGrad keeps it as ``.grad`` without a copy).
    """

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, tied):
        ctx.save_for_backward(ids, weight)
        ctx.padding_idx, ctx.tied = padding_idx, tied
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        ids, weight = ctx.saved_tensors
        tied, padding_idx = ctx.tied, ctx.padding_idx
        gradient, tied.gradient, tied.consumed = tied.gradient, None, True
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        if gradient is None:
            gradient = torch.zeros_like(weight)
        kept = gradient[padding_idx].clone() if padding_idx is not None else None
        gradient.index_add_(0, ids.reshape(-1), grad_output.reshape(-1, weight.shape[1]).to(gradient.dtype))
        if kept is not None:  # nn.Embedding: the padding row gets nothing from the lookup (the head's part stays)
            gradient[padding_idx] = kept
        return None, gradient, None, None


class _RowSteppedLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward hands the weight's gradient to the fused step by rows
    of the vocabulary (``step_by_rows``), so the dense ``[vocab, hidden]`` gradient never exists.

    Each chunk of rows gets its gradient from ``nn.Embedding``'s own dense backward (each token's gradient added
    into its row in token order, in the gradient's dtype), run over the chunk's rows with every other token sent to
    a padding row it skips: bitwise the dense gradient's rows. Without a live stepper it returns the dense gradient.
    """

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids, weight)
        ctx.padding_idx = padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        ids, weight = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        stepper = row_stepper(weight)
        padding_idx = ctx.padding_idx
        if stepper is None:
            return None, torch.ops.aten.embedding_dense_backward(
                grad_output, ids, weight.shape[0], -1 if padding_idx is None else padding_idx, False), None
        vocab = weight.shape[0]
        ids = ids.reshape(-1)
        used = ids != padding_idx if padding_idx is not None else torch.ones_like(ids, dtype=torch.bool)

        def rows_of(rows: slice) -> torch.Tensor:
            # nn.Embedding's own dense backward over the chunk's rows and one more, the padding row of this call,
            # which every other token (and the model's padding) is sent to and which the kernel skips
            width = min(rows.stop, vocab) - rows.start
            local = ids - rows.start
            local = torch.where(used & (local >= 0) & (local < width), local, width)
            return torch.ops.aten.embedding_dense_backward(grad_output, local, width + 1, width, False)[:width]

        stepper(weight, rows_of, vocab)
        return None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, chunk_tokens: int = 0,
                          tied: _TiedGradient | None = None) -> torch.Tensor:
    """Sum over rows of cross-entropy of ``F.linear(hidden, weight, bias)`` against `labels`, by tiles of the
    vocabulary (`_ChunkedCrossEntropy`).

    Equal to ``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index=-100,
    reduction="sum")`` (under autocast, the linear in autocast's dtype), without the ``[rows, vocab]`` logits
    ever existing: at most one tile's logits exist at a time, and backward recomputes them.

    Args:
        hidden: ``[rows, hidden_size]`` hidden states.
        weight: the head's ``[vocab, hidden_size]`` weight (a tied embedding gets its gradient summed by autograd).
        bias: the head's ``[vocab]`` bias, or None.
        labels: ``[rows]`` target ids; -100 is not scored.
        chunk_tokens: the logits held at once are at most ``chunk_tokens x vocab`` (0: `AUTO_CHUNK_LOGITS`).
        tied: the `_TiedGradient` of the `_TiedLookup` of `weight` that `hidden` was computed from: the weight's
            gradient is then left there for that lookup's backward instead of returned to autograd.
    """
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    max_logits = chunk_tokens * weight.shape[0] if chunk_tokens else AUTO_CHUNK_LOGITS
    return _ChunkedCrossEntropy.apply(hidden, weight, bias, labels, max_logits, dtype, tied)


class ChunkedLMLoss:
    """The Loop's default loss for a causal LM, with its head and cross-entropy chunked (`chunked_cross_entropy`).

    Build it with `for_model`; call it with the model the Loop runs and a dict batch: it returns
    ``(loss_sum, num_items)``, the items being the shifted labels that are not -100 (what
    `looptrain.batches.count_items(batch, shifted=True)` counts), or the model's own mean loss where the first
    batch shows the head cannot be reproduced exactly.

    A tied embedding (the head's weight is the input embedding's, a plain ``nn.Embedding``) gets one
    ``[vocab, hidden]`` gradient instead of three: during the training forward its lookup runs through
    `_TiedLookup`, whose backward adds its rows into the head's gradient in place. `fuse_tied_gradient`
    (True) turns that off, for tests.
    """

    fuse_tied_gradient = True

    def __init__(self, model: nn.Module, body: nn.Module, head: nn.Linear, chunk_tokens: int, strict: bool,
                 notice: Callable[[str], None]):
        self.model, self.body, self.head, self.chunk_tokens = model, body, head, chunk_tokens
        self.strict, self.notice = strict, notice
        self.checked = False  # the first batch compares head(body) with the model's own logits
        self.fallback: str | None = None  # why the model's own loss is used instead
        self._pending: _TiedGradient | None = None  # the tied lookup's, during a training forward

    @classmethod
    def for_model(cls, model: nn.Module, config: Any, shifts_labels: bool,
                  echo: Callable[[str], None]) -> ChunkedLMLoss | None:
        """The chunked loss for `model`, or None where the model's own loss is used (with a notice, for a causal LM).

        Args:
            model: the bare model.
            config: the `LoopConfig`: its `chunked_ce` (``auto``: on for causal LMs whose loss shifts labels;
                ``on``: the same, and a model it cannot serve exactly is an error; ``off``) and `ce_chunk_tokens`
                (the logits held at once: at most ``ce_chunk_tokens x vocab``; 0: ``AUTO_CHUNK_LOGITS``).
            shifts_labels: `looptrain.batches.model_shifts_labels(model)`.
            echo: prints one line (the notice).

        Raises:
            ConfigError: ``mode="on"`` and the model cannot be served exactly (the message says why).
        """
        mode, chunk_tokens = config.chunked_ce, config.ce_chunk_tokens
        if mode == "off" or (mode == "auto" and not shifts_labels):
            return None

        def notice(line: str) -> None:
            echo(f"notice: {line}")

        if getattr(config, "compile", False) and mode == "auto":  # "on" with compile: refused by LoopConfig
            notice("chunked cross-entropy is off under --compile (it runs outside the compiled forward): the compiled "
                   "model's own loss is used, its [tokens x vocab] logits included")
            return None
        reason = _structural_problem(model, shifts_labels)
        if reason is None:
            head = model.get_output_embeddings()
            return cls(model, model.get_decoder(), head, chunk_tokens, mode == "on", notice)
        if mode == "on":
            raise ConfigError(f"chunked_ce='on' (--chunked-ce on): {reason}; use --chunked-ce auto or off")
        notice(f"chunked cross-entropy is off for this model ({reason}): the model's own loss is used")
        return None

    def __call__(self, wrapped_model: nn.Module, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        inputs = {key: value for key, value in batch.items() if key not in _HEAD_KEYS}
        if not self.checked:
            self.checked = True
            self._check_head(inputs)
        labels = batch.get("labels")
        if self.fallback is not None or not isinstance(labels, torch.Tensor) or labels.dim() != 2:
            loss = wrapped_model(**batch).loss  # labels that are not [rows, length]: the model's own loss (or error)
            if loss is None:
                raise ValueError("the model returned no loss: pass `labels` in the batch or override Loop.compute_loss")
            return loss
        self._pending = None
        with self._lookup_fused():
            if wrapped_model is not self.model and torch.is_grad_enabled():
                # DDP syncs gradients only for a forward it runs: the model's own forward, its head standing aside.
                with _head_skipped(self.head):
                    hidden = wrapped_model(**inputs).logits
            else:
                hidden = _last_hidden_state(self.body(**inputs))
        tied, self._pending = self._pending, None  # one per forward: a second CE call gets none
        shift_labels = batch.get("shift_labels")
        if isinstance(shift_labels, torch.Tensor):  # transformers takes these as they are, at every position
            labels = shift_labels
        else:  # position t predicts token t + 1: the last position predicts nothing
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        labels = labels.to(hidden.device)
        scored = labels != IGNORE_INDEX
        if is_fake(labels):  # the estimator: no values to drop by; every position stays (-100 ones score 0)
            hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        else:  # prompts and padding never reach the head
            hidden, labels = hidden[scored], labels[scored]
        loss_sum = chunked_cross_entropy(hidden, self.head.weight, self.head.bias, labels, self.chunk_tokens, tied)
        return loss_sum, scored.sum()

    def _tied_embedding(self) -> nn.Embedding | None:
        """The input embedding whose weight is the head's, where its lookup can be fused (`_TiedLookup`)."""
        if not (self.fuse_tied_gradient and torch.is_grad_enabled() and self.head.weight.requires_grad):
            return None
        get = getattr(self.model, "get_input_embeddings", None)
        embedding = get() if callable(get) else None
        if (type(embedding) is not nn.Embedding or embedding.weight is not self.head.weight
                or embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse):
            return None
        return embedding

    def _row_stepped_embedding(self) -> nn.Embedding | None:
        """The untied input embedding whose weight the fused step takes by rows (``step_by_rows``)."""
        if not torch.is_grad_enabled():
            return None
        get = getattr(self.model, "get_input_embeddings", None)
        embedding = get() if callable(get) else None
        if (not isinstance(embedding, nn.Embedding) or embedding.weight is self.head.weight
                or embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse
                or row_stepper(embedding.weight) is None):
            return None
        return embedding

    @contextlib.contextmanager
    def _lookup_fused(self) -> Iterator[None]:
        """While entered (a training forward), the input embedding's lookup is a `_TiedLookup` for a tied model, a
        `_RowSteppedLookup` for an untied one whose weight the fused step takes by rows."""
        embedding = self._tied_embedding()
        stepped = self._row_stepped_embedding() if embedding is None else None
        if embedding is None and stepped is None:
            yield
            return

        def lookup(ids: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():  # e.g. inside a reentrant checkpoint's forward: nothing to fuse
                return F.embedding(ids, embedding.weight, embedding.padding_idx)
            self._pending = _TiedGradient()
            return _TiedLookup.apply(ids, embedding.weight, embedding.padding_idx, self._pending)

        def stepped_lookup(ids: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                return F.embedding(ids, stepped.weight, stepped.padding_idx)
            return _RowSteppedLookup.apply(ids, stepped.weight, stepped.padding_idx)

        module = embedding if embedding is not None else stepped
        module.forward = lookup if embedding is not None else stepped_lookup  # an instance attribute shadows the
        try:  # class's forward; the module's hooks still run
            yield
        finally:
            del module.forward

    @torch.no_grad()
    def _check_head(self, inputs: dict) -> None:
        """Once: the model's own logits on one short row equal the head applied to the body's hidden states."""
        if any(is_fake(value) for value in inputs.values()):
            return  # the estimator's fake tensors have no values to compare
        rows = next(value.shape[0] for value in inputs.values() if isinstance(value, torch.Tensor) and value.dim())
        probe = {key: _first_row(value, rows) for key, value in inputs.items()}
        was_training = self.model.training
        self.model.eval()  # no dropout: the two runs must see the same activations
        try:
            own = self.model(**probe).logits
            ours = self.head(_last_hidden_state(self.body(**probe)))
        finally:
            self.model.train(was_training)
        scale = own.float().abs().max().clamp(min=1e-6)
        tolerance = 1e-4 if own.dtype == torch.float32 else 2e-2
        if own.shape != ours.shape or not ((own.float() - ours.float()).abs().max() <= tolerance * scale):
            self.fallback = ("its logits are not its output embedding applied to its decoder's last hidden states "
                             "(a scaled or transformed head)")
            if self.strict:
                raise ConfigError(f"chunked_ce='on' (--chunked-ce on): {self.fallback}; use --chunked-ce auto or off")
            self.notice(f"chunked cross-entropy is off for this model ({self.fallback}): the model's own loss is used")


def _last_hidden_state(outputs: Any) -> torch.Tensor:
    return outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state


@contextlib.contextmanager
def _head_skipped(head: nn.Linear) -> Iterator[None]:
    """While entered, `head` returns its input: the model's forward gives its last hidden states as "logits"."""
    head.forward = _identity  # an instance attribute shadows nn.Linear.forward; the module's hooks still run
    try:
        yield
    finally:
        del head.forward


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _first_row(value: Any, rows: int) -> Any:
    """A batch value cut to its first row and `_PROBE_TOKENS` positions (per-row tensors only)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
        return value
    value = value[:1]
    return value[:, :_PROBE_TOKENS] if value.dim() >= 2 else value


def _structural_problem(model: nn.Module, shifts_labels: bool) -> str | None:
    """Why `model`'s loss cannot be computed by chunks exactly, from its structure; None when it can."""
    if not shifts_labels:
        return "it is not a causal LM whose loss shifts its labels"
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if type(head) is not nn.Linear:  # a subclass (peft's LoRA layer, a quantized Linear) may compute more
        return f"its output embedding is a {type(head).__name__}, not a torch.nn.Linear"
    if any(hasattr(parameter, "full_tensor") for parameter in head.parameters()):
        return "its head is sharded (FSDP)"
    body = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    if not isinstance(body, nn.Module) or body is model:
        return "it exposes no decoder body (get_decoder) apart from the head"
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None) is not None:
        return "it softcaps its logits (final_logit_softcapping)"
    return None


__all__ = ["AUTO_CHUNK_LOGITS", "CHUNKED_CE_MODES", "ChunkedLMLoss", "chunked_cross_entropy"]

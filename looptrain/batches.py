"""What the loop needs to know about a batch: its rows, items and tokens; moving and splitting it.

A batch is a tensor, or a mapping / list / tuple of tensors (nested as deep as you like). The
*items* of a batch are what a mean loss is taken over: its labels that are not -100 (one per row
for sequence classification, one per real token for token-level losses), or its rows when it has
no labels. The labels are a dict batch's `labels`, or the last element of a list / tuple batch
when it is an integer tensor (nanoGPT's `x, y`). A Hugging Face causal LM shifts a dict batch's
`labels` inside its forward (position t predicts token t+1): its items are the `labels[..., 1:]`
that are not -100 (`model_shifts_labels` tells such a model apart).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from looptrain import distributed

IGNORE_INDEX = -100
Items = torch.Tensor | int


def first_dimension(batch: Any) -> int:
    """The batch's row count: the first dimension of its first tensor that has one.

    Raises:
        ValueError: the batch holds no tensor with a batch dimension.
    """
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (Mapping, list, tuple)) or hasattr(values, "__iter__"):
        for value in values:
            if isinstance(value, torch.Tensor) and value.dim():
                return value.shape[0]
    raise ValueError(
        f"cannot tell the batch size of a {type(batch).__name__}: it holds no tensor with a batch dimension; "
        "batches must be tensors, or dicts / lists / tuples of tensors"
    )


def labels_of(batch: Any) -> torch.Tensor | None:
    """A dict batch's `labels`; a list / tuple batch's last element when it holds integer ids; else None."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        return labels if isinstance(labels, torch.Tensor) else None
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and isinstance(batch[-1], torch.Tensor):
        last = batch[-1]
        if last.dim() and not last.is_floating_point() and not last.is_complex() and last.dtype != torch.bool:
            return last
    return None


def count_items(batch: Any, *, shifted: bool = False) -> Items:
    """Items a mean loss was taken over: labels that are not -100 (a tensor: no host sync), else rows.

    Args:
        batch: the micro-batch.
        shifted: the model shifts a dict batch's labels before its loss (see `model_shifts_labels`):
            count `labels[..., 1:]`, or the batch's `shift_labels` when it brings them (transformers
            then takes those as they are). A list / tuple batch's labels are the caller's own, already
            aligned with the logits (nanoGPT's `x, y`): never shifted.
    """
    labels = labels_of(batch)
    if labels is None:
        return first_dimension(batch)
    if shifted and isinstance(batch, Mapping):
        shift_labels = batch.get("shift_labels")
        labels = shift_labels if isinstance(shift_labels, torch.Tensor) else labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


def model_shifts_labels(model: nn.Module) -> bool:
    """Whether `model`'s own loss shifts its `labels` left by one before taking its mean (a causal LM).

    True for a Hugging Face model that is not an encoder-decoder (`config.is_encoder_decoder`), whose
    forward computes its loss through transformers' `loss_function`, and whose `loss_function` is
    transformers' `ForCausalLMLoss`: every decoder LM of `AutoModelForCausalLM` whose loss shifts (Qwen,
    Llama, GPT-2, ..., BERT as a decoder), whatever its class is called. False for every other model:
    classifiers, masked LMs, encoder-decoders, and the causal LMs that compute their own cross-entropy
    over the labels as they are (XLNet, XLM, `BartForCausalLM` and its kin). The forward checked is
    that of the first transformers class in the model's MRO, so a subclass, FSDP2's sharded class, a
    peft wrapper and a `torch.compile`d module are judged by the model they hold. It inspects classes:
    call it once per model, not per batch.
    """
    model = _unwrapped(model)
    source = next((cls for cls in type(model).__mro__
                   if cls.__module__.startswith("transformers.") and "forward" in vars(cls)), None)
    if source is None or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False  # not a transformers model (nothing to import then), or an encoder-decoder
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # transformers < 4.46: causal LMs shift inside forward; the Auto mapping names them
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return source.__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    code = getattr(inspect.unwrap(vars(source)["forward"]), "__code__", None)
    if code is not None and "loss_function" not in code.co_names:
        return False  # the forward computes its own loss, over the labels as they are
    return getattr(model, "loss_function", None) is ForCausalLMLoss  # what transformers resolves loss_type to


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside peft's `PeftModel`, a `torch.compile`d module, DDP or DataParallel (else itself)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            inner = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        else:
            return model
        if inner is model or not isinstance(inner, nn.Module):
            return model
        model = inner


def as_loss_sum(loss: Any, items: Items, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_loss`'s result as `(loss_sum, num_items)`, float32 tensors on `device`.

    A mean loss is weighted by `items` (the batch's count); a `(loss_sum, num_items)` pair is taken
    as it is.
    """
    if isinstance(loss, tuple):
        if len(loss) != 2:
            raise TypeError(
                f"compute_loss returned a tuple of {len(loss)}; return a scalar mean loss or (loss_sum, num_items)"
            )
        loss, items = loss
        mean = False
    else:
        mean = True
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"compute_loss returned {type(loss).__name__}; return a scalar tensor (the mean loss) or "
            "(loss_sum, num_items)"
        )
    items = torch.as_tensor(items, dtype=torch.float32).to(device)
    return (loss.float() * items if mean else loss.float()), items


def samples_and_tokens(batch: Any) -> tuple[int, int]:
    """(samples, real tokens) of a batch, for throughput; tokens are 0 when the batch has no token ids.

    Tokens are the attention mask's ones; for packed rows (`is_packed`), the tokens before each row's padding
    and the sequences in them (`packed_samples_and_tokens`); without a mask, the elements of `input_ids`; for a
    tensor, list or tuple batch (`(x, y)` of token ids), the elements of its first 2-D integer tensor. Samples are
    rows, except for packed rows.
    """
    samples = first_dimension(batch)
    if isinstance(batch, Mapping):
        if isinstance(batch.get("attention_mask"), torch.Tensor):
            return samples, int(batch["attention_mask"].sum())
        if is_packed(batch):
            return packed_samples_and_tokens(batch["position_ids"], batch["labels"])
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return samples, batch["input_ids"].numel()
        return samples, 0
    tensors = [batch] if isinstance(batch, torch.Tensor) else [v for v in batch if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        if tensor.dim() >= 2 and not tensor.is_floating_point() and not tensor.is_complex():
            return samples, tensor.numel()
    return samples, 0


def is_packed(batch: Any) -> bool:
    """Whether a batch is packed rows (`data.packing.PackedCollator`): a dict with a 2-D ``input_ids``, no
    ``attention_mask``, and ``position_ids`` and ``labels`` of the same shape."""
    input_ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or isinstance(batch.get("attention_mask"), torch.Tensor):
        return False
    return all(isinstance(batch.get(key), torch.Tensor) and batch[key].shape == input_ids.shape
               for key in ("position_ids", "labels"))


def packed_samples_and_tokens(position_ids: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(samples, real tokens) of packed rows: a row's tokens run up to its padding (`packed_row_lengths`), and its
    samples are the sequences among them, a new one wherever a position is not its predecessor's plus one (as
    transformers reads them: ``masking_utils.find_packed_sequence_indices``).

    A sample with no scored label that ends a row with no padding reads as padding: looptrain's tokenization
    drops such samples (`data.tokenize.tokenize_lm`: nothing to predict), so its packed rows never hold one."""
    lengths = _packed_lengths(position_ids, labels)
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    real = torch.arange(position_ids.shape[1], device=position_ids.device) < lengths[:, None]
    return int((starts & real).sum()), int(lengths.sum())


def move_to(batch: Any, device: torch.device) -> Any:
    """The batch (tensor, mapping, list or tuple of them) on `device`; anything else unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: move_to(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(value, device) for value in batch)
    return batch


def split_batch(batch: Any, parts: int) -> list:
    """Cuts a batch into `parts` row-wise pieces (fewer when it has fewer rows).

    Every tensor whose first dimension is the batch's row count is split; anything else is shared.
    """
    if parts == 1:
        return [batch]
    rows = first_dimension(batch)
    bounds = [round(rows * index / parts) for index in range(parts + 1)]
    return [_per_row(batch, rows, lambda value, start=start, stop=stop: value[start:stop])
            for start, stop in zip(bounds, bounds[1:]) if stop > start]


def _per_row(batch: Any, rows: int, cut: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The batch with `cut` applied to every tensor whose first dimension is its `rows` (through mappings, lists
    and tuples); anything else is shared."""
    if isinstance(batch, torch.Tensor) and batch.dim() and batch.shape[0] == rows:
        return cut(batch)
    if isinstance(batch, Mapping):
        return {key: _per_row(item, rows, cut) for key, item in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_per_row(item, rows, cut) for item in batch)
    return batch


def token_pieces(lengths: Sequence[int], max_tokens: int, width: Callable[[int], int] = int) -> list[list[int]]:
    """How `split_by_tokens` cuts rows of these lengths: lists of row positions, longest rows first.

    The rows are ordered longest first (stable), then cut greedily: each piece takes as many of the next rows
    as keep its row count times `width(its longest row)` (the padded width) within `max_tokens`; a row wider
    than that alone is a piece of its own.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    order = sorted(range(len(lengths)), key=lambda row: -int(lengths[row]))
    pieces: list[list[int]] = []
    for row in order:
        if pieces and (len(pieces[-1]) + 1) * width(int(lengths[pieces[-1][0]])) <= max_tokens:
            pieces[-1].append(row)
        else:
            pieces.append([row])
    return pieces


def packed_row_lengths(position_ids: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """The lengths of packed rows (``position_ids`` restarting at 0 at every sample, no attention mask): up to the
    start of a row's last sequence when none of its labels is scored (the padding, `data.packing.PackedCollator`).

    Dropping such a sequence changes nothing: it comes last, so no other token attends to it, and its first label is
    -100, so the token before it scores nothing either."""
    return _packed_lengths(position_ids, labels).tolist()


def _packed_lengths(position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`packed_row_lengths` as a tensor, on the batch's device."""
    rows, width = position_ids.shape
    if width == 0:
        return torch.zeros(rows, dtype=torch.long, device=position_ids.device)
    columns = torch.arange(width, device=position_ids.device)
    start = torch.where(position_ids == 0, columns, 0).amax(dim=1)  # the last sequence's start (0: none later)
    last_scored = torch.where(labels != IGNORE_INDEX, columns, -1).amax(dim=1)
    return torch.where((start > 0) & (last_scored < start), start, width)


def split_by_tokens(batch: Any, max_tokens: int, multiple: int | None = None, trim: bool = True) -> list:
    """Cuts a dict batch into micro-batches of at most `max_tokens` padded tokens (rows x the piece's width).

    The rows are cut as `token_pieces` says (longest rows first: the order of rows inside one update changes
    no sum). A right-padded batch's pieces drop the padding columns none of their rows use (the width rounded
    up to `multiple`), in every tensor as wide as its ``input_ids``; a left-padded one keeps its width
    (dropping leading columns would move the rows' positions). A row's length runs to its last real token in the
    attention mask; a packed batch's (``position_ids`` and ``labels``, no mask) to its padding
    (`packed_row_lengths`); otherwise every row is the batch's width. `trim=False` keeps every piece at the batch's
    width (fixed-width padding). A batch that is one piece of its own width is returned as it is.

    Raises:
        ValueError: the batch is not a dict with a 2-D ``input_ids``; `max_tokens` < 1.
    """
    input_ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("micro_batch_tokens cuts dict batches with a 2-D `input_ids` (token ids), and this batch "
                         f"is a {type(batch).__name__} without one: turn micro_batch_tokens off (0) and split it "
                         "with batch_size and accum_steps")
    rows, width = input_ids.shape
    mask = batch.get("attention_mask")
    has_mask = isinstance(mask, torch.Tensor) and mask.shape == input_ids.shape
    packed = not has_mask and is_packed(batch)
    if has_mask:  # a row's length: up to its last real token (a mask with zeros inside a row keeps them)
        real = mask != 0
        lengths = torch.where(real.any(dim=1), width - real.flip(1).int().argmax(dim=1), 0).tolist()
    elif packed:
        lengths = packed_row_lengths(batch["position_ids"], batch["labels"])
    else:
        lengths = [width] * rows
    # Right padding: every row starts with a real token; packed rows end in their padding.
    trim = trim and (packed or (has_mask and bool((mask[:, 0] != 0).all())))
    multiple = max(int(multiple or 1), 1)

    def padded(length: int) -> int:
        return min(width, -(-length // multiple) * multiple) if trim else width

    pieces = token_pieces(lengths, max_tokens, padded)
    if len(pieces) == 1 and padded(int(lengths[pieces[0][0]])) == width:
        return [batch]

    def piece(members: list[int]) -> Any:
        index, columns = torch.tensor(members), padded(int(lengths[members[0]]))

        def cut(value: torch.Tensor) -> torch.Tensor:
            value = value.index_select(0, index.to(value.device))
            return value[:, :columns] if value.dim() >= 2 and value.shape[1] == width else value
        return _per_row(batch, rows, cut)

    return [piece(members) for members in pieces]


def on_device(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer already lives on `device` (then `.to` is skipped)."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(tensor.device.type == device.type and tensor.device.index in (None, device.index) for tensor in tensors)


def total_items(counts: list, device: torch.device) -> torch.Tensor:
    """The sum of item counts (tensors or ints) as a float32 tensor on `device`."""
    return torch.stack([torch.as_tensor(count, dtype=torch.float32) for count in counts]).sum().to(device)


def check_item_counts(counted: int, reported: int, where: str) -> None:
    """compute_loss must sum its loss over the items count_items counted, or the mean is off."""
    if counted != reported:
        raise ValueError(
            f"at {where}, compute_loss reported its loss over {reported} items but count_items counted "
            f"{counted}, and the gradients were divided by the count: override Loop.count_items(batch) to count "
            "the items your loss sums over (e.g. the tokens of your target key that are not -100)"
        )


def window_samples_and_tokens(window: list, device: torch.device) -> tuple[int, int]:
    """(samples, tokens) of a window, summed over every rank, for throughput."""
    samples = tokens = 0
    for batch in window:
        batch_samples, batch_tokens = samples_and_tokens(batch)
        samples, tokens = samples + batch_samples, tokens + batch_tokens
    samples, tokens = distributed.all_reduce_sum([samples, tokens], device)
    return int(samples), int(tokens)

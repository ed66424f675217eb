"""The optimizer a run steps, from the one the caller built and the run's `LoopConfig`.

The fused step (`optimizer_in_backward`) and bf16 weights (`weights="bf16"`) each turn an ordinary
optimizer into one optimizer per parameter (`OptimizerInBackward`, `BF16Optimizer`); the Loop wraps
the optimizer it is given here, once, when it is built.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from looptrain.errors import ConfigError
from looptrain.optim.bf16 import BF16Optimizer, steps_in_rows
from looptrain.optim.in_backward import OptimizerInBackward
from looptrain.optim.per_parameter import PerParameterOptimizer
from looptrain.optim.row_linear import row_steppable_linears, step_linears_by_rows


def wrap_for_config(model: nn.Module, optimizer: Any, config: Any, *,
                    in_backward: type[OptimizerInBackward] = OptimizerInBackward) -> Any:
    """The fused step and bf16 weights turn the optimizer into one optimizer per parameter.

    Args:
        model: the model, on its device and in its final dtype (bf16 weights are cast before).
        optimizer: the caller's optimizer; a `PerParameterOptimizer` was wrapped already and is kept.
        config: the run's `LoopConfig` (`optimizer_in_backward`, `weights`, `max_grad_norm`,
            `effective_clip_mode`, `stochastic_rounding`, `grad_dtype`, `step_by_rows`).
        in_backward: the class of the fused step's wrapper (the estimator's subclass for fake tensors).

    Returns:
        The optimizer the Loop steps: `OptimizerInBackward`, `BF16Optimizer`, or `optimizer` itself.

    Raises:
        ConfigError: `step_by_rows` on a model whose tables cannot be stepped by rows
            (`weights_stepped_by_rows`).
    """
    if isinstance(optimizer, PerParameterOptimizer):
        return optimizer  # wrapped by the caller already
    bf16_weights = config.weights == "bf16"
    if config.optimizer_in_backward:
        by_rows = getattr(config, "step_by_rows", False)
        row_stepped = weights_stepped_by_rows(model, optimizer) if by_rows else ()
        wrapped = in_backward(model, optimizer, max_grad_norm=config.max_grad_norm, clip=config.effective_clip_mode,
                              bf16_weights=bf16_weights, stochastic_rounding=config.stochastic_rounding,
                              row_stepped=row_stepped)
        if by_rows:
            step_linears_by_rows(row_steppable_linears(model, skip=(model.get_output_embeddings(),)))
        return wrapped
    if bf16_weights:
        return BF16Optimizer(model, optimizer, stochastic_rounding=config.stochastic_rounding,
                             grad_dtype=config.grad_dtype)
    return optimizer


def weights_stepped_by_rows(model: nn.Module, optimizer: Any) -> tuple[nn.Parameter, ...]:
    """``step_by_rows``: the weights whose gradient reaches the fused step by rows (`OptimizerInBackward.step_rows`),
    never whole: the untied LM head's (from the chunked cross-entropy's backward), the input embedding's (from its
    lookup's, `looptrain.lm_loss`) and every other plain ``nn.Linear``'s (`looptrain.optim.row_linear`); a frozen
    one is left out (nothing to step).

    Raises:
        ConfigError: no ``nn.Linear`` head, a head tied to the input embedding, or an optimizer that cannot step rows.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:
        raise ConfigError("step_by_rows=True (--step-by-rows) steps a causal LM's torch.nn.Linear head "
                          f"by rows; this model's output embedding is a {type(head).__name__}: turn it off")
    get_embedding = getattr(model, "get_input_embeddings", None)
    embedding = get_embedding() if callable(get_embedding) else None
    if getattr(embedding, "weight", None) is head.weight:
        raise ConfigError("step_by_rows=True (--step-by-rows) steps an untied head inside the chunked "
                          "cross-entropy's backward; this model's head is tied to its input embedding, whose lookup "
                          "adds to the same gradient later: turn it off for tied embeddings")
    tables = [head.weight]
    if isinstance(embedding, nn.Embedding) and embedding.max_norm is None and not embedding.scale_grad_by_freq \
            and not embedding.sparse:
        tables.append(embedding.weight)
    linears = row_steppable_linears(model, skip=(head,))
    tables = [table for table in tables if table.requires_grad] + [linear.weight for linear in linears]
    if any(not steps_in_rows(table, optimizer) for table in tables):  # the per-parameter optimizers: its class
        raise ConfigError(f"step_by_rows=True (--step-by-rows) steps weights' rows with AdamW, SGD "
                          f"(not fused) or Adafactor, not {type(optimizer).__name__}: use --optim adamw, sgd or "
                          "adafactor, or turn it off")
    return tuple(tables)

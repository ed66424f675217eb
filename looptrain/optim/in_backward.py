"""The optimizer step fused into backward: each parameter steps as soon as its gradient is ready.

`OptimizerInBackward` takes an ordinary optimizer and steps each parameter from a
``register_post_accumulate_grad_hook``, then frees the gradient: the full set of gradients never
exists at once. Clipping is kept (per parameter, or by the previous step's global norm).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from looptrain.optim import bf16 as bf16_steps
from looptrain.optim.bf16 import RowSource, fp32_norm, step_in_fp32_, step_rows_, steps_in_rows
from looptrain.optim.chunk_pricing import stack_norms, zero_norms
from looptrain.optim.per_parameter import PerParameterOptimizer

CLIP_MODES = ("per_parameter", "previous_global")
_ROW_STEPPER = "_looptrain_row_stepper"  # a row-stepped parameter's attribute: the fused step's `step_rows`, weakly

# Same epsilon as torch.nn.utils.clip_grad_norm_, so per-parameter clipping matches it exactly.
_CLIP_EPSILON = 1e-6


def _weak_hook(method: Any) -> Any:
    """A post-accumulate-grad hook that calls the bound `method` while its object lives, and does nothing after."""
    reference = weakref.WeakMethod(method)

    def hook(parameter: nn.Parameter) -> None:
        bound = reference()
        if bound is not None:
            bound(parameter)

    return hook


def row_stepper(parameter: nn.Parameter) -> Any:
    """The `OptimizerInBackward.step_rows` of the live fused step that steps `parameter` by rows (its `row_stepped`),
    or None: what a backward that computes the parameter's gradient by rows calls instead of returning it whole."""
    reference = getattr(parameter, _ROW_STEPPER, None)
    return reference() if reference is not None else None


class OptimizerInBackward(PerParameterOptimizer):
    """Step every parameter inside backward, as soon as its gradient is accumulated.

    Built from an ordinary optimizer (from `build_optimizer` or any torch / bitsandbytes
    optimizer). For each trainable parameter it makes one optimizer of the same class with that
    parameter's group hyperparameters; the original optimizer keeps its param groups (so an LR
    scheduler built on it keeps working: each hook copies the group's current hyperparameters,
    ``lr`` included, before stepping) but never gets state. After each parameter's step its
    ``.grad`` is set to None, so at most a few gradients are alive at any time.

    Clipping (``max_grad_norm``) cannot use this step's global norm, which is only known when
    backward ends, after every parameter has stepped. Two substitutes:

    - ``clip="per_parameter"``: each gradient is clipped to norm ``max_grad_norm`` on its own
      (``clip_grad_norm_([p], max_grad_norm)``). Bounds every update; changes the direction of the
      full update less predictably than global clipping.
    - ``clip="previous_global"``: every gradient is scaled by ``min(1, max_grad_norm /
      previous step's global norm)``. Keeps the update's direction; lags one step behind a
      spike. The first step, with no previous norm, is clipped per parameter.

    ``grad_norm`` is this step's global norm before clipping, summed from the per-parameter norms
    in the hooks, so it can be logged as usual.

    A parameter whose gradient is not finite is not stepped (its weights stay finite); ``grad_norm``
    is then not finite either, so the loop counts the window as skipped.

    Every backward pass is an optimizer step: gradient accumulation and GradScaler (fp16) do not
    combine with it.

    With ``bf16_weights=True`` the parameters are bf16 storage without fp32 master weights: each one
    steps in fp32 and is written back with stochastic rounding (`looptrain.optim.bf16`).

    Args:
        model_or_params: The model or its parameters; trainable ones get hooks.
        optimizer: The optimizer whose groups hold those parameters; it must have no state yet.
        max_grad_norm: Clip threshold, or None for no clipping.
        clip: ``"per_parameter"`` or ``"previous_global"``.
        bf16_weights: Step bf16 parameters in fp32 and round the result back into bf16.
        stochastic_rounding: With `bf16_weights`: False rounds to nearest (the control that stalls).
        row_stepped: Parameters whose gradient a backward may hand over by rows instead of whole (`step_rows`,
            found with `row_stepper`): an untied LM head's, from the chunked cross-entropy's backward. A whole
            gradient that arrives for them all the same is stepped as any other.

    The hooks hold the wrapper weakly (a parameter's hooks are not seen by Python's cycle collector, so a strong
    reference would keep the wrapper, its states and the model alive for the rest of the process): keep a reference
    for as long as it trains, as the Loop does. Once the wrapper is gone, or after `remove`, backward leaves
    gradients in ``.grad`` and nothing steps.

    Raises:
        ValueError: Unknown `clip`, non-positive `max_grad_norm`, an optimizer that already has
            state, a trainable parameter in no group, no trainable parameter, or a `row_stepped` parameter that is
            not trainable or cannot be stepped by rows (`looptrain.optim.bf16.steps_in_rows`).
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        clip: str = "per_parameter",
        bf16_weights: bool = False,
        stochastic_rounding: bool = True,
        row_stepped: Iterable[nn.Parameter] = (),
    ):
        if clip not in CLIP_MODES:
            raise ValueError(f"OptimizerInBackward: clip must be one of {CLIP_MODES}, got {clip!r}.")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"OptimizerInBackward: max_grad_norm must be > 0 or None, got {max_grad_norm}.")
        self.max_grad_norm = max_grad_norm
        self.clip = clip
        self.bf16_weights = bf16_weights
        self.stochastic_rounding = stochastic_rounding
        self._square_sum: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None
        self._previous_grad_norm: torch.Tensor | None = None
        self.steps = 0
        self._handles = []
        super().__init__(model_or_params, optimizer)  # adopts each parameter: its optimizer and its hook
        self._row_stepped: list[nn.Parameter] = []
        for parameter in row_stepped:
            if id(parameter) not in self._per_parameter or not steps_in_rows(parameter, self.optimizer_of(parameter)):
                raise ValueError(f"OptimizerInBackward: a row_stepped parameter of shape {tuple(parameter.shape)} is "
                                 f"not trainable here or cannot be stepped by rows with {type(optimizer).__name__}.")
            setattr(parameter, _ROW_STEPPER, weakref.WeakMethod(self.step_rows))
            self._row_stepped.append(parameter)

    def _adopt(self, parameter: nn.Parameter) -> None:
        super()._adopt(parameter)
        self._handles.append(parameter.register_post_accumulate_grad_hook(_weak_hook(self._step_parameter)))

    def _steps_in_fp32(self, parameter: nn.Parameter) -> bool:
        return self.bf16_weights and parameter.dtype == torch.bfloat16

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Global gradient norm (before clipping) of the last backward, a scalar tensor; None before the first."""
        return self._grad_norm

    def is_finite(self, value: torch.Tensor) -> bool:
        """Whether a scalar tensor is finite (a host sync): the one value this wrapper reads. A subclass for
        tensors without values (the estimator's `FakeOptimizerInBackward`) overrides it."""
        return bool(torch.isfinite(value))

    def _clip_scale(self, parameter_norm: torch.Tensor) -> torch.Tensor | None:
        if self.max_grad_norm is None:
            return None
        if self.clip == "per_parameter" or self._previous_grad_norm is None:
            reference = parameter_norm
        else:
            reference = self._previous_grad_norm
        return torch.clamp(self.max_grad_norm / (reference + _CLIP_EPSILON), max=1.0)

    def _open_backward(self, device: torch.device) -> None:
        if self._square_sum is None:
            # First step of this backward: finish the step (norm, counters) when backward ends.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._square_sum = torch.zeros((), dtype=torch.float32, device=device)

    @torch.no_grad()
    def _step_parameter(self, parameter: nn.Parameter) -> None:
        gradient = parameter.grad
        if gradient is None:  # a backward that returned none: a row-stepped parameter, stepped by rows already
            return
        self._open_backward(parameter.device)
        parameter_norm = fp32_norm(gradient)  # a large bf16 gradient's fp32 copy by chunks of rows
        self._square_sum = self._square_sum + parameter_norm.to(self._square_sum.device) ** 2
        if not self.is_finite(parameter_norm):  # never write a non-finite update into the weights
            parameter.grad = None
            return
        scale = self._clip_scale(parameter_norm)
        if scale is not None:
            gradient.mul_(scale.to(device=gradient.device, dtype=gradient.dtype))
        per_parameter = self.optimizer_of(parameter)  # with the scheduler's current lr (and betas, ...)
        if self.bf16_weights and parameter.dtype == torch.bfloat16:
            step_in_fp32_(parameter, per_parameter, gradient, self.stochastic_rounding)
        else:
            per_parameter.step()
        parameter.grad = None

    @torch.no_grad()
    def step_rows(self, parameter: nn.Parameter, rows_of: RowSource, rows_per_chunk: int) -> None:
        """Steps a `row_stepped` parameter inside backward from its gradient given by rows, which never exists whole.

        `rows_of(rows)` returns the gradient's rows `rows` (a slice of dim 0), computed from what the parameter is
        before this step: it is called once per chunk of at most `rows_per_chunk` rows (and of at most
        `looptrain.optim.bf16.STEP_CHUNK_ELEMENTS` elements) for the norm, then in each pass of the row-chunked step
        (`looptrain.optim.bf16.step_rows_`), each chunk before its rows are written. Clipping, the non-finite check
        and the norm are `_step_parameter`'s, from the chunks' norms.
        """
        self._open_backward(parameter.device)
        row_numel = max(1, parameter.numel() // max(1, parameter.shape[0]))
        rows_per_chunk = max(1, min(rows_per_chunk, bf16_steps.STEP_CHUNK_ELEMENTS // row_numel))
        chunks = [slice(start, start + rows_per_chunk) for start in range(0, parameter.shape[0], rows_per_chunk)]
        norms: list[torch.Tensor] = []
        for chunk in bf16_steps.priced_chunks(chunks, parameter, stand_ins=zero_norms(norms, parameter.device)):
            norms.append(torch.linalg.vector_norm(rows_of(chunk), 2, dtype=torch.float32))  # all but on fakes
        parameter_norm = torch.linalg.vector_norm(stack_norms(norms), 2)
        self._square_sum = self._square_sum + parameter_norm.to(self._square_sum.device) ** 2
        if not self.is_finite(parameter_norm):  # never write a non-finite update into the weights
            return
        scale = self._clip_scale(parameter_norm)
        source = rows_of
        if scale is not None:
            def source(rows: slice) -> torch.Tensor:
                gradient = rows_of(rows)
                return gradient.mul_(scale.to(device=gradient.device, dtype=gradient.dtype))
        step_rows_(parameter, self.optimizer_of(parameter), source, rows_per_chunk,
                   self.stochastic_rounding if self._steps_in_fp32(parameter) else False)

    def _end_of_backward(self) -> None:
        self._grad_norm = torch.sqrt(self._square_sum)
        if self.is_finite(self._grad_norm):  # a non-finite norm would clip every later step to zero
            self._previous_grad_norm = self._grad_norm
        self._square_sum = None
        self.steps += 1
        # LR schedulers warn when scheduler.step() comes before any optimizer.step(); the step did
        # happen, in the hooks.
        self.optimizer._opt_called = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor | None:
        """This backward's global norm before clipping; nothing left to clip.

        Each gradient was clipped in its hook, by `max_grad_norm` and `clip` (see the class docstring), and
        stepped: `max_norm` is the Loop's same threshold and is not applied again.
        """
        return self.grad_norm

    def step(self, closure: Any = None) -> None:
        """Nothing to do: every parameter stepped inside backward."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: per-parameter states, groups, clipping memory.

        Returns:
            `PerParameterOptimizer.state_dict()` (``optimizer``: the original's groups and
            hyperparameters; ``per_parameter``: one state_dict per trainable parameter, in order),
            plus ``previous_grad_norm`` and ``steps``.
        """
        previous = None if self._previous_grad_norm is None else self._previous_grad_norm.clone()
        return {**super().state_dict(), "previous_grad_norm": previous, "steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a `state_dict` taken from a wrapper over the same parameters.

        Raises:
            ValueError: If the number of per-parameter states differs from the parameters here.
        """
        super().load_state_dict(state_dict)
        previous = state_dict.get("previous_grad_norm")
        self._previous_grad_norm = None if previous is None else previous.clone()
        self.steps = int(state_dict.get("steps", 0))

    def remove(self) -> None:
        """Removes the hooks: backward then leaves gradients in ``.grad`` again, and nothing steps.

        The per-parameter states are not copied back into ``self.optimizer``.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for parameter in self._row_stepped:
            if row_stepper(parameter) == self.step_rows:
                delattr(parameter, _ROW_STEPPER)
        self._row_stepped = []

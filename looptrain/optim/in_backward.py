"""The optimizer step fused into backward: each parameter steps as soon as its gradient is ready.

`OptimizerInBackward` takes an ordinary optimizer and steps each parameter from a
``register_post_accumulate_grad_hook``, then frees the gradient: the full set of gradients never
exists at once. Clipping is kept (per parameter, or by the previous step's global norm).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

CLIP_MODES = ("per_parameter", "previous_global")

# Same epsilon as torch.nn.utils.clip_grad_norm_, so per-parameter clipping matches it exactly.
_CLIP_EPSILON = 1e-6


def _clone_for_parameter(optimizer: torch.optim.Optimizer, group: dict[str, Any], parameter: nn.Parameter):
    """A new optimizer of `optimizer`'s class over `parameter` alone, with `group`'s hyperparameters."""
    optimizer_class = type(optimizer)
    single_group = {**{key: value for key, value in group.items() if key != "params"}, "params": [parameter]}
    options = {}
    # bitsandbytes keeps optim_bits / min_8bit_size / ... outside the groups, in `args`.
    if "args" in inspect.signature(optimizer_class.__init__).parameters and hasattr(optimizer, "args"):
        options["args"] = optimizer.args
    try:
        clone = optimizer_class([single_group], **options)
    except TypeError as error:
        raise TypeError(
            f"OptimizerInBackward: cannot rebuild {optimizer_class.__name__} from a param group "
            f"({error}); it needs constructor arguments not stored in its param groups."
        ) from error
    if hasattr(clone, "mng"):
        clone.mng = _private_override_manager(clone.mng, parameter)
    if hasattr(optimizer, "name2qmap"):
        # Share bitsandbytes' quantisation maps instead of one copy per parameter.
        clone.name2qmap = optimizer.name2qmap
    return clone


def _private_override_manager(shared_manager: Any, parameter: nn.Parameter) -> Any:
    """A bitsandbytes GlobalOptimManager private to one per-parameter optimizer.

    bitsandbytes resolves overrides through ``index2config[(group_index, parameter_index)]`` in
    its process-global manager, and every per-parameter optimizer has the single position (0, 0):
    with the shared manager, the first embedding's 32-bit override would apply to every parameter
    stepped after it. The private manager holds only this parameter's override.
    """
    private = type(shared_manager).__new__(type(shared_manager))
    private.initialize()
    config: dict[str, Any] = {}
    for module, attribute, override in shared_manager.module_weight_config_triple:
        if getattr(module, attribute) is parameter:
            config.update(override)
    config.update(shared_manager.pid2config.get(id(parameter), {}))
    if config:
        private.pid2config[id(parameter)] = config
        private.index2config[(0, 0)] = config
    return private


class OptimizerInBackward:
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

    Args:
        model_or_params: The model or its parameters; trainable ones get hooks.
        optimizer: The optimizer whose groups hold those parameters; it must have no state yet.
        max_grad_norm: Clip threshold, or None for no clipping.
        clip: ``"per_parameter"`` or ``"previous_global"``.

    Raises:
        ValueError: Unknown `clip`, non-positive `max_grad_norm`, an optimizer that already has
            state, a trainable parameter in no group, or no trainable parameter.
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        clip: str = "per_parameter",
    ):
        if clip not in CLIP_MODES:
            raise ValueError(f"OptimizerInBackward: clip must be one of {CLIP_MODES}, got {clip!r}.")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"OptimizerInBackward: max_grad_norm must be > 0 or None, got {max_grad_norm}.")
        if any(len(state) for state in optimizer.state.values()):
            raise ValueError(
                "OptimizerInBackward: the optimizer already has state (it has stepped); wrap it "
                "before the first step, or load its state into the wrapper with load_state_dict."
            )
        if isinstance(model_or_params, nn.Module):
            named = [(name, parameter) for name, parameter in model_or_params.named_parameters()]
        else:
            named = [(f"parameter {index}", parameter) for index, parameter in enumerate(model_or_params)]
        named = [(name, parameter) for name, parameter in named if parameter.requires_grad]
        if not named:
            raise ValueError("OptimizerInBackward: no trainable parameter (all have requires_grad=False).")

        group_of = {}
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                group_of[id(parameter)] = group
        missing = [name for name, parameter in named if id(parameter) not in group_of]
        if missing:
            raise ValueError(
                f"OptimizerInBackward: trainable parameters {missing[:5]} are in no param group of "
                f"{type(optimizer).__name__}; build the optimizer from the same model (build_optimizer) "
                "or freeze them."
            )

        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.clip = clip
        self.parameters = [parameter for _, parameter in named]
        self._group_of = group_of
        self._per_parameter = {
            id(parameter): _clone_for_parameter(optimizer, group_of[id(parameter)], parameter)
            for parameter in self.parameters
        }
        self._square_sum: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None
        self._previous_grad_norm: torch.Tensor | None = None
        self.steps = 0
        self._handles = [parameter.register_post_accumulate_grad_hook(self._step_parameter) for parameter in self.parameters]

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """Global gradient norm (before clipping) of the last backward, a scalar tensor; None before the first."""
        return self._grad_norm

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The original optimizer's param groups (what schedulers and loggers read)."""
        return self.optimizer.param_groups

    def _clip_scale(self, parameter_norm: torch.Tensor) -> torch.Tensor | None:
        if self.max_grad_norm is None:
            return None
        reference = parameter_norm if (self.clip == "per_parameter" or self._previous_grad_norm is None) else self._previous_grad_norm
        return torch.clamp(self.max_grad_norm / (reference + _CLIP_EPSILON), max=1.0)

    @torch.no_grad()
    def _step_parameter(self, parameter: nn.Parameter) -> None:
        if self._square_sum is None:
            # First hook of this backward: finish the step (norm, counters) when backward ends.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._square_sum = torch.zeros((), dtype=torch.float32, device=parameter.device)
        gradient = parameter.grad
        parameter_norm = torch.linalg.vector_norm(gradient, 2, dtype=torch.float32)
        self._square_sum = self._square_sum + parameter_norm.to(self._square_sum.device) ** 2
        if not _is_finite(parameter_norm):  # never write a non-finite update into the weights
            parameter.grad = None
            return
        scale = self._clip_scale(parameter_norm)
        if scale is not None:
            gradient.mul_(scale.to(device=gradient.device, dtype=gradient.dtype))

        per_parameter = self._per_parameter[id(parameter)]
        # Copy the scheduler's current hyperparameters (lr, and betas/momentum/... if scheduled).
        for key, value in self._group_of[id(parameter)].items():
            if key != "params":
                per_parameter.param_groups[0][key] = value
        per_parameter.step()
        parameter.grad = None

    def _end_of_backward(self) -> None:
        self._grad_norm = torch.sqrt(self._square_sum)
        if _is_finite(self._grad_norm):  # a non-finite norm would clip every later step to zero
            self._previous_grad_norm = self._grad_norm
        self._square_sum = None
        self.steps += 1
        # LR schedulers warn when scheduler.step() comes before any optimizer.step(); the step did
        # happen, in the hooks.
        self.optimizer._opt_called = True

    def step(self, closure: Any = None) -> None:
        """Nothing to do: every parameter stepped inside backward."""

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The per-parameter optimizers, which hold the state (what memory meters count)."""
        return list(self._per_parameter.values())

    @property
    def state(self) -> dict:
        """Every per-parameter optimizer's state, merged."""
        return {key: value for optimizer in self._per_parameter.values() for key, value in optimizer.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop any gradient left on the parameters (normally there is none after backward).

        Args:
            set_to_none: Kept for signature compatibility; gradients are always set to None.
        """
        for parameter in self.parameters:
            parameter.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: per-parameter states, groups, clipping memory.

        Returns:
            A dict with ``optimizer`` (the original's state_dict: groups and hyperparameters),
            ``per_parameter`` (one state_dict per trainable parameter, in parameter order),
            ``previous_grad_norm`` and ``steps``.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "per_parameter": [self._per_parameter[id(parameter)].state_dict() for parameter in self.parameters],
            "previous_grad_norm": None if self._previous_grad_norm is None else self._previous_grad_norm.clone(),
            "steps": self.steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict` taken from a wrapper over the same parameters.

        Args:
            state_dict: The output of `state_dict`.

        Raises:
            ValueError: If the number of per-parameter states differs from the parameters here.
        """
        per_parameter_states = state_dict["per_parameter"]
        if len(per_parameter_states) != len(self.parameters):
            raise ValueError(
                f"OptimizerInBackward.load_state_dict: {len(per_parameter_states)} per-parameter states "
                f"for {len(self.parameters)} trainable parameters; freeze the same parameters as the saved run."
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        # load_state_dict replaced the group dicts: re-point the parameter-to-group map.
        self._group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        for parameter, state in zip(self.parameters, per_parameter_states):
            self._per_parameter[id(parameter)].load_state_dict(state)
        previous = state_dict.get("previous_grad_norm")
        self._previous_grad_norm = None if previous is None else previous.clone()
        self.steps = int(state_dict.get("steps", 0))

    def remove(self) -> None:
        """Remove the hooks: backward then leaves gradients in ``.grad`` again, and nothing steps.

        The per-parameter states are not copied back into ``self.optimizer``.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _is_finite(value: torch.Tensor) -> bool:
    """Whether a scalar tensor is finite; a fake one (the estimator's: no value) counts as finite."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor) or bool(torch.isfinite(value))

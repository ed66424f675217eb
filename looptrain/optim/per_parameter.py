"""One optimizer per parameter, built from an ordinary optimizer: what the fused step and bf16 weights need.

`PerParameterOptimizer` takes an optimizer over some parameters and makes, for each trainable one, an
optimizer of the same class over that parameter alone, with its group's hyperparameters. The
original optimizer keeps its param groups (so an LR scheduler built on it keeps working: the
current hyperparameters, `lr` included, are copied in before each step) but never holds state. Its
subclasses decide when each parameter steps: inside backward (`OptimizerInBackward`) or at the
window's end in fp32 with stochastic rounding (`BF16Optimizer`). Parameters unfrozen later join
with `add_param_group`, the others' state untouched. Each wrapper clips its own gradients
(`clip_grad_norm_`, see `looptrain.optim.clipping`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from looptrain.optim.clipping import clip_parameters_
from looptrain.optim.factory import private_override_manager


def clone_for_parameter(optimizer: torch.optim.Optimizer, group: dict[str, Any], parameter: nn.Parameter):
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
            f"{optimizer_class.__name__} cannot be rebuilt from a param group ({error}): one optimizer per "
            "parameter needs constructor arguments stored in its param groups."
        ) from error
    if hasattr(clone, "mng"):  # the overrides are the original's (its own manager, `build_optimizer`'s)
        clone.mng = _private_override_manager(getattr(optimizer, "mng", clone.mng), parameter)
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
    private = private_override_manager(shared_manager)
    config: dict[str, Any] = {}
    for module, attribute, override in shared_manager.module_weight_config_triple:
        if getattr(module, attribute) is parameter:
            config.update(override)
    config.update(shared_manager.pid2config.get(id(parameter), {}))
    if config:
        private.pid2config[id(parameter)] = config
        private.index2config[(0, 0)] = config
    return private


class PerParameterOptimizer:
    """An optimizer seen as one optimizer per trainable parameter (see the module docstring).

    Args:
        model_or_params: the model or its parameters; the trainable ones get an optimizer each.
        optimizer: the optimizer whose groups hold them; it must have no state yet.

    Raises:
        ValueError: an optimizer that already has state, a trainable parameter in no group, or no
            trainable parameter.
    """

    def __init__(self, model_or_params: nn.Module | Iterable[nn.Parameter], optimizer: torch.optim.Optimizer):
        name = type(self).__name__
        if any(len(state) for state in optimizer.state.values()):
            raise ValueError(
                f"{name}: the optimizer already has state (it has stepped); wrap it before the first step, "
                "or load its state into the wrapper with load_state_dict."
            )
        if isinstance(model_or_params, nn.Module):
            named = list(model_or_params.named_parameters())
        else:
            named = [(f"parameter {index}", parameter) for index, parameter in enumerate(model_or_params)]
        named = [(parameter_name, parameter) for parameter_name, parameter in named if parameter.requires_grad]
        if not named:
            raise ValueError(f"{name}: no trainable parameter (all have requires_grad=False).")
        self.optimizer = optimizer
        self.parameters: list[nn.Parameter] = []
        self._group_of: dict[int, dict] = {}
        self._per_parameter: dict[int, torch.optim.Optimizer] = {}
        self._index_groups()
        missing = [parameter_name for parameter_name, parameter in named if id(parameter) not in self._group_of]
        if missing:
            raise ValueError(
                f"{name}: trainable parameters {missing[:5]} are in no param group of {type(optimizer).__name__}; "
                "build the optimizer from the same model (build_optimizer) or freeze them."
            )
        for _, parameter in named:
            self._adopt(parameter)

    def _index_groups(self) -> None:
        self._group_of = {
            id(parameter): group for group in self.optimizer.param_groups for parameter in group["params"]
        }

    def _adopt(self, parameter: nn.Parameter) -> None:
        """Gives `parameter` its own optimizer (subclasses add their hooks)."""
        self.parameters.append(parameter)
        self._per_parameter[id(parameter)] = clone_for_parameter(
            self.optimizer, self._group_of[id(parameter)], parameter
        )

    def optimizer_of(self, parameter: nn.Parameter) -> torch.optim.Optimizer:
        """The parameter's own optimizer, with its group's current hyperparameters copied in."""
        per_parameter = self._per_parameter[id(parameter)]
        for key, value in self._group_of[id(parameter)].items():
            if key != "params":
                per_parameter.param_groups[0][key] = value
        return per_parameter

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Adds parameters (unfrozen ones): to the original optimizer's groups, each with an optimizer of its own."""
        self.optimizer.add_param_group(group)
        self._index_groups()
        for parameter in self.optimizer.param_groups[-1]["params"]:
            self._adopt(parameter)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The original optimizer's param groups (what schedulers and loggers read)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """Every per-parameter optimizer's state, merged."""
        return {key: value for optimizer in self._per_parameter.values() for key, value in optimizer.state.items()}

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The per-parameter optimizers, which hold the state (what memory meters count)."""
        return list(self._per_parameter.values())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scales the gradients to global norm `max_norm` at most; returns their norm before (torch's clipping)."""
        return clip_parameters_(self.parameters, max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every gradient (always to None)."""
        for parameter in self.parameters:
            parameter.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The original's state_dict (groups, hyperparameters) and one state_dict per parameter, in order."""
        return {"optimizer": self.optimizer.state_dict(),
                "per_parameter": [self._per_parameter[id(parameter)].state_dict() for parameter in self.parameters]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores `state_dict()` taken from a wrapper over the same parameters.

        Raises:
            ValueError: the number of per-parameter states differs from the parameters here.
        """
        per_parameter_states = state_dict["per_parameter"]
        if len(per_parameter_states) != len(self.parameters):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: {len(per_parameter_states)} per-parameter states for "
                f"{len(self.parameters)} trainable parameters; freeze the same parameters as the saved run."
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._index_groups()  # load_state_dict replaced the group dicts
        for parameter, state in zip(self.parameters, per_parameter_states):
            if not self._steps_in_fp32(parameter):
                self._per_parameter[id(parameter)].load_state_dict(state)
                continue
            # torch casts loaded state to the parameter's dtype: show it an fp32 parameter so the state stays fp32
            storage = parameter.data
            parameter.data = torch.empty_like(storage, dtype=torch.float32)
            try:
                self._per_parameter[id(parameter)].load_state_dict(state)
            finally:
                parameter.data = storage

    def _steps_in_fp32(self, parameter: nn.Parameter) -> bool:
        """Whether this wrapper steps `parameter` through an fp32 copy (its state is then fp32)."""
        return False

"""Optimizer factory and the optimizer step fused into backward.

`build_optimizer` makes AdamW (``foreach`` / ``fused`` exposed), bitsandbytes' 8-bit AdamW (paged
or not, with 32-bit state for every embedding), Hugging Face's Adafactor and SGD, always over two
parameter groups (weight decay / no weight decay) that hold every trainable parameter exactly once
and no frozen one.

`OptimizerInBackward` takes such an optimizer and steps each parameter from a
``register_post_accumulate_grad_hook`` as soon as its gradient is ready, then frees the gradient:
the full set of gradients never exists at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from looptrain.freeze import is_norm_module

OPTIMIZER_NAMES = ("adamw", "adamw8bit", "paged_adamw8bit", "adafactor", "sgd")
CLIP_MODES = ("per_parameter", "previous_global")

# Same epsilon as torch.nn.utils.clip_grad_norm_, so per-parameter clipping matches it exactly.
_CLIP_EPSILON = 1e-6


def build_parameter_groups(
    model: nn.Module, weight_decay: float, *, decay_embeddings: bool = True
) -> list[dict[str, Any]]:
    """Split the trainable parameters into a weight-decay group and a no-decay group.

    No decay on biases (parameters named ``bias``) and on every parameter of a normalisation layer
    (detected by module type, `looptrain.freeze.is_norm_module`, so ``LlamaRMSNorm`` counts).
    Embeddings are decayed by default, as Hugging Face ``Trainer`` does, so runs compare with
    Trainer's; pass ``decay_embeddings=False`` for the minGPT / nanoGPT convention. Frozen
    parameters are in no group; tied parameters appear once.

    Args:
        model: The model.
        weight_decay: Weight decay of the decay group.
        decay_embeddings: Whether ``nn.Embedding`` weights are decayed.

    Returns:
        A list of one or two param-group dicts (empty groups are left out).

    Raises:
        ValueError: If the model has no trainable parameter.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen or not parameter.requires_grad:
                continue
            seen.add(id(parameter))
            exempt = (
                name.endswith("bias")
                or is_norm_module(module)
                or (not decay_embeddings and isinstance(module, nn.Embedding))
            )
            (no_decay if exempt else decay).append(parameter)

    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not trainable:
        raise ValueError(
            f"build_optimizer: {type(model).__name__} has no trainable parameter (all have "
            "requires_grad=False); unfreeze something, e.g. looptrain.freeze.unfreeze(model.classifier)."
        )
    # minGPT's check: every trainable parameter in exactly one group, nothing else in any group.
    grouped = [id(parameter) for parameter in decay + no_decay]
    assert len(grouped) == len(set(grouped)), "a parameter landed in both weight-decay groups"
    assert set(grouped) == {id(parameter) for parameter in trainable}, "parameter groups do not cover the trainable parameters"

    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def register_embedding_state_bits(model: nn.Module, bits: int = 32) -> int:
    """Give every trainable ``nn.Embedding`` weight `bits`-bit optimizer state in bitsandbytes.

    The one place where looptrain touches bitsandbytes' process-global ``GlobalOptimManager``.
    Overrides are keyed on the parameter object, so they also apply to optimizers built later
    over the same parameters (`OptimizerInBackward`'s per-parameter ones). Registering the same
    module twice is a no-op.

    Args:
        model: The model.
        bits: 32 (the bitsandbytes recommendation for NLP embeddings) or 8.

    Returns:
        The number of embedding modules registered.
    """
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    registered = {(id(module), attribute) for module, attribute, _ in manager.module_weight_config_triple}
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.weight.requires_grad:
            if (id(module), "weight") not in registered:
                manager.register_module_override(module, "weight", {"optim_bits": bits})
            count += 1
    return count


def _import_bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(
            "8-bit optimizers need bitsandbytes: pip install bitsandbytes (or use --optim adamw / adafactor)."
        ) from error
    return bitsandbytes


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float = 0.0,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    foreach: bool | None = None,
    fused: bool | None = None,
    embedding_bits: int = 32,
    decay_embeddings: bool = True,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Build an optimizer over the trainable parameters of `model`.

    Args:
        model: The model; frozen parameters get no group and no state.
        name: One of ``adamw``, ``adamw8bit``, ``paged_adamw8bit``, ``adafactor``, ``sgd``.
        lr: Learning rate (Adafactor too: relative steps are off, as in Trainer's ``adafactor``).
        weight_decay: Decoupled weight decay (L2 for SGD), not applied to biases and norms.
        betas: Adam betas (adamw, adamw8bit, paged_adamw8bit).
        eps: Adam epsilon (adamw, adamw8bit, paged_adamw8bit).
        foreach: ``torch.optim.AdamW`` / ``SGD`` option; ``False`` steps one tensor at a time,
            which lowers the step's peak memory (no multi-tensor temporaries) at some speed cost.
        fused: ``torch.optim.AdamW`` / ``SGD`` option: one fused kernel per step.
        embedding_bits: Optimizer-state bits for ``nn.Embedding`` weights under the 8-bit
            optimizers: 32 (default, for stability) or 8.
        decay_embeddings: Whether embedding weights are in the weight-decay group.
        **kwargs: Passed to the optimizer class (e.g. ``momentum`` for sgd, ``beta1`` for adafactor,
            ``min_8bit_size`` for the 8-bit ones).

    Returns:
        The optimizer.

    Raises:
        ValueError: Unknown `name`, options that do not apply to it, or no trainable parameter.
        ImportError: bitsandbytes missing for the 8-bit optimizers.
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"build_optimizer: unknown optimizer {name!r}; valid names are {', '.join(OPTIMIZER_NAMES)}.")
    if name not in ("adamw", "sgd") and (foreach is not None or fused is not None):
        raise ValueError(f"build_optimizer: foreach/fused apply to adamw and sgd only, not {name!r}; leave them None.")
    if foreach and fused:
        raise ValueError("build_optimizer: foreach=True and fused=True exclude each other; pick one.")
    if embedding_bits not in (8, 32):
        raise ValueError(f"build_optimizer: embedding_bits must be 8 or 32, got {embedding_bits}.")
    groups = build_parameter_groups(model, weight_decay, decay_embeddings=decay_embeddings)

    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=foreach, fused=fused, **kwargs)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, foreach=foreach, fused=fused, **kwargs)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # Trainer's optim="adafactor" settings (the seeds' ladder): explicit lr, no relative step,
        # no parameter-scale factor; first moment off unless beta1 is passed.
        options = {"scale_parameter": False, "relative_step": False, "warmup_init": False, **kwargs}
        return Adafactor(groups, lr=lr, **options)

    bitsandbytes = _import_bitsandbytes()
    if embedding_bits != 8:
        register_embedding_state_bits(model, embedding_bits)
    optimizer_class = bitsandbytes.optim.PagedAdamW8bit if name == "paged_adamw8bit" else bitsandbytes.optim.AdamW8bit
    return optimizer_class(groups, lr=lr, betas=betas, eps=eps, **kwargs)


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes held by the tensors in an optimizer's state (8-bit state counts 1 byte an element).

    A tensor shared between parameters (bitsandbytes' quantisation maps) is counted once.

    Args:
        optimizer: A torch optimizer (bitsandbytes ones included) or an `OptimizerInBackward`.

    Returns:
        The number of bytes.
    """
    return _state_bytes(inner_optimizers(optimizer))


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers that hold the state: an `OptimizerInBackward`'s per-parameter ones, else itself.

    Args:
        optimizer: A torch optimizer, an `OptimizerInBackward`, or None.

    Returns:
        A list of optimizers (empty for None).
    """
    if optimizer is None:
        return []
    if isinstance(optimizer, OptimizerInBackward):
        return list(optimizer._per_parameter.values())
    return [optimizer]


def _state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    seen: set[int] = set()
    total = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    total += value.numel() * value.element_size()
    return total


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
    def grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last backward, or None before the first."""
        return None if self._grad_norm is None else float(self._grad_norm)

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
        self._previous_grad_norm = self._grad_norm
        self._square_sum = None
        self.steps += 1
        # LR schedulers warn when scheduler.step() comes before any optimizer.step(); the step did
        # happen, in the hooks.
        self.optimizer._opt_called = True

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


__all__ = [
    "CLIP_MODES",
    "OPTIMIZER_NAMES",
    "OptimizerInBackward",
    "build_optimizer",
    "build_parameter_groups",
    "optimizer_state_bytes",
    "register_embedding_state_bits",
]

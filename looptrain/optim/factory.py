"""The optimizer factory: names, parameter groups, and the options each optimizer takes.

`build_optimizer` makes AdamW (``foreach`` / ``fused`` exposed), bitsandbytes' 8-bit AdamW (paged
or not, with 32-bit state for every embedding), Hugging Face's Adafactor (its step in place:
`optim.adafactor`) and SGD, always over parameter groups (weight decay / no weight decay, per depth
with layer-wise learning-rate decay) that hold every trainable parameter exactly once and no frozen one.
The optimizer names and the rule "foreach only for adamw and sgd" are defined here once; the command
line and the estimator read them from here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from looptrain.freeze import is_norm_module, layer_depths

OPTIMIZER_NAMES = ("adamw", "adamw8bit", "paged_adamw8bit", "adafactor", "sgd")
FOREACH_OPTIMIZERS = ("adamw", "sgd")  # torch optimizers with foreach / fused implementations
EIGHT_BIT_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit")  # bitsandbytes


def optimizer_options_problem(name: str, foreach: bool | None = None, fused: bool | None = None) -> str | None:
    """Why `name` with these options cannot be built, or None. The command line and the estimator ask too."""
    if name not in OPTIMIZER_NAMES:
        return f"unknown optimizer {name!r}; valid names are {', '.join(OPTIMIZER_NAMES)}"
    if name not in FOREACH_OPTIMIZERS and (foreach is not None or fused is not None):
        return (f"foreach/fused apply to {' and '.join(FOREACH_OPTIMIZERS)} only, not {name!r}; "
                "leave them unset")
    if foreach and fused:
        return "foreach=True and fused=True exclude each other; pick one"
    return None


def optimizer_name_of(optimizer: Any) -> str | None:
    """The `build_optimizer` name of an optimizer object, when it is one of those (else None)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # OptimizerInBackward wraps one
    class_name = type(inner).__name__
    module = type(inner).__module__
    if module.startswith("bitsandbytes"):
        return "paged_adamw8bit" if "Paged" in class_name else "adamw8bit"
    return {"AdamW": "adamw", "SGD": "sgd", "Adafactor": "adafactor"}.get(class_name)


def build_parameter_groups(
    model: nn.Module, weight_decay: float, *, decay_embeddings: bool = True,
    layer_lr_decay: float | None = None, lr: float | None = None,
) -> list[dict[str, Any]]:
    """Split the trainable parameters into a weight-decay group and a no-decay group (per depth with LLRD).

    No decay on biases (parameters named ``bias``) and on every parameter of a normalisation layer
    (detected by module type, `looptrain.freeze.is_norm_module`, so ``LlamaRMSNorm`` counts).
    Embeddings are decayed by default, as Hugging Face ``Trainer`` does, so runs compare with
    Trainer's; pass ``decay_embeddings=False`` for the minGPT / nanoGPT convention. Frozen
    parameters are in no group; tied parameters appear once.

    With `layer_lr_decay` (layer-wise learning-rate decay), each depth of
    `looptrain.freeze.layer_depths` gets its own pair of groups: the head and the top block train at
    `lr`, the block ``k`` below the top at ``lr * layer_lr_decay**k``, the embeddings at
    ``lr * layer_lr_decay**L`` (``L`` blocks). Each group records its ``layer`` label.

    Args:
        model: The model.
        weight_decay: Weight decay of the decay group.
        decay_embeddings: Whether ``nn.Embedding`` weights are decayed.
        layer_lr_decay: Per-block learning-rate factor in (0, 1], or None (one learning rate).
        lr: The top learning rate (needed with `layer_lr_decay`).

    Returns:
        A list of param-group dicts (empty groups are left out).

    Raises:
        ValueError: If the model has no trainable parameter, or `layer_lr_decay` is out of (0, 1] or
            given without `lr`.
    """
    exempt_ids: set[int] = set()
    ordered: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen or not parameter.requires_grad:
                continue
            seen.add(id(parameter))
            ordered.append(parameter)
            if (name.endswith("bias") or is_norm_module(module)
                    or (not decay_embeddings and isinstance(module, nn.Embedding))):
                exempt_ids.add(id(parameter))

    if not ordered:
        raise ValueError(
            f"build_optimizer: {type(model).__name__} has no trainable parameter (all have "
            "requires_grad=False); unfreeze something, e.g. looptrain.freeze.unfreeze(model.classifier)."
        )

    def split(parameters: list[nn.Parameter], **options: Any) -> list[dict[str, Any]]:
        decay = [parameter for parameter in parameters if id(parameter) not in exempt_ids]
        no_decay = [parameter for parameter in parameters if id(parameter) in exempt_ids]
        return [{"params": decay, "weight_decay": weight_decay, **options},
                {"params": no_decay, "weight_decay": 0.0, **options}]

    if layer_lr_decay is None:
        groups = split(ordered)
    else:
        if not (isinstance(layer_lr_decay, (int, float)) and 0 < layer_lr_decay <= 1):
            raise ValueError(f"build_optimizer: layer_lr_decay must be in (0, 1], got {layer_lr_decay!r}.")
        if lr is None:
            raise ValueError("build_optimizer: layer_lr_decay needs the top learning rate lr.")
        trainable_ids = {id(parameter) for parameter in ordered}
        depths = layer_depths(model)
        groups = []
        for index, (label, named) in enumerate(depths):
            exponent = max(0, index - 1)  # the head and the top block (indices 0, 1) at lr
            parameters = [parameter for _, parameter in named if id(parameter) in trainable_ids]
            groups += split(parameters, lr=lr * layer_lr_decay**exponent, layer=label)

    # minGPT's check: every trainable parameter in exactly one group, nothing else in any group.
    grouped = [id(parameter) for group in groups for parameter in group["params"]]
    assert len(grouped) == len(set(grouped)), "a parameter landed in two parameter groups"
    assert set(grouped) == {id(parameter) for parameter in ordered}, (
        "parameter groups do not cover the trainable parameters"
    )
    return [group for group in groups if group["params"]]


def register_embedding_state_bits(model: nn.Module, bits: int = 32, manager: Any = None) -> int:
    """Give every trainable ``nn.Embedding`` weight, and an untied LM head, `bits`-bit optimizer state in bitsandbytes.

    A causal LM's output embedding (``get_output_embeddings()``, an ``nn.Linear``) holds the same kind of
    rows as the input embedding, one per token, most of them rarely updated: it is registered too when it is
    not tied to the input embedding (a tied one is the embedding's own weight, registered already).

    By default the overrides go to bitsandbytes' process-global ``GlobalOptimManager``, where they apply to every
    bitsandbytes optimizer built later over the same parameters, and the manager holds the modules for the rest of
    the process. `build_optimizer` passes a manager of the optimizer's own instead (`private_override_manager`).
    Registering the same module twice is a no-op.

    Args:
        model: The model.
        bits: 32 (the bitsandbytes recommendation for NLP embeddings) or 8.
        manager: the ``GlobalOptimManager`` instance to register in (None: the process-global one).

    Returns:
        The number of modules registered (embeddings, and an untied LM head).
    """
    if manager is None:
        from bitsandbytes.optim import GlobalOptimManager

        manager = GlobalOptimManager.get_instance()
    registered = {(id(module), attribute) for module, attribute, _ in manager.module_weight_config_triple}
    count = 0
    modules = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if isinstance(head, nn.Linear) and all(head.weight is not module.weight for module in modules):
        modules.append(head)  # an untied LM head
    for module in modules:
        if module.weight.requires_grad:
            if (id(module), "weight") not in registered:
                manager.register_module_override(module, "weight", {"optim_bits": bits})
            count += 1
    return count


def import_optimizer(name: str) -> None:
    """Imports the module the optimizer `name` comes from (looptrain's for ``adafactor``, bitsandbytes for the 8-bit
    ones), so that processes forked afterwards find it imported: bitsandbytes' first import costs about a second on
    a CPU (its kernels import torch.compile's machinery). Raises ImportError as `build_optimizer` would."""
    if name == "adafactor":
        import looptrain.optim.adafactor  # noqa: F401  (torch alone: not transformers.optimization)
    elif name in EIGHT_BIT_OPTIMIZERS:
        _import_bitsandbytes()


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
    layer_lr_decay: float | None = None,
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
        layer_lr_decay: Layer-wise learning-rate decay: the block ``k`` below the top trains at
            ``lr * layer_lr_decay**k``, the embeddings at ``lr * layer_lr_decay**L`` (see
            `build_parameter_groups`); None: one learning rate.
        **kwargs: Passed to the optimizer class (e.g. ``momentum`` for sgd, ``beta1`` for adafactor,
            ``min_8bit_size`` for the 8-bit ones).

    Returns:
        The optimizer.

    Raises:
        ValueError: Unknown `name`, options that do not apply to it, or no trainable parameter.
        ImportError: bitsandbytes missing for the 8-bit optimizers.
    """
    problem = optimizer_options_problem(name, foreach, fused)
    if problem:
        raise ValueError(f"build_optimizer: {problem}.")
    if embedding_bits not in (8, 32):
        raise ValueError(f"build_optimizer: embedding_bits must be 8 or 32, got {embedding_bits}.")
    groups = build_parameter_groups(model, weight_decay, decay_embeddings=decay_embeddings,
                                    layer_lr_decay=layer_lr_decay, lr=lr)

    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=foreach, fused=fused, **kwargs)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, foreach=foreach, fused=fused, **kwargs)
    if name == "adafactor":
        from looptrain.optim.adafactor import Adafactor  # Hugging Face's, its step in place (one temporary)

        # Trainer's optim="adafactor" settings (the seeds' ladder): explicit lr, no relative step,
        # no parameter-scale factor; first moment off unless beta1 is passed.
        options = {"scale_parameter": False, "relative_step": False, "warmup_init": False, **kwargs}
        return Adafactor(groups, lr=lr, **options)

    bitsandbytes = _import_bitsandbytes()
    optimizer_class = bitsandbytes.optim.PagedAdamW8bit if name == "paged_adamw8bit" else bitsandbytes.optim.AdamW8bit
    optimizer = optimizer_class(groups, lr=lr, betas=betas, eps=eps, **kwargs)
    # The optimizer's own override manager: bitsandbytes' process-global one would hold this model's embeddings for
    # the rest of the process, and resolves overrides by (group, parameter) position, which another optimizer in the
    # same process (a planner's probes, a sweep) would then read as its own.
    optimizer.mng = private_override_manager(optimizer.mng)
    if embedding_bits != 8:
        register_embedding_state_bits(model, embedding_bits, optimizer.mng)
    return optimizer


def private_override_manager(manager: Any) -> Any:
    """A new, empty bitsandbytes ``GlobalOptimManager`` of `manager`'s class, private to the optimizer it is given to
    (``optimizer.mng``): its overrides apply to that optimizer alone and go with it."""
    private = type(manager).__new__(type(manager))
    private.initialize()
    return private



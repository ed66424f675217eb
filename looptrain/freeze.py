"""Freeze and unfreeze parameters: by module, by name pattern, by transformer block index.

A frozen parameter has ``requires_grad=False``: autograd computes no gradient for it, so it holds
no ``.grad`` tensor and, because `looptrain.optim.build_optimizer` only hands trainable parameters
to the optimizer, no optimizer state either. Blocks that sit before the first trainable parameter
also store no activations, since nothing upstream of them needs a gradient.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from torch import nn

ModuleOrParameters = nn.Module | nn.Parameter | Iterable[nn.Module | nn.Parameter]

# Attribute names under which architectures keep their list of repeated blocks, e.g.
# BERT/RoBERTa/DeBERTa/ELECTRA `encoder.layer`, GPT-2 `h`, LLaMA/Mistral `layers`, T5 `block`.
BLOCK_LIST_NAMES = ("layer", "layers", "h", "block", "blocks")

# Norm classes recognised by type; custom ones (LlamaRMSNorm, T5LayerNorm, DebertaLayerNorm, ...)
# are recognised by their class name below, because they subclass nn.Module directly.
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    nn.RMSNorm,
)


def is_norm_module(module: nn.Module) -> bool:
    """Whether `module` is a normalisation layer (LayerNorm, RMSNorm, BatchNorm, GroupNorm, ...).

    Detection is by type first, then by class name (ending in ``Norm`` or containing ``LayerNorm``
    or ``RMSNorm``) so that models' own norm classes such as ``LlamaRMSNorm`` count too.

    Args:
        module: Any module.

    Returns:
        True for a normalisation layer.
    """
    if isinstance(module, _NORM_TYPES):
        return True
    class_name = type(module).__name__
    return class_name.endswith("Norm") or "LayerNorm" in class_name or "RMSNorm" in class_name


def _iter_parameters(target: ModuleOrParameters, keep_norms_trainable: bool) -> Iterable[nn.Parameter]:
    if isinstance(target, nn.Parameter):
        yield target
        return
    if isinstance(target, nn.Module):
        for module in target.modules():
            if keep_norms_trainable and is_norm_module(module):
                continue
            yield from module.parameters(recurse=False)
        return
    for item in target:
        yield from _iter_parameters(item, keep_norms_trainable)


def freeze(target: ModuleOrParameters, *, keep_norms_trainable: bool = False) -> None:
    """Set ``requires_grad=False`` on every parameter of a module, parameter, or iterable of them.

    Args:
        target: An ``nn.Module``, an ``nn.Parameter``, or an iterable of those (for example a slice
            of an ``nn.ModuleList``: ``freeze(model.bert.encoder.layer[:2])``).
        keep_norms_trainable: Leave the parameters of normalisation layers trainable (fastai's
            habit: norm layers are cheap and adapting them helps a frozen body fit new data).
    """
    for parameter in _iter_parameters(target, keep_norms_trainable):
        parameter.requires_grad_(False)


def unfreeze(target: ModuleOrParameters) -> None:
    """Set ``requires_grad=True`` on every parameter of a module, parameter, or iterable of them.

    Args:
        target: An ``nn.Module``, an ``nn.Parameter``, or an iterable of those.
    """
    for parameter in _iter_parameters(target, keep_norms_trainable=False):
        parameter.requires_grad_(True)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that require gradients, in registration order, tied ones once.

    Args:
        model: Any module.

    Returns:
        A list of parameters with ``requires_grad=True``.
    """
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def _named_parameters_of_modules(
    model: nn.Module, modules: Iterable[nn.Module], keep_norms_trainable: bool
) -> list[tuple[str, nn.Parameter]]:
    """(qualified name, parameter) for the parameters owned by `modules`, in `model`'s order."""
    wanted = set()
    for module in modules:
        for parameter in _iter_parameters(module, keep_norms_trainable):
            wanted.add(id(parameter))
    return [(name, parameter) for name, parameter in model.named_parameters() if id(parameter) in wanted]


def _freeze_named(named: list[tuple[str, nn.Parameter]]) -> list[str]:
    for _, parameter in named:
        parameter.requires_grad_(False)
    return [name for name, _ in named]


def freeze_by_pattern(
    model: nn.Module,
    patterns: str | Sequence[str],
    *,
    syntax: str = "glob",
    keep_norms_trainable: bool = False,
) -> list[str]:
    """Freeze the parameters whose qualified names match any of `patterns`.

    Args:
        model: The model whose ``named_parameters()`` names are matched.
        patterns: One pattern or several. With ``syntax="glob"`` a pattern must match the whole
            name (``"bert.encoder.layer.[01].*"``); with ``syntax="regex"`` it is searched
            anywhere in the name (``r"layer\\.(0|1)\\."``).
        syntax: ``"glob"`` (fnmatch, case-sensitive) or ``"regex"`` (``re.search``).
        keep_norms_trainable: Leave parameters of normalisation layers trainable.

    Returns:
        The names of the parameters frozen, in model order.

    Raises:
        ValueError: For an unknown `syntax`, or a pattern that matches no parameter (usually a
            typo; the message lists a few real names to copy from).
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if syntax not in ("glob", "regex"):
        raise ValueError(f"freeze_by_pattern: syntax must be 'glob' or 'regex', got {syntax!r}.")

    def matches(pattern: str, name: str) -> bool:
        if syntax == "glob":
            return fnmatch.fnmatchcase(name, pattern)
        return re.search(pattern, name) is not None

    norm_parameter_ids = set()
    if keep_norms_trainable:
        for module in model.modules():
            if is_norm_module(module):
                norm_parameter_ids.update(id(parameter) for parameter in module.parameters(recurse=False))

    names = [name for name, _ in model.named_parameters()]
    selected = []
    for pattern in patterns:
        hits = [(name, parameter) for name, parameter in model.named_parameters() if matches(pattern, name)]
        if not hits:
            raise ValueError(
                f"freeze_by_pattern: {syntax} pattern {pattern!r} matches no parameter of "
                f"{type(model).__name__}; parameter names look like {names[:3]}."
            )
        selected.extend(hits)
    chosen_ids = {id(parameter) for _, parameter in selected} - norm_parameter_ids
    named = [(name, parameter) for name, parameter in model.named_parameters() if id(parameter) in chosen_ids]
    return _freeze_named(named)


def find_transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """Find the list of repeated transformer blocks of a model, without knowing its class.

    The first ``nn.ModuleList`` (or ``nn.Sequential``) in ``named_modules()`` order whose attribute
    name is one of ``layer``, ``layers``, ``h``, ``block``, ``blocks`` and whose children all share
    one class: BERT/RoBERTa/DeBERTa/ELECTRA ``encoder.layer``, GPT-2 ``transformer.h``,
    LLaMA-style ``model.layers``, T5's encoder ``block``.

    Args:
        model: A transformer model, with or without a task head.

    Returns:
        The block list itself (indexable, in forward order).

    Raises:
        ValueError: If no such list exists; the message names the model class.
    """
    for name, module in model.named_modules():
        attribute = name.rsplit(".", 1)[-1]
        if attribute not in BLOCK_LIST_NAMES or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if children and len({type(child) for child in children}) == 1:
            return module
    raise ValueError(
        f"find_transformer_blocks: found no list of transformer blocks in {type(model).__name__} "
        f"(looked for an nn.ModuleList named one of {BLOCK_LIST_NAMES}, e.g. encoder.layer, h, "
        "layers). Freeze its blocks by name with freeze_by_pattern(model, ...) instead."
    )


def freeze_layers(model: nn.Module, num_layers: int, *, keep_norms_trainable: bool = False) -> list[str]:
    """Freeze the first `num_layers` transformer blocks (found by `find_transformer_blocks`).

    Args:
        model: A transformer model.
        num_layers: How many blocks, counted from the input side, to freeze (0 freezes none).
        keep_norms_trainable: Leave the blocks' normalisation layers trainable.

    Returns:
        The names of the parameters frozen, in model order.

    Raises:
        ValueError: If `num_layers` is negative or exceeds the number of blocks, or the model has
            no recognisable block list.
    """
    blocks = find_transformer_blocks(model)
    if num_layers < 0 or num_layers > len(blocks):
        raise ValueError(
            f"freeze_layers: num_layers={num_layers} but {type(model).__name__} has {len(blocks)} "
            f"transformer blocks; pass a number between 0 and {len(blocks)} (use freeze_encoder to "
            "freeze everything but the head)."
        )
    return _freeze_named(_named_parameters_of_modules(model, list(blocks)[:num_layers], keep_norms_trainable))


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_input_embeddings()``: None where the model has no such method, a Hugging Face model has none
    (``NotImplementedError``), or it returns no module."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embedding = getter() if callable(getter) else None
    except NotImplementedError:
        return None
    return embedding if isinstance(embedding, nn.Module) else None


def embedding_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that make up a model's embeddings block (what `freeze_embeddings` freezes).

    - A base model with an ``embeddings`` submodule (BERT, RoBERTa, DeBERTa, ELECTRA, ...): that
      whole submodule: word, position and token-type embeddings, the embeddings LayerNorm and any
      projection inside it.
    - Otherwise (GPT-2, LLaMA, ...): ``get_input_embeddings()`` plus every ``nn.Embedding`` that is
      a direct child of the base model (GPT-2's ``wpe``).
    - A model that is not a Hugging Face model and has neither: every ``nn.Embedding`` in it.

    Args:
        model: Any model; for HF models ``model.base_model`` is searched.

    Returns:
        The modules, possibly empty.
    """
    base = getattr(model, "base_model", model)
    embeddings_block = getattr(base, "embeddings", None)
    if isinstance(embeddings_block, nn.Module):
        return [embeddings_block]
    found: list[nn.Module] = []
    if callable(getattr(model, "get_input_embeddings", None)):
        embedding = input_embeddings(model)
        if embedding is not None:
            found.append(embedding)
        found.extend(
            child for child in base.children() if isinstance(child, nn.Embedding) and child not in found
        )
        return found
    return [module for module in model.modules() if isinstance(module, nn.Embedding)]


def freeze_embeddings(model: nn.Module, *, keep_norms_trainable: bool = False) -> list[str]:
    """Freeze the model's embeddings block (see `embedding_modules` for exactly what that is).

    For BERT-like models this is ``base_model.embeddings``: word, position and token-type
    embeddings and the embeddings LayerNorm. A tied output head (``lm_head.weight`` that *is*
    the word-embedding matrix) is frozen with it, since it is the same tensor.

    Args:
        model: A transformer model.
        keep_norms_trainable: Leave the embeddings LayerNorm trainable.

    Returns:
        The names of the parameters frozen, in model order.

    Raises:
        ValueError: If the model has no embeddings to freeze.
    """
    modules = embedding_modules(model)
    if not modules:
        raise ValueError(
            f"freeze_embeddings: found no embedding layer in {type(model).__name__} (no "
            "base_model.embeddings, get_input_embeddings() or nn.Embedding); freeze its input "
            "layer with freeze(module) or freeze_by_pattern instead."
        )
    return _freeze_named(_named_parameters_of_modules(model, modules, keep_norms_trainable))


def freeze_encoder(model: nn.Module, *, keep_norms_trainable: bool = False) -> list[str]:
    """Freeze everything except the task head: every parameter of ``model.base_model``.

    Args:
        model: A Hugging Face model with a head (``...ForSequenceClassification`` etc.).
        keep_norms_trainable: Leave the encoder's normalisation layers trainable.

    Returns:
        The names of the parameters frozen, in model order.

    Raises:
        ValueError: If the model has no ``base_model`` distinct from itself (a bare encoder or a
            non-HF model), where "everything but the head" is undefined.
    """
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise ValueError(
            f"freeze_encoder: {type(model).__name__} has no separate base_model and task head, so "
            "'everything but the head' is undefined; freeze the body explicitly with freeze(module)."
        )
    return _freeze_named(_named_parameters_of_modules(model, [base], keep_norms_trainable))


_INDEX_PATTERN = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _group_key(name: str) -> tuple[str, int | None]:
    """Group a parameter name by its block (prefix, index) or by its owning module's path."""
    match = _INDEX_PATTERN.match(name)
    if match:
        return match.group(1), int(match.group(2))
    parts = name.split(".")[:-1]
    return ".".join(parts[:2]) if parts else name, None


def _format_index_range(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _summarise(entries: list[tuple[str, int | None, int, int]]) -> list[str]:
    """Merge consecutive entries (prefix, index, tensors, numel) of one prefix into index ranges."""
    merged: list[list] = []  # [prefix, first_index, last_index, tensors, numel]
    for prefix, index, tensors, numel in entries:
        last = merged[-1] if merged else None
        if last and last[0] == prefix and (
            (index is None and last[1] is None) or (index is not None and last[2] is not None and index == last[2] + 1)
        ):
            if index is not None:
                last[2] = index
            last[3] += tensors
            last[4] += numel
        else:
            merged.append([prefix, index, index, tensors, numel])
    lines = []
    for prefix, first, last, tensors, numel in merged:
        label = prefix if first is None else f"{prefix}.{_format_index_range(first, last)}"
        lines.append(f"  {label:<44} {tensors:>4} tensors {numel:>14,} params")
    return lines


def freeze_report(model: nn.Module) -> str:
    """One screen on what is trainable and what is frozen, names grouped by block and module.

    Args:
        model: Any model.

    Returns:
        A multi-line string: totals, then the frozen and the trainable groups in model order,
        consecutive blocks merged into index ranges (``bert.encoder.layer.0-1``).
    """
    groups: dict[tuple[bool, str, int | None], list[int]] = {}
    order: list[tuple[bool, str, int | None]] = []
    for name, parameter in model.named_parameters():
        key = (parameter.requires_grad, *_group_key(name))
        if key not in groups:
            groups[key] = [0, 0]
            order.append(key)
        groups[key][0] += 1
        groups[key][1] += parameter.numel()

    total = sum(stats[1] for stats in groups.values())
    trainable = sum(stats[1] for key, stats in groups.items() if key[0])
    trainable_tensors = sum(stats[0] for key, stats in groups.items() if key[0])
    total_tensors = sum(stats[0] for stats in groups.values())
    share = 100.0 * trainable / total if total else 0.0
    lines = [
        f"{type(model).__name__}: {trainable:,} of {total:,} parameters trainable ({share:.1f}%), "
        f"{trainable_tensors} of {total_tensors} tensors; {total - trainable:,} frozen",
    ]
    for requires_grad, title in ((False, "frozen"), (True, "trainable")):
        entries = [(key[1], key[2], *groups[key]) for key in order if key[0] is requires_grad]
        lines.append(f"{title}:" if entries else f"{title}: none")
        lines.extend(_summarise(entries))
    return "\n".join(lines)


def layer_depths(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """The model's parameters by depth from the output: the head, each block from the top, the embeddings.

    What gradual unfreezing (`looptrain.unfreeze`) and layer-wise learning-rate decay
    (`build_optimizer(..., layer_lr_decay=...)`) both walk. In registration order (forward order
    for the supported architectures): parameters after the last block are the head (depth 0: pooler,
    classifier, final norm), block ``i`` of ``L`` has depth ``L - i``, and parameters before the
    first block are the embeddings (depth ``L + 1``). Every parameter, trainable or not, is in
    exactly one entry; tied parameters once, where they first appear.

    Args:
        model: A transformer whose block list `find_transformer_blocks` finds.

    Returns:
        ``[(label, [(name, parameter), ...]), ...]`` from depth 0 to depth ``L + 1`` (an entry may be
        empty, e.g. a model without embeddings before its blocks).

    Raises:
        ValueError: If the model has no recognisable block list.
    """
    blocks = find_transformer_blocks(model)
    block_of = {id(parameter): index for index, block in enumerate(blocks) for parameter in block.parameters()}
    count = len(blocks)
    head: list[tuple[str, nn.Parameter]] = []
    embeddings: list[tuple[str, nn.Parameter]] = []
    by_block: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(count)]
    after_blocks = False
    for name, parameter in model.named_parameters():
        index = block_of.get(id(parameter))
        if index is not None:
            by_block[index].append((name, parameter))
            after_blocks = after_blocks or index == count - 1
        else:
            (head if after_blocks else embeddings).append((name, parameter))
    block_prefix = next((name for name, module in model.named_modules() if module is blocks), "blocks")
    depths = [("head", head)]
    depths += [(f"{block_prefix}.{index}", by_block[index]) for index in reversed(range(count))]
    depths.append(("embeddings", embeddings))
    return depths

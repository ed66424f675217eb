"""LoRA and QLoRA through peft: low-rank adapters on a frozen base, trained by the Loop unchanged.

`apply_lora` wraps a model in peft's `PeftModel`: every ``nn.Linear`` of the transformer blocks (or the
modules you name) gets a rank-``r`` adapter, the base is frozen, and a sequence classifier's head is
trained fully (peft's ``modules_to_save``). With ``qlora=True`` the frozen block Linears are first stored
in 4-bit NF4 by bitsandbytes (`quantize_blocks_4bit`), computing in bf16 or fp32. The returned model is
an ``nn.Module`` like any other: pass it to `looptrain.Loop`.

`save_lora` writes the adapter in peft's format (``PeftModel.from_pretrained(base, directory)`` loads
it), and `merge_lora` the merged full weights (``from_pretrained`` loads them alone).

On the command line these are ``--lora R``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``,
``--qlora`` and ``--merge-lora``; docs/lora.md has the details and the memory they save (or do not).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from looptrain.errors import ConfigError
from looptrain.fake import fake_mode_of, is_fake
from looptrain.freeze import find_transformer_blocks

QUANT_TYPE = "nf4"
QUANT_BLOCK = 64  # bitsandbytes' 4-bit blocksize: one absmax per 64 weights


def block_linear_names(model: nn.Module) -> list[str]:
    """The distinct attribute names of the ``nn.Linear`` modules inside the transformer blocks.

    ``["query", "key", "value", "dense"]`` for BERT, ``["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
    "up_proj", "down_proj"]`` for Qwen2/Llama, ``["c_attn", "c_proj", "c_fc"]`` for GPT-2 (its projections are
    transformers' ``Conv1D``, a Linear whose weight is stored transposed).

    Raises:
        ValueError: the model has no list of transformer blocks (`find_transformer_blocks`).
    """
    blocks = find_transformer_blocks(model)
    names = []
    for name, module in blocks.named_modules():
        if _is_linear(module):
            attribute = name.rsplit(".", 1)[-1]
            if attribute not in names:
                names.append(attribute)
    return names


def default_targets(model: nn.Module) -> list[str]:
    """The modules the adapters wrap by default: every Linear (or GPT-2 ``Conv1D``) of the transformer blocks.

    Qualified names (``bert.encoder.layer.0.attention.self.query``, ...), so a same-named Linear outside the
    blocks (BERT's ``pooler.dense``) stays as it is.
    """
    blocks = find_transformer_blocks(model)
    targets = [name for name, module in model.named_modules()
               if _is_linear(module) and any(module is inner for inner in blocks.modules())]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no Linear layer in its transformer blocks for LoRA to adapt; "
                         "name the modules with targets=[...] (--lora-targets)")
    return targets


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def task_head_names(model: nn.Module) -> list[str]:
    """The task head of a classifier (the trainable modules outside ``model.base_model``), trained fully.

    A causal LM's head is its output embedding (often tied to the input one): it stays frozen, as in LoRA.
    """
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        return []
    output = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    names = []
    for name, child in model.named_children():
        if child is base or child is output or not any(True for _ in child.parameters()):
            continue
        names.append(name)
    return names


def parse_targets(text: str | Iterable[str] | None) -> list[str] | None:
    """``"q_proj, v_proj"`` -> ``["q_proj", "v_proj"]``; empty or None -> None (the default targets)."""
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [item.strip() for item in items if item.strip()]
    return items or None


def apply_lora(model: nn.Module, rank: int, *, alpha: int | None = None, dropout: float = 0.0,
               targets: str | Iterable[str] | None = None, qlora: bool = False,
               compute_dtype: torch.dtype | None = None) -> nn.Module:
    """Wraps `model` in peft LoRA adapters of rank `rank` on a frozen base; returns the `PeftModel`.

    Args:
        model: a transformers model (a sequence classifier or a causal LM) or any module with transformer blocks.
        rank: the adapters' rank r (>= 1).
        alpha: the scaling numerator (updates are scaled by ``alpha / rank``); None: ``2 * rank``.
        dropout: dropout on each adapter's input.
        targets: module names (peft's ``target_modules``: a list or a comma-separated string); None: every
            Linear of the transformer blocks (`default_targets`).
        qlora: store the targeted frozen Linears (and GPT-2 ``Conv1D``) in 4-bit NF4 first (`quantize_blocks_4bit`).
        compute_dtype: with `qlora`, the dtype the 4-bit layers compute in (default: bf16 where this CPU or GPU
            computes bf16 natively, else fp32).

    Raises:
        ConfigError: rank < 1, a rank not below a target's width (`rank_width_problem`), a target that matches no
            module, peft missing, `qlora` with no target in the blocks' Linears (nothing to quantize).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ConfigError("LoRA needs peft: pip install peft (or pip install 'looptrain[lora]')") from error
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"LoRA rank must be an integer >= 1 (got {rank!r})")
    names = parse_targets(targets) or default_targets(model)
    _refuse_head_targets(model, names)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} | {name for name, _ in
                                                                                model.named_modules()}
    missing = [name for name in names if name not in present]
    if missing:
        raise ConfigError(f"LoRA targets {', '.join(missing)} match no module of {type(model).__name__}; "
                          f"its block Linears are {', '.join(block_linear_names(model)) or 'none'}")
    rank_problem = rank_width_problem(model, names, rank)
    if rank_problem:
        raise ConfigError(rank_problem)
    conv1d = _targets_conv1d(model, names)  # before QLoRA replaces them
    if qlora and not quantize_blocks_4bit(model, names, compute_dtype):
        raise ConfigError(f"QLoRA stores the Linear (and Conv1D) layers of the transformer blocks in 4 bits, and the "
                          f"LoRA targets {', '.join(names)} of {type(model).__name__} hold none: nothing would be "
                          f"quantized; target block layers ({', '.join(block_linear_names(model)) or 'none'}) or "
                          "drop --qlora")
    # peft's own switch for the Conv1D layers it wraps now (none of them once QLoRA stored them as 4-bit Linears).
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout, target_modules=names,
                        modules_to_save=task_head_names(model) or None, fan_in_fan_out=_targets_conv1d(model, names),
                        task_type=task_type_of(model))
    wrapped = get_peft_model(model, config)
    # GPT-2's Conv1D stores its weight [in, out], so peft transposes the adapters' update for it (fan_in_fan_out).
    # Its 4-bit Linears store [out, in] and take no transposition; the saved adapter_config.json still describes the
    # Conv1D base it merges into (`merge_lora`, from_pretrained of the original weights).
    config.fan_in_fan_out = conv1d
    config.base_model_name_or_path = resolved_base(wrapped.base_model.model)
    return wrapped


def _targeted(model: nn.Module, targets: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """The modules `targets` name, as `apply_lora` matches them: by their full name or by its last part."""
    names = set(targets)
    return [(name, module) for name, module in model.named_modules()
            if name in names or name.rsplit(".", 1)[-1] in names]


def _targets_conv1d(model: nn.Module, names: list[str]) -> bool:
    """Whether the modules named `names` include a transformers ``Conv1D`` (GPT-2's projections)."""
    return any(_is_conv1d(module) for _, module in _targeted(model, names))


def task_type_of(model: nn.Module) -> str | None:
    """peft's task type of a transformers model, from its class: ``SEQ_CLS`` for a sequence classifier, ``CAUSAL_LM``
    for a causal LM, None for anything else. Saved in adapter_config.json: peft's ``AutoPeftModel*`` classes and
    `looptrain-predict` read from it what the adapter is for."""
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return "SEQ_CLS"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "CAUSAL_LM"
    return None


def resolved_base(model: nn.Module) -> str | None:
    """The base an adapter records (``base_model_name_or_path``): the directory `model` was loaded from as an absolute
    path, so the adapter finds it from any working directory; a hub name (or anything that is not a local directory)
    as it is."""
    name = getattr(model, "name_or_path", None) or None
    return str(Path(name).resolve()) if name and Path(name).is_dir() else name


def rank_width_problem(model: nn.Module, targets: Iterable[str], rank: int) -> str | None:
    """Why `rank` is too large for the narrowest module `targets` name, or None.

    An adapter of rank r on an ``in x out`` layer trains ``r * (in + out)`` weights: at ``r >= min(in, out)`` that is
    at least the layer's own ``in * out``, so "low-rank" adapters would train more than a full fine-tune does.
    """
    widths = [(min(shape), name, shape) for name, module in _targeted(model, targets)
              if (shape := _layer_shape(module))]
    if not widths:
        return None
    width, name, (rows, columns) = min(widths)
    if rank < width:
        return None
    return (f"--lora {rank} is not below the width {width} of {name} ({rows} x {columns}); a rank that large trains "
            f"more than full fine-tuning; pass a rank below {width} or drop --lora for a full fine-tune")


def _layer_shape(module: nn.Module) -> tuple[int, int] | None:
    """(inputs, outputs) of a Linear (4-bit ones included, whose weight is packed), a GPT-2 Conv1D or an Embedding."""
    if isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(module, nn.LayerNorm):
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def _refuse_head_targets(model: nn.Module, names: list[str]) -> None:
    """A ConfigError for a target that names only modules of the task head (`task_head_names`): the head trains
    fully beside the adapters (peft's ``modules_to_save``), so peft would find nothing to adapt there
    (``NoMatchingPeftModuleError``). Targets match as peft matches them: a module's name or its dotted tail."""
    heads = task_head_names(model)
    for target in names:
        matched = [name for name, _ in model.named_modules() if name == target or name.endswith("." + target)]
        if matched and all(name.split(".", 1)[0] in heads for name in matched):
            raise ConfigError(f"LoRA target {target} is the task head ({', '.join(heads)}), which is trained fully "
                              "beside the adapters, not adapted; target modules of the transformer blocks instead: "
                              f"{', '.join(block_linear_names(model)) or 'none'} (--lora-targets)")


def save_lora(model: nn.Module, directory: str | Path) -> Path:
    """Writes `apply_lora`'s adapters and trained head in peft's format (adapter_model.safetensors +
    adapter_config.json): ``PeftModel.from_pretrained(base, directory)`` loads them onto the base, 4-bit or not."""
    if not is_lora_model(model):
        raise ConfigError(f"save_lora saves a peft model's adapters (apply_lora's result), not a "
                          f"{type(model).__name__}; save a full model with its own save_pretrained")
    directory = Path(directory)
    model.save_pretrained(str(directory))
    return directory


def load_lora(model: nn.Module, adapter_dir: str | Path, *, trainable: bool = True) -> nn.Module:
    """`model` (the base, as loaded) with the adapters `save_lora` wrote to `adapter_dir` (a --lora run's final/):
    ``PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)``, to continue training them with their own
    rank, alpha, dropout and targets; the base stays frozen. The adapter then records `model`'s directory as its base,
    and a task type (`task_type_of`) when it had none.

    Raises:
        ConfigError: peft missing, or `adapter_dir` holds no adapter_config.json.
    """
    peft = _saved_adapter_peft(adapter_dir, "loading")
    config = peft.PeftConfig.from_pretrained(str(adapter_dir))
    config.task_type = config.task_type or task_type_of(model)
    config.base_model_name_or_path = resolved_base(model) or config.base_model_name_or_path
    return peft.PeftModel.from_pretrained(model, str(adapter_dir), config=config, is_trainable=trainable)


def _saved_adapter_peft(adapter_dir: str | Path, doing: str):
    """peft, once `adapter_dir` is known to hold a saved adapter (`doing`: "loading", "merging", for the error)."""
    try:
        import peft
    except ImportError as error:
        raise ConfigError(f"{doing} LoRA adapters needs peft: pip install peft") from error
    if not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise ConfigError(f"{adapter_dir} holds no adapter_config.json: pass the directory save_lora (or a --lora "
                          "run's final/) wrote")
    return peft


def merge_lora(base: nn.Module, adapter_dir: str | Path, directory: str | Path | None = None) -> nn.Module:
    """The full model: `base` with the adapters of `adapter_dir` (`save_lora`, a run's final/) merged into its weights.

    Pass the base in full precision (``from_pretrained`` of the original weights), also after QLoRA: merging into
    4-bit weights would bake their rounding in. With `directory`, the merged model is saved there too
    (``save_pretrained``: config and safetensors, loadable without peft).

    Raises:
        ConfigError: peft missing, or `adapter_dir` holds no adapter_config.json.
    """
    peft = _saved_adapter_peft(adapter_dir, "merging")
    merged = peft.PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    if directory is not None:
        merged.save_pretrained(str(directory))
    return merged


def default_compute_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 where the device computes it fast (CUDA with bf16, a CPU whose bf16 matmuls measured faster), else fp32."""
    from looptrain.precision import cpu_bf16_is_fast, resolve_device

    device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_bf16_is_fast() else torch.float32


def quantize_blocks_4bit(model: nn.Module, names: Iterable[str] | None = None,
                         compute_dtype: torch.dtype | None = None) -> int:
    """Replaces the frozen ``nn.Linear`` (and GPT-2 ``Conv1D``) layers of the blocks named `names` by bitsandbytes'
    4-bit NF4 Linears.

    One layer at a time, so the transient is one layer's weight. The weights are quantized where they are (CPU
    or CUDA) with bitsandbytes' default blocksize (64) and double quantization of the scales; biases stay in
    `compute_dtype`. Returns the number of layers replaced.

    Raises:
        ConfigError: this bitsandbytes cannot quantize to 4 bits on the model's device (the message says how to
            go on: LoRA without --qlora).
    """
    try:
        import bitsandbytes as bnb
    except ImportError as error:
        raise ConfigError("QLoRA needs bitsandbytes: pip install bitsandbytes") from error
    names = set(names or default_targets(model))
    compute_dtype = compute_dtype or default_compute_dtype(_device_of(model))
    blocks = find_transformer_blocks(model)
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        if not any(parent is inner for inner in blocks.modules()):
            continue
        for attribute, child in list(parent.named_children()):
            qualified = f"{prefix}.{attribute}" if prefix else attribute
            if (type(child) is nn.Linear or _is_conv1d(child)) and (attribute in names or qualified in names):
                setattr(parent, attribute, _linear_4bit(bnb, child, compute_dtype))
                replaced += 1
    return replaced


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): a Linear whose weight is stored transposed, ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and module.weight.dim() == 2


def _linear_4bit(bnb: Any, child: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """bitsandbytes' 4-bit NF4 Linear computing what `child` (an ``nn.Linear`` or a ``Conv1D``) computes.

    A ``Conv1D`` computes ``x @ W + b`` with ``W`` of ``[in, out]``: its 4-bit Linear stores ``W`` transposed, the
    ``[out, in]`` layout a Linear's weight has.
    """
    weight = child.weight.detach()
    if _is_conv1d(child):
        weight = weight.t()
    out_features, in_features = weight.shape
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=child.bias is not None, compute_dtype=compute_dtype,
                              compress_statistics=True, quant_type=QUANT_TYPE, device="meta")
    if is_fake(weight):  # the estimator's model: bitsandbytes' storage on fake tensors, nothing quantized
        layer.weight = fake_params4bit(weight.shape, compute_dtype, fake_mode_of(weight), weight.device)
    else:
        weight = weight.to(compute_dtype).contiguous()
        try:
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True,
                                             quant_type=QUANT_TYPE)._quantize(weight.device)
        except (RuntimeError, NotImplementedError) as error:
            raise ConfigError(f"this bitsandbytes cannot store weights in 4 bits on {weight.device} ({error}); "
                              "train LoRA without --qlora (the frozen base in bf16: --weights bf16)") from error
    # bitsandbytes repacks the weights for AVX-512 BF16 CPUs on the first no-grad eval forward (in place,
    # scales de-nested: more memory, and a layout only some CPUs get): every CPU keeps the training layout.
    layer.support_avx512bf16_for_cpu = False
    if child.bias is not None:
        layer.bias = nn.Parameter(child.bias.detach().to(compute_dtype), requires_grad=False)
    return layer


_QUANT_BLOCK_2 = 256  # double quantization: the 8-bit absmaxes are scaled by one fp32 absmax per 256 of them


def _quantized_4bit_bytes(shape: Iterable[int]) -> int:
    """Bytes bitsandbytes stores for one weight of `shape` in NF4 with double quantization (`quantize_blocks_4bit`).

    The packed weight (two 4-bit values per uint8), one uint8 absmax per 64-weight block, the second level's fp32
    absmax per 256 blocks and its fp32 offset, and the two code tables each layer holds (16 and 256 fp32 values).
    """
    numel = 1
    for size in shape:
        numel *= int(size)
    blocks = -(-numel // QUANT_BLOCK)
    return (numel + 1) // 2 + blocks + 4 * -(-blocks // _QUANT_BLOCK_2) + 4 + 4 * (16 + 256)


def fake_params4bit(shape: Iterable[int], compute_dtype: torch.dtype, fake_mode: Any,
                    device: torch.device | str = "cpu") -> nn.Parameter:
    """The estimator's stand-in for ``Params4bit(weight)._quantize()`` of a weight of `shape`: fake tensors of
    bitsandbytes' sizes, in `fake_mode`.

    bitsandbytes cannot wrap a fake tensor (``Params4bit`` is a tensor subclass), so the weight is a plain frozen
    ``nn.Parameter`` holding the packed uint8 storage, with the attributes and the `QuantState` (8-bit absmax, fp32
    offset, the second level's fp32 absmax, both code tables) that ``Linear4bit.forward`` and
    ``bnb.matmul_4bit`` read: the forward, the saved tensors and the backward's dequantization then run through
    bitsandbytes' own code and its fake kernels, as they do for real. A model quantized already (a real
    ``Params4bit``) is priced through the same stand-in, built from its quantization state's shape and dtype.
    """
    from bitsandbytes.functional import QuantState

    shape = torch.Size(shape)
    numel = shape.numel()
    blocks = -(-numel // QUANT_BLOCK)
    with fake_mode:
        packed = torch.empty(((numel + 1) // 2, 1), dtype=torch.uint8, device=device)
        absmax = torch.empty(blocks, dtype=torch.uint8, device=device)
        offset = torch.empty((), dtype=torch.float32, device=device)
        absmax_2 = torch.empty(-(-blocks // _QUANT_BLOCK_2), dtype=torch.float32, device=device)
        code = torch.empty(16, dtype=torch.float32, device=device)
        code_2 = torch.empty(256, dtype=torch.float32, device=device)
    state_2 = QuantState(absmax=absmax_2, code=code_2, blocksize=_QUANT_BLOCK_2, dtype=torch.float32)
    state = QuantState(absmax=absmax, shape=shape, dtype=compute_dtype, blocksize=QUANT_BLOCK, code=code,
                       quant_type=QUANT_TYPE, offset=offset, state2=state_2)
    parameter = nn.Parameter(packed, requires_grad=False)
    parameter.quant_state = state
    parameter.blocksize, parameter.compress_statistics, parameter.quant_type = QUANT_BLOCK, True, QUANT_TYPE
    parameter.quant_storage, parameter.bnb_quantized = torch.uint8, True
    return parameter


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of the 4-bit weights' quantization states (absmax, offset, code tables): part of the stored
    base, though neither parameters nor buffers (`quantize_blocks_4bit`'s; none for a model without them).

    What a meter or the estimator adds to a QLoRA model's parameters to count the base it stores."""
    tensors = []
    for parameter in model.parameters():
        state = getattr(parameter, "quant_state", None)
        while state is not None:
            tensors += [value for value in (state.absmax, state.code, state.offset) if isinstance(value, torch.Tensor)]
            state = state.state2
    return tensors


def _device_of(model: nn.Module) -> torch.device:
    return next((parameter.device for parameter in model.parameters()), torch.device("cpu"))


def is_4bit_layer(module: nn.Module) -> bool:
    """Whether `module` is one of bitsandbytes' 4-bit Linears (`quantize_blocks_4bit`'s), without importing it."""
    return type(module).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4") and type(module).__module__.startswith(
        "bitsandbytes")


def is_lora_model(model: Any) -> bool:
    """Whether `model` is a peft model (`apply_lora`'s result); peft is not imported when it is not loaded (a
    `PeftModel` cannot exist then)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


__all__ = ["apply_lora", "block_linear_names", "default_compute_dtype", "default_targets", "fake_params4bit",
           "is_4bit_layer", "is_lora_model", "load_lora", "merge_lora", "parse_targets", "quant_state_tensors",
           "quantize_blocks_4bit", "rank_width_problem", "resolved_base", "save_lora", "task_head_names",
           "task_type_of"]

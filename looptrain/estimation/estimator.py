"""The estimator: the peak memory of a training step for any model shape and strategy mix, before training.

`estimate` builds the model on fake tensors (`FakeTensorMode`: shapes and dtypes, no storage, no
compute), applies the strategy with looptrain's own freeze, checkpointing and optimizer modules,
builds a real `Loop` over it, and drives the Loop's own update (`Loop.run_update`, the method
`fit()` calls) for two optimizer steps under the `StorageTracker` (the first on one micro-batch: it
creates the optimizer state). What it measures is what the
Loop does: autocast casts, the GradScaler's unscale, clipping, the optimizer step (bitsandbytes'
CPU kernels included), the fused step. `measure` runs the same strategy for real, through
`Loop.fit`, for the accuracy check.

Fake tensors have shapes but no values, so the two checks of a gradient's finiteness cannot be read:
the estimator brings its own behaviour for them (`FakePrecision`, `FakeOptimizerInBackward`: every
update steps, since its memory is what is measured), and production code never branches on fakes.

An estimate made once is read back from the on-disk cache (`estimate_cache`) when the same question comes
again; ``cache=False`` or ``LOOPTRAIN_CACHE_DIR=off`` computes it every time.

It sits above the Loop, as the planner does; leaf modules never import it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from looptrain import strategy as strategies
from looptrain.batches import model_shifts_labels, token_pieces
from looptrain.checkpoint import capture_rng_state, restore_rng_state
from looptrain.config import LoopConfig
from looptrain.estimation import cache as estimate_cache
from looptrain.loop import Loop
from looptrain.optim import FOREACH_OPTIMIZERS, OptimizerInBackward
from looptrain.precision import Precision
from looptrain.strategy import Strategy

PRESETS = {
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                  "vocab_size": 30522},
    "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                   "vocab_size": 30522},
    "macbert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                      "intermediate_size": 4096, "vocab_size": 21128},
    # Decoder LMs (Qwen2Config numbers of the published checkpoints; tied input and output embeddings).
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "tie_word_embeddings": True},
}
ESTIMATE_METER = "estimate_fake_tensor_tracker"


def preset_config(name: str, num_labels: int = 2):
    """The config of a named shape, no download: a ``BertConfig`` (bert-base, bert-large, macbert-large) or a
    ``Qwen2Config`` (qwen2.5-0.5b, qwen2.5-1.5b: decoder LMs, estimated as causal LMs)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or pass --config / --model.")
    values = dict(PRESETS[name])
    return AutoConfig.for_model(values.pop("model_type", "bert"), num_labels=num_labels, **values)


def is_causal_lm_config(config: Any) -> bool:
    """Whether a transformers config describes a decoder-only causal LM (built with ``AutoModelForCausalLM``).

    True when it is not an encoder-decoder and either its ``architectures`` name a causal LM (``*ForCausalLM``,
    ``*LMHeadModel``), or it names no architecture and its model type has a causal-LM class but no masked-LM
    one (Qwen2, Llama, GPT-2, Mistral; not BERT, whose plain config stays a classifier).
    """
    from transformers.models.auto import modeling_auto

    if getattr(config, "is_encoder_decoder", False):
        return False
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
    model_type = getattr(config, "model_type", None)
    return (model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def load_config(path: str, num_labels: int = 2):
    """A transformers config from a model directory or a config.json file (local only)."""
    from transformers import AutoConfig

    if os.path.isdir(path):
        config = AutoConfig.from_pretrained(path)
    elif os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
        if "model_type" not in values:
            raise ValueError(f"{path} has no 'model_type'; add e.g. \"model_type\": \"bert\".")
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        raise ValueError(f"{path} is neither a model directory nor a config.json file.")
    config.num_labels = num_labels
    return config


def _fake_model(model_or_config: Any, num_labels: int, fake_mode) -> nn.Module:
    """A copy of the model whose parameters and buffers are fake CPU tensors (no real memory)."""
    if isinstance(model_or_config, nn.Module):
        memo: dict[int, Any] = {}
        for parameter in model_or_config.parameters():
            memo[id(parameter)] = nn.Parameter(_cpu_fake(parameter, fake_mode), requires_grad=parameter.requires_grad)
        for buffer in model_or_config.buffers():
            memo[id(buffer)] = _cpu_fake(buffer, fake_mode)
        return copy.deepcopy(model_or_config, memo)
    config = model_or_config
    if isinstance(config, str):
        config = _named_config(config, num_labels)
    else:
        config = copy.deepcopy(config)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config.num_labels = num_labels
    auto_class = AutoModelForCausalLM if is_causal_lm_config(config) else AutoModelForSequenceClassification
    with fake_mode:
        # The attention implementation is resolved as a real from_config resolves it (sdpa where torch has it).
        return auto_class.from_config(config)


def _named_config(name: str, num_labels: int):
    """The config a preset name or a local path names."""
    return preset_config(name, num_labels) if name in PRESETS else load_config(name, num_labels)


def _fake_tensors(model: nn.Module, fake_mode) -> None:
    """Replaces the real parameters and buffers of `model` (peft's adapters on a fake base) by fakes, in place;
    a tensor shared by several modules stays one."""
    replaced: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, as_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in table.items():
                if tensor is None or is_fake(tensor):
                    continue
                if id(tensor) not in replaced:
                    fake = _cpu_fake(tensor, fake_mode)
                    replaced[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) if as_parameter \
                        else fake
                table[name] = replaced[id(tensor)]


def _cpu_fake(tensor: torch.Tensor, fake_mode) -> torch.Tensor:
    """A fake CPU tensor of `tensor`'s shape, strides and dtype. The estimate always runs on the CPU (a CUDA run's
    kernels are priced there, `estimate(device=)`): a model on a GPU (or on the meta device) is copied as CPU fakes,
    which the estimate's CPU Loop then keeps where they are."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return fake_mode.from_tensor(tensor)
    with fake_mode:
        return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="cpu")


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    if not embeddings:
        raise ValueError("the model has no nn.Embedding and no config.vocab_size: estimate/measure feed token ids.")
    return embeddings[0].num_embeddings


def random_batch(batch_size: int, seq_len: int, vocab_size: int, num_labels: int, generator=None, *,
                 token_labels: bool = False, padded: bool = False) -> dict:
    """A batch of random token ids, every row `seq_len` long.

    Args:
        batch_size, seq_len: the batch's shape.
        vocab_size: token ids are drawn below it.
        num_labels: a sequence classifier's classes (one label per row).
        generator: the random generator (None: the global one).
        token_labels: a causal LM's batch: ``labels`` are the ``[batch_size, seq_len]`` token ids themselves
            (the model shifts them), every token scored; no attention mask (every row is whole).
        padded: with `token_labels`, a padded batch: its attention mask is kept, its rows after the first one
            token short (a real causal LM then builds the [rows, 1, seq, seq] mask and repeats GQA's KV heads).
    """
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    if token_labels and padded:
        attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        attention_mask[1:, -1] = 0
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "labels": input_ids.masked_fill(attention_mask == 0, -100)}
    if token_labels:
        # No attention mask: a real causal LM reads an all-ones mask's values and drops it (sdpa's is_causal path,
        # GQA's KV heads kept as they are); under fake tensors it cannot read them, and would build a
        # [rows, 1, seq, seq] mask and repeat the KV heads that the real run never does. No mask is that run.
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    return {"input_ids": input_ids, "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
            "labels": torch.randint(0, num_labels, (batch_size,), generator=generator)}


class FakePrecision(Precision):
    """`Precision` on fake tensors: a gradient norm has no value to test, so every update steps."""

    def step(self, optimizer: Any, grad_norm: torch.Tensor) -> bool:
        """Steps the optimizer (and, under fp16, updates the scaler); returns True: the step's memory is measured."""
        optimizer.step()
        if self.scaler.is_enabled():
            self.scaler.update()  # closes the unscale_ of this window (no value to read on fake tensors)
        return True


class FakeOptimizerInBackward(OptimizerInBackward):
    """`OptimizerInBackward` on fake tensors: a norm has no value to test, so every gradient counts as finite."""

    def _is_finite(self, value: torch.Tensor) -> bool:
        return True


def _on_fake_tensors(loop: Loop) -> None:
    """Gives `loop` the estimator's fake-tensor behaviour, where the Loop would read a value (finiteness)."""
    loop.precision = FakePrecision(loop.device, loop.precision.name)
    if isinstance(loop.optimizer, OptimizerInBackward):
        loop.optimizer.__class__ = FakeOptimizerInBackward  # its hooks are already registered: same object, same state


@contextlib.contextmanager
def _whole_rows():
    """A causal LM's rows are whole sequences, as in the real run: no packed-sequence mask on fake positions.

    Without a KV cache (training with checkpointing) transformers looks for sequences packed into a row by reading
    ``position_ids``; a fake tensor has no values to read, so it would build a ``[rows, 1, seq, seq]`` mask that
    the real run (the model's own ``arange`` positions) never builds. The ops that look still run and are priced.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = masking_utils.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        result = original(position_ids)
        return None if result is not None and is_fake(position_ids) else result

    with _replaced(masking_utils, find_packed_sequence_indices=find_packed_sequence_indices):
        yield


@contextlib.contextmanager
def _one_fake_mode():
    """A fake tensor deep-copied in the block (peft copies the head a LoRA model trains, ``modules_to_save``) stays
    in its own fake mode.

    torch's ``Tensor.__deepcopy__`` copies a subclass's ``__dict__``, and a FakeTensor's holds its
    ``FakeTensorMode``: the copy would get a mode of its own, whose converter's storage weak references
    (``StorageWeakRef``, a raw pointer each) are copies of the original's, and both would release them. That double
    release corrupted the heap (a segfault in a later estimate) once the estimate's Loop was freed at once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _replaced(FakeTensorMode, create=True, __deepcopy__=lambda mode, memo: mode):
        yield


@contextlib.contextmanager
def _replaced(owner: Any, *, create: bool = False, **attributes: Any):
    """`owner`'s attributes replaced by `attributes` for the block, the originals put back after it
    (`unittest.mock.patch.object`, one per attribute; `create`: an attribute `owner` lacks is added, then removed)."""
    from unittest import mock  # imported here: estimating is the only user, and it imports asyncio

    with contextlib.ExitStack() as stack:
        for name, value in attributes.items():
            stack.enter_context(mock.patch.object(owner, name, value, create=create))
        yield


def _device_type(device: Any) -> str:
    """"cpu" or "cuda" (of "cuda:1", a torch.device, ...): the kernels an estimate prices."""
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"estimate: device={device!r} is not priced; use 'cpu' or 'cuda'")
    return device_type


@contextlib.contextmanager
def _cuda_kernels():
    """Attention and autocast as a CUDA GPU runs them, on the estimate's fake CPU tensors.

    On the CPU a masked or dropped-out attention runs the math path, which keeps the attention probabilities (and
    their dropout) for backward: a [rows, heads, seq, seq] tensor or three per layer. On CUDA (sm80 and later)
    torch picks a fused kernel: flash attention for fp16 / bf16 without a mask (grouped-query heads as they are),
    else the memory-efficient kernel (any dtype, an additive mask). Both keep only their output and its log-sum-exp.
    The fused kernels' own aten ops run here on fake tensors (their meta kernels), so what autograd saves is what
    the GPU's autograd saves. CUDA's autocast runs the ops of `CUDA_AUTOCAST_FP32` in fp32 where the CPU's runs
    them in their input's dtype: under the estimate's (CPU) autocast they are run as CUDA's would run them.
    """
    functional = torch.nn.functional

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        flash = attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
        if flash:
            return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                      scale=scale)[0]
        if key.shape[-3] != query.shape[-3]:  # the memory-efficient kernel takes every head's keys
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:  # as torch converts it: an additive mask of the query's dtype
                attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
            attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, needs_grad,
                                                                      dropout_p, is_causal, scale=scale)[0]

    fp32_ops = {name: _fp32_under_autocast(getattr(functional, name)) for name in CUDA_AUTOCAST_FP32}
    with _replaced(functional, scaled_dot_product_attention=attention, **fp32_ops):
        yield


# The threads that run a training step's matmuls, each with its own cuBLAS handle and workspace: the one that runs the
# forward (and evaluation, and the optimizer), and autograd's device thread, which runs every backward. Measured on an
# H200 (torch 2.11, CUDA 13): 32 MiB allocated at the first forward matmul, 32 MiB more at the first backward, nothing
# more for bf16 autocast (cuBLASLt shares the handle's workspace) or later steps (docs/memory.md).
CUBLAS_HANDLES = 2


def cublas_workspace_bytes() -> int:
    """The workspace torch gives each cuBLAS handle, allocated through the caching allocator at the handle's first
    matmul and kept for the process: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs in KiB, summed) where it
    is set, else torch's default: 32 MiB on compute capability 9.x-12.x (Hopper, Blackwell), 8 MiB + 128 KiB before.
    Without a visible GPU the 32 MiB of current GPUs is assumed (a budget errs on the high side)."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(size) * int(count) for size, count in pairs) * 1024
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 9
    return 4096 * 8 * 1024 if 9 <= major <= 12 else (4096 * 2 + 16 * 8) * 1024


def _with_cublas_workspaces(result: dict[str, Any]) -> dict[str, Any]:
    """A CUDA estimate's result with cuBLAS's workspaces (`CUBLAS_HANDLES` of `cublas_workspace_bytes`) added to its
    peak, its phases' peaks and its activations and temporaries: the caching allocator counts them, and they exist
    from a run's first update on. Added after the cache, which holds the tensors alone (the size depends on this
    machine's GPU and environment)."""
    each = cublas_workspace_bytes()
    workspaces = CUBLAS_HANDLES * each
    breakdown = dict(result["memory_breakdown"])
    breakdown["activations_and_temps"] = breakdown.get("activations_and_temps", 0) + workspaces
    phases = {phase: peak + workspaces for phase, peak in (result["phase_peak_bytes"] or {}).items()}
    return {**result, "peak_memory_bytes": result["peak_memory_bytes"] + workspaces, "memory_breakdown": breakdown,
            "phase_peak_bytes": phases,
            "cublas_workspace_bytes": workspaces,
            "notes": [*result.get("notes", []), f"includes cuBLAS's workspaces: {CUBLAS_HANDLES} x "
                      f"{each / 2**20:g} MiB (the forward's thread and autograd's)"]}


# torch.nn.functional's ops that CUDA's autocast runs in fp32 and the CPU's runs in the input's dtype (the op lists of
# torch's autocast docs; the losses are fp32 on both). Under CUDA's bf16 autocast a bf16 model's LayerNorm reads and
# writes fp32: its input is saved for backward in fp32, and the residual stream after it is fp32.
CUDA_AUTOCAST_FP32 = ("layer_norm", "group_norm", "softmax", "log_softmax")


def _fp32_under_autocast(function: Any) -> Any:
    """`function` as CUDA's autocast runs an op of its fp32 list: floating-point inputs cast to fp32, run in fp32."""
    def run(*args, **kwargs):
        if not torch.is_autocast_enabled("cpu"):  # the estimate's Loop autocasts on its own device, the CPU
            return function(*args, **kwargs)

        def fp32(value):
            return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value

        with torch.autocast("cpu", enabled=False):
            return function(*map(fp32, args), **{name: fp32(value) for name, value in kwargs.items()})

    return run


def _price_4bit_storage(tracker: Any, model: nn.Module) -> None:
    """QLoRA: the 4-bit weights' quantization states count as parameters, and the forward's dequantized weight is
    seen.

    A quantization state (absmax, offset, code tables) is stored with its weight but is no parameter or buffer.
    On the CPU, bitsandbytes' 4-bit forward (``gemm_4bit``) dequantizes the weight to the compute dtype inside one
    op: a tracker on a real run never sees that transient (only RSS does); the estimate runs bitsandbytes' own
    Python kernel of it (the dequantizations, then ``linear``) so that it does.
    """
    from looptrain.lora import _quant_state_tensors
    from looptrain.memory.tracker import CATEGORY_PARAMS

    states = _quant_state_tensors(model)
    if tracker is None or not states:
        return
    tracker.track_all(states, CATEGORY_PARAMS)
    try:
        from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl
    except ImportError:  # another bitsandbytes: its fake kernel gives the output alone
        pass
    else:
        tracker._kernel_of_op[torch.ops.bitsandbytes.gemm_4bit.default] = _gemm_4bit_default_impl
    tracker.reset_peak()


def as_strategy(strategy: Strategy | None, levers: dict) -> Strategy:
    """`strategy` (default: `looptrain.strategy.Strategy()`) with `levers` (its field names) replaced.

    Raises:
        TypeError: a keyword that is no lever of the strategy, naming the valid ones.
        ValueError: an invalid lever value (`ConfigError` names the field).
    """
    base = strategy if strategy is not None else strategies.Strategy()
    names = {spec.name for spec in strategies.levers(type(base))}
    unknown = sorted(set(levers) - names)
    if unknown:
        raise TypeError(f"unknown strategy option(s) {', '.join(unknown)}; the levers are: {', '.join(sorted(names))}")
    return dataclasses.replace(base, **levers) if levers else base


def _strategy_loop(model: nn.Module, strategy: Strategy, max_grad_norm: float | None, device: str = "cpu") -> Loop:
    """The Loop of one strategy over `model` on `device`: its model levers applied, its optimizer built, its
    LoopConfig.

    An invalid mix raises `ConfigError` (a ValueError) naming the fields. A compiled strategy runs eagerly
    (`as_run_eagerly`).
    """
    strategy = as_run_eagerly(strategy)
    config = LoopConfig.from_strategy(strategy, max_grad_norm=max_grad_norm, device=device, eval_every="no",
                                      progress_bar=False, track_memory=True, track_every_update=True,
                                      log_every=10**9)
    strategy.prepare_model(model)
    model = strategy.wrap_model(model, device)
    return Loop(model, strategy.build_optimizer(model, 1e-5), [], config=config)


def as_run_eagerly(strategy: Strategy) -> Strategy:
    """The strategy the estimate drives: `compile` off, its loss as the compiled run computes it.

    torch.compile does not run on fake tensors (nor under the tracker, a dispatch mode), so a compiled strategy
    is estimated as the eager run of the same computation: chunked cross-entropy off (`--compile` turns
    ``chunked_ce="auto"`` off). Compiled graphs may free activations earlier than eager; the estimate does not
    count on it (docs/compile.md).
    """
    if not strategy.compile:
        return strategy
    return dataclasses.replace(strategy, compile=False, chunked_ce="off")


def estimate(
    model_or_config: Any,
    batch_size: int,
    seq_len: int,
    strategy: Strategy | None = None,
    *,
    num_labels: int = 2,
    max_grad_norm: float | None = 1.0,
    padded: bool = False,
    cache: bool = True,
    device: str = "cpu",
    **levers: Any,
) -> dict[str, Any]:
    """Estimate the peak memory of a training step on fake tensors, by driving the Loop's own update.

    The model is built under ``FakeTensorMode`` (from a config, a preset name, a local path, or a
    fake copy of a real model), the strategy is applied with looptrain's own modules, and a `Loop`
    with this strategy's `LoopConfig` runs two optimizer updates (`Loop.run_update`: forward under
    autocast, scaled backward, unscale, clip, step, zero) under the CPU meter's tracker: the first on one
    micro-batch (it creates the optimizer state), the second on a window of ``min(accum_steps, 2)``
    micro-batches (from the second micro-batch on, memory repeats).
    No real memory is allocated and nothing is computed. The RNG states are left as they were.
    This prices a ``batch_size x seq_len`` batch in the worst state a batch can meet (gradients and
    optimizer state alive beside it); `estimate_windows` prices the windows a run really sees.

    Args:
        model_or_config: an ``nn.Module`` (copied, never modified), a transformers config, a preset
            name (``bert-base``, ``bert-large``, ``macbert-large``) or a local model dir / config.json.
        batch_size: micro-batch size (the strategy's own `batch_size` is not read).
        seq_len: tokens per sequence (every sequence padded to it).
        strategy: the `looptrain.Strategy` to price (default: `Strategy()`, fp32 AdamW). Every lever
            that is not ``applied_by="batches"`` counts: precision, weights and gradient dtype,
            accumulation, checkpointing, the fused step, the optimizer and ``foreach``, freezing.
        num_labels: classifier outputs.
        max_grad_norm: the Loop's clipping threshold (None: no clipping).
        padded: a causal LM's batch is padded (rows shorter than `seq_len`): the model then builds its
            attention mask and repeats GQA's KV heads, which a batch of whole rows skips.
        **levers: strategy fields to replace, by name (``precision="bf16"``, ``optimizer="adafactor"``,
            ``gradient_checkpointing=True``, ``freeze_layers=2``, ``weights="bf16"``, ...): the same as
            passing ``dataclasses.replace(strategy, **levers)``.
        device: the device the run trains on, whose kernels are priced: "cpu", or "cuda" (or "cuda:N"), where
            torch's AdamW and SGD step every tensor at once by default (``foreach``: the step's temporaries for
            all parameters together) and attention runs the fused kernels (flash, or memory-efficient with a
            mask), which keep the output and its log-sum-exp for backward instead of the attention
            probabilities, and autocast runs LayerNorm and softmax in fp32 (`_cuda_kernels`); cuBLAS's
            workspaces are added (`cublas_workspace_bytes`, one per matmul thread). The estimate itself always
            runs on the CPU, on fake tensors.
        cache: read the result from the on-disk cache of estimates when an identical estimate was made before,
            and store it there otherwise (`looptrain.estimation.cache`; ``LOOPTRAIN_CACHE_DIR=off`` turns
            it off everywhere). False: always estimate, store nothing. ``"only"``: read the cache and raise
            `LookupError` instead of computing (the planner's search once its time is spent).

    Returns:
        ``peak_memory_bytes``, ``memory_meter`` ("estimate_fake_tensor_tracker"), ``memory_breakdown``
        (params, grads, optimizer_state, activations_and_temps, peak_phase), ``phase_peak_bytes``,
        ``parameters``, ``trainable_parameters``, ``notes``, ``estimate_seconds`` (this call's),
        ``compute_seconds`` (what computing it took, when it was computed) and ``from_cache`` (whether the result
        was read from the cache); on CUDA ``cublas_workspace_bytes``, included in the peak.

    Raises:
        ValueError: an invalid mix (`looptrain.ConfigError` names the fields), an unknown preset.
        TypeError: a keyword that is no lever.
    """
    strategy = as_strategy(strategy, levers)
    window = [(batch_size, seq_len)] * strategy.accum_steps
    if strategy.micro_batch_tokens:  # every row seq_len wide: equal pieces, then one smaller one
        window, strategy = token_windows([window], strategy)[0], dataclasses.replace(strategy, micro_batch_tokens=0)
    window = window[:2]
    # The first update creates the optimizer state: one micro-batch does that, and its peak is below the second
    # update's (the same tensors, without the state), so a second micro-batch there would only cost time; and its
    # loss need not be the model's (`_priming_loss`).
    return _cached_estimate(model_or_config, [window[:1], window], strategy, num_labels=num_labels,
                            max_grad_norm=max_grad_norm, padded=padded, cache=cache, primes=True, device=device)


def estimate_windows(
    model_or_config: Any,
    windows: Sequence[Sequence[tuple[int, int]]],
    strategy: Strategy | None = None,
    *,
    num_labels: int = 2,
    max_grad_norm: float | None = 1.0,
    padded: bool = False,
    cache: bool = True,
    device: str = "cpu",
    **levers: Any,
) -> dict[str, Any]:
    """`estimate` over given accumulation windows: the Loop's update driven once per window, in order.

    Args:
        model_or_config: as in `estimate`.
        windows: each window's micro-batch shapes ``(rows, width)``, driven from a fresh start (no
            gradients, no optimizer state: the first update creates it), e.g. `bounding_windows` of
            the shapes a run's sampler gives.
        strategy, num_labels, max_grad_norm, padded, cache, device, **levers: as in `estimate` (`padded`: the
            micro-batches of more than one row).

    Returns:
        The same dict as `estimate`: the peak over all the windows, its breakdown and phase.
    """
    if not windows or not all(windows):
        raise ValueError("estimate_windows needs at least one window, and every window at least one (rows, width)")
    return _cached_estimate(model_or_config, windows, as_strategy(strategy, levers), num_labels=num_labels,
                            max_grad_norm=max_grad_norm, padded=padded, cache=cache, primes=False, device=device)


def _cached_estimate(model_or_config: Any, windows: Sequence[Sequence[tuple[int, int]]], strategy: Strategy, *,
                     num_labels: int, max_grad_norm: float | None, padded: bool, cache: bool,
                     primes: bool, device: str = "cpu") -> dict[str, Any]:
    """`estimate_windows`, read from the on-disk cache or computed and written there. `primes`: the first window
    only creates the optimizer state (`estimate`'s), so its loss is `_priming_loss`."""
    device_type = _device_type(device)
    if device_type == "cuda" and strategy.foreach is None and strategy.optimizer in FOREACH_OPTIMIZERS:
        strategy = dataclasses.replace(strategy, foreach=True)  # torch's default where every parameter is on CUDA
    if strategy.micro_batch_tokens:  # the micro-batches the Loop would cut, priced as they are
        windows, strategy = token_windows(windows, strategy), dataclasses.replace(strategy, micro_batch_tokens=0)
    strategy = dataclasses.replace(strategy, trim_heap=False)  # the C heap's pages hold no tensor: nothing to price
    # An invalid mix fails before work (the tracker's own refusal of compile aside: the estimate runs eagerly).
    LoopConfig.from_strategy(strategy, max_grad_norm=max_grad_norm, device="cpu", track_memory=False)
    started = time.perf_counter()
    key = estimate_cache.key(
        model_or_config, windows, strategy, num_labels=num_labels, max_grad_norm=max_grad_norm, padded=padded,
        named_config=_named_config(model_or_config, num_labels) if isinstance(model_or_config, str) else None,
        primes=primes, device=device_type,
    ) if cache else None
    result = estimate_cache.read(key) if key is not None else None
    if result is None and cache == "only":
        raise LookupError("no cached estimate of these settings (cache='only' computes nothing)")
    if result is None:
        result = _estimate_windows(model_or_config, windows, strategy, num_labels, max_grad_norm, padded, primes,
                                   device_type)
        result["compute_seconds"] = round(time.perf_counter() - started, 3)  # kept: what a cached read stands for
        if key is not None:
            estimate_cache.write(key, result)
        result["from_cache"] = False
    else:
        result["from_cache"] = True
    if device_type == "cuda":
        result = _with_cublas_workspaces(result)
    result["estimate_seconds"] = round(time.perf_counter() - started, 3)
    return result


def token_windows(windows: Sequence[Sequence[tuple[int, int]]], strategy: Strategy) -> list[list[tuple[int, int]]]:
    """Windows of ``(rows, width)`` batches as the Loop cuts them with `strategy.micro_batch_tokens`, every row of
    a batch as wide as the batch (`looptrain.batches.token_pieces`: rows that fit the tokens together, then the
    rest)."""
    return [[(len(piece), width) for rows, width in window
             for piece in token_pieces([width] * rows, strategy.micro_batch_tokens)] for window in windows]


def _estimate_windows(model_or_config: Any, windows: Sequence[Sequence[tuple[int, int]]], strategy: Strategy,
                      num_labels: int, max_grad_norm: float | None, padded: bool,
                      primes: bool = False, device_type: str = "cpu") -> dict[str, Any]:
    """`estimate_windows`'s work, without the cache: the Loop's update driven on fake tensors under the tracker.

    `primes`: the first window only creates what the later ones start from (the optimizer state), so its loss is
    `_priming_loss` instead of the model's (`estimate`'s first update). `device_type` "cuda": attention and autocast
    priced as CUDA runs them (`_cuda_kernels`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rng_states = capture_rng_state()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with _one_fake_mode():
            model = _fake_model(model_or_config, num_labels, fake_mode)
            # LoRA's adapters are built by peft outside the fake mode (its device moves cannot swap fakes), then
            # made fakes like the base they wrap: a real adapter is copied into a fake at every use (counted
            # twice). QLoRA's 4-bit storage is fake from the start (`quantize_blocks_4bit` on a fake weight).
            model = strategy.wrap_model(model)
            _fake_tensors(model, fake_mode)
            # Built outside the fake mode: optimizers' constant tables (bitsandbytes' quantisation maps) are real.
            loop = _strategy_loop(model, strategy, max_grad_norm)
        model = loop.model  # LoRA: the adapters' PeftModel
        _on_fake_tensors(loop)
        token_labels = model_shifts_labels(model)  # the task, decided once from the model: a causal LM's labels
        with fake_mode:
            # One batch per (position, shape): a shape met again at the same place reuses its batch.
            batches: dict[tuple[int, int, int], dict] = {}
            for window in windows:
                for position, (rows, width) in enumerate(window):
                    if (position, rows, width) not in batches:
                        batches[position, rows, width] = random_batch(rows, width, _vocab_size(model), num_labels,
                                                                      token_labels=token_labels,
                                                                      padded=padded and rows > 1)
            loop.meter.start(loop.model, loop.optimizer)
            _price_4bit_storage(loop.meter.tracker, model)
            kernels = _cuda_kernels() if device_type == "cuda" else contextlib.nullcontext()
            with _whole_rows(), kernels:
                try:
                    for index, window in enumerate(windows):
                        if primes and index == 0:
                            loop.compute_loss = lambda batch: _priming_loss(loop.model)
                        loop.run_update([batches[position, rows, width]
                                         for position, (rows, width) in enumerate(window)])
                        loop.__dict__.pop("compute_loss", None)  # the Loop's own from here on
                finally:
                    loop.meter.stop()
            summary = loop.meter.summary()
    finally:
        restore_rng_state(rng_states)
    parameters = list(model.parameters())
    return {
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "memory_meter": ESTIMATE_METER,
        "memory_breakdown": summary["memory_breakdown"],
        "phase_peak_bytes": summary["phase_peak_bytes"],
        "parameters": sum(_numel(p) for p in parameters),
        "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad),
        "notes": [],
    }


def _priming_loss(model: nn.Module) -> torch.Tensor:
    """A loss whose backward gives every trainable parameter a gradient (zeros) without the model's forward: the
    Loop's update on it creates the optimizer state, and every hook and wrapper the gradients pass through (the
    fused step, fp32 accumulation, the scaler) runs as in a real update, in about a third of its fake-tensor ops.
    A parameter the model's forward leaves without a gradient gets state here where a run would not give it any: the
    estimate errs above, never below."""
    return torch.stack([parameter.sum() for parameter in model.parameters() if parameter.requires_grad]).sum() * 0


def _numel(parameter: torch.Tensor) -> int:
    """A parameter's elements; a 4-bit weight's are those of the weight it stores (two per uint8 of storage)."""
    state = getattr(parameter, "quant_state", None)
    return int(torch.Size(state.shape).numel()) if state is not None and state.shape is not None else parameter.numel()


def bounding_windows(windows: Sequence[Sequence[tuple[int, int]]], *,
                     fresh: bool = True) -> list[list[tuple[int, int]]]:
    """The few windows whose `estimate_windows` peak is the peak of a run over all of `windows`.

    `windows` are a run's accumulation windows in order, each its micro-batches' ``(rows, width)``.
    A micro-batch's memory depends on its shape and on what lives beside it: the optimizer state
    (from the first update on) and the gradients (from a window's second micro-batch on: the update
    before ended with ``zero_grad(set_to_none=True)``). So a fresh run's first window keeps its first
    micro-batch (a length-grouped sampler puts the longest batch there, where neither exists yet) and,
    after it, the widest of its other micro-batches (every shape no other shape has both more rows and
    more width than: the rest hold no more beside the same gradients); every later window is stood for
    by the widest shapes met first in a window and met later in one, driven after it. A window cut into
    many token micro-batches (`micro_batch_tokens`) is priced in a few of them.

    Args:
        windows: the run's windows, in order.
        fresh: the run starts without optimizer state (False for a resumed run: every window then
            counts as a later one, and the later windows are driven twice, the second time with state).
    """
    windows = [list(window) for window in windows if window]
    first, later = (windows[:1], windows[1:]) if fresh else ([], windows)
    first = [[window[0], *_widest(set(window[1:]))] for window in first]
    leading = _widest({window[0] for window in later})
    following = _widest({shape for window in later for shape in window[1:]})
    steady = [[leading[index % len(leading)]] + ([following[index % len(following)]] if following else [])
              for index in range(max(len(leading), len(following)))] if leading else []
    return first + steady if fresh else steady + steady


def _widest(shapes: set) -> list[tuple[int, int]]:
    """The shapes that no other shape covers in both rows and width, widest first."""
    return sorted((shape for shape in shapes
                   if not any(other != shape and other[0] >= shape[0] and other[1] >= shape[1] for other in shapes)),
                  key=lambda shape: (-shape[1], -shape[0]))


def measure(model: nn.Module, batch_size: int, seq_len: int, strategy: Strategy | None = None, *,
            num_labels: int = 2, max_grad_norm: float | None = 1.0, device: str = "cpu",
            **levers: Any) -> dict[str, Any]:
    """Runs the same strategy for real, through `Loop.fit`, and returns its summary.

    Two optimizer updates over random token batches (every row `seq_len` long), with the tensor tracker on:
    the measured side of the estimator's accuracy check. On the CPU the summary's meter is the tracker's; on
    ``device="cuda"`` it is the caching allocator's ``max_memory_allocated`` (the tracker gives the breakdown).
    ``model`` is modified (frozen, checkpointed, trained, moved to `device`); pass a fresh one. The other
    arguments are those of `estimate`.
    """
    strategy = as_strategy(strategy, levers)
    generator = torch.Generator().manual_seed(0)
    token_labels = model_shifts_labels(model)
    batches = [random_batch(batch_size, seq_len, _vocab_size(model), num_labels, generator, token_labels=token_labels)
               for _ in range(2 * strategy.accum_steps)]
    loop = _strategy_loop(model, strategy, max_grad_norm, device)
    loop.train_loader = batches
    return loop.fit()


# The strategy mixes whose estimate tests/test_memory.py checks against a real Loop.fit (and
# scripts/estimate_accuracy.py tabulates): every lever, fp16 with its scaler, clipping and accumulation.
ACCURACY_MIXES = {
    "fp32 adamw": {},
    "bf16": {"precision": "bf16"},
    "checkpointing": {"gradient_checkpointing": True},
    "frozen encoder": {"freeze_encoder": True},
    "adafactor": {"optimizer": "adafactor"},
    "fused step": {"optimizer_in_backward": True},
    "foreach=False": {"foreach": False},
    "adamw8bit": {"optimizer": "adamw8bit"},
    "accumulation 4 + checkpointing": {"accum_steps": 4, "gradient_checkpointing": True},
    "adamw8bit fused step": {"optimizer": "adamw8bit", "optimizer_in_backward": True},
    "fp16 GradScaler + clipping + accumulation 3": {"precision": "fp16", "max_grad_norm": 0.5, "accum_steps": 3},
    "bf16 + checkpointing + frozen first layer + adafactor": {
        "precision": "bf16", "gradient_checkpointing": True, "freeze_layers": 1, "optimizer": "adafactor"},
    "no clipping + frozen embeddings + sgd": {"max_grad_norm": None, "freeze_embeddings": True, "optimizer": "sgd"},
    "bf16 weights": {"weights": "bf16"},
    "bf16 weights + fp32 grads + accumulation 3": {"weights": "bf16", "grad_dtype": "fp32", "accum_steps": 3},
    "bf16 weights + adamw8bit fused step": {"weights": "bf16", "optimizer": "adamw8bit", "optimizer_in_backward": True},
    "bf16 weights + adafactor fused step + checkpointing": {
        "weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True, "gradient_checkpointing": True},
}


def ladder(batch_size: int, seq_len: int) -> list[tuple[str, dict[str, Any]]]:
    """The strategy mixes of the ladder table: (label, ``estimate`` options) at one effective batch."""
    accumulated = {"batch_size": 1, "accum_steps": batch_size}
    checkpointed = {**accumulated, "gradient_checkpointing": True}
    return [
        (f"baseline: bs {batch_size}, fp32, AdamW", {}),
        (f"+ accumulation (bs 1 x {batch_size})", accumulated),
        ("+ gradient checkpointing", checkpointed),
        ("+ Adafactor", {**checkpointed, "optimizer": "adafactor"}),
        ("+ freeze encoder (head only)", {**checkpointed, "optimizer": "adafactor", "freeze_encoder": True}),
        (f"+ seq {seq_len // 2}",
         {**checkpointed, "optimizer": "adafactor", "freeze_encoder": True, "seq_len": seq_len // 2}),
        (f"bs {batch_size}, bf16 autocast", {"precision": "bf16"}),
        ("bs 1 x acc + ckpt, AdamW foreach=False", {**checkpointed, "foreach": False}),
        ("bs 1 x acc + ckpt, AdamW8bit", {**checkpointed, "optimizer": "adamw8bit"}),
        (f"bs {batch_size} + ckpt + bf16, AdamW8bit fused into backward",
         {"gradient_checkpointing": True, "precision": "bf16", "optimizer": "adamw8bit",
          "optimizer_in_backward": True}),
        (f"bs {batch_size} + ckpt + bf16, Adafactor fused into backward",
         {"gradient_checkpointing": True, "precision": "bf16", "optimizer": "adafactor",
          "optimizer_in_backward": True}),
        (f"bs {batch_size} + ckpt, bf16 weights, AdamW8bit fused",
         {"gradient_checkpointing": True, "weights": "bf16", "optimizer": "adamw8bit", "optimizer_in_backward": True}),
        (f"bs {batch_size} + ckpt, bf16 weights, Adafactor fused",
         {"gradient_checkpointing": True, "weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True}),
        ("bs 1 x acc + ckpt, bf16 weights, Adafactor", {**checkpointed, "weights": "bf16", "optimizer": "adafactor"}),
    ]

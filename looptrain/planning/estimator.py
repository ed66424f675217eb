"""The estimator: the peak memory of a training step for any model shape and strategy mix, before training.

`estimate` builds the model on fake tensors (`FakeTensorMode`: shapes and dtypes, no storage, no
compute), applies the strategy with looptrain's own freeze, checkpointing and optimizer modules,
builds a real `Loop` over it, and drives the Loop's own update (`Loop.run_update`, the method
`fit()` calls) for two optimizer steps under the `StorageTracker`. What it measures is what the
Loop does: autocast casts, the GradScaler's unscale, clipping, the optimizer step (bitsandbytes'
CPU kernels included), the fused step. `measure` runs the same strategy for real, through
`Loop.fit`, for the accuracy check.

Fake tensors have shapes but no values, so the two checks of a gradient's finiteness cannot be read:
the estimator brings its own behaviour for them (`FakePrecision`, `FakeOptimizerInBackward`: every
update steps, since its memory is what is measured), and production code never branches on fakes.

It sits above the Loop, as the planner does; leaf modules never import it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from looptrain import state
from looptrain import strategy as strategies
from looptrain.config import LoopConfig
from looptrain.loop import Loop
from looptrain.optim import OptimizerInBackward
from looptrain.precision import Precision
from looptrain.strategy import Strategy

PRESETS = {
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                  "vocab_size": 30522},
    "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                   "vocab_size": 30522},
    "macbert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                      "intermediate_size": 4096, "vocab_size": 21128},
}
ESTIMATE_METER = "estimate_fake_tensor_tracker"


def preset_config(name: str, num_labels: int = 2):
    """A ``BertConfig`` for a named shape (bert-base, bert-large, macbert-large); no download."""
    from transformers import BertConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or pass --config / --model.")
    return BertConfig(num_labels=num_labels, **PRESETS[name])


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
    """A copy of the model whose parameters and buffers are fake tensors (no real memory)."""
    if isinstance(model_or_config, nn.Module):
        memo: dict[int, Any] = {}
        for parameter in model_or_config.parameters():
            memo[id(parameter)] = nn.Parameter(fake_mode.from_tensor(parameter.detach()),
                                               requires_grad=parameter.requires_grad)
        for buffer in model_or_config.buffers():
            memo[id(buffer)] = fake_mode.from_tensor(buffer)
        return copy.deepcopy(model_or_config, memo)
    config = model_or_config
    if isinstance(config, str):
        config = preset_config(config, num_labels) if config in PRESETS else load_config(config, num_labels)
    else:
        config = copy.deepcopy(config)
    from transformers import AutoModelForSequenceClassification

    config.num_labels = num_labels
    with fake_mode:
        return AutoModelForSequenceClassification.from_config(config)


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    if not embeddings:
        raise ValueError("the model has no nn.Embedding and no config.vocab_size: estimate/measure feed token ids.")
    return embeddings[0].num_embeddings


def random_batch(batch_size: int, seq_len: int, vocab_size: int, num_labels: int, generator=None) -> dict:
    """A sequence-classification batch of random token ids, every row `seq_len` long."""
    return {
        "input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "labels": torch.randint(0, num_labels, (batch_size,), generator=generator),
    }


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


def _strategy_loop(model: nn.Module, strategy: Strategy, max_grad_norm: float | None) -> Loop:
    """The Loop of one strategy over `model`: its model levers applied, its optimizer built, its LoopConfig.

    An invalid mix raises `ConfigError` (a ValueError) naming the fields.
    """
    config = LoopConfig.from_strategy(strategy, max_grad_norm=max_grad_norm, device="cpu", eval_every="no",
                                      progress_bar=False, track_memory=True, log_every=10**9)
    strategy.prepare_model(model)
    return Loop(model, strategy.build_optimizer(model, 1e-5), [], config=config)


def estimate(
    model_or_config: Any,
    batch_size: int,
    seq_len: int,
    strategy: Strategy | None = None,
    *,
    num_labels: int = 2,
    max_grad_norm: float | None = 1.0,
    **levers: Any,
) -> dict[str, Any]:
    """Estimate the peak memory of a training step on fake tensors, by driving the Loop's own update.

    The model is built under ``FakeTensorMode`` (from a config, a preset name, a local path, or a
    fake copy of a real model), the strategy is applied with looptrain's own modules, and a `Loop`
    with this strategy's `LoopConfig` runs two optimizer updates (`Loop.run_update`: forward under
    autocast, scaled backward, unscale, clip, step, zero) on one window of ``min(accum_steps, 2)``
    micro-batches (from the second micro-batch on, memory repeats) under the CPU meter's tracker.
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
        **levers: strategy fields to replace, by name (``precision="bf16"``, ``optimizer="adafactor"``,
            ``gradient_checkpointing=True``, ``freeze_layers=2``, ``weights="bf16"``, ...): the same as
            passing ``dataclasses.replace(strategy, **levers)``.

    Returns:
        ``peak_memory_bytes``, ``memory_meter`` ("estimate_fake_tensor_tracker"), ``memory_breakdown``
        (params, grads, optimizer_state, activations_and_temps, peak_phase), ``phase_peak_bytes``,
        ``parameters``, ``trainable_parameters``, ``notes`` and ``estimate_seconds``.

    Raises:
        ValueError: an invalid mix (`looptrain.ConfigError` names the fields), an unknown preset.
        TypeError: a keyword that is no lever.
    """
    strategy = as_strategy(strategy, levers)
    window = [(batch_size, seq_len)] * min(strategy.accum_steps, 2)
    return estimate_windows(model_or_config, [window, window], strategy, num_labels=num_labels,
                            max_grad_norm=max_grad_norm)


def estimate_windows(
    model_or_config: Any,
    windows: Sequence[Sequence[tuple[int, int]]],
    strategy: Strategy | None = None,
    *,
    num_labels: int = 2,
    max_grad_norm: float | None = 1.0,
    **levers: Any,
) -> dict[str, Any]:
    """`estimate` over given accumulation windows: the Loop's update driven once per window, in order.

    Args:
        model_or_config: as in `estimate`.
        windows: each window's micro-batch shapes ``(rows, width)``, driven from a fresh start (no
            gradients, no optimizer state: the first update creates it), e.g. `bounding_windows` of
            the shapes a run's sampler gives.
        strategy, num_labels, max_grad_norm, **levers: as in `estimate`.

    Returns:
        The same dict as `estimate`: the peak over all the windows, its breakdown and phase.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not windows or not all(windows):
        raise ValueError("estimate_windows needs at least one window, and every window at least one (rows, width)")
    strategy = as_strategy(strategy, levers)
    LoopConfig.from_strategy(strategy, max_grad_norm=max_grad_norm, device="cpu")  # an invalid mix fails before work
    started = time.perf_counter()
    rng_states = state.capture_rng_state()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        model = _fake_model(model_or_config, num_labels, fake_mode)
        # Built outside the fake mode: optimizers' constant tables (bitsandbytes' quantisation maps) are real.
        loop = _strategy_loop(model, strategy, max_grad_norm)
        _on_fake_tensors(loop)
        with fake_mode:
            # One batch per (position, shape): a shape met again at the same place reuses its batch.
            batches: dict[tuple[int, int, int], dict] = {}
            for window in windows:
                for position, (rows, width) in enumerate(window):
                    if (position, rows, width) not in batches:
                        batches[position, rows, width] = random_batch(rows, width, _vocab_size(model), num_labels)
            loop.meter.start(loop.model, loop.optimizer)
            try:
                for window in windows:
                    loop.run_update([batches[position, rows, width] for position, (rows, width) in enumerate(window)])
            finally:
                loop.meter.stop()
            summary = loop.meter.summary()
    finally:
        state.restore_rng_state(rng_states)
    parameters = list(model.parameters())
    return {
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "memory_meter": ESTIMATE_METER,
        "memory_breakdown": summary["memory_breakdown"],
        "phase_peak_bytes": summary["phase_peak_bytes"],
        "parameters": sum(p.numel() for p in parameters),
        "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad),
        "notes": [],
        "estimate_seconds": round(time.perf_counter() - started, 3),
    }


def bounding_windows(windows: Sequence[Sequence[tuple[int, int]]], *,
                     fresh: bool = True) -> list[list[tuple[int, int]]]:
    """The few windows whose `estimate_windows` peak is the peak of a run over all of `windows`.

    `windows` are a run's accumulation windows in order, each its micro-batches' ``(rows, width)``.
    A micro-batch's memory depends on its shape and on what lives beside it: the optimizer state
    (from the first update on) and the gradients (from a window's second micro-batch on: the update
    before ended with ``zero_grad(set_to_none=True)``). So a fresh run's first window is kept as it
    is (a length-grouped sampler puts the longest batch there, where neither exists yet), and every
    later window is stood for by the widest shapes met first in a window and met later in one
    (every shape no other shape has both more rows and more width than), driven after it.

    Args:
        windows: the run's windows, in order.
        fresh: the run starts without optimizer state (False for a resumed run: every window then
            counts as a later one, and the later windows are driven twice, the second time with state).
    """
    windows = [list(window) for window in windows if window]
    first, later = (windows[:1], windows[1:]) if fresh else ([], windows)
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
            num_labels: int = 2, max_grad_norm: float | None = 1.0, **levers: Any) -> dict[str, Any]:
    """Runs the same strategy for real, through `Loop.fit`, and returns its summary (tracker meter).

    Two optimizer updates over random token batches (every row `seq_len` long), with the CPU
    tensor tracker on: the measured side of the estimator's accuracy check. ``model`` is modified
    (frozen, checkpointed, trained); pass a fresh one. The arguments are those of `estimate`.
    """
    strategy = as_strategy(strategy, levers)
    generator = torch.Generator().manual_seed(0)
    batches = [random_batch(batch_size, seq_len, _vocab_size(model), num_labels, generator)
               for _ in range(2 * strategy.accum_steps)]
    loop = _strategy_loop(model, strategy, max_grad_norm)
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

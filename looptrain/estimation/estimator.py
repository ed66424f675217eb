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
the estimator brings its own behaviour for them through the Loop's documented doors (`Loop(make_precision=
FakePrecision, wrap_optimizer=wrap_optimizer_on_fakes)`: every update steps, since its memory is what is
measured) and its first update's loss through ``run_update(window, compute_loss=)``; it assigns nothing on
the Loop. Production code asks whether a tensor is fake in one place only, `looptrain.fake.is_fake`, where
it would read a value a fake tensor does not have.

The estimator's other modules: `fakes` (the fake model and the Loop's behaviour on fakes), `cuda` (CUDA's
kernels and cuBLAS's workspaces priced on the CPU), `shapes` (presets, configs, batches, the ladder).

An estimate made once is read back from the on-disk cache (`looptrain.estimation.cache`) when the same question
comes again; ``cache=False`` or ``LOOPTRAIN_CACHE_DIR=off`` computes it every time.

It sits above the Loop, as the planner does; leaf modules never import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from looptrain import strategy as strategies
from looptrain.batches import model_shifts_labels
from looptrain.checkpoint import capture_rng_state, restore_rng_state
from looptrain.config import LoopConfig
from looptrain.estimation import cache as estimate_cache
from looptrain.estimation.blocks import NotAffine, depths, extrapolated_result, mark_blocks, stack_blocks
from looptrain.estimation.cuda import cuda_kernels, priced_device_type, with_cublas_workspaces
from looptrain.estimation.fakes import (
    FakePrecision,
    fake_model,
    fake_tensors,
    matmul_scratch_rule,
    one_fake_mode,
    parameter_numel,
    price_4bit_storage,
    priming_loss,
    vocab_size,
    whole_rows,
    wrap_optimizer_on_fakes,
)
from looptrain.estimation.shapes import named_config, random_batch, token_windows
from looptrain.loop import Loop
from looptrain.optim import FOREACH_OPTIMIZERS
from looptrain.strategy import Strategy

ESTIMATE_METER = "estimate_fake_tensor_tracker"


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


def _strategy_loop(model: nn.Module, strategy: Strategy, max_grad_norm: float | None, device: str = "cpu", *,
                   on_fakes: bool = False, train_loader: Sequence = ()) -> Loop:
    """The Loop of one strategy over `model` on `device`: its model levers applied, its optimizer built, its
    LoopConfig; `on_fakes`: with the estimator's fake-tensor behaviour, through the Loop's doors. `train_loader`:
    the batches `fit` trains on (the estimate drives `run_update` itself and gives none).

    An invalid mix raises `ConfigError` (a ValueError) naming the fields. A compiled strategy runs eagerly
    (`as_run_eagerly`).
    """
    strategy = as_run_eagerly(strategy)
    config = LoopConfig.from_strategy(strategy, max_grad_norm=max_grad_norm, device=device, eval_every="no",
                                      progress_bar=False, track_memory=True, track_every_update=True,
                                      log_every=10**9)
    strategy.prepare_model(model)
    model = strategy.wrap_model(model, device)
    doors = {"make_precision": FakePrecision, "wrap_optimizer": wrap_optimizer_on_fakes} if on_fakes else {}
    return Loop(model, strategy.build_optimizer(model, 1e-5), list(train_loader), config=config, **doors)


def as_run_eagerly(strategy: Strategy) -> Strategy:
    """The strategy the estimate drives: `compile` off, its loss as the compiled run computes it.

    torch.compile does not run on fake tensors (nor under the tracker, a dispatch mode), so a compiled strategy
    is estimated as the eager run of the same computation: chunked cross-entropy off (`--compile` turns
    ``chunked_ce="auto"`` off). Compiled graphs may free activations earlier than eager; the estimate does not
    count on it (docs/compile.md).
    """
    if not strategy.compile:
        return strategy
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
    eval_batch_size: int | None = None,
    extrapolate: bool = True,
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
            attention mask and repeats GQA's KV heads, which a batch of whole rows skips. With the strategy's
            `packing`, every micro-batch builds one, of one row too (a packed row's block mask, from its positions).
        **levers: strategy fields to replace, by name (``precision="bf16"``, ``optimizer="adafactor"``,
            ``gradient_checkpointing=True``, ``freeze_layers=2``, ``weights="bf16"``, ...): the same as
            passing ``dataclasses.replace(strategy, **levers)``.
        device: the device the run trains on, whose kernels are priced: "cpu", or "cuda" (or "cuda:N"), where
            torch's AdamW and SGD step every tensor at once by default (``foreach``: the step's temporaries for
            all parameters together) and attention runs the fused kernels (flash, or memory-efficient with a
            mask), which keep the output and its log-sum-exp for backward instead of the attention
            probabilities, and autocast runs LayerNorm and softmax in fp32 (`cuda.cuda_kernels`); cuBLAS's
            workspaces are added (`cuda.cublas_workspace_bytes`, one per matmul thread). The estimate itself always
            runs on the CPU, on fake tensors.
        cache: read the result from the on-disk cache of estimates when an identical estimate was made before,
            and store it there otherwise (`looptrain.estimation.cache`; ``LOOPTRAIN_CACHE_DIR=off`` turns
            it off everywhere). False: always estimate, store nothing. ``"only"``: read the cache and raise
            `LookupError` instead of computing (the planner's search once its time is spent).
        eval_batch_size: also price evaluation (`evaluate_on_fakes`) at ``eval_batch_size x seq_len``, after the
            updates: the weights and the optimizer state resident, no gradients; None: training alone.
        extrapolate: a model of N identical blocks is priced on 2, 3 and 4 of them and extrapolated to N, byte-exact
            where the truncated runs prove it (`looptrain.estimation.blocks`), else run whole; False: always whole.

    Returns:
        ``peak_memory_bytes`` (the higher of ``training_peak_bytes`` and ``evaluation_peak_bytes``, the latter None
        without evaluation), ``memory_meter`` ("estimate_fake_tensor_tracker"), ``memory_breakdown``
        (params, grads, optimizer_state, activations_and_temps, peak_phase), ``phase_peak_bytes``,
        ``parameters``, ``trainable_parameters``, ``notes``, ``estimate_seconds`` (this call's),
        ``compute_seconds`` (what computing it took, when it was computed) and ``from_cache`` (whether the result
        was read from the cache), ``extrapolated`` (whether it was extrapolated from a few blocks) and
        ``extrapolation`` (which blocks were priced, or why the model was run whole); on CUDA
        ``cublas_workspace_bytes``, included in the peak; ``kernel_scratch_bytes``: what the process's RSS holds
        above the peak inside matmul kernels, no tensor (on a CPU that emulates bf16: `matmul_scratch_rule`), not in
        the peak, which is the tensors' as a tracker measures them.

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
    # loss need not be the model's (`fakes.priming_loss`).
    evaluation = [(eval_batch_size, seq_len)] if eval_batch_size else []
    return _cached_estimate(model_or_config, [window[:1], window], strategy, num_labels=num_labels,
                            max_grad_norm=max_grad_norm, padded=padded, cache=cache, primes=True, device=device,
                            evaluation=evaluation, extrapolate=extrapolate)


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
    evaluation: Sequence[tuple[int, int]] = (),
    extrapolate: bool = True,
    **levers: Any,
) -> dict[str, Any]:
    """`estimate` over given accumulation windows: the Loop's update driven once per window, in order.

    Args:
        model_or_config: as in `estimate`.
        windows: each window's micro-batch shapes ``(rows, width)``, driven from a fresh start (no
            gradients, no optimizer state: the first update creates it), e.g. `bounding_windows` of
            the shapes a run's sampler gives.
        strategy, num_labels, max_grad_norm, padded, cache, device, extrapolate, **levers: as in `estimate`
            (`padded`: the micro-batches of more than one row).

    Returns:
        The same dict as `estimate`: the peak over all the windows, its breakdown and phase.
    """
    if not windows or not all(windows):
        raise ValueError("estimate_windows needs at least one window, and every window at least one (rows, width)")
    return _cached_estimate(model_or_config, windows, as_strategy(strategy, levers), num_labels=num_labels,
                            max_grad_norm=max_grad_norm, padded=padded, cache=cache, primes=False, device=device,
                            evaluation=evaluation, extrapolate=extrapolate)


def estimate_evaluation(model_or_config: Any, shapes: Sequence[tuple[int, int]], strategy: Strategy | None = None, *,
                        num_labels: int = 2, padded: bool = False, cache: bool = True, device: str = "cpu",
                        extrapolate: bool = True, **levers: Any) -> dict[str, Any]:
    """Evaluation's peak alone: the model evaluated (`evaluate_on_fakes`) on batches of `shapes` ``(rows, width)``
    after one update has created the optimizer state (its loss `fakes.priming_loss`: no forward), as evaluation
    meets it in a run. The dict of `estimate`; its ``peak_memory_bytes`` is ``evaluation_peak_bytes`` (the priming
    update is no training step: ``training_peak_bytes`` is None). The other arguments are `estimate`'s."""
    if not shapes:
        raise ValueError("estimate_evaluation needs at least one (rows, width) shape")
    result = _cached_estimate(model_or_config, [[(1, 2)]], as_strategy(strategy, levers), num_labels=num_labels,
                              max_grad_norm=None, padded=padded, cache=cache, primes=True, device=device,
                              evaluation=shapes, extrapolate=extrapolate)
    return {**result, "peak_memory_bytes": result["evaluation_peak_bytes"], "training_peak_bytes": None}


def evaluate_on_fakes(loop: Loop, batches: Sequence[dict]) -> None:
    """`Loop.evaluate`'s memory on fake tensors: the model in eval mode, each batch's `Loop.eval_step` under
    ``torch.no_grad()`` and the precision's autocast, under the meter's "eval" phase. The metrics' update, which
    reads values a fake tensor lacks, is left out: it holds only the predicted class ids beside the batch."""
    loop.meter.mark("eval")
    loop.wrapped_model.eval()
    with torch.no_grad():
        for batch in batches:
            with loop.precision.autocast():
                loop.eval_step(batch)
    loop.wrapped_model.train()


def split_peaks(result: dict[str, Any]) -> dict[str, Any]:
    """An estimate's result with ``training_peak_bytes`` (the highest phase but "eval") and ``evaluation_peak_bytes``
    ("eval"'s, None without evaluation) beside its peak, the higher of the two."""
    phases = result.get("phase_peak_bytes") or {}
    training = max((peak for phase, peak in phases.items() if phase != "eval"), default=result["peak_memory_bytes"])
    return {**result, "training_peak_bytes": training, "evaluation_peak_bytes": phases.get("eval")}


def _cached_estimate(model_or_config: Any, windows: Sequence[Sequence[tuple[int, int]]], strategy: Strategy, *,
                     num_labels: int, max_grad_norm: float | None, padded: bool, cache: bool,
                     primes: bool, device: str = "cpu",
                     evaluation: Sequence[tuple[int, int]] = (), extrapolate: bool = True) -> dict[str, Any]:
    """`estimate_windows`, read from the on-disk cache or computed and written there. `primes`: the first window
    only creates the optimizer state (`estimate`'s), so its loss is `fakes.priming_loss`. `evaluation`: the
    evaluation batches' shapes, evaluated after the windows. `extrapolate`: from a few of its identical blocks
    where that is exact (`blocks`); the cache keeps the extrapolated estimate apart from the whole run's."""
    device_type = priced_device_type(device)
    if device_type == "cuda" and strategy.foreach is None and strategy.optimizer in FOREACH_OPTIMIZERS:
        strategy = dataclasses.replace(strategy, foreach=True)  # torch's default where every parameter is on CUDA
    if strategy.micro_batch_tokens:  # the micro-batches the Loop would cut, priced as they are
        windows, strategy = token_windows(windows, strategy), dataclasses.replace(strategy, micro_batch_tokens=0)
    strategy = dataclasses.replace(strategy, trim_heap=False)  # the C heap's pages hold no tensor: nothing to price
    # An invalid mix fails before work (the tracker's own refusal of compile aside: the estimate runs eagerly).
    LoopConfig.from_strategy(strategy, max_grad_norm=max_grad_norm, device="cpu", track_memory=False)
    started = time.perf_counter()
    config = named_config(model_or_config, num_labels) if isinstance(model_or_config, str) else None
    stack, why_whole = (_extrapolation_plan(model_or_config, config, strategy) if extrapolate
                        else (None, "extrapolate=False"))

    def key(extrapolated: bool) -> str | None:
        return estimate_cache.key(
            model_or_config, windows, strategy, num_labels=num_labels, max_grad_norm=max_grad_norm, padded=padded,
            named_config=config, primes=primes, device=device_type, evaluation=evaluation,
            extrapolated=extrapolated) if cache else None

    keys = [key(True), key(False)] if stack else [key(False)]
    result = estimate_cache.read(keys[0]) if keys[0] is not None else None
    if result is None and cache == "only":
        raise LookupError("no cached estimate of these settings (cache='only' computes nothing)")
    if result is None:
        def run(depth: int | None = None) -> Any:
            return _estimate_windows(model_or_config, windows, strategy, num_labels, max_grad_norm, padded, primes,
                                     device_type, evaluation, depth=depth)

        result = _extrapolated_or_whole(run, stack, why_whole)
        # A whole run is the whole run's figure: kept under its key too when the extrapolation fell back to it.
        written = keys if not result["extrapolated"] else keys[:1]
        result["compute_seconds"] = round(time.perf_counter() - started, 3)  # kept: what a cached read stands for
        for name in written:
            if name is not None:
                estimate_cache.write(name, result)
        result["from_cache"] = False
    else:
        result["from_cache"] = True
    if device_type == "cuda":
        result = with_cublas_workspaces(result)
    result = split_peaks(result)
    result["estimate_seconds"] = round(time.perf_counter() - started, 3)
    return result


def _extrapolation_plan(model_or_config: Any, config: Any, strategy: Strategy) -> tuple[tuple | None, str | None]:
    """``((depths, blocks), None)`` when the estimate is to be extrapolated from `depths` of the model's `blocks`
    identical blocks (`blocks.depths`); else ``(None, why not)``."""
    count, why = stack_blocks(model_or_config, config)
    if not count:
        return None, why
    frozen = isinstance(model_or_config, nn.Module) and not all(p.requires_grad for p in model_or_config.parameters())
    priced, why = depths(count, strategy, frozen)
    return ((priced, count), None) if priced else (None, why)


def _extrapolated_or_whole(run: Any, stack: tuple | None, why_whole: str | None) -> dict[str, Any]:
    """The estimate extrapolated from `stack`'s depths (`blocks.extrapolated_result`), or the whole model's with
    ``extrapolated`` False and the reason."""
    if stack is not None:
        try:
            return extrapolated_result(run, *stack)
        except NotAffine as reason:
            why_whole = str(reason)
    result, _ = run()
    return {**result, "extrapolated": False, "extrapolation": f"whole model: {why_whole}"}


def _estimate_windows(model_or_config: Any, windows: Sequence[Sequence[tuple[int, int]]], strategy: Strategy,
                      num_labels: int, max_grad_norm: float | None, padded: bool,
                      primes: bool = False, device_type: str = "cpu",
                      evaluation: Sequence[tuple[int, int]] = (), *,
                      depth: int | None = None) -> tuple[dict[str, Any], list | None]:
    """`estimate_windows`'s work, without the cache: the Loop's update driven on fake tensors under the tracker,
    then, with `evaluation`, the model evaluated on batches of those shapes (`evaluate_on_fakes`). Returns the result
    and, with `depth` (the model cut to its first `depth` blocks), the tracker's timeline (`blocks`).

    `primes`: the first window only creates what the later ones start from (the optimizer state), so its loss is
    `fakes.priming_loss` instead of the model's (`estimate`'s first update). `device_type` "cuda": attention and
    autocast priced as CUDA runs them (`cuda.cuda_kernels`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rng_states = capture_rng_state()
    scratch_rule = matmul_scratch_rule(device_type)  # measured on real tensors: before the fake mode
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with one_fake_mode():
            model = fake_model(model_or_config, num_labels, fake_mode, depth)
            # LoRA's adapters are built by peft outside the fake mode (its device moves cannot swap fakes), then
            # made fakes like the base they wrap: a real adapter is copied into a fake at every use (counted
            # twice). QLoRA's 4-bit storage is fake from the start (`quantize_blocks_4bit` on a fake weight), or, for
            # a model quantized already, copied as fakes of its packed bytes (`fakes.fake_model`).
            model = strategy.wrap_model(model)
            fake_tensors(model, fake_mode)
            # Built outside the fake mode: optimizers' constant tables (bitsandbytes' quantisation maps) are real.
            loop = _strategy_loop(model, strategy, max_grad_norm, on_fakes=True)
        model = loop.model  # LoRA: the adapters' PeftModel
        token_labels = model_shifts_labels(model)  # the task, decided once from the model: a causal LM's labels
        with fake_mode:
            # One batch per (position, shape): a shape met again at the same place reuses its batch.
            batches: dict[tuple[int, int, int], dict] = {}
            for window in windows:
                for position, (rows, width) in enumerate(window):
                    if (position, rows, width) not in batches:
                        # A packed row builds its block mask from its positions however many rows there are.
                        batches[position, rows, width] = random_batch(rows, width, vocab_size(model), num_labels,
                                                                      token_labels=token_labels,
                                                                      padded=(padded and rows > 1) or strategy.packs)
            loop.meter.start(loop.model, loop.optimizer)
            price_4bit_storage(loop.meter.tracker, model)
            if scratch_rule is not None:
                loop.meter.tracker.price_op_scratch(scratch_rule)
            if depth is not None:
                loop.meter.tracker.record_timeline()
                mark_blocks(loop.model, loop.meter.tracker)
            kernels = cuda_kernels() if device_type == "cuda" else contextlib.nullcontext()
            with whole_rows(), kernels:
                try:
                    for index, window in enumerate(windows):
                        # The priming window's loss is for its update only; the Loop's own hook from then on.
                        loss = (lambda batch: priming_loss(loop.model)) if primes and index == 0 else None
                        loop.run_update([batches[(position, *shape)] for position, shape in enumerate(window)],
                                        compute_loss=loss)
                    if evaluation:  # the training batches are gone by then: a run's evaluation reads its own
                        batches.clear()
                        evaluate_on_fakes(loop, [random_batch(rows, width, vocab_size(model), num_labels,
                                                              token_labels=token_labels, padded=padded and rows > 1)
                                                 for rows, width in evaluation])
                finally:
                    loop.meter.stop()
            summary = loop.meter.summary()
            timeline = loop.meter.tracker.timeline
            scratch = max(0, loop.meter.tracker.scratch_peak_bytes - summary["peak_memory_bytes"])
    finally:
        restore_rng_state(rng_states)
    parameters = list(model.parameters())
    return {
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "memory_meter": ESTIMATE_METER,
        "memory_breakdown": summary["memory_breakdown"],
        "phase_peak_bytes": summary["phase_peak_bytes"],
        "kernel_scratch_bytes": scratch,
        "parameters": sum(parameter_numel(p) for p in parameters),
        "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad),
        "notes": [],
    }, timeline


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
    first = [[window[0], *widest(set(window[1:]))] for window in first]
    leading = widest({window[0] for window in later})
    following = widest({shape for window in later for shape in window[1:]})
    steady = [[leading[index % len(leading)]] + ([following[index % len(following)]] if following else [])
              for index in range(max(len(leading), len(following)))] if leading else []
    return first + steady if fresh else steady + steady


def widest(shapes: set) -> list[tuple[int, int]]:
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
    batches = [random_batch(batch_size, seq_len, vocab_size(model), num_labels, generator, token_labels=token_labels)
               for _ in range(2 * strategy.accum_steps)]
    return _strategy_loop(model, strategy, max_grad_norm, device, train_loader=batches).fit()


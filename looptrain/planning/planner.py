"""The planner: a memory budget in, the fastest exact training configuration that fits out.

`plan(model, dataset, collator, memory_budget=..., effective_batch=...)` sits above the Loop, beside
the estimator, and drives both:

1. **Candidates** are `looptrain.Strategy` instances: the user's strategy with the searched fields
   replaced (any other lever, a `Strategy` subclass's own included, is kept). The effective batch never
   changes: micro-batch × accumulation (× ranks) is always what was asked for. Levers that keep the
   math are always free: the split, gradient checkpointing (none, every other block, all), the
   optimizer step fused into backward (when accumulation is 1), dynamic padding. Levers that change
   the numerics are used only when allowed (`Levers`): precision
   (bf16/fp16 where the hardware has it, fp32 always tried beside it; where it is bf16, bf16 weights with
   stochastic rounding too), the optimizer within its family
   (adamw → adamw8bit → paged_adamw8bit). Levers that change the task (freezing, a shorter max length)
   are never applied; when nothing fits they are suggested, with their estimates. LoRA (`lora_rank`,
   `qlora`, ...) is the task's choice too: with it, the planner plans the rest and never changes it (the
   model must be the wrapped `PeftModel` the run trains, `Strategy.wrap_model`), and says how much it
   saves over the full fine-tune with the same settings (one more estimate); without it, LoRA and QLoRA
   r 16 are among the suggestions when nothing fits.
2. **Fits**: `looptrain.estimation.estimate` at the dataset's longest padded batch (its worst batch), plus a
   safety margin (`DEFAULT_MARGIN`), must be within the budget, by the meter the budget counts (`METERS`):
   live tensors (the estimate alone), or the process's RSS above its start / CUDA's reserved memory (what the
   process holds besides tensors is measured once by a probe and charged to every candidate, and each probed
   candidate must fit by its own measured peak). For each precision, optimizer and checkpointing mode, the
   largest micro-batch that fits is found by a search over the divisors of the effective batch (memory only
   grows with the micro-batch). The estimates run in a forked child (`EstimateWorker`), so the training
   process never holds what estimating costs; they are cached on disk.
3. **Fastest, never losing**: the configuration the run would train without the planner (the user's split, else
   the safe default: micro-batch 1, every block checkpointed) is always a candidate and probed first; the prior's
   favourite next, then others while their probes fit the probe budget (5% of the run by default, less the
   estimates' time) and could pay for themselves. A probe is one update of the real Loop (`Loop.run_update`)
   on a real batch of the worst shape, learning rate 0, with a small micro-batch and one of the run's typical
   work timed beside it: a micro-batch's fixed cost and its seconds per FLOP (`ranking.micro_batch_costs`, one line
   for the splits of the same settings), and the optimizer step's seconds, over the micro-batches and updates of
   an epoch under that candidate's batching, predict the epoch's time; candidates left unprobed keep a prior,
   FLOP-style prediction and rank after the probed ones. The baseline is replaced only by a candidate predicted at least
   `KEEP_BASELINE_WITHIN` faster.

Everything measured and decided is in the returned `Plan` (`table()`, `to_dict()`).

This module holds `plan` itself, the order of its work; the parts live beside it: `plans` (what a plan is made of),
`search` (what fits), `ranking` (the probes and what is fastest) and `suggestions` (when nothing fits; LoRA's saving).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from looptrain.estimation import cache as estimate_cache
from looptrain.estimation.worker import EstimateWorker
from looptrain.flops import count_model_flops
from looptrain.lora import is_lora_model
from looptrain.memory import allocator
from looptrain.planning import probes
from looptrain.planning.errors import PlanError
from looptrain.planning.plans import (
    DEFAULT_MARGIN,
    METERS,
    MIN_PLANNING_SECONDS,
    Candidate,
    Levers,
    Plan,
    estimate_seconds,
    format_bytes,
    lora_words,
)
from looptrain.planning.ranking import (
    first_probe_ceiling,
    probe_candidates,
    record_probe,
    run_growth,
    typical_batch,
)
from looptrain.planning.search import (
    Search,
    costed,
    costed_candidates,
    estimate_workers,
    import_optimizers,
    lightest_split,
    mode_frontier,
    probe_fits,
    smaller_split,
    valid_settings,
    worst_batch_width,
)
from looptrain.planning.suggestions import lora_comparison, nothing_fits_message
from looptrain.precision import resolve_device
from looptrain.strategy import Strategy


def plan(
    model: nn.Module,
    dataset: Any,
    collator: Any,
    *,
    memory_budget: int,
    effective_batch: int,
    base: Strategy | None = None,
    baseline: Strategy | None = None,
    levers: Levers = Levers(),  # noqa: B008 (frozen: one shared default is safe)
    fixed: Sequence[str] = (),
    device: str = "cpu",
    epochs: int = 1,
    max_grad_norm: float | None = 1.0,
    margin: float | None = None,
    probe: bool = True,
    probe_budget: float | None = None,
    probe_fraction: float = 0.05,
    seed: int = 42,
    rss_baseline: int | None = None,
    meter: str | None = None,
    make_lean: Callable[[], str | None] | None = None,
    token_micro_batches: bool = True,
    echo: Callable[[str], None] = lambda line: None,
) -> Plan:
    """Plans the fastest training that fits `memory_budget`, keeping `effective_batch` exact.

    Args:
        model: the model to train; `base`'s model levers (freezing) are applied to it in place, as the
            run applies them. Probes run it in place with the learning rate at 0, and leave its weights as
            they were. With `base.lora_rank`, the wrapped `PeftModel` (`base.wrap_model(model)`), as the
            run trains it.
        dataset: the tokenized training set (`looptrain.data.TokenizedDataset`: `lengths` and items). For a
            causal LM, items with token labels: the estimate prices its `[rows, width]` labels (see `estimate`),
            the worst batch padded when the dataset has shorter samples.
        collator: the collator the run will use: `batch_width` and `max_length` (which caps widths); probes
            call it (for a causal LM it pads the labels too, with -100).
        memory_budget: bytes the run's peak may take, by `meter`.
        effective_batch: samples per optimizer update; every candidate keeps it exact.
        base: the user's `Strategy` (their precision, optimizer, freezing, padding, grouping, ...); every
            candidate is a `dataclasses.replace` of it, so levers the planner does not search (freezing, or
            a field of a `Strategy` subclass) are kept as given.
        baseline: the configuration the run would train without the planner (the user's flags). It is
            always among the candidates when it fits, probed first, and the plan replaces it only when
            another candidate's measured prediction is at least `KEEP_BASELINE_WITHIN` faster. Default:
            `base` when its split is the effective batch. When it does not fit, the safe default stands in
            for it: micro-batch 1, every block checkpointed (the lowest-memory split).
        levers: the numerics levers allowed.
        fixed: names of `Strategy` fields the user set explicitly: never changed.
        device: where the run trains.
        epochs: of the planned run (to budget the probes).
        max_grad_norm: the run's clipping (the estimate includes its temporaries).
        margin: the budget share kept free (default `DEFAULT_MARGIN` of the device type).
        probe: measure speeds on this device (False: rank by the prior alone).
        probe_budget: seconds the probes may take in all (default: `probe_fraction` of the planned run's
            predicted time less the seconds the estimates took; the baseline and the prior's favourite are
            always probed). No probe starts that its predicted time would take past the budget.
        probe_fraction: see `probe_budget`.
        seed: the run's seed (batching order).
        rss_baseline: with `meter="rss"`: the process's RSS the budget counts from (`rss_baseline_bytes()`
            when the run starts is typical; the weights then count).
        meter: what the budget counts. "tensors": live tensor bytes (the tracker's meter; the estimate alone
            decides). "rss" (Linux): the process's peak RSS above `rss_baseline`. "cuda_reserved": the CUDA
            caching allocator's reserved bytes. Under a measured meter ("rss", "cuda_reserved") a candidate
            is eligible only when its probe's measured peak, with the margin, fits. Default: "rss" when
            `rss_baseline` is given, else "tensors".
        make_lean: under `meter="rss"`: called if the first probe, made with the C allocator as the process
            has it, measures over the budget (with the run's growth and the margin). It may make the allocator's
            thresholds one step leaner, so that RSS follows the tensors more closely (the command line passes
            `allocator.fix_thresholds`: 1 MiB, then 128 KiB), and returns what it did, or None when it changed
            nothing; the first probe is then measured again, and asked again while it does not fit (at most
            `len(allocator.LEAN_STEPS)` times). The plan says what was done (`Plan.malloc`,
            `Plan.malloc_threshold_bytes`). glibc's own thresholds keep freed blocks resident but train about a
            third faster than 128 KiB, and 1 MiB nearly as fast as them (docs/memory.md), so the allocator is left
            as lean as the first probe needs and no leaner.
        token_micro_batches: train every candidate but your own flags (a `baseline` given and fitting: it trains as
            given; the safe default is the planner's own and is cut too) as `by_tokens` realises it: its window as one
            batch, cut into micro-batches of at most (its micro-batch x the worst width) padded tokens
            (`micro_batch_tokens`), so that short rows run many to a micro-batch within the same memory. Its
            estimate and probe are those of its split at the worst width, which bounds every such micro-batch; its
            predicted time counts the micro-batches it cuts. False (several processes, which must run the same
            micro-batches): the splits as they are.
        echo: prints progress lines.

    Returns:
        The `Plan`: candidates that fit, fastest first.

    Raises:
        PlanError: nothing fits; the message lists what would (freezing, LoRA, a shorter max length, levers).
    """
    base = base or Strategy(batch_size=effective_batch, accum_steps=1)
    if base.micro_batch_tokens or (baseline is not None and baseline.micro_batch_tokens):
        raise PlanError("the planner chooses the micro-batches' tokens itself: drop micro_batch_tokens "
                        "(--micro-batch-tokens) from the strategy it plans")
    meter = meter or ("rss" if rss_baseline is not None else "tensors")
    if meter not in METERS:
        raise PlanError(f"unknown budget meter {meter!r}: pass one of {', '.join(METERS)}")
    if meter == "rss" and rss_baseline is None:
        raise PlanError("a budget of process RSS counts from the RSS at the run's start: pass rss_baseline="
                        "rss_baseline_bytes() (taken before the model is loaded, so the weights count)")
    if base.lora_rank and isinstance(model, nn.Module) and not is_lora_model(model):
        raise PlanError(f"{lora_words(base)}: pass the wrapped model the run trains (model = "
                        "base.wrap_model(model)): the probes train it as it is")
    if isinstance(model, nn.Module):
        base.prepare_model(model)  # the task's own levers (freezing): never changed by the plan, probed as they run
        probes.MODEL_DIGESTS[model] = estimate_cache.model_digest(model)  # before a probe changes what it reads
    device_type = resolve_device(device).type
    margin = DEFAULT_MARGIN.get(device_type, 0.15) if margin is None else margin
    lengths = list(dataset.lengths)
    worst_width = worst_batch_width(lengths, collator, base.padding)
    num_labels = getattr(model, "num_labels", None) or getattr(getattr(model, "config", None), "num_labels", None) or 2
    search = Search(model, worst_width, memory_budget, margin, max_grad_norm, num_labels, echo, device_type)
    malloc: str | None = None
    search.padded = min(lengths) < worst_width  # a batch of more than one row holding the longest sample is padded
    search.by_tokens = token_micro_batches
    search.measured = meter != "tensors"
    search.flops = count_model_flops(model) if isinstance(model, nn.Module) else None
    # The estimates run in a child process: what estimating costs (torch's fake-tensor machinery) stays out of
    # this process, whose RSS the budget may count. The optimizers' libraries are imported here first, once: the
    # probes need them here anyway, and each child forked after finds them imported instead of paying for it.
    if isinstance(model, nn.Module):
        import_optimizers(base, levers, fixed)
    frozen = _freeze_objects(collect=probe and meter != "tensors")
    try:
        for _ in range(estimate_workers() if isinstance(model, nn.Module) else 0):
            search.workers.append(EstimateWorker(search.estimate_here))  # closed below, whatever happens next
        measured = probes.Meter(meter, rss_baseline) if meter != "tensors" else None
        if measured is not None and not (probe and isinstance(model, nn.Module)):
            raise PlanError(f"a budget {METERS[meter]} is checked by probing a real model: pass probe=True, "
                            "or plan for a budget of live tensors (meter='tensors')")
        if baseline is None and base.batch_size * base.accum_steps == effective_batch:
            baseline = base
        order = sorted(range(len(lengths)), key=lambda index: -lengths[index])  # the worst batch: the longest samples
        reference: Candidate | None = None  # the first probe's candidate, costed and probed before the search
        first_seconds = first_charged = 0.0  # the first probe(s): wall seconds, and as `Search.charged` counts them
        if probe and isinstance(model, nn.Module):
            # Before the search, the configuration every plan probes first (the user's, else the safe default):
            # its probe predicts the run's time, which bounds planning's (`probe_fraction`, or `probe_budget`), and
            # under a measured meter it measures what the process holds besides tensors, which the search charges.
            firsts = [s for s in (baseline, lightest_split(base, effective_batch))
                      if s is not None and valid_settings(s)]
            search.prefetch(firsts)  # side by side: the lightest is needed when the baseline does not fit
            first = next((s for s in firsts if search.fits(s)), None)
            if first is not None and first != baseline and probe_budget is None:
                # Your flags do not fit: which checkpointing modes do, at their lightest split? One round, side by
                # side, whatever planning's time (`--plan-time` bounds it: then the search asks, within its time).
                search.prefetch_all(mode_frontier(base, effective_batch, set(fixed)))
            if first is not None:
                batch = collator([dataset[i] for i in order[:first.batch_size]])
                reference = costed(search, first, dataset, collator, lengths, device_type, seed,
                                   as_given=first == baseline)
                typical = typical_batch(reference, dataset, collator, order)
                started = time.perf_counter()
                # A probe that reads more than a fitting one may stops there: the process stays within its budget.
                # The most it may measure and still fit, its growth included: past it, it stops (before the optimizer
                # step, when the step would take it past).
                ceiling = first_probe_ceiling(memory_budget, margin, search.peak(first)) \
                    if measured is not None else None
                step_bytes = search.step_bytes(first)  # the step itself cannot be stopped: it is checked before
                probed = probes.probe(model, first, batch, device, max_grad_norm, measured, ceiling, step_bytes,
                                      typical=typical)
                leans = meter == "rss" and make_lean is not None
                if leans and probed.get("from_cache") and not probe_fits(probed, search, first):
                    # Measured again, though cached: besides its verdict, this probe under glibc's own thresholds
                    # leaves freed chunks in the heap, which the run reuses once the thresholds are fixed. A rerun
                    # that read it from the cache trained 10% slower (docs/plan.md).
                    probed = probes.measure_probe(model, probes.as_run(first, measured), batch, device, max_grad_norm,
                                                  measured, ceiling, step_bytes, typical=typical)
                first_charged = probed["probe_seconds"]  # as measured, or as recorded when read from the cache
                # One step leaner at a time (`allocator.LEAN_STEPS`: a middle threshold first, which trains nearly as
                # fast as glibc's own), until the first probe fits or the allocator has nothing leaner.
                for _ in allocator.LEAN_STEPS if leans else ():
                    if probe_fits(probed, search, first):
                        break
                    said = make_lean()
                    if said is None:
                        break
                    echo(f"  {first.batch_size} x {first.accum_steps} measured "
                         f"{format_bytes(probed['measured_peak_bytes'])}, over the budget with the run's growth, "
                         f"under the C allocator's {'own thresholds' if malloc is None else 'thresholds so far'}: "
                         f"{said}; measuring it again")
                    malloc = said
                    probed = probes.probe(model, first, batch, device, max_grad_norm, measured, ceiling, step_bytes,
                                          typical=typical)
                    first_charged += probed["probe_seconds"]
                first_seconds = time.perf_counter() - started
                record_probe(reference, probed, search.flops)
                total = probe_budget if probe_budget is not None else 0.0 if probed.get("stopped") else \
                    probe_fraction * reference.seconds_per_epoch * epochs  # stopped: no time measured, the floor
                # Both probes count when the first was measured again with the allocator fixed: planning's time is
                # all of it, and the favourite's probe after the search is reserved at the second's (the allocator
                # as it will be).
                search.limit = max(search.charged, estimate_seconds(
                    total, probed["probe_seconds"], MIN_PLANNING_SECONDS if probe_budget is None else 0.0,
                    spent=first_charged))
            if reference is not None and measured is not None:
                besides = max(0, reference.probe["measured_peak_bytes"] - reference.estimated_peak_bytes)
                search.growth = run_growth(reference.probe["measured_peak_bytes"], reference.estimated_peak_bytes)
                search.overhead = besides + search.growth
                echo(f"  the process holds {format_bytes(besides)} besides the estimated tensors (measured: "
                     f"{format_bytes(reference.probe['measured_peak_bytes'])} at {first.batch_size} x "
                     f"{first.accum_steps}); {format_bytes(search.growth)} more is kept for the run's growth")
        candidates = costed_candidates(search, dataset, collator, lengths, effective_batch, base, levers, set(fixed),
                                        device_type, seed, baseline, reference)
        search.limit = None  # what follows (suggestions when nothing fits, LoRA's comparison) is one estimate each
        if not candidates:
            if measured is not None and not search.overhead:
                # What would fit is judged by the same meter: measure the process's memory besides the tensors on
                # the lightest settings (one row of the longest sample), or every suggestion would be priced as
                # tensors alone.
                lightest = lightest_split(base, effective_batch)
                longest = max(range(len(lengths)), key=lambda index: lengths[index])
                # Stopped at the budget (before a step that would pass it, too): what it holds besides is at least that.
                probed = probes.probe(model, lightest, collator([dataset[longest]]), device, max_grad_norm, measured,
                                      memory_budget, search.step_bytes(lightest))
                search.overhead = max(0, probed["measured_peak_bytes"] - search.peak(lightest))
            raise PlanError(nothing_fits_message(search, effective_batch, base, levers, collator, lengths,
                                                  device_type, frozenset(fixed)))
        result = Plan(memory_budget, margin, effective_batch, worst_width, device, candidates, search.count,
                      search.seconds, 0.0, probe_budget, len(lengths), meter=METERS[meter])
        result.cached_estimates = search.cached
        result.growth_bytes = search.growth
        result.malloc = malloc
        result.malloc_threshold_bytes = allocator.fixed_threshold() if malloc is not None else None
        if malloc is not None:
            result.notes.append(f"the first probe did not fit under the C allocator's own thresholds, which keep "
                                f"freed blocks resident: {malloc}")
        result.extrapolated = search.extrapolated
        result.predictions = len(search.predicted - search.cache.keys())  # not estimated after all
        if search.skipped:
            result.notes.append(f"the search stopped short of {search.skipped} estimate(s): planning's time (5% of "
                                "the run its first probe predicts, or --plan-time) was spent, so those splits count "
                                "as not fitting; a longer --plan-time searches further (a rerun on the cache stops "
                                "where this run did)")
        if search.extrapolated:
            result.notes.append(f"{len(search.extrapolated)} fused-step candidate(s) not estimated: the line through "
                                "two estimates of the same settings at smaller micro-batches (activations are affine "
                                "in the rows) puts them over the budget")
        chosen = next((c for c in candidates if c.baseline), None)
        if chosen is None:
            result.notes.append("neither your flags nor the safe default (micro-batch 1, every block checkpointed) "
                                "fit: every candidate is the planner's")
        elif chosen.settings != baseline:
            result.baseline_words = "safe default"
            result.notes.append(("your flags do not fit" if baseline is not None else "no split of yours to start "
                                 "from") + "; the baseline is the safe default: micro-batch 1, every block "
                                "checkpointed")
        if search.overhead:
            result.notes.append(f"fits: (estimate + {format_bytes(search.overhead - search.growth)} the process "
                                f"measured besides tensors + {format_bytes(search.growth)} for the run's growth) x "
                                f"{1 + margin:.2f} within the budget, and each probe's measured peak + the growth x "
                                f"{1 + margin:.2f}")
        if probe and isinstance(model, nn.Module):
            result.probe_seconds = first_seconds
            result.charged_seconds = search.charged + first_charged
            probe_candidates(result, model, dataset, collator, order, device, epochs, max_grad_norm, probe_budget,
                              probe_fraction, measured, echo, flops=search.flops,
                              smaller=lambda candidate: None if "batch_size" in fixed else smaller_split(
                                  search, candidate, result.candidates, dataset, collator, lengths, device_type, seed))
        else:
            for candidate in candidates:
                candidate.seconds_per_epoch = candidate.prior
            result.notes.append("nothing probed: speeds are a prior in arbitrary units (padded tokens, recompute, "
                                "micro-batch size, precision), not measured")
        realised = [candidate for candidate in result.candidates if candidate.trained is not None]
        for candidate in realised:
            candidate.settings, candidate.trained = candidate.trained, None
        if probes.trims(measured):
            for candidate in result.candidates:
                candidate.settings = probes.as_run(candidate.settings, measured)
            result.notes.append("glibc's own malloc thresholds keep freed blocks resident over a run, where a probe "
                                "measured a fresh heap: the run trims the heap before each micro-batch (--trim-heap, "
                                "2-10% of the speed), as its probes did, so that its RSS stays near theirs")
        if realised:
            result.notes.append(f"{len(realised)} candidate(s) train each window as one batch cut into micro-batches "
                                "of at most (micro-batch x the worst width) padded tokens: short rows run many to a "
                                "micro-batch, within the memory of the split they were estimated and probed as")
        if base.lora_rank:
            lora_comparison(search, result)
        return result
    finally:
        for worker in search.workers:
            worker.close()
        if frozen:
            gc.unfreeze()


def _freeze_objects(collect: bool) -> bool:
    """Hides every object the process holds from the collector until `plan` returns (`gc.freeze`): the probes'
    collections, which free what each probe made before the next is measured, then scan only what planning made.
    After transformers, peft and bitsandbytes are imported, a full collection scans hundreds of thousands of objects
    (about 0.2 s each, 12 of them in a plan of 4 probes). The children forked after it share those objects' pages
    untouched. `collect`: a full collection first (once), where probes measure the process's memory, so that garbage
    made before planning is not frozen into their measurements. Returns whether it froze them (not when the caller
    had already: theirs stay frozen)."""
    if gc.get_freeze_count():
        return False
    if collect:
        gc.collect()
    gc.freeze()
    return True


__all__ = ["plan"]

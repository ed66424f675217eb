"""How "fits" is searched: `Search` estimates (in forked workers, cached, most steps predicted from two estimates)
and decides what fits the budget by its meter; `candidate_settings` finds, for each precision, optimizer and
checkpointing mode, the largest micro-batch that fits (`largest_fitting`), and `costed_candidates` turns them into
`Candidate`s."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from looptrain.config import ConfigError, LoopConfig
from looptrain.estimation.estimator import estimate
from looptrain.estimation.windows import run_windows
from looptrain.estimation.worker import EstimateWorker
from looptrain.flops import ModelFlops
from looptrain.lora import is_4bit_layer, is_lora_model
from looptrain.optim.factory import import_optimizer
from looptrain.planning.plans import Candidate, Levers, divisors, format_bytes, lora_words
from looptrain.planning.ranking import prior_seconds, probe_within, run_growth
from looptrain.precision import amp_precision, resolve_device
from looptrain.strategy import Strategy

OPTIMIZER_FAMILIES = {"adamw": ("adamw", "adamw8bit", "paged_adamw8bit")}
CHECKPOINT_MODES = ((False, 1), (True, 2), (True, 1))  # none, every other block, every block
FULL_FINE_TUNE = "full fine-tune"  # `Search.peak(model=...)`: the search's LoRA model without its adapters


class SearchTimeSpent(Exception):
    """The plan's time for estimates is spent: a split not estimated yet counts as not fitting."""


def probe_fits(probed: dict, search: Search, settings: Strategy) -> bool:
    """A probe's measured peak fits the search's budget, with the run's growth (from its estimate) and the margin
    (`probe_within`)."""
    growth = run_growth(probed.get("measured_peak_bytes", 0), search.peak(settings))
    return probe_within(probed, growth, search.margin, search.budget)


def costed_candidates(search: Search, dataset, collator, lengths, effective_batch: int, base: Strategy,
                       levers: Levers, fixed: set, device_type: str, seed: int,
                       baseline: Strategy | None, known: Candidate | None = None) -> list[Candidate]:
    """The candidates that fit, with their epoch's padded tokens and updates and their prior, best prior first.

    The baseline (the configuration without the planner; when it does not fit, the lightest split) is among
    them, marked, whether or not the search reached it. `known` (the candidate probed before the search) is used
    as it is when its settings are among them, its probe kept.
    """
    settings_list = candidate_settings(search, effective_batch, base, levers, fixed, device_type)
    fallback = lightest_split(base, effective_batch)
    chosen = next((s for s in (baseline, fallback) if s is not None and valid_settings(s) and fits_or_spent(search, s)),
                  None)
    if chosen is not None and chosen not in settings_list:
        settings_list.append(chosen)
    candidates = [known if known is not None and settings == known.settings
                  else costed(search, settings, dataset, collator, lengths, device_type, seed,
                               as_given=settings == baseline)
                  for settings in settings_list]
    for candidate in candidates:
        candidate.baseline = candidate.settings == chosen
    return sorted(candidates, key=lambda candidate: candidate.prior)


def fits_or_spent(search: Search, settings: Strategy) -> bool:
    """`search.fits`, False once the search's time is spent on settings not estimated yet."""
    try:
        return search.fits(settings)
    except SearchTimeSpent:
        return False


def costed(search: Search, settings: Strategy, dataset, collator, lengths, device_type: str, seed: int,
            as_given: bool = False) -> Candidate:
    """A candidate with its estimate, its epoch's padded tokens and updates (from the lengths alone) and its prior:
    of its batches as `by_tokens` cuts them (`as_given`: the user's own flags, trained as they are)."""
    from looptrain import data as data_module

    candidate = Candidate(settings, search.candidate_peak(settings), step_bytes=search.step_bytes(settings))
    candidate.predicted = search.key(settings) not in search.cache
    # The user's own flags train as given; the safe default is the planner's, and is cut like the rest.
    trained = by_tokens(settings, search.width) if search.by_tokens and not as_given else settings
    candidate.trained = trained if trained != settings else None
    loader = data_module.make_train_loader(dataset, trained.batch_size, collator,
                                           grouping="length" if trained.group_by_length else "random", seed=seed)
    windows = run_windows(loader.batch_sampler, lengths, collator, trained.accum_steps,
                          micro_batch_tokens=trained.micro_batch_tokens)
    shapes = [shape for window in windows for shape in window]
    candidate.padded_tokens = sum(rows * width for rows, width in shapes)
    candidate.micro_batches = len(shapes)
    work = search.flops.per_batch if search.flops is not None else lambda rows, width: float(rows * width)
    works = [work(rows, width) for rows, width in shapes]  # each micro-batch's model FLOPs (else padded tokens)
    if search.flops is not None:
        candidate.flops = sum(works)
    if shapes:  # the micro-batch of mean work: one priced there prices the epoch's total exactly if time is affine
        mean = sum(works) / len(shapes)
        candidate.typical_shape = min(zip(works, shapes), key=lambda pair: (abs(pair[0] - mean), pair[1]))[1]
    candidate.updates = len(windows)
    candidate.prior = prior_seconds(candidate, search.model, device_type)
    return candidate


def by_tokens(settings: Strategy, width: int) -> Strategy:
    """A split as a token-cut run trains it: the window (micro-batch x accumulation) as one batch, cut into
    micro-batches of at most micro-batch x `width` padded tokens (`micro_batch_tokens`); `settings` as they are
    when that cannot apply (fixed-width padding, no accumulation, the fused step, torch.compile, a cut already).

    Each such micro-batch of r rows w wide has r x w <= micro-batch x `width` tokens and r x w x w attention
    scores at most micro-batch x `width` x `width`: within what the split's estimate and probe at `width` (the
    worst batch) priced.
    """
    if settings.padding != "dynamic" or settings.accum_steps == 1 or settings.optimizer_in_backward \
            or settings.compile or settings.micro_batch_tokens:
        return settings
    return dataclasses.replace(settings, batch_size=settings.batch_size * settings.accum_steps, accum_steps=1,
                               micro_batch_tokens=settings.batch_size * width)


def worst_batch_width(lengths: Sequence[int], collator: Any, padding: str) -> int:
    """The width of the dataset's longest padded batch (any batch holding the longest sample)."""
    if padding == "max_length":
        return int(collator.max_length)
    return int(collator.batch_width([max(lengths)]))


class Search:
    """Estimates at the worst batch, memoised; `fits` compares them with the budget less the margin."""

    def __init__(self, model, width: int, budget: int, margin: float, max_grad_norm, num_labels: int, echo,
                 device_type: str = "cpu"):
        self.model, self.width, self.budget, self.margin = model, width, budget, margin
        self.max_grad_norm, self.num_labels, self.echo = max_grad_norm, num_labels, echo
        self.device_type = device_type  # whose kernels the estimates price (`estimate(device=)`): the run's device
        self.cache: dict = {}
        self.results: dict = {}  # the whole estimate (breakdown, phase), by the same key
        self.count = 0
        self.cached = 0  # of `count`, the estimates read from the on-disk cache (looptrain.estimation.cache)
        self.seconds = 0.0
        # The estimates as `limit` counts them: each at what computing it cost (a cached one at its recorded cost), so
        # that a rerun reading them from the cache stops where the first run stopped, in a fraction of the time.
        self.charged = 0.0
        self.overhead = 0  # a budget of process RSS: what the process holds besides the estimated tensors
        self.smallest_failure: Strategy | None = None  # `largest_fitting`'s smallest split that did not fit
        self.extrapolated: list[Strategy] = []  # fused candidates ruled out by extrapolation, not estimated
        self.limit: float | None = None  # seconds the estimates may take; then only cached ones are read
        self.round_seconds = 0.0  # the longest round of estimates so far, as charged: what `spent` expects of the next
        self.skipped = 0  # estimates not made because `limit` was spent
        self.growth = 0  # a measured meter: kept free for what the run adds to a probe's peak (`RUN_GROWTH`)
        self.padded = False  # the worst batch of more than one row holds shorter, padded rows (see `estimate`)
        self.full_model: Any = None  # `FULL_FINE_TUNE`'s model, made once where the estimates run
        self.workers: list[EstimateWorker] = []  # run the estimates in child processes (`plan` starts them)
        self.by_tokens = False  # candidates other than your flags train as `by_tokens` cuts them (`costed`)
        # A measured meter: every candidate's memory is confirmed by its probe, so a split's predicted peak
        # (`predict`) stands for its estimate; under the tensors meter the estimate decides alone, and the search
        # estimates the split its predictions chose (`largest_fitting`).
        self.measured = False
        self.predicted: set = set()  # keys of the splits a prediction decided (`predict`), not estimated
        self.flops: ModelFlops | None = None  # the model's FLOPs per token, which weigh a probe's time (`plan` sets it)

    def priced(self, settings: Strategy) -> Strategy:
        """The settings whose estimate is that of `settings`: with `micro_batch_tokens`, the split whose memory bounds
        theirs (its micro-batch at the worst width: what `by_tokens` made them from); `trim_heap` off (the C heap
        holds no tensor)."""
        settings = dataclasses.replace(settings, trim_heap=False)
        if not settings.micro_batch_tokens:
            return settings
        rows = max(1, min(settings.batch_size, settings.micro_batch_tokens // self.width))
        return dataclasses.replace(settings, batch_size=rows, micro_batch_tokens=0,
                                   accum_steps=math.ceil(settings.batch_size / rows) * settings.accum_steps)

    def key(self, settings: Strategy, seq_len: int | None = None, model: str | None = None) -> tuple:
        """What the estimator prices of `settings` at `seq_len` (default: the worst batch's width)."""
        settings = self.priced(settings)
        priced = {**settings.estimate_options(), "accum_steps": min(settings.accum_steps, 2)}  # memory repeats after 2
        key = settings.batch_size, seq_len or self.width, type(settings), tuple(sorted(priced.items()))
        return key if model is None else (*key, model)

    def peak(self, settings: Strategy, seq_len: int | None = None, model: str | None = None) -> int:
        """The estimate of `settings` at the worst batch (or `seq_len` wide), memoised by what the estimator prices.

        `model`: None (the search's model) or `FULL_FINE_TUNE` (a LoRA model without its adapters). With
        `workers` (`plan` starts them), the estimate runs in a child process.
        """
        request = self._request(settings, seq_len, model)
        if request[-1] not in self.cache:
            self._estimate([request], demanded=True)
        return self.cache[request[-1]]

    def prefetch(self, settings_list: Sequence[Strategy]) -> None:
        """Estimates those of `settings_list` not memoised yet side by side, one per worker, so that `peak` finds them
        (`search.workers`: one per core, up to two). Best effort: nothing with one worker, for fewer than two
        estimates, or once the search's time is spent. A round is charged as its longest estimate: the search's
        decisions do not depend on how many ran beside each other, and a rerun on the cache takes the same."""
        if len(self.workers) < 2 or self.spent():
            return
        wanted = {}
        for settings in settings_list:
            request = self._request(settings, None, None)
            if request[-1] not in self.cache:
                wanted.setdefault(request[-1], request)
        if len(wanted) > 1:
            self._estimate(list(wanted.values())[:len(self.workers)], demanded=False)

    def prefetch_all(self, settings_list: Sequence[Strategy]) -> None:
        """`prefetch` of all of `settings_list` not memoised yet, a round (one per worker) at a time."""
        wanted: dict[tuple, Strategy] = {}
        for settings in settings_list:
            key = self.key(settings)
            if key not in self.cache:
                wanted.setdefault(key, settings)
        pending = list(wanted.values())
        for start in range(0, len(pending), max(1, len(self.workers))):
            self.prefetch(pending[start:start + len(self.workers)])

    def _request(self, settings: Strategy, seq_len: int | None, model: str | None) -> tuple:
        seq_len = seq_len or self.width
        settings = self.priced(settings)
        return settings, seq_len, model, self.key(settings, seq_len, model)

    def _estimate(self, requests: list[tuple], demanded: bool) -> None:
        """One round: each request on its own worker (here without any), their results memoised."""
        started = time.perf_counter()
        spent = self.spent()  # then only cached estimates are read
        workers = self.workers or [None] * len(requests)
        for (settings, seq_len, model, _), worker in zip(requests, workers):
            if worker is not None:
                worker.submit((settings, seq_len, model, spent))
        answers = []
        for request, worker in zip(requests, workers):  # every answer is read, so that no worker is left behind
            settings, seq_len, model, _ = request
            try:
                answers.append(worker.collect() if worker is not None
                               else self.estimate_here((settings, seq_len, model, spent)))
            except Exception as error:  # noqa: BLE001  raised below for what was asked, once every answer is in
                answers.append(error)
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        failed = next((answer for answer in answers if isinstance(answer, Exception)
                       and not isinstance(answer, LookupError)), None)
        if demanded and failed is not None:
            raise failed  # a prefetch's failure is not memoised: `peak` meets it again if the search asks
        results = [answer for answer in answers if not isinstance(answer, Exception)]
        # A cached estimate counts at what computing it cost; a round of side-by-side estimates, at its longest.
        cost = max((result.get("compute_seconds", elapsed) for result in results), default=0.0)
        self.charged += cost
        self.round_seconds = max(self.round_seconds, cost)
        for (settings, seq_len, _, key), result in zip(requests, answers):
            if isinstance(result, Exception):
                continue
            self.count += 1
            self.cached += bool(result.get("from_cache"))
            self.cache[key] = result["peak_memory_bytes"]
            self.results[key] = result
            self.echo(f"  estimate {settings.batch_size} x {settings.accum_steps}, {settings.precision}"
                      f"{', bf16 weights' if settings.weights == 'bf16' else ''}, "
                      f"{settings.optimizer}, checkpointing {settings.checkpointing}"
                      f"{', fused step' if settings.optimizer_in_backward else ''}"
                      f"{', ' + lora_words(settings) if settings.lora_rank else ''}"
                      f"{f', seq {seq_len}' if seq_len != self.width else ''}: {format_bytes(self.cache[key])}"
                      f"{' (from the cache)' if result.get('from_cache') else ''}")
        if demanded and len(results) < len(requests):
            self.skipped += 1
            raise SearchTimeSpent

    def spent(self) -> bool:
        """Whether planning's time (`limit`) has no room for another round as long as the longest so far: then only
        cached estimates are read (a round is not started that would end past the limit)."""
        return self.limit is not None and self.charged + self.round_seconds > self.limit

    def estimate_here(self, request: tuple) -> dict:
        """`estimate` of a `peak` request in this process (the worker's child calls it too)."""
        settings, seq_len, model, cached_only = request
        if model == FULL_FINE_TUNE:
            if self.full_model is None:
                self.full_model = full_fine_tune_model(self.model)
            model = self.full_model
        return estimate(self.model if model is None else model, settings.batch_size, seq_len, settings,
                        num_labels=self.num_labels, max_grad_norm=self.max_grad_norm, padded=self.padded,
                        cache="only" if cached_only else True, device=self.device_type)

    def predict(self, settings: Strategy) -> int | None:
        """The estimate of `settings` (memoised), else their peak predicted from two estimates of the same settings at
        other micro-batches, else None.

        For fixed settings at one width, the peak of each phase of the update (forward, backward, the optimizer
        step: `phase_peak_bytes`) is affine in the micro-batch's rows: activations and temporaries grow with them,
        weights, gradients and optimizer state do not (docs/plan.md: exact to 2.3e-4 on 12 mixes of models,
        optimizers, precisions, checkpointing, LoRA and chunked cross-entropy). Each phase is read off the line
        through the two nearest estimates (those on either side when there are), and the prediction is the largest.
        Where the worst batch of several rows is padded, one row is not (nothing to pad): it is neither a point nor
        predicted.
        """
        key = self.key(settings)
        if key in self.cache:
            return self.cache[key]
        rows, points = key[0], self.family_estimates(settings)
        if rows < (2 if self.padded else 1) or len(points) < 2:
            return None
        below = [point for point in points if point[0] < rows]
        above = [point for point in points if point[0] > rows]
        (low, first), (high, second) = (below[-1], above[0]) if below and above else \
            (below[-2], below[-1]) if len(below) >= 2 else (above[0], above[1])

        def phases(result: dict) -> dict:
            return result.get("phase_peak_bytes") or {"peak": result["peak_memory_bytes"]}

        ends = phases(first), phases(second)
        return int(max(ends[0][phase] + (ends[1][phase] - ends[0][phase]) * (rows - low) / (high - low)
                       for phase in ends[0] if phase in ends[1]))

    def family_estimates(self, settings: Strategy) -> list[tuple[int, dict]]:
        """The estimates of `settings` at other micro-batches that lie on one line, ``(rows, result)`` by rows: at two
        rows or more where the worst batch is padded (one row is not)."""
        key, smallest = self.key(settings), 2 if self.padded else 1
        return sorted(((other[0], result) for other, result in self.results.items()
                       if other[1:] == key[1:] and other[0] >= smallest), key=lambda point: point[0])

    def step_bytes(self, settings: Strategy) -> int:
        """What the optimizer step of `settings` allocates beyond the weights and gradients alive before it: its
        estimate's optimizer phase less them (the optimizer state it creates and the step's temporaries; the same at
        every micro-batch, so any estimate of the same settings tells), or 0 without one or with the fused step.

        Inside a step nothing can stop a probe (`probes._Ceiling`): on worked example 2, Hugging Face's Adafactor's
        first step took the process 110 MiB above what it held before it, past the budget, where its estimate said
        83 MiB (looptrain's in-place step of it takes one 41 MiB temporary less).
        """
        if settings.optimizer_in_backward:
            return 0
        key = self.key(settings)
        result = self.results.get(key) or next((result for _, result in self.family_estimates(settings)), None)
        if result is None or "optimizer" not in (result.get("phase_peak_bytes") or {}):
            return 0
        parts = result["memory_breakdown"]
        alive = parts["params"] + parts["grads"] + result.get("cublas_workspace_bytes", 0)
        return max(0, result["phase_peak_bytes"]["optimizer"] - alive)

    def known(self, settings: Strategy) -> bool:
        """Whether `fits` can answer for `settings` without an estimate."""
        return self.predict(settings) is not None

    def candidate_peak(self, settings: Strategy) -> int:
        """A candidate's peak: its estimate; its prediction when it has none and either a measured meter's probe
        will measure it or planning's time is spent."""
        predicted = self.predict(settings)
        if predicted is not None and self.measured:
            return predicted
        try:
            return self.peak(settings)
        except SearchTimeSpent:
            if predicted is None:
                raise
            return predicted

    def fits(self, settings: Strategy) -> bool:
        """Whether `settings` fit the budget less the margin (with what the process holds besides tensors): by their
        estimate, or their prediction (`predict`) when they have none, or by an estimate made now."""
        key, peak = self.key(settings), self.predict(settings)
        if peak is None:
            peak = self.peak(settings)
        elif key not in self.cache:
            self.predicted.add(key)
        return self.within(peak)

    def within(self, peak: int) -> bool:
        """Whether an estimated `peak` fits the budget less the margin, with what the process holds besides tensors."""
        return (peak + self.overhead) * (1 + self.margin) <= self.budget


def optimizer_names(base: Strategy, levers: Levers, fixed: Sequence[str]) -> tuple[str, ...]:
    """The optimizers the plan may try: the user's, or with `Levers.optimizer_family` (and the optimizer not fixed)
    every member of its family (`OPTIMIZER_FAMILIES`)."""
    if levers.optimizer_family and "optimizer" not in fixed:
        return OPTIMIZER_FAMILIES.get(base.optimizer, (base.optimizer,))
    return (base.optimizer,)


def import_optimizers(base: Strategy, levers: Levers, fixed: Sequence[str]) -> None:
    """Imports the libraries of the optimizers the plan may estimate and probe (`import_optimizer`); one that is not
    installed is left to the estimate, which says so."""
    for name in optimizer_names(base, levers, fixed):
        with contextlib.suppress(ImportError):
            import_optimizer(name)


def estimate_workers() -> int:
    """How many estimates run side by side: one per core this process may use, up to two (an estimate is one
    thread of Python; the search rarely has more than two it is sure to need)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(2, cores))


def valid_settings(settings: Strategy) -> bool:
    try:
        LoopConfig.from_strategy(settings, device="cpu", track_memory=False)  # probes and planned compiled runs: off
    except ConfigError:
        return False
    return True


def candidate_settings(search: Search, effective_batch: int, base: Strategy, levers: Levers, fixed: set,
                        device_type: str) -> list[Strategy]:
    """For each allowed precision, optimizer, checkpointing mode and fused step: the largest split that fits.

    The checkpointing modes are searched from the one that saves the most memory (every block) to none, so that
    a search cut short by planning's time has found the splits most likely to fit first. Memory only grows as
    fewer blocks are checkpointed, so a mode is searched only up to the largest micro-batch the mode before it
    reached (and not at all when that one fitted none); a later optimizer of the family (slower, lighter) must buy
    a larger micro-batch than the ones before it reached with the same mode, and the fused step (the whole batch in
    one micro-batch) is tried only where the unfused step did not reach it.
    """
    sizes = divisors(effective_batch)
    if "batch_size" in fixed:
        sizes = [size for size in sizes if size == base.batch_size]
    numerics = [(base.precision, base.weights)]  # (autocast precision, weight storage)
    if levers.precision and "precision" not in fixed:
        fast = amp_precision(resolve_device(device_type))[0]
        numerics = list(dict.fromkeys([("fp32", base.weights), (fast, base.weights)]))
        if fast == "bf16" and "weights" not in fixed:
            numerics.append(("bf16", "bf16"))
    # bf16 weights compute in bf16 (LoopConfig.compute_precision), and never with fp16's GradScaler.
    numerics = [("bf16" if weights == "bf16" else precision, weights) for precision, weights in numerics
                if weights == "fp32" or precision != "fp16"]
    optimizers = [name for name in optimizer_names(base, levers, fixed)
                  if device_type == "cuda" or not name.startswith("paged")]
    checkpointing_fixed = fixed & {"gradient_checkpointing", "checkpoint_every"}
    modes = [(base.gradient_checkpointing, base.checkpoint_every)] if checkpointing_fixed \
        else list(reversed(CHECKPOINT_MODES))  # the most memory saved first
    fused_options = [base.optimizer_in_backward] if "optimizer_in_backward" in fixed else [False, True]
    chosen: list[Strategy] = []
    for precision, weights in dict.fromkeys(numerics):
        reached: dict = {}  # checkpointing mode -> the largest micro-batch an earlier optimizer of the family reached
        for optimizer in optimizers:
            if search.limit is not None:
                search.prefetch_all(mode_frontier(base, effective_batch, fixed, precision=precision, weights=weights,
                                                  optimizer=optimizer))
            cap = effective_batch  # the largest micro-batch the previous (more checkpointed) mode fitted
            fused_may_fit = True in fused_options  # the fused step fitted (or was not needed) with the previous mode
            for checkpointing, every in modes:
                if cap == 0 and not fused_may_fit:
                    break  # less checkpointing fits nothing that more did not
                unfused_best = 0
                for fused in fused_options:
                    template = dataclasses.replace(base, precision=precision, weights=weights, optimizer=optimizer,
                                                   gradient_checkpointing=checkpointing, checkpoint_every=every,
                                                   optimizer_in_backward=fused)
                    floor = reached.get((checkpointing, every), 0)  # a later optimizer must buy a larger micro-batch
                    if fused:
                        if unfused_best == effective_batch or not fused_may_fit or floor == effective_batch:
                            continue  # the whole batch fits unfused; or with more checkpointing it did not fit fused
                        failed = search.smallest_failure if unfused_best < effective_batch else None
                        if failed is not None and cannot_fit_fused(search, failed, effective_batch):
                            fused_may_fit = False  # extrapolated from the unfused estimates
                            continue
                        options = [effective_batch]
                    else:
                        options = [size for size in sizes if floor < size <= cap]
                        search.smallest_failure = None
                    size = largest_fitting(search, template, options, effective_batch) if options else None
                    if fused:
                        fused_may_fit = size is not None
                    else:
                        unfused_best = size or 0
                    if size is not None:
                        chosen.append(dataclasses.replace(template, batch_size=size,
                                                          accum_steps=effective_batch // size))
                floor = reached.get((checkpointing, every), 0)
                # A later optimizer of the family is lighter: it fits at least what the ones before it reached.
                cap = max(unfused_best, floor if False in fused_options else 0)
                reached[(checkpointing, every)] = max(floor, unfused_best)
    return chosen


def largest_fitting(search: Search, template: Strategy, sizes: list[int], effective_batch: int) -> int | None:
    """The largest micro-batch in `sizes` that fits (memory grows with it: a binary search).

    A step is decided by its split's estimate, or by its prediction from two estimates of the same settings at other
    micro-batches (`Search.predict`): the first step is estimated beside the step it takes when it fits, and from
    then on the line through them decides most steps without an estimate. Under the tensors meter (the estimate
    decides alone) the largest split a prediction chose is estimated before it is returned; should it not fit, the
    search goes on below it.
    """
    def split(size: int) -> Strategy:
        return dataclasses.replace(template, batch_size=size, accum_steps=effective_batch // size)

    sizes = [size for size in sizes if valid_settings(split(size))]
    low, high, best = 0, len(sizes) - 1, None
    search.smallest_failure = None
    while low <= high:
        middle = (low + high) // 2
        settings = split(sizes[middle])
        if not search.known(settings):
            # Beside it, where the search goes next when it fits (larger splits are the faster ones); at the last
            # step, the split below the best so far, which stands in for it when its probe measures over the budget
            # (`smaller_split`).
            below = sizes.index(best) - 1 if best is not None else -1
            beside = [split(sizes[(middle + 1 + high) // 2])] if middle < high \
                else [split(sizes[below])] if below >= 0 else []
            search.prefetch([settings] + [other for other in beside if not search.known(other)])
        try:
            fitting = search.fits(settings)
        except SearchTimeSpent:  # what the estimates made so far found: the largest split known to fit
            return max((size for size in sizes if search.known(split(size)) and search.fits(split(size))),
                       default=best)
        if fitting:
            best, low = sizes[middle], middle + 1
        else:
            high = middle - 1
            search.smallest_failure = settings
    if best is None or search.measured or search.key(split(best)) in search.cache:
        return best
    try:
        search.peak(split(best))  # a prediction chose it: estimated, as the tensors meter decides by estimates
    except SearchTimeSpent:
        return best  # planning's time is spent: the prediction stands
    if search.fits(split(best)):
        return best
    found = largest_fitting(search, template, sizes[:sizes.index(best)], effective_batch)
    search.smallest_failure = search.smallest_failure or split(best)
    return found


def mode_frontier(base: Strategy, effective_batch: int, fixed: set, **fields: Any) -> list[Strategy]:
    """Each checkpointing mode's lightest valid split (its smallest micro-batch, unfused), `fields` set; none when
    checkpointing or the micro-batch is fixed, or the step fused into backward is (the search then tries no
    unfused split).

    Which modes fit at all decides more of a plan's speed than a larger micro-batch of the mode that saves the most
    (recomputing every block costs about a third of a forward and backward): the planner estimates them side by side
    before its first probe when your flags do not fit, and `candidate_settings` before it bisects any mode, so that
    a search cut short by planning's time has every mode's lightest split that fits among its candidates.
    """
    if fixed & {"gradient_checkpointing", "checkpoint_every", "batch_size"} \
            or ("optimizer_in_backward" in fixed and base.optimizer_in_backward):
        return []
    splits = []
    for checkpointing, every in reversed(CHECKPOINT_MODES):
        template = dataclasses.replace(base, gradient_checkpointing=checkpointing, checkpoint_every=every,
                                       optimizer_in_backward=False, **fields)
        for size in divisors(effective_batch):
            split = dataclasses.replace(template, batch_size=size, accum_steps=effective_batch // size)
            if valid_settings(split):
                splits.append(split)
                break
    return splits


def cannot_fit_fused(search: Search, failed: Strategy, effective_batch: int) -> bool:
    """Whether the step fused into backward at the whole batch is sure not to fit, extrapolated from two estimates of
    `failed`'s settings (unfused, at smaller micro-batches, one of which did not fit).

    The fused step holds no gradients, but the weights, the optimizer state and the activations of the whole batch.
    Where those estimates peaked in forward or backward, their activations and temporaries are affine in the rows,
    as each phase's peak is (`Search.predict`): the line through the two largest, read at `effective_batch` rows,
    plus the weights and the state, bound the fused step's peak. Below that bound, or without two such estimates,
    the fused candidate is estimated. (Scaling one estimate's activations by `effective_batch / rows` overstates
    them by the line's intercept: on worked example 1 it ruled out 8-bit AdamW fused, 3.09 GiB, under 4 GiB.)
    """
    points = [(rows, result["memory_breakdown"]) for rows, result in search.family_estimates(failed)]
    if len(points) < 2 or any(parts["peak_phase"] not in ("forward", "backward") for _, parts in points[-2:]):
        return False
    (low, first), (high, second) = points[-2:]
    slope = (second["activations_and_temps"] - first["activations_and_temps"]) / (high - low)
    bound = second["params"] + second["optimizer_state"] + second["activations_and_temps"] \
        + slope * (effective_batch - high)
    if search.within(bound):
        return False
    search.extrapolated.append(dataclasses.replace(failed, batch_size=effective_batch, accum_steps=1,
                                                   optimizer_in_backward=True))
    return True


def lightest_split(base: Strategy, effective_batch: int) -> Strategy:
    """The lightest exact split of `base`: micro-batch 1, every block checkpointed."""
    return dataclasses.replace(base, batch_size=1, accum_steps=effective_batch, gradient_checkpointing=True,
                               checkpoint_every=1, optimizer_in_backward=False)


def full_fine_tune_model(model: Any) -> Any:
    """What `estimate` prices as the full fine-tune of a LoRA model: the model without its adapters.

    A config, a preset or a model that is not a `PeftModel` is returned as it is. A `PeftModel`: a copy with
    its adapters unloaded and every parameter trainable, sharing the original's tensors (no memory; the
    original is unchanged). A QLoRA model (4-bit base): its transformers config (the unquantized model), or
    None when it has none.
    """
    if not is_lora_model(model):
        return model
    if any(is_4bit_layer(module) for module in model.modules()):
        config = getattr(model, "config", None)
        return config if hasattr(config, "to_dict") else None
    import copy

    memo: dict[int, Any] = {id(buffer): buffer for buffer in model.buffers()}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(parameter.detach(), requires_grad=True)
    return copy.deepcopy(model, memo).unload()


def smaller_split(search: Search, candidate: Candidate, candidates: list[Candidate], dataset, collator, lengths,
                   device_type: str, seed: int) -> Candidate | None:
    """The next smaller micro-batch of a candidate's settings (same effective batch), costed, when it is no candidate
    yet and its estimate fits; None otherwise (micro-batch 1, or the next one is a candidate already)."""
    settings = candidate.settings
    effective_batch = settings.batch_size * settings.accum_steps
    sizes = [size for size in divisors(effective_batch) if size < settings.batch_size]
    if settings.optimizer_in_backward or not sizes:
        return None
    smaller = dataclasses.replace(settings, batch_size=sizes[-1], accum_steps=effective_batch // sizes[-1])
    if any(other.settings == smaller for other in candidates) or not valid_settings(smaller) \
            or not search.fits(smaller):
        return None
    return costed(search, smaller, dataset, collator, lengths, device_type, seed)

"""How "fits" is searched: `Search` pairs the estimate book with the budget and decides what fits; for each precision,
optimizer and checkpointing mode, `candidate_settings` finds the largest micro-batch that fits (`largest_fitting`)
and returns them with the fused-step candidates it ruled out by extrapolation (`Found`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from looptrain.config import ConfigError, LoopConfig
from looptrain.optim.factory import import_optimizer
from looptrain.planning.book import EstimateBook, SearchTimeSpent
from looptrain.planning.budget import Budget
from looptrain.planning.plans import Levers, divisors
from looptrain.precision import amp_precision, resolve_device
from looptrain.strategy import Strategy

OPTIMIZER_FAMILIES = {"adamw": ("adamw", "adamw8bit", "paged_adamw8bit")}
CHECKPOINT_MODES = ((False, 1), (True, 2), (True, 1))  # none, every other block, every block


@dataclass(frozen=True)
class Search:
    """The estimate book read against a budget: `fits` compares an estimate (or a prediction) with the budget's rule.

    A new budget (once the first probe has measured the process) is a new `Search` (`with_budget`); the book is
    shared, so nothing is estimated twice.
    """

    book: EstimateBook
    budget: Budget

    def with_budget(self, budget: Budget) -> Search:
        return dataclasses.replace(self, budget=budget)

    @property
    def limit(self) -> float | None:
        """Planning's time for the estimates (`EstimateBook.limit`)."""
        return self.book.limit

    @property
    def measured(self) -> bool:
        """Whether every candidate's memory is confirmed by its probe (a measured meter): a split's predicted peak
        then stands for its estimate; under the tensors meter the estimate decides alone."""
        return self.budget.measured

    def peak(self, settings: Strategy, seq_len: int | None = None, model: str | None = None) -> int:
        return self.book.peak(settings, seq_len, model)

    def key(self, settings: Strategy) -> tuple:
        return self.book.key(settings)

    def memoised(self, settings: Strategy) -> bool:
        return self.book.memoised(settings)

    def known(self, settings: Strategy) -> bool:
        return self.book.known(settings)

    def prefetch(self, settings_list: Sequence[Strategy]) -> None:
        self.book.prefetch(settings_list)

    def prefetch_all(self, settings_list: Sequence[Strategy]) -> None:
        self.book.prefetch_all(settings_list)

    def family_estimates(self, settings: Strategy) -> list[tuple[int, dict]]:
        return self.book.family_estimates(settings)

    def within(self, peak: int) -> bool:
        """Whether an estimated `peak` fits the budget (`Budget.within`)."""
        return self.budget.within(peak)

    def fits(self, settings: Strategy) -> bool:
        """Whether `settings` fit the budget: by their estimate, or their prediction (`EstimateBook.predict`) when
        they have none, or by an estimate made now."""
        peak = self.book.predict(settings)
        if peak is None:
            peak = self.book.peak(settings)
        elif not self.book.memoised(settings):
            self.book.note_predicted(settings)
        return self.budget.within(peak)

    def estimate_round(self, settings_list: Sequence[Strategy], rounds: int | None = 1) -> None:
        """Estimates those of `settings_list` not memoised yet, a round at a time (as many as there are workers, at
        least one), at most `rounds` rounds (None: all of them), before anything else the search asks and within
        planning's time (`EstimateBook.spent`): what a search that planning's time cuts short should know first
        (which checkpointing modes fit, `first_probe`; the step fused into backward at the whole batch,
        `candidate_settings`). A round planning's time has no room for is not made: planning stays within its bound,
        and the table notes the estimates it stopped short of."""
        book = self.book
        wanted = [settings for settings in settings_list if not book.memoised(settings)]
        size = max(1, len(book.workers))
        try:
            for start in range(0, len(wanted), size)[:rounds]:
                book.prefetch(wanted[start:start + size])
                for settings in wanted[start:start + size]:
                    book.peak(settings)
        except SearchTimeSpent:
            pass

    @property
    def padded(self) -> bool:
        """Whether the worst batch of several rows is padded (`EstimateBook.predict` draws no line from one row)."""
        return self.book.padded

    def fits_or_spent(self, settings: Strategy) -> bool:
        """`fits`, False once planning's time is spent on settings not estimated yet."""
        try:
            return self.fits(settings)
        except SearchTimeSpent:
            return False

    def candidate_peak(self, settings: Strategy) -> int:
        """A candidate's peak: its estimate; its prediction when it has none and either a measured meter's probe
        will measure it or planning's time is spent."""
        predicted = self.book.predict(settings)
        if predicted is not None and self.measured:
            return predicted
        try:
            return self.book.peak(settings)
        except SearchTimeSpent:
            if predicted is None:
                raise
            return predicted


@dataclass(frozen=True)
class Fitting:
    """`largest_fitting`'s answer: the largest micro-batch that fits (None: none), and the smallest split that did
    not fit on the way (None: none did not), which the fused step's bound extrapolates from."""

    size: int | None
    smallest_failure: Strategy | None = None


@dataclass(frozen=True)
class Found:
    """`candidate_settings`' answer: the largest split that fits of each mode searched, and the fused-step splits
    ruled out by extrapolation, without an estimate (`ruled_out_fused`)."""

    settings: list[Strategy]
    extrapolated: list[Strategy] = field(default_factory=list)


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


def valid_settings(settings: Strategy) -> bool:
    """Whether the Loop can run `settings` (`LoopConfig`'s checks)."""
    try:
        LoopConfig.from_strategy(settings, device="cpu", track_memory=False)  # probes and planned compiled runs: off
    except ConfigError:
        return False
    return True


def lightest_split(base: Strategy, effective_batch: int) -> Strategy:
    """The lightest exact split of `base`: micro-batch 1, every block checkpointed."""
    return dataclasses.replace(base, batch_size=1, accum_steps=effective_batch, gradient_checkpointing=True,
                               checkpoint_every=1, optimizer_in_backward=False)


def searched_numerics(base: Strategy, levers: Levers, fixed: set, device_type: str) -> list[tuple[str, str]]:
    """The (autocast precision, weight storage) pairs the search tries: the user's, or with `Levers.precision` fp32
    and what `--amp` picks here, and where that is bf16, bf16 weights too."""
    numerics = [(base.precision, base.weights)]
    if levers.precision and "precision" not in fixed:
        fast = amp_precision(resolve_device(device_type))[0]
        numerics = list(dict.fromkeys([("fp32", base.weights), (fast, base.weights)]))
        if fast == "bf16" and "weights" not in fixed:
            numerics.append(("bf16", "bf16"))
    # bf16 weights compute in bf16 (LoopConfig.compute_precision), and never with fp16's GradScaler.
    numerics = [("bf16" if weights == "bf16" else precision, weights) for precision, weights in numerics
                if weights == "fp32" or precision != "fp16"]
    return list(dict.fromkeys(numerics))


def candidate_settings(search: Search, effective_batch: int, base: Strategy, levers: Levers, fixed: set,
                       device_type: str) -> Found:
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
    optimizers = [name for name in optimizer_names(base, levers, fixed)
                  if device_type == "cuda" or not name.startswith("paged")]
    checkpointing_fixed = fixed & {"gradient_checkpointing", "checkpoint_every"}
    modes = [(base.gradient_checkpointing, base.checkpoint_every)] if checkpointing_fixed \
        else list(reversed(CHECKPOINT_MODES))  # the most memory saved first
    fused_options = [base.optimizer_in_backward] if "optimizer_in_backward" in fixed else [False, True]
    numerics = searched_numerics(base, levers, fixed, device_type)
    if search.limit is not None:
        search.estimate_round(first_round(search, base, effective_batch, numerics, modes, optimizers[0], fixed,
                                          fused=True in fused_options and effective_batch in sizes))
    found, failure = Found([]), None  # failure: the last bisection's smallest split that did not fit
    for precision, weights in numerics:
        reached: dict = {}  # checkpointing mode -> the largest micro-batch an earlier optimizer of the family reached
        for optimizer in optimizers:
            if search.limit is not None:
                search.prefetch_all(mode_frontier(base, effective_batch, fixed, precision=precision, weights=weights,
                                                  optimizer=optimizer))
            template = dataclasses.replace(base, precision=precision, weights=weights, optimizer=optimizer)
            modes_found = _search_modes(search, template, modes, fused_options, sizes, effective_batch, reached,
                                        failure)
            found = Found(found.settings + modes_found.settings, found.extrapolated + modes_found.extrapolated)
            reached, failure = modes_found.reached, modes_found.failure
    return found


def first_round(search: Search, base: Strategy, effective_batch: int, numerics: list[tuple[str, str]], modes: list,
                optimizer: str, fixed: set, fused: bool) -> list[Strategy]:
    """What a search under a time limit estimates first, whatever the time (`Search.estimate_round`): the two corners
    of the fastest numerics, the whole batch fused with every block checkpointed (`whole_batch_fused`) and the least
    checkpointing at the smallest micro-batch (with an estimate of the same settings at another micro-batch, such as
    your flags', the line through both predicts every split between: `EstimateBook.predict`), then the other fused
    whole batches. Those corners are candidates where they fit, beside the safe default a search cut short keeps."""
    splits = whole_batch_fused(base, effective_batch, numerics, modes, optimizer) if fused else []
    fastest = sorted(numerics, key=lambda pair: (pair[1] != "fp32", pair[0] == "fp32"))[0]
    # The smallest micro-batch an estimate can draw a line from: 2 rows where the worst batch is padded (one row is
    # not, and is no point of the line).
    rows = divisors(effective_batch)[1] if search.padded and effective_batch > 1 else 1
    least = [dataclasses.replace(split, batch_size=rows, accum_steps=effective_batch // rows)
             for split in mode_frontier(base, effective_batch, fixed, precision=fastest[0], weights=fastest[1],
                                        optimizer=optimizer)[-1:]]
    return [split for split in splits[:1] + least + splits[1:] if not search.memoised(split)]


def whole_batch_fused(base: Strategy, effective_batch: int, numerics: list[tuple[str, str]], modes: list,
                      optimizer: str) -> list[Strategy]:
    """The whole batch in one micro-batch with the optimizer step fused into backward (no gradients held: the
    lightest way to run the largest micro-batch), the fastest numerics first (`--amp`'s precision before fp32, bf16
    weights last), each from the most checkpointing to the least: what a search cut short by planning's time
    estimates before anything else (`Search.estimate_round`), so that its candidates hold more than the safe default
    (docs/plan.md, "The planner against a grid")."""
    ordered = sorted(numerics, key=lambda pair: (pair[1] != "fp32", pair[0] == "fp32"))
    splits = [dataclasses.replace(base, batch_size=effective_batch, accum_steps=1, optimizer_in_backward=True,
                                  gradient_checkpointing=checkpointing, checkpoint_every=every, precision=precision,
                                  weights=weights, optimizer=optimizer)
              for precision, weights in ordered for checkpointing, every in modes]
    return [split for split in splits if valid_settings(split)]


@dataclass(frozen=True)
class _ModesFound:
    """`_search_modes`' answer: the splits found, the fused ones ruled out, the largest micro-batch reached by each
    mode (so far, this optimizer included) and the last bisection's smallest split that did not fit."""

    settings: list[Strategy]
    extrapolated: list[Strategy]
    reached: dict
    failure: Strategy | None


def _search_modes(search: Search, template: Strategy, modes: list, fused_options: list, sizes: list[int],
                  effective_batch: int, reached: dict, failure: Strategy | None) -> _ModesFound:
    """`candidate_settings` for one precision and optimizer: each checkpointing mode, unfused then fused, its
    largest split that fits; `reached` by the optimizers before this one, `failure` left by the last bisection."""
    settings, extrapolated, reached = [], [], dict(reached)
    cap = effective_batch  # the largest micro-batch the previous (more checkpointed) mode fitted
    fused_may_fit = True in fused_options  # the fused step fitted (or was not needed) with the previous mode
    for checkpointing, every in modes:
        # Under a time limit the mode before may have been cut short: this mode's splits known already still count.
        known = _known_sizes(search, template, (checkpointing, every), sizes, effective_batch) \
            if search.limit is not None else []
        if cap == 0 and not fused_may_fit and not known:
            break  # less checkpointing fits nothing that more did not
        unfused_best = 0
        for fused in fused_options:
            mode = dataclasses.replace(template, gradient_checkpointing=checkpointing, checkpoint_every=every,
                                       optimizer_in_backward=fused)
            floor = reached.get((checkpointing, every), 0)  # a later optimizer must buy a larger micro-batch
            if fused:
                if unfused_best == effective_batch or not fused_may_fit or floor == effective_batch:
                    continue  # the whole batch fits unfused; or with more checkpointing it did not fit fused
                failed = failure if unfused_best < effective_batch else None
                ruled_out = ruled_out_fused(search, failed, effective_batch) if failed is not None else None
                if ruled_out is not None:
                    extrapolated.append(ruled_out)
                    fused_may_fit = False  # extrapolated from the unfused estimates
                    continue
                options = [effective_batch]
            else:
                options = [size for size in sizes if floor < size and (size <= cap or size in known)]
                failure = None
            size = None
            if options:
                fitting = largest_fitting(search, mode, options, effective_batch)
                size, failure = fitting.size, fitting.smallest_failure
            if fused:
                fused_may_fit = size is not None
            else:
                unfused_best = size or 0
            if size is not None:
                settings.append(dataclasses.replace(mode, batch_size=size, accum_steps=effective_batch // size))
        floor = reached.get((checkpointing, every), 0)
        # A later optimizer of the family is lighter: it fits at least what the ones before it reached.
        cap = max(unfused_best, floor if False in fused_options else 0)
        reached[(checkpointing, every)] = max(floor, unfused_best)
    return _ModesFound(settings, extrapolated, reached, failure)


def _known_sizes(search: Search, template: Strategy, mode: tuple[bool, int], sizes: list[int],
                 effective_batch: int) -> list[int]:
    """The micro-batches of `mode` (unfused) the search knows without an estimate (memoised or predicted)."""
    unfused = dataclasses.replace(template, gradient_checkpointing=mode[0], checkpoint_every=mode[1],
                                  optimizer_in_backward=False)
    return [size for size in sizes
            if search.known(dataclasses.replace(unfused, batch_size=size, accum_steps=effective_batch // size))]


def largest_fitting(search: Search, template: Strategy, sizes: list[int], effective_batch: int) -> Fitting:
    """The largest micro-batch in `sizes` that fits (memory grows with it: a binary search), and the smallest split
    that did not on the way.

    A step is decided by its split's estimate, or by its prediction from two estimates of the same settings at other
    micro-batches (`EstimateBook.predict`): the first step is estimated beside the step it takes when it fits, and
    from then on the line through them decides most steps without an estimate. Under the tensors meter (the estimate
    decides alone) the largest split a prediction chose is estimated before it is returned; should it not fit, the
    search goes on below it.
    """
    def split(size: int) -> Strategy:
        return dataclasses.replace(template, batch_size=size, accum_steps=effective_batch // size)

    sizes = [size for size in sizes if valid_settings(split(size))]
    low, high, best, failure = 0, len(sizes) - 1, None, None
    while low <= high:
        middle = (low + high) // 2
        settings = split(sizes[middle])
        if not search.known(settings):
            # Beside it, where the search goes next when it fits (larger splits are the faster ones); at the last
            # step, the split below the best so far, which stands in for it when its probe measures over the budget
            # (`candidates.smaller_split`).
            below = sizes.index(best) - 1 if best is not None else -1
            beside = [split(sizes[(middle + 1 + high) // 2])] if middle < high \
                else [split(sizes[below])] if below >= 0 else []
            search.prefetch([settings] + [other for other in beside if not search.known(other)])
        try:
            fitting = search.fits(settings)
        except SearchTimeSpent:  # what the estimates made so far found: the largest split known to fit
            return Fitting(max((size for size in sizes if search.known(split(size)) and search.fits(split(size))),
                               default=best), failure)
        if fitting:
            best, low = sizes[middle], middle + 1
        else:
            high, failure = middle - 1, settings
    if best is None or search.measured or search.memoised(split(best)):
        return Fitting(best, failure)
    try:
        search.peak(split(best))  # a prediction chose it: estimated, as the tensors meter decides by estimates
    except SearchTimeSpent:
        return Fitting(best, failure)  # planning's time is spent: the prediction stands
    if search.fits(split(best)):
        return Fitting(best, failure)
    below = largest_fitting(search, template, sizes[:sizes.index(best)], effective_batch)
    return Fitting(below.size, below.smallest_failure or split(best))


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


def ruled_out_fused(search: Search, failed: Strategy, effective_batch: int) -> Strategy | None:
    """The step fused into backward at the whole batch when it is sure not to fit, extrapolated from two estimates of
    `failed`'s settings (unfused, at smaller micro-batches, one of which did not fit); None when it may fit.

    The fused step holds no gradients, but the weights, the optimizer state and the activations of the whole batch.
    Where those estimates peaked in forward or backward, their activations and temporaries are affine in the rows,
    as each phase's peak is (`EstimateBook.predict`): the line through the two largest, read at `effective_batch`
    rows, plus the weights and the state, bound the fused step's peak. Below that bound, or without two such
    estimates, the fused candidate is estimated. (Scaling one estimate's activations by `effective_batch / rows`
    overstates them by the line's intercept, and rules out fused steps that fit: docs/plan.md, 'Most steps of the
    search are predicted'.)
    """
    points = [(rows, result["memory_breakdown"]) for rows, result in search.family_estimates(failed)]
    if len(points) < 2 or any(parts["peak_phase"] not in ("forward", "backward") for _, parts in points[-2:]):
        return None
    (low, first), (high, second) = points[-2:]
    slope = (second["activations_and_temps"] - first["activations_and_temps"]) / (high - low)
    bound = second["params"] + second["optimizer_state"] + second["activations_and_temps"] \
        + slope * (effective_batch - high)
    if search.within(bound):
        return None
    return dataclasses.replace(failed, batch_size=effective_batch, accum_steps=1, optimizer_in_backward=True)

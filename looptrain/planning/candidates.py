"""The plan's search phase: the settings that fit (`search.candidate_settings`) made `Candidate`s, each costed with
its estimate, its epoch's padded tokens, micro-batches and updates under its own batching, and its prior
(`find_candidates`); and a token-cut run's settings (`by_tokens`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from looptrain.estimation.windows import run_windows
from looptrain.planning import packing_lever
from looptrain.planning.plans import Candidate, divisors
from looptrain.planning.request import Request
from looptrain.planning.search import Search, candidate_settings, lightest_split, valid_settings
from looptrain.planning.timing import prior_seconds
from looptrain.strategy import Strategy


@dataclass(frozen=True)
class Searched:
    """The search phase's answer: the candidates that fit, best prior first (the baseline marked), and the fused-step
    splits ruled out by extrapolation without an estimate."""

    candidates: list[Candidate]
    extrapolated: list[Strategy]


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


def costed(search: Search, settings: Strategy, request: Request, as_given: bool = False) -> Candidate:
    """A candidate with its estimate, its epoch's padded tokens and updates (from the lengths alone) and its prior:
    of its batches as `by_tokens` cuts them (`as_given`: the user's own flags, trained as they are)."""
    from looptrain import data as data_module

    peak = search.candidate_peak(settings)
    step_bytes = search.book.step_bytes(settings)
    predicted = not search.memoised(settings)
    # The user's own flags train as given; the safe default is the planner's, and is cut like the rest.
    trained = by_tokens(settings, request.worst_width) if request.token_micro_batches and not as_given else settings
    if settings.batch_packing == "on":  # each window one batch, packed, its rows cut (`packing_lever`)
        trained = packing_lever.trained(settings, search.book.width_of(settings))
        windows = packing_lever.windows(request, trained)
    else:
        loader = data_module.make_train_loader(request.dataset, trained.batch_size, request.collator,
                                               grouping="length" if trained.group_by_length else "random",
                                               seed=request.seed)
        windows = run_windows(loader.batch_sampler, list(request.lengths), request.collator, trained.accum_steps,
                              micro_batch_tokens=trained.micro_batch_tokens)
    shapes = [shape for window in windows for shape in window]
    flops = request.flops
    work = flops.per_batch if flops is not None else lambda rows, width: float(rows * width)
    works = [work(rows, width) for rows, width in shapes]  # each micro-batch's model FLOPs (else padded tokens)
    typical_shape = None
    if shapes:  # the micro-batch of mean work: one priced there prices the epoch's total exactly if time is affine
        mean = sum(works) / len(shapes)
        typical_shape = min(zip(works, shapes), key=lambda pair: (abs(pair[0] - mean), pair[1]))[1]
    candidate = Candidate(settings, peak, padded_tokens=sum(rows * width for rows, width in shapes),
                          micro_batches=len(shapes), typical_shape=typical_shape,
                          flops=sum(works) if flops is not None else 0.0, updates=len(windows),
                          trained=trained if trained != settings else None, predicted=predicted,
                          step_bytes=step_bytes, truncation=search.book.truncation(settings))
    return dataclasses.replace(candidate, prior=prior_seconds(candidate, request.model, request.device_type))


def find_candidates(request: Request, search: Search, known: Candidate | None = None) -> Searched:
    """The search phase: the candidates that fit, with their epoch's padded tokens and updates and their prior, best
    prior first.

    The baseline (the configuration without the planner; when it does not fit, the lightest split) is among
    them, marked, whether or not the search reached it. `known` (the candidate probed before the search) is used
    as it is when its settings are among them, its probe kept.
    """
    found = candidate_settings(search, request.effective_batch, request.base, request.levers, set(request.fixed),
                               request.device_type)
    settings_list = list(found.settings)
    if packing_lever.searchable(request):
        settings_list += packing_lever.variants(search, found.settings, request.effective_batch, request.fixed)
    fallback = lightest_split(request.base, request.effective_batch)
    chosen = next((s for s in (request.baseline, fallback)
                   if s is not None and valid_settings(s) and search.fits_or_spent(s)), None)
    if chosen is not None and chosen not in settings_list:
        settings_list.append(chosen)
    candidates = [known if known is not None and settings == known.settings
                  else costed(search, settings, request, as_given=settings == request.baseline)
                  for settings in settings_list]
    for candidate in candidates:
        candidate.mark_baseline(candidate.settings == chosen)
    return Searched(sorted(candidates, key=lambda candidate: candidate.prior), list(found.extrapolated))


def smaller_split(search: Search, candidate: Candidate, candidates: list[Candidate],
                  request: Request) -> Candidate | None:
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
    return costed(search, smaller, request)

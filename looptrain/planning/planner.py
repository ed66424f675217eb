"""The planner: a memory budget in, the fastest exact training configuration that fits out.

`plan(model, dataset, collator, memory_budget=..., effective_batch=...)` sits above the Loop, beside the estimator,
and drives both, in five phases, each a function that takes values and returns values:

1. **Check** (`request.check`): the arguments checked and resolved into one `Request`; the model prepared as the
   run prepares it (the task's own levers, freezing).
2. **First probe** (`first_probe.first_probe`): the configuration the run would train without the planner (the
   user's split, else the safe default: micro-batch 1, every block checkpointed) is estimated and probed first. Its
   probe predicts the run's time, which bounds planning's (5% of the run by default, at least
   `MIN_PLANNING_SECONDS`), and under a measured meter it measures what the process holds besides tensors, which
   every later candidate is charged (`Budget.with_process`).
3. **Search** (`candidates.find_candidates`): candidates are `looptrain.Strategy` instances, the user's strategy with
   the searched fields replaced; the effective batch never changes. Levers that keep the math are always free (the
   split, gradient checkpointing, the fused step, dynamic padding); levers that change the numerics only when
   allowed (`Levers`); levers that change the task (freezing, LoRA, a shorter max length) are never applied, and
   are suggested when nothing fits (`suggestions`). A candidate fits when its estimate at the dataset's worst batch
   fits the `Budget`; for each precision, optimizer and checkpointing mode the largest micro-batch that fits is
   found (`search`), with estimates memoised, cached on disk and made in forked workers (`book.EstimateBook`).
4. **Rank** (`ranking.rank`): the baseline and the prior's favourite are probed, then others while their probes fit
   planning's time and could pay for themselves; each probe (one real update, `probes`) predicts the epoch's time
   (`timing`). The baseline is replaced only by a candidate predicted at least `KEEP_BASELINE_WITHIN` faster.
5. **Explain** (`explain`): the `Plan`, with every measure and decision in its table, JSON and notes.

The rules and their measurements are in docs/plan.md.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

import looptrain.planning.probes as probes
from looptrain.memory import allocator
from looptrain.planning import packing_lever
from looptrain.planning.book import EstimateBook
from looptrain.planning.candidates import Searched, find_candidates, smaller_split
from looptrain.planning.errors import PlanError
from looptrain.planning.first_probe import FirstProbe, first_probe
from looptrain.planning.plans import MIN_PLANNING_SECONDS, Candidate, Levers, Plan, format_bytes, split_words
from looptrain.planning.ranking import Prober, Ranking, rank
from looptrain.planning.request import Request, check
from looptrain.planning.search import Search, import_optimizers, lightest_split
from looptrain.planning.suggestions import lora_comparison, nothing_fits_message
from looptrain.strategy import Strategy

__all__ = ["plan"]


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
    """Plans the fastest training that fits `memory_budget`, keeping `effective_batch` exact (docs/plan.md, 'Python').

    Args:
        model: the model to train (`base`'s freezing is applied to it in place; probes train it with the learning
            rate at 0 and leave its weights as they were); with `base.lora_rank`, the wrapped `PeftModel`. A config or
            a preset name: estimated only (`probe=False`).
        dataset: the tokenized training set (`lengths` and items; a causal LM's with token labels).
        collator: the run's collator: `batch_width` and `max_length`; probes call it.
        memory_budget: bytes the run's peak may take, by `meter`.
        effective_batch: samples per optimizer update; every candidate keeps it exact.
        base: the user's `Strategy`; every candidate replaces only the fields the planner searches.
        baseline: what the run would train without the planner (default: `base` when its split is the effective
            batch); probed first, replaced only by a candidate at least `KEEP_BASELINE_WITHIN` faster. When it does
            not fit, the safe default stands in: micro-batch 1, every block checkpointed.
        levers: the numerics levers allowed.
        fixed: names of `Strategy` fields the user set explicitly: never changed.
        device: where the run trains.
        epochs: of the planned run (to budget the probes).
        max_grad_norm: the run's clipping (the estimate includes its temporaries).
        margin: the budget share kept free (default `DEFAULT_MARGIN` of the device type).
        probe: measure speeds on this device (False: rank by the prior alone).
        probe_budget: seconds planning may take (default: `probe_fraction` of the run the first probe predicts, at
            least `MIN_PLANNING_SECONDS`); the baseline and the prior's favourite are always probed.
        probe_fraction: see `probe_budget`.
        seed: the run's seed (batching order).
        rss_baseline: with `meter="rss"`: the process's RSS the budget counts from (`rss_baseline_bytes()`).
        meter: what the budget counts: "tensors" (the estimate alone decides), "rss" (the process's peak RSS above
            `rss_baseline`) or "cuda_reserved"; under the last two each candidate's probe must fit too. Default:
            "rss" when `rss_baseline` is given, else "tensors".
        make_lean: under `meter="rss"`: asked to make the C allocator one step leaner while the first probe does not
            fit (`first_probe`; the command line passes `allocator.fix_thresholds`); returns what it did, or None.
        token_micro_batches: train every candidate but your own flags as `candidates.by_tokens` cuts it (False: the
            splits as they are, for several processes, which must run the same micro-batches).
        echo: prints progress lines.

    Returns:
        The `Plan`: candidates that fit, fastest first.

    Raises:
        PlanError: nothing fits; the message lists what would (freezing, LoRA, a shorter max length, levers).
    """
    request = check(model, dataset, collator, memory_budget=memory_budget, effective_batch=effective_batch, base=base,
                    baseline=baseline, margin=margin, meter=meter, rss_baseline=rss_baseline, levers=levers,
                    fixed=fixed, device=device, epochs=epochs, max_grad_norm=max_grad_norm, probe=probe,
                    probe_budget=probe_budget, probe_fraction=probe_fraction, seed=seed, make_lean=make_lean,
                    token_micro_batches=token_micro_batches, echo=echo)
    # The optimizers' libraries are imported here first, once: the probes need them here anyway, and each estimate
    # worker forked after finds them imported instead of paying for it.
    if request.is_module:
        import_optimizers(request.base, request.levers, request.fixed)
    frozen = _freeze_objects(collect=probe and request.meter is not None)
    try:
        with _open_book(request) as book:
            search = Search(book, request.budget)
            first = first_probe(request, search)
            search = search.with_budget(first.budget)
            searched = find_candidates(request, search, first.reference)
            book.limit_time(None)  # what follows (suggestions, LoRA's comparison) is one estimate each
            if not searched.candidates:
                raise PlanError(_nothing_fits(request, search))
            tally = Tally.of(book, first)
            notes, baseline_words = _search_notes(request, first, searched, tally)
            ranked = _rank(request, search, first, searched, tally, baseline_words)
            return explain(request, search, first, searched, ranked, tally, notes, baseline_words)
    finally:
        if frozen:
            gc.unfreeze()


def _open_book(request: Request) -> EstimateBook:
    """The plan's estimate book, its workers started for a real model: the estimates then run in child processes,
    so that what estimating costs (torch's fake-tensor machinery) stays out of this process, whose RSS the budget
    may count."""
    book = EstimateBook(request.model, request.worst_width, max_grad_norm=request.max_grad_norm,
                        num_labels=request.num_labels, echo=request.echo, device_type=request.device_type,
                        padded=request.padded, counts_scratch=request.budget.meter == "rss",
                        packed_width=packing_lever.packed_width(request) if packing_lever.packs(request) else None)
    if request.is_module:
        try:
            book.start_workers()
        except BaseException:
            book.close()
            raise
    return book


@dataclass(frozen=True)
class Tally:
    """The estimates the search made (as the plan reports them), and planning's time as charged so far: the
    estimates and the first probe(s), each at what it cost when computed."""

    estimates: int
    cached: int
    seconds: float
    predictions: int
    skipped: int
    charged: float

    @classmethod
    def of(cls, book: EstimateBook, first: FirstProbe) -> Tally:
        return cls(book.count, book.cached, book.seconds, book.predictions(), book.skipped,
                   book.charged + first.charged)


def _nothing_fits(request: Request, search: Search) -> str:
    """What would fit when nothing does (`nothing_fits_message`), judged by the same meter: under a measured meter
    with nothing measured yet, the process's memory besides the tensors is measured on the lightest settings (one
    row of the longest sample), or every suggestion would be priced as tensors alone."""
    if request.meter is not None and not search.budget.overhead:
        lightest = lightest_split(request.base, request.effective_batch)
        longest = max(range(len(request.lengths)), key=lambda index: request.lengths[index])
        # Stopped at the budget (before a step that would pass it, too): what it holds besides is at least that.
        step_bytes = search.book.step_bytes(lightest)
        probed = probes.probe(request.model, lightest, request.collator([request.dataset[longest]]), request.device,
                              request.max_grad_norm, request.meter, request.budget.bytes, step_bytes)
        search = search.with_budget(search.budget.with_overhead(
            max(0, probed["measured_peak_bytes"] - search.peak(lightest))))
    return nothing_fits_message(search, request.effective_batch, request.base, request.levers, request.collator,
                                list(request.lengths), request.device_type, request.fixed)


def _search_notes(request: Request, first: FirstProbe, searched: Searched, tally: Tally) -> tuple[list[str], str]:
    """The notes on the search (the allocator made leaner, estimates cut short, fused steps ruled out, the baseline,
    the fit rule under a measured meter), and how the table names the baseline."""
    notes, words = [], "your flags"
    if first.malloc is not None:
        notes.append(f"the first probe did not fit under the C allocator's own thresholds, which keep "
                     f"freed blocks resident: {first.malloc}")
    if tally.skipped:
        notes.append(f"the search stopped short of {tally.skipped} estimate(s): planning's time (5% of "
                     "the run its first probe predicts, or --plan-time) was spent, so those splits count "
                     "as not fitting; a longer --plan-time searches further (a rerun on the cache stops "
                     "where this run did)")
    if searched.extrapolated:
        notes.append(f"{len(searched.extrapolated)} fused-step candidate(s) not estimated: the line through "
                     "two estimates of the same settings at smaller micro-batches (activations are affine "
                     "in the rows) puts them over the budget")
    chosen = next((c for c in searched.candidates if c.baseline), None)
    if chosen is None:
        notes.append("neither your flags nor the safe default (micro-batch 1, every block checkpointed) "
                     "fit: every candidate is the planner's")
    elif chosen.settings != request.baseline:
        words = "safe default"
        notes.append(("your flags do not fit" if request.baseline is not None else "no split of yours to start "
                      "from") + "; the baseline is the safe default: micro-batch 1, every block checkpointed")
    budget = first.budget
    if budget.overhead:
        notes.append(f"fits: (estimate + {format_bytes(budget.besides)} the process "
                     f"measured besides tensors + {format_bytes(budget.growth)} for the run's growth) x "
                     f"{1 + budget.margin:.2f} within the budget, and each probe's measured peak + the growth x "
                     f"{1 + budget.margin:.2f}")
    return notes, words


def _rank(request: Request, search: Search, first: FirstProbe, searched: Searched, tally: Tally,
          baseline_words: str) -> Ranking:
    """The rank phase (`ranking.rank`) where the plan probes; else every candidate at its prior, in the prior's
    order."""
    if not request.probes:
        for candidate in searched.candidates:
            candidate.predict(candidate.prior)
        return Ranking(searched.candidates, ["nothing probed: speeds are a prior in arbitrary units (padded tokens, "
                                             "recompute, micro-batch size, precision), not measured"],
                       0.0, request.probe_budget)
    prober = packing_lever.prober(request, Prober(request.model, request.dataset, request.collator, request.order,
                                                  request.device, request.max_grad_norm, request.meter, search.budget,
                                                  request.flops, request.echo,
                                                  seconds_left=_seconds_left(request, first, tally)))

    def smaller(candidate: Candidate, candidates: list[Candidate]) -> Candidate | None:
        return None if "batch_size" in request.fixed else smaller_split(search, candidate, candidates, request)

    return rank(searched.candidates, prober, epochs=request.epochs, probe_budget=request.probe_budget,
                probe_fraction=request.probe_fraction, first_seconds=first.seconds, charged_seconds=tally.charged,
                baseline_words=baseline_words, smaller=smaller)


def _seconds_left(request: Request, first: FirstProbe, tally: Tally) -> float | None:
    """Planning's seconds left when the rank phase starts: its allowance (`--plan-time`, else `probe_fraction` of the
    run the first probe predicts, at least `MIN_PLANNING_SECONDS`) less what the estimates and the first probe
    cost, as charged. None where the first probe timed nothing (no bound to keep)."""
    reference = first.reference
    if request.probe_budget is not None:
        return request.probe_budget - tally.charged
    if reference is None or reference.seconds_per_epoch is None or reference.probe.get("stopped"):
        return None
    return max(request.probe_fraction * reference.seconds_per_epoch * request.epochs,
               MIN_PLANNING_SECONDS) - tally.charged


def explain(request: Request, search: Search, first: FirstProbe, searched: Searched, ranked: Ranking, tally: Tally,
            notes: list[str], baseline_words: str) -> Plan:
    """The explain phase: the `Plan`, each candidate's settings made what the run trains (token cuts, a trimmed
    heap), with the notes in the order the phases made them and, for a LoRA plan, its saving over the full
    fine-tune."""
    notes = notes + ranked.notes + packing_lever.note(ranked.candidates)
    realised = sum(candidate.trained is not None for candidate in ranked.candidates)
    trims = probes.trims(request.meter)
    for candidate in ranked.candidates:
        candidate.realise(lambda settings: probes.as_run(settings, request.meter))
    if trims:
        notes.append("glibc's own malloc thresholds keep freed blocks resident over a run, where a probe "
                     "measured a fresh heap: the run trims the heap before each micro-batch (--trim-heap, "
                     "2-10% of the speed), as its probes did, so that its RSS stays near theirs")
    notes.extend(_cut_probe_notes(ranked.candidates))
    truncated = [c.probe["truncated"] for c in ranked.candidates if c.probe.get("truncated")]
    if truncated:
        notes.append(f"{len(truncated)} probe(s) ran {truncated[0]['depth']} of the model's {truncated[0]['blocks']} "
                     "identical blocks and were scaled to the whole stack: each micro-batch's blocks' seconds "
                     f"x {truncated[0]['blocks'] / truncated[0]['depth']:.1f}, the optimizer step by the parameters, "
                     "the measured peak by what the estimate prices between the two stacks")
    sampled = [c.probe["head_tiles_sampled"] for c in ranked.candidates if c.probe.get("head_tiles_sampled")]
    if sampled:
        notes.append(f"{len(sampled)} probe(s) computed their head's first two vocabulary tiles and one in every "
                     f"{sampled[0]} after, and priced the others at those tiles' seconds per vocabulary row: a "
                     "tile's work is its rows' share of the head's, its memory one tile whichever")
    if realised:
        notes.append(f"{realised} candidate(s) train each window as one batch cut into micro-batches "
                     "of at most (micro-batch x the worst width) padded tokens: short rows run many to a "
                     "micro-batch, within the memory of the split they were estimated and probed as")
    lora, estimates, seconds = None, tally.estimates, tally.seconds
    if request.base.lora_rank:
        comparison = lora_comparison(search, ranked.candidates[0])
        notes.append(comparison.note)
        lora = comparison.lora
        estimates, seconds = estimates + comparison.estimates, seconds + comparison.estimate_seconds
    budget = first.budget
    return Plan(budget.bytes, budget.margin, request.effective_batch, request.worst_width, request.device,
                ranked.candidates, estimates, seconds, ranked.probe_seconds, ranked.probe_budget_seconds,
                len(request.lengths), meter=budget.words, notes=notes, cached_estimates=tally.cached,
                extrapolated=searched.extrapolated, growth_bytes=budget.growth, malloc=first.malloc,
                malloc_threshold_bytes=allocator.fixed_threshold() if first.malloc is not None else None,
                charged_seconds=tally.charged if request.probes else 0.0, baseline_words=baseline_words, lora=lora,
                predictions=tally.predictions, overhead_bytes=budget.overhead)


def _cut_probe_notes(candidates: list[Candidate]) -> list[str]:
    """What planning did not measure where its time left could not pay for a whole probe, and why."""
    def words(candidate: Candidate) -> str:
        return f"{split_words(candidate.settings)} (checkpointing {candidate.settings.checkpointing})"
    lined = [words(c) for c in candidates if c.probe.get("line_only")]
    timed = [words(c) for c in candidates if c.probe.get("memory") and not c.probe.get("line_only")]
    notes = []
    if lined:
        notes.append(f"not probed: {', '.join(lined)}: planning's time left could not pay for a probe, the estimate "
                     "decides the memory with room to spare, and a probe of the same kernels (for a fused step, of "
                     "its settings stepping after backward) drew the line that prices its micro-batches (its "
                     "optimizer step is that probe's)")
    if timed:
        notes.append(f"probed without the worst batch: {', '.join(timed)}: planning's time left could not pay for "
                     "a whole probe, and the estimate decides the memory with room to spare: only the micro-batches "
                     "that price the run were timed")
    return notes


def _freeze_objects(collect: bool) -> bool:
    """Hides every object the process holds from the collector until `plan` returns (`gc.freeze`): the probes'
    collections, which free what each probe made before the next is measured, then scan only what planning made
    (after transformers, peft and bitsandbytes are imported, a full collection scans hundreds of thousands of
    objects: docs/plan.md, 'How "fits" is decided'). The children forked after it share those objects' pages
    untouched. `collect`: a full collection first (once), where probes measure the process's memory, so that garbage
    made before planning is not frozen into their measurements. Returns whether it froze them (not when the caller
    had already: theirs stay frozen)."""
    if gc.get_freeze_count():
        return False
    if collect:
        gc.collect()
    gc.freeze()
    return True

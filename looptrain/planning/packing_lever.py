"""Packing as a lever that keeps the math: each update's samples packed among themselves (``--batch-packing on``).

`--packing` packs the whole data set into rows and counts rows in the effective batch: an update then holds other
samples, and more of them, than the unpacked run's, so the planner never switches it on (docs/causal_lm.md). What
it may switch on is `BatchPackingCollator`'s packing: a packed candidate trains each window (the unpacked run's
``effective batch`` samples, from the same sampler and seed) as one batch whose samples are packed best-fit
decreasing into rows of at most ``--max-length`` tokens, cut into micro-batches of at most (micro-batch x the widest
packed row) tokens. Every update sums the same tokens' losses over the same scored tokens as the unpacked run.

A packed candidate is estimated at its micro-batch of the widest packed row (with the block mask a packed row builds:
`Strategy.packs`), costed over its packed windows, and probed on the widest packed rows. The lever is searched for a
causal LM's token-labelled data set and a real model whose attention keeps packed samples apart
(`packing_problem`), in one process (ranks would pack their own rows), with dynamic padding and without
torch.compile, unless ``batch_packing`` is fixed (``--batch-packing on`` or ``off``) or ``--packing`` is given.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from looptrain.planning.plans import Candidate, divisors
from looptrain.planning.ranking import Prober
from looptrain.strategy import Strategy

_SEARCHABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> its answer, asked once


def searchable(request: Any) -> bool:
    """Whether the plan may pack batches (see the module's docstring); asks the model itself last, once a plan."""
    from looptrain.data.packing import packing_problem

    if request in _SEARCHABLE:
        return _SEARCHABLE[request]
    base, rows = request.base, getattr(request.dataset, "rows", None)
    answer = not ("batch_packing" in request.fixed or base.packing or base.batch_packing != "auto"
                  or getattr(rows, "trained", None) is None or not request.token_micro_batches
                  or not request.is_module or base.padding != "dynamic" or base.compile
                  or not hasattr(request.collator, "pad_id") or not getattr(request.collator, "max_length", None))
    if answer:
        with cache_off(request.model):
            answer = packing_problem(request.model) is None
    _SEARCHABLE[request] = answer
    return answer


def packs(request: Any) -> bool:
    """Whether some candidate of the plan packs its batches: the lever is searched, or fixed on."""
    return request.base.batch_packing == "on" or searchable(request)


class cache_off:
    """``config.use_cache`` off inside the block (transformers then masks packed rows apart), as it was after it."""

    def __init__(self, model: Any):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config = getattr(base, "config", None)

    def __enter__(self) -> None:
        self.was = getattr(self.config, "use_cache", None)
        if self.config is not None:
            self.config.use_cache = False

    def __exit__(self, *exc_info) -> None:
        if self.config is not None:
            self.config.use_cache = self.was


def packing_collator(collator: Any) -> Any:
    from looptrain.data.packing import BatchPackingCollator

    return collator if isinstance(collator, BatchPackingCollator) else BatchPackingCollator(collator)


def window_batches(request: Any, group_by_length: bool) -> list[list[int]]:
    """The run's windows as lists of sample indices (the unpacked run's, one batch of `effective_batch` each)."""
    from looptrain import data as data_module

    loader = data_module.make_train_loader(request.dataset, request.effective_batch, request.collator,
                                           grouping="length" if group_by_length else "random", seed=request.seed)
    return [batch for epoch in range(request.epochs) for batch in loader.batch_sampler.epoch_batches(epoch)]


def packed_rows(request: Any, group_by_length: bool) -> list[list[int]]:
    """Every packed row of the run (its windows packed, each epoch's), as sample indices, longest first."""
    from looptrain.data.packing import pack_best_fit

    lengths, rows = request.lengths, []
    for window in window_batches(request, group_by_length):
        rows += [[window[index] for index in pack]
                 for pack in pack_best_fit([lengths[index] for index in window], request.collator.max_length)]
    return sorted(rows, key=lambda row: -sum(lengths[index] for index in row))


def packed_width(request: Any) -> int:
    """The widest packed row of the run's windows, padded as the collator pads."""
    widest = packed_rows(request, request.base.group_by_length)[0]
    return int(request.collator.batch_width([sum(request.lengths[index] for index in widest)]))


def trained(settings: Strategy, width: int) -> Strategy:
    """A packed split as the run trains it: the window (micro-batch x accumulation samples) as one batch, packed,
    its rows cut into micro-batches of at most micro-batch x `width` (the widest packed row) tokens."""
    window = settings.batch_size * settings.accum_steps
    return dataclasses.replace(settings, batch_size=window, accum_steps=1,
                               micro_batch_tokens=settings.batch_size * width if settings.accum_steps > 1 else 0)


def windows(request: Any, settings: Strategy) -> list[list[tuple[int, int]]]:
    """The micro-batch shapes ``(rows, width)`` of every window of a packed candidate as the run trains it."""
    from looptrain import data as data_module
    from looptrain.estimation.windows import run_windows

    collator = packing_collator(request.collator)
    loader = data_module.make_train_loader(request.dataset, settings.batch_size, collator,
                                           grouping="length" if settings.group_by_length else "random",
                                           seed=request.seed)
    return run_windows(loader.batch_sampler, list(request.lengths), collator, settings.accum_steps,
                       micro_batch_tokens=settings.micro_batch_tokens)


def variants(search: Any, found: Sequence[Strategy], effective_batch: int, fixed: Sequence[str] = ()) -> list[Strategy]:
    """For each setting the search found, the same with batches packed at the largest micro-batch (in packed rows)
    up to its own that fits at the widest packed row (its own alone where the micro-batch is fixed); none where none
    fits."""
    from looptrain.planning.search import largest_fitting

    packed: list[Strategy] = []
    for settings in found:
        template = dataclasses.replace(settings, batch_packing="on")
        sizes = [size for size in divisors(effective_batch) if size <= settings.batch_size
                 and (size == settings.batch_size or "batch_size" not in fixed)]
        if settings.optimizer_in_backward:
            sizes = [effective_batch]
        size = largest_fitting(search, template, sizes, effective_batch).size
        if size is None:
            continue
        variant = dataclasses.replace(template, batch_size=size, accum_steps=effective_batch // size)
        if variant not in packed:
            packed.append(variant)
    return packed


class PackedRows:
    """The packed rows of a run's windows as a data set for the probes: item i is the i-th longest row."""

    def __init__(self, request: Any, rows: list[list[int]]):
        from looptrain.data.packing import concatenated

        self.dataset, self.rows, self.concatenated = request.dataset, rows, concatenated
        self.lengths = [sum(request.lengths[index] for index in row) for row in rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        samples = [self.dataset[sample] for sample in self.rows[index]]
        return self.concatenated([(sample["input_ids"], sample["labels"]) for sample in samples])


@dataclass(frozen=True, eq=False)
class PackingProber(Prober):
    """A `Prober` that probes packed candidates on the widest packed rows (`packed`), the model's cache off."""

    packed: Prober | None = None

    def probe(self, candidate: Candidate, candidates: list[Candidate]) -> None:
        if candidate.settings.batch_packing != "on" or self.packed is None:
            return super().probe(candidate, candidates)
        with cache_off(self.model):
            return self.packed.probe(candidate, candidates)


def prober(request: Any, plain: Prober) -> Prober:
    """`plain`, or where the plan may pack batches a `PackingProber` beside it."""
    if not packs(request):
        return plain
    from looptrain.data.packing import PackedCollator

    rows = PackedRows(request, packed_rows(request, request.base.group_by_length))
    collator = PackedCollator(request.collator.pad_id, request.collator.max_length,
                              request.collator.pad_to_multiple_of)
    fields = {spec.name: getattr(plain, spec.name) for spec in dataclasses.fields(Prober) if spec.init}
    packed = dataclasses.replace(plain, dataset=rows, collator=collator, order=list(range(len(rows))), batches={})
    return PackingProber(**{**fields, "batches": {}}, packed=packed)


def note(candidates: Sequence[Candidate]) -> list[str]:
    """The plan's note on packing where a candidate packs its batches."""
    if not any(candidate.settings.batch_packing == "on" for candidate in candidates):
        return []
    return ["batches packed (--batch-packing on): each update's samples, the unpacked run's, packed best-fit "
            "decreasing into rows of at most --max-length tokens and cut into micro-batches of at most "
            "(micro-batch x the widest packed row) tokens: the same math, estimated and probed on the widest "
            "packed rows"]

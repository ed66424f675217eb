"""What the planner says besides its ranking: what would fit when nothing does (`nothing_fits_message`: the lightest
split plus one task or numerics change, LoRA and QLoRA included), and how much a LoRA plan saves over the full
fine-tune with the same settings (`lora_comparison`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from looptrain.planning.book import FULL_FINE_TUNE, full_fine_tune_model
from looptrain.planning.plans import Candidate, Levers, format_bytes, lora_words
from looptrain.planning.search import Search, lightest_split, valid_settings
from looptrain.precision import amp_precision, resolve_device
from looptrain.strategy import Strategy

# LoRA: the rank suggested when nothing fits, and the share of the full fine-tune's peak below which a LoRA
# plan's saving is called small (activations dominate: a small model, or long sequences).
LORA_SUGGESTED_RANK = 16
LORA_SMALL_SAVING = 0.2
LORA_LEVERS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "qlora")


def nothing_fits_message(search: Search, effective_batch: int, base: Strategy, levers: Levers, collator, lengths,
                          device_type: str, fixed: frozenset = frozenset()) -> str:
    """What would fit, with its estimate: the lightest exact settings plus one task or numerics change, each priced
    at the lighter of micro-batch 1 and the step fused into backward (`lightest_peak`), as the search would try
    them."""
    fusable = "optimizer_in_backward" not in fixed and "batch_size" not in fixed
    lightest = lightest_split(base, effective_batch)
    suggestions = []
    if not levers.optimizer_family and base.optimizer == "adamw":
        suggestions.append(("--optim auto (8-bit AdamW)", dataclasses.replace(lightest, optimizer="adamw8bit"), None))
    fast = amp_precision(resolve_device(device_type))[0]
    if not levers.precision and base.precision == "fp32":
        suggestions.append(("--amp", dataclasses.replace(lightest, precision=fast), None))
    if base.weights == "fp32" and fast == "bf16":
        suggestions.append(("--weights bf16", dataclasses.replace(lightest, precision="bf16", weights="bf16"), None))
    if not base.lora_rank:  # freezing and LoRA do not mix (LoRA freezes the whole base)
        blocks = block_count(search.book.model)
        for count in sorted({blocks // 2, blocks - 1} - {0}) if blocks else []:
            suggestions.append((f"--freeze-layers {count}",
                                dataclasses.replace(lightest, freeze_layers=count, freeze_encoder=False), None))
        suggestions.append(("--freeze-encoder",
                            dataclasses.replace(lightest, freeze_encoder=True, freeze_layers=0,
                                                freeze_embeddings=False), None))
    adapters = lora_suggestions(search, base, lightest)
    width = search.book.width
    if width > 16:
        suggestions.append((f"--max-length {width // 2}", lightest, width // 2))
    entries = [(*suggestion, None) for suggestion in suggestions] + adapters
    # Side by side where there are workers: each suggestion at micro-batch 1, then the fused step of those over.
    plain = [lightest] + [settings for _, settings, seq_len, model in entries if seq_len is None and model is None]
    search.prefetch_all(plain)
    if fusable:
        search.prefetch_all([fused_split(settings, effective_batch) for settings in plain
                             if search.memoised(settings) and may_fit_fused(search, settings)
                             and valid_settings(fused_split(settings, effective_batch))])
    peak, fused = lightest_peak(search, lightest, effective_batch, fusable)
    meter = "of CUDA reserved memory" if device_type == "cuda" else "of the process's RSS"
    budget = search.budget
    lines = [f"nothing fits {format_bytes(budget.bytes)} (with a {budget.margin:.0%} margin) at the worst "
             f"batch ({width} tokens wide), even micro-batch 1 x {effective_batch} with gradient checkpointing: "
             f"estimated {format_bytes(search.peak(lightest))}"
             + (f" ({format_bytes(peak)} with the step fused into backward at {effective_batch} x 1)" if fused else "")
             + (f" + {format_bytes(budget.overhead)} {meter} measured besides tensors" if budget.overhead else "")
             + "."]
    fitting, lora_over = [], []
    for label, settings, seq_len, model in entries:
        try:
            peak, fused = lightest_peak(search, settings, effective_batch, fusable, seq_len, model)
        except Exception as error:  # LoRA: any estimate that cannot run here (QLoRA without 4 bits)
            if isinstance(error, (ValueError, TypeError)) or model is not None or settings.lora_rank:
                continue  # an invalid mix
            raise
        if search.within(peak):
            fitting.append(f"fits with {label} (est. {format_bytes(peak)}"
                           + (f" with the step fused into backward at {effective_batch} x 1)" if fused else ")"))
        elif (label, settings, seq_len, model) in adapters:
            lora_over.append(f"{label} (est. {format_bytes(peak)})")
    lines.append("; ".join(fitting) + "." if fitting else "None of --amp, --optim auto, freezing, LoRA or a halved "
                 "--max-length fits either: raise the budget.")
    if lora_over:
        lines.append(f"Not enough: {', '.join(lora_over)}.")
    return " ".join(lines)


def lightest_peak(search: Search, settings: Strategy, effective_batch: int, fusable: bool, seq_len: int | None = None,
                  model: str | None = None) -> tuple[int, bool]:
    """The estimate of `settings` (a micro-batch-1 split), or where that does not fit the budget and the fused step is
    free (`fusable`), the lighter of it and the step fused into backward at the whole batch, which holds no
    gradients but every row's activations: (peak, whether the fused step's). An invalid fused mix (a clipping mode
    the fused step refuses) or one whose estimate cannot run here is left out."""
    peak = search.peak(settings, seq_len, model)
    if not fusable or not may_fit_fused(search, settings, seq_len, model):
        return peak, False
    fused = fused_split(settings, effective_batch)
    if not valid_settings(fused):
        return peak, False
    try:
        fused_peak = search.peak(fused, seq_len, model)
    except (ValueError, TypeError):
        return peak, False
    return (fused_peak, True) if fused_peak < peak else (peak, False)


def may_fit_fused(search: Search, settings: Strategy, seq_len: int | None = None, model: str | None = None) -> bool:
    """Whether the step fused into backward might fit where `settings` (estimated) do not: they do not fit, and the
    weights and optimizer state of their estimate, which the fused step holds too, do."""
    if search.within(search.peak(settings, seq_len, model)):
        return False
    breakdown = search.book.results.get(search.book.key(settings, seq_len, model), {}).get("memory_breakdown", {})
    return search.within(breakdown.get("params", 0) + breakdown.get("optimizer_state", 0))


def fused_split(settings: Strategy, effective_batch: int) -> Strategy:
    """`settings` with the step fused into backward: the whole batch in one micro-batch."""
    return dataclasses.replace(settings, batch_size=effective_batch, accum_steps=1, optimizer_in_backward=True)


def lora_suggestions(search: Search, base: Strategy, lightest: Strategy) -> list[tuple]:
    """LoRA's suggestions when nothing fits: (label, settings, None, model to estimate or None).

    Without LoRA: LoRA and QLoRA of rank `LORA_SUGGESTED_RANK` (freezing dropped: LoRA freezes the base).
    With LoRA but not QLoRA: ``--qlora``, estimated on the unwrapped base (a wrapped model is not quantized again).
    """
    if base.qlora:
        return []
    if base.lora_rank:
        if full_fine_tune_model(search.book.model) is None:
            return []
        return [("--qlora", dataclasses.replace(lightest, qlora=True), None, FULL_FINE_TUNE)]
    frozen = [name for name in ("freeze_embeddings", "freeze_layers", "freeze_encoder")
              if getattr(lightest, name) != Strategy.__dataclass_fields__[name].default]
    lora = dataclasses.replace(lightest, lora_rank=LORA_SUGGESTED_RANK,
                               **{name: Strategy.__dataclass_fields__[name].default for name in frozen})
    dropped = f" (without --{', --'.join(name.replace('_', '-') for name in frozen)})" if frozen else ""
    return [(f"--lora {LORA_SUGGESTED_RANK}{dropped}", lora, None, None),
            (f"--lora {LORA_SUGGESTED_RANK} --qlora{dropped}", dataclasses.replace(lora, qlora=True), None, None)]


@dataclass(frozen=True)
class LoraComparison:
    """`lora_comparison`'s answer: `Plan.lora` (None when the estimate could not run), the note, and the estimates
    it made and their seconds (the plan counts them)."""

    lora: dict | None
    note: str
    estimates: int
    estimate_seconds: float


def lora_comparison(search: Search, winner: Candidate) -> LoraComparison:
    """The LoRA winner against the full fine-tune with the same settings, at the worst batch: one more estimate.

    Its `lora`: both estimates, the saving, whether the full fine-tune fits the budget too; its note says so, and
    when LoRA saves less than `LORA_SMALL_SAVING` of the full fine-tune's peak (activations dominate: a small model,
    long sequences), that it is small. An estimate that cannot run gives a note and nothing else.
    """
    settings = dataclasses.replace(winner.settings, **{name: Strategy.__dataclass_fields__[name].default
                                                       for name in LORA_LEVERS})
    flags = " ".join(settings.flags())
    book = search.book
    started, count = book.seconds, book.count
    try:
        if full_fine_tune_model(book.model) is None:
            raise ValueError("a 4-bit model without a transformers config")
        full = search.peak(settings, model=FULL_FINE_TUNE)
    except Exception as error:  # noqa: BLE001  a report: never a reason to fail the plan
        return LoraComparison(None, f"no comparison of {lora_words(winner.settings)} with a full fine-tune "
                              f"({type(error).__name__}: {error})", book.count - count, book.seconds - started)
    saving = full - winner.estimated_peak_bytes
    share = saving / full if full else 0.0
    fits = search.within(full)
    lora = {"settings": dataclasses.asdict(winner.settings), "estimated_peak_bytes": winner.estimated_peak_bytes,
            "full_fine_tune_flags": settings.flags(), "full_fine_tune_peak_bytes": full,
            "saving_bytes": saving, "saving_share": round(share, 4), "full_fine_tune_fits": fits,
            "small_saving": share < LORA_SMALL_SAVING}
    words = lora_words(winner.settings)
    if saving <= 0:
        amount = f"{words} saves nothing"
    else:
        amount = f"{words} saves {'only ' if share < LORA_SMALL_SAVING else ''}{format_bytes(saving)} ({share:.0%})"
    text = (f"{amount} over the full fine-tune with the same settings ({flags}: est. {format_bytes(full)}, "
            f"{words} est. {format_bytes(winner.estimated_peak_bytes)}) at this length ({book.width} tokens)")
    if share < LORA_SMALL_SAVING:
        text += (": the activations dominate the peak, and LoRA trims only the weights' gradients and optimizer "
                 "state; " + ("the full fine-tune fits the budget too (drop --lora to train every weight)" if fits
                              else "still, with these settings only LoRA fits the budget"))
    return LoraComparison(lora, text, book.count - count, book.seconds - started)


def block_count(model: Any) -> int:
    from looptrain.freeze import find_transformer_blocks

    try:
        return len(find_transformer_blocks(model))
    except (ValueError, TypeError):
        return 0

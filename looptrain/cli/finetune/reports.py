"""What a run reports: the end-of-run table (with the budget's note), and what would fit after an out-of-memory
error."""

from __future__ import annotations

from pathlib import Path

from looptrain.cli.finetune.arguments import strategy_of


class OutOfMemory(Exception):
    """Training ran out of memory and `--auto-batch` could not (or was not asked to) recover."""


def what_would_fit(model_config, flags, precision: str, device) -> str:
    """Estimated peaks (looptrain.estimation.estimate) of this run and of a few lighter flag sets."""
    import torch

    from looptrain import estimation
    from looptrain.precision import amp_precision

    current = {"precision": precision}  # this run's levers are strategy_of(flags), with its resolved precision
    batch, accum = flags.batch_size, flags.accum_steps
    candidates = [("these flags", batch, current)]
    if batch > 1:
        candidates.append((f"--batch-size {batch // 2} --accum {accum * 2} (or --auto-batch)", batch // 2,
                           {**current, "accum_steps": accum * 2}))
    if not flags.gradient_checkpointing:
        candidates.append(("+ --grad-checkpoint", batch, {**current, "gradient_checkpointing": True}))
    if flags.optimizer == "adamw":
        candidates.append(("+ --optim adamw8bit", batch, {**current, "optimizer": "adamw8bit"}))
    if precision == "fp32":
        amp = amp_precision(device)[0]  # what --amp would train in here: fp32 on a CPU where bf16 measured slow
        if amp != "fp32":
            candidates.append(("+ --amp", batch, {**current, "precision": amp}))
        else:
            candidates.append(("+ --precision bf16 (slower than fp32 on this CPU)", batch,
                               {**current, "precision": "bf16"}))
    if flags.weights == "fp32":
        candidates.append(("+ --weights bf16", batch, {**current, "precision": "bf16", "weights": "bf16"}))
    budget = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    lines = [f"  estimated peak of live tensors at --max-length {flags.max_length} (looptrain.estimation.estimate"
             + (f"; this GPU has {budget / 2**30:.1f} GiB)" if budget else ")") + ":"]
    for label, micro_batch, options in candidates:
        try:
            peak = estimation.estimate(model_config, micro_batch, flags.max_length, strategy_of(flags, **options),
                                     num_labels=model_config.num_labels, max_grad_norm=flags.max_grad_norm,
                                     device=device.type)["peak_memory_bytes"]
        except Exception as error:  # noqa: BLE001 (advice printed while reporting an OOM: must never mask it)
            lines.append(f"    {label}: no estimate ({type(error).__name__}: {error})")
            continue
        verdict = "" if budget is None else ("  fits" if peak < 0.9 * budget else "  does not fit")
        lines.append(f"    {label}: {peak / 2**20:.1f} MiB{verdict}")
    return "\n".join(lines)


def final_table(summary: dict, baseline: dict | None, output_dir: Path) -> str:
    language_model = summary.get("task") == "causal-lm"
    header = "| | model | |" if language_model else "| | model | majority class |"
    lines = [f"\nlooptrain run in {output_dir}", header, "|---|---|---|"]
    evaluation = summary.get("final_eval")
    if evaluation:
        for key, label in () if language_model else (("accuracy", "accuracy"), ("f1", "macro-F1")):
            base = f"{baseline[key]:.4f}" if baseline else "-"
            lines.append(f"| {label} | {evaluation[key]:.4f} | {base} |")
        lines.append(f"| eval loss | {evaluation['loss']:.4f} | |")
        if "perplexity" in evaluation:
            lines.append(f"| eval perplexity | {evaluation['perplexity']:.4f} | |")
    lines.append(f"| train time | {summary['train_runtime_s']:.1f} s | |")
    lines.append(f"| samples/s | {summary['train_samples_per_s']:.2f} | |")
    if summary.get("mfu") is not None:  # model FLOP/s over the peak measured on this device (docs/speed.md)
        lines.append(f"| MFU | {summary['mfu']:.1%} ({summary['model_flops_per_s'] / 1e9:.2f} GFLOP/s of the "
                     f"{summary['peak_flops_dtype']} matmul peak {summary['peak_flops_per_s'] / 1e9:.1f} GFLOP/s "
                     f"on {summary['peak_flops_device']}) | |")
    lines.append(f"| optimizer steps (skipped) | {summary['optimizer_steps']} ({summary['skipped_steps']}) | |")
    peak = summary.get("peak_memory_bytes")
    unfreeze = summary.get("unfreeze")
    if peak is not None:
        stage = f", last unfreezing stage ({unfreeze['stage']}/{unfreeze['stages']})" if unfreeze else ""
        if summary.get("untracked_updates"):  # the tracker set aside the updates tracked ones cover (docs/memory.md)
            tracked = summary["tracked_updates"]
            stage += (f"; {tracked} of {tracked + summary['untracked_updates']} updates tracked, the others' "
                      "micro-batches no larger")
        lines.append(f"| peak memory | {peak / 2**20:.1f} MiB ({summary['memory_meter']}{stage}) | |")
    if summary.get("estimated_peak_bytes"):
        lines.extend(_estimate_rows(summary))
    elif summary.get("estimate_missing"):  # the run's own estimate failed, or was not ready in time
        lines.append(f"| estimated peak (worst batch) | missing ({summary['estimate_missing']}) | |")
    if summary.get("plan"):
        lines.append(f"| memory budget | {summary['plan']['budget_bytes'] / 2**20:.1f} MiB "
                     f"{summary['plan'].get('meter', '')} (plan: {summary['plan']['settings']['batch_size']} x "
                     f"{summary['plan']['settings']['accum_steps']}) | |")
    if summary.get("planning_seconds") is not None:
        share = summary["planning_seconds"] / max(summary["planning_seconds"] + summary["train_runtime_s"], 1e-9)
        lines.append(f"| planning | {summary['planning_seconds']:.1f} s (estimates "
                     f"{summary['planning_estimate_seconds']:.1f} s, probes {summary['planning_probe_seconds']:.1f} s;"
                     f" {share:.1%} of planning + training) | |")
    rss, start = summary.get("peak_rss_bytes"), summary.get("rss_at_start_bytes")
    if rss:
        above = f"; {(rss - start) / 2**20:.1f} MiB above the {start / 2**20:.1f} MiB held at start" if start else ""
        lines.append(f"| peak RSS | {rss / 2**20:.1f} MiB (process, OS{above}) | |")
    lines.extend(_budget_note(summary.get("plan"), rss, start))
    if summary.get("best_checkpoint"):
        lines.append(f"| best checkpoint | {summary['best_checkpoint']} ({summary['best_metric']:.4f}) | |")
    return "\n".join(lines)


def training_peak_bytes(summary: dict) -> int | None:
    """The measured peak of training alone: the tensor meter's highest phase but "eval"; a meter of one peak (CUDA's)
    gives it unless evaluation holds that peak. None for a meter of RSS, which counts more than tensors."""
    if summary.get("memory_meter") == "cpu_rss_delta" or summary.get("peak_memory_bytes") is None:
        return None
    phases = summary.get("phase_peak_bytes")
    if phases:
        return max((peak for phase, peak in phases.items() if phase != "eval"), default=None)
    if (summary.get("memory_breakdown") or {}).get("peak_phase") == "eval":
        return None
    return summary["peak_memory_bytes"]


def evaluation_peak_bytes(summary: dict) -> int | None:
    """The measured peak of evaluation alone: the tensor meter's "eval" phase; a meter of one peak (CUDA's) gives
    it when evaluation holds that peak. None for a meter of RSS, or a run that did not evaluate."""
    if summary.get("memory_meter") == "cpu_rss_delta" or summary.get("peak_memory_bytes") is None:
        return None
    phases = summary.get("phase_peak_bytes")
    if phases:
        return phases.get("eval")
    return summary["peak_memory_bytes"] if (summary.get("memory_breakdown") or {}).get("peak_phase") == "eval" \
        else None


def _error(measured: int | None, estimated: int | None) -> float | None:
    """(measured - estimated) / estimated, or None where either is unknown."""
    return round((measured - estimated) / estimated, 4) if estimated and measured is not None else None


def estimate_errors(summary: dict) -> dict:
    """Each measured peak beside its estimate's error, like with like, on a meter of tensors (never the RSS rise):

    - ``training_peak_bytes`` / ``evaluation_peak_bytes``: the measured peaks apart (None where not known);
    - ``training_estimate_error`` / ``evaluation_estimate_error``: each against its own estimate
      (``estimated_training_peak_bytes``, ``estimated_evaluation_peak_bytes``);
    - ``estimate_error``: the run's peak against ``estimated_peak_bytes``, the higher of the two estimates; where
      evaluation was not estimated, training's error (the estimate then leaves evaluation out).
    """
    training, evaluation = training_peak_bytes(summary), evaluation_peak_bytes(summary)
    estimated_training = summary.get("estimated_training_peak_bytes", summary.get("estimated_peak_bytes"))
    estimated_evaluation = summary.get("estimated_evaluation_peak_bytes")
    whole = summary["peak_memory_bytes"] if training is not None or evaluation is not None else None
    return {
        "training_peak_bytes": training, "evaluation_peak_bytes": evaluation,
        "training_estimate_error": _error(training, estimated_training),
        "evaluation_estimate_error": _error(evaluation, estimated_evaluation),
        "estimate_error": (_error(whole, summary.get("estimated_peak_bytes")) if estimated_evaluation is not None
                           else _error(training, estimated_training)),
    }


def _estimate_rows(summary: dict) -> list[str]:
    """The estimate's row (the run's peak against it), each phase's peak beside its estimate and, when evaluation
    was not estimated and peaked above training, a note."""
    if summary.get("estimate_error") is not None:
        error = f"error {summary['estimate_error']:+.1%}"
    elif summary.get("memory_meter") == "cpu_rss_delta":
        error = "live tensors; this run's meter is RSS, so no error: --budget-meter tensors measures them"
    else:
        error = "no error: evaluation holds this meter's one peak, and training's own is not known"
    rows = [f"| estimated peak (worst batch) | {summary['estimated_peak_bytes'] / 2**20:.1f} MiB ({error}) | |"]
    training, evaluation = training_peak_bytes(summary), evaluation_peak_bytes(summary)
    estimated_evaluation = summary.get("estimated_evaluation_peak_bytes")
    if estimated_evaluation is not None:
        batch = f" at batch {summary['evaluation_batch_size']}" if summary.get("evaluation_batch_size") else ""
        for label, measured, estimated, key in (
                ("training peak", training, summary.get("estimated_training_peak_bytes"), "training_estimate_error"),
                (f"evaluation peak{batch}", evaluation, estimated_evaluation, "evaluation_estimate_error")):
            shown = "-" if measured is None else f"{measured / 2**20:.1f} MiB"
            error = f" (error {summary[key]:+.1%})" if summary.get(key) is not None else ""
            rows.append(f"| {label} | {shown}, estimated {estimated / 2**20:.1f} MiB{error} | |")
    elif training is not None and evaluation is not None and evaluation > training:
        rows.append(f"| note | evaluation peaked at {evaluation / 2**20:.1f} MiB, above training's "
                    f"{training / 2**20:.1f} MiB; evaluation is not in the estimate (--eval-batch-size lowers it) | |")
    scratch = summary.get("estimated_kernel_scratch_bytes")
    if scratch:
        rows.append(f"| held inside bf16 matmuls (RSS, no tensor) | {scratch / 2**20:.1f} MiB above the estimated "
                    "peak: this CPU computes bf16 in an fp32 buffer of each output | |")
    return rows


def _budget_note(plan: dict | None, rss: int | None, start: int | None) -> list[str]:
    """A table row saying why the process's RSS above its start went over a planned run's budget."""
    if not (plan and rss and start) or rss - start <= plan["budget_bytes"]:
        return []
    over = f"RSS above start {(rss - start) / 2**20:.1f} MiB > budget {plan['budget_bytes'] / 2**20:.1f} MiB"
    if plan.get("meter") != "of live tensors":
        why = ("the plan's probes measured one update at the worst batch; evaluation, checkpoint saving and the "
               "allocator's growth over the run came on top (docs/plan.md)")
    else:
        why = ("the budget was of live tensors (the peak memory above); RSS also holds the libraries' buffers, the "
               "data and allocator caches: plan with --budget-meter rss (the default) for a budget of RSS "
               "(docs/plan.md)")
    return [f"| note | {over}: {why} | |"]

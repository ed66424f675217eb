"""One run of `finetune.py`: its inputs loaded, the plan applied, the loaders, optimizer and Loop built; trained,
evaluated and saved."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from looptrain.cli.console import Console, say, speaking
from looptrain.cli.errors import UsageError
from looptrain.cli.finetune.arguments import loop_config, strategy_of
from looptrain.cli.finetune.budget import plan_only_output, planned_evaluation, planned_request
from looptrain.cli.finetune.inputs import (
    Inputs,
    embedded_model_path,
    load_inputs,
    load_weights,
    quiet_peft,
    run_identity,
)
from looptrain.cli.finetune.reports import OutOfMemory, estimate_errors, final_table, what_would_fit
from looptrain.cli.recipe import write_recipe

RUN_RECIPE = "config.yaml"  # beside run_config.json: the --config recipe that trains the run again

if TYPE_CHECKING:
    from looptrain.cli.finetune.own_estimate import RunEstimate
    from looptrain.cli.finetune.request import RunRequest


def build_scheduler(optimizer, flags, total_steps: int):
    """--scheduler after --warmup-ratio of the updates."""
    import torch

    warmup = int(round(total_steps * flags.warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if flags.scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if flags.scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return max(0.0, 1.0 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------- the run
def run(request: RunRequest) -> dict:
    """The command line's run (a `RunRequest`): the output directory locked and checked first, then `train`.

    Every message goes through this rank's console: rank 0 speaks (to stderr with --plan-only --json, whose stdout
    holds the JSON alone), the other ranks stay silent.
    """
    from transformers.utils import logging as hf_logging

    from looptrain import distributed

    hf_logging.disable_progress_bar()  # no "Loading weights" / "Writing model shards" bars: the loop reports progress
    place = distributed.init_distributed(request.flags.device)  # under torchrun: join the group before samplers
    with speaking(Console(speaks=place.is_main, to_stderr=request.flags.json)):
        return _run_in_place(request, place)


def _run_in_place(request: RunRequest, place) -> dict:
    from looptrain import ledger
    from looptrain.config import check_process_group

    flags = request.flags
    if request.process.capped_kernel_caches:
        say(f"--memory-budget: {request.process.capped_kernel_caches}")
    model_path = flags.adapter["base"] if flags.adapter else flags.model  # an adapter trains on its base
    if model_path is None:
        model_path = str(embedded_model_path())
        os.environ["HF_HUB_OFFLINE"] = "1"  # the embedded model is loaded by path, never from a hub
    config = loop_config(request, run_identity(flags, model_path, place.world_size))  # validates every option
    check_process_group(config, place.world_size, sharded=flags.fsdp, optimizer_name=flags.optimizer)
    request = dataclasses.replace(request, model_path=model_path, config=config)
    if flags.plan_only:  # nothing is written: no lock, no ledger
        return train(request, place)
    output_dir = Path(config.output_dir)
    if place.is_main:
        check_writable(output_dir)
    with ledger.OutputDirLock(output_dir, echo=say) if place.is_main else contextlib.nullcontext():
        if place.is_main:  # the output directory's verdict before any data or model is read, asked once: the Loop
            # holding the same lock is given this verdict (`looptrain.ledger.RunLedger.begin`)
            verdict = ledger.RunLedger(output_dir, echo=say).begin(config.identity(), config.resume, config.overwrite)
            if verdict["action"] == "finished":
                if not (output_dir / "final").is_dir():
                    say(missing_final_notice(output_dir))
                return {**ledger.finished_run_summary(output_dir, echo=say), "interrupted": None}
        return train(request, place)


def missing_final_notice(output_dir: Path) -> str:
    """What to do with a run whose run.json says finished but which has no final/: a looptrain before final/ was
    published atomically marked a run finished before writing it, so a kill during that write left this."""
    from looptrain.checkpoint import latest_checkpoint

    latest = latest_checkpoint(output_dir)
    again = (f"continue from its newest checkpoint with --resume {latest} (it trains the last updates again and "
             "writes final/)" if latest is not None else "it saved no checkpoint: train it again with --overwrite "
             "(which moves these files aside)")
    return (f"warning: the run in {output_dir} is recorded as finished but has no final/ (its write was cut off); "
            f"{again}")


def check_writable(output_dir: Path) -> None:
    """The output directory can be created and takes a file, or a UsageError naming it. The directories made to
    find out are removed again: the run's lock creates them (`looptrain.ledger.OutputDirLock`), and removes them
    if the run writes nothing."""
    import tempfile

    from looptrain.ledger import missing_directories

    missing = missing_directories(output_dir)  # the deepest first
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as error:
        raise UsageError(f"--output-dir {output_dir} is not writable ({error.strerror or error}): pass a directory "
                         "you can write to (e.g. --output-dir runs/exp1)") from None
    finally:
        for directory in missing:
            with contextlib.suppress(OSError):
                directory.rmdir()


def train(request: RunRequest, place) -> dict:
    """Everything after the output directory's checks: data, model, the Loop, final/ and the tables."""
    from looptrain import distributed, memory
    from looptrain import loop as loop_module
    from looptrain.cli.finetune.own_estimate import announcing
    from looptrain.guards import OUT_OF_MEMORY_ERRORS
    from looptrain.precision import amp_precision, resolve_device, resolve_precision
    from looptrain.report import report_after_run
    from looptrain.seeding import seed_everything

    config = request.config
    device = distributed.device_for(resolve_device(config.device), place)
    if config.precision == "auto" and request.budget is None and config.weights == "fp32":
        say(amp_precision(device)[1])
    elif config.weights == "bf16":  # the weights decide: bf16 compute, whatever --amp would pick on this CPU
        say("--weights bf16: the forward and backward compute in bf16 (the weights are bf16)")
    output_dir = Path(config.output_dir)
    seed_everything(config.seed)
    inputs = load_inputs(request.flags, request.model_path)

    plan_result = None
    if request.budget is not None:
        request, plan_result = planned_request(request, inputs.model, inputs.train_set, inputs.collator, device,
                                               output_dir)
        request, plan_result = planned_evaluation(request, plan_result, inputs.model, inputs.eval_set,
                                                  inputs.collator, device, place)
        if request.budget.plan_only:
            return plan_only_output(request, plan_result)
        if plan_result is not None and plan_result.meter != "of live tensors" and request.config.track_memory \
                and device.type == "cpu":
            # The budget is read by the OS, and the plan's speeds were probed without the tensor tracker, whose
            # Python hook on every op slows small micro-batches (docs/plan.md): the run meters what the plan did.
            # (On CUDA the allocator meters the run either way.)
            request = dataclasses.replace(request, config=dataclasses.replace(request.config, track_memory=False))
            say("--memory-budget: the run's meter is the budget's (process RSS); the tensor tracker is off "
                "(--budget-meter tensors keeps it, with its breakdown)")
    config = request.config
    precision = resolve_precision(config.compute_precision, device)
    train_loader, eval_loader, estimate = make_loaders(request, place, inputs, plan_result)
    try:  # the estimate's child (if one computes it) never outlives the run: interrupts, errors, the end
        optimizer, scheduler = build_optimization(request, inputs.model, device, len(train_loader))
        prepare_output_dir(request, place, inputs.model, precision, device, plan_result)

        def save_final(summary: dict) -> dict:  # before run.json says "finished" (`looptrain.run.Run.finish`)
            estimated = estimate.collect(summary["train_runtime_s"])  # waits for it a little at most
            summary = summary_of_run(summary, request, inputs, plan_result, estimated, estimate.waited_seconds)
            summary["estimate_missing"] = estimate.missing  # why a run that prices itself has no estimate
            write_final(request, place, inputs, output_dir / "final")
            return summary

        loop = announcing(loop_module.Loop)(inputs.model, optimizer, train_loader, eval_loader=eval_loader,
                                            scheduler=scheduler, config=config, save_final=save_final)
        loop.run_estimate = estimate
        try:
            summary = loop.fit()
        except OUT_OF_MEMORY_ERRORS as error:
            raise OutOfMemory(f"{error}\n{what_would_fit(inputs.model.config, request.flags, precision, loop.device)}"
                              ) from error
    finally:
        estimate.close()
    if summary["interrupted"]:
        return summary  # a checkpoint was saved; no final/ for an unfinished run
    say(final_table(summary, summary["majority_baseline"], output_dir))
    say(memory.format_memory_table(summary))
    if place.is_main:  # the picture of the run (rank 0 alone), or a notice: never a reason to fail a finished run
        say(report_after_run(output_dir))
    distributed.barrier()
    return summary


def make_loaders(request: RunRequest, place, inputs: Inputs, plan_result):
    """The train loader, the eval loader, this run's memory estimate over their batches (`run_estimate`: a
    `RunEstimate`, perhaps still computing beside the first updates); says the padding."""
    import torch

    from looptrain import data as data_module
    from looptrain.cli.finetune.inputs import train_collator

    flags, config = request.flags, request.config
    grouping = "tokens" if flags.max_tokens else ("length" if flags.group_by_length else "random")
    train_loader = data_module.make_train_loader(
        inputs.train_set, flags.batch_size, train_collator(flags, inputs.model, inputs.collator), grouping=grouping,
        max_tokens=flags.max_tokens,
        seed=config.seed, num_workers=flags.num_workers, pin_memory=torch.cuda.is_available())
    eval_loader = None
    if inputs.eval_set is not None:  # under --memory-budget, at the batch the plan fitted (`planned_evaluation`)
        eval_loader = data_module.make_eval_loader(
            inputs.eval_set, flags.eval_batch_size, inputs.collator, num_workers=flags.num_workers,
            num_replicas=place.world_size, rank=place.rank)
    _, padding_line = data_module.padding_stats(
        train_loader, inputs.train_set.lengths, padding=flags.padding, max_length=flags.max_length,
        pad_to_multiple_of=flags.pad_to_multiple_of)
    rows = "rows of packed samples" if flags.packing else "samples"
    packed = ", packed" if flags.packing else ""
    if flags.batch_packing == "on":
        packed = ", each batch's samples packed; the padding below is the unpacked batches'"
    say(f"batches ({grouping}, {flags.padding} padding{packed}): "
        f"{padding_line.replace(' samples in ', f' {rows} in ')}")
    longest = "packed row" if flags.packing else "sample"
    widths = (f"its longest {longest}: {max(inputs.train_set.lengths, default=0)} tokens; --max-length "
              f"{flags.max_length} is only the cap" if flags.padding == "dynamic" else
              f"--padding max_length: every batch {flags.max_length} tokens wide")

    def describe(estimated: dict) -> str:
        scratch = estimated.get("kernel_scratch_bytes") or 0
        besides = (f"; the process's RSS needs {scratch / 2**20:.1f} MiB more, held inside this CPU's emulated bf16 "
                   "matmuls (no tensor)" if scratch else "")
        return (f"estimated peak of live tensors: {estimated['peak_memory_bytes'] / 2**20:.1f} MiB, priced at the "
                f"batches this data makes ({widths}){besides}")

    return train_loader, eval_loader, run_estimate(flags, config, inputs, train_loader, eval_loader, plan_result,
                                                   describe)


def build_optimization(request: RunRequest, model, device, batches_per_epoch: int):
    """The optimizer and the schedule (an FSDP model is sharded first: fully_shard replaces the parameters)."""
    from looptrain import distributed
    from looptrain.loop import planned_updates

    flags = request.flags
    if flags.fsdp:  # shard before the optimizer is built: fully_shard replaces the parameters
        model.to(device)
        distributed.shard_model(model)
    optimizer = strategy_of(flags).build_optimizer(model, flags.lr, weight_decay=flags.weight_decay,
                                                   layer_lr_decay=flags.layer_lr_decay)
    scheduler = build_scheduler(optimizer, flags, planned_updates(batches_per_epoch, request.config))
    return optimizer, scheduler


def prepare_output_dir(request: RunRequest, place, model, precision: str, device, plan_result) -> None:
    """Checks a forced resume's weights fit the model, then writes run_config.json and the run's recipe,
    config.yaml (main process)."""
    from looptrain.checkpoint import write_json_atomic
    from looptrain.metrics import label_names_of
    from looptrain.precision import cpu_description

    config = request.config
    output_dir = Path(config.output_dir)
    # a forced resume: a model that does not fit fails before anything is written
    if config.resume not in (None, "auto"):
        from looptrain.checkpoint import check_weights_fit, resolve_resume_checkpoint

        check_weights_fit(resolve_resume_checkpoint(config.resume, output_dir), model)
    if place.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        resolved = {"arguments": request.arguments(),
                    "model_path": request.model_path, "loop_config": config.to_dict(), "world_size": place.world_size,
                    "resolved": {"precision": precision, "device": str(device), "cpu": cpu_description()},
                    "plan": plan_result.to_dict() if plan_result is not None else request.resumed_plan,
                    # a LoRA run's final/ holds no config.json: looptrain-predict reads a classifier's labels here
                    "labels": label_names_of(model.config) if request.flags.task == "sequence-classification" else None}
        write_json_atomic(output_dir / "run_config.json", resolved)
        write_recipe(output_dir / RUN_RECIPE, request.recipe(), comments=(
            f"The recipe of the run in {output_dir}: looptrain-finetune --config {output_dir / RUN_RECIPE} "
            "--output-dir NEW_DIR", "trains it again (the flags of a command line override these).",))


def summary_of_run(summary: dict, request: RunRequest, inputs: Inputs, plan_result, estimated: dict | None,
                   estimate_seconds: float = 0.0) -> dict:
    """A finished run's summary with the command line's keys: the task, the majority baseline, final/, its plan (or
    the saved plan a resumed run trained) and its estimate's error, the cost of planning (an unplanned run's: the
    `estimate_seconds` it waited for its own estimate), the RSS at the start."""
    from looptrain import metrics

    summary["rss_at_start_bytes"] = request.process.rss_at_start  # what a budget of RSS counts from (None: not Linux)
    classifier = inputs.task == "sequence-classification"
    # over the model's classes, as its own macro F1 (a class the evaluation data lacks counts as 0 in both)
    baseline = (metrics.majority_baseline(inputs.eval_set.labels, num_labels=inputs.model.config.num_labels)
                if classifier and inputs.eval_set else None)
    summary["task"] = inputs.task
    summary["majority_baseline"] = baseline
    summary["final_dir"] = str(Path(request.config.output_dir) / "final")
    summary["plan"] = plan_result.to_dict() if plan_result is not None else request.resumed_plan
    # The estimate of the run's peak (the higher of training's and evaluation's), and each apart.
    estimated = estimated or {}
    summary["estimated_peak_bytes"] = estimated.get("peak_memory_bytes")
    summary["estimated_training_peak_bytes"] = estimated.get("training_peak_bytes")
    summary["estimated_evaluation_peak_bytes"] = estimated.get("evaluation_peak_bytes")
    summary["estimated_kernel_scratch_bytes"] = estimated.get("kernel_scratch_bytes")
    summary["evaluation_batch_size"] = request.flags.eval_batch_size if inputs.eval_set is not None else None
    # Planning's cost (a plan's estimates and probes; what an unplanned run waited for its own), beside the training's.
    estimating, probing = ((plan_result.estimate_seconds, plan_result.probe_seconds) if plan_result is not None
                           else (estimate_seconds, 0.0))
    summary["planning_seconds"] = round(estimating + probing, 3)
    summary["planning_estimate_seconds"] = round(estimating, 3)
    summary["planning_probe_seconds"] = round(probing, 3)
    # Each estimate against the peak it prices, on a meter of tensors (never the RSS rise): the run's, training's
    # and evaluation's (`estimate_errors`).
    summary.update(estimate_errors(summary))
    return summary


def write_final(request: RunRequest, place, inputs: Inputs, final_dir: Path) -> None:
    """final/: the trained weights (safetensors; a sharded model's gathered first), the tokenizer and, with
    --merge-lora, merged/. Written into a temporary directory and renamed into place (`published_directory`), so
    a kill or a full disk leaves no final/ (nor a partial one), and the run unfinished: --resume auto continues it."""
    from looptrain import distributed
    from looptrain.checkpoint import latest_checkpoint
    from looptrain.checkpoint.save import published_directory

    latest = latest_checkpoint(final_dir.parent)
    advice = (f"Free some space and run the same command with --resume auto: it continues from {latest.name} and "
              "writes final/" if latest is not None else "Free some space and run the same command with --resume "
              "auto: no checkpoint was saved (--eval-every), so it trains this run again from the start")
    writing = (published_directory(final_dir, model=inputs.model, advice=advice) if place.is_main
               else contextlib.nullcontext(final_dir))
    with writing as directory:
        distributed.save_pretrained(inputs.model, directory)  # every rank: a sharded model's weights are gathered
        if place.is_main:
            inputs.tokenizer.save_pretrained(directory)
            if request.flags.merge_lora:
                write_merged(request.flags, request.model_path, inputs, directory, shown=final_dir)


def write_merged(flags, model_path: str, inputs: Inputs, final_dir: Path, shown: Path | None = None) -> Path:
    """--merge-lora: final/merged/, the --model weights loaded in full precision with final/'s adapters merged in
    (`looptrain.lora.merge_lora`): never the trained model's 4-bit weights (QLoRA), whose rounding would be merged
    too. Loadable by `from_pretrained` alone, with the tokenizer. `final_dir` is where final/ is being written,
    `shown` the name it will have."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from looptrain.lora import merge_lora

    merged_dir = final_dir / "merged"
    auto_class = AutoModelForCausalLM if inputs.task == "causal-lm" else AutoModelForSequenceClassification
    config = inputs.model.get_base_model().config  # the trained run's: labels, pad token
    import torch

    base = load_weights(auto_class, model_path, config, flags, dtype=torch.float32)
    with quiet_peft():
        merge_lora(base, final_dir, merged_dir)
    inputs.tokenizer.save_pretrained(merged_dir)
    shown = shown or final_dir
    say(f"--merge-lora: merged full weights in {shown / 'merged'} (the adapters of {shown} added into {model_path})")
    return merged_dir


def run_estimate(flags, config, inputs: Inputs, train_loader, eval_loader, plan_result, describe) -> RunEstimate:
    """This run's estimate (`looptrain.estimation.run_batches_peaks`): training's peak over the batches its sampler
    will give it, where it gives them, and evaluation's over its evaluation batches, with the run's peak the higher;
    a planned run's training peak is its plan's worst-batch estimate, its evaluation's the plan's. Read from the
    estimate cache, else computed beside the first updates (`looptrain.cli.finetune.own_estimate.start_estimate`);
    `describe` words it. None in it where the estimator cannot price the run."""
    from looptrain.cli.finetune.own_estimate import RunEstimate, start_estimate
    from looptrain.estimation import evaluation_shapes, run_batches_peaks, run_windows
    from looptrain.precision import resolve_device

    if plan_result is not None:
        training, evaluation = plan_result.winner.estimated_peak_bytes, plan_result.evaluation_peak_bytes
        return RunEstimate(result={"training_peak_bytes": training, "evaluation_peak_bytes": evaluation,
                                   "peak_memory_bytes": max(training, evaluation or 0)})
    if flags.fsdp or flags.max_tokens:
        return RunEstimate()  # the estimator models one process; token budgets give too many batch shapes to price
    model = inputs.model
    settings = strategy_of(flags, **{**config.loop_fields(), "precision": resolve_precision_name(config)})
    try:
        windows = run_windows(  # a batch-packing collator gives each batch's packed rows
            train_loader.batch_sampler, inputs.train_set.lengths, train_loader.collate_fn, config.accum_steps,
            epochs=config.epochs, max_steps=config.max_steps, micro_batch_tokens=config.micro_batch_tokens)
        evaluation = (evaluation_shapes(eval_loader.batch_sampler, inputs.eval_set.lengths, inputs.collator)
                      if eval_loader is not None else [])  # the final evaluation runs whatever --eval-every says
    except Exception as error:  # noqa: BLE001  an estimate is a report, never a reason to stop a run
        missing = f"{type(error).__name__}: {error}"
        say(f"notice: no memory estimate for this run ({missing})")
        return RunEstimate(missing=missing)
    device = resolve_device(config.device).type

    def peaks(cache) -> dict:
        # A resumed run may start anywhere, with its optimizer state restored: no window is priced without it.
        return run_batches_peaks(model, settings, windows, evaluation=evaluation, fresh=config.resume is None,
                                 max_grad_norm=config.max_grad_norm, num_labels=model.config.num_labels, device=device,
                                 cache=cache)

    # In a child process (EstimateWorker): what estimating costs stays out of the training's RSS.
    return start_estimate(lambda _: peaks(True), lambda: peaks("only"), describe)


def resolve_precision_name(config) -> str:
    from looptrain.precision import resolve_device, resolve_precision

    return resolve_precision(config.compute_precision, resolve_device(config.device))


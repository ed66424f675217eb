"""`--memory-budget` on the command line: the plan (made on rank 0), the C allocator it needs, `--plan-only`'s
output, and the request that trains the plan's settings."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

from looptrain.cli.console import say
from looptrain.cli.errors import UsageError
from looptrain.cli.finetune.arguments import effective_batch, strategy_of

if typing.TYPE_CHECKING:
    from looptrain.cli.finetune.request import RunRequest

# Under --memory-budget, --batch-size and --accum only define the effective batch: the planner chooses the split.
PLANNED_SPLIT = ("batch_size", "accum_steps")

# The planner's own flags: valued, and switches.
PLAN_FLAGS_WITH_VALUE = ("--memory-budget", "--plan-time", "--effective-batch", "--budget-meter", "--save-config")
PLAN_SWITCHES = ("--plan-only", "--json", "--amp")


def planned_request(request: RunRequest, model, train_set, collator, device, output_dir: Path):
    """The request that trains --memory-budget's plan, and the `Plan` (None for a resumed run, which keeps the plan
    it saved)."""
    from looptrain import distributed, strategy
    from looptrain.planning import Levers, plan

    flags, budget, config = request.flags, request.budget, request.config
    saved = output_dir / "run_config.json"
    if config.resume == "auto" and saved.is_file():  # the ledger already matched this run's identity
        saved_plan = json.loads(saved.read_text(encoding="utf-8")).get("plan") or {}
        previous = saved_plan.get("settings")
        if previous:
            settings = strategy.Strategy(**previous)
            say("--memory-budget: resuming with the run's saved plan: " + " ".join(settings.flags()))
            follow_plan_allocator(request, saved_plan.get("malloc"), saved_plan.get("malloc_threshold_bytes"))
            # The saved plan is written again (run_config.json, summary.json): a later resume reads it.
            return request.planned(settings, resumed_plan=saved_plan), None
    given = request.process.given
    # Every lever whose flag was given is kept as given; --precision auto, --optim auto and --batch-packing auto are the
    # planner's to choose.
    fixed = [spec.name for spec in strategy.levers(strategy.Strategy)
             if spec.metadata["lever"]["flag"] in given and spec.name not in PLANNED_SPLIT]
    fixed = [name for name in fixed
             if not (name in ("precision", "optimizer", "batch_packing") and getattr(flags, name) == "auto")]
    base = strategy_of(flags, precision="fp32" if flags.amp or flags.precision == "auto" else flags.precision)
    levers = Levers(precision=flags.amp or flags.precision == "auto", optimizer_family=flags.optimizer == "auto")
    baseline = without_planner(flags, base, device)
    say(f"--memory-budget {budget.size}: planning effective batch {effective_batch(flags)} "
          f"(levers: split, checkpointing, fused step{', precision' if levers.precision else ''}"
          f"{', optimizer family' if levers.optimizer_family else ''}; fixed: {', '.join(sorted(fixed)) or 'nothing'})")
    meter = budget_meter(request, device)
    place = distributed.current()
    result = plan_on_rank_zero(place, lambda: plan(
        model, train_set, collator, memory_budget=budget.bytes, effective_batch=effective_batch(flags),
        base=base, baseline=baseline, levers=levers, fixed=fixed, device=str(device), epochs=flags.epochs,
        max_grad_norm=config.max_grad_norm, probe_budget=budget.plan_time, seed=config.seed,
        rss_baseline=request.process.rss_at_start, meter=meter, make_lean=lean_allocator(request),
        token_micro_batches=place.world_size == 1, echo=say))  # ranks must run the same micro-batches
    if not place.is_main:
        follow_plan_allocator(request, result.malloc, result.malloc_threshold_bytes)
    say(result.table())
    say("winner: " + " ".join(result.winner.settings.flags()))
    return request.planned(result.winner.settings), result


def planned_evaluation(request: RunRequest, plan_result, model, eval_set, collator, device, place):
    """The request and the plan with evaluation inside the budget: --eval-batch-size (given, or its default) kept
    when evaluation's estimated peak at it fits the plan's budget, else cut to the largest batch that fits
    (`looptrain.planning.evaluation_batch`), said in the plan's notes and on the run's line. A resumed planned run
    evaluates at the batch its saved plan chose. Without evaluation data: both as they are."""
    import time

    from looptrain.estimation.worker import EstimateWorker
    from looptrain.planning import evaluation_batch

    if eval_set is None:
        return request, plan_result
    if plan_result is None:
        saved = (request.resumed_plan or {}).get("evaluation_batch_size")
        return (with_eval_batch(request, saved) if saved else request), None
    started = time.perf_counter()
    settings = strategy_of(request.flags)
    # In a child process (EstimateWorker): what estimating costs stays out of the RSS a budget may count.
    with EstimateWorker(lambda rows: evaluation_peak(model, settings, eval_set, collator, rows, device, place)) \
            as worker:
        chosen = evaluation_batch(plan_result, request.flags.eval_batch_size, worker)
    if chosen.note:
        say(f"--memory-budget: {chosen.note}")
    plan_result = dataclasses.replace(
        plan_result, notes=[*plan_result.notes, chosen.note] if chosen.note else plan_result.notes,
        evaluation_batch_size=chosen.size, evaluation_peak_bytes=chosen.peak_bytes,
        estimate_seconds=plan_result.estimate_seconds + time.perf_counter() - started)
    return with_eval_batch(request, chosen.size), plan_result


def with_eval_batch(request: RunRequest, rows: int) -> RunRequest:
    """The request evaluating `rows` a batch, as if --eval-batch-size had said so."""
    return dataclasses.replace(request, flags=request.flags.replace(eval_batch_size=rows))


def evaluation_peak(model, settings, eval_set, collator, rows: int, device, place) -> int:
    """Evaluation's estimated peak (`looptrain.estimation.estimate_evaluation`) at `rows` a batch, over the batches
    this rank's evaluation loader would give."""
    from looptrain.data import eval_batches
    from looptrain.estimation import estimate_evaluation, evaluation_shapes

    lengths = list(eval_set.lengths)
    shapes = evaluation_shapes(eval_batches(len(lengths), rows, lengths, num_replicas=place.world_size,
                                            rank=place.rank), lengths, collator)
    return estimate_evaluation(model, shapes, settings, num_labels=model.config.num_labels, padded=True,
                               device=device.type)["evaluation_peak_bytes"]


def plan_on_rank_zero(place, make_plan):
    """`make_plan()` on rank 0, its result (a `Plan`, or the `PlanError` it raised) on every rank.

    Ranks that each planned for themselves could pick different splits (each probe times the machine at another
    moment), and DDP would then hang or train unequal windows; a rank whose plan failed alone would leave the
    others waiting for it. Rank 0 plans `distributed.alone()`: the planner's estimates and probes build Loops, which
    would otherwise wrap the model in DDP and wait for ranks that are not planning.
    """
    from looptrain import distributed
    from looptrain.planning import PlanError

    result: typing.Any = None
    if place.is_main:
        try:
            with distributed.alone():  # the planner's Loops train on this rank alone: no DDP, no collectives
                result = make_plan()
        except PlanError as error:
            if not place.is_distributed:
                raise
            result = error
    if place.is_distributed:
        result = distributed.all_gather_objects(result)[0]
        if isinstance(result, PlanError):
            raise result
    return result


def budget_meter(request: RunRequest, device) -> str:
    """What --memory-budget counts: --budget-meter, with auto = the process's RSS on a CPU (the allocator's
    reserved memory on CUDA); live tensors where RSS cannot be read (not Linux), said so."""
    meter = request.budget.meter
    if device.type == "cuda":
        if meter == "rss":
            raise UsageError("--budget-meter rss counts a CPU process's memory; on CUDA the budget is the "
                             "allocator's reserved memory (--budget-meter auto) or live tensors (tensors)")
        return "tensors" if meter == "tensors" else "cuda_reserved"
    if meter == "tensors":
        return "tensors"
    if request.process.rss_at_start is None:
        if meter == "rss":
            raise UsageError("--budget-meter rss reads the process's RSS from /proc (Linux): use "
                             "--budget-meter tensors here")
        say("--memory-budget: the process's RSS cannot be read here (not Linux): planning for live tensors")
        return "tensors"
    return "rss"


def follow_plan_allocator(request: RunRequest, malloc: str | None, threshold: int | None = None) -> None:
    """A plan made with glibc's thresholds fixed (`Plan.malloc`, at `Plan.malloc_threshold_bytes`; a plan saved
    before that field: 128 KiB) holds its budget only with them: a process that trains it without planning (a resumed
    run, the other ranks under torchrun) fixes them too where it owns the process, and says how to otherwise."""
    from looptrain.memory import allocator

    if not malloc:
        return
    say("--memory-budget: " + (allocator.keep_rss_lean(threshold) if request.process.owns_process else
          "the plan was made with glibc's malloc thresholds fixed, and this process keeps its allocator: run "
          "scripts/finetune.py, or set " + " ".join(f"{name}={value}"
                                                     for name, value in allocator.lean_environment(threshold).items())))


def lean_allocator(request: RunRequest):
    """The planner's `make_lean` in the command line's own process: glibc's malloc thresholds fixed
    (`allocator.fix_thresholds`). None (never asked) in a process that runs `main` among other work: its allocator
    is left alone, and the planner measures, and charges, what it holds."""
    from looptrain.memory import allocator

    return allocator.fix_thresholds if request.process.owns_process else None


def without_planner(flags, base, device):
    """The configuration the run would train without --memory-budget: the flags as given (--amp as it resolves
    here), split --batch-size x (effective batch / --batch-size); None when --batch-size does not divide it."""
    from looptrain.precision import amp_precision

    batch = effective_batch(flags)
    if batch % flags.batch_size:
        return None
    precision = amp_precision(device)[0] if flags.amp or flags.precision == "auto" else base.precision
    if base.weights == "bf16":
        precision = "bf16"
    return dataclasses.replace(base, precision=precision, batch_size=flags.batch_size,
                               accum_steps=batch // flags.batch_size)


def plan_only_output(request: RunRequest, result) -> dict:
    """--plan-only: the plan (a table, or JSON) and the command line that trains with the winner."""
    from looptrain.memory.allocator import lean_environment

    command = ["python", "scripts/finetune.py", *without_plan_flags(list(request.process.argv)),
               *result.winner.settings.flags()]
    if result.evaluation_batch_size is not None:  # the evaluation batch the plan fitted (`planned_evaluation`)
        command += ["--eval-batch-size", str(result.evaluation_batch_size)]
    # Planned with glibc's thresholds fixed: the run keeps the budget only with them, so the command sets them.
    environment = lean_environment(result.malloc_threshold_bytes) if result.malloc else {}
    if request.flags.save_config is not None:
        save_plan_recipe(request, request.flags.save_config, environment)
    if request.budget.json:  # stdout holds the JSON alone (this rank's messages go to stderr)
        print(json.dumps({**result.to_dict(), "command": command, "environment": environment}, indent=2))
    else:
        say("train it with:\n  " + " ".join([f"{name}={value}" for name, value in environment.items()] + command))
    return {"plan": result.to_dict(), "command": command, "environment": environment, "interrupted": None}


def save_plan_recipe(request: RunRequest, path: str, environment: dict) -> None:
    """--save-config: the planned request's recipe (the winner's levers, no budget), with the environment the plan
    needs said in its comments."""
    from looptrain.cli.recipe import write_recipe

    needs = [f"It needs: {' '.join(f'{name}={value}' for name, value in environment.items())} (the allocator's "
             "thresholds the plan fitted with)."] if environment else []
    write_recipe(path, request.recipe(), comments=[
        f"--memory-budget {request.budget.size}'s plan: looptrain-finetune --config {path} trains its winner "
        "(the flags of a command line override these).", *needs])
    say(f"--save-config: the plan's recipe is in {path}: looptrain-finetune --config {path}")


def without_plan_flags(argv: list[str]) -> list[str]:
    """The command line minus the planner's own flags and every lever's (the winner's `flags()` say them all)."""
    from looptrain import strategy

    with_value, switches = set(PLAN_FLAGS_WITH_VALUE), set(PLAN_SWITCHES)
    for spec in strategy.levers(strategy.Strategy):
        meta = spec.metadata["lever"]
        (switches if meta["const"] is not None or isinstance(spec.default, bool) else with_value).add(meta["flag"])
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=")[0]
        if name in with_value:
            skip = "=" not in token
            continue
        if name not in switches:
            kept.append(token)
    return kept


def rss_at_start() -> int | None:
    """The process's RSS once torch, transformers and looptrain are imported: a --memory-budget of RSS
    (with --no-track-memory) counts from here, so the weights count."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import looptrain  # noqa: F401
    from looptrain.planning import PlanError, rss_baseline_bytes

    try:
        return rss_baseline_bytes()
    except PlanError:  # not Linux: budgets of live tensors still work
        return None

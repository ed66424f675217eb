"""The planner: the effective batch kept, fixed levers kept, the worst batch planned for, the winner within budget."""

from __future__ import annotations

import dataclasses
import gc
import json
import re

import pytest
import torch

from looptrain import Loop, LoopConfig, data
from looptrain.cli import finetune
from looptrain.optim import build_optimizer
from looptrain.planning import Levers, PlanError, parse_size, plan, probes
from looptrain.strategy import Strategy

from conftest import live_loops_and_optimizers, make_tiny_bert, make_tiny_tokenizer, settled_rss_meter, write_csv

EFFECTIVE_BATCH = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """64 short samples (3-13 words) and the collator, max_length 32."""
    tokenizer = make_tiny_tokenizer()
    texts = data.read_classification_data(write_csv(tmp_path_factory.mktemp("plan") / "train.csv", 64))
    return data.tokenize(texts, tokenizer, 32), data.DynamicPaddingCollator(tokenizer, max_length=32)


def budget_between(model, dataset, collator, small: int, large: int, **options) -> int:
    """A budget that fits micro-batch `small` but not `large` (fp32 AdamW, no checkpointing, 5% margin)."""
    from looptrain import estimation

    width = collator.batch_width([max(dataset.lengths)])
    estimate = estimation.estimate
    low = estimate(model, small, width, accum_steps=EFFECTIVE_BATCH // small, **options)["peak_memory_bytes"]
    high = estimate(model, large, width, accum_steps=EFFECTIVE_BATCH // large, **options)["peak_memory_bytes"]
    assert high > low * 1.1
    return int(1.05 * (low + high) / 2)


def test_sizes_parse_in_every_unit():
    assert [parse_size(text) for text in ("4GiB", "3.5 GB", "512MiB", "100KB", "1024B", "2KiB")] == [
        4 * 2**30, 3_500_000_000, 512 * 2**20, 100_000, 1024, 2048]
    with pytest.raises(PlanError, match="write a number and a unit, e.g. 4GiB"):
        parse_size("4 gigs")
    # A bare number is refused, not read as bytes: "--memory-budget 4" once planned for 4 bytes.
    with pytest.raises(PlanError, match=r"the memory size '4' has no unit: write 4GiB, 4MiB or, for bytes, 4B"):
        parse_size("4")


@pytest.mark.slow
def test_every_candidate_keeps_the_effective_batch_and_fits(dataset, cpu_kind):
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH,
                  levers=Levers(precision=True), probe=False, token_micro_batches=False)  # the splits as searched
    numerics = {(c.settings.precision, c.settings.weights) for c in result.candidates}
    if cpu_kind == "native-bf16":  # --amp means bf16 here: bf16 autocast and bf16 weights are tried beside fp32
        assert {("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")} <= numerics
        assert len(result.candidates) >= 3
    else:  # bf16 is emulated (several times slower): fp32 alone, with and without the fused step or checkpointing
        assert numerics == {("fp32", "fp32")}
        assert len(result.candidates) >= 2
    for candidate in result.candidates:
        assert candidate.settings.batch_size * candidate.settings.accum_steps == EFFECTIVE_BATCH
        assert candidate.estimated_peak_bytes * (1 + result.margin) <= budget
    # Without checkpointing micro-batch 4 is the largest that fits; checkpointing buys a larger one.
    plain = [c.settings.batch_size for c in result.candidates if not c.settings.gradient_checkpointing
             and not c.settings.optimizer_in_backward and c.settings.precision == "fp32"]
    assert plain == [4]
    assert any(c.settings.gradient_checkpointing and c.settings.batch_size > 4 for c in result.candidates)


def test_a_lever_the_user_fixed_is_never_changed(dataset):
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    base = Strategy(batch_size=2, accum_steps=8, precision="bf16", optimizer="sgd", gradient_checkpointing=True,
                    checkpoint_every=1)
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, base=base,
                  levers=Levers(precision=True, optimizer_family=True),
                  fixed=["precision", "optimizer", "gradient_checkpointing", "optimizer_in_backward"], probe=False)
    assert result.candidates
    for candidate in result.candidates:
        settings = candidate.settings
        assert (settings.precision, settings.optimizer, settings.gradient_checkpointing, settings.checkpoint_every,
                settings.optimizer_in_backward) == ("bf16", "sgd", True, 1, False)


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_the_winner_measured_by_the_tracker_stays_within_the_budget(dataset):
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())  # probes: lr 0
    winner = result.winner.settings
    loader = data.make_train_loader(train_set, winner.batch_size, collator,
                                    grouping="length" if winner.group_by_length else "random")
    optimizer = build_optimizer(model, winner.optimizer, 1e-3)
    config = LoopConfig(**winner.loop_fields(), device="cpu", progress_bar=False, eval_every="no", log_every=1000,
                        track_memory=True)
    summary = Loop(model, optimizer, loader, config=config).fit()
    assert summary["memory_meter"] == "cpu_tensor_tracker"
    assert summary["peak_memory_bytes"] <= budget
    estimated = result.winner.estimated_peak_bytes
    assert abs(summary["peak_memory_bytes"] - estimated) <= 0.1 * estimated


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_one_very_long_sample_is_planned_for(dataset, tmp_path):
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 8, 16)
    # The splits as searched (not cut by tokens, tests/test_token_micro_batches.py): their micro-batch sizes.
    short_plan = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, probe=False,
                      token_micro_batches=False)
    # The same data plus one sample of 32 tokens: any batch holding it is 32 wide, so it is the worst batch.
    long_text = " ".join(["good"] * 40)
    rows = [{"text": long_text, "label": "pos"}] + [{"text": "the good film", "label": "neg"}] * 63
    long_set = data.tokenize(data.read_classification_data(rows), make_tiny_tokenizer(), 32)
    assert max(long_set.lengths) == 32 and sorted(long_set.lengths)[-2] < 8
    long_plan = plan(model, long_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, probe=False,
                     token_micro_batches=False)
    assert long_plan.worst_width == 32 > short_plan.worst_width
    def largest_plain_batch(result) -> int:
        return max((c.settings.batch_size for c in result.candidates
                    if not c.settings.gradient_checkpointing and not c.settings.optimizer_in_backward), default=0)

    assert largest_plain_batch(long_plan) < largest_plain_batch(short_plan) == 8


@pytest.mark.slow  # about 5 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_when_nothing_fits_the_error_says_what_would(dataset):
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2, num_layers=2)
    with pytest.raises(PlanError, match=r"nothing fits .* even micro-batch 1 x 16 with gradient checkpointing: "
                                        r"estimated .*fits with --freeze-encoder \(est\. [0-9.]+ MiB\)"):
        plan(model, train_set, collator, memory_budget=150_000, effective_batch=EFFECTIVE_BATCH, probe=False)


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_what_would_fit_is_priced_with_the_step_fused_into_backward(dataset):
    """A suggestion is priced as the search would try it: at micro-batch 1, and where that does not fit, with the step
    fused into backward at the whole batch (no gradients held). On an H200, bert-large at 4 GiB was told that nothing
    fits, 8-bit AdamW included (3.66 GiB at 1 x 32), where 8-bit AdamW fused into backward holds about 2.3 GiB."""
    from looptrain import estimation

    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2, num_layers=2, hidden_size=512, intermediate_size=2048)  # weights dominate
    width = collator.batch_width([max(train_set.lengths)])
    lightest = Strategy(batch_size=1, accum_steps=EFFECTIVE_BATCH, gradient_checkpointing=True, checkpoint_every=1)
    fused = dataclasses.replace(lightest, batch_size=EFFECTIVE_BATCH, accum_steps=1, optimizer_in_backward=True)

    def peak(settings: Strategy, **levers) -> int:
        return estimation.estimate(model, settings.batch_size, width, settings, **levers)["peak_memory_bytes"]

    adamw, adamw_fused = peak(lightest), peak(fused)
    eight_bit, eight_bit_fused = peak(lightest, optimizer="adamw8bit"), peak(fused, optimizer="adamw8bit")
    assert eight_bit_fused < 0.85 * min(eight_bit, adamw, adamw_fused), (eight_bit_fused, eight_bit, adamw_fused)
    margin = 0.05
    budget = int((1 + margin) * (eight_bit_fused + min(eight_bit, adamw_fused)) / 2)
    with pytest.raises(PlanError) as error:
        plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, margin=margin,
             probe=False)
    message = str(error.value)
    assert f"estimated {adamw / 2**20:.1f} MiB ({adamw_fused / 2**20:.1f} MiB with the step fused into " \
        f"backward at {EFFECTIVE_BATCH} x 1)" in message, message
    assert (f"fits with --optim auto (8-bit AdamW) (est. {eight_bit_fused / 2**20:.1f} MiB with the step fused into "
            f"backward at {EFFECTIVE_BATCH} x 1)") in message, message
    # Where the user fixed the fused step (off), 8-bit AdamW at micro-batch 1 is what is priced, and it does not fit.
    with pytest.raises(PlanError) as error:
        plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, margin=margin,
             probe=False, fixed=("optimizer_in_backward",))
    message = str(error.value)
    assert "fits with --optim auto" not in message and "with the step fused into backward" not in message, message


@pytest.mark.slow
def test_the_probe_is_bounded(dataset, cpu_kind):
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH,
         levers=Levers(precision=True), probe=False)  # the estimates, cached: with no planning time, only they are read
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH,
                  levers=Levers(precision=True), probe_budget=0.0)
    assert result.cached_estimates == result.estimates > 0
    probed = [c for c in result.candidates if c.probed]
    # With no probe time at all, only the configuration without the planner (here the safe default: the user's
    # 16 x 1 does not fit) and the prior's favourite are measured.
    assert 1 <= len(probed) <= 2 < len(result.candidates)
    assert any(c.baseline for c in probed) and result.baseline_words == "safe default"
    assert any("not probed: their probes would not fit the probe budget (0 s)" in note for note in result.notes)
    assert all(c.seconds_per_epoch > 0 for c in result.candidates)
    assert result.candidates[:len(probed)] == sorted(probed, key=lambda c: c.seconds_per_epoch) \
        or result.winner.baseline  # the baseline may be kept ahead of a candidate less than 5% faster


# ------------------------------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def train_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("plan-cli") / "train.csv", 64)


def cli(model_dir, train_csv, output_dir, *extra):
    return finetune.main(["--model", str(model_dir), "--data", str(train_csv), "--output-dir", str(output_dir),
                          "--max-length", "32", "--no-progress-bar", "--log-every", "1000", *extra])


def test_a_planned_run_reports_its_plan_and_its_estimate_error(model_dir, train_csv, tmp_path, capsys):
    # On the CPU: a CUDA run's peak also holds cuBLAS's workspace (64 MiB on an H200), which no estimate prices.
    assert cli(model_dir, train_csv, tmp_path, "--memory-budget", "2MiB", "--effective-batch", "16",
               "--grad-checkpoint", "--budget-meter", "tensors", "--device", "cpu") == 0
    out = capsys.readouterr().out
    assert "| 1 (winner" in out and re.search(r"estimated peak \(worst batch\) \| [0-9.]+ MiB \(error [+-]", out)
    assert "plan for a budget of 2.0 MiB of live tensors" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    settings = summary["plan"]["settings"]
    assert settings["batch_size"] * settings["accum_steps"] == 16
    assert settings["gradient_checkpointing"] is True  # given explicitly: fixed
    assert summary["estimated_peak_bytes"] == summary["plan"]["estimated_peak_bytes"] <= 2 * 2**20
    training_peak = max(peak for phase, peak in summary["phase_peak_bytes"].items() if phase != "eval")
    assert summary["estimate_error"] == pytest.approx(
        (training_peak - summary["estimated_peak_bytes"]) / summary["estimated_peak_bytes"], abs=1e-4)
    assert abs(summary["estimate_error"]) <= 0.10
    # When the process's RSS above its start (torch's buffers, the data, allocator caches) went over a budget of
    # live tensors, the table says so and how to plan for RSS instead; when it did not, there is no note. (In a
    # long pytest process the kernel's peak mark may sit anywhere: both branches are checked.)
    above = (summary["peak_rss_bytes"] - summary["rss_at_start_bytes"]) / 2**20
    note = f"| note | RSS above start {above:.1f} MiB > budget 2.0 MiB: the budget was of live tensors"
    assert (note in out) == (above > 2.0)
    assert ("plan with --budget-meter rss (the default) for a budget of RSS" in out) == (above > 2.0)
    # Planning's cost: its estimates and probes, in summary.json and the table.
    assert summary["planning_seconds"] == pytest.approx(
        summary["planning_estimate_seconds"] + summary["planning_probe_seconds"], abs=2e-3)
    assert summary["planning_estimate_seconds"] > 0 and summary["planning_probe_seconds"] > 0
    assert summary["plan"]["planning_seconds"] == pytest.approx(summary["planning_seconds"], abs=2e-3)
    assert f"| planning | {summary['planning_seconds']:.1f} s (estimates" in out


@pytest.mark.slow  # two planned runs and a resume each
@pytest.mark.parametrize("owns_process", [True, False])
def test_a_resumed_planned_run_keeps_its_saved_plan_and_the_allocator_it_was_planned_with(model_dir, train_csv,
                                                                                           tmp_path, capsys,
                                                                                           monkeypatch, owns_process):
    """`--resume auto` trains the saved plan without planning again; a plan made with glibc's thresholds fixed
    (`plan.malloc`) fixes them again in the console script's process, and says how in any other."""
    import os
    import signal

    from looptrain import Loop
    from looptrain.memory import allocator

    def interrupt(self, *, step, **_):
        if step == 1:  # stop after this window, with a checkpoint
            os.kill(os.getpid(), signal.SIGINT)

    argv = ["--model", str(model_dir), "--data", str(train_csv), "--output-dir", str(tmp_path), "--max-length", "32",
            "--no-progress-bar", "--log-every", "1000", "--memory-budget", "2MiB", "--effective-batch", "16",
            "--budget-meter", "tensors", "--max-steps", "3", "--device", "cpu"]  # a GPU holds cuBLAS's 64 MiB
    with monkeypatch.context() as patched:
        patched.setattr(Loop, "on_step_end", interrupt)
        assert finetune.main(argv) == 130
    first = json.loads((tmp_path / "run_config.json").read_text())
    assert first["plan"]["malloc"] is None  # a budget of tensors: the allocator is never asked
    first["plan"]["malloc"] = "fixed (as a console script's plan would say)"
    first["plan"]["malloc_threshold_bytes"] = allocator.MODERATE_THRESHOLD_BYTES  # the planner's middle step
    (tmp_path / "run_config.json").write_text(json.dumps(first))
    capsys.readouterr()
    applied = []
    monkeypatch.setattr(allocator, "keep_rss_lean",
                        lambda threshold: applied.append(threshold) or "thresholds fixed again (stand-in)")
    assert finetune.main([*argv, "--resume", "auto"], owns_process=owns_process) == 0
    out = capsys.readouterr().out
    assert "--memory-budget: resuming with the run's saved plan: " in out and "plan for a budget" not in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3
    # The saved plan is written again, so a later resume (or a reader of the summary) still finds it.
    assert json.loads((tmp_path / "run_config.json").read_text())["plan"] == first["plan"] == summary["plan"]
    said = ("--memory-budget: thresholds fixed again (stand-in)" if owns_process else
            "--memory-budget: the plan was made with glibc's malloc thresholds fixed, and this process keeps its "
            "allocator: run scripts/finetune.py, or set MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=131072")
    assert said in out
    assert applied == ([allocator.MODERATE_THRESHOLD_BYTES] if owns_process else [])


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_rank_zero_plans_and_every_rank_gets_its_plan_or_its_error(monkeypatch, rank):
    """Every rank planning for itself could pick another split (its probes time the machine at another moment), and
    DDP would then hang or train unequal windows: rank 0 plans and the others take its plan; its PlanError, too.
    (tests/test_distributed.py trains a planned run on two ranks.)"""
    from looptrain import distributed
    from looptrain.cli.finetune import plan_on_rank_zero
    from looptrain.planning import PlanError

    place = distributed.DistributedInfo(rank=rank, world_size=2)
    sent = []

    def gather(value):  # rank 0's value reaches every rank
        sent.append(value)
        return [value if rank == 0 else "rank zero's plan", None]

    monkeypatch.setattr(distributed, "all_gather_objects", gather)
    planned = []
    assert plan_on_rank_zero(place, lambda: planned.append(rank) or "rank zero's plan") == "rank zero's plan"
    assert planned == ([0] if rank == 0 else []) and sent == ["rank zero's plan" if rank == 0 else None]

    def refuse():
        raise PlanError("nothing fits (test)")

    if rank == 0:  # a plan that fails on rank 0 is sent, then raised on every rank
        with pytest.raises(PlanError, match=r"nothing fits \(test\)"):
            plan_on_rank_zero(place, refuse)
        assert isinstance(sent[-1], PlanError)
    with pytest.raises(PlanError, match=r"nothing fits \(test\)"):  # one process: raised at once, nothing sent
        plan_on_rank_zero(distributed.DistributedInfo(), refuse)


@pytest.mark.parametrize("meter, why", [
    ("of live tensors", "the budget was of live tensors (the peak memory above); RSS also holds"),
    ("of process RSS above the start", "the plan's probes measured one update at the worst batch; evaluation, "
                                       "checkpoint saving"),
])
def test_the_end_of_run_table_explains_rss_above_a_planned_budget(meter, why):
    summary = {"train_runtime_s": 1.0, "train_samples_per_s": 1.0, "optimizer_steps": 1, "skipped_steps": 0,
               "peak_rss_bytes": 700 * 2**20, "rss_at_start_bytes": 325 * 2**20,
               "plan": {"budget_bytes": 300 * 2**20, "meter": meter, "settings": {"batch_size": 2, "accum_steps": 8}}}
    table = finetune.final_table(summary, None, "runs/x")
    assert "| peak RSS | 700.0 MiB (process, OS; 375.0 MiB above the 325.0 MiB held at start) | |" in table
    assert f"| note | RSS above start 375.0 MiB > budget 300.0 MiB: {why}" in table
    within = {**summary, "peak_rss_bytes": 600 * 2**20}  # 275 MiB above the start: within the budget, no note
    assert "| note |" not in finetune.final_table(within, None, "runs/x")


def test_the_end_of_run_table_computes_no_estimate_error_against_the_rss_rise():
    summary = {"train_runtime_s": 1.0, "train_samples_per_s": 1.0, "optimizer_steps": 1, "skipped_steps": 0,
               "peak_memory_bytes": 500 * 2**20, "memory_meter": "cpu_rss_delta",
               "estimated_peak_bytes": 300 * 2**20, "estimate_error": None}
    table = finetune.final_table(summary, None, "runs/x")
    assert "| estimated peak (worst batch) | 300.0 MiB (live tensors; this run's meter is RSS, so no error" in table
    tracked = {**summary, "memory_meter": "cpu_tensor_tracker", "estimate_error": 0.0123}
    assert "| estimated peak (worst batch) | 300.0 MiB (error +1.2%) | |" in finetune.final_table(tracked, None, "x")


def test_each_estimate_error_is_like_with_like_and_an_unestimated_higher_evaluation_peak_is_a_note():
    from looptrain.cli.finetune import reports

    summary = {"train_runtime_s": 1.0, "train_samples_per_s": 1.0, "optimizer_steps": 1, "skipped_steps": 0,
               "memory_meter": "cpu_tensor_tracker", "peak_memory_bytes": 500 * 2**20,
               "estimated_peak_bytes": 300 * 2**20,
               "phase_peak_bytes": {"setup": 100 * 2**20, "forward": 250 * 2**20, "backward": 303 * 2**20,
                                    "eval": 500 * 2**20}}
    # Evaluation not estimated: the error is training's, 303 against 300, not evaluation's 500 (+66.7%).
    summary.update(reports.estimate_errors(summary))
    assert summary["estimate_error"] == summary["training_estimate_error"] == 0.01
    assert summary["evaluation_estimate_error"] is None
    assert (summary["training_peak_bytes"], summary["evaluation_peak_bytes"]) == (303 * 2**20, 500 * 2**20)
    table = finetune.final_table(summary, None, "runs/x")
    assert "| estimated peak (worst batch) | 300.0 MiB (error +1.0%) | |" in table
    assert ("| note | evaluation peaked at 500.0 MiB, above training's 303.0 MiB; evaluation is not in the estimate "
            "(--eval-batch-size lowers it) | |") in table
    below = {**summary, "phase_peak_bytes": {**summary["phase_peak_bytes"], "eval": 200 * 2**20}}
    assert "evaluation peaked" not in finetune.final_table(below, None, "runs/x")
    # Evaluation estimated: the run's peak against the higher estimate, and each phase against its own.
    priced = {**summary, "estimated_peak_bytes": 400 * 2**20, "estimated_training_peak_bytes": 300 * 2**20,
              "estimated_evaluation_peak_bytes": 400 * 2**20, "evaluation_batch_size": 64}
    priced.update(reports.estimate_errors(priced))
    assert (priced["estimate_error"], priced["training_estimate_error"], priced["evaluation_estimate_error"]) == \
        (0.25, 0.01, 0.25)
    table = finetune.final_table(priced, None, "runs/x")
    assert "| estimated peak (worst batch) | 400.0 MiB (error +25.0%) | |" in table
    assert "| training peak | 303.0 MiB, estimated 300.0 MiB (error +1.0%) | |" in table
    assert "| evaluation peak at batch 64 | 500.0 MiB, estimated 400.0 MiB (error +25.0%) | |" in table
    assert "evaluation peaked" not in table
    # A meter of one peak (CUDA's) whose peak is evaluation's: training's own is not known.
    cuda = {**summary, "memory_meter": "cuda_max_memory_allocated", "phase_peak_bytes": None,
            "memory_breakdown": {"peak_phase": "eval"}}
    assert reports.estimate_errors(cuda)["estimate_error"] is None
    assert "(no error: evaluation holds this meter's one peak, and training's own is not known)" in \
        finetune.final_table({**cuda, "estimate_error": None}, None, "runs/x")
    assert reports.estimate_errors({**cuda, **{key: priced[key] for key in (
        "estimated_peak_bytes", "estimated_training_peak_bytes", "estimated_evaluation_peak_bytes")}}) == {
        "training_peak_bytes": None, "evaluation_peak_bytes": 500 * 2**20, "training_estimate_error": None,
        "evaluation_estimate_error": 0.25, "estimate_error": 0.25}


def test_a_lora_run_evaluated_at_batch_64_has_its_whole_peak_estimated(model_dir, train_csv, tmp_path, capsys):
    """Issue 53's example: a --lora 8 classifier, micro-batches of 1, evaluation batches of 64. Evaluation holds the
    run's peak, and the estimate prices it: within 10% of the whole run's peak, each phase of its own."""
    assert cli(model_dir, train_csv, tmp_path, "--batch-size", "1", "--eval-batch-size", "64", "--eval-split", "0.5",
               "--max-steps", "2", "--eval-every", "2", "--lora", "8", "--device", "cpu") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    phases = summary["phase_peak_bytes"]
    training = max(peak for phase, peak in phases.items() if phase != "eval")
    assert phases["eval"] == summary["peak_memory_bytes"] > 2 * training  # the case: evaluation peaked higher
    assert (summary["training_peak_bytes"], summary["evaluation_peak_bytes"]) == (training, phases["eval"])
    assert summary["estimated_peak_bytes"] == max(summary["estimated_training_peak_bytes"],
                                                  summary["estimated_evaluation_peak_bytes"])
    assert summary["estimate_error"] == round((summary["peak_memory_bytes"] - summary["estimated_peak_bytes"])
                                              / summary["estimated_peak_bytes"], 4)
    assert abs(summary["estimate_error"]) <= 0.10
    assert abs(summary["training_estimate_error"]) <= 0.10 and abs(summary["evaluation_estimate_error"]) <= 0.10
    assert summary["evaluation_batch_size"] == 64
    out = capsys.readouterr().out
    assert f"| evaluation peak at batch 64 | {phases['eval'] / 2**20:.1f} MiB, estimated " in out
    assert "evaluation peaked" not in out


@pytest.mark.slow  # plans, then trains and evaluates: a whole run under a budget
def test_a_budget_that_fits_training_but_not_evaluation_cuts_the_evaluation_batch(model_dir, train_csv, tmp_path,
                                                                                    capsys):
    budget = int(0.4 * 2**20)
    assert cli(model_dir, train_csv, tmp_path, "--lora", "8", "--memory-budget", "0.4MiB", "--budget-meter",
               "tensors", "--effective-batch", "2", "--eval-batch-size", "64", "--eval-split", "0.5", "--max-steps",
               "2", "--eval-every", "2", "--device", "cpu") == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    plan, rows = summary["plan"], summary["evaluation_batch_size"]
    assert 1 < rows == plan["evaluation_batch_size"] < 64
    note = f"evaluation batch 64 -> {rows} to stay within 0.4 MiB of live tensors"
    assert f"--memory-budget: {note}" in out and any(line.startswith(note) for line in plan["notes"])
    assert plan["estimated_evaluation_peak_bytes"] == summary["estimated_evaluation_peak_bytes"]
    assert summary["estimated_evaluation_peak_bytes"] * (1 + plan["margin"]) <= budget
    # Evaluation holds the run's peak, and the run stays within the budget.
    assert summary["evaluation_peak_bytes"] == summary["peak_memory_bytes"] <= budget
    assert abs(summary["evaluation_estimate_error"]) <= 0.10
    # Evaluating 64 rows at a time would not have fit: the note gives its estimate.
    at_64 = float(re.search(r"; ([0-9.]+) MiB at 64\)", out).group(1)) * 2**20
    assert at_64 * (1 + plan["margin"]) > budget - 0.05 * 2**20


def test_every_run_reports_its_estimate_error(model_dir, train_csv, tmp_path):
    assert cli(model_dir, train_csv, tmp_path, "--batch-size", "8", "--device", "cpu") == 0  # the CPU's tracker
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["plan"] is None and summary["estimated_peak_bytes"] > 0
    assert summary["memory_meter"] == "cpu_tensor_tracker" and abs(summary["estimate_error"]) <= 0.10


@pytest.mark.slow  # 3 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_plan_script_prints_json_and_the_command_line_and_writes_nothing(model_dir, train_csv, tmp_path, capsys):
    from looptrain.cli import plan as plan_script

    output_dir = tmp_path / "never-written"
    assert plan_script.main(["--model", str(model_dir), "--data", str(train_csv), "--output-dir", str(output_dir),
                             "--max-length", "32", "--memory-budget", "1MiB", "--effective-batch", "16", "--json",
                             "--budget-meter", "tensors", "--device", "cpu"]) == 0  # a GPU holds cuBLAS's 64 MiB
    captured = capsys.readouterr()
    printed = json.loads(captured.out)  # stdout is the JSON alone; the planner's progress and table go to stderr
    assert "winner:" in captured.err
    assert printed["settings"]["batch_size"] * printed["settings"]["accum_steps"] == 16
    assert printed["command"][:2] == ["python", "scripts/finetune.py"] and "--memory-budget" not in printed["command"]
    assert f"--batch-size {printed['settings']['batch_size']}" in " ".join(printed["command"])
    assert not output_dir.exists()
    assert plan_script.main(["--model", str(model_dir)]) == 2


@pytest.mark.parametrize("flags, message", [
    (["--memory-budget", "4 gigs"], r"--memory-budget: cannot read the memory size '4 gigs'"),
    (["--optim", "auto"], r"--optim auto lets the planner choose the optimizer: add --memory-budget SIZE"),
    (["--plan-only"], r"--plan-only, --plan-time and --budget-meter belong to --memory-budget"),
    (["--budget-meter", "tensors"], r"--plan-only, --plan-time and --budget-meter belong to --memory-budget"),
    (["--memory-budget", "4"], r"--memory-budget: the memory size '4' has no unit: write 4GiB, 4MiB or, for bytes, 4B"),
    (["--json"], r"--json prints the plan of --plan-only as JSON .*add --plan-only, or drop --json"),
    (["--effective-batch", "10", "--batch-size", "4"], r"--effective-batch 10 is not a multiple of --batch-size 4"),
    (["--memory-budget", "1GiB", "--micro-batch-tokens", "64"],
     r"--memory-budget chooses the micro-batches itself, their tokens included: drop --micro-batch-tokens"),
])
def test_planner_flag_errors(model_dir, train_csv, tmp_path, capsys, flags, message):
    assert cli(model_dir, train_csv, tmp_path, *flags) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.slow
def test_a_budget_of_process_rss_keeps_only_candidates_whose_probe_fits(dataset):
    from looptrain.planning import rss_baseline_bytes

    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    result = plan(model, train_set, collator, memory_budget=2**30, effective_batch=EFFECTIVE_BATCH,
                  rss_baseline=rss_baseline_bytes(), probe_budget=0.0)
    assert result.meter == "of process RSS above the start" and result.candidates
    for candidate in result.candidates:  # only measured candidates are eligible, and they measured within it
        assert candidate.probed and 0 <= candidate.probe["measured_peak_bytes"] * (1 + result.margin) <= 2**30
    # The same budget counted from 2 GiB below the process's RSS: every probe measures over it.
    with pytest.raises(PlanError,
                       match=r"nothing fits 1.00 GiB .* \+ 2\.\d+ GiB of the process's RSS measured besides tensors"):
        plan(model, train_set, collator, memory_budget=2**30, effective_batch=EFFECTIVE_BATCH,
             rss_baseline=rss_baseline_bytes() - 2 * 2**30, probe_budget=0.0)


@pytest.mark.slow
def test_under_a_budget_of_process_rss_what_would_fit_counts_the_rss_besides_tensors(dataset):
    """When no split fits even by its tensors, the suggestions are judged by the same meter: a freeze that fits
    as tensors alone is not suggested when the process's other RSS (here 100 MiB above the baseline) sinks it."""
    import gc

    from looptrain import estimation
    from looptrain.memory import allocator
    from looptrain.planning import rss_baseline_bytes

    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    effective_batch = 2  # few splits to search: the test is about the advice, not the search
    width = collator.batch_width([max(train_set.lengths)])
    lightest = {"accum_steps": effective_batch, "gradient_checkpointing": True}
    frozen = estimation.estimate(model, 1, width, freeze_encoder=True, **lightest)["peak_memory_bytes"]
    full = estimation.estimate(model, 1, width, **lightest)["peak_memory_bytes"]
    budget = int((frozen + full) / 2)  # the frozen encoder fits as tensors; the full model does not
    assert frozen * 1.05 < budget < full
    tensors_only = str(pytest.raises(PlanError, plan, model, train_set, collator, memory_budget=budget,
                                     effective_batch=effective_batch, probe=False).value)
    assert "fits with --freeze-encoder" in tensors_only
    # What earlier tests left for the collector, and free in the C heap (the probes trim it), goes back to the OS now:
    # not during planning, below the baseline.
    gc.collect()
    allocator.release_freed()
    with pytest.raises(PlanError) as refused:
        plan(model, train_set, collator, memory_budget=budget, effective_batch=effective_batch,
             rss_baseline=rss_baseline_bytes() - 100 * 2**20, probe_budget=0.0)
    message = str(refused.value)
    # About the 100 MiB the baseline was moved down by (the process may also have returned a little since).
    assert re.search(r"\+ (9[5-9]|1\d\d)\.\d MiB of the process's RSS measured besides tensors", message), message
    assert "fits with --freeze-encoder" not in message and "raise the budget" in message


def wider_bert():
    return make_tiny_bert(num_labels=2, hidden_size=128, intermediate_size=512, num_attention_heads=4)


@pytest.fixture(scope="module")
def bf16_weights_budget(dataset) -> int:
    """A budget between wider_bert's lowest fp32-weight estimate (fp32 or bf16 autocast) and its bf16-weight one."""
    from looptrain import estimation

    train_set, collator = dataset
    model = wider_bert()
    width = collator.batch_width([max(train_set.lengths)])

    def lowest(**options) -> int:
        return min(estimation.estimate(model, batch, width, accum_steps=EFFECTIVE_BATCH // batch,
                                   gradient_checkpointing=True, **options)["peak_memory_bytes"] for batch in (1, 2))

    fp32_weights = min(lowest(precision=precision) for precision in ("fp32", "bf16"))
    bf16_weights = lowest(weights="bf16")
    assert fp32_weights > 1.15 * bf16_weights
    return int(1.05 * (fp32_weights + bf16_weights) / 2)


@pytest.mark.slow
def test_bf16_weights_are_a_numerics_lever_and_probes_leave_the_fp32_weights_alone(dataset, bf16_weights_budget,
                                                                                   cpu_kind):
    """Under a budget that no fp32-weight mix fits, --amp lets the planner store the weights in bf16 on a CPU with
    native bf16; on an AVX2 CPU (emulated bf16) it does not, and says nothing fits. The probe casts the model and
    restores it."""
    train_set, collator = dataset
    model, budget = wider_bert(), bf16_weights_budget
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if cpu_kind == "avx2":
        with pytest.raises(PlanError, match=r"nothing fits") as refused:
            plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH,
                 levers=Levers(precision=True), probe=False)
        assert "--weights bf16" not in str(refused.value)  # not offered where bf16 is emulated
        return
    # A probe budget of 0 measures one candidate of each precision: the bf16-weight winner is probed.
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH,
                  levers=Levers(precision=True), probe_budget=0.0)
    assert result.candidates and all(candidate.settings.weights == "bf16" for candidate in result.candidates)
    assert result.winner.settings.loop_fields()["weights"] == "bf16"
    for name, tensor in model.state_dict().items():  # probed in bf16, handed back in fp32, bit for bit
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    with pytest.raises(PlanError, match=r"--weights bf16"):  # without the lever, nothing fits and it says what would
        plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, probe=False)


# ------------------------------------------------------------------------------------------ never loses
def fake_probe(speeds: dict):
    """A `probes.probe` stand-in: the micro-step seconds per token of each micro-batch size, no optimizer time."""
    def probe(model, settings, batch, device, max_grad_norm, meter=None, ceiling=None, step_bytes=0, typical=None,
              **cuts):  # truncation=, memory=: a probe cut to what it decides
        tokens = int(batch["input_ids"].numel())
        return {"micro_step_seconds": speeds[settings.batch_size] * tokens, "optimizer_step_seconds": 0.0,
                "probe_seconds": 0.01, "tokens": tokens, "batch_shape": list(batch["input_ids"].shape)}
    return probe


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
@pytest.mark.parametrize("faster, kept", [(0.97, True), (0.5, False)])
def test_the_configuration_without_the_planner_is_kept_unless_another_is_measured_faster(dataset, monkeypatch,
                                                                                         faster, kept, tmp_path):
    """The user's split is always a probed candidate; the plan replaces it only when another candidate's measured
    prediction is at least KEEP_BASELINE_WITHIN (5%) faster: 3% is within a probe's noise, 2x is not."""
    from looptrain.planning import ranking

    _, collator = dataset
    rows = [{"text": "the good film was fun", "label": label} for label in ["pos", "neg"] * 32]  # one length
    train_set = data.tokenize(data.read_classification_data(rows), make_tiny_tokenizer(), 32)
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    user = Strategy(batch_size=2, accum_steps=8)  # fits (micro-batch 2 < 4); the search's largest plain split is 4
    # Per token, micro-batch 2 takes 1 unit; every other size `faster` units (the same padding: no grouping).
    speeds = {size: (1.0 if size == 2 else faster) for size in (1, 2, 4, 8, 16)}
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))  # no real probe cached by another test
    monkeypatch.setattr(probes, "probe", fake_probe(speeds))
    monkeypatch.setattr(ranking, "PRIOR_OPTIMISM", 0.0)  # probe every candidate: the ranking is the measured one
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, base=user)
    baseline = [c for c in result.candidates if c.baseline]
    assert len(baseline) == 1 and baseline[0].settings == user and baseline[0].probed
    assert len(result.candidates) > 1 and all(c.probed for c in result.candidates)
    others = [c for c in result.candidates if not c.baseline]
    best_other = min(others, key=lambda c: c.seconds_per_epoch)
    assert best_other.seconds_per_epoch / baseline[0].seconds_per_epoch == pytest.approx(faster)
    assert result.winner.baseline == kept
    assert ("kept the your flags: no candidate is predicted at least 5% faster" in result.notes) == kept
    assert ("| 1 (winner, your flags) |" if kept else "| 1 (winner) |") in result.table()


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_without_probe_time_only_the_baseline_and_the_favourite_are_probed(dataset, monkeypatch, tmp_path):
    from looptrain.planning import book

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))  # a probe cached by another test costs 0 s
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    # Planning's time is estimates and probes together: with none, the search reads only cached estimates, so
    # make them first (a plan without probes), as a rerun finds them.
    plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH,
         base=Strategy(batch_size=1, accum_steps=16), probe=False)
    calls = []
    probe = fake_probe(dict.fromkeys((1, 2, 4, 8, 16), 1.0))
    monkeypatch.setattr(probes, "probe", lambda *args, **kwargs: calls.append(args[1]) or probe(*args, **kwargs))
    # One estimate at a time: two workers would estimate the lightest split beside the baseline before planning's
    # time is known (free where there are two cores), which the first plan's search did not need.
    monkeypatch.setattr(book, "estimate_workers", lambda: 1)
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH,
                  base=Strategy(batch_size=1, accum_steps=16), probe_budget=0.0)
    assert len(result.candidates) > 2
    assert len(calls) == len({id(c) for c in result.candidates if c.probed}) == 2  # never a candidate twice
    assert calls[0] == Strategy(batch_size=1, accum_steps=16)  # the baseline first
    assert result.probe_budget_seconds == 0.0 and result.cached_estimates == result.estimates
    assert any("not probed: their probes would not fit the probe budget (0 s)" in note for note in result.notes)


# ------------------------------------------------------------------------------------------ the meter users mean
@pytest.mark.slow  # over 6 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
@pytest.mark.hardware  # .ci/run runs it natively and again as an AVX2 CPU (ONEDNN_MAX_CPU_ISA=AVX2 ...)
def test_a_planned_run_keeps_its_budget_of_process_rss_with_evaluation_and_checkpoints(tmp_path):
    """The default meter on a CPU is the process's RSS above its start (what top and the OOM killer see): a fresh
    process plans, trains, evaluates, saves checkpoints and final/, and its peak RSS above the start, read from
    the kernel, stays within the budget; the tracker's tensors are counted inside it."""
    import os
    import subprocess
    import sys

    from transformers import BertConfig, BertModel

    from conftest import WORDS

    model_dir = tmp_path / "model"
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(model_dir)  # 3.2M parameters: 12 MiB of weights, 50 MiB with AdamW
    make_tiny_tokenizer().save_pretrained(model_dir)
    train_csv = write_csv(tmp_path / "train.csv", 96)
    budget = 400 * 2**20  # a fresh process holds 160-200 MiB besides its tensors at its first update (docs/plan.md)
    command = [sys.executable, "-m", "looptrain.cli.finetune", "--model", str(model_dir), "--data", str(train_csv),
               "--output-dir", str(tmp_path / "run"), "--max-length", "32", "--eval-split", "0.25",
               "--eval-every", "2", "--max-steps", "4", "--memory-budget", f"{budget}B", "--effective-batch", "16",
               "--no-progress-bar"]
    # As a user runs it: glibc's allocator as it starts (no MALLOC_* variables), which looptrain fixes itself.
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    environment = {**environment, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["plan"]["meter"] == "of process RSS above the start"
    assert "plan for a budget of 0.39 GiB of process RSS above the start" in finished.stdout
    assert sorted(path.name for path in (tmp_path / "run").glob("checkpoint-*"))  # saved at the evaluations
    assert summary["final_eval"] is not None
    above_start = summary["peak_rss_bytes"] - summary["rss_at_start_bytes"]
    assert summary["peak_memory_bytes"] < above_start <= budget, (above_start / 2**20, finished.stdout[-3000:])
    # The estimate prices tensors; this run's meter is the RSS rise, so no error is computed against it.
    assert summary["memory_meter"] == "cpu_rss_delta" and summary["estimate_error"] is None
    assert "MiB (live tensors; this run's meter is RSS, so no error: --budget-meter tensors" in finished.stdout


def rss_probe(held: dict):
    """A `probes.probe` stand-in under the RSS meter: one unit of time per token, and a measured peak of `held["bytes"]`
    (what the process holds, its allocator's holes included) plus 1 MiB per row."""
    def probe(model, settings, batch, device, max_grad_norm, meter=None, ceiling=None, step_bytes=0, typical=None):
        rows, width = batch["input_ids"].shape
        return {"micro_step_seconds": 1e-3 * rows * width, "optimizer_step_seconds": 0.0, "probe_seconds": 0.01,
                "tokens": rows * width, "batch_shape": [rows, width],
                "measured_peak_bytes": held["bytes"] + rows * 2**20}
    return probe


@pytest.mark.parametrize("holes", [False, pytest.param(True, marks=pytest.mark.slow)])  # one case in make test
def test_the_allocator_is_made_lean_only_when_the_first_probe_does_not_fit_with_its_own(dataset, monkeypatch,
                                                                                        tmp_path, holes):
    """glibc's own thresholds keep freed blocks resident (more RSS) but train faster: `make_lean` is asked only when
    the first probe measures over the budget with them; the first probe is then measured again, the search charges
    the new measure, and the plan says what was done. When it fits, the allocator is left alone, and every candidate
    trims the heap before each micro-batch (its freed blocks would stay resident over the run)."""
    from looptrain.memory import allocator
    from looptrain.planning import rss_baseline_bytes

    train_set, collator = dataset
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    held = {"bytes": (600 if holes else 100) * 2**20, "lean": False}
    monkeypatch.setattr(probes, "probe", rss_probe(held))
    monkeypatch.setattr(allocator, "keeps_freed", lambda: not held["lean"])  # glibc's own thresholds, until fixed
    asked = []

    def make_lean():
        asked.append(held["bytes"])
        held.update(bytes=100 * 2**20, lean=True)  # the holes returned to the OS
        return "thresholds fixed (a stand-in)"

    lines = []
    result = plan(make_tiny_bert(num_labels=2), train_set, collator, memory_budget=300 * 2**20,
                  effective_batch=EFFECTIVE_BATCH, rss_baseline=rss_baseline_bytes(), probe_budget=0.0,
                  make_lean=make_lean, echo=lines.append)
    assert asked == ([600 * 2**20] if holes else [])
    assert result.malloc == ("thresholds fixed (a stand-in)" if holes else None)
    assert result.to_dict()["malloc"] == result.malloc
    assert [c.settings.trim_heap for c in result.candidates] == [not holes] * len(result.candidates)
    assert any("the run trims the heap before each micro-batch" in note for note in result.notes) == (not holes)
    reference = next(c for c in result.candidates if c.baseline)
    assert reference.probe["measured_peak_bytes"] == 100 * 2**20 + reference.settings.batch_size * 2**20
    said = [line for line in lines if "under the C allocator's own thresholds" in line]
    assert len(said) == (1 if holes else 0)
    if holes:
        assert re.search(r"16 x 1 measured 0\.60 GiB, over the budget with the run's growth, under the C allocator's "
                         r"own thresholds: thresholds fixed \(a stand-in\); measuring it again", said[0]), said
        assert any(note.startswith("the first probe did not fit under the C allocator's own thresholds")
                   for note in result.notes)


@pytest.mark.parametrize("middle_fits", [pytest.param(True, marks=pytest.mark.slow), False])  # one case in make test
def test_the_allocator_is_made_only_as_lean_as_the_first_probe_needs(dataset, monkeypatch, tmp_path, middle_fits):
    """`make_lean` goes one step leaner a call (`allocator.fix_thresholds`: 1 MiB with the heap trimmed, which trains
    nearly as fast as glibc's own thresholds, then 128 KiB): the planner stops asking once the first probe fits, and
    the run trims the heap where the step leaves blocks in it."""
    from looptrain.memory import allocator
    from looptrain.planning import rss_baseline_bytes

    train_set, collator = dataset
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    held = {"bytes": 600 * 2**20, "lean": False}
    monkeypatch.setattr(probes, "probe", rss_probe(held))
    monkeypatch.setattr(allocator, "keeps_freed", lambda: not held["lean"])
    steps = [(150 if middle_fits else 280, False, "1 MiB (a stand-in)"), (100, True, "128 KiB (a stand-in)")]
    asked = []

    def make_lean():
        asked.append(held["bytes"] // 2**20)
        if len(asked) > len(steps):
            return None
        megabytes, lean, said = steps[len(asked) - 1]
        held.update(bytes=megabytes * 2**20, lean=lean)
        return said

    lines = []
    result = plan(make_tiny_bert(num_labels=2), train_set, collator, memory_budget=300 * 2**20,
                  effective_batch=EFFECTIVE_BATCH, rss_baseline=rss_baseline_bytes(), probe_budget=0.0,
                  make_lean=make_lean, echo=lines.append)
    assert asked == ([600] if middle_fits else [600, 280])
    assert result.malloc == ("1 MiB (a stand-in)" if middle_fits else "128 KiB (a stand-in)")
    assert [c.settings.trim_heap for c in result.candidates] == [middle_fits] * len(result.candidates)
    said = [line for line in lines if "measuring it again" in line]
    assert len(said) == len(asked)
    assert "under the C allocator's own thresholds: 1 MiB (a stand-in)" in said[0]
    if not middle_fits:
        assert "measured 0.29 GiB, over the budget with the run's growth, under the C allocator's thresholds so far: " \
            "128 KiB (a stand-in); measuring it again" in said[1], said


def test_a_first_probe_stopped_at_its_ceiling_makes_the_allocator_lean_and_is_measured_again(dataset, monkeypatch,
                                                                                             tmp_path):
    """The first probe's ceiling is the most it may measure and fit with the growth its own measure implies (a quarter
    of what it holds besides its estimate): (budget / (1 + margin) + estimate / 4) / 1.25. Under glibc's own
    thresholds the heap's holes take it past, so it stops there (no timings), the allocator is made lean and the probe
    is measured again, whole; the plan's time and its charge for what the process holds besides the tensors come from
    that second measure."""
    from looptrain.memory import allocator
    from looptrain.planning import plans, rss_baseline_bytes

    train_set, collator = dataset
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    held, budget = {"bytes": 600 * 2**20, "lean": False}, 300 * 2**20
    measure, calls = rss_probe(held), []

    def probe(model, settings, batch, device, max_grad_norm, meter=None, ceiling=None, step_bytes=0, typical=None):
        result = measure(model, settings, batch, device, max_grad_norm, meter)
        calls.append((ceiling, result["measured_peak_bytes"] > ceiling))
        if result["measured_peak_bytes"] <= ceiling:
            return result
        return {"stopped": True, "ceiling": ceiling, "measured_peak_bytes": ceiling + 2**20, "probe_seconds": 0.01,
                "tokens": result["tokens"], "batch_shape": result["batch_shape"]}

    monkeypatch.setattr(probes, "probe", probe)
    monkeypatch.setattr(allocator, "keeps_freed", lambda: not held["lean"])
    result = plan(make_tiny_bert(num_labels=2), train_set, collator, memory_budget=budget,
                  effective_batch=EFFECTIVE_BATCH, rss_baseline=rss_baseline_bytes(), probe_budget=0.0,
                  make_lean=lambda: held.update(bytes=100 * 2**20, lean=True) or "thresholds fixed (a stand-in)")
    reference = next(c for c in result.candidates if c.baseline)
    fitting = int((budget / (1 + plans.DEFAULT_MARGIN["cpu"]) + reference.estimated_peak_bytes / 4) / 1.25)
    assert calls[:2] == [(fitting, True), (fitting, False)]  # stopped under glibc's thresholds, whole once lean
    assert result.malloc == "thresholds fixed (a stand-in)"
    # The most that fits by the plan's own rule: its measure plus the growth it implies, with the margin.
    grown = fitting + (fitting - reference.estimated_peak_bytes) / 4
    assert grown * (1 + plans.DEFAULT_MARGIN["cpu"]) <= budget < (grown + 2) * (1 + plans.DEFAULT_MARGIN["cpu"])
    assert not reference.probe.get("stopped") and reference.seconds_per_epoch > 0
    assert reference.probe["measured_peak_bytes"] == 100 * 2**20 + reference.settings.batch_size * 2**20


@pytest.mark.parametrize("holes", [pytest.param(False, marks=pytest.mark.slow), True])  # one case in make test
def test_a_rerun_measures_again_the_cached_first_probe_that_makes_the_allocator_lean(dataset, monkeypatch, tmp_path,
                                                                                    holes):
    """The first probe under glibc's own thresholds leaves freed chunks in the heap, which the run reuses once the
    thresholds are fixed (a rerun that read it from the cache trained 10% slower): read from the cache and over the
    budget, it is measured again before `make_lean`; read from the cache and fitting, it is not."""
    from looptrain.memory import allocator
    from looptrain.planning import rss_baseline_bytes

    train_set, collator = dataset
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    held = {"bytes": (600 if holes else 100) * 2**20, "lean": False}
    measure = rss_probe(held)
    monkeypatch.setattr(probes, "probe", lambda *args, **kwargs: {**measure(*args, **kwargs), "from_cache": True})
    measured = []
    monkeypatch.setattr(probes, "measure_probe", lambda model, settings, *rest, **options: measured.append(
        (settings, held["lean"])) or measure(model, settings, *rest))
    monkeypatch.setattr(allocator, "keeps_freed", lambda: not held["lean"])

    def make_lean():
        held.update(bytes=100 * 2**20, lean=True)
        return "thresholds fixed (a stand-in)"

    result = plan(make_tiny_bert(num_labels=2), train_set, collator, memory_budget=300 * 2**20,
                  effective_batch=EFFECTIVE_BATCH, rss_baseline=rss_baseline_bytes(), probe_budget=0.0,
                  make_lean=make_lean)
    first = next(c for c in result.candidates if c.baseline).settings
    assert [(settings.batch_size, settings.accum_steps, lean) for settings, lean in measured] == \
        ([(first.batch_size, first.accum_steps, False)] if holes else [])
    assert result.malloc == ("thresholds fixed (a stand-in)" if holes else None)


@pytest.mark.slow  # over 6 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_plan_only_gives_the_lean_thresholds_with_the_command_when_the_plan_needed_them(model_dir, train_csv,
                                                                                        tmp_path, monkeypatch, capsys):
    """The console script (`owns_process=True`) lets the planner fix glibc's thresholds; a plan made with them holds
    its budget only with them, so --plan-only prints the command with MALLOC_* set. The allocator is a stand-in:
    this test process keeps its own."""
    from looptrain.memory import allocator

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    held = {"bytes": 900 * 2**20}
    monkeypatch.setattr(probes, "probe", rss_probe(held))
    monkeypatch.setattr(allocator, "fix_thresholds", lambda: held.update(bytes=100 * 2**20) or "fixed (stand-in)")
    argv = ["--model", str(model_dir), "--data", str(train_csv), "--output-dir", str(tmp_path / "out"),
            "--max-length", "32", "--memory-budget", "400MiB", "--effective-batch", "16", "--plan-only", "--json"]
    assert finetune.main(argv, owns_process=True) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["malloc"] == "fixed (stand-in)"
    assert printed["environment"] == {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    held["bytes"] = 900 * 2**20
    assert finetune.main(argv) == 2  # a process that does other work keeps its allocator: nothing fits
    assert "nothing fits" in capsys.readouterr().err


@pytest.mark.slow  # a search over real estimates
def test_a_fused_step_that_cannot_fit_is_ruled_out_by_extrapolation_not_estimated(dataset):
    """Activations are affine in a micro-batch's rows: the fused step at the whole batch holds the weights, the
    optimizer state and the activations the line through two unfused estimates gives at 16 rows. A candidate ruled
    out that way is never estimated by the plan, and a real estimate confirms it does not fit."""
    from looptrain import estimation

    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 2, 4)
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, probe=False)
    assert result.extrapolated, result.notes
    assert any("fused-step candidate(s) not estimated: the line through two estimates" in note
               for note in result.notes)
    width = result.worst_width
    for settings in result.extrapolated:
        assert settings.optimizer_in_backward and settings.batch_size == EFFECTIVE_BATCH
        assert settings not in [c.settings for c in result.candidates]
        peak = estimation.estimate(model, settings.batch_size, width, settings, cache=False)["peak_memory_bytes"]
        assert peak * (1 + result.margin) > budget


def test_the_fused_steps_bound_is_the_line_through_two_estimates_not_one_scaled():
    """The fused step at the whole batch is ruled out without an estimate only when the weights, the optimizer state
    and the activations read off the line through the two largest unfused estimates (activations 10 + 2 MiB a row:
    74 MiB at 32 rows) do not fit. Scaling one estimate's activations by the rows (26 MiB at 8 rows, x 4) would
    overstate them by the line's intercept, and rule out a fused step that fits."""
    from looptrain.planning import search as plan_search
    from looptrain.planning.book import EstimateBook
    from looptrain.planning.budget import Budget

    mib = 2**20
    for budget, ruled_out in ((240, False), (200, True)):  # the bound: 100 + 50 + 74 = 224 MiB
        book = EstimateBook(torch.nn.Linear(1, 1), 32)
        search = plan_search.Search(book, Budget(budget * mib, 0.0))
        for rows in (4, 8):
            split = Strategy(batch_size=rows, accum_steps=32 // rows)
            book.results[book.key(split)] = {"memory_breakdown": {
                "peak_phase": "backward", "params": 100 * mib, "optimizer_state": 50 * mib,
                "activations_and_temps": (10 + 2 * rows) * mib}}
        extrapolated = plan_search.ruled_out_fused(search, Strategy(batch_size=8, accum_steps=4), 32)
        assert (extrapolated is not None) == ruled_out
        assert [s.batch_size for s in [extrapolated] if s is not None] == ([32] if ruled_out else [])


def test_with_no_planning_time_the_search_stops_short_and_the_baseline_trains(dataset, monkeypatch, tmp_path):
    """Planning's time (estimates and probes) is bounded: with none left after the first probe and nothing cached,
    the search estimates one round more, the whole batch with the step fused into backward (`whole_batch_fused`),
    and nothing else; the note says so. The configuration without the planner and the prior's favourite among the
    others (here the lightest split, cut by tokens: less padding at the same speed a token) are both probed, and the
    faster measured trains."""
    from looptrain.planning import book

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cold"))
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    monkeypatch.setattr(probes, "probe", fake_probe(dict.fromkeys((1, 2, 4, 8, 16), 1.0)))
    real = book.estimate  # the whole batch fused: over the budget, in no time (a real estimate costs seconds here)
    monkeypatch.setattr(book, "estimate", lambda model, rows, width, settings, **kwargs: real(
        model, rows, width, settings, **kwargs) if not settings.optimizer_in_backward else
        {**row_estimates(model, rows), "peak_memory_bytes": 2 * budget})
    user = Strategy(batch_size=2, accum_steps=8)
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, base=user,
                  probe_budget=0.0)
    # The baseline's own estimate (does it fit), and with two estimate workers the lightest split's beside it; then
    # one round of the whole batch fused (as many as there are workers).
    from looptrain.planning.candidates import by_tokens
    from looptrain.planning.search import CHECKPOINT_MODES, whole_batch_fused

    workers = max(1, book.estimate_workers())
    fused = whole_batch_fused(user, EFFECTIVE_BATCH, [("fp32", "fp32")], list(reversed(CHECKPOINT_MODES)),
                              "adamw")[:workers]
    assert result.estimates == min(2, workers) + len(fused) and result.cached_estimates == 0
    # The candidates are splits those estimates priced (the lightest, where it was estimated beside the baseline)
    # and nothing else; the configuration without the planner, probed, trains.
    lightest = by_tokens(Strategy(batch_size=1, accum_steps=EFFECTIVE_BATCH, gradient_checkpointing=True,
                                  checkpoint_every=1), result.worst_width)  # cut by tokens as the planner trains it
    settings = [c.settings for c in result.candidates]
    assert user in settings and all(s in [user, lightest, *fused] for s in settings)
    assert result.winner.settings == lightest and all(c.probed for c in result.candidates[:2])
    assert any("the search stopped short of" in note for note in result.notes)


def one_second_estimates(dataset, monkeypatch):
    """The dataset, a tiny BERT and a budget between micro-batches 4 and 8, with every estimate costed at 1 s
    (`compute_seconds`: what planning's time charges) and probes faked: planning's decisions depend on no clock."""
    from looptrain.planning import book

    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    real = book.estimate
    monkeypatch.setattr(book, "estimate",
                        lambda *args, **kwargs: {**real(*args, **kwargs), "compute_seconds": 1.0})
    monkeypatch.setattr(probes, "probe", fake_probe(dict.fromkeys((1, 2, 4, 8, 16), 1.0)))
    return train_set, collator, model, budget


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_a_rerun_on_the_cache_takes_the_same_decisions_in_a_fraction_of_the_time(dataset, monkeypatch, tmp_path):
    """Planning's time counts each estimate at what computing it cost, one read from the cache at its recorded cost:
    a rerun on the cache stops where the first run stopped (it does not spend the time again on splits the first did
    not reach), plans the same candidates and trains the same winner. Here every estimate costs 1 s."""
    from looptrain.planning import book

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    train_set, collator, model, budget = one_second_estimates(dataset, monkeypatch)
    monkeypatch.setattr(book, "estimate_workers", lambda: 1)  # one at a time (side by side: the next test)
    options = {"memory_budget": budget, "effective_batch": EFFECTIVE_BATCH, "probe_budget": 3.5}
    first = plan(model, train_set, collator, **options)
    # 1 s each, of 3.48 s: the third ends at 3 s; a fourth would end past it, so it is not started.
    assert first.estimates == 3 and first.cached_estimates == 0
    assert any("the search stopped short of" in note for note in first.notes)
    # The table's last line says what the probe budget is: what is left after the probes that always run.
    assert f"({first.probe_budget_seconds:.0f} s left for probes beyond the baseline's and the favourite's)" \
        in first.table().splitlines()[-1 - len(first.notes)]
    again = plan(model, train_set, collator, **options)
    assert again.estimates == again.cached_estimates == 3  # not one more: the cached three cost 3 s as before
    assert again.notes == first.notes and again.charged_seconds == pytest.approx(first.charged_seconds)
    assert [c.settings for c in again.candidates] == [c.settings for c in first.candidates]


def test_estimates_side_by_side_find_the_same_plan_and_charge_a_round_as_its_longest(dataset, monkeypatch, tmp_path):
    """With two estimate workers the search estimates the baseline beside the lightest split, and each binary-search
    step beside the step it takes when that one fits: the same candidates as one worker finds, its rounds charged
    as their longest estimate (here every estimate costs 1 s), so the same time searches as far."""
    from looptrain.planning import book

    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    per_row = {(True, 1): 1, (True, 2): 2, (False, 1): 4}  # MiB of activations a row: every block, every other, none

    def affine(model, rows, seq_len, settings, **kwargs) -> dict:  # 10 MiB of weights, the rows' activations
        activations = rows * per_row[settings.gradient_checkpointing, settings.checkpoint_every] * 2**20
        return {"peak_memory_bytes": 10 * 2**20 + activations, "compute_seconds": 1.0, "from_cache": False,
                "memory_breakdown": {"peak_phase": "backward", "params": 10 * 2**20, "optimizer_state": 0,
                                     "activations_and_temps": activations}}

    monkeypatch.setattr(book, "estimate", affine)
    monkeypatch.setattr(probes, "probe", fake_probe(dict.fromkeys((1, 2, 4, 8, 16), 1.0)))
    budget = int(1.05 * 36 * 2**20)  # no checkpointing: 4 rows fit (26 MiB), 8 do not (42 MiB); every other: 8
    results = {}
    for workers in (1, 2):
        monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / f"cache-{workers}"))
        monkeypatch.setattr(book, "estimate_workers", lambda workers=workers: workers)
        results[workers] = plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH,
                                probe_budget=100.0, token_micro_batches=False)  # the splits as searched
    one, two = results[1], results[2]
    assert [c.settings for c in two.candidates] == [c.settings for c in one.candidates]
    assert {(c.settings.batch_size, c.settings.checkpoint_every if c.settings.gradient_checkpointing else 0)
            for c in one.candidates} >= {(4, 0), (8, 2), (16, 1)}
    assert one.charged_seconds == pytest.approx(one.estimates + 0.01 * len([c for c in one.candidates if c.probed]),
                                                abs=0.05)
    assert two.estimates >= one.estimates and two.charged_seconds < one.charged_seconds - 1


def test_a_round_side_by_side_is_charged_as_its_longest_and_a_failed_prefetch_is_not_kept():
    """`EstimateBook.prefetch` sends one estimate to each worker and reads every answer: the round counts as its longest
    estimate, and an estimate that failed beside another is not memoised, so the search meets its error when it
    asks for it, and not before."""
    from looptrain.planning.book import EstimateBook

    class Worker:
        def submit(self, request):
            self.request = request

        def collect(self):
            settings = self.request[0]
            if settings.batch_size == 16:
                raise ValueError("no estimate at 16 rows")
            return {"peak_memory_bytes": settings.batch_size * 2**20, "compute_seconds": settings.batch_size / 4}

    search = EstimateBook(torch.nn.Linear(1, 1), 32, workers=[Worker(), Worker()])
    two, four, sixteen = (Strategy(batch_size=size, accum_steps=16 // size) for size in (2, 4, 16))
    search.prefetch([two, four])
    assert search.count == 2 and search.charged == pytest.approx(1.0)  # 0.5 s beside 1.0 s: the round is 1.0 s
    assert search.peak(four) == 4 * 2**20 and search.count == 2  # memoised: not estimated again
    search.prefetch([sixteen, Strategy(batch_size=8, accum_steps=2)])
    assert search.count == 3 and search.charged == pytest.approx(3.0)
    with pytest.raises(ValueError, match="no estimate at 16 rows"):
        search.peak(sixteen)


def test_a_small_runs_estimates_leave_room_in_ten_seconds_for_both_probes():
    """Planning's time is 5% of the run, at least `MIN_PLANNING_SECONDS` (10 s), probes included: the estimates get
    what is left after the first probe and as much again for the favourite's, which follows the search."""
    from looptrain.planning import plans

    assert plans.MIN_PLANNING_SECONDS == 10.0
    assert plans.estimate_seconds(2.2, 2.5, plans.MIN_PLANNING_SECONDS) == pytest.approx(5.0)  # a 44-s run
    assert plans.estimate_seconds(200.0, 2.5, plans.MIN_PLANNING_SECONDS) == pytest.approx(195.0)  # a long run
    assert plans.estimate_seconds(2.2, 6.0, plans.MIN_PLANNING_SECONDS) < 0  # probes alone fill it: no search
    assert plans.estimate_seconds(0.0, 1.0, 0.0) == pytest.approx(-2.0)  # --plan-time 0: no floor
    # The first probe measured twice (the allocator fixed after the first): both count, the second is reserved again.
    assert plans.estimate_seconds(2.2, 1.0, plans.MIN_PLANNING_SECONDS, spent=3.5) == pytest.approx(5.5)


def test_a_probe_times_a_small_micro_batch_and_a_candidates_epoch_counts_each_micro_batchs_fixed_cost():
    """A probe of an accumulating split runs its warm-up twice and times the second (rows x 16 tokens) beside the
    worst batch; an unaccumulated one times only the worst batch. The line through the two, in model FLOPs, splits
    a micro-batch's time into a fixed cost and its work; an epoch is then its micro-batches' fixed costs, their work
    and its optimizer steps, so the same tokens cut into twice the micro-batches are predicted slower by that cost.
    """
    from looptrain.flops import ModelFlops, count_model_flops
    from looptrain.planning import plans, timing

    model = make_tiny_bert(num_labels=2)
    rows, width = 2, 24  # wider than the warm-up's 16 columns, every one a real token
    ids = torch.randint(5, model.config.vocab_size, (rows, width), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones(rows, width, dtype=torch.long),
             "labels": torch.tensor([0, 1])}
    accumulating = probes.measure_probe(model, Strategy(batch_size=2, accum_steps=8), batch, "cpu", 1.0)
    assert accumulating["small_batch_shape"] == [rows, probes.PROBE_WARM_UP_WIDTH]
    assert 0 < accumulating["small_step_seconds"]
    whole = probes.measure_probe(model, Strategy(batch_size=2, accum_steps=1), batch, "cpu", 1.0)
    assert "small_step_seconds" not in whole
    assert timing.micro_batch_costs(whole, count_model_flops(model)) is None

    flops = ModelFlops(dense=100.0, attention=1.0)  # 2 x 16 rows: 3,712 FLOPs; 2 x 256: 182,272
    probe = {"micro_step_seconds": 0.1 + 182_272e-6, "small_step_seconds": 0.1 + 3_712e-6,
             "small_batch_shape": [2, 16], "batch_shape": [2, 256], "tokens": 512, "optimizer_step_seconds": 0.5}
    fixed, per_flop = timing.micro_batch_costs(probe, flops)
    assert fixed == pytest.approx(0.1) and per_flop == pytest.approx(1e-6)
    assert timing.micro_batch_costs({**probe, "small_step_seconds": 0.3}, flops) is None  # noise: slower than large
    assert timing.micro_batch_costs({**probe, "small_step_seconds": 0.001}, flops) == \
        (0.0, pytest.approx(probe["micro_step_seconds"] / 182_272))  # a negative fixed cost: all of it work

    few, many = (plans.Candidate(Strategy(), 0, padded_tokens=4096, micro_batches=count, flops=2e6, updates=8)
                 for count in (10, 20))
    for candidate in (few, many):
        timing.record_probe(candidate, probe, flops)
    assert few.seconds_per_epoch == pytest.approx(0.1 * 10 + 2.0 + 0.5 * 8)
    assert many.seconds_per_epoch - few.seconds_per_epoch == pytest.approx(0.1 * 10)
    tokens_only = plans.Candidate(Strategy(), 0, padded_tokens=4096, micro_batches=10, updates=8)  # no FLOPs
    timing.record_probe(tokens_only, probe, flops)
    assert tokens_only.seconds_per_epoch == pytest.approx(probe["micro_step_seconds"] / 512 * 4096 + 0.5 * 8)


def test_a_probe_times_a_typical_micro_batch_after_the_worst_and_prices_the_run_from_it(monkeypatch):
    """The worst batch's longest rows cost more per FLOP than a run's typical micro-batches (docs/plan.md: 11.5
    against 6.5-7 s per TFLOP), so a probe given a `typical` micro-batch times it after the worst batch, and the line
    of costs goes through it and the small step, not through the worst batch. A probe stopped at its ceiling by the
    worst batch never runs it."""
    from looptrain.flops import ModelFlops
    from looptrain.planning import plans, timing

    seen = []
    real_compute_loss = Loop.compute_loss
    monkeypatch.setattr(Loop, "compute_loss", lambda self, batch: seen.append(list(batch["input_ids"].shape))
                        or real_compute_loss(self, batch))
    model = make_tiny_bert(num_labels=2)
    ids = torch.randint(5, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    worst = {"input_ids": ids[:2], "attention_mask": torch.ones(2, 24, dtype=torch.long),
             "labels": torch.tensor([0, 1])}
    typical = probes.warm_up_batch({"input_ids": ids, "attention_mask": torch.ones(3, 24, dtype=torch.long),
                                    "labels": torch.tensor([0, 1, 0])}, 20)
    settings = Strategy(batch_size=2, accum_steps=8)
    timed = probes.measure_probe(model, settings, worst, "cpu", 1.0, typical=typical)
    assert seen == [[2, 16], [2, 16], [2, 24], [3, 20]]  # warm-up twice, the worst, then the typical
    assert timed["typical_batch_shape"] == [3, 20] and timed["typical_step_seconds"] > 0
    assert timed["batch_shape"] == [2, 24] and timed["micro_step_seconds"] > 0 and timed["small_step_seconds"] > 0

    # One micro-batch an update (no accumulation, the fused step): the typical one is an update of its own, second.
    for one in (Strategy(batch_size=2, accum_steps=1), Strategy(batch_size=2, accum_steps=1, optimizer="sgd",
                                                                 optimizer_in_backward=True)):
        seen.clear()
        alone = probes.measure_probe(model, one, worst, "cpu", 1.0, typical=typical)
        assert seen == [[2, 16], [3, 20], [2, 24]] and alone["typical_step_seconds"] > 0
        assert alone["typical_batch_shape"] == [3, 20] and "small_step_seconds" not in alone

    class Past:  # a meter that reads past any ceiling: the probe stops at the worst batch's first check
        kind = "rss"

        def settle(self):
            pass

        def reset(self):
            pass

        def peak(self):
            return 2**40

        def current(self):
            return 2**40
    seen.clear()
    stopped = probes.measure_probe(model, settings, worst, "cpu", 1.0, Past(), 2**30, typical=typical)
    assert stopped["stopped"] is True and seen == [[2, 16], [2, 16]]  # stopped as the worst batch started
    assert all(parameter.grad is None for parameter in model.parameters())

    class Below(Past):  # within the ceiling, but not with the optimizer step's bytes on top
        def current(self):
            return 2**30 - 2**20
    seen.clear()
    stopped = probes.measure_probe(model, settings, worst, "cpu", 1.0, Below(), 2**30, step_bytes=2**21,
                                   typical=typical)
    assert stopped["stopped"] is True and stopped["before_step_bytes"] == 2**21
    assert seen == [[2, 16], [2, 16], [2, 24]]  # the step would not fit: stopped before the typical micro-batch

    flops = ModelFlops(dense=100.0, attention=1.0)  # 2 x 16: 3,712 FLOPs; 4 x 64: 41,984; 2 x 256: 182,272
    probe = {"small_step_seconds": 0.1 + 3_712e-6, "small_batch_shape": [2, 16],
             "typical_step_seconds": 0.1 + 41_984e-6, "typical_batch_shape": [4, 64],
             "micro_step_seconds": 0.1 + 1.5 * 182_272e-6, "batch_shape": [2, 256], "tokens": 512,
             "optimizer_step_seconds": 0.5}
    assert timing.micro_batch_costs(probe, flops) == (pytest.approx(0.1), pytest.approx(1e-6))
    without = {key: value for key, value in probe.items() if not key.startswith("typical")}
    assert timing.micro_batch_costs(without, flops)[1] == pytest.approx((1.5 * 182_272 - 3_712) / (182_272 - 3_712)
                                                                         * 1e-6)  # the worst batch's dearer FLOPs

    # A split of the same kernels reuses that line, with its own optimizer steps: its probe times no typical batch.
    assert timing.same_kernels(Strategy(batch_size=2, accum_steps=16),
                                Strategy(batch_size=32, accum_steps=1, micro_batch_tokens=512))
    assert not timing.same_kernels(Strategy(batch_size=2, accum_steps=16),
                                    Strategy(batch_size=2, accum_steps=16, gradient_checkpointing=True))
    other = plans.Candidate(Strategy(batch_size=4, accum_steps=8), 0, padded_tokens=4096, micro_batches=10,
                            flops=2e6, updates=8)
    timing.record_probe(other, {**without, "optimizer_step_seconds": 0.25}, flops, line_from=probe)
    assert other.seconds_per_epoch == pytest.approx(0.1 * 10 + 2.0 + 0.25 * 8)
    # Without a line (one micro-batch an update), the typical micro-batch's seconds per FLOP price the epoch (per
    # padded token without FLOPs counted).
    alone = {key: value for key, value in probe.items() if not key.startswith("small")}
    whole = plans.Candidate(Strategy(batch_size=8, accum_steps=1), 0, padded_tokens=4096, micro_batches=8,
                            flops=2e6, updates=8)
    timing.record_probe(whole, alone, flops)
    assert whole.seconds_per_epoch == pytest.approx((0.1 + 41_984e-6) / 41_984 * 2e6 + 0.5 * 8)
    uncounted = plans.Candidate(Strategy(batch_size=8, accum_steps=1), 0, padded_tokens=4096, micro_batches=8,
                                updates=8)
    timing.record_probe(uncounted, alone, flops)
    assert uncounted.seconds_per_epoch == pytest.approx((0.1 + 41_984e-6) / 256 * 4096 + 0.5 * 8)


def test_a_probes_warm_up_is_the_worst_batch_cut_to_columns_real_in_every_row():
    """The warm-up micro-batch only has to leave the gradients (their size does not depend on the width): the worst
    batch cut to 16 columns that are real tokens in every row, right or left padding alike."""
    from looptrain.planning.probes import PROBE_WARM_UP_WIDTH, warm_up_batch

    assert PROBE_WARM_UP_WIDTH == 16
    ids = torch.arange(80).reshape(2, 40)
    right = torch.ones(2, 40, dtype=torch.long)
    right[1, 30:] = 0
    batch = {"input_ids": ids, "attention_mask": right, "token_type_ids": torch.zeros(2, 40, dtype=torch.long),
             "labels": torch.tensor([0, 1])}
    warm = warm_up_batch(batch, 16)
    assert torch.equal(warm["input_ids"], ids[:, :16]) and torch.equal(warm["attention_mask"], right[:, :16])
    assert warm["token_type_ids"].shape == (2, 16) and torch.equal(warm["labels"], batch["labels"])
    left = torch.ones(2, 40, dtype=torch.long)
    left[1, :10] = 0
    warm = warm_up_batch({**batch, "attention_mask": left}, 16)
    assert torch.equal(warm["input_ids"], ids[:, 10:26]) and bool(warm["attention_mask"].all())
    causal = {"input_ids": ids, "labels": ids.clone()}  # no mask: every column is real; token labels are cut too
    assert warm_up_batch(causal, 16)["labels"].shape == (2, 16)
    assert warm_up_batch({"input_ids": ids[:, :12]}, 16)["input_ids"].shape == (2, 12)  # no wider: as it is
    few = torch.zeros(2, 40, dtype=torch.long)
    few[:, :5] = 1  # 5 columns real in every row: fewer than 16, so the whole batch warms up
    assert warm_up_batch({**batch, "attention_mask": few}, 16)["input_ids"].shape == (2, 40)


# ------------------------------------------------------------------------------ the search order, the probe cache
class AffineSearch:
    """A `Search` stand-in: a peak affine in the micro-batch's rows, per checkpointing mode; records each estimate."""

    ROW = {(True, 1): 1, (True, 2): 2, (False, 1): 4}  # activations per row: every block, every other, none

    def __init__(self, budget: int, limit: float | None = None):
        self.budget, self.margin, self.overhead, self.measured, self.padded = budget, 0.0, 0, False, False
        self.results, self.estimated, self.cache = {}, [], set()
        self.limit, self.rounds = limit, []  # a time limit (probes follow); the rounds `prefetch_all` was asked for
        self.forced = []  # the rounds `estimate_round` was asked for

    def prefetch_all(self, settings_list) -> None:
        self.rounds.append(list(settings_list))

    def estimate_round(self, settings_list, rounds=1) -> None:
        self.forced.append(list(settings_list))  # the search's first round: `known` says what it priced

    def peak(self, settings) -> int:
        grads = 0 if settings.optimizer_in_backward else 10
        return 20 + grads + settings.batch_size * self.ROW[settings.gradient_checkpointing, settings.checkpoint_every]

    def key(self, settings):
        return repr(settings)

    def prefetch(self, settings_list) -> None:
        pass  # one estimate at a time: `estimated` records the search's own order

    def known(self, settings) -> bool:
        return False  # no predictions: every step is estimated

    def memoised(self, settings) -> bool:
        return self.key(settings) in self.cache

    def family_estimates(self, settings) -> list:
        return []  # no estimate results: the fused step is never ruled out without its own

    def fits(self, settings) -> bool:
        self.estimated.append(settings)
        self.cache.add(self.key(settings))
        return self.peak(settings) <= self.budget


def row_estimates(model, rows, *args, **kwargs) -> dict:
    """An `estimate` stand-in for tests whose statement needs no real estimate: a MiB per row, the peak in the
    optimizer step, computed in no time."""
    return {"peak_memory_bytes": rows * 2**20, "memory_breakdown": {"peak_phase": "optimizer_step"},
            "compute_seconds": 0.0, "from_cache": False}


def test_planning_hides_the_objects_it_found_from_the_collector_and_gives_them_back(dataset, monkeypatch, tmp_path):
    """Each probe collects garbage before it is measured; after the imports a full collection took about 0.2 s. The
    plan freezes the objects that exist when it starts (`gc.freeze`), so its collections scan only what it makes,
    and unfreezes them when it returns; objects the caller had frozen stay frozen."""
    import gc

    from looptrain.planning import book

    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    seen = []
    monkeypatch.setattr(book, "estimate", row_estimates)
    probe = fake_probe(dict.fromkeys((1, 2, 4, 8, 16), 1.0))
    monkeypatch.setattr(probes, "probe", lambda *args, **kwargs: seen.append(gc.get_freeze_count())
                        or probe(*args, **kwargs))
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    options = {"memory_budget": 2**30, "effective_batch": EFFECTIVE_BATCH, "probe_budget": 0.0}
    gc.unfreeze()  # from an unfrozen collector (a plugin or library of the test process may have frozen some)
    plan(model, train_set, collator, **options)
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0

    gc.freeze()  # the caller's own
    try:
        plan(model, train_set, collator, **options)
        assert gc.get_freeze_count() > 0  # still frozen (a few may have been freed meanwhile)
    finally:
        gc.unfreeze()


def test_the_optimizers_libraries_are_imported_before_the_estimate_workers_fork(dataset, monkeypatch):
    """Importing transformers' Adafactor (or bitsandbytes) costs about a second; imported once before the workers
    fork, each child finds it imported. Every optimizer the plan may try is imported; a missing library is left to
    the estimate, which says so."""
    from looptrain.planning import book
    from looptrain.planning import search as plan_search

    events = []
    monkeypatch.setattr(book, "estimate", row_estimates)
    monkeypatch.setattr(plan_search, "import_optimizer", lambda name: events.append(name))
    real_worker = book.EstimateWorker
    monkeypatch.setattr(book, "EstimateWorker", lambda serve: events.append("fork") or real_worker(serve))
    train_set, collator = dataset
    plan(make_tiny_bert(num_labels=2), train_set, collator, memory_budget=2**30, effective_batch=EFFECTIVE_BATCH,
         base=Strategy(batch_size=8, accum_steps=1, optimizer="adafactor"), probe=False)
    assert events[0] == "adafactor" and events[1:] == ["fork"] * book.estimate_workers()

    events.clear()
    plan_search.import_optimizers(Strategy(optimizer="adamw"), Levers(optimizer_family=True), ())
    assert events == ["adamw", "adamw8bit", "paged_adamw8bit"]
    events.clear()
    plan_search.import_optimizers(Strategy(optimizer="adamw"), Levers(optimizer_family=True), ("optimizer",))
    assert events == ["adamw"]

    def missing(name):
        raise ImportError("no bitsandbytes")

    monkeypatch.setattr(plan_search, "import_optimizer", missing)
    plan_search.import_optimizers(Strategy(optimizer="adamw8bit"), Levers(), ())  # no error here


def test_the_last_step_of_the_search_is_estimated_beside_the_split_below_the_best():
    """Each binary-search step is estimated beside the step it takes when that one fits; the last step, beside the
    split below the best so far: the one `smaller_split` probes in place of the favourite when the favourite's probe
    measures over the budget, so that its estimate is made before, in the round's spare worker."""
    from looptrain.planning import search as plan_search

    class Rounds(AffineSearch):
        def __init__(self, budget: int):
            super().__init__(budget)
            self.rounds = []

        def prefetch(self, settings_list) -> None:
            self.rounds.append([settings.batch_size for settings in settings_list])

    template = Strategy(batch_size=1, accum_steps=32, gradient_checkpointing=True, checkpoint_every=1)
    for budget, best, last in ((38, 8, [8, 2]), (37, 4, [8, 2]), (50, 16, [32, 8])):
        search = Rounds(budget)  # every block checkpointed: 20 + 10 + a row each
        assert plan_search.largest_fitting(search, template, [1, 2, 4, 8, 16, 32], 32).size == best
        assert search.rounds[0] == [4, 16] and search.rounds[-1] == last


@pytest.mark.parametrize("mix", [
    {"optimizer": "adafactor", "gradient_checkpointing": True, "checkpoint_every": 1},
    pytest.param({"optimizer": "adamw"}, marks=pytest.mark.slow),
    pytest.param({"optimizer": "adamw", "precision": "fp16", "gradient_checkpointing": True, "checkpoint_every": 2},
                 marks=pytest.mark.slow),
])
def test_a_splits_peak_is_predicted_phase_by_phase_from_two_estimates_at_other_micro_batches(mix):
    """For fixed settings at one width, each phase's peak is affine in the micro-batch's rows: from the estimates at
    2 and 4 rows, `EstimateBook.predict` gives the estimator's own peak at 3 and 8 rows (interpolated and extrapolated),
    checked against estimates made apart. One row of a padded worst batch is not padded: no prediction there, nor
    for other settings."""
    from looptrain import estimation
    from looptrain.planning.book import EstimateBook

    model = make_tiny_bert(num_labels=2, num_layers=3)
    search = EstimateBook(model, 24, padded=True)
    split = lambda rows: Strategy(batch_size=rows, accum_steps=4, **mix)  # noqa: E731
    assert search.predict(split(3)) is None  # nothing estimated yet
    for rows in (2, 4):
        search.peak(split(rows))
    for rows in (3, 8):
        truth = estimation.estimate(model, rows, 24, split(rows), cache=False, padded=True)["peak_memory_bytes"]
        assert search.predict(split(rows)) == pytest.approx(truth, rel=1e-3)
    assert search.predict(split(1)) is None
    assert search.predict(dataclasses.replace(split(3), optimizer="sgd")) is None


def phased_estimates(extra: dict | None = None, seconds: float = 0.0):
    """An `estimate` stand-in whose phases are affine in the rows (MiB): forward 10 + 3r, backward 12 + 4r, the
    optimizer step 40, plus `extra` MiB of backward at given rows (not affine there), each costed at `seconds`.
    Records the rows estimated."""
    calls = []

    def estimate(model, rows, seq_len, settings, **kwargs) -> dict:
        if kwargs.get("cache") == "only":  # planning's time spent: only cached estimates are read, and none is
            raise LookupError("not in the cache")
        calls.append(rows)
        phases = {"forward": 10 + 3 * rows, "backward": 12 + 4 * rows + (extra or {}).get(rows, 0), "optimizer": 40}
        peak_phase = max(phases, key=phases.get)
        return {"peak_memory_bytes": phases[peak_phase] * 2**20, "compute_seconds": seconds, "from_cache": False,
                "phase_peak_bytes": {phase: value * 2**20 for phase, value in phases.items()},
                "memory_breakdown": {"peak_phase": peak_phase}}

    return estimate, calls


def test_the_search_decides_steps_by_prediction_and_estimates_the_split_a_prediction_chose(monkeypatch):
    """Over the 8 micro-batches of an effective batch of 128, the binary search estimates its first two steps and
    decides the rest by prediction. Per phase: the peaks at 8 and 32 rows (44 and 140 MiB) put 16 rows at 76 MiB, where
    a line through the peaks themselves would not. Under the tensors meter a split a prediction chose is estimated
    before it is returned, and when that estimate does not fit, the search goes on below it; under a measured meter
    (each candidate's probe measures it) the prediction stands, and so it does when planning's time is spent."""
    from looptrain.planning import book, plans
    from looptrain.planning import search as plan_search
    from looptrain.planning.budget import Budget

    template = Strategy(batch_size=1, accum_steps=128)
    sizes = plans.divisors(128)
    for budget, measured, extra, best, estimated in (
            (78, False, None, 16, [8, 32, 16]),  # 16 predicted to fit (76 MiB), then estimated: it fits
            (78, True, None, 16, [8, 32]),  # measured meter: 16's probe will measure it
            (78, False, {16: 20}, 8, [8, 32, 16]),  # 16 estimated at 96 MiB: below it, 8 (44 MiB, estimated) fits
            (50, False, None, 8, [8, 32])):  # 16 predicted over the budget: 8 was estimated already
        stand_in, calls = phased_estimates(extra)
        monkeypatch.setattr(book, "estimate", stand_in)
        estimates = book.EstimateBook(torch.nn.Linear(1, 1), 32)
        search = plan_search.Search(estimates, Budget(int(budget * 2**20), 0.0, "rss" if measured else "tensors"))
        assert plan_search.largest_fitting(search, template, sizes, 128).size == best
        assert calls == estimated and estimates.key(template.__class__(batch_size=16, accum_steps=8)) \
            in estimates.predicted

    # Planning's time spent before the chosen split could be estimated: the prediction stands, as its peak too.
    stand_in, calls = phased_estimates(seconds=1.0)
    monkeypatch.setattr(book, "estimate", stand_in)
    estimates = book.EstimateBook(torch.nn.Linear(1, 1), 32)
    estimates.limit_time(2.5)  # two estimates of 1 s: a third would end past it
    search = plan_search.Search(estimates, Budget(78 * 2**20, 0.0))
    assert plan_search.largest_fitting(search, template, sizes, 128).size == 16 and calls == [8, 32]
    assert search.candidate_peak(Strategy(batch_size=16, accum_steps=8)) == 76 * 2**20 and calls == [8, 32]


def test_a_first_round_of_estimates_is_made_only_within_planning_time(monkeypatch):
    """`Search.estimate_round` (the rounds a search asks before anything else) keeps planning's time: with 2.5 s for
    estimates of 1 s each, one at a time, it makes two and stops short of the third (counted as skipped, no error),
    and asked again makes none; with 1.5 s it makes one; `rounds=1` makes one round."""
    from looptrain.planning import book
    from looptrain.planning import search as plan_search
    from looptrain.planning.budget import Budget

    splits = [Strategy(batch_size=rows, accum_steps=128 // rows) for rows in (1, 2, 4, 8)]

    def search_of(limit: float):
        stand_in, calls = phased_estimates(seconds=1.0)
        monkeypatch.setattr(book, "estimate", stand_in)
        estimates = book.EstimateBook(torch.nn.Linear(1, 1), 32)
        estimates.limit_time(limit)
        return plan_search.Search(estimates, Budget(2**30, 0.0)), estimates, calls

    search, estimates, calls = search_of(2.5)
    search.estimate_round(splits, rounds=None)
    assert (calls, estimates.skipped) == ([1, 2], 1)
    search.estimate_round(splits[2:])  # no room for a third
    assert (calls, estimates.skipped) == ([1, 2], 2)
    search, estimates, calls = search_of(1.5)
    search.estimate_round(splits, rounds=None)
    assert (calls, estimates.skipped) == ([1], 1)
    search, estimates, calls = search_of(2.5)
    search.estimate_round(splits, rounds=1)
    assert (calls, estimates.skipped) == ([1], 0)


def test_the_search_finds_the_lightest_mode_first_and_never_estimates_a_split_more_checkpointing_ruled_out():
    """Checkpointing modes are searched from every block to none, so a search cut short has found the splits most
    likely to fit; a mode checkpointing less is estimated only up to the largest micro-batch the mode before it
    fitted, and still finds its own largest split (memory grows as fewer blocks are checkpointed)."""
    import dataclasses

    from looptrain.planning import search as plan_search

    search = AffineSearch(budget=38)  # every block: 8 rows (38), every other: 4 (38), none: 2 (38); fused: 16 rows
    base = Strategy(batch_size=16, accum_steps=1)
    chosen = plan_search.candidate_settings(search, 16, base, Levers(), set(), "cpu").settings
    first = search.estimated[0]
    assert (first.gradient_checkpointing, first.checkpoint_every) == (True, 1)
    for settings in search.estimated:  # no mode is estimated above what a more checkpointed one fitted
        mode = (settings.gradient_checkpointing, settings.checkpoint_every)
        if not settings.optimizer_in_backward:
            assert settings.batch_size <= {(True, 1): 16, (True, 2): 8, (False, 1): 4}[mode], settings
    # The same splits as a brute force over every mode, size and fused step.
    expected = set()
    for (checkpointing, every), fused in [(mode, fused) for mode in AffineSearch.ROW for fused in (False, True)]:
        fits = [size for size in (1, 2, 4, 8, 16) if (not fused or size == 16) and search.peak(dataclasses.replace(
            base, batch_size=size, accum_steps=16 // size, gradient_checkpointing=checkpointing,
            checkpoint_every=every, optimizer_in_backward=fused)) <= search.budget]
        if fits:
            expected.add((checkpointing, every, fused, max(fits)))
    found = {(s.gradient_checkpointing, s.checkpoint_every, s.optimizer_in_backward, s.batch_size) for s in chosen}
    assert found == expected == {(True, 1, False, 8), (True, 2, False, 4), (False, 1, False, 2), (True, 1, True, 16)}
    assert len(search.estimated) == len({repr(settings) for settings in search.estimated})  # none twice


def test_under_a_time_limit_the_search_asks_first_which_checkpointing_modes_fit_at_their_lightest_split():
    """With planning's time bounded (probes follow), the search first estimates each checkpointing mode's lightest
    split side by side, before any mode is bisected; without a limit it does not (a whole search needs none of
    them first), and where checkpointing or the micro-batch is fixed there is no frontier to ask."""
    from looptrain.planning import search as plan_search

    base = Strategy(batch_size=16, accum_steps=1)
    timed = AffineSearch(budget=38, limit=5.0)
    assert plan_search.candidate_settings(timed, 16, base, Levers(), set(), "cpu") == \
        plan_search.candidate_settings(AffineSearch(budget=38), 16, base, Levers(), set(), "cpu")
    assert [(s.gradient_checkpointing, s.checkpoint_every, s.batch_size, s.accum_steps, s.optimizer_in_backward)
            for s in timed.rounds[0]] == [(True, 1, 1, 16, False), (True, 2, 1, 16, False), (False, 1, 1, 16, False)]
    untimed = AffineSearch(budget=38)
    plan_search.candidate_settings(untimed, 16, base, Levers(), set(), "cpu")
    assert untimed.rounds == []
    for fixed in ({"gradient_checkpointing"}, {"checkpoint_every"}, {"batch_size"}):
        assert plan_search.mode_frontier(base, 16, fixed) == []
    fused = dataclasses.replace(base, optimizer_in_backward=True)
    assert plan_search.mode_frontier(fused, 16, {"optimizer_in_backward"}) == []
    assert len(plan_search.mode_frontier(fused, 16, set())) == 3  # the fused step not fixed: unfused splits are tried


@pytest.mark.slow  # over 10 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_when_your_flags_do_not_fit_each_modes_lightest_split_is_estimated_first_within_planning_time(
        dataset, monkeypatch, tmp_path):
    """Flags that do not fit make the planner ask first, after its first probe, which checkpointing modes fit at
    their lightest split (side by side), within planning's time: with the default time (the 10-s floor, every estimate
    costed at 1 s) those are the first estimates after your flags' and the lightest split's; with `--plan-time 0`
    none is made (planning keeps its bound)."""
    train_set, collator, model, budget = one_second_estimates(dataset, monkeypatch)
    user = Strategy(batch_size=16, accum_steps=1)  # over the budget (micro-batch 8 is)
    for probe_budget in (None, 0.0):
        monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / f"cold {probe_budget}"))
        lines: list[str] = []
        plan(model, train_set, collator, memory_budget=budget, effective_batch=EFFECTIVE_BATCH, base=user,
             probe_budget=probe_budget, echo=lines.append)
        estimates = [line for line in lines if line.lstrip().startswith("estimate ")]
        modes = [next((words for words in ("all blocks", "every 2", "none")
                       if f"estimate 1 x {EFFECTIVE_BATCH}, fp32, adamw, checkpointing {words}:" in line), None)
                 for line in estimates]
        if probe_budget is None:
            assert modes[:4] == [None, "all blocks", "every 2", "none"], estimates
        else:
            assert modes == [None, "all blocks"], estimates


@pytest.mark.parametrize("smaller_prior, stand_in", [(2.0, 16), (1.2, 2)], ids=["runner-up", "smaller split"])
def test_a_favourite_measured_over_the_budget_is_replaced_by_what_the_prior_ranks_next(dataset, monkeypatch,
                                                                                       smaller_prior, stand_in):
    """Under a measured meter a favourite whose probe measures over the budget gets a stand-in, probed at once with no
    probe time left: the candidate the prior ranks first of those not probed, its own next smaller split among them.
    (On the benchmark of docs/plan.md the favourite, every other block at 2 x 16, measured over, and its smaller
    split 1 x 32 stood in, while no block checkpointed at 1 x 32, ranked above that split, was never probed.)"""
    from looptrain.planning import ranking
    from looptrain.planning.budget import Budget
    from looptrain.planning.plans import Candidate

    train_set, collator = dataset

    def candidate(rows: int, every: int, prior: float, baseline: bool = False) -> Candidate:
        settings = Strategy(batch_size=rows, accum_steps=16 // rows, gradient_checkpointing=True,
                            checkpoint_every=every)
        return Candidate(settings, 2**20, padded_tokens=1000, micro_batches=16 // rows, updates=1, prior=prior,
                         baseline=baseline)

    safe, favourite = candidate(1, 1, prior=3.0, baseline=True), candidate(4, 2, prior=1.0)
    runner_up, smaller = candidate(16, 1, prior=1.5), candidate(2, 2, prior=smaller_prior)
    probed = []

    def probe(model, settings, batch, device, max_grad_norm, meter=None, ceiling=None, step_bytes=0, typical=None):
        rows, width = batch["input_ids"].shape
        probed.append(rows)
        return {"micro_step_seconds": 1e-3 * rows * width, "optimizer_step_seconds": 0.0, "probe_seconds": 0.01,
                "tokens": rows * width, "batch_shape": [rows, width],
                "measured_peak_bytes": (400 if settings == favourite.settings else 100) * 2**20}

    monkeypatch.setattr(probes, "probe", probe)
    order = sorted(range(len(train_set.lengths)), key=lambda index: -train_set.lengths[index])
    prober = ranking.Prober(None, train_set, collator, order, "cpu", 1.0, probes.Meter("rss", 0),
                            Budget(300 * 2**20, 0.05, "rss"))
    result = ranking.rank([favourite, runner_up, safe], prober, epochs=1, probe_budget=0.0, probe_fraction=0.05,
                          smaller=lambda over, candidates: smaller if over is favourite else None)
    assert probed == [1, 4, stand_in]  # the baseline, the favourite (over the budget), its stand-in; no time for more
    assert favourite not in result.candidates and {id(c) for c in result.candidates} == \
        {id(safe), id(runner_up if stand_in == 16 else smaller)}


class KnownOnlySearch(AffineSearch):
    """A search whose time is spent: only the splits in `known` answer, any other raises `SearchTimeSpent`."""

    def __init__(self, budget: int, known: list):
        super().__init__(budget, limit=0.0)
        self.known_keys = {self.key(settings) for settings in known}

    def known(self, settings) -> bool:
        return self.key(settings) in self.known_keys

    def fits(self, settings) -> bool:
        from looptrain.planning.book import SearchTimeSpent

        if not self.known(settings):
            raise SearchTimeSpent
        return super().fits(settings)


def test_a_search_cut_short_keeps_every_split_it_already_knows_to_fit():
    """Once planning's time is spent, a mode's bisection stops, and the largest split of that mode already estimated
    (the frontier's lightest, here) is its candidate: a mode checkpointing less, known to fit at micro-batch 1, is
    not lost because the bisection of the mode before it was cut short."""
    from looptrain.planning import search as plan_search

    base = Strategy(batch_size=16, accum_steps=1)
    frontier = plan_search.mode_frontier(base, 16, set())
    search = KnownOnlySearch(budget=34, known=frontier)  # at 1 row, every block: 31, every other: 32, none: 34
    chosen = plan_search.candidate_settings(search, 16, base, Levers(), set(), "cpu").settings
    assert chosen == frontier
    search = KnownOnlySearch(budget=33, known=frontier)  # none at 1 row (34) is over: not a candidate
    assert plan_search.candidate_settings(search, 16, base, Levers(), set(), "cpu").settings == frontier[:2]
    assert all(dataclasses.replace(split, batch_size=1, accum_steps=16) == split for split in frontier)


def test_a_search_under_a_time_limit_estimates_the_whole_batch_fused_first_and_keeps_it_when_it_fits():
    """Under planning's time limit the search's first round (`Search.estimate_round`, within that time) is the whole
    batch in one micro-batch with the step fused into backward and every block checkpointed beside micro-batch 1
    without checkpointing (then the other fused whole batches; the fastest numerics first), and it keeps those that
    fit as candidates, though the bisection of the modes checkpointing more was cut short by the time. Without a time
    limit no such round is asked for."""
    from looptrain.planning import search as plan_search

    class RoundSearch(KnownOnlySearch):
        def estimate_round(self, settings_list, rounds=1) -> None:
            super().estimate_round(settings_list, rounds)
            self.known_keys |= {self.key(settings) for settings in settings_list[:2]}  # two workers

    base = Strategy(batch_size=16, accum_steps=1)
    frontier = plan_search.mode_frontier(base, 16, set())
    search = RoundSearch(budget=36, known=frontier[:1])  # fused, 16 rows: every block 36, every other 52; 1 row: 34
    chosen = plan_search.candidate_settings(search, 16, base, Levers(), set(), "cpu").settings
    fused = [(s.batch_size, s.accum_steps, s.gradient_checkpointing, s.checkpoint_every, s.optimizer_in_backward)
             for s in search.forced[0]]
    assert fused == [(16, 1, True, 1, True), (1, 16, False, 1, False), (16, 1, True, 2, True), (16, 1, False, 1, True)]
    assert search.forced[0][0] in chosen and search.forced[0][1] in chosen and search.forced[0][2] not in chosen
    untimed = AffineSearch(budget=36)
    plan_search.candidate_settings(untimed, 16, base, Levers(), set(), "cpu")
    assert untimed.forced == []
    # --amp's precision before fp32, bf16 weights last.
    numerics = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]
    order = [(s.precision, s.weights) for s in plan_search.whole_batch_fused(base, 16, numerics, [(True, 1)],
                                                                            "adafactor")]
    assert order == [("bf16", "fp32"), ("fp32", "fp32"), ("bf16", "bf16")]


@pytest.mark.slow  # over 6 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_a_rerun_reads_its_probes_from_the_cache_and_plans_the_same(dataset, monkeypatch, tmp_path):
    """Probes on a CPU are kept in the on-disk cache like the estimates: a rerun of the same plan measures nothing,
    predicts the same speeds and picks the same winner; with the cache off every probe is measured again."""

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    train_set, collator = dataset
    model = make_tiny_bert(num_labels=2)
    budget = budget_between(model, train_set, collator, 4, 8)
    options = {"memory_budget": budget, "effective_batch": EFFECTIVE_BATCH, "probe_budget": 30.0}
    first = plan(model, train_set, collator, **options)
    measured = [c for c in first.candidates if c.probed]
    assert measured and not any(c.probe.get("from_cache") for c in measured)
    calls = []
    real = probes.measure_probe
    monkeypatch.setattr(probes, "measure_probe", lambda *args, **kwargs: calls.append(args[1]) or real(*args,
                                                                                                         **kwargs))
    model = make_tiny_bert(num_labels=2)  # a rerun's model, as loaded: the first plan's probes changed its config
    again = plan(model, train_set, collator, **options)
    assert calls == [] and again.cached_estimates == again.estimates
    assert again.winner.settings == first.winner.settings
    assert {repr(c.settings): c.seconds_per_epoch for c in again.candidates if c.probed} == \
        {repr(c.settings): c.seconds_per_epoch for c in measured}
    assert all(c.probe["from_cache"] for c in again.candidates if c.probed)
    assert "probe (cached)" in again.table()
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", "off")
    plan(make_tiny_bert(num_labels=2), train_set, collator, **options)
    assert len(calls) == len(measured)


def test_a_probe_of_process_rss_trims_the_heap_where_glibc_keeps_freed_blocks(monkeypatch):
    """Under glibc's own thresholds a probe measures a fresh heap, which a whole run outgrows unless it trims the heap
    before each micro-batch: the probe is measured as the run will train, trimmed; with the thresholds fixed (or under
    the tensors meter) as given."""
    from looptrain.memory import allocator

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", "off")
    measured = []
    monkeypatch.setattr(probes, "measure_probe",
                        lambda model, settings, *rest, **options: measured.append(settings) or {})
    settings = Strategy(batch_size=2, accum_steps=8)
    rss = probes.Meter("rss", probes.rss_baseline_bytes())
    for keeps, meter, trims in ((True, rss, True), (False, rss, False), (True, None, False)):
        monkeypatch.setattr(allocator, "keeps_freed", lambda keeps=keeps: keeps)
        probes.probe(torch.nn.Linear(1, 1), settings, {}, "cpu", 1.0, meter)
        assert measured.pop() == dataclasses.replace(settings, trim_heap=trims)


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_a_probe_stops_at_its_ceiling_and_leaves_the_model_as_it_was():
    """Under a measured meter a probe that reads above its ceiling stops there: a probe over the budget would have
    taken the process past it (docs/plan.md). Its peak is past the ceiling and far below the whole update's, it has
    no timings, and the model keeps its weights and holds no gradients. The batch's wide layers (16 x 256 tokens x
    4096 features: 64 MiB a tensor) are served by mmap whatever the heap holds, so RSS follows them. Each meter counts
    from the RSS after the heap's free pages are given back, as the probe's own start gives them back
    (`settled_rss_meter`)."""
    model = make_tiny_bert(num_labels=2, max_position_embeddings=256, intermediate_size=4096)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    ids = torch.randint(5, 20, (16, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(16, dtype=torch.long)}
    settings = Strategy(batch_size=16, accum_steps=2, optimizer="sgd")
    mib = 2**20
    stopped = probes.measure_probe(model, settings, batch, "cpu", 1.0, settled_rss_meter(), 48 * mib)
    whole = probes.measure_probe(model, settings, batch, "cpu", 1.0, settled_rss_meter())
    assert stopped["stopped"] is True and stopped["ceiling"] == 48 * mib
    assert "micro_step_seconds" not in stopped and "stopped" not in whole and whole["micro_step_seconds"] > 0
    assert whole["measured_peak_bytes"] > 200 * mib  # what the update holds at its worst
    assert 48 * mib < stopped["measured_peak_bytes"] < whole["measured_peak_bytes"] / 2
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())


def test_a_probe_stops_before_an_optimizer_step_that_would_cross_its_ceiling():
    """Nothing inside an optimizer step can stop a probe: Adafactor's first step took worked example 2's process
    110 MiB past what it held before it, and past the budget (docs/plan.md). Before the step the probe reads its meter
    with the step's bytes (from the estimate) and stops there when they would cross the ceiling; the step never
    runs. The same probe with room for its step runs it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model = make_tiny_bert(num_labels=2)
    ids = torch.randint(5, 20, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(2, dtype=torch.long)}
    settings, gib = Strategy(batch_size=2, accum_steps=2), 2**30
    steps = []
    handle = register_optimizer_step_post_hook(lambda *args: steps.append(1))
    try:
        meter = probes.Meter("rss", probes.rss_baseline_bytes())
        stopped = probes.measure_probe(model, settings, batch, "cpu", 1.0, meter, 8 * gib, step_bytes=16 * gib)
        assert steps == []
        whole = probes.measure_probe(model, settings, batch, "cpu", 1.0, meter, 8 * gib, step_bytes=2**20)
    finally:
        handle.remove()
    assert stopped["stopped"] is True and stopped["before_step_bytes"] == 16 * gib
    assert "micro_step_seconds" not in stopped and stopped["measured_peak_bytes"] == 8 * gib + 1
    assert "stopped" not in whole and whole["micro_step_seconds"] > 0 and steps == [1]
    assert all(parameter.grad is None for parameter in model.parameters())


def test_a_probe_stopped_at_its_ceiling_never_fits_whatever_the_rounding():
    """A stopped probe records its peak as one byte past its ceiling, and the growth a measure implies is rounded
    down to a byte: on worked example 2 (a budget of 697.2 MiB) that byte let a first probe stopped before its step
    count as fitting, and the plan, with no time for it, failed. A stopped probe never fits; the most that fits
    (its ceiling) does."""
    from looptrain.planning.budget import Budget

    estimate = 379_772_616
    rounded = []
    for budget in range(731_045_888, 731_045_888 + 64):
        fit = Budget(budget, 0.05, "rss")
        ceiling = fit.first_probe_ceiling(estimate)
        assert fit.first_probe_fits({"measured_peak_bytes": ceiling}, estimate)
        assert not fit.first_probe_fits({"stopped": True, "ceiling": ceiling, "measured_peak_bytes": ceiling + 1},
                                        estimate)
        rounded.append(fit.first_probe_fits({"measured_peak_bytes": ceiling + 1}, estimate))
    assert any(rounded)  # the byte the rounding lets through, which a stopped probe must not be


def test_a_probe_of_process_rss_starts_and_ends_with_the_heap_trimmed(monkeypatch):
    """Under the RSS meter a probe gives the C heap's free pages back before it measures and after it: a probe's
    freed blocks stayed resident through the next probe and through the run (68 MiB after worked example 2's plan,
    docs/plan.md). Under no meter it leaves the heap alone."""
    from looptrain.memory import allocator

    trims = []
    monkeypatch.setattr(allocator, "release_freed", lambda: trims.append(1) or True)
    model = make_tiny_bert(num_labels=2)
    ids = torch.randint(5, 20, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(2, dtype=torch.long)}
    settings = Strategy(batch_size=2, accum_steps=2)  # trim_heap off: the Loop itself trims nothing
    probes.measure_probe(model, settings, batch, "cpu", 1.0)
    assert trims == []
    probes.measure_probe(model, settings, batch, "cpu", 1.0, probes.Meter("rss", probes.rss_baseline_bytes()))
    assert trims == [1, 1]


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_a_probe_leaves_no_loop_or_optimizer_state_alive_behind_it():
    """A probe's Loop, its optimizer and the optimizer's state are freed when the probe returns, with no collection
    after it: the probe's timed `compute_loss` closes over its Loop (a cycle), and a collection made inside the probe
    freed nothing. Left to the collector's oldest generation, the probe's AdamW state outlived the plan and a bf16
    run at 900 MiB carried its 173 MiB to the end (993 MiB above the start instead of 825, docs/plan.md)."""
    model = make_tiny_bert(num_labels=2)
    ids = torch.randint(5, 20, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(2, dtype=torch.long)}
    rss = probes.Meter("rss", probes.rss_baseline_bytes())
    gc.collect()
    before = live_loops_and_optimizers()
    gc.disable()  # what a run's automatic collections would free late, or (from the oldest generation) never
    try:
        for settings, meter in ((Strategy(batch_size=2, accum_steps=2), None),
                                (Strategy(batch_size=2, accum_steps=1), rss),
                                (Strategy(batch_size=2, accum_steps=1, optimizer_in_backward=True), None)):
            result = probes.measure_probe(model, settings, batch, "cpu", 1.0, meter)
            assert result["micro_step_seconds"] > 0
            assert live_loops_and_optimizers() == before, settings
    finally:
        gc.enable()


def test_the_optimizer_steps_bytes_come_from_the_estimate():
    """`EstimateBook.step_bytes`: the estimate's optimizer phase less the weights and gradients, so at least the state
    the first step creates: AdamW's two fp32 moments per parameter, Adafactor's factored rows and columns far less.
    The same at every micro-batch (read from the nearest estimate), and nothing for the step fused into backward."""
    from looptrain.planning.book import EstimateBook

    model = make_tiny_bert(num_labels=2)
    weights = sum(parameter.numel() * 4 for parameter in model.parameters())
    search = EstimateBook(model, 32)
    adamw = Strategy(batch_size=2, accum_steps=4)
    adafactor = dataclasses.replace(adamw, optimizer="adafactor")
    search.peak(adamw), search.peak(adafactor)
    assert 2 * weights <= search.step_bytes(adamw) < 4 * weights
    assert search.step_bytes(adafactor) < search.step_bytes(adamw) - weights
    assert search.step_bytes(dataclasses.replace(adamw, batch_size=4, accum_steps=2)) == search.step_bytes(adamw)
    assert search.step_bytes(dataclasses.replace(adamw, optimizer_in_backward=True)) == 0
    assert search.step_bytes(Strategy(batch_size=2, accum_steps=4, optimizer="sgd")) == 0  # not estimated


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_a_stopped_probe_is_read_from_the_cache_only_for_a_ceiling_no_higher(monkeypatch, tmp_path):
    """A probe stopped at its ceiling says its peak passes that ceiling, not where it ends: a plan with a lower
    ceiling reads it from the cache, one with a higher ceiling measures it again."""
    from looptrain.estimation import cache as estimate_cache

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    mib = 2**20
    measured = []

    def measure(model, settings, batch, device, max_grad_norm, meter=None, ceiling=None, step_bytes=0, typical=None):
        measured.append(ceiling)
        if ceiling is None:
            return {"micro_step_seconds": 0.1, "optimizer_step_seconds": 0.0, "probe_seconds": 0.5, "tokens": 4,
                    "batch_shape": [1, 4], "measured_peak_bytes": 150 * mib}
        return {"stopped": True, "ceiling": ceiling, "measured_peak_bytes": ceiling + mib, "probe_seconds": 0.5,
                "tokens": 4, "batch_shape": [1, 4]}

    monkeypatch.setattr(probes, "measure_probe", measure)
    model = torch.nn.Linear(1, 1)
    probes.MODEL_DIGESTS[model] = estimate_cache.model_digest(model)
    meter, settings, batch = probes.Meter("rss", probes.rss_baseline_bytes()), Strategy(), {"input_ids": [[1] * 4]}
    assert not probes.probe(model, settings, batch, "cpu", 1.0, meter, 100 * mib).get("from_cache")
    assert probes.probe(model, settings, batch, "cpu", 1.0, meter, 90 * mib)["from_cache"]  # passes 90 too
    assert measured == [100 * mib]
    assert not probes.probe(model, settings, batch, "cpu", 1.0, meter, 110 * mib).get("from_cache")
    assert probes.probe(model, settings, batch, "cpu", 1.0, meter, None).get("from_cache") is None  # no ceiling
    assert probes.probe(model, settings, batch, "cpu", 1.0, meter, 120 * mib)["from_cache"]  # measured whole now
    assert measured == [100 * mib, 110 * mib, None]


def test_a_cached_probe_of_process_rss_is_read_only_while_the_process_holds_about_the_same(monkeypatch, tmp_path):
    """Under the RSS meter a cached probe's peak moves up by what the process holds more than when it was measured
    (never down), and beyond `PROBE_HELD_TOLERANCE` more (another program, more loaded) it is measured again."""
    from looptrain.estimation import cache as estimate_cache

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    mib = 2**20
    probe = {"micro_step_seconds": 0.5, "optimizer_step_seconds": 0.1, "probe_seconds": 1.5, "tokens": 64,
             "batch_shape": [2, 32], "measured_peak_bytes": 300 * mib, "held_bytes": 100 * mib}
    estimate_cache.write_probe("k", probe)
    assert probes.cached_probe("k", 100 * mib)["measured_peak_bytes"] == 300 * mib
    assert probes.cached_probe("k", 120 * mib)["measured_peak_bytes"] == 320 * mib
    assert probes.cached_probe("k", 90 * mib)["measured_peak_bytes"] == 300 * mib  # never lowered
    assert probes.cached_probe("k", 100 * mib + probes.PROBE_HELD_TOLERANCE + 1) is None
    assert probes.cached_probe("k", 0)["measured_peak_bytes"] == 300 * mib  # holding less: the peak stays
    assert probes.cached_probe("missing", 100 * mib) is None


def test_a_probes_cache_key_names_its_typical_micro_batch():
    """A probe that timed a typical micro-batch is another probe than one that did not, or timed another shape: its
    cache key says which (a rerun then reads what it would have measured)."""
    from looptrain.estimation import cache as estimate_cache

    ids = torch.ones(2, 24, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def key(typical):
        return estimate_cache.probe_key("model", Strategy(batch_size=2, accum_steps=8), batch, max_grad_norm=1.0,
                                        meter="rss", warm_up_width=16, allocator="glibc", typical=typical)

    def typical(rows, width):
        return {"input_ids": torch.ones(rows, width, dtype=torch.long),
                "attention_mask": torch.ones(rows, width, dtype=torch.long)}
    assert key(None) != key(typical(3, 20)) != key(typical(3, 21))
    assert key(typical(3, 20)) == key(typical(3, 20)) and key(None) == key(None)


def test_a_budget_of_rss_caps_onednn_kernel_caches_in_a_process_of_its_own(monkeypatch, tmp_path):
    """Under bf16 autocast each batch width keeps its kernels in oneDNN's and PyTorch's caches (5.3 MiB a width on a
    MiniLM, docs/memory.md): the console script caps both before its first kernel, unless the user set them; a process
    that runs `main` among other work keeps its own."""
    import os

    from looptrain.cli import finetune as finetune_package
    from looptrain.memory import allocator

    runs = []
    monkeypatch.setattr(finetune_package, "run", lambda args: runs.append(args) or {})  # the flags and the start only
    for name in allocator.KERNEL_CACHE_VARIABLES:  # a module's fixture may have run the command line before
        monkeypatch.delenv(name, raising=False)
    argv = ["--model", "m", "--data", "d.csv", "--output-dir", str(tmp_path), "--memory-budget", "1GiB"]
    assert finetune_package.main(argv) == 0
    assert all(name not in os.environ for name in allocator.KERNEL_CACHE_VARIABLES)
    assert finetune_package.main(argv, owns_process=True) == 0
    assert [os.environ[name] for name in allocator.KERNEL_CACHE_VARIABLES] == ["64", "64"]
    assert runs[-1].process.capped_kernel_caches.startswith(  # `run` prints it where its progress goes
        "oneDNN's kernel caches capped at 64 entries each (ONEDNN_PRIMITIVE_CACHE_CAPACITY=64, LRU_CACHE_CAPACITY=64)")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert allocator.cap_kernel_caches() is None  # the user's setting stands, and so does the other library's default
    assert os.environ["LRU_CACHE_CAPACITY"] == "512" and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    monkeypatch.delenv("LRU_CACHE_CAPACITY")
    assert finetune_package.main(argv[:-2], owns_process=True) == 0  # no budget: nothing capped
    assert all(name not in os.environ for name in allocator.KERNEL_CACHE_VARIABLES)

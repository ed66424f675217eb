#!/usr/bin/env python
"""Benchmark: LoRA with looptrain beside peft + Hugging Face Trainer, on the same tiny causal LM and data.

Both sides train the same rank-16 adapters (alpha 32, dropout 0, on every Linear of the blocks: q/k/v/o and
gate/up/down, looptrain's default targets) on the same frozen base, with the same data, effective batch,
learning rate, schedule, clipping and epochs, each run in a fresh subprocess, A/B alternated, medians reported.

- Model: a Llama shape (hidden 256, 4 blocks, 4 heads / 2 KV heads, intermediate 688, vocab 8192, tied
  embeddings: 5.0M parameters), random weights saved once with a word-level tokenizer built with the
  ``tokenizers`` library: nothing is downloaded (``HF_HUB_OFFLINE=1``).
- Data: ``--rows`` JSONL texts of uneven length (4 to ``--max-length`` words, most of them short: 4 + an
  exponential of mean 24), the words drawn from a Zipf law over the vocabulary (word k with odds 1/k: what the
  adapters can learn on a frozen random base), EOS appended, loss on every token.
- Trainer: ``get_peft_model`` with the same ``LoraConfig``, the rows tokenized by looptrain's own
  ``tokenize_lm`` (the same ids and labels), a collator that pads to the batch's longest row and sets the
  padding's labels to -100 (looptrain's ``DynamicPaddingCollator``), Trainer's default optimizer.
- looptrain: ``looptrain-finetune --task causal-lm --lora 16`` in-process (``looptrain.cli.finetune.main``),
  its defaults (chunked cross-entropy on), ``--no-track-memory`` (the tensor tracker is a measurement, off
  like Trainer's nothing); "lowest" adds the levers that keep the math (``--grad-checkpoint --no-foreach``;
  Trainer: ``gradient_checkpointing=True``); "no chunked CE" is the default with ``--chunked-ce off`` (the
  model's own loss, as Trainer computes it), compared with Trainer's default run.
- Memory: each child runs with ``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072``; the baseline is
  the RSS after importing torch, transformers, peft and looptrain (``bench_plan._baseline``, peft added), the
  kernel's peak mark is reset to it, and the figure is VmHWM minus that baseline (the weights count).
- Time: "train" is the training loop alone (Trainer: ``trainer.train()``; looptrain: the summary's
  ``train_runtime_s``, ``Loop.fit``); "all" is from loading the tokenizer to the end of the adapter's save.
- Loss: the mean training loss of the last ``LAST_UPDATES`` updates (sanity: both learn from ln(8192) = 9.0).

    PYTHONPATH=. python scripts/bench_lora.py --repeats 3 [--bf16] [--json lora_bench.json]

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import MALLOC_ENVIRONMENT, MIB, ROOT
from bench_plan import _baseline as _framework_baseline

from looptrain.memory.meters import proc_status_bytes

SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 688}
VOCAB_WORDS = 8192 - 3
SPECIALS = ["<pad>", "<unk>", "<eos>"]
RANK, ALPHA, DROPOUT = 16, 32, 0.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH_SIZE, ACCUM = 8, 2
LEARNING_RATE = 1e-3
LAST_UPDATES = 5
LABELS = {"default": "default", "lowest": "lowest memory", "nochunk": "default, --chunked-ce off"}


def _baseline() -> int:
    import peft  # noqa: F401  (the Trainer side needs it; looptrain imports it for --lora)

    return _framework_baseline()


def words() -> list[str]:
    """Made-up words (two or three syllables), distinct, in a fixed order: the language counts up this list."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    generator = random.Random(0)
    seen: dict[str, None] = {}
    while len(seen) < VOCAB_WORDS:
        seen["".join(generator.choice(syllables) for _ in range(generator.choice((2, 3))))] = None
    return list(seen)


def prepare(directory: Path, rows: int, max_length: int, seed: int) -> dict:
    """Writes the random-weight Llama + tokenizer (model/) and train.jsonl; returns their paths and the lengths."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocabulary = words()
    backend = Tokenizer(models.WordLevel(vocab={token: index for index, token in enumerate(SPECIALS + vocabulary)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<eos>", model_max_length=max_length)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=max_length, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         **SHAPE)
    torch.manual_seed(seed)
    model_dir = directory / "model"
    model = AutoModelForCausalLM.from_config(config)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    generator = random.Random(seed)
    weights = [1 / rank for rank in range(1, len(vocabulary) + 1)]  # Zipf: word k drawn with odds 1/k
    lengths, lines = [], []
    for _ in range(rows):  # uneven: most rows short, a long tail up to max_length - 1 words (+ EOS)
        length = min(max_length - 1, 4 + int(generator.expovariate(1 / 24)))
        lines.append(json.dumps({"text": " ".join(generator.choices(vocabulary, weights, k=length))}) + "\n")
        lengths.append(length + 1)
    data = directory / "train.jsonl"
    data.write_text("".join(lines), encoding="utf-8")
    return {"model_dir": str(model_dir), "data": str(data), "lengths": sorted(lengths), "parameters": parameters}


def worker_trainer(spec: dict) -> dict:
    """peft's get_peft_model + transformers.Trainer, the padding masked in the labels; one run, then save."""
    baseline = _baseline()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from looptrain.data import DynamicPaddingCollator, read_lm_data, tokenize_lm

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    dataset = tokenize_lm(read_lm_data(spec["data"]), tokenizer, spec["max_length"])
    features = [{"input_ids": ids, "labels": labels} for ids, labels in zip(dataset.input_ids, dataset.labels)]
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"])
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=DROPOUT, target_modules=TARGETS,
                                             task_type="CAUSAL_LM"))
    lowest = spec["config"] == "lowest"
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=ACCUM,
            learning_rate=LEARNING_RATE, weight_decay=0.0, warmup_steps=0, lr_scheduler_type="linear",
            num_train_epochs=spec["epochs"], max_grad_norm=1.0, use_cpu=True, bf16=spec["bf16"], report_to=[],
            save_strategy="no", eval_strategy="no", logging_strategy="steps", logging_steps=1,
            dataloader_num_workers=0, seed=spec["seed"], gradient_checkpointing=lowest,
            gradient_checkpointing_kwargs={"use_reentrant": False} if lowest else None)
        trainer = Trainer(model=model, args=arguments, train_dataset=features,
                          data_collator=DynamicPaddingCollator(tokenizer))
        train_started = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - train_started
        trainer.save_model(os.path.join(output_dir, "final"))
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        optimizer = f"optim={getattr(arguments.optim, 'value', arguments.optim)}"
        steps = trainer.state.global_step
    return {"seconds": time.perf_counter() - started, "train_seconds": train_seconds,
            "peak_rss_delta": proc_status_bytes("VmHWM") - baseline, "first_loss": losses[0],
            "final_loss": statistics.fmean(losses[-LAST_UPDATES:]), "updates": steps, "optimizer": optimizer}


def looptrain_argv(spec: dict, output_dir: str) -> list[str]:
    """looptrain-finetune's arguments for `spec` (the same settings as the Trainer side)."""
    argv = ["--task", "causal-lm", "--model", spec["model_dir"], "--data", spec["data"], "--output-dir", output_dir,
            "--max-length", str(spec["max_length"]), "--lora", str(RANK), "--lora-alpha", str(ALPHA),
            "--lora-dropout", str(DROPOUT), "--batch-size", str(BATCH_SIZE), "--accum", str(ACCUM),
            "--lr", str(LEARNING_RATE), "--weight-decay", "0", "--warmup-ratio", "0", "--scheduler", "linear",
            "--max-grad-norm", "1.0", "--epochs", str(spec["epochs"]), "--eval-split", "0",
            "--seed", str(spec["seed"]), "--device", "cpu", "--eval-every", "no", "--no-track-memory",
            "--no-progress-bar", "--log-every", "1"]
    if spec["bf16"]:
        argv += ["--precision", "bf16"]
    if spec["config"] == "lowest":
        argv += ["--grad-checkpoint", "--no-foreach"]
    if spec["config"] == "nochunk":
        argv += ["--chunked-ce", "off"]
    return argv


def worker_looptrain(spec: dict) -> dict:
    """looptrain-finetune --task causal-lm --lora 16, in-process; one run, then its final/ adapter save."""
    baseline = _baseline()
    from looptrain.cli import finetune

    with tempfile.TemporaryDirectory() as output_dir:
        started = time.perf_counter()
        code = finetune.main(looptrain_argv(spec, output_dir))
        seconds = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"looptrain-finetune exited {code}")
        summary = json.loads((Path(output_dir) / "summary.json").read_text())
        events = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [event["loss"] for event in events if event.get("split", "train") == "train" and "loss" in event
              and event.get("event", "train") == "train"]
    return {"seconds": seconds, "train_seconds": summary["train_runtime_s"],
            "peak_rss_delta": proc_status_bytes("VmHWM") - baseline, "first_loss": losses[0],
            "final_loss": statistics.fmean(losses[-LAST_UPDATES:]), "updates": summary["optimizer_steps"],
            "optimizer": "AdamW (for-loop)" if spec["config"] == "lowest" else "AdamW (foreach)"}


def run_worker(spec: dict) -> dict:
    environment = {**os.environ, **MALLOC_ENVIRONMENT, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                            env=environment, cwd=ROOT, timeout=3600, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"worker {spec['framework']} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=192)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, A/B alternated")
    parser.add_argument("--configs", default="default,lowest,nochunk",
                        help="default, lowest, nochunk (comma-separated; nochunk needs default)")
    parser.add_argument("--bf16", action="store_true",
                        help="also bf16 autocast on both sides, default levers (where native)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="write every run's figures here")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.worker:
        spec = json.loads(arguments.worker)
        result = (worker_trainer if spec["framework"] == "trainer" else worker_looptrain)(spec)
        print(json.dumps(result))
        return 0

    import peft
    import torch
    import transformers

    precisions = ["fp32"] + (["bf16"] if arguments.bf16 else [])
    configs = {"fp32": arguments.configs.split(","), "bf16": ["default"]}  # bf16: the default levers only
    if arguments.bf16:
        from looptrain.precision import cpu_bf16_is_fast, cpu_bf16_speed_line

        if not cpu_bf16_is_fast():
            print(f"the bf16 rows are slow here: {cpu_bf16_speed_line()}", file=sys.stderr)
    results: dict[tuple[str, str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as directory:
        prepared = prepare(Path(directory), arguments.rows, arguments.max_length, arguments.seed)
        lengths = prepared.pop("lengths")
        parameters = prepared.pop("parameters")
        print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 "
              f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, {torch.get_num_threads()} threads, shared with other "
              f"jobs (load average at start {os.getloadavg()[0]:.2f}); torch {torch.__version__}, transformers "
              f"{transformers.__version__}, peft {peft.__version__}")
        print(f"model: Llama {SHAPE}, vocab {VOCAB_WORDS + len(SPECIALS)}, tied embeddings, {parameters / 1e6:.1f}M "
              f"parameters (random); data: {len(lengths)} rows, tokens median {lengths[len(lengths) // 2]}, p95 "
              f"{lengths[int(0.95 * len(lengths))]}, max {lengths[-1]}; LoRA r {RANK}, alpha {ALPHA}, dropout "
              f"{DROPOUT}, targets {','.join(TARGETS)}; batch {BATCH_SIZE} x accum {ACCUM}, lr {LEARNING_RATE}, "
              f"linear, no warmup, clip 1.0, {arguments.epochs} epoch(s)", flush=True)
        spec = {**prepared, "seed": arguments.seed, "max_length": arguments.max_length, "epochs": arguments.epochs}
        for repeat in range(arguments.repeats):
            for precision in precisions:
                for config in configs[precision]:
                    order = ("trainer", "looptrain") if repeat % 2 == 0 else ("looptrain", "trainer")
                    for framework in order:
                        if config == "nochunk" and framework == "trainer":
                            continue  # Trainer's side of it is its default run
                        run = run_worker({**spec, "framework": framework, "config": config,
                                          "bf16": precision == "bf16"})
                        results.setdefault((precision, config, framework), []).append(run)
                        print(f"  repeat {repeat + 1} {precision} {config} {framework}: "
                              f"{run['peak_rss_delta'] / MIB:.1f} MiB, train {run['train_seconds']:.1f} s, all "
                              f"{run['seconds']:.1f} s, loss {run['first_loss']:.2f} -> {run['final_loss']:.2f}",
                              file=sys.stderr, flush=True)
    print(f"\nmedians of {arguments.repeats} runs each (A/B alternated, fresh process per run); peak RSS above the "
          f"post-import baseline; ratio = looptrain / Trainer (memory and time: lower is better)\n")
    print("| precision | config | side | peak RSS Δ MiB | ratio | train s | ratio | all s | ratio | "
          f"loss first -> last {LAST_UPDATES} | updates | optimizer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for precision in precisions:
        for config in configs[precision]:
            theirs = results[(precision, "default" if config == "nochunk" else config, "trainer")]
            for framework in ("looptrain",) if config == "nochunk" else ("trainer", "looptrain"):
                runs = results[(precision, config, framework)]
                cells = []
                for key in ("peak_rss_delta", "train_seconds", "seconds"):
                    value = _median(runs, key)
                    shown = f"{value / MIB:.1f}" if key == "peak_rss_delta" else f"{value:.1f}"
                    ratio = "" if framework == "trainer" else f"{value / _median(theirs, key):.2f}x"
                    cells += [shown, ratio]
                first, last = _median(runs, "first_loss"), _median(runs, "final_loss")
                side = "peft + Trainer" if framework == "trainer" else "looptrain"
                print(f"| {precision} | {LABELS[config]} | {side} | "
                      f"{' | '.join(cells)} | {first:.2f} -> {last:.2f} | {runs[0]['updates']} | "
                      f"{runs[0]['optimizer']} |")
    print(f"\n(ln vocab = {math.log(VOCAB_WORDS + len(SPECIALS)):.2f}; looptrain default = its flags below, lowest "
          "adds --grad-checkpoint --no-foreach (Trainer: gradient_checkpointing=True), nochunk adds --chunked-ce off "
          "(against Trainer's default run)\n")
    print("looptrain's command: looptrain-finetune " + " ".join(
        looptrain_argv({**spec, "model_dir": "MODEL", "data": "train.jsonl", "config": "default", "bf16": False},
                       "OUT")))
    if arguments.json:
        Path(arguments.json).write_text(json.dumps({" ".join(key): runs for key, runs in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

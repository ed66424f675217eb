"""Benchmark: what `--compile` (torch.compile, inductor) costs and saves per update on this machine.

A BERT of ~36.6M parameters (hidden 512, 8 layers, 8 heads, intermediate 2048, vocab 21128, 2 labels; random
weights) trains on dynamic-padded micro-batches whose widths follow a long-tailed distribution (most rows
short, a few up to --max-width). For each mix (precision, checkpointing) it runs the Loop's own update
(`Loop.run_update`, what `fit` runs) eagerly and compiled, on the same batches, and prints:

- compile s: the compiled run's first updates (where dynamo and inductor compile) minus as many compiled
  updates' median: the one-off cost. inductor's FX-graph and AOTAutograd caches are off; its cache of built
  C++ kernels (/tmp/torchinductor_$USER) is not, so a machine that ran this before compiles faster than a
  fresh one, and later mixes reuse kernels of earlier ones;
- eager and compiled s/update: the median over --updates updates after warm-up;
- speed-up and break-even: compile s / (eager - compiled) s per update, the updates a run needs before
  compiling pays; "never" when compiled updates are not faster.

Usage:
    python scripts/bench_compile.py [--updates 8] [--mixes fp32,bf16,fp32+ckpt] [--batch-size 8]

Timings depend on the machine and on its load: on a crowded machine OpenMP threads spin against each other and
the numbers mean nothing (docs/compile.md); the CPU is named above the table.
Never part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # no graph cache: each mix compiles its graphs
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from looptrain import Loop, LoopConfig
from looptrain.compilation import BACKEND_VARIABLE

COMPILE_UPDATES = 2  # the updates that compile: the first, and the recompile after the classifier sets problem_type


def make_model(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=21128, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                        intermediate_size=2048, max_position_embeddings=512, num_labels=2)
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


def long_tailed_batches(count: int, batch_size: int, max_width: int, seed: int = 0) -> list[dict]:
    """Micro-batches padded to their longest row; row lengths log-normal (median ~48 tokens), clipped."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.exp(torch.randn(batch_size, generator=generator) * 0.8 + 3.9).long().clamp(8, max_width)
        width = int(lengths.max())
        ids = torch.randint(1000, 21128, (batch_size, width), generator=generator)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        batches.append({"input_ids": ids * mask, "attention_mask": mask,
                        "labels": torch.randint(0, 2, (batch_size,), generator=generator)})
    return batches


def time_updates(batches: list[dict], *, compiled: bool, precision: str, checkpointing: bool) -> list[float]:
    """Seconds of each update (`Loop.run_update` over one micro-batch), in order."""
    model = make_model()
    config = LoopConfig(precision=precision, gradient_checkpointing=checkpointing, compile=compiled, device="cpu",
                        track_memory=False, progress_bar=False, eval_every="no", log_every=10**9)
    loop = Loop(model, torch.optim.AdamW(model.parameters(), lr=1e-5), [], config=config)
    seconds = []
    for batch in batches:
        started = time.perf_counter()
        loop.run_update([batch])
        seconds.append(time.perf_counter() - started)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=8, help="timed updates after warm-up")
    parser.add_argument("--mixes", default="fp32,bf16,fp32+ckpt", help="comma-separated: fp32, bf16, +ckpt")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-width", type=int, default=256)
    args = parser.parse_args(argv)
    os.environ[BACKEND_VARIABLE] = "inductor"
    torch.set_num_threads(os.cpu_count() or 1)
    batches = long_tailed_batches(COMPILE_UPDATES + args.updates, args.batch_size, args.max_width)
    widths = sorted(int(batch["input_ids"].shape[1]) for batch in batches)
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, native bf16 (oneDNN): "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"BERT 36.6M, micro-batch {args.batch_size}, dynamic padding: widths {widths[0]}..{widths[-1]} "
          f"(median {statistics.median(widths):g}), {args.updates} timed updates after {COMPILE_UPDATES} warm-up")
    print()
    print("| mix | compile s | eager s/update | compiled s/update | speed-up | break-even (updates) |")
    print("|---|---|---|---|---|---|")
    for mix in args.mixes.split(","):
        precision, checkpointing = mix.split("+")[0], mix.endswith("+ckpt")
        eager = time_updates(batches, compiled=False, precision=precision, checkpointing=checkpointing)
        torch._dynamo.reset()
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled = time_updates(batches, compiled=True, precision=precision, checkpointing=checkpointing)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
        eager_median = statistics.median(eager[COMPILE_UPDATES:])
        compiled_median = statistics.median(compiled[COMPILE_UPDATES:])
        compile_seconds = sum(compiled[:COMPILE_UPDATES]) - COMPILE_UPDATES * compiled_median
        saving = eager_median - compiled_median
        break_even = f"{compile_seconds / saving:.0f}" if saving > 0 else "never"
        print(f"| {mix} | {compile_seconds:.1f} ({graphs} graphs) | {eager_median:.3f} | {compiled_median:.3f} | "
              f"{eager_median / compiled_median:.2f}x | {break_even} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Benchmark: a planner's probe of a deep causal LM, whole and on a truncated stack of its blocks (scaled).

The model is scripts/bench_sft.py's Qwen2.5-0.5B shape (24 blocks, random weights); the probe is the one the
planner makes first for `--batch-size 1 --accum 8 --grad-checkpoint --optim adafactor` at max length 1024: the worst
batch (one row of `--width` tokens), the warm-up and small step (16 tokens), a typical micro-batch (`--typical`
tokens), the Adafactor step. Each repetition runs the whole probe (every block, every vocabulary tile of the head),
then the planner's (`--depth` of the 24 blocks, and a sample of the head's tiles, every `--head-tiles-every`-th:
both scaled, looptrain.planning.truncation and looptrain.tile_sample), and prints their timings side by side and the
probes' own seconds.

    PYTHONPATH=. python scripts/bench_probe_truncation.py --repeats 2 [--workdir /tmp/looptrain-bench-sft]

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEYS = ("small_step_seconds", "typical_step_seconds", "micro_step_seconds", "optimizer_step_seconds",
        "probe_seconds")


def token_batch(rows: int, width: int, vocab: int, seed: int):
    import torch

    ids = torch.randint(2, vocab, (rows, width), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/looptrain-bench-sft", help="bench_sft.py's model and data")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--width", type=int, default=959, help="the worst batch's tokens")
    parser.add_argument("--typical", type=int, default=195, help="the typical micro-batch's tokens")
    parser.add_argument("--head-tiles-every", type=int, default=None,
                        help="the planner's probe samples the head's tiles this sparsely (default: the planner's)")
    arguments = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from bench_sft import make_model_and_data
    from transformers import AutoModelForCausalLM

    from looptrain.planning import probes
    from looptrain.planning.truncation import Truncation
    from looptrain.precision import cpu_description
    from looptrain.strategy import Strategy

    model_dir, _ = make_model_and_data(Path(arguments.workdir), 48, 24, 1024)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    vocab = model.config.vocab_size
    settings = Strategy(batch_size=1, accum_steps=8, gradient_checkpointing=True, optimizer="adafactor")
    batch, typical = token_batch(1, arguments.width, vocab, 0), token_batch(1, arguments.typical, vocab, 1)
    print(f"CPU: {cpu_description()}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    sampled = arguments.head_tiles_every or probes.HEAD_TILE_EVERY
    for repeat in range(arguments.repeats):
        probes.HEAD_TILE_EVERY = 1  # every tile
        whole = probes.measure_probe(model, settings, batch, "cpu", 1.0, typical=typical)
        probes.HEAD_TILE_EVERY = sampled
        part = probes.measure_probe(model, settings, batch, "cpu", 1.0, typical=typical,
                                    truncation=Truncation(arguments.depth, len(model.model.layers)))
        print(json.dumps({"repeat": repeat, **{key: [round(whole[key], 3), round(part[key], 3),
                                                     round(part[key] / whole[key], 3)] for key in KEYS}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

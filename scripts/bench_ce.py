"""Benchmark: the chunked cross-entropy's LM head and loss alone, forward + backward, against another revision's.

A Qwen2.5-0.5B head by default (vocabulary 151,936, hidden 896) with random weights, `--tokens` hidden states and
labels, through `looptrain.lm_loss.chunked_cross_entropy` (untied: the head's weight gets its gradient; tied: the
hidden states come through the fused tied lookup `_TiedLookup`, whose backward adds its rows into the head's
gradient), in fp32 and under bf16 autocast. With `--compare REV`, the same runs with `looptrain/lm_loss.py` as it is
at git revision REV (loaded beside this checkout's looptrain), in the same process, alternating. Each figure is the
median of `--repeats` timed forward + backward passes after one untimed warm-up, wall and CPU (user + system)
seconds of the process.

Usage:
    PYTHONPATH=. python scripts/bench_ce.py --compare cfc53ae [--tokens 1024] [--repeats 3] [--chunk-tokens 0]
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

HEADS, PRECISIONS = ("untied", "tied"), ("fp32", "bf16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936, help="the head's rows (151,936: Qwen2.5)")
    parser.add_argument("--hidden", type=int, default=896, help="the head's columns (896: Qwen2.5-0.5B)")
    parser.add_argument("--tokens", type=int, default=1024, help="scored tokens of the micro-batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed forward + backward passes per figure")
    parser.add_argument("--chunk-tokens", type=int, default=0,
                        help="--ce-chunk-tokens (0: each revision's automatic size)")
    parser.add_argument("--heads", default=",".join(HEADS), help=f"comma-separated, from {', '.join(HEADS)}")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated, from {', '.join(PRECISIONS)} (bf16: autocast)")
    parser.add_argument("--compare", metavar="REV", help="also time looptrain/lm_loss.py as at this git revision")
    return parser.parse_args(argv)


def module_at(revision: str) -> ModuleType:
    """`looptrain/lm_loss.py` as it is at `revision`, imported under another name (its imports are this checkout's)."""
    source = subprocess.run(["git", "show", f"{revision}:looptrain/lm_loss.py"], check=True, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parent.parent).stdout
    path = Path(tempfile.mkdtemp()) / f"lm_loss_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"lm_loss_{revision}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_pass(module: ModuleType, inputs: dict, head: str, precision: str, chunk_tokens: int) -> None:
    """One forward + backward of the head and its loss; the gradients are dropped after."""
    weight, hidden, labels, ids = inputs["weight"], inputs["hidden"], inputs["labels"], inputs["ids"]
    if not chunk_tokens and not hasattr(module, "MIN_TILE_ROWS"):  # before the tiles: the automatic token chunk
        chunk_tokens = max(1, module.AUTO_CHUNK_LOGITS // weight.shape[0])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        tied = module._TiedGradient() if head == "tied" else None
        states = hidden + module._TiedLookup.apply(ids, weight, None, tied) if tied is not None else hidden
        loss = module.chunked_cross_entropy(states, weight, None, labels, chunk_tokens, tied)
    loss.backward()
    weight.grad = hidden.grad = None


def timed(module: ModuleType, inputs: dict, head: str, precision: str, chunk_tokens: int) -> tuple[float, float]:
    """(wall s, CPU s) of one pass."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    one_pass(module, inputs, head, precision, chunk_tokens)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return wall, after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime


def main(argv=None) -> None:
    args = parse_args(argv)
    from looptrain import lm_loss

    modules = {"this checkout": lm_loss}
    if args.compare:
        modules = {args.compare: module_at(args.compare), **modules}
    generator = torch.Generator().manual_seed(0)
    inputs = {"weight": (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).requires_grad_(),
              "hidden": torch.randn(args.tokens, args.hidden, generator=generator).requires_grad_(),
              "labels": torch.randint(0, args.vocab, (args.tokens,), generator=generator),
              "ids": torch.randint(0, args.vocab, (args.tokens,), generator=generator)}
    print(f"CPU {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; vocabulary "
          f"{args.vocab}, hidden {args.hidden}, {args.tokens} tokens, --chunk-tokens {args.chunk_tokens}", flush=True)
    print("| head | precision | " + " | ".join(f"{name}: wall s (CPU s)" for name in modules) + " |")
    print("|---|---|" + "---|" * len(modules))
    for head in args.heads.split(","):
        for precision in args.precisions.split(","):
            samples = {name: [] for name in modules}
            for module in modules.values():  # warm-up
                one_pass(module, inputs, head, precision, args.chunk_tokens)
            for _ in range(args.repeats):
                for name, module in modules.items():
                    samples[name].append(timed(module, inputs, head, precision, args.chunk_tokens))
            cells = [f"{statistics.median(w for w, _ in runs):.2f} ({statistics.median(c for _, c in runs):.2f})"
                     for runs in samples.values()]
            print(f"| {head} | {precision} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    sys.exit(main())

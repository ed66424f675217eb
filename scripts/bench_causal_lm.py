"""Causal LMs at full size: the lowest full fine-tune's estimate against a real run, and the lever ladder.

Two tables:

- ``--measure``: the Qwen2.5-0.5B shape (``looptrain.planning`` preset ``qwen2.5-0.5b``, built from its
  config with random weights, in the lowest run's weight dtype) at micro-batch 1 x ``--seq-len``. The
  parent finds the lowest full fine-tune with ``looptrain.planning.lowest`` (what ``python -m
  looptrain.memory --lowest`` prints), then runs it for real through ``Loop.fit`` for ``--updates``
  updates in two fresh subprocesses: one with the tensor tracker on (its peak), one with it off (the
  process's peak RSS above the RSS after the model was built, with glibc told to give freed blocks
  back: ``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072``). The weights exist before the
  run starts, so the RSS figure is compared to the estimate as RSS above the start + the weights' bytes.
- ``--ladder``: estimates only, for the 0.5B and 1.5B shapes at 1 x ``--ladder-seq-len`` (2048): each
  lever added in turn, with what it saves.

Run (2 shared CPU cores: several minutes each)::

    PYTHONPATH=. python scripts/bench_causal_lm.py --measure --seq-len 512 --updates 3
    PYTHONPATH=. python scripts/bench_causal_lm.py --ladder

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

GIB = 1024**3
MALLOC_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")


def cpu_line() -> str:
    import torch

    from looptrain.precision import cpu_bf16_speed_line, cpu_has_native_bf16

    return (f"CPU: {torch.backends.cpu.get_cpu_capability()}, native bf16 {cpu_has_native_bf16()} (oneDNN's report; "
            f"{cpu_bf16_speed_line()}), {torch.get_num_threads()} threads")


def ladder_rungs() -> list[tuple[str, dict[str, Any]]]:
    """Each rung adds one lever to the one above (a full strategy, not a delta); chunked CE last, when it exists.

    The chunked cross-entropy is on by default for causal LMs (``chunked_ce="auto"``): the rungs before its
    own turn it off, so that each rung shows one lever's saving.
    """
    from looptrain.strategy import Strategy, levers

    names = {spec.name for spec in levers(Strategy)}
    rungs = [("baseline: fp32, AdamW", {"chunked_ce": "off"} if "chunked_ce" in names else {})]
    rungs.append(("+ gradient checkpointing (all blocks)", {**rungs[-1][1], "gradient_checkpointing": True}))
    rungs.append(("+ bf16 autocast", {**rungs[-1][1], "precision": "bf16"}))
    rungs.append(("bf16 weights instead (no fp32 master)", {**rungs[-1][1], "weights": "bf16"}))
    rungs.append(("+ AdamW8bit", {**rungs[-1][1], "optimizer": "adamw8bit"}))
    rungs.append(("+ Adafactor instead", {**rungs[-1][1], "optimizer": "adafactor"}))
    rungs.append(("+ step fused into backward", {**rungs[-1][1], "optimizer_in_backward": True}))
    if "chunked_ce" in names:
        rungs.append(("+ chunked cross-entropy", {**rungs[-1][1], "chunked_ce": "on"}))
    return rungs


def ladder(seq_len: int) -> None:
    from looptrain import estimation

    print(f"## Estimated ladder, micro-batch 1 x {seq_len} tokens ({cpu_line()}); GiB (2^30 B)\n")
    for shape in SHAPES:
        print(f"### {shape}\n")
        print("| rung | peak GiB | saves GiB | params | grads | optimizer state | activations + temps | peak phase "
              "| s |")
        print("|---|---|---|---|---|---|---|---|---|")
        previous = None
        for label, options in ladder_rungs():
            # its column "s" times the estimator
            result = estimation.estimate(shape, 1, seq_len, cache=False, **options)
            peak, b = result["peak_memory_bytes"], result["memory_breakdown"]
            saves = "" if previous is None else f"{(previous - peak) / GIB:+.2f}"
            print(f"| {label} | {peak / GIB:.2f} | {saves} | {b['params'] / GIB:.2f} | {b['grads'] / GIB:.2f} | "
                  f"{b['optimizer_state'] / GIB:.2f} | {b['activations_and_temps'] / GIB:.2f} | {b['peak_phase']} | "
                  f"{result['estimate_seconds']:.1f} |", flush=True)
            previous = peak
        print()


def measured_run(config, settings: dict, seq_len: int, updates: int, tracked: bool) -> dict:
    """One real run of the strategy `settings` on a model built from `config` (random weights, in the strategy's
    weight dtype as a checkpoint in that dtype loads, its model levers applied: freezing, LoRA), `updates` updates
    of random token batches through `Loop.fit`: its figures (the tracker's peak when `tracked`, else the process's
    peak RSS above the RSS after the model was built)."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from looptrain import Loop, LoopConfig, estimation
    from looptrain.lora import quant_state_tensors
    from looptrain.memory.meters import current_rss_bytes, proc_status_bytes, reset_peak_rss
    from looptrain.memory.tracker import tensor_bytes
    from looptrain.strategy import Strategy

    strategy = Strategy(**settings)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if strategy.weights == "bf16" else torch.float32  # as a checkpoint in that dtype loads
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    strategy.prepare_model(model)
    model = strategy.wrap_model(model)
    generator = torch.Generator().manual_seed(0)
    batches = [estimation.random_batch(strategy.batch_size, seq_len, config.vocab_size, 2, generator, token_labels=True)
               for _ in range(updates * strategy.accum_steps)]
    loop = Loop(model, strategy.build_optimizer(model, 1e-5), batches,
                config=LoopConfig.from_strategy(strategy, device="cpu", track_memory=tracked, progress_bar=False,
                                                eval_every="no", log_every=10**9))
    weights = sum(tensor.numel() * tensor.element_size() for tensor in model.parameters())
    # The stored model: distinct storages of parameters, buffers and 4-bit quantization states (QLoRA).
    stored = tensor_bytes(list(loop.model.parameters()) + list(loop.model.buffers()) + quant_state_tensors(loop.model))
    gc.collect()
    start_rss = current_rss_bytes()
    reset_peak_rss()
    started = time.perf_counter()
    summary = loop.fit()
    seconds = time.perf_counter() - started
    peak_rss = proc_status_bytes("VmHWM")
    return {"tracked": tracked, "peak_memory_bytes": summary["peak_memory_bytes"],
            "memory_meter": summary["memory_meter"], "memory_breakdown": summary["memory_breakdown"],
            "rss_above_start_bytes": peak_rss - start_rss, "start_rss_bytes": start_rss, "weights_bytes": weights,
            "stored_bytes": stored, "seconds": seconds, "optimizer_steps": summary["optimizer_steps"],
            "threads": torch.get_num_threads()}


def tracked_and_untracked(command: list[str]) -> dict[bool, dict]:
    """`command` (a child that prints `measured_run`'s figures as JSON on its last line) run twice in fresh processes
    with glibc told to give freed blocks back: with ``--tracked`` (key True) and without (key False)."""
    runs = {}
    for tracked in (True, False):
        completed = subprocess.run(command + (["--tracked"] if tracked else []),
                                   env={**os.environ, **MALLOC_ENVIRONMENT}, capture_output=True, text=True,
                                   check=False)
        if completed.returncode:
            sys.exit(f"the {'tracked' if tracked else 'RSS'} run failed:\n{completed.stderr[-3000:]}")
        runs[tracked] = json.loads(completed.stdout.strip().splitlines()[-1])
    return runs


def child(settings: dict, seq_len: int, updates: int, tracked: bool) -> None:
    """One real run of `settings` on the 0.5B shape; prints its figures as JSON on the last line."""
    from looptrain import estimation

    print(json.dumps(measured_run(estimation.preset_config("qwen2.5-0.5b"), settings, seq_len, updates, tracked)))


def measure(seq_len: int, updates: int, output: str | None) -> None:
    from looptrain import planning

    started = time.perf_counter()
    found = planning.lowest("qwen2.5-0.5b", 1, seq_len, echo=lambda line: print(line, file=sys.stderr))
    search_seconds = time.perf_counter() - started
    estimated = found.estimate["peak_memory_bytes"]
    settings = dataclasses.asdict(found.settings)
    runs = tracked_and_untracked([sys.executable, __file__, "--child", json.dumps(settings), "--seq-len",
                                  str(seq_len), "--updates", str(updates)])
    tracked, untracked = runs[True], runs[False]
    rss = untracked["rss_above_start_bytes"] + untracked["weights_bytes"]
    print(f"## qwen2.5-0.5b shape, random weights, the lowest full fine-tune at 1 x {seq_len}, {updates} updates "
          f"({cpu_line()})\n")
    print(f"lowest (found in {search_seconds:.0f} s, {found.estimates} estimates): "
          f"{' '.join(found.settings.flags())}\n")
    print("| figure | GiB | vs estimate |")
    print("|---|---|---|")
    print(f"| estimate (fake tensors) | {estimated / GIB:.3f} | |")
    print(f"| tracker peak (live tensors) | {tracked['peak_memory_bytes'] / GIB:.3f} | "
          f"{tracked['peak_memory_bytes'] / estimated - 1:+.1%} |")
    print(f"| peak RSS above the start + weights | {rss / GIB:.3f} | {rss / estimated - 1:+.1%} |")
    print(f"| (peak RSS above the start) | {untracked['rss_above_start_bytes'] / GIB:.3f} | |")
    print(f"\nseconds for {updates} updates: {tracked['seconds']:.0f} tracked, {untracked['seconds']:.0f} untracked")
    if output:
        with open(output, "w", encoding="utf-8") as handle:
            json.dump({"seq_len": seq_len, "updates": updates, "lowest": found.to_dict(), "tracked": tracked,
                       "untracked": untracked, "cpu": cpu_line()}, handle, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="the 0.5B shape: estimate vs tracker vs RSS")
    parser.add_argument("--ladder", action="store_true", help="the estimated ladder of the 0.5B and 1.5B shapes")
    parser.add_argument("--seq-len", type=int, default=512, help="--measure's tokens per row")
    parser.add_argument("--ladder-seq-len", type=int, default=2048)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--json", help="--measure: write its figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tracked", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.child:
        child(json.loads(arguments.child), arguments.seq_len, arguments.updates, arguments.tracked)
        return 0
    if not (arguments.measure or arguments.ladder):
        parser.error("choose --measure, --ladder or both")
    if arguments.ladder:
        ladder(arguments.ladder_seq_len)
    if arguments.measure:
        measure(arguments.seq_len, arguments.updates, arguments.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

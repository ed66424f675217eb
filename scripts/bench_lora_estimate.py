"""LoRA and QLoRA: the estimate against real runs, the 0.5B/1.5B table, and where LoRA stops paying.

Three parts (docs/lora.md, "Will it fit? The estimate", has their figures):

- ``--measure``: LoRA and QLoRA (rank 16, gradient checkpointing, fp32 compute) on a model built from a config with
  random weights (``--shape tiny``, a small Qwen2, or a preset: ``qwen2.5-0.5b``) at micro-batch 1 x ``--seq-len``:
  the estimate (fake tensors), then ``--updates`` real updates through ``Loop.fit`` in two fresh subprocesses, one
  with the tensor tracker on (its peak), one with it off (the process's peak RSS above the RSS after the model was
  built, wrapped and quantized, with glibc told to give freed blocks back:
  ``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072``). The stored model exists before the run starts,
  so the RSS figure is compared to the estimate as RSS above the start + the stored bytes (parameters, buffers and
  the 4-bit weights' quantization states).
- ``--table``: estimates only, for the 0.5B and 1.5B shapes at 1 x 512 and 1 x 2048: the lowest full fine-tune
  (``looptrain.planning.lowest``, what ``python -m looptrain.memory --lowest`` prints), and LoRA / QLoRA rank 16 each
  at the lowest of a few lever mixes (`ADAPTER_MIXES`), with bytes per parameter (peak / all parameters).
- ``--where``: where LoRA stops paying (huggingface/peft#1514): a small base at long sequences, estimated, and one
  real run each of the lowest full fine-tune and of the best LoRA mix (``--where-measure``).

Run (2 shared CPU cores: minutes each)::

    PYTHONPATH=. python scripts/bench_lora_estimate.py --measure --shape tiny --seq-len 512 --updates 3
    PYTHONPATH=. python scripts/bench_lora_estimate.py --measure --shape qwen2.5-0.5b --seq-len 256 --updates 2
    PYTHONPATH=. python scripts/bench_lora_estimate.py --table
    PYTHONPATH=. python scripts/bench_lora_estimate.py --where --where-measure

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_causal_lm import GIB, SHAPES, cpu_line, measured_run, tracked_and_untracked

MIB = 1024**2
RANK = 16
MEASURED = {  # what --measure runs: fp32 compute (bf16 would compile bitsandbytes' CPU kernels inside the run)
    "LoRA r16 + checkpointing": {"lora_rank": RANK, "gradient_checkpointing": True},
    "QLoRA r16 + checkpointing": {"lora_rank": RANK, "qlora": True, "gradient_checkpointing": True},
}
ADAPTER_MIXES = {  # --table and --where: each adapter column is the lowest of these (all with checkpointing)
    "ckpt": {"gradient_checkpointing": True},
    "ckpt, bf16 weights": {"gradient_checkpointing": True, "weights": "bf16"},
}  # (+ the fused step was no lower at 0.5B x 512, where it was tried: the adapters' grads are small)
# --shape tiny and --where's small base: Qwen2 blocks, the real vocabulary (the embedding is most of it).
TINY = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 256, "intermediate_size": 1024,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
        "max_position_embeddings": 32768}


# --where's small base: Qwen2 blocks under a 32k vocabulary (the embedding about half of 25M parameters), so that
# activations, not weights, dominate at long sequences.
SMALL = {**TINY, "vocab_size": 32000, "hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6,
         "num_attention_heads": 6, "num_key_value_heads": 2}


def config_of(shape: str, **overrides: Any):
    from transformers import AutoConfig

    from looptrain import estimation

    if shape in ("tiny", "small"):
        values = {**(TINY if shape == "tiny" else SMALL), **overrides}
        return AutoConfig.for_model(values.pop("model_type"), **values)
    config = estimation.preset_config(shape)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def child(settings: dict, shape: str, overrides: dict, seq_len: int, updates: int, tracked: bool) -> None:
    """One real run of `settings` (`bench_causal_lm.measured_run`); prints its figures as JSON on the last line."""
    print(json.dumps(measured_run(config_of(shape, **overrides), settings, seq_len, updates, tracked)))


def run_real(settings: dict, shape: str, overrides: dict, seq_len: int, updates: int) -> dict[bool, dict]:
    return tracked_and_untracked([sys.executable, __file__, "--child", json.dumps(settings), "--shape", shape,
                                  "--overrides", json.dumps(overrides), "--seq-len", str(seq_len), "--updates",
                                  str(updates)])


def measure(shape: str, seq_len: int, updates: int) -> None:
    from looptrain import estimation

    config = config_of(shape)
    print(f"## {shape} shape, random weights, 1 x {seq_len}, {updates} updates ({cpu_line()}); MiB (2^20 B)\n")
    print("| mix | estimate | tracker peak | vs estimate | RSS above start + stored | vs estimate | stored | "
          "s (tracked / untracked) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, settings in MEASURED.items():
        estimated = estimation.estimate(config, 1, seq_len, **settings)["peak_memory_bytes"]
        runs = run_real({"batch_size": 1, **settings}, shape, {}, seq_len, updates)
        tracked, untracked = runs[True], runs[False]
        rss = untracked["rss_above_start_bytes"] + untracked["stored_bytes"]
        print(f"| {label} | {estimated / MIB:.1f} | {tracked['peak_memory_bytes'] / MIB:.1f} | "
              f"{tracked['peak_memory_bytes'] / estimated - 1:+.1%} | {rss / MIB:.1f} | {rss / estimated - 1:+.1%} | "
              f"{untracked['stored_bytes'] / MIB:.1f} | {tracked['seconds']:.0f} / {untracked['seconds']:.0f} |",
              flush=True)


def lowest_adapter(config, seq_len: int, levers: dict) -> tuple[str, dict]:
    """The lowest estimate of `levers` (LoRA or QLoRA) over `ADAPTER_MIXES`: (mix label, estimate)."""
    from looptrain import estimation

    results = {label: estimation.estimate(config, 1, seq_len, **levers, **mix) for label, mix in ADAPTER_MIXES.items()}
    label = min(results, key=lambda name: results[name]["peak_memory_bytes"])
    return label, results[label]


def cell(result: dict) -> str:
    return f"{result['peak_memory_bytes'] / GIB:.2f} GiB, {result['peak_memory_bytes'] / result['parameters']:.2f} B/p"


# The lowest full fine-tune `looptrain.planning.lowest` finds for these shapes at 512 and 2048 tokens on a CPU with
# native bf16 (docs/causal_lm.md); --table --search runs the search instead (12 estimates a cell, slow).
LOWEST_FULL = {"precision": "bf16", "weights": "bf16", "optimizer": "adafactor", "gradient_checkpointing": True,
               "optimizer_in_backward": True, "chunked_ce": "on"}


def table(seq_lens: list[int], shapes: list[str], search: bool = False) -> None:
    from looptrain import estimation, planning
    from looptrain.strategy import Strategy

    print(f"## Estimated, micro-batch 1, rank 16 ({cpu_line()}); GiB (2^30 B) and bytes per parameter\n")
    print("| shape | seq | full fine-tune, lowest | LoRA r16 | QLoRA r16 |")
    print("|---|---|---|---|---|")
    notes = []
    for shape in shapes:
        config = estimation.preset_config(shape)
        for seq_len in seq_lens:
            if search:
                found = planning.lowest(config, 1, seq_len, echo=lambda line: None)
                full, full_flags = found.estimate, " ".join(found.settings.flags())
            else:
                full = estimation.estimate(config, 1, seq_len, **LOWEST_FULL)
                full_flags = "--lowest's " + " ".join(flag for flag in Strategy(batch_size=1, **LOWEST_FULL).flags()
                                                      if flag not in ("--batch-size", "--accum", "1"))
            lora_mix, lora = lowest_adapter(config, seq_len, {"lora_rank": RANK})
            qlora_mix, qlora = lowest_adapter(config, seq_len, {"lora_rank": RANK, "qlora": True})
            print(f"| {shape} | {seq_len} | {cell(full)} | {cell(lora)} ({lora_mix}) | {cell(qlora)} "
                  f"({qlora_mix}) |", flush=True)
            notes.append(f"{shape} {seq_len}: full fine-tune {full_flags}; LoRA "
                         f"{lora['trainable_parameters'] / 1e6:.2f}M trained")
    print()
    for note in notes:
        print(f"- {note}")


def where(seq_lens: list[int], measure_seq: int | None, updates: int) -> None:
    """A small base (`SMALL`) at long sequences: the lowest full fine-tune against the best LoRA mix, and with the
    adapters' dropout (each adapter then saves its own dropped copy of its input, and the mask)."""
    from looptrain import estimation, planning

    config = config_of("small")
    parameters = estimation.estimate(config, 1, 8)["parameters"]
    print(f"## Where LoRA stops paying: a small base (Qwen2 blocks, hidden 384, 6 layers, vocab 32000, "
          f"{parameters / 1e6:.1f}M parameters) at 1 x seq ({cpu_line()}); MiB\n")
    print("| seq | full fine-tune, lowest | LoRA r16 (best mix) | LoRA / full | + --lora-dropout 0.1 | / full |")
    print("|---|---|---|---|---|---|")
    measured_pair = None
    for seq_len in seq_lens:
        found = planning.lowest(config, 1, seq_len, echo=lambda line: None)
        mix, lora = lowest_adapter(config, seq_len, {"lora_rank": RANK})
        full_peak, lora_peak = found.estimate["peak_memory_bytes"], lora["peak_memory_bytes"]
        dropped = estimation.estimate(config, 1, seq_len, lora_rank=RANK, lora_dropout=0.1,
                                    **ADAPTER_MIXES[mix])["peak_memory_bytes"]
        print(f"| {seq_len} | {full_peak / MIB:.1f} ({' '.join(found.settings.flags())}) | {lora_peak / MIB:.1f} "
              f"({mix}) | {lora_peak / full_peak:.2f} | {dropped / MIB:.1f} | {dropped / full_peak:.2f} |",
              flush=True)
        if seq_len == measure_seq:
            measured_pair = (found, mix, full_peak, dropped)
    if measured_pair is None:
        return
    found, mix, full_peak, lora_peak = measured_pair
    full_settings = dict(found.to_dict()["settings"]["strategy"])
    lora_settings = {"batch_size": 1, "lora_rank": RANK, "lora_dropout": 0.1, **ADAPTER_MIXES[mix]}
    print(f"\n### Measured at 1 x {measure_seq}, {updates} updates (tracker peak, RSS above start + stored)\n")
    print("| run | estimate | tracker | RSS above start + stored |")
    print("|---|---|---|---|")
    for label, settings, estimated in (("full fine-tune, lowest", full_settings, full_peak),
                                       (f"LoRA r16 ({mix}, --lora-dropout 0.1)", lora_settings, lora_peak)):
        runs = run_real(settings, "small", {}, measure_seq, updates)
        rss = runs[False]["rss_above_start_bytes"] + runs[False]["stored_bytes"]
        print(f"| {label} | {estimated / MIB:.1f} | {runs[True]['peak_memory_bytes'] / MIB:.1f} "
              f"({runs[True]['peak_memory_bytes'] / estimated - 1:+.1%}) | {rss / MIB:.1f} "
              f"({rss / estimated - 1:+.1%}) |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="LoRA and QLoRA: estimate vs tracker vs RSS")
    parser.add_argument("--shape", default="tiny", help="--measure's model: tiny, or a preset (qwen2.5-0.5b)")
    parser.add_argument("--seq-len", type=int, default=512, help="--measure's tokens per row")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--table", action="store_true", help="the estimated 0.5B / 1.5B table")
    parser.add_argument("--table-seq-lens", default="512,2048")
    parser.add_argument("--table-shapes", default=",".join(SHAPES))
    parser.add_argument("--search", action="store_true", help="--table: search the lowest full fine-tune per cell")
    parser.add_argument("--where", action="store_true", help="where LoRA stops paying, estimated")
    parser.add_argument("--where-seq-lens", default="1024,4096,8192")
    parser.add_argument("--where-measure", type=int, default=None, metavar="SEQ",
                        help="--where: also run the lowest full fine-tune and the best LoRA mix at this length")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--tracked", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.child:
        child(json.loads(arguments.child), arguments.shape, json.loads(arguments.overrides), arguments.seq_len,
              arguments.updates, arguments.tracked)
        return 0
    if not (arguments.measure or arguments.table or arguments.where):
        parser.error("choose --measure, --table, --where or several")
    if arguments.measure:
        measure(arguments.shape, arguments.seq_len, arguments.updates)
    if arguments.table:
        table([int(value) for value in arguments.table_seq_lens.split(",")], arguments.table_shapes.split(","),
              arguments.search)
    if arguments.where:
        where([int(value) for value in arguments.where_seq_lens.split(",")], arguments.where_measure,
              arguments.updates)
    return 0


if __name__ == "__main__":
    sys.exit(main())

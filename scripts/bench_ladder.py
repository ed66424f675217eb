"""The strategy ladder of seed 000, measured with looptrain and with Hugging Face Trainer in one run.

For every rung (seed 000's ladder for chinese-macbert-large, then looptrain's own rungs) this prints:

- the **estimated** peak at full size (macbert-large: hidden 1024, 24 layers, vocab 21128, seq 128,
  effective batch 32), from ``looptrain.estimation.estimate`` (fake tensors, no memory, no compute);
- the **measured** peak RSS above the post-model-load RSS and the time per sample of a smaller shape
  (default hidden 512, 8 layers, 8 heads, vocab 21128: 36.6M parameters) trained for a few updates
  by looptrain's ``Loop`` and by ``transformers.Trainer``, each run in a fresh subprocess;
- looptrain's tensor-tracker peak (a separate tracked run: the timed run has the tracker off) and
  the estimator's figure for the same small shape, to check the estimator.

Every measurement runs in its own process with ``MALLOC_MMAP_THRESHOLD_=131072
MALLOC_TRIM_THRESHOLD_=131072``: without them glibc keeps freed large blocks resident and RSS
reports the allocator's history instead of the live peak.

Run (about 20 minutes on 2 idle CPU cores; much longer when they are shared)::

    PYTHONPATH=. python scripts/bench_ladder.py --plot docs/ladder.png --json ladder.json
    PYTHONPATH=. python scripts/bench_ladder.py --tracker-overhead --threads 1 --baseline-memory old_memory.py

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MIB = 1024 * 1024
GIB = 1024**3
FULL_SIZE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
             "vocab_size": 21128}
# The measured shape: the 36.6M-parameter BERT of REFERENCE_NUMBERS.md (Trainer timings exist for it).
SMALL_SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "intermediate_size": 2048,
               "vocab_size": 21128}
MALLOC_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
EFFECTIVE_BATCH = 32
SEQ_LEN = 128
LEARNING_RATE = 1e-5


def rungs() -> list[dict[str, Any]]:
    """The ladder, rung by rung. Each rung is a full strategy (not a delta), so each runs on its own.

    Keys: ``name``; ``batch_size`` and ``accum_steps`` (effective batch 32 throughout); ``seq_len``;
    ``optimizer`` (looptrain.optim name); ``gradient_checkpointing``; ``precision``;
    ``optimizer_in_backward``; ``freeze_encoder``; ``foreach``; ``trainer_optim`` (Trainer's
    ``optim``, or None where Trainer cannot run the rung).
    """
    accumulated = {"batch_size": 1, "accum_steps": EFFECTIVE_BATCH}
    base = {
        "seq_len": SEQ_LEN, "optimizer": "adamw", "gradient_checkpointing": False, "precision": "fp32",
        "optimizer_in_backward": False, "freeze_encoder": False, "foreach": None, "trainer_optim": "adamw_torch",
        "batch_size": EFFECTIVE_BATCH, "accum_steps": 1,
    }
    checkpointed = {**base, **accumulated, "gradient_checkpointing": True}
    fused = {**base, "gradient_checkpointing": True, "precision": "bf16", "optimizer_in_backward": True,
             "trainer_optim": None}
    return [
        {**base, "name": "1 baseline: bs 32, fp32, AdamW"},
        {**base, **accumulated, "name": "2 + accumulation (bs 1 x 32)"},
        {**checkpointed, "name": "3 + gradient checkpointing"},
        {**checkpointed, "optimizer": "adafactor", "trainer_optim": "adafactor", "name": "4 + Adafactor"},
        {**checkpointed, "optimizer": "adafactor", "trainer_optim": "adafactor", "freeze_encoder": True,
         "name": "5 + freeze encoder (head only)"},
        {**checkpointed, "optimizer": "adafactor", "trainer_optim": "adafactor", "freeze_encoder": True,
         "seq_len": SEQ_LEN // 2, "name": "6 + max_length 64"},
        {**base, "precision": "bf16", "name": "7 bs 32, bf16 autocast"},
        {**checkpointed, "optimizer": "adamw8bit", "trainer_optim": "adamw_bnb_8bit",
         "name": "8 bs 1 x 32 + ckpt, AdamW8bit (32-bit embeddings)"},
        {**fused, "optimizer": "adamw8bit", "name": "9 bs 32 + ckpt + bf16, AdamW8bit fused into backward"},
        {**fused, "optimizer": "adafactor", "name": "10 bs 32 + ckpt + bf16, Adafactor fused into backward"},
        {**checkpointed, "foreach": False, "name": "11 bs 1 x 32 + ckpt, AdamW foreach=False"},
    ]


# ------------------------------------------------------------------------------------------------
# The worker: one framework, one rung, one fresh process
# ------------------------------------------------------------------------------------------------


def _read_peak_rss() -> int:
    """Peak RSS of this process (VmHWM), which ``reset_peak_rss`` can lower; else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False where not allowed.

    Model construction has its own transient peak; without the reset it could hide a smaller
    training peak behind it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _build_model(shape: dict[str, int], rung: dict[str, Any]):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from looptrain import freeze

    torch.manual_seed(0)
    config = BertConfig(num_labels=2, max_position_embeddings=512, **shape)
    model = BertForSequenceClassification(config)
    if rung["freeze_encoder"]:
        freeze.freeze_encoder(model)
    return model


def _random_rows(samples: int, seq_len: int, vocab_size: int) -> list[dict[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)
    labels = torch.randint(0, 2, (samples,), generator=generator)
    return [
        {"input_ids": input_ids[index], "attention_mask": torch.ones(seq_len, dtype=torch.long),
         "labels": labels[index]}
        for index in range(samples)
    ]


def run_looptrain(rung: dict[str, Any], shape: dict[str, int], updates: int, track_memory: bool) -> dict[str, Any]:
    """Trains `updates` optimizer updates with looptrain's Loop; returns timings and memory figures."""
    import torch
    from torch.utils.data import DataLoader

    from looptrain import Loop, LoopConfig
    from looptrain.optim import build_optimizer

    model = _build_model(shape, rung)
    rows = _random_rows(updates * EFFECTIVE_BATCH, rung["seq_len"], shape["vocab_size"])
    loader = DataLoader(rows, batch_size=rung["batch_size"], shuffle=False)
    stamps: list[float] = []

    class TimedLoop(Loop):
        def on_step_end(self, **_: Any) -> None:
            stamps.append(time.perf_counter())

    baseline = _current_rss()
    reset = _reset_peak_rss()
    optimizer = build_optimizer(model, rung["optimizer"], LEARNING_RATE, weight_decay=0.0, foreach=rung["foreach"])
    # The tracked (memory-only) run keeps 2 micro-batches per window, as the estimator does: from
    # the second micro-batch on, every micro-batch of a window holds the same memory (the grads
    # exist already), so the peak is that of the full window at a 16th of the time.
    accum_steps = min(rung["accum_steps"], 2) if track_memory else rung["accum_steps"]
    config = LoopConfig(
        epochs=1, max_steps=updates, accum_steps=accum_steps, precision=rung["precision"],
        gradient_checkpointing=rung["gradient_checkpointing"], optimizer_in_backward=rung["optimizer_in_backward"],
        track_memory=track_memory, device="cpu", log_every=10**6, eval_every="no", progress_bar=False,
        max_grad_norm=1.0,
    )
    loop = TimedLoop(model, optimizer, loader, config=config)
    started = time.perf_counter()
    summary = loop.fit()
    result = _result(stamps, started, baseline, reset)
    result["optimizer_steps"] = summary["optimizer_steps"]
    result["train_loss"] = summary["train_loss"]
    if track_memory:
        result["tracker_peak_bytes"] = summary["peak_memory_bytes"]
        result["tracker_breakdown"] = summary["memory_breakdown"]
    result["threads"] = torch.get_num_threads()
    return result


def run_trainer(rung: dict[str, Any], shape: dict[str, int], updates: int) -> dict[str, Any]:
    """Trains `updates` optimizer updates with transformers.Trainer; returns timings and memory figures."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = _build_model(shape, rung)
    rows = _random_rows(updates * EFFECTIVE_BATCH, rung["seq_len"], shape["vocab_size"])
    stamps: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    baseline = _current_rss()
    reset = _reset_peak_rss()
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=rung["batch_size"],
            gradient_accumulation_steps=rung["accum_steps"],
            gradient_checkpointing=rung["gradient_checkpointing"],
            gradient_checkpointing_kwargs={"use_reentrant": False} if rung["gradient_checkpointing"] else None,
            optim=rung["trainer_optim"],
            bf16=rung["precision"] == "bf16",
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            max_steps=updates,
            dataloader_num_workers=0,
            learning_rate=LEARNING_RATE,
            weight_decay=0.0,
            lr_scheduler_type="constant",  # looptrain runs without a scheduler here
            max_grad_norm=1.0,
            seed=42,
        )
        trainer = Trainer(model=model, args=arguments, train_dataset=rows, callbacks=[Stamps()])
        started = time.perf_counter()
        output = trainer.train()
    result = _result(stamps, started, baseline, reset)
    result["optimizer_steps"] = output.global_step
    result["train_loss"] = output.training_loss
    result["threads"] = torch.get_num_threads()
    return result


def _current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _result(stamps: list[float], started: float, baseline: int, reset: bool) -> dict[str, Any]:
    peak = _read_peak_rss()
    update_seconds = [later - earlier for earlier, later in zip(stamps, stamps[1:])]  # the first update is warm-up
    return {
        "first_update_s": stamps[0] - started if stamps else None,
        "update_seconds": update_seconds,
        "seconds_per_sample": statistics.median(update_seconds) / EFFECTIVE_BATCH if update_seconds else None,
        "rss_baseline_bytes": baseline,
        "peak_rss_bytes": peak,
        "peak_rss_delta_bytes": peak - baseline,
        "peak_rss_reset": reset,
    }


def worker(spec: dict[str, Any]) -> None:
    """Runs one measurement and prints its result as the last line of stdout (JSON)."""
    if spec["framework"] == "looptrain":
        result = run_looptrain(spec["rung"], spec["shape"], spec["updates"], spec["track_memory"])
    else:
        result = run_trainer(spec["rung"], spec["shape"], spec["updates"])
    print(json.dumps(result))


def measure_in_subprocess(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs `worker(spec)` in a fresh interpreter with glibc's malloc thresholds fixed."""
    environment = {**os.environ, **MALLOC_ENVIRONMENT, "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
        capture_output=True, text=True, env=environment, timeout=timeout,
    )
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        tail = (completed.stderr or completed.stdout)[-2000:]
        return {"error": f"exit {completed.returncode}: {tail}", "wall_s": wall}
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


# ------------------------------------------------------------------------------------------------
# Estimates
# ------------------------------------------------------------------------------------------------


def estimate_rung(rung: dict[str, Any], shape: dict[str, int]) -> dict[str, Any]:
    """``looptrain.estimation.estimate`` for the rung at `shape` (a fake-tensor run: seconds, no memory)."""
    from transformers import BertConfig

    from looptrain import estimation

    config = BertConfig(num_labels=2, max_position_embeddings=512, **shape)
    return estimation.estimate(
        config, rung["batch_size"], rung["seq_len"], precision=rung["precision"], optimizer=rung["optimizer"],
        gradient_checkpointing=rung["gradient_checkpointing"], optimizer_in_backward=rung["optimizer_in_backward"],
        freeze_encoder=rung["freeze_encoder"], foreach=rung["foreach"], accum_steps=rung["accum_steps"],
    )


# ------------------------------------------------------------------------------------------------
# Tables and plot
# ------------------------------------------------------------------------------------------------


def _mib(value: Any) -> str:
    return "n/a" if value is None else f"{value / MIB:.0f}"


def _ratio(numerator: Any, denominator: Any) -> str:
    if numerator is None or denominator is None or denominator <= 0:
        return "n/a"
    return f"{numerator / denominator:.3f}"


def _ms(value: Any) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f}"


def print_tables(rows: list[dict[str, Any]], arguments: argparse.Namespace) -> None:
    print(f"\n### Measured: {arguments.shape_label}, seq 128 (64 for rung 6), effective batch 32, "
          f"{arguments.updates} updates ({arguments.updates * EFFECTIVE_BATCH} samples; "
          f"time = median of updates 2..{arguments.updates})\n")
    print("| rung | looptrain RSS Δ MiB | Trainer RSS Δ MiB | memory ratio | looptrain ms/sample | Trainer ms/sample "
          "| time ratio | looptrain tracker peak MiB (− weights) | estimate (this shape) MiB | estimate error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ours, theirs = row["looptrain"], row["trainer"]
        tracked = row["looptrain_tracked"]
        tracker_peak = tracked.get("tracker_peak_bytes")
        estimate_small = row["estimate_small"]["peak_memory_bytes"]
        error = f"{(estimate_small - tracker_peak) / tracker_peak:+.1%}" if tracker_peak else "n/a"
        # The RSS deltas start after model load, so the weights are in the tracker's peak only.
        weights = (tracked.get("tracker_breakdown") or {}).get("params")
        if tracker_peak and weights is not None:
            tracker_cell = f"{_mib(tracker_peak)} ({_mib(tracker_peak - weights)})"
        else:
            tracker_cell = _mib(tracker_peak)
        print(
            f"| {row['rung']['name']} | {_mib(ours.get('peak_rss_delta_bytes'))} | "
            f"{_mib(theirs.get('peak_rss_delta_bytes'))} | "
            f"{_ratio(ours.get('peak_rss_delta_bytes'), theirs.get('peak_rss_delta_bytes'))} | "
            f"{_ms(ours.get('seconds_per_sample'))} | "
            f"{_ms(theirs.get('seconds_per_sample'))} | "
            f"{_ratio(ours.get('seconds_per_sample'), theirs.get('seconds_per_sample'))} | "
            f"{tracker_cell} | {_mib(estimate_small)} | {error} |"
        )
    print("\n### Estimated at full size: macbert-large shape (hidden 1024, 24 layers, vocab 21128, 325.5M params), "
          "effective batch 32\n")
    print("| rung | estimated peak GiB | params | grads | optimizer state | activations + temps | peak phase |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        full = row["estimate_full"]
        breakdown = full["memory_breakdown"]
        print(
            f"| {row['rung']['name']} | {full['peak_memory_bytes'] / GIB:.2f} | {breakdown['params'] / GIB:.2f} | "
            f"{breakdown['grads'] / GIB:.2f} | {breakdown['optimizer_state'] / GIB:.2f} | "
            f"{breakdown['activations_and_temps'] / GIB:.2f} | {breakdown['peak_phase']} |"
        )
    errors = [row for row in rows
              if "error" in row["looptrain"] or "error" in row["trainer"] or "error" in row["looptrain_tracked"]]
    for row in errors:
        for key in ("looptrain", "trainer", "looptrain_tracked"):
            if "error" in row[key]:
                print(f"\nerror in {row['rung']['name']} ({key}): {row[key]['error']}")
    print_targets(rows)


def print_targets(rows: list[dict[str, Any]]) -> None:
    """The issue's targets, each with the figures it is judged on."""
    print("\n### Targets\n")
    both = [row for row in rows if row["rung"]["trainer_optim"] and "peak_rss_delta_bytes" in row["trainer"]
            and "peak_rss_delta_bytes" in row["looptrain"]]
    def margin(row: dict[str, Any], key: str, unit: float, unit_name: str) -> str:
        ours, theirs = row["looptrain"][key], row["trainer"][key]
        return f"{row['rung']['name'].split()[0]} (+{(ours - theirs) / unit:.2f} {unit_name}, {ours / theirs:.3f}×)"

    memory_misses = [margin(row, "peak_rss_delta_bytes", MIB, "MiB") for row in both
                     if row["looptrain"]["peak_rss_delta_bytes"] > row["trainer"]["peak_rss_delta_bytes"]]
    time_misses = [margin(row, "seconds_per_sample", 1e-3, "ms/sample") for row in both
                   if row["looptrain"]["seconds_per_sample"] > row["trainer"]["seconds_per_sample"]]
    print(f"- memory parity (looptrain RSS Δ ≤ 1.0× Trainer's) at {len(both) - len(memory_misses)}/{len(both)} rungs; "
          f"missed: {memory_misses or 'none'}")
    print(f"- time parity (looptrain s/sample ≤ 1.0× Trainer's) at {len(both) - len(time_misses)}/{len(both)} rungs; "
          f"missed: {time_misses or 'none'}")
    by_number = {row["rung"]["name"].split()[0]: row for row in rows}
    trainer_eight_bit = by_number.get("8", {}).get("trainer", {}).get("peak_rss_delta_bytes")
    fused_eight_bit = by_number.get("9", {}).get("looptrain", {}).get("peak_rss_delta_bytes")
    print(f"- 8-bit full fine-tune: looptrain rung 9 RSS Δ {_mib(fused_eight_bit)} MiB vs Trainer rung 8 "
          f"{_mib(trainer_eight_bit)} MiB: {_ratio(fused_eight_bit, trainer_eight_bit)}× (target ≤ 0.80×)")
    errors = []
    for row in rows:
        peak = row["looptrain_tracked"].get("tracker_peak_bytes")
        if peak:
            errors.append((abs(row["estimate_small"]["peak_memory_bytes"] - peak) / peak, row["rung"]["name"]))
    if errors:
        worst = max(errors)
        print(f"- estimator vs measured tracker peak (measured shape): worst {worst[0]:.1%} ({worst[1]}); "
              f"within 10% at {sum(1 for error, _ in errors if error <= 0.10)}/{len(errors)} rungs")
    full_fine_tunes = [row for row in rows if not row["rung"]["freeze_encoder"] and row["rung"]["seq_len"] == SEQ_LEN]
    eight_bit = [row for row in full_fine_tunes if row["rung"]["optimizer"] == "adamw8bit"]
    if not full_fine_tunes or not eight_bit:
        return
    lowest = min(full_fine_tunes, key=lambda row: row["estimate_full"]["peak_memory_bytes"])
    lowest_eight_bit = min(eight_bit, key=lambda row: row["estimate_full"]["peak_memory_bytes"])
    print(f"- full-size full fine-tune, lowest estimate: {lowest['rung']['name']}: "
          f"{lowest['estimate_full']['peak_memory_bytes'] / GIB:.2f} GiB "
          f"(targets: fits in 4 GiB; best looptrain rung ≤ 2.5 GiB); lowest with 8-bit AdamW: "
          f"{lowest_eight_bit['rung']['name']}: "
          f"{lowest_eight_bit['estimate_full']['peak_memory_bytes'] / GIB:.2f} GiB")



def plot(rows: list[dict[str, Any]], path: str, arguments: argparse.Namespace) -> None:
    """Two panels: measured RSS Δ (looptrain vs Trainer, small shape) and the full-size estimate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["rung"]["name"] for row in rows]
    positions = list(range(len(rows)))
    ours = [row["looptrain"].get("peak_rss_delta_bytes", 0) / MIB for row in rows]
    theirs = [(row["trainer"].get("peak_rss_delta_bytes") or 0) / MIB for row in rows]
    tracker = [(row["looptrain_tracked"].get("tracker_peak_bytes") or 0) / MIB for row in rows]
    full = [row["estimate_full"]["peak_memory_bytes"] / GIB for row in rows]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(13, 10), constrained_layout=True)
    width = 0.27
    top.bar([p - width for p in positions], ours, width, label="looptrain: peak RSS − RSS after model load",
            color="#1f77b4")
    top.bar(positions, theirs, width, label="HF Trainer: peak RSS − RSS after model load", color="#ff7f0e")
    top.bar([p + width for p in positions], tracker, width,
            label="looptrain: tensor-tracker peak (live tensors, weights included)", color="#9ecae1")
    for position, row in zip(positions, rows):
        if not row["rung"]["trainer_optim"]:
            top.text(position, 5, "Trainer\nn/a", ha="center", va="bottom", fontsize=8, color="#ff7f0e")
    top.set_ylabel("MiB")
    top.set_title(f"Measured: {arguments.shape_label}, effective batch 32, 2 CPU cores (malloc thresholds fixed)")
    top.set_xticks(positions, [label.split(" ", 1)[0] for label in labels])
    top.legend(loc="upper right")
    bottom.bar(positions, full, 0.6, color="#2ca02c")
    for position, value in zip(positions, full):
        bottom.text(position, value + 0.1, f"{value:.2f}", ha="center", fontsize=8)
    bottom.axhline(4.0, color="grey", linestyle="--", linewidth=1)
    bottom.text(len(rows) - 0.5, 4.05, "4 GiB", ha="right", va="bottom", color="grey", fontsize=8)
    bottom.set_ylabel("GiB (estimate_fake_tensor_tracker)")
    bottom.set_title("Estimated peak at full size: macbert-large shape (325.5M params), seq 128 (64 for rung 6)")
    bottom.set_xticks(positions, [label.split(" ", 1)[0] for label in labels])
    legend_text = "\n".join(labels)
    bottom.text(1.01, 1.0, legend_text, transform=bottom.transAxes, va="top", fontsize=8)
    top.text(1.01, 1.0, legend_text, transform=top.transAxes, va="top", fontsize=8)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------
# Tracker overhead
# ------------------------------------------------------------------------------------------------

OVERHEAD_SHAPES = {
    "tiny BERT (hidden 32, 2 layers, vocab 512): per-op cost dominates": (32, 2, 512, 2),
    "small BERT (hidden 256, 4 layers, vocab 8000)": (256, 4, 8000, 4),
    "MiniLM-sized BERT (hidden 384, 12 layers, vocab 30522)": (384, 12, 30522, 12),
}


def tracker_overhead(baseline_module_path: str, repeats: int = 5, steps: int = 3) -> None:
    """Prints tracked / untracked step time for the tracker now and, optionally, an older one.

    Same process, same model, same optimizer; the three meters take turns `repeats` times, each
    for one warm-up step and `steps` timed steps; the table gives medians. The older tracker is any
    module with ``make_meter``, e.g. the single-file ``looptrain/memory.py`` of before the package split
    (``git show 6d9579b:looptrain/memory.py > old_memory.py``).
    """
    import importlib.util

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from looptrain import memory

    meters = {"untracked": (memory, False), "tracker (this tree)": (memory, True)}
    if baseline_module_path:
        specification = importlib.util.spec_from_file_location("baseline_memory", baseline_module_path)
        baseline = importlib.util.module_from_spec(specification)
        sys.modules["baseline_memory"] = baseline  # dataclasses look their module up there
        specification.loader.exec_module(baseline)
        meters["tracker (baseline file)"] = (baseline, True)
    from looptrain.precision import cpu_description

    print(f"\n### Tracker overhead: batch 8 x 128, AdamW, CPU {cpu_description()}, median of {repeats * steps} steps\n")
    print("| model | untracked s/step | " + " | ".join(f"{name} s/step (ratio)" for name in list(meters)[1:]) + " |")
    print("|---|---|" + "---|" * (len(meters) - 1))
    for label, (hidden, layers, vocab, heads) in OVERHEAD_SHAPES.items():
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=128, num_labels=2))
        optimizer = torch.optim.AdamW(model.parameters())
        batch = {"input_ids": torch.randint(0, vocab, (8, 128)), "attention_mask": torch.ones(8, 128, dtype=torch.long),
                 "labels": torch.zeros(8, dtype=torch.long)}

        def step(meter, model=model, batch=batch, optimizer=optimizer) -> None:  # marks as the Loop does
            meter.mark("forward")
            loss = model(**batch).loss
            meter.mark("backward")
            loss.backward()
            meter.mark("optimizer")
            optimizer.step()
            optimizer.zero_grad()

        timings: dict[str, list[float]] = {name: [] for name in meters}
        for _ in range(repeats):
            for name, (module, track) in meters.items():
                meter = module.make_meter("cpu", track_tensors=track)
                with meter.tracking(model, optimizer):
                    step(meter)  # warm-up
                    for _ in range(steps):
                        started = time.perf_counter()
                        step(meter)
                        timings[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(values) for name, values in timings.items()}
        untracked = medians["untracked"]
        cells = " | ".join(f"{medians[name]:.4f} ({medians[name] / untracked:.2f}x)" for name in list(meters)[1:])
        print(f"| {label} | {untracked:.4f} | {cells} |", flush=True)


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--updates", type=int, default=2, help="optimizer updates per timed run (the first is warm-up)")
    parser.add_argument("--tracked-updates", type=int, default=2, help="optimizer updates in the tracked (memory) run")
    parser.add_argument("--rungs", default="", help="comma-separated rung numbers to run (default: all)")
    parser.add_argument("--hidden", type=int, default=SMALL_SHAPE["hidden_size"])
    parser.add_argument("--layers", type=int, default=SMALL_SHAPE["num_hidden_layers"])
    parser.add_argument("--heads", type=int, default=SMALL_SHAPE["num_attention_heads"])
    parser.add_argument("--plot", default="docs/ladder.png", help="where to write the PNG ('' for none)")
    parser.add_argument("--json", default="", help="also write every figure to this JSON file")
    parser.add_argument("--from-json", default="",
                        help="print the tables and plot of an earlier --json file, run nothing")
    parser.add_argument("--tracker-overhead", action="store_true", help="only time the tracker's overhead (no ladder)")
    parser.add_argument("--baseline-memory", default="",
                        help="with --tracker-overhead: an older looptrain/memory.py to compare")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of this process, for --tracker-overhead (0: torch's default; "
                             "ladder workers keep the default)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    if arguments.worker:
        worker(json.loads(arguments.worker))
        return 0
    import torch
    import transformers

    shape = {**SMALL_SHAPE, "hidden_size": arguments.hidden, "num_hidden_layers": arguments.layers,
             "num_attention_heads": arguments.heads, "intermediate_size": 4 * arguments.hidden}
    arguments.shape_label = (f"BERT hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
                             f"{shape['num_attention_heads']} heads, vocab {shape['vocab_size']}")
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    if arguments.tracker_overhead:
        tracker_overhead(arguments.baseline_memory)
        return 0
    if arguments.from_json:
        with open(arguments.from_json) as handle:
            saved = json.load(handle)
        rows, shape = saved["rows"], saved["shape"]
        arguments.updates = saved["updates"]
        arguments.shape_label = (f"BERT hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
                                 f"{shape['num_attention_heads']} heads, vocab {shape['vocab_size']}")
        print_tables(rows, arguments)
        if arguments.plot:
            plot(rows, arguments.plot, arguments)
        return 0
    selected = [rung for rung in rungs()
                if not arguments.rungs or rung["name"].split()[0] in arguments.rungs.split(",")]
    from looptrain.precision import cpu_description

    print(f"machine: {os.cpu_count()} CPU cores, {cpu_description()}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; load average at start {os.getloadavg()}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    rows = []
    for rung in selected:
        row = {"rung": rung}
        base_spec = {"rung": rung, "shape": shape}
        # Interleaved per rung, so load from other work on the machine hits both frameworks alike.
        row["looptrain"] = measure_in_subprocess(
            {**base_spec, "framework": "looptrain", "updates": arguments.updates, "track_memory": False},
            arguments.timeout)
        if rung["trainer_optim"]:
            row["trainer"] = measure_in_subprocess(
                {**base_spec, "framework": "trainer", "updates": arguments.updates}, arguments.timeout)
        else:
            row["trainer"] = {}
        row["looptrain_tracked"] = measure_in_subprocess(
            {**base_spec, "framework": "looptrain", "updates": arguments.tracked_updates, "track_memory": True},
            arguments.timeout)
        row["estimate_small"] = estimate_rung(rung, shape)
        row["estimate_full"] = estimate_rung(rung, FULL_SIZE)
        row["load_average"] = os.getloadavg()
        print(f"done: {rung['name']}: looptrain {_mib(row['looptrain'].get('peak_rss_delta_bytes'))} MiB "
              f"{_ms(row['looptrain'].get('seconds_per_sample'))} ms/sample, "
              f"Trainer {_mib(row['trainer'].get('peak_rss_delta_bytes'))} MiB "
              f"{_ms(row['trainer'].get('seconds_per_sample'))} ms/sample, "
              f"tracker {_mib(row['looptrain_tracked'].get('tracker_peak_bytes'))} MiB, "
              f"estimate {row['estimate_full']['peak_memory_bytes'] / GIB:.2f} GiB full size; "
              f"load {row['load_average'][0]:.1f}", flush=True)
        rows.append(row)
        if arguments.json:  # after every rung, so a crash later loses nothing
            with open(arguments.json, "w") as handle:
                json.dump({"shape": shape, "updates": arguments.updates, "rows": rows}, handle, indent=1, default=str)
    print_tables(rows, arguments)
    if arguments.plot:
        plot(rows, arguments.plot, arguments)
        print(f"\nplot: {arguments.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

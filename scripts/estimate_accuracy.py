"""Estimator accuracy and tracker overhead on a small BERT: prints two markdown tables.

Run: PYTHONPATH=. python scripts/estimate_accuracy.py
"""

from __future__ import annotations

import time

import torch
from transformers import BertConfig, BertForSequenceClassification

from looptrain import memory

MIXES = {
    "fp32 adamw": {}, "bf16": {"precision": "bf16"}, "checkpointing": {"gradient_checkpointing": True},
    "frozen encoder": {"freeze_encoder": True}, "adafactor": {"optimizer": "adafactor"},
    "fused step": {"optimizer_in_backward": True}, "foreach=False": {"foreach": False},
    "adamw8bit": {"optimizer": "adamw8bit"}, "accumulation 4 + checkpointing": {"accum_steps": 4, "gradient_checkpointing": True},
}


def small_bert(hidden: int = 64, layers: int = 2, vocab: int = 512) -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=2 * hidden,
        max_position_embeddings=128, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def accuracy_table() -> None:
    print("| mix | estimate KiB | measured KiB | error |\n|---|---|---|---|")
    for name, options in MIXES.items():
        estimated = memory.estimate(small_bert(), 4, 32, **options)["peak_memory_bytes"]
        measured = memory.measure(small_bert(), 4, 32, **options)["peak_memory_bytes"]
        print(f"| {name} | {estimated / 1024:.1f} | {measured / 1024:.1f} | {(estimated - measured) / measured:+.1%} |")


def overhead_table(repeats: int = 5) -> None:
    model = small_bert(hidden=256, layers=4, vocab=8000)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = {"input_ids": torch.randint(0, 8000, (8, 128)), "attention_mask": torch.ones(8, 128, dtype=torch.long), "labels": torch.zeros(8, dtype=torch.long)}

    def step(meter) -> None:
        meter.mark("forward")
        loss = model(**batch).loss
        meter.mark("backward")
        loss.backward()
        meter.mark("optimizer")
        optimizer.step()
        optimizer.zero_grad()

    timings = {}
    for track in (False, True, False, True):
        meter = memory.make_meter("cpu", track_tensors=track)
        with meter.tracking(model, optimizer):
            step(meter)  # warm-up
            started = time.perf_counter()
            for _ in range(repeats):
                step(meter)
            timings[track] = (time.perf_counter() - started) / repeats
    print(f"\nsmall BERT (hidden 256, 4 layers, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), batch 8 x 128, AdamW, 2 threads")
    print(f"| meter | s/step |\n|---|---|\n| untracked (track_tensors=False) | {timings[False]:.3f} |\n| cpu_tensor_tracker | {timings[True]:.3f} |")
    print(f"overhead ratio tracked/untracked: {timings[True] / timings[False]:.2f}")


if __name__ == "__main__":
    accuracy_table()
    overhead_table()

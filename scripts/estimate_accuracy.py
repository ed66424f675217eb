"""Estimator accuracy on a small BERT: `estimation.estimate` (fake tensors) against `estimation.measure` (a real
`Loop.fit` with the tensor tracker), for every mix of `estimation.ACCURACY_MIXES`; prints a markdown table.
The tracker's overhead is timed by `scripts/bench_ladder.py --tracker-overhead`.

Run: PYTHONPATH=. python scripts/estimate_accuracy.py
"""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification

from looptrain import estimation


def small_bert(hidden: int = 64, layers: int = 2, vocab: int = 512) -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=128, num_labels=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def accuracy_table() -> None:
    print("| mix | estimate KiB | measured KiB (tracker, Loop.fit) | error |\n|---|---|---|---|")
    for name, options in estimation.ACCURACY_MIXES.items():
        estimated = estimation.estimate(small_bert(), 4, 32, **options)["peak_memory_bytes"]
        measured = estimation.measure(small_bert(), 4, 32, **options)["peak_memory_bytes"]
        print(f"| {name} | {estimated / 1024:.1f} | {measured / 1024:.1f} | {(estimated - measured) / measured:+.1%} |")


if __name__ == "__main__":
    accuracy_table()

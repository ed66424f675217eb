#!/usr/bin/env python
"""Token classification (NER-style tagging) with a plain PyTorch tagger and a `Loop` subclass with one hook.

    python examples/token_classification.py                 # a synthetic tagging task, about half a minute on a CPU
    python examples/token_classification.py --batch-size 4 --accum 4

The batches are dicts with `input_ids`, `attention_mask` and per-token `labels` (-100 on padding).
`compute_loss` is the only hook overridden: it returns the loss *sum* over the labelled tokens and
their count, which the loop counts the same way before the forward passes (labels that are not -100),
so accumulation is exact however many tokens each micro-batch holds. Evaluation runs the same
`compute_loss`, keeps the logits the tagger produced on the way, and scores them against the labels:
token accuracy and macro F1 over the tags, beside the loss.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from looptrain import Loop, LoopConfig

TAGS = ["O", "B-PER", "I-PER", "B-LOC"]
# Some words are a first name or a place depending on context: "jordan hopper" is a person, "in jordan" a place.
AMBIGUOUS = ["jordan", "florence", "austin", "georgia", "victoria", "sydney"]
FIRST_NAMES = ["ada", "alan", "grace", "edsger", "barbara", "donald", "ken", "dennis", *AMBIGUOUS]
LAST_NAMES = ["lovelace", "turing", "hopper", "dijkstra", "liskov", "knuth", "thompson", "ritchie"]
PLACES = ["paris", "london", "zurich", "boston", "kyoto", "lagos", "lima", "oslo", *AMBIGUOUS]
FILLER = ["the", "a", "met", "visited", "said", "that", "today", "and", "wrote", "code", "went", "lives"]
PREPOSITIONS = ["in", "to", "from", "near"]


def sentence(rng: random.Random) -> tuple[list[str], list[str]]:
    """A random sentence of filler words, full names (B-PER I-PER) and places after a preposition (B-LOC)."""
    words, tags = [], []
    for _ in range(rng.randint(3, 9)):
        kind = rng.random()
        if kind < 0.2:
            words += [rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)]
            tags += ["B-PER", "I-PER"]
        elif kind < 0.4:
            words += [rng.choice(PREPOSITIONS), rng.choice(PLACES)]
            tags += ["O", "B-LOC"]
        else:
            words.append(rng.choice(FILLER))
            tags.append("O")
    return words, tags


def synthetic_data(num_train: int, num_eval: int, seed: int) -> tuple[list, list, dict]:
    """Train and eval sentences (words, tags), and the vocabulary (word -> id, 0 for padding)."""
    rng = random.Random(seed)
    samples = [sentence(rng) for _ in range(num_train + num_eval)]
    words = sorted(set(FIRST_NAMES + LAST_NAMES + PLACES + FILLER + PREPOSITIONS))
    vocabulary = {"[PAD]": 0, **{word: index for index, word in enumerate(words, 1)}}
    return samples[:num_train], samples[num_train:], vocabulary


def batches_of(samples: list, vocabulary: dict, batch_size: int) -> list[dict]:
    """Dict batches padded to their longest sentence; padded positions get label -100 and mask 0."""
    batches = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        width = max(len(words) for words, _ in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention_mask = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (words, tags) in enumerate(chunk):
            input_ids[row, :len(words)] = torch.tensor([vocabulary[word] for word in words])
            attention_mask[row, :len(words)] = 1
            labels[row, :len(words)] = torch.tensor([TAGS.index(tag) for tag in tags])
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return batches


class Tagger(nn.Module):
    """Embeddings, a small bidirectional transformer encoder, one linear layer of tag scores per token."""

    def __init__(self, vocab_size: int, num_tags: int, width: int = 32, layers: int = 1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width, padding_idx=0)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_tags)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embedding(input_ids), src_key_padding_mask=attention_mask == 0)
        return self.head(hidden)


class TaggingLoop(Loop):
    """The one hook a tagger needs: the cross-entropy summed over labelled tokens, and their count."""

    def compute_loss(self, batch):
        logits = self.wrapped_model(batch["input_ids"], batch["attention_mask"])
        labels = batch["labels"]
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return loss_sum, (labels != -100).sum()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-sentences", type=int, default=800)
    parser.add_argument("--eval-sentences", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    train, evaluation, vocabulary = synthetic_data(args.train_sentences, args.eval_sentences, args.seed)
    torch.manual_seed(args.seed)
    model = Tagger(len(vocabulary), len(TAGS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    config = LoopConfig(epochs=args.epochs, accum_steps=args.accum, metric_for_best="f1", output_dir=args.output_dir,
                        log_every=10, seed=args.seed, device="cpu")
    loop = TaggingLoop(model, optimizer, batches_of(train, vocabulary, args.batch_size),
                       eval_loader=batches_of(evaluation, vocabulary, 64), config=config)
    summary = loop.fit()
    scores = summary["final_eval"]
    print(f"token accuracy {scores['accuracy']:.3f}, macro F1 over {len(TAGS)} tags {scores['f1']:.3f} "
          f"({scores['count']} tokens) after {summary['optimizer_steps']} updates")
    return summary


if __name__ == "__main__":
    main()

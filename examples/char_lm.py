#!/usr/bin/env python
"""A nanoGPT-style character-level language model, trained by a `Loop` subclass that overrides one hook.

    python examples/char_lm.py                     # a few hundred updates on the CPU, about a minute
    python examples/char_lm.py --steps 50 --accum 4 --precision bf16 --grad-checkpoint

Batches are `(x, y)` pairs of character ids, `y` being `x` shifted by one. `compute_loss` is the only
hook overridden: the loop counts the items of each window (the targets, `y`'s elements) before the
forward passes, so accumulation is exact over tokens; evaluation runs the same `compute_loss` and
reports the loss and its perplexity; gradient checkpointing finds the model's `blocks`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from looptrain import Loop, LoopConfig

TEXT = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to
do: once or twice she had peeped into the book her sister was reading, but it had no pictures or
conversations in it, and what is the use of a book, thought Alice, without pictures or conversations?
So she was considering in her own mind, as well as she could, for the hot day made her feel very
sleepy and stupid, whether the pleasure of making a daisy-chain would be worth the trouble of getting
up and picking the daisies, when suddenly a White Rabbit with pink eyes ran close by her.
There was nothing so very remarkable in that; nor did Alice think it so very much out of the way to
hear the Rabbit say to itself, Oh dear! Oh dear! I shall be late! But when the Rabbit actually took a
watch out of its waistcoat-pocket, and looked at it, and then hurried on, Alice started to her feet,
for it flashed across her mind that she had never before seen a rabbit with either a waistcoat-pocket,
or a watch to take out of it, and burning with curiosity, she ran across the field after it, and
fortunately was just in time to see it pop down a large rabbit-hole under the hedge.
"""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        query, key, value = self.qkv(self.attention_norm(hidden)).split(width, dim=-1)
        query, key, value = (part.view(batch, length, self.heads, -1).transpose(1, 2) for part in (query, key, value))
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        hidden = hidden + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return hidden + self.mlp(self.mlp_norm(hidden))


class CharGPT(nn.Module):
    """Token and position embeddings, a stack of `blocks`, a final norm and a linear head."""

    def __init__(self, vocab_size: int, context: int, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        hidden = self.token_embedding(ids) + self.position_embedding(positions)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


class CharLMLoop(Loop):
    """The one hook a language model needs: the mean next-character cross-entropy of a batch."""

    def compute_loss(self, batch):
        inputs, targets = batch
        logits = self.wrapped_model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def windows_of(ids: torch.Tensor, context: int, count: int, generator: torch.Generator) -> list:
    """`count` random (x, y) pairs of `context` characters, y shifted by one."""
    starts = torch.randint(0, len(ids) - context - 1, (count,), generator=generator)
    return [(ids[start:start + context], ids[start + 1:start + context + 1]) for start in starts.tolist()]


def batched(pairs: list, batch_size: int) -> list:
    return [tuple(torch.stack(column) for column in zip(*pairs[start:start + batch_size]))
            for start in range(0, len(pairs), batch_size)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer updates")
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch (sequences)")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per update")
    parser.add_argument("--context", type=int, default=64, help="characters per sequence")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "auto"))
    parser.add_argument("--grad-checkpoint", action="store_true")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    characters = sorted(set(TEXT))
    ids = torch.tensor([characters.index(character) for character in TEXT])
    split = int(0.9 * len(ids))
    generator = torch.Generator().manual_seed(args.seed)
    train_pairs = windows_of(ids[:split], args.context, args.steps * args.batch_size * args.accum, generator)
    eval_pairs = windows_of(ids[split - args.context:], args.context, 32, generator)
    torch.manual_seed(args.seed)
    model = CharGPT(len(characters), args.context, width=args.width, layers=args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    config = LoopConfig(accum_steps=args.accum, precision=args.precision, gradient_checkpointing=args.grad_checkpoint,
                        max_steps=args.steps, eval_every=max(args.steps // 3, 1), log_every=max(args.steps // 10, 1),
                        metric_for_best="perplexity", output_dir=args.output_dir, seed=args.seed, device="cpu")
    loop = CharLMLoop(model, optimizer, batched(train_pairs, args.batch_size),
                      eval_loader=batched(eval_pairs, args.batch_size), config=config)
    summary = loop.fit()
    print(f"{len(characters)} characters (uniform perplexity {len(characters)}): "
          f"eval perplexity {summary['final_eval']['perplexity']:.2f} after {summary['optimizer_steps']} updates "
          f"({math.log(len(characters)):.2f} nats/char at the start, {summary['final_eval']['loss']:.2f} now)")
    return summary


if __name__ == "__main__":
    main()

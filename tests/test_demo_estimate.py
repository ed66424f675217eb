"""A run's reported estimate prices the batches its sampler gives, where it gives them (the `make demo` gap).

Length grouping gives the longest batch first, in the first window, before any optimizer state or
gradient exists. The estimate once priced that batch beside the full optimizer state and gradients, a
moment no run has: -11.3% on the demo (569.6 MB estimated, 505 MB measured, fp32). The tiny run below
has the same shape of data (one long sample, the rest short) with optimizer state large beside the
activations, so the old estimate is off by far more than 10% and the new one is exact.
"""

from __future__ import annotations

import csv
import json
import random

import pytest

from looptrain.cli import finetune
from looptrain.estimation import bounding_windows, estimate, estimate_windows, run_windows

from conftest import WORDS, save_tiny_bert


def test_bounding_windows_keep_the_first_window_and_the_widest_later_shapes():
    windows = [[(8, 98), (8, 15), (8, 32)], [(8, 20), (8, 30), (8, 73)], [(8, 88), (8, 26)], [(8, 12), (8, 40)]]
    # The first window's first micro-batch (no gradients, no optimizer state yet), then the widest of its others
    # (gradients held: (8, 15) holds no more than (8, 32)); later: the widest first-of-window and later shapes.
    assert bounding_windows(windows) == [[(8, 98), (8, 32)], [(8, 88), (8, 73)]]
    # A window cut into token micro-batches: its pieces that no other covers.
    pieces = [[(1, 256), (1, 250), (1, 256), (2, 120), (2, 128), (4, 60)]]
    assert bounding_windows(pieces) == [[(1, 256), (1, 256), (2, 128), (4, 60)]]
    # Shapes that neither covers in both rows and width each get a window: (5, 90) is wider than (8, 88).
    assert bounding_windows([[(8, 10)], [(8, 88)], [(5, 90)]]) == [[(8, 10)], [(5, 90)], [(8, 88)]]
    # A resumed run has optimizer state from its first window on: every window counts, driven twice.
    assert bounding_windows(windows, fresh=False) == [[(8, 98), (8, 73)], [(8, 98), (8, 73)]]
    assert bounding_windows([[(4, 7), (4, 9)]]) == [[(4, 7), (4, 9)]]


@pytest.fixture(scope="module")
def wide_vocab_model_dir(tmp_path_factory):
    """A tiny BERT whose embedding table (2000 x 32) makes its AdamW state weigh like the demo's."""
    return save_tiny_bert(tmp_path_factory.mktemp("wide-vocab-bert"), vocab_size=2000)


def write_one_long_sample_csv(path):
    """47 samples of 3-9 tokens and one of 62: the demo's corpus in small (a long tail, one outlier)."""
    generator = random.Random(0)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for index in range(48):
            count = 60 if index == 17 else generator.randint(1, 7)
            writer.writerow([" ".join(generator.choice(WORDS) for _ in range(count)), generator.choice(["pos", "neg"])])
    return path


def test_a_length_grouped_run_estimates_the_batches_it_sees(wide_vocab_model_dir, tmp_path):
    data = write_one_long_sample_csv(tmp_path / "train.csv")
    args = ["--model", str(wide_vocab_model_dir), "--data", str(data), "--output-dir", str(tmp_path / "run"),
            "--precision", "fp32", "--batch-size", "8", "--accum", "2", "--group-by-length", "--max-length", "64",
            "--no-progress-bar", "--log-every", "1000", "--device", "cpu"]  # the CPU's kernels, as estimated below
    assert finetune.main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())

    # The sampler's own batches: 48 samples, 6 batches of 8, 3 windows of 2. The 62-token sample's batch is
    # the first one (length grouping gives the longest first), before any gradient or optimizer state exists.
    from looptrain import data as data_module

    tokenizer = data_module.load_tokenizer(str(wide_vocab_model_dir))
    train_set = data_module.tokenize(finetune.load_data(finetune.build_parser().parse_args(args))[0], tokenizer, 64)
    collator = data_module.DynamicPaddingCollator(tokenizer, max_length=64)
    loader = data_module.make_train_loader(train_set, 8, collator, grouping="length", seed=42)
    windows = run_windows(loader.batch_sampler, train_set.lengths, collator, accum_steps=2)
    assert windows == [[(8, 62), (8, 3)], [(8, 6), (8, 7)], [(8, 8), (8, 9)]]
    assert bounding_windows(windows) == [[(8, 62), (8, 3)], [(8, 8), (8, 9)]]

    # The run's estimate is of exactly those windows, and it and the tracker describe the same run: within
    # 0.1% (the batches' own bytes). The old estimate, 8 x 62 beside the optimizer state and the gradients,
    # was 31% above the measured peak.
    windows_estimate = estimate_windows(str(wide_vocab_model_dir), bounding_windows(windows), accum_steps=2,
                                        num_labels=2)["peak_memory_bytes"]
    assert summary["estimated_peak_bytes"] == windows_estimate
    assert summary["memory_meter"] == "cpu_tensor_tracker"
    assert abs(summary["estimate_error"]) <= 0.001
    worst_batch = estimate(str(wide_vocab_model_dir), 8, 62, accum_steps=2, num_labels=2)["peak_memory_bytes"]
    assert (summary["peak_memory_bytes"] - worst_batch) / worst_batch < -0.25


def test_a_first_window_of_many_micro_batches_is_priced_by_its_widest(wide_vocab_model_dir):
    """The first window's dominated micro-batches hold no more than its widest beside the same gradients: its
    estimate over all of them and over `bounding_windows`' few differ by the dropped micro-batches' own input
    tensors (the Loop holds a window's batches through it), a few bytes a token."""
    window = [(1, 40), (2, 20), (1, 38), (1, 40), (2, 18), (4, 10), (3, 9), (4, 10)]
    reduced = bounding_windows([window])
    assert reduced == [[(1, 40), (1, 40), (2, 20), (4, 10)]]
    whole, few = (estimate_windows(str(wide_vocab_model_dir), windows, accum_steps=len(window), num_labels=2)
                  for windows in ([window], reduced))
    dropped = [(1, 38), (2, 18), (3, 9), (4, 10)]
    # int64 input_ids, attention_mask and token_type_ids a token, an int64 label a row
    dropped_inputs = sum(3 * 8 * rows * width + 8 * rows for rows, width in dropped)
    assert 0 <= whole["peak_memory_bytes"] - few["peak_memory_bytes"] <= dropped_inputs

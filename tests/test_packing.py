"""--packing: best-fit decreasing packs, no token attending across a sample, and a packed run equal to the unpacked one.

The references are hand-written: the packs of a small case worked out by hand, each sample's logits run alone, and a
full-batch loop over the same samples per window (the model's own mean over its shifted labels: the sum of token
losses over the number of scored tokens).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_causal_lm import FAMILIES, PAD, collate, lm_samples, make_causal_lm, max_difference

from looptrain import Loop
from looptrain.batches import samples_and_tokens
from looptrain.data import DataError, DynamicPaddingCollator, TokenizedDataset
from looptrain.data.packing import BatchPackingCollator, PackedCollator, PackedDataset, pack_best_fit, packing_problem

from conftest import quiet_config

# fp32 sums taken in another order (a packed row's matmuls and softmax over more, masked, columns) differ by a few
# ulps of the logits' size (~1): 1e-5 bounds that noise, four orders below what a leak across samples changes.
LOGIT_TOLERANCE = 1e-5


def test_best_fit_decreasing_packs_worked_by_hand():
    # Longest first: 8 opens pack 0 (room 2), 6 pack 1 (room 4), 5 pack 2 (room 5); 4 fits pack 1 best (room 4 -> 0);
    # 3 only fits pack 2 (room 5 -> 2); 2 fits pack 0 and pack 2 alike (room 2): the first of them, pack 0.
    assert pack_best_fit([5, 3, 8, 2, 6, 4], 10) == [[2, 3], [4, 5], [0, 1]]
    assert pack_best_fit([], 10) == []
    with pytest.raises(DataError, match="a sample of 11 tokens does not fit a pack of 10"):
        pack_best_fit([3, 11], 10)


def samples_dataset(samples) -> TokenizedDataset:
    return TokenizedDataset([ids.tolist() for ids, _ in samples], None, [labels.tolist() for _, labels in samples],
                            max_length=32)


def test_a_pack_concatenates_its_samples_with_their_first_labels_ignored_and_positions_restarting():
    dataset = TokenizedDataset([[5, 6, 7], [8, 9], [10, 11, 12, 13]], None,
                               [[5, 6, 7], [-100, 9], [-100, -100, 12, 13]], max_length=6)
    packed = PackedDataset(dataset, 6)
    assert packed.packs == [[2, 1], [0]] and packed.lengths.tolist() == [6, 3]
    assert packed[0] == {"input_ids": [10, 11, 12, 13, 8, 9], "labels": [-100, -100, 12, 13, -100, 9],
                         "position_ids": [0, 1, 2, 3, 0, 1]}
    batch = PackedCollator(PAD, 6)([packed[0], packed[1]])
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: the positions make the mask
    assert batch["input_ids"][1].tolist() == [5, 6, 7, PAD, PAD, PAD]
    assert batch["labels"][1].tolist() == [-100, 6, 7, -100, -100, -100]
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 0, 1, 2]  # the padding: a run of its own
    assert "attention_mask" in PackedCollator(PAD, 6)([dataset[0], dataset[1]])  # unpacked items: padded as usual
    with pytest.raises(DataError, match="one label per sample: drop --packing"):
        PackedDataset(TokenizedDataset([[5, 6]], None, [1]), 6)


def test_a_packed_batch_counts_its_samples_and_their_tokens_not_its_rows_and_padding():
    # Samples of 5, 3, 8, 2, 6 and 4 tokens in rows of 10 (packs worked out by hand above): rows of 10, 10 and 8
    # tokens. Six samples, 28 tokens, whatever padding the rows get: none in the two full rows (each ending in a
    # short sample: 2 and 4 tokens), 2 tokens at width 10; 6, 6 and 8 at width 16.
    lengths = [5, 3, 8, 2, 6, 4]
    ids = [list(range(3, 3 + length)) for length in lengths]
    labels = [[-100] * (length - 2) + row[-2:] if index % 2 else row for index, (length, row) in
              enumerate(zip(lengths, ids))]  # every other sample scores only its last 2 tokens (a masked prompt)
    packed = PackedDataset(TokenizedDataset(ids, None, labels, max_length=10), 10)
    for width, multiple in ((10, None), (16, 16)):
        batch = PackedCollator(PAD, width, pad_to_multiple_of=multiple)([packed[index] for index in range(3)])
        assert batch["input_ids"].shape == (3, width)
        assert samples_and_tokens(batch) == (6, 28)
    features = [{"input_ids": row, "labels": row} for row in ids]  # a batch packed by itself (--batch-packing on)
    assert samples_and_tokens(BatchPackingCollator(DynamicPaddingCollator(PAD, max_length=10))(features)) == (6, 28)
    # Unpacked batches count as they did: rows and the mask's ones; rows and every id without a mask.
    unpacked = DynamicPaddingCollator(PAD, max_length=10)(features)
    assert unpacked["input_ids"].shape == (6, 8) and samples_and_tokens(unpacked) == (6, 28)
    whole = {"input_ids": unpacked["input_ids"], "labels": unpacked["input_ids"],
             "position_ids": torch.arange(8).repeat(6, 1)}  # positions from 0 in every row, no mask: 6 whole rows
    assert samples_and_tokens(whole) == (6, 48)
    assert samples_and_tokens((unpacked["input_ids"], unpacked["input_ids"])) == (6, 48)


def packed_model(family: str):
    model = make_causal_lm(family)
    assert packing_problem(model) is None and model.config.use_cache is False
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_sample_of_a_packed_batch_gets_the_logits_and_losses_it_gets_alone(family):
    samples = lm_samples(12, seed=3)
    packed = PackedDataset(samples_dataset(samples), 32)
    model = packed_model(family)
    with torch.no_grad():
        for pad in (PAD, 7):  # what the padding holds changes no real token: none attends to it
            batch = PackedCollator(pad, 32)([packed[index] for index in range(len(packed))])
            logits = model(**{key: batch[key] for key in ("input_ids", "position_ids")}).logits
            for row, pack in enumerate(packed.packs):
                start = 0
                for sample in pack:
                    ids, labels = samples[sample]
                    alone = model(input_ids=ids[None]).logits[0]
                    mine = logits[row, start:start + len(ids)]
                    assert (mine - alone).abs().max().item() < LOGIT_TOLERANCE
                    loss_alone = F.cross_entropy(alone[:-1], labels[1:], reduction="sum")
                    loss_packed = F.cross_entropy(mine[:-1], batch["labels"][row, start + 1:start + len(ids)],
                                                  reduction="sum")
                    assert loss_packed.item() == pytest.approx(loss_alone.item(), rel=1e-5)
                    start += len(ids)


def test_the_check_can_fail_a_cache_hides_the_packing_and_alibi_cannot_honour_it():
    model = make_causal_lm("qwen2").eval()  # config.use_cache True: transformers then ignores packed positions
    ids, positions = torch.tensor([[11, 12, 13, 14]]), torch.tensor([[0, 1, 0, 1]])
    with torch.no_grad():
        leaked = model(input_ids=ids, position_ids=positions).logits[0, 2:] - model(input_ids=ids[:, 2:]).logits[0]
    assert leaked.abs().max().item() > 1e-3
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=100, hidden_size=32, n_layer=1, n_head=4))
    assert packing_problem(bloom) == ("--packing restarts position_ids at every sample, and BloomForCausalLM takes no "
                                      "position_ids: drop --packing")


def windows_of(packed: PackedDataset, rows: int, accum: int):
    """Micro-batches of `rows` packs in order, and the samples of each window of `accum` of them."""
    batches = [PackedCollator(PAD, packed.max_length)([packed[index] for index in range(start, start + rows)])
               for start in range(0, len(packed), rows)]
    window_packs = rows * accum
    windows = [[sample for pack in packed.packs[start:start + window_packs] for sample in pack]
               for start in range(0, len(packed), window_packs)]
    return batches, windows


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_run_equals_the_full_batch_loop_over_the_same_samples_per_window(family):
    # 40 samples of 3-23 tokens (every other one with a prompt masked) in rows of 32: micro-batches of 2 rows,
    # accumulation 2, the last window shorter. The reference takes each window's samples unpacked, as one padded
    # batch, and steps on the model's mean over its scored tokens.
    samples = lm_samples(40, seed=1)
    packed = PackedDataset(samples_dataset(samples), 32)
    batches, windows = windows_of(packed, rows=2, accum=2)
    model = make_causal_lm(family)
    assert packing_problem(model) is None
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=1.0), batches,
                config=quiet_config(accum_steps=2, epochs=1, max_grad_norm=None))
    summary = loop.fit()
    # The summary counts the samples and their tokens: 40 samples, not the 18 rows; no padding among the tokens.
    assert len(packed) == 18 and summary["train_samples"] == len(samples) == 40
    assert summary["train_tokens"] == sum(len(ids) for ids, _ in samples) == 557
    reference = make_causal_lm(family)
    optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    for window in windows:
        reference(**collate([samples[index] for index in window])).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert loop.step == len(windows)
    assert max_difference(reference, make_causal_lm(family)) > 1e-2  # the check can fail: training moved them
    assert max_difference(reference, model) < 1e-6


@pytest.mark.slow
def test_ddp_packs_per_rank_and_equals_the_full_batch_loop(tmp_path):
    # 2 ranks, one pack a micro-batch, accumulation 2: a window is 2 packs of each rank, as looptrain's sampler
    # gives them out. The reference steps once per window on all 4 packs' samples, unpacked, as one batch.
    from looptrain.data import make_train_loader

    from conftest import run_two_ranks

    saved = run_two_ranks("packing_ddp.py", ["qwen2", "40"], tmp_path / "ddp.pt")
    samples = lm_samples(40, seed=1)
    packed = PackedDataset(samples_dataset(samples), 32)
    per_rank = [make_train_loader(packed, 1, PackedCollator(PAD, 32), seed=0, num_replicas=2, rank=rank)
                .batch_sampler.epoch_batches() for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    reference = make_causal_lm("qwen2")
    optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    for start in range(0, len(per_rank[0]), 2):
        window = [sample for batches in per_rank for batch in batches[start:start + 2] for pack in batch
                  for sample in packed.packs[pack]]
        reference(**collate([samples[index] for index in window])).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert saved["step"] == -(-len(per_rank[0]) // 2)
    difference = max((value - saved["state_dict"][name]).abs().max().item()
                     for name, value in reference.state_dict().items())
    assert max_difference(reference, make_causal_lm("qwen2")) > 1e-2
    assert difference < 1e-6


def test_the_estimate_prices_a_packed_rows_mask_even_for_a_single_row():
    # One row of 32 tokens: whole, the model builds no mask (sdpa's causal path); packed, it builds the row's block
    # mask from its positions, and attends through it. The estimate of the packed row is the higher one.
    from transformers import LlamaConfig

    from looptrain import Strategy
    from looptrain.estimation import estimate

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    peaks = {packing: estimate(config, 1, 32, Strategy(optimizer="sgd", packing=packing),
                               cache=False)["peak_memory_bytes"] for packing in (False, True)}
    assert peaks[True] > peaks[False]

"""--batch-packing: each batch's samples packed among themselves, the planner's packing lever.

A batch-packed run holds every update's samples as the unpacked run holds them, so its weights equal a hand-written
full-batch loop over the same windows (the model's own mean over the window's scored tokens), and the planner may
choose it as a lever that keeps the math.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_causal_lm import PAD, collate, make_causal_lm, max_difference

from looptrain import Loop, Strategy
from looptrain.batches import split_by_tokens
from looptrain.data import DynamicPaddingCollator, TokenizedDataset, make_train_loader
from looptrain.data.packing import BatchPackingCollator, packing_problem
from looptrain.estimation.windows import run_windows

from conftest import quiet_config

MAX_LENGTH = 32
# SGD at lr 1.0 over a few windows carries fp32's rounding into the weights: the unpacked Loop over the same windows
# differs from the hand-written loop by up to ~7e-6 on this data; a token scored wrongly moves them by ~1e-2.
WEIGHT_TOLERANCE = 2e-5


def skewed_samples(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) rows: most 3-6 tokens, one in eight 24-32; every other one with a prompt masked."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        low, high = (24, 33) if index % 8 == 3 else (3, 7)
        length = int(torch.randint(low, high, (1,), generator=generator))
        input_ids = torch.randint(3, 100, (length,), generator=generator)
        labels = input_ids.clone()
        if index % 2 == 0:
            labels[:int(torch.randint(1, length - 1, (1,), generator=generator))] = -100
        samples.append((input_ids, labels))
    return samples


def dataset_of(samples) -> TokenizedDataset:
    return TokenizedDataset([ids.tolist() for ids, _ in samples], None, [labels.tolist() for _, labels in samples],
                            max_length=MAX_LENGTH)


def reference_run(family: str, samples, windows) -> torch.nn.Module:
    """SGD at lr 1.0, one step per window on its samples unpacked, as one padded batch (the model's own mean)."""
    model = make_causal_lm(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for window in windows:
        model(**collate([samples[index] for index in window])).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def packed_run(family: str, dataset, settings: Strategy) -> tuple[torch.nn.Module, list[list[int]], dict]:
    """`settings` trained by the Loop on batch-packed batches; returns the model, the windows' samples and the run's
    summary."""
    model = make_causal_lm(family)
    assert packing_problem(model) is None
    collator = BatchPackingCollator(DynamicPaddingCollator(PAD, max_length=MAX_LENGTH))
    loader = make_train_loader(dataset, settings.batch_size, collator, seed=0)
    windows = [[index for batch in loader.batch_sampler.epoch_batches(0)[start:start + settings.accum_steps]
                for index in batch] for start in range(0, len(loader), settings.accum_steps)]
    config = quiet_config(**{**settings.loop_fields(), "epochs": 1, "max_grad_norm": None, "chunked_ce": "auto"})
    summary = Loop(model, torch.optim.SGD(model.parameters(), lr=1.0), loader, config=config).fit()
    return model, windows, summary


def test_a_packed_batch_is_cut_into_rows_without_its_padding():
    collator = BatchPackingCollator(DynamicPaddingCollator(PAD, max_length=6))
    features = [{"input_ids": ids, "labels": ids} for ids in ([5, 6, 7, 8], [9, 10], [11, 12, 13])]
    batch = collator(features)  # rows: [5 6 7 8 9 10], [11 12 13] padded to 6
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert collator.row_lengths([4, 2, 3]) == [6, 3]
    first, second = split_by_tokens(batch, 6)
    assert first["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert second["input_ids"].tolist() == [[11, 12, 13]]  # the padding's columns dropped
    assert second["labels"].tolist() == [[-100, 12, 13]] and second["position_ids"].tolist() == [[0, 1, 2]]


def test_a_batch_packed_run_equals_the_unpacked_full_batch_loop_over_the_same_windows():
    # 32 skewed samples, windows of 8 (one batch each), its rows cut into micro-batches of at most 2 x 32 tokens.
    samples = skewed_samples(32, seed=1)
    settings = Strategy(batch_size=8, accum_steps=1, micro_batch_tokens=2 * MAX_LENGTH, batch_packing="on")
    model, windows, summary = packed_run("llama", dataset_of(samples), settings)
    reference = reference_run("llama", samples, windows)
    # The summary counts samples and their tokens, as the unpacked run does: not packed rows, not their padding.
    assert sorted(index for window in windows for index in window) == list(range(32))
    assert summary["train_samples"] == 32 and summary["train_tokens"] == sum(len(ids) for ids, _ in samples)
    # The shapes the run's own estimate prices are the micro-batches the Loop ran.
    collator = BatchPackingCollator(DynamicPaddingCollator(PAD, max_length=MAX_LENGTH))
    loader = make_train_loader(dataset_of(samples), 8, collator, seed=0)
    windows_priced = run_windows(loader.batch_sampler, loader.dataset.lengths, collator, 1,
                                 micro_batch_tokens=2 * MAX_LENGTH)
    assert windows_priced == [[tuple(piece["input_ids"].shape) for piece in split_by_tokens(batch, 2 * MAX_LENGTH)]
                              for batch in loader]
    assert max_difference(reference, make_causal_lm("llama")) > 1e-2  # the check can fail: training moved them
    assert max_difference(reference, model) < WEIGHT_TOLERANCE


def plan_skewed(base: Strategy, fixed: tuple[str, ...]):
    from looptrain.planning import plan

    samples = skewed_samples(32, seed=2)
    dataset = dataset_of(samples)
    model = make_causal_lm("qwen2")
    result = plan(model, dataset, DynamicPaddingCollator(PAD, max_length=MAX_LENGTH), memory_budget=2**30,
                  effective_batch=8, base=base, probe=False, meter="tensors", seed=0,
                  fixed=("batch_size", "gradient_checkpointing", "checkpoint_every", "optimizer_in_backward", *fixed))
    return result, samples, dataset


def test_the_plan_packs_skewed_batches_and_its_run_equals_the_unpacked_run():
    # Windows of 8 samples, most 3-6 tokens and one 24-32: padded, a window is 8 rows as wide as its longest; packed,
    # 2 rows. The plan chooses packing, and the run it plans equals the unpacked full-batch loop.
    base = Strategy(batch_size=8, accum_steps=1, optimizer="sgd")
    result, samples, dataset = plan_skewed(base, ())
    winner = result.winner.settings
    assert winner.batch_packing == "on" and any(c.settings.batch_packing == "auto" for c in result.candidates)
    packed = next(c for c in result.candidates if c.settings.batch_packing == "on")
    plain = next(c for c in result.candidates if c.settings.batch_packing == "auto")
    assert packed.padded_tokens < plain.padded_tokens / 2
    assert "batches packed" in result.table() and "--batch-packing on" in " ".join(winner.flags())
    settings = dataclasses.replace(winner, optimizer="sgd")
    model, windows, _ = packed_run("qwen2", dataset, settings)
    assert max_difference(reference_run("qwen2", samples, windows), model) < WEIGHT_TOLERANCE


def test_the_plan_never_packs_where_packing_is_fixed_off():
    result, _, _ = plan_skewed(Strategy(batch_size=8, accum_steps=1, optimizer="sgd", batch_packing="off"),
                               ("batch_packing",))
    assert {candidate.settings.batch_packing for candidate in result.candidates} == {"off"}


@pytest.mark.slow  # probes train for real: the suite's time is kept for the plan's choice above
def test_a_packed_candidate_is_probed_on_the_widest_packed_rows():
    # Packed, the probe's worst batch is the widest rows the run's windows pack into (the unpacked worst batch is the
    # longest samples, padded): its width is the widest packed row's, worked out here with pack_best_fit per window.
    from looptrain.data.packing import pack_best_fit
    from looptrain.planning import plan

    samples = skewed_samples(32, seed=2)
    dataset = dataset_of(samples)
    collator = DynamicPaddingCollator(PAD, max_length=MAX_LENGTH)
    result = plan(make_causal_lm("qwen2"), dataset, collator, memory_budget=2**30, effective_batch=8,
                  base=Strategy(batch_size=8, accum_steps=1, optimizer="sgd"), meter="tensors", seed=0,
                  probe_budget=600,  # planning's time never cuts the search short on a loaded host
                  fixed=("batch_size", "gradient_checkpointing", "checkpoint_every", "optimizer_in_backward"))
    windows = make_train_loader(dataset, 8, collator, seed=0).batch_sampler.epoch_batches(0)
    rows = sorted((sum(dataset.lengths[window[index]] for index in pack) for window in windows
                   for pack in pack_best_fit([dataset.lengths[index] for index in window], MAX_LENGTH)), reverse=True)
    packed = next(candidate for candidate in result.candidates if candidate.settings.batch_packing == "on")
    assert packed.probed and packed.probe["batch_shape"] == [min(8, len(rows)), rows[0]]
    plain = next(candidate for candidate in result.candidates if candidate.settings.batch_packing == "auto")
    assert plain.probe["batch_shape"] == [8, max(dataset.lengths)]

"""Token micro-batches (`micro_batch_tokens`): a batch cut by padded tokens, exact against a full-batch step; the
planner's token cut within its split's memory; the heap trimmed before each micro-batch (`trim_heap`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from looptrain import Loop, LoopConfig, estimation
from looptrain.batches import split_by_tokens, token_pieces
from looptrain.config import ConfigError, check_process_group
from looptrain.estimation import run_windows
from looptrain.memory import allocator
from looptrain.planning import PlanError, by_tokens, plan, probes
from looptrain.strategy import Strategy

from conftest import make_tiny_bert, make_tiny_tokenizer, quiet_config, random_token_batches, write_csv

LENGTHS = [3, 17, 5, 9, 12, 4, 20, 7]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """64 short samples (3-13 words) and the collator, max_length 32."""
    from looptrain import data

    tokenizer = make_tiny_tokenizer()
    texts = data.read_classification_data(write_csv(tmp_path_factory.mktemp("tokens") / "train.csv", 64))
    return data.tokenize(texts, tokenizer, 32), data.DynamicPaddingCollator(tokenizer, max_length=32)


def test_rows_are_cut_longest_first_into_pieces_within_the_tokens():
    # Sorted: 20, 17, 12, 9, 7, 5, 4, 3. Budget 40: [20] (2 x 20 = 40 fits: [20, 17]), [12, 9, 7] (3 x 12 = 36),
    # [5, 4, 3] (3 x 5 = 15; a fourth row would make 20, but there is none).
    pieces = token_pieces(LENGTHS, 40)
    assert [[LENGTHS[row] for row in piece] for piece in pieces] == [[20, 17], [12, 9, 7], [5, 4, 3]]
    assert token_pieces(LENGTHS, 19)[0] == [6]  # a row wider than the budget is a piece of its own
    assert sorted(row for piece in token_pieces(LENGTHS, 1) for row in piece) == list(range(8))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_pieces(LENGTHS, 0)


def test_a_batch_is_cut_into_trimmed_pieces_holding_every_row_once():
    (batch,) = random_token_batches([LENGTHS], vocab_size=30, seed=1)
    pieces = split_by_tokens(batch, 40)
    assert [tuple(piece["input_ids"].shape) for piece in pieces] == [(2, 20), (3, 12), (3, 5)]
    rows = {}
    for piece in pieces:
        assert piece["input_ids"].numel() <= 40
        for ids, mask, label in zip(piece["input_ids"], piece["attention_mask"], piece["labels"]):
            length = int(mask.sum())
            rows[tuple(ids[:length].tolist())] = int(label)
    original = {tuple(batch["input_ids"][row, :length].tolist()): int(batch["labels"][row])
                for row, length in enumerate(LENGTHS)}
    assert rows == original
    # Fixed-width padding keeps the width; a batch that is one piece of its own width comes back as it is.
    assert {piece["input_ids"].shape[1] for piece in split_by_tokens(batch, 40, trim=False)} == {20}
    assert split_by_tokens(batch, 8 * 20)[0] is batch
    # The collator's rounding is kept.
    assert [piece["input_ids"].shape[1] for piece in split_by_tokens(batch, 48, multiple=8)] == [20, 16, 8]


def test_a_left_padded_batch_keeps_its_width_and_a_batch_without_token_ids_is_refused():
    (batch,) = random_token_batches([[4, 2, 3]], vocab_size=30)
    left = {key: value.flip(-1) if value.dim() == 2 else value for key, value in batch.items()}
    assert {piece["input_ids"].shape[1] for piece in split_by_tokens(left, 4)} == {4}
    # A mask with a zero inside a row: the row runs to its last real token, and nothing real is cut off.
    holes = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1],
                                                                                       [1, 0, 0, 0]])}
    assert [piece["input_ids"].tolist() for piece in split_by_tokens(holes, 4)] == [[[4, 5, 6, 7]], [[0, 1, 2]], [[8]]]
    with pytest.raises(ValueError, match="micro_batch_tokens cuts dict batches with a 2-D `input_ids`"):
        split_by_tokens({"x": torch.ones(4, 3)}, 4)


def full_batch_reference(batches: list[dict], lr: float) -> torch.nn.Module:
    """Plain PyTorch: one forward and backward of each whole batch (mean loss), one SGD step per batch."""
    model = make_tiny_bert(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("tokens", [pytest.param(40, marks=pytest.mark.slow), 19,
                                    pytest.param(1, marks=pytest.mark.slow)])
def test_token_micro_batches_train_the_weights_a_full_batch_step_trains(tokens):
    batches = random_token_batches([LENGTHS, [6, 2, 11, 8, 3, 9, 1, 5]], vocab_size=30, seed=3)
    reference = full_batch_reference(batches, lr=0.5)
    model = make_tiny_bert(seed=0)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.5), batches,
                config=quiet_config(micro_batch_tokens=tokens, max_grad_norm=None))
    loop.fit()
    assert loop.step == 2
    assert loop.micro_step == sum(len(token_pieces(b["attention_mask"].sum(1).tolist(), tokens)) for b in batches)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_token_micro_batches_refuse_the_fused_step_and_several_processes():
    with pytest.raises(ConfigError, match="micro_batch_tokens cuts a batch into micro-batches that accumulate, which "
                                          "optimizer_in_backward=True cannot do"):
        LoopConfig(micro_batch_tokens=64, optimizer_in_backward=True)
    with pytest.raises(ConfigError, match="micro_batch_tokens cannot run with several processes"):
        check_process_group(LoopConfig(micro_batch_tokens=64), 2, sharded=False)


def test_the_estimate_of_a_token_cut_batch_is_that_of_its_pieces():
    model = make_tiny_bert(num_labels=2)
    cut = estimation.estimate(model, 16, 24, Strategy(batch_size=16, accum_steps=1, micro_batch_tokens=4 * 24))
    split = estimation.estimate(model, 4, 24, Strategy(batch_size=4, accum_steps=4))
    assert cut["peak_memory_bytes"] == split["peak_memory_bytes"]
    whole = estimation.estimate(model, 16, 24, Strategy(batch_size=16, accum_steps=1))
    assert whole["peak_memory_bytes"] > split["peak_memory_bytes"]


def test_the_planner_cuts_its_splits_by_tokens_within_their_memory_and_keeps_the_users_flags(dataset):
    train_set, collator = dataset
    width = collator.batch_width([max(train_set.lengths)])
    model = make_tiny_bert(num_labels=2)
    budget = int(1.05 * estimation.estimate(model, 4, width, accum_steps=4)["peak_memory_bytes"]) + 1
    mine = Strategy(batch_size=2, accum_steps=8)
    result = plan(model, train_set, collator, memory_budget=budget, effective_batch=16, baseline=mine, probe=False)
    for candidate in result.candidates:
        settings = candidate.settings
        if candidate.baseline:  # the user's flags train as given
            assert settings == mine
            continue
        assert (settings.batch_size, settings.accum_steps) == (16, 1)
        rows = settings.micro_batch_tokens // width
        assert rows * width == settings.micro_batch_tokens and 16 % rows == 0
        # Its estimate is its split's at the worst width, which fits the budget.
        split = dataclasses.replace(settings, batch_size=rows, accum_steps=16 // rows, micro_batch_tokens=0)
        assert candidate.estimated_peak_bytes == estimation.estimate(model, rows, width, split)["peak_memory_bytes"]
        assert candidate.estimated_peak_bytes * (1 + result.margin) <= budget
        # Its predicted work is the run's cut: every micro-batch within the tokens, every sample once.
        loader = planning_loader(train_set, collator, settings)
        shapes = [shape for window in run_windows(loader.batch_sampler, train_set.lengths, collator, 1,
                                                  micro_batch_tokens=settings.micro_batch_tokens)
                  for shape in window]
        assert all(r * w <= settings.micro_batch_tokens or r == 1 for r, w in shapes)
        assert sum(r for r, _ in shapes) == len(train_set.lengths)
        assert candidate.padded_tokens == sum(r * w for r, w in shapes)
    assert any(not c.baseline for c in result.candidates)
    assert "cut into micro-batches of at most (micro-batch x the worst width) padded tokens" in "\n".join(result.notes)
    # Several processes must run the same micro-batches: the splits stay as they are.
    uncut = plan(model, train_set, collator, memory_budget=budget, effective_batch=16, baseline=mine, probe=False,
                 token_micro_batches=False)
    assert all(not c.settings.micro_batch_tokens for c in uncut.candidates)
    with pytest.raises(PlanError, match="the planner chooses the micro-batches' tokens itself"):
        plan(model, train_set, collator, memory_budget=budget, effective_batch=16, probe=False,
             base=Strategy(batch_size=16, accum_steps=1, micro_batch_tokens=64))


def planning_loader(train_set, collator, settings):
    from looptrain import data

    return data.make_train_loader(train_set, settings.batch_size, collator,
                                  grouping="length" if settings.group_by_length else "random", seed=42)


def test_by_tokens_leaves_what_it_cannot_cut_as_it_is():
    for settings in (Strategy(batch_size=16, accum_steps=1),
                     Strategy(batch_size=4, accum_steps=4, padding="max_length"),
                     Strategy(batch_size=16, accum_steps=1, optimizer_in_backward=True),
                     Strategy(batch_size=4, accum_steps=4, compile=True)):
        assert by_tokens(settings, 32) == settings
    assert by_tokens(Strategy(batch_size=4, accum_steps=4), 32) == Strategy(batch_size=16, accum_steps=1,
                                                                           micro_batch_tokens=128)


def test_trim_heap_gives_the_freed_pages_back_before_every_micro_batch_and_every_step(monkeypatch):
    events = []
    monkeypatch.setattr(allocator, "release_freed", lambda: events.append("trim") or True)
    batches = random_token_batches([LENGTHS, LENGTHS], vocab_size=30)
    model = make_tiny_bert(seed=0)
    model.register_forward_pre_hook(lambda module, args: events.append("forward"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda *args: events.append("step"))
    loop = Loop(model, optimizer, batches, config=quiet_config(trim_heap=True, micro_batch_tokens=40))
    loop.fit()
    assert loop.micro_step == 6 and loop.step == 2
    # Each window of 3 micro-batches: trimmed before each forward, and before the step (the backward's freed pages are
    # not resident beside the step's temporaries).
    assert events == ["trim", "forward"] * 3 + ["trim", "step"] + ["trim", "forward"] * 3 + ["trim", "step"]
    monkeypatch.undo()
    assert allocator.release_freed() == (allocator._glibc() is not None)  # trims where the C library is glibc


@pytest.mark.slow  # a whole command-line run (7 s); .ci/run runs it
def test_the_command_line_trains_in_token_micro_batches(model_dir, tmp_path):
    import json

    from looptrain.cli import finetune

    train = write_csv(tmp_path / "train.csv", 24)
    output_dir = tmp_path / "run"
    assert finetune.main(["--model", str(model_dir), "--data", str(train), "--output-dir", str(output_dir),
                          "--max-length", "32", "--no-progress-bar", "--eval-split", "0", "--batch-size", "12",
                          "--micro-batch-tokens", "32", "--trim-heap", "--no-track-memory"]) == 0
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == 2  # 24 samples, 12 per update, however they were cut
    assert summary["config"]["micro_batch_tokens"] == 32 and summary["config"]["trim_heap"] is True


@pytest.mark.slow  # about 5 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_a_split_whose_probe_measures_over_the_budget_is_replaced_by_the_next_smaller_one(dataset, monkeypatch,
                                                                                          tmp_path):
    """The estimate may fit where the process's RSS does not: the probe rejects the split, and the next smaller
    split of the same settings is costed and probed at once (budget or not), instead of leaving only the lightest."""
    from looptrain.planning import rss_baseline_bytes

    train_set, collator = dataset
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    probed_rows = []

    def probe(model, settings, batch, device, max_grad_norm, meter=None, ceiling=None, step_bytes=0, typical=None):
        rows, width = batch["input_ids"].shape
        probed_rows.append(rows)
        # Per token, more rows are faster (sublinear), so the largest split that fits wins.
        return {"micro_step_seconds": 1e-3 * rows ** 0.5 * width, "optimizer_step_seconds": 0.0, "probe_seconds": 0.01,
                "tokens": rows * width, "batch_shape": [rows, width],
                "measured_peak_bytes": (100 + 12 * rows) * 2**20}  # 16 rows: 292 MiB, over; 8 rows: 196 MiB

    monkeypatch.setattr(probes, "probe", probe)
    result = plan(make_tiny_bert(num_labels=2), train_set, collator, memory_budget=300 * 2**20, effective_batch=16,
                  rss_baseline=rss_baseline_bytes(), base=Strategy(batch_size=2, accum_steps=8, group_by_length=True))
    assert 16 in probed_rows and 8 in probed_rows
    assert all(candidate.probe["batch_shape"][0] <= 8 for candidate in result.candidates)
    width = result.worst_width
    assert result.winner.settings.micro_batch_tokens == 8 * width  # the 8-row split, cut by tokens
    assert result.winner.probe["batch_shape"] == [8, width]


@pytest.mark.slow  # about 5 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_no_probe_runs_past_what_fits_its_ceiling_stops_it(dataset, monkeypatch, tmp_path):
    """Each probe under a measured meter gets a ceiling: the most it may measure and still fit. The first, whose
    growth is a quarter of what its own measure holds besides its estimate: (budget / (1 + margin) + estimate / 4)
    / 1.25; every later one budget / (1 + margin) less the growth. A probe that passes it stops (as `measure_probe`
    does), counts as over the budget, and the next smaller split stands in."""
    from looptrain.planning import plans, rss_baseline_bytes

    train_set, collator = dataset
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    mib, budget = 2**20, 300 * 2**20
    ceilings = []

    def probe(model, settings, batch, device, max_grad_norm, meter=None, ceiling=None, step_bytes=0, typical=None):
        rows, width = batch["input_ids"].shape
        ceilings.append((rows, ceiling))
        peak = (100 + 12 * rows) * mib  # 16 rows: 292 MiB, past every ceiling; 8 rows: 196 MiB
        if ceiling is not None and peak > ceiling:
            return {"stopped": True, "ceiling": ceiling, "measured_peak_bytes": ceiling + mib, "probe_seconds": 0.01,
                    "tokens": rows * width, "batch_shape": [rows, width]}
        return {"micro_step_seconds": 1e-3 * rows ** 0.5 * width, "optimizer_step_seconds": 0.0, "probe_seconds": 0.01,
                "tokens": rows * width, "batch_shape": [rows, width], "measured_peak_bytes": peak}

    monkeypatch.setattr(probes, "probe", probe)
    lines = []
    result = plan(make_tiny_bert(num_labels=2), train_set, collator, memory_budget=budget, effective_batch=16,
                  rss_baseline=rss_baseline_bytes(), base=Strategy(batch_size=2, accum_steps=8, group_by_length=True),
                  echo=lines.append)
    fitting = int(budget / (1 + plans.DEFAULT_MARGIN["cpu"]))
    first = next(candidate for candidate in result.candidates if candidate.baseline)
    within = budget / (1 + plans.DEFAULT_MARGIN["cpu"])
    assert ceilings[0] == (2, int((within + first.estimated_peak_bytes / 4) / 1.25))  # its growth from its measure
    assert result.growth_bytes > 0 and all(ceiling == fitting - result.growth_bytes for _, ceiling in ceilings[1:])
    assert (16, fitting - result.growth_bytes) in ceilings and 8 in [rows for rows, _ in ceilings]
    assert any("probe 16 x 1" in line and "stopped past" in line and "over the budget" in line for line in lines)
    assert all(candidate.probe["batch_shape"][0] <= 8 and not candidate.probe.get("stopped")
               for candidate in result.candidates)
    assert result.winner.probe["batch_shape"] == [8, result.worst_width]



@pytest.mark.slow  # real probes of two kernel settings
def test_the_first_probe_of_each_kernel_setting_times_the_runs_mean_micro_batch(dataset, monkeypatch, tmp_path):
    """Each candidate knows its epoch's micro-batch of mean work (`typical_shape`); the first probe of settings that
    run the same kernels is handed a real batch of that shape to time (cut from the longest samples, every token
    real), and the other splits of those settings reuse its line of costs, probed for their memory and steps alone."""
    from looptrain import data
    from looptrain.flops import count_model_flops
    from looptrain.planning import ranking, timing

    train_set, collator = dataset
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ranking, "PRIOR_OPTIMISM", 0.0)  # probe every candidate
    handed = []

    def probe(model, settings, batch, device, max_grad_norm, meter=None, ceiling=None, step_bytes=0, typical=None):
        rows, width = batch["input_ids"].shape
        handed.append((settings, typical))
        timed = {"micro_step_seconds": 1e-3 * rows * width, "optimizer_step_seconds": 0.0, "probe_seconds": 0.01,
                 "tokens": rows * width, "batch_shape": [rows, width]}
        if settings.accum_steps > 1:  # a window of micro-batches times the warm-up's second run (one update: not)
            timed |= {"small_step_seconds": 1e-3 * rows * 16, "small_batch_shape": [rows, 16]}
        if typical is not None:
            assert bool(typical["attention_mask"].all())
            shape = list(typical["input_ids"].shape)
            timed |= {"typical_step_seconds": 1e-3 * shape[0] * shape[1], "typical_batch_shape": shape}
        return timed

    monkeypatch.setattr(probes, "probe", probe)
    model = make_tiny_bert(num_labels=2)
    result = plan(model, train_set, collator, memory_budget=2**30, effective_batch=16,
                  base=Strategy(batch_size=2, accum_steps=8, group_by_length=True), probe_budget=60.0)
    assert len(handed) >= 2 and all(candidate.probed for candidate in result.candidates)
    first_settings, first_typical = handed[0]
    first = next(c for c in result.candidates if timing.same_kernels(c.settings, first_settings) and c.baseline)
    flops = count_model_flops(model)
    shapes = [shape for window in run_windows(data.make_train_loader(
        train_set, first.settings.batch_size, collator, grouping="length", seed=42).batch_sampler,
        list(train_set.lengths), collator, first.settings.accum_steps,
        micro_batch_tokens=first.settings.micro_batch_tokens) for shape in window]
    mean = sum(flops.per_batch(*shape) for shape in shapes) / len(shapes)
    typical = min(shapes, key=lambda shape: (abs(flops.per_batch(*shape) - mean), shape))
    assert first.typical_shape == typical and list(first_typical["input_ids"].shape) == list(typical)
    # A typical batch for every probe but those of settings whose line an earlier probe drew (small and typical
    # micro-batches timed: a window of micro-batches; a probe of one micro-batch an update times the typical alone).
    reused = 0
    for index, (settings, typical) in enumerate(handed):
        lines = [other for other, given in handed[:index] if given is not None and other.accum_steps > 1]
        reused += any(timing.same_kernels(settings, other) for other in lines)
        assert (typical is None) == any(timing.same_kernels(settings, other) for other in lines)
    assert reused  # a split priced by the line of an earlier probe of the same kernels

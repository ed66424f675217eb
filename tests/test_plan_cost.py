"""What planning costs: probes of a deep model on a truncated stack of its blocks, scaled to the whole (docs/plan.md,
'What planning costs')."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch
from torch import nn

from looptrain.planning import probes
from looptrain.planning.truncation import Truncation, truncated, truncation_for
from looptrain.strategy import Strategy

from conftest import settled_rss_meter

BLOCKS = 16
SHALLOW = 8
# A whole probe that drew a line: the small micro-batch (16 tokens) and a typical one (256), and a step of 0.5 s.
WHOLE_PROBE = {"small_step_seconds": 0.2, "small_batch_shape": [1, 16], "typical_step_seconds": 1.2,
               "typical_batch_shape": [1, 256], "micro_step_seconds": 4.0, "optimizer_step_seconds": 0.5,
               "probe_seconds": 9.0, "tokens": 1000, "batch_shape": [1, 1000]}


def tiny_decoder(blocks: int = BLOCKS) -> nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=blocks,
                         num_attention_heads=2, num_key_value_heads=1, use_cache=False, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config)


def token_batch(rows: int, width: int) -> dict:
    ids = torch.randint(2, 64, (rows, width), generator=torch.Generator().manual_seed(rows * width))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.fixture
def work_clock(monkeypatch):
    """`time.perf_counter` made a clock of work: each module's forward (a checkpointed block's recompute included)
    advances it by its own parameters times its input's rows, each optimizer step by the parameters it steps (from
    inside the step, where the probe's step marks time it). A truncated probe scaled right then predicts the whole
    probe's seconds exactly."""
    now = [0.0]

    def forward(module, args):
        rows = args[0].shape[:-1].numel() if args and isinstance(args[0], torch.Tensor) else 1
        now[0] += sum(parameter.numel() for parameter in module.parameters(recurse=False)) * rows * 1e-9

    def step(optimizer):
        now[0] += sum(p.numel() for group in optimizer.param_groups for p in group["params"]) * 1e-9

    hook = nn.modules.module.register_module_forward_pre_hook(forward)
    monkeypatch.setattr(torch.optim.Optimizer, "_accelerator_graph_capture_health_check", step)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    yield
    hook.remove()


@pytest.mark.slow  # two probes of an 8-block decoder each: 2-5 s on 2 shared cores
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_truncated_probe_scaled_to_the_whole_stack_predicts_the_whole_probe(work_clock, checkpointing):
    model = tiny_decoder(SHALLOW)  # any stack: the planner truncates only 16 blocks or more, the probe any
    settings = Strategy(batch_size=2, accum_steps=4, gradient_checkpointing=checkpointing, optimizer="adamw")
    batch, typical = token_batch(2, 40), token_batch(2, 24)
    whole = probes.measure_probe(model, settings, batch, "cpu", 1.0, typical=typical)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    part = probes.measure_probe(model, settings, batch, "cpu", 1.0, typical=typical, truncation=Truncation(2, SHALLOW))
    assert part["truncated"] == {"depth": 2, "blocks": SHALLOW, "shift_bytes": 0}
    for key in ("micro_step_seconds", "small_step_seconds", "typical_step_seconds", "optimizer_step_seconds"):
        assert part[key] == pytest.approx(whole[key], rel=1e-6), key
    # The probe's own cost: 2 blocks' work and the head's, not 8 blocks'.
    assert part["probe_seconds"] < 0.5 * whole["probe_seconds"]
    # The blocks are back, in order, and the weights unchanged.
    assert len(model.model.layers) == SHALLOW
    assert [name for name, _ in model.named_parameters()] == list(dict(model.named_parameters()))
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())


def test_a_probe_that_samples_its_heads_tiles_predicts_the_probe_of_every_tile(monkeypatch):
    """On a clock of matmul work (each ``F.linear`` advances it by its rows times its output features), a probe whose
    head computes a sample of its vocabulary tiles (every 8th after the first two, `probes.HEAD_TILE_EVERY`) times
    every micro-batch as the probe of every tile does, and leaves the weights as they were (no skipped row of a
    gradient holds garbage: the learning rate is 0)."""
    import torch.nn.functional as F

    from looptrain import lm_loss

    now = [0.0]
    linear = F.linear

    def timed_linear(input, weight, bias=None):
        now[0] += input.shape[:-1].numel() * weight.shape[0] * 1e-9
        return linear(input, weight, bias)

    monkeypatch.setattr(F, "linear", timed_linear)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(lm_loss, "MIN_TILE_ROWS", 16)  # 4 tokens a logit row of 256: tiles of 16 rows
    model = tiny_decoder(2)
    settings = Strategy(batch_size=2, accum_steps=4, ce_chunk_tokens=4, optimizer="adamw")
    batch, typical = token_batch(2, 40), token_batch(2, 24)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    monkeypatch.setattr(probes, "HEAD_TILE_EVERY", 1)
    every = probes.measure_probe(model, settings, batch, "cpu", 1.0, typical=typical)
    monkeypatch.setattr(probes, "HEAD_TILE_EVERY", 8)
    sampled = probes.measure_probe(model, settings, batch, "cpu", 1.0, typical=typical)
    assert sampled["head_tiles_sampled"] == 8 and "head_tiles_sampled" not in every
    for key in ("micro_step_seconds", "small_step_seconds", "typical_step_seconds"):
        assert sampled[key] == pytest.approx(every[key], rel=1e-9), key
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.slow  # two probes under the RSS meter, each settling the process (collections, a trimmed heap)
def test_a_truncated_probes_peak_and_ceiling_move_by_the_estimates_difference(monkeypatch):
    """Under a measured meter, the truncated probe's peak is the whole stack's: what it measured plus what the
    estimator priced between the two stacks (less the set-aside weights it held); its ceiling is lowered by as
    much."""
    model = tiny_decoder(SHALLOW)
    settings = Strategy(batch_size=1, accum_steps=2, optimizer="adamw")
    meter = settled_rss_meter()
    shift = 64 * 2**20
    probed = probes.measure_probe(model, settings, token_batch(1, 24), "cpu", 1.0, meter,
                                  truncation=Truncation(2, SHALLOW, shift))
    # Less the set-aside blocks' weights, which the process holds while the probe runs (and the shift prices too).
    aside = sum(p.numel() * p.element_size() for block in model.model.layers[2:] for p in block.parameters())
    assert probed["measured_peak_bytes"] >= shift - aside
    # A ceiling the truncated stack's own peak stays under, but not with the shift: the probe stops.
    ceiling = probed["measured_peak_bytes"] - shift // 2
    stopped = probes.measure_probe(model, settings, token_batch(1, 24), "cpu", 1.0, meter, ceiling,
                                   truncation=Truncation(2, SHALLOW, shift))
    assert stopped["stopped"] and stopped["ceiling"] == ceiling and stopped["measured_peak_bytes"] > ceiling
    assert len(model.model.layers) == SHALLOW


@pytest.mark.slow  # two probes under the RSS meter of a 16-block model, each settling the process
def test_a_truncated_probes_peak_does_not_depend_on_whether_the_set_aside_weights_were_read_before(tmp_path):
    """A model loaded from a memory-mapped file holds a weight's pages only once read: the truncated probe reads the
    set-aside blocks' weights in and takes them off the shift, so its peak is the same either way (left unread and
    added by the shift, they were counted once; read before, twice)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=BLOCKS, num_attention_heads=2,
        num_key_value_heads=1, use_cache=False, tie_word_embeddings=True))
    aside = [p for block in model.model.layers[3:] for p in block.parameters()]
    aside_bytes = sum(p.numel() * p.element_size() for p in aside)
    settings = Strategy(batch_size=1, accum_steps=2, optimizer="sgd")
    meter = settled_rss_meter()
    truncation = Truncation(3, BLOCKS, aside_bytes + 2**20)  # the estimate's difference prices the weights too

    def peak() -> int:
        return probes.measure_probe(model, settings, token_batch(1, 24), "cpu", None, meter,
                                    truncation=truncation)["measured_peak_bytes"]

    weights = tmp_path / "weights"  # the set-aside weights mapped from a file, as safetensors loads them: unread
    weights.write_bytes(b"")
    with weights.open("r+b") as file:
        file.truncate(aside_bytes)
    mapped = torch.from_file(str(weights), shared=False, size=aside_bytes // 4, dtype=torch.float32)
    offset = 0
    for parameter in aside:
        parameter.data = mapped[offset:offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()
    unread = peak()
    mapped.normal_()  # every page read and written: held
    read = peak()
    assert aside_bytes > 40 * 2**20
    assert abs(read - unread) < aside_bytes / 4, (read, unread, aside_bytes)


def test_only_a_deep_stack_whose_estimate_priced_truncated_depths_is_probed_truncated():
    estimate = {"peak_memory_bytes": 1000, "depth_peak_bytes": {"2": 300, "3": 350, "4": 400}}
    assert truncation_for(tiny_decoder(), estimate) == Truncation(3, BLOCKS, 650)
    assert truncation_for(tiny_decoder(), estimate, predicted_shift=700) == Truncation(3, BLOCKS, 700)
    assert truncation_for(tiny_decoder(), {"peak_memory_bytes": 1000}) is None  # estimated whole
    assert truncation_for(tiny_decoder(BLOCKS - 1), estimate) is None  # too shallow
    frozen = tiny_decoder()
    frozen.model.embed_tokens.weight.requires_grad_(False)
    assert truncation_for(frozen, estimate) is None  # the first block's input has no gradient to time
    model = tiny_decoder()
    with truncated(model, 3) as blocks:
        assert len(blocks) == 3 and len(model.model.layers) == 3
    assert len(model.model.layers) == BLOCKS


@pytest.mark.slow  # a whole plan with estimates of a 16-block model: over 10 s on 2 cores
def test_a_plan_of_a_deep_model_probes_a_truncated_stack_and_cuts_what_its_time_cannot_pay_for(monkeypatch, tmp_path):
    from test_estimate_causal_lm import CausalLMCollator, TokenDataset

    from looptrain import lm_loss
    from looptrain.planning import plan

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lm_loss, "MIN_TILE_ROWS", 16)  # 4 tokens a logit row of 256 (below): tiles of 16 rows
    # Every probe after the first predicted past planning's time left.
    monkeypatch.setattr("looptrain.planning.ranking.predicted_probe_seconds", lambda *args: float("inf"))
    model = tiny_decoder()
    dataset, collator = TokenDataset(32), CausalLMCollator(0, max_length=48)
    # Rows of one length: every candidate's typical micro-batch is its worst one cut to no narrower, so a probe cut
    # to what it decides always has a micro-batch to time (whatever the search's favourite is).
    dataset.input_ids = [ids + [7] * (40 - len(ids)) for ids in dataset.input_ids]
    dataset.lengths = [len(ids) for ids in dataset.input_ids]
    result = plan(model, dataset, collator, memory_budget=2**30, effective_batch=8,
                  base=Strategy(batch_size=1, accum_steps=8, gradient_checkpointing=True, ce_chunk_tokens=4),
                  probe_budget=60)
    print(result.table())
    probed = [c for c in result.candidates if c.probed]
    baseline = next(c for c in probed if c.baseline)
    assert baseline.probe["truncated"]["depth"] == 3 and baseline.probe["truncated"]["blocks"] == BLOCKS
    assert any(re.search(r"ran 3 of the model's 16 identical blocks and were scaled", note) for note in result.notes)
    assert baseline.probe["head_tiles_sampled"] == probes.HEAD_TILE_EVERY == 8
    assert any(re.search(r"computed their head's first two vocabulary tiles and one in every 8 after", note)
               for note in result.notes)
    # Planning's time is spent before the search's favourite: the estimate decides every candidate's memory (the
    # tensors meter), so it is priced by the line of the baseline's kernels, or timed without its worst batch.
    cut = [c for c in probed if c.probe.get("memory") == "decided by the estimate"]
    assert cut and all(not c.baseline for c in cut)
    assert any(note.startswith(("not probed: ", "probed without the worst batch: ")) for note in result.notes)
    assert len(model.model.layers) == BLOCKS


def test_the_estimate_decides_the_memory_only_with_room_for_what_the_process_holds_besides_twice():
    from looptrain.planning.budget import Budget

    assert Budget(100, 0.0).decides(10**6)  # the tensors meter: the estimate is the verdict
    assert not Budget(1000, 0.0, "rss").decides(100)  # nothing measured besides tensors yet
    measured = Budget(1000, 0.0, "rss", overhead=300, growth=60)
    assert measured.within(500) and not measured.decides(500)  # 500 + 300 fits; 500 + 2 x 300 does not
    assert measured.decides(400)


def test_a_cut_probe_is_priced_by_the_line_of_a_probe_alike_and_never_stands_for_a_whole_probes_cost():
    from looptrain.flops import ModelFlops
    from looptrain.planning.plans import Candidate
    from looptrain.planning.timing import line_priced, predicted_probe_seconds, record_probe

    flops = ModelFlops(1e6, 0.0)
    alike = Candidate(Strategy(batch_size=1, accum_steps=8), 100, micro_batches=48, flops=48 * 2.56e8, updates=6)
    record_probe(alike, dict(WHOLE_PROBE), flops)
    other = Candidate(Strategy(batch_size=2, accum_steps=4), 200, micro_batches=24, flops=48 * 2.56e8, updates=6)
    priced = line_priced(alike, flops)
    assert priced["line_only"] and priced["optimizer_step_seconds"] == 0.5 and priced["probe_seconds"] == 0.0
    record_probe(other, priced, flops, alike.probe)
    # The line: 0.2 s = fixed + 16 rows' work, 1.2 s = fixed + 256 rows' work (per FLOP: 1 s / 240e6 FLOPs).
    per_flop = 1.0 / (240 * 1e6)
    fixed = 0.2 - per_flop * 16e6
    assert other.seconds_per_epoch == pytest.approx(fixed * 24 + per_flop * 48 * 2.56e8 + 0.5 * 6)
    assert line_priced(other, None) is None  # no FLOPs counted: only a probe prices it
    # A probe's cost is predicted from whole probes only.
    third = Candidate(Strategy(batch_size=2, accum_steps=4, gradient_checkpointing=True), 150)
    assert predicted_probe_seconds(third, [other]) == 0.0
    assert predicted_probe_seconds(third, [other, alike]) == pytest.approx(9.0 * 2 * 1.35)


def test_a_fused_steps_cut_probe_is_priced_by_the_line_of_its_settings_stepped_after_backward(monkeypatch):
    """Where planning's time cannot pay for a probe, a candidate that steps inside backward is priced by the line of
    the same settings stepping after it (the same forward and backward, the same per-parameter optimizer work, timed
    as that probe's step), and nothing runs; a whole probe is never priced so (its line would leave out the step)."""
    from looptrain.flops import ModelFlops
    from looptrain.planning.budget import Budget
    from looptrain.planning.plans import Candidate
    from looptrain.planning.ranking import Prober
    from looptrain.planning.timing import record_probe, steps_alike

    after = Strategy(batch_size=1, accum_steps=8, gradient_checkpointing=True)
    fused = Strategy(batch_size=8, accum_steps=1, gradient_checkpointing=True, optimizer_in_backward=True)
    assert steps_alike(fused, after) and not steps_alike(after, fused)
    assert not steps_alike(dataclasses.replace(fused, gradient_checkpointing=False), after)
    flops = ModelFlops(1e6, 0.0)
    baseline = Candidate(after, 100, micro_batches=48, flops=48 * 2.56e8, updates=6)
    record_probe(baseline, dict(WHOLE_PROBE), flops)
    probed = []
    monkeypatch.setattr(probes, "probe", lambda *args, **options: probed.append(options) or dict(WHOLE_PROBE))
    priced = {}
    for seconds_left, runs in ((0.0, 0), (None, 1)):
        candidate = priced[seconds_left] = Candidate(fused, 100, micro_batches=6, flops=48 * 2.56e8, updates=6)
        Prober(None, None, None, [0] * 8, "cpu", 1.0, None, Budget(2**30, 0.0), flops,
               seconds_left=seconds_left, batches={8: {}}).probe(candidate, [baseline, candidate])
        assert len(probed) == runs
    # The line: fixed 0.2 - 16e6 / 240e6 s a micro-batch, 1 s per 240e6 FLOPs; the step, the baseline's, 6 times.
    cut = priced[0.0]
    assert cut.probe["line_only"] and cut.probe["probe_seconds"] == 0.0
    assert cut.seconds_per_epoch == pytest.approx((0.2 - 16e6 / 240e6) * 6 + 48 * 2.56e8 / 240e6 + 0.5 * 6)


def test_a_typical_micro_batch_wider_than_the_longest_rows_but_one_is_the_longest_row_repeated():
    from test_estimate_causal_lm import CausalLMCollator, TokenDataset

    from looptrain.planning.plans import Candidate
    from looptrain.planning.timing import typical_batch

    dataset, collator = TokenDataset(32), CausalLMCollator(0, max_length=48)  # one sample of 40 tokens, the rest < 20
    order = sorted(range(len(dataset.lengths)), key=lambda index: -dataset.lengths[index])
    batch = typical_batch(Candidate(Strategy(batch_size=4), 0, typical_shape=(4, 30)), dataset, collator, order)
    assert batch["input_ids"].tolist() == [dataset.input_ids[5][:30]] * 4
    assert batch["attention_mask"].all()
    # Rows long enough: the longest rows themselves, cut to the width.
    batch = typical_batch(Candidate(Strategy(batch_size=2), 0, typical_shape=(2, 12)), dataset, collator, order)
    assert batch["input_ids"].tolist() == [dataset.input_ids[index][:12] for index in order[:2]]
    assert typical_batch(Candidate(Strategy(batch_size=2), 0, typical_shape=(2, 41)), dataset, collator, order) is None

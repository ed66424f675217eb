"""bf16 weights: unbiased stochastic rounding, fp32 steps one tensor at a time, and proof that it learns."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from looptrain import ConfigError, Loop, build_optimizer, optimizer_state_bytes
from looptrain.optim import BF16Optimizer, OptimizerInBackward, cast_to_bf16, gradient_of, stochastic_round_

from conftest import SmallMLP, make_tiny_bert, mlp_batches, quiet_config, task_batches

BF16 = torch.bfloat16


def bf16_neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each fp32 value (truncation, and one ulp up)."""
    low = (values.view(torch.int32) & -65536).view(torch.float32)  # drop the low 16 bits: toward zero
    ulp = (low.view(torch.int32) + 65536).view(torch.float32) - low
    return torch.minimum(low, low + ulp), torch.maximum(low, low + ulp)


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    torch.manual_seed(0)
    values = torch.cat([torch.randn(200) * 0.05, torch.randn(50) * 30, torch.tensor([0.05 + 2e-5, -1.9999, 255.99])])
    draws = 4000
    target = torch.empty(draws, values.numel(), dtype=BF16)
    stochastic_round_(target, values.expand(draws, -1).contiguous())
    rounded = target.float()
    low, high = bf16_neighbours(values)
    assert ((rounded == low) | (rounded == high)).all()
    # E[round(x)] = x: the mean of the draws is within 5 standard errors of the value, element by element.
    standard_error = (high - low) / 2 / draws**0.5
    assert ((rounded.mean(0) - values).abs() <= 5 * standard_error + 1e-12).all()
    exact = values.to(BF16)  # values bf16 can hold are never moved
    again = torch.empty_like(exact)
    stochastic_round_(again, exact.float())
    assert torch.equal(again, exact)


def test_small_updates_vanish_when_rounding_to_nearest_and_survive_stochastically():
    # lr 2e-5 on a weight of 0.05: a bf16 there has neighbours 2.4e-4 apart.
    torch.manual_seed(0)
    nearest = torch.full((10_000,), 0.05, dtype=BF16)
    stochastic = nearest.clone()
    for _ in range(500):
        nearest.copy_(nearest.float() + 2e-5)
        stochastic_round_(stochastic, stochastic.float() + 2e-5)
    assert torch.equal(nearest, torch.full_like(nearest, 0.05))
    assert stochastic.float().mean().item() == pytest.approx(0.05 + 500 * 2e-5, rel=2e-3)


def test_weights_stay_bf16_in_place_and_the_state_is_fp32():
    model = SmallMLP()
    cast_to_bf16(model)
    pointers = [parameter.data_ptr() for parameter in model.parameters()]
    optimizer = BF16Optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for batch in mlp_batches(3):
        inputs = {key: value.to(BF16) if value.is_floating_point() else value for key, value in batch.items()}
        model(**inputs)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [parameter.data_ptr() for parameter in model.parameters()] == pointers
    assert all(parameter.dtype == BF16 and parameter.grad is None for parameter in model.parameters())
    numel = sum(parameter.numel() for parameter in model.parameters())
    assert optimizer_state_bytes(optimizer) == 8 * numel + 4 * 4  # exp_avg + exp_avg_sq in fp32, a step count each
    assert {state["exp_avg"].dtype for state in optimizer.state.values()} == {torch.float32}


def test_clip_grad_norm_reads_fp32_buffers_and_equals_torch_on_the_same_gradients():
    torch.manual_seed(0)
    model = SmallMLP()
    cast_to_bf16(model)
    optimizer = BF16Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_dtype="fp32")
    for batch in mlp_batches(2):
        model(x=batch["x"].to(BF16), labels=batch["labels"])["loss"].backward()
    assert all(parameter.grad is None and parameter.main_grad.dtype == torch.float32
               for parameter in model.parameters())
    reference = [nn.Parameter(parameter.main_grad.clone()) for parameter in model.parameters()]
    for parameter in reference:
        parameter.grad = parameter.detach().clone()
    expected = nn.utils.clip_grad_norm_(reference, 0.01)
    norm = optimizer.clip_grad_norm_(0.01)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for parameter, clipped in zip(model.parameters(), reference):
        torch.testing.assert_close(parameter.main_grad, clipped.grad, rtol=1e-6, atol=0)


def test_fp32_accumulation_sums_each_micro_batch_exactly_and_beats_bf16_sums():
    """grad_dtype="fp32" adds each micro-batch's bf16 gradient into fp32: over 32 micro-batches its window
    gradient is closer to the fp64 reference than bf16 accumulation's (measured, both reported)."""
    batches = [{"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(index)),
                "labels": torch.tensor([0, 1, 2, 0])} for index in range(32)]

    def window_gradient(grad_dtype: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = SmallMLP()
        cast_to_bf16(model)
        BF16Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_dtype=grad_dtype)
        for batch in batches:
            model(x=batch["x"].to(BF16), labels=batch["labels"])["loss"].backward()
        return gradient_of(model.net[0].weight).double()

    torch.manual_seed(0)
    reference_model = SmallMLP()
    cast_to_bf16(reference_model)
    per_batch = []
    for batch in batches:  # each micro-batch's bf16 gradient on its own, summed in fp64
        reference_model.zero_grad()
        reference_model(x=batch["x"].to(BF16), labels=batch["labels"])["loss"].backward()
        per_batch.append(reference_model.net[0].weight.grad.double())
    reference = torch.stack(per_batch).sum(0)
    in_fp32 = window_gradient("fp32")
    in_bf16 = window_gradient("bf16")
    error_fp32 = ((in_fp32 - reference).norm() / reference.norm()).item()
    error_bf16 = ((in_bf16 - reference).norm() / reference.norm()).item()
    assert error_fp32 < 1e-6  # the fp32 sum of 32 bf16 numbers is exact up to fp32 rounding
    assert 1e-4 < error_bf16 < 2e-2  # bf16 rounds at every addition: small, but there
    assert error_fp32 < error_bf16


# ------------------------------------------------------------------ it learns
def held_out_loss(model: nn.Module, batches: list[dict]) -> float:
    model.eval()
    bf16 = next(model.parameters()).dtype == BF16
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=bf16):
        return sum(float(model(**batch).loss) for batch in batches) / len(batches)


@pytest.fixture(scope="module")
def pretrained():
    """A tiny BERT trained part-way in fp32 (lr 1e-3): weights of a pre-trained model's size, loss ~0.2."""
    model = make_tiny_bert(num_labels=3)
    Loop(model, build_optimizer(model, "adamw", 1e-3), task_batches(60, seed=1), config=quiet_config()).fit()
    return model


def fine_tune(pretrained: nn.Module, optimizer: str = "adamw", lr: float = 3e-5, **fields) -> float:
    model = copy.deepcopy(pretrained)
    Loop(model, build_optimizer(model, optimizer, lr, 0.01), task_batches(150, seed=2),
         config=quiet_config(**fields)).fit()
    assert next(model.parameters()).dtype == (BF16 if fields.get("weights") == "bf16" else torch.float32)
    return held_out_loss(model, task_batches(10, seed=99))


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_bf16_weights_with_stochastic_rounding_learn_like_fp32_and_round_to_nearest_stalls(pretrained):
    """Fine-tuning at lr 3e-5, 150 updates of AdamW. Tolerance: bf16 + SR ends within 10% of fp32's
    improvement of the held-out loss; round-to-nearest keeps less than a third of it (measured on this
    task: fp32 0.2020 -> 0.1664, SR 0.1658, nearest 0.2012)."""
    start = held_out_loss(copy.deepcopy(pretrained), task_batches(10, seed=99))
    fp32 = fine_tune(pretrained)
    stochastic = fine_tune(pretrained, weights="bf16")
    nearest = fine_tune(pretrained, weights="bf16", stochastic_rounding=False)
    improvement = start - fp32
    assert improvement > 0.02, (start, fp32)
    assert abs(stochastic - fp32) <= 0.10 * improvement, (start, fp32, stochastic)
    assert start - nearest < improvement / 3, (start, fp32, nearest)


@pytest.mark.parametrize("optimizer, fields", [
    ("adamw8bit", {}),
    ("adafactor", {}),
    ("adamw", {"optimizer_in_backward": True}),
    ("adamw8bit", {"optimizer_in_backward": True}),
    ("adafactor", {"optimizer_in_backward": True, "gradient_checkpointing": True}),
    ("adamw", {"accum_steps": 4}),
    ("adamw", {"accum_steps": 4, "grad_dtype": "fp32"}),
])
@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_every_optimizer_and_mode_learns_with_bf16_weights(pretrained, optimizer, fields):
    """Same task at lr 1e-4 (Adafactor's and 8-bit AdamW's updates differ from AdamW's): bf16 + SR ends
    within 15% of the same optimizer's fp32 improvement."""
    if optimizer == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    start = held_out_loss(copy.deepcopy(pretrained), task_batches(10, seed=99))
    fp32_fields = {key: value for key, value in fields.items() if key != "grad_dtype"}
    fp32 = fine_tune(pretrained, optimizer, lr=1e-4, **fp32_fields)
    bf16 = fine_tune(pretrained, optimizer, lr=1e-4, weights="bf16", **fields)
    assert start - fp32 > 0.01, (start, fp32)
    assert abs(bf16 - fp32) <= 0.15 * (start - fp32), (start, fp32, bf16)


# ------------------------------------------------------------------ the Loop's side
def test_loop_casts_wraps_and_reports_bf16(tmp_path):
    model = make_tiny_bert()
    loop = Loop(model, build_optimizer(model, "adamw", 1e-3), task_batches(4, seed=0),
                config=quiet_config(weights="bf16", track_memory=True, output_dir=str(tmp_path), eval_every=4))
    assert isinstance(loop.optimizer, BF16Optimizer) and loop.precision.name == "bf16"
    summary = loop.fit()
    numel = sum(parameter.numel() for parameter in model.parameters())
    assert summary["precision"] == "bf16" and summary["config"]["weights"] == "bf16"
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    assert summary["memory_breakdown"]["params"] == 2 * numel + buffers  # the tracker counts buffers too
    steps = sum(1 for parameter in model.parameters())  # one fp32 step count per tensor
    assert optimizer_state_bytes(loop.optimizer) == 8 * numel + 4 * steps  # fp32 moments, no master copy
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    assert {tensor.dtype for tensor in saved.values() if tensor.is_floating_point()} == {BF16}


def test_fused_step_with_bf16_weights_steps_in_backward():
    model = make_tiny_bert()
    loop = Loop(model, build_optimizer(model, "adamw", 1e-3), task_batches(3, seed=0),
                config=quiet_config(weights="bf16", optimizer_in_backward=True))
    assert isinstance(loop.optimizer, OptimizerInBackward) and loop.optimizer.bf16_weights
    before = model.classifier.weight.detach().clone()
    loop.fit()
    assert not torch.equal(before, model.classifier.weight) and model.classifier.weight.dtype == BF16
    assert all(parameter.grad is None for parameter in model.parameters())


def test_resume_with_bf16_weights_is_exact(tmp_path):
    """The stochastic rounding draws from torch's RNG, which checkpoints save: a resumed run ends bit for bit
    where the uninterrupted one does."""
    def run(output_dir, **fields):
        model = make_tiny_bert(seed=3)
        Loop(model, build_optimizer(model, "adamw", 1e-3), task_batches(6, seed=0),
             config=quiet_config(weights="bf16", output_dir=str(output_dir), eval_every=3, seed=5, **fields)).fit()
        return model

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    for (name, expected), actual in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(expected, actual), name


@pytest.mark.parametrize("fields, message", [
    ({"weights": "fp16"}, r"weights must be one of fp32, bf16 \(got 'fp16'\)"),
    ({"weights": "bf16", "precision": "fp16"}, r"weights='bf16' computes in bf16 and cannot run fp16 autocast"),
    ({"weights": "bf16", "optimizer_in_backward": True, "grad_dtype": "fp32"},
     r"grad_dtype='fp32' chooses the dtype gradients accumulate in, and optimizer_in_backward=True"),
    ({"stochastic_rounding": False}, r"stochastic_rounding=False only applies with weights='bf16'"),
    ({"grad_dtype": "fp32"}, r"grad_dtype only applies with weights='bf16'"),
    ({"weights": "bf16", "grad_dtype": "fp16"}, r"grad_dtype must be one of bf16, fp32"),
])
def test_invalid_combinations_name_the_fields(fields, message):
    with pytest.raises(ConfigError, match=message):
        quiet_config(**fields)


def test_a_model_cast_by_the_user_keeps_its_fp32_norms():
    """`cast_to_bf16(model, keep_fp32=(nn.LayerNorm,))` before the Loop: the Loop keeps that choice."""
    model = make_tiny_bert()
    kept = cast_to_bf16(model, keep_fp32=(nn.LayerNorm,))
    assert kept and all("LayerNorm" in name for name in kept)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    Loop(model, build_optimizer(model, "adamw", 1e-3), task_batches(3, seed=0),
         config=quiet_config(weights="bf16")).fit()
    for name, parameter in model.named_parameters():
        assert parameter.dtype == (torch.float32 if name in kept else BF16), name
    assert all(not torch.equal(before[name], dict(model.named_parameters())[name]) for name in kept)

"""bf16 weights stepped in row chunks: bitwise the same weights, state and random stream as the whole-tensor
step, and a step transient bounded by a chunk instead of by the largest tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import looptrain.optim.bf16 as bf16
import looptrain.optim.in_backward as in_backward
from looptrain import build_optimizer
from looptrain.memory import StorageTracker
from looptrain.optim import BF16Optimizer, OptimizerInBackward, cast_to_bf16

VOCAB, DIM = 1009, 48  # the tied embedding is 48,432 elements, 16x the next largest tensor
CHUNK = 4000  # forced chunk: 83 rows (3,984 elements) a chunk, 12 full chunks and a last one of 13 rows
WINDOW = 2999  # forced rounding window: windows of random bits straddle the chunks' boundaries


class TiedLM(nn.Module):
    """A language model in miniature: a large tied embedding, one small block, logits from the embedding."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.LayerNorm(DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.block(self.embedding(ids[:, :-1]))
        logits = hidden @ self.embedding.weight.T
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def today_step_in_fp32_(parameter, optimizer, gradient, stochastic_rounding=True):
    """The whole-tensor step as it was before chunking (looptrain 3f8bb02), verbatim but for names: the reference."""
    if parameter.dtype != torch.bfloat16:
        parameter.grad = gradient.to(parameter.dtype)
        optimizer.step()
        parameter.grad = None
        return
    storage = parameter.data
    parameter.data = storage.float()
    parameter.grad = gradient.float()
    try:
        optimizer.step()
        updated = parameter.data
    finally:
        parameter.data = storage
        parameter.grad = None
    if not stochastic_rounding:
        storage.copy_(updated)
        return
    flat_target, flat_value, window = storage.view(-1), updated.contiguous().view(-1), 1 << 22
    for start in range(0, flat_value.numel(), window):
        bits = flat_value[start:start + window].view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
        flat_target[start:start + window].copy_((bits + noise).bitwise_and_(-65536).view(torch.float32))


OPTIMIZERS = {  # name -> (build_optimizer arguments, stepped in chunks)
    "adamw": (("adamw", 1e-2, 0.01), {}, True),
    "sgd": (("sgd", 0.5, 0.01), {"momentum": 0.9}, True),
    "adafactor": (("adafactor", 1e-2, 0.01), {}, False),
    "adamw8bit": (("adamw8bit", 1e-2, 0.01), {}, False),
}
MODES = ("plain", "fused", "grad_fp32")


def train(optimizer_name: str, mode: str, stochastic_rounding: bool = True, steps: int = 3):
    """Three steps from the same start and data; returns the weights, the optimizer state and the chunked steps."""
    arguments, options, _ = OPTIMIZERS[optimizer_name]
    torch.manual_seed(0)
    model = TiedLM()
    cast_to_bf16(model)
    optimizer = build_optimizer(model, *arguments, **options)
    if mode == "fused":
        wrapped = OptimizerInBackward(model, optimizer, bf16_weights=True, stochastic_rounding=stochastic_rounding)
    else:
        wrapped = BF16Optimizer(model, optimizer, stochastic_rounding=stochastic_rounding,
                                grad_dtype="fp32" if mode == "grad_fp32" else "bf16")
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(step))
        model(ids).backward()
        wrapped.step()
        wrapped.zero_grad()
    weights = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    return weights, wrapped.state_dict()["per_parameter"]


def assert_bitwise_equal(expected, actual, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, where
        assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8)) if expected.dim() else \
            torch.equal(expected, actual), where  # bit patterns: -0.0 and NaN payloads count
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), where
        for key in expected:
            assert_bitwise_equal(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (left, right) in enumerate(zip(expected, actual)):
            assert_bitwise_equal(left, right, f"{where}[{index}]")
    else:
        assert expected == actual, where


@pytest.fixture
def chunk_calls(monkeypatch):
    """Counts the chunked steps (one per large tensor per step)."""
    calls = []
    chunked = bf16._step_in_row_chunks_

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return chunked(*args, **kwargs)

    monkeypatch.setattr(bf16, "_step_in_row_chunks_", counting)
    return calls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_chunked_step_is_bitwise_todays_whole_step(optimizer_name, mode, monkeypatch, chunk_calls):
    """Weights and every state tensor after three steps, chunked (forced small chunks and rounding windows)
    against the whole-tensor step of before (the same random stream): equal bit for bit."""
    if optimizer_name == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    with monkeypatch.context() as today:
        today.setattr(bf16, "step_in_fp32_", today_step_in_fp32_)
        today.setattr(in_backward, "step_in_fp32_", today_step_in_fp32_)
        expected = train(optimizer_name, mode)
    assert not chunk_calls
    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", CHUNK)
    monkeypatch.setattr(bf16, "_ROUNDING_WINDOW", WINDOW)
    actual = train(optimizer_name, mode)
    assert_bitwise_equal(expected, actual)
    assert chunk_calls == ([torch.Size([VOCAB, DIM])] * 3 if OPTIMIZERS[optimizer_name][2] else [])


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_chunked_and_whole_steps_of_today_are_bitwise_equal_rounding_to_nearest(optimizer_name, monkeypatch):
    expected = train(optimizer_name, "plain", stochastic_rounding=False)
    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", CHUNK)
    assert_bitwise_equal(expected, train(optimizer_name, "plain", stochastic_rounding=False))


@pytest.mark.parametrize("options", [{"foreach": True}, {"amsgrad": True}, {"fused": True}])
def test_adamw_variants_chunked_equal_whole(options, monkeypatch):
    """foreach and amsgrad chunk bitwise; fused=True steps whole (its CPU kernel rounds a vector's tail apart)."""
    def run():
        torch.manual_seed(0)
        parameter = nn.Parameter(torch.randn(301, 37).to(torch.bfloat16))  # rows and chunks of odd sizes
        optimizer = torch.optim.AdamW([parameter], lr=1e-2, weight_decay=0.1, **options)
        for step in range(3):
            gradient = torch.randn(301, 37, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            bf16.step_in_fp32_(parameter, optimizer, gradient)
        return parameter.detach().clone(), optimizer.state_dict()

    expected = run()
    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", 1111)
    monkeypatch.setattr(bf16, "_ROUNDING_WINDOW", 997)
    assert_bitwise_equal(expected, run())


def test_a_one_dimensional_tensor_steps_in_chunks_of_elements(monkeypatch):
    def run():
        torch.manual_seed(0)
        parameter = nn.Parameter(torch.randn(10_007).to(torch.bfloat16))
        optimizer = torch.optim.SGD([parameter], lr=0.1, momentum=0.9, nesterov=True)
        for step in range(3):
            bf16.step_in_fp32_(parameter, optimizer, torch.randn(10_007, generator=torch.Generator().manual_seed(step)))
        return parameter.detach().clone(), optimizer.state_dict()

    expected = run()
    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", 1000)  # 10 chunks of 1,000 elements and one of 7
    assert_bitwise_equal(expected, run())


def test_the_cpu_generator_draws_the_same_bits_in_pieces_as_at_once():
    """Why any rounding window gives today's stream on CPU (the windows keep it on other devices too)."""
    torch.manual_seed(7)
    whole = torch.randint(0, 1 << 16, (10_000,), dtype=torch.int32)
    torch.manual_seed(7)
    pieces = torch.cat([torch.randint(0, 1 << 16, (size,), dtype=torch.int32) for size in (1, 2_999, 7_000)])
    assert torch.equal(whole, pieces)


def step_transient_bytes(monkeypatch, chunk_elements: int) -> tuple[int, int]:
    """The tracker's peak during an AdamW step (the second: the state exists) above what was live before it."""
    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(bf16, "_ROUNDING_WINDOW", min(chunk_elements, 1 << 22))
    torch.manual_seed(0)
    model = TiedLM()
    cast_to_bf16(model)
    optimizer = BF16Optimizer(model, build_optimizer(model, "adamw", 1e-2, 0.01))
    ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(ids).backward()
        if optimizer.state:
            break
        optimizer.step()
        optimizer.zero_grad()
    tracker = StorageTracker()
    with tracker:
        tracker.classify(model, optimizer)
        tracker.reset_peak()
        before = tracker.current_bytes
        optimizer.step()
    return tracker.peak_bytes - before, model.embedding.weight.numel()


def test_the_step_transient_is_a_chunk_not_the_embedding(monkeypatch):
    """Measured by looptrain's CPU tensor tracker: whole, the embedding's fp32 copies (param, grad, AdamW's
    temporaries, the rounding's bits) set the step's peak; in chunks of 1/12 of it, the peak is a few chunks."""
    whole, numel = step_transient_bytes(monkeypatch, 1 << 30)
    chunked, _ = step_transient_bytes(monkeypatch, CHUNK)
    chunk_bytes = 4 * (CHUNK // DIM) * DIM  # one chunk in fp32
    assert whole >= 4 * 4 * numel, whole  # at least four fp32 copies of the embedding at once
    assert chunked <= 8 * chunk_bytes, (chunked, chunk_bytes)
    assert chunked < whole / 3, (chunked, whole)

"""bf16 weights stepped in row chunks: bitwise the same weights, state and random stream as the whole-tensor
step (AdamW, SGD), the same up to fp32 rounding noise (Adafactor), and a step transient bounded by a chunk
instead of by the largest tensor."""

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
from looptrain.optim.bf16 import _copy_of
from looptrain.optim.factory import build_parameter_groups

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


OPTIMIZERS = {  # name -> (build_optimizer arguments, stepped in chunks bitwise); Adafactor: its own tests below
    "adamw": (("adamw", 1e-2, 0.01), {}, True),
    "sgd": (("sgd", 0.5, 0.01), {"momentum": 0.9}, True),
    "adamw8bit": (("adamw8bit", 1e-2, 0.01), {}, False),
}
MODES = ("plain", "fused", "grad_fp32")


def train(optimizer_name: str, mode: str, stochastic_rounding: bool = True, steps: int = 3, device: str = "cpu"):
    """Three steps from the same start and data; returns the weights and the optimizer state."""
    arguments, options, _ = OPTIMIZERS[optimizer_name]
    return train_with(lambda model: build_optimizer(model, *arguments, **options), mode, stochastic_rounding, steps,
                      device)


def train_with(build, mode: str, stochastic_rounding: bool = True, steps: int = 3, device: str = "cpu"):
    """`train` with the optimizer `build(model)`."""
    torch.manual_seed(0)  # every device's generator: the rounding's random bits too
    model = TiedLM().to(device)
    cast_to_bf16(model)
    optimizer = build(model)
    if mode == "fused":
        wrapped = OptimizerInBackward(model, optimizer, bf16_weights=True, stochastic_rounding=stochastic_rounding)
    else:
        wrapped = BF16Optimizer(model, optimizer, stochastic_rounding=stochastic_rounding,
                                grad_dtype="fp32" if mode == "grad_fp32" else "bf16")
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(step))
        model(ids.to(device)).backward()
        wrapped.step()
        wrapped.zero_grad()
    weights = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    return weights, wrapped.state_dict()["per_parameter"]


def assert_trees(expected, actual, where: str, tensors_agree) -> None:
    """`expected` and `actual` (tensors, dicts, lists, tuples, other values) have the same structure, keys and
    values: tensors of one dtype and shape, then `tensors_agree(expected, actual, where)`; other values equal."""
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, where
        tensors_agree(expected, actual, where)
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), where
        for key in expected:
            assert_trees(expected[key], actual[key], f"{where}.{key}", tensors_agree)
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (left, right) in enumerate(zip(expected, actual)):
            assert_trees(left, right, f"{where}[{index}]", tensors_agree)
    else:
        assert expected == actual, where


def _bitwise(expected, actual, where: str) -> None:
    assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8)) if expected.dim() else \
        torch.equal(expected, actual), where  # bit patterns: -0.0 and NaN payloads count


def assert_bitwise_equal(expected, actual, where: str = "") -> None:
    assert_trees(expected, actual, where, _bitwise)


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


ON_A_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", ON_A_GPU])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_stochastic_rounding_draws_the_same_bits_chunked_or_whole_on_every_device(
        optimizer_name, mode, device, monkeypatch, chunk_calls):
    """The rounding's random integers come in windows of `_ROUNDING_WINDOW`, whatever the chunks: CUDA's Philox
    generator advances per call (one draw of 2n is not two draws of n, as it is for the CPU's), so only the same
    calls in the same order give the chunked step the whole step's bits."""
    monkeypatch.setattr(bf16, "_ROUNDING_WINDOW", WINDOW)
    whole = train(optimizer_name, mode, device=device)
    assert not chunk_calls
    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", CHUNK)
    chunked = train(optimizer_name, mode, device=device)
    assert chunk_calls == [torch.Size([VOCAB, DIM])] * 3
    assert_bitwise_equal(whole, chunked)
    nearest, _ = train(optimizer_name, mode, stochastic_rounding=False, device=device)
    assert any(not torch.equal(nearest[name], chunked[0][name]) for name in nearest)  # the rounding was random


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


def step_transient_bytes(monkeypatch, chunk_elements: int, optimizer_name: str = "adamw") -> tuple[int, int]:
    """The tracker's peak during a step (the second: the state exists) above what was live before it."""
    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(bf16, "_ROUNDING_WINDOW", min(chunk_elements, 1 << 22))
    torch.manual_seed(0)
    model = TiedLM()
    cast_to_bf16(model)
    optimizer = BF16Optimizer(model, build_optimizer(model, optimizer_name, 1e-2, 0.01))
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

# Adafactor (Hugging Face's class, as build_optimizer makes it): a 2-D tensor steps in passes over row chunks, the
# same formulas; its column sums and RMS norms add in another order, so the result is the whole step's up to fp32
# rounding noise. Tolerances: exp_avg_sq_row exact in practice, exp_avg_sq_col (column means) within rtol 1e-6;
# what passes through an RMS norm within rtol 1e-5: the parameter's RMS, and exp_avg (the clipped update's momentum;
# atol 1e-5 of its largest magnitude, as it cancels near zero): torch's whole-tensor fp32 norm on CPU is itself off
# by a few 1e-6 (the chunks' norms combine in fp64). bf16 weights at most one bf16 step apart, in at most 0.1% of
# the elements (a value at a rounding boundary). Observed here: col 1.5e-7, RMS 2.6e-6, exp_avg 1.3e-6 of its
# largest magnitude, one weight one step apart.
ADAFACTOR_VARIANTS = {
    "factory": {},  # build_optimizer's: lr 1e-2, no relative step, no parameter scale, no first moment
    "beta1_clipped": {"beta1": 0.9, "clip_threshold": 0.5},  # the RMS clip active at every step
    "relative_step": None,  # relative_step, scale_parameter (the parameter's RMS), warmup_init
}
STATE_RTOL = 1e-6
NORM_RTOL = 1e-5  # the parameter's RMS and exp_avg


def adafactor_of(variant: str):
    def build(model):
        options = ADAFACTOR_VARIANTS[variant]
        if options is not None:
            return build_optimizer(model, "adafactor", 1e-2, 0.01, **options)
        from transformers.optimization import Adafactor

        return Adafactor(build_parameter_groups(model, 0.01), lr=None, relative_step=True, scale_parameter=True,
                         warmup_init=True)
    return build


@pytest.fixture
def adafactor_chunk_calls(monkeypatch):
    """Records (shape, rows a chunk) of each chunked Adafactor step."""
    calls = []
    chunked = bf16._step_adafactor_in_row_chunks_

    def counting(parameter, optimizer, gradient, stochastic_rounding, rows_per_chunk):
        calls.append((parameter.shape, rows_per_chunk))
        return chunked(parameter, optimizer, gradient, stochastic_rounding, rows_per_chunk)

    monkeypatch.setattr(bf16, "_step_adafactor_in_row_chunks_", counting)
    return calls


def _within_rounding_noise(expected, actual, where: str) -> None:
    if expected.dtype == torch.bfloat16:
        steps = (expected.view(torch.int16).int() - actual.view(torch.int16).int()).abs()
        assert steps.max().item() <= 1, where
        assert steps.count_nonzero().item() <= max(1, expected.numel() // 1000), where
    elif expected.dtype == torch.float32:
        rtol = NORM_RTOL if where.endswith((".RMS", ".exp_avg")) else STATE_RTOL
        scale = expected.abs().max().item() if expected.numel() else 0.0
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=where)
    else:
        assert torch.equal(expected, actual), where


def assert_close_to_rounding_noise(expected, actual, where: str = "") -> None:
    """fp32 tensors within the tolerances above, bf16 ones at most one bf16 step apart, the rest equal."""
    assert_trees(expected, actual, where, _within_rounding_noise)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", sorted(ADAFACTOR_VARIANTS))
def test_chunked_adafactor_is_the_whole_step_up_to_rounding_noise(variant, mode, monkeypatch, adafactor_chunk_calls):
    """Four steps of the TiedLM, the embedding in 13 chunks of 83 rows (the last one 13 rows), against Adafactor's
    own step() on the whole tensor, with the same random stream: the tolerances above."""
    pytest.importorskip("transformers")
    expected = train_with(adafactor_of(variant), mode, steps=4)
    assert not adafactor_chunk_calls
    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", CHUNK)
    monkeypatch.setattr(bf16, "_ROUNDING_WINDOW", WINDOW)
    actual = train_with(adafactor_of(variant), mode, steps=4)
    assert_close_to_rounding_noise(expected, actual)
    assert adafactor_chunk_calls == [(torch.Size([VOCAB, DIM]), CHUNK // DIM)] * 4


def test_chunked_adafactor_matches_a_single_tensor_step_for_step(monkeypatch):
    """One 301 x 37 tensor (chunks of 30 rows, the last one 1 row), rounding to nearest: each step's state and
    weights against Adafactor's whole step from the same start, so no difference carries over between steps."""
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    start = torch.randn(301, 37).to(torch.bfloat16)
    parameters = [nn.Parameter(start.clone()), nn.Parameter(start.clone())]
    optimizers = [Adafactor([parameter], lr=1e-2, scale_parameter=False, relative_step=False, beta1=0.9,
                            weight_decay=0.1, clip_threshold=0.5) for parameter in parameters]
    for step in range(4):
        gradient = torch.randn(301, 37, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        for parameter in parameters:
            parameter.grad = gradient.clone()
        bf16.step_in_fp32_(parameters[0], optimizers[0], parameters[0].grad, stochastic_rounding=False)
        bf16.step_in_fp32_(parameters[1], optimizers[1], parameters[1].grad, stochastic_rounding=False,
                           chunk_elements=1111)
        assert parameters[0].grad is None and parameters[1].grad is None  # dropped once stepped, as whole
        assert_close_to_rounding_noise(optimizers[0].state_dict(), optimizers[1].state_dict(), f"step {step}")
        assert_close_to_rounding_noise(parameters[0].detach(), parameters[1].detach(), f"step {step}")
        # the next step from the same state and weights (load_state_dict would cast the state to bf16)
        optimizers[1].state[parameters[1]] = {key: _copy_of(value)
                                              for key, value in optimizers[0].state[parameters[0]].items()}
        parameters[1].data.copy_(parameters[0].data)


def test_small_and_one_dimensional_tensors_keep_adafactors_whole_step(monkeypatch, adafactor_chunk_calls):
    """Only tensors past the chunk size that Adafactor factors (2-D) take the chunked step; the others are bitwise
    Adafactor's own step."""
    from transformers.optimization import Adafactor

    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", 100)
    for shape in [(50,), (1000,), (10, 10)]:
        states = []
        for step_in_fp32 in (bf16.step_in_fp32_, today_step_in_fp32_):
            torch.manual_seed(0)
            parameter = nn.Parameter(torch.randn(shape).to(torch.bfloat16))
            optimizer = Adafactor([parameter], lr=1e-2, scale_parameter=False, relative_step=False)
            torch.manual_seed(1)
            step_in_fp32(parameter, optimizer, torch.randn(shape).to(torch.bfloat16))
            states.append((parameter.detach().clone(), optimizer.state_dict()))
        assert_bitwise_equal(*states)
    assert not adafactor_chunk_calls


def test_the_adafactor_step_transient_is_a_chunk_not_the_embedding(monkeypatch, adafactor_chunk_calls):
    """Adafactor whole: the embedding's fp32 parameter and gradient and the one temporary of looptrain's in-place
    step (grad², then the update in it) at once; in chunks of 1/12 of it (three passes), a few chunks."""
    pytest.importorskip("transformers")
    whole, numel = step_transient_bytes(monkeypatch, 1 << 30, "adafactor")
    assert not adafactor_chunk_calls
    chunked, _ = step_transient_bytes(monkeypatch, CHUNK, "adafactor")
    assert adafactor_chunk_calls == [(torch.Size([VOCAB, DIM]), CHUNK // DIM)] * 2
    chunk_bytes = 4 * (CHUNK // DIM) * DIM  # one chunk in fp32
    print(f"adafactor step transient: whole {whole} B ({whole / (4 * numel):.2f} fp32 embeddings), "
          f"chunked {chunked} B ({chunked / chunk_bytes:.2f} fp32 chunks)")
    assert whole >= 2.9 * 4 * numel, whole  # three fp32 copies of the embedding at once (measured: 3.02; 4.02 with
    # transformers' own step, whose update and its negation are two)
    assert chunked <= 8 * chunk_bytes, (chunked, chunk_bytes)  # measured: 4.3 chunks
    assert chunked < whole / 3, (chunked, whole)


def test_a_large_bf16_gradients_norm_is_taken_by_chunks_of_rows(monkeypatch):
    """`fp32_norm`: the fused step's and clipping's norm of a large bf16 gradient, without its whole fp32 copy
    (CPU's vector_norm(dtype=float32) converts the tensor whole); equal to the float64 norm to fp32 noise."""
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(300, 100, generator=generator).to(torch.bfloat16)
    exact = torch.linalg.vector_norm(gradient.double()).float()
    seen = []
    norm = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda tensor, *args, **kwargs: (
        seen.append(tensor.numel()), norm(tensor, *args, **kwargs))[1])
    chunked = bf16.fp32_norm(gradient, chunk_elements=1000)
    assert max(seen[:-1]) == 1000 and len(seen) == 31  # 30 chunks of 10 rows, then their norms
    torch.testing.assert_close(chunked, exact, rtol=1e-6, atol=0)
    seen.clear()
    small = torch.randn(10, 10, generator=generator).to(torch.bfloat16)
    assert torch.equal(bf16.fp32_norm(small, chunk_elements=1000), norm(small, 2, dtype=torch.float32))
    assert seen == [100]  # at most one chunk's elements: whole, as before

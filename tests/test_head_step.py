"""step_by_rows: an untied LM head and the input embedding stepped by rows of the vocabulary in backward.

References are torch's own: the model's full logits, ``F.cross_entropy`` over them and autograd's whole gradient,
stepped by torch's (or Hugging Face's) optimizer over the whole model. Tiny random Llama / Qwen2 (untied) configs;
``lm_loss.MIN_TILE_ROWS`` lowered so that the head's 96 rows go in tiles of a few rows, an uneven last one too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_chunked_ce import make_batch, make_lm

from looptrain import Loop, estimation, lm_loss
from looptrain.errors import ConfigError
from looptrain.optim import OptimizerInBackward
from looptrain.optim.in_backward import row_stepper

from conftest import quiet_config


def optimizer_for(name: str, parameters):
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=0.5, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.1)
    from transformers.optimization import Adafactor

    return Adafactor(parameters, lr=1e-2, relative_step=False, scale_parameter=False, warmup_init=False)


def reference_run(model, name: str, batches: list[dict]) -> torch.nn.Module:
    """torch's own: full logits, F.cross_entropy (the mean over scored shifted labels), whole gradients, one step."""
    optimizer = optimizer_for(name, model.parameters())
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def lever_run(model, name: str, batches: list[dict], **fields) -> Loop:
    loop = Loop(model, optimizer_for(name, model.parameters()), batches,
                config=quiet_config(max_grad_norm=None, optimizer_in_backward=True, chunked_ce="on",
                                    ce_chunk_tokens=7, step_by_rows=True, **fields))
    loop.fit()
    return loop


@pytest.mark.parametrize("family, name", [("llama", "sgd"), ("qwen2-untied", "sgd"),
                                          pytest.param("qwen2-untied", "adamw", marks=pytest.mark.slow),
                                          pytest.param("llama", "adafactor", marks=pytest.mark.slow)])
def test_the_head_stepped_by_rows_equals_torchs_unchunked_cross_entropy_and_step(family, name, monkeypatch):
    monkeypatch.setattr(lm_loss, "MIN_TILE_ROWS", 5)  # 7 x 96 logits a tile: 33 and 22 rows for 20 and 30 tokens
    batches = [make_batch(rows=4, seed=seed) for seed in range(2)]
    steps = []
    monkeypatch.setattr(OptimizerInBackward, "step_rows", _counted(OptimizerInBackward.step_rows, steps))
    reference = reference_run(make_lm(family), name, batches)
    model = make_lm(family)
    loop = lever_run(model, name, batches, gradient_checkpointing=True)  # the blocks' linears recomputed too
    # each update: the head, the 2 blocks' 7 linear weights, the embedding, all by rows (none reached the hook whole)
    assert len(steps) == 2 * 16 and steps[0] == steps[15] == 96 and loop.step == 2
    moved = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), make_lm(family).parameters()))
    for (key, got), expected in zip(model.named_parameters(), reference.parameters()):
        # fp32 noise (weights moved by ~1e-2); AdamW's g / sqrt(v) magnifies it where a gradient is near zero
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5 if name == "adamw" else 2e-6, msg=key)
    assert moved > 1e-3


def _counted(step_rows, rows_seen: list):
    def counted(self, parameter, rows_of, rows_per_chunk):
        rows_seen.append(parameter.shape[0])
        return step_rows(self, parameter, rows_of, rows_per_chunk)

    return counted


def hand_over(weight: torch.nn.Parameter, gradient: torch.Tensor, rows_per_chunk: int) -> None:
    """One backward in which `weight`'s gradient reaches the fused step by rows, as the chunked loss hands it over."""

    class HandOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, parameter):
            return parameter.new_zeros(())

        @staticmethod
        def backward(ctx, grad_output):
            row_stepper(weight)(weight, lambda rows: gradient[rows].clone(), rows_per_chunk)
            return None

    HandOver.apply(weight).backward()


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_rows_stepped_from_a_gradient_are_bitwise_torchs_whole_step(name):
    """The step itself: a gradient handed over in chunks of 5 of its 37 rows gives bitwise torch's one step of it
    (fp32 weights; bf16 weights against torch's step of their fp32 copy rounded to nearest)."""
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.nn.Parameter(torch.randn(37, 8, generator=torch.Generator().manual_seed(0)).to(dtype))
        expected = torch.nn.Parameter(weight.detach().float().clone())
        reference = optimizer_for(name, [expected])
        wrapper = OptimizerInBackward([weight], optimizer_for(name, [weight]), bf16_weights=dtype == torch.bfloat16,
                                      stochastic_rounding=False, row_stepped=[weight])
        for step in range(3):
            gradient = torch.randn(37, 8, generator=torch.Generator().manual_seed(step + 1)).to(dtype)
            expected.grad = gradient.float()
            reference.step()
            expected.data = expected.data.to(dtype).float()  # bf16: what a whole step rounded to nearest keeps
            hand_over(weight, gradient, 5)
        assert torch.equal(weight.detach().float(), expected.detach()) and wrapper.steps == 3, (name, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_embeddings_rows_are_bitwise_nn_embeddings_dense_gradient_stepped_whole(dtype):
    """The input embedding's lookup (`lm_loss._RowSteppedLookup`): tokens repeated and padding, chunks of 5 rows,
    SGD with momentum; the reference is ``F.embedding``'s own dense backward and torch's step of it."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(37, 8, generator=generator).to(dtype))
    expected = torch.nn.Parameter(weight.detach().clone())
    reference = optimizer_for("sgd", [expected])
    wrapper = OptimizerInBackward([weight], optimizer_for("sgd", [weight]), bf16_weights=dtype == torch.bfloat16,
                                  stochastic_rounding=False, row_stepped=[weight])
    for _ in range(2):
        ids = torch.randint(0, 37, (3, 40), generator=generator)
        ids[0, :6] = 3  # the padding row: nothing from the lookup
        grad_output = torch.randn(3, 40, 8, generator=generator).to(dtype)
        torch.nn.functional.embedding(ids, expected, padding_idx=3).backward(grad_output)
        master = expected.detach().float().requires_grad_()
        master.grad = expected.grad.float()
        reference.param_groups[0]["params"] = [master]
        reference.state[master] = reference.state.pop(expected, {}) or reference.state.pop(master, {})
        reference.step()
        expected.data, expected.grad = master.detach().to(dtype), None
        reference.state[expected] = reference.state.pop(master)
        reference.param_groups[0]["params"] = [expected]
        lm_loss._RowSteppedLookup.apply(ids, weight, 3).backward(grad_output)
    assert weight.grad is None and wrapper.steps == 2
    assert torch.equal(weight.detach(), expected.detach())


@pytest.mark.slow
def test_the_estimate_prices_the_vocab_tables_stepped_by_rows(monkeypatch):
    from test_estimate_causal_lm import TOLERANCE, causal_lm, llama_config

    def wide():
        config = llama_config()
        config.vocab_size = 4096  # the head's gradient (4096 x 32 bf16, 256 KiB) stands out of the tiny blocks
        return config

    monkeypatch.setattr(lm_loss, "AUTO_CHUNK_LOGITS", 63 * 256)  # the head's 4096 rows in 16 tiles of 63 tokens
    monkeypatch.setattr(lm_loss, "MIN_TILE_ROWS", 256)
    options = {"weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True,
               "gradient_checkpointing": True, "chunked_ce": "on"}
    whole = estimation.estimate(causal_lm(wide), 1, 64, cache=False, **options)["peak_memory_bytes"]
    estimated = estimation.estimate(causal_lm(wide), 1, 64, cache=False, step_by_rows=True, **options)
    measured = estimation.measure(causal_lm(wide), 1, 64, step_by_rows=True, **options)
    error = abs(estimated["peak_memory_bytes"] - measured["peak_memory_bytes"]) / measured["peak_memory_bytes"]
    assert error <= TOLERANCE, (estimated["peak_memory_bytes"], measured["peak_memory_bytes"])
    assert whole - estimated["peak_memory_bytes"] >= 4096 * 32 * 2 * 0.75  # most of the head's gradient


@pytest.mark.parametrize("fields, message", [
    ({"optimizer_in_backward": False}, r"step_by_rows=True steps weights by rows inside backward: set "
                                       r"optimizer_in_backward=True"),
    ({"chunked_ce": "off"}, r"step_by_rows=True steps the head from the chunked cross-entropy's backward"),
    ({"accum_steps": 2}, r"optimizer_in_backward=True cannot be combined with accum_steps > 1"),
])
def test_combinations_it_cannot_serve_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        quiet_config(**{"optimizer_in_backward": True, "step_by_rows": True, **fields})


@pytest.mark.parametrize("family, optimizer, message", [
    ("qwen2-tied", "sgd", r"this model's head is tied to its input embedding.*turn it off for tied embeddings"),
    ("llama", "fused-adamw", r"steps weights' rows with AdamW, SGD \(not fused\) or Adafactor, not AdamW"),
])
def test_a_tied_head_or_an_optimizer_that_cannot_step_rows_is_refused(family, optimizer, message):
    model = make_lm(family)
    built = (torch.optim.AdamW(model.parameters(), fused=True) if optimizer == "fused-adamw"
             else optimizer_for(optimizer, model.parameters()))
    with pytest.raises(ConfigError, match=message):
        Loop(model, built, [make_batch()], config=quiet_config(optimizer_in_backward=True, step_by_rows=True))


def test_untied_head_reads_presets_configs_and_modules():
    from looptrain.planning.lowest import untied_head

    assert untied_head("llama-3.1-8b") and untied_head("qwen2.5-7b")
    assert not untied_head("llama-3.2-1b") and not untied_head("qwen2.5-0.5b") and not untied_head("bert-base")
    assert untied_head(make_lm("llama")) and not untied_head(make_lm("qwen2-tied"))


@pytest.mark.slow
def test_lowest_steps_the_vocab_tables_by_rows_with_the_fused_step_where_the_head_is_untied():
    from test_estimate_causal_lm import llama_config

    from looptrain.planning.lowest import lowest
    from looptrain.strategy import Strategy

    config = llama_config()
    config.vocab_size = 4096
    result = lowest(config, 1, 32, Strategy(chunked_ce="on"), fixed=["chunked_ce"], native_bf16=True)
    assert result.settings.optimizer_in_backward and result.settings.step_by_rows
    assert "--step-by-rows" in result.settings.flags()
    fused = [peak for settings, peak in result.tried if settings.optimizer_in_backward]
    assert all(settings.step_by_rows for settings, _ in result.tried if settings.optimizer_in_backward)
    assert result.estimate["peak_memory_bytes"] == min(fused) == min(peak for _, peak in result.tried)


@pytest.mark.parametrize("window, vocab, count", [
    (1024, 256, 1),  # in `make test`: 8 chunks, Adafactor fused by rows
    pytest.param(1024, 4096, 3, marks=pytest.mark.slow),  # 128 chunks, every mix
    pytest.param(1000, 4096, 3, marks=pytest.mark.slow),  # a chunk is not one whole window of bits
    pytest.param(3000, 512, 1, marks=pytest.mark.slow),  # some cross a window, some not
    pytest.param(1500, 4096, 3, marks=pytest.mark.slow),  # every chunk but a few crosses a window's end
    pytest.param(3000, 4096, 3, marks=pytest.mark.slow),
])
def test_a_fake_row_chunked_step_skipping_identical_chunks_prices_every_byte_of_the_whole_pass(window, vocab, count,
                                                                                              monkeypatch):
    """`bf16.priced_chunks`: the estimate with the middle chunks skipped equals the one running every chunk (the
    tables' rows in chunks of 32; Adafactor and AdamW, fused or not, by rows or from a whole gradient)."""
    from test_estimate_causal_lm import causal_lm, llama_config

    from looptrain.optim import bf16

    def wide():
        config = llama_config()
        config.vocab_size = vocab
        return config

    monkeypatch.setattr(bf16, "STEP_CHUNK_ELEMENTS", 1024)
    monkeypatch.setattr(bf16, "_ROUNDING_WINDOW", window)
    monkeypatch.setattr(lm_loss, "AUTO_CHUNK_LOGITS", 31 * 32)  # tiles of 32 rows for 31 tokens
    monkeypatch.setattr(lm_loss, "MIN_TILE_ROWS", 32)
    mixes = [{"optimizer": "adafactor", "optimizer_in_backward": True, "step_by_rows": True},
             {"optimizer": "adamw", "optimizer_in_backward": True},
             {"optimizer": "adafactor"}]
    model = causal_lm(wide)
    for mix in mixes[:count]:
        results = []
        for skipped in (True, False):
            monkeypatch.setattr(bf16, "FAKE_CHUNKS_SKIPPED", skipped)
            result = estimation.estimate(model, 1, 32, weights="bf16", chunked_ce="on", cache=False, **mix)
            results.append({key: result[key] for key in ("peak_memory_bytes", "memory_breakdown",
                                                         "phase_peak_bytes")})
        assert results[0] == results[1], mix


@pytest.mark.parametrize("clip", ["per_parameter", "previous_global"])
def test_rows_stepped_under_clipping_equal_torchs_clipped_whole_step(clip):
    """Clipping with the gradient given by rows: its norm from the chunks' norms, the scale applied to every chunk,
    against torch's `clip_grad_norm_` of the whole gradient then one SGD step (previous_global: the first step
    clipped per parameter, later steps by the previous step's norm), to fp32 noise."""
    weight = torch.nn.Parameter(torch.randn(37, 8, generator=torch.Generator().manual_seed(0)))
    expected = torch.nn.Parameter(weight.detach().clone())
    reference = torch.optim.SGD([expected], lr=0.5, momentum=0.9)
    wrapper = OptimizerInBackward([weight], torch.optim.SGD([weight], lr=0.5, momentum=0.9), max_grad_norm=1.0,
                                  clip=clip, row_stepped=[weight])
    previous = None
    for step in range(3):
        gradient = 3 * torch.randn(37, 8, generator=torch.Generator().manual_seed(step + 1))
        expected.grad = gradient.clone()
        norm = torch.linalg.vector_norm(gradient)
        reference_norm = norm if clip == "per_parameter" or previous is None else previous
        expected.grad.mul_(torch.clamp(1.0 / (reference_norm + 1e-6), max=1.0))
        reference.step()
        previous = norm
        hand_over(weight, gradient, 5)
        assert wrapper.grad_norm.item() == pytest.approx(norm.item(), rel=1e-6)
    torch.testing.assert_close(weight.detach(), expected.detach(), rtol=0, atol=1e-6)
def test_a_fake_chunked_norm_standing_in_for_its_middle_chunks_holds_every_byte_of_the_whole(monkeypatch):
    """`bf16.fp32_norm` on a fake bf16 gradient of 20 chunks: with the middle chunks' norms stood in for
    (`priced_chunks`), the tracker's peak and the bytes left are those of every chunk's norm computed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from looptrain.memory.tracker import StorageTracker
    from looptrain.optim import bf16

    seen = []
    for skipped in (True, False):
        monkeypatch.setattr(bf16, "FAKE_CHUNKS_SKIPPED", skipped)
        with FakeTensorMode():
            gradient = torch.empty(40, 8, dtype=torch.bfloat16)
            tracker = StorageTracker()
            tracker.record_timeline()
            with tracker:
                norm = bf16.fp32_norm(gradient, chunk_elements=16)
        norms_run = sum(event[0].startswith("linalg_vector_norm") for event, _, _ in tracker.timeline[1:])
        seen.append((tracker.peak_bytes, tracker.current_bytes, tuple(norm.shape), norm.dtype, norms_run))
    assert seen[0][:4] == seen[1][:4] == (seen[1][0], seen[1][1], (), torch.float32)
    assert seen[1][4] == 21 and seen[0][4] == 6  # 20 chunks and their stack, or 5 of them


def test_a_fake_rounding_makes_only_its_sums_and_holds_the_same_bytes_at_every_step(monkeypatch):
    """`bf16._round_flat_` on fakes makes each piece's int32 sum alone (the views, the mask and the copy into the bf16
    target make no bytes): at each op that makes bytes (the windows, the sums) the tracker's live bytes are the same,
    in the same order, as with every op run, and so are the peak and the bytes left."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from looptrain.memory.tracker import StorageTracker
    from looptrain.optim import bf16

    monkeypatch.setattr(bf16, "_ROUNDING_WINDOW", 300)
    seen = []
    for shortcut in (True, False):
        monkeypatch.setattr(bf16, "FAKE_CHUNKS_SKIPPED", shortcut)
        with FakeTensorMode():
            target, value = torch.empty(1000, dtype=torch.bfloat16), torch.empty(1000)
            tracker = StorageTracker()
            tracker.record_timeline()
            with tracker:
                noise = bf16._RoundingNoise(1000, value.device, None)
                for start in range(0, 1000, 170):  # pieces across the windows' ends
                    bf16._round_flat_(target[start:start + 170], value[start:start + 170], noise)
        makers = ("randint.low_generator", "add.Tensor", "empty.memory_format")  # windows, sums (full run), sums (fake)
        made = [live for event, _, live in tracker.timeline[1:] if event[0] in makers and event[1] > 0]
        seen.append((made, tracker.peak_bytes, tracker.current_bytes, len(tracker.timeline)))
    assert seen[0][:3] == seen[1][:3] and len(seen[0][0]) == 13 and seen[0][3] < seen[1][3] / 2

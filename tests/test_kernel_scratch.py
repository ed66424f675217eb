"""What a matmul kernel holds inside, which is no tensor: oneDNN's fp32 buffer of an emulated bf16 matmul's output.

Measured once per CPU kind (`looptrain.memory.kernels.cpu_bf16_matmul_scratch`), counted by the estimate's tracker
apart from the tensors (`kernel_scratch_bytes`), and checked against the process's RSS on the CPU the test runs on.
"""

from __future__ import annotations

import pytest
import torch

from looptrain import estimation
from looptrain.estimation import blocks, fakes
from looptrain.memory import kernels
from looptrain.memory.allocator import release_freed
from looptrain.memory.meters import current_rss_bytes, proc_status_bytes, reset_peak_rss
from looptrain.memory.tracker import StorageTracker


@pytest.fixture
def scratch_per_element(monkeypatch):
    """Pins what this CPU's bf16 matmuls hold inside, per output element, for the estimate: `pin(4)`."""
    def pin(value: int) -> None:
        monkeypatch.setattr(fakes, "cpu_bf16_matmul_scratch", lambda: value)
    return pin


@pytest.mark.parametrize(("measured", "counted"), [(4.38, 4), (2.0, 4), (0.29, 0), (0.0, 0)])
def test_the_measured_buffer_is_rounded_to_the_fp32_output_it_is_or_to_nothing(monkeypatch, tmp_path, measured,
                                                                                counted):
    calls = []
    monkeypatch.setattr(kernels, "measure_bf16_matmul_scratch", lambda: calls.append(1) or measured)
    monkeypatch.setattr(kernels, "_SCRATCH", {})
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))
    assert kernels.cpu_bf16_matmul_scratch() == counted
    monkeypatch.setattr(kernels, "_SCRATCH", {})  # a new process: the disk entry is read
    assert kernels.cpu_bf16_matmul_scratch() == counted and len(calls) == 1


def test_the_tracker_counts_a_bf16_matmuls_buffer_apart_from_the_tensors(scratch_per_element):
    scratch_per_element(4)
    tracker = StorageTracker()
    tracker.price_op_scratch(fakes.matmul_scratch_rule("cpu"))
    with tracker:
        left = torch.ones(64, 32, dtype=torch.bfloat16)
        right = torch.ones(32, 128, dtype=torch.bfloat16)
        product = left @ right
        tensors = (64 * 32 + 32 * 128 + 64 * 128) * 2
        assert tracker.peak_bytes == tensors
        assert tracker.scratch_peak_bytes == tensors + 64 * 128 * 4  # the fp32 buffer of the whole output
        del product
        table = torch.zeros(256, 128, dtype=torch.bfloat16)
        table.addmm_(torch.ones(256, 32, dtype=torch.bfloat16), right)  # in place: the buffer is the table's size
        held = (64 * 32 + 32 * 128 + 256 * 128 + 256 * 32) * 2
        assert tracker.scratch_peak_bytes == held + 256 * 128 * 4
        tracker.reset_peak()
        fp32 = torch.ones(512, 32) @ torch.ones(32, 512)  # fp32 and batched matmuls hold no such buffer
        torch.bmm(torch.ones(2, 512, 32, dtype=torch.bfloat16), torch.ones(2, 32, 512, dtype=torch.bfloat16))
        assert tracker.scratch_peak_bytes == tracker.peak_bytes > held
        del fp32


def test_nothing_is_counted_where_bf16_matmuls_hold_no_buffer_or_on_a_gpu(scratch_per_element):
    scratch_per_element(0)
    assert fakes.matmul_scratch_rule("cpu") is None
    scratch_per_element(4)
    assert fakes.matmul_scratch_rule("cuda") is None and fakes.matmul_scratch_rule("cpu") is not None


def _llama(layers: int = 5):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, max_position_embeddings=64)


# bf16 autocast over fp32 weights: the head's gradient is the highest moment (bf16 weights peak in their step)
AUTOCAST = {"precision": "bf16", "optimizer": "sgd", "optimizer_in_backward": True}


def test_an_estimate_reports_the_buffer_beside_an_unchanged_peak(scratch_per_element):
    scratch_per_element(0)
    plain = estimation.estimate(_llama(2), 1, 16, cache=False, **AUTOCAST)
    scratch_per_element(4)
    priced = estimation.estimate(_llama(2), 1, 16, cache=False, **AUTOCAST)
    assert plain["kernel_scratch_bytes"] == 0 < priced["kernel_scratch_bytes"]
    assert priced["peak_memory_bytes"] == plain["peak_memory_bytes"]  # the tensors' peak, as a tracker measures it
    # The untied head's fp32 gradient gains a bf16 product of [vocab, hidden] while every weight is held: the
    # product's fp32 buffer sits on at least the weights, the gradient and the product.
    weights = priced["memory_breakdown"]["params"]
    assert priced["peak_memory_bytes"] + priced["kernel_scratch_bytes"] >= weights + 4096 * 32 * (4 + 2 + 4)


@pytest.mark.slow
def test_the_buffer_of_a_deep_stack_extrapolates_exactly(scratch_per_element, monkeypatch):
    monkeypatch.setattr(blocks, "FEWEST_BLOCKS", 5)
    scratch_per_element(4)
    extrapolated = estimation.estimate(_llama(5), 1, 16, cache=False, **AUTOCAST)
    whole = estimation.estimate(_llama(5), 1, 16, cache=False, extrapolate=False, **AUTOCAST)
    assert extrapolated["extrapolated"] is True
    assert extrapolated["kernel_scratch_bytes"] == whole["kernel_scratch_bytes"] > 0


@pytest.mark.hardware
def test_the_counted_buffer_matches_the_rss_an_in_place_bf16_matmul_takes_on_this_cpu():
    """Whatever the CPU: the rule the estimate counts by (the measurement on a product) predicts what an in-place
    accumulation into a 64 MiB (fp32) table raises the process's RSS by, beyond the tensors."""
    rows, inner, columns = 4096, 8, 4096
    table = torch.zeros(rows, columns, dtype=torch.bfloat16)
    left, right = torch.ones(rows, inner, dtype=torch.bfloat16), torch.ones(inner, columns, dtype=torch.bfloat16)
    table[:8].addmm_(left[:8], right)  # kernel selection
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        release_freed()
        before = current_rss_bytes()
        reset_peak_rss()
        table.addmm_(left, right)
        rise = proc_status_bytes("VmHWM") - before  # the kernel's mark since the reset, not the process's peak
    finally:
        torch.set_num_threads(threads)
    counted = kernels.cpu_bf16_matmul_scratch() * rows * columns
    if counted:
        assert rise == pytest.approx(counted, rel=0.25)
    else:
        assert rise < rows * columns  # well under an fp32 buffer (4 bytes an element)


def test_the_runs_table_shows_the_buffer_beside_the_estimate_where_there_is_one():
    from looptrain.cli import finetune

    summary = {"train_runtime_s": 1.0, "train_samples_per_s": 1.0, "optimizer_steps": 1, "skipped_steps": 0,
               "memory_meter": "cpu_tensor_tracker", "peak_memory_bytes": 300 * 2**20,
               "estimated_peak_bytes": 300 * 2**20, "estimate_error": 0.0}
    row = ("| held inside bf16 matmuls (RSS, no tensor) | 519.3 MiB above the estimated peak: this CPU computes "
           "bf16 in an fp32 buffer of each output | |")
    assert row in finetune.final_table({**summary, "estimated_kernel_scratch_bytes": 544_538_624}, None, "runs/x")
    assert "held inside" not in finetune.final_table({**summary, "estimated_kernel_scratch_bytes": 0}, None, "x")


@pytest.mark.parametrize(("counts_scratch", "expected"), [(True, 1000 + 300), (False, 1000)])
def test_a_budget_of_rss_charges_the_buffer_to_each_estimate_and_one_of_tensors_does_not(monkeypatch,
                                                                                          counts_scratch, expected):
    from looptrain.planning import book as books
    from looptrain.strategy import Strategy

    result = {"peak_memory_bytes": 1000, "kernel_scratch_bytes": 300, "memory_breakdown": {}}
    monkeypatch.setattr(books, "estimate", lambda *args, **kwargs: result)
    book = books.EstimateBook(_llama(2), 16, counts_scratch=counts_scratch)
    assert book.peak(Strategy(batch_size=2, accum_steps=4)) == expected


def test_the_buffer_is_never_measured_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError, match="measured on real tensors"):
        kernels.measure_bf16_matmul_scratch()

"""The CUDA paths: fp16 + GradScaler, the allocator meter, bitsandbytes on the GPU.

Skipped without a CUDA device (every CPU machine, CI included); run them on a GPU with
`make test TORCH_SPEC='torch>=2.4'` or `python -m pytest -m gpu`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from looptrain import Loop, LoopConfig
from looptrain.optim import build_optimizer

from conftest import SmallMLP

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_config(**fields) -> LoopConfig:
    defaults = {"device": "cuda", "progress_bar": False, "log_every": 1000, "eval_every": "no"}
    return LoopConfig(**{**defaults, **fields})


class SumLoop(Loop):
    def compute_loss(self, batch):
        return self.model(batch).float().sum(), 1


def test_fp16_overflow_on_cuda_is_skipped_and_counted():
    model = nn.Linear(1, 1, bias=False)
    nn.init.constant_(model.weight, 0.0)
    batches = [torch.full((1, 1), 100.0) for _ in range(10)]
    summary = SumLoop(model, torch.optim.SGD(model.parameters(), lr=1e-3), batches,
                      config=cuda_config(precision="fp16", max_grad_norm=None)).fit()
    # As on CPU: scales 2^16 .. 2^10 overflow fp16 (gradient = scale x 100 > 65504), 2^9 steps.
    assert (summary["skipped_steps"], summary["optimizer_steps"]) == (7, 3)
    assert model.weight.item() == pytest.approx(-3 * 1e-3 * 100, rel=1e-3)


def test_cuda_meter_reports_the_allocator_peak():
    model = SmallMLP(in_features=256, hidden=1024)
    batches = [{"x": torch.randn(64, 256), "labels": torch.randint(0, 3, (64,))} for _ in range(3)]
    summary = Loop(model, torch.optim.AdamW(model.parameters()), batches, config=cuda_config()).fit()
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert summary["memory_meter"] == "cuda_max_memory_allocated"
    # Weights, grads and AdamW's two states are all alive during the step: at least 4x the weights.
    assert summary["peak_memory_bytes"] >= 4 * parameter_bytes
    assert summary["memory_breakdown"]["optimizer_state"] >= 2 * parameter_bytes
    assert summary["reserved_bytes"] >= summary["peak_memory_bytes"]


def test_adamw8bit_on_cuda_keeps_embeddings_32bit():
    class EmbedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            self.hidden = nn.Linear(64, 64)

        def forward(self, ids):
            return self.hidden(self.embed(ids)).sum()

    model = EmbedMLP().cuda()
    optimizer = build_optimizer(model, "adamw8bit", lr=1e-3)
    model(torch.randint(0, 100, (4, 8), device="cuda")).backward()
    optimizer.step()
    assert optimizer.state[model.hidden.weight]["state1"].dtype == torch.uint8
    assert optimizer.state[model.embed.weight]["state1"].dtype == torch.float32

"""Faults inside the loop: non-finite windows, divergence, out-of-memory with auto_batch, SIGTERM."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from looptrain import Loop, TrainingDiverged
from looptrain.guards import OUT_OF_MEMORY_ERRORS

from conftest import SmallMLP, mlp_batches
from conftest import quiet_config as quiet


def poisoned(batches: list[dict], positions: set[int]) -> list[dict]:
    """The same batches with NaN inputs at the given positions."""
    return [{**batch, "x": torch.full_like(batch["x"], float("nan"))} if index in positions else batch
            for index, batch in enumerate(batches)]


def test_nonfinite_windows_are_skipped_counted_and_logged(tmp_path):
    torch.manual_seed(0)
    model = SmallMLP()
    batches = poisoned(mlp_batches(6), {1, 3})
    summary = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                   config=quiet(output_dir=str(tmp_path))).fit()
    assert (summary["optimizer_steps"], summary["skipped_steps"]) == (4, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [event for event in events if event["event"] == "skipped"]
    assert [event["micro_step"] for event in skipped] == [2, 4]
    assert all(event["reason"] == "non-finite loss or gradients" for event in skipped)


def test_consecutive_bad_windows_stop_the_run_naming_step_and_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = SmallMLP()
    batches = poisoned(mlp_batches(10), {4, 5, 6, 7, 8, 9})
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                config=quiet(output_dir=str(tmp_path), eval_every=2, max_bad_windows=3))
    with pytest.raises(TrainingDiverged, match=r"not finite for 3 windows in a row, up to step 4 \(micro-step 7\).*"
                                               r"Last good checkpoint: .*checkpoint-4"):
        loop.fit()
    # None of the bad windows was applied: the weights are those of step 4.
    at_step_4 = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    for name, parameter in model.state_dict().items():
        assert torch.equal(parameter, at_step_4[name]), name


def test_fp16_overflow_skips_are_not_bad_windows():
    class Overflowing(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(1, 1, bias=False)

        def forward(self, x):
            return self.linear(x)

    class SumLoop(Loop):
        def compute_loss(self, batch):
            return self.model(batch).float().sum(), 1

    model = Overflowing()
    batches = [torch.full((1, 1), 100.0) for _ in range(10)]
    # Seven scaler skips in a row (scale 2^16 .. 2^10) with a finite loss: the scaler's business, not divergence.
    summary = SumLoop(model, torch.optim.SGD(model.parameters(), lr=1e-3), batches,
                      config=quiet(precision="fp16", max_grad_norm=None, max_bad_windows=2)).fit()
    assert summary["skipped_steps"] == 7 and summary["optimizer_steps"] == 3


class RowLimitedMLP(SmallMLP):
    """A model that raises torch's out-of-memory error for micro-batches of more than `limit` rows."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.rows_seen = []

    def forward(self, x, labels=None):
        self.rows_seen.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise OUT_OF_MEMORY_ERRORS[0](f"CUDA out of memory (simulated: {x.shape[0]} rows > {self.limit})")
        return super().forward(x, labels)


def test_auto_batch_halves_the_micro_batch_and_keeps_the_exact_update():
    batches = mlp_batches(3, rows=8) + mlp_batches(1, rows=5, seed=1)  # the last batch is uneven
    torch.manual_seed(0)
    reference = SmallMLP()
    limited = RowLimitedMLP(limit=2)
    limited.load_state_dict(reference.state_dict())
    Loop(reference, torch.optim.SGD(reference.parameters(), lr=0.5), batches,
         config=quiet(accum_steps=2, max_grad_norm=None)).fit()
    summary = Loop(limited, torch.optim.SGD(limited.parameters(), lr=0.5), batches,
                   config=quiet(accum_steps=2, max_grad_norm=None, auto_batch=True)).fit()
    assert summary["micro_batch_splits"] == 4  # 8 rows -> 4 -> 2
    assert max(limited.rows_seen[-4:]) <= 2
    assert summary["optimizer_steps"] == 2 and summary["micro_steps"] == 16  # 4 batches x 4 pieces
    for (name, expected), actual in zip(reference.state_dict().items(), limited.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_out_of_memory_without_auto_batch_explains_and_suggests():
    model = RowLimitedMLP(limit=2)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.5), mlp_batches(2), config=quiet())
    with pytest.raises(OUT_OF_MEMORY_ERRORS[0], match=r"(?s)out of memory at step 0 \(micro-batch of 8 rows\).*"
                                                      r"held at the failure: params .* MiB.*try: auto_batch=True"):
        loop.fit()


def test_auto_batch_gives_up_when_a_single_row_does_not_fit():
    model = RowLimitedMLP(limit=0)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.5), mlp_batches(1, rows=4),
                config=quiet(auto_batch=True))
    with pytest.raises(OUT_OF_MEMORY_ERRORS[0], match=r"micro-batch of 1 rows"):
        loop.fit()


class SignalAtStep(Loop):
    """Sends itself SIGTERM at the end of one step: what a cluster scheduler does before a kill."""

    signal_step = 3

    def on_step_end(self, *, step, **_):
        if step == self.signal_step and self._signals.received is None:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tmp_path):
    batches = mlp_batches(8)

    def make(loop_class, output_dir, **fields):
        torch.manual_seed(0)
        model = SmallMLP()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return model, loop_class(model, optimizer, batches, scheduler=scheduler,
                                 config=quiet(epochs=2, accum_steps=2, output_dir=str(output_dir), **fields))

    reference, loop = make(Loop, tmp_path / "full")
    loop.fit()
    interrupted_model, loop = make(SignalAtStep, tmp_path / "cut")
    summary = loop.fit()
    # The signal lands in step 3's on_step_end, before the loop asks every rank whether to stop
    # (one all-reduce after each window): the run stops, on every rank alike, after that window.
    assert summary["interrupted"] == "SIGTERM" and summary["optimizer_steps"] == 3
    assert (tmp_path / "cut" / "checkpoint-3" / "COMPLETE").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was put back
    resumed, loop = make(Loop, tmp_path / "cut", resume="auto")
    assert loop.fit()["optimizer_steps"] == 8
    for (name, expected), actual in zip(reference.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(actual, expected), name

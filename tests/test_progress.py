"""The Loop's `Progress` record and the one clipping call every optimizer answers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from looptrain import Loop
from looptrain.optim import BF16Optimizer, OptimizerInBackward, PerParameterOptimizer, clip_gradients
from looptrain.progress import Progress

from conftest import SmallMLP, quiet_config


def test_progress_counts_updates_passes_and_the_data_position_as_a_frozen_value():
    progress = Progress().after_pass().after_pass().after_update(True).after_batches(2)
    progress = progress.after_pass().after_update(False).after_batches(1)
    assert (progress.step, progress.micro_step, progress.skipped_steps, progress.batch_in_epoch) == (1, 3, 1, 3)
    assert progress.in_epochs(12) == 0.25 and progress.in_epochs(None) == 0.0
    finished = progress.evaluated({"loss": 0.5}).next_epoch()
    assert (finished.epoch, finished.batch_in_epoch, finished.last_eval_step) == (1, 0, 1)
    assert finished.last_eval == {"loss": 0.5}
    assert Progress.from_state_dict({**finished.state_dict(), "run_checkpoints": []}) == finished
    with pytest.raises(dataclasses.FrozenInstanceError):
        finished.step = 7  # only its owner replaces it


def test_the_loops_counters_read_its_progress_and_its_run_holds_no_loop():
    torch.manual_seed(0)
    model = SmallMLP()
    batches = [{"x": torch.randn(4, 8), "labels": torch.randint(0, 3, (4,))} for _ in range(5)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, config=quiet_config(accum_steps=2))
    loop.fit()
    assert (loop.step, loop.micro_step, loop.epoch, loop.batch_in_epoch) == (3, 5, 1, 0)
    assert (loop.progress.step, loop.progress.micro_step) == (loop.step, loop.micro_step)
    assert not any(value is loop for value in vars(loop.run).values())


def _gradients_of(model: torch.nn.Module) -> None:
    torch.manual_seed(1)
    model(torch.randn(6, 8) * 10, labels=torch.randint(0, 3, (6,)))["loss"].backward()


@pytest.mark.parametrize("kind", ["plain", "per_parameter", "bf16_optimizer"])
def test_every_optimizer_clips_its_own_gradients_as_torch_does(kind):
    torch.manual_seed(0)
    reference, model = SmallMLP(), SmallMLP()
    model.load_state_dict(reference.state_dict())
    _gradients_of(reference)
    expected = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = {"plain": optimizer, "per_parameter": PerParameterOptimizer(model, optimizer),
                 "bf16_optimizer": BF16Optimizer(model, optimizer)}[kind]
    _gradients_of(model)
    norm = clip_gradients(optimizer, list(model.parameters()), 0.1)
    torch.testing.assert_close(norm, expected)
    for clipped, gradient in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(gradient.grad, clipped.grad)


def test_the_fused_step_answers_with_its_backwards_norm():
    torch.manual_seed(0)
    model = SmallMLP()
    fused = OptimizerInBackward(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.1)
    _gradients_of(model)
    assert clip_gradients(fused, list(model.parameters()), 0.1) is fused.grad_norm
    assert all(parameter.grad is None for parameter in model.parameters())  # stepped and freed in backward

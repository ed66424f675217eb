"""Every invalid LoopConfig value or combination raises a ConfigError that names the fields."""

import pytest
import torch

from looptrain import LoopConfig
from looptrain.config import ConfigError


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"accum_steps": 0}, r"accum_steps must be >= 1 \(got 0\)"),
        ({"epochs": 0}, r"epochs must be >= 1"),
        ({"max_steps": 0}, r"max_steps must be a positive number"),
        ({"seed": -1}, r"seed must be an integer from 0 to 2\*\*32 - 1 \(got -1\)"),
        ({"precision": "fp8"}, r"precision must be one of fp32, bf16, fp16, auto \(got 'fp8'\)"),
        ({"max_grad_norm": 0.0}, r"max_grad_norm must be > 0, or None"),
        ({"clip_mode": "sometimes"}, r"clip_mode must be one of"),
        ({"log_every": 0}, r"log_every must be >= 1"),
        ({"eval_every": 0}, r"eval_every must be 'epoch', 'no' or a positive number"),
        ({"eval_every": "weekly"}, r"eval_every must be"),
        ({"save_total_limit": 0}, r"save_total_limit must be >= 1, or None"),
        ({"metric_for_best": ""}, r"metric_for_best must be a metric name such as 'f1' or 'loss', or None"),
        ({"report_to": "comet"},
         r"report_to must be 'none' or comma-separated names from tensorboard, wandb, mlflow \(got 'comet'\)"),
        ({"report_to": "tensorboard"}, r"report_to='tensorboard' writes its files under output_dir: set output_dir"),
        ({"optimizer_in_backward": True, "accum_steps": 4},
         r"optimizer_in_backward=True cannot be combined with accum_steps > 1"),
        ({"optimizer_in_backward": True, "precision": "fp16"},
         r"optimizer_in_backward=True cannot be combined with precision='fp16'"),
        ({"optimizer_in_backward": True, "clip_mode": "global"}, r"clip_mode='global' needs every gradient at once"),
        ({"clip_mode": "per_parameter"}, r"clip_mode='per_parameter' only applies with optimizer_in_backward=True"),
        ({"load_best_at_end": True}, r"load_best_at_end=True needs output_dir"),
        ({"load_best_at_end": True, "output_dir": "x", "eval_every": "no"}, r"load_best_at_end=True needs evaluations"),
        ({"resume": "auto"}, r"resume='auto' looks for checkpoints in output_dir"),
        ({"device": "toaster"}, r"device='toaster' is not a device name"),
    ],
)
def test_invalid_config_names_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        LoopConfig(**fields)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ConfigError, match=r"device='cuda' was asked for but CUDA is not available"):
        LoopConfig(device="cuda")


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as error:
        LoopConfig(accum_steps=0, precision="fp8")
    assert "accum_steps" in str(error.value) and "precision" in str(error.value)


def test_auto_clip_mode_resolves_per_strategy():
    assert LoopConfig().effective_clip_mode == "global"
    assert LoopConfig(optimizer_in_backward=True).effective_clip_mode == "per_parameter"


def test_best_metric_direction_defaults_by_name_and_can_be_forced():
    config = LoopConfig()
    assert [config.best_mode_for(name) for name in ("f1", "accuracy", "loss", "eval_loss", "perplexity", "mae")] == [
        "max", "max", "min", "min", "min", "min"]
    assert LoopConfig(metric_for_best="bleu", greater_is_better=False).best_mode_for("bleu") == "min"


def test_defaults_are_valid_and_serialisable():
    config = LoopConfig()
    assert config.to_dict()["accum_steps"] == 1 and config.precision == "fp32"


def test_tensorboard_without_its_package_is_refused_before_training(monkeypatch, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "tensorboard" else real_find_spec(name, *args))
    with pytest.raises(ConfigError, match=r"report_to='tensorboard' needs the tensorboard package: pip install "
                                          r"tensorboard"):
        LoopConfig(report_to="tensorboard", output_dir=str(tmp_path))
    monkeypatch.undo()
    assert LoopConfig(report_to="tensorboard", output_dir=str(tmp_path)).report_to == "tensorboard"

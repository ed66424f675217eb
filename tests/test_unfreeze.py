"""Gradual unfreezing and layer-wise learning-rate decay: which parameters train when, at which rate."""

from __future__ import annotations

import json
import re

import pytest
import torch

from looptrain import ConfigError, Loop, LoopConfig, build_optimizer, freeze_embeddings
from looptrain.cli import finetune
from looptrain.config import check_process_group
from looptrain.freeze import layer_depths
from looptrain.gradient_checkpointing import checkpointed_block_indices
from looptrain.optim import build_parameter_groups

from conftest import make_tiny_bert, quiet_config, task_batches, write_csv


# ------------------------------------------------------------------ layer-wise learning-rate decay
def test_layer_depths_hold_every_parameter_once_from_the_head_down():
    model = make_tiny_bert(num_layers=3)
    depths = layer_depths(model)
    assert [label for label, _ in depths] == ["head", "bert.encoder.layer.2", "bert.encoder.layer.1",
                                              "bert.encoder.layer.0", "embeddings"]
    names = [name for _, named in depths for name, _ in named]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    assert {name for name, _ in depths[0][1]} == {"bert.pooler.dense.weight", "bert.pooler.dense.bias",
                                                 "classifier.weight", "classifier.bias"}
    assert all(name.startswith("bert.embeddings.") for name, _ in depths[-1][1])


def test_layer_lr_decay_gives_each_depth_its_rate_and_every_parameter_one_group():
    model = make_tiny_bert(num_layers=3)
    freeze_embeddings(model)  # frozen parameters are in no group
    groups = build_parameter_groups(model, 0.01, layer_lr_decay=0.5, lr=1e-3)
    # minGPT's check, from the outside: every trainable parameter in exactly one group, no frozen one
    grouped = [id(parameter) for group in groups for parameter in group["params"]]
    trainable = {id(parameter) for parameter in model.parameters() if parameter.requires_grad}
    assert len(grouped) == len(set(grouped)) and set(grouped) == trainable
    rate = {group["layer"]: group["lr"] for group in groups}
    assert rate == {"head": 1e-3, "bert.encoder.layer.2": 1e-3, "bert.encoder.layer.1": 5e-4,
                    "bert.encoder.layer.0": 2.5e-4}
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    for group in groups:  # the weight-decay split still holds inside each depth
        decayed = group["weight_decay"] > 0
        for parameter in group["params"]:
            name = names[id(parameter)]
            assert decayed == (not name.endswith("bias") and "LayerNorm" not in name), name


def test_layer_lr_decay_reaches_the_embeddings_and_survives_the_scheduler():
    model = make_tiny_bert(num_layers=2)
    optimizer = build_optimizer(model, "adamw", 1e-3, 0.01, layer_lr_decay=0.9)
    rate = {group["layer"]: group["lr"] for group in optimizer.param_groups}
    assert rate["embeddings"] == pytest.approx(1e-3 * 0.9**2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    optimizer.step()  # no gradients: changes nothing, keeps the scheduler's order check quiet
    scheduler.step()
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(
        [0.5 * base for base in scheduler.base_lrs])


@pytest.mark.parametrize("decay", [0.0, 1.5, -0.9])
def test_layer_lr_decay_out_of_range_is_refused(decay):
    with pytest.raises(ValueError, match=r"layer_lr_decay must be in \(0, 1\]"):
        build_optimizer(make_tiny_bert(), "adamw", 1e-3, layer_lr_decay=decay)


# ------------------------------------------------------------------ gradual unfreezing
class RecordingLoop(Loop):
    """Records, after every update, which parameters moved and which blocks are checkpointed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.before = {name: parameter.detach().clone() for name, parameter in self.model.named_parameters()}
        self.moved: list[set[str]] = []
        self.checkpointed: list[list[int]] = []

    def on_step_end(self, **kwargs) -> None:
        moved = set()
        for name, parameter in self.model.named_parameters():
            if not torch.equal(parameter.detach(), self.before[name]):
                moved.add(name)
            self.before[name] = parameter.detach().clone()
        self.moved.append(moved)
        self.checkpointed.append(checkpointed_block_indices(self.model))


def depth_names(model) -> dict[str, set[str]]:
    return {label: {name for name, _ in named} for label, named in layer_depths(model)}


@pytest.mark.parametrize("fields", [
    {},
    {"optimizer_in_backward": True},
    {"weights": "bf16"},
    {"accum_steps": 2},
])
def test_unfreezing_trains_the_head_first_then_one_block_per_stage_embeddings_last(fields):
    model = make_tiny_bert(num_layers=2)
    depths = depth_names(model)
    loop = RecordingLoop(model, build_optimizer(model, "adamw", 1e-2),
                         task_batches(8 * fields.get("accum_steps", 1), seed=0),
                         config=quiet_config(unfreeze_every=2, gradient_checkpointing=True, **fields))
    summary = loop.fit()
    head, top, bottom, embeddings = (depths[label] for label in
                                     ("head", "bert.encoder.layer.1", "bert.encoder.layer.0", "embeddings"))
    expected = [head, head, head | top, head | top, head | top | bottom, head | top | bottom]
    expected += [head | top | bottom | embeddings] * 2
    assert loop.moved == expected
    # checkpointing follows: no block while only the head trains, then every block a gradient passes through
    assert loop.checkpointed == [[], [], [1], [1], [0, 1], [0, 1], [0, 1], [0, 1]]
    assert summary["unfreeze"]["stage"] == summary["unfreeze"]["stages"] == 4


def test_parameters_keep_their_optimizer_state_when_others_join():
    class StateLoop(Loop):
        def on_step_end(self, **kwargs) -> None:
            if self.step == 3:  # the end of stage 1: only the head has state
                self.state_at_3 = {id(p): state["exp_avg"].clone() for p, state in self.optimizer.state.items()}

    model = make_tiny_bert(num_layers=2)
    optimizer = build_optimizer(model, "adamw", 1e-2)
    loop = StateLoop(model, optimizer, task_batches(6, seed=0), config=quiet_config(unfreeze_every=3))
    loop.fit()
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    depths = depth_names(model)
    assert {names[key] for key in loop.state_at_3} == depths["head"]
    stepped = {names[id(parameter)]: int(state["step"]) for parameter, state in optimizer.state.items()}
    assert stepped == {**dict.fromkeys(depths["head"], 6), **dict.fromkeys(depths["bert.encoder.layer.1"], 3)}
    for parameter, state in optimizer.state.items():  # the head's moments went on from step 3, not from zero
        if id(parameter) in loop.state_at_3:
            assert not torch.equal(state["exp_avg"], loop.state_at_3[id(parameter)])


def test_parameters_the_user_froze_stay_frozen_in_every_stage():
    model = make_tiny_bert(num_layers=2)
    freeze_embeddings(model)
    embeddings = {name: parameter.detach().clone() for name, parameter in model.named_parameters()
                  if name.startswith("bert.embeddings.")}
    loop = Loop(model, build_optimizer(model, "adamw", 1e-2), task_batches(6, seed=0),
                config=quiet_config(unfreeze_every=1))
    summary = loop.fit()
    assert summary["unfreeze"]["stages"] == 3  # head, two blocks: the embeddings are no stage
    for name, parameter in model.named_parameters():
        if name in embeddings:
            assert not parameter.requires_grad and torch.equal(parameter, embeddings[name]), name


def test_unfreezing_every_epoch_and_the_last_stage_peak_in_the_summary():
    model = make_tiny_bert(num_layers=2)
    loop = Loop(model, build_optimizer(model, "adamw", 1e-2), task_batches(3, seed=0),
                config=quiet_config(unfreeze_every="epoch", epochs=5, track_memory=True))
    summary = loop.fit()
    unfreeze = summary["unfreeze"]
    assert unfreeze["stage"] == unfreeze["stages"] == 4
    assert len(unfreeze["earlier_stage_peak_bytes"]) == 3
    # the summary's peak is the last stage's (every parameter trains): above each earlier stage's peak
    assert all(earlier < summary["peak_memory_bytes"] for earlier in unfreeze["earlier_stage_peak_bytes"])


def test_resume_in_a_later_stage_is_exact(tmp_path):
    def run(output_dir, **fields):
        model = make_tiny_bert(num_layers=2, seed=3)
        Loop(model, build_optimizer(model, "adamw", 1e-2), task_batches(8, seed=0),
             config=quiet_config(unfreeze_every=2, output_dir=str(output_dir), eval_every=3, seed=5, **fields)).fit()
        return model

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    for (name, expected), actual in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(expected, actual), name
    events = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [(event["step"], event["unfrozen"]) for event in events if event.get("event") == "unfreeze"] == [
        (0, "head"), (2, "bert.encoder.layer.1"), (4, "bert.encoder.layer.0"), (6, "embeddings")]


def test_an_optimizer_without_the_later_stages_is_refused():
    model = make_tiny_bert(num_layers=2)
    head_only = torch.optim.AdamW(model.classifier.parameters(), lr=1e-3)
    with pytest.raises(ValueError,
                       match=r"unfreeze_every: the optimizer does not hold .*build the optimizer over the whole model"):
        Loop(model, head_only, task_batches(2, seed=0), config=quiet_config(unfreeze_every=1))


def test_bad_unfreeze_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"unfreeze_every must be None, 'epoch' or a positive number"):
        LoopConfig(unfreeze_every=0)
    with pytest.raises(ConfigError, match=r"unfreeze_every \(gradual unfreezing\) cannot run with several processes"):
        check_process_group(LoopConfig(unfreeze_every=2), world_size=2, sharded=False)


# ------------------------------------------------------------------ the command line
@pytest.fixture(scope="module")
def train_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("data") / "train.csv", 32)


def cli(model_dir, data, output_dir, *extra):
    return finetune.main(["--model", str(model_dir), "--data", str(data), "--output-dir", str(output_dir),
                          "--max-length", "32", "--lr", "1e-3", "--no-track-memory", "--no-progress-bar", *extra])


def test_cli_unfreeze_schedule_and_layer_lr_decay(model_dir, train_csv, tmp_path, capsys):
    assert cli(model_dir, train_csv, tmp_path, "--batch-size", "4", "--unfreeze-schedule", "2",
               "--layer-lr-decay", "0.8", "--eval-every", "no") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["unfreeze_every"] == 2 and summary["unfreeze"]["stages"] == 4
    out = capsys.readouterr().out
    assert re.search(r"unfreeze: stage 4/4 from step 6: embeddings trains", out), out
    meter = r"(cpu_rss_delta|cuda_max_memory_allocated)"  # the CLI's default device: cuda where there is one
    assert re.search(rf"\| peak memory \| [\d.]+ MiB \({meter}, last unfreezing stage \(4/4\)\)", out), out
    config = json.loads((tmp_path / "run_config.json").read_text())
    assert config["arguments"]["layer_lr_decay"] == 0.8


@pytest.mark.parametrize("flags, message", [
    (["--layer-lr-decay", "1.5"], r"--layer-lr-decay must be in \(0, 1\] \(got 1.5\)"),
    (["--unfreeze-schedule", "often"], r"expected 'epoch' or a number of optimizer updates per stage, got 'often'"),
    (["--unfreeze-schedule", "2", "--freeze-encoder"],
     r"--unfreeze-schedule unfreezes blocks that --freeze-encoder keeps frozen"),
    (["--no-stochastic-rounding"], r"stochastic_rounding=False .*--weights bf16|--no-stochastic-rounding"),
])
def test_cli_refuses_bad_unfreezing_and_bf16_flags(model_dir, train_csv, tmp_path, capsys, flags, message):
    try:
        code = cli(model_dir, train_csv, tmp_path, *flags)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err), err


def test_cli_bf16_weights_train_and_save_bf16(model_dir, train_csv, tmp_path):
    from safetensors.torch import load_file

    assert cli(model_dir, train_csv, tmp_path, "--batch-size", "8", "--weights", "bf16", "--optim", "adafactor",
               "--optim-in-backward", "--grad-checkpoint", "--eval-every", "no") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["config"]["weights"] == "bf16"
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert {tensor.dtype for tensor in saved.values() if tensor.is_floating_point()} == {torch.bfloat16}

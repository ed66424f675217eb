"""Checkpoints: exact round-trips, atomic writes, rotation with the best kept, safe loading."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from looptrain.checkpoint import (
    BestTracker,
    CheckpointError,
    is_better,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_resume_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
)
from looptrain.checkpoint import files as files_module
from looptrain.checkpoint import save as save_module

from conftest import SmallMLP, make_tiny_bert


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0, scheduler=None):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = torch.randn(4, 8, generator=generator)
        labels = torch.randint(0, 3, (4,), generator=generator)
        model(inputs, labels)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _make_run(seed: int = 0):
    torch.manual_seed(seed)
    model = SmallMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _save_simple(output_dir: Path, step: int, metrics=None) -> Path:
    model = SmallMLP()
    return save_checkpoint(output_dir, step, model=model, trainer_state={"epoch": 0}, metrics=metrics)


def test_round_trip_restores_weights_optimizer_scheduler_and_continues_identically(tmp_path):
    model, optimizer, scheduler = _make_run()
    _train_steps(model, optimizer, 2, scheduler=scheduler)
    trainer_state = {"step": 2, "micro_step": 4, "epoch": 0, "batch_in_epoch": 3, "history": [{"loss": 1.5}]}
    path = save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler,
                           trainer_state=trainer_state, metrics={"f1": 0.5})
    assert path == tmp_path / "checkpoint-2"
    assert sorted(os.listdir(path)) == sorted([
        "COMPLETE", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pt",
        "trainer_state.json", "metrics.json",
    ])

    restored_model, restored_optimizer, restored_scheduler = _make_run(seed=1)
    loaded_state = load_checkpoint(path, model=restored_model, optimizer=restored_optimizer,
                                   scheduler=restored_scheduler)
    assert loaded_state == trainer_state
    for original, restored in zip(model.state_dict().values(), restored_model.state_dict().values()):
        assert torch.equal(original, restored)
    assert restored_scheduler.state_dict()["last_epoch"] == 2
    assert restored_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]

    # One more AdamW step from the original and from the restored copy: bitwise equal weights.
    _train_steps(model, optimizer, 1, seed=7, scheduler=scheduler)
    _train_steps(restored_model, restored_optimizer, 1, seed=7, scheduler=restored_scheduler)
    for original, restored in zip(model.state_dict().values(), restored_model.state_dict().values()):
        assert torch.equal(original, restored)
    assert json.loads((path / "metrics.json").read_text()) == {"f1": 0.5}


def test_grad_scaler_round_trip(tmp_path):
    model = SmallMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    for step in range(3):
        loss = model(torch.randn(2, 8), torch.tensor([0, 1]))["loss"]
        if step == 1:
            loss = loss * float("inf")  # overflow: the scaler backs off and skips the step
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    saved = scaler.state_dict()
    assert saved["scale"] != 2.0**10
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, scaler=scaler, trainer_state={})
    restored = torch.amp.GradScaler("cpu")
    load_checkpoint(path, model=SmallMLP(), optimizer=torch.optim.SGD(SmallMLP().parameters(), lr=0.1),
                    scaler=restored)
    assert restored.state_dict() == saved
    assert restored.get_scale() == scaler.get_scale()


def test_rng_states_restored(tmp_path):
    random.seed(1)
    np.random.seed(1)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    torch.manual_seed(1)
    path = save_checkpoint(tmp_path, 1, model=SmallMLP(), trainer_state={})
    draws_after_save = (random.random(), np.random.normal(), np.random.rand(3).tolist(), torch.rand(3))
    load_checkpoint(path, model=SmallMLP())
    draws_after_load = (random.random(), np.random.normal(), np.random.rand(3).tolist(), torch.rand(3))
    assert draws_after_save[:3] == draws_after_load[:3]
    assert torch.equal(draws_after_save[3], draws_after_load[3])
    # restore_rng=False leaves the generators alone.
    before = torch.rand(1)
    load_checkpoint(path, model=SmallMLP(), restore_rng=False)
    assert not torch.equal(torch.rand(1), before)


def test_every_state_file_loads_with_weights_only(tmp_path):
    model, optimizer, scheduler = _make_run()
    _train_steps(model, optimizer, 1, scheduler=scheduler)
    scaler = torch.amp.GradScaler("cpu")
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                           trainer_state={})
    loaded = {name: torch.load(path / name, weights_only=True)
              for name in ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pt")}
    assert set(loaded["optimizer.pt"]) == {"state", "param_groups"} and loaded["optimizer.pt"]["state"]
    assert loaded["scheduler.pt"]["last_epoch"] == 1
    assert loaded["scaler.pt"]["scale"] == scaler.get_scale()
    assert torch.equal(loaded["rng_state.pt"]["torch"], torch.get_rng_state())


def test_bitsandbytes_8bit_optimizer_state_round_trip(tmp_path):
    bitsandbytes = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = nn.Linear(4096, 2)  # >= 4096 elements: bnb keeps this state in 8 bits
    optimizer = bitsandbytes.optim.AdamW8bit(model.parameters(), lr=1e-3)
    try:
        model(torch.randn(3, 4096)).sum().backward()
        optimizer.step()
    except (RuntimeError, NotImplementedError) as error:  # a build without CPU kernels
        pytest.skip(f"bitsandbytes cannot step on CPU here: {error}")
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, trainer_state={})
    torch.load(path / "optimizer.pt", weights_only=True)
    restored = nn.Linear(4096, 2)
    restored_optimizer = bitsandbytes.optim.AdamW8bit(restored.parameters(), lr=1e-3)
    load_checkpoint(path, model=restored, optimizer=restored_optimizer)
    original_state = optimizer.state[model.weight]
    restored_state = restored_optimizer.state[restored.weight]
    assert restored_state["state1"].dtype == torch.uint8
    for key in ("state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(original_state[key], restored_state[key])


def test_crash_mid_save_leaves_no_checkpoint_and_rotation_cleans_up(tmp_path, monkeypatch):
    model, optimizer, scheduler = _make_run()
    first = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={})
    first_files = {name: (first / name).read_bytes() for name in os.listdir(first)}

    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if Path(path).name == "scheduler.pt":
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(save_module.torch, "save", failing_save)
    # A killed process cannot clean up after itself: make the cleanup a no-op to leave the temp dir.
    monkeypatch.setattr(save_module.shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={})
    monkeypatch.undo()

    assert not (tmp_path / "checkpoint-2").exists()
    temporary = tmp_path / f".tmp-checkpoint-2-{os.getpid()}"
    assert temporary.is_dir() and (temporary / "optimizer.pt").exists()
    assert {name: (first / name).read_bytes() for name in os.listdir(first)} == first_files
    assert list_checkpoints(tmp_path) == [first]
    assert latest_checkpoint(tmp_path) == first

    rotate_checkpoints(tmp_path, save_total_limit=None)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


def test_failed_save_removes_its_temp_dir(tmp_path, monkeypatch):
    def failing_save(obj, path, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(save_module.torch, "save", failing_save)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 5, model=SmallMLP(), trainer_state={})
    assert os.listdir(tmp_path) == []


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 4, model=SmallMLP(), trainer_state={"epoch": 0})
    path = save_checkpoint(tmp_path, 4, model=SmallMLP(), trainer_state={"epoch": 1})
    assert json.loads((path / "trainer_state.json").read_text())["epoch"] == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]


def test_list_checkpoints_sorts_by_step_and_skips_incomplete(tmp_path):
    for step in (10, 2, 100):
        _save_simple(tmp_path, step)
    (tmp_path / "checkpoint-50").mkdir()  # no COMPLETE marker
    (tmp_path / "checkpoint-x").mkdir()
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-10", "checkpoint-100"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-100"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_rotation_keeps_newest_plus_best(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _save_simple(tmp_path, step)
    deleted = rotate_checkpoints(tmp_path, 2, best_checkpoint="checkpoint-1")
    assert [path.name for path in deleted] == ["checkpoint-2", "checkpoint-3"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-4", "checkpoint-5"]
    # The best among the newest: exactly N remain.
    _save_simple(tmp_path, 6)
    rotate_checkpoints(tmp_path, 2, best_checkpoint=tmp_path / "checkpoint-5")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5", "checkpoint-6"]
    # 0 and None keep everything.
    _save_simple(tmp_path, 7)
    assert rotate_checkpoints(tmp_path, 0) == [] and rotate_checkpoints(tmp_path, None) == []
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5", "checkpoint-6", "checkpoint-7"]
    rotate_checkpoints(tmp_path, 1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-7"]
    with pytest.raises(ValueError, match=">= 0"):
        rotate_checkpoints(tmp_path, -1)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PAYLOAD_RAN",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_tampered_pickle_is_refused_and_does_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, optimizer, _ = _make_run()
    path = save_checkpoint(tmp_path / "run", 1, model=model, optimizer=optimizer, trainer_state={})
    with open(path / "optimizer.pt", "wb") as handle:
        pickle.dump({"state": {}, "param_groups": [], "evil": _Payload()}, handle)
    with pytest.raises(CheckpointError, match=r"refusing to load .*optimizer\.pt.*execute code"):
        load_checkpoint(path, model=SmallMLP(), optimizer=torch.optim.AdamW(SmallMLP().parameters()))
    assert not (tmp_path / "PAYLOAD_RAN").exists()

    (path / "rng_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"rng_state\.pt"):
        load_checkpoint(path, model=SmallMLP())


def test_not_a_checkpoint_errors_name_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", model=SmallMLP())
    run = tmp_path / "run"
    _save_simple(run, 3)
    with pytest.raises(CheckpointError, match=r"output directory, not a checkpoint; pass --resume .*checkpoint-3"):
        load_checkpoint(run, model=SmallMLP())
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume_checkpoint(tmp_path / "empty", run)
    assert resolve_resume_checkpoint("auto", run) == run / "checkpoint-3"
    assert resolve_resume_checkpoint("auto", tmp_path / "fresh") is None
    assert resolve_resume_checkpoint(None, run) is None
    # Wrong model: missing and unexpected keys listed.
    with pytest.raises(CheckpointError, match=r"missing keys \['weight'\], unexpected keys \['net\.0\.bias'"):
        load_checkpoint(run / "checkpoint-3", model=nn.Linear(8, 16, bias=False))
    # Optimizer requested but none saved.
    with pytest.raises(CheckpointError, match="has no optimizer.pt"):
        load_checkpoint(run / "checkpoint-3", model=SmallMLP(),
                        optimizer=torch.optim.SGD(SmallMLP().parameters(), lr=1))


@pytest.mark.parametrize("state, message", [
    ({"epoch": 0}, r"trainer_state\.json has no 'step': it is damaged or not looptrain's; resume from another"),
    ({"step": "3"}, r"trainer_state\.json: 'step' is \"3\", not int; it is damaged"),
    ({"step": True}, r"trainer_state\.json: 'step' is true, not int"),
    ([3], r"trainer_state\.json holds a JSON list, not the object of counters a checkpoint saves"),
])
def test_a_trainer_state_without_an_integer_step_names_the_file_and_the_key(tmp_path, state, message):
    path = _save_simple(tmp_path, 3)
    (path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + "/" + message):
        load_checkpoint(path, model=SmallMLP())


def test_a_resume_names_a_missing_or_mistyped_counter_of_its_trainer_state(tmp_path):
    from looptrain import resume

    model = SmallMLP()
    state = {"step": 3, "micro_step": 3, "epoch": 0, "batch_in_epoch": 3, "skipped_steps": 0, "last_eval": None,
             "last_eval_step": -1, "best": {}, "epoch_rng_state": None}
    path = save_checkpoint(tmp_path, 3, model=model, trainer_state={**state, "micro_step": None})
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: 'micro_step' is null, not int"):
        resume.load_training_checkpoint(path, model=model, optimizer=None, scheduler=None, precision=None,
                                        device=torch.device("cpu"))
    path = save_checkpoint(tmp_path, 4, model=model, trainer_state={**state, "epoch_rng_state": "lost"})
    with pytest.raises(CheckpointError, match=r"'epoch_rng_state' is \"lost\", not list \| None"):
        resume.load_training_checkpoint(path, model=model, optimizer=None, scheduler=None, precision=None,
                                        device=torch.device("cpu"))
    path = save_checkpoint(tmp_path, 5, model=model, trainer_state=state)
    saved, _ = resume.load_training_checkpoint(path, model=model, optimizer=None, scheduler=None, precision=None,
                                               device=torch.device("cpu"))
    assert {key: saved[key] for key in state} == state


class _TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight


def test_tied_weights_plain_module(tmp_path):
    torch.manual_seed(0)
    model = _TiedModel()
    path = save_checkpoint(tmp_path, 1, model=model, trainer_state={})
    restored = _TiedModel()
    load_checkpoint(path, model=restored)
    assert torch.equal(restored.embedding.weight, model.embedding.weight)
    assert restored.head.weight is restored.embedding.weight


def test_tiny_bert_checkpoint_loads_with_from_pretrained(tmp_path):
    from transformers import BertForSequenceClassification

    model = make_tiny_bert()
    path = save_checkpoint(tmp_path, 1, model=model, trainer_state={})
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    reloaded = BertForSequenceClassification.from_pretrained(path)
    for (name, original), (_, restored) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(original, restored), name
    into_existing = make_tiny_bert(seed=3)
    load_checkpoint(path, model=into_existing)
    assert torch.equal(into_existing.classifier.weight, model.classifier.weight)


def test_tied_hugging_face_model(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=20, max_position_embeddings=16)
    torch.manual_seed(0)
    model = BertForMaskedLM(config)
    path = save_checkpoint(tmp_path, 1, model=model, trainer_state={})
    torch.manual_seed(1)
    restored = BertForMaskedLM(config)
    load_checkpoint(path, model=restored)
    assert torch.equal(restored.cls.predictions.decoder.weight, model.bert.embeddings.word_embeddings.weight)


def test_is_better_and_best_tracker():
    assert is_better(0.5, None, "max") and is_better(0.6, 0.5, "max") and not is_better(0.5, 0.5, "max")
    assert is_better(0.4, 0.5, "min") and not is_better(float("nan"), 0.5, "max")
    with pytest.raises(ValueError, match="'max' or 'min'"):
        is_better(1.0, 0.0, "up")
    assert BestTracker("loss").mode == "min" and BestTracker("f1").mode == "max"
    # A tracker built directly agrees with LoopConfig on every lower-is-better name (it once maximised perplexity).
    from looptrain import LoopConfig

    for name in ("perplexity", "eval_ppl", "mae", "word_error_rate", "accuracy", "f1_binary"):
        assert BestTracker(name).mode == LoopConfig().best_mode_for(name), name
    assert BestTracker("perplexity").mode == "min" and BestTracker("accuracy").mode == "max"

    tracker = BestTracker("f1")
    assert tracker.update({"f1": 0.5, "loss": 1.0}, "checkpoint-10", step=10)
    assert not tracker.update({"eval_f1": 0.4}, "checkpoint-20", step=20)
    assert tracker.update({"f1": 0.7}, "checkpoint-30", step=30)
    saved = json.loads(json.dumps(tracker.state_dict()))
    assert saved == {"metric_name": "f1", "mode": "max", "best_metric": 0.7,
                     "best_checkpoint": "checkpoint-30", "best_step": 30}
    resumed = BestTracker("f1")
    resumed.load_state_dict(saved)
    assert resumed.best_checkpoint == "checkpoint-30"
    with pytest.raises(KeyError, match="--metric-for-best"):
        tracker.update({"accuracy": 0.9}, "checkpoint-40")
    with pytest.raises(CheckpointError, match="same --metric-for-best"):
        BestTracker("loss").load_state_dict(saved)


def test_trainer_state_numbers_from_numpy_and_torch(tmp_path):
    path = save_checkpoint(tmp_path, 1, model=SmallMLP(),
                           trainer_state={"loss": torch.tensor(0.25), "epoch": np.int64(2)})
    assert load_checkpoint(path, model=SmallMLP()) == {"step": 1, "loss": 0.25, "epoch": 2}
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        save_checkpoint(tmp_path, 2, model=SmallMLP(), trainer_state={"bad": object()})
    assert list_checkpoints(tmp_path) == [path] and sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


def test_crash_between_the_renames_of_a_resave_is_recovered(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 4, model=SmallMLP(), trainer_state={"epoch": 0})
    real_rename = os.rename
    calls = []

    def rename_then_die(source, destination):
        calls.append(Path(destination).name)
        if len(calls) == 2:  # old renamed aside; the process dies before the new one moves in
            raise KeyboardInterrupt
        return real_rename(source, destination)

    monkeypatch.setattr(files_module.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, model=SmallMLP(), trainer_state={"epoch": 1})
    monkeypatch.undo()
    assert list_checkpoints(tmp_path) == []
    rotate_checkpoints(tmp_path, 3)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    assert json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["epoch"] == 1


def test_writing_a_model_prints_no_bar_of_its_own_and_leaves_transformers_bars_as_they_were(tmp_path, capfd):
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    try:
        save_module._save_model_weights(make_tiny_bert(), tmp_path)
        assert (tmp_path / "model.safetensors").exists()
        assert "Writing model shards" not in capfd.readouterr().err
        assert transformers_logging.is_progress_bar_enabled()
    finally:
        if not shown:
            transformers_logging.disable_progress_bar()

"""One description of a strategy: a lever declared once reaches both command lines, the estimator and the planner.

`looptrain.Strategy`'s field metadata generates the flags of `looptrain-finetune` and of
`python -m looptrain.memory`; the estimator prices every lever but the batching ones; the planner's
candidates are `dataclasses.replace` copies of the user's strategy. The end-to-end test declares a lever
that exists only here (`freeze_pooler`) and follows it everywhere.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from looptrain import LoopConfig, Strategy, data, estimation, planning
from looptrain import strategy as strategies
from looptrain.cli import estimate as estimate_cli
from looptrain.cli import finetune
from looptrain.strategy import lever, levers

from conftest import make_tiny_bert, make_tiny_tokenizer, write_csv


@dataclasses.dataclass(kw_only=True)
class PoolerStrategy(Strategy):
    """A strategy with one lever more, declared the way a new lever is: one field and its implementation."""

    freeze_pooler: bool = lever(False, flag="--freeze-pooler", applied_by="model",
                                help="freeze BERT's pooler: no grads or optimizer state for it")

    def prepare_model(self, model):
        report = super().prepare_model(model)
        if self.freeze_pooler:
            for parameter in model.bert.pooler.parameters():
                parameter.requires_grad_(False)
        return report


@pytest.fixture
def pooler_lever(monkeypatch):
    """`looptrain.strategy.Strategy` is the strategy with the new lever, as if it had been declared there."""
    monkeypatch.setattr(strategies, "Strategy", PoolerStrategy)
    return PoolerStrategy


def pooler_numel(model) -> int:
    return sum(parameter.numel() for parameter in model.bert.pooler.parameters())


def test_every_lever_is_a_flag_of_both_command_lines_and_an_option_of_the_estimator():
    finetune_flags = {option for action in finetune.build_parser()._actions for option in action.option_strings}
    estimate_flags = {option for action in estimate_cli.build_parser()._actions for option in action.option_strings}
    priced = set(Strategy().estimate_options())
    for spec in levers(Strategy):
        meta = spec.metadata["lever"]
        assert meta["flag"] in finetune_flags, spec.name
        # One shape is priced, so the batches' levers get no flag there, but the micro-batch's rows and packing
        # (a packed row builds its block mask, which the estimate prices from `Strategy.packing`).
        if meta["applied_by"] == "batches" and spec.name not in ("batch_size", "packing"):
            assert meta["flag"] not in estimate_flags and spec.name not in priced
        else:
            assert meta["flag"] in estimate_flags, spec.name
            assert spec.name in priced or spec.name in ("batch_size", "packing")
    # The loop's levers are LoopConfig fields, declared once (LoopLevers) and inherited.
    assert set(strategies.LoopLevers.__dataclass_fields__) <= set(LoopConfig.__dataclass_fields__)


def test_a_strategys_flags_parse_back_to_the_same_strategy():
    strategy = Strategy(batch_size=4, accum_steps=3, precision="bf16", optimizer="sgd", foreach=False,
                        gradient_checkpointing=True, checkpoint_every=2, freeze_layers=1, padding="max_length",
                        group_by_length=True, weights="bf16", stochastic_rounding=False, grad_dtype="fp32")
    flags = strategy.flags()
    assert flags[:4] == ["--batch-size", "4", "--accum", "3"]  # the split first, then every lever off its default
    assert {"--no-foreach", "--no-stochastic-rounding", "--group-by-length", "--grad-checkpoint"} <= set(flags)
    args = finetune.build_parser().parse_args(flags)
    assert finetune.strategy_of(args) == strategy
    assert Strategy().flags() == ["--batch-size", "8", "--accum", "1"]


def test_bad_lever_values_are_named_by_field_and_flag(capsys):
    with pytest.raises(ValueError, match=r"padding must be one of dynamic, max_length \(got 'some'\)"):
        Strategy(padding="some")
    with pytest.raises(ValueError, match=r"freeze_layers must be >= 0 \(got -1\)"):
        Strategy(freeze_layers=-1)
    with pytest.raises(ValueError, match=r"foreach/fused apply to adamw and sgd only, not 'adafactor'"):
        Strategy(optimizer="adafactor", foreach=False)
    with pytest.raises(TypeError, match=r"unknown strategy option\(s\) precison; the levers are: accum_steps, "):
        estimation.estimate(make_tiny_bert(), 2, 8, precison="bf16")
    with pytest.raises(SystemExit) as exited:
        finetune.build_parser().parse_args(["--freeze-layers", "-1"])
    assert exited.value.code == 2
    assert "argument --freeze-layers: must be >= 0 (got -1)" in capsys.readouterr().err


def test_the_estimator_takes_a_strategy_or_its_fields_as_keywords():
    model = make_tiny_bert(num_labels=2)
    strategy = Strategy(optimizer="adafactor", gradient_checkpointing=True, accum_steps=2)
    as_object = estimation.estimate(model, 2, 16, strategy)
    as_keywords = estimation.estimate(model, 2, 16, optimizer="adafactor", gradient_checkpointing=True, accum_steps=2)
    assert as_object["peak_memory_bytes"] == as_keywords["peak_memory_bytes"]
    assert as_object["memory_breakdown"] == as_keywords["memory_breakdown"]
    replaced = estimation.estimate(model, 2, 16, strategy, optimizer="adamw")  # keywords replace the strategy's fields
    assert replaced["memory_breakdown"]["optimizer_state"] > as_object["memory_breakdown"]["optimizer_state"]


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_a_lever_declared_once_reaches_both_command_lines_the_estimator_and_the_planner(
        pooler_lever, model_dir, tmp_path, capsys):
    model = make_tiny_bert(num_labels=2)
    pooled = pooler_numel(model)
    assert pooled > 0

    # 1. Both command lines have the flag, from the field's metadata alone.
    args = finetune.build_parser().parse_args(["--freeze-pooler", "--batch-size", "4"])
    assert finetune.strategy_of(args) == PoolerStrategy(batch_size=4, freeze_pooler=True)
    assert estimate_cli._parse_arguments(["--preset", "bert-base", "--freeze-pooler"]).freeze_pooler is True

    # 2. The estimator prices it: no gradient and no AdamW state for the pooler (exp_avg and exp_avg_sq, 8 B per
    #    element, and a 4-byte step counter per tensor).
    plain = estimation.estimate(model, 2, 16)
    frozen = estimation.estimate(model, 2, 16, freeze_pooler=True)
    assert plain["trainable_parameters"] - frozen["trainable_parameters"] == pooled
    saved = plain["memory_breakdown"]["optimizer_state"] - frozen["memory_breakdown"]["optimizer_state"]
    assert saved == 8 * pooled + 4 * len(list(model.bert.pooler.parameters()))
    config = tmp_path / "config.json"
    model.config.to_json_file(config)
    assert estimate_cli.main(["--config", str(config), "--batch-size", "2", "--seq-len", "16",
                              "--freeze-pooler"]) == 0
    assert "| as given |" in capsys.readouterr().out

    # 3. The planner's candidates are the user's strategy with the searched fields replaced: the lever stays,
    #    every estimate prices it, and the winner's command line names it.
    tokenizer = make_tiny_tokenizer()
    train_set = data.tokenize(data.read_classification_data(write_csv(tmp_path / "train.csv", 32)), tokenizer, 32)
    collator = data.DynamicPaddingCollator(tokenizer, max_length=32)
    reference = make_tiny_bert(num_labels=2)
    result = planning.plan(model, train_set, collator, memory_budget=64 * 2**20, effective_batch=8,
                           base=PoolerStrategy(freeze_pooler=True), probe=False)
    assert result.candidates and all(isinstance(c.settings, PoolerStrategy) and c.settings.freeze_pooler
                                      for c in result.candidates)
    assert "--freeze-pooler" in result.winner.settings.flags()
    assert not any(parameter.requires_grad for parameter in model.bert.pooler.parameters())  # applied, as runs do
    winner, width = result.winner.settings, result.worst_width
    assert result.winner.estimated_peak_bytes == estimation.estimate(
        reference, winner.batch_size, width, winner)["peak_memory_bytes"]
    assert result.winner.estimated_peak_bytes < estimation.estimate(
        reference, winner.batch_size, width, dataclasses.replace(winner, freeze_pooler=False))["peak_memory_bytes"]

    # 4. A real run carries it out: the pooler leaves training exactly as it came in.
    csv = write_csv(tmp_path / "run.csv", 24)
    assert finetune.main(["--model", str(model_dir), "--data", str(csv), "--output-dir", str(tmp_path / "run"),
                          "--max-length", "32", "--lr", "1e-2", "--batch-size", "8", "--max-steps", "2",
                          "--no-track-memory", "--no-progress-bar", "--freeze-pooler"]) == 0
    before = load_file(str(model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    pooler_names = [name for name in before if "pooler" in name]
    assert pooler_names and all(torch.equal(before[name], after["bert." + name]) for name in pooler_names)
    moved = [name for name in before if "pooler" not in name and "encoder.layer.1" in name]
    assert any(not torch.equal(before[name], after["bert." + name]) for name in moved)
    arguments = json.loads((tmp_path / "run" / "run_config.json").read_text())["arguments"]
    assert arguments["freeze_pooler"] is True


def test_lora_levers_parse_check_and_round_trip():
    parser = finetune.build_parser()
    args = parser.parse_args(["--model", "m", "--data", "d", "--lora", "8", "--lora-dropout", "0.05",
                              "--lora-targets", "q_proj,v_proj", "--qlora"])
    strategy = finetune.strategy_of(args)
    assert (strategy.lora_rank, strategy.lora_dropout, strategy.lora_targets, strategy.qlora) == \
        (8, 0.05, "q_proj,v_proj", True)
    assert finetune.strategy_of(parser.parse_args(["--model", "m", "--data", "d", *strategy.flags()])) == strategy
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--data", "d", "--lora-dropout", "-0.1"])
    with pytest.raises(strategies.ConfigError, match=r"qlora need LoRA: set lora_rank \(--lora R"):
        Strategy(qlora=True)
    with pytest.raises(strategies.ConfigError, match=r"freezes the whole base already; drop freeze_layers"):
        Strategy(lora_rank=4, freeze_layers=1)
    with pytest.raises(strategies.ConfigError, match=r"lora_dropout must be in \[0, 1\)"):
        Strategy(lora_rank=4, lora_dropout=1.0)


def test_wrap_model_gives_peft_adapters_on_every_block_linear_and_trains_the_head_fully():
    model = make_tiny_bert()
    wrapped = Strategy(lora_rank=4).wrap_model(model)
    trainable = {name for name, parameter in wrapped.named_parameters() if parameter.requires_grad}
    # 2 blocks x (query, key, value, attention output, intermediate, output) x (A, B), and the classifier
    assert sum(".lora_A." in name for name in trainable) == sum(".lora_B." in name for name in trainable) == 12
    assert not any("pooler" in name and "lora" in name for name in trainable)  # pooler.dense is no block Linear
    assert {name for name in trainable if "lora" not in name} == {
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias"}
    assert Strategy(lora_rank=4).wrap_model(wrapped) is wrapped  # a wrapped model stays as it is
    assert Strategy().wrap_model(model) is model

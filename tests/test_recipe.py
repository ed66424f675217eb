"""`--config FILE` recipes: the file's flags under the command line's, every key form, a run's own recipe that trains it
again bitwise, --plan-only's --save-config, and the estimate's recipes."""

from __future__ import annotations

import json

import pytest
import torch

from looptrain.cli import estimate as estimate_cli
from looptrain.cli import finetune, plan
from looptrain.cli.recipe import expand_config
from looptrain.strategy import Strategy

from conftest import write_csv


def parsed(argv: list[str]):
    """finetune's flags of `argv` (a --config written out in front), and the command line it became."""
    parser = finetune.build_parser()
    argv = expand_config(parser, argv)
    return parser.parse_args(argv), argv


def write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_command_line_overrides_the_file_and_the_files_flags_count_as_given(tmp_path):
    recipe = write(tmp_path / "run.yaml", "lr: 0.1\nbatch_size: 4\ngrad_checkpoint: true\nseed: 7\n")
    args, argv = parsed(["--config", recipe, "--lr", "0.01", "--seed=9"])
    assert (args.lr, args.batch_size, args.gradient_checkpointing, args.seed) == (0.01, 4, True, 9)
    assert argv == ["--batch-size=4", "--grad-checkpoint", "--lr", "0.01", "--seed=9"]  # each flag once, typed last
    assert {"--batch-size", "--grad-checkpoint"} <= finetune.Process(argv=tuple(argv)).given  # kept by a planner
    assert args.config is None  # the recipe was read, not passed on


@pytest.mark.parametrize("text, suffix", [
    ("accum: 2\ngrad-checkpoint: true\nno_foreach: true\neval_every: no\nmax_grad_norm: null\n", ".yaml"),
    ("accum_steps: 2\ngradient_checkpointing: true\nforeach: false\neval-every: 'no'\nmax-grad-norm: none\n",
     ".yml"),
    ('{"accum": 2, "grad_checkpoint": true, "foreach": false, "eval_every": "no", "max_grad_norm": null}', ".json"),
])
def test_a_key_is_a_flags_name_or_its_fields_with_dashes_or_underscores(text, suffix, tmp_path):
    """YAML reads booleans as YAML 1.2 does: `eval_every: no` is the string "no", as on the command line."""
    args, _ = parsed(["--config", write(tmp_path / f"run{suffix}", text)])
    assert (args.accum_steps, args.gradient_checkpointing, args.foreach, args.eval_every, args.max_grad_norm) == \
        (2, True, False, "no", None)


def test_a_switch_set_to_its_default_and_a_null_leave_the_flag_out(tmp_path):
    recipe = write(tmp_path / "run.yaml", "amp: false\nstochastic_rounding: true\neval_data: null\n")
    assert parsed(["--config", recipe])[1] == []


def test_a_list_reaches_a_flag_of_several_values_or_one_whose_repeats_add_up(tmp_path):
    """A list for a one-value flag would keep its last item only: refused (tests/test_bad_inputs.py)."""
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--names", nargs="+")
    parser.add_argument("--tag", action="append")
    parser.add_argument("--seed", type=int)
    recipe = write(tmp_path / "run.yaml", "names: [a, b]\ntag: [x, y]\n")
    args = parser.parse_args(expand_config(parser, ["--config", recipe]))
    assert (args.names, args.tag) == (["a", "b"], ["x", "y"])
    with pytest.raises(SystemExit):
        expand_config(parser, ["--config", write(tmp_path / "list.yaml", "seed: [1, 2]\n")])


# ------------------------------------------------------------------ a run's recipe trains it again
def final_weights(output_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(output_dir / "final" / "model.safetensors")


def test_a_finished_runs_config_yaml_trains_the_same_weights_bitwise(model_dir, tmp_path):
    """Flags off their defaults (the split, the schedule, the seed, checkpointing): a recipe that lost any of them
    would train other weights."""
    import yaml

    train = write_csv(tmp_path / "train.csv", 32)
    first, second = tmp_path / "first", tmp_path / "second"
    assert finetune.main(["--model", str(model_dir), "--data", str(train), "--output-dir", str(first),
                          "--max-length", "32", "--max-steps", "3", "--batch-size", "4", "--accum", "2", "--lr",
                          "1e-3", "--scheduler", "cosine", "--seed", "3", "--grad-checkpoint", "--eval-every", "no",
                          "--no-track-memory", "--no-progress-bar"]) == 0
    recipe = yaml.safe_load((first / "config.yaml").read_text(encoding="utf-8"))
    assert recipe == {"model": str(model_dir), "data": str(train), "accum": 2, "grad_checkpoint": True,
                      "batch_size": 4, "lr": 0.001, "scheduler": "cosine", "max_length": 32, "no_track_memory": True,
                      "no_progress_bar": True, "max_steps": 3, "seed": 3, "eval_every": "no",
                      "output_dir": str(first)}
    assert finetune.main(["--config", str(first / "config.yaml"), "--output-dir", str(second)]) == 0

    def arguments(run):
        return json.loads((run / "run_config.json").read_text(encoding="utf-8"))["arguments"]

    assert {**arguments(second), "output_dir": str(first)} == arguments(first)  # same strategy, data, seed
    expected, trained = final_weights(first), final_weights(second)
    assert expected.keys() == trained.keys()
    for name, tensor in expected.items():
        assert torch.equal(trained[name], tensor), name


def test_plan_only_saves_the_planned_run_as_a_recipe_that_trains_the_winner(model_dir, tmp_path, monkeypatch, capsys):
    """looptrain-plan reads memory_budget from the file; the saved recipe holds the winner's levers, no budget."""
    import yaml

    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    train = write_csv(tmp_path / "train.csv", 32)
    recipe = write(tmp_path / "budget.yaml", f"model: {model_dir}\ndata: {train}\nmax_length: 32\nmemory_budget: 2GiB\n"
                                             "effective_batch: 8\nbudget_meter: tensors\nmax_steps: 2\n")
    saved = tmp_path / "planned.yaml"
    assert plan.main(["--config", recipe, "--plan-time", "0", "--json", "--save-config", str(saved)]) == 0
    winner = Strategy(**json.loads(capsys.readouterr().out)["settings"])
    values = yaml.safe_load(saved.read_text(encoding="utf-8"))
    assert not {"memory_budget", "effective_batch", "budget_meter", "plan_only", "json", "save_config"} & set(values)
    args, _ = parsed(["--config", str(saved)])
    assert finetune.strategy_of(args) == winner
    assert (args.model, args.data, args.max_steps, args.memory_budget) == (str(model_dir), str(train), 2, None)


def test_save_config_needs_plan_only(model_dir, tmp_path, capsys):
    assert finetune.main(["--model", str(model_dir), "--save-config", str(tmp_path / "x.yaml")]) == 2
    assert "--save-config writes the plan of --plan-only as a recipe: add --plan-only" in capsys.readouterr().err


# ------------------------------------------------------------------ the estimate
def test_the_estimate_reads_a_recipe_and_its_flags_override_it(tmp_path, capsys):
    from conftest import make_tiny_bert

    model = tmp_path / "config.json"
    make_tiny_bert(num_labels=2).config.to_json_file(model)
    recipe = write(tmp_path / "estimate.yaml", f"model: {model}\nbatch_size: 4\nseq_len: 16\ngrad_checkpoint: true\n"
                                               "optim: adafactor\n")

    def estimated(argv):
        assert estimate_cli.main([*argv, "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        return result["peak_memory_bytes"], result["flags"], result["batch_size"], result["seq_len"]

    assert estimated(["--config", recipe]) == estimated(["--model", str(model), "--batch-size", "4", "--seq-len", "16",
                                                         "--grad-checkpoint", "--optim", "adafactor"])
    assert estimated(["--config", recipe, "--batch-size", "2"])[2] == 2


def test_the_estimate_reads_a_models_config_json_given_to_config_as_the_model(tmp_path, capsys):
    """--config config.json named the model's config before recipes: a JSON mapping with model_type still does."""
    from conftest import make_tiny_bert

    config = tmp_path / "config.json"
    make_tiny_bert(num_labels=2).config.to_json_file(config)
    assert estimate_cli.main(["--config", str(config), "--batch-size", "2", "--seq-len", "16"]) == 0
    assert "| as given |" in capsys.readouterr().out


def test_the_estimate_needs_a_model_from_the_command_line_or_the_recipe(tmp_path, capsys):
    recipe = write(tmp_path / "estimate.yaml", "batch_size: 4\n")
    with pytest.raises(SystemExit) as exit_info:
        estimate_cli.main(["--config", recipe])
    assert exit_info.value.code == 2
    assert "one of the arguments --preset --model is required (or preset or model in the --config file)" in \
        capsys.readouterr().err


def test_loop_configs_switched_fields_may_be_named_by_their_field(tmp_path):
    recipe = write(tmp_path / "run.yaml", "track_memory: false\nprogress_bar: true\n")
    parser = finetune.build_parser()
    args = parser.parse_args(expand_config(parser, ["--config", recipe], finetune.SWITCHED_FIELDS))
    assert (args.no_track_memory, args.no_progress_bar) == (True, False)


def test_a_runs_recipe_is_its_own_file(tmp_path):
    """config.yaml belongs to its run: --overwrite moves it aside with the run, predict and --save-config never write
    it (`looptrain.ledger.run_file_owner`)."""
    from looptrain.checkpoint import write_json_atomic
    from looptrain.ledger import run_file_owner

    write_json_atomic(tmp_path / "run" / "run.json", {"status": "finished"})
    assert run_file_owner(tmp_path / "run" / "config.yaml") == (tmp_path / "run").resolve()

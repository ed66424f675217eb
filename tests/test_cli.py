"""The command lines as a package: the console scripts setup.cfg declares resolve, and exit with main's code."""

from __future__ import annotations

import configparser
import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from looptrain.cli import finetune, plan

ROOT = Path(__file__).resolve().parent.parent
EXPECTED_SCRIPTS = {"looptrain-finetune", "looptrain-plan", "looptrain-estimate", "looptrain-predict",
                    "looptrain-report"}


def declared_console_scripts() -> dict[str, str]:
    """setup.cfg's console_scripts: name -> "module:function"."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    lines = parser.get("options.entry_points", "console_scripts", fallback="").strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines if line.strip())


def test_every_command_line_is_declared_as_a_console_script():
    assert EXPECTED_SCRIPTS <= set(declared_console_scripts())


@pytest.mark.parametrize("name", sorted(EXPECTED_SCRIPTS))
def test_console_script_resolves_to_a_callable(name):
    module_name, _, function_name = declared_console_scripts()[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if module_name == "looptrain.cli.estimate" and error.name == module_name:
            pytest.skip("looptrain.cli.estimate is created by the estimate command line's move (planning/ layer); "
                        "this branch does not have it yet")
        raise
    assert callable(getattr(module, function_name)), f"{name}: {module_name}:{function_name} is not callable"


def test_finetune_entry_point_exits_with_the_code_main_returns(monkeypatch):
    calls = []
    monkeypatch.setattr(finetune, "main", lambda **options: calls.append(options) or 3)
    with pytest.raises(SystemExit) as exit_info:
        finetune.main_entry()
    assert exit_info.value.code == 3
    assert calls == [{"owns_process": True}]  # the console script's process is the run's: the allocator is its to fix


def test_plan_entry_point_exits_with_the_code_main_returns(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["looptrain-plan", "--model", "unused"])  # no --memory-budget: a user error
    with pytest.raises(SystemExit) as exit_info:
        plan.main_entry()
    assert exit_info.value.code == 2
    assert "--memory-budget SIZE is required" in capsys.readouterr().err


@pytest.mark.parametrize("name", [*sorted(EXPECTED_SCRIPTS), "python -m looptrain.memory"])
def test_help_prints_the_usage_and_exits_0(name, monkeypatch, capsys):
    """Every console script's --help, and the estimate's module run: `looptrain-plan --help` once said that
    --memory-budget is required instead."""
    import runpy

    monkeypatch.setattr(sys, "argv", [name.split()[-1], "--help"])
    with pytest.raises(SystemExit) as exit_info:
        if name.startswith("python -m "):
            monkeypatch.delitem(sys.modules, "looptrain.memory.__main__", raising=False)
            runpy.run_module(name.split()[-1], run_name="__main__", alter_sys=True)
        else:
            module_name, _, function_name = declared_console_scripts()[name].partition(":")
            getattr(importlib.import_module(module_name), function_name)()
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err
    assert captured.out.startswith("usage:") and "--help" in captured.out and "error" not in captured.err


def test_the_scripts_shim_runs_from_a_checkout(tmp_path):
    """`python scripts/finetune.py` is public contract: the shim finds its checkout's looptrain from any directory.

    The one test that runs a script by path; every other test runs `main(argv)` or `python -m looptrain.cli.finetune`.
    """
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "finetune.py"), "--help"], cwd=tmp_path,
                          env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: finetune.py") and "--memory-budget" in done.stdout


def test_the_command_line_is_parsed_once_into_a_frozen_request_and_a_plan_gives_a_new_one():
    from looptrain.strategy import Strategy

    argv = ["--model", "m", "--data", "d.csv", "--batch-size", "8", "--effective-batch", "32"]
    request = finetune.request_of(finetune.build_parser().parse_args(argv), finetune.Process(argv=tuple(argv)))
    assert (request.flags.accum_steps, request.flags.metric_for_best) == (4, "f1")  # resolved once, from the flags
    assert request.strategy == Strategy(batch_size=8, accum_steps=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.budget = None
    with pytest.raises(TypeError):
        request.flags.values["lr"] = 1.0
    planned = request.planned(Strategy(batch_size=2, accum_steps=16, gradient_checkpointing=True))
    assert (planned.flags.batch_size, planned.flags.accum_steps, planned.strategy.gradient_checkpointing) == \
        (2, 16, True)
    assert (request.flags.batch_size, request.strategy.gradient_checkpointing) == (8, False)  # the asked one stays


def test_every_run_option_is_declared_like_a_lever_and_its_flag_comes_from_the_declaration():
    from looptrain import strategy
    from looptrain.config import LoopConfig

    assert all("lever" in spec.metadata or "option" in spec.metadata for spec in dataclasses.fields(LoopConfig))
    actions = {action.dest: action for action in finetune.build_parser()._actions}
    options = [spec for spec in strategy.declared(LoopConfig) if "option" in spec.metadata]
    for spec in options:
        meta = spec.metadata["option"]
        assert meta["help"], spec.name
        if meta["flag"]:
            assert actions[spec.name].option_strings == [meta["flag"]], spec.name
    assert strategy.flag_names(LoopConfig)["unfreeze_every"] == "--unfreeze-schedule"
    assert finetune.build_parser().parse_args(["--eval-every", "5", "--max-grad-norm", "none"]).max_grad_norm is None


# ------------------------------------------------------------------ usage lines: the name the user typed
@pytest.mark.parametrize("name", sorted(EXPECTED_SCRIPTS))
def test_each_console_script_names_itself_in_its_usage_line(name, monkeypatch, capsys):
    """Installed as bin/looptrain-predict, the usage line says looptrain-predict (not predict.py)."""
    module_name, _, function_name = declared_console_scripts()[name].partition(":")
    entry = getattr(importlib.import_module(module_name), function_name)
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{name}", "--help", "--memory-budget", "1GiB"])
    with pytest.raises(SystemExit) as exit_info:
        entry()
    assert exit_info.value.code in (0, None)
    assert capsys.readouterr().out.startswith(f"usage: {name} ")


@pytest.mark.parametrize("module, typed", [("looptrain.memory", "python -m looptrain.memory"),
                                           ("looptrain.cli.predict", "python -m looptrain.cli.predict"),
                                           ("looptrain.cli.finetune", "python -m looptrain.cli.finetune"),
                                           ("looptrain.report", "python -m looptrain.report")])
def test_a_module_run_names_the_module_in_its_usage_line(module, typed, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["ignored", "--help"])
    monkeypatch.delitem(sys.modules, module, raising=False)  # run afresh, as `python -m` does
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert exit_info.value.code in (0, None)
    assert capsys.readouterr().out.startswith(f"usage: {typed} ")


def test_a_script_or_a_python_caller_sees_the_scripts_name(monkeypatch, capsys):
    from looptrain.cli import estimate, predict

    monkeypatch.setattr(sys, "argv", ["scripts/predict.py"])
    for main, script in ((predict.main, "predict.py"), (finetune.main, "finetune.py"), (estimate.main, "estimate.py")):
        with pytest.raises(SystemExit):
            main(["--help"])
        assert capsys.readouterr().out.startswith(f"usage: {script} ")

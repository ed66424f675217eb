"""The examples in examples/ run on tiny sizes, each with one overridden hook, and learn."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from looptrain import Loop

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overridden_hooks(loop_class: type) -> set[str]:
    """The Loop methods a subclass defines itself."""
    return {name for name in vars(loop_class) if callable(getattr(Loop, name, None))}


@pytest.fixture(scope="module")
def char_lm():
    return load_example("char_lm")


def test_char_lm_learns_with_compute_loss_alone(char_lm, capsys):
    assert overridden_hooks(char_lm.CharLMLoop) == {"compute_loss"}
    summary = char_lm.main(["--steps", "45", "--batch-size", "8", "--context", "32", "--width", "32"])
    characters = len(set(char_lm.TEXT))
    scores = summary["final_eval"]
    # Evaluation ran the subclass's compute_loss: loss and perplexity (token-level), no class scores.
    assert set(scores) == {"loss", "perplexity", "count"}
    assert scores["perplexity"] == pytest.approx(math.exp(scores["loss"]))
    assert scores["count"] == 32 * 32  # 32 eval sequences of 32 target characters
    assert scores["perplexity"] < 0.6 * characters  # uniform guessing scores `characters`
    assert summary["metric_for_best"] == "perplexity" and summary["best_checkpoint"] is None  # no output_dir
    # Throughput counts the (x, y) batches' tokens, not only their rows.
    assert summary["train_tokens"] == 32 * summary["train_samples"] == 32 * 8 * 45
    # The rates are rounded to 3 decimals: they agree to what that rounding allows, however slow the machine.
    assert abs(summary["train_tokens_per_s"] - 32 * summary["train_samples_per_s"]) <= 0.0005 * (32 + 1)
    assert "eval perplexity" in capsys.readouterr().out


def test_char_lm_accumulation_over_tuple_batches_is_exact(char_lm):
    # 2 micro-batches of 4 sequences x accumulation 2 == batches of 8: the loop counts y's elements.
    def train(batch_size: int, accum: int) -> torch.nn.Module:
        characters = sorted(set(char_lm.TEXT))
        ids = torch.tensor([characters.index(c) for c in char_lm.TEXT])
        pairs = char_lm.windows_of(ids, 16, 32, torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        model = char_lm.CharGPT(len(characters), 16, width=16, layers=1)
        loop = char_lm.CharLMLoop(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                  char_lm.batched(pairs, batch_size),
                                  config=char_lm.LoopConfig(accum_steps=accum, max_grad_norm=None, eval_every="no",
                                                            progress_bar=False, track_memory=False, device="cpu"))
        loop.fit()
        return model

    reference, accumulated = train(8, 1), train(4, 2)
    for (name, expected), actual in zip(reference.state_dict().items(), accumulated.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_token_classification_learns_with_compute_loss_alone():
    example = load_example("token_classification")
    assert overridden_hooks(example.TaggingLoop) == {"compute_loss"}
    summary = example.main(["--train-sentences", "400", "--eval-sentences", "100", "--epochs", "2"])
    scores = summary["final_eval"]
    # The logits the tagger produced inside compute_loss were scored against the labels (-100 skipped).
    assert {"loss", "accuracy", "f1", "count"} <= set(scores) and "perplexity" not in scores
    _, evaluation, vocabulary = example.synthetic_data(400, 100, seed=0)
    eval_labels = torch.cat([batch["labels"].flatten() for batch in example.batches_of(evaluation, vocabulary, 64)])
    labelled = eval_labels[eval_labels != -100]
    assert scores["count"] == labelled.numel()
    majority_accuracy = (labelled == 0).float().mean().item()  # always "O"
    assert scores["accuracy"] > majority_accuracy + 0.05
    assert scores["f1"] > 0.5  # the majority tagger's macro F1 over 4 tags is below 0.25


# ------------------------------------------------------------------ docs/sft.md: a recipe, a run, predictions
SFT_PAGE = EXAMPLES.parent / "docs" / "sft.md"
TINY_RUN = ["--max-length", "40", "--max-steps", "2", "--no-progress-bar", "--no-track-memory"]  # the tiny Llama's


def page_commands(page: Path) -> list[list[str]]:
    """The looptrain commands of a page's bash blocks, each split as a shell would."""
    import re
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.startswith("looptrain-")]


@pytest.mark.slow  # 3.5 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
@pytest.mark.report  # the page says the run leaves report.png: its runs draw it
def test_the_sft_page_runs_as_written(tmp_path, monkeypatch):
    """Each command of docs/sft.md, from the checkout's root as the page says, with the recipe of examples/sft/: a
    tiny Llama (with a chat template) in place of Qwen and two updates, given on the command line, which overrides
    the recipe; runs/ goes under tmp_path."""
    import json

    import yaml
    from test_finetune_causal_lm import CHAT_TEMPLATE, save_tiny_llama

    from looptrain.cli import finetune, predict

    model = save_tiny_llama(tmp_path / "tiny-llama", CHAT_TEMPLATE)
    monkeypatch.chdir(EXAMPLES.parent)  # the recipe's paths are relative to the checkout's root
    commands = page_commands(SFT_PAGE)
    assert [command[0] for command in commands] == ["looptrain-finetune", "looptrain-finetune", "looptrain-predict"]

    def here(token: str) -> str:  # the page's runs/ under tmp_path
        return str(tmp_path / token) if token.startswith("runs/") else token

    recipe = yaml.safe_load((EXAMPLES / "sft" / "recipe.yaml").read_text(encoding="utf-8"))
    for name, *argv in commands:
        argv = [here(token) for token in argv]
        if name == "looptrain-finetune":
            output = [] if "--output-dir" in argv else ["--output-dir", here(recipe["output_dir"])]
            assert finetune.main([*argv, "--model", str(model), *TINY_RUN, *output]) == 0
        else:
            assert predict.main([*argv, "--no-progress-bar"]) == 0
    for run in ("runs/sft", "runs/sft-chat"):
        summary = json.loads((tmp_path / run / "summary.json").read_text(encoding="utf-8"))
        assert summary["task"] == "causal-lm" and summary["optimizer_steps"] == 2
        assert set(summary["final_eval"]) >= {"loss", "perplexity"}  # eval_split held rows out
        assert (tmp_path / run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # matplotlib: the test extra
        written = yaml.safe_load((tmp_path / run / "config.yaml").read_text(encoding="utf-8"))
        assert {key: written[key] for key in ("task", "accum", "grad_checkpoint", "lr")} == \
            {key: recipe[key] for key in ("task", "accum", "grad_checkpoint", "lr")}
        assert "response_column" not in written  # TRL's completion column is found without one
    predictions = (tmp_path / "runs" / "sft" / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    prompts = (EXAMPLES / "sft" / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(predictions) == len(prompts) and all("generated" in json.loads(line) for line in predictions)

"""scripts/predict.py (looptrain.cli.predict): predictions in input order that match the model's own logits, an
evaluation equal to the Loop's, generation for causal LMs, and user errors that name the fix."""

from __future__ import annotations

import configparser
import csv
import json
import random
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

from looptrain.cli import finetune, predict
from looptrain.metrics import majority_baseline

from conftest import WORDS, make_tiny_bert, make_tiny_tokenizer, write_csv

ROOT = Path(__file__).resolve().parent.parent
LABELS = ("neg", "neu", "pos")


def write_rows(path: Path, rows: int, labels=LABELS, seed: int = 0) -> Path:
    """Texts of 1 to 20 words (so sorting by length reorders them) with labels drawn from `labels`."""
    generator = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for _ in range(rows):
            words = [generator.choice(WORDS) for _ in range(generator.randint(1, 20))]
            writer.writerow([" ".join(words), generator.choice(labels)])
    return path


def save_classifier(directory: Path, label_names=LABELS) -> Path:
    """A tiny 3-label BERT classifier whose predictions vary from row to row (large initial weights)."""
    model = make_tiny_bert(num_labels=3, initializer_range=0.5, seed=1)
    if label_names is not None:
        model.config.id2label = dict(enumerate(label_names))
        model.config.label2id = {name: index for index, name in enumerate(label_names)}
    model.save_pretrained(directory)
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return save_classifier(tmp_path_factory.mktemp("classifier"))


@pytest.fixture(scope="module")
def rows_csv(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("rows") / "rows.csv", 24)


@pytest.fixture(scope="module")
def finetuned(model_dir, tmp_path_factory):
    """A real fine-tuning run with an eval file: its output directory and that file."""
    directory = tmp_path_factory.mktemp("finetuned")
    train, evaluation = write_csv(directory / "train.csv", 32, seed=1), write_csv(directory / "eval.csv", 16, seed=2)
    output_dir = directory / "run"
    assert finetune.main(["--model", str(model_dir), "--data", str(train), "--eval-data", str(evaluation),
                          "--output-dir", str(output_dir), "--max-steps", "2", "--max-length", "32", "--lr", "1e-3",
                          "--no-track-memory", "--no-progress-bar"]) == 0
    return output_dir, evaluation


def predict_main(*argv) -> int:
    return predict.main([str(value) for value in argv] + ["--no-progress-bar"])


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def texts_and_labels(path: Path) -> tuple[list[str], list[str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return [row["text"] for row in rows], [row["label"] for row in rows]


def own_logits(model_path: Path, texts: list[str], max_length: int) -> torch.Tensor:
    """The model's logits, one row at a time (no padding), computed without looptrain."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with torch.no_grad():
        return torch.cat([model(**tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")).logits
                          for text in texts])


def test_one_line_per_row_in_input_order_with_the_models_own_argmax(classifier_dir, rows_csv, tmp_path):
    output = tmp_path / "out" / "predictions.jsonl"  # the folder is created
    assert predict_main("--model", classifier_dir, "--data", rows_csv, "--output", output, "--batch-size", 5,
                        "--max-length", 32) == 0
    lines = read_lines(output)
    texts, _ = texts_and_labels(rows_csv)
    assert len(lines) == len(texts) == 24
    logits = own_logits(classifier_dir, texts, max_length=32)
    expected = [LABELS[index] for index in logits.argmax(dim=-1).tolist()]
    assert [line["label"] for line in lines] == expected
    assert len(set(expected)) > 1  # the rows are told apart: an order mix-up would show
    for line, row_logits in zip(lines, logits):
        assert list(line["probabilities"]) == list(LABELS)
        assert sum(line["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)
        assert line["probability"] == line["probabilities"][line["label"]] == max(line["probabilities"].values())
        torch.testing.assert_close(torch.tensor(list(line["probabilities"].values())), row_logits.softmax(-1),
                                   atol=1e-5, rtol=0)


def test_evaluation_scores_the_predictions(classifier_dir, rows_csv, tmp_path, capsys):
    output, metrics_json = tmp_path / "predictions.jsonl", tmp_path / "metrics.json"
    assert predict_main("--model", classifier_dir, "--data", rows_csv, "--output", output, "--label-column", "label",
                        "--metrics-json", metrics_json, "--batch-size", 7, "--max-length", 32) == 0
    predicted = [line["label"] for line in read_lines(output)]
    _, truth = texts_and_labels(rows_csv)
    written = json.loads(metrics_json.read_text())
    assert written["metrics"]["accuracy"] == pytest.approx(sum(p == t for p, t in zip(predicted, truth)) / len(truth))
    assert written["metrics"]["count"] == len(truth) == 24
    assert written["majority_baseline"] == majority_baseline([LABELS.index(label) for label in truth])
    out = capsys.readouterr().out
    assert "| accuracy |" in out and "| macro-F1 |" in out and "| loss |" in out


def test_evaluation_equals_the_fine_tuning_runs_final_eval(finetuned, tmp_path, capsys):
    output_dir, eval_csv = finetuned
    output, metrics_json = tmp_path / "predictions.jsonl", tmp_path / "metrics.json"
    # No --output and no --max-length: the evaluation alone, at the training run's --max-length (32).
    assert predict_main("--model", output_dir / "final", "--data", eval_csv, "--label-column", "label",
                        "--metrics-json", metrics_json) == 0
    assert "at most 32 tokens (the training run's)" in capsys.readouterr().out
    assert not output.exists()
    summary = json.loads((output_dir / "summary.json").read_text())
    scores = json.loads(metrics_json.read_text())["metrics"]
    assert scores["accuracy"] == summary["final_eval"]["accuracy"]
    assert scores["f1"] == pytest.approx(summary["final_eval"]["f1"], abs=1e-12)
    assert scores["loss"] == pytest.approx(summary["final_eval"]["loss"], rel=1e-6)
    assert json.loads(metrics_json.read_text())["majority_baseline"] == summary["majority_baseline"]

    assert predict_main("--model", output_dir / "final", "--data", eval_csv, "--output", output) == 0
    predicted = [line["label"] for line in read_lines(output)]
    _, truth = texts_and_labels(eval_csv)
    assert scores["accuracy"] == sum(p == t for p, t in zip(predicted, truth)) / len(truth)


@pytest.mark.parametrize("flag, target", [
    ("--metrics-json", "summary.json"), ("--metrics-json", "run.json"), ("--output", "metrics.jsonl"),
    ("--output", "final/predictions.jsonl"), ("--metrics-json", "checkpoint-2/metrics.json"),
])
def test_the_outputs_never_overwrite_a_fine_tuning_runs_own_files(finetuned, tmp_path, capsys, flag, target):
    output_dir, eval_csv = finetuned
    before = {path: path.read_bytes() for path in sorted(output_dir.rglob("*")) if path.is_file()}
    outputs = {"--output": tmp_path / "predictions.jsonl", "--metrics-json": tmp_path / "metrics.json", flag: None}
    outputs[flag] = output_dir / target
    argv = ["--model", output_dir / "final", "--data", eval_csv, "--label-column", "label"]
    assert predict_main(*argv, *[item for option, path in outputs.items() for item in (option, path)]) == 2
    err = capsys.readouterr().err
    example = output_dir / ("predictions.jsonl" if flag == "--output" else "predict-metrics.json")
    assert err == (f"predict.py: error: {flag} {output_dir / target} is one of the files of the fine-tuning run in "
                   f"{output_dir} (its run.json, summary.json, metrics.jsonl, run_config.json, checkpoints and final/ "
                   f"are the run's own), which would be overwritten; pass another path, e.g. {flag} {example}\n")
    assert {path: path.read_bytes() for path in sorted(output_dir.rglob("*")) if path.is_file()} == before
    # The path the message names is the run directory's, and not one of its own files: it is written.
    outputs[flag] = example
    assert predict_main(*argv, *[item for option, path in outputs.items() for item in (option, path)]) == 0
    assert example.is_file()
    example.unlink()


def test_a_model_without_label_names_reads_integer_ids(tmp_path):
    model = save_classifier(tmp_path / "model", label_names=None)  # id2label: LABEL_0..LABEL_2
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"text": f"good {word}", "label": index % 3}) + "\n"
                            for index, word in enumerate(WORDS[:9])))
    assert predict_main("--model", model, "--data", data, "--label-column", "label", "--output",
                        tmp_path / "p.jsonl", "--max-length", 32) == 0
    assert {line["label"] for line in read_lines(tmp_path / "p.jsonl")} <= {"LABEL_0", "LABEL_1", "LABEL_2"}


@pytest.fixture(scope="module")
def causal_lm_dir(tmp_path_factory):
    """A tiny random GPT-2 (no end-of-text token: every row generates its full length) and a decoding tokenizer."""
    from tokenizers import decoders
    from transformers import GPT2Config, GPT2LMHeadModel

    directory = tmp_path_factory.mktemp("gpt2")
    config = GPT2Config(vocab_size=len(WORDS) + 5, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        initializer_range=0.5, bos_token_id=2, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer = make_tiny_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.WordPiece()
    tokenizer.save_pretrained(directory)
    return directory


def test_a_causal_lm_generates_each_rows_greedy_continuation(causal_lm_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts, output = write_rows(tmp_path / "prompts.csv", 10, seed=3), tmp_path / "generated.jsonl"
    # Batches of rows of unequal lengths: left padding must not change what a row generates.
    assert predict_main("--model", causal_lm_dir, "--data", prompts, "--output", output, "--batch-size", 4,
                        "--max-new-tokens", 5) == 0
    lines = read_lines(output)
    texts, _ = texts_and_labels(prompts)
    model = AutoModelForCausalLM.from_pretrained(causal_lm_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(causal_lm_dir)
    expected = []
    for text in texts:  # one row at a time: no padding at all
        prompt = tokenizer(text, return_tensors="pt")
        tokens = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        expected.append(tokenizer.decode(tokens[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True))
    assert [line["generated"] for line in lines] == expected
    assert len(set(expected)) > 1  # the rows are told apart: an order mix-up would show


def encoder_as_classifier(model_dir: Path, directory: Path) -> Path:
    """An encoder's weights under a config that claims a classifier: the head's weights are missing."""
    shutil.copytree(model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["BertForSequenceClassification"]}))
    return directory


@pytest.mark.parametrize("case, message", [
    ("no model", r"--model .*nowhere: no such directory .*pass the final/ directory of a fine-tuning run"),
    ("a run's directory", r"is a run's output directory; pass the model it wrote: --model .*final"),
    ("an encoder", r"holds BertModel, not a sequence classifier or a causal LM; pass a fine-tuned run's final/"),
    ("an untrained head", r"has no saved weights for classifier\.bias, classifier\.weight: they would be random"),
    ("no data", r"data file not found: .*missing\.csv"),
    ("unknown labels", r"label\(s\) 'maybe', 'unsure' not seen in the training data \(known: 'neg', 'neu', 'pos'\)"),
    ("no text column", r"column 'text' not found .*available columns: sentence, label.*--text-column"),
    ("names for ids", r"has no label names .* must be its integer ids 0\.\.2, not names like 'neg'"),
    ("nothing to do", r"nothing to do: pass --output FILE .* or --label-column NAME"),
    ("output is the data", r"--output .*rows\.csv is the --data file itself, which would be overwritten"),
    ("metrics without labels", r"--metrics-json writes the evaluation, which needs the labels: add --label-column"),
    ("labels for a causal LM", r"is a causal LM: it generates text, which --label-column does not score"),
    ("too long for the positions", r"--max-length 100 is longer than the model's 64 positions; use --max-length 64"),
])
def test_user_errors_exit_2_naming_the_fix(case, message, classifier_dir, causal_lm_dir, model_dir, rows_csv,
                                           tmp_path, capsys):
    output = tmp_path / "p.jsonl"
    (tmp_path / "run" / "final").mkdir(parents=True)
    unknown = tmp_path / "unknown.csv"
    unknown.write_text("text,label\ngood film,pos\nbad film,maybe\nfilm,unsure\n")
    renamed = tmp_path / "renamed.csv"
    renamed.write_text("sentence,label\ngood film,pos\n")
    argv = {
        "no model": ["--model", tmp_path / "nowhere", "--data", rows_csv, "--output", output],
        "a run's directory": ["--model", tmp_path / "run", "--data", rows_csv, "--output", output],
        "an encoder": ["--model", model_dir, "--data", rows_csv, "--output", output],
        "an untrained head": ["--model", encoder_as_classifier(model_dir, tmp_path / "untrained"), "--data", rows_csv,
                              "--output", output],
        "no data": ["--model", classifier_dir, "--data", tmp_path / "missing.csv", "--output", output],
        "unknown labels": ["--model", classifier_dir, "--data", unknown, "--label-column", "label"],
        "no text column": ["--model", classifier_dir, "--data", renamed, "--output", output],
        "names for ids": ["--model", save_classifier(tmp_path / "ids", label_names=None), "--data", rows_csv,
                          "--label-column", "label"],
        "nothing to do": ["--model", classifier_dir, "--data", rows_csv],
        "output is the data": ["--model", classifier_dir, "--data", rows_csv, "--output", rows_csv],
        "metrics without labels": ["--model", classifier_dir, "--data", rows_csv, "--output", output,
                                   "--metrics-json", tmp_path / "m.json"],
        "labels for a causal LM": ["--model", causal_lm_dir, "--data", rows_csv, "--output", output,
                                   "--label-column", "label"],
        "too long for the positions": ["--model", classifier_dir, "--data", rows_csv, "--output", output,
                                       "--max-length", 100],
    }[case]
    assert predict_main(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("predict.py: error: ") and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not output.exists()


def test_debug_shows_the_traceback(classifier_dir, tmp_path):
    from looptrain import DataError

    with pytest.raises(DataError, match="data file not found"):
        predict_main("--model", classifier_dir, "--data", tmp_path / "missing.csv", "--output", tmp_path / "p.jsonl",
                     "--debug")


def test_the_console_script_and_the_shim(monkeypatch, capsys):
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    assert "looptrain-predict = looptrain.cli.predict:main_entry" in parser.get("options.entry_points",
                                                                              "console_scripts")
    monkeypatch.setattr(sys, "argv", ["predict.py", "--help"])
    monkeypatch.delitem(sys.modules, "looptrain.cli.predict")  # run afresh, as `python -m looptrain.cli.predict` does
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("looptrain.cli.predict", run_name="__main__")
    assert exit_info.value.code == 0
    assert "--label-column" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["looptrain-predict", "--model", "m", "--data", "d"])  # nothing to do: exit 2
    with pytest.raises(SystemExit) as exit_info:
        predict.main_entry()
    assert exit_info.value.code == 2

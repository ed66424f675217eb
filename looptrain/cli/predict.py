"""Predict with a fine-tuned model, and evaluate it alone on a labelled file.

    python scripts/predict.py --model runs/x/final --data test.csv --output predictions.jsonl
    python scripts/predict.py --model runs/x/final --data dev.csv --label-column label    # evaluation only
    looptrain-predict --model runs/x/final --data test.jsonl --output predictions.jsonl  # once installed

A sequence classifier (what `looptrain-finetune` writes to `final/`) gives one JSON line per input row,
in input order: `{"label": ..., "probability": ..., "probabilities": {...}}`. With `--label-column`,
the rows' labels are scored as the Loop scores them (`looptrain.metrics.EvalMetrics`: accuracy,
macro-F1, loss) beside the majority baseline. A causal language model gives `{"generated": ...}`,
greedy, `--max-new-tokens` per row. docs/predict.md has every flag, the formats and the errors.
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from looptrain.cli.adapters import (
    CAUSAL_LM_SUFFIXES,
    CLASSIFIER_SUFFIXES,
    adapter_kind,
    model_found,
    read_adapter,
    tokenizer_path,
)
from looptrain.cli.errors import UsageError, program_name

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# finetune.py's defaults by model kind, used when the training run's own is not known
DEFAULT_MAX_LENGTH = {"classifier": 128, "causal_lm": 1024}
# A causal LM's prompts by default: the first of these columns the data has (TRL's conversational columns first).
PROMPT_COLUMNS = ("messages", "prompt", "text")


def build_parser() -> argparse.ArgumentParser:
    from looptrain.cli.finetune import DefaultOnceFormatter, add_loading_arguments

    parser = argparse.ArgumentParser(
        prog=program_name("predict.py"), formatter_class=DefaultOnceFormatter,
        description="Predict with a fine-tuned classifier (or generate with a causal LM); with --label-column, "
                    "evaluate it on the file's labels.")
    parser.add_argument("--model", required=True, help="the model directory: a run's final/ (or a hub id in the cache)")
    parser.add_argument("--base-model", default=None, metavar="DIR",
                        help="with a LoRA adapter as --model (a --lora run's final/): the model it was trained on "
                             "(default: the base its adapter_config.json records)")
    parser.add_argument("--data", required=True,
                        help="the rows to predict: any source looptrain-finetune's --data reads (.csv, .tsv, .jsonl, "
                             ".json, .parquet, a save_to_disk DIR[:SPLIT], a cached hub NAME[:SPLIT])")
    parser.add_argument("--output", default=None, metavar="FILE",
                        help="write one JSON line per row here, in input order (default: none, only the summary)")
    parser.add_argument("--text-column", default=None,
                        help="text column (default: text; a causal LM's prompts: the first of messages, prompt, text "
                             "the data has). A column of chats (messages lists) is rendered with the chat template")
    parser.add_argument("--text-pair-column", default=None, help="second text column, for sentence-pair tasks")
    parser.add_argument("--label-column", default=None,
                        help="label column: also evaluate (accuracy, macro-F1, loss, the majority baseline); "
                             "default: no evaluation")
    parser.add_argument("--metrics-json", default=None, metavar="FILE",
                        help="with --label-column: write the evaluation here as JSON")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per forward (default: 64)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="truncate rows to this many tokens (default: the training run's --max-length when "
                             f"--model is a run's final/, else {DEFAULT_MAX_LENGTH['classifier']} for a classifier, "
                             f"{DEFAULT_MAX_LENGTH['causal_lm']} for a causal LM)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="causal LMs: tokens generated per row, greedily (default: 32)")
    parser.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16", "auto"), default="fp32",
                        help="autocast dtype of the forward; auto: what is fast on this device (default: fp32)")
    add_loading_arguments(parser)  # as looptrain-finetune reads them
    parser.add_argument("--no-progress-bar", action="store_true", help="no progress bar, even on a terminal")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    return parser


def check_flags(args) -> None:
    """Rejects flags that cannot work, naming them, before anything is read: the outputs never overwrite --data nor a
    fine-tuning run's own files (`looptrain.ledger.run_file_owner`)."""
    from looptrain.ledger import run_file_owner

    for flag, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1 (got {value})")
    if args.output is None and args.label_column is None:
        raise UsageError("nothing to do: pass --output FILE to write the predictions, or --label-column NAME to "
                         "evaluate on the file's labels (or both)")
    if args.metrics_json is not None and args.label_column is None:
        raise UsageError("--metrics-json writes the evaluation, which needs the labels: add --label-column NAME")
    for flag in ("output", "metrics_json"):
        path = getattr(args, flag)
        if path is None:
            continue
        option = "--" + flag.replace("_", "-")
        if Path(path).is_dir():
            raise UsageError(f"{option} {path} is a directory; pass a file path")
        if Path(path).resolve() == Path(args.data).resolve():
            raise UsageError(f"{option} {path} is the --data file itself, which would be overwritten; "
                             "pass another path")
        if (run_directory := run_file_owner(path)) is not None:
            example = run_directory / ("predictions.jsonl" if flag == "output" else "predict-metrics.json")
            raise UsageError(f"{option} {path} is one of the files of the fine-tuning run in {run_directory} (its "
                             "run.json, summary.json, metrics.jsonl, run_config.json, checkpoints and final/ are the "
                             f"run's own), which would be overwritten; pass another path, e.g. {option} {example}")


# ---------------------------------------------------------------------- the model
def model_kind(config, model_path: str) -> str:
    """"classifier" or "causal_lm" from the config's architectures; a UsageError for anything else."""
    architectures = list(getattr(config, "architectures", None) or [])
    if any(name.endswith(CLASSIFIER_SUFFIXES) for name in architectures):
        if config.num_labels < 2 or getattr(config, "problem_type", None) in ("regression",
                                                                               "multi_label_classification"):
            raise UsageError(f"--model {model_path} is a {config.problem_type or 'one-output'} head, not a "
                             "single-label classifier; predict.py scores single-label classifiers")
        return "classifier"
    if any(name.endswith(CAUSAL_LM_SUFFIXES) for name in architectures) and not config.is_encoder_decoder:
        return "causal_lm"
    held = ", ".join(architectures) or f"a {config.model_type} model with no architectures in its config"
    raise UsageError(f"--model {model_path} holds {held}, not a sequence classifier or a causal LM; pass a "
                     "fine-tuned run's final/ directory (looptrain-finetune writes it)")


def load_model(model_path: str, config, kind: str, args):
    """The classifier (or causal LM) as it was saved, in eval mode; a UsageError when weights are missing (a head
    that transformers would initialise at random would predict noise)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    auto_class = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if args.adapter is not None:
            model, loading = load_adapter_model(auto_class, config, args.adapter, args)
        else:
            model, loading = auto_class.from_pretrained(model_path, config=config, output_loading_info=True,
                                                        trust_remote_code=args.trust_remote_code)
    except UsageError:
        raise
    except Exception as error:  # safetensors' own error for a truncated file is a plain Exception subclass
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"cannot load the weights of --model {model_path}: {detail}; the file may be truncated or "
                         "corrupt: copy or save the model again") from error
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(loading["missing_keys"])
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise UsageError(f"--model {model_path} has no saved weights for {shown}: they would be random; pass the "
                         "final/ directory of a fine-tuning run, which saves every weight")
    return model.eval()


def check_model_exists(model_path: str) -> None:
    """Refuses a --model that is neither a directory nor a hub model in the local cache, before any download."""
    directory = Path(model_path)
    if directory.is_dir() and not (directory / "config.json").is_file() and (directory / "final").is_dir():
        raise UsageError(f"--model {model_path} is a run's output directory; pass the model it wrote: "
                         f"--model {directory / 'final'}")
    if not model_found(model_path):
        raise UsageError(f"--model {model_path}: no such directory (nor a hub model in the local cache); pass the "
                         "final/ directory of a fine-tuning run, e.g. --model runs/finetune/final")


# ---------------------------------------------------------------------- LoRA adapters
def adapter_head_labels(model_path: str, adapter: dict) -> int | None:
    """The number of labels of the classifier head the adapter trained fully (its modules_to_save), from the
    saved weights' shapes: the head's output weight (RoBERTa's out_proj, else its one 2-D weight)."""
    from safetensors import safe_open

    weights = Path(model_path) / "adapter_model.safetensors"
    heads = set(adapter.get("modules_to_save") or ())
    if not weights.is_file() or not heads:
        return None
    with safe_open(str(weights), "pt") as handle:
        shapes = {key: handle.get_slice(key).get_shape() for key in handle.keys()
                  if "lora_" not in key and key.endswith(".weight") and heads & set(key.split("."))}
    matrices = {key: shape for key, shape in shapes.items() if len(shape) == 2}
    chosen = [shape for key, shape in matrices.items() if "out_proj" in key] or list(matrices.values())
    return int(chosen[0][0]) if len(chosen) == 1 else None


def load_adapter_model(auto_class, config, adapter: dict, args):
    """The base with the adapter's weights merged in (`PeftModel.from_pretrained(...).merge_and_unload()`): what the
    run trained, as one plain model. The base's missing head is no error when the adapter trained it."""
    try:
        from peft import PeftModel
    except ImportError as error:
        raise UsageError("--model is a LoRA adapter, which needs peft: pip install peft (or pip install "
                         "'looptrain[lora]')") from error
    from looptrain.cli.finetune.inputs import quiet_peft

    base, loading = auto_class.from_pretrained(adapter["base"], config=config, output_loading_info=True,
                                               trust_remote_code=args.trust_remote_code)
    heads = set(adapter.get("modules_to_save") or ())
    missing = sorted(key for key in loading["missing_keys"] if not heads & set(key.split(".")))
    with quiet_peft():
        model = PeftModel.from_pretrained(base, args.model).merge_and_unload()
    return model, {"missing_keys": missing}


def training_run_config(model_path: str) -> dict:
    """The run_config.json of the run that wrote `model_path` (a run's final/); {} when there is none."""
    run_config = Path(model_path).parent / "run_config.json"
    from looptrain.run_files import read_json_object

    return read_json_object(run_config) if Path(model_path).name == "final" else {}


def training_max_length(model_path: str) -> int | None:
    """The --max-length of the run that wrote `model_path` (a run's final/), from its run_config.json."""
    value = (training_run_config(model_path).get("arguments") or {}).get("max_length")
    return value if isinstance(value, int) and value > 0 else None


def training_label_names(model_path: str, num_labels: int) -> list[str] | None:
    """The label names of the classifier the run that wrote `model_path` trained (a LoRA run's final/ holds no
    config.json with them), when its run_config.json has `num_labels` of them."""
    names = training_run_config(model_path).get("labels")
    return [str(name) for name in names] if isinstance(names, list) and len(names) == num_labels else None


# ---------------------------------------------------------------------- the data
def read_data(args, config, kind: str):
    """The rows, with labels mapped to the model's ids when --label-column is given; a causal LM's chats (`Chats`)
    when its prompt column holds them."""
    from looptrain.cli.chat_prompts import read_chats
    from looptrain.data import read_classification_data

    if kind == "causal_lm" and (chats := read_chats(args, PROMPT_COLUMNS)) is not None:
        return chats
    args.text_column = args.text_column or "text"
    text_column = (args.text_column, args.text_pair_column) if args.text_pair_column else args.text_column
    if kind == "causal_lm" or args.label_column is None:
        return read_classification_data(args.data, text_column, None, encoding_errors=args.encoding_errors)
    from looptrain.metrics import named_labels

    names = named_labels(config)
    # The model's names map the file's labels to its ids; a label the model never learnt is an error naming it.
    data = read_classification_data(args.data, text_column, args.label_column, label_names=names,
                                    num_labels=config.num_labels, encoding_errors=args.encoding_errors)
    if names is None and data.label_names is not None:
        raise UsageError(f"--model {args.model} has no label names (its config says LABEL_0..LABEL_"
                         f"{config.num_labels - 1}), so the labels of {args.data} must be its integer ids "
                         f"0..{config.num_labels - 1}, not names like {data.label_names[0]!r}")
    return data


# ---------------------------------------------------------------------- prompts (causal LMs)
def prompt_set(data, tokenizer, args, print):
    """The prompts' tokens (a `TokenizedDataset`): chats through the chat template (`chat_ids`), texts through the
    tokenizer (its special tokens added, truncated at the end); says how many were truncated."""
    from looptrain import data as data_module
    from looptrain.cli.chat_prompts import Chats, chat_ids

    if isinstance(data, Chats):
        ids, truncated = chat_ids(data, tokenizer, args)
        dataset = data_module.TokenizedDataset(ids, None, None, num_truncated=truncated, max_length=args.max_length)
        cut = "their first tokens"
    else:
        dataset = data_module.tokenize(data, tokenizer, args.max_length, progress=not args.no_progress_bar)
        cut = "their end"
    if dataset.num_truncated:
        print(f"notice: {dataset.num_truncated} of {len(dataset)} prompts were truncated to {args.max_length} tokens "
              f"({cut} cut)")
    return dataset


# ---------------------------------------------------------------------- classification
def classify(model, tokenizer, data, args, device, precision, print):
    """Per row, in input order: the predicted id (the logits' argmax, as the metrics take it) and the probabilities
    ([rows, labels], float32); and with labels, the EvalMetrics that scored them."""
    import torch
    from tqdm.auto import tqdm

    from looptrain import data as data_module
    from looptrain.batches import as_loss_sum, count_items, first_dimension, move_to
    from looptrain.metrics import EvalMetrics

    dataset = data_module.tokenize(data, tokenizer, args.max_length, progress=not args.no_progress_bar)
    if dataset.num_truncated:
        print(f"notice: {dataset.num_truncated} of {len(dataset)} rows were truncated to {args.max_length} tokens")
    collator = data_module.DynamicPaddingCollator(tokenizer, max_length=args.max_length)
    # Sorted by length (least padding); batch_sampler maps each batch back to its rows. One process: rank 0 of 1.
    loader = data_module.make_eval_loader(dataset, args.batch_size, collator, num_replicas=1, rank=0)
    predictions = torch.zeros(len(dataset), dtype=torch.long)
    probabilities = torch.zeros(len(dataset), model.config.num_labels, dtype=torch.float32)
    evaluation = EvalMetrics.for_model(model) if data.labels is not None else None
    bar = tqdm(total=len(dataset), desc="predicting", unit="rows", disable=True if args.no_progress_bar else None)
    with torch.no_grad(), bar:
        for rows, batch in zip(loader.batch_sampler, loader):
            batch = move_to(batch, device)
            with precision.autocast():
                outputs = model(**batch)
            predictions[rows] = outputs.logits.argmax(dim=-1).cpu()
            probabilities[rows] = torch.softmax(outputs.logits.float(), dim=-1).cpu()
            if evaluation is not None:  # what Loop.eval_step returns for this batch, scored by the Loop's metrics
                loss_sum, num_items = as_loss_sum(outputs.loss, count_items(batch), device)
                evaluation.update({"loss_sum": loss_sum, "num_items": num_items, "rows": first_dimension(batch),
                                   "logits": outputs.logits, "labels": batch["labels"]})
            bar.update(len(rows))
    return predictions, probabilities, evaluation


def prediction_lines(predictions, probabilities, label_names: list[str]):
    """One JSON line per row: the predicted label, its probability, and every label's."""
    for best, row in zip(predictions.tolist(), probabilities.tolist()):
        yield json.dumps({"label": label_names[best], "probability": row[best],
                          "probabilities": dict(zip(label_names, row))})


def evaluation_table(scores: dict, baseline: dict) -> str:
    lines = ["| | model | majority class |", "|---|---|---|"]
    for key, label in (("accuracy", "accuracy"), ("f1", "macro-F1")):
        lines.append(f"| {label} | {scores[key]:.4f} | {baseline[key]:.4f} |")
    lines.append(f"| loss | {scores['loss']:.4f} | |")
    lines.append(f"| rows | {scores['count']} | |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- generation
def generate(model, tokenizer, dataset, args, device, precision) -> list[str]:
    """Each row's greedy continuation (--max-new-tokens) of its prompt's tokens (`prompt_set`), decoded without
    special tokens, in input order."""
    import torch
    from tqdm.auto import tqdm

    from looptrain import data as data_module
    from looptrain.batches import move_to

    pad_id = next((value for value in (tokenizer.pad_token_id, tokenizer.eos_token_id, model.config.pad_token_id,
                                       model.config.eos_token_id) if isinstance(value, int)), 0)
    loader = data_module.make_eval_loader(dataset, args.batch_size, data_module.DynamicPaddingCollator(pad_id),
                                          num_replicas=1, rank=0)
    generated: list[str] = [""] * len(dataset)
    bar = tqdm(total=len(dataset), desc="generating", unit="rows", disable=True if args.no_progress_bar else None)
    with torch.no_grad(), bar:
        for rows, batch in zip(loader.batch_sampler, loader):
            batch = move_to(left_padded(batch), device)
            with precision.autocast():
                output = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                        max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad_id)
            new_tokens = output[:, batch["input_ids"].shape[1]:]
            for row, tokens in zip(rows, new_tokens):
                generated[row] = tokenizer.decode(tokens, skip_special_tokens=True)
            bar.update(len(rows))
    return generated


def left_padded(batch: dict) -> dict:
    """A right-padded batch (DynamicPaddingCollator's) padded on the left instead, as decoder-only generation needs."""
    import torch

    lengths = batch["attention_mask"].sum(dim=1).tolist()
    width = batch["input_ids"].shape[1]
    return {key: torch.stack([torch.roll(row, width - length) for row, length in zip(batch[key], lengths)])
            for key in ("input_ids", "attention_mask")}


# ---------------------------------------------------------------------- the run
def write_lines(path: str, lines) -> None:
    """Writes the lines to `path` through a temporary file, so a failed run leaves no half-written output."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line + "\n")
    os.replace(temporary, target)


def compute_settings(args):
    """The device and the autocast precision of --device and --precision (UsageError when they cannot run here)."""
    from looptrain.precision import Precision, precision_problem, resolve_device, resolve_precision

    try:
        device = resolve_device(args.device)
    except ValueError as error:
        raise UsageError(f"--device: {error}") from None
    name = resolve_precision(args.precision, device)
    problem = precision_problem(device, name)
    if problem:
        raise UsageError(f"--precision {args.precision}: {problem}")
    return device, Precision(device, name)


def model_config_and_kind(args):
    """The model's config and kind, with --max-length resolved (and checked) against its positions."""
    from looptrain.cli.finetune import load_model_config

    check_model_exists(args.model)
    # finetune.py's reader of the config, which names the fix for a bad one; it checks an explicit --max-length.
    checks = argparse.Namespace(trust_remote_code=args.trust_remote_code, max_length=args.max_length or 1,
                                freeze_layers=0)
    args.adapter = read_adapter(args.model, args.base_model)
    if args.adapter is None:
        config = load_model_config(args.model, checks)
        kind = model_kind(config, args.model)
    else:  # the base's config, with the head the adapter trained
        config = load_model_config(args.adapter["base"], checks)
        kind = adapter_kind(args.adapter, args.model)
        labels = adapter_head_labels(args.model, args.adapter) if kind == "classifier" else None
        if labels is not None and labels != config.num_labels:
            config.num_labels = labels
        names = training_label_names(args.model, config.num_labels) if kind == "classifier" else None
        if names:
            config.id2label = dict(enumerate(names))
            config.label2id = {name: index for index, name in enumerate(names)}
    if kind == "causal_lm" and (args.label_column or args.text_pair_column):
        raise UsageError(f"--model {args.model} is a causal LM: it generates text, which --label-column does not "
                         "score and --text-pair-column does not feed; drop them")
    positions = getattr(config, "max_position_embeddings", None)
    room = positions - args.max_new_tokens if kind == "causal_lm" and positions else positions  # prompt + new tokens
    if room is not None and room < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} fills the model's {positions} positions, leaving "
                         f"none for the prompt; pass --max-new-tokens {positions // 2} or less")
    if args.max_length is None:
        trained = training_max_length(args.model)
        args.max_length_source = "the training run's" if trained else "the default"
        default = DEFAULT_MAX_LENGTH[kind]
        args.max_length = trained or min(default, room or default)
    else:
        args.max_length_source = "--max-length"
    if kind == "causal_lm" and room is not None and args.max_length > room:
        raise UsageError(f"--max-length {args.max_length} + --max-new-tokens {args.max_new_tokens} is more than the "
                         f"model's {positions} positions; lower one of them (e.g. --max-length {max(room, 1)})")
    return config, kind


def run(args, print=builtins.print) -> dict:
    """Loads the model and the data, predicts (and evaluates), writes the outputs; returns the summary."""
    from transformers.utils import logging as hf_logging

    from looptrain import data as data_module
    from looptrain.checkpoint import write_json_atomic
    from looptrain.cli.finetune.inputs import check_vocabulary
    from looptrain.metrics import label_names_of, majority_baseline

    hf_logging.disable_progress_bar()  # no "Loading weights" bar: predict.py has its own
    device, precision = compute_settings(args)
    config, kind = model_config_and_kind(args)
    data = read_data(args, config, kind)
    for notice in data.notices:
        print(f"notice: {notice}")
    tokenizer = data_module.load_tokenizer(tokenizer_path(args.model, args.adapter),  # an adapter's, else its base's
                                           allow_slow=args.allow_slow_tokenizer,
                                           trust_remote_code=args.trust_remote_code)
    model = load_model(args.model, config, kind, args).to(device)
    check_vocabulary(model, tokenizer, args.model)
    print(f"model {args.model} ({kind.replace('_', ' ')}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"params) on {device} in {precision.name}; data {args.data}: {len(data)} rows, at most {args.max_length} "
          f"tokens ({args.max_length_source})")
    started = time.perf_counter()
    summary: dict = {"model": args.model, "data": args.data, "rows": len(data), "output": args.output}
    if kind == "causal_lm":
        generated = generate(model, tokenizer, prompt_set(data, tokenizer, args, print), args, device, precision)
        write_lines(args.output, (json.dumps({"generated": text}) for text in generated))
        print(f"generated {len(generated)} rows in {time.perf_counter() - started:.1f} s; wrote {args.output}")
        return summary

    label_names = label_names_of(config)
    predictions, probabilities, evaluation = classify(model, tokenizer, data, args, device, precision, print)
    counts = Counter(predictions.tolist())
    print(f"predicted {len(data)} rows in {time.perf_counter() - started:.1f} s: "
          + ", ".join(f"{name} {counts[index]}" for index, name in enumerate(label_names)))
    if args.output is not None:
        write_lines(args.output, prediction_lines(predictions, probabilities, label_names))
        print(f"wrote {args.output}")
    if evaluation is not None:
        summary["metrics"] = evaluation.compute()
        # as finetune.py's summary.json has it: over the model's classes, as its own macro F1
        summary["majority_baseline"] = majority_baseline(data.labels, num_labels=config.num_labels)
        print(evaluation_table(summary["metrics"], summary["majority_baseline"]))
        if args.metrics_json is not None:
            write_json_atomic(args.metrics_json, summary)
            print(f"wrote {args.metrics_json}")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code (0 ok, 2 for a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    from looptrain.data.errors import DataError

    try:
        check_flags(args)
        run(args)
    except (UsageError, DataError) as error:
        if args.debug:
            raise
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


def main_entry() -> None:
    """The `looptrain-predict` console script: exits with main's code."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())

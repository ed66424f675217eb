"""Every bad input of the command lines, in one table: exit 2, a message that names the fix, no traceback.

Each row is a reproduction from docs/reliability.md: the flags (and the files they name) that once gave a
traceback, a silent override or a wrong run. The command runs in-process (`main(argv)`); argparse's own
errors exit 2 through SystemExit. Nothing is written to a refused run's output directory, and a run
already there is left byte for byte as it was.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_finetune_causal_lm import make_lm_tokenizer

from looptrain.cli import estimate as estimate_cli
from looptrain.cli import finetune
from looptrain.cli import report as report_cli

from conftest import WORDS, make_tiny_tokenizer, save_tiny_bert, write_csv

BASE = ["--model", "{model}", "--data", "{train}", "--output-dir", "{out}", "--max-length", "32", "--max-steps", "1",
        "--eval-every", "no", "--no-track-memory", "--no-progress-bar"]

# (id, command, the flags added to BASE (finetune) or the whole command line (estimate), what stderr says)
CASES = [
    # --- data files
    ("misspelled column", "finetune", ["--text-column", "sentence"],
     r"column 'sentence' not found .*available columns: text, label.*--text-column"),
    ("empty file", "finetune", ["--data", "{empty}"], r"is empty"),
    ("header without rows", "finetune", ["--data", "{header_only}"], r"has a header but no data rows"),
    ("empty text in a row", "finetune", ["--data", "{empty_text}"],
     r"empty_text\.csv line 3: text column 'text' is empty; fill or drop the row"),
    ("bad JSONL line", "finetune", ["--data", "{bad_jsonl}"],
     r"bad\.jsonl line 2: text column 'text' is null; fill or drop the row"),
    ("not UTF-8", "finetune", ["--data", "{latin1}"], r"latin1\.csv.*2.*--encoding-errors replace"),
    ("semicolon-separated .csv", "finetune", ["--data", "{semicolon}"],
     r"looks semicolon-separated.*save it with commas"),
    ("TSV saved as .csv", "finetune", ["--data", "{tab}"], r"looks tab-separated; rename it to"),
    ("extra field in a row", "finetune", ["--data", "{extra_field}"],
     r"extra_field\.csv:3: 3 fields but the header names 2 columns; quote a text"),
    ("missing file", "finetune", ["--data", "{missing}"], r"nothing\.csv"),
    ("one class", "finetune", ["--data", "{one_class}"], r"a classifier needs at least two classes"),
    ("unknown eval label", "finetune", ["--eval-data", "{unknown_label}", "--eval-every", "epoch"],
     r"label\(s\) 'surprise' not seen in the training data \(known: 'neg', 'pos'\); fix the labels"),
    ("duplicate column", "finetune", ["--data", "{duplicate}"], r"column 'text' appears 2 times in the header"),
    ("effective batch with --accum", "finetune", ["--effective-batch", "8", "--batch-size", "8", "--accum", "1"],
     r"--effective-batch 8 and --accum 1 both set the accumulation: drop --accum"),
    ("effective batch not a multiple", "finetune", ["--effective-batch", "12", "--batch-size", "8"],
     r"--effective-batch 12 is not a multiple of --batch-size 8: pass an effective batch that --batch-size divides"),
    ("eval split leaves nothing", "finetune", ["--eval-split", "0.99"],
     r"--eval-split 0.99 of 32 samples leaves no training sample; lower --eval-split"),
    ("eval split out of range", "finetune", ["--eval-split", "1.5"], r"--eval-split must be in \[0, 1\)"),
    # --- flags that contradict each other or cannot hold
    ("weights bf16 with precision fp32", "finetune", ["--weights", "bf16", "--precision", "fp32"],
     r"--weights bf16 computes in bf16, so --precision fp32 cannot hold; drop --precision"),
    ("amp with precision fp32", "finetune", ["--amp", "--precision", "fp32"], r"contradict each other; pass one"),
    ("json without plan-only", "finetune", ["--json"],
     r"--json prints the plan of --plan-only as JSON.*add --plan-only"),
    ("budget without a unit", "finetune", ["--memory-budget", "4"], r"has no unit: write 4GiB, 4MiB"),
    ("optim auto without a budget", "finetune", ["--optim", "auto"], r"add --memory-budget SIZE"),
    ("plan-only without a budget", "finetune", ["--plan-only"], r"belong to --memory-budget: add --memory-budget"),
    ("budget with max-tokens", "finetune", ["--memory-budget", "1GiB", "--max-tokens", "512"],
     r"--max-tokens does not have; drop one"),
    ("fused step with accumulation", "finetune", ["--optim-in-backward", "--accum", "4"],
     r"(?s)cannot be combined with accum_steps > 1.*accum_steps is --accum"),
    ("fused step with fp16", "finetune", ["--optim-in-backward", "--precision", "fp16"], r"use precision='bf16'"),
    ("no-foreach with adafactor", "finetune", ["--no-foreach", "--optim", "adafactor"],
     r"--no-foreach applies to --optim adamw and sgd only \(got --optim adafactor\); drop it"),
    ("freeze encoder and layers", "finetune", ["--freeze-encoder", "--freeze-layers", "1"],
     r"--freeze-encoder already freezes the embeddings and every layer; drop"),
    ("unfreeze with frozen encoder", "finetune", ["--freeze-encoder", "--unfreeze-schedule", "2"], r"pass one of them"),
    ("overwrite and resume", "finetune", ["--overwrite", "--resume", "auto"], r"pass one of them"),
    ("loss-on for a classifier", "finetune", ["--loss-on", "last"],
     r"--loss-on belong to --task causal-lm: add --task causal-lm, or drop --loss-on"),
    ("packing for a classifier", "finetune", ["--packing"],
     r"--packing concatenates a causal LM's samples into rows; a classifier has one label per row: add --task "
     r"causal-lm or drop --packing"),
    ("packing with max_length padding", "finetune", ["--task", "causal-lm", "--packing", "--padding", "max_length"],
     r"--packing fills rows with samples instead of padding them; --padding max_length pads every row: drop one"),
    ("two packings", "finetune", ["--task", "causal-lm", "--packing", "--batch-packing", "on"],
     r"--packing packs the whole data set into rows and --batch-packing on each batch's samples: drop one of them"),
    ("batch packing for a classifier", "finetune", ["--batch-packing", "on"],
     r"--batch-packing on packs a causal LM's samples into rows of dynamic width: add --task causal-lm or drop "
     r"--batch-packing"),
    ("packing with a token budget", "finetune", ["--task", "causal-lm", "--packing", "--max-tokens", "512"],
     r"--packing makes every row up to --max-length tokens already, so --max-tokens has nothing to group: drop "
     r"--max-tokens and set the rows per micro-batch with --batch-size"),
    # --- values out of range
    ("batch size 0", "finetune", ["--batch-size", "0"], r"argument --batch-size: must be >= 1 \(got 0\)"),
    ("negative freeze layers", "finetune", ["--freeze-layers", "-1"], r"argument --freeze-layers: must be >= 0"),
    ("more frozen layers than blocks", "finetune", ["--freeze-layers", "5"],
     r"--freeze-layers 5.*2 transformer blocks"),
    ("unknown precision", "finetune", ["--precision", "fp8"], r"invalid choice: 'fp8'"),
    ("lr nan", "finetune", ["--lr", "nan"], r"--lr must be a finite number > 0"),
    ("weight decay nan", "finetune", ["--weight-decay", "nan"], r"--weight-decay must be a finite number >= 0"),
    ("negative warmup", "finetune", ["--warmup-ratio", "-3"], r"--warmup-ratio must be in \[0, 1\)"),
    ("negative workers", "finetune", ["--num-workers", "-1"], r"--num-workers must be >= 0 \(got -1\)"),
    ("token budget below one sample", "finetune", ["--max-tokens", "1"], r"raise --max-tokens to at least 32"),
    ("negative seed", "finetune", ["--seed", "-1"], r"seed must be an integer from 0 to 2\*\*32 - 1"),
    ("max length above the model's", "finetune", ["--max-length", "512"],
     r"--max-length 512 is longer than the model's 64 positions"),
    # --- the machine and the output directory
    ("device without MPS", "finetune", ["--device", "mps"],
     r"(?s)this PyTorch build has no MPS device .*use device='cpu' or 'auto'.*device is --device"),
    ("unknown device type", "finetune", ["--device", "xpu"], r"looptrain trains on 'cpu' and 'cuda'"),
    ("output dir is a file", "finetune", ["--output-dir", "{a_file}"], r"is a file; pass a directory"),
    ("output dir not writable", "finetune", ["--output-dir", "/sys/fs/looptrain-cannot-write-here"],
     r"--output-dir /sys/fs/looptrain-cannot-write-here is not writable .*pass a directory you can write to"),
    ("tensorboard missing", "finetune", ["--report-to", "tensorboard", "{no_tensorboard}"],
     r"needs the tensorboard package: pip install tensorboard"),
    ("wandb missing", "finetune", ["--report-to", "wandb", "{no_wandb}"],
     r"(?s)report_to='wandb' needs the wandb package: pip install wandb \(or pip install 'looptrain\[wandb\]'\).*"
     r"report_to is --report-to"),
    ("mlflow missing, the flag repeated", "finetune", ["--report-to", "tensorboard", "--report-to", "mlflow",
                                                       "{no_mlflow}"],
     r"report_to='mlflow' needs the mlflow package: pip install mlflow-skinny "
     r"\(or pip install 'looptrain\[mlflow\]'\)"),
    ("unknown tracker", "finetune", ["--report-to", "wandb,comet"],
     r"report_to must be 'none' or comma-separated names from tensorboard, wandb, mlflow \(got 'wandb,comet'\)"),
    # --- a model without a list of transformer blocks (XLM keeps attentions and ffns side by side)
    ("no blocks: layer-wise decay", "finetune", ["--model", "{xlm}", "--layer-lr-decay", "0.9"],
     r"--layer-lr-decay works block by block, and XLMForSequenceClassification has no list of transformer blocks"),
    ("no blocks: unfreezing", "finetune", ["--model", "{xlm}", "--unfreeze-schedule", "2"],
     r"--unfreeze-schedule works block by block.*drop --unfreeze-schedule"),
    ("no blocks: checkpointing", "finetune", ["--model", "{xlm}", "--grad-checkpoint"],
     r"--grad-checkpoint works block by block"),
    # --- LoRA
    ("merge without LoRA", "finetune", ["--merge-lora"], r"--merge-lora merges trained LoRA adapters.*add --lora R"),
    ("LoRA with freezing", "finetune", ["--lora", "4", "--freeze-layers", "1"],
     r"--lora freezes the whole base already.*drop --freeze-layers"),
    ("LoRA with layer-wise decay", "finetune", ["--lora", "4", "--layer-lr-decay", "0.9"],
     r"--layer-lr-decay .* which --lora freezes.*drop --layer-lr-decay"),
    ("LoRA with gradual unfreezing", "finetune", ["--lora", "4", "--unfreeze-schedule", "2"],
     r"--unfreeze-schedule .* --lora keeps frozen.*drop --unfreeze-schedule"),
    ("QLoRA that quantizes nothing", "finetune", ["--lora", "4", "--qlora", "--lora-targets", "bert.pooler.dense"],
     r"QLoRA stores the Linear \(and Conv1D\) layers of the transformer blocks in 4 bits, and the LoRA targets "
     r"bert\.pooler\.dense of BertForSequenceClassification hold none: nothing would be quantized; target block "
     r"layers \(query, key, value, dense\) or drop --qlora"),
    ("LoRA rank above a layer's width", "finetune", ["--lora", "100000"],
     r"--lora 100000 is not below the width 32 of bert\.encoder\.layer\.0\.\S+ \(32 x 32\); a rank that large "
     r"trains more than full fine-tuning; pass a rank below 32 or drop --lora for a full fine-tune"),
    ("resume a full fine-tune with LoRA", "finetune", ["--output-dir", "{done}", "--resume", "auto", "--lora", "4"],
     r'(?s)another run; these settings differ.*lora: null -> \{"rank": 4'),
    # --- runs and checkpoints (a finished run is in {done})
    ("fresh run into another run", "finetune", ["--output-dir", "{done}"], r"already holds another run"),
    ("resume with another accumulation", "finetune", ["--output-dir", "{done}", "--resume", "auto", "--accum", "2"],
     r"(?s)another run; these settings differ.*accum_steps: 1 -> 2"),
    ("resume with bf16 weights", "finetune", ["--output-dir", "{done}", "--resume", "auto", "--weights", "bf16"],
     r'(?s)another run; these settings differ \(saved -> now\):.*weights: null -> "bf16"'),
    ("resume another run's checkpoint", "finetune", ["--output-dir", "{done}", "--resume", "{other_checkpoint}"],
     r"already holds another run"),
    ("resume another run's checkpoint copied into the run", "finetune",
     ["--output-dir", "{done_copy}", "--resume", "{copied_checkpoint}"],
     r"(?s)that checkpoint belongs to another run than the one in .*seed: 42 -> 7.*Nothing was changed\. To continue "
     r"that run in a directory of its own: --resume \S+ --output-dir NEW_DIR"),
    ("resume a missing checkpoint", "finetune", ["--resume", "/nonexistent/checkpoint-3"], r"checkpoint"),
    # --- --config recipes (the files the `files` fixture writes) and --save-config
    ("recipe: misspelled key", "finetune", ["--config", "{recipe_misspelled}"],
     r"misspelled\.yaml: unknown key 'grad_checkpiont'; did you mean 'grad_checkpoint'\?"),
    ("recipe: bad value", "finetune", ["--config", "{recipe_bad_value}"],
     r"bad_value\.yaml: lr: argument --lr: invalid float value: 'fast'"),
    ("recipe: bad choice", "finetune", ["--config", "{recipe_bad_choice}"],
     r"bad_choice\.json: precision: argument --precision: invalid choice: 'fp8'"),
    ("recipe: a number for a switch", "finetune", ["--config", "{recipe_switch}"],
     r"switch\.yaml: grad_checkpoint: --grad-checkpoint is a switch: write true \(--grad-checkpoint\) or false"),
    ("recipe: a list for a one-value flag", "finetune", ["--config", "{recipe_list}"],
     r"list\.yaml: seed: --seed takes one value, not a list"),
    ("recipe: not YAML", "finetune", ["--config", "{recipe_not_yaml}"], r"not_yaml\.yaml: not YAML at line 2"),
    ("recipe: not a mapping", "finetune", ["--config", "{recipe_sequence}"],
     r"a recipe is a mapping of flags to values \(key: value lines\), not a list"),
    ("recipe: another suffix", "finetune", ["--config", "{a_file}"],
     r"--config \S+a_file: a recipe is a \.yaml, \.yml or \.json file \(got no suffix\)"),
    ("recipe: missing file", "finetune", ["--config", "{missing_recipe}"],
     r"--config \S+nothing\.yaml: cannot read it \(No such file or directory\)"),
    ("recipe: flags that contradict each other", "finetune", ["--config", "{recipe_contradiction}"],
     r"--amp and --precision fp32 contradict each other"),
    ("save-config without plan-only", "finetune", ["--save-config", "{out}/plan.yaml"],
     r"--save-config writes the plan of --plan-only as a recipe: add --plan-only"),
    ("save-config with another suffix", "finetune", ["--memory-budget", "1GiB", "--plan-only", "--save-config",
                                                     "{out}/plan.txt"],
     r"a recipe is written as \.yaml, \.yml or \.json"),
    ("save-config over a run's recipe", "finetune", ["--memory-budget", "1GiB", "--plan-only", "--save-config",
                                                     "{done}/config.yaml"],
     r"--save-config \S+config\.yaml is one of the files of the run in \S+done .*pass another path"),
    ("estimate: recipe misspelled key", "estimate", ["--config", "{recipe_misspelled}"],
     r"unknown key 'grad_checkpiont'; did you mean 'grad_checkpoint'\?"),
    # --- the estimate's command line
    ("compile with chunked CE on", "finetune", ["--compile", "--chunked-ce", "on"],
     r"compile=True \(--compile\).*chunked_ce='on'.*use --chunked-ce auto or off with --compile"),
    ("estimate: compile with chunked CE on", "estimate", ["--preset", "bert-base", "--compile", "--chunked-ce", "on"],
     r"compile=True \(--compile\).*use --chunked-ce auto or off with --compile"),
    ("estimate: batch size 0", "estimate", ["--preset", "bert-base", "--batch-size", "0"],
     r"argument --batch-size: must be >= 1 \(got 0\)"),
    ("estimate: negative seq len", "estimate", ["--preset", "bert-base", "--seq-len", "-5"],
     r"argument --seq-len: must be >= 1 \(got -5\)"),
    ("estimate: bf16 weights with fp16", "estimate", ["--preset", "bert-base", "--weights", "bf16", "--precision",
                                                     "fp16"], r"weights='bf16' computes in bf16 and cannot run fp16"),
    # --- lengths beyond the model's positions, as finetune's --max-length (learned positions, and RoPE's trained span)
    ("estimate: seq len beyond a BERT preset's positions", "estimate", ["--preset", "bert-base", "--seq-len", "1024"],
     r"error: --seq-len 1024 is longer than the model's 512 positions; use --seq-len 512 or less"),
    ("estimate: seq len beyond a RoPE preset's positions", "estimate",
     ["--preset", "qwen2.5-0.5b", "--seq-len", "40000", "--lowest"],
     r"error: --seq-len 40000 is longer than the model's 32768 positions; use --seq-len 32768 or less"),
    ("estimate: seq len beyond a model's positions", "estimate", ["--model", "{model}", "--seq-len", "128", "--ladder"],
     r"--seq-len 128 is longer than the model's 64 positions; use --seq-len 64 or less"),
    # --- a model that ships its own code (auto_map): refused, never asked (tests below: stdin is never read)
    ("estimate: model with custom code", "estimate", ["--model", "{custom_code}"],
     r"--model '.*custom-code' ships custom code .*pass --trust-remote-code only if you trust that code"),
    # --- LoRA targets that peft would find nothing in (NoMatchingPeftModuleError)
    ("LoRA targets the task head", "finetune", ["--lora", "4", "--lora-targets", "classifier"],
     r"LoRA target classifier is the task head \(classifier\), which is trained fully beside the adapters, not "
     r"adapted; target modules of the transformer blocks instead: query, key, value, dense \(--lora-targets\)"),
    ("LoRA targets a block and the task head", "finetune", ["--lora", "4", "--lora-targets", "query,classifier"],
     r"LoRA target classifier is the task head"),
    ("estimate: LoRA targets the task head", "estimate",
     ["--model", "{model}", "--seq-len", "16", "--lora", "4", "--lora-targets", "classifier"],
     r"LoRA target classifier is the task head.*query, key, value, dense"),
    # --- a tokenizer with more tokens than the model's input embedding has rows (checked before training)
    ("tokenizer larger than a classifier's embedding", "finetune", ["--model", "{small_vocab_bert}"],
     r"the tokenizer of --model .*small-vocab-bert has 35 tokens and the model's input embedding 10 rows, so ids 10 "
     r"and up have no embedding; pass the model's own tokenizer, or resize the embedding to the tokenizer first "
     r"\(model.resize_token_embeddings\(35\), then save_pretrained\)"),
    ("tokenizer larger than a causal LM's embedding", "finetune", ["--model", "{small_vocab_llama}", "--task",
                                                                   "causal-lm"],
     r"has 35 tokens and the model's input embedding 12 rows.*resize_token_embeddings\(35\)"),
    # --- the picture's command line (looptrain-report RUN_DIR)
    ("report: not a run", "report", ["{xlm}"],
     r"xlm is not a run: it has no metrics\.jsonl \(.*\) nor summary\.json \(at its end\): pass the --output-dir "
     r"of a looptrain-finetune run$"),
    ("report: no such directory", "report", ["{out}"], r"out does not exist: pass the --output-dir of a looptrain-"),
    ("report: --output onto another run's picture", "report", ["{done}", "--output", "{other}/report.png"],
     r"--output \S+/other/report\.png is a file of the run in \S+/other; pass a path outside any run's own files"),
    ("report: --output not a PNG", "report", ["{done}", "--output", "{done}/summary.json"],
     r"--output \S+/done/summary\.json does not end in \.png: the picture is a PNG; pass a PATH\.png"),
]


def save_small_vocab_llama(directory: Path) -> Path:
    """A tiny Llama causal LM whose embedding has 12 rows, saved with the 35-token tokenizer of the causal-LM tests."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = make_lm_tokenizer()
    config = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


REMOTE_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('the shipped code ran')\n"


def save_custom_code_model(model_dir: Path, directory: Path, marker: Path) -> Path:
    """The tiny BERT with a config whose auto_map points at Python files shipped beside it, which would write
    `marker` if anything imported them (its model type is unknown to transformers: only that code could load it)."""
    import shutil

    shutil.copytree(model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="custom-bert", architectures=["CustomModel"],
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                            "AutoModelForSequenceClassification": "modeling_custom.CustomModel"})
    (directory / "config.json").write_text(json.dumps(config))
    payload = REMOTE_CODE.format(marker=str(marker))
    (directory / "configuration_custom.py").write_text(
        payload + "from transformers import BertConfig\n"
        "class CustomConfig(BertConfig):\n    model_type = 'custom-bert'\n")
    (directory / "modeling_custom.py").write_text(
        payload + "from transformers import BertForSequenceClassification\n"
        "class CustomModel(BertForSequenceClassification):\n    pass\n")
    return directory


def save_tiny_xlm(directory: Path) -> Path:
    """A tiny XLM encoder: its attention and feed-forward layers sit in parallel lists, with no block list."""
    from transformers import XLMConfig, XLMModel

    config = XLMConfig(vocab_size=len(WORDS) + 5, emb_dim=32, n_layers=2, n_heads=2, max_position_embeddings=64,
                       dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    XLMModel(config).save_pretrained(directory)
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory, model_dir):
    """The files and directories the table names, and one finished run (`done`) and another run's checkpoint."""
    root = tmp_path_factory.mktemp("bad-inputs")
    paths = {"model": model_dir, "train": write_csv(root / "train.csv", 32), "missing": root / "nothing.csv"}
    texts = {"empty": "", "header_only": "text,label\n", "empty_text": "text,label\ngood words,pos\n,neg\n",
             "semicolon": "text;label\ngood words;pos\nbad words;neg\n", "tab": "text\tlabel\ngood\tpos\nbad\tneg\n",
             "extra_field": "text,label\ngood words,pos\nbad, words,neg\n",
             "one_class": "text,label\ngood words,pos\nfine words,pos\n",
             "unknown_label": "text,label\ngood words,pos\nodd words,surprise\n",
             "duplicate": "text,text,label\na,b,pos\nc,d,neg\n"}
    for name, text in texts.items():
        paths[name] = root / f"{name}.csv"
        paths[name].write_text(text, encoding="utf-8")
    paths["latin1"] = root / "latin1.csv"
    paths["latin1"].write_bytes("text,label\ncaf\u00e9 words,pos\n".encode("latin-1"))
    paths["bad_jsonl"] = root / "bad.jsonl"
    paths["bad_jsonl"].write_text('{"text": "good", "label": "pos"}\n{"text": null, "label": "neg"}\n')
    recipes = {"misspelled.yaml": "grad_checkpiont: true\n", "bad_value.yaml": "lr: fast\n",
               "bad_choice.json": '{"precision": "fp8"}', "switch.yaml": "grad_checkpoint: 3\n",
               "list.yaml": "seed: [1, 2]\n", "not_yaml.yaml": "lr: [1\nseed: 2\n", "sequence.yaml": "- lr: 1\n",
               "contradiction.yaml": "amp: true\nprecision: fp32\n"}
    for name, text in recipes.items():
        paths[f"recipe_{name.split('.')[0]}"] = root / name
        paths[f"recipe_{name.split('.')[0]}"].write_text(text, encoding="utf-8")
    paths["missing_recipe"] = root / "nothing.yaml"
    paths["a_file"] = root / "a_file"
    paths["a_file"].write_text("not a directory")
    paths["xlm"] = save_tiny_xlm(root / "xlm")
    paths["small_vocab_bert"] = save_tiny_bert(root / "small-vocab-bert", vocab_size=10)
    paths["small_vocab_llama"] = save_small_vocab_llama(root / "small-vocab-llama")
    paths["code_ran"] = root / "SHIPPED_CODE_RAN"
    paths["custom_code"] = save_custom_code_model(model_dir, root / "custom-code", paths["code_ran"])
    for name, seed in (("done", "42"), ("other", "7")):  # "done" has BASE's settings; "other" is another run
        paths[name] = root / name
        extra = ["--seed", seed, "--eval-every", "1"]  # a checkpoint at step 1
        assert finetune.main(format_argv(BASE, {**paths, "out": paths[name]}) + extra) == 0
    paths["other_checkpoint"] = sorted(paths["other"].glob("checkpoint-*"))[-1]
    paths["done_copy"] = root / "done-copy"  # the finished run, with the other run's checkpoint copied in as its own
    shutil.copytree(paths["done"], paths["done_copy"])
    paths["copied_checkpoint"] = paths["done_copy"] / "checkpoint-7"
    shutil.copytree(paths["other_checkpoint"], paths["copied_checkpoint"])
    return paths


def format_argv(argv: list[str], paths: dict) -> list[str]:
    return [token.format(**{name: str(path) for name, path in paths.items()}) for token in argv]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file()}


@pytest.mark.parametrize("name, command, flags, message", CASES, ids=[case[0] for case in CASES])
def test_a_bad_input_exits_2_with_a_message_that_names_the_fix(files, tmp_path, capsys, monkeypatch, name, command,
                                                               flags, message):
    missing = [flag[len("{no_"):-1] for flag in flags if flag.startswith("{no_")]  # a package not installed
    if missing:
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda module, *args: None if module in missing else real_find_spec(module, *args))
        flags = [flag for flag in flags if not flag.startswith("{no_")]
    paths = {**files, "out": tmp_path / "out"}
    before = {run: snapshot(files[run]) for run in ("done", "other", "done_copy")}
    main = {"finetune": finetune.main, "estimate": estimate_cli.main, "report": report_cli.main}[command]
    argv = format_argv((BASE if command == "finetune" else []) + flags, paths)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert re.search(message, err), err
    # A refused run writes nothing: not even the output directory it checked, nor a lock file in it.
    assert not (tmp_path / "out").exists(), sorted(path.name for path in (tmp_path / "out").rglob("*"))
    for run, files_before in before.items():  # the runs already there are untouched
        assert snapshot(files[run]) == files_before, run


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_a_full_disk_at_a_checkpoint_names_the_space_needed_and_leaves_no_partial_checkpoint(files, tmp_path):
    """A real write failure, in a child process: a file-size limit (RLIMIT_FSIZE) makes torch.save fail exactly as
    a full disk does ("[enforce fail at inline_container.cc] unexpected pos"), once the weights are written."""
    import resource
    import signal
    import subprocess
    import sys

    def limit_file_size():  # in the child: writes past 120 kB fail (the optimizer state is ~180 kB)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (120_000, 120_000))

    output_dir = tmp_path / "full"
    argv = format_argv(BASE, {**files, "out": output_dir}) + ["--eval-every", "1"]
    done = subprocess.run([sys.executable, "-m", "looptrain.cli.finetune", *argv], capture_output=True, text=True,
                          preexec_fn=limit_file_size, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(rf"cannot write checkpoint-1 in {re.escape(str(output_dir))}: no space left .*inline_container.*"
                     r"It needs about 0\.\d MB; .* MB free\. Free some space or pass an output directory on a larger "
                     r"disk \(--output-dir\) and --resume the last checkpoint", done.stderr), done.stderr
    assert not [path.name for path in output_dir.iterdir() if "checkpoint-1" in path.name]  # no partial or temp dir


def test_a_second_ctrl_c_stops_at_once_with_exit_130_and_keeps_the_saved_checkpoints(files, tmp_path, capsys,
                                                                                    monkeypatch):
    import os
    import signal

    from looptrain import Loop

    def two_interrupts(self, *, step, **_):
        if step == 2:  # checkpoint-1 was saved at step 1; now Ctrl-C, and Ctrl-C again before the window ends
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Loop, "on_step_end", two_interrupts)
    output_dir = tmp_path / "interrupted"
    argv = format_argv(BASE, {**files, "out": output_dir}) + ["--eval-every", "1", "--max-steps", "3"]
    assert finetune.main(argv) == 130
    captured = capsys.readouterr()
    assert "SIGINT received: stopping after this window and saving a checkpoint (send it again to stop at once" \
        in captured.out
    assert "finetune.py: stopped at once: what was in progress (a window of training, or final/) was not saved. " \
           f"Checkpoints already in {output_dir} are intact" in captured.err
    assert "--resume auto continues from the last one (checkpoint-1)" in captured.err
    assert "Traceback" not in captured.err
    assert sorted(path.name for path in output_dir.glob("*checkpoint*")) == ["checkpoint-1"]
    assert (output_dir / "checkpoint-1" / "COMPLETE").is_file()
    monkeypatch.undo()
    assert finetune.main(argv + ["--resume", "auto"]) == 0  # as the message says
    assert "resum" in capsys.readouterr().out.lower()
    assert json.loads((output_dir / "summary.json").read_text())["optimizer_steps"] == 3


@pytest.mark.parametrize("schedule, steps, fix", [
    ("1000", "8", "lower it to at most 2 updates"),
    ("epoch", "8", "train at least 4 epochs (--epochs), or give a number of updates"),
])
def test_an_unfreezing_schedule_longer_than_the_run_is_said_at_the_start(files, tmp_path, capsys, schedule, steps,
                                                                         fix):
    argv = format_argv(BASE, {**files, "out": tmp_path / "run"}) + ["--unfreeze-schedule", schedule,
                                                                     "--max-steps", steps, "--batch-size", "4"]
    assert finetune.main(argv) == 0
    out = capsys.readouterr().out
    notice = next(line for line in out.splitlines() if line.startswith("notice: unfreeze_every"))
    assert f"the run makes {steps} updates in 1 epoch(s): it reaches stage 1 of 4" in notice
    assert "never train" in notice and fix in notice
    assert out.index(notice) < out.index("unfreeze: stage 1/4")  # said before training starts
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["unfreeze"]["stage"] == 1 and summary["unfreeze"]["stages"] == 4  # what the notice said


class RecordingStdin(io.StringIO):
    """A stdin holding "y" (the answer that would run a model's shipped code), which records every read."""

    def __init__(self):
        super().__init__("y\n")
        self.reads = 0

    def read(self, *args):
        self.reads += 1
        return super().read(*args)

    def readline(self, *args):
        self.reads += 1
        return super().readline(*args)


@pytest.mark.parametrize("command", ["estimate", "plan", "predict", "finetune"])
def test_a_model_that_ships_code_is_refused_without_asking_and_none_of_its_code_runs(files, tmp_path, capsys,
                                                                                   monkeypatch, command):
    """transformers asks "Do you wish to run the custom code? [y/N]" when trust_remote_code is left None, and a "y"
    on stdin runs the model's own files: every command line passes False (True with --trust-remote-code)."""
    import sys

    from looptrain.cli import plan, predict

    marker = tmp_path / "SHIPPED_CODE_RAN"
    model, data = str(save_custom_code_model(files["model"], tmp_path / "custom-code", marker)), str(files["train"])
    stdin = RecordingStdin()
    monkeypatch.setattr(sys, "stdin", stdin)
    argv, main = {
        "estimate": (["--model", model, "--seq-len", "16", "--batch-size", "2"], estimate_cli.main),
        "plan": (format_argv(BASE, {**files, "out": tmp_path / "out"}) + ["--model", model, "--memory-budget", "4GiB"],
                 plan.main),
        "predict": (["--model", model, "--data", data, "--label-column", "label"], predict.main),
        "finetune": (format_argv(BASE, {**files, "out": tmp_path / "out"}) + ["--model", model], finetune.main),
    }[command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "[y/N]" not in captured.out + captured.err and "Traceback" not in captured.err
    assert re.search(r"error: --model '.*custom-code' ships custom code \(its own model classes\), which looptrain "
                     r"never runs unless asked \(trust_remote_code\): pass --trust-remote-code only if you trust "
                     r"that code",
                     captured.err), captured.err
    assert stdin.reads == 0
    assert not marker.exists()


def test_a_checkpoint_whose_trainer_state_lacks_the_step_is_refused_naming_the_file_and_the_key(files, tmp_path,
                                                                                               capsys):
    import shutil

    checkpoint = tmp_path / "copied" / "checkpoint-1"
    shutil.copytree(sorted(files["done"].glob("checkpoint-*"))[-1], checkpoint)
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["step"]
    state_file.write_text(json.dumps(state))
    argv = format_argv(BASE, {**files, "out": tmp_path / "out"}) + ["--resume", str(checkpoint)]
    assert finetune.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(rf"finetune\.py: error: {re.escape(str(state_file))} has no 'step': it is damaged or not "
                     r"looptrain's; resume from another checkpoint", err), err


def test_the_estimate_builds_its_model_from_a_config_never_leaving_trust_remote_code_unset(monkeypatch):
    """`from_config` with trust_remote_code left None asks "run the custom code? [y/N]" for a config that ships code:
    the estimate always decides (True only for a config class that is itself the checkpoint's trusted code)."""
    from transformers import AutoModelForSequenceClassification, BertConfig

    from looptrain.estimation import estimate

    seen = []
    real = AutoModelForSequenceClassification.from_config.__func__

    def recording(cls, config, **options):
        seen.append(options.get("trust_remote_code", "unset"))
        return real(cls, config, **options)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_config", classmethod(recording))
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=20, max_position_embeddings=32)
    estimate(config, 1, 8, cache=False)
    assert seen == [False]

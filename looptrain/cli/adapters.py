"""A peft LoRA adapter directory (a --lora run's final/) as a command line's --model: its adapter_config.json read,
its base resolved (--base-model, else the base it records), and the LoRA levers it was trained with.

`looptrain-predict` merges it into its base to predict; `looptrain-finetune` continues training it; looptrain-estimate
prices its base with its adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

from looptrain.cli.errors import UsageError

ADAPTER_CONFIG = "adapter_config.json"
CLASSIFIER_SUFFIXES = ("ForSequenceClassification",)
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # Qwen2ForCausalLM, GPT2LMHeadModel, ...
ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "adapter_model.bin")
# The LoRA levers an adapter fixes (its own rank, alpha, dropout and targets), by Strategy field and flag.
ADAPTER_LEVERS = {"lora_rank": "--lora", "lora_alpha": "--lora-alpha", "lora_dropout": "--lora-dropout",
                  "lora_targets": "--lora-targets", "qlora": "--qlora"}


def model_found(model_path: str) -> bool:
    """Whether `model_path` is a directory or a hub model in the local cache (nothing is downloaded)."""
    from huggingface_hub import try_to_load_from_cache

    if Path(model_path).is_dir():
        return True
    try:
        cached = try_to_load_from_cache(model_path, "config.json")
    except Exception:  # noqa: BLE001  not even a valid hub id (runs/x/final): a missing directory
        cached = None
    return isinstance(cached, str)


def is_adapter(model_path: str | None) -> bool:
    """Whether `model_path` is an adapter directory: an adapter_config.json and no config.json of a full model."""
    if model_path is None:
        return False
    directory = Path(model_path)
    return (directory / ADAPTER_CONFIG).is_file() and not (directory / "config.json").is_file()


def read_adapter(model_path: str | None, base_model: str | None = None) -> dict | None:
    """The adapter_config.json of a LoRA adapter `model_path` (a --lora run's final/), its "base" resolved:
    `base_model` (--base-model), else the base it records; None for a full model. A UsageError naming both ways on
    when the base is not here, and for --base-model with a full model."""
    if not is_adapter(model_path):
        if base_model is not None:
            raise UsageError(f"--base-model is for a LoRA adapter as --model, and {model_path} holds a full model; "
                             "drop --base-model")
        return None
    try:
        adapter = json.loads((Path(model_path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UsageError(f"--model {model_path}: cannot read its {ADAPTER_CONFIG} ({error}); save the adapter "
                         "again") from error
    if not isinstance(adapter, dict):
        raise UsageError(f"--model {model_path}: its {ADAPTER_CONFIG} is not a JSON object; save the adapter again")
    recorded = adapter.get("base_model_name_or_path")
    base = base_model or recorded
    if not base or not model_found(base):
        where = (f"--base-model {base}" if base_model else
                 f"its base {recorded!r} (as {ADAPTER_CONFIG} records it)" if recorded else "its base (unrecorded)")
        raise UsageError(f"--model {model_path} holds LoRA adapters, and {where} is not here (no such directory, nor a "
                         "hub model in the local cache); pass the base the run trained on with --base-model DIR, or "
                         "merge the adapters into full weights with looptrain-finetune --merge-lora (its final/merged/ "
                         "loads alone)")
    return {**adapter, "base": base}


def adapter_levers(adapter: dict, model_path: str) -> dict:
    """The `looptrain.Strategy` LoRA levers the adapter was trained with (its rank, alpha, dropout, targets): what a
    run that continues it trains, and what the estimate prices. A UsageError for an adapter that is not LoRA."""
    rank, targets = adapter.get("r"), adapter.get("target_modules")
    if adapter.get("peft_type", "LORA") != "LORA" or not isinstance(rank, int) or rank < 1:
        raise UsageError(f"--model {model_path} holds a {adapter.get('peft_type') or 'peft'} adapter without a LoRA "
                         "rank; looptrain continues LoRA adapters (a --lora run's final/)")
    if not isinstance(targets, list) or not targets:  # peft also takes a regex string, which looptrain cannot price
        raise UsageError(f"--model {model_path}: its target_modules {targets!r} are not a list of module names; "
                         "looptrain continues adapters whose targets are named (a --lora run's final/)")
    alpha = adapter.get("lora_alpha")
    return {"lora_rank": rank, "lora_alpha": alpha if isinstance(alpha, int) and alpha != 2 * rank else 0,
            "lora_dropout": float(adapter.get("lora_dropout") or 0.0),
            "lora_targets": ",".join(sorted(map(str, targets))), "qlora": False}


def check_no_lora_flags(model_path: str, given) -> None:
    """A UsageError when LoRA flags come with an adapter --model: it brings its own rank, alpha, dropout and
    targets (--qlora included: its base is loaded as it was saved)."""
    clashing = [flag for flag in ADAPTER_LEVERS.values() if flag in given]
    if clashing:
        raise UsageError(f"--model {model_path} is a LoRA adapter, which keeps its own rank, alpha, dropout and "
                         f"targets ({ADAPTER_CONFIG}) and trains on its base as saved; drop {', '.join(clashing)} "
                         "(or pass the base as --model to train new adapters)")


def adapter_fingerprints(model_path: str) -> dict:
    """The adapter's files (config and weights), each's size and whole-content hash: what a run that continues the
    adapter must find again on resume."""
    from looptrain.ledger import file_fingerprint

    directory = Path(model_path)
    return {name: file_fingerprint(directory / name) for name in ADAPTER_FILES if (directory / name).is_file()}


def tokenizer_path(model_path: str, adapter: dict | None) -> str:
    """Where the tokenizer is read: the adapter directory when it holds tokenizer files (a run's final/ does), else
    the base."""
    if adapter is None:
        return model_path
    directory = Path(model_path)
    held = any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                                          "tokenizer.model"))
    return model_path if held else adapter["base"]


def adapter_kind(adapter: dict, model_path: str) -> str:
    """"classifier" or "causal_lm" from the adapter's task_type (or, for an older adapter, its base model class)."""
    task = adapter.get("task_type")
    base_class = str((adapter.get("auto_mapping") or {}).get("base_model_class") or "")
    if task == "SEQ_CLS" or base_class.endswith(CLASSIFIER_SUFFIXES):
        return "classifier"
    if task == "CAUSAL_LM" or base_class.endswith(CAUSAL_LM_SUFFIXES):
        return "causal_lm"
    raise UsageError(f"--model {model_path} holds LoRA adapters for {task or base_class or 'an unrecorded task'}, not "
                     "for a sequence classifier or a causal LM; pass a --lora run's final/ directory")

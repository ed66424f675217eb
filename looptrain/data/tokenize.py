"""Tokenization: loads a fast tokenizer and turns texts into unpadded token ids (TokenizedDataset).

Truncation to ``max_length`` happens here, padding does not: :mod:`looptrain.data.collate` pads
each batch only as far as it needs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from looptrain.data.errors import DataError
from looptrain.data.readers import LanguageModelingData, TextClassificationData
from looptrain.data.store import IGNORE_INDEX, TokenizedDataset, TokenRowsBuilder

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | os.PathLike, use_fast: bool = True, allow_slow: bool = False, **kwargs: Any):
    """Loads a tokenizer with ``AutoTokenizer``, insisting on a fast (Rust) one.

    Fast tokenizers batch-encode many times faster than Python ones and report truncation exactly.

    Args:
        path: A local directory or a hub id.
        use_fast: Ask for the fast tokenizer (transformers 5 always tries fast first).
        allow_slow: Accept a slow (Python) tokenizer when no fast one exists. ``use_fast=False``
            also counts as opting in.
        **kwargs: Passed to ``AutoTokenizer.from_pretrained``.

    Returns:
        The tokenizer.

    Raises:
        DataError: When the tokenizer cannot be loaded, or only a slow one exists and slow was not
            allowed.
    """
    from transformers import AutoTokenizer

    # Never None: transformers then asks "Do you wish to run the custom code? [y/N]" on stdin, and a "y"
    # runs code shipped with the checkpoint that nobody opted in to. Callers pass True to opt in.
    kwargs.setdefault("trust_remote_code", False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(path), use_fast=use_fast, **kwargs)
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):
            raise DataError(
                f"{os.fspath(path)!r} ships its own Python code (auto_map in its config), which is not run "
                "unless you ask: pass trust_remote_code=True (--trust-remote-code) only if you trust that code"
            ) from error
        raise DataError(
            f"could not load a tokenizer from {os.fspath(path)!r} ({error}); pass a directory with "
            "tokenizer files (tokenizer.json) or a hub id that is in the local cache"
        ) from error
    if not getattr(tokenizer, "is_fast", False) and use_fast and not allow_slow:
        raise DataError(
            f"only a slow (Python) tokenizer exists for {os.fspath(path)!r} ({type(tokenizer).__name__}); "
            "it is much slower for batch tokenization. Pass allow_slow=True to use it anyway, or save a "
            "tokenizer.json (fast tokenizer) beside the model"
        )
    return tokenizer


def tokenize(
    data: TextClassificationData,
    tokenizer,
    max_length: int,
    batch_size: int = 1000,
    progress: bool = True,
) -> TokenizedDataset:
    """Tokenizes texts (or text pairs) in batches, truncating to ``max_length`` and not padding.

    Padding is left to :class:`DynamicPaddingCollator`, so each batch is padded only as far as it
    needs. The number of truncated samples is logged and kept on the result (``num_truncated``).

    Args:
        data: What :func:`read_classification_data` returned.
        tokenizer: A Hugging Face tokenizer (fast ones report truncation without a second pass).
        max_length: Longest sequence, special tokens included.
        batch_size: Texts per tokenizer call.
        progress: Show a tqdm bar; it appears only for more than one batch on a terminal.

    Returns:
        A :class:`TokenizedDataset` with ``lengths`` and ``num_truncated``.

    Raises:
        DataError: When ``max_length`` or ``batch_size`` is not a positive integer.
    """
    from tqdm.auto import tqdm

    if not isinstance(max_length, int) or max_length < 1:
        raise DataError(f"max_length must be a positive integer, got {max_length!r}")
    if batch_size < 1:
        raise DataError(f"batch_size must be positive, got {batch_size}")
    is_fast = bool(getattr(tokenizer, "is_fast", False))
    rows = TokenRowsBuilder()
    num_truncated = 0
    total = len(data.texts)
    # disable=None lets tqdm hide itself on non-TTY outputs (logs, CI); small inputs never show a bar.
    disable = None if progress and total > batch_size else True
    with tqdm(total=total, desc="tokenizing", unit="samples", disable=disable) as bar:
        for start in range(0, total, batch_size):
            texts = data.texts[start : start + batch_size]
            pairs = data.text_pairs[start : start + batch_size] if data.text_pairs is not None else None
            encoded = tokenizer(
                texts, pairs, truncation=True, max_length=max_length, padding=False, return_attention_mask=False
            )
            if is_fast and encoded.encodings is not None:
                # The Rust tokenizer keeps what truncation cut in `overflowing`: an exact count for free.
                num_truncated += sum(1 for encoding in encoded.encodings if encoding.overflowing)
            else:
                full = tokenizer(texts, pairs, truncation=False, padding=False, return_attention_mask=False)
                num_truncated += sum(1 for ids in full["input_ids"] if len(ids) > max_length)
            types = encoded.get("token_type_ids") or [None] * len(texts)
            for ids, token_types in zip(encoded["input_ids"], types):
                rows.add(ids, token_types=token_types)
            bar.update(len(texts))
    if num_truncated:
        logger.info(
            "tokenize: %d of %d samples (%.1f%%) truncated to max_length=%d",
            num_truncated, total, 100.0 * num_truncated / max(total, 1), max_length,
        )
    return rows.dataset(data.labels, num_truncated=num_truncated, max_length=max_length,
                        label_names=data.label_names)


def tokenize_lm(data: LanguageModelingData, tokenizer, max_length: int, batch_size: int = 1000) -> TokenizedDataset:
    """Tokenizes a causal LM's data into input ids and token labels, EOS appended, truncated to ``max_length``.

    - ``text``: the labels are the input ids (loss on every token; the model shifts them).
    - ``prompt_response``: the prompt is tokenized with the tokenizer's special tokens (a BOS where it adds
      one), the response without, one after the other; the prompt's labels are -100 (loss on the response only).
    - ``messages``: the chat is rendered with ``tokenizer.apply_chat_template`` (its text, then tokenized with no
      added special tokens: the template writes its own). When the last message is the assistant's and the
      chat's text starts with the text of the chat before it plus the generation prompt, that prefix is the
      prompt (-100) and the last assistant turn the response; otherwise the loss is on every token.

    The EOS token is appended to every sample (unless it already ends with it), so the model learns to stop.
    A sample longer than ``max_length`` keeps its first ``max_length`` tokens (its EOS is then cut) and is
    counted in ``num_truncated``. A sample left with no token to predict (the model shifts its labels, so the
    first is never scored: a prompt that fills ``max_length`` by itself, a lone token) would add nothing to
    the loss, and a batch of only such samples would divide by zero: it is dropped, counted in ``num_dropped``.

    Args:
        data: What :func:`read_lm_data` returned.
        tokenizer: A Hugging Face tokenizer with an EOS token (and, for chats, a chat template).
        max_length: Longest sequence, EOS and special tokens included.
        batch_size: Texts per tokenizer call.

    Returns:
        A :class:`TokenizedDataset` whose ``labels`` are one list of token labels per sample.

    Raises:
        DataError: When ``max_length`` is not a positive integer, the tokenizer has no EOS token, chats come
            with a tokenizer that has no chat template, or every sample was dropped.
    """
    if not isinstance(max_length, int) or max_length < 1:
        raise DataError(f"max_length must be a positive integer, got {max_length!r}")
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        raise DataError(
            f"the tokenizer ({type(tokenizer).__name__}) has no EOS token, and a causal LM learns to stop from the "
            "EOS appended to every sample; set one and save it with the model "
            "(tokenizer.eos_token = '...'; tokenizer.save_pretrained(MODEL_DIR))"
        )
    prompts, responses, special = _lm_segments(data, tokenizer)
    rows = TokenRowsBuilder()
    num_truncated = num_dropped = 0
    for start in range(0, len(responses), batch_size):
        chunk = slice(start, start + batch_size)
        response_ids = _encode(tokenizer, responses[chunk], special and prompts is None)
        prompt_ids = (_encode(tokenizer, prompts[chunk], special) if prompts is not None
                      else [[] for _ in response_ids])
        for prompt, response in zip(prompt_ids, response_ids):
            sample = prompt + response
            if not sample or sample[-1] != eos_id:
                sample = sample + [eos_id]
            sample_labels = [IGNORE_INDEX] * len(prompt) + sample[len(prompt):]
            if len(sample) > max_length:
                num_truncated += 1
                sample, sample_labels = sample[:max_length], sample_labels[:max_length]
            if all(label == IGNORE_INDEX for label in sample_labels[1:]):
                num_dropped += 1  # nothing to predict (the model shifts: the first label is never scored)
                continue
            rows.add(sample, sample_labels)
    if not rows:
        raise DataError(f"{data.source}: no sample has a token to predict within --max-length {max_length} (every "
                        "prompt fills it by itself); raise --max-length or shorten the prompts")
    if num_truncated:
        logger.info("tokenize_lm: %d of %d samples truncated to max_length=%d", num_truncated, len(responses),
                    max_length)
    return rows.dataset(num_truncated=num_truncated, max_length=max_length, num_dropped=num_dropped)


def _lm_segments(data: LanguageModelingData, tokenizer) -> tuple[list[str] | None, list[str], bool]:
    """(prompts or None, responses, whether the tokenizer adds its special tokens) of each sample, as text."""
    if data.kind == "text":
        return None, list(data.texts), True
    if data.kind == "prompt_response":
        return list(data.texts), list(data.responses or []), True
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{data.source} holds chats (a messages column), and the tokenizer has no chat template to render them "
            "with; use a model whose tokenizer has one (an instruct/chat model), or set it and save it with the "
            "model (tokenizer.chat_template = '{% for m in messages %}...{% endfor %}'; "
            "tokenizer.save_pretrained(MODEL_DIR)), or write the data as prompt/response or text columns"
        )
    prompts, responses = [], []
    for chat in data.messages or []:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        prefix = ""
        if len(chat) > 1 and chat[-1]["role"] == "assistant":
            before = tokenizer.apply_chat_template(chat[:-1], tokenize=False, add_generation_prompt=True)
            prefix = before if text.startswith(before) else ""
        prompts.append(prefix)
        responses.append(text[len(prefix):])
    return prompts, responses, False


def _encode(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text, untruncated (the caller truncates the joined sample and counts it)."""
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens, truncation=False, padding=False,
                        return_attention_mask=False, verbose=False)
    return [list(ids) for ids in encoded["input_ids"]]

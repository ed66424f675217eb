"""Tokenization: loads a fast tokenizer and turns texts into unpadded token ids (TokenizedDataset).

Truncation to ``max_length`` happens here, padding does not: :mod:`looptrain.data.collate` pads
each batch only as far as it needs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from looptrain.data.chat import LOSS_ON, chat_sample
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


def tokenize_lm(data: LanguageModelingData, tokenizer, max_length: int, batch_size: int = 1000,
                loss_on: str = "assistant") -> TokenizedDataset:
    """Tokenizes a causal LM's data into input ids and token labels (-100 where there is no loss), truncated.

    As TRL's SFTTrainer does (docs/data.md, "Masks"):

    - ``text``: the text with the tokenizer's special tokens, EOS appended; loss on every token.
    - ``prompt_response``: prompt and completion tokenized together (with special tokens, EOS appended), the
      loss on the tokens after the prompt's: those the prompt's own tokens (its closing EOS, if the tokenizer
      adds one, left out) share with the start of the whole. Where the prompt's tokens are not a prefix of the
      whole (a prompt ending in a space), one warning counts the rows and the merged token is trained.
    - ``messages``: the chat rendered with ``tokenizer.apply_chat_template`` (``tools=`` the row's tools) and
      tokenized with no added special tokens and no EOS appended (the template writes both); the loss on every
      assistant turn (:func:`looptrain.data.chat.chat_sample`), after the prompt's for conversational
      prompt/completion data (``data.prompt_turns``).

    ``loss_on`` narrows or widens that: ``"last"`` trains only a chat's last assistant turn (a chat that does
    not end with one is an error), ``"all"`` every token of every kind. A sample longer than ``max_length``
    keeps its first ``max_length`` tokens and is counted in ``num_truncated``. A sample left with no token to
    predict (the model shifts its labels, so the first is never scored) would add nothing to the loss, and a
    batch of only such samples would divide by zero: it is dropped, counted in ``num_dropped``.

    Args:
        data: What :func:`read_lm_data` returned.
        tokenizer: A fast Hugging Face tokenizer with an EOS token (and, for chats, a chat template).
        max_length: Longest sequence, EOS and special tokens included.
        batch_size: Texts per tokenizer call.
        loss_on: ``"assistant"`` (the default), ``"last"`` or ``"all"``.

    Returns:
        A :class:`TokenizedDataset` whose ``labels`` are one list of token labels per sample, and whose
        ``num_scored`` says how many tokens carry a loss.

    Raises:
        DataError: When ``max_length`` is not a positive integer, ``loss_on`` is unknown, the tokenizer has no EOS
            token, chats come with a tokenizer that has no chat template, a chat's assistant turns cannot be found
            (the message names the template, the chat and the levers), or every sample was dropped.
    """
    if not isinstance(max_length, int) or max_length < 1:
        raise DataError(f"max_length must be a positive integer, got {max_length!r}")
    if loss_on not in LOSS_ON:
        raise DataError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        raise DataError(
            f"the tokenizer ({type(tokenizer).__name__}) has no EOS token, and a causal LM learns to stop from the "
            "EOS appended to every sample; set one and save it with the model "
            "(tokenizer.eos_token = '...'; tokenizer.save_pretrained(MODEL_DIR))"
        )
    if data.kind == "messages":
        samples = _chat_samples(data, tokenizer, loss_on)
    else:
        samples = _text_samples(data, tokenizer, eos_id, batch_size, loss_on)
    rows = TokenRowsBuilder()
    num_truncated = num_dropped = num_scored = 0
    for sample, mask in samples:
        if len(sample) > max_length:
            num_truncated += 1
            sample, mask = sample[:max_length], mask[:max_length]
        sample_labels = [token if trained else IGNORE_INDEX for token, trained in zip(sample, mask)]
        scored = sum(mask[1:])  # the model shifts: the first label is never scored
        if not scored:
            num_dropped += 1
            continue
        num_scored += scored
        rows.add(sample, sample_labels)
    if not rows:
        raise DataError(f"{data.source}: no sample has a token to predict within --max-length {max_length} (every "
                        "prompt fills it by itself); raise --max-length or shorten the prompts")
    if num_truncated:
        logger.info("tokenize_lm: %d of %d samples truncated to max_length=%d", num_truncated, len(data), max_length)
    return rows.dataset(num_truncated=num_truncated, max_length=max_length, num_dropped=num_dropped,
                        num_scored=num_scored)


def _text_samples(data: LanguageModelingData, tokenizer, eos_id: int, batch_size: int,
                  loss_on: str) -> Iterator[tuple[list[int], list[bool]]]:
    """(ids, loss mask) of each text or prompt/completion sample, EOS appended."""
    mismatched: list[int] = []
    for start in range(0, len(data.texts), batch_size):
        texts = data.texts[start:start + batch_size]
        if data.kind == "prompt_response":
            completions = (data.responses or [])[start:start + batch_size]
            wholes = _encode(tokenizer, [prompt + completion for prompt, completion in zip(texts, completions)])
            prompts = _encode(tokenizer, texts)
        else:
            wholes, prompts = _encode(tokenizer, texts), [[] for _ in texts]
        for offset, (whole, prompt) in enumerate(zip(wholes, prompts)):
            if prompt and prompt[-1] == eos_id:
                prompt = prompt[:-1]  # the tokenizer closes every text with EOS: not a token of the prompt
            masked = 0 if loss_on == "all" else len(os.path.commonprefix([prompt, whole]))
            if loss_on != "all" and masked < len(prompt):
                mismatched.append(start + offset)
            if not whole or whole[-1] != eos_id:
                whole = whole + [eos_id]
            yield whole, [False] * masked + [True] * (len(whole) - masked)
    if mismatched:
        first = mismatched[0]
        logger.warning(
            "tokenize_lm: in %d of %d samples of %s the prompt's tokens are not the start of the prompt+completion's "
            "(the tokenizer merges across the boundary, as for a prompt ending in a space); the loss starts after "
            "the tokens they share, so the merged token is trained. First: sample %d, prompt %r",
            len(mismatched), len(data.texts), data.source, first, data.texts[first][-40:])


def _chat_samples(data: LanguageModelingData, tokenizer, loss_on: str) -> Iterator[tuple[list[int], list[bool]]]:
    """(ids, loss mask) of each chat (:func:`looptrain.data.chat.chat_sample`); no EOS appended."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{data.source} holds chats (a messages column), and the tokenizer has no chat template to render them "
            "with; use a model whose tokenizer has one (an instruct/chat model), or set it and save it with the "
            "model (tokenizer.chat_template = '{% for m in messages %}...{% endfor %}'; "
            "tokenizer.save_pretrained(MODEL_DIR)), or write the data as prompt/response or text columns"
        )
    from jinja2 import TemplateError

    chats = data.messages or []
    unanswered = 0
    for index, chat in enumerate(chats):
        tools = data.tools[index] if data.tools is not None else None
        prompt_turns = data.prompt_turns[index] if data.prompt_turns is not None else 0
        try:
            sample = chat_sample(tokenizer, chat, tools, prompt_turns, loss_on, index)
        except DataError as error:
            raise DataError(f"{data.source}, {error}") from None
        except TemplateError as error:  # the template's own raise_exception, or a template that cannot render
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise DataError(f"{data.source}, sample {index}: the chat template of {name!r} refused the chat or its "
                            f"first messages ({error}); fix the chat's roles and order, or train on every token with "
                            "--loss-on all (which renders only the whole chat)") from None
        yield sample
        unanswered += chat[-1].get("role") != "assistant"
    if unanswered and loss_on == "assistant":
        logger.warning("tokenize_lm: %d of %d chats of %s do not end with an assistant turn; their earlier "
                       "assistant turns are trained", unanswered, len(chats), data.source)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text with the tokenizer's special tokens, untruncated (the caller truncates and counts)."""
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=True, truncation=False, padding=False,
                        return_attention_mask=False, verbose=False)
    return [list(ids) for ids in encoded["input_ids"]]

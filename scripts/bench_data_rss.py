"""Benchmark: what a causal LM's tokenized data costs in memory (RSS), per token.

Writes a JSONL file of about ``--tokens`` tokens (``text`` rows, or ``prompt``/``completion`` rows) into a temporary
directory, then, in a fresh Python process per kind, reads it with ``read_lm_data`` and tokenizes it with
``tokenize_lm``, printing the process's RSS (``VmRSS`` in /proc/self/status) after the imports, after reading, after
tokenizing, and after dropping the read data (then again after glibc's ``malloc_trim(0)`` hands freed heap pages
back), with the peak (``VmHWM``). The tokenizer is a word-level one built in code from ``--vocab`` words, so one
word is one token and the token count is known: the words, plus the EOS ``tokenize_lm`` appends to each sample.

Bytes per token: the store's arrays (``TokenizedDataset.rows.nbytes``; absent before the store existed) and by
RSS (after the drop and the trim, minus after the imports): what holding the tokenized data costs the process.

Run (one CPU core is enough; the file is about 60 MB a kind)::

    PYTHONPATH=. python scripts/bench_data_rss.py --tokens 10000000
    PYTHONPATH=../other-checkout python scripts/bench_data_rss.py --tokens 10000000   # another checkout's looptrain

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

EOS = "</s>"
MIB = 1024**2


def words(vocab: int) -> list[str]:
    return [f"w{index}" for index in range(vocab)]


def write_data(path: str, kind: str, tokens: int, vocab: int, seed: int = 0) -> int:
    """A JSONL file of rows of 20 to 180 words (mean 100) until ``tokens`` tokens; returns the exact token count
    (words + one EOS a row)."""
    rng = np.random.default_rng(seed)
    names = np.array(words(vocab))
    total = 0
    with open(path, "w", encoding="utf-8") as handle:
        while total < tokens:
            length = int(rng.integers(20, 181))
            row = names[rng.integers(0, vocab, length)]
            if kind == "text":
                record = {"text": " ".join(row)}
            else:
                cut = length // 3
                record = {"prompt": " ".join(row[:cut]), "completion": " ".join(row[cut:])}
            handle.write(json.dumps(record) + "\n")
            total += length + 1
    return total


def build_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {word: index for index, word in enumerate(["<unk>", EOS, *words(vocab)])}
    backend = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=EOS, pad_token=EOS)


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, MiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.split()[0] if value.split() else "0"
    return int(fields["VmRSS"]) / 1024, int(fields["VmHWM"]) / 1024


def child(path: str, kind: str, vocab: int) -> dict:
    """Reads and tokenizes the file in this (fresh) process; the RSS at each point."""
    import torch  # noqa: F401  (looptrain imports it: counted in the baseline, not in the data)

    from looptrain.data import read_lm_data, tokenize_lm

    tokenizer = build_tokenizer(vocab)
    marks = {"import": rss_mib()[0]}
    data = read_lm_data(path, response_column="completion")
    marks["read"] = rss_mib()[0]
    dataset = tokenize_lm(data, tokenizer, max_length=1024)
    marks["tokenized"] = rss_mib()[0]
    del data
    gc.collect()
    marks["dropped"] = rss_mib()[0]
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    marks["trimmed"], marks["peak"] = rss_mib()
    rows = getattr(dataset, "rows", None)
    return {"marks": marks, "tokens": int(np.sum(dataset.lengths)), "samples": len(dataset),
            "store_bytes": rows.nbytes if rows is not None else None}


def cpu_line() -> str:
    import torch

    try:
        from looptrain.precision import cpu_has_native_bf16

        bf16 = "yes" if cpu_has_native_bf16() else "no"
    except ImportError:
        bf16 = "unknown"
    return f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 {bf16}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=10_000_000, help="tokens a file holds (about)")
    parser.add_argument("--vocab", type=int, default=4000, help="words of the word-level tokenizer")
    parser.add_argument("--kinds", default="text,prompt", help="text and/or prompt (prompt/completion rows)")
    parser.add_argument("--child", nargs=2, metavar=("FILE", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.vocab)))
        return
    print(cpu_line())
    print("| data | tokens | samples | RSS import | read | tokenized | raw data dropped | trimmed | peak | "
          "store B/token | RSS B/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as directory:
        for kind in args.kinds.split(","):
            path = os.path.join(directory, f"{kind}.jsonl")
            expected = write_data(path, kind, args.tokens, args.vocab)
            run = subprocess.run([sys.executable, __file__, "--vocab", str(args.vocab), "--child", path, kind],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            result = json.loads(run.stdout.strip().splitlines()[-1])
            marks, tokens = result["marks"], result["tokens"]
            assert tokens == expected, f"{tokens} tokens stored, {expected} written"
            store = (f"{result['store_bytes'] / tokens:.2f}" if result["store_bytes"] is not None else "-")
            by_rss = (marks["trimmed"] - marks["import"]) * MIB / tokens
            label = "text" if kind == "text" else "prompt/completion"
            print(f"| {label} ({os.path.getsize(path) / MIB:.0f} MiB) | {tokens:,} | {result['samples']:,} | "
                  + " | ".join(f"{marks[key]:.0f}" for key in ("import", "read", "tokenized", "dropped", "trimmed",
                                                                "peak"))
                  + f" | {store} | {by_rss:.1f} |")


if __name__ == "__main__":
    main()

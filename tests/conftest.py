"""Tiny models, tokenizers and data shared by the test suite (CPU, no network)."""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# looptrain's on-disk caches (estimates, the matmul peak): one fresh directory per test session, never the user's.
if "LOOPTRAIN_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["LOOPTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="looptrain-test-cache-")
# A run's own estimate, computed beside its updates, is waited for whatever the machine's load (a run waits at most
# max(2 s, 2% of its time): tests/test_run_estimate.py checks that limit).
os.environ.setdefault("LOOPTRAIN_ESTIMATE_WAIT", "600")

import pytest
import torch
from torch import nn

WORDS = (
    "the a good bad movie film great awful plot actor loved hated boring fun long short "
    "story ending music scene slow fast best worst funny sad happy dull bright dark"
).split()


class OneWeight(nn.Module):
    """y = w * x with a single scalar weight: the analytic oracle for the loop's update."""

    def __init__(self, w: float = 0.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(float(w)))

    def forward(self, x):
        return self.w * x


class SmallMLP(nn.Module):
    """Two-layer MLP classifier returning an object with `.loss` and `.logits`, like HF models."""

    def __init__(self, in_features: int = 8, hidden: int = 16, num_labels: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_labels))

    def forward(self, x, labels=None):
        logits = self.net(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class DtypeProbe(nn.Module):
    """A linear classifier that records the dtype of its logits: what autocast ran it in."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.seen = []

    def forward(self, x, labels):
        logits = self.linear(x)
        self.seen.append(logits.dtype)
        return {"loss": nn.functional.cross_entropy(logits.float(), labels), "logits": logits}


def run_torchrun(command: list[str], environment: dict, cwd: Path, timeout: float = 240, attempts: int = 2):
    """A torchrun launch (about 10-20 s on 2 cores). One that does not end within `timeout` is launched again (a
    warning says so), up to `attempts` launches; then the test fails with what the last one printed (the ranks'
    progress), so that a hang says where it stopped. Twice, in fresh-clone .ci/run runs, a 2-rank launch that passes
    in 10-17 s ran past 300-600 s after both ranks had wrapped their models, and did not again on the same commit:
    a launch that hangs, not a result that differs (every launch's result is still checked by its test)."""
    import subprocess
    import warnings

    for attempt in range(1, attempts + 1):
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, cwd=cwd)
        except subprocess.TimeoutExpired as error:
            if attempt < attempts:
                warnings.warn(f"torchrun did not end within {timeout:.0f} s: launched again", stacklevel=2)
                continue

            def text(value) -> str:
                return (value.decode(errors="replace") if isinstance(value, bytes) else value or "")[-3000:]

            pytest.fail(f"torchrun did not end within {timeout:.0f} s, {attempts} times; stdout: {text(error.stdout)}"
                        f"\nstderr: {text(error.stderr)}")
    raise AssertionError("unreachable")


def run_two_ranks(script: str, arguments: list[str], output: Path) -> dict:
    """tests/`script` launched on 2 gloo ranks with `arguments` and `output` last (one thread a rank, offline), which
    must exit 0; returns what rank 0 saved to `output` (`leave_group`)."""
    import sys

    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "2",
               str(root / "tests" / script), *arguments, str(output)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    result = run_torchrun(command, environment, root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(output)


def leave_group(loop, output: str) -> None:
    """The end of a rank launched by `run_two_ranks`: rank 0 saves the trained weights and the step to `output`;
    then every rank leaves the group together (a rank that exits while gloo's threads still serve the other aborts:
    "terminate called without an active exception")."""
    from looptrain import distributed

    if int(os.environ["RANK"]) == 0:
        torch.save({"state_dict": loop.model.state_dict(), "step": loop.step}, output)
    distributed.shutdown()
    assert not torch.distributed.is_initialized(), "shutdown left the group the Loop joined"


def exit_rank(code: int) -> None:
    """Ends a rank without the interpreter's finalization: a rank aborted there once in a CI run (SIGABRT,
    "terminate called without an active exception") although the group had been destroyed; the result is saved,
    the streams flushed."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quiet_config(**fields):
    """A LoopConfig for tests: no bar, no logs, no evaluation schedule, CPU, no tensor tracker (unless given)."""
    from looptrain import LoopConfig

    defaults = {"progress_bar": False, "log_every": 1000, "eval_every": "no", "device": "cpu", "track_memory": False}
    return LoopConfig(**{**defaults, **fields})


def mlp_batches(count: int, rows: int = 8, seed: int = 0) -> list[dict]:
    """`count` batches for SmallMLP: 8 features, labels in 0..2."""
    generator = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, 8, generator=generator),
             "labels": torch.randint(0, 3, (rows,), generator=generator)}
            for _ in range(count)]


def live_loops_and_optimizers() -> tuple[int, int]:
    """How many `Loop`s and torch optimizers the collector tracks now (alive, or garbage not yet collected)."""
    import gc

    from looptrain.loop import Loop

    objects = gc.get_objects()
    return (sum(isinstance(item, Loop) for item in objects),
            sum(isinstance(item, torch.optim.Optimizer) for item in objects))


def settled_rss_meter():
    """An RSS meter counting from the RSS after the heap's free pages are given back, as each probe's own start gives
    them back (`Meter.settle`): a baseline taken before would leave every ceiling and peak as much off as earlier
    tests left freed."""
    from looptrain.planning import probes

    probes.Meter("rss", 0).settle()
    return probes.Meter("rss", probes.rss_baseline_bytes())


def make_tiny_bert(num_labels: int = 3, num_layers: int = 2, seed: int = 0, **overrides):
    """A tiny BertForSequenceClassification with dropout off (deterministic)."""
    from transformers import BertConfig, BertForSequenceClassification

    fields = {"vocab_size": len(WORDS) + 5, "hidden_size": 32, "num_hidden_layers": num_layers,
              "num_attention_heads": 2, "intermediate_size": 37, "max_position_embeddings": 64,
              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_labels": num_labels}
    config = BertConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


def task_batches(count: int, seed: int, rows: int = 16, length: int = 12) -> list[dict]:
    """A learnable sequence task for the tiny BERT: the label is the first token's id modulo 3."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(5, len(WORDS) + 5, (rows, length), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[:, 0] % 3})
    return batches


def make_tiny_tokenizer():
    """A fast WordPiece tokenizer over WORDS, built in memory with the `tokenizers` library."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: index for index, token in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=64,
    )


def random_token_batches(lengths, vocab_size: int, num_labels: int = 3, seed: int = 0):
    """One padded batch per list of lengths: dicts of input_ids, attention_mask, labels."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for batch_lengths in lengths:
        width = max(batch_lengths)
        input_ids = torch.zeros(len(batch_lengths), width, dtype=torch.long)
        attention_mask = torch.zeros(len(batch_lengths), width, dtype=torch.long)
        for row, length in enumerate(batch_lengths):
            input_ids[row, :length] = torch.randint(5, vocab_size, (length,), generator=generator)
            attention_mask[row, :length] = 1
        labels = torch.randint(0, num_labels, (len(batch_lengths),), generator=generator)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return batches


# ------------------------------------------------------------------ the CPU a test pretends to run on
# Tests of a hardware-dependent choice (what --amp means, which precisions the planner tries, bf16 weights as a
# lever) pin the CPU with these fixtures and assert both behaviours, so no result depends on the machine. They
# carry the `hardware` marker (added below), which .ci/run runs again under ONEDNN_MAX_CPU_ISA=AVX512_CORE and under
# the AVX2 variables.
# "speed" is what looptrain.precision.measure_cpu_matmul_speed returns there (FLOP/s of one core); "scratch" what
# looptrain.memory.kernels.measure_bf16_matmul_scratch does (bytes a bf16 matmul holds inside per output element).
CPU_KINDS = {
    "avx2": {"native_bf16": False, "native_fp16": False, "capability": "AVX2", "amx": False,
             "speed": {"fp32": 1e11, "bf16": 1e9}, "scratch": 0.0},
    "native-bf16": {"native_bf16": True, "native_fp16": False, "capability": "AVX512", "amx": True,
                    "speed": {"fp32": 1e11, "bf16": 2.2e11}, "scratch": 0.3},
    # AVX-512 without its bf16 instructions (Skylake / Cascade Lake): oneDNN reports bf16, which runs slower.
    "avx512-core": {"native_bf16": True, "native_fp16": False, "capability": "AVX512", "amx": False,
                    "avx512_bf16": False, "speed": {"fp32": 1e11, "bf16": 2.9e10}, "scratch": 4.4},
}
CPU_KIND_FIXTURES = {"cpu_kind", "avx2_cpu", "amx_cpu", "avx512_core_cpu"}


def pin_cpu(monkeypatch, kind: str) -> str:
    """Makes looptrain see the CPU `kind` of CPU_KINDS: oneDNN's bf16/fp16 report, torch's capability and the
    measured matmul speeds (the measurement pinned, its caches fresh: a disk entry of the real CPU is not read).

    Modules that imported the capability functions by name hold their own binding: every looptrain module
    loaded so far is patched, not only looptrain.precision.
    """
    import sys

    from looptrain import precision
    from looptrain.memory import kernels

    facts = CPU_KINDS[kind]
    replacements = {
        precision.cpu_has_native_bf16: lambda: facts["native_bf16"],
        precision.cpu_has_native_fp16: lambda: facts["native_fp16"],
    }
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "looptrain" or name.startswith("looptrain.")):
            continue
        for attribute in ("cpu_has_native_bf16", "cpu_has_native_fp16"):
            original = getattr(module, attribute, None)
            if original in replacements:
                monkeypatch.setattr(module, attribute, replacements[original])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: facts["capability"])
    monkeypatch.setattr(precision, "measure_cpu_matmul_speed", lambda: dict(facts["speed"]))
    monkeypatch.setattr(precision, "_SPEEDS", {})
    monkeypatch.setattr(precision, "SPEED_CACHE_KIND", f"matmul_speed-pinned-{kind}")
    monkeypatch.setattr(precision, "onednn_isa_cap", lambda: None)
    monkeypatch.setattr(kernels, "measure_bf16_matmul_scratch", lambda: facts["scratch"])
    monkeypatch.setattr(kernels, "_SCRATCH", {})
    monkeypatch.setattr(kernels, "SCRATCH_CACHE_KIND", f"matmul_scratch-pinned-{kind}")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: facts["amx"], raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: facts.get("avx512_bf16", facts["native_bf16"]),
                        raising=False)
    return kind


@pytest.fixture(params=["avx2", "native-bf16"])
def cpu_kind(request, monkeypatch) -> str:
    """Runs the test once per CPU kind ("avx2", "native-bf16"), pinned; the test asserts each kind's behaviour."""
    return pin_cpu(monkeypatch, request.param)


@pytest.fixture
def avx2_cpu(monkeypatch):
    """A CPU like a 2-core AMD EPYC with AVX2 only: oneDNN has no native bf16 or fp16 there."""
    return pin_cpu(monkeypatch, "avx2")


@pytest.fixture
def amx_cpu(monkeypatch):
    """A CPU with AMX (Sapphire Rapids and later): native bf16."""
    return pin_cpu(monkeypatch, "native-bf16")


@pytest.fixture
def avx512_core_cpu(monkeypatch):
    """An AVX-512 CPU without AVX512_BF16 or AMX: oneDNN reports bf16, whose matmuls run 0.29x fp32's speed."""
    return pin_cpu(monkeypatch, "avx512-core")


def pytest_collection_modifyitems(config, items):
    """A test that pins the CPU kind tests a hardware-dependent choice: it gets the `hardware` marker."""
    for item in items:
        if CPU_KIND_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.hardware)


@pytest.fixture
def tiny_bert():
    return make_tiny_bert()


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _keep_kernel_cache_variables(monkeypatch):
    """A command line run under --memory-budget as the process's own caps oneDNN's kernel caches through the
    environment (`allocator.cap_kernel_caches`): each test ends with the variables as it found them."""
    import os

    from looptrain.memory.allocator import KERNEL_CACHE_VARIABLES

    for name in KERNEL_CACHE_VARIABLES:
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture(autouse=True)
def _report_png_only_where_tested(request, monkeypatch):
    """Drawing report.png is a large share of a tiny in-process run's time (docs/testing.md), over a hundred runs:
    only the tests marked `report` (tests/test_report.py, the SFT page's test) draw it, with matplotlib; the other
    in-process runs check everything else a run writes. Subprocess runs always draw."""
    if request.node.get_closest_marker("report") is None:
        import looptrain.report

        monkeypatch.setattr(looptrain.report, "report_after_run",
                            lambda run_dir: f"(report.png not drawn in this test: tests/conftest.py; {run_dir})")


@pytest.fixture(autouse=True)
def _reset_bnb_overrides():
    """bitsandbytes' GlobalOptimManager is process-global: start and end every test clean."""
    yield
    # Any exception, not only ImportError: a bitsandbytes built for another torch fails on import with
    # AttributeError (or RuntimeError, OSError), and this teardown runs after every test: a miss would fail them all.
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except Exception:  # noqa: BLE001 (bitsandbytes missing or unloadable: nothing to reset)
        return
    manager = GlobalOptimManager.get_instance()
    manager.initialize()


def save_tiny_bert(directory: Path, vocab_size: int = len(WORDS) + 5) -> Path:
    """A tiny BERT encoder (dropout off, seed 0) and the tiny fast tokenizer, saved like a hub checkpoint."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(directory)
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny BERT encoder (dropout off) and its fast tokenizer, saved like a hub checkpoint."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def write_csv(path: Path, rows: int, seed: int = 0) -> Path:
    generator = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for _ in range(rows):
            label = generator.choice(["pos", "neg"])
            cue = generator.choice(["good great loved fun", "bad awful hated dull"][label == "neg"].split())
            words = [generator.choice(WORDS) for _ in range(generator.randint(2, 12))] + [cue]
            generator.shuffle(words)
            writer.writerow([" ".join(words), label])
    return path


# ------------------------------------------------------------------ the reference run of the reliability suites
# tests/test_reliability.py and tests/test_ledger.py share these. Module scope, as before: each module gets its own
# data and its own uninterrupted run. The command line they run (flags, one thread) stays in test_reliability.py.
@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reliability-data")
    return write_csv(directory / "train.csv", 32, seed=5), write_csv(directory / "eval.csv", 16, seed=6)


@pytest.fixture(scope="module")
def uninterrupted(model_dir, data_files, tmp_path_factory):
    """The reference run, in-process: its final weights are what every interrupted run must reach."""
    from test_reliability import TOTAL_STEPS, argv, run_in_process

    output_dir = tmp_path_factory.mktemp("uninterrupted")
    assert run_in_process(argv(model_dir, data_files, output_dir)) == 0
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == TOTAL_STEPS
    return output_dir

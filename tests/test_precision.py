"""`--amp` / precision="auto" pick what is fast on the hardware; emulated precisions run with a warning."""

from __future__ import annotations

import pytest
import torch

from looptrain import Loop, LoopConfig, precision

from conftest import DtypeProbe

pytestmark = pytest.mark.hardware


def test_amp_on_a_cpu_without_native_bf16_means_fp32_and_says_why(avx2_cpu):
    chosen, reason = precision.amp_precision(torch.device("cpu"))
    assert chosen == "fp32"
    assert reason == ("--amp: this CPU has no native bf16 (AVX2); training in fp32, which is faster here; "
                      "force with --precision bf16")
    assert precision.resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert precision.resolve_precision("bf16", torch.device("cpu")) == "bf16"  # an explicit choice stands


def test_amp_on_a_cpu_with_native_bf16_means_bf16(amx_cpu):
    chosen, reason = precision.amp_precision(torch.device("cpu"))
    assert chosen == "bf16"
    assert reason == "--amp: bf16 autocast (this CPU has native bf16: AVX512+AVX512_BF16+AMX)"


@pytest.mark.parametrize("has_bf16, expected", [(True, "bf16"), (False, "fp16")])
def test_amp_on_cuda_is_bf16_where_the_gpu_has_it_else_fp16(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: has_bf16)
    assert precision.amp_precision(torch.device("cuda"))[0] == expected


def test_emulated_precisions_are_named_in_a_warning(avx2_cpu):
    cpu = torch.device("cpu")
    assert "bf16 on a CPU without native bf16 (AVX2): it is emulated and several times slower" in \
        precision.emulation_warning(cpu, "bf16")
    assert "fp16 on a CPU without native fp16 (AVX2)" in precision.emulation_warning(cpu, "fp16")
    assert precision.emulation_warning(cpu, "fp32") is None


def test_no_warning_where_bf16_is_native(amx_cpu):
    assert precision.emulation_warning(torch.device("cpu"), "bf16") is None


def fit_probe(**fields) -> tuple[DtypeProbe, dict]:
    model = DtypeProbe()
    batches = [{"x": torch.randn(3, 4), "labels": torch.tensor([0, 1, 0])}]
    config = LoopConfig(progress_bar=False, device="cpu", track_memory=False, eval_every="no", **fields)
    return model, Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, config=config).fit()


def test_loop_auto_precision_follows_the_hardware(avx2_cpu, capsys):
    model, summary = fit_probe(precision="auto")
    assert set(model.seen) == {torch.float32} and summary["precision"] == "fp32"
    assert "AVX2" in summary["cpu"]
    assert "warning" not in capsys.readouterr().out


def test_loop_auto_precision_uses_native_bf16(amx_cpu):
    model, summary = fit_probe(precision="auto")
    assert set(model.seen) == {torch.bfloat16} and summary["precision"] == "bf16"


def test_explicit_bf16_on_an_avx2_cpu_runs_with_one_warning(avx2_cpu, capsys):
    model, summary = fit_probe(precision="bf16")
    assert set(model.seen) == {torch.bfloat16} and summary["precision"] == "bf16"
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: precision bf16 on a CPU without native bf16 (AVX2): it is emulated and several "
                        "times slower than fp32 here (use --amp or --precision fp32 for speed)"]


def test_cpu_description_names_model_and_capability():
    description = precision.cpu_description()
    assert torch.backends.cpu.get_cpu_capability() in description
    assert precision.cpu_name() in description and f"{torch.get_num_threads()} threads" in description

"""`--amp` / precision="auto" pick what is fast on the hardware, as measured; slow precisions run with a warning."""

from __future__ import annotations

import re

import pytest
import torch

from looptrain import Loop, LoopConfig, precision
from looptrain.planning.plans import Levers
from looptrain.planning.search import searched_numerics
from looptrain.strategy import Strategy

from conftest import DtypeProbe

pytestmark = pytest.mark.hardware


def test_amp_on_a_cpu_without_native_bf16_means_fp32_and_says_why(avx2_cpu):
    chosen, reason = precision.amp_precision(torch.device("cpu"))
    assert chosen == "fp32"
    assert reason == ("--amp: fp32: bf16 matmuls run 0.01x the speed of fp32 on this CPU (measured; AVX2); "
                      "bf16 autocast needs 1.1x; force with --precision bf16")
    assert precision.resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert precision.resolve_precision("bf16", torch.device("cpu")) == "bf16"  # an explicit choice stands


def test_amp_on_a_cpu_with_native_bf16_means_bf16(amx_cpu):
    chosen, reason = precision.amp_precision(torch.device("cpu"))
    assert chosen == "bf16"
    assert reason == ("--amp: bf16 autocast: bf16 matmuls run 2.2x the speed of fp32 on this CPU "
                      "(measured; AVX512+AVX512_BF16+AMX)")


def test_amp_where_onednn_reports_bf16_but_it_measures_slow_means_fp32(avx512_core_cpu):
    """An AVX-512 CPU without AVX512_BF16/AMX: oneDNN says bf16 is supported; the measurement decides."""
    assert precision.cpu_has_native_bf16()
    chosen, reason = precision.amp_precision(torch.device("cpu"))
    assert chosen == "fp32" and not precision.cpu_bf16_is_fast()
    assert re.fullmatch(r"--amp: fp32: bf16 matmuls run 0\.29x the speed of fp32 on this CPU \(measured; AVX512\); "
                        r"bf16 autocast needs 1\.1x; force with --precision bf16", reason), reason
    assert precision.emulation_warning(torch.device("cpu"), "bf16").startswith(
        "precision bf16 is slower than fp32 here: bf16 matmuls run 0.29x the speed of fp32")


@pytest.mark.parametrize("bf16, expected, line", [
    (1.2e11, "bf16", r"--amp: bf16 autocast: bf16 matmuls run 1\.2x the speed of fp32 on this CPU \(measured; .+\)"),
    (1.05e11, "fp32", r"--amp: fp32: bf16 matmuls run 1\.05x .+; bf16 autocast needs 1\.1x; force with .+"),
    (None, "fp32", r"--amp: fp32: this CPU has no bf16 matmul in this torch \(.+\); bf16 autocast needs 1\.1x; .+"),
])
def test_amp_follows_the_measured_ratio_by_the_rule(monkeypatch, bf16, expected, line):
    """bf16 autocast only where bf16 matmuls measured >= 1.1x fp32's speed (1.05x: fp32; none at all: fp32)."""
    monkeypatch.setattr(precision, "measure_cpu_matmul_speed", lambda: {"fp32": 1e11, "bf16": bf16})
    monkeypatch.setattr(precision, "_SPEEDS", {})
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", "off")
    chosen, reason = precision.amp_precision(torch.device("cpu"))
    assert chosen == expected and precision.resolve_precision("auto", torch.device("cpu")) == expected
    assert re.fullmatch(line, reason), reason


def test_the_measurement_is_made_once_and_cached_in_process_and_on_disk(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(precision, "measure_cpu_matmul_speed", lambda: calls.append(1) or {"fp32": 1e11, "bf16": 3e10})
    monkeypatch.setattr(precision, "_SPEEDS", {})
    monkeypatch.setenv("LOOPTRAIN_CACHE_DIR", str(tmp_path))
    assert precision.cpu_bf16_speedup() == pytest.approx(0.3)
    assert precision.amp_precision(torch.device("cpu"))[0] == "fp32"
    assert len(calls) == 1  # the second call read the process's cache
    monkeypatch.setattr(precision, "_SPEEDS", {})  # a new process: the disk entry is read
    assert precision.cpu_bf16_speedup() == pytest.approx(0.3) and len(calls) == 1
    assert list((tmp_path / precision.SPEED_CACHE_KIND).glob("*.json"))


def test_the_measurement_is_quick_and_restores_the_threads():
    threads = torch.get_num_threads()
    speed = precision.measure_cpu_matmul_speed(side=32, repeats=2)
    assert speed["fp32"] > 0 and (speed["bf16"] is None or speed["bf16"] > 0)
    assert torch.get_num_threads() == threads


def test_the_planner_does_not_try_bf16_for_speed_where_it_measures_slow(avx512_core_cpu):
    numerics = searched_numerics(Strategy(), Levers(precision=True), set(), "cpu")
    assert numerics == [("fp32", "fp32")]


def test_the_planner_tries_bf16_where_it_measures_fast(amx_cpu):
    numerics = searched_numerics(Strategy(), Levers(precision=True), set(), "cpu")
    assert numerics == [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]


@pytest.mark.parametrize("has_bf16, expected", [(True, "bf16"), (False, "fp16")])
def test_amp_on_cuda_is_bf16_where_the_gpu_has_it_else_fp16(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: has_bf16)
    assert precision.amp_precision(torch.device("cuda"))[0] == expected


def test_emulated_precisions_are_named_in_a_warning(avx2_cpu):
    cpu = torch.device("cpu")
    assert "bf16 is slower than fp32 here: bf16 matmuls run 0.01x the speed of fp32 on this CPU (measured; AVX2)" in \
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
    assert warnings == ["warning: precision bf16 is slower than fp32 here: bf16 matmuls run 0.01x the speed of fp32 "
                        "on this CPU (measured; AVX2) (use --amp or --precision fp32 for speed)"]


def test_cpu_description_names_model_and_capability():
    description = precision.cpu_description()
    assert torch.backends.cpu.get_cpu_capability() in description
    assert precision.cpu_name() in description and f"{torch.get_num_threads()} threads" in description


@pytest.mark.slow  # a dozen estimates of a tiny Qwen2: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_lowest_may_pick_bf16_for_memory_and_says_how_slow_it_is_here(avx512_core_cpu):
    from test_estimate_causal_lm import qwen2_config

    from looptrain import planning

    result = planning.lowest(qwen2_config(), 2, 16)
    assert result.settings.weights == "bf16"  # the lightest numerics, although bf16 measured slower here
    assert result.notes == ["bf16 chosen for memory, not speed: bf16 matmuls run 0.29x the speed of fp32 on this CPU "
                            "(measured; AVX512)"]

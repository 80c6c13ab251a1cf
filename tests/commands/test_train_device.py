"""``grpo-mem train --device cpu|cuda|auto --dtype fp32|bf16|auto``: how the flags resolve, the GRPOConfig they
give, and the CUDA memory figure (per-step ``torch.cuda.max_memory_allocated``) through report and comparison. No
GPU is needed: CUDA availability and the CUDA allocator's statistics are stood in for where a test needs them."""

from __future__ import annotations

import types

import pytest
import torch

from grpo_mem.commands import train
from grpo_mem.commands.report import totals
from grpo_mem.commands.train import build_parser
from grpo_mem.commands.train_settings import TrainSettings, grpo_config_kwargs, make_grpo_config, resolve_device


@pytest.mark.parametrize(
    "device,dtype,cuda,bf16,expected",
    [
        ("auto", "auto", False, False, ("cpu", "fp32")),
        ("auto", "auto", True, True, ("cuda", "bf16")),
        ("auto", "auto", True, False, ("cuda", "fp32")),  # e.g. a V100 or T4: no bf16
        ("cpu", "auto", True, True, ("cpu", "fp32")),
        ("cpu", "bf16", False, False, ("cpu", "bf16")),  # TRL's bf16 autocast on CPU, asked for explicitly
        ("cuda", "fp32", True, True, ("cuda", "fp32")),
        ("auto", "fp32", True, True, ("cuda", "fp32")),
    ],
)
def test_resolve_device(device, dtype, cuda, bf16, expected):
    assert resolve_device(device, dtype, cuda_available=cuda, bf16_supported=bf16) == expected


@pytest.mark.parametrize(
    "device,dtype,cuda,bf16,match",
    [
        ("cuda", "auto", False, False, r"--device cuda: torch sees no CUDA device"),
        ("cuda", "bf16", True, False, r"--dtype bf16: this CUDA device does not support bf16"),
        ("tpu", "auto", True, True, r"--device must be one of auto, cpu, cuda, got 'tpu'"),
        ("cpu", "fp16", True, True, r"--dtype must be one of auto, fp32, bf16, got 'fp16'"),
    ],
)
def test_resolve_device_refuses_by_name(device, dtype, cuda, bf16, match):
    with pytest.raises(ValueError, match=match):
        resolve_device(device, dtype, cuda_available=cuda, bf16_supported=bf16)


def test_flags_parse_and_bad_values_exit_2(capsys):
    parser = build_parser()
    settings = parser.parse_settings(["--device", "cuda", "--dtype", "bf16"])
    assert (settings.device, settings.dtype) == ("cuda", "bf16")
    defaults = parser.parse_settings([])
    assert (defaults.device, defaults.dtype) == ("auto", "auto")
    for argv, message in (
        (["--device", "tpu"], "device must be one of auto, cpu, cuda, got 'tpu'"),
        (["--dtype", "fp16"], "dtype must be one of auto, fp32, bf16, got 'fp16'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_settings(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_grpo_config_kwargs_per_device_and_dtype():
    settings = TrainSettings()
    cpu = grpo_config_kwargs(settings, "out", "cpu", "fp32")
    assert (cpu["use_cpu"], cpu["bf16"], cpu["fp16"]) == (True, False, False)
    cuda = grpo_config_kwargs(settings, "out", "cuda", "bf16")
    assert (cuda["use_cpu"], cuda["bf16"], cuda["fp16"]) == (False, True, False)
    assert {k: v for k, v in cpu.items() if k not in ("use_cpu", "bf16")} == {
        k: v for k, v in cuda.items() if k not in ("use_cpu", "bf16")
    }
    extra = grpo_config_kwargs(TrainSettings(extra={"bf16": False}), "out", "cuda", "bf16")
    assert extra["bf16"] is False  # --extra is applied last


def test_without_a_gpu_auto_trains_on_cpu_in_fp32_and_cuda_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = make_grpo_config(TrainSettings(), tmp_path)
    assert config.use_cpu is True and config.bf16 is False and config.fp16 is False
    with pytest.raises(SystemExit) as exit_info:  # refused before anything is loaded
        train.main(["--device", "cuda", "--output-dir", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch sees no CUDA device" in err
    assert not (tmp_path / "x").exists()


def _fake_cuda(monkeypatch, peaks):
    """Stand-ins for the CUDA allocator statistics the step callback reads: each step's peak (bytes) from ``peaks``."""
    calls = []
    state = {"peak": 0}

    def reset():
        calls.append("reset")
        state["peak"] = peaks.pop(0)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: reset())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: state["peak"])
    return calls


def test_cuda_step_memory_is_the_peak_allocation_reported_and_compared(monkeypatch, tmp_path):
    """The step callback on CUDA: peak statistics reset at each step's start, read after a synchronise at its end
    (MB = 2**20 bytes); the summary, printed text and figure use it as the run's memory figure; ``--compare``'s
    ratios include it."""
    from grpo_mem.commands.compare import compare_runs, format_compare
    from grpo_mem.commands.memory import RssSampler, make_step_stats_callback
    from grpo_mem.commands.report import format_summary, plot_summary, step_rows

    def run(peaks_mb, patched):
        calls = _fake_cuda(monkeypatch, [int(p * 2**20) for p in peaks_mb])
        callback = make_step_stats_callback(RssSampler(), cuda=True)
        for step in range(1, len(peaks_mb) + 1):
            callback.on_step_begin(None, types.SimpleNamespace(global_step=step - 1), None)
            callback.on_step_end(None, types.SimpleNamespace(global_step=step), None)
        assert calls == ["sync", "reset", "sync"] * len(peaks_mb)
        rows = step_rows(callback.records, [{"step": s, "reward": 0.5, "loss": 0.1, "grad_norm": 1.0} for s in (1, 2)])
        assert [r["peak_cuda_allocated_mb"] for r in rows] == peaks_mb
        summary = {
            "model": "/m/tiny",
            "task": "chain_sum",
            "patched": patched,
            "device": "cuda",
            "dtype": "bf16",
            "few_shot": 0,
            "settings": {"num_generations": 8},
            "prompt_tokens": {"min": 40, "max": 43, "mean": 41.5, "shared_prefix": 32},
            "steps": rows,
            "totals": totals(rows),
            "rss_before_train_mb": 600.0,
            "ru_maxrss_mb": 1000.0,
            "train_time_s": 9.0,
            "wall_time_s": 10.0,
            "conversion_time_s": 0.0,
            "grpo_mem_warnings": [],
            "files": {"json": str(tmp_path / "s.json"), "png": str(tmp_path / f"s{patched}.png")},
        }
        assert summary["totals"]["peak_cuda_allocated_mb"] == max(peaks_mb)
        return summary

    stock, patched = run([3000.0, 3500.0], False), run([1000.0, 1400.0], True)
    text = format_summary(patched)
    assert "grpo_mem patch, cuda bf16" in text and "peak CUDA alloc MB" in text.splitlines()[2]
    assert text.splitlines()[3].split()[4] == "1000"  # step 1's figure is the CUDA peak, not the RSS
    assert "peak CUDA allocated (torch.cuda.max_memory_allocated): max over steps 1400 MB" in text
    plot_summary(patched, tmp_path / "one.png")
    assert (tmp_path / "one.png").read_bytes()[:4] == b"\x89PNG"
    compared = compare_runs(stock, patched)
    assert compared["ratios"]["peak_cuda_allocated_mb"] == pytest.approx(1400 / 3500)
    both = {"runs": {"stock": stock, "patched": patched}, **compared, "files": stock["files"]}
    lines = format_compare(both).splitlines()
    assert "peak CUDA alloc MB" in lines[1] and lines[3].split()[3:5] == ["3000", "1000"]
    assert "patched / stock: peak CUDA alloc 0.400x (max over steps)" in format_compare(both)


def test_cpu_summary_without_device_key_reads_as_before(tmp_path):
    """A summary written before ``--device`` existed (no ``device`` key) is a CPU run: RSS is its memory figure."""
    from grpo_mem.commands.report import memory_figure

    assert memory_figure({}) == ("peak_rss_mb", "peak RSS")
    assert memory_figure({"device": "cpu"}) == ("peak_rss_mb", "peak RSS")

"""bench_long.py end to end at a tiny size, in this process: the CSV's columns, grpo_mem equal to stock (log-probs,
every parameter's gradient), and the table's ratios equal to the measured figures they are made of."""

import os
import sys

import pytest
from helpers import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_long  # noqa: E402

from grpo_mem.bench import harness  # noqa: E402
from grpo_mem.bench.results import CSV_COLUMNS  # noqa: E402
from grpo_mem.bench.tokens import token_counts  # noqa: E402

TINY = ("qwen3-4b/64/8/4", "qwen3.5-4b/64/8/4")


@pytest.fixture
def in_process(monkeypatch):
    """Each cell runs in this process (a fresh process per provider costs ~30 s of imports here); the CPU cut made
    smaller still (hidden 64, vocabulary 512) so a run takes seconds."""
    import importlib

    def launcher(target, **_):
        module, name = target.split(":")
        return getattr(importlib.import_module(module), name)

    monkeypatch.setattr(bench_long, "isolated", launcher)
    cut = bench_long.cut_for_cpu
    monkeypatch.setattr(bench_long, "cut_for_cpu", lambda config: cut(config, hidden=64, vocab=512))


def _csv_by(path):
    rows = harness.read_csv(str(path))
    return rows, {(r["config"]["model"], r["provider"], r["metric"]): r for r in rows}


def test_tiny_run_writes_the_csv_and_its_ratios(tmp_path, in_process):
    csv_path, png = tmp_path / "long.csv", tmp_path / "long.png"
    assert bench_long.main(["--only", ",".join(TINY), "--csv", str(csv_path), "--png", str(png)]) == 0
    with open(csv_path) as f:
        assert tuple(f.readline().strip().split(",")) == CSV_COLUMNS
    rows, by = _csv_by(csv_path)
    assert {r["provider"] for r in rows} == {"full_seq", "grpo_mem"}
    summary = {s["model"]: s for s in bench_long.summary(str(csv_path))}
    assert set(summary) == {"qwen3-4b", "qwen3.5-4b"}
    for model, s in summary.items():
        stock_t, ours_t = by[(model, "full_seq", "wall_time")]["p50"], by[(model, "grpo_mem", "wall_time")]["p50"]
        stock_m = by[(model, "full_seq", "peak_rss_above_base")]["p50"]
        ours_m = by[(model, "grpo_mem", "peak_rss_above_base")]["p50"]
        assert s["time_ratio"] == pytest.approx(ours_t / stock_t, rel=1e-12)
        assert s["mem_ratio"] == pytest.approx(ours_m / stock_m, rel=1e-12)
        assert s["ideal"] == round(token_counts(4, 64, 8)["ideal_ratio"], 4)
        assert s["time_over_ideal"] == pytest.approx(s["time_ratio"] / s["ideal"], rel=1e-12)
        assert s["mem_over_ideal"] == pytest.approx(s["mem_ratio"] / s["ideal"], rel=1e-12)
        # grpo_mem scores what stock scores: log-probs within 1e-5, every parameter's gradient within 1e-4 of its norm
        assert s["logp_diff"] <= 1e-5 and s["grad_diff"] <= 1e-4, (model, s["logp_diff"], s["grad_diff"])
        assert "hidden 64" in s["cut"] and "vocabulary 512" in s["cut"]
    table = bench_long.table(str(csv_path))
    assert f"| qwen3-4b | 64 | 8 | 4 | {summary['qwen3-4b']['ideal']:.3f} |" in table
    assert png.stat().st_size > 0


def test_a_stock_run_that_does_not_fit_is_skipped_and_estimated(tmp_path, in_process):
    csv_path = tmp_path / "long.csv"
    # a reserve above the machine's memory: no stock run fits
    argv = ["--only", TINY[0], "--csv", str(csv_path), "--png", str(tmp_path / "l.png"), "--reserve-gb", "1e6"]
    assert bench_long.main(argv) == 0
    rows, by = _csv_by(csv_path)
    assert "stock does not fit" in by[("qwen3-4b", "full_seq", "wall_time")]["config"]["skipped"]
    (s,) = bench_long.summary(str(csv_path))
    ours = by[("qwen3-4b", "grpo_mem", "peak_rss_above_base")]
    assert s["mem_estimated"] and s["time_ratio"] is None
    assert s["mem_ratio"] == pytest.approx(ours["p50"] / (ours["config"]["estimated_stock_peak_gb"] * 1e3))
    assert s["logp_diff"] <= 1e-5  # against a plain no-grad forward instead
    assert "est. (does not fit)" in bench_long.table(str(csv_path))


def test_grid_and_cut():
    full = bench_long.grid(full=True)
    assert len(full) == 2 * 4 * 3 * 2 and ("qwen3.5-4b", 32768, 4096, 16) in full
    assert bench_long.grid(full=False) == list(bench_long.CPU_GRID)
    cut = bench_long.model_config("qwen3.5-4b", cpu_cut=True)
    assert (cut["hidden_size"], cut["intermediate_size"], cut["vocab_size"]) == (256, 928, 8192)
    assert cut["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(ValueError, match="model/P/C/G"):
        bench_long.parse_only("qwen3-4b/4096/64")
    with pytest.raises(ValueError, match="multiple of 64"):
        bench_long.cut_for_cpu(cut, hidden=100)

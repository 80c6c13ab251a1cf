"""The benchmark harness measures known allocations and writes its CSV schema exactly."""

import csv
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from grpo_mem.bench import harness

ALLOC_BYTES = 200 * 10**6  # 200 MB, fp32
THIS = os.path.abspath(__file__)


def alloc_worker(args: dict) -> dict:
    """Worker run in a fresh process: one op that allocates, touches and frees ``args['bytes']`` bytes."""
    n = args["bytes"] // 4

    def op():
        t = torch.ones(n, dtype=torch.float32)  # ones() writes every page, so all of it becomes resident
        return float(t[-1])

    return dict(
        harness.measure(op, warmup=1, repeats=2, memory_repeats=2).to_dict(), once=harness.measure_once(op).to_dict()
    )


def grow_worker(args: dict) -> dict:
    keep = torch.ones(args["bytes"] // 4)
    return {"n": keep.numel()}


def failing_worker(args: dict) -> dict:
    raise ValueError(f"bad value {args['x']}")


@pytest.fixture(scope="module")
def isolated_results():
    """The three fresh-process runs, launched together to save wall time (each child spends seconds importing torch)."""
    calls = {
        "alloc": dict(target=f"{THIS}:alloc_worker", args={"bytes": ALLOC_BYTES}, timeout_s=120),
        "grow": dict(target=f"{THIS}:grow_worker", args={"bytes": 3 * 10**9}, rss_budget_mb=1500, timeout_s=120),
        "fail": dict(target=f"{THIS}:failing_worker", args={"x": -3}, timeout_s=120),
    }
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {
            k: pool.submit(harness.run_isolated, kw.pop("target"), kw.pop("args"), **kw) for k, kw in calls.items()
        }
        return {k: f.result() for k, f in futures.items()}


def test_known_allocation_in_fresh_process(isolated_results):
    res = isolated_results["alloc"]
    assert "skipped" not in res, res
    m = harness.Measurement.from_dict(res)
    mb = ALLOC_BYTES / harness.MB
    # The tracker sees exactly the storage (ones + the 4-byte scalar of t[-1]); RSS sees it plus a little slack
    for peak in m.peak_tensor_bytes:
        assert abs(peak / harness.MB - mb) <= 0.01 * mb, (peak, mb)
    for peak in m.peak_rss_above_base_bytes:
        assert abs(peak / harness.MB - mb) <= 0.05 * mb, (peak, mb)
    assert m.rss_method in ("vmhwm", "sampler")
    assert len(m.times_s) == len(m.cpu_times_s) == 2 and all(t > 0 for t in m.times_s + m.cpu_times_s)
    assert m.threads == 2


def test_measure_once_times_and_measures_the_same_call(isolated_results):
    res = isolated_results["alloc"]
    assert "skipped" not in res, res
    m = harness.Measurement.from_dict(res["once"])
    mb = ALLOC_BYTES / harness.MB
    assert len(m.times_s) == len(m.cpu_times_s) == len(m.peak_rss_above_base_bytes) == 1 and m.times_s[0] > 0
    assert abs(m.peak_rss_above_base_bytes[0] / harness.MB - mb) <= 0.05 * mb, (m.peak_rss_above_base_bytes, mb)
    assert m.peak_tensor_bytes == [] and m.mmap_threshold_fixed
    assert set(m.metrics()) == {"wall_time", "cpu_time", "peak_rss_above_base"}


def test_tracker_counts_views_once_and_ignores_inputs_and_inplace():
    w = torch.randn(300, 300, requires_grad=True)
    pre = torch.zeros(1_000_000)
    with harness.TensorMemoryTracker() as t:
        pre.add_(1.0)  # in place on a tensor made before the block: nothing new
        x = torch.randn(300, 300)  # 360 kB
        y = (x @ w).relu()  # mm output 360 kB, relu output 360 kB
        view = y[:10]
        del y  # the view keeps relu's storage alive; mm's output died (relu's backward needs only its own output)
        assert t.live_bytes == 2 * 360_000
        view.sum().backward()
        del x, view
    # w.grad (360 kB) outlives the block; everything else is gone
    assert t.live_bytes == 360_000
    assert t.peak_bytes >= 3 * 360_000


def test_rss_budget_and_failures_become_skips(isolated_results):
    res = isolated_results["grow"]
    assert res["skipped"].startswith("over the RSS budget of 1500 MB"), res
    assert "ValueError: bad value -3" in isolated_results["fail"]["skipped"], isolated_results["fail"]


def test_percentiles_match_numpy():
    v = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    p50, p20, p80 = harness.percentiles(v)
    np.testing.assert_allclose([p50, p20, p80], np.percentile(v, [50, 20, 80]), rtol=0, atol=1e-12)
    assert all(math.isnan(x) for x in harness.percentiles([]))


def _written_csv(tmp_path) -> tuple[str, list]:
    """Rows of two measured configurations and one skipped one, written to a CSV: (its path, the rows)."""
    m = harness.Measurement(
        times_s=[1.0, 2.0, 3.0],
        cpu_times_s=[2.0, 4.0, 6.0],
        peak_rss_above_base_bytes=[5 * 10**6],
        peak_tensor_bytes=[4 * 10**6],
        base_rss_bytes=10**8,
        rss_method="vmhwm",
        threads=2,
    )
    rows = harness.measurement_rows("group", "trl", "full", "P", 256, m, {"G": 4, "model": "llama"})
    rows += harness.measurement_rows("group", "trl", "full", "P", 512, m, {"G": 4, "model": "llama"})
    rows += harness.skipped_rows("group", "grpo_mem", "full", "P", 512, {"G": 4, "model": "llama"}, "too big")
    path = tmp_path / "r.csv"
    harness.write_csv(rows, str(path))
    return str(path), rows


CSV_COLUMNS = ["op", "provider", "mode", "metric", "unit", "x_name", "x_value", "p50", "p20", "p80", "config"]
CSV_COLUMNS += ["device", "timestamp", "version"]


def test_csv_schema(tmp_path):
    path, rows = _written_csv(tmp_path)
    with open(path, newline="") as f:
        assert next(csv.reader(f)) == CSV_COLUMNS
    back = harness.read_csv(path)
    assert len(back) == 2 * 4 + 4  # 4 metrics for each of 2 measured configurations, 4 skipped metrics
    by = {(r["provider"], r["metric"], r["x_value"]): r for r in back}
    t = by[("trl", "wall_time", "256")]
    assert (t["unit"], t["p50"], t["p20"], t["p80"]) == ("s", 2.0, 1.4, 2.6)
    assert t["config"] == {"G": 4, "model": "llama", "n": 3}
    assert (by[("trl", "cpu_time", "256")]["unit"], by[("trl", "cpu_time", "256")]["p50"]) == ("s", 4.0)
    r = by[("trl", "peak_rss_above_base", "512")]
    assert (r["unit"], r["p50"]) == ("MB", 5.0)
    assert by[("trl", "peak_tensor", "512")]["p50"] == 4.0
    s = by[("grpo_mem", "wall_time", "512")]
    assert math.isnan(s["p50"]) and s["config"]["skipped"] == "too big"
    for key in ("grpo_mem=", ";torch=", ";transformers=", ";trl="):
        assert key in t["version"]
    with pytest.raises(ValueError, match="mode must be one of"):
        harness.measurement_rows("group", "trl", "fwdbwd", "P", 1, harness.Measurement(times_s=[1.0]), {})
    harness.write_csv(rows[:1], path, append=True)
    assert len(harness.read_csv(path)) == 13
    with open(path, newline="") as f:
        skipped = [r for r in csv.DictReader(f) if r["provider"] == "grpo_mem"]
    assert skipped and all(r["p50"] == r["p20"] == r["p80"] == "" for r in skipped)


def test_plot_and_table(tmp_path):
    path, _ = _written_csv(tmp_path)
    png = tmp_path / "r.png"
    harness.plot_csv(path, str(png), op="group", panel_keys=("model", "G"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = harness.markdown_table(
        ["P", "provider", "time s"], [[256, "trl", 1.23456], [512, "trl", float("nan")], [1024, "trl", 3001.4]]
    )
    assert table.splitlines() == [
        "| P | provider | time s |",
        "|---:|---|---:|",
        "| 256 | trl | 1.23 |",
        "| 512 | trl | - |",
        "| 1024 | trl | 3001 |",
    ]


def _sweep_result(lp, ent, norm, **extra) -> dict:
    m = harness.Measurement(
        times_s=[1.0], cpu_times_s=[2.0], peak_rss_above_base_bytes=[3 * 10**6], peak_tensor_bytes=[10**6]
    )
    return dict(m.to_dict(), log_probs=lp, entropies=ent, grad_norm=norm, **extra)


_SWEEP_RESULTS = {
    "trl": _sweep_result([[-1.0, -2.0]], [[0.5, 0.25]], 4.0, n_params=10),
    "grpo_mem": _sweep_result(
        [[-1.0, -2.5]], [[0.5, 0.5]], 5.0, fallback_warnings=["grpo_mem: fell back"], prompt_passes_per_call=1.0
    ),
    "late": _sweep_result([[0.0]], [[0.0]], 3.0),
}


def _sweep() -> tuple[list, list, list]:
    """A sweep of 4 cells (trl, grpo_mem, a skipped one, one compared with an earlier reference):
    (its results, the cells launched, the lines reported)."""
    from grpo_mem.bench.sweep import Cell, Sweep

    launched, lines = [], []

    def launch(args):
        launched.append(args["provider"])
        return _SWEEP_RESULTS[args["provider"]]

    cells = [
        Cell("trl", 8, {"P": 8}, {"provider": "trl"}, key="a"),
        Cell("grpo_mem", 8, {"P": 8}, {"provider": "grpo_mem"}, key="a"),
        Cell("grpo_mem", 16, {"P": 16}, {"provider": "grpo_mem"}, key="b", skip="too big"),
        Cell("late", 32, {"P": 32}, {"provider": "late"}, key="c"),
    ]
    sweep = Sweep(
        "op", "P", launch, device="cpu", version="v", references={"c": {"grad_norm": 2.0}}, report=lines.append
    )
    return sweep.run(cells), launched, lines


def test_sweep_compares_with_trl_and_skips():
    """The one sweep runner: each cell launched in order, compared with the ``trl`` cell of its configuration (or an
    earlier reference), skipped cells recorded as such."""
    out, launched, lines = _sweep()
    assert launched == ["trl", "grpo_mem", "late"]  # the skipped cell is never launched
    c = out[1].config
    diffs = (c["logp_max_abs_diff_vs_trl"], c["entropy_max_abs_diff_vs_trl"], c["grad_norm_rel_diff_vs_trl"])
    assert diffs == (0.5, 0.25, 0.25)
    assert c["fallback"] == ["grpo_mem: fell back"] and c["prompt_passes_per_call"] == 1.0 and c["grad_norm"] == 5.0
    assert out[0].config == {"P": 8, "grad_norm": 4.0, "n_params": 10}  # the reference is not compared with itself
    assert out[3].config["grad_norm_rel_diff_vs_trl"] == 0.5 and "logp_max_abs_diff_vs_trl" not in out[3].config
    assert out[2].skipped == "too big" and {r["p50"] for r in out[2].rows} == {""}
    assert "SKIPPED (too big)" in lines[2] and "grad-norm rel diff vs trl 2.5e-01" in lines[1]
    assert len(out[1].rows) == 4 and {r["x_value"] for r in out[1].rows} == {8}


def test_sweep_rows_per_rank_of_a_multi_process_launch():
    from grpo_mem.bench.sweep import Cell, Sweep

    launch = lambda args: {"ranks": [_SWEEP_RESULTS["trl"], _SWEEP_RESULTS["trl"]]}  # noqa: E731
    ranks = Sweep("op", "G", launch, device="cpu", version="v", report=lambda line: None).run(
        [Cell("trl", 2, {"G": 2}, {})]
    )[0]
    configs = [json.loads(r["config"]) for r in ranks.rows if r["metric"] == "wall_time"]
    assert sorted((c["rank"], c["world"]) for c in configs) == [(0, 2), (1, 2)]


def test_sweep_csv_merge_replaces_only_the_rows_re_measured(tmp_path):
    from grpo_mem.bench.sweep import merge_csv

    out, _, _ = _sweep()
    path = str(tmp_path / "m.csv")
    key = lambda r: (r["provider"], r["x_value"], r["metric"])  # noqa: E731
    merge_csv(out[0].rows + out[1].rows, path, key)
    merge_csv(out[3].rows, path, key)  # a new configuration: added
    merge_csv(out[2].rows, path, key)  # grpo_mem at 16: added; nothing else replaced
    back = harness.read_csv(path)
    assert len(back) == 16 and sorted({r["provider"] for r in back}) == ["grpo_mem", "late", "trl"]
    merge_csv(out[1].rows[:1], path, key)  # re-measured: one row replaced, not duplicated
    assert len(harness.read_csv(path)) == 16


def test_sweep_compares_gradients_per_parameter_by_sketch():
    """Gradients of providers run in separate processes are compared per parameter through their sketches: equal
    gradients give ~0, one parameter off by 8 % of its norm is found at that parameter (the global norm hardly
    moves), a tiny parameter is measured against 1e-3 of the global norm, a missing gradient by its whole norm."""
    from grpo_mem.bench.group_worker import grad_sketches
    from grpo_mem.bench.sweep import compare_with_reference, grad_param_difference

    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    grads["1.bias"] *= 1e-6  # ~0: measured against the floor

    def sketched(changes):
        for n, p in model.named_parameters():
            p.grad = grads[n] + changes.get(n, 0)
        return grad_sketches(model)

    ref = sketched({})
    assert grad_param_difference(sketched({}), ref) == (0.0, "")
    off = 0.08 * grads["1.weight"].norm() * torch.randn(8, 64, generator=g) / 8**0.5 / 8
    worst, where = grad_param_difference(sketched({"1.weight": off}), ref)
    assert where == "1.weight" and 0.04 < worst < 0.16, worst  # the sketch's spread: about 25 % of the true 0.08
    worst, where = grad_param_difference(sketched({"1.bias": 1e-6 * torch.ones(8)}), ref)
    total = sum(float(v.norm()) ** 2 for v in grads.values()) ** 0.5
    true = 8**0.5 * 1e-6 / (1e-3 * total)  # |change| over the floor, not over the bias gradient's own 3e-6
    assert where == "1.bias" and true / 3 < worst < 3 * true and true < 1e-4, (worst, true)
    del ref["0.bias"]  # a gradient in one result only: its whole norm over the floor of the reference's global norm
    worst, where = grad_param_difference(sketched({}), ref)
    total = sum(v[0] ** 2 for v in ref.values()) ** 0.5
    assert where == "0.bias" and worst == pytest.approx(float(grads["0.bias"].norm()) / (1e-3 * total), rel=1e-6)
    changed = sketched({"0.weight": 0.1 * torch.randn(64, 64, generator=g)})
    c = compare_with_reference({"grad_sketches": sketched({})}, {"grad_sketches": changed})
    assert c["grad_param_worst_vs_trl"] == "0.weight" and c["grad_param_max_rel_diff_vs_trl"] > 1e-3

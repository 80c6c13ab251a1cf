"""bench_sp.py end to end at a tiny size (sp_size 2 scores what sp_size 1 scores, with less memory per rank), and the
paper estimate of a GRPO step's memory per GPU (``grpo_mem.bench.estimate.estimate_grpo_step``)."""

import math
import os
import sys

import pytest
import torch
from helpers import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_sp  # noqa: E402
import longest_prompt  # noqa: E402

from grpo_mem.bench import estimate, harness  # noqa: E402

# Qwen3-8B's sizes (estimate.QWEN3_8B_CONFIG) without building it: the estimate tests stay arithmetic only
QWEN3_8B = estimate.ModelShape(
    n_params=8_190_735_360,
    layers=36,
    hidden=4096,
    q_dim=32 * 128,
    kv_dim=8 * 128,
    intermediate=12288,
    vocab=151936,
    max_positions=40960,
    heads=32,
    kv_heads=8,
)


def test_quick_run_writes_rows_and_sp2_scores_as_sp1(tmp_path):
    csv_path, out = tmp_path / "sp.csv", tmp_path / "runs"
    assert bench_sp.main(["--quick", "--csv", str(csv_path), "--out-dir", str(out)]) == 0
    rows = harness.read_csv(str(csv_path))
    got = {(r["provider"], r["config"]["rank"], r["metric"]): r["p50"] for r in rows}
    metrics = ("wall_time", "cpu_time", "peak_rss_above_base", "peak_tensor")
    for provider, rank in (("sp1", 0), ("sp2", 0), ("sp2", 1)):
        for metric in metrics:
            value = got[(provider, rank, metric)]
            assert math.isfinite(value) and value > 0, (provider, rank, metric, value)
    assert len(rows) == 3 * len(metrics)
    sp1, sp2 = (torch.load(out / f"sp{k}" / "logps.pt") for k in (1, 2))
    assert sp1["logps"].shape == (bench_sp.QUICK["G"], bench_sp.QUICK["C"])
    assert float((sp2["logps"] - sp1["logps"]).abs().max()) <= 1e-5
    # the parameter gradient summed over the two ranks is the one-process gradient
    assert abs(sp2["grad_norm"] - sp1["grad_norm"]) <= 1e-5 * sp1["grad_norm"]
    # each rank holds about half the activations (the tracker counts tensors: no allocator noise)
    for rank in (0, 1):
        assert got[("sp2", rank, "peak_tensor")] < 0.85 * got[("sp1", 0, "peak_tensor")]
    assert "| 512, 32, 8 | 2 | zigzag | heads | 1 |" in bench_sp.table(str(csv_path))


def test_bench_expectation_splits_all_but_the_gathered_kv():
    one, two = bench_sp.expected(4096, 257, 8, 1), bench_sp.expected(4096, 257, 8, 2, "gather")
    assert two["gradients"] == one["gradients"]
    # without the gathered K/V (and the prompt K/V's gradients), the activations halve exactly (4096 prompt tokens and
    # C - 1 = 256 completion tokens a row: the completion pass runs C - 1, grpo_mem.bench.tokens.backbone_tokens)
    assert two["activations"] - two["gathered_kv"] == pytest.approx((one["activations"] - one["gathered_kv"]) / 2)
    shape = estimate.model_shape(bench_sp.model_spec(4096, 256))
    kv = 2 * shape.kv_dim * 4 * shape.layers  # bytes of every layer's K and V per token, fp32
    assert two["gathered_kv"] == kv * (2 * 4096 + 8 * 256)  # prompt K/V and their gradients, completion K/V (C - 1)
    # the head exchange: each rank keeps one of the 2 K/V heads, so everything halves
    heads = bench_sp.expected(4096, 257, 8, 2)
    assert heads["gathered_kv"] == two["gathered_kv"] / 2
    assert heads["activations"] == pytest.approx((one["activations"] - one["gathered_kv"]) / 2 + heads["gathered_kv"])


@pytest.mark.parametrize(("method", "k"), [("trl", 1), ("grpo_mem", 1), ("grpo_mem", 8)])
def test_step_estimate_grows_with_the_prompt(method, k):
    totals = [
        estimate.estimate_grpo_step(QWEN3_8B, method=method, P=P, C=1024, G=8, sp_size=k).total
        for P in (1, 1000, 8000, 64000, 128000)
    ]
    assert all(a < b for a, b in zip(totals, totals[1:])), totals


def test_sequence_parallel_divides_everything_under_the_head_exchange():
    P, C, G = 65536, 1025, 8  # C - 1 = 1024 completion tokens a row: divisible by every k
    one = estimate.estimate_grpo_step(QWEN3_8B, method="grpo_mem", P=P, C=C, G=G)
    for k in (2, 4, 8):
        sp = estimate.estimate_grpo_step(QWEN3_8B, method="grpo_mem", P=P, C=C, G=G, sp_size=k)
        assert sp.layer_inputs == pytest.approx(one.layer_inputs / k)
        assert sp.layer_activations == pytest.approx(one.layer_activations / k)
        assert sp.prompt_kv == pytest.approx(one.prompt_kv / k)  # the head exchange: 8 K/V heads, 8 / k a rank
        gather = estimate.activation_bytes(QWEN3_8B, method="grpo_mem", P=P, C=C, G=G, sp_size=k, exchange="gather")
        assert gather["prompt_kv"] == one.prompt_kv  # the all-gather: the whole prompt's K/V on every rank
        assert gather["prompt_kv"] == 2 * 36 * 2 * 1024 * P * 2  # K/V and gradients, every layer, bf16
        assert gather["kv_transient"] == 2 * 2 * 1024 * P * 2  # one layer's gathered K/V and gradient
        assert sp.kv_transient == pytest.approx(gather["kv_transient"] / k)
        assert (sp.model_states, sp.gathered_weights, sp.head) == (one.model_states, one.gathered_weights, one.head)
    assert one.kv_transient == 0
    # ZeRO-3: 16 bytes per parameter over 8 GPUs
    assert one.model_states == pytest.approx(QWEN3_8B.n_params * 2)


@pytest.mark.parametrize("G", [2, 8, 16])
def test_stock_needs_more_than_grpo_mem_for_groups(G):
    for P in (512, 8192, 32768):
        trl = estimate.estimate_grpo_step(QWEN3_8B, method="trl", P=P, C=1024, G=G)
        ours = estimate.estimate_grpo_step(QWEN3_8B, method="grpo_mem", P=P, C=1024, G=G)
        assert trl.total > ours.total, (G, P)


def test_longest_prompt_is_the_edge_of_the_budget():
    found = {}
    for method, k in (("trl", 1), ("grpo_mem", 1), ("grpo_mem", 8)):
        P = estimate.longest_prompt(QWEN3_8B, method=method, C=1024, G=8, sp_size=k)
        step = lambda n: estimate.estimate_grpo_step(QWEN3_8B, method=method, P=n, C=1024, G=8, sp_size=k)  # noqa: E731
        assert step(P).total <= estimate.H100_BYTES < step(P + 1).total
        found[(method, k)] = P
    assert 0 < found[("trl", 1)] < found[("grpo_mem", 1)] < found[("grpo_mem", 8)]
    assert estimate.longest_prompt(QWEN3_8B, method="trl", C=1024, G=8, budget=10 * estimate.GB) == 0  # states alone
    with pytest.raises(ValueError, match="sp_size must be 1, got 8"):
        estimate.estimate_grpo_step(QWEN3_8B, method="trl", P=10, C=10, G=8, sp_size=8)
    with pytest.raises(ValueError, match="sp_size must divide world=8, got 3"):
        estimate.estimate_grpo_step(QWEN3_8B, method="grpo_mem", P=10, C=10, G=8, sp_size=3)


def test_qwen3_8b_config_and_the_table():
    shape = estimate.model_shape(estimate.QWEN3_8B_CONFIG)  # on the meta device
    assert shape == QWEN3_8B
    found = longest_prompt.rows()
    assert [label for label, _, _ in found] == ["stock TRL", "grpo_mem", "grpo_mem + sp_size 8"]
    text = longest_prompt.table(found)
    for _, P, est in found:
        assert f"| {P} |" in text and est.total <= estimate.H100_BYTES

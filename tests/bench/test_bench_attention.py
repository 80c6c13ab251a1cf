"""bench_attention.py --device cuda: skipped cleanly without CUDA; its rows fit the shared CSV schema."""

import os
import sys

import pytest
import torch
from helpers import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_attention  # noqa: E402

from grpo_mem.bench import harness  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the sweep would run")
def test_cuda_sweep_without_cuda_prints_why_and_measures_nothing(tmp_path, capsys):
    csv_path = tmp_path / "attention_cuda.csv"
    assert bench_attention.main(["--device", "cuda", "--csv", str(csv_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped: no CUDA device" in out and "Nothing measured" in out
    assert not csv_path.exists()


def test_cuda_rows_fit_the_csv_schema_and_table(tmp_path):
    """A cuda_worker-shaped result (do_bench quantiles in s, peak bytes) becomes rows the harness writes and reads back,
    and the CUDA table shows them."""
    cfg = dict(B=16, P=512, C=64, Hq=8, Hkv=2, d=64, U=1, dtype="bf16")
    res = dict(
        time_s=[1.5e-3, 1.4e-3, 1.7e-3],
        op_peak_bytes=12 * 10**6,
        peak_bytes=80 * 10**6,
        device="cuda (NVIDIA H100 80GB HBM3)",
    )
    rows = []
    for provider in bench_attention.CUDA_PROVIDERS:
        rows += bench_attention.cuda_rows(res, provider, cfg)
    path = tmp_path / "attention_cuda.csv"
    harness.write_csv(rows, str(path))
    back = harness.read_csv(str(path))
    assert {(r["metric"], r["unit"]) for r in back} == {
        ("wall_time", "s"),
        ("peak_tensor", "MB"),
        ("peak_allocated", "MB"),
    }
    wall = next(r for r in back if r["metric"] == "wall_time")
    assert (wall["p50"], wall["p20"], wall["p80"]) == (1.5e-3, 1.4e-3, 1.7e-3)
    table = bench_attention.table(
        str(path), bench_attention.CUDA_PROVIDERS, ("wall_time", "peak_tensor"), ("time s", "tensor MB")
    )
    assert "time s triton" in table and "| 16, 512, 64, 8/2, 64, 1 |" in table

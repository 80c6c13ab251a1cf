"""Shared-prefix attention alone, forward + backward: the naive reference (prompt K/V materialised per completion,
GQA repeated) against grpo_mem's zero-copy backends ("torch" chunked matmuls, "cpu" ATen fused kernels).

    python benchmarks/bench_attention.py            # sweep, writes benchmarks/results/attention.csv and prints a table
    python benchmarks/bench_attention.py --table    # print the table from the CSV

Each (configuration, provider) runs in a fresh process on the shared harness (1 thread by default): wall and CPU
time, peak RSS above base and peak live tensor bytes of one forward+backward call.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

OP = "shared_prefix_attention"
PROVIDERS = ("ref", "torch", "cpu")
CSV_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention.csv")
# (B, P, C, Hq, Hkv, d, U): the group benchmark's layer shape, a longer prompt, four prompts, MHA-128
CONFIGS = [
    (16, 512, 64, 8, 2, 64, 1),
    (16, 1024, 64, 8, 2, 64, 1),
    (16, 512, 64, 8, 2, 64, 4),
    (8, 512, 64, 16, 2, 128, 1),
]


def worker(args: dict) -> dict:
    """One (configuration, provider): random fp32 inputs, left-padded prompts, EOS-padded completions."""
    import torch

    from grpo_mem.ops.attention import shared_prefix_attention, shared_prefix_attention_ref

    B, P, C, Hq, Hkv, d, U = (args[k] for k in ("B", "P", "C", "Hq", "Hkv", "d", "U"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, C, d, generator=g)
    k, v = torch.randn(B, Hkv, C, d, generator=g), torch.randn(B, Hkv, C, d, generator=g)
    pk, pv = torch.randn(U, Hkv, P, d, generator=g), torch.randn(U, Hkv, P, d, generator=g)
    index = torch.arange(B) % U
    prefix_mask = torch.arange(P)[None, :] >= (torch.arange(U)[:, None] * 7)  # prompts left-padded by 0, 7, 14, ...
    key_mask = torch.arange(C)[None, :] < (C - torch.arange(B)[:, None] % 5)  # completions shorter by 0..4 tokens
    leaves = [t.requires_grad_() for t in (q, k, v, pk, pv)]
    if args["provider"] == "ref":
        fn = shared_prefix_attention_ref
    else:
        def fn(*a, **kw):
            return shared_prefix_attention(*a, backend=args["provider"], **kw)

    def op():
        out = fn(*leaves, index, prefix_mask, key_mask, scale=d**-0.5)
        out.sum().backward()

    def setup():
        for t in leaves:
            t.grad = None

    m = harness.measure(op, setup=setup, warmup=1, repeats=args.get("repeats", 7), time_budget_s=20.0)
    return m.to_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="only print the table from the CSV")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--csv", default=CSV_PATH)
    opts = parser.parse_args(argv)
    if not opts.table:
        rows = []
        for B, P, C, Hq, Hkv, d, U in CONFIGS:
            cfg = dict(B=B, P=P, C=C, Hq=Hq, Hkv=Hkv, d=d, U=U)
            for provider in PROVIDERS:
                res = harness.run_isolated("bench_attention:worker", dict(cfg, provider=provider), threads=opts.threads)
                if "skipped" in res:
                    rows += harness.skipped_rows(OP, provider, "full", "P", P, cfg, res["skipped"])
                else:
                    rows += harness.measurement_rows(OP, provider, "full", "P", P, res, cfg)
                print(provider, cfg, "done", flush=True)
        os.makedirs(os.path.dirname(opts.csv), exist_ok=True)
        harness.write_csv(rows, opts.csv)
    print(table(opts.csv))
    return 0


def table(path: str) -> str:
    cells: dict = {}
    for r in harness.read_csv(path):
        cfg = r["config"]
        key = tuple(cfg[k] for k in ("B", "P", "C", "Hq", "Hkv", "d", "U"))
        cells[(key, r["provider"], r["metric"])] = r["p50"]
    keys = sorted({k for k, _, _ in cells}, key=lambda t: (t[6], t[5], t[1]))
    out = []
    for key in keys:
        row = ["{}, {}, {}, {}/{}, {}, {}".format(*key)]
        for metric in ("cpu_time", "wall_time", "peak_tensor"):
            row += [cells.get((key, p, metric)) for p in PROVIDERS]
        out.append(row)
    headers = ["B, P, C, Hq/Hkv, d, U"] + [f"{m} {p}" for m in ("cpu s", "wall s", "tensor MB") for p in PROVIDERS]
    return harness.markdown_table(headers, out)


if __name__ == "__main__":
    raise SystemExit(main())

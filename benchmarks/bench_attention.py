"""Shared-prefix attention alone, forward + backward: the naive reference (prompt K/V materialised per completion,
GQA repeated) against grpo_mem's zero-copy backends ("torch" chunked matmuls, "cpu" ATen fused kernels, "triton" on
CUDA).

    python benchmarks/bench_attention.py                  # CPU sweep, writes benchmarks/results/attention.csv, prints a table
    python benchmarks/bench_attention.py --table          # print the table from the CSV
    python benchmarks/bench_attention.py --device cuda    # GPU sweep (bf16 by default) into results/attention_cuda.csv

Each (configuration, provider) runs in a fresh process on the shared harness. CPU (1 thread by default): wall and CPU
time, peak RSS above base and peak live tensor bytes of one forward+backward call. CUDA: time from
``triton.testing.do_bench`` (median and 20/80 % quantiles over ~100 ms of calls), the op's own peak allocation
(``torch.cuda.max_memory_allocated`` during one call minus what was allocated before it) and the absolute peak, in
the same CSV columns. Without a CUDA device ``--device cuda`` prints why and exits 0, measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # this script (its workers' module) and the checkout's grpo_mem

from grpo_mem.bench import harness  # noqa: E402

OP = "shared_prefix_attention"
PROVIDERS = ("ref", "torch", "cpu")
CUDA_PROVIDERS = ("ref", "torch", "triton")
CSV_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention.csv")
CUDA_CSV_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_cuda.csv")
DTYPES = ("fp32", "bf16", "fp16")
# (B, P, C, Hq, Hkv, d, U): the group benchmark's layer shape, a longer prompt, four prompts, MHA-128
CONFIGS = [
    (16, 512, 64, 8, 2, 64, 1),
    (16, 1024, 64, 8, 2, 64, 1),
    (16, 512, 64, 8, 2, 64, 4),
    (8, 512, 64, 16, 2, 128, 1),
]


def _inputs(args: dict, device: str = "cpu"):
    """Random inputs of one configuration (left-padded prompts, EOS-padded completions) and the op to measure."""
    import torch

    from grpo_mem.ops.attention import shared_prefix_attention, shared_prefix_attention_ref

    B, P, C, Hq, Hkv, d, U = (args[k] for k in ("B", "P", "C", "Hq", "Hkv", "d", "U"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.get("dtype", "fp32")]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, C, d, generator=g)
    k, v = torch.randn(B, Hkv, C, d, generator=g), torch.randn(B, Hkv, C, d, generator=g)
    pk, pv = torch.randn(U, Hkv, P, d, generator=g), torch.randn(U, Hkv, P, d, generator=g)
    index = (torch.arange(B) % U).to(device)
    prefix_mask = (torch.arange(P)[None, :] >= (torch.arange(U)[:, None] * 7)).to(device)  # left-padded by 0, 7, ...
    key_mask = (torch.arange(C)[None, :] < (C - torch.arange(B)[:, None] % 5)).to(device)  # shorter by 0..4 tokens
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, pk, pv)]
    if args["provider"] == "ref":
        fn = shared_prefix_attention_ref
    else:

        def fn(*a, **kw):
            return shared_prefix_attention(*a, backend=args["provider"], **kw)

    def op():
        out = fn(*leaves, index, prefix_mask, key_mask, scale=d**-0.5)
        out.sum().backward()

    return op, leaves


def worker(args: dict) -> dict:
    """One (configuration, provider) on CPU: fp32 inputs; time, CPU time, RSS and live tensor bytes."""
    op, leaves = _inputs(args)

    def setup():
        for t in leaves:
            t.grad = None

    m = harness.measure(op, setup=setup, warmup=1, repeats=args.get("repeats", 7), time_budget_s=20.0)
    return m.to_dict()


def cuda_worker(args: dict) -> dict:
    """One (configuration, provider) on the first CUDA device: do_bench time (s) and peak allocations (bytes)."""
    import torch
    from triton.testing import do_bench

    op, leaves = _inputs(args, "cuda")
    op()  # compile / warm up
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    op()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    ms = do_bench(op, grad_to_none=leaves, quantiles=[0.5, 0.2, 0.8])
    return dict(
        time_s=[x / 1e3 for x in ms],
        op_peak_bytes=peak - before,
        peak_bytes=peak,
        device=f"cuda ({torch.cuda.get_device_name()})",
    )


def cuda_rows(res: dict, provider: str, cfg: dict) -> list[dict]:
    """CSV rows of one cuda_worker result: wall_time (s, do_bench quantiles), peak_tensor (MB, the op's own peak
    allocation) and peak_allocated (MB, absolute); same columns as the CPU rows."""
    mb = harness.MB
    metrics = [
        ("wall_time", "s", tuple(res["time_s"]), None),
        ("peak_tensor", "MB", (res["op_peak_bytes"] / mb,) * 3, 1),
        ("peak_allocated", "MB", (res["peak_bytes"] / mb,) * 3, 1),
    ]
    version, now = harness.versions(), harness.now_utc()
    return [
        dict(
            op=OP,
            provider=provider,
            mode="full",
            metric=metric,
            unit=unit,
            x_name="P",
            x_value=cfg["P"],
            p50=p[0],
            p20=p[1],
            p80=p[2],
            config=json.dumps(dict(cfg, **({"n": n} if n else {})), sort_keys=True),
            device=res["device"],
            timestamp=now,
            version=version,
        )
        for metric, unit, p, n in metrics
    ]


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA benchmark cannot run here (None when it can)."""
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
        return f"no CUDA device ({build}); the CUDA benchmark needs one"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="only print the table from the CSV")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--csv", default=None, help=f"default {CSV_PATH} (cpu), {CUDA_CSV_PATH} (cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default fp32 on cpu, bf16 on cuda")
    opts = parser.parse_args(argv)
    if opts.device == "cuda":
        return main_cuda(opts)
    opts.csv = opts.csv or CSV_PATH
    if opts.dtype not in (None, "fp32"):
        parser.error("the CPU sweep runs in fp32")
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


def main_cuda(opts) -> int:
    """The sweep on CUDA (``--device cuda``): providers ref, torch, triton; skipped with a message without CUDA."""
    opts.csv = opts.csv or CUDA_CSV_PATH
    if not opts.table:
        why = cuda_unavailable_reason()
        if why is not None:
            print(f"bench_attention --device cuda: skipped: {why}. Nothing measured, {opts.csv} left unchanged.")
            return 0
        rows = []
        for B, P, C, Hq, Hkv, d, U in CONFIGS:
            cfg = dict(B=B, P=P, C=C, Hq=Hq, Hkv=Hkv, d=d, U=U, dtype=opts.dtype or "bf16")
            for provider in CUDA_PROVIDERS:
                res = harness.run_isolated(
                    "bench_attention:cuda_worker", dict(cfg, provider=provider), threads=opts.threads
                )
                if "skipped" in res:
                    rows += harness.skipped_rows(
                        OP,
                        provider,
                        "full",
                        "P",
                        P,
                        cfg,
                        res["skipped"],
                        metrics=(("wall_time", "s"), ("peak_tensor", "MB"), ("peak_allocated", "MB")),
                        device="cuda",
                    )
                else:
                    rows += cuda_rows(res, provider, cfg)
                print(provider, cfg, "done", flush=True)
        harness.write_csv(rows, opts.csv)
    print(
        table(
            opts.csv, CUDA_PROVIDERS, ("wall_time", "peak_tensor", "peak_allocated"), ("time s", "tensor MB", "peak MB")
        )
    )
    return 0


def table(
    path: str,
    providers=PROVIDERS,
    metrics=("cpu_time", "wall_time", "peak_tensor"),
    labels=("cpu s", "wall s", "tensor MB"),
) -> str:
    cells: dict = {}
    for r in harness.read_csv(path):
        cfg = r["config"]
        key = tuple(cfg[k] for k in ("B", "P", "C", "Hq", "Hkv", "d", "U"))
        cells[(key, r["provider"], r["metric"])] = r["p50"]
    keys = sorted({k for k, _, _ in cells}, key=lambda t: (t[6], t[5], t[1]))
    out = []
    for key in keys:
        row = ["{}, {}, {}, {}/{}, {}, {}".format(*key)]
        for metric in metrics:
            row += [cells.get((key, p, metric)) for p in providers]
        out.append(row)
    headers = ["B, P, C, Hq/Hkv, d, U"] + [f"{m} {p}" for m in labels for p in providers]
    return harness.markdown_table(headers, out)


if __name__ == "__main__":
    raise SystemExit(main())

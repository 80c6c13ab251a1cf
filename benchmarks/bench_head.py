"""LM-head step benchmark: per-token log-probs (+ entropies) of hidden states through a linear head, forward + backward.

The op, per provider, on hidden (N, H), weight (V, H) (both requiring grad), random targets (N,):
``logp, ent = head(hidden, weight, targets)`` then ``(logp.sum() + ent.sum()).backward()`` into fresh gradients.

Providers:

- ``grpo_mem_cpp``: ``grpo_mem.ops.linear_logprobs(..., return_entropy=True, backend="cpp")`` (the C++ extension).
- ``grpo_mem_torch``: the same with ``backend="torch"`` (chunked pure torch).
- ``trl``: TRL 1.16's ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` with the vocabulary chunk TRL's fused head
  uses (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``) and ``outputs=("entropy",)``.
- ``liger``: Liger-Kernel's pure-torch chunked selective log-prob
  (``liger_kernel.chunked_loss.fused_linear_ppo._ChunkedSelectiveLogProbFunction``). It has no entropy: its op is
  ``logp.sum().backward()`` (``config.entropy = false``).
- ``naive``: ``grpo_mem.ops.linear_logprobs_ref`` (full (N, V) logits, ``log_softmax`` + ``gather``, autograd).

``--device cuda`` runs the same op on the current GPU (``grpo_mem_triton``, ``backend="triton"``, takes the place of
``grpo_mem_cpp``): ``wall_time`` from CUDA events and ``peak_tensor`` from ``torch.cuda.max_memory_allocated``
(``harness_cuda``), rows in ``benchmarks/results/head_cuda.csv``; without a CUDA device it prints why and exits 0.

Every (configuration, provider) runs in a fresh process (``harness.run_isolated``). Reported per configuration:
``wall_time`` and ``cpu_time`` (s, p50 over the timed calls), ``peak_rss_above_base`` (MB: peak resident memory during
one call minus the resident memory just before it; inputs and weights are in the base, the gradients the call creates
are not) and ``peak_tensor`` (MB, the op's live tensor storages). A configuration whose naive logits (plus their
gradient and softmax temporaries) would not fit the memory budget is recorded as skipped with the estimate, as is any
run the harness kills over its RSS budget or time limit.

Usage (from the repository root)::

    python benchmarks/bench_head.py                 # full grid -> benchmarks/results/head.csv, head.png, table
    python benchmarks/bench_head.py --grid quick    # the docs/benchmarks.md subset (H=576; N=16384 only at V=49152)
    python benchmarks/bench_head.py --grid target --dtype bfloat16 --append   # N=4096, H=576, V=49152 in bf16
    python benchmarks/bench_head.py --table         # reprint the markdown table from the CSV
    python benchmarks/bench_head.py --device cuda --grid qwen7b --dtype bfloat16   # N=32768, H=3584, V=152064 on GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # this script (its workers' module) and the checkout's grpo_mem

from grpo_mem.bench import group_worker, harness, harness_cuda  # noqa: E402

OP = "head_logprobs"
PROVIDERS = ("grpo_mem_cpp", "grpo_mem_torch", "trl", "liger", "naive")
CUDA_PROVIDERS = ("grpo_mem_triton", "grpo_mem_torch", "trl", "liger", "naive")
RESULTS = os.path.join(_HERE, "results")
CSV_PATH = os.path.join(RESULTS, "head.csv")
PNG_PATH = os.path.join(RESULTS, "head.png")
CUDA_CSV_PATH = os.path.join(RESULTS, "head_cuda.csv")
CUDA_PNG_PATH = os.path.join(RESULTS, "head_cuda.png")
NS = (1024, 4096, 16384)
HS = (576, 1024)
VS = (32000, 49152, 151936)
TARGET = dict(N=4096, H=576, V=49152)
QWEN7B = dict(N=32768, H=3584, V=152064)  # Qwen2.5-7B's head, the shape of the HBM-traffic estimate
RSS_BUDGET_MB = 16000.0


def naive_bytes(n: int, v: int, dtype_bytes: int) -> int:
    """Estimated peak bytes of the naive provider's (N, V) tensors: logits, log-softmax and softmax (entropy) in the
    input dtype and their gradients alive together in the backward (about 5 (N, V) tensors)."""
    return 5 * n * v * dtype_bytes


def _head_fn(provider: str, hidden, weight, target, args: dict):
    """The head of ``provider`` as a function of no arguments returning (log-probs (N,), entropies (N,) or None)."""
    from grpo_mem.ops import linear_logprobs, linear_logprobs_ref

    if provider in ("grpo_mem_cpp", "grpo_mem_torch", "grpo_mem_triton"):
        backend = provider.split("_")[-1]
        if "cpp_block" in args:
            from grpo_mem.ops import logprobs_cpp

            logprobs_cpp.CPP_BLOCK_N, logprobs_cpp.CPP_BLOCK_V = args["cpp_block"]

        def head():
            return linear_logprobs(hidden, weight, target, return_entropy=True, backend=backend)
    elif provider == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        def head():
            logp, ent, *_ = ChunkedLogProbFunction.apply(
                hidden, weight, None, target, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy",)
            )
            return logp, ent
    elif provider == "liger":
        from liger_kernel.chunked_loss.fused_linear_ppo import _ChunkedSelectiveLogProbFunction

        def head():
            return _ChunkedSelectiveLogProbFunction.apply(hidden, weight, target, None, 1.0, 4096), None
    elif provider == "naive":

        def head():
            return linear_logprobs_ref(hidden, weight, target, return_entropy=True)
    else:
        raise ValueError(f"unknown provider {provider!r}")

    return head


def worker(args: dict) -> dict:
    """One head configuration (``N``, ``H``, ``V``, ``dtype``) and ``provider`` in a fresh process: time and memory of
    forward + backward, the sum of the log-probs (``checksum``) and the weight gradient's norm and size."""
    import torch

    n, h, v = args["N"], args["H"], args["V"]
    dtype = getattr(torch, args["dtype"])
    provider = args["provider"]
    device = torch.device(args.get("device", "cpu"))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype).requires_grad_()
    # logits ~ N(0, 2^2): a realistic spread for a trained head
    weight = (torch.randn(v, h, generator=g) * (2.0 / math.sqrt(h))).to(device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g).to(device)
    entropy = provider != "liger"
    head = _head_fn(provider, hidden, weight, target, args)

    def op():
        logp, ent = head()
        loss = logp.sum() + (ent.sum() if ent is not None else 0.0)
        loss.backward()
        return float(logp.detach().double().sum())

    def setup():
        hidden.grad = None
        weight.grad = None

    out = group_worker.measure_op(op, setup, device, dict(args, time_budget_s=args.get("time_budget_s", 60.0)))
    setup()
    checksum = op()
    out.update(
        checksum=checksum,
        entropy=entropy,
        grad_weight_mb=weight.numel() * weight.element_size() / 1e6,
        grad_norm=float(weight.grad.double().norm()),
    )
    return out


# The subset run for docs/benchmarks.md on the shared 2-core machine (the full grid takes hours there)
QUICK = [dict(N=n, H=576, V=v) for v in (32000, 49152) for n in (1024, 4096)] + [
    dict(N=1024, H=576, V=151936),
    dict(N=16384, H=576, V=49152),
]


def configs(grid: str, dtype: str) -> list[dict]:
    if grid == "target":
        return [dict(TARGET, dtype=dtype)]
    if grid == "qwen7b":
        return [dict(QWEN7B, dtype=dtype)]
    if grid == "quick":
        return [dict(c, dtype=dtype) for c in QUICK]
    return [dict(N=n, H=h, V=v, dtype=dtype) for h in HS for v in VS for n in NS]


def run(
    cfgs: list[dict],
    providers: Sequence[str],
    *,
    append: bool,
    repeats: int,
    device: str = "cpu",
    csv_path: str = CSV_PATH,
) -> list[dict]:
    """Measure every (configuration, provider) on ``device`` ("cpu" or "cuda"); the CSV is written after each
    configuration so a long sweep keeps what it measured."""
    rows = []
    budget_bytes = RSS_BUDGET_MB * 1e6
    if device == "cuda":
        import torch

        budget_bytes = 0.9 * torch.cuda.get_device_properties(0).total_memory
    for i, cfg in enumerate(cfgs):
        cfg_rows = []
        sums = {}
        for prov in providers:
            new, checksum = _run_provider(cfg, prov, repeats=repeats, device=device, budget_bytes=budget_bytes)
            cfg_rows += new
            if checksum is not None:
                sums[prov] = checksum
        if len(sums) > 1:
            print(f"  sum of log-probs per provider (should agree): {json.dumps(sums)}", flush=True)
        if append or i > 0:
            _replace_in_csv(cfg_rows, csv_path)
        else:
            harness.write_csv(cfg_rows, csv_path)
        rows += cfg_rows
    return rows


def _run_provider(cfg: dict, prov: str, *, repeats: int, device: str, budget_bytes: float) -> tuple[list, float | None]:
    """One (configuration, provider) in a fresh process: its CSV rows (skipped rows when it cannot run) and the sum
    of its log-probs (None when skipped)."""
    x_value = cfg["N"]
    dtype_bytes = 2 if cfg["dtype"] in ("bfloat16", "float16") else 4
    config = dict(cfg, provider=prov, entropy=prov != "liger")
    dev_name = None if device == "cpu" else harness_cuda.cuda_device_name()
    need = naive_bytes(cfg["N"], cfg["V"], dtype_bytes)
    if prov == "naive" and need > budget_bytes:
        reason = f"naive (N, V) tensors need about {need / 1e9:.1f} GB (> {budget_bytes / 1e9:.0f} GB budget)"
        print(f"{cfg} {prov}: skipped: {reason}", flush=True)
        return harness.skipped_rows(OP, prov, "full", "N", x_value, config, reason, device=dev_name), None
    # big configurations on CPU: no warm-up call (one call is minutes of CPU), one timed call
    big = device == "cpu" and cfg["N"] * cfg["V"] * cfg["H"] > 2e11
    args = dict(cfg, provider=prov, repeats=1 if big else repeats, warmup=0 if big else 1, device=device)
    res = harness.run_isolated("bench_head:worker", args, rss_budget_mb=RSS_BUDGET_MB, timeout_s=1800.0)
    if "skipped" in res:
        print(f"{cfg} {prov}: skipped: {res['skipped']}", flush=True)
        return harness.skipped_rows(OP, prov, "full", "N", x_value, config, res["skipped"], device=dev_name), None
    config.update(
        grad_weight_mb=round(res["grad_weight_mb"], 1),
        logp_sum=res["checksum"],
        grad_weight_norm=res["grad_norm"],
    )
    if device == "cuda":
        config.update(
            memory="torch.cuda.max_memory_allocated above memory_allocated before the call",
            cuda_peak_allocated_mb=round(res["cuda_peak_allocated_mb"], 1),
        )
    new = harness.measurement_rows(OP, prov, "full", "N", x_value, res, config, device=res.get("cuda_device", dev_name))
    print(f"{cfg} {prov}: " + json.dumps({r["metric"]: round(r["p50"], 3) for r in new}), flush=True)
    return new, res["checksum"]


def _key(row: dict) -> tuple:
    c = row["config"] if isinstance(row["config"], dict) else json.loads(row["config"])
    return (row["op"], row["provider"], row["mode"], row["metric"], c.get("dtype"), c["N"], c["H"], c["V"])


def _replace_in_csv(new_rows: list[dict], csv_path: str = CSV_PATH) -> None:
    """Append ``new_rows`` to the CSV, dropping older rows of the same (provider, metric, configuration)."""
    import csv

    new_keys = {_key(r) for r in new_rows}
    kept = []
    if os.path.exists(csv_path):
        with open(csv_path, newline="") as f:
            kept = [r for r in csv.DictReader(f) if _key(r) not in new_keys]
    harness.write_csv(kept, csv_path)
    harness.write_csv(new_rows, csv_path, append=True)


def table(csv_path: str = CSV_PATH) -> str:
    rows = harness.read_csv(csv_path)
    keyed = {}
    for r in rows:
        c = r["config"]
        key = (c.get("dtype"), c["N"], c["H"], c["V"])
        keyed.setdefault(key, {})[(r["provider"], r["metric"])] = (r["p50"], c.get("skipped"))
    providers = [
        p for p in dict.fromkeys(PROVIDERS + CUDA_PROVIDERS) if any(p == k[0] for d in keyed.values() for k in d)
    ]
    headers = ["dtype", "N", "H", "V"]
    for p in providers:
        headers += [f"{p} wall s", f"{p} CPU s", f"{p} MB"]
    out = []
    for key in sorted(keyed, key=lambda k: (str(k[0]), k[2], k[3], k[1])):
        d = keyed[key]
        line = list(key)
        for p in providers:
            t, skipped = d.get((p, "wall_time"), (math.nan, None))
            cpu, _ = d.get((p, "cpu_time"), (math.nan, None))
            mem, _ = d.get((p, "peak_rss_above_base"), d.get((p, "peak_tensor"), (math.nan, None)))
            line += ["skipped" if skipped else t, "skipped" if skipped else cpu, "skipped" if skipped else mem]
        out.append(line)
    return harness.markdown_table(headers, out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--grid",
        default="full",
        choices=("full", "quick", "target", "qwen7b"),
        help="full: N x H x V grid; quick: the docs subset; target: N=4096, H=576, V=49152; "
        "qwen7b: N=32768, H=3584, V=152064",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (default) or cuda: the current GPU, providers %s" % ",".join(CUDA_PROVIDERS),
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--providers", default=None, help="comma-separated subset (default: all of the device's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--append",
        action="store_true",
        help="add to the CSV (replacing rows of the same provider and configuration) instead of overwriting",
    )
    ap.add_argument("--table", action="store_true", help="only print the table of the existing CSV")
    ns = ap.parse_args(argv)
    cuda = ns.device == "cuda"
    csv_path, png_path = (CUDA_CSV_PATH, CUDA_PNG_PATH) if cuda else (CSV_PATH, PNG_PATH)
    if ns.table:
        print(table(csv_path))
        return 0
    if cuda and (reason := harness_cuda.cuda_unavailable_reason()):
        print(f"bench_head.py skipped: {reason}", file=sys.stderr)
        return 0
    known = CUDA_PROVIDERS if cuda else PROVIDERS
    providers = [p for p in (ns.providers or ",".join(known)).split(",") if p]
    unknown = [p for p in providers if p not in known]
    if unknown:
        raise SystemExit(f"unknown providers {unknown} for --device {ns.device}; choose from {known}")
    run(
        configs(ns.grid, ns.dtype), providers, append=ns.append, repeats=ns.repeats, device=ns.device, csv_path=csv_path
    )
    harness.plot_csv(
        csv_path,
        png_path,
        op=OP,
        panel_keys=("dtype", "H", "V"),
        log_y=True,
        title=f"LM head fwd+bwd with entropy ({'CUDA' if cuda else 'CPU'})",
    )
    print(table(csv_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())

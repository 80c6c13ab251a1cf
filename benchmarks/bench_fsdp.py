"""Per-rank peak memory and time of the scoring forward + backward under FSDP2, 2 processes on CPU (gloo).

Providers, each in its own ``torch.distributed.run`` launch of 2 processes: ``trl`` and ``grpo_mem`` as in
``bench_group.py`` (``grpo_mem.bench.group``); ``full_seq`` is the full-sequence baseline run through the root module
(FSDP2 unshards the embedding and head only inside the root's forward, so ``group``'s direct backbone call does not
run here): ``model(..., logits_to_keep=C + 1)`` and an fp32 log-softmax gather on the C completion positions, whose
(B, C, V) logits are a few percent of the trunk's activations at these shapes. Every rank builds the same
trunk-heavy Llama (``grpo_mem.bench.presets.BENCH_MODELS["llama"]``: 8 layers, hidden 512, V=8192), shards it with
``fully_shard`` per decoder layer and then at the root (``reshard_after_forward=True``), as accelerate's
``fsdp_version: 2`` does, and scores its own group (one prompt of width P, G completions of width C; a different
random group per rank): log-probs, then ``(log_probs * completion_mask).sum().backward()``. The launches run through
the benchmark library's sweep (``grpo_mem.bench.sweep``), which writes one set of CSV rows per rank.
Measured per rank with ``harness.measure`` (1 warm-up call, timed calls, then one call under ``PeakRSS`` and the
live-tensor tracker); the table gives the mean over the ranks and the ratio grpo_mem / full_seq against the ideal
ratio (P + G·(C − 1)) / (G·(P + C)) (``grpo_mem.bench.tokens.token_counts``). The ranks start with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``,
``ALLOCATOR_ENV``), timed calls included: fixed only before the memory call (``harness.measure``), it leaves the free
heap chunks of the earlier calls in place, later allocations reuse them, and the peak RSS then counts freed memory the
heap keeps resident (about 300 MB per rank for grpo_mem at P=512, C=64, G=16) rather than live memory.

Usage (from the repository root)::

    python benchmarks/bench_fsdp.py                 # P=512, C=64, G=16 -> benchmarks/results/fsdp.csv, table
    python benchmarks/bench_fsdp.py -P 256 -G 8     # another shape
    python benchmarks/bench_fsdp.py --table         # reprint the table from the CSV
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path.insert(0, _ROOT)  # the checkout's grpo_mem: the script measures the code beside it

from grpo_mem.bench import harness, isolate  # noqa: E402
from grpo_mem.bench.sweep import Cell, Sweep  # noqa: E402
from grpo_mem.bench.tokens import token_counts  # noqa: E402

OP = "group_logprobs_fsdp2"
CSV_PATH = os.path.join(_HERE, "results", "fsdp.csv")
PROVIDERS = ("trl", "full_seq", "grpo_mem")
# --window: bench_tree.py's window (S=512 system prompt, own parts 32-96, 4 micro-batches of 4 groups, G=8, C=64)
WINDOW_OP = "tree_window_fsdp2"
WINDOW_CSV_PATH = os.path.join(_HERE, "results", "fsdp_tree.csv")
WINDOW_PROVIDERS = ("grpo_mem_group", "grpo_mem_tree")
WINDOW = dict(q_min=32, q_max=96, G=8, C=64, groups_per_mb=4, micro_batches=4)
WORLD = 2
# From the ranks' start, every allocation above 64 KiB its own mmap, unmapped on free (see the module docstring)
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def worker(provider: str, P: int, C: int, G: int, repeats: int, out: str) -> None:
    """One rank: shard, measure, and (rank 0) write every rank's measurement to ``out`` as JSON."""
    import torch
    import torch.distributed as dist

    from grpo_mem.bench import group

    model = _sharded_model()
    rank = dist.get_rank()
    if provider == "full_seq":

        def fn(input_ids, attention_mask):
            logits = model(
                input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=C + 1, use_cache=False
            ).logits[:, :-1]
            logps = torch.log_softmax(logits.float(), -1).gather(-1, input_ids[:, -C:, None]).squeeze(-1)
            return logps, None

    else:
        fn = group.make_logprob_fn(provider, model, C)
    ids, mask, cmask = group.make_inputs(G, P, C, groups=1, vocab=model.config.vocab_size, seed=rank)

    def op():
        logps, _ = fn(ids, mask)
        (logps * cmask).sum().backward()

    m = harness.measure(
        op, setup=lambda: model.zero_grad(set_to_none=True), warmup=1, repeats=repeats, memory_repeats=1
    )
    _gather_to(out, m.to_dict())


def _sharded_model():
    """The benchmark Llama, sharded with ``fully_shard`` per decoder layer and at the root, on a fresh gloo group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from grpo_mem.bench import group
    from grpo_mem.bench.presets import bench_model_config

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = group.build_model(bench_model_config("llama"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _gather_to(out: str, measurement: dict) -> None:
    """Every rank's measurement, written by rank 0 to ``out`` as JSON; then the process group ends."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measurement)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def window_worker(provider: str, S: int, repeats: int, out: str) -> None:
    """One rank of ``--window``: its own window (seeded by rank, so the ranks' prompts differ) scored micro-batch by
    micro-batch through a ``SharingSession``, each followed by its backward."""
    import torch.distributed as dist

    from grpo_mem.bench.tree import make_window, own_lengths, window_fn

    model = _sharded_model()
    rank = dist.get_rank()
    w = WINDOW
    U = w["groups_per_mb"] * w["micro_batches"]
    Qs = own_lengths(U, w["q_min"], w["q_max"], seed=rank)
    ids, mask, cmask = make_window(S, Qs, w["G"], w["C"], w["groups_per_mb"], model.config.vocab_size, seed=rank + 1)
    rows = w["groups_per_mb"] * w["G"]
    fn = window_fn(provider, model, w["C"], ids, mask, rows, None)
    cmask = cmask.float()

    def op():
        for s in range(0, ids.shape[0], rows):
            lp, _ = fn(ids[s : s + rows], mask[s : s + rows])
            (lp * cmask[s : s + rows]).sum().backward()

    m = harness.measure(
        op, setup=lambda: model.zero_grad(set_to_none=True), warmup=0, repeats=repeats, memory_repeats=1
    )
    _gather_to(out, m.to_dict())


def launch(args: dict) -> dict:
    """Run ``worker`` (or, with ``args["window_s"]``, ``window_worker``) on 2 fresh processes (``args``: provider, P,
    C, G, repeats); ``{"ranks": [each rank's harness.Measurement as a dict]}``, or ``{"skipped": reason,
    "stderr_tail": ...}`` when the launch failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_ROOT, **ALLOCATOR_ENV)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={WORLD}",
            "--master_addr=127.0.0.1",
            f"--master_port={isolate.free_port()}",
            os.path.abspath(__file__),
            "--worker",
            args["provider"],
            "-P",
            str(args["P"]),
            "-C",
            str(args["C"]),
            "-G",
            str(args["G"]),
            "--repeats",
            str(args["repeats"]),
            "--out",
            out,
        ] + (["--window", str(args["window_s"])] if args.get("window_s") else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return {
                "skipped": f"torch.distributed.run exited with code {proc.returncode}",
                "stderr_tail": proc.stderr[-3000:],
            }
        with open(out) as f:
            return {"ranks": json.load(f)}


def table(path: str = CSV_PATH) -> str:
    """Markdown table from the CSV, each provider's newest run, mean over its ranks: time, CPU time, peak RSS above
    base and peak live tensor bytes per rank, and grpo_mem's RSS over full_seq's against the ideal ratio."""
    rows = harness.read_csv(path)
    latest = {}  # each (provider, shape) from its newest run only
    for r in rows:
        key = (r["provider"], r["config"]["P"], r["config"]["C"], r["config"]["G"])
        latest[key] = max(latest.get(key, ""), r["timestamp"])
    rows = [
        r
        for r in rows
        if r["timestamp"] == latest[(r["provider"], r["config"]["P"], r["config"]["C"], r["config"]["G"])]
    ]
    by = {}
    for r in rows:
        cfg = r["config"]
        by.setdefault((r["provider"], cfg["P"], cfg["C"], cfg["G"]), {}).setdefault(r["metric"], []).append(
            float(r["p50"])
        )
    out = []
    for (provider, P, C, G), metrics in sorted(by.items(), key=lambda kv: (kv[0][1:], PROVIDERS.index(kv[0][0]))):
        mean = {k: sum(v) / len(v) for k, v in metrics.items()}
        base = by.get(("full_seq", P, C, G))
        ratio = ""
        if base and provider == "grpo_mem":
            b = sum(base["peak_rss_above_base"]) / len(base["peak_rss_above_base"])
            ideal = token_counts(G, P, C)["ideal_ratio"]
            r_rss = mean["peak_rss_above_base"] / b
            r_t = mean["peak_tensor"] / (sum(base["peak_tensor"]) / len(base["peak_tensor"]))
            ratio = f"{r_rss:.3f} ({r_rss / ideal:.2f}x ideal {ideal:.3f}); tensors {r_t:.3f} ({r_t / ideal:.2f}x)"
        out.append(
            [
                provider,
                P,
                C,
                G,
                f"{mean['wall_time']:.2f}",
                f"{mean['cpu_time']:.2f}",
                f"{mean['peak_rss_above_base']:.0f}",
                f"{mean['peak_tensor']:.0f}",
                ratio,
            ]
        )
    headers = [
        "provider",
        "P",
        "C",
        "G",
        "time (s)",
        "CPU time (s)",
        "peak RSS above base (MB/rank)",
        "live tensors (MB/rank)",
        "ratio to full_seq",
    ]
    return harness.markdown_table(headers, out)


def window_table(path: str = WINDOW_CSV_PATH) -> str:
    """Markdown table of ``--window`` runs, each provider's newest, per rank: time, CPU time, peak RSS above base and
    live tensors, and tree over group against the ideal ratio of the rank's own prompts."""
    from grpo_mem.bench.tree import ideal_ratio, own_lengths

    rows = harness.read_csv(path)
    newest = {}
    for r in rows:
        newest[r["provider"]] = max(newest.get(r["provider"], ""), r["timestamp"])
    by = {}
    for r in rows:
        if r["timestamp"] == newest[r["provider"]]:
            key = (r["config"]["S"], r["config"]["rank"], r["provider"])
            by.setdefault(key, {})[r["metric"]] = float(r["p50"])
    out = []
    for (S, rank, provider), m in sorted(by.items()):
        ratio = ""
        group = by.get((S, rank, "grpo_mem_group"))
        if provider == "grpo_mem_tree" and group:
            Qs = own_lengths(WINDOW["groups_per_mb"] * WINDOW["micro_batches"], WINDOW["q_min"], WINDOW["q_max"], rank)
            rho = ideal_ratio(S, Qs, WINDOW["G"], WINDOW["C"])  # the rank's own prompts (seeded by rank)
            r_rss = m["peak_rss_above_base"] / group["peak_rss_above_base"]
            r_t = m["wall_time"] / group["wall_time"]
            ratio = f"memory {r_rss:.3f} ({r_rss / rho:.2f}x ideal {rho:.3f}); time {r_t:.3f} ({r_t / rho:.2f}x)"
        out.append(
            [
                S,
                rank,
                provider,
                f"{m['wall_time']:.2f}",
                f"{m['cpu_time']:.2f}",
                f"{m['peak_rss_above_base']:.0f}",
                f"{m['peak_tensor']:.0f}",
                ratio,
            ]
        )
    headers = [
        "S",
        "rank",
        "provider",
        "time (s)",
        "CPU time (s)",
        "peak RSS above base (MB)",
        "live tensors (MB)",
        "tree / group",
    ]
    return harness.markdown_table(headers, out)


def _run_window(S: int, providers: list[str], repeats: int) -> None:
    """``--window S``: each provider's window under FSDP2, rows per rank into ``WINDOW_CSV_PATH``."""
    config = dict(S=S, **WINDOW, model="llama", fsdp="fully_shard", allocator_env=ALLOCATOR_ENV)
    outcomes = Sweep(WINDOW_OP, "S", launch).run(
        [
            Cell(
                p,
                S,
                config,
                dict(provider=p, P=0, C=WINDOW["C"], G=WINDOW["G"], repeats=repeats, window_s=S),
                name=f"window S={S}",
            )
            for p in providers
        ]
    )
    rows = [row for o in outcomes for row in o.rows]
    harness.write_csv(rows, WINDOW_CSV_PATH, append=os.path.exists(WINDOW_CSV_PATH))
    print(window_table())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-P", type=int, default=512, help="prompt width (default 512)")
    ap.add_argument("-C", type=int, default=64, help="completion width (default 64)")
    ap.add_argument("-G", type=int, default=16, help="completions per prompt (default 16)")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per rank (default 2)")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset of trl,full_seq,grpo_mem")
    ap.add_argument("--table", action="store_true", help="reprint the table from the CSV and exit")
    ap.add_argument(
        "--window",
        type=int,
        metavar="S",
        help="bench_tree.py's window with an S-token system prompt, "
        "grpo_mem_group vs grpo_mem_tree (results/fsdp_tree.csv)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        if args.window:
            window_worker(args.worker, args.window, args.repeats, args.out)
        else:
            worker(args.worker, args.P, args.C, args.G, args.repeats, args.out)
        return 0
    if args.table:
        print(table())
        print(window_table() if os.path.exists(WINDOW_CSV_PATH) else "")
        return 0
    if args.window:
        providers = WINDOW_PROVIDERS if args.providers == ",".join(PROVIDERS) else args.providers.split(",")
        _run_window(args.window, list(providers), args.repeats)
        return 0
    providers = args.providers.split(",")
    for provider in providers:
        if provider not in PROVIDERS:
            ap.error(f"--providers: unknown provider {provider!r}, expected some of {PROVIDERS}")
    config = dict(P=args.P, C=args.C, G=args.G, model="llama", fsdp="fully_shard", allocator_env=ALLOCATOR_ENV)
    outcomes = Sweep(OP, "G", launch).run(
        [
            Cell(
                p,
                args.G,
                config,
                dict(provider=p, P=args.P, C=args.C, G=args.G, repeats=args.repeats),
                name=f"P={args.P} C={args.C} G={args.G}",
            )
            for p in providers
        ]
    )
    rows = [row for o in outcomes for row in o.rows]
    harness.write_csv(rows, CSV_PATH, append=os.path.exists(CSV_PATH))
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

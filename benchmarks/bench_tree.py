"""Prefix-tree sharing: one optimizer step whose prompts share a long system prompt, stock TRL vs grpo_mem's modes.

The op: one gradient-accumulation window of ``micro_batches`` micro-batches, each holding ``groups_per_mb`` whole groups
of G completions (what ``patch_trl``'s group-aware shuffle gives). Every prompt is the same system prompt of S random
tokens followed by its own Q_u tokens (Q_u uniform in [q_min, q_max], seeded), left-padded to one width; completions
have lengths uniform in [C/2, C] and end with EOS. Each micro-batch: per-token log-probs and entropies, then
``(log_probs * completion_mask).sum().backward()``, gradients accumulated over the window.

Providers:

- ``trl``, ``full_seq``: as in ``bench_group.py`` (``grpo_mem.bench.group``; every row forwards its whole prompt and
  completion).
- ``grpo_mem_group``: a ``SharingSession(sharing="group")`` over the window: each prompt forwarded once, whole.
- ``grpo_mem_tree``: a ``SharingSession(sharing="tree")``: the system prompt forwarded once per window, each own
  part once, every level read in place.

Ideal ratio of the token-linear work per window, tree over group (U = groups_per_mb · micro_batches prompts):
``(S + ΣQ_u + U·G·(C − 1)) / (U·S + ΣQ_u + U·G·(C − 1))`` (``grpo_mem.bench.tree.ideal_ratio``). The worker also counts the tokens the backbone actually forwards per
window (``trunk_tokens``), so the CSV shows the work each mode does, not only its time.

``--threshold`` measures where a shared span starts to pay for its own pass: the tree mode with the span as a node
(``min_shared_tokens=1``) against the same batch with the span forwarded inside each prompt (``min_shared_tokens``
above S), for S ∈ {8, 16, 32, 64, 128}, one micro-batch of 4 groups; that sets ``grpo_mem.model.plan.
DEFAULT_MIN_SHARED_TOKENS``.

Each (configuration, provider) runs in a fresh process (``grpo_mem.bench.sweep``); memory is the peak RSS above the
process's base before the window (weights and inputs in the base). Log-probs of every provider are compared with a
plain no-grad full-sequence forward afterwards.

Usage (from the repository root)::

    python benchmarks/bench_tree.py              # S in {512, 2048} -> benchmarks/results/tree.csv, tree.png, table
    python benchmarks/bench_tree.py --threshold  # the min_shared_tokens measurement -> tree_threshold.csv
    python benchmarks/bench_tree.py --table      # reprint the tables from the CSVs
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from typing import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the checkout's grpo_mem: the script measures the code beside it

from grpo_mem.bench import group, group_worker, harness  # noqa: E402
from grpo_mem.bench.tree import ideal_ratio, make_window, own_lengths, window_fn  # noqa: E402
from grpo_mem.bench.presets import bench_model_config  # noqa: E402
from grpo_mem.bench.sweep import Cell, Sweep, isolated, merge_csv  # noqa: E402

OP = "tree_window"
OP_THRESHOLD = "tree_threshold"
PROVIDERS = ("trl", "full_seq", "grpo_mem_group", "grpo_mem_tree")
RESULTS = os.path.join(_HERE, "results")
CSV_PATH = os.path.join(RESULTS, "tree.csv")
PNG_PATH = os.path.join(RESULTS, "tree.png")
THRESHOLD_CSV = os.path.join(RESULTS, "tree_threshold.csv")
# Stock providers at S=2048 hold every row's full-sequence activations: 32 rows x 2176 tokens per micro-batch, 3.4x
# the tokens of S=512, where trl measured 9.5 GB above base (benchmarks/results/tree.csv): more than this 24 GB machine
# can give a worker.
STOCK_MAX_S = 512


def worker(args: dict) -> dict:
    """One (configuration, provider) in a fresh process. ``args``: arch, provider, S, q_min, q_max, G, C,
    groups_per_mb, micro_batches, optional seed, repeats, min_repeats, time_budget_s, min_shared_tokens.

    Returns the measurement dict plus ``trunk_tokens`` (tokens through the backbone per window), the log-prob
    difference from a plain no-grad forward, ``log_probs`` (masked entries 0), ``grad_norm`` and ``version``."""
    import torch

    version = harness.versions()
    model = group.build_model(bench_model_config(args["arch"]), seed=args.get("seed", 0))
    U = args["groups_per_mb"] * args["micro_batches"]
    Qs = own_lengths(U, args["q_min"], args["q_max"], args.get("seed", 0))
    G, C = args["G"], args["C"]
    input_ids, attention_mask, cmask = make_window(
        args["S"], Qs, G, C, args["groups_per_mb"], model.config.vocab_size, seed=args.get("seed", 0) + 1
    )
    rows = args["groups_per_mb"] * G
    fn = window_fn(args["provider"], model, C, input_ids, attention_mask, rows, args.get("min_shared_tokens"))
    tokens = [0]
    hook = model.get_input_embeddings().register_forward_hook(
        lambda m, i, o: tokens.__setitem__(0, tokens[0] + i[0].numel()) if torch.is_grad_enabled() else None
    )
    cmask_f = cmask.float()
    last = {}

    def op():
        tokens[0] = 0
        lps = []
        for s in range(0, input_ids.shape[0], rows):
            lp, _ = fn(input_ids[s : s + rows], attention_mask[s : s + rows])
            (lp * cmask_f[s : s + rows]).sum().backward()
            lps.append(lp.detach())
        last["lp"], last["tokens"] = torch.cat(lps), tokens[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = harness.measure(
            op,
            setup=lambda: model.zero_grad(set_to_none=True),
            warmup=args.get("warmup", 0),
            repeats=args.get("repeats", 1),
            min_repeats=args.get("min_repeats", 1),
            time_budget_s=args.get("time_budget_s", 20.0),
            memory_repeats=1,
        )
    hook.remove()
    return dict(
        m.to_dict(),
        trunk_tokens=last["tokens"],
        logp_max_abs_diff_vs_plain_forward=_plain_forward_diff(
            model, input_ids, attention_mask, cmask_f, last["lp"], rows
        ),
        log_probs=(last["lp"] * cmask_f).tolist(),
        grad_norm=group_worker.grad_norm(model),
        Qs=Qs,
        fallback_warnings=sorted({str(w.message) for w in caught if "grpo_mem" in str(w.message)}),
        version=version,
    )


def _plain_forward_diff(model, input_ids, attention_mask, cmask, lp, rows: int) -> float:
    """The check, after measuring: the largest |difference| of the log-probs ``lp`` (rows, C) from a plain no-grad
    full-sequence forward with log_softmax over the vocabulary, micro-batch by micro-batch of ``rows`` rows, where
    ``cmask`` (rows, C) float is 1."""
    import torch

    C = lp.shape[1]
    diffs = []
    with torch.no_grad():
        for s in range(0, input_ids.shape[0], rows):
            ids, mask = input_ids[s : s + rows], attention_mask[s : s + rows]
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            logits = model.get_output_embeddings()(hidden[:, -C - 1 : -1]).float()
            ref = torch.log_softmax(logits, -1).gather(-1, ids[:, -C:, None])[..., 0] * cmask[s : s + rows]
            diffs.append(float((lp[s : s + rows] * cmask[s : s + rows] - ref).abs().max()))
    return max(diffs)


def sweep_configs() -> list[dict]:
    """The tree configurations: S ∈ {512, 2048}, own parts 32–96 tokens, G=8, C=64, 4 groups per micro-batch,
    4 micro-batches per window, on the 8-layer Llama-shaped model (``grpo_mem.bench.presets.BENCH_MODELS["llama"]``)."""
    return [
        dict(arch="llama", S=S, q_min=32, q_max=96, G=8, C=64, groups_per_mb=4, micro_batches=4) for S in (512, 2048)
    ]


def threshold_configs() -> list[dict]:
    """Short shared spans, one micro-batch of 4 groups: where a node of its own starts to pay."""
    return [
        dict(arch="llama", S=S, q_min=32, q_max=96, G=8, C=64, groups_per_mb=4, micro_batches=1)
        for S in (8, 16, 32, 64, 128)
    ]


def _ideal(cfg: dict) -> float:
    """The ideal ratio of tree over group sharing for a configuration's window (``tree.ideal_ratio``)."""
    U = cfg["groups_per_mb"] * cfg["micro_batches"]
    return ideal_ratio(cfg["S"], own_lengths(U, cfg["q_min"], cfg["q_max"], 0), cfg["G"], cfg["C"])


def _run(cfgs, providers_of, op, csv_path, *, threads, rss_budget_mb, timeout_s, measure_args):
    """Run every (configuration, provider) in a fresh process (stock providers above ``STOCK_MAX_S`` recorded as
    skipped); the CSV, written after each one, keeps the rows of other S values and providers."""
    cells = []
    for cfg in cfgs:
        rho = _ideal(cfg)
        for prov, extra in providers_of(cfg):
            config = {k: v for k, v in cfg.items() if k != "arch"}
            config.update(
                extra, ideal_ratio_tree_over_group=round(rho, 4), threads=threads, **measure_args, model=cfg["arch"]
            )
            skip = (
                f"not run: S={cfg['S']} needs over 24 GB for the stock path (9.5 GB at S=512)"
                if prov in ("trl", "full_seq") and cfg["S"] > STOCK_MAX_S
                else None
            )
            cells.append(
                Cell(
                    prov + (f"@{extra['min_shared_tokens']}" if "min_shared_tokens" in extra else ""),
                    cfg["S"],
                    config,
                    dict(cfg, provider=prov, **extra, **measure_args),
                    key=(cfg["S"],),
                    name=str(cfg),
                    skip=skip,
                )
            )
    rows: list[dict] = []

    def save(outcome):
        rows.extend(outcome.rows)
        merge_csv(rows, csv_path, lambda r: (r["op"], r["provider"], r["metric"], r["x_value"]))

    sweep = Sweep(
        op,
        "S",
        isolated("bench_tree:worker", threads=threads, timeout_s=timeout_s, rss_budget_mb=rss_budget_mb),
        device=harness.device_name(threads),
    )
    sweep.run(cells, on_outcome=save)
    return rows


def _p50s(path: str, op: str) -> dict:
    out = {}
    for r in harness.read_csv(path):
        if r["op"] == op:
            out.setdefault(r["x_value"], {}).setdefault(r["provider"], {})[r["metric"]] = r
    return out


def table(path: str = CSV_PATH) -> str:
    """Per S: each provider's p50 wall and CPU time, peak RSS above base and trunk tokens per window; tree over
    group for each, beside the ideal ratio and the targets (time ≤ 1.2×, memory ≤ 1.3× the ideal ratio)."""
    headers = [
        "S",
        "provider",
        "wall s",
        "cpu s",
        "mem MB",
        "trunk tokens",
        "ideal ρ tree/group",
        "tree/group",
        "/ ideal",
        "|Δlogp| vs plain fwd",
    ]
    out = []
    for S, d in sorted(_p50s(path, OP).items(), key=lambda kv: float(kv[0])):
        group = d.get("grpo_mem_group", {})
        for prov in PROVIDERS:
            m = d.get(prov)
            if not m:
                continue
            wall, cpu, mem = (m.get(k) for k in ("wall_time", "cpu_time", "peak_rss_above_base"))
            if wall is None or math.isnan(wall["p50"]):
                out.append(
                    [S, prov, "skipped", "", "", "", "", "", "", wall["config"].get("skipped", "") if wall else ""]
                )
                continue
            rho = _ideal(wall["config"])  # the formula of today, not the one recorded with older rows
            ratios = ""
            over = ""
            if prov == "grpo_mem_tree" and group:
                rt = wall["p50"] / group["wall_time"]["p50"]
                rc = cpu["p50"] / group["cpu_time"]["p50"]
                rm = mem["p50"] / group["peak_rss_above_base"]["p50"]
                ratios = f"time {rt:.3f}, cpu {rc:.3f}, mem {rm:.3f}"
                over = (
                    f"time {rt / rho:.2f}× ({'meets' if rt / rho <= 1.2 else 'MISSES'} ≤ 1.2), cpu {rc / rho:.2f}×, "
                    f"mem {rm / rho:.2f}× ({'meets' if rm / rho <= 1.3 else 'MISSES'} ≤ 1.3)"
                )
            out.append(
                [
                    S,
                    prov,
                    wall["p50"],
                    cpu["p50"],
                    mem["p50"],
                    wall["config"].get("trunk_tokens"),
                    rho,
                    ratios,
                    over,
                    f"{wall['config']['logp_max_abs_diff_vs_plain_forward']:.1e}",
                ]
            )
    return harness.markdown_table(headers, out)


def threshold_table(path: str = THRESHOLD_CSV) -> str:
    """Per shared span S: wall and CPU time with the span as a node and forwarded inside each prompt."""
    headers = [
        "S",
        "node: wall s",
        "inside: wall s",
        "node/inside wall",
        "node: cpu s",
        "inside: cpu s",
        "node/inside cpu",
    ]
    out = []
    for S, d in sorted(_p50s(path, OP_THRESHOLD).items(), key=lambda kv: float(kv[0])):
        node = next((v for k, v in d.items() if k.endswith("@1")), None)
        inside = next((v for k, v in d.items() if not k.endswith("@1")), None)
        if not node or not inside:
            continue
        nw, iw = node["wall_time"]["p50"], inside["wall_time"]["p50"]
        nc, ic = node["cpu_time"]["p50"], inside["cpu_time"]["p50"]
        out.append([S, nw, iw, nw / iw, nc, ic, nc / ic])
    return harness.markdown_table(headers, out)


def plot(csv_path: str = CSV_PATH, png_path: str = PNG_PATH) -> None:
    """``tree.png``: p50 wall time, CPU time and peak RSS above base against S, per provider."""
    harness.plot_csv(
        csv_path,
        png_path,
        op=OP,
        metrics=("wall_time", "cpu_time", "peak_rss_above_base"),
        panel_keys=("model", "G"),
        log_x=True,
        log_y=True,
        title="one window, 4 x 4 groups, G=8, C=64",
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threshold", action="store_true", help="measure min_shared_tokens (tree_threshold.csv)")
    p.add_argument("--table", action="store_true", help="only print the tables from the CSVs")
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset of %(default)s")
    p.add_argument("--only-s", default="", help="comma-separated S values to keep, e.g. 512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rss-budget-mb", type=float, default=16000.0)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args(argv)
    providers = [x for x in a.providers.split(",") if x]
    for x in providers:
        if x not in PROVIDERS:
            raise ValueError(f"unknown provider {x!r}; choose from {PROVIDERS}")
    run = dict(
        threads=a.threads,
        rss_budget_mb=a.rss_budget_mb,
        timeout_s=a.timeout_s,
        measure_args=dict(repeats=a.repeats, min_repeats=1, time_budget_s=0.0),
    )
    if not a.table:
        if a.threshold:
            _run(
                threshold_configs(),
                lambda c: [
                    ("grpo_mem_tree", {"min_shared_tokens": 1}),
                    ("grpo_mem_tree", {"min_shared_tokens": c["S"] + 1}),
                ],
                OP_THRESHOLD,
                THRESHOLD_CSV,
                **run,
            )
        else:
            cfgs = sweep_configs()
            if a.only_s:
                keep = {int(s) for s in a.only_s.split(",")}
                cfgs = [c for c in cfgs if c["S"] in keep]
            _run(cfgs, lambda c: [(x, {}) for x in providers], OP, CSV_PATH, **run)
            plot()
    if a.threshold or (a.table and os.path.exists(THRESHOLD_CSV)):
        print(threshold_table())
    if not a.threshold:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

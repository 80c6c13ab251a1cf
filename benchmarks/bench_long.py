"""Long prompts: one scoring forward + backward of stock TRL against grpo_mem at the prompt lengths peers publish.

The op is ``grpo-mem bench``'s (:mod:`grpo_mem.bench.group`): one group of G completions of C tokens after a prompt of
P tokens (left-padded by P/8, completions of C/2 to C tokens ended by EOS), log-probs and entropies of every completion
token, then ``(log_probs * completion_mask).sum().backward()``, in one micro-batch of G rows. Each provider runs in a
fresh process (``grpo_mem.bench.sweep``), stock first; grpo_mem's log-probs and per-parameter gradients are compared
with stock's (``|Δlogp|``, worst parameter's relative gradient difference). Beside the measured ratios (grpo_mem over
stock, time and peak memory) stands the ideal ratio of backbone tokens, (P + G·(C − 1)) / (G·(P + C))
(``grpo_mem.bench.tokens.token_counts``; the issue writes it (P + G·C) / (G·(P + C)): the last completion token
predicts nothing and is not run).

Grid (:func:`grid`, ``--full-grid``): P in {4096, 8192, 16384, 32768}, C in {64, 512, 4096}, G in {8, 16}, on two
models with random weights, their ``config.json`` written from published sizes (nothing downloaded):

- ``qwen3-4b``: Qwen3-4B (``grpo_mem.bench.presets.PRESETS["qwen3-4b"]``) cut to 4 layers;
- ``qwen3.5-4b``: Qwen3.5-4B's text model cut to 4 layers, one period of 3 Gated DeltaNet layers and 1 gated full
  attention layer (``benchmarks/gpu_check.py``'s ``QWEN3_5_4B_4L``).

The CPU run (the default without a GPU) cuts the models further (:func:`cut_for_cpu`, stated in each row's
``config["cut"]``): hidden 256, MLP width scaled by the same factor, 4 query / 1 KV heads of 64 (the 4:1 grouping of
both models), Gated DeltaNet 2 key / 4 value heads of 64 (their 1:2), vocabulary 8192; the layer count, tying, RoPE
and layer pattern stay. The head then weighs on the time and its gradient on the memory as little as at full size,
where it is a small part of a long prompt's cost. ``CPU_GRID`` is what a shared 2-core machine measures in half an hour.

Stock TRL on a GPU is ``trl`` (TRL 1.16's fused head on the completion positions). On CPU TRL 1.16's head scores every
position over the vocabulary (its compact mode needs Triton), which is not what it does on a GPU; the CPU baseline is
``full_seq``: the full prompt + completion sequence through the backbone and TRL's chunked head on the completion
positions (``trl.kernels.ChunkedLogProbFunction``), as TRL's compact mode runs on a GPU. ``--stock`` picks either.

Before each configuration the stock run's peak is estimated (``grpo_mem.bench.fits.estimate_stock_memory``, head on
the completion positions) and compared with the memory available (``MemAvailable``, or the GPU's free memory) less
``--reserve-gb``. A configuration whose stock run does not fit runs grpo_mem alone (checked against a plain no-grad
forward instead of stock); its row says so and gives the ratio to that paper estimate instead of a measured one.

Measured (``grpo_mem.bench.measure``): wall and CPU time of one call (``--repeats`` > 1: their p50, memory in one
more call), peak memory above the process's base (CPU: resident set; CUDA: ``torch.cuda.max_memory_allocated``), peak
of live tensors (CPU). Weights and inputs are in the base; the parameter gradients the op creates are not, and are the
same on both sides (``grad_mb`` in the table). Rows go to ``benchmarks/results/long.csv`` (the long format of
``grpo_mem.bench.results``; a re-run of a configuration replaces its rows), the figure to ``long.png``.

Usage (from the repository root)::

    python benchmarks/bench_long.py                   # CPU_GRID (cut models) -> results/long.csv, long.png, table
    python benchmarks/bench_long.py --device cuda     # the full grid on the current GPU, full-width models
    python benchmarks/bench_long.py --only qwen3-4b/4096/64/8   # one configuration (model/P/C/G)
    python benchmarks/bench_long.py --table           # reprint the table from the CSV
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the checkout's grpo_mem: the script measures the code beside it
sys.path.insert(1, _HERE)

from gpu_check import QWEN3_5_4B_4L  # noqa: E402

from grpo_mem.bench import harness  # noqa: E402
from grpo_mem.bench.presets import EOS_ID, PAD_ID, PRESETS  # noqa: E402
from grpo_mem.bench.sweep import Cell, Sweep, compare_with_reference, isolated, merge_csv  # noqa: E402
from grpo_mem.bench.tokens import token_counts  # noqa: E402

OP = "long_prompt_scoring"
WORKER = "grpo_mem.bench.group_worker:worker"
RESULTS = os.path.join(_HERE, "results")
CSV_PATH = os.path.join(RESULTS, "long.csv")
PNG_PATH = os.path.join(RESULTS, "long.png")
MB = 1e6
LAYERS = 4

MODELS: dict[str, dict[str, Any]] = {
    "qwen3-4b": dict(PRESETS["qwen3-4b"].config, num_hidden_layers=LAYERS),
    "qwen3.5-4b": dict(QWEN3_5_4B_4L, num_hidden_layers=LAYERS),
}
"""The two models at full width, cut to :data:`LAYERS` layers (Qwen3.5: one period, 3 Gated DeltaNet + 1 full)."""

PROMPTS = (4096, 8192, 16384, 32768)
COMPLETIONS = (64, 512, 4096)
GROUPS = (8, 16)
CPU_GRID = tuple((m, 4096, C, 8) for m in MODELS for C in (64, 512)) + (("qwen3-4b", 8192, 64, 8),)
"""(model, P, C, G) measured on CPU: both models at P=4096 with C = 64 and 512, and Qwen3-4B at P=8192, C=64, G=8
(each stock run takes 4-6 minutes of wall time on the shared 2-core machine at P=4096)."""
CPU_HIDDEN = 256
CPU_VOCAB = 8192


def cut_for_cpu(config: dict[str, Any], hidden: int = CPU_HIDDEN, vocab: int = CPU_VOCAB) -> dict[str, Any]:
    """``config`` narrowed for a CPU run: hidden ``hidden``, MLP width scaled by hidden / published hidden (rounded to
    16), 4 query / 1 KV heads of 64, Gated DeltaNet (if any) 2 key / 4 value heads of 64, vocabulary ``vocab``;
    layers, layer pattern, RoPE and tying as published. Raises ValueError for a ``hidden`` not a multiple of 64."""
    if hidden <= 0 or hidden % 64:
        raise ValueError(f"hidden must be a positive multiple of 64, got {hidden}")
    scale = hidden / config["hidden_size"]
    out = dict(
        config,
        hidden_size=hidden,
        intermediate_size=16 * max(1, round(config["intermediate_size"] * scale / 16)),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=vocab,
    )
    if "linear_num_key_heads" in config:
        out.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
    return out


def cut_note(config: dict[str, Any]) -> str:
    """The cut of :func:`cut_for_cpu` in words, for the CSV's ``config["cut"]``."""
    return (
        f"hidden {config['hidden_size']}, MLP {config['intermediate_size']}, 4/1 heads of 64"
        + (", DeltaNet 2/4 heads of 64" if "linear_num_key_heads" in config else "")
        + f", vocabulary {config['vocab_size']} (CPU cut)"
    )


def grid(full: bool) -> list[tuple[str, int, int, int]]:
    """(model, P, C, G) in run order: every model x P x C x G with ``full``, else :data:`CPU_GRID`."""
    if not full:
        return list(CPU_GRID)
    return [(m, P, C, G) for m in MODELS for P in PROMPTS for C in COMPLETIONS for G in GROUPS]


def model_config(name: str, cpu_cut: bool) -> dict[str, Any]:
    """The config.json content of ``MODELS[name]`` (cut with :func:`cut_for_cpu` if ``cpu_cut``), with this benchmark's
    EOS and padding ids. Raises ValueError for an unknown name."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    config = cut_for_cpu(MODELS[name]) if cpu_cut else dict(MODELS[name])
    return dict(config, eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=1, attention_dropout=0.0)


# ----------------------------------------------------------------------------------------------- fitting and cells
def stock_estimate(config: dict, G: int, P: int, C: int, dtype: str, device: str):
    """Stock's estimated peak (``estimate_stock_memory`` of one micro-batch of G rows; its head on the G·C completion
    positions, as TRL's compact mode and ``full_seq`` run it)."""
    from grpo_mem.bench.estimate import model_shape
    from grpo_mem.bench.fits import estimate_stock_memory

    # device="cuda": the head on completion positions, no process base (the base is subtracted from the measurement)
    return estimate_stock_memory(model_shape(config), micro=G, P=P, C=C, dtype=dtype, device="cuda")


def cell_csv_config(name: str, P: int, C: int, G: int, config: dict, est, *, device, dtype, threads, repeats, stock):
    """The CSV ``config`` of one (model, P, C, G): the shape, the run's settings, the ideal token ratio and stock's
    estimate (``est``, :func:`stock_estimate`); on CPU the cut too."""
    from grpo_mem.bench.estimate import GB

    csv_config = {
        "model": name,
        "P": P,
        "C": C,
        "G": G,
        "groups": 1,
        "micro": G,
        "layers": config["num_hidden_layers"],
        "dtype": dtype,
        "threads": threads,
        "repeats": repeats,
        "stock": stock,
        "ideal_ratio": round(token_counts(G, P, C)["ideal_ratio"], 4),
        "estimated_stock_peak_gb": round(est.total / GB, 3),
        "grad_mb": round(est.gradients / MB, 1),
    }
    if device == "cpu":
        csv_config["cut"] = cut_note(config)
    return csv_config


def cells(
    configs: Sequence[tuple[str, int, int, int]],
    *,
    stock: str,
    device: str,
    dtype: str,
    threads: int,
    repeats: int,
    available: float,
) -> list[Cell]:
    """Stock then grpo_mem for each (model, P, C, G); a stock cell whose estimate exceeds ``available`` bytes is
    skipped with the estimate as its reason, and its grpo_mem cell is checked against a plain forward instead."""
    from grpo_mem.bench.estimate import DTYPES, GB

    out = []
    for name, P, C, G in configs:
        config = model_config(name, cpu_cut=device == "cpu")
        est = stock_estimate(config, G, P, C, dtype, device)
        fits = est.total <= available
        csv_config = cell_csv_config(
            name, P, C, G, config, est, device=device, dtype=dtype, threads=threads, repeats=repeats, stock=stock
        )
        args = {
            "model_config": config,
            "G": G,
            "P": P,
            "C": C,
            "groups": 1,
            "micro": G,
            "dtype": DTYPES[dtype],
            "device": device,
            "repeats": repeats,
            "min_repeats": repeats,
            "time_budget_s": None,
            "single_call": repeats == 1 and device == "cpu",
        }
        skip = (
            None
            if fits
            else (
                f"stock does not fit: estimated {est.total / GB:.1f} GB > {available / GB:.1f} GB available "
                f"({est.describe()})"
            )
        )
        key = (name, P, C, G)
        label = f"{name} P={P} C={C} G={G}"
        out.append(Cell(stock, P, csv_config, dict(args, provider=stock, plain_forward_check=False), key, label, skip))
        out.append(
            Cell("grpo_mem", P, csv_config, dict(args, provider="grpo_mem", plain_forward_check=not fits), key, label)
        )
    return out


# --------------------------------------------------------------------------------------------------------- running
def compare_with_stock(outcomes: list) -> None:
    """Give each grpo_mem outcome the differences from its configuration's stock outcome (``*_vs_stock`` keys of
    ``sweep.compare_with_reference``: log-probs, entropies, gradient norm, worst parameter's gradient) and rebuild its
    CSV rows with them. The sweep's own ``*_vs_trl`` keys are dropped (the stock here may be ``full_seq``)."""
    from grpo_mem.bench.results import measurement_rows

    stock = {o.cell.key: o.result for o in outcomes if o.cell.provider != "grpo_mem" and not o.skipped}
    for o in outcomes:
        if o.cell.provider != "grpo_mem" or o.skipped:
            continue
        for k in [k for k in o.config if k.endswith("_vs_trl")]:
            del o.config[k]
        if o.cell.key in stock:
            diffs = compare_with_reference(o.result, stock[o.cell.key])
            o.config.update({k.replace("_vs_trl", "_vs_stock"): v for k, v in diffs.items()})
        device = o.rows[0]["device"] if o.rows else None
        o.rows = measurement_rows(
            OP, "grpo_mem", "full", "P", o.cell.x_value, o.result, o.config, device=device, version=o.result["version"]
        )


def run(cells_: list[Cell], *, device: str, threads: int, rss_budget_mb: float) -> list:
    """Every cell in a fresh process (stock, then grpo_mem, per configuration); the outcomes, grpo_mem's compared with
    stock's (:func:`compare_with_stock`)."""
    cuda_name = None
    if device == "cuda":
        from grpo_mem.bench.harness_cuda import cuda_device_name

        cuda_name = cuda_device_name()
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    sweep = Sweep(
        OP,
        "P",
        isolated(WORKER, threads=threads, env=env, timeout_s=7200.0, rss_budget_mb=rss_budget_mb),
        device=cuda_name,
    )
    outcomes = sweep.run(cells_)
    compare_with_stock(outcomes)
    return outcomes


# ---------------------------------------------------------------------------------------------- table and figure
def memory_metric(rows: list[dict]) -> str:
    """The peak-memory metric of these rows: ``peak_rss_above_base`` (CPU) if present, else ``peak_tensor`` (CUDA's
    ``max_memory_allocated`` above the base)."""
    return "peak_rss_above_base" if any(r["metric"] == "peak_rss_above_base" for r in rows) else "peak_tensor"


def summary(path: str = CSV_PATH) -> list[dict]:
    """Per configuration of the CSV (in its order): model, P, C, G, ideal, stock and grpo_mem time (s) and memory
    (MB), grpo_mem's ratios to stock (memory: to the paper estimate where stock did not fit, ``mem_estimated``) and
    each over the ideal, ``grad_mb`` and the largest log-prob difference from stock (or from a plain forward)."""
    rows = harness.read_csv(path)
    by: dict[tuple, dict] = {}
    for r in rows:
        c = r["config"]
        entry = by.setdefault((c["model"], c["P"], c["C"], c["G"]), {"config": c})
        side = "grpo" if r["provider"] == "grpo_mem" else "stock"
        entry.setdefault(side, {})[r["metric"]] = r
    out = []
    for (model, P, C, G), e in by.items():
        if "grpo" not in e:
            continue
        grpo, stock = e["grpo"], e.get("stock", {})
        met = memory_metric(list(grpo.values()))
        gc = grpo["wall_time"]["config"]
        s = {"model": model, "P": P, "C": C, "G": G, "ideal": gc["ideal_ratio"], "grad_mb": gc.get("grad_mb")}
        s["device"] = grpo["wall_time"]["device"]
        s["grpo_time"], s["grpo_mb"] = grpo["wall_time"]["p50"], grpo[met]["p50"]
        measured = "wall_time" in stock and _finite(stock["wall_time"]["p50"])
        s["stock_fits"] = measured
        if measured:
            s["stock_time"], s["stock_mb"] = stock["wall_time"]["p50"], stock[met]["p50"]
            s["time_ratio"] = s["grpo_time"] / s["stock_time"]
            s["mem_ratio"] = s["grpo_mb"] / s["stock_mb"]
            s["mem_estimated"] = False
            s["logp_diff"] = gc.get("logp_max_abs_diff_vs_stock")
            s["grad_diff"] = gc.get("grad_param_max_rel_diff_vs_stock")
        else:
            s["stock_time"] = s["stock_mb"] = s["time_ratio"] = None
            s["stock_mb_estimated"] = gc["estimated_stock_peak_gb"] * 1e3
            s["mem_ratio"] = s["grpo_mb"] / s["stock_mb_estimated"]
            s["mem_estimated"] = True
            s["logp_diff"] = gc.get("logp_max_abs_diff_vs_plain_forward")
            s["grad_diff"] = None
        s["time_over_ideal"] = None if s["time_ratio"] is None else s["time_ratio"] / s["ideal"]
        s["mem_over_ideal"] = s["mem_ratio"] / s["ideal"]
        s["cut"] = gc.get("cut", "")
        out.append(s)
    return out


def _finite(v) -> bool:
    """Whether a CSV cell read back holds a number (a skipped row's is empty or NaN)."""
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(path: str = CSV_PATH) -> str:
    """Markdown table of the CSV (:func:`summary`): per configuration, stock and grpo_mem's time (s) and peak memory
    (MB), grpo_mem's ratios beside the ideal and over it, and grpo_mem's largest differences from stock. Where stock did
    not fit, its memory is the paper estimate (marked "est.") and there is no time ratio."""
    headers = [
        "model",
        "P",
        "C",
        "G",
        "ideal",
        "time stock s",
        "time grpo_mem s",
        "time ratio",
        "time / ideal",
        "memory stock MB",
        "memory grpo_mem MB",
        "memory ratio",
        "memory / ideal",
        "gradients MB",
        "max abs Δlogp",
        "worst param grad rel diff",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for s in summary(path):
        stock_mb = (
            f"{s['stock_mb_estimated']:.0f} est. (does not fit)" if s["mem_estimated"] else f"{s['stock_mb']:.0f}"
        )
        cells_ = [
            s["model"],
            s["P"],
            s["C"],
            s["G"],
            f"{s['ideal']:.3f}",
            _fmt(s["stock_time"], ".1f"),
            f"{s['grpo_time']:.1f}",
            _fmt(s["time_ratio"], ".3f"),
            _fmt(s["time_over_ideal"], ".2f"),
            stock_mb,
            f"{s['grpo_mb']:.0f}",
            f"{s['mem_ratio']:.3f}",
            f"{s['mem_over_ideal']:.2f}",
            _fmt(s["grad_mb"], ".0f"),
            _fmt(s["logp_diff"], ".1e"),
            _fmt(s["grad_diff"], ".1e"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells_) + " |")
    return "\n".join(lines)


def plot(path: str = CSV_PATH, png: str = PNG_PATH) -> None:
    """``png``: grpo_mem's measured time and memory ratios to stock against the ideal ratio (one point per
    configuration, a marker per model; the diagonal is the ideal), and the memory ratio over the ideal by P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(path)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4))
    markers = dict(zip(MODELS, ("o", "s")))
    top = max([r["ideal"] for r in rows] + [r["mem_ratio"] for r in rows] + [r["time_ratio"] or 0 for r in rows])
    ax.plot([0, top * 1.1], [0, top * 1.1], color="gray", lw=1, ls="--", label="ideal")
    for model, marker in markers.items():
        mine = [r for r in rows if r["model"] == model]
        timed = [r for r in mine if r["time_ratio"] is not None]
        ax.scatter(
            [r["ideal"] for r in timed], [r["time_ratio"] for r in timed], marker=marker, c="C0", label=f"time, {model}"
        )
        ax.scatter(
            [r["ideal"] for r in mine], [r["mem_ratio"] for r in mine], marker=marker, c="C1", label=f"memory, {model}"
        )
        for C in sorted({r["C"] for r in mine}):
            pts = sorted((r for r in mine if r["C"] == C), key=lambda r: r["P"])
            bx.plot([r["P"] for r in pts], [r["mem_over_ideal"] for r in pts], marker=marker, label=f"{model}, C={C}")
    ax.set_xlabel("ideal ratio (P + G·(C − 1)) / (G·(P + C))")
    ax.set_ylabel("grpo_mem / stock")
    ax.set_title("measured ratio against the ideal")
    ax.legend(fontsize=7)
    bx.axhline(1.0, color="gray", lw=1, ls="--")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("prompt length P")
    bx.set_ylabel("memory ratio / ideal")
    bx.set_title("memory ratio over the ideal")
    bx.legend(fontsize=7)
    device = rows[0]["device"] if rows else ""
    fig.suptitle(f"long prompts, one group of G in one micro-batch ({device})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------ main
def parse_only(value: str) -> list[tuple[str, int, int, int]]:
    """``--only`` ("model/P/C/G,..."), as (model, P, C, G). Raises ValueError naming a malformed entry."""
    out = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        parts = item.split("/")
        if len(parts) != 4 or parts[0] not in MODELS or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            raise ValueError(f"--only entries are model/P/C/G with model in {sorted(MODELS)}, got {item!r}")
        out.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from grpo_mem.bench.estimate import GB
    from grpo_mem.bench.fits import available_memory_bytes
    from grpo_mem.bench.results import write_csv

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--stock", choices=("trl", "full_seq"), default=None, help="default: full_seq on CPU, trl on CUDA")
    ap.add_argument("--full-grid", action="store_true", help="every P x C x G (default on CUDA)")
    ap.add_argument("--only", default=None, metavar="M/P/C/G,...", help="only these configurations")
    ap.add_argument("--repeats", type=int, default=None, help="calls per provider (default: 1 on CPU, 3 on CUDA)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--reserve-gb", type=float, default=2.0, help="memory kept free beside the estimate")
    ap.add_argument("--csv", default=CSV_PATH)
    ap.add_argument("--png", default=PNG_PATH)
    ap.add_argument("--table", action="store_true", help="only reprint the table from the CSV")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.csv))
        return 0
    cuda = args.device == "cuda"
    if cuda:
        from grpo_mem.bench.harness_cuda import cuda_unavailable_reason

        if (reason := cuda_unavailable_reason()) is not None:
            print(f"bench_long: {reason}; nothing run", file=sys.stderr)
            return 0
    try:
        configs = parse_only(args.only) if args.only else grid(args.full_grid or cuda)
    except ValueError as exc:
        ap.error(str(exc))
    available, where = available_memory_bytes(args.device)
    host = available if not cuda else available_memory_bytes("cpu")[0]
    budget = available - args.reserve_gb * GB
    print(f"bench_long: {len(configs)} configurations; {available / GB:.1f} GB available ({where})", file=sys.stderr)
    outcomes = run(
        cells(
            configs,
            stock=args.stock or ("trl" if cuda else "full_seq"),
            device=args.device,
            dtype=args.dtype or ("bf16" if cuda else "fp32"),
            threads=args.threads,
            repeats=args.repeats or (3 if cuda else 1),
            available=budget,
        ),
        device=args.device,
        threads=args.threads,
        rss_budget_mb=0.95 * host / 1e6,
    )
    rows = [r for o in outcomes for r in o.rows]
    if args.csv == CSV_PATH or os.path.exists(args.csv):
        merge_csv(rows, args.csv, key=_row_key)
    else:
        write_csv(rows, args.csv)
    print(table(args.csv))
    plot(args.csv, args.png)
    print(f"wrote {args.csv} and {args.png}", file=sys.stderr)
    return 0 if all(not o.skipped or o.cell.skip for o in outcomes) else 1


def _row_key(r: dict) -> tuple:
    c = r["config"]
    return (r["provider"], r["metric"], c["model"], c["P"], c["C"], c["G"], r["device"])


if __name__ == "__main__":
    sys.exit(main())

"""What ``grpo-mem bench`` prints and draws from its sweep's outcomes: per provider the wall and CPU time, peak memory
and their ratios to stock TRL (:func:`summarize`), the markdown table, the bar chart and the verdict line, with the
row of the provider ``patch_trl`` runs by default marked (:func:`default_row`)."""

from __future__ import annotations

import math
import os
from typing import Any


def default_row(image_tokens: int = 0) -> tuple[str, str]:
    """The provider whose row stands for grpo_mem as ``patch_trl`` runs it by default, and its sharing mode: text
    prompts, the provider of ``patch_trl``'s default ``sharing`` (``grpo_mem_tree`` for ``"tree"``); image prompts,
    ``grpo_mem`` (the only patched provider of an image run, group sharing)."""
    import inspect

    from grpo_mem.bench.group import PROVIDERS
    from grpo_mem.patches.trl import patch_trl

    if image_tokens:
        return "grpo_mem", PROVIDERS["grpo_mem"].sharing
    mode = inspect.signature(patch_trl).parameters["sharing"].default
    return next(p.name for p in PROVIDERS.values() if p.sharing == mode), mode


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b) else a / b


def summarize(outcomes: list, default: str | None = None) -> list[dict]:
    """Per provider (in order, from the sweep's :class:`~grpo_mem.bench.sweep.Outcome` list): wall and CPU time p50
    (s), peak memory above base (MB; peak RSS on CPU, peak CUDA allocation on CUDA), ratios to ``trl``, max |Δ
    log-prob| and |Δ entropy| vs ``trl``, gradient-norm relative difference vs ``trl``, fallback warnings, or the
    reason it was skipped (``skipped``; with ``"not_run": True`` where it was not attempted: stock TRL whose
    estimate does not fit, its ratios then None); ``"default": True`` on the row of provider ``default``
    (:func:`default_row`)."""
    from grpo_mem.bench.measure import Measurement

    out = []
    for outcome in outcomes:
        row: dict[str, Any] = {"provider": outcome.cell.provider, "default": outcome.cell.provider == default}
        if outcome.skipped:
            # not_run: the run was not attempted (stock TRL whose estimate does not fit), not a failure
            out.append(dict(row, skipped=outcome.skipped, **({"not_run": True} if outcome.cell.skip else {})))
            continue
        metrics = Measurement.from_dict(outcome.result).metrics()
        mem = metrics.get("peak_rss_above_base") or metrics.get("peak_tensor")
        cpu = metrics.get("cpu_time")
        row.update(
            time_s=metrics["wall_time"][1][0],
            cpu_s=cpu[1][0] if cpu else None,
            mem_mb=mem[1][0] if mem else None,
            fallback=outcome.config.get("fallback") or [],
        )
        row.update({k: v for k, v in outcome.config.items() if k.endswith("_vs_trl")})
        out.append(row)
    base = next((r for r in out if r["provider"] == "trl" and "skipped" not in r), {})
    for row in out:
        if "skipped" not in row:
            row["time_vs_trl"] = _ratio(row["time_s"], base.get("time_s"))
            row["cpu_vs_trl"] = _ratio(row["cpu_s"], base.get("cpu_s"))
            row["mem_vs_trl"] = _ratio(row["mem_mb"], base.get("mem_mb"))
    return out


def verdict(summary: list[dict], mode: str, image_tokens: int = 0) -> str:
    """The line ``grpo-mem bench`` ends with: the default row's peak memory and wall time over stock TRL's (the rows
    of :func:`summarize`; ``mode``: the default row's sharing mode); where stock TRL was not run (``not_run``), the
    default row's own peak memory and time with the reason; or why there is no verdict."""
    row = next((r for r in summary if r.get("default")), None)
    stock = next((r for r in summary if r["provider"] == "trl"), None)
    how = f"image prompts run {mode} sharing" if image_tokens else f"the default is {mode} sharing"
    if stock is not None and stock.get("not_run") and row is not None and "skipped" not in row:
        mem = "-" if row["mem_mb"] is None else f"{row['mem_mb']:.0f} MB"
        return (
            f"on this shape grpo_mem peaks at {mem} above base in {row['time_s']:.3g} s; {stock['skipped']}, so no "
            f"ratio; {how}"
        )
    for name, r in (("stock TRL", stock), ("grpo_mem", row)):
        if r is None or "skipped" in r:
            return f"no verdict: {name} was not measured" + (f" ({r['skipped'][:80]})" if r else "")
    mem, wall = _times(row["mem_vs_trl"], "the memory"), _times(row["time_vs_trl"], "the time")
    return f"on this shape grpo_mem uses {mem} and {wall} of stock TRL; {how}"


def _times(ratio: float | None, what: str) -> str:
    return what if ratio is None else f"{ratio:.2f}x {what}"


def table(summary: list[dict]) -> str:
    """The markdown table printed by ``grpo-mem bench``; the default row (:func:`default_row`) says so. A row not
    measured holds ``-`` and why (a stock TRL row not run: ``stock not run (estimated X GB > Y GB available)``, the
    other rows' ratios then ``-``)."""
    from grpo_mem.bench.results import markdown_table

    headers = [
        "provider",
        "time s",
        "CPU s",
        "peak mem MB",
        "time / trl",
        "CPU / trl",
        "mem / trl",
        "max abs Δlogp vs trl",
    ]
    rows = []
    for r in summary:
        name = r["provider"] + (" (default)" if r.get("default") else "")
        if "skipped" in r:
            why = r["skipped"] if r.get("not_run") else f"skipped: {r['skipped'][:80]}"
            rows.append([name, None, None, None, None, None, None, why])
            continue
        if r["provider"] == "trl":
            diff = "(reference)"
        elif "logp_max_abs_diff_vs_trl" in r:
            diff = f"{r['logp_max_abs_diff_vs_trl']:.1e}"
        else:
            diff = "-"
        if r["fallback"]:
            diff += " (fell back to the full sequence)"
        rows.append(
            [
                name,
                r["time_s"],
                r["cpu_s"],
                r["mem_mb"],
                r["time_vs_trl"],
                r["cpu_vs_trl"],
                r["mem_vs_trl"],
                diff,
            ]
        )
    return markdown_table(headers, rows)


def plot(summary: list[dict], png_path: str, title: str) -> None:
    """Bar chart of wall time, CPU time and peak memory per measured provider (matplotlib, Agg); a provider not run
    (``not_run``) is named with its reason under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in summary if "skipped" not in r]
    panels = [
        (k, label)
        for k, label in (
            ("time_s", "wall time [s]"),
            ("cpu_s", "CPU time [s]"),
            ("mem_mb", "peak memory above base [MB]"),
        )
        if any(r.get(k) is not None for r in measured)
    ]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(3.6 * len(panels) + 0.5, 3.4), squeeze=False, constrained_layout=True
    )
    names = [r["provider"] for r in measured]
    for ax, (key, label) in zip(axes[0], panels):
        values = [r.get(key) or 0.0 for r in measured]
        bars = ax.bar(names, values, color=["0.6" if n == "trl" else "tab:blue" for n in names])
        ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 1000 else f"{v:.3g}" for v in values], fontsize=8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    not_run = [f"{r['provider']}: {r['skipped']}" for r in summary if r.get("not_run")]
    fig.suptitle("\n".join([title, *not_run]), fontsize=9)
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)

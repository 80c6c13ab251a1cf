"""``grpo-mem train --compare``: stock TRL, then the grpo_mem patch, with the same settings and seeds.

Each run is ``python -m grpo_mem.cli train ... --output-dir=OUTPUT_DIR/stock|patched --patch=false|true`` in a fresh
process, one after the other, so each run's peak RSS and ``ru_maxrss`` are its own and the two never share the
cores. Generation comes before scoring in every step, so with the same seeds both runs sample the same completions
and get the same rewards for as long as their updates agree (to fp32 rounding, they do): the comparison reports
the largest per-step reward difference, which should be 0.

Writes ``OUTPUT_DIR/summary.json`` (both runs' summaries, their differences and the patched/stock ratios,
:func:`compare_runs`) and ``OUTPUT_DIR/summary.png`` (one figure, :func:`plot_compare`), and prints a side-by-side
table (:func:`format_compare`). Nothing here imports torch: the parent process only starts the runs and reads their
summaries.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from grpo_mem.commands.flags import check_output_dir, to_argv
from grpo_mem.commands.report import fmt, memory_figure, plot_token_ratio, prompt_text, token_ratio_mean

RUNS = ("stock", "patched")
"""Run names, in the order they run; also the subdirectories of the output directory."""


def run_command(settings, patched: bool, output_dir: Path | str) -> list[str]:
    """The command line of one run of the comparison: ``settings`` with ``compare`` off, ``patch=patched`` and
    ``output_dir``, as flags of ``python -m grpo_mem.cli train``."""
    child = dataclasses.replace(settings, compare=False, patch=patched, output_dir=str(output_dir))
    # --patch is always spelt out, so each command says which run it is.
    flags = to_argv(child)
    if not any(f.startswith("--patch=") for f in flags):
        flags.append(f"--patch={'true' if patched else 'false'}")
    return [sys.executable, "-m", "grpo_mem.cli", "train", *flags]


def _ratio(patched: float | None, stock: float | None) -> float:
    if patched is None or stock is None or not stock or math.isnan(stock) or math.isnan(patched):
        return math.nan
    return patched / stock


def _median_after_first(values: list[float]) -> float:
    """Median over steps 2.. (step 1 differs: AdamW allocates its moments at its end); all steps if only one."""
    part = values[1:] if len(values) > 1 else values
    return statistics.median(part) if part else math.nan


def compare_runs(stock: dict, patched: dict) -> dict:
    """Differences and ratios (patched / stock) of two run summaries (:func:`grpo_mem.commands.train.run`).

    Returns a dict with ``steps_compared`` (steps present in both), ``reward_abs_diff`` (per step, |patched -
    stock|), ``reward_max_abs_diff``, ``rewards_identical`` (bool), ``loss_max_abs_diff``,
    ``grad_norm_max_rel_diff``, and ``ratios``: ``peak_rss_mb`` (max step peak), ``peak_rss_median_mb`` (median
    step peak over steps 2..), ``peak_rss_above_start_mb`` (max step peak minus the RSS before training),
    ``ru_maxrss_mb``, on CUDA ``peak_cuda_allocated_mb`` (max step peak of ``torch.cuda.max_memory_allocated``),
    ``step_time_median_s``, ``step_time_mean_s``, ``train_time_s``. A ratio is NaN when a figure
    is missing or zero. ``token_ratio_mean``: the patched run's mean over steps of the backbone's tokens over stock
    TRL's, as its patch logged them (None when it logged none; the stock run logs none).
    """
    by_step = {r["step"]: r for r in stock["steps"]}
    pairs = [(by_step[r["step"]], r) for r in patched["steps"] if r["step"] in by_step]

    def diffs(key, relative=False):
        out = []
        for s, p in pairs:
            if s[key] is None or p[key] is None:
                continue
            d = abs(p[key] - s[key])
            out.append(d / abs(s[key]) if relative and s[key] else d)
        return out

    reward_diff = [
        abs(p["reward"] - s["reward"]) if p["reward"] is not None and s["reward"] is not None else None
        for s, p in pairs
    ]
    known = [d for d in reward_diff if d is not None]

    def above(summary):
        return summary["totals"]["peak_rss_mb"] - summary["rss_before_train_mb"]

    def median_peak(summary):
        return _median_after_first([r["peak_rss_mb"] for r in summary["steps"]])

    st, pt = stock["totals"], patched["totals"]
    loss, grad = diffs("loss"), diffs("grad_norm", relative=True)
    return {
        "steps_compared": [p["step"] for _, p in pairs],
        "reward_abs_diff": reward_diff,
        "reward_max_abs_diff": max(known) if known else math.nan,
        "rewards_identical": bool(pairs)
        and len(known) == len(pairs)
        and max(known) == 0.0
        and len(stock["steps"]) == len(patched["steps"]),
        "loss_max_abs_diff": max(loss) if loss else math.nan,
        "grad_norm_max_rel_diff": max(grad) if grad else math.nan,
        "token_ratio_mean": token_ratio_mean(patched["steps"]),
        "ratios": {
            "peak_rss_mb": _ratio(pt["peak_rss_mb"], st["peak_rss_mb"]),
            "peak_rss_median_mb": _ratio(median_peak(patched), median_peak(stock)),
            "peak_rss_above_start_mb": _ratio(above(patched), above(stock)),
            "ru_maxrss_mb": _ratio(patched["ru_maxrss_mb"], stock["ru_maxrss_mb"]),
            **(
                {"peak_cuda_allocated_mb": _ratio(pt["peak_cuda_allocated_mb"], st["peak_cuda_allocated_mb"])}
                if "peak_cuda_allocated_mb" in pt and "peak_cuda_allocated_mb" in st
                else {}
            ),
            "step_time_median_s": _ratio(pt["step_time_median_s"], st["step_time_median_s"]),
            "step_time_mean_s": _ratio(pt["step_time_mean_s"], st["step_time_mean_s"]),
            "train_time_s": _ratio(patched["train_time_s"], stock["train_time_s"]),
        },
    }


def _reward_diff_text(summary: dict) -> str:
    d = summary["reward_max_abs_diff"]
    if summary["rewards_identical"]:
        return "max |Δ reward| per step = 0 (identical rewards)"
    return f"max |Δ reward| per step = {fmt(d, '.3g')} (rewards differ)"


def format_compare(summary: dict) -> str:
    """The side-by-side table printed at the end of ``--compare``: per step reward, peak RSS and step time of both
    runs (and the patched run's backbone tokens over stock TRL's, when its patch logged them), then the ratios."""
    stock, patched = summary["runs"]["stock"], summary["runs"]["patched"]
    by_step = {r["step"]: r for r in patched["steps"]}
    tokens = summary.get("token_ratio_mean") is not None
    key, label = memory_figure(stock)
    lines = [
        f"grpo-mem train --compare: {Path(stock['model']).name} on {stock['task']}, "
        f"G={stock['settings']['num_generations']}, prompts: {prompt_text(stock)}",
        f"{'':>5} {'reward':^15} {label + ' MB':^15} {'step time s':^15}",
        f"{'step':>5} {'stock':>7} {'patched':>7} {'stock':>7} {'patched':>7} {'stock':>7} {'patched':>7}"
        + ("  patched tokens / stock" if tokens else ""),
    ]
    for s in stock["steps"]:
        p = by_step.get(s["step"], {})
        lines.append(
            f"{s['step']:>5} {fmt(s['reward'], '7.3f')} {fmt(p.get('reward'), '7.3f')} "
            f"{fmt(s.get(key), '7.0f')} {fmt(p.get(key), '7.0f')} "
            f"{fmt(s['step_time_s'], '7.2f')} {fmt(p.get('step_time_s'), '7.2f')}"
            + (f"  {fmt(p.get('token_ratio'), '.3f')}" if tokens else "")
        )
    r = summary["ratios"]
    if key != "peak_rss_mb":
        lines.append(f"patched / stock: {label} {fmt(r.get(key), '.3f')}x (max over steps)")
    lines += [
        f"patched / stock: peak RSS {fmt(r['peak_rss_mb'], '.3f')}x (max over steps; "
        f"{fmt(r['peak_rss_above_start_mb'], '.3f')}x above the RSS before training), "
        f"step time {fmt(r['step_time_median_s'], '.3f')}x (median), training time {fmt(r['train_time_s'], '.3f')}x",
        f"{_reward_diff_text(summary)}; max |Δ loss| {fmt(summary['loss_max_abs_diff'], '.3g')}, "
        f"max relative |Δ grad norm| {fmt(summary['grad_norm_max_rel_diff'], '.3g')}",
        *(
            [
                f"tokens the patched run's backbone forwarded / stock TRL's: {summary['token_ratio_mean']:.3f} (mean "
                "over steps)"
            ]
            if tokens
            else []
        ),
        f"wrote {summary['files']['json']} and {summary['files']['png']}",
    ]
    return "\n".join(lines)


def plot_compare(summary: dict, path: Path | str) -> None:
    """One PNG (matplotlib, Agg backend): reward, peak RSS and step time per step of both runs, sharing the step
    axis, each panel annotated with its patched/stock figure; below them the patched run's backbone tokens over stock
    TRL's per step, when its patch logged them (the stock run has no such figure)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    stock, patched = summary["runs"]["stock"], summary["runs"]["patched"]
    style = {
        "stock": dict(color="tab:gray", marker="o", ms=5, lw=2, label="stock TRL"),
        "patched": dict(color="tab:blue", marker="x", ms=6, lw=1.2, ls="--", label="grpo_mem patch"),
    }
    tokens = summary.get("token_ratio_mean") is not None
    fig, axes = plt.subplots(4 if tokens else 3, 1, figsize=(8, 11.5 if tokens else 9), sharex=True)
    ax_r, ax_m, ax_t = axes[:3]
    for name, run in (("stock", stock), ("patched", patched)):
        steps = [r["step"] for r in run["steps"]]
        ax_r.plot(steps, [r["reward"] if r["reward"] is not None else math.nan for r in run["steps"]], **style[name])
        ax_m.plot(steps, [r[memory_figure(stock)[0]] for r in run["steps"]], **style[name])
        ax_t.plot(steps, [r["step_time_s"] for r in run["steps"]], **style[name])
    _annotate(axes, summary, style["patched"])
    for ax in axes:
        ax.legend(loc="upper left", fontsize=8)
    _step_axis(axes[-1], sorted({r["step"] for run in (stock, patched) for r in run["steps"]}))
    fig.suptitle(
        f"{Path(stock['model']).name} · {stock['task']} · G={stock['settings']['num_generations']} · "
        f"stock TRL vs grpo_mem, same seeds\nprompts: {prompt_text(stock)}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _annotate(axes, summary: dict, patched_style: dict) -> None:
    """:func:`plot_compare`'s labels and its patched/stock figures on each panel; the token panel, if there is one."""
    r = summary["ratios"]
    box = dict(boxstyle="round", fc="white", ec="0.7", alpha=0.9)

    def note(ax, text):
        ax.text(0.99, 0.04, text, transform=ax.transAxes, ha="right", va="bottom", fontsize=9, bbox=box)

    ax_r, ax_m, ax_t = axes[:3]
    ax_r.set_ylabel("mean reward")
    ax_r.set_ylim(-0.05, 1.05)
    note(ax_r, _reward_diff_text(summary))
    key, label = memory_figure(summary["runs"]["stock"])
    ax_m.set_ylabel(f"{label} in step (MB)")
    note(
        ax_m,
        f"patched / stock: {fmt(r['peak_rss_mb'], '.2f')}x max step peak, "
        f"{fmt(r['peak_rss_above_start_mb'], '.2f')}x above RSS before training"
        if key == "peak_rss_mb"
        else f"patched / stock: {fmt(r.get(key), '.2f')}x max step peak",
    )
    ax_t.set_ylabel("step time (s)")
    note(
        ax_t,
        f"patched / stock: {fmt(r['step_time_median_s'], '.2f')}x median step time, "
        f"{fmt(r['train_time_s'], '.2f')}x training time",
    )
    for ax in (ax_m, ax_t):
        lo, hi = ax.get_ylim()
        ax.set_ylim(0, hi * 1.05)
    if len(axes) > 3:
        plot_token_ratio(axes[3], [(summary["runs"]["patched"]["steps"], patched_style)])
        note(axes[3], f"patched: backbone tokens {summary['token_ratio_mean']:.3f}x stock TRL's (mean over steps)")


def _step_axis(ax, all_steps: list[int]) -> None:
    """The shared x axis: every step ticked when there are at most 20, else integer ticks."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("optimizer step")
    if 0 < len(all_steps) <= 20:
        ax.set_xticks(all_steps)
        ax.set_xlim(all_steps[0] - 0.5, all_steps[-1] + 0.5)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def run_compare(settings, *, verbose: bool = True) -> dict:
    """Run :data:`RUNS` one after the other (:func:`run_command`), then write and return the comparison.

    Returns a dict with ``compare`` (True), ``settings``, ``commands`` (run name -> argv), ``runs`` (run name -> that
    run's summary), the keys of :func:`compare_runs`, and ``files``. Also written as ``OUTPUT_DIR/summary.json``.

    Raises:
        ValueError: a bad setting (``settings.validate()``), an ``output_dir`` that cannot be written
            (:func:`~grpo_mem.commands.flags.check_output_dir`, before either run), or a run that exits with status 2 (a setting it
            rejected, such as prompts longer than the model allows; the run printed why).
        RuntimeError: a run that fails otherwise.
    """
    settings.validate()
    check_output_dir(settings.output_dir)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    commands, runs = {}, {}
    for name in RUNS:
        cmd = run_command(settings, name == "patched", out / name)
        commands[name] = cmd
        if verbose:
            print(f"grpo-mem train --compare: {name} run: {shlex.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, stdout=None if verbose else subprocess.DEVNULL)
        if proc.returncode == 2:
            raise ValueError(f"--compare: the {name} run rejected its settings (exit status 2, see above)")
        if proc.returncode != 0:
            raise RuntimeError(f"--compare: the {name} run failed with exit status {proc.returncode}")
        runs[name] = json.loads((out / name / "summary.json").read_text())
    summary = {
        "compare": True,
        "settings": dataclasses.asdict(settings),
        "commands": commands,
        "runs": runs,
        **compare_runs(runs["stock"], runs["patched"]),
        "files": {"json": str(out / "summary.json"), "png": str(out / "summary.png")},
    }
    plot_compare(summary, out / "summary.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if verbose:
        print(format_compare(summary), flush=True)
    return summary

"""What one ``grpo-mem train`` run reports: per-step rows read from TRL's logs, the printed summary and the figure.

Shared by :mod:`~grpo_mem.commands.train` (one run) and :mod:`~grpo_mem.commands.compare` (two runs side by side);
imports nothing heavy (matplotlib only inside :func:`plot_summary`).

The token saving. The patched scoring method adds to TRL's logged metrics, per optimizer step (TRL averages each
metric's list over the step's micro-batches): ``grpo_mem/backbone_tokens`` (tokens the backbone forwarded for the
policy's training micro-batches, prompt passes plus completion passes), ``grpo_mem/stock_tokens`` (what stock TRL
would have forwarded for the same micro-batches, B x (P + C)), ``grpo_mem/token_ratio`` (their ratio) and
``grpo_mem/path/<name>`` (the fraction of micro-batches that took path ``tree``, ``group`` or ``stock``).
:func:`token_saving` reads them defensively: a run of stock TRL, or of a grpo_mem that does not log them, has none,
and then nothing about them is printed or plotted.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

LOGGED = {
    "reward": "reward",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "completions/mean_length": "completion_mean_length",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
}
"""Per-step metrics copied from TRL's logs into summary.json (TRL name -> summary name)."""

TOKEN_METRICS = {
    "grpo_mem/backbone_tokens": "backbone_tokens",
    "grpo_mem/stock_tokens": "stock_tokens",
    "grpo_mem/token_ratio": "token_ratio",
}
"""The patch's token counts in TRL's logs (logged name -> summary name)."""

MEMORY = {
    "cpu": ("peak_rss_mb", "peak RSS"),
    "cuda": ("peak_cuda_allocated_mb", "peak CUDA alloc"),
}
"""A run's device -> (the per-step memory figure's key in its rows and totals, its label): the process's resident set
on CPU, ``torch.cuda.max_memory_allocated`` on CUDA (:mod:`grpo_mem.commands.memory`)."""


def memory_figure(summary: dict) -> tuple[str, str]:
    """(key, label) of ``summary``'s memory figure (:data:`MEMORY`); a summary without ``device`` ran on CPU."""
    return MEMORY[summary.get("device", "cpu")]


PATH_PREFIX = "grpo_mem/path/"
"""Logged name prefix of the fraction of micro-batches that took each scoring path."""


def _number(value) -> float | None:
    """``value`` as a float if it is a finite-or-not real number (bools excluded), else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def token_saving(logs: dict) -> dict:
    """The token saving logged at one step: ``backbone_tokens``, ``stock_tokens``, ``token_ratio`` (floats, None when
    not logged) and ``paths`` (path name -> fraction of micro-batches, empty when not logged). A ratio missing from
    the logs is derived from the two counts when both are there."""
    out = {dst: _number(logs.get(src)) for src, dst in TOKEN_METRICS.items()}
    if out["token_ratio"] is None and out["backbone_tokens"] is not None and out["stock_tokens"]:
        out["token_ratio"] = out["backbone_tokens"] / out["stock_tokens"]
    out["paths"] = {
        k[len(PATH_PREFIX) :]: v
        for k, v in ((k, _number(v)) for k, v in logs.items())
        if k.startswith(PATH_PREFIX) and v is not None
    }
    return out


def saving_text(saving: dict) -> str:
    """``"tokens 0.28x stock (tree)"`` or ``"tokens 0.41x stock (tree 0.50, stock 0.50)"``; "" when no ratio."""
    ratio = saving.get("token_ratio")
    if ratio is None:
        return ""
    paths = {k: v for k, v in (saving.get("paths") or {}).items() if v > 0}
    if len(paths) == 1 and math.isclose(next(iter(paths.values())), 1.0):
        where = f" ({next(iter(paths))})"
    else:
        where = f" ({', '.join(f'{k} {v:.2f}' for k, v in sorted(paths.items()))})" if paths else ""
    return f"tokens {ratio:.3f}x stock{where}"


def step_rows(records: list[dict], log_history: list[dict]) -> list[dict]:
    """One row per optimizer step: ``step``, ``step_time_s``, ``peak_rss_mb`` and (on CUDA) ``peak_cuda_allocated_mb``
    from ``records`` (the step stats
    callback's, :func:`grpo_mem.commands.memory.make_step_stats_callback`), then the :data:`LOGGED` metrics (None when
    not logged) and the :func:`token_saving` keys from the ``log_history`` entries (``trainer.state.log_history``)
    whose ``step`` is that step."""
    logged: dict[int, dict] = {}
    for entry in log_history:
        if isinstance(entry, dict) and "step" in entry:
            logged.setdefault(entry["step"], {}).update(entry)
    rows = []
    for rec in records:
        logs = logged.get(rec["step"], {})
        row = {"step": rec["step"], "step_time_s": rec["step_time_s"], "peak_rss_mb": rec["peak_rss_mb"]}
        if "peak_cuda_allocated_mb" in rec:
            row["peak_cuda_allocated_mb"] = rec["peak_cuda_allocated_mb"]
        row.update({dst: _number(logs.get(src)) for src, dst in LOGGED.items()})
        row.update(token_saving(logs))
        rows.append(row)
    return rows


def token_ratio_mean(rows: list[dict]) -> float | None:
    """Mean of the steps' ``token_ratio`` over the steps that have one; None when none has."""
    ratios = [r["token_ratio"] for r in rows if r.get("token_ratio") is not None]
    return sum(ratios) / len(ratios) if ratios else None


def prompt_text(summary: dict) -> str:
    """``"449 tokens (shared prefix 438), 16 few-shot examples"``: the prompts' length after the chat template."""
    t = summary["prompt_tokens"]
    size = f"{t['max']}" if t["min"] == t["max"] else f"{t['min']}-{t['max']}"
    text = f"{size} tokens (shared prefix {t['shared_prefix']})"
    return text + (f", {summary['few_shot']} few-shot examples" if summary["few_shot"] else "")


def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or "-" for None and NaN."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_summary(summary: dict) -> str:
    """The end-of-run text report: one line per step (with the backbone's tokens over stock TRL's when the patch
    logged them), then totals."""
    with_tokens = any(r.get("token_ratio") is not None for r in summary["steps"])
    key, label = memory_figure(summary)
    where = f", {summary['device']} {summary['dtype']}" if "device" in summary else ""
    lines = [
        f"grpo-mem train: {summary['model']} on {summary['task']} "
        f"({'grpo_mem patch' if summary['patched'] else 'stock TRL, --no-patch'}{where})",
        f"prompts: {prompt_text(summary)}",
        f"{'step':>5} {'reward':>7} {'std':>6} {'len':>5} {label + ' MB':>12} {'time s':>7}"
        + ("  backbone tokens / stock" if with_tokens else ""),
    ]
    for r in summary["steps"]:
        line = (
            f"{r['step']:>5} {fmt(r['reward'], '7.3f')} {fmt(r['reward_std'], '6.3f')} "
            f"{fmt(r['completion_mean_length'], '5.1f')} {r[key]:>12.0f} {r['step_time_s']:>7.2f}"
        )
        lines.append(line + (f"  {saving_text(r) or '-'}" if with_tokens else ""))
    t = summary["totals"]
    lines += [
        f"reward: first {t['reward_first']:.3f}, last {t['reward_last']:.3f}, "
        f"mean of first half {t['reward_first_half']:.3f}, second half {t['reward_second_half']:.3f}",
        *(
            [f"peak CUDA allocated (torch.cuda.max_memory_allocated): max over steps {t[key]:.0f} MB"]
            if key != "peak_rss_mb"
            else []
        ),
        f"peak RSS: max over steps {t['peak_rss_mb']:.0f} MB (before training {summary['rss_before_train_mb']:.0f} MB), "
        f"ru_maxrss {summary['ru_maxrss_mb']:.0f} MB",
        f"step time: mean {t['step_time_mean_s']:.2f} s, median {t['step_time_median_s']:.2f} s; "
        f"training {summary['train_time_s']:.1f} s; wall {summary['wall_time_s']:.1f} s"
        + (
            f" (incl. {summary['conversion_time_s']:.1f} s one-time conversion)" if summary["conversion_time_s"] else ""
        ),
    ]
    if t.get("token_ratio_mean") is not None:
        lines.append(f"backbone tokens / stock TRL's: mean over steps {t['token_ratio_mean']:.3f}")
    if summary["grpo_mem_warnings"]:
        lines.append("grpo_mem warnings: " + " | ".join(summary["grpo_mem_warnings"]))
    lines.append(f"wrote {summary['files']['json']} and {summary['files']['png']}")
    return "\n".join(lines)


def plot_token_ratio(ax, runs: list[tuple[list[dict], dict]]) -> bool:
    """Plot each run's per-step ``token_ratio`` on ``ax`` (``runs``: (step rows, matplotlib line style)); runs
    without any ratio are left out. Returns whether anything was plotted (the caller then labels the axis)."""
    plotted = False
    for rows, style in runs:
        points = [(r["step"], r["token_ratio"]) for r in rows if r.get("token_ratio") is not None]
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], **style)
            plotted = True
    if plotted:
        ax.set_ylabel("backbone tokens / stock")
        lo, hi = ax.get_ylim()
        ax.set_ylim(0, max(hi, 1.0) * 1.05)
        ax.axhline(1.0, color="0.6", ls=":", lw=1)
    return plotted


def plot_summary(summary: dict, path: Path) -> None:
    """Write a PNG with mean reward and peak memory (RSS on CPU, CUDA allocation on CUDA) per step, and the backbone's tokens over stock TRL's per step when
    the patch logged them (matplotlib, Agg backend), to ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = summary["steps"]
    with_tokens = any(r.get("token_ratio") is not None for r in rows)
    steps = [r["step"] for r in rows]
    reward = [r["reward"] if r["reward"] is not None else math.nan for r in rows]
    std = [r["reward_std"] if r["reward_std"] is not None else 0.0 for r in rows]
    label = "grpo_mem patch" if summary["patched"] else "stock TRL"
    fig, axes = plt.subplots(3 if with_tokens else 2, 1, figsize=(7, 8.5 if with_tokens else 6), sharex=True)
    ax_r, ax_m = axes[0], axes[1]
    ax_r.plot(steps, reward, marker="o", ms=3, label="mean reward")
    ax_r.fill_between(
        steps,
        [max(r - s, 0.0) for r, s in zip(reward, std)],
        [min(r + s, 1.0) for r, s in zip(reward, std)],
        alpha=0.2,
        label="± reward std (clipped to [0, 1])",
    )
    ax_r.set_ylabel("reward")
    ax_r.set_ylim(-0.05, 1.05)
    ax_r.legend(loc="upper left", fontsize=8)
    ax_r.set_title(
        f"{Path(summary['model']).name} · {summary['task']} · G={summary['settings']['num_generations']}"
        f" · {label}\nprompts: {prompt_text(summary)}",
        fontsize=10,
    )
    key, label = memory_figure(summary)
    ax_m.plot(steps, [r[key] for r in rows], marker="o", ms=3, color="tab:red", label=f"{label} in step")
    if key == "peak_rss_mb":
        ax_m.axhline(summary["ru_maxrss_mb"], color="tab:red", ls=":", lw=1, label="ru_maxrss (whole process)")
        ax_m.axhline(summary["rss_before_train_mb"], color="gray", ls="--", lw=1, label="RSS before training")
    ax_m.set_ylabel(f"{'RSS' if key == 'peak_rss_mb' else 'CUDA allocated'} (MB)")
    ax_m.legend(loc="lower right", fontsize=8)
    if with_tokens:
        plot_token_ratio(
            axes[2],
            [(rows, dict(marker="o", ms=3, color="tab:green", label="tokens forwarded by the backbone / stock TRL's"))],
        )
        axes[2].legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _half_mean(values: list[float], second: bool) -> float:
    if not values:
        return math.nan
    half = len(values) // 2
    part = values[half:] if second else values[: max(half, 1)]
    return sum(part) / len(part)


def totals(rows: list[dict]) -> dict:
    """A run's totals over its :func:`step_rows`: first, last and mean reward, the means of its first and second halves,
    peak RSS (and peak CUDA allocation when every step has one), mean and median step time (s), and
    :func:`token_ratio_mean`; NaN where a value is missing."""
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    times = [r["step_time_s"] for r in rows]
    return {
        "reward_first": rewards[0] if rewards else math.nan,
        "reward_last": rewards[-1] if rewards else math.nan,
        "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
        "reward_first_half": _half_mean(rewards, second=False),
        "reward_second_half": _half_mean(rewards, second=True),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rows) if rows else math.nan,
        **(
            {"peak_cuda_allocated_mb": max(r["peak_cuda_allocated_mb"] for r in rows)}
            if rows and all(r.get("peak_cuda_allocated_mb") is not None for r in rows)
            else {}
        ),
        "step_time_mean_s": sum(times) / len(times) if times else math.nan,
        "step_time_median_s": statistics.median(times) if times else math.nan,
        "token_ratio_mean": token_ratio_mean(rows),
    }

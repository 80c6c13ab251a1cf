"""Benchmark results: the long-format CSV (rows from a :class:`~grpo_mem.bench.measure.Measurement`, skipped rows,
writing and reading), its plot and markdown tables.

CSV columns, exactly: ``op, provider, mode, metric, unit, x_name, x_value, p50, p20, p80, config, device, timestamp,
version``. ``mode`` is ``fwd``, ``bwd`` or ``full`` (forward + backward); ``config`` is a JSON object of everything that
defines the configuration (and ``"skipped": reason`` on skipped rows, whose p-columns are empty); ``version`` holds the
grpo_mem, torch, transformers and trl versions. The metrics and their units: :mod:`grpo_mem.bench.measure`.
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import importlib
import json
import math
import os
import platform
import subprocess
from typing import Any, Iterable, Sequence

from grpo_mem.bench.measure import MB, Measurement

CSV_COLUMNS = (
    "op",
    "provider",
    "mode",
    "metric",
    "unit",
    "x_name",
    "x_value",
    "p50",
    "p20",
    "p80",
    "config",
    "device",
    "timestamp",
    "version",
)
MODES = ("fwd", "bwd", "full")
# The directory holding the ``grpo_mem`` package: the repository root in a source checkout (for :func:`versions`)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------------------- CSV rows
@functools.lru_cache(maxsize=None)
def versions() -> str:
    """``"grpo_mem=X;torch=Y;transformers=Z;trl=W"``; ``X`` from package metadata, else ``grpo_mem.__version__``, plus
    ``+g<commit>`` when the repository is a git checkout (``.dirty`` if ``grpo_mem/`` differs from that commit).
    Missing packages read ``none``."""
    from importlib import metadata

    def ver(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "grpo_mem":
                try:
                    return getattr(importlib.import_module("grpo_mem"), "__version__", "src")
                except Exception:
                    return "none"
            return "none"

    gm = ver("grpo_mem")
    # A source checkout only: an installed copy's directory may sit inside some unrelated repository
    if os.path.exists(os.path.join(_REPO, ".git")):
        try:
            sha = subprocess.run(
                ["git", "-C", _REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            if sha:
                dirty = subprocess.run(
                    ["git", "-C", _REPO, "status", "--porcelain", "--", "grpo_mem"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout.strip()
                gm += f"+g{sha}" + (".dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return ";".join([f"grpo_mem={gm}"] + [f"{n}={ver(n)}" for n in ("torch", "transformers", "trl")])


@functools.lru_cache(maxsize=None)
def device_name(threads: int | None = None) -> str:
    """``"cpu (<model name>, <threads> threads)"`` from ``/proc/cpuinfo``."""
    name = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu ({name}, {threads} threads)" if threads else f"cpu ({name})"


def now_utc() -> str:
    """The time now in UTC, ISO 8601 to the second: the CSV's ``timestamp``."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _row_key(op: str, provider: str, mode: str, x_name: str, x_value: Any, device, version, timestamp) -> dict:
    """The columns every row of one (configuration, provider) shares; ``device`` a string or a function giving it,
    ``version``/``timestamp`` None for :func:`versions`/:func:`now_utc`. Raises ValueError for a ``mode`` outside
    :data:`MODES`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return dict(
        op=op,
        provider=provider,
        mode=mode,
        x_name=x_name,
        x_value=x_value,
        device=device() if callable(device) else device,
        timestamp=timestamp or now_utc(),
        version=version or versions(),
    )


def _row(key: dict, metric: str, unit: str, p50, p20, p80, config: dict) -> dict:
    """One CSV row (keyed by :data:`CSV_COLUMNS`): ``key``'s shared columns, the metric, its percentiles and
    ``config`` as sorted JSON."""
    return dict(key, metric=metric, unit=unit, p50=p50, p20=p20, p80=p80, config=json.dumps(config, sort_keys=True))


def measurement_rows(
    op: str,
    provider: str,
    mode: str,
    x_name: str,
    x_value: Any,
    measurement: Measurement | dict,
    config: dict,
    *,
    device: str | None = None,
    version: str | None = None,
    timestamp: str | None = None,
) -> list[dict]:
    """CSV rows (dicts keyed by :data:`CSV_COLUMNS`) for every metric in ``measurement``.

    ``config`` is stored as sorted JSON; the number of samples of each metric is added to it as ``"n"``.
    Raises ValueError for a ``mode`` outside :data:`MODES`.
    """
    if isinstance(measurement, dict):
        measurement = Measurement.from_dict(measurement)
    key = _row_key(
        op,
        provider,
        mode,
        x_name,
        x_value,
        device or (lambda: device_name(measurement.threads or None)),
        version,
        timestamp,
    )
    rows = []
    for metric, (unit, (p50, p20, p80), n) in measurement.metrics().items():
        cfg = dict(config, n=n)
        if metric == "peak_rss_above_base":
            cfg["rss_method"] = measurement.rss_method
            cfg["base_rss_mb"] = round(measurement.base_rss_bytes / MB, 1)
            cfg["mmap_threshold_fixed"] = measurement.mmap_threshold_fixed
        rows.append(_row(key, metric, unit, p50, p20, p80, cfg))
    return rows


def skipped_rows(
    op: str,
    provider: str,
    mode: str,
    x_name: str,
    x_value: Any,
    config: dict,
    reason: str,
    *,
    metrics: Iterable[tuple[str, str]] = (
        ("wall_time", "s"),
        ("cpu_time", "s"),
        ("peak_rss_above_base", "MB"),
        ("peak_tensor", "MB"),
    ),
    device: str | None = None,
    version: str | None = None,
    timestamp: str | None = None,
) -> list[dict]:
    """Rows recording that ``provider`` could not run this configuration: empty p-columns, ``"skipped": reason`` in
    ``config``. ``metrics`` are ``(metric, unit)`` pairs. Raises ValueError for a ``mode`` outside :data:`MODES`."""
    key = _row_key(op, provider, mode, x_name, x_value, device or device_name, version, timestamp)
    cfg = dict(config, skipped=reason)
    return [_row(key, metric, unit, "", "", "", cfg) for metric, unit in metrics]


def write_csv(rows: Iterable[dict], path: str, *, append: bool = False) -> None:
    """Write ``rows`` (dicts with exactly the keys of :data:`CSV_COLUMNS`) to ``path``, header first; NaN floats are
    written as empty cells.

    With ``append`` and an existing file, rows are added without a second header. Raises ValueError if a row's keys
    differ from :data:`CSV_COLUMNS`.
    """
    rows = list(rows)
    for r in rows:
        if set(r) != set(CSV_COLUMNS):
            raise ValueError(f"row keys must be exactly {CSV_COLUMNS}, got {sorted(r)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not (append and os.path.exists(path))
    with open(path, "w" if new else "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(
                {k: (("" if math.isnan(v) else repr(float(v))) if isinstance(v, float) else v) for k, v in r.items()}
            )


def read_csv(path: str) -> list[dict]:
    """Rows of a harness CSV as dicts; ``p50/p20/p80`` as floats (NaN when empty), ``config`` parsed from JSON."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("p50", "p20", "p80"):
            r[k] = float(r[k]) if r[k] not in ("", None) else math.nan
        r["config"] = json.loads(r["config"]) if r["config"] else {}
    return rows


# ------------------------------------------------------------------------------------------------- plot and tables
def plot_csv(
    csv_path: str,
    png_path: str,
    *,
    op: str | None = None,
    metrics: Sequence[str] = ("wall_time", "peak_rss_above_base"),
    panel_keys: Sequence[str] = (),
    log_x: bool = False,
    log_y: bool = False,
    title: str | None = None,
) -> None:
    """Plot a harness CSV to a PNG (matplotlib, Agg backend).

    One row of panels per metric; one column per distinct value of the ``config`` keys in ``panel_keys`` (e.g.
    ``("model", "G")``); in each panel one line per provider: p50 against ``x_value`` with a p20..p80 band. Skipped
    rows are left out; ``log_x`` (base 2) and ``log_y`` set log axes. Raises ValueError if no row matches ``op`` and
    ``metrics``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _plotted_rows(csv_path, op, metrics)
    panels = sorted(
        {_panel_of(r, panel_keys) for r in rows},
        key=lambda t: tuple((0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)) for x in t),
    )
    mets = [m for m in metrics if any(r["metric"] == m for r in rows)]
    fig, axes = plt.subplots(
        len(mets), len(panels), figsize=(3.6 * len(panels) + 1, 3.0 * len(mets)), squeeze=False, constrained_layout=True
    )
    for i, met in enumerate(mets):
        for j, pan in enumerate(panels):
            _plot_lines(axes[i][j], rows, met, panel_keys, pan)
            _format_axes(axes[i][j], rows, met, panel_keys, pan, log_x=log_x, log_y=log_y)
            if i == 0 and j == 0:
                axes[i][j].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def _plotted_rows(csv_path: str, op: str | None, metrics: Sequence[str]) -> list[dict]:
    """The measured rows of ``csv_path`` of ``op`` (None: any) and ``metrics``. Raises ValueError if there is none."""
    rows = [
        r
        for r in read_csv(csv_path)
        if (op is None or r["op"] == op)
        and r["metric"] in metrics
        and "skipped" not in r["config"]
        and not math.isnan(r["p50"])
    ]
    if not rows:
        raise ValueError(f"no measured rows for op={op!r}, metrics={list(metrics)} in {csv_path}")
    return rows


def _panel_of(row: dict, panel_keys: Sequence[str]) -> tuple:
    return tuple(row["config"].get(k) for k in panel_keys)


def _plot_lines(ax, rows: list[dict], met: str, panel_keys: Sequence[str], pan: tuple) -> None:
    """One line per provider in panel ``pan``: metric ``met``'s p50 against ``x_value``, a p20..p80 band."""
    for prov in sorted({r["provider"] for r in rows}):
        pts = [r for r in rows if r["metric"] == met and r["provider"] == prov and _panel_of(r, panel_keys) == pan]
        if not pts:
            continue
        pts.sort(key=lambda r: float(r["x_value"]))
        xs = [float(r["x_value"]) for r in pts]
        ax.plot(xs, [r["p50"] for r in pts], marker="o", label=prov)
        ax.fill_between(xs, [r["p20"] for r in pts], [r["p80"] for r in pts], alpha=0.2)


def _format_axes(ax, rows: list[dict], met: str, panel_keys: Sequence[str], pan: tuple, *, log_x: bool, log_y: bool):
    """Labels, scales, ticks (every ``x_value`` of ``rows``), the panel's title and a grid."""
    from matplotlib import ticker

    unit = next(r["unit"] for r in rows if r["metric"] == met)
    ax.set_xlabel(rows[0]["x_name"])
    ax.set_ylabel(f"{met} [{unit}]")
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
        # Plain numbers, minor ticks labelled when the panel spans few decades (matplotlib's thresholds)
        ax.yaxis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.6)))
    xs_all = sorted({float(r["x_value"]) for r in rows})
    ax.set_xticks(xs_all)
    ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    if panel_keys:
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(panel_keys, pan)), fontsize=9)
    ax.grid(alpha=0.3)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, floatfmt: str = ".3g") -> str:
    """A GitHub markdown table. Floats are formatted with ``floatfmt``, from 1000 up as integers (NaN and None print
    as ``-``); numeric
    columns (all cells numbers) are right-aligned. Raises ValueError if a row's length differs from ``headers``."""
    rows = [list(r) for r in rows]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row has {len(r)} cells, headers have {len(headers)}: {r}")

    def fmt(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 1000 else format(v, floatfmt)
        return str(v)

    numeric = [
        all(isinstance(r[j], (int, float)) or r[j] is None for r in rows) and bool(rows) for j in range(len(headers))
    ]
    cells = [[fmt(v) for v in r] for r in rows]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if numeric[j] else "---" for j in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)

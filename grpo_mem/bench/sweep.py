"""One sweep runner for every benchmark: ``grpo-mem bench``, ``benchmarks/bench_group.py``, ``bench_tree.py`` and
``bench_fsdp.py`` describe their (configuration, provider) cells; :class:`Sweep` runs them one after the other, each
through its launcher (a fresh process, :func:`grpo_mem.bench.isolate.run_isolated`, or a multi-process launch),
compares every provider with stock TRL's cell of the same configuration, prints one progress line per cell and turns
the results into the long-format CSV rows of :mod:`grpo_mem.bench.results`.

A worker's result is a :class:`grpo_mem.bench.measure.Measurement` dict, optionally with ``log_probs``,
``entropies`` (lists, masked entries 0), ``grad_norm``, ``grad_sketches`` (per-parameter gradient sketches, compared
per parameter), ``fallback_warnings`` and the figures in
:data:`RESULT_KEYS`; or ``{"ranks": [result, ...]}`` for a multi-process launch (one set of rows per rank); or
``{"skipped": reason}``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Sequence

from grpo_mem.bench import isolate, results
from grpo_mem.bench.measure import Measurement, percentiles

REFERENCE = "trl"
"""The provider every other one is compared with (``*_vs_trl`` keys of the config)."""

RESULT_KEYS = (
    "grad_norm",
    "n_params",
    "logp_max_abs_diff_vs_plain_forward",
    "trunk_tokens",
    "prompt_passes_per_call",
    "cuda_peak_allocated_mb",
    "vision_patch_rows",
)
"""Figures copied from a worker's result into the cell's CSV config when present and not None."""


@dataclass
class Cell:
    """One (configuration, provider) of a sweep.

    ``provider``: the CSV's provider column; ``x_value``: its x column; ``config``: what defines the configuration
    (the CSV's config column, before the result's figures are added); ``args``: what the launcher gets; ``key``:
    cells with equal keys are the same configuration, compared with its :data:`REFERENCE` cell; ``name``: a short
    description for the progress line; ``skip``: a reason not to run it (its rows are written as skipped)."""

    provider: str
    x_value: float
    config: dict[str, Any]
    args: dict[str, Any]
    key: Hashable = ()
    name: str = ""
    skip: str | None = None


@dataclass
class Outcome:
    """A cell once run: the launcher's ``result``, the CSV ``config`` (the cell's, plus :data:`RESULT_KEYS`,
    ``fallback`` and the comparison with the reference) and its CSV ``rows``."""

    cell: Cell
    result: dict[str, Any]
    config: dict[str, Any]
    rows: list[dict] = field(default_factory=list)

    @property
    def skipped(self) -> str | None:
        return self.result.get("skipped")


def max_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """Largest |a - b| over two equally shaped nested lists (0.0 when empty)."""
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


GRAD_FLOOR = 1e-3
"""A parameter's gradient difference is measured against the larger of its norm and this fraction of the global
norm (a parameter whose exact gradient is ~0, e.g. a key bias, is not measured against its rounding noise)."""


def grad_param_difference(sketches: dict[str, list], reference: dict[str, list]) -> tuple[float, str]:
    """(largest relative difference, the parameter it is at) between two results' per-parameter gradient sketches
    (``group_worker.grad_sketches``: name -> [norm, sketch...]): per parameter, the norm of the sketches' difference (which
    estimates the gradients' difference) over the larger of the reference gradient's norm and ``GRAD_FLOOR`` x the
    reference's global norm; a parameter with a gradient in one result only differs by its whole norm."""
    total = sum(v[0] ** 2 for v in reference.values()) ** 0.5
    worst, where = 0.0, ""
    for name in sorted(set(sketches) | set(reference)):
        ours, ref = sketches.get(name), reference.get(name)
        scale = max(ref[0] if ref else 0.0, GRAD_FLOOR * total, 1e-30)
        if ours is None or ref is None:
            diff = (ours or ref)[0]
        else:
            diff = sum((a - b) ** 2 for a, b in zip(ours[1:], ref[1:])) ** 0.5
        if diff / scale > worst:
            worst, where = diff / scale, name
    return worst, where


def compare_with_reference(result: dict, reference: dict) -> dict[str, float]:
    """``logp_max_abs_diff_vs_trl``, ``entropy_max_abs_diff_vs_trl``, ``grad_norm_rel_diff_vs_trl`` and, per
    parameter, ``grad_param_max_rel_diff_vs_trl`` (with ``grad_param_worst_vs_trl``, the parameter it is at;
    ``grad_param_difference``) of ``result`` against ``reference`` (a result of the reference provider, or a dict
    holding only its ``grad_norm``): each key only where both results hold what it needs."""
    out = {}
    if "log_probs" in result and "log_probs" in reference:
        out["logp_max_abs_diff_vs_trl"] = max_abs_diff(result["log_probs"], reference["log_probs"])
    if "entropies" in result and "entropies" in reference:
        out["entropy_max_abs_diff_vs_trl"] = max_abs_diff(result["entropies"], reference["entropies"])
    if result.get("grad_norm") is not None and reference.get("grad_norm"):
        out["grad_norm_rel_diff_vs_trl"] = abs(result["grad_norm"] - reference["grad_norm"]) / reference["grad_norm"]
    if result.get("grad_sketches") and reference.get("grad_sketches"):
        worst, where = grad_param_difference(result["grad_sketches"], reference["grad_sketches"])
        out["grad_param_max_rel_diff_vs_trl"], out["grad_param_worst_vs_trl"] = worst, where
    return out


def describe(outcome: Outcome, op: str) -> str:
    """The progress line of one cell: p50 wall and CPU time, peak RSS above base, tensor peak, the child's time, and
    the differences from a plain forward and from stock TRL (rank 0's figures for a multi-process launch)."""
    cell, res, c = outcome.cell, outcome.result, outcome.config
    head = f"[{op}] {cell.name or cell.config} {cell.provider}"
    if outcome.skipped:
        return f"{head}: SKIPPED ({outcome.skipped})\n{res.get('stderr_tail', '')}".rstrip()
    m = Measurement.from_dict(res["ranks"][0] if "ranks" in res else res)
    parts = [
        f"wall p50 {percentiles(m.times_s)[0]:.2f} s",
        f"cpu p50 {percentiles(m.cpu_times_s)[0]:.2f} s (n={len(m.times_s)})",
    ]
    if m.peak_rss_above_base_bytes:
        parts.append(f"rss+ {m.peak_rss_above_base_bytes[0] / 1e6:.0f} MB")
    if m.peak_tensor_bytes:
        parts.append(f"tensor peak {m.peak_tensor_bytes[0] / 1e6:.0f} MB")
    if "child_wall_s" in res:
        parts.append(f"child {res['child_wall_s']:.0f} s")
    for key, label, spec in (
        ("trunk_tokens", "trunk tokens", "d"),
        ("logp_max_abs_diff_vs_plain_forward", "|dlogp| vs plain forward", ".1e"),
        ("logp_max_abs_diff_vs_trl", "|dlogp| vs trl", ".1e"),
        ("grad_norm_rel_diff_vs_trl", "grad-norm rel diff vs trl", ".1e"),
        ("grad_param_max_rel_diff_vs_trl", "worst parameter's grad rel diff vs trl", ".1e"),
    ):
        if c.get(key) is not None:
            parts.append(f"{label} {format(c[key], spec)}")
    if c.get("fallback"):
        parts.append(f"FALLBACK {c['fallback']}")
    return f"{head}: " + ", ".join(parts)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Sweep:
    """Runs cells of one op and makes their CSV rows.

    ``launch(args) -> result``: runs one cell (never raises for a failed run: returns ``{"skipped": reason}``, as
    :func:`~grpo_mem.bench.isolate.run_isolated` does). ``x_name``/``mode``/``device``/``version``: the CSV
    columns (``version`` default: :func:`~grpo_mem.bench.results.versions`, unless the result carries its own).
    ``references``: reference results measured earlier, by cell key (a dict with at least ``grad_norm``), used when
    a key's :data:`REFERENCE` cell is not part of this sweep. ``report``: where progress lines go (stderr)."""

    op: str
    x_name: str
    launch: Callable[[dict], dict]
    mode: str = "full"
    device: str | None = None
    version: str | None = None
    references: dict[Hashable, dict] = field(default_factory=dict)
    report: Callable[[str], None] = _stderr

    def run(self, cells: Iterable[Cell], *, on_outcome: Callable[[Outcome], None] | None = None) -> list[Outcome]:
        """Run ``cells`` in order (a key's reference cell first, to compare the others with it); returns their
        outcomes. ``on_outcome`` runs after each cell (e.g. to write the CSV so far)."""
        version = self.version or results.versions()
        references = dict(self.references)
        outcomes = []
        for cell in cells:
            result = {"skipped": cell.skip} if cell.skip else self.launch(cell.args)
            outcome = Outcome(cell, result, dict(cell.config))
            if outcome.skipped:
                outcome.rows = results.skipped_rows(
                    self.op,
                    cell.provider,
                    self.mode,
                    self.x_name,
                    cell.x_value,
                    outcome.config,
                    outcome.skipped,
                    device=self.device,
                    version=version,
                )
            else:
                self._add_figures(outcome, references)
                outcome.rows = self._rows(outcome, version)
            self.report(describe(outcome, self.op))
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
        return outcomes

    def _add_figures(self, outcome: Outcome, references: dict) -> None:
        res, config, cell = outcome.result, outcome.config, outcome.cell
        config.update({k: res[k] for k in RESULT_KEYS if res.get(k) is not None})
        if res.get("fallback_warnings"):
            config["fallback"] = res["fallback_warnings"]
        if cell.provider == REFERENCE:
            references[cell.key] = res
        elif cell.key in references:
            config.update(compare_with_reference(res, references[cell.key]))

    def _rows(self, outcome: Outcome, version: str) -> list[dict]:
        res, cell = outcome.result, outcome.cell
        ranks = res["ranks"] if "ranks" in res else [res]
        rows = []
        for rank, measured in enumerate(ranks):
            config = dict(outcome.config, rank=rank, world=len(ranks)) if "ranks" in res else outcome.config
            rows += results.measurement_rows(
                self.op,
                cell.provider,
                self.mode,
                self.x_name,
                cell.x_value,
                measured,
                config,
                device=self.device,
                version=measured.get("version", version),
            )
        return rows


def isolated(target: str, **kwargs) -> Callable[[dict], dict]:
    """A :class:`Sweep` launcher running ``target`` (``"module:function"``) in a fresh process per cell:
    :func:`~grpo_mem.bench.isolate.run_isolated` with ``kwargs`` (threads, timeout_s, rss_budget_mb, env)."""
    return functools.partial(isolate.run_isolated, target, **kwargs)


def _as_read(row: dict) -> dict:
    """A row as :func:`~grpo_mem.bench.results.read_csv` gives it back: config a dict, x_value a float."""
    config = row["config"] if isinstance(row["config"], dict) else json.loads(row["config"])
    return dict(row, config=config, x_value=float(row["x_value"]))


def merge_csv(rows: list[dict], path: str, key: Callable[[dict], Hashable]) -> None:
    """Write ``rows`` to the CSV at ``path``, keeping the rows already there whose ``key(row)`` no new row has (so
    re-measuring one provider or one configuration keeps the others). ``key`` sees every row as read back from a
    CSV (config a dict, x_value a float)."""
    new = {key(_as_read(r)) for r in rows}
    keep = []
    if os.path.exists(path):
        for r in results.read_csv(path):
            if key(_as_read(r)) not in new:
                keep.append(dict(r, config=json.dumps(r["config"], sort_keys=True)))
    results.write_csv(keep + rows, path)

"""What ``grpo_mem.verify`` judges by: error statistics, the bounds grpo_mem must stay within, and the report.

The bounds depend on the precision (the constants below; :class:`Bounds` groups each precision's):

- fp32: against stock TRL run in fp64 (weights cast to fp64 in place and back, which is exact), grpo_mem's error must
  stay within stock's own fp32 error: max <= 2 x stock's + 1e-5 (k = 2, as flash-attention's tests), RMS and mean
  <= stock's + 1e-5 over the unmasked log-probs and entropies; a relative gradient error <= 2 x stock's + 1e-4 over
  all parameters and <= 2 x stock's + 1e-3 for each (a parameter whose gradient is small against its terms, such as
  a norm weight, carries relative fp32 errors of a few 1e-4: 2.2e-4 for grpo_mem and 2.0e-5 for stock on one of
  SmolLM2-135M's). On a real model stock's own fp32 error is a few 1e-5 (SmolLM2-135M: 3e-5 in max |log-prob|), so a
  fixed bound on |grpo_mem - stock| would fail where grpo_mem is as exact as stock. A direct difference within 1e-5
  (values) and 1e-4 (||Δg|| / ||g|| over all parameters and for the worst one) implies the criterion (triangle
  inequality), so the fp64 run is made only for what exceeds it: forward only when the gradients are within. A model
  with an op that refuses fp64 (the grouped matmul of MoE experts) is judged by the direct bounds.

  Stock's error alone is one sample of what fp32 does on this model: a correct implementation with another
  summation order (grpo_mem's prompt-once attention merges regions, its head sums vocabulary chunks) can be a few
  times off it, and on a deep model that exceeds the fixed 1e-5. So when stock's error does not cover grpo_mem's,
  a second yardstick is measured: the **fp32-storage floor**, the fp64 truth rerun with every module's outputs (and,
  in the backward, the gradients into them) rounded to fp32. That is the error an implementation would have if it
  stored every intermediate in fp32 and computed everything else exactly; it grows with the model's depth and width
  as rounding errors do, and every fp32 implementation has at least it. A real one rounds a few times more per
  module (inside each matmul's accumulation, softmax, norms), so the error scale becomes the larger of stock's and
  ``FP32_FLOOR_FACTOR`` = 8 x the floor's, each statistic separately. Measured on SmolLM2-135M (fp32, 8 rows of a
  230-token prompt with a 200-token system message, 12-token completions; ``benchmarks/results/verify_real.csv``):
  log-prob error rms/max floor 9.0e-7/2.9e-6, stock 3.8e-6/1.4e-5 (4.2x/5.0x the floor), grpo_mem 5.3e-6/1.8e-5
  (5.9x/6.1x). A bug is not of that size: one log-prob off by 1e-3, or gradients off by 1%, fails on every model
  measured (the tests and ``verify_real.py --perturb``); noise of 3e-5 on every log-prob of a 2-layer model whose
  floor is below 1e-7 fails too.
- bf16/fp16 (autocast, e.g. TRL's ``bf16=True``, or low-precision weights): both paths carry rounding errors of a few
  1e-2 that are rounded independently, so they are compared against a third run, stock TRL on the same model in fp32
  (weights cast to fp32 in place and back, which is exact), in Cut Cross-Entropy's style: grpo_mem's error against
  fp32 must stay within stock's own (``within_stock_error``, ``grad_within_stock_error``; RMS and mean <= stock's +
  1e-3, max <= 2 x stock's + 1e-3, per parameter a relative gradient error <= stock's + 1e-2), the criterion
  ``tests/model/test_precision.py`` applies on a SmolLM2-shaped model.

:func:`truth_failures` applies them to the runs :mod:`grpo_mem.patches.verify` makes; :class:`VerifyReport` is what
``verify`` returns and prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# fp32, against an fp64 run: |ours - truth| <= k |stock - truth| + tol; a direct |ours - stock| <= tol implies it
FP32_VALUE_TOL = 1e-5  # max |Δ log-prob|, max |Δ entropy|; RMS and mean error: ours <= stock's + this
FP32_GRAD_TOL = 1e-4  # ||Δg|| / ||g||; relative gradient error over all parameters: ours <= k x stock's + this
FP32_PARAM_GRAD_TOL = 1e-3  # relative gradient error of each parameter: ours <= k x stock's + this
FP32_MAX_FACTOR = 2.0  # k for the max value error and the gradient errors (flash-attention's tests)
# bf16/fp16, against an fp32 run (Cut Cross-Entropy's tests: |ours - truth| <= k |stock - truth| + tol)
BF16_GRAD_TOL = 1e-2  # relative gradient error: ours <= stock's + this
BF16_STAT_TOL = 1e-3  # RMS and mean error: ours <= stock's + this
BF16_MAX_FACTOR = 2.0  # max error: ours <= 2 x stock's + BF16_STAT_TOL (k = 2, as flash-attention's tests)
FP32_FLOOR_FACTOR = 8.0  # fp32: the error scale is the larger of stock's and this x the fp32-storage floor's


@dataclass(frozen=True)
class Bounds:
    """One precision's bounds against a stock run of higher precision: values' RMS and mean error <= stock's +
    ``stat_tol``, max <= ``max_factor`` x stock's + ``stat_tol``; relative gradient errors <= ``grad_factor`` x
    stock's + ``grad_tol`` over all parameters and + ``param_grad_tol`` for each."""

    stat_tol: float
    max_factor: float
    grad_tol: float
    param_grad_tol: float
    grad_factor: float


FP32_BOUNDS = Bounds(FP32_VALUE_TOL, FP32_MAX_FACTOR, FP32_GRAD_TOL, FP32_PARAM_GRAD_TOL, FP32_MAX_FACTOR)
"""fp32 against an fp64 run."""
BF16_BOUNDS = Bounds(BF16_STAT_TOL, BF16_MAX_FACTOR, BF16_GRAD_TOL, BF16_GRAD_TOL, 1.0)
"""bf16/fp16 against an fp32 run."""


class VerificationError(AssertionError):
    """``verify(..., raise_on_mismatch=True)`` found grpo_mem outside its bounds; the message is the report."""

    def __init__(self, report: VerifyReport):
        super().__init__(str(report))
        self.report = report


def error_stats(err: torch.Tensor) -> dict[str, float]:
    """max, RMS and mean of absolute errors ``err`` (any shape; empty -> zeros), as floats."""
    err = err.double().abs().flatten()
    if err.numel() == 0:
        return {"max": 0.0, "rms": 0.0, "mean": 0.0}
    return {"max": float(err.max()), "rms": float(err.pow(2).mean().sqrt()), "mean": float(err.mean())}


def within_stock_error(
    err_ours: torch.Tensor,
    err_stock: torch.Tensor,
    *,
    tol: float = BF16_STAT_TOL,
    max_factor: float = BF16_MAX_FACTOR,
    err_floor: torch.Tensor | None = None,
    floor_factor: float = 1.0,
) -> tuple[bool, str]:
    """Criterion on one tensor: with errors ``err_ours``, ``err_stock`` (the same shape, any dtype) against a truth
    of higher precision (fp32 for bf16/fp16 runs, fp64 for fp32 runs), grpo_mem's RMS and mean error within stock's
    + ``tol`` and its max within ``max_factor`` x stock's + ``tol`` (defaults: the bf16 bounds).

    Whole-tensor statistics rather than elementwise: at trained-like peaked logits both computations carry bf16
    errors of a few 1e-2 rounded independently, so one element can be worse for either (tests/model/test_precision.py).
    ``err_floor`` (the same shape): the errors of the fp32-storage floor run; each statistic of stock's is then
    replaced by the larger of it and ``floor_factor`` x the floor's (:data:`FP32_FLOOR_FACTOR`).
    Returns (ok, the first violated statistic or "").
    """
    ours, stock = error_stats(err_ours), error_stats(err_stock)
    floor = error_stats(err_floor) if err_floor is not None else None
    for stat, k in (("rms", 1.0), ("mean", 1.0), ("max", max_factor)):
        ref, what = stock[stat], "stock's"
        if floor is not None and floor_factor * floor[stat] > ref:
            ref, what = floor_factor * floor[stat], f"{floor_factor:g} x the fp32 floor's"
        if not ours[stat] <= k * ref + tol:
            return False, f"{stat} error {ours[stat]:.3g} > {k:g} x {what} {ref:.3g} + {tol:g}"
    return True, ""


def grad_errors(grads: dict, ref: dict) -> tuple[float, str, float, dict[str, float]]:
    """Relative gradient differences of ``grads`` against ``ref`` (both {name: tensor}, the same names).

    Returns (||Δg|| / ||g|| over all parameters, the worst parameter's name, its ||Δg_p|| / ||g_p||, and every
    parameter's relative difference). Differences in fp32 (fp64 if either is fp64: sketches), norms accumulated in
    fp64; a parameter whose reference
    gradient is 0 is measured against 1e-30 (so any difference there is reported as large).
    """
    total_diff = total_ref = 0.0
    per = {}
    for name, r in ref.items():
        a = grads[name]
        dtype = torch.promote_types(torch.promote_types(a.dtype, r.dtype), torch.float32)
        r = r.to(dtype)
        d = float(torch.linalg.vector_norm(a.to(dtype) - r, dtype=torch.float64))
        n = float(torch.linalg.vector_norm(r, dtype=torch.float64))
        total_diff += d * d
        total_ref += n * n
        per[name] = d / max(n, 1e-30)
    worst = max(per, key=per.get) if per else ""
    return (total_diff**0.5) / max(total_ref**0.5, 1e-30), worst, per.get(worst, 0.0), per


def grad_within_stock_error(
    ours: dict[str, float],
    stock: dict[str, float],
    *,
    tol: float = BF16_GRAD_TOL,
    factor: float = 1.0,
    floor: dict[str, float] | None = None,
    floor_factor: float = 1.0,
) -> tuple[bool, str, float]:
    """Gradient criterion: per parameter, grpo_mem's relative error against the truth within ``factor`` x stock's +
    ``tol`` (defaults: the bf16 bound, stock's + ``BF16_GRAD_TOL``). ``ours``/``stock``: {name: relative error}
    (``grad_errors``' last return). Returns (ok, the parameter with the largest excess over ``factor`` x stock's,
    that excess). ``floor``: the fp32-storage floor run's relative errors; stock's are then replaced by the larger of
    them and ``floor_factor`` x the floor's."""
    ref = {n: max(stock[n], floor_factor * floor[n]) if floor is not None else stock[n] for n in stock}
    excess = {n: ours[n] - factor * ref[n] for n in stock}
    worst = max(excess, key=excess.get) if excess else ""
    return excess.get(worst, 0.0) <= tol, worst, excess.get(worst, 0.0)


@dataclass
class MicroBatchPath:
    """Which path grpo_mem took for one micro-batch: ``"prompt-once"`` or ``"stock fallback"``, and why."""

    index: int
    rows: int
    unique_prompts: int
    path: str
    why: str


@dataclass
class VerifyReport:
    """What ``verify`` measured. Differences are grpo_mem minus stock TRL, at unmasked completion positions.

    ``precision``: "fp32", "bf16 autocast", "bf16 weights", ... ``truth``: the reference run both paths were judged
    against, "fp32" (stock TRL in fp32, for low precision), "fp64" (stock TRL in fp64, for fp32 when a direct
    difference exceeded its bound; ``exceeded`` names those) or "" (none needed). ``*_vs_truth`` hold each path's
    errors against it ({"grpo_mem": stats, "stock": stats} with stats {"max", "rms", "mean"} for values; relative
    norms for gradients, None when the truth ran without gradients), and ``passed`` follows them; without a truth it
    follows the direct differences. ``failures`` says which bound failed. ``seconds``: wall time of the whole call;
    ``timings``: wall seconds of each run ("grpo_mem", "stock", "truth"), the device synchronised before each clock
    read. ``peak_memory_mb``: verify's peak above its start, ``memory_kind`` "CUDA allocated" or "RSS".
    """

    passed: bool
    precision: str
    rows: int
    prompt_len: int
    completion_len: int
    max_logp_diff: float
    max_entropy_diff: float
    grad_rel_diff: float
    worst_param: str
    worst_param_rel_diff: float
    bounds: dict[str, str]
    micro_batches: list[MicroBatchPath]
    failures: list[str] = field(default_factory=list)
    truth: str = ""
    floor: bool = False  # fp32: the fp32-storage floor was run (stock's error alone did not cover grpo_mem's)
    exceeded: list[str] = field(default_factory=list)  # fp32: direct bounds exceeded, judged against the truth
    logp_vs_truth: dict[str, dict[str, float]] | None = None  # {"grpo_mem": stats, "stock": stats}
    entropy_vs_truth: dict[str, dict[str, float]] | None = None
    grad_vs_truth: dict[str, float] | None = None  # grpo_mem / stock overall relative error, worst excess
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0  # verify's own peak above its start (memory_kind: "RSS" or "CUDA allocated")
    memory_kind: str = ""
    row_chunks: dict[str, int] = field(default_factory=dict)  # rows per call of the stock-path runs
    truth_mode: str = ""  # how the truth widened the model: "per module" or "whole model"
    backend: str = ""  # the kernel backend in use (a line of the report when set)

    def __str__(self) -> str:
        lines = [self._headline(), self._cost()]
        if self.backend:
            lines.append(f"kernel backend: {self.backend}")
        lines += _table([("quantity", "grpo_mem vs stock", "bound", "ok")] + self._direct_rows() + self._truth_rows())
        lines.append("")
        lines += _table(
            [("micro-batch", "rows", "unique prompts", "path", "why")]
            + [(str(m.index), str(m.rows), str(m.unique_prompts), m.path, m.why) for m in self.micro_batches]
        )
        if self.failures:
            lines.append("")
            lines += [f"FAILED: {f}" for f in self.failures]
        return "\n".join(lines)

    def _headline(self) -> str:
        """The first line: the verdict, the precision, the batch's layout and the time taken."""
        verdict = "PASSED" if self.passed else "FAILED"
        n_mb = len(self.micro_batches)
        return (
            f"grpo_mem.verify: {verdict} ({self.precision}; {self.rows} rows in {n_mb} micro-batch"
            f"{'es' if n_mb != 1 else ''}, prompt width {self.prompt_len}, completion width {self.completion_len})"
        )

    def _cost(self) -> str:
        """verify's own cost: wall seconds of each run, peak memory, how the stock-path runs were split."""
        runs = ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
        chunks = ", ".join(f"{v} row{'s' if v != 1 else ''} ({k})" for k, v in self.row_chunks.items())
        return (
            f"verify's cost: {self.seconds:.1f} s ({runs}); peak memory {self.peak_memory_mb:.0f} MB above its start "
            f"({self.memory_kind or '-'}); calls of at most {chunks or '-'}"
            + (f"; truth widened {self.truth_mode}" if self.truth_mode else "")
        )

    def _ok(self, name: str) -> str:
        """The "ok" cell of bound ``name``: "-" (not applied), "no", "exceeded: see vs <truth>" or "yes"."""
        if self.bounds.get(name) == "-":
            return "-"
        if any(f.startswith(name + ":") for f in self.failures):
            return "no"
        return f"exceeded: see vs {self.truth}" if name in self.exceeded else "yes"

    def _direct_rows(self) -> list[tuple[str, str, str, str]]:
        """The table's rows of grpo_mem against stock TRL directly."""
        grad, ok = self.bounds["gradient"], self._ok("gradient")
        return [
            ("max |Δ log-prob|", f"{self.max_logp_diff:.3e}", self.bounds["log-prob"], self._ok("log-prob")),
            ("max |Δ entropy|", f"{self.max_entropy_diff:.3e}", self.bounds["entropy"], self._ok("entropy")),
            ("‖Δg‖/‖g‖ all params", f"{self.grad_rel_diff:.3e}", grad, ok),
            ("‖Δg‖/‖g‖ worst param", f"{self.worst_param_rel_diff:.3e} ({self.worst_param})", grad, ok),
        ]

    def _truth_rows(self) -> list[tuple[str, str, str, str]]:
        """The table's rows of both paths against the truth run, if one was made."""
        if not self.truth:
            return []
        rows = []
        for name, stats in (("log-prob", self.logp_vs_truth), ("entropy", self.entropy_vs_truth)):
            o, s = stats["grpo_mem"], stats["stock"]
            key = f"{name} vs {self.truth}"
            both = f"ours {o['max']:.3e}/{o['rms']:.3e}, stock {s['max']:.3e}/{s['rms']:.3e}"
            if "fp32 floor" in stats:
                f = stats["fp32 floor"]
                both += f", fp32 floor {f['max']:.3e}/{f['rms']:.3e}"
            rows.append((f"{key} (max/rms)", both, self.bounds[key], self._ok(key)))
        g = self.grad_vs_truth
        if g is not None:
            key = f"gradient vs {self.truth}"
            floor = f", fp32 floor {g['fp32 floor']:.3e}" if "fp32 floor" in g else ""
            both = (
                f"ours {g['grpo_mem']:.3e}, stock {g['stock']:.3e}{floor}; worst excess {g['worst_excess']:.2e} "
                f"({g['worst_param']})"
            )
            rows.append((key, both, self.bounds[key], self._ok(key)))
        return rows


def _table(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return out


def truth_failures(
    report: VerifyReport, ours, stock, truth, sel, common, truth_name: str, bounds: Bounds, floor=None
) -> list[str]:
    """Judge grpo_mem's run ``ours`` against a stock run ``truth`` of higher precision (``truth_name``: "fp32" for
    bf16/fp16, "fp64" for fp32): its error within stock's own (:func:`within_stock_error`,
    :func:`grad_within_stock_error` with ``bounds``). Runs (``ours``, ``stock``, ``truth``) carry ``logps``,
    ``entropies`` (rows, C) compared where ``sel`` (rows, C) bool holds, and ``grads`` ({name: tensor}) compared over
    the names of ``common`` (None: values only). ``floor``: a run of the fp32-storage floor (fp32 runs: the truth with
    every module's output rounded to fp32), whose error against ``truth`` then counts as an error fp32 itself causes
    (:data:`FP32_FLOOR_FACTOR`). Records the bounds and errors in ``report``; returns the failures."""
    report.truth = truth_name
    report.bounds.update(_truth_bounds(truth_name, bounds, floor is not None))
    report.logp_vs_truth, report.entropy_vs_truth = {}, {}
    failures = []
    for name, attr, out in (
        ("log-prob", "logps", report.logp_vs_truth),
        ("entropy", "entropies", report.entropy_vs_truth),
    ):
        err_ours = (getattr(ours, attr) - getattr(truth, attr))[sel]
        err_stock = (getattr(stock, attr) - getattr(truth, attr))[sel]
        err_floor = (getattr(floor, attr) - getattr(truth, attr))[sel] if floor is not None else None
        out["grpo_mem"], out["stock"] = error_stats(err_ours), error_stats(err_stock)
        if floor is not None:
            out["fp32 floor"] = error_stats(err_floor)
        ok, why = within_stock_error(
            err_ours,
            err_stock,
            tol=bounds.stat_tol,
            max_factor=bounds.max_factor,
            err_floor=err_floor,
            floor_factor=FP32_FLOOR_FACTOR,
        )
        if not ok:
            failures.append(f"{name} vs {truth_name}: {why}")
    if common is not None:
        failures += _grad_failures(report, ours, stock, truth, common, truth_name, bounds, floor)
    report.floor = floor is not None
    return failures


def _truth_bounds(truth_name: str, b: Bounds, floor: bool = False) -> dict[str, str]:
    """The report's bound texts of the comparisons against the truth (``floor``: with the fp32-storage floor)."""
    ref = f"max(stock's, {FP32_FLOOR_FACTOR:g} x floor's)" if floor else "stock's"
    stat = f"ours rms, mean <= {ref} + {b.stat_tol:g}; max <= {b.max_factor:g} x {ref} + {b.stat_tol:g}"
    k = f"{b.grad_factor:g} x " if b.grad_factor != 1 else ""
    grad = (
        f"per param: ours <= {k}{ref} + {b.param_grad_tol:g}"
        if b.grad_tol == b.param_grad_tol
        else f"ours <= {k}{ref} + {b.grad_tol:g}, per param + {b.param_grad_tol:g}"
    )
    return {f"log-prob vs {truth_name}": stat, f"entropy vs {truth_name}": stat, f"gradient vs {truth_name}": grad}


def _grad_failures(
    report: VerifyReport, ours, stock, truth, common, truth_name: str, b: Bounds, floor=None
) -> list[str]:
    """:func:`truth_failures`' gradient part: relative errors against the truth over the names of ``common``."""
    truth_grads = {n: truth.grads[n] for n in common if n in truth.grads}
    rel_ours, _, _, per_ours = grad_errors(ours.grads, truth_grads)
    rel_stock, _, _, per_stock = grad_errors(stock.grads, truth_grads)
    per_floor, rel_ref = None, rel_stock
    if floor is not None:
        rel_floor, _, _, per_floor = grad_errors(floor.grads, truth_grads)
        rel_ref = max(rel_stock, FP32_FLOOR_FACTOR * rel_floor)
    ok, worst_p, excess = grad_within_stock_error(
        per_ours, per_stock, tol=b.param_grad_tol, factor=b.grad_factor, floor=per_floor, floor_factor=FP32_FLOOR_FACTOR
    )
    report.grad_vs_truth = {"grpo_mem": rel_ours, "stock": rel_stock, "worst_param": worst_p, "worst_excess": excess}
    if floor is not None:
        report.grad_vs_truth["fp32 floor"] = rel_floor
    if ok and rel_ours <= b.grad_factor * rel_ref + b.grad_tol:
        return []
    k = f"{b.grad_factor:g} x " if b.grad_factor != 1 else ""
    return [
        f"gradient vs {truth_name}: {worst_p}: relative error {per_ours.get(worst_p, 0):.3e} vs stock's "
        f"{per_stock.get(worst_p, 0):.3e} ({k}stock's + {b.param_grad_tol:g} allowed); all params {rel_ours:.3e} "
        f"vs {rel_stock:.3e} ({k}stock's + {b.grad_tol:g} allowed)"
    ]

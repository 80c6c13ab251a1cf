"""``grpo_mem.verify``: check on one batch, on the user's own model, that grpo_mem computes what stock TRL computes.

The same batch is scored twice with gradients, in the trainer's own precision: by TRL's own
``_get_per_token_logps_and_entropies`` (the unpatched method, with the fused head TRL gave the model), and by the
patched method ``patch_trl`` installs (``shared_prompt_logprobs`` per micro-batch, through a ``SharingSession`` when
the batch spans several micro-batches of one gradient-accumulation window, exactly as in training). Each micro-batch
is followed by the backward of a fixed scalar loss, TRL-like:

    loss = -sum_rt A_r m_rt logp_rt / sum_rt m_rt  -  0.1 * sum_rt m_rt H_rt / sum_rt m_rt

(TRL's default ``dapo`` token-level masked mean with importance ratio 1, plus an entropy bonus where the stock
method's entropies carry gradient), where A_r ~ N(0, 1) are fixed random advantages (a seeded generator, one per row)
rather than the batch's own, which are often all zero on a short run, and m is the completion mask. Log-probs and
entropies are compared where m = 1 only (TRL releases differ in what they return at masked positions; the loss never
reads them).

grpo_mem's log-probs, entropies and gradients must stay within stock TRL's own error against a run of higher
precision (fp64 for fp32, fp32 for bf16/fp16); the bounds and the report: :mod:`grpo_mem.patches.verify_criteria`.
This module runs the steps; what is scored: ``verify_inputs``; the runs: ``verify_runs``; the truth: ``verify_truth``;
the gradient sketches: ``verify_sketch``; what is put back afterwards: ``verify_state``.

Memory: verify is for the user whose training runs out of memory, so no run holds much more than the patched
training step it checks (measured: ``benchmarks/results/verify_memory.csv``; one row of stock's or the truth's run can
top a step whose last layer runs its prompts only as far as their K/V: 1.01x on the bench shape, 1.054x on a tiny one):

- grpo_mem's path runs first, exactly as in training, with nothing else held.
- Stock TRL's method runs in row chunks: as many whole rows (P + C tokens each) as fit in the most backbone tokens
  grpo_mem ran in one micro-batch (usually 1 row with a long shared prompt), its decoder layers checkpointed
  (non-reentrant ``torch.utils.checkpoint``: the same values, one layer's activations at a time in the backward).
  The loss is a sum over rows, so the chunks' gradients add up to the micro-batch's. TRL's own fused head runs
  with a narrower vocabulary tile (``verify_runs.trl_head_tile``: TRL's tile-width constant, as many columns as the hidden
  size; the same code, sums over the vocabulary in another order: 1-2 fp32 ulps). With TRL's 32768 columns, one
  call on CPU (where TRL scores every position of a row) took a (P + C - 1) x 32768 tile and several fp32 copies
  of it, more than the patched step's whole peak.
- The truth (fp32 for a bf16/fp16 run, fp64 for fp32) is stock TRL's method on the model widened one module at a
  time (``verify_truth.upcast_per_module``: no whole copy in the wider dtype; a copy a backward formula saves is re-widened when
  read; of an embedding table only the rows the batch uses), in row chunks sized for the wider activations,
  checkpointed, its gradients in the wider dtype streamed into sketches as its backward produces them (no ``.grad``
  buffer).
- Gradients are compared through linear count sketches (``verify_sketch.Sketcher``: small parameters exactly, large ones as
  8192 fp64 bucket sums, norms of differences to about 1%), so no run's gradients are held while another runs.

The model's gradients (every ``.grad``, the same tensor objects), the train/eval mode of every module, the RNG states
(Python, NumPy, torch CPU and CUDA), the trainer's logged metrics, and every method and forward are as they were
afterwards; nothing is patched that was not before. If ``patch_trl`` was already applied, the stock side still runs
TRL's original method (``__wrapped_original__`` of the patched one).
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from tqdm.auto import tqdm

from ..model.distributed import unwrap_causal_lm
from ..model.plan import PromptGrouping
from ..ops._backends import RESOLVED, preferred
from .trl import patched_method
from .verify_criteria import (
    BF16_BOUNDS,
    FP32_BOUNDS,
    FP32_GRAD_TOL,
    FP32_VALUE_TOL,
    MicroBatchPath,
    VerificationError,
    VerifyReport,
    error_stats,
    grad_errors,
    truth_failures,
)
from .verify_inputs import Setup, autocast_dtype, check_batch, is_trainer, lay_out, low_precision
from .verify_runs import checkpointed_layers, chunk_ranges, row_chunk, score, stock_entropy_coef, trl_head_tile
from .verify_state import PeakMemory, preserved, sync
from .verify_truth import widened_truth

__all__ = ["verify"]

ALWAYS_FLOOR = False
"""fp32: run the fp32-storage floor whenever the fp64 truth runs, not only when stock's own error does not cover
grpo_mem's (``benchmarks/verify_real.py --floor`` sets it, to record the floor's numbers)."""


def verify(
    trainer_or_model,
    batch=None,
    *,
    raise_on_mismatch: bool = False,
    micro_batch_size: int | None = None,
    temperature: float | None = None,
    seed: int = 0,
    print_report: bool = True,
    progress: bool = True,
) -> VerifyReport:
    """Compare grpo_mem with stock TRL on one batch of the user's own model: log-probs, entropies, gradients.

    Args:
        trainer_or_model: a ``GRPOTrainer``/``RLOOTrainer`` (patched or not), or a transformers causal LM (possibly
            PEFT-wrapped), which then needs ``batch``. Run it before training starts (the model unwrapped, one
            process); a trainer's ``per_device_train_batch_size``, ``gradient_accumulation_steps``, temperature,
            ``cast_lm_head_to_fp32`` and mixed precision apply, and, when it asks for the MoE router loss, that loss
            joins the compared gradients with the trainer's ``router_aux_loss_coef``.
        batch: None (trainer only: the first generation batch of its training dataloader, generated and scored by
            the trainer's ``_generate_and_score_completions``), or a dict as TRL lays it out: ``prompt_ids``,
            ``prompt_mask`` (rows, P) left-padded, ``completion_ids``, ``completion_mask`` (rows, C) right-padded,
            int64 ids and 0/1 masks; optional ``tool_mask`` (rows, C) and TRL's multimodal keys.
        raise_on_mismatch: raise ``VerificationError`` (an ``AssertionError``) with the report if a bound fails.
        micro_batch_size: rows per micro-batch; default the trainer's ``per_device_train_batch_size``, or the whole
            batch for a model. Micro-batches of one gradient-accumulation window share prompt passes as in training.
        temperature: for a model given directly (default 1.0); a trainer's own is used otherwise.
        seed: seed of the fixed random advantages.
        print_report: print the report.
        progress: show a progress bar on stderr (tqdm) over the scored calls of every run: grpo_mem's micro-batches,
            stock TRL's row chunks, the truth's (verify runs several times the step it checks, minutes on CPU).

    Returns:
        A ``VerifyReport`` (``passed``, the differences, the bounds, per micro-batch the path taken and why).

    Raises:
        ValueError/TypeError: a missing or malformed batch (naming the keys or shapes), or no batch for a model.
        VerificationError: with ``raise_on_mismatch`` and a failed bound.
    """
    model = _checked_model(trainer_or_model, batch, micro_batch_size)
    trainer = trainer_or_model if is_trainer(trainer_or_model) else None
    device = next(model.parameters()).device
    sync(device)
    start, timings = time.perf_counter(), {}
    bar = tqdm(
        total=0, unit="call", file=sys.stderr, dynamic_ncols=True, disable=not progress, leave=False, mininterval=0
    )
    with preserved(model), PeakMemory(device) as peak, bar:
        setup = lay_out(trainer_or_model, batch, micro_batch_size, temperature, seed)
        setup.bar = bar
        low = low_precision(model, trainer)
        setup.low_dtype = autocast_dtype(model, trainer)
        stock, ours, truth, decisions = _score_both(setup, low, seed, timings)
        report = _compare(setup, stock, ours, truth, low, seed, timings)
        del stock, ours, truth
    _complete(report, setup, decisions, peak)
    sync(device)
    report.seconds = time.perf_counter() - start
    if print_report:
        print(report)
    if raise_on_mismatch and not report.passed:
        raise VerificationError(report)
    return report


def _checked_model(trainer_or_model, batch, micro_batch_size) -> torch.nn.Module:
    """The model ``verify`` scores; raises TypeError/ValueError naming what is wrong with the arguments."""
    model = trainer_or_model.model if is_trainer(trainer_or_model) else trainer_or_model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"verify takes a TRL trainer or a torch model, got {type(trainer_or_model).__name__}")
    if batch is None and not is_trainer(trainer_or_model):
        raise ValueError("verify needs a batch when given a model (a dict with prompt_ids, prompt_mask, ...)")
    if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if batch is not None:
        check_batch(batch)
    return model


def _complete(report: VerifyReport, setup: Setup, decisions, peak: PeakMemory) -> None:
    """The report's verdict, per micro-batch paths, how the stock-path runs were split, memory and backends."""
    report.micro_batches = _micro_batch_paths(setup, decisions)
    report.passed = not report.failures
    report.truth_mode = setup.truth_mode
    report.row_chunks = {"stock": row_chunk(setup, 1.0), **setup.truth_rows}
    report.peak_memory_mb, report.memory_kind = peak.peak_mb, peak.kind
    report.backend = _backend_line(setup.backends)


def _score_both(setup: Setup, low: str | None, seed: int, timings: dict):
    """Score the batch with grpo_mem (micro-batch decisions recorded), with stock TRL (in row chunks no larger than
    grpo_mem's micro-batches in backbone tokens, its decoder layers checkpointed: the same values) and, in low precision, with stock TRL in fp32. Returns (stock, ours,
    truth or None, decisions); ``timings`` gets each run's wall seconds."""
    device = setup.ids.device

    def score_with(fn, before_call=None, entropy_coef=None, after_call=None, chunks=None, label=""):
        torch.manual_seed(seed)  # the same dropout draws, if any
        return score(fn, setup, entropy_coef, before_call, after_call, chunks=chunks, label=label)

    # grpo_mem first, as training runs it (nothing else held): the patched method, on a private handle (nothing
    # installed on a class or the trainer)
    ours_fn, handle = patched_method(setup.stock_fn)
    session = handle.session(setup.self_obj)
    prompt_ids, prompt_mask = setup.ids[:, : setup.P], setup.mask[:, : setup.P]
    decisions = []

    def before_call(i):
        if i % setup.window == 0:
            window = setup.slices[i : i + setup.window]
            session.begin_window([prompt_ids[lo:hi] for lo, hi in window], [prompt_mask[lo:hi] for lo, hi in window])

    with checkpointed_layers(unwrap_causal_lm(setup.model)), trl_head_tile(setup):  # as stock's run, below
        entropy_coef = stock_entropy_coef(setup)  # the loss stock's entropies can carry (one row's forward)
    sync(device)
    t = time.perf_counter()
    RESOLVED.clear()
    try:
        with session.recording() as decided:  # each call's last decision: its micro-batch's
            ours = score_with(
                ours_fn, before_call, entropy_coef, lambda: decisions.append(decided[-1]), label="grpo_mem"
            )
    finally:
        with contextlib.suppress(RuntimeError):
            session.close_window()
    sync(device)
    timings["grpo_mem"] = time.perf_counter() - t
    setup.backends = dict(RESOLVED)  # what grpo_mem's kernels ran on (empty: every micro-batch took stock's path)
    setup.budget_tokens = max(d.stock_tokens if d.path == "stock" else d.backbone_tokens for d in decisions)
    t = time.perf_counter()
    with checkpointed_layers(unwrap_causal_lm(setup.model)), trl_head_tile(setup):
        stock = score_with(
            setup.stock_fn,
            entropy_coef=ours.entropy_coef,
            chunks=chunk_ranges(setup, row_chunk(setup, 1.0)),
            label="stock TRL",
        )
    sync(device)
    timings["stock"] = time.perf_counter() - t
    truth = widened_truth(setup, torch.float32, stock.entropy_coef, seed, True, timings) if low else None
    return stock, ours, truth, decisions


def _compare(setup: Setup, stock, ours, truth, low, seed: int, timings: dict) -> VerifyReport:
    """The report's differences and failures (paths are added by ``_micro_batch_paths``); in fp32, runs the fp64
    truth when a direct bound is exceeded (call inside ``preserved``)."""
    sel = setup.sel.to(stock.logps.device)
    d_logp = (ours.logps - stock.logps)[sel]
    d_ent = (ours.entropies - stock.entropies)[sel]
    failures = []
    only = sorted(set(ours.grads) ^ set(stock.grads))
    if only:
        failures.append(f"gradient: parameters with a gradient on one path only: {only[:5]}")
    common = {n: stock.grads[n] for n in stock.grads if n in ours.grads}
    rel, worst, worst_rel, _ = grad_errors(ours.grads, common)
    report = VerifyReport(
        passed=False,
        precision=low or "fp32",
        rows=setup.ids.shape[0],
        prompt_len=setup.P,
        completion_len=setup.loss_mask.shape[1],
        max_logp_diff=error_stats(d_logp)["max"],
        max_entropy_diff=error_stats(d_ent)["max"],
        grad_rel_diff=rel,
        worst_param=worst,
        worst_param_rel_diff=worst_rel,
        bounds={},
        micro_batches=[],
        failures=failures,
        timings=timings,
    )
    if low:
        report.bounds = {"log-prob": "-", "entropy": "-", "gradient": "-"}
        failures += truth_failures(report, ours, stock, truth, sel, common, "fp32", BF16_BOUNDS)
    else:
        failures += _fp32_failures(report, setup, ours, stock, sel, common, seed)
    return report


def _fp32_failures(report, setup, ours, stock, sel, common, seed) -> list[str]:
    """fp32: grpo_mem against stock directly; what exceeds its bound there is judged against stock TRL in fp64
    (forwards only when the gradients are within theirs)."""
    report.bounds = {
        k: f"<= {v:g}"
        for k, v in (("log-prob", FP32_VALUE_TOL), ("entropy", FP32_VALUE_TOL), ("gradient", FP32_GRAD_TOL))
    }
    direct = (
        ("log-prob", report.max_logp_diff, FP32_VALUE_TOL),
        ("entropy", report.max_entropy_diff, FP32_VALUE_TOL),
        ("gradient", max(report.grad_rel_diff, report.worst_param_rel_diff), FP32_GRAD_TOL),
    )
    for name, value, tol in direct:
        if not value <= tol:
            report.exceeded.append(name)
    if not report.exceeded:
        return []
    with_grads = "gradient" in report.exceeded
    try:
        truth = widened_truth(setup, torch.float64, stock.entropy_coef, seed, with_grads, report.timings)
    except (RuntimeError, TypeError, NotImplementedError) as exc:  # an op without fp64 (grouped_mm of MoE experts)
        why = " ".join(str(exc).split())[:200]
        return [
            f"{name}: {value:.3e} > {tol:g}, and no fp64 truth to judge it by ({type(exc).__name__}: {why})"
            for name, value, tol in direct
            if name in report.exceeded
        ]
    grads = common if with_grads else None
    failures = truth_failures(report, ours, stock, truth, sel, grads, "fp64", FP32_BOUNDS)
    if not failures and not ALWAYS_FLOOR:
        return []
    # beyond stock's own error: judged again with the error fp32 storage alone causes on this model as the yardstick
    floor = widened_truth(
        setup, torch.float64, stock.entropy_coef, seed, with_grads, report.timings, round_to=torch.float32
    )
    return truth_failures(report, ours, stock, truth, sel, grads, "fp64", FP32_BOUNDS, floor=floor)


def _micro_batch_paths(setup: Setup, decisions) -> list[MicroBatchPath]:
    """Per micro-batch, the path its decision took and why (or what it shared)."""
    groupings = [
        PromptGrouping.of(setup.ids[lo:hi, : setup.P], setup.mask[lo:hi, : setup.P]) for lo, hi in setup.slices
    ]
    paths = []
    for i, ((lo, hi), decision) in enumerate(zip(setup.slices, decisions)):
        unique = int(groupings[i].first.numel())
        if decision.path == "stock":
            paths.append(MicroBatchPath(i, hi - lo, unique, "stock fallback", decision.cause))
            continue
        w0 = i - i % setup.window
        mine = set(groupings[i].keys)
        shared = [
            j for j in range(w0, min(w0 + setup.window, len(setup.slices))) if j != i and mine & set(groupings[j].keys)
        ]
        detail = (
            f"{decision.path} sharing, {unique} prompt{'s' if unique != 1 else ''} for {hi - lo} rows; "
            f"{decision.backbone_tokens} backbone tokens vs stock's {decision.stock_tokens}"
        )
        if shared:
            detail += f"; prompt pass shared with micro-batch(es) {shared}"
        paths.append(MicroBatchPath(i, hi - lo, unique, "prompt-once", detail))
    return paths


def _backend_line(backends: dict) -> str:
    """The report's kernel backend line: what each op of grpo_mem's run resolved to and where the preference came
    from, e.g. ``"attention torch, head torch (GRPO_MEM_BACKEND=torch)"``."""
    preference, source = preferred()
    names = {"multi_region_attention": "attention", "linear_logprobs": "head", "selective_log_softmax": "head"}
    ran = ", ".join(sorted(f"{names.get(op, op)} {name}" for op, name in backends.items())) or "no grpo_mem kernel ran"
    origin = {"default": "auto", "patch_trl": f"patch_trl(backend={preference!r})"}.get(
        source, f"{source}={preference}"
    )
    return f"{ran} ({origin})"

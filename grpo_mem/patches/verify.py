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

The model's gradients (every ``.grad``, the same tensor objects), the train/eval mode of every module, the RNG states
(Python, NumPy, torch CPU and CUDA), the trainer's logged metrics, and every method and forward are as they were
afterwards; nothing is patched that was not before. If ``patch_trl`` was already applied, the stock side still runs
TRL's original method (``__wrapped_original__`` of the patched one).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import random
import sys
import time
import types
import warnings
from dataclasses import dataclass

import torch

from ..model import support
from ..model.distributed import unwrap_causal_lm
from ..model.forward import installed, own_forward, restore, validate_inputs
from ..model.plan import PromptGrouping
from .checks import LOGPS_METHOD, LOGPS_PARAMS
from .trl import active_handle, group_shuffle, patched_method
from .verify_criteria import (
    BF16_BOUNDS,
    BF16_GRAD_TOL,
    BF16_MAX_FACTOR,
    BF16_STAT_TOL,
    FP32_BOUNDS,
    FP32_GRAD_TOL,
    FP32_MAX_FACTOR,
    FP32_PARAM_GRAD_TOL,
    FP32_VALUE_TOL,
    MicroBatchPath,
    VerificationError,
    VerifyReport,
    error_stats,
    grad_errors,
    grad_within_stock_error,
    truth_failures,
    within_stock_error,
)

__all__ = [
    "BF16_GRAD_TOL",
    "BF16_MAX_FACTOR",
    "BF16_STAT_TOL",
    "FP32_GRAD_TOL",
    "FP32_MAX_FACTOR",
    "FP32_PARAM_GRAD_TOL",
    "FP32_VALUE_TOL",
    "MicroBatchPath",
    "VerificationError",
    "VerifyReport",
    "grad_errors",
    "grad_within_stock_error",
    "verify",
    "within_stock_error",
]

ENTROPY_COEF = 0.1
REQUIRED_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
EXTRA_KEYS = LOGPS_PARAMS[LOGPS_PARAMS.index("pixel_values") :]


# ---------------------------------------------------------------------------------------------------------------------
# what is scored, and by what


class _Scorer:
    """Stands in for a trainer when ``verify`` is given a model: what TRL's method reads of ``self``."""

    def __init__(self, model, temperature: float):
        self.temperature = temperature
        self.accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext)
        self.args = types.SimpleNamespace(cast_lm_head_to_fp32=False)
        # read by older TRL releases' method
        self.model_kwarg_keys = set(inspect.signature(unwrap_causal_lm(model).forward).parameters)
        self.use_liger_kernel = False
        self._entropy_bonus_enabled = True
        self.is_fsdp_enabled = False

    def __getattr__(self, name):
        """Other methods TRL's method calls on ``self`` (1.14.x: ``_full_logits_logps``), GRPOTrainer's own."""
        import trl

        fn = getattr(trl.GRPOTrainer, name, None) if not name.startswith("__") else None
        if not callable(fn):
            raise AttributeError(name)
        return types.MethodType(inspect.unwrap(fn), self)


def _stock_method(owner):
    """TRL's own ``_get_per_token_logps_and_entropies`` of ``owner``'s class, past grpo_mem's patch and TRL's
    profiling decorator (which would log the calls as training time)."""
    fn = getattr(owner if isinstance(owner, type) else type(owner), LOGPS_METHOD)
    while hasattr(fn, "__wrapped_original__"):
        fn = fn.__wrapped_original__
    return inspect.unwrap(fn)


def _has_fused_head(causal_lm) -> bool:
    fn = own_forward(causal_lm)
    if fn is None:
        return False
    try:
        return "fused_lm_head" in inspect.signature(fn, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return False


def _check_batch(batch) -> dict:
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict laid out as TRL lays it out, got {type(batch).__name__}")
    missing = [k for k in REQUIRED_KEYS if batch.get(k) is None]
    if missing:
        raise ValueError(
            f"batch lacks {missing}: verify needs {list(REQUIRED_KEYS)} as TRL lays them out (left-padded prompts, "
            f"right-padded completions), got keys {sorted(batch)}"
        )
    for key in REQUIRED_KEYS:
        value = batch[key]
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            got = getattr(value, "shape", value)
            raise ValueError(f"batch[{key!r}] must be a 2-D (rows, width) tensor, got {got!r}")
    for ids, mask in (("prompt_ids", "prompt_mask"), ("completion_ids", "completion_mask")):
        if batch[ids].shape != batch[mask].shape:
            raise ValueError(
                f"batch[{ids!r}] has shape {tuple(batch[ids].shape)} but batch[{mask!r}] {tuple(batch[mask].shape)}"
            )
    if batch["prompt_ids"].shape[0] != batch["completion_ids"].shape[0]:
        raise ValueError(
            f"batch has {batch['prompt_ids'].shape[0]} prompt rows but {batch['completion_ids'].shape[0]} completion "
            "rows"
        )
    if batch["completion_ids"].shape[1] < 1 or batch["prompt_ids"].shape[1] < 1:
        raise ValueError(
            f"prompt and completion widths must be >= 1, got {batch['prompt_ids'].shape[1]} and "
            f"{batch['completion_ids'].shape[1]}"
        )
    return batch


def _trainer_batch(trainer) -> dict:
    """The first generation batch of the trainer's training dataloader, generated and scored by the trainer's own
    ``_generate_and_score_completions``, rows ordered as ``patch_trl`` orders them (TRL's own row shuffle, or whole
    groups when the trainer's active patch was made with ``group_shuffle=True``)."""
    accelerator = trainer.accelerator
    n_loaders = len(getattr(accelerator, "_dataloaders", []))
    saved = {}
    for name in ("_metrics", "_logs", "_total_train_tokens"):
        if hasattr(trainer, name):
            with contextlib.suppress(Exception):
                saved[name] = copy.deepcopy(getattr(trainer, name))
    try:
        generation_batch = next(iter(trainer.get_train_dataloader()))
        batch = trainer._generate_and_score_completions(generation_batch)
    finally:
        for name, value in saved.items():
            setattr(trainer, name, value)
        if hasattr(accelerator, "_dataloaders"):
            del accelerator._dataloaders[n_loaders:]
    handle = active_handle(trainer)
    if handle is not None and handle.group_shuffle:
        return group_shuffle(batch)
    module = sys.modules[type(trainer).__module__]
    return module.shuffle_sequence_dict(batch) if hasattr(module, "shuffle_sequence_dict") else batch


# ---------------------------------------------------------------------------------------------------------------------
# state that verify must leave as it found it


@contextlib.contextmanager
def _preserved(model):
    params = list(model.parameters())
    grads = [p.grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    rng = (random.getstate(), torch.random.get_rng_state())
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    causal_lm = unwrap_causal_lm(model)
    had_forward = "forward" in causal_lm.__dict__
    previous_forward = causal_lm.__dict__.get("forward")
    had_grpo_mem = installed(causal_lm)
    attn_impl = causal_lm.config._attn_implementation
    for p in params:
        p.grad = None
    try:
        with warnings.catch_warnings(), support.restoring_warnings():
            warnings.filterwarnings("ignore", message="grpo_mem: falling back")
            yield
    finally:
        for p in params:
            p.grad = None
        for p, g in zip(params, grads):
            p.grad = g
        for m, training in modes:
            m.training = training
        random.setstate(rng[0])
        torch.random.set_rng_state(rng[1])
        if np_state is not None:
            numpy.random.set_state(np_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if not had_grpo_mem:
            restore(causal_lm)
        elif causal_lm.config._attn_implementation != attn_impl:
            restore(causal_lm, forward=False)
        if had_forward:
            causal_lm.forward = previous_forward
        else:
            causal_lm.__dict__.pop("forward", None)


@contextlib.contextmanager
def _cast(model, trainer, dtype: torch.dtype):
    """The model in ``dtype`` (fp32 or fp64; floating parameters and buffers cast in place and back: exact from
    bf16/fp16 to fp32 and from fp32 to fp64) and no autocast, neither the caller's nor the trainer's
    ``accelerator.autocast()``."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    dtypes = [t.dtype for t in tensors]
    device_type = tensors[0].device.type if tensors else "cpu"
    accelerator = getattr(trainer, "accelerator", None)
    had_autocast = accelerator is not None and "autocast" in accelerator.__dict__
    previous = accelerator.__dict__.get("autocast") if accelerator is not None else None
    for t in tensors:
        t.data = t.data.to(dtype)
    if accelerator is not None:
        accelerator.autocast = lambda *a, **k: torch.autocast(device_type, enabled=False)
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)
        if accelerator is not None:
            if had_autocast:
                accelerator.autocast = previous
            else:
                del accelerator.autocast


# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    logps: torch.Tensor
    entropies: torch.Tensor
    grads: dict
    entropy_coef: float


def _score(fn, setup: _Setup, entropy_coef, before_call=None, after_call=None, backward: bool = True) -> _Run:
    """Score the micro-batches ``setup.slices`` in order with ``fn`` (TRL's method or the patched one), each followed
    by the backward of its share of the fixed loss; returns log-probs, entropies (fp32, or fp64 from an fp64 model)
    and the summed gradients. ``entropy_coef`` None: ``ENTROPY_COEF`` if the method's entropies carry gradient (TRL
    < 1.14 computes them without gradient unless the entropy bonus is on), else 0; the coefficient used is returned
    for the other runs. ``before_call(i)`` / ``after_call()`` run around micro-batch i's call. ``backward=False``:
    forwards only, under ``torch.no_grad()`` (no gradients returned)."""
    model, self_obj, ids, mask, loss_mask = setup.model, setup.self_obj, setup.ids, setup.mask, setup.loss_mask
    C = loss_mask.shape[1]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    all_logps, all_ent = [], []
    for i, (lo, hi) in enumerate(setup.slices):
        if before_call is not None:
            before_call(i)
        # forward under the trainer's mixed precision, as accelerate's prepared forward applies it in training (TRL
        # < 1.15's method enters no autocast itself; 1.15+ enters the same one again inside); backward outside any
        # autocast, as in training, also when verify is called inside one
        with self_obj.accelerator.autocast(), torch.set_grad_enabled(backward):
            logps, ent, aux = fn(
                self_obj,
                model,
                ids[lo:hi],
                mask[lo:hi],
                C,
                batch_size=hi - lo,
                compute_entropy=True,
                compute_aux_loss=setup.aux_coef != 0.0,
                **setup.extras,
            )
        if after_call is not None:
            after_call()
        acc = torch.float64 if logps.dtype == torch.float64 else torch.float32  # the fp64 truth stays fp64
        if backward:
            m, (a, n_tok) = loss_mask[lo:hi].to(acc), setup.weights
            if entropy_coef is None:
                entropy_coef = ENTROPY_COEF if ent.requires_grad else 0.0
            loss = -(a[lo:hi, None] * m * logps.to(acc)).sum() / n_tok - entropy_coef * (m * ent.to(acc)).sum() / n_tok
            if aux is not None:  # the MoE router loss, weighted as the trainer weights it: its gradient is compared
                loss = loss + setup.aux_coef * aux.to(acc)
            with torch.autocast(logps.device.type, enabled=False):
                loss.backward()
        all_logps.append(logps.detach().to(acc))
        all_ent.append(ent.detach().to(acc))
    grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
    for _, p in named:
        p.grad = None
    return _Run(torch.cat(all_logps), torch.cat(all_ent), grads, entropy_coef)


@dataclass
class _Setup:
    """What both paths of ``verify`` score: the model, the object whose method is called, the batch laid out as TRL
    lays it out, the micro-batches, the loss weights and the gradient-accumulation windows."""

    model: torch.nn.Module
    self_obj: object
    stock_fn: object
    temperature: float
    ids: torch.Tensor
    mask: torch.Tensor
    P: int
    loss_mask: torch.Tensor
    sel: torch.Tensor
    slices: list
    weights: tuple
    extras: dict
    aux_coef: float  # the trainer's router_aux_loss_coef when it asks for the MoE router loss, else 0
    window: int


def _setup(trainer_or_model, batch, micro_batch_size, temperature, seed) -> _Setup:
    """Validate the arguments and lay out the batch (generating it from the trainer if None); call inside
    ``_preserved``, since generating runs the model."""
    is_trainer = _is_trainer(trainer_or_model)
    model = trainer_or_model.model if is_trainer else trainer_or_model
    if is_trainer:
        self_obj, stock_fn = trainer_or_model, _stock_method(trainer_or_model)
        T = float(trainer_or_model.temperature)
        mb = micro_batch_size or trainer_or_model.args.per_device_train_batch_size
        ga = trainer_or_model.args.gradient_accumulation_steps
        enabled = bool(getattr(trainer_or_model, "aux_loss_enabled", False))
        aux = float(trainer_or_model.router_aux_loss_coef) if enabled else 0.0
    else:
        import trl

        T = 1.0 if temperature is None else float(temperature)
        self_obj, stock_fn = _Scorer(model, T), _stock_method(trl.GRPOTrainer)
        mb, ga, aux = micro_batch_size, None, 0.0
        causal_lm = unwrap_causal_lm(model)
        if not _has_fused_head(causal_lm):
            with contextlib.suppress(ImportError):  # TRL releases without a fused head score logits themselves
                from trl.trainer.utils import add_fused_lm_head

                add_fused_lm_head(causal_lm, temperature=T, outputs=("log_probs", "entropy"))
    model.train()
    if batch is None:
        batch = _check_batch(_trainer_batch(trainer_or_model))
    device = next(model.parameters()).device
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).long()
    P, C = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    validate_inputs(ids, mask, C, T)
    B = ids.shape[0]
    extras = {k: batch[k] for k in EXTRA_KEYS if batch.get(k) is not None}
    mb = B if (mb is None or extras) else min(int(mb), B)  # multimodal inputs: one call, TRL slices them
    slices = [(lo, min(lo + mb, B)) for lo in range(0, B, mb)]
    loss_mask = batch["completion_mask"].long()
    if batch.get("tool_mask") is not None:
        loss_mask = loss_mask * batch["tool_mask"].long()
    sel = loss_mask.bool() if batch.get("tool_mask") is None else batch["completion_mask"].bool()
    advantages = torch.randn(B, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(device)
    weights = (advantages, loss_mask.sum().clamp_min(1).float())
    return _Setup(
        model, self_obj, stock_fn, T, ids, mask, P, loss_mask, sel, slices, weights, extras, aux, ga or len(slices)
    )


def _score_both(setup: _Setup, low: str | None, seed: int, timings: dict):
    """Score the batch with stock TRL, with grpo_mem (micro-batch decisions recorded) and, in low precision, with
    stock TRL in fp32. Returns (stock, ours, truth or None, decisions); ``timings`` gets each run's wall seconds."""

    def score_with(fn, before_call=None, entropy_coef=None, after_call=None):
        torch.manual_seed(seed)  # the same dropout draws, if any
        return _score(fn, setup, entropy_coef, before_call, after_call)

    t = time.perf_counter()
    stock = score_with(setup.stock_fn)
    timings["stock"] = time.perf_counter() - t
    # grpo_mem: the patched method, on a private handle (nothing installed on a class or the trainer)
    ours_fn, handle = patched_method(setup.stock_fn)
    session = handle.session(setup.self_obj)
    prompt_ids, prompt_mask = setup.ids[:, : setup.P], setup.mask[:, : setup.P]
    decisions = []

    def before_call(i):
        if i % setup.window == 0:
            window = setup.slices[i : i + setup.window]
            session.begin_window([prompt_ids[lo:hi] for lo, hi in window], [prompt_mask[lo:hi] for lo, hi in window])

    t = time.perf_counter()
    try:
        ours = score_with(ours_fn, before_call, stock.entropy_coef, lambda: decisions.append(session.last_decision))
    finally:
        with contextlib.suppress(RuntimeError):
            session.close_window()
    timings["grpo_mem"] = time.perf_counter() - t
    truth = _truth(setup, torch.float32, stock.entropy_coef, seed, True, timings) if low else None
    return stock, ours, truth, decisions


def _truth(setup: _Setup, dtype: torch.dtype, entropy_coef: float, seed: int, backward: bool, timings: dict) -> _Run:
    """Stock TRL on the model cast to ``dtype`` (fp32 for low-precision runs, fp64 for fp32 runs), with gradients
    only if ``backward``. In fp64, TRL's fused head (which computes in fp32 whatever the weights' dtype, the same
    roundings as the stock fp32 run) is replaced by the model's own logits and a log-softmax in fp64."""
    t = time.perf_counter()
    exact = _exact_head(unwrap_causal_lm(setup.model), setup.temperature) if dtype == torch.float64 else None
    with _cast(setup.model, setup.self_obj, dtype), exact or contextlib.nullcontext():
        torch.manual_seed(seed)
        truth = _score(setup.stock_fn, setup, entropy_coef, backward=backward)
    timings["truth"] = time.perf_counter() - t
    return truth


@contextlib.contextmanager
def _exact_head(causal_lm, temperature: float):
    """``causal_lm``'s calls with ``fused_lm_head=True`` (TRL's fused head) answered in the model's own dtype: its
    logits over the labelled positions (``logits_to_keep``), divided by ``temperature``, through ``log_softmax``;
    log-probs and entropies (rows, T - 1), 0 where the label is -100, as TRL's head lays them out."""
    had = "forward" in causal_lm.__dict__
    fused = causal_lm.forward

    def forward(*args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return fused(*args, labels=labels, **kwargs) if labels is not None else fused(*args, **kwargs)
        valid = labels != -100
        columns = valid.any(0).nonzero()
        first = max(int(columns[0]) if len(columns) else labels.shape[1] - 1, 1)  # first labelled column
        kwargs["use_cache"] = False
        out = fused(*args, logits_to_keep=labels.shape[1] - first + 1, **kwargs)
        logp = torch.log_softmax(out.logits[:, :-1] / temperature, -1)
        target, keep = labels[:, first:], valid[:, first:]
        token = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0].masked_fill(~keep, 0)
        entropy = -(logp.exp() * logp).sum(-1).masked_fill(~keep, 0)
        pad = token.new_zeros(labels.shape[0], first - 1)
        return types.SimpleNamespace(
            log_probs=torch.cat([pad, token], 1),
            entropy=torch.cat([pad, entropy], 1),
            aux_loss=getattr(out, "aux_loss", None),
        )

    causal_lm.forward = forward
    try:
        yield
    finally:
        if had:
            causal_lm.forward = fused
        else:
            causal_lm.__dict__.pop("forward", None)


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
        truth = _truth(setup, torch.float64, stock.entropy_coef, seed, with_grads, report.timings)
    except (RuntimeError, TypeError, NotImplementedError) as exc:  # an op without fp64 (grouped_mm of MoE experts)
        why = " ".join(str(exc).split())[:200]
        return [
            f"{name}: {value:.3e} > {tol:g}, and no fp64 truth to judge it by ({type(exc).__name__}: {why})"
            for name, value, tol in direct
            if name in report.exceeded
        ]
    return truth_failures(report, ours, stock, truth, sel, common if with_grads else None, "fp64", FP32_BOUNDS)


def _compare(setup: _Setup, stock, ours, truth, low, seed: int, timings: dict) -> VerifyReport:
    """The report's differences and failures (paths are added by ``_micro_batch_paths``); in fp32, runs the fp64
    truth when a direct bound is exceeded (call inside ``_preserved``)."""
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


def _micro_batch_paths(setup: _Setup, decisions) -> list[MicroBatchPath]:
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


def verify(
    trainer_or_model,
    batch=None,
    *,
    raise_on_mismatch: bool = False,
    micro_batch_size: int | None = None,
    temperature: float | None = None,
    seed: int = 0,
    print_report: bool = True,
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

    Returns:
        A ``VerifyReport`` (``passed``, the differences, the bounds, per micro-batch the path taken and why).

    Raises:
        ValueError/TypeError: a missing or malformed batch (naming the keys or shapes), or no batch for a model.
        VerificationError: with ``raise_on_mismatch`` and a failed bound.
    """
    start = time.perf_counter()
    model = trainer_or_model.model if _is_trainer(trainer_or_model) else trainer_or_model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"verify takes a TRL trainer or a torch model, got {type(trainer_or_model).__name__}")
    if batch is None and not _is_trainer(trainer_or_model):
        raise ValueError("verify needs a batch when given a model (a dict with prompt_ids, prompt_mask, ...)")
    if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if batch is not None:
        _check_batch(batch)
    timings = {}
    with _preserved(model):
        setup = _setup(trainer_or_model, batch, micro_batch_size, temperature, seed)
        low = _low_precision(model, trainer_or_model if _is_trainer(trainer_or_model) else None)
        stock, ours, truth, decisions = _score_both(setup, low, seed, timings)
        report = _compare(setup, stock, ours, truth, low, seed, timings)
    report.micro_batches = _micro_batch_paths(setup, decisions)
    report.passed = not report.failures
    report.seconds = time.perf_counter() - start
    if print_report:
        print(report)
    if raise_on_mismatch and not report.passed:
        raise VerificationError(report)
    return report


def _is_trainer(obj) -> bool:
    return hasattr(obj, "accelerator") and hasattr(obj, "model")


def _low_precision(model, trainer) -> str | None:
    """ "bf16 autocast" / "fp16 autocast" / "bf16 weights" / ... when the run is not plain fp32, else None."""
    mixed = getattr(getattr(trainer, "accelerator", None), "mixed_precision", "no") if trainer is not None else "no"
    if mixed in ("bf16", "fp16"):
        return f"{mixed} autocast"
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is not None and torch.is_autocast_enabled(param.device.type):
        return f"{str(torch.get_autocast_dtype(param.device.type)).replace('torch.', '')} autocast"
    low = sorted(
        {str(p.dtype).replace("torch.", "") for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)}
    )
    return f"{'/'.join(low)} weights" if low else None

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

Memory: verify is for the user whose training runs out of memory, so no run holds more than the patched training
step it checks (measured: ``benchmarks/results/verify_memory.csv``):

- grpo_mem's path runs first, exactly as in training, with nothing else held.
- Stock TRL's method runs in row chunks: as many whole rows (P + C tokens each) as fit in the most backbone tokens
  grpo_mem ran in one micro-batch (usually 1 row with a long shared prompt), its decoder layers checkpointed
  (non-reentrant ``torch.utils.checkpoint``: the same values, one layer's activations at a time in the backward).
  The loss is a sum over rows, so the chunks' gradients add up to the micro-batch's. TRL's own fused head runs
  with a narrower vocabulary tile (``_trl_head_tile``: TRL's tile-width constant, as many columns as the hidden
  size; the same code, sums over the vocabulary in another order: 1-2 fp32 ulps). With TRL's 32768 columns, one
  call on CPU (where TRL scores every position of a row) took a (P + C - 1) x 32768 tile and several fp32 copies
  of it, more than the patched step's whole peak.
- The truth (fp32 for a bf16/fp16 run, fp64 for fp32) is stock TRL's method on the model widened one module at a
  time (``_upcast_per_module``: no whole copy in the wider dtype; a copy a backward formula saves is re-widened when
  read; of an embedding table only the rows the batch uses), in row chunks sized for the wider activations,
  checkpointed, its gradients in the wider dtype streamed into sketches as its backward produces them (no ``.grad``
  buffer).
- Gradients are compared through linear count sketches (``_Sketcher``: small parameters exactly, large ones as
  8192 fp64 bucket sums, norms of differences to about 1%), so no run's gradients are held while another runs.

The model's gradients (every ``.grad``, the same tensor objects), the train/eval mode of every module, the RNG states
(Python, NumPy, torch CPU and CUDA), the trainer's logged metrics, and every method and forward are as they were
afterwards; nothing is patched that was not before. If ``patch_trl`` was already applied, the stock side still runs
TRL's original method (``__wrapped_original__`` of the patched one).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import random
import sys
import time
import types
import warnings
import weakref
import zlib
from dataclasses import dataclass, field

import torch

from ..model import support
from ..model.distributed import unwrap_causal_lm
from ..model.forward import installed, own_forward, restore, validate_inputs
from ..model.plan import PromptGrouping
from ..ops._backends import RESOLVED, preferred
from .checks import LOGPS_METHOD, LOGPS_PARAMS
from .handle import active_handle
from .trl import group_shuffle, patched_method
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
ALWAYS_FLOOR = False
"""fp32: run the fp32-storage floor whenever the fp64 truth runs, not only when stock's own error does not cover
grpo_mem's (``benchmarks/verify_real.py --floor`` sets it, to record the floor's numbers)."""
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
    for t in tensors:
        t.data = t.data.to(dtype)
    try:
        with _no_autocast(trainer, device_type):
            yield
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)


# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# gradients kept as sketches: what the comparisons read, without a second copy of the model's gradients

SKETCH_BUCKETS = 8192
"""Buckets of a large parameter's gradient sketch; parameters of at most this many elements are kept exactly."""
_SKETCH_BLOCK = 1 << 14  # elements hashed at a time (bounds the pattern and the temporaries: 128 KiB each)


class _Sketcher:
    """Linear count sketches of gradients (Charikar et al.'s CountSketch), the same hash for every run of one
    ``verify`` call, so that differences of sketches are sketches of differences.

    A parameter of n <= ``SKETCH_BUCKETS`` elements is kept exactly (in its gradient's dtype). A larger one is reduced to
    ``SKETCH_BUCKETS`` fp64 sums: element i goes to bucket h(i) with sign s(i), both pseudo-random and fixed for the
    call. For any vector x (a gradient, a difference of two) ``||S x||^2`` is an unbiased estimate of ``||x||^2`` with
    variance at most ``2 ||x||^4 / SKETCH_BUCKETS``: a relative standard deviation <= 1.6% on squared norms (0.8% on
    norms), whatever x is. Sketches add: the truth's gradient is sketched chunk by chunk as its backward produces it.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._on: dict = {}

    def _pattern(self, device):
        """The buckets and signs of a block's elements (the block's own shift and sign apply on top), on ``device``."""
        if device not in self._on:
            g = torch.Generator().manual_seed(self.seed)
            idx = torch.randint(SKETCH_BUCKETS, (_SKETCH_BLOCK,), generator=g)
            sign = torch.randint(0, 2, (_SKETCH_BLOCK,), generator=g).double() * 2 - 1
            self._on[device] = (idx.to(device), sign.to(device))
        return self._on[device]

    def add(self, acc: dict, name: str, grad: torch.Tensor, own: bool = False) -> None:
        """Add the sketch of ``grad`` (any shape and floating dtype) to ``acc[name]``: a small parameter's gradient
        itself, in the dtype it first came in (``own``: ``grad`` is handed over, not copied), a large one's fp64
        bucket sums."""
        x = grad.detach().reshape(-1)
        n = x.numel()
        if n <= SKETCH_BUCKETS:
            if name in acc:
                acc[name] += x.to(acc[name].dtype)
            else:
                acc[name] = x if own else x.clone()
            return
        out = acc.get(name)
        if out is None:
            out = acc[name] = torch.zeros(SKETCH_BUCKETS, dtype=torch.float64, device=x.device)
        idx, sign = self._pattern(x.device)
        for block, lo in enumerate(range(0, n, _SKETCH_BLOCK)):
            xb = x[lo : lo + _SKETCH_BLOCK].double()
            m = xb.numel()
            h = zlib.crc32(f"{name}:{block}".encode())  # a shift and a sign per block: blocks do not align
            bucket = (idx[:m] + h) & (SKETCH_BUCKETS - 1)
            out.index_add_(0, bucket, xb.mul_(sign[:m]).mul_(1.0 if h & 1 << 20 else -1.0))

    def add_rows(self, acc: dict, name: str, grad: torch.Tensor, rows: torch.Tensor, shape: tuple) -> None:
        """``add`` of the gradient of a parameter of ``shape`` (rows, width) that is zero but in rows ``rows``
        (distinct int64 indices), given as ``grad`` (len(rows), width): the same sketch as ``add`` of the dense
        gradient, without building it."""
        n_rows, width = shape
        if n_rows * width <= SKETCH_BUCKETS:
            dense = grad.new_zeros(shape)
            dense[rows] = grad
            self.add(acc, name, dense)
            return
        out = acc.get(name)
        if out is None:
            out = acc[name] = torch.zeros(SKETCH_BUCKETS, dtype=torch.float64, device=grad.device)
        idx, sign = self._pattern(grad.device)
        flat = (rows.to(grad.device)[:, None] * width + torch.arange(width, device=grad.device)).reshape(-1)
        block, offset = flat // _SKETCH_BLOCK, flat % _SKETCH_BLOCK
        blocks = block.unique()
        shift = torch.tensor([zlib.crc32(f"{name}:{int(b)}".encode()) for b in blocks], device=grad.device)
        h = shift[torch.searchsorted(blocks, block)]
        bucket = (idx[offset] + h) & (SKETCH_BUCKETS - 1)
        block_sign = torch.where(h & (1 << 20) != 0, 1.0, -1.0).double()
        out.index_add_(0, bucket, grad.detach().reshape(-1).double() * sign[offset] * block_sign)

    def take_grads(self, named, acc: dict | None = None) -> dict:
        """Sketch every ``.grad`` of ``named`` ((name, parameter) pairs) into ``acc`` and drop the ``.grad``s."""
        acc = {} if acc is None else acc
        for name, p in named:
            if p.grad is not None:
                self.add(acc, name, p.grad, own=True)
                p.grad = None
        return acc


@dataclass
class _Run:
    logps: torch.Tensor
    entropies: torch.Tensor
    grads: dict  # {name: fp64 sketch} (see _Sketcher)
    entropy_coef: float


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chunks(setup, rows: int) -> list[tuple[int, int]]:
    """Each micro-batch of ``setup.slices`` cut into row chunks of at most ``rows`` rows."""
    return [(a, min(a + rows, hi)) for lo, hi in setup.slices for a in range(lo, hi, rows)]


def _score(
    fn, setup: _Setup, entropy_coef, before_call=None, after_call=None, backward: bool = True, chunks=None, sink=None
) -> _Run:
    """Score the batch with ``fn`` (TRL's method or the patched one) in ``chunks`` (row ranges; default the
    micro-batches ``setup.slices``), each followed by the backward of its share of the fixed loss (the loss is a sum
    over rows, so chunks of a micro-batch add up to its gradient); returns log-probs, entropies (fp32, or fp64 from an
    fp64 truth) and the sketch of the summed gradients (the ``.grad``s are dropped). ``entropy_coef`` None:
    ``ENTROPY_COEF`` if the method's entropies carry gradient (TRL < 1.14 computes them without gradient unless the
    entropy bonus is on), else 0; the coefficient used is returned for the other runs. ``before_call(i)`` /
    ``after_call()`` run around call i. ``backward=False``: forwards only, under ``torch.no_grad()`` (no gradients
    returned). ``sink``: the sketches the truth's per-module gradients were added to during its backwards."""
    model, self_obj, ids, mask, loss_mask = setup.model, setup.self_obj, setup.ids, setup.mask, setup.loss_mask
    C = loss_mask.shape[1]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    all_logps, all_ent = [], []
    for i, (lo, hi) in enumerate(chunks or setup.slices):
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
        del logps, ent, aux
    grads = setup.sketcher.take_grads(named, sink) if backward else {}
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
    sketcher: _Sketcher = field(default_factory=_Sketcher)
    backends: dict = field(default_factory=dict)  # op -> the backend grpo_mem's run resolved it to
    budget_tokens: int = 0  # the most backbone tokens grpo_mem's path ran in one micro-batch (set by its run)
    low_dtype: torch.dtype | None = None  # the autocast dtype of a mixed-precision run
    truth_mode: str = ""  # how the truth widened the model: "per module" or "whole model"
    truth_rows: dict = field(default_factory=dict)  # {"fp32 truth" | "fp64 truth": rows per call}


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


def _row_chunk(setup: _Setup, scale: float) -> int:
    """Rows per chunk of a stock-path run whose activations take ``scale`` x the bytes per token of the model's own
    dtype: as many full rows (P + C tokens each) as fit in the most tokens grpo_mem's path ran through the backbone in
    one micro-batch, at least 1, at most the micro-batch. Whole micro-batches where the loss is not a sum over rows
    (the MoE router loss, computed over the call's tokens) or the call carries multimodal inputs."""
    width, mb = setup.ids.shape[1], max(hi - lo for lo, hi in setup.slices)
    if setup.aux_coef != 0.0 or setup.extras:
        return mb
    return max(1, min(mb, int(setup.budget_tokens / (scale * width))))


def _act_bytes(setup: _Setup) -> int:
    """Bytes per element of the activations of the trainer's run (its autocast dtype, else the weights')."""
    if setup.low_dtype is not None:
        return setup.low_dtype.itemsize
    param = next((p for p in setup.model.parameters() if p.is_floating_point()), None)
    return 4 if param is None else param.dtype.itemsize


def _score_both(setup: _Setup, low: str | None, seed: int, timings: dict):
    """Score the batch with grpo_mem (micro-batch decisions recorded), with stock TRL (in row chunks no larger than
    grpo_mem's micro-batches in backbone tokens, its decoder layers checkpointed: the same values) and, in low precision, with stock TRL in fp32. Returns (stock, ours,
    truth or None, decisions); ``timings`` gets each run's wall seconds."""
    device = setup.ids.device

    def score_with(fn, before_call=None, entropy_coef=None, after_call=None, chunks=None):
        torch.manual_seed(seed)  # the same dropout draws, if any
        return _score(fn, setup, entropy_coef, before_call, after_call, chunks=chunks)

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

    _sync(device)
    t = time.perf_counter()
    RESOLVED.clear()
    try:
        ours = score_with(ours_fn, before_call, None, lambda: decisions.append(session.last_decision))
    finally:
        with contextlib.suppress(RuntimeError):
            session.close_window()
    _sync(device)
    timings["grpo_mem"] = time.perf_counter() - t
    setup.backends = dict(RESOLVED)  # what grpo_mem's kernels ran on (empty: every micro-batch took stock's path)
    setup.budget_tokens = max(d.stock_tokens if d.path == "stock" else d.backbone_tokens for d in decisions)
    t = time.perf_counter()
    with _checkpointed_layers(unwrap_causal_lm(setup.model)), _trl_head_tile(setup):
        stock = score_with(
            setup.stock_fn, entropy_coef=ours.entropy_coef, chunks=_chunks(setup, _row_chunk(setup, 1.0))
        )
    _sync(device)
    timings["stock"] = time.perf_counter() - t
    truth = _truth(setup, torch.float32, stock.entropy_coef, seed, True, timings) if low else None
    return stock, ours, truth, decisions


@contextlib.contextmanager
def _trl_head_tile(setup: _Setup):
    """TRL's fused head (``trl.trainer.utils.add_fused_lm_head``) with vocabulary tiles as wide as the head's input
    (the hidden size, rounded down to a multiple of 128, at least 128; at most the vocabulary rounded up to 128, where
    the vocabulary fits in one tile: the same sums as TRL's; at most TRL's own width), so that a tile of fp32 logits
    takes no more than the call's hidden states in fp32. TRL's own code path: its module constant
    ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (32768 in 1.16), which it passes as ``chunk_size`` to its
    ``_ChunkedLogProbFunction``. Its kernel folds each tile into online log-sum-exp statistics, so a narrower tile
    changes only the order of the fp32 sums over the vocabulary (1-2 ulps measured:
    ``tests/patches/test_verify.py::test_trl_head_tile_changes_only_summation_order``). Why: on CPU TRL scores
    every position of a row (P + C - 1 per row), allocates its full tile width whatever the
    vocabulary, and its torch fallback holds about 9 fp32 copies of a tile at once in the backward, which made
    stock's call peak above the patched step's. TRL releases without the constant: nothing changes."""
    import importlib

    try:
        utils = importlib.import_module("trl.trainer.utils")
    except ImportError:
        utils = None
    own = getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", None)
    if not isinstance(own, int):
        yield
        return
    head = unwrap_causal_lm(setup.model).get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        yield
        return
    vocab, hidden = weight.shape
    columns = min(max(128, hidden // 128 * 128), -(-vocab // 128) * 128)
    utils._CHUNKED_LOGPROB_CHUNK_SIZE = min(own, columns)
    try:
        yield
    finally:
        utils._CHUNKED_LOGPROB_CHUNK_SIZE = own


class _Upcast(torch.autograd.Function):
    """``p`` (a parameter) in ``dtype`` for one module call; its gradient goes to ``sink(name, grad)`` in ``dtype``
    (summed there at the truth's precision) instead of ``p.grad``."""

    @staticmethod
    def forward(ctx, p, dtype, sink, name):
        ctx.sink, ctx.name = sink, name
        return p.detach().to(dtype)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.name, grad)
        return None, None, None, None


class _UpcastRows(torch.autograd.Function):
    """Rows ``rows`` of ``p`` (an embedding table) in ``dtype``; their gradient goes to
    ``sink(name, grad, rows, p.shape)`` instead of ``p.grad``."""

    @staticmethod
    def forward(ctx, p, rows, dtype, sink, name):
        ctx.sink, ctx.name, ctx.rows, ctx.shape = sink, name, rows, tuple(p.shape)
        return p.detach()[rows].to(dtype)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.name, grad, ctx.rows, ctx.shape)
        return None, None, None, None, None


@contextlib.contextmanager
def _upcast_per_module(model, dtype: torch.dtype, sink):
    """The model's floating parameters and buffers seen in ``dtype`` by each module only while it runs: a forward
    pre-hook puts copies in ``dtype`` in the module's ``_parameters``/``_buffers`` (exact: bf16/fp16 -> fp32 and
    fp32 -> fp64 are widenings), the forward hook puts the originals back. A copy a backward formula saves (a linear
    layer's weight) is not kept: saved-tensor hooks store the original parameter and widen it again when the backward
    reads it. So at most one module's weights exist in ``dtype`` at a time, besides the activations. An
    ``nn.Embedding`` (without ``max_norm``) called with its ids widens only the rows the ids use, and its ids are
    renumbered into them (what it avoids: a vocabulary table in fp64, Gemma 3's 262144 x 640 x 8 B = 1.3 GB, and
    as much for its gradient). Gradients (``dtype``) go to ``sink(name, grad)`` (an embedding's:
    ``sink(name, rows_grad, rows, shape)``), not to ``.grad``. Everything is put back on exit, also after an error."""
    widener = _Widener(model, dtype, sink)
    handles = []
    for module in model.modules():
        if module._parameters or module._buffers:
            plain = not isinstance(module, torch.nn.Embedding) or module.max_norm is not None
            handles.append(module.register_forward_pre_hook(widener.pre if plain else widener.pre_embedding))
            handles.append(module.register_forward_hook(widener.post))
    try:
        with torch.autograd.graph.saved_tensors_hooks(widener.pack, widener.unpack):
            yield
    finally:
        for h in handles:
            h.remove()
        widener.put_back()


class _Widener:
    """The hooks of ``_upcast_per_module`` and what they share: the widened copies alive (id -> (weakref, original))
    and, per module, the stack of what its pre-hooks swapped in (a module may run re-entrantly)."""

    def __init__(self, model, dtype: torch.dtype, sink):
        self.dtype, self.sink = dtype, sink
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.copies: dict[int, tuple] = {}
        self.stacks: dict[int, list] = {}

    def widen(self, t, grad: bool):
        if grad and t.requires_grad and torch.is_grad_enabled():
            w = _Upcast.apply(t, self.dtype, self.sink, self.names.get(id(t), ""))
        else:
            w = t.detach().to(self.dtype)
        self.copies[id(w)] = (weakref.ref(w), t)
        return w

    def pre(self, module, args):
        swapped = []
        for store, grad in ((module._parameters, True), (module._buffers, False)):
            for key, t in list(store.items()):
                if t is not None and t.is_floating_point() and t.dtype != self.dtype:
                    store[key] = self.widen(t, grad)
                    swapped.append((store, key, t))
        self.stacks.setdefault(id(module), []).append(swapped)

    def pre_embedding(self, module, args):
        """An ``nn.Embedding`` called with its token ids: only the rows the ids use, widened, and the ids renumbered
        into them (the same values and gradients; a whole vocabulary table in fp64 is what this avoids)."""
        weight = module._parameters.get("weight")
        ids = args[0] if args else None
        if not (isinstance(ids, torch.Tensor) and weight is not None and weight.dtype != self.dtype):
            return self.pre(module, args)
        rows, local = torch.unique(ids, return_inverse=True)
        if weight.requires_grad and torch.is_grad_enabled():
            compact = _UpcastRows.apply(weight, rows, self.dtype, self.sink, self.names.get(id(weight), ""))
        else:
            compact = weight.detach()[rows].to(self.dtype)
        swapped = [(module._parameters, "weight", weight)]
        module._parameters["weight"] = compact
        pad = module.padding_idx
        if pad is not None:
            hit = (rows == pad).nonzero()
            module.padding_idx = int(hit[0, 0]) if len(hit) else None
            swapped.append((module.__dict__, "padding_idx", pad))
        for key, t in list(module._buffers.items()):
            if t is not None and t.is_floating_point() and t.dtype != self.dtype:
                module._buffers[key] = t.to(self.dtype)
                swapped.append((module._buffers, key, t))
        self.stacks.setdefault(id(module), []).append(swapped)
        return (local, *args[1:])

    def post(self, module, args, out):
        for store, key, t in self.stacks[id(module)].pop():
            store[key] = t

    def pack(self, t):
        entry = self.copies.get(id(t))
        if entry is not None and entry[0]() is t:
            return ("widened", entry[1])
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 2 and packed[0] == "widened":
            return packed[1].detach().to(self.dtype)
        return packed

    def put_back(self) -> None:
        """Every original back in its module (also those of modules whose forward raised before their post-hook)."""
        for stack in self.stacks.values():
            for swapped in stack:
                for store, key, t in swapped:
                    store[key] = t
        self.copies.clear()


class _Round(torch.autograd.Function):
    """``t`` rounded to ``dtype`` and back (values and, in the backward, gradients)."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


@contextlib.contextmanager
def _rounded_outputs(model, dtype: torch.dtype):
    """Every module's floating output tensors (a tensor, or the tensors of a tuple/list) rounded to ``dtype`` and back,
    and the gradients flowing back into them too: an exact computation that stores every intermediate in ``dtype``."""

    def hook(module, args, out):
        if isinstance(out, torch.Tensor):
            return _Round.apply(out, dtype) if out.is_floating_point() else out
        if isinstance(out, (tuple, list)) and not hasattr(out, "keys"):
            items = [
                _Round.apply(t, dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in out
            ]
            return type(out)(items) if type(out) in (tuple, list) else out
        return out

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _checkpointed_layers(model):
    """Each block of the model's longest ``nn.ModuleList`` (its decoder layers) run under non-reentrant activation
    checkpointing (``torch.utils.checkpoint``): only the layers' inputs are kept, one layer's activations are
    recomputed at a time in the backward. The values are the same (the recomputation repeats the same operations, with
    the same RNG state). Nothing changes if the layers checkpoint already (``gradient_checkpointing``) or there are
    none."""
    from torch.utils.checkpoint import checkpoint

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    layers = max(lists, key=len, default=[])
    if not layers or any(getattr(m, "gradient_checkpointing", False) for m in layers):
        yield
        return
    own = [(layer, layer.__dict__.get("forward")) for layer in layers]
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer, forward in own:
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward


def _truth(
    setup: _Setup,
    dtype: torch.dtype,
    entropy_coef: float,
    seed: int,
    backward: bool,
    timings: dict,
    round_to: torch.dtype | None = None,
) -> _Run:
    """Stock TRL's method on the model widened to ``dtype`` (fp32 for low-precision runs, fp64 for fp32 runs), with
    gradients only if ``backward``, in row chunks no larger than grpo_mem's micro-batches (in bytes). The model is
    widened one module at a time (``_upcast_per_module``): no whole copy in ``dtype``; with gradients, its decoder
    layers are checkpointed (``_checkpointed_layers``), so that a row in ``dtype`` takes no more than grpo_mem's
    micro-batch. TRL's fused head (which reads
    the head's weight outside the head module and computes in fp32 whatever the weights' dtype) is replaced by the
    model's own logits and a log-softmax in ``dtype``. A model the per-module widening cannot run (a parameter read
    outside its module's call) is widened whole in place instead, as before (``_cast``). ``round_to``: every module's
    outputs and their gradients rounded to that dtype (``_rounded_outputs``; timed as "fp32 floor")."""
    device = setup.ids.device
    _sync(device)
    t = time.perf_counter()
    causal_lm = unwrap_causal_lm(setup.model)
    scale = dtype.itemsize / _act_bytes(setup)
    rows = _row_chunk(setup, scale)
    setup.truth_rows[f"{str(dtype).replace('torch.float', 'fp')} truth"] = rows
    chunks = _chunks(setup, rows)
    sink: dict = {}

    def add(name, grad, rows=None, shape=None):
        if rows is None:
            setup.sketcher.add(sink, name, grad)
        else:
            setup.sketcher.add_rows(sink, name, grad, rows, shape)

    def rounding():
        return _rounded_outputs(setup.model, round_to) if round_to is not None else contextlib.nullcontext()

    def run(widen):
        sink.clear()
        checkpointed = _checkpointed_layers(causal_lm) if backward else contextlib.nullcontext()
        with (
            widen,
            _no_autocast(setup.self_obj, device.type),
            _exact_head(causal_lm, setup.temperature),
            rounding(),
            checkpointed,
        ):
            torch.manual_seed(seed)
            return _score(setup.stock_fn, setup, entropy_coef, backward=backward, chunks=chunks, sink=sink)

    try:
        truth = run(_upcast_per_module(setup.model, dtype, add))
        setup.truth_mode = "per module"
    except (RuntimeError, TypeError):  # e.g. a weight read outside its module in the model's dtype
        for p in setup.model.parameters():
            p.grad = None
        truth = run(_cast(setup.model, None, dtype))
        setup.truth_mode = "whole model"
    _sync(device)
    timings["truth" if round_to is None else "fp32 floor"] = time.perf_counter() - t
    return truth


@contextlib.contextmanager
def _no_autocast(trainer, device_type: str):
    """No autocast inside, neither the caller's nor the trainer's ``accelerator.autocast()``."""
    accelerator = getattr(trainer, "accelerator", None)
    had = accelerator is not None and "autocast" in accelerator.__dict__
    previous = accelerator.__dict__.get("autocast") if accelerator is not None else None
    if accelerator is not None:
        accelerator.autocast = lambda *a, **k: torch.autocast(device_type, enabled=False)
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        if accelerator is not None:
            if had:
                accelerator.autocast = previous
            else:
                del accelerator.autocast


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
    grads = common if with_grads else None
    failures = truth_failures(report, ours, stock, truth, sel, grads, "fp64", FP32_BOUNDS)
    if not failures and not ALWAYS_FLOOR:
        return []
    # beyond stock's own error: judged again with the error fp32 storage alone causes on this model as the yardstick
    floor = _truth(setup, torch.float64, stock.entropy_coef, seed, with_grads, report.timings, round_to=torch.float32)
    return truth_failures(report, ours, stock, truth, sel, grads, "fp64", FP32_BOUNDS, floor=floor)


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
    model = trainer_or_model.model if _is_trainer(trainer_or_model) else trainer_or_model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"verify takes a TRL trainer or a torch model, got {type(trainer_or_model).__name__}")
    _sync(next(model.parameters()).device)
    start = time.perf_counter()
    if batch is None and not _is_trainer(trainer_or_model):
        raise ValueError("verify needs a batch when given a model (a dict with prompt_ids, prompt_mask, ...)")
    if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if batch is not None:
        _check_batch(batch)
    timings = {}
    device = next(model.parameters()).device
    with _preserved(model), _PeakMemory(device) as peak:
        setup = _setup(trainer_or_model, batch, micro_batch_size, temperature, seed)
        low = _low_precision(model, trainer_or_model if _is_trainer(trainer_or_model) else None)
        setup.low_dtype = _autocast_dtype(model, trainer_or_model if _is_trainer(trainer_or_model) else None)
        stock, ours, truth, decisions = _score_both(setup, low, seed, timings)
        report = _compare(setup, stock, ours, truth, low, seed, timings)
        del stock, ours, truth
    report.micro_batches = _micro_batch_paths(setup, decisions)
    report.passed = not report.failures
    report.truth_mode = setup.truth_mode
    report.row_chunks = {"stock": _row_chunk(setup, 1.0), **setup.truth_rows}
    report.peak_memory_mb, report.memory_kind = peak.peak_mb, peak.kind
    report.backend = _backend_line(setup.backends)
    _sync(device)
    report.seconds = time.perf_counter() - start
    if print_report:
        print(report)
    if raise_on_mismatch and not report.passed:
        raise VerificationError(report)
    return report


def _is_trainer(obj) -> bool:
    return hasattr(obj, "accelerator") and hasattr(obj, "model")


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


class _PeakMemory:
    """Peak memory of the block above its start: on CUDA ``torch.cuda.max_memory_allocated`` (its peak statistic is
    reset at entry, as ``reset_peak_memory_stats`` does), elsewhere the process's peak RSS
    (``grpo_mem.bench.measure.PeakRSS``). ``peak_mb`` (MB = 1e6 bytes) and ``kind`` after the block."""

    def __init__(self, device: torch.device):
        self.device, self.peak_mb, self.kind = device, 0.0, ""

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from ..bench.measure import PeakRSS

            self.rss = PeakRSS().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = (torch.cuda.max_memory_allocated(self.device) - self.base) / 1e6
            self.kind = "CUDA allocated"
        else:
            self.rss.__exit__(*exc)
            self.peak_mb, self.kind = self.rss.peak_above_base / 1e6, "RSS"
        return False


def _autocast_dtype(model, trainer) -> torch.dtype | None:
    """The dtype activations are computed in under the trainer's or the caller's autocast, else None."""
    mixed = getattr(getattr(trainer, "accelerator", None), "mixed_precision", "no") if trainer is not None else "no"
    if mixed in ("bf16", "fp16"):
        return torch.bfloat16 if mixed == "bf16" else torch.float16
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is not None and torch.is_autocast_enabled(param.device.type):
        return torch.get_autocast_dtype(param.device.type)
    return None


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

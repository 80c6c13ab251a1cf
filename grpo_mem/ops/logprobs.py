"""Fused selective log-softmax: per-token log-probabilities (and entropies) of a linear head without (N, V) logits.

``linear_logprobs(h, W, y)`` equals ``torch.log_softmax(h @ W.T, -1).gather(-1, y[:, None])[:, 0]`` computed in fp32,
tile by tile: the forward keeps O(N) online statistics (running max, sum of exponentials, sum of exponentials times
logit, the target logit) and the backward recomputes each tile and folds it into the gradients. Algorithm after Apple's
Cut Cross-Entropy (Wijmans et al., arXiv 2411.09009) with the entropy term of TRL 1.16's ``ChunkedLogProbFunction``.

Logits are transformed as TRL 1.16's fused head does (``trl/kernels/chunked_logprob.py``, ``_transform``):
``z = softcap * tanh((h W^T + b) * logit_scale / softcap) / temperature`` (no tanh when ``softcap`` is None).

Three backends share this math: ``"torch"`` (chunked pure torch, this file), ``"cpp"`` (``csrc/linear_logprobs.cpp``,
loaded by ``_ext`` and registered with the dispatcher as ``torch.ops.grpo_mem.*``, fake kernels below) and
``"triton"`` (``logprobs_triton``, imported on first use). ``LINEAR_BACKENDS`` and ``SLS_BACKENDS`` map each name to
its ``(forward, backward)``. ``linear_logprobs_ref`` is the naive (N, V) reference that tests and benchmarks compare
against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _ext
from ._backends import lazy, resolve
from ._rowstats import finish_row_stats

__all__ = [
    "LINEAR_BACKENDS",
    "SLS_BACKENDS",
    "LinearLogprobsFunction",
    "LogprobParams",
    "SelectiveLogSoftmaxFunction",
    "linear_logprobs",
    "linear_logprobs_ref",
    "selective_log_softmax",
    "selective_log_softmax_ref",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Tile of the torch backend: (TORCH_BLOCK_N tokens) x (TORCH_BLOCK_V vocabulary entries) in fp32 = 16 MiB per temporary.
TORCH_BLOCK_N = 1024
TORCH_BLOCK_V = 4096
# Tile of the cpp backend, its one tile policy (the C++ ops take their tiles as arguments): one fp32 buffer of
# CPP_BLOCK_N x CPP_BLOCK_V elements (32 MiB); with fewer tokens than CPP_BLOCK_N the vocabulary block widens to keep
# that size (_cpp_blocks); selective_log_softmax folds each row in CPP_BLOCK_V columns. Measured with the bench_head.py worker
# (cpp_block override), fwd+bwd, H=576: N=4096, V=49152: 4096 x 2048 took 10.9 CPU-s vs 12.3 for 2048 x 1024;
# N=1024, V=151936: 1024 x 8192 took 7.9 CPU-s vs 10.0 for 1024 x 2048.
CPP_BLOCK_N = 4096
CPP_BLOCK_V = 2048


def _cpp_blocks(n_tok: int) -> tuple[int, int]:
    """``(block_n, block_v)`` of the cpp linear head for ``n_tok`` tokens."""
    block_n = max(1, min(n_tok, CPP_BLOCK_N))
    block_v = max(CPP_BLOCK_V, (CPP_BLOCK_N * CPP_BLOCK_V // block_n) // 64 * 64)
    return block_n, block_v


def _register_fake_kernels() -> None:
    """Output shapes and dtypes of the C++ ops (``csrc/linear_logprobs.cpp`` registers their CPU kernels), so that
    FakeTensor and ``torch.compile`` can trace through them. Outputs an op does not compute are (0,)."""
    f32 = torch.float32

    @torch.library.register_fake("grpo_mem::linear_logprobs_fwd")
    def _(hidden, weight, bias, target, scale, cap, inv_t, has_cap, want_entropy, block_n, block_v):
        n = hidden.shape[0]
        return tuple(hidden.new_empty((size,), dtype=f32) for size in (n, n if want_entropy else 0, n))

    @torch.library.register_fake("grpo_mem::linear_logprobs_bwd")
    def _(
        hidden,
        weight,
        bias,
        target,
        lse,
        ent,
        g_lp,
        g_ent,
        scale,
        cap,
        inv_t,
        has_cap,
        need_dh,
        need_dw,
        need_db,
        block_n,
        block_v,
    ):
        db_like = bias if bias is not None else weight
        return (
            torch.empty_like(hidden) if need_dh else hidden.new_empty((0,)),
            torch.empty_like(weight) if need_dw else weight.new_empty((0,)),
            torch.empty_like(db_like) if need_db and bias is not None else db_like.new_empty((0,)),
        )

    @torch.library.register_fake("grpo_mem::selective_log_softmax_fwd")
    def _(logits, target, inv_t, want_entropy, block_v):
        n = logits.shape[0]
        return tuple(logits.new_empty((size,), dtype=f32) for size in (n, n if want_entropy else 0, n))

    @torch.library.register_fake("grpo_mem::selective_log_softmax_bwd")
    def _(logits, target, lse, ent, g_lp, g_ent, inv_t, block_v):
        return torch.empty_like(logits)


if _ext.HAS_EXT:
    _register_fake_kernels()


@dataclass(frozen=True)
class LogprobParams:
    """Non-tensor options of the fused head, shared by every backend.

    ``temperature`` divides the logits (> 0), ``logit_scale`` multiplies them before the soft cap, ``softcap`` is the
    final logit soft cap (None: no cap), ``return_entropy`` asks for the entropy output, ``backend`` is the resolved
    backend ("torch", "cpp" or "triton").
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    return_entropy: bool = False
    backend: str = "torch"

    @property
    def inv_t(self) -> float:
        return 1.0 / self.temperature


# ----------------------------------------------------------------------------------------------------------------------
# validation and dispatch


def _check_float(name: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} float, got {value!r}")
    return value


def _targets(index: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """int64 (N,) targets with ignored rows mapped to -1; raises ValueError on any other index outside [0, vocab)."""
    index = index.to(torch.int64)
    valid = index != ignore_index
    if index.numel():
        bad = valid & ((index < 0) | (index >= vocab))
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"index[{pos}] = {int(index[pos])} is outside [0, {vocab}) and is not ignore_index={ignore_index}"
            )
    return torch.where(valid, index, torch.full_like(index, -1)).contiguous()


# ----------------------------------------------------------------------------------------------------------------------
# references (naive: build the full logits)


def _transform(a: torch.Tensor, logit_scale: float, softcap: float | None, inv_t: float) -> torch.Tensor:
    """TRL 1.16's order: scale, soft cap, then multiply by 1/temperature. Same dtype as ``a``."""
    z = a * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_t


def linear_logprobs_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Naive reference of :func:`linear_logprobs`: builds the (N, V) logits in the inputs' dtype.

    Every intermediate (logits, log-softmax) stays in the input dtype, so with fp64 inputs it is the ground truth and
    with bf16 inputs it is the "same-dtype naive" baseline of the accuracy tests. Outputs are cast to fp32 (fp64 inputs
    give fp64 outputs). Differentiable through autograd. Same arguments as :func:`linear_logprobs`.
    """
    z = _transform(F.linear(hidden, weight, bias), logit_scale, softcap, 1.0 / temperature)
    return _select(z, index, return_entropy, ignore_index)


def selective_log_softmax_ref(
    logits: torch.Tensor, index: torch.Tensor, *, temperature: float = 1.0, return_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Naive reference of :func:`selective_log_softmax`, computed in the dtype of ``logits`` (fp32 output)."""
    return _select(logits * (1.0 / temperature), index, return_entropy, None)


def _select(z, index, return_entropy, ignore_index):
    out_dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    logsm = torch.log_softmax(z, dim=-1)
    valid = torch.ones_like(index, dtype=torch.bool) if ignore_index is None else index != ignore_index
    safe = torch.where(valid, index, torch.zeros_like(index)).to(torch.int64)
    zero = torch.zeros((), dtype=out_dtype, device=z.device)
    logp = torch.where(valid, logsm.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(out_dtype), zero)
    if not return_entropy:
        return logp
    ent = -(torch.softmax(z, dim=-1) * logsm).sum(-1)
    return logp, torch.where(valid, ent.to(out_dtype), zero)


# ----------------------------------------------------------------------------------------------------------------------
# torch backend: the tile math in fp32, chunked over tokens and vocabulary


def _fold_tile_torch(a, target, v0, m, s, sz, zy, p: LogprobParams, want_entropy: bool) -> None:
    """Fold one fp32 tile ``a`` (n, c) of pre-scale logits (bias included) into the running row statistics.

    ``m`` running max of z, ``s`` = sum exp(z - m), ``sz`` = sum exp(z - m) * (z - m) (entropy = log s - sz / s, which
    avoids the cancellation of LSE - sum p z when |z| is large), ``zy`` the target logit. All (n,) fp32, in place.
    """
    z = _transform(a, p.logit_scale, p.softcap, p.inv_t)
    c = z.shape[1]
    local = target - v0
    in_tile = (local >= 0) & (local < c)
    zy.copy_(torch.where(in_tile, z.gather(1, local.clamp(0, c - 1).unsqueeze(1)).squeeze(1), zy))
    new_m = torch.maximum(m, z.amax(1))
    # -inf logits (masked vocabulary): a row with no finite value yet keeps m = -inf and s = 0 and subtracts 0
    # instead (-inf - (-inf) is NaN); e * (z - m) is taken as 0 where e = 0 (0 * (-inf) is NaN)
    ref = torch.where(torch.isneginf(new_m), torch.zeros_like(new_m), new_m)
    alpha = torch.exp(m - ref)  # 0 while m = -inf
    z.sub_(ref.unsqueeze(1))
    e = torch.exp(z)
    if want_entropy:
        # previous rows' terms relative to the new max; s == 0 while m = -inf
        old = torch.where(s > 0, alpha * (sz + (m - ref) * s), torch.zeros_like(s))
        sz.copy_(old + torch.where(e > 0, e * z, torch.zeros_like(z)).sum(1))
    s.mul_(alpha).add_(e.sum(1))
    m.copy_(new_m)


def _grad_tile_torch(a, target, v0, lse, ent, g_lp, g_ent, p: LogprobParams) -> torch.Tensor:
    """d(loss)/d(a) for one fp32 tile ``a`` (n, c), where loss = sum g_lp * logp + sum g_ent * entropy.

    dz = g_lp * (onehot - p) - g_ent * p * (log p + H), with the target entry g_lp * (-expm1(log p_y)) formed without
    cancellation; then the 1/temperature, soft-cap (1 - tanh^2) and logit_scale chain. ``g_lp``/``g_ent`` (n,) fp32 are
    zero on ignored rows (or None: no gradient from that output). Returns a new (n, c) fp32 tensor.
    """
    u = a * p.logit_scale
    if p.softcap is not None:
        t = torch.tanh(u / p.softcap)
        logp = t * (p.softcap * p.inv_t)
    else:
        t = None
        logp = u.mul_(p.inv_t)
    logp.sub_(lse.unsqueeze(1))
    prob = torch.exp(logp)
    c = a.shape[1]
    if g_ent is not None:
        dz = (logp + ent.unsqueeze(1)).mul_(prob).mul_(-g_ent.unsqueeze(1))
        dz.masked_fill_(prob == 0, 0.0)  # p log p -> 0 at a -inf logit (0 * (-inf) is NaN)
    else:
        dz = torch.zeros_like(prob)
    if g_lp is not None:
        dz.sub_(prob * g_lp.unsqueeze(1))
        local = target - v0
        in_tile = (local >= 0) & (local < c)
        rows = in_tile.nonzero().squeeze(1)
        cols = local[rows]
        lp_y = logp[rows, cols]
        fix = g_lp[rows] * -torch.expm1(lp_y)
        if g_ent is not None:
            fix = fix - g_ent[rows] * lp_y.exp() * (lp_y + ent[rows])
        dz[rows, cols] = fix
    dz.mul_(p.inv_t)
    if t is not None:
        dz.mul_(1 - t * t)
    return dz.mul_(p.logit_scale)


def _f32_rows(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return x[lo:hi].to(torch.float32)


def linear_logprobs_fwd_torch(hidden, weight, bias, target, p: LogprobParams):
    """Chunked torch forward. Returns (logp, entropy or None, lse), each (N,) fp32; ignored rows (target -1) give 0."""
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    want_entropy = p.return_entropy
    m = torch.full((n_tok,), -math.inf, device=dev)
    s = torch.zeros(n_tok, device=dev)
    sz = torch.zeros(n_tok, device=dev)
    zy = torch.zeros(n_tok, device=dev)
    for v0 in range(0, vocab, TORCH_BLOCK_V):
        v1 = min(v0 + TORCH_BLOCK_V, vocab)
        w = _f32_rows(weight, v0, v1)
        b = None if bias is None else _f32_rows(bias, v0, v1)
        for n0 in range(0, n_tok, TORCH_BLOCK_N):
            n1 = min(n0 + TORCH_BLOCK_N, n_tok)
            a = F.linear(_f32_rows(hidden, n0, n1), w, b)
            sl = slice(n0, n1)
            _fold_tile_torch(a, target[sl], v0, m[sl], s[sl], sz[sl], zy[sl], p, want_entropy)
    return finish_row_stats(m, s, sz, zy, target, want_entropy)


def linear_logprobs_bwd_torch(
    hidden, weight, bias, target, lse, ent, g_lp, g_ent, p, need_dh, need_dw, need_db, logp=None
):
    """Chunked torch backward (vocabulary outer, tokens inner: d_weight rows finish one vocabulary block at a time, so
    the fp32 accumulator is one (block_v, H) tile unless the weight is already fp32). Returns (dh, dw, db) in the
    inputs' dtypes, None where not needed (``logp`` unused: the triton backward's input)."""
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    dh = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_dh else None
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty_like(bias) if need_db else None
    for v0 in range(0, vocab, TORCH_BLOCK_V):
        v1 = min(v0 + TORCH_BLOCK_V, vocab)
        w = _f32_rows(weight, v0, v1)
        b = None if bias is None else _f32_rows(bias, v0, v1)
        dw_acc = None
        if need_dw:
            dw_acc = (
                dw[v0:v1] if dw.dtype == torch.float32 else torch.empty((v1 - v0, weight.shape[1]), device=w.device)
            )
            dw_acc.zero_()
        db_acc = torch.zeros(v1 - v0, device=w.device) if need_db else None
        for n0 in range(0, n_tok, TORCH_BLOCK_N):
            n1 = min(n0 + TORCH_BLOCK_N, n_tok)
            h = _f32_rows(hidden, n0, n1)
            sl = slice(n0, n1)
            da = _grad_tile_torch(
                F.linear(h, w, b),
                target[sl],
                v0,
                lse[sl],
                None if ent is None else ent[sl],
                None if g_lp is None else g_lp[sl],
                None if g_ent is None else g_ent[sl],
                p,
            )
            if need_dh:
                dh[sl].addmm_(da, w)
            if need_dw:
                dw_acc.addmm_(da.t(), h)
            if need_db:
                db_acc.add_(da.sum(0))
        if need_dw and dw_acc.data_ptr() != dw[v0:v1].data_ptr():
            dw[v0:v1].copy_(dw_acc)
        if need_db:
            db[v0:v1].copy_(db_acc)
    return (dh.to(hidden.dtype) if need_dh else None), dw, db


# ----------------------------------------------------------------------------------------------------------------------
# autograd Functions and dispatch


def linear_logprobs_fwd_cpp(hidden, weight, bias, target, p: LogprobParams):
    """C++ forward (``torch.ops.grpo_mem.linear_logprobs_fwd``); returns as :func:`linear_logprobs_fwd_torch`."""
    logp, ent, lse = torch.ops.grpo_mem.linear_logprobs_fwd(
        hidden,
        weight,
        bias,
        target,
        p.logit_scale,
        p.softcap or 0.0,
        p.inv_t,
        p.softcap is not None,
        p.return_entropy,
        *_cpp_blocks(hidden.shape[0]),
    )
    return logp, (ent if p.return_entropy else None), lse


def linear_logprobs_bwd_cpp(
    hidden, weight, bias, target, lse, ent, g_lp, g_ent, p, need_dh, need_dw, need_db, logp=None
):
    """C++ backward (``torch.ops.grpo_mem.linear_logprobs_bwd``); returns as :func:`linear_logprobs_bwd_torch`
    (``logp`` unused)."""
    grads = torch.ops.grpo_mem.linear_logprobs_bwd(
        hidden,
        weight,
        bias,
        target,
        lse,
        ent,
        g_lp,
        g_ent,
        p.logit_scale,
        p.softcap or 0.0,
        p.inv_t,
        p.softcap is not None,
        need_dh,
        need_dw,
        need_db,
        *_cpp_blocks(hidden.shape[0]),
    )
    return tuple(g if need else None for g, need in zip(grads, (need_dh, need_dw, need_db)))


LINEAR_BACKENDS = {
    "torch": (linear_logprobs_fwd_torch, linear_logprobs_bwd_torch),
    "cpp": (linear_logprobs_fwd_cpp, linear_logprobs_bwd_cpp),
    "triton": (lazy("logprobs_triton", "linear_logprobs_fwd"), lazy("logprobs_triton", "linear_logprobs_bwd")),
}
"""Backend name -> ``(forward, backward)`` of the fused head. ``forward(hidden, weight, bias, target, params)`` returns
``(logp, entropy or None, lse)``, each (N,) fp32; ``backward(hidden, weight, bias, target, lse, ent, g_lp, g_ent,
params, need_dh, need_dw, need_db, logp)`` returns ``(dh, dw, db)``, None where not needed."""


def _row_grad(g, target):
    """Upstream per-row gradient as contiguous fp32 with ignored rows zeroed, or None."""
    if g is None:
        return None
    return torch.where(target >= 0, g.to(torch.float32), torch.zeros((), device=g.device)).contiguous()


class LinearLogprobsFunction(torch.autograd.Function):
    """Autograd Function of :func:`linear_logprobs` on validated inputs: apply(hidden, weight, bias, target, params)
    -> (logp, entropy or None); ``target`` is int64 (N,) with -1 on ignored rows."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, params: LogprobParams):
        ctx.set_materialize_grads(False)
        logp, ent, lse = LINEAR_BACKENDS[params.backend][0](hidden, weight, bias, target, params)
        # the triton backward takes the target term from the saved log-probs (see logprobs_triton._dlogits)
        ctx.save_for_backward(hidden, weight, bias, target, lse, ent, logp if params.backend == "triton" else None)
        ctx.params = params
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, target, lse, ent, logp = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        g_lp, g_ent = _row_grad(g_lp, target), _row_grad(g_ent, target)
        if (g_lp is None and g_ent is None) or not (need_dh or need_dw or need_db):
            return None, None, None, None, None
        dh, dw, db = LINEAR_BACKENDS[ctx.params.backend][1](
            hidden,
            weight,
            bias,
            target,
            lse,
            ent,
            g_lp,
            g_ent,
            ctx.params,
            need_dh,
            need_dw,
            need_db and bias is not None,
            logp,
        )
        return dh, dw, db, None, None


def _check_linear_inputs(hidden, weight, index, bias, temperature, logit_scale, softcap, ignore_index):
    """``linear_logprobs``' argument checks (its Raises); returns the float hyperparameters as Python floats."""
    for name, x in (("hidden", hidden), ("weight", weight), ("index", index)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (N, H), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (V, H) with H = {hidden.shape[1]}, got shape {tuple(weight.shape)}")
    if index.shape != (hidden.shape[0],):
        raise ValueError(f"index must have shape ({hidden.shape[0]},), got {tuple(index.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden and weight must be fp32, bf16 or fp16, got {hidden.dtype} and {weight.dtype}")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(f"index must be an integer tensor, got {index.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"bias must be fp32, bf16 or fp16, got {bias.dtype}")
    for name, x in (("weight", weight), ("index", index), ("bias", bias)):
        if x is not None and x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device} but hidden is on {hidden.device}")
    temperature = _check_float("temperature", temperature, positive=True)
    logit_scale = _check_float("logit_scale", logit_scale, positive=False)
    if softcap is not None:
        softcap = _check_float("softcap", softcap, positive=True)
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    return temperature, logit_scale, softcap


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities (and entropies) of a linear LM head, without building the (N, V) logits.

    Equals, in fp32, ``log_softmax(z, -1).gather(-1, index[:, None])[:, 0]`` and ``-(softmax(z) * log_softmax(z)).sum(-1)``
    with ``z = softcap * tanh((hidden @ weight.T + bias) * logit_scale / softcap) / temperature`` (TRL 1.16's order; no
    tanh when ``softcap`` is None). Extra memory: one (tokens x vocabulary) tile plus O(N) statistics, and an fp32
    d_weight accumulator when the weight is not fp32 (the cpp and torch backends keep it to one vocabulary block).

    Args:
        hidden: (N, H) fp32, bf16 or fp16 hidden states.
        weight: (V, H) head weight, float dtype; gradients flow to it only if it requires grad.
        index: (N,) integer target token ids in [0, V), or ``ignore_index``.
        bias: (V,) head bias or None.
        temperature: > 0, divides the logits.
        logit_scale: finite multiplier applied before the soft cap.
        softcap: final logit soft cap (> 0) or None.
        return_entropy: also return the entropy of each row's distribution.
        ignore_index: rows with this index give log-prob 0, entropy 0 and no gradient.
        backend: "auto" (triton on CUDA, cpp on CPU when the extension is built, torch otherwise), "torch", "cpp" or
            "triton" (CUDA, or CPU tensors with TRITON_INTERPRET=1).

    Returns:
        log-probs (N,) fp32, and entropies (N,) fp32 (nats) when ``return_entropy``.

    Raises:
        TypeError: non-tensor inputs, non-float hidden/weight, non-integer index, non-float hyperparameters.
        ValueError: bad shapes, an index outside [0, V) that is not ``ignore_index``, temperature <= 0, softcap <= 0,
            unknown backend.
        BackendUnavailableError (a ValueError): an explicitly requested backend that cannot run here.
    """
    temperature, logit_scale, softcap = _check_linear_inputs(
        hidden, weight, index, bias, temperature, logit_scale, softcap, ignore_index
    )
    resolved = resolve("linear_logprobs", backend, hidden)

    # one compute dtype for the GEMM operands (autocast-style mixed inputs): cast differentiably outside the Function
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    hidden = hidden.to(dtype).contiguous()
    weight = weight.to(dtype).contiguous()
    if bias is not None:
        bias = bias.contiguous()
    target = _targets(index, weight.shape[0], ignore_index)
    params = LogprobParams(temperature, logit_scale, softcap, bool(return_entropy), resolved)
    logp, ent = LinearLogprobsFunction.apply(hidden, weight, bias, target, params)
    return (logp, ent) if return_entropy else logp


# ----------------------------------------------------------------------------------------------------------------------
# selective_log_softmax: the same statistics over given logits


def selective_log_softmax_fwd_torch(logits, target, p: LogprobParams):
    """Row-chunked torch forward over (N, V) logits; (logp, entropy or None, lse), each (N,) fp32."""
    n_tok = logits.shape[0]
    dev = logits.device
    m = torch.full((n_tok,), -math.inf, device=dev)
    s = torch.zeros(n_tok, device=dev)
    sz = torch.zeros(n_tok, device=dev)
    zy = torch.zeros(n_tok, device=dev)
    for n0 in range(0, n_tok, TORCH_BLOCK_N):
        sl = slice(n0, min(n0 + TORCH_BLOCK_N, n_tok))
        _fold_tile_torch(logits[sl].float(), target[sl], 0, m[sl], s[sl], sz[sl], zy[sl], p, p.return_entropy)
    return finish_row_stats(m, s, sz, zy, target, p.return_entropy)


def selective_log_softmax_bwd_torch(logits, target, lse, ent, g_lp, g_ent, p):
    """Row-chunked torch backward; returns d_logits (N, V) in the dtype of ``logits``."""
    out = torch.empty_like(logits)
    for n0 in range(0, logits.shape[0], TORCH_BLOCK_N):
        sl = slice(n0, min(n0 + TORCH_BLOCK_N, logits.shape[0]))
        out[sl] = _grad_tile_torch(
            logits[sl].float(),
            target[sl],
            0,
            lse[sl],
            None if ent is None else ent[sl],
            None if g_lp is None else g_lp[sl],
            None if g_ent is None else g_ent[sl],
            p,
        )
    return out


def selective_log_softmax_fwd_cpp(logits, target, p: LogprobParams):
    """C++ forward (``torch.ops.grpo_mem.selective_log_softmax_fwd``); returns as the torch forward."""
    logp, ent, lse = torch.ops.grpo_mem.selective_log_softmax_fwd(
        logits, target, p.inv_t, p.return_entropy, CPP_BLOCK_V
    )
    return logp, (ent if p.return_entropy else None), lse


def selective_log_softmax_bwd_cpp(logits, target, lse, ent, g_lp, g_ent, p):
    """C++ backward (``torch.ops.grpo_mem.selective_log_softmax_bwd``): d_logits in the dtype of ``logits``."""
    return torch.ops.grpo_mem.selective_log_softmax_bwd(logits, target, lse, ent, g_lp, g_ent, p.inv_t, CPP_BLOCK_V)


SLS_BACKENDS = {
    "torch": (selective_log_softmax_fwd_torch, selective_log_softmax_bwd_torch),
    "cpp": (selective_log_softmax_fwd_cpp, selective_log_softmax_bwd_cpp),
    "triton": (
        lazy("logprobs_triton", "selective_log_softmax_fwd"),
        lazy("logprobs_triton", "selective_log_softmax_bwd"),
    ),
}
"""Backend name -> ``(forward, backward)`` of :func:`selective_log_softmax`: ``forward(logits, target, params)`` ->
``(logp, entropy or None, lse)``; ``backward(logits, target, lse, ent, g_lp, g_ent, params)`` -> d_logits."""


class SelectiveLogSoftmaxFunction(torch.autograd.Function):
    """Autograd Function of :func:`selective_log_softmax` on flattened, validated inputs: apply(logits (N, V),
    target (N,) int64, params) -> (logp, entropy or None)."""

    @staticmethod
    def forward(ctx, logits, target, params: LogprobParams):
        ctx.set_materialize_grads(False)
        logp, ent, lse = SLS_BACKENDS[params.backend][0](logits, target, params)
        ctx.save_for_backward(logits, target, lse, ent)
        ctx.params = params
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, target, lse, ent = ctx.saved_tensors
        p = ctx.params
        g_lp, g_ent = _row_grad(g_lp, target), _row_grad(g_ent, target)
        if (g_lp is None and g_ent is None) or not ctx.needs_input_grad[0]:
            return None, None, None
        return SLS_BACKENDS[p.backend][1](logits, target, lse, ent, g_lp, g_ent, p), None, None


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``index`` under ``softmax(logits / temperature)``, and optionally the entropies.

    Equals ``torch.log_softmax(logits.float() / temperature, -1).gather(-1, index[..., None])[..., 0]`` (TRL's
    ``selective_log_softmax``) without an fp32 copy of the logits: rows are folded chunk by chunk in fp32, and the
    backward writes d_logits (same shape and dtype as ``logits``) directly.

    Args:
        logits: (..., V) fp32, bf16 or fp16.
        index: (...) integer ids in [0, V).
        temperature: > 0.
        return_entropy: also return entropies (nats).
        backend: as in :func:`linear_logprobs`.

    Returns:
        log-probs (...) fp32, and entropies (...) fp32 when ``return_entropy``.

    Raises:
        TypeError / ValueError: non-tensor or non-float logits, non-integer index, shape mismatch, index outside
        [0, V), temperature <= 0, unknown backend.
        BackendUnavailableError (a ValueError): an explicitly requested backend that cannot run here.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(index, torch.Tensor):
        raise TypeError(f"logits and index must be tensors, got {type(logits).__name__} and {type(index).__name__}")
    if logits.dim() < 1 or logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"logits must be (..., V) fp32, bf16 or fp16, got {logits.dtype} of shape {tuple(logits.shape)}"
        )
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index must have shape {tuple(logits.shape[:-1])}, got {tuple(index.shape)}")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(f"index must be an integer tensor, got {index.dtype}")
    if index.device != logits.device:
        raise ValueError(f"index is on {index.device} but logits is on {logits.device}")
    temperature = _check_float("temperature", temperature, positive=True)
    resolved = resolve("selective_log_softmax", backend, logits)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab).contiguous()
    # no ignore_index here: every index must be a vocabulary id (-2**63 never occurs as one)
    target = _targets(index.reshape(-1), vocab, -(2**63))
    params = LogprobParams(temperature, 1.0, None, bool(return_entropy), resolved)
    logp, ent = SelectiveLogSoftmaxFunction.apply(flat, target, params)
    logp = logp.view(index.shape)
    return (logp, ent.view(index.shape)) if return_entropy else logp

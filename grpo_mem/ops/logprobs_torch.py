"""The ``"torch"`` backend of the fused selective log-softmax (``grpo_mem.ops.logprobs``): the tile math in fp32,
chunked over tokens (TORCH_BLOCK_N) and vocabulary (TORCH_BLOCK_V), on any device.
``transform_logits`` is the logit transform every backend and the references share.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._rowstats import finish_row_stats
from .logprobs_cpp import LogprobParams

__all__ = [
    "linear_logprobs_fwd",
    "linear_logprobs_bwd",
    "selective_log_softmax_fwd",
    "selective_log_softmax_bwd",
    "transform_logits",
]

# Tile of the torch backend: (TORCH_BLOCK_N tokens) x (TORCH_BLOCK_V vocabulary entries) in fp32 = 16 MiB per temporary.
TORCH_BLOCK_N = 1024


TORCH_BLOCK_V = 4096


def transform_logits(a: torch.Tensor, logit_scale: float, softcap: float | None, inv_t: float) -> torch.Tensor:
    """TRL 1.16's order: scale, soft cap, then multiply by 1/temperature. Same dtype as ``a``."""
    z = a * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_t


def _fold_tile_torch(a, target, v0, m, s, sz, zy, p: LogprobParams, want_entropy: bool) -> None:
    """Fold one fp32 tile ``a`` (n, c) of pre-scale logits (bias included) into the running row statistics.

    ``m`` running max of z, ``s`` = sum exp(z - m), ``sz`` = sum exp(z - m) * (z - m) (entropy = log s - sz / s, which
    avoids the cancellation of LSE - sum p z when |z| is large), ``zy`` the target logit. All (n,) fp32, in place.
    """
    z = transform_logits(a, p.logit_scale, p.softcap, p.inv_t)
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


def linear_logprobs_fwd(hidden, weight, bias, target, p: LogprobParams):
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


def linear_logprobs_bwd(hidden, weight, bias, target, lse, ent, g_lp, g_ent, p, need_dh, need_dw, need_db, logp=None):
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


def selective_log_softmax_fwd(logits, target, p: LogprobParams):
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


def selective_log_softmax_bwd(logits, target, lse, ent, g_lp, g_ent, p):
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

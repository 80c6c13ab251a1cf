"""Shared-prefix (two-region) attention for the completion pass of a GRPO group forward.

G completions of one prompt attend to that prompt's keys/values and, causally, to their own. Stock scoring
concatenates the prompt K/V in front of every completion (``torch.cat`` in the KV cache, then ``repeat_kv`` for GQA),
so each layer holds G·(Hq/Hkv) copies of the prompt K/V for backward. Here the prompt K/V are read in place:

* region 1 (prompt): for each unique prompt, the queries of all completions that share it and the Hq/Hkv query heads
  of one kv head are folded into one ``(n_u·rep·C, d)`` matrix against that prompt's ``(P, d)`` keys;
* region 2 (completion): per-row causal attention over the completion's own keys;
* the two partial results ``(o_r, l_r)`` (output normalised within the region, log-sum-exp of its scaled scores) merge
  exactly by ``o = (e^{l_1} o_1 + e^{l_2} o_2) / (e^{l_1} + e^{l_2})``.

Backward is FlashAttention-2's (Dao, arXiv 2307.08691, Alg. 2) applied to each region with the merged output and
log-sum-exp: ``P = exp(S − L)``, ``D = rowsum(dO ∘ O)``, ``dS = P ∘ (dP − D)``. Probabilities are recomputed, so the
autograd graph holds only the inputs, the output and the (B, Hq, C) fp32 log-sum-exp. The two-region split with an
LSE merge follows Hydragen (arXiv 2402.05099) and ring-flash-attention's ``_update_out_and_lse``; the fused CUDA
analogue is DualKV (arXiv 2605.15422).

Backends: ``"torch"`` (any device, chunked so temporaries stay bounded), ``"cpu"`` (the same two regions on ATen's
fused CPU attention kernels, whose forward returns the log-sum-exp and whose backward takes the merged output and
log-sum-exp), ``"triton"`` (``attention_triton.py``; CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._backends import aten_cpu_attention, resolve

__all__ = [
    "shared_prefix_attention",
    "shared_prefix_attention_ref",
    "SharedPrefixAttentionFunction",
    "SharedPrefixAttentionParams",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements of one fp32 score matrix chunk in the torch path (4 MiB at fp32). Backward holds about four such matrices
# (S, P, dP, dS) at a time, forward two.
_DEFAULT_CHUNK_ELEMS = 1 << 20


@dataclass(frozen=True)
class SharedPrefixAttentionParams:
    """Non-tensor options of :class:`SharedPrefixAttentionFunction`.

    scale: softmax scale applied to ``q·k`` (dimensionless, usually ``d**-0.5``).
    backend: ``"torch"``, ``"cpu"`` or ``"triton"`` (already resolved, never ``"auto"``).
    chunk_elems: upper bound on the elements of one score matrix chunk in the torch path.
    """

    scale: float
    backend: str
    chunk_elems: int = _DEFAULT_CHUNK_ELEMS


# ----------------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, scale, sync=True):
    """Validate shapes, dtypes and devices; returns ``(B, Hq, Hkv, C, P, U, d)``.

    ``prefix_index`` values are checked on the host (two reads back) when ``sync``; otherwise by ``torch._assert_async``,
    which on CUDA fails the next synchronising call instead of stalling this one (the Triton path reads nothing back).
    """
    names = ("q", "k", "v", "prefix_k", "prefix_v")
    tensors = (q, k, v, prefix_k, prefix_v)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {t.dtype}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    B, Hq, C, d = q.shape
    if tuple(k.shape[:1]) != (B,) or k.shape[2:] != (C, d):
        raise ValueError(f"k must have shape (B={B}, Hkv, C={C}, d={d}), got {tuple(k.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of kv heads Hkv={Hkv}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    U, Hkv_p, P, d_p = prefix_k.shape
    if Hkv_p != Hkv or d_p != d:
        raise ValueError(f"prefix_k must have shape (U, Hkv={Hkv}, P, d={d}), got {tuple(prefix_k.shape)}")
    if prefix_v.shape != prefix_k.shape:
        raise ValueError(f"prefix_v shape {tuple(prefix_v.shape)} must equal prefix_k shape {tuple(prefix_k.shape)}")
    if U == 0 and B > 0:
        raise ValueError(f"prefix_k holds U=0 prompts for B={B} rows")
    if not isinstance(prefix_index, torch.Tensor):
        raise TypeError(f"prefix_index must be a torch.Tensor, got {type(prefix_index).__name__}")
    if prefix_index.dtype != torch.int64:
        raise TypeError(f"prefix_index must be int64, got {prefix_index.dtype}")
    if tuple(prefix_index.shape) != (B,):
        raise ValueError(f"prefix_index must have shape (B={B},), got {tuple(prefix_index.shape)}")
    if prefix_index.device != q.device:
        raise ValueError(f"prefix_index is on {prefix_index.device} but q is on {q.device}")
    if B > 0 and sync:
        lo, hi = int(prefix_index.min()), int(prefix_index.max())
        if lo < 0 or hi >= U:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prefix_index values must lie in [0, U={U}), got {bad}")
    elif B > 0:
        in_range = ((prefix_index >= 0) & (prefix_index < U)).all()
        torch._assert_async(in_range, f"prefix_index values must lie in [0, U={U})")
    if not isinstance(prefix_mask, torch.Tensor) or prefix_mask.dtype != torch.bool:
        raise TypeError(f"prefix_mask must be a bool tensor, got {getattr(prefix_mask, 'dtype', type(prefix_mask))}")
    if tuple(prefix_mask.shape) != (U, P):
        raise ValueError(f"prefix_mask must have shape (U={U}, P={P}), got {tuple(prefix_mask.shape)}")
    if prefix_mask.device != q.device:
        raise ValueError(f"prefix_mask is on {prefix_mask.device} but q is on {q.device}")
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
            raise TypeError(f"key_mask must be a bool tensor or None, got {getattr(key_mask, 'dtype', type(key_mask))}")
        if tuple(key_mask.shape) != (B, C):
            raise ValueError(f"key_mask must have shape (B={B}, C={C}), got {tuple(key_mask.shape)}")
        if key_mask.device != q.device:
            raise ValueError(f"key_mask is on {key_mask.device} but q is on {q.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    return B, Hq, Hkv, C, P, U, d


# ----------------------------------------------------------------------------------------------------------------------
# naive reference
# ----------------------------------------------------------------------------------------------------------------------


def shared_prefix_attention_ref(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask=None, *, scale):
    """Naive reference: materialise ``[prefix_k[prefix_index]; k]`` per row and run masked softmax attention.

    Equals ``softmax(scale · q [K_p; K]^T + mask) [V_p; V]`` with the prompt K/V of row b gathered from
    ``prefix_k[prefix_index[b]]`` and the kv heads repeated ``Hq // Hkv`` times; computed in the input dtype (fp64 if
    given fp64), so it serves both as the exact truth and as "the naive same-dtype result". A query with no visible key
    outputs 0. Memory: O(B·Hq·C·(P+C)); for tests and benchmarks only.

    Args and return: as :func:`shared_prefix_attention`. Raises ``ValueError``/``TypeError`` on bad input.
    """
    B, Hq, Hkv, C, P, U, d = _check_inputs(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, scale)
    rep = Hq // Hkv
    keys = torch.cat([prefix_k[prefix_index], k], dim=2).repeat_interleave(rep, dim=1)  # (B, Hq, P+C, d)
    values = torch.cat([prefix_v[prefix_index], v], dim=2).repeat_interleave(rep, dim=1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    comp_vis = causal.expand(B, C, C)
    if key_mask is not None:
        comp_vis = comp_vis & key_mask[:, None, :]
    pref_vis = prefix_mask[prefix_index][:, None, :].expand(B, C, P)
    visible = torch.cat([pref_vis, comp_vis], dim=2)[:, None]  # (B, 1, C, P+C)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    has_key = visible.any(dim=-1, keepdim=True)
    # A row without visible keys would be all -inf (NaN softmax); give it zeros instead, with zero gradient.
    scores = scores.masked_fill(~has_key, 0.0)
    probs = torch.softmax(scores, dim=-1) * has_key
    return torch.matmul(probs, values)


# ----------------------------------------------------------------------------------------------------------------------
# torch zero-copy path
# ----------------------------------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the torch path: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _groups(prefix_index: torch.Tensor, U: int):
    """Rows of each prompt: list of ``(u, rows)`` with ``rows`` an int64 tensor of row indices, ascending."""
    order = torch.argsort(prefix_index, stable=True)
    counts = torch.bincount(prefix_index, minlength=U).tolist()
    out, start = [], 0
    for u, n in enumerate(counts):
        if n:
            out.append((u, order[start:start + n]))
            start += n
    return out


def _query_chunks(rows: torch.Tensor, per_row: int, C: int, budget: int):
    """Split the queries of ``rows`` into chunks ``(rows_chunk, c0, c1)`` of at most ``budget`` score elements.

    ``per_row`` is the number of score elements one query position of one row produces (all heads, all keys).
    Whole rows are grouped while they fit; a row too large on its own is split along its C query positions.
    """
    row_elems = per_row * C
    if row_elems <= budget:
        nb = max(1, budget // max(row_elems, 1))
        return [(rows[i:i + nb], 0, C) for i in range(0, rows.numel(), nb)]
    cl = max(1, budget // max(per_row, 1))
    return [(rows[i:i + 1], c0, min(C, c0 + cl)) for i in range(rows.numel()) for c0 in range(0, C, cl)]


def _take(x: torch.Tensor, rows: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """``x[rows, :, c0:c1]`` for x of shape (B, H, C, ...), via ``index_select`` (faster than advanced indexing)."""
    x = x.index_select(0, rows)
    return x if c0 == 0 and c1 == x.shape[2] else x[:, :, c0:c1]


def _put(x: torch.Tensor, rows: torch.Tensor, c0: int, c1: int, val: torch.Tensor, accumulate: bool = False):
    """``x[rows, :, c0:c1] = val`` (or ``+=``) in place; ``rows`` holds no duplicates."""
    if c0 == 0 and c1 == x.shape[2]:
        (x.index_add_ if accumulate else x.index_copy_)(0, rows, val)
    elif accumulate:
        x[rows, :, c0:c1] += val
    else:
        x[rows, :, c0:c1] = val


def _fold(x: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(n, Hq, c, d) → (Hkv, n·rep·c, d): the queries of one kv head across rows and its query heads, as one matrix."""
    n, Hq, c, d = x.shape
    return x.reshape(n, Hkv, Hq // Hkv, c, d).transpose(0, 1).reshape(Hkv, -1, d)


def _unfold(x: torch.Tensor, n: int, Hq: int, c: int) -> torch.Tensor:
    """Inverse of :func:`_fold` for a trailing dim of any size: (Hkv, n·rep·c, e) → (n, Hq, c, e)."""
    Hkv, _, e = x.shape
    return x.reshape(Hkv, n, Hq // Hkv, c, e).transpose(0, 1).reshape(n, Hq, c, e)


def _completion_visibility(rows, c0, c1, C, rep, key_mask, device):
    """Bool (n, 1, rep·(c1−c0), C): query position i sees completion key j iff j ≤ i and key_mask[row, j]."""
    qpos = torch.arange(c0, c1, device=device)
    vis = torch.arange(C, device=device)[None, :] <= qpos[:, None]  # (c, C)
    vis = vis.repeat(rep, 1)[None, None]  # (1, 1, rep·c, C)
    if key_mask is not None:
        vis = vis & key_mask[rows][:, None, None, :]
    return vis


def _prefix_region_fwd(q, prefix_k, prefix_v, prefix_mask, groups, Hkv, scale, budget, o_acc, l_acc):
    """Region 1 forward. Writes the normalised region output into ``o_acc`` and its LSE into ``l_acc``."""
    B, Hq, C, d = q.shape
    P = prefix_k.shape[2]
    acc = o_acc.dtype
    for u, rows in groups:
        ku = prefix_k[u].to(acc)  # (Hkv, P, d): at most one copy per prompt, never per row
        vu = prefix_v[u].to(acc)
        kmask = prefix_mask[u]  # (P,)
        for rc, c0, c1 in _query_chunks(rows, Hq * P, C, budget):
            n, c = rc.numel(), c1 - c0
            qc = _fold(_take(q, rc, c0, c1).to(acc), Hkv)  # (Hkv, M, d)
            s = torch.matmul(qc, ku.transpose(1, 2)).mul_(scale)  # (Hkv, M, P)
            s.masked_fill_(~kmask, float("-inf"))
            lse = torch.logsumexp(s, dim=-1)  # (Hkv, M), -inf where no key visible
            s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
            o = torch.matmul(s, vu)  # (Hkv, M, d), normalised
            _put(o_acc, rc, c0, c1, _unfold(o, n, Hq, c))
            _put(l_acc, rc, c0, c1, _unfold(lse[..., None], n, Hq, c)[..., 0])


def _completion_region_fwd(q, k, v, key_mask, Hkv, scale, budget, o_acc, l_acc):
    """Region 2 forward (per-row causal). Same outputs as :func:`_prefix_region_fwd`."""
    B, Hq, C, d = q.shape
    rep = Hq // Hkv
    acc = o_acc.dtype
    all_rows = torch.arange(B, device=q.device)
    for rc, c0, c1 in _query_chunks(all_rows, Hq * C, C, budget):
        n, c = rc.numel(), c1 - c0
        qc = _take(q, rc, c0, c1).to(acc).reshape(n, Hkv, rep * c, d)
        kc, vc = k.index_select(0, rc).to(acc), v.index_select(0, rc).to(acc)  # (n, Hkv, C, d)
        s = torch.matmul(qc, kc.transpose(-1, -2)).mul_(scale)  # (n, Hkv, rep·c, C)
        s.masked_fill_(~_completion_visibility(rc, c0, c1, C, rep, key_mask, q.device), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
        o = torch.matmul(s, vc)  # (n, Hkv, rep·c, d)
        _put(o_acc, rc, c0, c1, o.reshape(n, Hq, c, d))
        _put(l_acc, rc, c0, c1, lse.reshape(n, Hq, c))


def _merge(o1, l1, o2, l2):
    """Exact LSE merge of two normalised partial attentions; rows with no visible key in either region give 0."""
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    w1 = torch.exp(l1 - safe)[..., None]  # exp(-inf) = 0 for an empty region
    w2 = torch.exp(l2 - safe)[..., None]
    return o1 * w1 + o2 * w2, lse


def _torch_fwd(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, params):
    """Torch forward: returns ``(out in q.dtype (B, Hq, C, d), lse (B, Hq, C))``, lse fp32 (fp64 for fp64 inputs)."""
    B, Hq, C, d = q.shape
    Hkv, U = k.shape[1], prefix_k.shape[0]
    dev, acc = q.device, _acc_dtype(q.dtype)
    o1 = torch.zeros(B, Hq, C, d, dtype=acc, device=dev)
    l1 = torch.full((B, Hq, C), float("-inf"), dtype=acc, device=dev)
    o2, l2 = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))
    _prefix_region_fwd(q, prefix_k, prefix_v, prefix_mask, _groups(prefix_index, U), Hkv, params.scale,
                       params.chunk_elems, o1, l1)
    _completion_region_fwd(q, k, v, key_mask, Hkv, params.scale, params.chunk_elems, o2, l2)
    out, lse = _merge(o1, l1, o2, l2)
    return out.to(q.dtype), lse


def _torch_bwd(dout, q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, out, lse, params):
    """Torch backward, FlashAttention-2 style per region with the merged ``out``/``lse``.

    Returns ``(dq, dk, dv, dprefix_k, dprefix_v)`` in the accumulation dtype (fp32; fp64 for fp64 inputs); prompt
    gradients are summed in that dtype over every row of the prompt's group and every query head of the kv head.
    """
    B, Hq, C, d = q.shape
    Hkv, U, P = k.shape[1], prefix_k.shape[0], prefix_k.shape[2]
    rep = Hq // Hkv
    scale, budget = params.scale, params.chunk_elems
    dev, acc = q.device, _acc_dtype(q.dtype)
    do32 = dout.to(acc)
    delta = (do32 * out.to(acc)).sum(-1)  # (B, Hq, C): D = rowsum(dO ∘ O)
    lse_safe = torch.where(torch.isinf(lse), 0.0, lse)  # empty rows: every score is -inf, so P = 0 there
    dq = torch.zeros(B, Hq, C, d, dtype=acc, device=dev)
    dpk = torch.zeros(U, Hkv, P, d, dtype=acc, device=dev)
    dpv = torch.zeros_like(dpk)
    dk = torch.zeros(B, Hkv, C, d, dtype=acc, device=dev)
    dv = torch.zeros_like(dk)

    # region 1: the prompt, queries of a whole group folded against its keys
    for u, rows in _groups(prefix_index, U):
        ku, vu = prefix_k[u].to(acc), prefix_v[u].to(acc)
        kmask = prefix_mask[u]
        for rc, c0, c1 in _query_chunks(rows, Hq * P, C, budget):
            n, c = rc.numel(), c1 - c0
            qc = _fold(_take(q, rc, c0, c1).to(acc), Hkv)  # (Hkv, M, d)
            doc = _fold(_take(do32, rc, c0, c1), Hkv)
            lc = _fold(_take(lse_safe, rc, c0, c1)[..., None], Hkv)  # (Hkv, M, 1)
            dc = _fold(_take(delta, rc, c0, c1)[..., None], Hkv)
            p = torch.matmul(qc, ku.transpose(1, 2)).mul_(scale)  # (Hkv, M, P)
            p.masked_fill_(~kmask, float("-inf")).sub_(lc).exp_()
            dpv[u] += torch.matmul(p.transpose(1, 2), doc)
            ds = torch.matmul(doc, vu.transpose(1, 2)).sub_(dc).mul_(p)  # dS = P ∘ (dP − D)
            del p
            _put(dq, rc, c0, c1, _unfold(torch.matmul(ds, ku), n, Hq, c).mul_(scale), accumulate=True)
            dpk[u] += torch.matmul(ds.transpose(1, 2), qc).mul_(scale)

    # region 2: each row's own completion, causal
    all_rows = torch.arange(B, device=dev)
    for rc, c0, c1 in _query_chunks(all_rows, Hq * C, C, budget):
        n, c = rc.numel(), c1 - c0
        qc = _take(q, rc, c0, c1).to(acc).reshape(n, Hkv, rep * c, d)
        doc = _take(do32, rc, c0, c1).reshape(n, Hkv, rep * c, d)
        lc = _take(lse_safe, rc, c0, c1).reshape(n, Hkv, rep * c, 1)
        dc = _take(delta, rc, c0, c1).reshape(n, Hkv, rep * c, 1)
        kc, vc = k.index_select(0, rc).to(acc), v.index_select(0, rc).to(acc)
        p = torch.matmul(qc, kc.transpose(-1, -2)).mul_(scale)  # (n, Hkv, rep·c, C)
        p.masked_fill_(~_completion_visibility(rc, c0, c1, C, rep, key_mask, dev), float("-inf"))
        p.sub_(lc).exp_()
        dv.index_add_(0, rc, torch.matmul(p.transpose(-1, -2), doc))
        ds = torch.matmul(doc, vc.transpose(-1, -2)).sub_(dc).mul_(p)
        del p
        _put(dq, rc, c0, c1, torch.matmul(ds, kc).mul_(scale).reshape(n, Hq, c, d), accumulate=True)
        dk.index_add_(0, rc, torch.matmul(ds.transpose(-1, -2), qc).mul_(scale))
    return dq, dk, dv, dpk, dpv


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility → additive mask (0 visible, −inf hidden) in ``dtype``, as the ATen CPU kernels take it."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _region2_layout(q, k, key_mask, Hkv):
    """Region 2 as one batched attention: queries (B, Hkv, rep·C, d) against each row's own (B, Hkv, C, d) keys,
    with the (B, 1, rep·C, C) causal-and-padding mask. Folding the query heads of a kv head avoids repeating K/V."""
    B, Hq, C, d = q.shape
    rows = torch.arange(B, device=q.device)
    visible = _completion_visibility(rows, 0, C, C, Hq // Hkv, key_mask, q.device)
    return q.reshape(B, Hkv, -1, d), _additive(visible, q.dtype)


def _has_key(prefix_index, prefix_mask, key_mask, B, Hq, C, device):
    """(B, Hq, C) bool: which queries see at least one key in region 1 and region 2 (the kernels report LSE 0, not
    −inf, for a query that sees none)."""
    has1 = prefix_mask.any(-1)[prefix_index][:, None, None].expand(B, Hq, C)
    seen = torch.ones(B, C, dtype=torch.bool, device=device) if key_mask is None else key_mask.cumsum(-1) > 0
    return has1, seen[:, None, :].expand(B, Hq, C)


def _cpu_fwd(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, params):
    """Forward on ATen's fused CPU kernels: one call per unique prompt (its group's queries folded against its K/V in
    place) and one batched call for the completions; merged by LSE. Returns ``(out in q.dtype, lse fp32)``."""
    fwd, _ = aten_cpu_attention()
    B, Hq, C, d = q.shape
    Hkv, U = k.shape[1], prefix_k.shape[0]
    acc = _acc_dtype(q.dtype)
    o1 = torch.empty(B, Hq, C, d, dtype=acc, device=q.device)
    l1 = torch.empty(B, Hq, C, dtype=acc, device=q.device)
    for u, rows in _groups(prefix_index, U):
        n = rows.numel()
        qu = _fold(q.index_select(0, rows), Hkv)[None]  # (1, Hkv, n·rep·C, d)
        mask = _additive(prefix_mask[u][None, None, None, :], q.dtype)
        o, lse = fwd(qu, prefix_k[u : u + 1], prefix_v[u : u + 1], 0.0, False, attn_mask=mask, scale=params.scale)
        o1.index_copy_(0, rows, _unfold(o[0].to(acc), n, Hq, C))
        l1.index_copy_(0, rows, _unfold(lse[0, ..., None].to(acc), n, Hq, C)[..., 0])
    q2, mask2 = _region2_layout(q, k, key_mask, Hkv)
    o2, l2 = fwd(q2, k, v, 0.0, False, attn_mask=mask2, scale=params.scale)
    o2, l2 = o2.reshape(B, Hq, C, d).to(acc), l2.reshape(B, Hq, C).to(acc)
    has1, has2 = _has_key(prefix_index, prefix_mask, key_mask, B, Hq, C, q.device)
    l1.masked_fill_(~has1, float("-inf"))
    l2 = l2.masked_fill(~has2, float("-inf"))
    out, lse = _merge(o1, l1, o2, l2)
    return out.to(q.dtype), lse


def _cpu_bwd(dout, q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, out, lse, params):
    """Backward on ATen's fused CPU kernels: each region's FlashAttention-2 backward given the merged ``out`` and
    ``lse``, so the kernel's ``D = rowsum(dO ∘ O)`` and ``P = exp(S − L)`` are those of the whole attention."""
    _, bwd = aten_cpu_attention()
    B, Hq, C, d = q.shape
    Hkv, U = k.shape[1], prefix_k.shape[0]
    lse = torch.where(torch.isinf(lse), 0.0, lse).to(_acc_dtype(q.dtype))  # no key: all P = exp(−inf) = 0
    dout = dout.contiguous()
    dq = torch.zeros(B, Hq, C, d, dtype=_acc_dtype(q.dtype), device=q.device)
    dpk, dpv = torch.zeros_like(prefix_k), torch.zeros_like(prefix_v)
    for u, rows in _groups(prefix_index, U):
        n = rows.numel()
        fold = lambda x: _fold(x.index_select(0, rows), Hkv)[None]  # noqa: E731
        fold_l = _fold(lse.index_select(0, rows)[..., None], Hkv)[None, ..., 0]
        mask = _additive(prefix_mask[u][None, None, None, :], q.dtype)
        g = bwd(fold(dout), fold(q), prefix_k[u : u + 1], prefix_v[u : u + 1], fold(out), fold_l, 0.0, False,
                attn_mask=mask, scale=params.scale)  # fmt: skip
        dq.index_add_(0, rows, _unfold(g[0][0].to(dq.dtype), n, Hq, C))
        dpk[u], dpv[u] = g[1][0], g[2][0]
    q2, mask2 = _region2_layout(q, k, key_mask, Hkv)
    g = bwd(dout.reshape(B, Hkv, -1, d), q2, k, v, out.reshape(B, Hkv, -1, d), lse.reshape(B, Hkv, -1), 0.0, False,
            attn_mask=mask2, scale=params.scale)  # fmt: skip
    dq += g[0].reshape(B, Hq, C, d)
    return dq, g[1], g[2], dpk, dpv


class SharedPrefixAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves only the inputs, the output and the fp32 log-sum-exp; recomputes scores in backward.

    ``forward(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, params)`` → ``out``; see
    :func:`shared_prefix_attention` for shapes. ``params`` is a :class:`SharedPrefixAttentionParams`.
    """

    @staticmethod
    def forward(ctx, q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, params):
        if params.backend == "triton":
            from .attention_triton import shared_prefix_attention_fwd

            out, lse = shared_prefix_attention_fwd(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask,
                                                   params.scale)
        elif params.backend == "cpu":
            out, lse = _cpu_fwd(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, params)
        else:
            out, lse = _torch_fwd(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, params)
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, out, lse)
        ctx.params = params
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, out, lse = ctx.saved_tensors
        params = ctx.params
        if params.backend == "triton":
            from .attention_triton import shared_prefix_attention_bwd

            grads = shared_prefix_attention_bwd(dout, q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask,
                                                key_mask, out, lse, params.scale)
        elif params.backend == "cpu":
            grads = _cpu_bwd(dout, q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, out, lse, params)
        else:
            grads = _torch_bwd(dout, q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, out, lse,
                               params)
        dq, dk, dv, dpk, dpv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v, prefix_k, prefix_v)))
        return dq, dk, dv, dpk, dpv, None, None, None, None


def shared_prefix_attention(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask=None, *, scale,
                            backend="auto"):
    """Causal attention of completion queries over ``[own prompt ; own completion]`` without copying the prompt K/V.

    Equals :func:`shared_prefix_attention_ref`, i.e. for each row b, with ``rep = Hq // Hkv``::

        K = torch.cat([prefix_k[prefix_index[b]], k[b]], dim=1).repeat_interleave(rep, 0)   # (Hq, P+C, d)
        V = torch.cat([prefix_v[prefix_index[b]], v[b]], dim=1).repeat_interleave(rep, 0)
        visible[i, j] = prefix_mask[prefix_index[b], j]                  for j < P
                      = (j − P ≤ i) and key_mask[b, j − P]                for j ≥ P
        out[b] = softmax(scale · q[b] K^T masked by visible) V

    but never builds ``prefix_k[prefix_index]`` or GQA-repeated K/V: the prompt K/V are read in place, once per
    unique prompt, and the two regions are merged by log-sum-exp. A query with no visible key outputs 0 with zero
    gradient. Query head h uses kv head ``h // rep``. Accumulation is fp32 (fp64 for fp64 inputs).

    Args:
        q: (B, Hq, C, d) completion queries after RoPE; fp16, bf16, fp32, or fp64 (torch backend only, fp64 throughout).
        k, v: (B, Hkv, C, d) the completions' own keys/values after RoPE, q's dtype.
        prefix_k, prefix_v: (U, Hkv, P, d) the U unique prompts' keys/values after RoPE, q's dtype; prompts may be
            left-padded to a common P (padding masked by ``prefix_mask``).
        prefix_index: (B,) int64 in [0, U): the prompt of row b. Rows need not be sorted; groups may differ in size.
        prefix_mask: (U, P) bool, True where the prompt key position is real.
        key_mask: (B, C) bool, True where the completion key position is real; None means all real.
        scale: softmax scale (``module.scaling``), a finite positive Python float.
        backend: ``"torch"`` (chunked matmuls, any device), ``"cpu"`` (ATen's fused CPU attention kernels, called
            once per unique prompt on its folded queries and once for all completions), ``"triton"`` (fp16/bf16/fp32;
            reads q/k/v and the prompt K/V in place with their strides and never synchronises with the host), or
            ``"auto"`` (triton for fp16/bf16/fp32 CUDA tensors, torch for fp64 CUDA tensors, cpu for CPU tensors,
            torch otherwise).

    Returns:
        (B, Hq, C, d) tensor of q's dtype. Differentiable in q, k, v, prefix_k, prefix_v (prompt gradients are summed
        in fp32 over all rows sharing the prompt). Memory kept for backward: the inputs, the output and a
        (B, Hq, C) fp32 log-sum-exp.

    Raises:
        ValueError: bad shapes, ``Hq % Hkv != 0``, ``prefix_index`` out of range, mismatched devices, non-positive
            scale, unknown backend; ``BackendUnavailableError`` (a ValueError) for an explicitly requested backend that
            cannot run here (``"triton"`` without CUDA or the interpreter, or with fp64 inputs).
        RuntimeError: ``prefix_index`` out of range on the triton backend (``torch._assert_async``: at once on CPU, at
            the next synchronising call on CUDA).
        TypeError: non-tensor arguments, non-float q/k/v, non-int64 ``prefix_index``, non-bool masks.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    backend = resolve("shared_prefix_attention", backend, q)
    # the Triton path must not stall the host on each layer: its index check runs on the device
    _check_inputs(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, scale, sync=backend != "triton")
    params = SharedPrefixAttentionParams(scale=float(scale), backend=backend)
    return SharedPrefixAttentionFunction.apply(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask,
                                               params)

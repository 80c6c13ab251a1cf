"""The ``"sdpa"`` backend of multi-region attention: the regions on PyTorch's fused CUDA attention kernels (the
FlashAttention-2 and memory-efficient kernels ATen ships behind ``scaled_dot_product_attention``), every entry of a
region in one launch, with no host synchronisation.

A query row's softmax over the union of its regions is the log-sum-exp merge of per-region softmaxes
(``attention_cpu.merge_lse_``). Forward: a shared region is one varlen FlashAttention call
(``aten._flash_attention_forward`` with ``cum_seq_q``/``cum_seq_k``) in which sequence u is entry u's real keys
against the queries of every row reading u (rows sorted by entry, all their C positions and Hq heads; the kernel
reads one kv head for its Hq/Hkv query heads, so an entry's K/V are read once and never repeated); padding keys are
moved behind every sequence, so any key mask is exact. The own region is one dense causal FlashAttention call
(``key_mask`` None), or one memory-efficient call with the causal-and-padding mask as an additive bias (the query
heads of a kv head folded into the query length). Backward: each call's FlashAttention-2 backward (Dao, arXiv
2307.08691, Alg. 2) given the merged output O and the merged log-sum-exp L: inside it P = exp(S - L) is the global
probability and D = rowsum(dO * O) the global term, so the per-region dQ add up and each region's dK, dV are exact
(PyTorch's context-parallel ring attention does the same with its flash and efficient kernels).

The mechanism (a region packed into varlen sequences, unpacked, merged; the backward with merged statistics) is
written once against a :class:`FusedKernels` set, with torch operations only, on any device; ``CUDA_KERNELS`` is this
backend's set. tests/ops/test_cuda_backends.py runs the mechanism on CPU with ATen's CPU flash kernels as a set with
FlashAttention's conventions, and the CUDA set on meta tensors (ATen's meta kernels give the CUDA kernels' layouts).

Capabilities (``_backends.TABLE``): fp16 and bf16 (FlashAttention-2's dtypes; fp32 goes to Triton), head dim a
multiple of 8 up to 256, compute capability 8.0 or newer; no soft-capping or sliding window (not expressible for rows
folded into one sequence: ``resolve`` passes such calls to Triton); sinks are merged outside every backend
(``attention._add_sinks``). Host reads: none (``max_seqlen_q`` is bounded by B·C from the shapes, not read back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .attention_cpu import acc_dtype, merge_lse_, own_layout

__all__ = [
    "CUDA_KERNELS",
    "FusedKernels",
    "RegionPlan",
    "fused_bwd",
    "fused_fwd",
    "multi_region_attention_bwd",
    "multi_region_attention_fwd",
    "region_plan",
]


@dataclass(frozen=True)
class FusedKernels:
    """The fused attention kernels :func:`fused_fwd` / :func:`fused_bwd` run on, with FlashAttention-2's conventions.

    ``varlen_fwd(q (Tq, Hq, d), k (Tk, Hkv, d), v, cu_q, cu_k, max_q, max_k, scale)`` -> ``(out (Tq, Hq, d) in q's
    dtype, lse (Hq, Tq) fp32)``: sequence i is queries ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]``
    (int32 (n+1,) offsets; ``max_q``/``max_k`` bound the lengths), no mask, query head h reading kv head
    h // (Hq/Hkv). ``varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale)`` -> ``(dq, dk, dv)``
    shaped as q, k, v. Rows outside every sequence, keys outside every sequence and sequences without keys may hold
    any values (the mechanism masks them).

    ``causal_fwd(q (B, Hq, C, d), k (B, Hkv, C, d), v, scale)`` -> ``(out (B, Hq, C, d), lse (B, Hq, C) fp32)``:
    causal attention within each row; ``causal_bwd(dout, q, k, v, out, lse, scale)`` -> ``(dq, dk, dv)``.

    ``masked_fwd(q (B, H, L, d), k (B, H, S, d), v, bias (B, 1, L, S) additive in q's dtype, scale)`` -> ``(out,
    lse (B, H, L) fp32)``; a row whose bias is -inf everywhere may hold any values. ``masked_bwd(dout, q, k, v, out,
    lse, bias, scale)`` -> ``(dq, dk, dv)``.

    The backward halves take the merged output and log-sum-exp of the whole attention (finite: -inf replaced by 0).
    """

    varlen_fwd: Callable
    varlen_bwd: Callable
    causal_fwd: Callable
    causal_bwd: Callable
    masked_fwd: Callable
    masked_bwd: Callable


@dataclass(frozen=True)
class RegionPlan:
    """One region as varlen sequences, built on the device from its index and mask (no host read).

    rows: (B,) int64, the rows in packed order (by entry, stable; rows reading nothing last). key_u, key_s: (U·S,)
    int64, the packed keys' entry and position (entry 0's real keys, entry 1's, ..., then every padding key). cu_q,
    cu_k: (U+1,) int32 offsets of each entry's queries (C per reading row) and real keys. valid: (B,) bool, the row
    reads an entry with a real key. keep: (U, S) bool, the real keys of entries some row reads (the keys whose
    gradient is not 0). max_q = max(B·C, 2), max_k = S: bounds of a sequence's lengths (from the shapes, so nothing
    is read back; FlashAttention sizes its grid by them).
    """

    rows: torch.Tensor
    key_u: torch.Tensor
    key_s: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    valid: torch.Tensor
    keep: torch.Tensor
    max_q: int
    max_k: int


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """int32 (n+1,) exclusive prefix sums of int64 (n,) ``counts``, starting at 0."""
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)


def region_plan(index: torch.Tensor, mask: torch.Tensor, C: int) -> RegionPlan:
    """The :class:`RegionPlan` of a region read by rows of ``C`` queries: ``index`` (B,) int64 in [-1, U) (the entry
    each row reads, -1 none), ``mask`` (U, S) bool (True at real keys, padding anywhere). Sorts, scatters and prefix
    sums on ``index``'s device; reads nothing back."""
    U, S = mask.shape
    B = index.shape[0]
    entry = torch.where(index >= 0, index, U)
    rows = torch.argsort(entry, stable=True)
    readers = torch.zeros(U + 1, dtype=torch.int64, device=index.device)
    readers = readers.scatter_add_(0, entry, torch.ones_like(entry))[:U]
    real = mask.sum(1)
    keys = torch.argsort((~mask).flatten().to(torch.int32), stable=True)
    valid = (index >= 0) & (real.index_select(0, index.clamp(min=0)) > 0)
    keep = mask & (readers > 0)[:, None]
    # max_q >= 2: FlashAttention-2 reshapes queries for max_seqlen_q == 1 (decoding) as if every sequence had one
    return RegionPlan(
        rows, keys // S, keys % S, _offsets(readers * C), _offsets(real), valid, keep, max_q=max(B * C, 2), max_k=S
    )


def _pack_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B, H, C, e) -> (B·C, H, e): the rows in ``rows``' order, each row's C positions in order."""
    B, H, C, e = x.shape
    return x.transpose(1, 2).index_select(0, rows).reshape(B * C, H, e)


def _unsort(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Row ``rows[i]`` of the result is ``x[i]`` (the inverse of ``index_select(0, rows)``)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format).index_copy_(0, rows, x)


def _unpack_rows(x: torch.Tensor, plan: RegionPlan, B: int, C: int, acc: torch.dtype) -> torch.Tensor:
    """(B·C, H, e) in packed order -> (B, H, C, e) in ``acc``, 0 on rows that are not ``plan.valid``."""
    H, e = x.shape[1:]
    out = _unsort(x.reshape(B, C, H, e), plan.rows).transpose(1, 2).to(acc)
    return torch.where(plan.valid[:, None, None, None], out, 0.0)


def _pack_keys(x: torch.Tensor, plan: RegionPlan) -> torch.Tensor:
    """(U, Hkv, S, d) -> (U·S, Hkv, d) in the plan's key order (one gather)."""
    return x.transpose(1, 2)[plan.key_u, plan.key_s]


def _unpack_keys(dx: torch.Tensor, plan: RegionPlan, shape) -> torch.Tensor:
    """(U·S, Hkv, d) packed key gradients -> (U, Hkv, S, d), 0 outside ``plan.keep``."""
    U, H, S, d = shape
    out = torch.zeros((U, S, H, d), dtype=dx.dtype, device=dx.device)
    out[plan.key_u, plan.key_s] = dx
    return out.masked_fill_(~plan.keep[..., None, None], 0).transpose(1, 2)


def _region_fwd(kernels: FusedKernels, q, region_k, region_v, plan: RegionPlan, scale: float):
    """One shared region: ``(o_r (B, Hq, C, d), l_r (B, Hq, C))`` in the accumulation dtype, 0 and -inf on rows that
    see none of its keys."""
    B, Hq, C, _ = q.shape
    out, lse = kernels.varlen_fwd(
        _pack_rows(q, plan.rows),
        _pack_keys(region_k, plan),
        _pack_keys(region_v, plan),
        plan.cu_q,
        plan.cu_k,
        plan.max_q,
        plan.max_k,
        scale,
    )
    acc = acc_dtype(q.dtype)
    lse = _unsort(lse.reshape(Hq, B, C).transpose(0, 1), plan.rows).to(acc)
    return _unpack_rows(out, plan, B, C, acc), torch.where(plan.valid[:, None, None], lse, float("-inf"))


def _region_bwd(kernels: FusedKernels, dout, q, out, lse, region_k, region_v, plan: RegionPlan, scale: float):
    """One shared region's backward given the merged ``out`` and finite merged ``lse``: ``(dq_r in the accumulation
    dtype, d region_k, d region_v)``."""
    B, Hq, C, _ = q.shape
    dq, dk, dv = kernels.varlen_bwd(
        _pack_rows(dout, plan.rows),
        _pack_rows(q, plan.rows),
        _pack_keys(region_k, plan),
        _pack_keys(region_v, plan),
        _pack_rows(out, plan.rows),
        lse.index_select(0, plan.rows).transpose(0, 1).reshape(Hq, B * C),
        plan.cu_q,
        plan.cu_k,
        plan.max_q,
        plan.max_k,
        scale,
    )
    dq = _unpack_rows(dq, plan, B, C, acc_dtype(q.dtype))
    return dq, _unpack_keys(dk, plan, region_k.shape), _unpack_keys(dv, plan, region_v.shape)


def _own_fwd(kernels: FusedKernels, q, k, v, key_mask, scale: float):
    """The own region: ``(o, lse)`` in the accumulation dtype; queries that see no own key get 0 and -inf."""
    B, Hq, C, d = q.shape
    acc = acc_dtype(q.dtype)
    if key_mask is None:
        o, lse = kernels.causal_fwd(q, k, v, scale)
        return o.to(acc), lse.to(acc)
    q_f, bias, seen = own_layout(q, key_mask, k.shape[1])
    o, lse = kernels.masked_fwd(q_f, k, v, bias, scale)
    o, lse = o.reshape(B, Hq, C, d).to(acc), lse.reshape(B, Hq, C).to(acc)
    return torch.where(seen[..., None], o, 0.0), torch.where(seen, lse, float("-inf"))


def _own_bwd(kernels: FusedKernels, dout, q, k, v, out, lse, key_mask, scale: float):
    """The own region's backward given the merged ``out`` and finite merged ``lse``: ``(dq, dk, dv)``."""
    if key_mask is None:
        return kernels.causal_bwd(dout, q, k, v, out, lse, scale)
    B, Hq, C, d = q.shape
    Hkv = k.shape[1]
    q_f, bias, _ = own_layout(q, key_mask, Hkv)
    fold = lambda x: x.reshape(B, Hkv, -1, *x.shape[3:])  # noqa: E731 - (B, Hq, C, ...) -> (B, Hkv, rep·C, ...)
    dq, dk, dv = kernels.masked_bwd(fold(dout), q_f, k, v, fold(out), lse.reshape(B, Hkv, -1), bias, scale)
    return dq.reshape(B, Hq, C, d), dk, dv


def fused_fwd(kernels: FusedKernels, q, k, v, regions, key_mask, scale: float):
    """Multi-region attention forward on ``kernels``: the own region, then each region merged by log-sum-exp.

    Args: as :func:`grpo_mem.ops.attention.multi_region_attention` (validated; ``regions`` 4-tuples).
    Returns: ``(out (B, Hq, C, d) in q's dtype, lse (B, Hq, C) fp32)``, lse -inf where a query sees no key.
    """
    B, Hq, C, d = q.shape
    if q.numel() == 0:
        return torch.zeros_like(q), torch.full((B, Hq, C), float("-inf"), device=q.device)
    o, lse = _own_fwd(kernels, q, k, v, key_mask, scale)
    for region_k, region_v, index, mask in regions:
        if region_k.shape[2]:
            o_r, l_r = _region_fwd(kernels, q, region_k, region_v, region_plan(index, mask, C), scale)
            merge_lse_(o, lse, o_r, l_r)
    return o.to(q.dtype), lse


def fused_bwd(kernels: FusedKernels, dout, q, k, v, regions, key_mask, out, lse, scale: float):
    """Multi-region attention backward on ``kernels``: each call's backward given the merged ``out`` and ``lse``.

    Returns: ``(dq fp32, dk, dv, [(d region_k, d region_v) per region])``, the others in the inputs' dtype; keys no
    query sees get exactly 0.
    """
    C = q.shape[2]
    if q.numel() == 0:
        zeros = [(torch.zeros_like(rk), torch.zeros_like(rv)) for rk, rv, _, _ in regions]
        return torch.zeros(q.shape, device=q.device), torch.zeros_like(k), torch.zeros_like(v), zeros
    lse = torch.where(torch.isinf(lse), 0.0, lse)  # a query with no key anywhere: every P = exp(-inf - 0) = 0
    dout = dout.contiguous()
    dq, dk, dv = _own_bwd(kernels, dout, q, k, v, out, lse, key_mask, scale)
    dq = dq.to(acc_dtype(q.dtype))
    dregions = []
    for region_k, region_v, index, mask in regions:
        if not region_k.shape[2]:
            dregions.append((torch.zeros_like(region_k), torch.zeros_like(region_v)))
            continue
        plan = region_plan(index, mask, C)
        dq_r, drk, drv = _region_bwd(kernels, dout, q, out, lse, region_k, region_v, plan, scale)
        dq += dq_r
        dregions.append((drk, drv))
    return dq, dk, dv, dregions


# ----------------------------------------------------------------------------------------------------------------------
# the CUDA kernels (ATen's FlashAttention-2 and memory-efficient attention); CUDA-only: tests/ops/test_cuda_backends.py
# ----------------------------------------------------------------------------------------------------------------------


def _rng_state(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's dropout state arguments (read only with dropout, which is 0 here)."""
    return q.new_empty(2, dtype=torch.uint64), q.new_empty((), dtype=torch.uint64)


def _flash_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale
    )[:2]
    return out, lse


def _flash_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale):
    rng, unused = _rng_state(q)
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, False, rng, unused, scale=scale
    )


def _flash_causal_fwd(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
    return out, lse


def _flash_causal_bwd(dout, q, k, v, out, lse, scale):
    C = q.shape[2]
    rng, unused = _rng_state(q)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, C, C, 0.0, True, rng, unused, scale=scale
    )


_BIAS_ALIGN = 16
"""Elements the memory-efficient kernel's bias rows are aligned to (``scaled_dot_product_attention`` pads its masks
the same way before calling the kernel)."""


def _aligned_bias(bias: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, 1, L, S) additive bias -> (B, heads, L, S) view of rows starting at multiples of ``_BIAS_ALIGN``."""
    B, _, L, S = bias.shape
    width = -(-S // _BIAS_ALIGN) * _BIAS_ALIGN
    if width != S or bias.stride(2) != S or bias.stride(3) != 1:
        buf = bias.new_empty((B, 1, L, width))
        buf[..., :S] = bias
        bias = buf[..., :S]
    return bias.expand(B, heads, L, S)


def _bmhk(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, d) with (B, L, H, d)-contiguous memory, the layout the efficient backward assumes for ``out``."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_fwd(q, k, v, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _aligned_bias(bias, q.shape[1]), True, 0.0, False, scale=scale
    )[:2]
    return out, lse[..., : q.shape[2]]  # the kernel pads the LSE's query dim to a multiple of 32


def _efficient_bwd(dout, q, k, v, out, lse, bias, scale):
    B, H, L, _ = q.shape
    padded = torch.zeros((B, H, -(-L // 32) * 32), dtype=torch.float32, device=q.device)
    padded[..., :L] = lse
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        k,
        v,
        _aligned_bias(bias, H),
        _bmhk(out),
        padded,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        False,
        scale=scale,
    )
    return dq, dk, dv


CUDA_KERNELS = FusedKernels(
    varlen_fwd=_flash_varlen_fwd,
    varlen_bwd=_flash_varlen_bwd,
    causal_fwd=_flash_causal_fwd,
    causal_bwd=_flash_causal_bwd,
    masked_fwd=_efficient_fwd,
    masked_bwd=_efficient_bwd,
)
"""The ``"sdpa"`` backend's kernels: FlashAttention-2 varlen for shared regions, dense causal for an unpadded own
region, the memory-efficient kernel with an additive bias for a padded one."""


def _refuse_features(params) -> None:
    if params.softcap is not None or params.sliding_window is not None:
        raise ValueError(
            "the sdpa backend computes neither soft-capping nor a sliding window (softcap="
            f"{params.softcap}, sliding_window={params.sliding_window}): use backend='triton' or 'torch'"
        )


def multi_region_attention_fwd(q, k, v, regions, key_mask, params, positions=None):
    """Forward on the CUDA fused kernels (:func:`fused_fwd` with ``CUDA_KERNELS``): ``(out in q's dtype, lse fp32
    (B, Hq, C))``. Raises ValueError for ``params.softcap`` or ``params.sliding_window``."""
    _refuse_features(params)
    return fused_fwd(CUDA_KERNELS, q, k, v, regions, key_mask, params.scale)


def multi_region_attention_bwd(dout, q, k, v, regions, key_mask, out, lse, params, positions=None):
    """Backward on the CUDA fused kernels (:func:`fused_bwd`): ``(dq fp32, dk, dv, [(d region_k, d region_v)])``.
    Raises ValueError for ``params.softcap`` or ``params.sliding_window``."""
    _refuse_features(params)
    return fused_bwd(CUDA_KERNELS, dout, q, k, v, regions, key_mask, out, lse, params.scale)

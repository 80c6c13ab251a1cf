"""Triton kernels for shared-prefix (two-region) attention: forward, and a three-kernel backward.

Same op as :func:`grpo_mem.ops.attention.shared_prefix_attention` (see there for the semantics). Layout of the work:

* ``_spa_fwd_kernel`` — one program per (block of BLOCK_M folded queries, row b, kv head h). The Hq/Hkv query heads
  of kv head h are folded into the M dimension (query ``m = r·C + i`` is head ``h·rep + r``, position i), so each key
  tile serves every query head of the kv head. Online softmax (FlashAttention-2, Dao, arXiv 2307.08691) runs over the
  prompt's keys ``prefix_k[prefix_index[b], h]`` read in place (tiles wholly inside the left padding are skipped),
  then causally over the row's own keys. Writes ``out`` and the natural-log LSE of the scaled scores.
* ``_spa_bwd_dq_kernel`` — same grid; recomputes ``P = exp(S − L)`` over both regions and accumulates
  ``dQ = scale · Σ_j P_ij (dP_ij − D_i) K_j`` with ``D = rowsum(dO ∘ O)``.
* ``_spa_bwd_dkdv_completion_kernel`` — one program per (block of completion keys, row, kv head); loops over the
  queries that can see the block (all query heads of the kv head, causal lower bound).
* ``_spa_bwd_dkdv_prefix_kernel`` — one program per (block of prompt keys, prompt u, kv head); loops over every row
  of the prompt's group (rows listed by prompt, ascending row index), every query head of the kv head and every query
  block. dK/dV of the prompt are accumulated in fp32 registers and written once: no atomics, and the summation order
  (row, then head, then query block) is fixed, so the result is deterministic.

All products accumulate in fp32 (``tl.dot(..., input_precision="ieee")``: fp32 inputs are not rounded to tf32);
probabilities are cast to the value dtype before ``P·V`` / ``Pᵀ·dO`` as in FlashAttention-2. Runs on CUDA, or on CPU
tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first imported); there the
``EMULATE_BF16`` flag makes bf16 arithmetic match the compiled kernels (see :func:`_launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import launch_device

__all__ = [
    "shared_prefix_attention_fwd",
    "shared_prefix_attention_bwd",
    "block_config",
    "KERNELS",
]

@triton.jit
def _round_bf16(x):
    """Round fp32 ``x`` to the nearest-even bf16 value, kept in fp32 (interpreter only: its own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _spa_fwd_kernel(
    Q, K, V, PK, PV, PIDX, PSTART, PMASK, KMASK, OUT, LSE,
    stride_qb, stride_qh, stride_qc,
    stride_kb, stride_kh, stride_kc,
    stride_pu, stride_ph, stride_pp,
    stride_ob, stride_oh, stride_oc,
    SCALE, C, P, HKV,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    qk_scale = SCALE * 1.4426950408889634  # work in log2 units: exp(x) = exp2(x·log2 e)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < REP * C
    head = h * REP + offs_m // C
    pos = offs_m % C
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qc + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if EMULATE_BF16:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # region 1: the row's prompt, read in place
    u = tl.load(PIDX + b)
    pstart = tl.load(PSTART + u)
    pk_base = PK + u * stride_pu + h * stride_ph
    pv_base = PV + u * stride_pu + h * stride_ph
    for n0 in range((pstart // BLOCK_N) * BLOCK_N, P, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < P
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(pk_base + offs_n[:, None] * stride_pp + offs_d[None, :], mask=kv_mask, other=0.0)
        if EMULATE_BF16:
            k = k.to(tl.float32)
        v = tl.load(pv_base + offs_n[:, None] * stride_pp + offs_d[None, :], mask=kv_mask, other=0.0)
        if EMULATE_BF16:
            v = v.to(tl.float32)
        real = tl.load(PMASK + u * P + offs_n, mask=n_ok, other=0) != 0
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(real[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        pc = p.to(V.dtype.element_ty)
        if EMULATE_BF16:
            pc = _round_bf16(p)
        acc = acc * alpha[:, None] + tl.dot(pc, v, input_precision="ieee")
        m_i = m_new

    # region 2: the row's own completion, causal (keys up to the largest query position in this block)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_kb + h * stride_kh
    hi = tl.minimum(tl.max(tl.where(row_ok, pos, 0), 0) + 1, C)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < C
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kc + offs_d[None, :], mask=kv_mask, other=0.0)
        if EMULATE_BF16:
            k = k.to(tl.float32)
        v = tl.load(v_base + offs_n[:, None] * stride_kc + offs_d[None, :], mask=kv_mask, other=0.0)
        if EMULATE_BF16:
            v = v.to(tl.float32)
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        if HAS_KMASK:
            real = tl.load(KMASK + b * C + offs_n, mask=n_ok, other=0) != 0
            visible = visible & real[None, :]
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        pc = p.to(V.dtype.element_ty)
        if EMULATE_BF16:
            pc = _round_bf16(p)
        acc = acc * alpha[:, None] + tl.dot(pc, v, input_precision="ieee")
        m_i = m_new

    empty = l_i == 0.0  # no visible key: output 0, LSE -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptrs = OUT + b * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_oc + offs_d[None, :]
    if EMULATE_BF16:
        out = _round_bf16(out)
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    # LSE is a contiguous (B, Hq, C) fp32 tensor
    tl.store(LSE + (b * HKV * REP + head) * C + pos, lse, mask=row_ok)


@triton.jit
def _spa_bwd_dq_kernel(
    Q, K, V, PK, PV, PIDX, PSTART, PMASK, KMASK, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qc,
    stride_kb, stride_kh, stride_kc,
    stride_pu, stride_ph, stride_pp,
    stride_ob, stride_oh, stride_oc,
    SCALE, C, P, HKV,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    # Q, DQ share the q strides; DO shares OUT's strides (stride_o*).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    qk_scale = SCALE * 1.4426950408889634

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < REP * C
    head = h * REP + offs_m // C
    pos = offs_m % C
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    md = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qc + offs_d[None, :],
                mask=md, other=0.0)
    if EMULATE_BF16:
        q = q.to(tl.float32)
    do = tl.load(DO + b * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_oc + offs_d[None, :],
                 mask=md, other=0.0)
    if EMULATE_BF16:
        do = do.to(tl.float32)
    row_idx = (b * HKV * REP + head) * C + pos
    lse2 = tl.load(LSE + row_idx, mask=row_ok, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # rows without keys: every score is -inf, so P = 0
    delta = tl.load(DELTA + row_idx, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    u = tl.load(PIDX + b)
    pstart = tl.load(PSTART + u)
    pk_base = PK + u * stride_pu + h * stride_ph
    pv_base = PV + u * stride_pu + h * stride_ph
    for n0 in range((pstart // BLOCK_N) * BLOCK_N, P, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < P
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(pk_base + offs_n[:, None] * stride_pp + offs_d[None, :], mask=kv_mask, other=0.0)
        if EMULATE_BF16:
            k = k.to(tl.float32)
        v = tl.load(pv_base + offs_n[:, None] * stride_pp + offs_d[None, :], mask=kv_mask, other=0.0)
        if EMULATE_BF16:
            v = v.to(tl.float32)
        real = tl.load(PMASK + u * P + offs_n, mask=n_ok, other=0) != 0
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(real[None, :], s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dsc = ds.to(K.dtype.element_ty)
        if EMULATE_BF16:
            dsc = _round_bf16(ds)
        dq += tl.dot(dsc, k, input_precision="ieee")

    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_kb + h * stride_kh
    hi = tl.minimum(tl.max(tl.where(row_ok, pos, 0), 0) + 1, C)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < C
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kc + offs_d[None, :], mask=kv_mask, other=0.0)
        if EMULATE_BF16:
            k = k.to(tl.float32)
        v = tl.load(v_base + offs_n[:, None] * stride_kc + offs_d[None, :], mask=kv_mask, other=0.0)
        if EMULATE_BF16:
            v = v.to(tl.float32)
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        if HAS_KMASK:
            real = tl.load(KMASK + b * C + offs_n, mask=n_ok, other=0) != 0
            visible = visible & real[None, :]
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(visible, s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dsc = ds.to(K.dtype.element_ty)
        if EMULATE_BF16:
            dsc = _round_bf16(ds)
        dq += tl.dot(dsc, k, input_precision="ieee")

    dq = dq * SCALE
    if EMULATE_BF16:
        dq = _round_bf16(dq)
    tl.store(DQ + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qc + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=md)


@triton.jit
def _spa_bwd_dkdv_completion_kernel(
    Q, K, V, KMASK, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qc,
    stride_kb, stride_kh, stride_kc,
    stride_ob, stride_oh, stride_oc,
    SCALE, C, HKV,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    # K, V, DK, DV share the k strides; DO shares OUT's strides.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    qk_scale = SCALE * 1.4426950408889634

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < C
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    nd = n_ok[:, None] & d_ok[None, :]
    kv_off = b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kc + offs_d[None, :]
    k = tl.load(K + kv_off, mask=nd, other=0.0)
    if EMULATE_BF16:
        k = k.to(tl.float32)
    v = tl.load(V + kv_off, mask=nd, other=0.0)
    if EMULATE_BF16:
        v = v.to(tl.float32)
    key_ok = n_ok
    if HAS_KMASK:
        key_ok = key_ok & (tl.load(KMASK + b * C + offs_n, mask=n_ok, other=0) != 0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # queries at positions >= the block's first key, for every query head of this kv head
    for r in range(REP):
        head = h * REP + r
        for m0 in range(((pid_n * BLOCK_N) // BLOCK_M) * BLOCK_M, C, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < C
            md = m_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + b * stride_qb + head * stride_qh + offs_m[:, None] * stride_qc + offs_d[None, :],
                        mask=md, other=0.0)
            if EMULATE_BF16:
                q = q.to(tl.float32)
            do = tl.load(DO + b * stride_ob + head * stride_oh + offs_m[:, None] * stride_oc + offs_d[None, :],
                         mask=md, other=0.0)
            if EMULATE_BF16:
                do = do.to(tl.float32)
            row_idx = (b * HKV * REP + head) * C + offs_m
            lse2 = tl.load(LSE + row_idx, mask=m_ok, other=0.0) * 1.4426950408889634
            lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
            delta = tl.load(DELTA + row_idx, mask=m_ok, other=0.0)
            # transposed scores: keys along rows, queries along columns
            st = tl.dot(k, tl.trans(q), input_precision="ieee") * qk_scale
            visible = key_ok[:, None] & m_ok[None, :] & (offs_n[:, None] <= offs_m[None, :])
            st = tl.where(visible, st, float("-inf"))
            pt = tl.exp2(st - lse2[None, :])
            ptc = pt.to(DO.dtype.element_ty)
            if EMULATE_BF16:
                ptc = _round_bf16(pt)
            dv += tl.dot(ptc, do, input_precision="ieee")
            dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
            dst = pt * (dpt - delta[None, :])
            dstc = dst.to(Q.dtype.element_ty)
            if EMULATE_BF16:
                dstc = _round_bf16(dst)
            dk += tl.dot(dstc, q, input_precision="ieee")

    dk = dk * SCALE
    if EMULATE_BF16:
        dk = _round_bf16(dk)
    tl.store(DK + kv_off, dk.to(DK.dtype.element_ty), mask=nd)
    if EMULATE_BF16:
        dv = _round_bf16(dv)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=nd)


@triton.jit
def _spa_bwd_dkdv_prefix_kernel(
    Q, PK, PV, ROWS, ROW_START, PSTART, PMASK, DO, LSE, DELTA, DPK, DPV,
    stride_qb, stride_qh, stride_qc,
    stride_pu, stride_ph, stride_pp,
    stride_ob, stride_oh, stride_oc,
    SCALE, C, P, HKV,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    # PK, PV, DPK, DPV share the prefix strides; DO shares OUT's strides. ROWS lists the rows grouped by prompt
    # (ascending within a prompt); ROW_START[u]..ROW_START[u+1] are prompt u's entries.
    pid_n = tl.program_id(0)
    pid_uh = tl.program_id(1)
    u = pid_uh // HKV
    h = pid_uh % HKV
    qk_scale = SCALE * 1.4426950408889634

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < P
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    nd = n_ok[:, None] & d_ok[None, :]
    p_off = u * stride_pu + h * stride_ph + offs_n[:, None] * stride_pp + offs_d[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    pstart = tl.load(PSTART + u)
    if pid_n * BLOCK_N + BLOCK_N > pstart:  # blocks wholly inside the left padding get zero gradient
        k = tl.load(PK + p_off, mask=nd, other=0.0)
        if EMULATE_BF16:
            k = k.to(tl.float32)
        v = tl.load(PV + p_off, mask=nd, other=0.0)
        if EMULATE_BF16:
            v = v.to(tl.float32)
        key_ok = n_ok & (tl.load(PMASK + u * P + offs_n, mask=n_ok, other=0) != 0)
        g0 = tl.load(ROW_START + u)
        g1 = tl.load(ROW_START + u + 1)
        for g in range(g0, g1):
            b = tl.load(ROWS + g)
            for r in range(REP):
                head = h * REP + r
                for m0 in range(0, C, BLOCK_M):
                    offs_m = m0 + tl.arange(0, BLOCK_M)
                    m_ok = offs_m < C
                    md = m_ok[:, None] & d_ok[None, :]
                    q = tl.load(Q + b * stride_qb + head * stride_qh + offs_m[:, None] * stride_qc
                                + offs_d[None, :], mask=md, other=0.0)
                    if EMULATE_BF16:
                        q = q.to(tl.float32)
                    do = tl.load(DO + b * stride_ob + head * stride_oh + offs_m[:, None] * stride_oc
                                 + offs_d[None, :], mask=md, other=0.0)
                    if EMULATE_BF16:
                        do = do.to(tl.float32)
                    row_idx = (b * HKV * REP + head) * C + offs_m
                    lse2 = tl.load(LSE + row_idx, mask=m_ok, other=0.0) * 1.4426950408889634
                    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
                    delta = tl.load(DELTA + row_idx, mask=m_ok, other=0.0)
                    st = tl.dot(k, tl.trans(q), input_precision="ieee") * qk_scale
                    st = tl.where(key_ok[:, None] & m_ok[None, :], st, float("-inf"))
                    pt = tl.exp2(st - lse2[None, :])
                    ptc = pt.to(DO.dtype.element_ty)
                    if EMULATE_BF16:
                        ptc = _round_bf16(pt)
                    dv += tl.dot(ptc, do, input_precision="ieee")
                    dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
                    dst = pt * (dpt - delta[None, :])
                    dstc = dst.to(Q.dtype.element_ty)
                    if EMULATE_BF16:
                        dstc = _round_bf16(dst)
                    dk += tl.dot(dstc, q, input_precision="ieee")

    dk = dk * SCALE
    if EMULATE_BF16:
        dk = _round_bf16(dk)
    tl.store(DPK + p_off, dk.to(DPK.dtype.element_ty), mask=nd)
    if EMULATE_BF16:
        dv = _round_bf16(dv)
    tl.store(DPV + p_off, dv.to(DPV.dtype.element_ty), mask=nd)


KERNELS = {
    "fwd": _spa_fwd_kernel,
    "bwd_dq": _spa_bwd_dq_kernel,
    "bwd_dkdv_completion": _spa_bwd_dkdv_completion_kernel,
    "bwd_dkdv_prefix": _spa_bwd_dkdv_prefix_kernel,
}


# kernel name -> ((BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim <= 64, (...) for head dim 65..256).
# fp32 inputs use the exact (FMA, not tf32) dot, which needs far smaller tiles to stay within the register file.
# Registers and shared memory of each build for sm_80 and sm_90 are printed by tests/test_attention_triton_aot.py.
_BLOCKS_16BIT = {
    "fwd": ((64, 64, 4, 2), (64, 64, 8, 2)),
    "bwd_dq": ((64, 32, 4, 2), (64, 64, 8, 2)),
    "bwd_dkdv_completion": ((32, 64, 8, 2), (32, 64, 8, 2)),
    "bwd_dkdv_prefix": ((32, 64, 8, 2), (32, 64, 8, 2)),
}
_BLOCKS_FP32 = {
    "fwd": ((16, 16, 4, 1), (16, 16, 4, 1)),
    "bwd_dq": ((16, 16, 4, 1), (16, 16, 4, 1)),
    "bwd_dkdv_completion": ((16, 32, 4, 2), (16, 32, 4, 2)),
    "bwd_dkdv_prefix": ((16, 32, 4, 2), (16, 32, 4, 2)),
}


def block_config(name: str, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Shipped launch configuration of kernel ``name`` for ``head_dim`` and input ``dtype``.

    Returns a dict with BLOCK_M, BLOCK_N, num_warps, num_stages. Chosen so that the sm_90 builds have no register
    spills (checked by ``tests/test_attention_triton_aot.py``; the 16-bit builds for sm_80 have none either).
    Raises ValueError for an unknown name or a head dim outside [1, 256].
    """
    if name not in KERNELS:
        raise ValueError(f"unknown kernel name {name!r}; expected one of {sorted(KERNELS)}")
    wide = _block_d(head_dim) > 64
    block_m, block_n, warps, stages = (_BLOCKS_FP32 if dtype == torch.float32 else _BLOCKS_16BIT)[name][wide]
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def _block_d(head_dim: int) -> int:
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head dim must be in [1, 256] for the Triton backend, got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim))


def _launch(name, grid, args, head_dim, dtype, interpret, **constexprs):
    """Launch kernel ``name`` on the device of its first tensor argument (Triton launches on the current device)."""
    cfg = block_config(name, head_dim, dtype)
    opts = {} if interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    # Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits and truncates fp32 -> bf16 casts;
    # EMULATE_BF16 gives its dots fp32 copies (exact: products of bf16 values are exact in fp32, and the compiled
    # kernels accumulate in fp32 too) and rounds to nearest-even bf16 wherever the GPU build rounds.
    emulate_bf16 = interpret and dtype == torch.bfloat16
    with launch_device(args[0]):
        KERNELS[name][grid](*args, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_M=cfg["BLOCK_M"],
                            BLOCK_N=cfg["BLOCK_N"], EMULATE_BF16=emulate_bf16, **constexprs, **opts)


def _prefix_tables(prefix_index, prefix_mask):
    """First real key of each prompt (P if none), int32 (U,); rows grouped by prompt and CSR offsets, int32."""
    U, P = prefix_mask.shape
    dev = prefix_mask.device
    if P == 0:
        pstart = torch.zeros(U, dtype=torch.int32, device=dev)
    else:
        # weight key j by P − j: the largest weight among real keys marks the first one; a prompt with none gives P
        weight = torch.arange(P, 0, -1, device=dev)
        pstart = (P - (prefix_mask * weight).amax(dim=1)).to(torch.int32)
    rows = torch.argsort(prefix_index, stable=True).to(torch.int32)
    counts = torch.bincount(prefix_index, minlength=U)
    row_start = torch.zeros(U + 1, dtype=torch.int32, device=prefix_index.device)
    row_start[1:] = torch.cumsum(counts, 0)
    return pstart.contiguous(), rows.contiguous(), row_start


def shared_prefix_attention_fwd(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, scale):
    """Launch the forward kernel. Shapes as :func:`grpo_mem.ops.attention.shared_prefix_attention` (validated there).

    Returns ``(out, lse)``: out (B, Hq, C, d) in q's dtype; lse (B, Hq, C) fp32, natural-log log-sum-exp of the
    scaled scores over all visible keys (−inf for a query with none).
    """
    q, k, v, prefix_k, prefix_v = (x.contiguous() for x in (q, k, v, prefix_k, prefix_v))
    B, Hq, C, d = q.shape
    Hkv, P = k.shape[1], prefix_k.shape[2]
    rep = Hq // Hkv
    interpret = q.device.type == "cpu"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, C, dtype=torch.float32, device=q.device)
    if B == 0 or C == 0:
        return out, lse
    pstart, _, _ = _prefix_tables(prefix_index, prefix_mask)
    pmask = prefix_mask.to(torch.int8).contiguous()
    kmask = key_mask.to(torch.int8).contiguous() if key_mask is not None else pmask  # unread when HAS_KMASK=False
    bm = block_config("fwd", d, q.dtype)["BLOCK_M"]
    grid = (triton.cdiv(rep * C, bm), B * Hkv)
    _launch("fwd", grid, (
        q, k, v, prefix_k, prefix_v, prefix_index, pstart, pmask, kmask, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        prefix_k.stride(0), prefix_k.stride(1), prefix_k.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(scale), C, P, Hkv,
    ), d, q.dtype, interpret, REP=rep, HAS_KMASK=key_mask is not None)
    return out, lse


def shared_prefix_attention_bwd(dout, q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, out, lse,
                                scale):
    """Launch the three backward kernels. ``out``/``lse`` are the forward's results, ``dout`` is (B, Hq, C, d).

    Returns ``(dq, dk, dv, dprefix_k, dprefix_v)`` in the dtypes of q, k, v, prefix_k, prefix_v (fp32 accumulation).
    ``D = rowsum(dO ∘ O)`` is computed in fp32 with torch, a (B, Hq, C) tensor.
    """
    q, k, v, prefix_k, prefix_v, out, dout = (x.contiguous() for x in (q, k, v, prefix_k, prefix_v, out, dout))
    B, Hq, C, d = q.shape
    U, Hkv, P = prefix_k.shape[0], k.shape[1], prefix_k.shape[2]
    rep = Hq // Hkv
    interpret = q.device.type == "cpu"
    dq, dk, dv, dpk, dpv = (torch.empty_like(x) for x in (q, k, v, prefix_k, prefix_v))
    if B == 0 or C == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dpk.zero_(), dpv.zero_()
    lse = lse.contiguous()
    delta = torch.einsum("bhcd,bhcd->bhc", dout.float(), out.float()).contiguous()
    pstart, rows, row_start = _prefix_tables(prefix_index, prefix_mask)
    pmask = prefix_mask.to(torch.int8).contiguous()
    kmask = key_mask.to(torch.int8).contiguous() if key_mask is not None else pmask
    q_strides = (q.stride(0), q.stride(1), q.stride(2))
    k_strides = (k.stride(0), k.stride(1), k.stride(2))
    p_strides = (prefix_k.stride(0), prefix_k.stride(1), prefix_k.stride(2))
    o_strides = (out.stride(0), out.stride(1), out.stride(2))

    cfg = block_config("bwd_dq", d, q.dtype)
    _launch("bwd_dq", (triton.cdiv(rep * C, cfg["BLOCK_M"]), B * Hkv), (
        q, k, v, prefix_k, prefix_v, prefix_index, pstart, pmask, kmask, dout, lse, delta, dq,
        *q_strides, *k_strides, *p_strides, *o_strides, float(scale), C, P, Hkv,
    ), d, q.dtype, interpret, REP=rep, HAS_KMASK=key_mask is not None)
    cfg = block_config("bwd_dkdv_completion", d, q.dtype)
    _launch("bwd_dkdv_completion", (triton.cdiv(C, cfg["BLOCK_N"]), B * Hkv), (
        q, k, v, kmask, dout, lse, delta, dk, dv,
        *q_strides, *k_strides, *o_strides, float(scale), C, Hkv,
    ), d, q.dtype, interpret, REP=rep, HAS_KMASK=key_mask is not None)
    cfg = block_config("bwd_dkdv_prefix", d, q.dtype)
    _launch("bwd_dkdv_prefix", (triton.cdiv(P, cfg["BLOCK_N"]), U * Hkv), (
        q, prefix_k, prefix_v, rows, row_start, pstart, pmask, dout, lse, delta, dpk, dpv,
        *q_strides, *p_strides, *o_strides, float(scale), C, P, Hkv,
    ), d, q.dtype, interpret, REP=rep)
    return dq, dk, dv, dpk, dpv

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

Head dims that are not a power of two run as two power-of-two column tiles (d=80: 64 + 16, d=96: 64 + 32; see
``head_dim_tiles``) instead of one padded 128-wide tile, so no MMA work is spent on padding columns.

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
    "prefix_dkdv_grid",
    "head_dim_tiles",
    "KERNELS",
]


@triton.jit
def _round_bf16(x):
    """Round fp32 ``x`` to the nearest-even bf16 value, kept in fp32 (interpreter only: its own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


# The head dimension is cut into two column tiles of power-of-two widths BLOCK_D0 + BLOCK_D1 (tl.dot needs powers of
# two): 64 + 16 for d=80, 64 + 32 for d=96, so the MMA work is 80/128 and 96/128 of one 128-wide tile. BLOCK_D1 = 0
# means one tile (d = 64, 128, 256). Every head-dim tile is then a pair (x0, x1); when BLOCK_D1 = 0, x1 is a
# placeholder (x0 itself, or zeros of x0's shape) that no helper reads, so the compiled kernel carries one tile.
# The helpers below are the only code that knows about the two parts.


@triton.jit
def _load_cols(base, rows, r_ok, D_LO: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
               EMULATE_BF16: tl.constexpr):
    """Head-dim columns [D_LO, D_LO + WIDTH) of the rows starting at element offsets ``rows`` from ``base`` (column
    stride 1): a (len(rows), WIDTH) tile, zero outside ``r_ok`` and in columns >= HEAD_DIM; fp32 under EMULATE_BF16."""
    offs_d = D_LO + tl.arange(0, WIDTH)
    x = tl.load(base + (rows[:, None] + offs_d[None, :]), mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
                other=0.0)
    if EMULATE_BF16:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_head(base, rows, r_ok, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
               EMULATE_BF16: tl.constexpr):
    """The two head-dim parts (x0, x1) of the rows at ``rows`` (see _load_cols); x1 is x0 when BLOCK_D1 = 0."""
    x0 = _load_cols(base, rows, r_ok, 0, BLOCK_D0, HEAD_DIM, EMULATE_BF16)
    x1 = x0
    if BLOCK_D1 > 0:
        x1 = _load_cols(base, rows, r_ok, BLOCK_D0, BLOCK_D1, HEAD_DIM, EMULATE_BF16)
    return x0, x1


@triton.jit
def _store_head(base, rows, r_ok, x0, x1, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr):
    """Store the parts (x0, x1) of a head-dim tile at the rows ``rows`` (columns < HEAD_DIM, rows in ``r_ok``), cast
    to the pointer's dtype. x1 is not read when BLOCK_D1 = 0."""
    offs_d = tl.arange(0, BLOCK_D0)
    tl.store(base + (rows[:, None] + offs_d[None, :]), x0.to(base.dtype.element_ty),
             mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    if BLOCK_D1 > 0:
        offs_d1 = BLOCK_D0 + tl.arange(0, BLOCK_D1)
        tl.store(base + (rows[:, None] + offs_d1[None, :]), x1.to(base.dtype.element_ty),
                 mask=r_ok[:, None] & (offs_d1 < HEAD_DIM)[None, :])


@triton.jit
def _zeros_head(ROWS: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr):
    """fp32 zero accumulators (acc0, acc1) for a (ROWS, head dim) tile; acc1 is a placeholder when BLOCK_D1 = 0."""
    acc0 = tl.zeros([ROWS, BLOCK_D0], tl.float32)
    acc1 = acc0
    if BLOCK_D1 > 0:
        acc1 = tl.zeros([ROWS, BLOCK_D1], tl.float32)
    return acc0, acc1


@triton.jit
def _dot_t(a0, a1, b0, b1, BLOCK_D1: tl.constexpr):
    """``a · bᵀ`` over the head dim, fp32: the sum of the parts' products (the head dim is the contraction)."""
    s = tl.dot(a0, tl.trans(b0), input_precision="ieee")
    if BLOCK_D1 > 0:
        s = tl.dot(a1, tl.trans(b1), s, input_precision="ieee")
    return s


@triton.jit
def _acc_dot(acc0, acc1, a, b0, b1, BLOCK_D1: tl.constexpr):
    """``acc += a · b`` for a head-dim tile b = (b0, b1) and accumulator (acc0, acc1), fp32."""
    acc0 += tl.dot(a, b0, input_precision="ieee")
    if BLOCK_D1 > 0:
        acc1 += tl.dot(a, b1, input_precision="ieee")
    return acc0, acc1


@triton.jit
def _scale_rows(acc0, acc1, alpha, BLOCK_D1: tl.constexpr):
    """Each row i of the head-dim tile (acc0, acc1) times alpha[i]."""
    acc0 = acc0 * alpha[:, None]
    if BLOCK_D1 > 0:
        acc1 = acc1 * alpha[:, None]
    return acc0, acc1


@triton.jit
def _spa_fwd_kernel(
    Q, K, V, PK, PV, PIDX, PSTART, PMASK, KMASK, OUT, LSE,
    stride_qb, stride_qh, stride_qc,
    stride_kb, stride_kh, stride_kc,
    stride_vb, stride_vh, stride_vc,
    stride_pku, stride_pkh, stride_pkp,
    stride_pvu, stride_pvh, stride_pvp,
    stride_ob, stride_oh, stride_oc,
    SCALE, C, C_PAD, P, HKV,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    # Offsets: the batch / head / prompt parts are int64 scalars (b·stride_qb alone passes 2^31 elements at
    # B=16, Hq=40, C=32k, d=128); the in-tile parts stay int32 (the launcher checks they fit).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = (pid_bh % HKV).to(tl.int64)
    qk_scale = SCALE * 1.4426950408889634  # work in log2 units: exp(x) = exp2(x·log2 e)

    # folded query m = r·C_PAD + i: head h·REP + r, position i. C_PAD = C rounded up to 16, so the division gives
    # runs of 16 consecutive positions whatever C is (C itself is usually not a multiple of 16 at run time).
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r = offs_m // C_PAD
    pos = offs_m % C_PAD
    row_ok = (r < REP) & (pos < C)
    q_rows = r * stride_qh + pos * stride_qc
    q0, q1 = _load_head(Q + b * stride_qb + h * REP * stride_qh, q_rows, row_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        EMULATE_BF16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0, acc1 = _zeros_head(BLOCK_M, BLOCK_D0, BLOCK_D1)

    # region 1: the row's prompt, read in place
    u = tl.load(PIDX + b)  # int64
    pstart = tl.load(PSTART + u)
    pk_base = PK + u * stride_pku + h * stride_pkh
    pv_base = PV + u * stride_pvu + h * stride_pvh
    pm_base = PMASK + u * P
    for n0 in range((pstart // BLOCK_N) * BLOCK_N, P, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < P
        k0, k1 = _load_head(pk_base, offs_n * stride_pkp, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        v0, v1 = _load_head(pv_base, offs_n * stride_pvp, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        real = tl.load(pm_base + offs_n, mask=n_ok, other=0) != 0
        s = _dot_t(q0, q1, k0, k1, BLOCK_D1) * qk_scale
        s = tl.where(real[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        pc = p.to(V.dtype.element_ty)
        if EMULATE_BF16:
            pc = _round_bf16(p)
        acc0, acc1 = _scale_rows(acc0, acc1, alpha, BLOCK_D1)
        acc0, acc1 = _acc_dot(acc0, acc1, pc, v0, v1, BLOCK_D1)
        m_i = m_new

    # region 2: the row's own completion, causal (keys up to the largest query position in this block)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    km_base = KMASK + b * C
    hi = tl.minimum(tl.max(tl.where(row_ok, pos, 0), 0) + 1, C)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < C
        k0, k1 = _load_head(k_base, offs_n * stride_kc, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        v0, v1 = _load_head(v_base, offs_n * stride_vc, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        if HAS_KMASK:
            real = tl.load(km_base + offs_n, mask=n_ok, other=0) != 0
            visible = visible & real[None, :]
        s = _dot_t(q0, q1, k0, k1, BLOCK_D1) * qk_scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        pc = p.to(V.dtype.element_ty)
        if EMULATE_BF16:
            pc = _round_bf16(p)
        acc0, acc1 = _scale_rows(acc0, acc1, alpha, BLOCK_D1)
        acc0, acc1 = _acc_dot(acc0, acc1, pc, v0, v1, BLOCK_D1)
        m_i = m_new

    empty = l_i == 0.0  # no visible key: output 0, LSE -inf
    denom = tl.where(empty, 1.0, l_i)[:, None]
    out0 = acc0 / denom
    out1 = acc1 / denom
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if EMULATE_BF16:
        out0 = _round_bf16(out0)
        out1 = _round_bf16(out1)
    _store_head(OUT + b * stride_ob + h * REP * stride_oh, r * stride_oh + pos * stride_oc, row_ok, out0, out1,
                HEAD_DIM, BLOCK_D0, BLOCK_D1)
    # LSE rows are C_PAD apart ((B, Hq, C_PAD) fp32): the queries of kv head h start at (b·HKV + h)·REP·C_PAD
    tl.store(LSE + (b * HKV + h) * REP * C_PAD + offs_m, lse, mask=row_ok)


@triton.jit
def _spa_bwd_delta_kernel(
    OUT, DO, DELTA,
    stride_ob, stride_oh, stride_oc,
    stride_dob, stride_doh, stride_doc,
    C, C_PAD, HQ,
    HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # D = rowsum(dO ∘ O) in fp32 for BLOCK_M queries of one (row, query head): FlashAttention-2's preprocessing step,
    # without the two fp32 (B, Hq, C, d) temporaries a torch expression would build.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    hq = (pid_bh % HQ).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < C
    o0, o1 = _load_head(OUT + b * stride_ob + hq * stride_oh, offs_m * stride_oc, m_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        False)
    do0, do1 = _load_head(DO + b * stride_dob + hq * stride_doh, offs_m * stride_doc, m_ok, HEAD_DIM, BLOCK_D0,
                          BLOCK_D1, False)
    delta = tl.sum(o0.to(tl.float32) * do0.to(tl.float32), 1)
    if BLOCK_D1 > 0:
        delta += tl.sum(o1.to(tl.float32) * do1.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * C_PAD + offs_m, delta, mask=m_ok)


@triton.jit
def _spa_bwd_dq_kernel(
    Q, K, V, PK, PV, PIDX, PSTART, PMASK, KMASK, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qc,
    stride_kb, stride_kh, stride_kc,
    stride_vb, stride_vh, stride_vc,
    stride_pku, stride_pkh, stride_pkp,
    stride_pvu, stride_pvh, stride_pvp,
    stride_dob, stride_doh, stride_doc,
    stride_dqb, stride_dqh, stride_dqc,
    SCALE, C, C_PAD, P, HKV,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = (pid_bh % HKV).to(tl.int64)
    qk_scale = SCALE * 1.4426950408889634

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r = offs_m // C_PAD
    pos = offs_m % C_PAD
    row_ok = (r < REP) & (pos < C)
    q0, q1 = _load_head(Q + b * stride_qb + h * REP * stride_qh, r * stride_qh + pos * stride_qc, row_ok, HEAD_DIM,
                        BLOCK_D0, BLOCK_D1, EMULATE_BF16)
    do0, do1 = _load_head(DO + b * stride_dob + h * REP * stride_doh, r * stride_doh + pos * stride_doc, row_ok,
                          HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
    row_base = (b * HKV + h) * REP * C_PAD  # LSE and DELTA are (B, Hq, C_PAD) fp32
    lse2 = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # rows without keys: every score is -inf, so P = 0
    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    dq0, dq1 = _zeros_head(BLOCK_M, BLOCK_D0, BLOCK_D1)

    u = tl.load(PIDX + b)
    pstart = tl.load(PSTART + u)
    pk_base = PK + u * stride_pku + h * stride_pkh
    pv_base = PV + u * stride_pvu + h * stride_pvh
    pm_base = PMASK + u * P
    for n0 in range((pstart // BLOCK_N) * BLOCK_N, P, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < P
        k0, k1 = _load_head(pk_base, offs_n * stride_pkp, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        v0, v1 = _load_head(pv_base, offs_n * stride_pvp, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        real = tl.load(pm_base + offs_n, mask=n_ok, other=0) != 0
        s = _dot_t(q0, q1, k0, k1, BLOCK_D1) * qk_scale
        s = tl.where(real[None, :], s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = _dot_t(do0, do1, v0, v1, BLOCK_D1)
        ds = p * (dp - delta[:, None])
        dsc = ds.to(K.dtype.element_ty)
        if EMULATE_BF16:
            dsc = _round_bf16(ds)
        dq0, dq1 = _acc_dot(dq0, dq1, dsc, k0, k1, BLOCK_D1)

    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    km_base = KMASK + b * C
    hi = tl.minimum(tl.max(tl.where(row_ok, pos, 0), 0) + 1, C)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < C
        k0, k1 = _load_head(k_base, offs_n * stride_kc, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        v0, v1 = _load_head(v_base, offs_n * stride_vc, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        if HAS_KMASK:
            real = tl.load(km_base + offs_n, mask=n_ok, other=0) != 0
            visible = visible & real[None, :]
        s = _dot_t(q0, q1, k0, k1, BLOCK_D1) * qk_scale
        s = tl.where(visible, s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = _dot_t(do0, do1, v0, v1, BLOCK_D1)
        ds = p * (dp - delta[:, None])
        dsc = ds.to(K.dtype.element_ty)
        if EMULATE_BF16:
            dsc = _round_bf16(ds)
        dq0, dq1 = _acc_dot(dq0, dq1, dsc, k0, k1, BLOCK_D1)

    dq0 = dq0 * SCALE
    dq1 = dq1 * SCALE
    if EMULATE_BF16:
        dq0 = _round_bf16(dq0)
        dq1 = _round_bf16(dq1)
    _store_head(DQ + b * stride_dqb + h * REP * stride_dqh, r * stride_dqh + pos * stride_dqc, row_ok, dq0, dq1,
                HEAD_DIM, BLOCK_D0, BLOCK_D1)


@triton.jit
def _dkdv_step(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q0, q1, do0, do1, visible, LSE_ROW, DELTA_ROW, offs_m, m_ok,
               qk_scale, BLOCK_D1: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """One query block's share of a key block's dK/dV, FlashAttention-2 backward on transposed scores (keys along
    rows, queries along columns): P = exp(S − L) over the ``visible`` (keys × queries) pairs, dV += Pᵀ·dO,
    dK += (P ∘ (dP − D))ᵀ·Q, dP = dO·Vᵀ. ``LSE_ROW``/``DELTA_ROW`` point at the query row's natural-log LSE and
    D = rowsum(dO ∘ O). Used by both dK/dV kernels (completion keys, causal; prompt keys, all visible)."""
    lse2 = tl.load(LSE_ROW + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(DELTA_ROW + offs_m, mask=m_ok, other=0.0)
    st = _dot_t(k0, k1, q0, q1, BLOCK_D1) * qk_scale
    st = tl.where(visible, st, float("-inf"))
    pt = tl.exp2(st - lse2[None, :])
    ptc = pt.to(do0.dtype)
    if EMULATE_BF16:
        ptc = _round_bf16(pt)
    dv0, dv1 = _acc_dot(dv0, dv1, ptc, do0, do1, BLOCK_D1)
    dpt = _dot_t(v0, v1, do0, do1, BLOCK_D1)
    dst = pt * (dpt - delta[None, :])
    dstc = dst.to(q0.dtype)
    if EMULATE_BF16:
        dstc = _round_bf16(dst)
    dk0, dk1 = _acc_dot(dk0, dk1, dstc, q0, q1, BLOCK_D1)
    return dk0, dk1, dv0, dv1


@triton.jit
def _spa_bwd_dkdv_completion_kernel(
    Q, K, V, KMASK, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qc,
    stride_kb, stride_kh, stride_kc,
    stride_vb, stride_vh, stride_vc,
    stride_dob, stride_doh, stride_doc,
    stride_dkb, stride_dkh, stride_dkc,
    stride_dvb, stride_dvh, stride_dvc,
    SCALE, C, C_PAD, HKV,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = (pid_bh % HKV).to(tl.int64)
    qk_scale = SCALE * 1.4426950408889634

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < C
    k0, k1 = _load_head(K + b * stride_kb + h * stride_kh, offs_n * stride_kc, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        EMULATE_BF16)
    v0, v1 = _load_head(V + b * stride_vb + h * stride_vh, offs_n * stride_vc, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        EMULATE_BF16)
    key_ok = n_ok
    if HAS_KMASK:
        key_ok = key_ok & (tl.load(KMASK + b * C + offs_n, mask=n_ok, other=0) != 0)
    dk0, dk1 = _zeros_head(BLOCK_N, BLOCK_D0, BLOCK_D1)
    dv0, dv1 = _zeros_head(BLOCK_N, BLOCK_D0, BLOCK_D1)

    # queries at positions >= the block's first key, for every query head of this kv head
    for r in range(REP):
        head = h * REP + r
        q_base = Q + b * stride_qb + head * stride_qh
        do_base = DO + b * stride_dob + head * stride_doh
        row_base = (b * HKV * REP + head) * C_PAD  # LSE and DELTA are (B, Hq, C_PAD) fp32
        for m0 in range(((pid_n * BLOCK_N) // BLOCK_M) * BLOCK_M, C, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < C
            q0, q1 = _load_head(q_base, offs_m * stride_qc, m_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
            do0, do1 = _load_head(do_base, offs_m * stride_doc, m_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
            visible = key_ok[:, None] & m_ok[None, :] & (offs_n[:, None] <= offs_m[None, :])
            dk0, dk1, dv0, dv1 = _dkdv_step(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q0, q1, do0, do1, visible,
                                            LSE + row_base, DELTA + row_base, offs_m, m_ok, qk_scale, BLOCK_D1,
                                            EMULATE_BF16)  # fmt: skip

    dk0 = dk0 * SCALE
    dk1 = dk1 * SCALE
    if EMULATE_BF16:
        dk0, dk1 = _round_bf16(dk0), _round_bf16(dk1)
        dv0, dv1 = _round_bf16(dv0), _round_bf16(dv1)
    _store_head(DK + b * stride_dkb + h * stride_dkh, offs_n * stride_dkc, n_ok, dk0, dk1, HEAD_DIM, BLOCK_D0,
                BLOCK_D1)
    _store_head(DV + b * stride_dvb + h * stride_dvh, offs_n * stride_dvc, n_ok, dv0, dv1, HEAD_DIM, BLOCK_D0,
                BLOCK_D1)


@triton.jit
def _spa_bwd_dkdv_prefix_kernel(
    Q, PK, PV, ROWS, ROW_START, PSTART, PMASK, DO, LSE, DELTA, DPK, DPV,
    stride_qb, stride_qh, stride_qc,
    stride_pku, stride_pkh, stride_pkp,
    stride_pvu, stride_pvh, stride_pvp,
    stride_dob, stride_doh, stride_doc,
    SCALE, C, C_PAD, P, HKV, N_SPLIT, stride_split,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    # ROWS lists the rows grouped by prompt (ascending within a prompt); ROW_START[u]..ROW_START[u+1] are prompt u's
    # entries. The work of one (key block, prompt, kv head) — every (row, query head, query block) of the group, in
    # that order — is cut into N_SPLIT contiguous ranges, one per program_id(2). Program s writes its fp32 sum to slice
    # s of DPK/DPV (contiguous (N_SPLIT, U, HKV, P, HEAD_DIM), slices stride_split apart), dK already scaled; the
    # slices are summed in order by _spa_bwd_prefix_reduce_kernel. With N_SPLIT == 1 DPK/DPV are the gradients.
    pid_n = tl.program_id(0)
    pid_uh = tl.program_id(1)
    pid_s = tl.program_id(2)
    u = (pid_uh // HKV).to(tl.int64)
    h = (pid_uh % HKV).to(tl.int64)
    qk_scale = SCALE * 1.4426950408889634

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < P
    dk0, dk1 = _zeros_head(BLOCK_N, BLOCK_D0, BLOCK_D1)
    dv0, dv1 = _zeros_head(BLOCK_N, BLOCK_D0, BLOCK_D1)

    pstart = tl.load(PSTART + u)
    if pid_n * BLOCK_N + BLOCK_N > pstart:  # blocks wholly inside the left padding get zero gradient
        k0, k1 = _load_head(PK + u * stride_pku + h * stride_pkh, offs_n * stride_pkp, n_ok, HEAD_DIM, BLOCK_D0,
                            BLOCK_D1, EMULATE_BF16)
        v0, v1 = _load_head(PV + u * stride_pvu + h * stride_pvh, offs_n * stride_pvp, n_ok, HEAD_DIM, BLOCK_D0,
                            BLOCK_D1, EMULATE_BF16)
        key_ok = n_ok & (tl.load(PMASK + u * P + offs_n, mask=n_ok, other=0) != 0)
        g0 = tl.load(ROW_START + u)
        g1 = tl.load(ROW_START + u + 1)
        n_mb = tl.cdiv(C, BLOCK_M)
        per_row = REP * n_mb
        total = ((g1 - g0) * per_row).to(tl.int64)
        lo = ((pid_s * total) // N_SPLIT).to(tl.int32)
        hi = (((pid_s + 1) * total) // N_SPLIT).to(tl.int32)
        for t in range(lo, hi):
            b = tl.load(ROWS + (g0 + t // per_row)).to(tl.int64)
            head = h * REP + (t // n_mb) % REP
            offs_m = (t % n_mb) * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = offs_m < C
            q0, q1 = _load_head(Q + b * stride_qb + head * stride_qh, offs_m * stride_qc, m_ok, HEAD_DIM, BLOCK_D0,
                                BLOCK_D1, EMULATE_BF16)
            do0, do1 = _load_head(DO + b * stride_dob + head * stride_doh, offs_m * stride_doc, m_ok, HEAD_DIM,
                                  BLOCK_D0, BLOCK_D1, EMULATE_BF16)
            row_base = (b * HKV * REP + head) * C_PAD  # LSE and DELTA are (B, Hq, C_PAD) fp32
            dk0, dk1, dv0, dv1 = _dkdv_step(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q0, q1, do0, do1,
                                            key_ok[:, None] & m_ok[None, :], LSE + row_base, DELTA + row_base,
                                            offs_m, m_ok, qk_scale, BLOCK_D1, EMULATE_BF16)  # fmt: skip

    dk0 = dk0 * SCALE
    dk1 = dk1 * SCALE
    out_off = pid_s.to(tl.int64) * stride_split + (u * HKV + h) * P * HEAD_DIM
    if EMULATE_BF16:
        if DPK.dtype.element_ty == tl.bfloat16:  # the gradient itself (N_SPLIT == 1), not an fp32 partial
            dk0, dk1 = _round_bf16(dk0), _round_bf16(dk1)
            dv0, dv1 = _round_bf16(dv0), _round_bf16(dv1)
    _store_head(DPK + out_off, offs_n * HEAD_DIM, n_ok, dk0, dk1, HEAD_DIM, BLOCK_D0, BLOCK_D1)
    _store_head(DPV + out_off, offs_n * HEAD_DIM, n_ok, dv0, dv1, HEAD_DIM, BLOCK_D0, BLOCK_D1)


@triton.jit
def _spa_bwd_prefix_reduce_kernel(
    PART_K, PART_V, DPK, DPV, N, N_SPLIT,
    BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    # DPK[i] = Σ_s PART_K[s, i] for s = 0, 1, ..., N_SPLIT − 1 in this order (deterministic); same for V. N elements per
    # split; every tensor contiguous.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    pk = PART_K + offs
    pv = PART_V + offs
    acc_k = tl.zeros([BLOCK], tl.float32)
    acc_v = tl.zeros([BLOCK], tl.float32)
    for _ in range(N_SPLIT):
        acc_k += tl.load(pk, mask=ok, other=0.0)
        acc_v += tl.load(pv, mask=ok, other=0.0)
        pk += N
        pv += N
    if EMULATE_BF16:
        acc_k = _round_bf16(acc_k)
        acc_v = _round_bf16(acc_v)
    tl.store(DPK + offs, acc_k.to(DPK.dtype.element_ty), mask=ok)
    tl.store(DPV + offs, acc_v.to(DPV.dtype.element_ty), mask=ok)


KERNELS = {
    "fwd": _spa_fwd_kernel,
    "bwd_delta": _spa_bwd_delta_kernel,
    "bwd_dq": _spa_bwd_dq_kernel,
    "bwd_dkdv_completion": _spa_bwd_dkdv_completion_kernel,
    "bwd_dkdv_prefix": _spa_bwd_dkdv_prefix_kernel,
    "bwd_prefix_reduce": _spa_bwd_prefix_reduce_kernel,
}

# kernel name -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for four tiers of head dims: up to 64, up to 128 in one
# head-dim tile, up to 256, and d in (64, 128) as two head-dim tiles (d=80: 64 + 16, d=96: 64 + 32; head_dim_tiles).
# The split tier keeps the 128 tier's tiles except where sm_80 spilled with them (bwd_dq 64×64: 8 to 14 STL) or ptxas
# went to its 255-register cap (fwd 64×64 with 2 stages at d=96; with 3 stages 190 registers). bwd_dkdv_completion
# sits at 255 registers on sm_80 without spilling at every tile tried (16×32 to 64×64, 4 or 8 warps, 1 to 3 stages).
# fp32 inputs use the exact (FMA, not tf32) dot, which needs far smaller tiles to stay within the register file.
# bwd_delta has no key tiles (BLOCK_N unused); bwd_prefix_reduce is elementwise (BLOCK_M elements per program).
# Registers, spills and shared memory of each build for sm_80 and sm_90, compiled with the argument attributes of the
# run-time specialisation, are checked and printed by tests/test_attention_triton_aot.py.
_BLOCKS_16BIT = {
    "fwd": ((64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 3)),
    "bwd_delta": ((64, 0, 4, 1), (32, 0, 4, 1), (16, 0, 4, 1), (32, 0, 4, 1)),
    "bwd_dq": ((64, 32, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 2)),
    "bwd_dkdv_completion": ((32, 64, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2)),
    "bwd_dkdv_prefix": ((32, 64, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2)),
    "bwd_prefix_reduce": ((1024, 0, 4, 1),) * 4,
}
_BLOCKS_FP32 = {
    "fwd": ((16, 16, 4, 2), (16, 16, 4, 2), (16, 16, 4, 1), (16, 16, 4, 2)),
    "bwd_delta": ((64, 0, 4, 1), (32, 0, 4, 1), (16, 0, 4, 1), (32, 0, 4, 1)),
    "bwd_dq": ((16, 16, 4, 2), (16, 16, 8, 2), (16, 16, 4, 1), (16, 16, 8, 2)),
    "bwd_dkdv_completion": ((16, 32, 4, 2), (16, 16, 4, 1), (16, 32, 8, 1), (16, 16, 4, 1)),
    "bwd_dkdv_prefix": ((16, 32, 4, 2), (16, 32, 4, 2), (16, 32, 8, 1), (16, 32, 4, 2)),
    "bwd_prefix_reduce": ((1024, 0, 4, 1),) * 4,
}
_TIER = {64: 0, 128: 1, 256: 2}
_TIER_SPLIT_128 = 3  # head dims in (64, 128) that run as two head-dim tiles
# The prefix dK/dV work is split until the grid has this many programs per SM (see prefix_dkdv_grid).
_PROGRAMS_PER_SM = 2
# SM count assumed for CPU tensors (Triton's interpreter): an H100 SXM's, so the interpreter runs the split GPUs run.
_DEFAULT_SM_COUNT = 132
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_I32_MAX = 2**31 - 1


def block_config(name: str, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Shipped launch configuration of kernel ``name`` for ``head_dim`` and input ``dtype``.

    Returns a dict with BLOCK_M, BLOCK_N, num_warps, num_stages. Chosen so that the sm_80 and sm_90 builds have no
    register spills (checked by ``tests/test_attention_triton_aot.py``).
    Raises ValueError for an unknown name or a head dim outside [1, 256].
    """
    if name not in KERNELS:
        raise ValueError(f"unknown kernel name {name!r}; expected one of {sorted(KERNELS)}")
    tier = _TIER[max(64, _block_d(head_dim))]
    if tier == _TIER[128] and head_dim_tiles(head_dim)[1]:
        tier = _TIER_SPLIT_128
    block_m, block_n, warps, stages = (_BLOCKS_FP32 if dtype == torch.float32 else _BLOCKS_16BIT)[name][tier]
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def _block_d(head_dim: int) -> int:
    """The head dim rounded up to a power of two (at least 16): the block-size tier of ``block_config``."""
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head dim must be in [1, 256] for the Triton backend, got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim))


def head_dim_tiles(head_dim: int) -> tuple[int, int]:
    """Widths ``(BLOCK_D0, BLOCK_D1)`` of the two head-dim column tiles the kernels use; ``BLOCK_D1 = 0`` means one.

    tl.dot needs power-of-two tiles of at least 16, so one tile is ``_block_d(head_dim)`` wide: 128 for d=80 and d=96,
    where 37% and 25% of every product would be masked padding. Two tiles, the larger power of two below the head dim
    plus the power of two that covers the rest, are used whenever they are narrower than that: (64, 16) for d=80
    (MMA work 80/128 of one tile), (64, 32) for d=96 (96/128); d=64, 128 and 256 stay one tile, as does d=112
    (64 + 64 is no narrower). Raises ValueError for a head dim outside [1, 256].
    """
    full = _block_d(head_dim)
    if full == 16 or full == head_dim:
        return full, 0
    lo = full // 2
    rest = max(16, triton.next_power_of_2(head_dim - lo))
    return (lo, rest) if lo + rest < full else (full, 0)


def prefix_dkdv_grid(B: int, U: int, Hkv: int, rep: int, C: int, P: int, head_dim: int, dtype: torch.dtype,
                     sm_count: int) -> tuple[int, int, int]:
    """Launch grid ``(key blocks, U·Hkv, splits)`` of the prompt dK/dV kernel.

    One (key block, prompt, kv head) alone gives cdiv(P, BLOCK_N)·U·Hkv programs — 16 for a Qwen2.5-1.5B layer
    (Hkv=2, P=512, one prompt) on a 132-SM H100 — each looping over every (row, query head, query block) of the group.
    That loop is cut into ``splits`` contiguous ranges, as many as needed for ``_PROGRAMS_PER_SM`` programs per SM
    (never more than the average work items of a prompt). Each range's fp32 sum goes to its own slice of a partial
    buffer, reduced in slice order: deterministic, no atomics. The buffer holds 2·splits·U·Hkv·P·d fp32 values, under
    2·(2·_PROGRAMS_PER_SM·sm_count)·BLOCK_N·d values whenever splits > 1 (35 MB for 132 SMs at d=128).
    """
    cfg = block_config("bwd_dkdv_prefix", head_dim, dtype)
    n_blocks = triton.cdiv(P, cfg["BLOCK_N"])
    base = n_blocks * U * Hkv
    if base == 0 or B == 0:
        return (n_blocks, U * Hkv, 1)
    items = triton.cdiv(B, U) * rep * triton.cdiv(C, cfg["BLOCK_M"])  # work items of an average prompt
    splits = max(1, min(triton.cdiv(_PROGRAMS_PER_SM * sm_count, base), items))
    return (n_blocks, U * Hkv, splits)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a cached property, no synchronisation); an H100's otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SM_COUNT


def _launch(name, grid, args, head_dim, dtype, interpret, **constexprs):
    """Launch kernel ``name`` on the device of its first tensor argument (Triton launches on the current device)."""
    if 0 in grid:
        return
    cfg = block_config(name, head_dim, dtype)
    opts = {} if interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    with launch_device(args[0]):
        KERNELS[name][grid](*args, **constexprs, **opts)


def _tile_constexprs(name, head_dim, dtype, interpret) -> dict:
    """HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_M, BLOCK_N and EMULATE_BF16 of the attention kernels."""
    cfg = block_config(name, head_dim, dtype)
    # Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits and truncates fp32 -> bf16 casts;
    # EMULATE_BF16 gives its dots fp32 copies (exact: products of bf16 values are exact in fp32, and the compiled
    # kernels accumulate in fp32 too) and rounds to nearest-even bf16 wherever the GPU build rounds.
    block_d0, block_d1 = head_dim_tiles(head_dim)
    return dict(HEAD_DIM=head_dim, BLOCK_D0=block_d0, BLOCK_D1=block_d1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                EMULATE_BF16=interpret and dtype == torch.bfloat16)


def _kernel_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: any strides, except that the last (head-dim) stride must be 1.

    transformers' q/k/v (``(B, C, H, d)`` projections transposed to ``(B, H, C, d)``) and autograd's output gradients
    already have it, so they are read in place; anything else (e.g. a gradient expanded from a scalar) is copied once.
    """
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _check_offsets(**tensors):
    """The kernels compute the batch / prompt part of an offset in int64 and the rest (head, position, head-dim index,
    within one batch entry) in int32: raise ValueError if that rest can pass 2**31 − 1 elements."""
    for name, x in tensors.items():
        span = sum((n - 1) * st for n, st in zip(x.shape[1:], x.stride()[1:]))
        if x.numel() and span > _I32_MAX:
            raise ValueError(f"{name} spans {span} elements within one batch entry (shape {tuple(x.shape)}, strides "
                             f"{x.stride()}); the Triton kernels need < 2**31")


def _check_dtype(q):
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"the Triton attention kernels take fp16, bf16 or fp32 inputs, got {q.dtype} "
                         f"(fp64: use backend='torch')")


def _padded(n: int) -> int:
    """``n`` rounded up to a multiple of 16: the row length of the LSE / D buffers and of the folded query index, so
    the kernels' address arithmetic sees a multiple of 16 (Triton then vectorises and keeps fewer per-element
    offsets; with an arbitrary completion length it spilled at d=256)."""
    return (n + 15) // 16 * 16


def _prefix_start(prefix_mask):
    """First real key of each prompt (P if it has none), int32 (U,). No host synchronisation."""
    U, P = prefix_mask.shape
    if P == 0:
        return torch.zeros(U, dtype=torch.int32, device=prefix_mask.device)
    # weight key j by P − j: the largest weight among real keys marks the first one; a prompt with none gives P
    weight = torch.arange(P, 0, -1, device=prefix_mask.device, dtype=torch.int32)
    return (P - (prefix_mask * weight).amax(dim=1)).to(torch.int32)


def _prefix_rows(prefix_index, U):
    """Rows grouped by prompt (ascending row index within a prompt), int32 (B,), and CSR offsets int32 (U + 1,):
    prompt u's rows are ``rows[row_start[u]:row_start[u + 1]]``. Sort and binary search: no host synchronisation
    (``bincount`` would read the maximum back to size its output)."""
    sorted_index, rows = torch.sort(prefix_index, stable=True)
    bounds = torch.arange(U + 1, device=prefix_index.device, dtype=prefix_index.dtype)
    row_start = torch.searchsorted(sorted_index, bounds, out_int32=True)
    return rows.to(torch.int32), row_start


def shared_prefix_attention_fwd(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, scale):
    """Launch the forward kernel. Shapes as :func:`grpo_mem.ops.attention.shared_prefix_attention` (validated there).

    Tensors are read in place with their strides (only the head-dim stride must be 1; see ``_kernel_view``), and no
    value is read back to the host. Returns ``(out, lse)``: out (B, Hq, C, d) in q's dtype, with q's strides when q is
    dense (transformers' transposed layout, so ``out.transpose(1, 2)`` is contiguous); lse (B, Hq, C) fp32, a view of a (B, Hq, C rounded up to 16) buffer,
    the natural-log log-sum-exp of the scaled scores over all visible keys (−inf for a query with none).
    Raises ValueError for fp64 inputs or strides too large for int32 offsets within one batch entry.
    """
    _check_dtype(q)
    q, k, v, prefix_k, prefix_v = (_kernel_view(x) for x in (q, k, v, prefix_k, prefix_v))
    B, Hq, C, d = q.shape
    Hkv, P = k.shape[1], prefix_k.shape[2]
    rep = Hq // Hkv
    interpret = q.device.type == "cpu"
    out = torch.empty_like(q)
    out = _kernel_view(out)
    c_pad = _padded(C)
    lse = torch.empty(B, Hq, c_pad, dtype=torch.float32, device=q.device)[..., :C]
    if B == 0 or C == 0:
        return out, lse
    _check_offsets(q=q, k=k, v=v, prefix_k=prefix_k, prefix_v=prefix_v, out=out)
    pstart = _prefix_start(prefix_mask)
    pmask = prefix_mask.contiguous()
    kmask = key_mask.contiguous() if key_mask is not None else pmask  # unread when HAS_KMASK=False
    meta = _tile_constexprs("fwd", d, q.dtype, interpret)
    grid = (triton.cdiv(rep * c_pad, meta["BLOCK_M"]), B * Hkv)
    _launch("fwd", grid, (
        q, k, v, prefix_k, prefix_v, prefix_index, pstart, pmask, kmask, out, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *prefix_k.stride()[:3], *prefix_v.stride()[:3],
        *out.stride()[:3], float(scale), C, c_pad, P, Hkv,
    ), d, q.dtype, interpret, REP=rep, HAS_KMASK=key_mask is not None, **meta)
    return out, lse


def shared_prefix_attention_bwd(dout, q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, out, lse,
                                scale):
    """Launch the backward kernels. ``out``/``lse`` are the forward's results, ``dout`` is (B, Hq, C, d).

    Returns ``(dq, dk, dv, dprefix_k, dprefix_v)`` in the dtypes of q, k, v, prefix_k, prefix_v (fp32 accumulation);
    dq/dk/dv have the strides of q/k/v when those are dense, dprefix_k/v are contiguous. ``D = rowsum(dO ∘ O)`` is
    computed in fp32 by a small kernel into a (B, Hq, C) tensor. No value is read back to the host and no input is
    copied (see ``_kernel_view``). Raises ValueError as :func:`shared_prefix_attention_fwd`.
    """
    _check_dtype(q)
    q, k, v, prefix_k, prefix_v, out, dout = (_kernel_view(x) for x in (q, k, v, prefix_k, prefix_v, out, dout))
    B, Hq, C, d = q.shape
    U, Hkv, P = prefix_k.shape[0], k.shape[1], prefix_k.shape[2]
    rep = Hq // Hkv
    interpret = q.device.type == "cpu"
    dq, dk, dv = (_kernel_view(torch.empty_like(x)) for x in (q, k, v))
    dpk, dpv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (prefix_k, prefix_v))
    if B == 0 or C == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dpk.zero_(), dpv.zero_()
    _check_offsets(q=q, k=k, v=v, prefix_k=prefix_k, prefix_v=prefix_v, out=out, dout=dout, dq=dq, dk=dk, dv=dv)
    c_pad = _padded(C)
    if lse.stride() != (Hq * c_pad, c_pad, 1):  # not the forward's padded buffer: copy into one
        lse = torch.empty(B, Hq, c_pad, dtype=torch.float32, device=q.device)[..., :C].copy_(lse)
    pstart = _prefix_start(prefix_mask)
    rows, row_start = _prefix_rows(prefix_index, U)
    pmask = prefix_mask.contiguous()
    kmask = key_mask.contiguous() if key_mask is not None else pmask
    q_s, k_s, v_s = q.stride()[:3], k.stride()[:3], v.stride()[:3]
    pk_s, pv_s, do_s = prefix_k.stride()[:3], prefix_v.stride()[:3], dout.stride()[:3]
    has_kmask = key_mask is not None

    delta = torch.empty(B, Hq, c_pad, dtype=torch.float32, device=q.device)
    meta = _tile_constexprs("bwd_delta", d, q.dtype, interpret)
    _launch("bwd_delta", (triton.cdiv(C, meta["BLOCK_M"]), B * Hq), (
        out, dout, delta, *out.stride()[:3], *do_s, C, c_pad, Hq,
    ), d, q.dtype, interpret, HEAD_DIM=d, BLOCK_D0=meta["BLOCK_D0"], BLOCK_D1=meta["BLOCK_D1"],
       BLOCK_M=meta["BLOCK_M"])
    meta = _tile_constexprs("bwd_dq", d, q.dtype, interpret)
    _launch("bwd_dq", (triton.cdiv(rep * c_pad, meta["BLOCK_M"]), B * Hkv), (
        q, k, v, prefix_k, prefix_v, prefix_index, pstart, pmask, kmask, dout, lse, delta, dq,
        *q_s, *k_s, *v_s, *pk_s, *pv_s, *do_s, *dq.stride()[:3], float(scale), C, c_pad, P, Hkv,
    ), d, q.dtype, interpret, REP=rep, HAS_KMASK=has_kmask, **meta)
    meta = _tile_constexprs("bwd_dkdv_completion", d, q.dtype, interpret)
    _launch("bwd_dkdv_completion", (triton.cdiv(C, meta["BLOCK_N"]), B * Hkv), (
        q, k, v, kmask, dout, lse, delta, dk, dv,
        *q_s, *k_s, *v_s, *do_s, *dk.stride()[:3], *dv.stride()[:3], float(scale), C, c_pad, Hkv,
    ), d, q.dtype, interpret, REP=rep, HAS_KMASK=has_kmask, **meta)
    meta = _tile_constexprs("bwd_dkdv_prefix", d, q.dtype, interpret)
    grid = prefix_dkdv_grid(B, U, Hkv, rep, C, P, d, q.dtype, _sm_count(q.device))
    n_split, n_elems = grid[2], U * Hkv * P * d
    if n_split == 1:
        part_k, part_v = dpk, dpv
    else:
        part_k, part_v = (torch.empty((n_split, U, Hkv, P, d), dtype=torch.float32, device=q.device) for _ in "kv")
    _launch("bwd_dkdv_prefix", grid, (
        q, prefix_k, prefix_v, rows, row_start, pstart, pmask, dout, lse, delta, part_k, part_v,
        *q_s, *pk_s, *pv_s, *do_s, float(scale), C, c_pad, P, Hkv, n_split, n_elems,
    ), d, q.dtype, interpret, REP=rep, **meta)
    if n_split > 1:
        block = block_config("bwd_prefix_reduce", d, q.dtype)["BLOCK_M"]
        _launch("bwd_prefix_reduce", (triton.cdiv(n_elems, block),), (part_k, part_v, dpk, dpv, n_elems, n_split),
                d, q.dtype, interpret, BLOCK=block, EMULATE_BF16=meta["EMULATE_BF16"])
    return dq, dk, dv, dpk, dpv


def multi_region_attention_fwd(q, k, v, regions, key_mask, scale):
    """Forward of :func:`grpo_mem.ops.attention.multi_region_attention`: the one-region case only (for now)."""
    if len(regions) != 1:
        raise NotImplementedError("the Triton multi-region kernels take exactly one region so far")
    return shared_prefix_attention_fwd(q, k, v, *regions[0], key_mask, scale)


def multi_region_attention_bwd(dout, q, k, v, regions, key_mask, out, lse, scale):
    """Backward of :func:`multi_region_attention_fwd`: ``(dq, dk, dv, [(dregion_k, dregion_v)])``."""
    if len(regions) != 1:
        raise NotImplementedError("the Triton multi-region kernels take exactly one region so far")
    dq, dk, dv, dpk, dpv = shared_prefix_attention_bwd(dout, q, k, v, *regions[0], key_mask, out, lse, scale)
    return dq, dk, dv, [(dpk, dpv)]

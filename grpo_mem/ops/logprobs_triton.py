"""Triton kernels of the fused selective log-softmax (the "triton" backend of ``grpo_mem.ops.logprobs``). The
kernels only: their tile sizes are in ``logprobs_triton_tiles``, the functions that size the grids, chunk the
vocabulary and launch them in ``logprobs_triton_launch``.

Same math and contract as the torch backend (``logprobs_torch``) (its ``linear_logprobs_ref`` is the reference):
z = softcap * tanh((h W^T + b) * logit_scale / softcap) / temperature, log p_y = z_y - LSE(z), H = LSE - sum p z.
Tiling after Apple's Cut Cross-Entropy (arXiv 2411.09009): the logits tile lives only in registers.

Kernels (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``):
- ``_linear_logprobs_fwd_kernel``: grid (token blocks, vocabulary splits). Each program runs the GEMM tile by tile over
  its vocabulary range and keeps fp32 online statistics per row: max m, s = sum e^(z-m), sz = sum e^(z-m) (z-m), the
  target logit. Splits are merged in torch (O(N * splits)).
- Backward, per vocabulary chunk [v_lo, v_hi) (``_vocab_chunk``: equal chunks, the (N, chunk) buffer about W's size):
  ``_linear_logprobs_bwd_dlogits_kernel`` (one program per (token block, vocabulary block) of the chunk) recomputes the
  logits tile (GEMM over H) and writes d_logits once, in the operand dtype, to an (N, chunk) buffer, plus fp32 column
  sums per token block for d_bias; ``_linear_logprobs_bwd_dh_kernel`` is the GEMM d_hidden += d_logits @ W[v_lo:v_hi]
  and ``_linear_logprobs_bwd_dw_kernel`` the GEMM d_weight[v_lo:v_hi] = d_logits^T @ hidden. Both keep their fp32
  output tile in registers over the whole reduction (the chunk, resp. all N rows) and store it once: d_weight directly
  in the weight's dtype (one rounding of the fp32 sum, the same as an fp32 result cast afterwards, without a (V, H)
  fp32 buffer: 2.2 GB at the shape below); d_hidden into an fp32 (N, H) accumulator across chunks, the last chunk
  writing the hidden dtype. Three GEMM passes in the backward (the old fused d_hidden and d_weight kernels each
  recomputed the logits: 4).
  Determinism: no atomics; each output element has one writer and a fixed summation order (chunks in order, d_bias
  partial sums reduced by ``sum(0)``), so results are bitwise reproducible. Cut Cross-Entropy (arXiv 2411.09009)
  fuses these GEMMs into the d_logits kernel with atomic adds instead; this keeps the exact, deterministic default.
- ``_selective_log_softmax_fwd_kernel`` / ``_selective_log_softmax_bwd_kernel``: the same statistics and d_logits over
  given logits (the logit transform applied in the kernel; a column offset for a vocabulary chunk), for
  ``selective_log_softmax`` and for the ``"cublas"`` head (``logprobs_cublas``: logits from cuBLAS GEMMs).

HBM traffic of the backward (estimate, not measured; docs/kernels.md, "Triton head kernels"), N=32768, H=3584,
V=152064, bf16, H100 SXM (3.35 TB/s, 989 dense bf16 TFLOP/s: NVIDIA datasheet); one GEMM pass 2*N*V*H = 35.7 TFLOP
= 36 ms. Before (fused kernels with per-tile fp32 slabs): the d_hidden slab moved N*H*8 B * V/128 = 1.12 TB (333 ms),
the d_weight slab V*H*8 B * N/64 = 2.23 TB (666 ms), against 4 GEMM passes (144 ms). Now (10 chunks of 15232):
d_logits buffer written once and read twice, 3*N*V*2 B = 29.9 GB (8.9 ms); fp32 d_hidden accumulator read and
written once per chunk, 8.7 GB (2.6 ms); d_weight written once, V*H*2 B = 1.1 GB; d_bias partials 0.6 GB; hidden and W
read once per GEMM pass, 4.0 GB: 44 GB, 13 ms, against 3 GEMM passes (108 ms). Operand re-reads beyond once per pass
(tiles whose panels fall out of L2; the grouped launch order limits them) are not modeled: a GPU measurement.

Float hyperparameters are runtime arguments cast to fp32 inside the kernels (Inductor passes Python floats as fp64,
Liger-Kernel #1366). On GPUs, fp32 inputs use 3xTF32 dots (``input_precision="tf32x3"``: hi/lo TF32 split, error
near fp32 rounding; plain "ieee" FMA dots spilled on sm_90); bf16/fp16 inputs use native dots with fp32 accumulators,
the dlogits tile being rounded to the input dtype as the dot operand of the backward (as CCE does).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["KERNELS"]


@triton.jit
def _logits_tile(
    H_BLK, W_BLK, B_BLK, n_rows, n_cols, H, stride_hn, stride_wv, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # (BLOCK_N, BLOCK_V) fp32 tile of h W^T + b (pre-scale logits) for the block whose first hidden row is H_BLK and
    # first weight row is W_BLK (64-bit scalar bases; in-block offsets stay 32-bit). Masked entries hold finite junk.
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    r_in = r < n_rows
    c_in = c < n_cols
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_in = ks < H
        h = tl.load(H_BLK + r[:, None] * stride_hn + ks[None, :], mask=r_in[:, None] & k_in[None, :], other=0.0)
        w = tl.load(W_BLK + c[:, None] * stride_wv + ks[None, :], mask=c_in[:, None] & k_in[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B_BLK + c, mask=c_in, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1 (core Triton has no tanh)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _neg_expm1(x):
    # 1 - e^x for x <= 0 without cancellation near 0 (Taylor series for |x| < 0.1: truncation < 2e-8 relative)
    series = -x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(x > -0.1, series, 1.0 - tl.exp(x))


@triton.jit
def _fold(z, valid, m, s, sz, HAS_ENTROPY: tl.constexpr):
    # fold a transformed tile z (invalid entries -inf) into the running row statistics. z may hold -inf anywhere
    # (masked vocabulary): a row with no finite value yet keeps m = -inf, s = 0 and subtracts 0 instead of its max
    # (-inf - (-inf) is NaN), and e * d is taken as 0 where e = 0 (0 * (-inf) is NaN).
    new_m = tl.maximum(m, tl.max(z, axis=1))
    ref = tl.where(new_m == float("-inf"), 0.0, new_m)
    d = z - ref[:, None]
    e = tl.where(valid, tl.exp(d), 0.0)
    alpha = tl.exp(m - ref)
    if HAS_ENTROPY:
        old = tl.where(s > 0.0, alpha * (sz + (m - ref) * s), 0.0)
        sz = old + tl.sum(tl.where(e > 0.0, e * d, 0.0), axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return new_m, s, sz


@triton.jit
def _dlogits(
    a, is_y, lse, ent, glp, gent, lp_y, scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr, HAS_LP_Y: tl.constexpr
):
    # d(sum glp*logp + gent*H)/d(a) for a pre-scale tile a, fp32; is_y marks the target entries and the per-row
    # lse, ent, glp, gent (and lp_y, the forward's saved log-prob) come broadcastable to a (rows on axis 0, or on
    # axis 1 for a transposed tile). Rows with glp = gent = 0 give 0.
    # With HAS_LP_Y the target entry uses the saved log p_y: a recomputed tile may differ from the forward's by an ulp
    # of z (another dot orientation), and for a confident row (1 - p_y ~ 1e-12) that ulp (~4e-6 at z = 50) would
    # dominate 1 - p_y = -expm1(log p_y).
    u = a * scale
    if HAS_SOFTCAP:
        t = _tanh(u / softcap)
        lp = t * (softcap * inv_t) - lse
        chain = (1.0 - t * t) * (inv_t * scale)
    else:
        lp = u * inv_t - lse
        chain = inv_t * scale
    p = tl.exp(lp)
    h_term = gent * (lp + ent)
    # off target: -p (glp + h_term); on target: glp (1 - p) - p h_term, with 1 - p = -expm1(lp) formed accurately
    if HAS_LP_Y:
        lp_t = lp_y
    else:
        lp_t = lp
    dz_y = glp * _neg_expm1(lp_t) - tl.exp(lp_t) * (gent * (lp_t + ent))
    # p = 0 (a -inf logit, or an underflow) gives exactly 0: p * (lp + ent) would be 0 * (-inf) = NaN at lp = -inf
    dz = tl.where(is_y, dz_y, tl.where(p > 0.0, -p * (glp + h_term), 0.0))
    return dz * chain


@triton.jit
def _transform(a, scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr):
    u = a * scale
    if HAS_SOFTCAP:
        u = _tanh(u / softcap) * softcap
    return u * inv_t


@triton.jit
def _row_grads(
    TARGET, LSE, ENT, GLP, GENT, LOGP, n0, n_rows, v0, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # per-row saved statistics and upstream gradients of rows [n0, n0 + n_rows); target made tile-local to v0
    r = tl.arange(0, BLOCK_N)
    r_in = r < n_rows
    tgt = tl.load(TARGET + n0 + r, mask=r_in, other=-1)
    local = tl.where(tgt >= 0, tgt - v0, -1)
    lse = tl.load(LSE + n0 + r, mask=r_in, other=0.0)
    lp_y = tl.load(LOGP + n0 + r, mask=r_in, other=0.0)
    glp = tl.zeros((BLOCK_N,), tl.float32)
    gent = tl.zeros((BLOCK_N,), tl.float32)
    ent = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_GLP:
        glp = tl.load(GLP + n0 + r, mask=r_in, other=0.0)
    if HAS_GENT:
        gent = tl.load(GENT + n0 + r, mask=r_in, other=0.0)
        ent = tl.load(ENT + n0 + r, mask=r_in, other=0.0)
    return local, lse, ent, glp, gent, lp_y


@triton.jit
def _linear_logprobs_fwd_kernel(
    HIDDEN, WEIGHT, BIAS, TARGET, M_OUT, S_OUT, SZ_OUT, ZY_OUT, N, V, H, stride_hn, stride_wv, V_PER_SPLIT, scale,
    softcap, inv_t, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    inv_t = tl.cast(inv_t, tl.float32)
    n0 = tl.program_id(0).to(tl.int64) * BLOCK_N
    split = tl.program_id(1).to(tl.int64)
    n_rows = tl.minimum(N - n0, BLOCK_N).to(tl.int32)
    r = tl.arange(0, BLOCK_N)
    r_in = r < n_rows
    tgt = tl.load(TARGET + n0 + r, mask=r_in, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    sz = tl.zeros((BLOCK_N,), tl.float32)
    zy = tl.zeros((BLOCK_N,), tl.float32)
    v_begin = split * V_PER_SPLIT
    v_end = tl.minimum(v_begin + V_PER_SPLIT, V)
    h_blk = HIDDEN + n0 * stride_hn
    for v0 in range(v_begin, v_end, BLOCK_V):
        n_cols = tl.minimum(v_end - v0, BLOCK_V).to(tl.int32)
        a = _logits_tile(
            h_blk, WEIGHT + v0 * stride_wv, BIAS + v0, n_rows, n_cols, H, stride_hn, stride_wv, HAS_BIAS, PRECISION,
            UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        c = tl.arange(0, BLOCK_V)
        valid = (c < n_cols)[None, :]
        z = tl.where(valid, _transform(a, scale, softcap, inv_t, HAS_SOFTCAP), float("-inf"))  # -inf tail, not 0
        zy += tl.sum(tl.where(c[None, :] == (tgt - v0)[:, None], z, 0.0), axis=1)
        m, s, sz = _fold(z, valid, m, s, sz, HAS_ENTROPY)
    out = split * N + n0 + r  # int64 (split and n0 are)
    tl.store(M_OUT + out, m, mask=r_in)
    tl.store(S_OUT + out, s, mask=r_in)
    tl.store(ZY_OUT + out, zy, mask=r_in)
    if HAS_ENTROPY:
        tl.store(SZ_OUT + out, sz, mask=r_in)


@triton.jit
def _grouped_tile(pid, n_a, n_b, GROUP: tl.constexpr):
    # (a, b) output tile of program pid in grouped order (Triton's matmul tutorial): GROUP consecutive a-blocks sweep
    # the b-blocks together, so the operand panels of a group are reused from L2 instead of re-read from HBM. In int64
    # (block indices that become pointer offsets; a few scalar instructions per program).
    pid = pid.to(tl.int64)
    n_a = n_a.to(tl.int64)
    n_b = n_b.to(tl.int64)
    per_group = GROUP * n_b
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_a - first, GROUP)
    a = first + (pid % per_group) % size
    b = (pid % per_group) // size
    return a, b


@triton.jit
def _linear_logprobs_bwd_dlogits_kernel(
    HIDDEN, WEIGHT, BIAS, TARGET, LSE, ENT, GLP, GENT, LOGP, DLOGITS, DB_PART, N, V_CHUNK, V_OFF, H, stride_hn,
    stride_wv, stride_dn, stride_db, scale, softcap, inv_t, HAS_BIAS: tl.constexpr, HAS_DB: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
):
    # One (BLOCK_N, BLOCK_V) tile of the vocabulary chunk [V_OFF, V_OFF + V_CHUNK): WEIGHT / BIAS point at the chunk's
    # first row. Recomputes the logits (GEMM over H, fp32 accumulator), forms d_logits in fp32 and stores it once,
    # rounded to the dtype of DLOGITS (the GEMM operand dtype), into the (N, V_CHUNK) buffer; with HAS_DB the fp32
    # column sums of the tile go to row n-block of the (n_blocks, >= V_CHUNK) DB_PART buffer (no atomics).
    scale = tl.cast(scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    inv_t = tl.cast(inv_t, tl.float32)
    nb, vb = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V_CHUNK, BLOCK_V), GROUP)
    n0 = nb * BLOCK_N
    v0 = vb * BLOCK_V
    n_rows = tl.minimum(N - n0, BLOCK_N).to(tl.int32)
    n_cols = tl.minimum(V_CHUNK - v0, BLOCK_V).to(tl.int32)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    r_in = r < n_rows
    c_in = c < n_cols
    a = _logits_tile(
        HIDDEN + n0 * stride_hn, WEIGHT + v0 * stride_wv, BIAS + v0, n_rows, n_cols, H, stride_hn, stride_wv, HAS_BIAS,
        PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
    )
    local, lse, ent, glp, gent, lp_y = _row_grads(
        TARGET, LSE, ENT, GLP, GENT, LOGP, n0, n_rows, V_OFF + v0, HAS_GLP, HAS_GENT, BLOCK_N
    )
    is_y = c[None, :] == local[:, None]
    da = _dlogits(
        a, is_y, lse[:, None], ent[:, None], glp[:, None], gent[:, None], lp_y[:, None], scale, softcap, inv_t,
        HAS_SOFTCAP, True,
    )
    msk = r_in[:, None] & c_in[None, :]
    da = tl.where(msk, da, 0.0)
    if HAS_DB:
        tl.store(DB_PART + nb * stride_db + v0 + c, tl.sum(da, axis=0), mask=c_in)
    tl.store(
        DLOGITS + n0 * stride_dn + v0 + (r[:, None] * stride_dn + c[None, :]), da.to(DLOGITS.dtype.element_ty), mask=msk
    )


@triton.jit
def _gemm_tile(A, B, stride_am, stride_ak, stride_bk, m, kk, j, m_in, j_in, K, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
    # (len(m), len(j)) fp32 tile of A @ B over k in [0, K): element (m, k) of A at A + m * stride_am + k * stride_ak,
    # element (k, j) of B at B + k * stride_bk + j, for the index ranges m, kk (= tl.arange(0, BLOCK_K)) and j; rows
    # m_in of A and columns j_in of B are real (the rest reads 0). The accumulator stays in registers over the whole
    # reduction. The GEMM of the d_hidden and d_weight kernels (a stride of 1 passed as the literal 1 folds away, so
    # each builds as if written out).
    acc = tl.zeros((m.shape[0], j.shape[0]), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = tl.cast(k_start, tl.int64)
        k_in = kk < (K - k).to(tl.int32)
        a = tl.load(A + k * stride_ak + (m[:, None] * stride_am + kk[None, :] * stride_ak),
                    mask=m_in[:, None] & k_in[None, :], other=0.0)
        b = tl.load(B + k * stride_bk + (kk[:, None] * stride_bk + j[None, :]), mask=k_in[:, None] & j_in[None, :],
                    other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _linear_logprobs_bwd_dh_kernel(
    DLOGITS, WEIGHT, DH_ACC, DH_OUT, N, V_CHUNK, H, stride_dn, stride_wv,
    ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
):
    # d_hidden[n-block, h-block] (+)= d_logits[n-block, chunk] @ W[chunk, h-block]: a plain GEMM whose fp32 output tile
    # stays in registers over the whole chunk and is written once. ACCUMULATE adds the fp32 (N, H) DH_ACC of the
    # previous chunks; DH_OUT is that accumulator again, or the final d_hidden (its dtype) for the last chunk.
    nb, hb = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(H, BLOCK_H), GROUP)
    n0 = nb * BLOCK_N
    k0 = hb * BLOCK_H
    n_rows = tl.minimum(N - n0, BLOCK_N).to(tl.int32)
    n_ks = tl.minimum(H - k0, BLOCK_H).to(tl.int32)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_H)
    r_in = r < n_rows
    k_in = ks < n_ks
    acc = _gemm_tile(DLOGITS + n0 * stride_dn, WEIGHT + k0, stride_dn, 1, stride_wv, r, c, ks, r_in, k_in, V_CHUNK,
                     PRECISION, UPCAST, BLOCK_V)
    offs = n0 * H + k0 + (r[:, None] * H + ks[None, :])
    msk = r_in[:, None] & k_in[None, :]
    if ACCUMULATE:
        acc += tl.load(DH_ACC + offs, mask=msk, other=0.0)
        # DH_OUT may be DH_ACC: every thread's load of the tile precedes any thread's store of it
        tl.debug_barrier()
    tl.store(DH_OUT + offs, acc.to(DH_OUT.dtype.element_ty), mask=msk)


@triton.jit
def _linear_logprobs_bwd_dw_kernel(
    DLOGITS, HIDDEN, DW, N, V_CHUNK, H, stride_dn, stride_hn,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
):
    # d_weight[chunk v-block, h-block] = d_logits[:, v-block]^T @ hidden[:, h-block]: the fp32 output tile stays in
    # registers over all N rows and is stored once, rounded to DW's dtype (DW points at the chunk's first row). The
    # d_logits^T tile (BLOCK_V, BLOCK_N) is read straight from the row-major buffer (row stride 1, reduction stride
    # stride_dn).
    vb, hb = _grouped_tile(tl.program_id(0), tl.cdiv(V_CHUNK, BLOCK_V), tl.cdiv(H, BLOCK_H), GROUP)
    v0 = vb * BLOCK_V
    k0 = hb * BLOCK_H
    n_cols = tl.minimum(V_CHUNK - v0, BLOCK_V).to(tl.int32)
    n_ks = tl.minimum(H - k0, BLOCK_H).to(tl.int32)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_H)
    c_in = c < n_cols
    k_in = ks < n_ks
    acc = _gemm_tile(DLOGITS + v0, HIDDEN + k0, 1, stride_dn, stride_hn, c, r, ks, c_in, k_in, N, PRECISION, UPCAST,
                     BLOCK_N)
    tl.store(DW + v0 * H + k0 + (c[:, None] * H + ks[None, :]), acc.to(DW.dtype.element_ty),
             mask=c_in[:, None] & k_in[None, :])


@triton.jit
def _selective_log_softmax_fwd_kernel(
    LOGITS, TARGET, M_OUT, S_OUT, SZ_OUT, ZY_OUT, V, stride_n, V0, scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # one program per row; statistics as in _linear_logprobs_fwd_kernel with a (1, BLOCK_V) tile. The logits are
    # vocabulary columns V0 .. V0 + V of the transform's input (scale, soft-cap, 1/temperature applied here)
    scale = tl.cast(scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    inv_t = tl.cast(inv_t, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    tgt = tl.load(TARGET + row) - V0
    m = tl.full((1,), float("-inf"), tl.float32)
    s = tl.zeros((1,), tl.float32)
    sz = tl.zeros((1,), tl.float32)
    zy = tl.zeros((1,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        valid = (cols < V)[None, :]
        a = tl.load(LOGITS + row * stride_n + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        z = tl.where(valid, _transform(a, scale, softcap, inv_t, HAS_SOFTCAP), float("-inf"))
        zy += tl.sum(tl.where(cols[None, :] == tgt, z, 0.0), axis=1)
        m, s, sz = _fold(z, valid, m, s, sz, HAS_ENTROPY)
    one = tl.arange(0, 1)
    tl.store(M_OUT + row + one, m)
    tl.store(S_OUT + row + one, s)
    tl.store(ZY_OUT + row + one, zy)
    if HAS_ENTROPY:
        tl.store(SZ_OUT + row + one, sz)


@triton.jit
def _selective_log_softmax_bwd_kernel(
    LOGITS, DLOGITS, TARGET, LSE, ENT, GLP, GENT, LOGP, V, stride_n, V0, scale, softcap, inv_t, HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LP_Y: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # d_logits of vocabulary columns V0 .. V0 + V; with HAS_LP_Y the target entry takes the forward's log-prob (LOGP)
    scale = tl.cast(scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    inv_t = tl.cast(inv_t, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1).to(tl.int64) * BLOCK_V
    c = tl.arange(0, BLOCK_V)
    col_mask = c < (V - col0).to(tl.int32)
    one = tl.arange(0, 1)
    tgt = tl.load(TARGET + row + one) - V0
    lse = tl.load(LSE + row + one)
    lp_y = lse
    if HAS_LP_Y:
        lp_y = tl.load(LOGP + row + one)
    glp = tl.zeros((1,), tl.float32)
    gent = tl.zeros((1,), tl.float32)
    ent = tl.zeros((1,), tl.float32)
    if HAS_GLP:
        glp = tl.load(GLP + row + one)
    if HAS_GENT:
        gent = tl.load(GENT + row + one)
        ent = tl.load(ENT + row + one)
    a = tl.load(LOGITS + (row * stride_n + col0) + c[None, :], mask=col_mask[None, :], other=0.0).to(tl.float32)
    is_y = c[None, :] == (tgt - col0)[:, None]
    da = _dlogits(
        a, is_y, lse[:, None], ent[:, None], glp[:, None], gent[:, None], lp_y[:, None], scale, softcap, inv_t,
        HAS_SOFTCAP, HAS_LP_Y,
    )
    tl.store(DLOGITS + (row * stride_n + col0) + c[None, :], da.to(DLOGITS.dtype.element_ty), mask=col_mask[None, :])


KERNELS = {
    "linear_logprobs_fwd": _linear_logprobs_fwd_kernel,
    "linear_logprobs_bwd_dlogits": _linear_logprobs_bwd_dlogits_kernel,
    "linear_logprobs_bwd_dh": _linear_logprobs_bwd_dh_kernel,
    "linear_logprobs_bwd_dw": _linear_logprobs_bwd_dw_kernel,
    "selective_log_softmax_fwd": _selective_log_softmax_fwd_kernel,
    "selective_log_softmax_bwd": _selective_log_softmax_bwd_kernel,
}
"""Kernel name (the key of the tile tables and of the AOT tests) -> ``@triton.jit`` function."""

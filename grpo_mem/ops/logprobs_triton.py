"""Triton kernels of the fused selective log-softmax (the "triton" backend of ``grpo_mem.ops.logprobs``).

Same math and contract as the torch backend in ``logprobs.py`` (its ``linear_logprobs_ref`` is the reference):
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
- ``_selective_log_softmax_fwd_kernel`` / ``_selective_log_softmax_bwd_kernel``: the same statistics over given logits.

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

import torch
import triton
import triton.language as tl

from ._device import launch_device
from ._rowstats import finish_row_stats

__all__ = [
    "linear_logprobs_fwd",
    "linear_logprobs_bwd",
    "selective_log_softmax_fwd",
    "selective_log_softmax_bwd",
    "KERNELS",
    "SHIPPED_CONFIGS",
]

# Shipped block sizes on CUDA, per kernel and operand dtype (bf16 and fp16 share tiles; fp32 operands use 3xTF32
# dots and smaller tiles). Chosen on the builds that run (runtime divisibility attributes, sm_80 and sm_90): no spills,
# checked by tests/test_logprobs_triton_aot.py, whose printout is the resource table of docs/kernels.md. Not timed (no GPU here):
# the bf16 choices rest on registers and shared memory per SM (65536 registers; 163 / 227 KB shared on sm_80 / sm_90).
# fwd (64 x 128 x 32, 2 stages) sits at 127-128 registers, the limit for 2 CTAs of 8 warps per SM: BLOCK_H=64 or a
# third stage gives 141-174 (one CTA), so it keeps its tile. The d_logits kernel stays at 128 registers with BLOCK_H=64
# and 3 stages (half the K iterations, a deeper pipeline, 2 CTAs still fit in shared memory). The d_hidden GEMM needs
# 186-196 registers (one CTA per SM either way), so it takes a 4th stage into the otherwise idle shared memory; the
# d_weight GEMM keeps 3 stages, which lets 2 CTAs per SM share sm_90's shared memory at its 107 registers.
# 128 x 256 output tiles (Triton's H100 matmul tile) build without spills too (202-246 registers) but were not taken
# untimed. GROUP: output-tile grouping of the launch order (L2 reuse of operand panels). The CPU interpreter uses
# small tiles (tl.dot needs every dimension >= 16) and narrow vocabulary chunks, so that the test shapes cross every
# block and chunk boundary.
CUDA_CONFIGS = {
    "lowp": {
        "linear_logprobs_fwd": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=32, num_warps=8, num_stages=2),
        "linear_logprobs_bwd_dlogits": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, GROUP=8, num_warps=8, num_stages=3),
        "linear_logprobs_bwd_dh": dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=128, GROUP=8, num_warps=8, num_stages=4),
        "linear_logprobs_bwd_dw": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=128, GROUP=8, num_warps=8, num_stages=3),
    },
    "fp32": {
        "linear_logprobs_fwd": dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=16, num_warps=4, num_stages=2),
        "linear_logprobs_bwd_dlogits": dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=16, GROUP=8, num_warps=4, num_stages=2),
        "linear_logprobs_bwd_dh": dict(BLOCK_N=64, BLOCK_V=32, BLOCK_H=64, GROUP=8, num_warps=4, num_stages=2),
        "linear_logprobs_bwd_dw": dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=64, GROUP=8, num_warps=4, num_stages=2),
    },
}
INTERPRET_CONFIG = dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=32, GROUP=2, num_warps=4, num_stages=1)
# Vocabulary chunks of the backward (columns of the (N, chunk) d_logits buffer): on CUDA, V is cut into the fewest equal
# chunks (multiples of 64 columns) no wider than max(V * H / N, CHUNK_V_MIN) + 63: the buffer about the size of the
# weight at most, and at least CHUNK_V_MIN wide so that the fp32 d_hidden accumulator, read and written once per chunk
# (8 * N * H bytes), stays small against the chunk's GEMMs (6 * N * chunk * H FLOP): at 4096 that is 8 / (6 * 4096) =
# 3.3e-4 B/FLOP, about 1/10 of an H100's 3.35 TB/s / 989 TFLOP/s = 3.4e-3. Equal chunks: a narrow remainder chunk
# would launch too few d_weight programs (each reducing over all N rows), e.g. 112 for a 512-column remainder at
# N = 131072.
CHUNK_V_MIN = 4096
INTERPRET_CHUNK_V = 128
SLS_CUDA_CONFIG = dict(BLOCK_V=2048, num_warps=8, num_stages=1)
SLS_INTERPRET_CONFIG = dict(BLOCK_V=128, num_warps=4, num_stages=1)


@triton.jit
def _logits_tile(
    H_BLK,
    W_BLK,
    B_BLK,
    n_rows,
    n_cols,
    H,
    stride_hn,
    stride_wv,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
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
    TARGET,
    LSE,
    ENT,
    GLP,
    GENT,
    LOGP,
    n0,
    n_rows,
    v0,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
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
    HIDDEN,
    WEIGHT,
    BIAS,
    TARGET,
    M_OUT,
    S_OUT,
    SZ_OUT,
    ZY_OUT,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
    V_PER_SPLIT,
    scale,
    softcap,
    inv_t,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
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
            h_blk,
            WEIGHT + v0 * stride_wv,
            BIAS + v0,
            n_rows,
            n_cols,
            H,
            stride_hn,
            stride_wv,
            HAS_BIAS,
            PRECISION,
            UPCAST,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
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
    HIDDEN,
    WEIGHT,
    BIAS,
    TARGET,
    LSE,
    ENT,
    GLP,
    GENT,
    LOGP,
    DLOGITS,
    DB_PART,
    N,
    V_CHUNK,
    V_OFF,
    H,
    stride_hn,
    stride_wv,
    stride_dn,
    stride_db,
    scale,
    softcap,
    inv_t,
    HAS_BIAS: tl.constexpr,
    HAS_DB: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr,
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
        HIDDEN + n0 * stride_hn,
        WEIGHT + v0 * stride_wv,
        BIAS + v0,
        n_rows,
        n_cols,
        H,
        stride_hn,
        stride_wv,
        HAS_BIAS,
        PRECISION,
        UPCAST,
        BLOCK_N,
        BLOCK_V,
        BLOCK_H,
    )
    local, lse, ent, glp, gent, lp_y = _row_grads(
        TARGET, LSE, ENT, GLP, GENT, LOGP, n0, n_rows, V_OFF + v0, HAS_GLP, HAS_GENT, BLOCK_N
    )
    is_y = c[None, :] == local[:, None]
    da = _dlogits(
        a,
        is_y,
        lse[:, None],
        ent[:, None],
        glp[:, None],
        gent[:, None],
        lp_y[:, None],
        scale,
        softcap,
        inv_t,
        HAS_SOFTCAP,
        True,
    )
    msk = r_in[:, None] & c_in[None, :]
    da = tl.where(msk, da, 0.0)
    if HAS_DB:
        tl.store(DB_PART + nb * stride_db + v0 + c, tl.sum(da, axis=0), mask=c_in)
    tl.store(
        DLOGITS + n0 * stride_dn + v0 + (r[:, None] * stride_dn + c[None, :]), da.to(DLOGITS.dtype.element_ty), mask=msk
    )


@triton.jit
def _linear_logprobs_bwd_dh_kernel(
    DLOGITS,
    WEIGHT,
    DH_ACC,
    DH_OUT,
    N,
    V_CHUNK,
    H,
    stride_dn,
    stride_wv,
    ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr,
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
    d_blk = DLOGITS + n0 * stride_dn
    w_blk = WEIGHT + k0
    acc = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
    for v_start in range(0, V_CHUNK, BLOCK_V):
        v = tl.cast(v_start, tl.int64)
        c_in = c < (V_CHUNK - v).to(tl.int32)
        da = tl.load(d_blk + v + (r[:, None] * stride_dn + c[None, :]), mask=r_in[:, None] & c_in[None, :], other=0.0)
        w = tl.load(
            w_blk + v * stride_wv + (c[:, None] * stride_wv + ks[None, :]),
            mask=c_in[:, None] & k_in[None, :],
            other=0.0,
        )
        if UPCAST:
            da = da.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(da, w, acc, input_precision=PRECISION)
    offs = n0 * H + k0 + (r[:, None] * H + ks[None, :])
    msk = r_in[:, None] & k_in[None, :]
    if ACCUMULATE:
        acc += tl.load(DH_ACC + offs, mask=msk, other=0.0)
        # DH_OUT may be DH_ACC: every thread's load of the tile precedes any thread's store of it
        tl.debug_barrier()
    tl.store(DH_OUT + offs, acc.to(DH_OUT.dtype.element_ty), mask=msk)


@triton.jit
def _linear_logprobs_bwd_dw_kernel(
    DLOGITS,
    HIDDEN,
    DW,
    N,
    V_CHUNK,
    H,
    stride_dn,
    stride_hn,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr,
):
    # d_weight[chunk v-block, h-block] = d_logits[:, v-block]^T @ hidden[:, h-block]: the fp32 output tile stays in
    # registers over all N rows and is stored once, rounded to DW's dtype (DW points at the chunk's first row).
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
    d_blk = DLOGITS + v0
    h_blk = HIDDEN + k0
    acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    for n_start in range(0, N, BLOCK_N):
        n = tl.cast(n_start, tl.int64)
        r_in = r < (N - n).to(tl.int32)
        # d_logits^T tile (BLOCK_V, BLOCK_N) read straight from the row-major buffer
        da_t = tl.load(
            d_blk + n * stride_dn + (c[:, None] + r[None, :] * stride_dn), mask=c_in[:, None] & r_in[None, :], other=0.0
        )
        h = tl.load(
            h_blk + n * stride_hn + (r[:, None] * stride_hn + ks[None, :]),
            mask=r_in[:, None] & k_in[None, :],
            other=0.0,
        )
        if UPCAST:
            da_t = da_t.to(tl.float32)
            h = h.to(tl.float32)
        acc = tl.dot(da_t, h, acc, input_precision=PRECISION)
    tl.store(
        DW + v0 * H + k0 + (c[:, None] * H + ks[None, :]),
        acc.to(DW.dtype.element_ty),
        mask=c_in[:, None] & k_in[None, :],
    )


@triton.jit
def _selective_log_softmax_fwd_kernel(
    LOGITS,
    TARGET,
    M_OUT,
    S_OUT,
    SZ_OUT,
    ZY_OUT,
    V,
    stride_n,
    inv_t,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # one program per row; statistics as in _linear_logprobs_fwd_kernel with a (1, BLOCK_V) tile
    inv_t = tl.cast(inv_t, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    tgt = tl.load(TARGET + row)
    m = tl.full((1,), float("-inf"), tl.float32)
    s = tl.zeros((1,), tl.float32)
    sz = tl.zeros((1,), tl.float32)
    zy = tl.zeros((1,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        valid = (cols < V)[None, :]
        z = tl.load(LOGITS + row * stride_n + cols[None, :], mask=valid, other=0.0).to(tl.float32) * inv_t
        z = tl.where(valid, z, float("-inf"))
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
    LOGITS,
    DLOGITS,
    TARGET,
    LSE,
    ENT,
    GLP,
    GENT,
    V,
    stride_n,
    inv_t,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    inv_t = tl.cast(inv_t, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1).to(tl.int64) * BLOCK_V
    c = tl.arange(0, BLOCK_V)
    col_mask = c < (V - col0).to(tl.int32)
    one = tl.arange(0, 1)
    tgt = tl.load(TARGET + row + one)
    lse = tl.load(LSE + row + one)
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
        a, is_y, lse[:, None], ent[:, None], glp[:, None], gent[:, None], lse[:, None], 1.0, 1.0, inv_t, False, False
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


# ----------------------------------------------------------------------------------------------------------------------
# launchers


def _config(device: torch.device, dtype: torch.dtype, name: str) -> dict:
    """Launch configuration of head kernel ``name`` (a key of KERNELS) for operands of ``dtype`` on ``device``."""
    if device.type != "cuda":
        return dict(INTERPRET_CONFIG)
    return dict(CUDA_CONFIGS["fp32" if dtype == torch.float32 else "lowp"][name])


def _vocab_chunk(n_tok: int, vocab: int, hid: int, device: torch.device) -> int:
    """Width of the backward's vocabulary chunks (see CHUNK_V_MIN); the last chunk may be narrower."""
    if device.type != "cuda":
        return INTERPRET_CHUNK_V
    widest = max(vocab * hid // max(n_tok, 1), CHUNK_V_MIN)
    return triton.cdiv(triton.cdiv(vocab, triton.cdiv(vocab, widest)), 64) * 64


def _num_programs_target(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # interpreter: small test shapes still get several splits in every kernel (merge paths exercised)


def _upcast(t: torch.Tensor) -> bool:
    # The CPU interpreter's tl.dot returns garbage for bf16/fp16 operands (triton 3.9, measured: 2e10 error on a 16x16
    # bf16 product), so under the interpreter operands are widened to fp32 after loading and after the dlogits
    # rounding. Products of bf16 values are exact in fp32, so this is the GPU's bf16-dot-with-fp32-accumulator math.
    return t.device.type != "cuda" and t.dtype != torch.float32


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands: 3xTF32 (hi/lo split, error near fp32 rounding) on tensor cores; "ieee" FMA dots spilled on sm_90
    # at every block size tried. For bf16/fp16 operands the value is ignored.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _splits(blocks_main: int, blocks_other: int, block: int, target_programs: int, cap: int) -> tuple[int, int]:
    """Split the loop dimension (``blocks_other`` blocks of ``block``) so that blocks_main * splits >= target, at most
    ``cap`` splits. Returns (splits, elements per split, a multiple of ``block``)."""
    splits = max(1, min(cap, blocks_other, -(-target_programs // max(blocks_main, 1))))
    per = -(-blocks_other // splits) * block
    splits = -(-(blocks_other * block) // per)
    return splits, per


def _common(hidden, weight, p):
    return (float(p.logit_scale), float(p.softcap or 1.0), float(p.inv_t)), p.softcap is not None


def linear_logprobs_fwd(hidden, weight, bias, target, p):
    """Triton forward. hidden (N, H), weight (V, H) same dtype, contiguous; bias (V,) or None; target (N,) int64 with
    -1 on ignored rows. Returns (logp, entropy or None, lse), each (N,) fp32."""
    n_tok, hid = hidden.shape
    vocab = weight.shape[0]
    if n_tok == 0:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if p.return_entropy else None), empty
    cfg = _config(hidden.device, hidden.dtype, "linear_logprobs_fwd")
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
    n_blocks, v_blocks = triton.cdiv(n_tok, bn), triton.cdiv(vocab, bv)
    splits, per = _splits(n_blocks, v_blocks, bv, _num_programs_target(hidden.device), cap=64)
    stats = torch.empty((4, splits, n_tok), device=hidden.device, dtype=torch.float32)
    m, s, sz, zy = stats
    (scale, softcap, inv_t), has_cap = _common(hidden, weight, p)
    with launch_device(hidden):
        _linear_logprobs_fwd_kernel[(n_blocks, splits)](
            hidden,
            weight,
            bias if bias is not None else weight,
            target,
            m,
            s,
            sz,
            zy,
            n_tok,
            vocab,
            hid,
            hidden.stride(0),
            weight.stride(0),
            per,
            scale,
            softcap,
            inv_t,
            HAS_BIAS=bias is not None,
            HAS_SOFTCAP=has_cap,
            HAS_ENTROPY=p.return_entropy,
            PRECISION=_precision(hidden.dtype),
            UPCAST=_upcast(hidden),
            BLOCK_N=bn,
            BLOCK_V=bv,
            BLOCK_H=cfg["BLOCK_H"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    m_all, s_all, sz_all, zy_all = _merge_splits(m, s, sz if p.return_entropy else None, zy)
    return finish_row_stats(m_all, s_all, sz_all, zy_all, target, p.return_entropy)


def _merge_splits(m, s, sz, zy):
    """Merge per-split (splits, N) statistics in split order (fixed, deterministic)."""
    m_all = m.amax(0)
    alpha = torch.exp(m - m_all)
    s_all = (alpha * s).sum(0)
    sz_all = None
    if sz is not None:
        term = torch.where(s > 0, alpha * (sz + (m - m_all) * s), torch.zeros_like(s))
        sz_all = term.sum(0)
    else:
        sz_all = torch.zeros_like(s_all)
    return m_all, s_all, sz_all, zy.sum(0)


def linear_logprobs_bwd(hidden, weight, bias, target, lse, ent, g_lp, g_ent, p, need_dh, need_dw, need_db, logp):
    """Triton backward: (dh, dw, db) in the inputs' dtypes (None where not requested). g_lp / g_ent: (N,) fp32 with
    zeros on ignored rows, or None; logp: the forward's (N,) fp32 log-probs (target term of the dlogits).

    Per vocabulary chunk [v_lo, v_hi) (``_vocab_chunk``): the d_logits kernel recomputes the chunk's logits and writes
    d_logits (N, chunk) once, in the operand dtype (the rounding the dots of the old fused backward applied too), and
    fp32 per-row-block column sums for d_bias; then two GEMMs read that buffer: d_hidden += d_logits @ W[v_lo:v_hi]
    (fp32 (N, H) accumulator across chunks, the last chunk writing d_hidden in the hidden dtype) and
    d_weight[v_lo:v_hi] = d_logits^T @ hidden, reduced over all N in registers and stored once in the weight's dtype
    (one rounding, as an fp32 result cast afterwards would give, without the (V, H) fp32 buffer). Three GEMM passes,
    no atomics: every output element has one writer and a fixed summation order (bitwise reproducible).
    Extra memory: the d_logits buffer (N * chunk elements: about the size of W at most, more only when N > V * H /
    CHUNK_V_MIN), the
    fp32 d_hidden accumulator (N * H * 4 bytes, only for non-fp32 hidden and more than one chunk) and the d_bias
    partial sums (cdiv(N, BLOCK_N) * chunk * 4 bytes)."""
    n_tok, hid = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    if n_tok == 0:  # no rows: zero gradients, no launch (an empty grid is not launchable)
        return (
            torch.zeros_like(hidden) if need_dh else None,
            torch.zeros_like(weight) if need_dw else None,
            torch.zeros_like(bias) if need_db else None,
        )
    cfg_dl = _config(dev, hidden.dtype, "linear_logprobs_bwd_dlogits")
    cfg_dh = _config(dev, hidden.dtype, "linear_logprobs_bwd_dh")
    cfg_dw = _config(dev, hidden.dtype, "linear_logprobs_bwd_dw")
    (scale, softcap, inv_t), has_cap = _common(hidden, weight, p)
    precision, upcast = _precision(hidden.dtype), _upcast(hidden)
    chunk = _vocab_chunk(n_tok, vocab, hid, dev)
    n_chunks = triton.cdiv(vocab, chunk)
    width = min(chunk, triton.cdiv(vocab, 64) * 64)  # buffer columns (row stride a multiple of 64 elements)
    dlogits = torch.empty((n_tok, width), device=dev, dtype=hidden.dtype)
    dummy = lse
    dh = dw = db = dh_acc = db_part = None
    if need_dh:
        dh = torch.empty_like(hidden)
        if n_chunks > 1:
            dh_acc = dh if hidden.dtype == torch.float32 else torch.empty(hidden.shape, device=dev, dtype=torch.float32)
    if need_dw:
        dw = torch.empty_like(weight)
    if need_db:
        db = torch.empty(vocab, device=dev, dtype=torch.float32)
        db_part = torch.empty((triton.cdiv(n_tok, cfg_dl["BLOCK_N"]), width), device=dev, dtype=torch.float32)

    def grid(cfg, rows, cols, brow, bcol):
        return (triton.cdiv(rows, cfg[brow]) * triton.cdiv(cols, cfg[bcol]),)

    def launch_opts(cfg):
        return {k: cfg[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_H", "GROUP", "num_warps", "num_stages")}

    with launch_device(hidden):
        for i in range(n_chunks):
            v_lo = i * chunk
            w_c = min(chunk, vocab - v_lo)
            _linear_logprobs_bwd_dlogits_kernel[grid(cfg_dl, n_tok, w_c, "BLOCK_N", "BLOCK_V")](
                hidden,
                weight[v_lo:],
                bias[v_lo:] if bias is not None else weight,
                target,
                lse,
                ent if ent is not None else dummy,
                g_lp if g_lp is not None else dummy,
                g_ent if g_ent is not None else dummy,
                logp,
                dlogits,
                db_part if need_db else dummy,
                n_tok,
                w_c,
                v_lo,
                hid,
                hidden.stride(0),
                weight.stride(0),
                dlogits.stride(0),
                width,
                scale,
                softcap,
                inv_t,
                HAS_BIAS=bias is not None,
                HAS_DB=need_db,
                HAS_SOFTCAP=has_cap,
                HAS_GLP=g_lp is not None,
                HAS_GENT=g_ent is not None,
                PRECISION=precision,
                UPCAST=upcast,
                **launch_opts(cfg_dl),
            )
            if need_db:  # fixed-order reduction of the row-block partial sums
                db[v_lo : v_lo + w_c] = db_part[:, :w_c].sum(0)
            if need_dh:
                last = i == n_chunks - 1
                _linear_logprobs_bwd_dh_kernel[grid(cfg_dh, n_tok, hid, "BLOCK_N", "BLOCK_H")](
                    dlogits,
                    weight[v_lo:],
                    dh_acc if i > 0 else dh,
                    dh if last else dh_acc,
                    n_tok,
                    w_c,
                    hid,
                    dlogits.stride(0),
                    weight.stride(0),
                    ACCUMULATE=i > 0,
                    PRECISION=precision,
                    UPCAST=upcast,
                    **launch_opts(cfg_dh),
                )
            if need_dw:
                _linear_logprobs_bwd_dw_kernel[grid(cfg_dw, w_c, hid, "BLOCK_V", "BLOCK_H")](
                    dlogits,
                    hidden,
                    dw[v_lo:],
                    n_tok,
                    w_c,
                    hid,
                    dlogits.stride(0),
                    hidden.stride(0),
                    PRECISION=precision,
                    UPCAST=upcast,
                    **launch_opts(cfg_dw),
                )
    if need_db:
        db = db.to(bias.dtype)
    return dh, dw, db


def selective_log_softmax_fwd(logits, target, p):
    """Triton forward over (N, V) contiguous logits: (logp, entropy or None, lse), each (N,) fp32."""
    n_tok, vocab = logits.shape
    cfg = dict(SLS_CUDA_CONFIG if logits.device.type == "cuda" else SLS_INTERPRET_CONFIG)
    stats = torch.empty((4, n_tok), device=logits.device, dtype=torch.float32)
    m, s, sz, zy = stats
    if n_tok:
        with launch_device(logits):
            _selective_log_softmax_fwd_kernel[(n_tok,)](
                logits,
                target,
                m,
                s,
                sz,
                zy,
                vocab,
                logits.stride(0),
                float(p.inv_t),
                HAS_ENTROPY=p.return_entropy,
                BLOCK_V=cfg["BLOCK_V"],
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
            )
    if not p.return_entropy:
        sz = torch.zeros_like(s)
    return finish_row_stats(m, s, sz, zy, target, p.return_entropy)


def selective_log_softmax_bwd(logits, target, lse, ent, g_lp, g_ent, p):
    """Triton backward: d_logits (N, V) in the dtype of ``logits``."""
    n_tok, vocab = logits.shape
    cfg = dict(SLS_CUDA_CONFIG if logits.device.type == "cuda" else SLS_INTERPRET_CONFIG)
    out = torch.empty_like(logits)
    dummy = lse
    if n_tok:
        with launch_device(logits):
            _selective_log_softmax_bwd_kernel[(n_tok, triton.cdiv(vocab, cfg["BLOCK_V"]))](
                logits,
                out,
                target,
                lse,
                ent if ent is not None else dummy,
                g_lp if g_lp is not None else dummy,
                g_ent if g_ent is not None else dummy,
                vocab,
                logits.stride(0),
                float(p.inv_t),
                HAS_GLP=g_lp is not None,
                HAS_GENT=g_ent is not None,
                BLOCK_V=cfg["BLOCK_V"],
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
            )
    return out


SHIPPED_CONFIGS = {
    (name, dtype): (
        dict(SLS_CUDA_CONFIG)
        if name.startswith("selective")
        else dict(CUDA_CONFIGS["fp32" if dtype == torch.float32 else "lowp"][name])
    )
    for name in KERNELS
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
}

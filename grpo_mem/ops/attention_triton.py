"""Triton kernels of multi-region attention (shared-prefix attention is its one-region call): forward, and a
three-kernel backward. The kernels only: their tile sizes are in ``attention_triton_tiles``, the Python functions that
size the grids and launch them in ``attention_triton_launch``.

Same op as :func:`grpo_mem.ops.attention.multi_region_attention` (see there for the semantics). Layout of the work:

* ``_mra_fwd_kernel`` — one program per (block of BLOCK_M folded queries, row b, kv head h). The Hq/Hkv query heads
  of kv head h are folded into the M dimension (query ``m = r·C + i`` is head ``h·rep + r``, position i), so each key
  tile serves every query head of the kv head. Online softmax (FlashAttention-2, Dao, arXiv 2307.08691) runs over one
  region's keys ``region_k[index[b], h]`` read in place (tiles wholly outside the entry's span of real keys are
  skipped; a row with index −1 does nothing), then, in the last launch, causally over the row's own keys. Launches
  chain through a normalised fp32 partial output and the LSE (the exact LSE merge of Hydragen, arXiv 2402.05099):
  with no region or one region there is a single launch, with R regions R launches
  (``attention_triton_inputs.launch_plan``). Writes ``out`` and the natural-log LSE of the scaled scores.
* ``_mra_bwd_dq_kernel`` — same grid and launches; recomputes ``P = exp(S − L)`` with the merged LSE and accumulates
  ``dQ = scale · Σ_j P_ij (dP_ij − D_i) K_j`` with ``D = rowsum(dO ∘ O)``.
* ``_mra_bwd_dkdv_own_kernel`` — one program per (block of own keys, row, kv head); loops over the queries
  that can see the block (all query heads of the kv head, causal lower bound).
* ``_mra_bwd_dkdv_region_kernel`` — per region, one program per (block of keys, entry u, kv head); loops over every
  row reading the entry (rows listed by entry, ascending row index; rows with index −1 are not listed), every query
  head of the kv head and every query block. dK/dV of the entry are accumulated in fp32 registers and written once:
  no atomics, and the summation order (row, then head, then query block) is fixed, so the result is deterministic.
  When the launcher splits that loop over several programs, ``_mra_bwd_region_reduce_kernel`` sums their fp32
  partial results in split order.

Head dims that are not a power of two run as two power-of-two column tiles (d=80: 64 + 16, d=96: 64 + 32; see
``attention_triton_tiles.head_dim_tiles``) instead of one padded 128-wide tile, so no MMA work is spent on padding
columns. With a sliding window, key tiles no query of a block can reach are skipped before their K/V are loaded, so a
query costs O(W) keys of work, plus a position check per tile of the entry.

All products accumulate in fp32 (``tl.dot(..., input_precision="ieee")``: fp32 inputs are not rounded to tf32);
probabilities are cast to the value dtype before ``P·V`` / ``Pᵀ·dO`` as in FlashAttention-2. Runs on CUDA, or on CPU
tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first imported); there the
``EMULATE_BF16`` flag makes bf16 arithmetic match the compiled kernels (see
``attention_triton_launch._tile_constexprs``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["KERNELS"]


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
    x = tl.load(base + (rows[:, None] + offs_d[None, :]), mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
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


# Sliding window (HAS_SLIDING_WINDOW, a constexpr: without it every helper below compiles its test away): key j is
# visible to query i iff 0 <= pos_i - pos_j < SLIDING_WINDOW on the int64 positions the caller gives (QPOS (B, C) for
# queries and own keys, RPOS (U, S) per region entry). A key tile whose positions cannot meet any query position of
# the block inside the sliding window is skipped before its K/V are loaded; the element test runs in int32 on
# positions taken relative to the block's first query position (see _in_sliding_window).
_NO_POS = tl.constexpr(4611686018427387904)  # 2**62: the min of no position (and −2**62 the max); no int64 overflow


@triton.jit
def _pos_range(POS, offs, ok):
    """Positions ``POS[offs]`` (int64, 0 outside ``ok``) and their min and max over ``ok`` (2**62 and −2**62 for
    none)."""
    p = tl.load(POS + offs, mask=ok, other=0)
    return p, tl.min(tl.where(ok, p, _NO_POS), 0), tl.max(tl.where(ok, p, -_NO_POS), 0)


@triton.jit
def _positions(POS, offs, ok, HAS_SLIDING_WINDOW: tl.constexpr):
    """_pos_range with a sliding window; without one, placeholders ``(offs, 0, 0)`` that no helper reads."""
    p, lo, hi = offs, 0, 0
    if HAS_SLIDING_WINDOW:
        p, lo, hi = _pos_range(POS, offs, ok)
    return p, lo, hi


@triton.jit
def _sliding_windows_meet(q_lo, q_hi, k_lo, k_hi, SLIDING_WINDOW, HAS_SLIDING_WINDOW: tl.constexpr):
    """Whether a query position in [q_lo, q_hi] and a key position in [k_lo, k_hi] can satisfy
    ``0 <= q − k < SLIDING_WINDOW`` (False when either range is empty); the constexpr True without a sliding window."""
    meet = True
    if HAS_SLIDING_WINDOW:
        meet = (q_hi >= k_lo) & (q_lo - k_hi < SLIDING_WINDOW)
    return meet


@triton.jit
def _in_sliding_window(visible, q_pos, k_pos, q_lo, q_hi, SLIDING_WINDOW, KEYS_FIRST: tl.constexpr,
                       HAS_SLIDING_WINDOW: tl.constexpr):
    """``visible`` and ``0 <= q_pos[i] − k_pos[j] < SLIDING_WINDOW``: (queries, keys), or (keys, queries) when
    KEYS_FIRST, for queries whose positions lie in [q_lo, q_hi] (others: any value); ``visible`` itself without a
    sliding window. Exact in int32: the query positions are taken relative to q_lo, the key positions too, clamped
    to [−SLIDING_WINDOW, q_hi − q_lo + 1] (a clamped key is invisible either way)."""
    if HAS_SLIDING_WINDOW:
        q_rel = (q_pos - q_lo).to(tl.int32)
        k_rel = tl.minimum(tl.maximum(k_pos - q_lo, -SLIDING_WINDOW), q_hi - q_lo + 1).to(tl.int32)
        if KEYS_FIRST:
            diff = q_rel[None, :] - k_rel[:, None]
        else:
            diff = q_rel[:, None] - k_rel[None, :]
        visible = visible & ((diff >= 0) & (diff < SLIDING_WINDOW))
    return visible


@triton.jit
def _tile_reach(P_BASE, M_BASE, n0, n_end, q_lo, q_hi, SLIDING_WINDOW, BLOCK_N: tl.constexpr, OWN: tl.constexpr,
                HAS_SLIDING_WINDOW: tl.constexpr):
    """``(key positions, live)`` of the key tile from ``n0`` (keys < n_end; P_BASE/M_BASE: the region's positions
    and key mask): whether any of its keys (a region entry's real keys, or any of the row's own keys when OWN) can be
    in the sliding window of a query position in [q_lo, q_hi]. Without a sliding window ``(n0, True)``: every tile is
    live (a constexpr, so the test compiles away)."""
    k_pos = n0  # unread without a sliding window
    live = True
    if HAS_SLIDING_WINDOW:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < n_end
        if not OWN:  # a region entry's padding keys have no position
            ok = ok & (tl.load(M_BASE + offs_n, mask=ok, other=0) != 0)
        k_pos, k_lo, k_hi = _pos_range(P_BASE, offs_n, ok)
        live = _sliding_windows_meet(q_lo, q_hi, k_lo, k_hi, SLIDING_WINDOW, HAS_SLIDING_WINDOW)
    return k_pos, live


@triton.jit
def _key_tile(K_BASE, V_BASE, M_BASE, stride_kn, stride_vn, n0, n_end, pos, window, HEAD_DIM: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, OWN: tl.constexpr,
              HAS_KMASK: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """The key tile from ``n0`` (keys < n_end) of one region: K/V (k0, k1, v0, v1) and their visibility to the
    block's queries at positions ``pos``: a row's own keys (OWN) causally and where the key mask is set (HAS_KMASK); a
    shared region's entry where its key mask is set, as a (1, BLOCK_N) row; and with a sliding window, ``window =
    (q_pos, k_pos, q_lo, q_hi, SLIDING_WINDOW)`` (see _in_sliding_window). K/V are loaded before the mask: that
    order keeps the forward at 202 registers on sm_80 (bf16, d=64), where loading the mask first took it to 255."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_end
    k0, k1 = _load_head(K_BASE, offs_n * stride_kn, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
    v0, v1 = _load_head(V_BASE, offs_n * stride_vn, n_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
    if OWN:
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        if HAS_KMASK:
            visible = visible & (tl.load(M_BASE + offs_n, mask=n_ok, other=0) != 0)[None, :]
    else:
        visible = (tl.load(M_BASE + offs_n, mask=n_ok, other=0) != 0)[None, :]
    q_pos, k_pos, q_lo, q_hi, SLIDING_WINDOW = window
    visible = _in_sliding_window(visible, q_pos, k_pos, q_lo, q_hi, SLIDING_WINDOW, False, HAS_SLIDING_WINDOW)
    return k0, k1, v0, v1, visible


@triton.jit
def _sweep(state, queries, STEP: tl.constexpr, K_BASE, V_BASE, M_BASE, n_lo, n_hi, n_end, P_BASE, stride_kn,
           stride_vn, pos, q_window, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D0: tl.constexpr,
           BLOCK_D1: tl.constexpr, OWN: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr,
           EMULATE_BF16: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold the key tiles from ``n_lo`` (a multiple of BLOCK_N) to ``n_hi`` of one region into ``state`` with
    ``STEP(state, queries, k0, k1, v0, v1, visible, qk_scale, BLOCK_D1, EMULATE_BF16, SOFTCAP)`` (_fwd_step,
    _dq_step), tile by tile in order; tiles out of every query's sliding window (``q_window = (q_pos, q_lo, q_hi,
    SLIDING_WINDOW)``, see _positions) are skipped before their K/V are loaded. The tile loop of the forward and dQ
    kernels, for a shared region's entry and for the row's own keys (OWN) alike."""
    q_pos, q_lo, q_hi, SLIDING_WINDOW = q_window
    for n0 in range(n_lo, n_hi, BLOCK_N):
        k_pos, live = _tile_reach(P_BASE, M_BASE, n0, n_end, q_lo, q_hi, SLIDING_WINDOW, BLOCK_N, OWN,
                                  HAS_SLIDING_WINDOW)
        if live:
            k0, k1, v0, v1, visible = _key_tile(K_BASE, V_BASE, M_BASE, stride_kn, stride_vn, n0, n_end, pos,
                                                (q_pos, k_pos, q_lo, q_hi, SLIDING_WINDOW), HEAD_DIM, BLOCK_N,
                                                BLOCK_D0, BLOCK_D1, OWN, HAS_KMASK, HAS_SLIDING_WINDOW, EMULATE_BF16)
            state = STEP(state, queries, k0, k1, v0, v1, visible, qk_scale, BLOCK_D1, EMULATE_BF16, SOFTCAP)
    return state


@triton.jit
def _tanh(x):
    """tanh in fp32 from one exp2 of −2|x| (no overflow; absolute error ~1e-7 near 0)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # e^{-2|x|}
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _capped(s, SOFTCAP: tl.constexpr):
    """Scores ``s`` in log2 units soft-capped as natural-log scores: ``c·tanh(s·ln2/c)·log2 e``; returns
    ``(capped s, tanh)`` (the backward's ``1 − tanh²``). Only called when SOFTCAP > 0."""
    t = _tanh(s * (0.6931471805599453 / SOFTCAP))
    return t * (SOFTCAP * 1.4426950408889634), t


@triton.jit
def _fwd_step(state, queries, k0, k1, v0, v1, visible, qk_scale, BLOCK_D1: tl.constexpr, EMULATE_BF16: tl.constexpr,
              SOFTCAP: tl.constexpr):
    """One key tile of the online softmax (FlashAttention-2 forward, log2 units), scores kept where ``visible``
    (soft-capped first when SOFTCAP > 0). ``queries = (q0, q1)``; ``state = (m_i, l_i, acc0, acc1)``, the running
    max, sum and unnormalised output: returns it updated. The STEP of _sweep in the forward."""
    q0, q1 = queries
    m_i, l_i, acc0, acc1 = state
    s = _dot_t(q0, q1, k0, k1, BLOCK_D1) * qk_scale
    if SOFTCAP > 0:
        s, _ = _capped(s, SOFTCAP)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    pc = p.to(v0.dtype)
    if EMULATE_BF16:
        pc = _round_bf16(p)
    acc0, acc1 = _scale_rows(acc0, acc1, alpha, BLOCK_D1)
    acc0, acc1 = _acc_dot(acc0, acc1, pc, v0, v1, BLOCK_D1)
    return m_new, l_i, acc0, acc1


@triton.jit
def _dq_step(state, queries, k0, k1, v0, v1, visible, qk_scale, BLOCK_D1: tl.constexpr, EMULATE_BF16: tl.constexpr,
             SOFTCAP: tl.constexpr):
    """One key tile of dQ (FlashAttention-2 backward): ``dq += (P ∘ (dP − D)) · K`` with ``P = exp2(S − L)`` over the
    ``visible`` scores and ``dP = dO · Vᵀ`` (unscaled: the caller multiplies by the softmax scale once); soft-capped
    scores (SOFTCAP > 0) multiply dS by ``1 − tanh²``. ``queries = (q0, q1, do0, do1, lse2, delta)``, ``state = (dq0,
    dq1)``: returns it updated. The STEP of _sweep in the dQ kernel."""
    q0, q1, do0, do1, lse2, delta = queries
    dq0, dq1 = state
    s = _dot_t(q0, q1, k0, k1, BLOCK_D1) * qk_scale
    if SOFTCAP > 0:
        s, t = _capped(s, SOFTCAP)
    s = tl.where(visible, s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    if SOFTCAP > 0:  # folded into P before the dP product: only one score-sized tile stays live across it
        p = p * (1.0 - t * t)
    dp = _dot_t(do0, do1, v0, v1, BLOCK_D1)
    ds = p * (dp - delta[:, None])
    dsc = ds.to(k0.dtype)
    if EMULATE_BF16:
        dsc = _round_bf16(ds)
    return _acc_dot(dq0, dq1, dsc, k0, k1, BLOCK_D1)


@triton.jit
def _mra_fwd_kernel(
    Q, K, V, RK, RV, RIDX, RSPAN, RMASK, KMASK, QPOS, RPOS, OUT, LSE, PREV,
    stride_qb, stride_qh, stride_qc, stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
    stride_rku, stride_rkh, stride_rks, stride_rvu, stride_rvh, stride_rvs, stride_ob, stride_oh, stride_oc,
    SCALE, C, C_PAD, S, HKV, SLIDING_WINDOW,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_REGION: tl.constexpr, HAS_OWN: tl.constexpr,
    HAS_PREV: tl.constexpr, EMULATE_BF16: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr,
):
    # Offsets: the batch / head / entry parts are int64 scalars (b·stride_qb alone passes 2^31 elements at
    # B=16, Hq=40, C=32k, d=128); the in-tile parts stay int32 (the launcher checks they fit).
    # One launch covers one shared region (HAS_REGION) and/or the own region (HAS_OWN), continuing from the normalised
    # partial result of earlier launches (HAS_PREV: PREV fp32 with OUT's strides, its LSE in LSE) and writing the
    # normalised result to OUT (fp32 partial, or the output in q's dtype) and its LSE to LSE. HAS_SLIDING_WINDOW: the
    # sliding window on QPOS/RPOS; key tiles out of every query's reach in this block are skipped (see _sweep).
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
    if HAS_REGION:
        if not HAS_OWN:  # nothing to do for a row reading nothing: every load and store below is masked off
            row_ok = tl.where(tl.load(RIDX + b) >= 0, row_ok, False)  # (row_ok & (u >= 0): the interpreter rejects)
    q_rows = r * stride_qh + pos * stride_qc
    q0, q1 = _load_head(Q + b * stride_qb + h * REP * stride_qh, q_rows, row_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                        EMULATE_BF16)
    # LSE rows are C_PAD apart ((B, Hq, C_PAD) fp32): the queries of kv head h start at (b·HKV + h)·REP·C_PAD.
    # (These output offsets are computed where they are used: kept live across the key loops they cost registers.)
    if HAS_PREV:  # a normalised partial (o, lse) is the online-softmax state (m = lse, l = 1, acc = o)
        lse_prev = tl.load(LSE + (b * HKV + h) * REP * C_PAD + offs_m, mask=row_ok, other=float("-inf"))
        seen = lse_prev != float("-inf")
        m_i = tl.where(seen, lse_prev * 1.4426950408889634, float("-inf"))
        l_i = tl.where(seen, 1.0, 0.0)
        acc0, acc1 = _load_head(PREV + b * stride_ob + h * REP * stride_oh, r * stride_oh + pos * stride_oc,
                                row_ok & seen, HEAD_DIM, BLOCK_D0, BLOCK_D1, False)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0, acc1 = _zeros_head(BLOCK_M, BLOCK_D0, BLOCK_D1)

    q_pos, q_lo, q_hi = _positions(QPOS + b * C, pos, row_ok, HAS_SLIDING_WINDOW)
    state = (m_i, l_i, acc0, acc1)
    if HAS_REGION:  # the row's entry, read in place; tiles wholly outside its span of real keys are skipped
        u = tl.load(RIDX + b)  # int64; -1: row b reads nothing of this region
        reads = u >= 0
        u = tl.maximum(u, 0)
        lo = tl.load(RSPAN + 2 * u)
        hi = tl.where(reads, tl.load(RSPAN + 2 * u + 1), 0)
        state = _sweep(state, (q0, q1), _fwd_step, RK + u * stride_rku + h * stride_rkh,
                       RV + u * stride_rvu + h * stride_rvh, RMASK + u * S, (lo // BLOCK_N) * BLOCK_N, hi, S,
                       RPOS + u * S, stride_rks, stride_rvs, pos, (q_pos, q_lo, q_hi, SLIDING_WINDOW), qk_scale,
                       HEAD_DIM, BLOCK_N, BLOCK_D0, BLOCK_D1, False, True, HAS_SLIDING_WINDOW, EMULATE_BF16, SOFTCAP)
    if HAS_OWN:  # the row's own keys, causal (up to the largest query position in this block)
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh
        km_base = KMASK + b * C
        hi_own = tl.minimum(tl.max(tl.where(row_ok, pos, 0), 0) + 1, C)
        state = _sweep(state, (q0, q1), _fwd_step, k_base, v_base, km_base, 0, hi_own, C, QPOS + b * C, stride_kc,
                       stride_vc, pos,
                       (q_pos, q_lo, q_hi, SLIDING_WINDOW), qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D0, BLOCK_D1, True,
                       HAS_KMASK, HAS_SLIDING_WINDOW, EMULATE_BF16, SOFTCAP)
    m_i, l_i, acc0, acc1 = state

    empty = l_i == 0.0  # no visible key: output 0, LSE -inf
    denom = tl.where(empty, 1.0, l_i)[:, None]
    out0 = acc0 / denom
    out1 = acc1 / denom
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if EMULATE_BF16:
        if OUT.dtype.element_ty == tl.bfloat16:  # the output itself, not an fp32 partial
            out0 = _round_bf16(out0)
            out1 = _round_bf16(out1)
    _store_head(OUT + b * stride_ob + h * REP * stride_oh, r * stride_oh + pos * stride_oc, row_ok, out0, out1,
                HEAD_DIM, BLOCK_D0, BLOCK_D1)
    tl.store(LSE + (b * HKV + h) * REP * C_PAD + offs_m, lse, mask=row_ok)


@triton.jit
def _mra_bwd_delta_kernel(
    OUT, DO, DELTA, stride_ob, stride_oh, stride_oc, stride_dob, stride_doh, stride_doc, C, C_PAD, HQ,
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
def _mra_bwd_dq_kernel(
    Q, K, V, RK, RV, RIDX, RSPAN, RMASK, KMASK, QPOS, RPOS, DO, LSE, DELTA, DQ, PREV,
    stride_qb, stride_qh, stride_qc, stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
    stride_rku, stride_rkh, stride_rks, stride_rvu, stride_rvh, stride_rvs, stride_dob, stride_doh, stride_doc,
    stride_dqb, stride_dqh, stride_dqc, SCALE, C, C_PAD, S, HKV, SLIDING_WINDOW,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_REGION: tl.constexpr, HAS_OWN: tl.constexpr,
    HAS_PREV: tl.constexpr, EMULATE_BF16: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr,
):
    # dQ over one shared region (HAS_REGION) and/or the own region (HAS_OWN), plus the fp32 partial dQ of earlier
    # launches (HAS_PREV: PREV with DQ's strides); writes DQ (an fp32 partial, or dQ in q's dtype). LSE/DELTA are the
    # merged attention's. HAS_SLIDING_WINDOW: the sliding window, tiles skipped as in the forward.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = (pid_bh % HKV).to(tl.int64)
    qk_scale = SCALE * 1.4426950408889634

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r = offs_m // C_PAD
    pos = offs_m % C_PAD
    row_ok = (r < REP) & (pos < C)
    if HAS_REGION:
        u = tl.load(RIDX + b)  # int64; -1: row b reads nothing of this region
        reads = u >= 0
        if not HAS_OWN:  # nothing to do for such a row: every load and store below is masked off
            row_ok = tl.where(reads, row_ok, False)  # (not row_ok & reads: the interpreter rejects that mask)
        u = tl.maximum(u, 0)
    q0, q1 = _load_head(Q + b * stride_qb + h * REP * stride_qh, r * stride_qh + pos * stride_qc, row_ok, HEAD_DIM,
                        BLOCK_D0, BLOCK_D1, EMULATE_BF16)
    do0, do1 = _load_head(DO + b * stride_dob + h * REP * stride_doh, r * stride_doh + pos * stride_doc, row_ok,
                          HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
    row_base = (b * HKV + h) * REP * C_PAD  # LSE and DELTA are (B, Hq, C_PAD) fp32
    lse2 = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # rows without keys: every score is -inf, so P = 0
    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    state = _zeros_head(BLOCK_M, BLOCK_D0, BLOCK_D1)

    q_pos, q_lo, q_hi = _positions(QPOS + b * C, pos, row_ok, HAS_SLIDING_WINDOW)
    queries = (q0, q1, do0, do1, lse2, delta)
    if HAS_REGION:
        lo = tl.load(RSPAN + 2 * u)
        hi = tl.where(reads, tl.load(RSPAN + 2 * u + 1), 0)
        state = _sweep(state, queries, _dq_step, RK + u * stride_rku + h * stride_rkh,
                       RV + u * stride_rvu + h * stride_rvh, RMASK + u * S, (lo // BLOCK_N) * BLOCK_N, hi, S,
                       RPOS + u * S, stride_rks, stride_rvs, pos, (q_pos, q_lo, q_hi, SLIDING_WINDOW), qk_scale,
                       HEAD_DIM, BLOCK_N, BLOCK_D0, BLOCK_D1, False, True, HAS_SLIDING_WINDOW, EMULATE_BF16, SOFTCAP)
    if HAS_OWN:
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh
        km_base = KMASK + b * C
        hi_own = tl.minimum(tl.max(tl.where(row_ok, pos, 0), 0) + 1, C)
        state = _sweep(state, queries, _dq_step, k_base, v_base, km_base, 0, hi_own, C, QPOS + b * C, stride_kc,
                       stride_vc, pos,
                       (q_pos, q_lo, q_hi, SLIDING_WINDOW), qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D0, BLOCK_D1, True,
                       HAS_KMASK, HAS_SLIDING_WINDOW, EMULATE_BF16, SOFTCAP)
    dq0, dq1 = state

    dq0 = dq0 * SCALE
    dq1 = dq1 * SCALE
    dq_base = DQ + b * stride_dqb + h * REP * stride_dqh
    dq_rows = r * stride_dqh + pos * stride_dqc
    if HAS_PREV:
        p0, p1 = _load_head(PREV + b * stride_dqb + h * REP * stride_dqh, dq_rows, row_ok, HEAD_DIM, BLOCK_D0,
                            BLOCK_D1, False)
        dq0 += p0
        if BLOCK_D1 > 0:
            dq1 += p1
    if EMULATE_BF16:
        if DQ.dtype.element_ty == tl.bfloat16:  # dQ itself, not an fp32 partial
            dq0 = _round_bf16(dq0)
            dq1 = _round_bf16(dq1)
    _store_head(dq_base, dq_rows, row_ok, dq0, dq1, HEAD_DIM, BLOCK_D0, BLOCK_D1)


@triton.jit
def _dkdv_step(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q0, q1, do0, do1, visible, LSE_ROW, DELTA_ROW, offs_m, m_ok,
               qk_scale, BLOCK_D1: tl.constexpr, EMULATE_BF16: tl.constexpr, SOFTCAP: tl.constexpr):
    """One query block's share of a key block's dK/dV, FlashAttention-2 backward on transposed scores (keys along
    rows, queries along columns): P = exp(S − L) over the ``visible`` (keys × queries) pairs, dV += Pᵀ·dO,
    dK += (P ∘ (dP − D))ᵀ·Q, dP = dO·Vᵀ. ``LSE_ROW``/``DELTA_ROW`` point at the query row's natural-log LSE and
    D = rowsum(dO ∘ O); soft-capped scores (SOFTCAP > 0) multiply dS by ``1 − tanh²``. Used by both dK/dV kernels
    (completion keys, causal; prompt keys, all visible)."""
    lse2 = tl.load(LSE_ROW + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(DELTA_ROW + offs_m, mask=m_ok, other=0.0)
    st = _dot_t(k0, k1, q0, q1, BLOCK_D1) * qk_scale
    if SOFTCAP > 0:
        st, tt = _capped(st, SOFTCAP)
    st = tl.where(visible, st, float("-inf"))
    pt = tl.exp2(st - lse2[None, :])
    ptc = pt.to(do0.dtype)
    if EMULATE_BF16:
        ptc = _round_bf16(pt)
    dv0, dv1 = _acc_dot(dv0, dv1, ptc, do0, do1, BLOCK_D1)
    dpt = _dot_t(v0, v1, do0, do1, BLOCK_D1)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP > 0:
        dst = dst * (1.0 - tt * tt)
    dstc = dst.to(q0.dtype)
    if EMULATE_BF16:
        dstc = _round_bf16(dst)
    dk0, dk1 = _acc_dot(dk0, dk1, dstc, q0, q1, BLOCK_D1)
    return dk0, dk1, dv0, dv1


@triton.jit
def _dkdv_query_block(dk0, dk1, dv0, dv1, k0, k1, v0, v1, Q_BASE, DO_BASE, stride_qc, stride_doc, visible, LSE_ROW,
                      DELTA_ROW, offs_m, m_ok, qk_scale, QP_ROW, k_window, HEAD_DIM: tl.constexpr,
                      BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, EMULATE_BF16: tl.constexpr,
                      SOFTCAP: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr):
    """Load the queries and output gradients at ``offs_m`` of one (row, query head) (Q_BASE/DO_BASE) and add their
    share to the key block's dK/dV (_dkdv_step), for both dK/dV kernels. With a sliding window (``k_window = (k_pos,
    k_lo, k_hi, SLIDING_WINDOW)``: the key block's positions, their range; QP_ROW: the row's positions) the block is
    skipped when none of its query positions can have a key of the block in its window, and ``visible`` gains the
    window test otherwise."""
    k_pos, k_lo, k_hi, SLIDING_WINDOW = k_window
    q_pos, q_lo, q_hi = _positions(QP_ROW, offs_m, m_ok, HAS_SLIDING_WINDOW)
    if _sliding_windows_meet(q_lo, q_hi, k_lo, k_hi, SLIDING_WINDOW, HAS_SLIDING_WINDOW):
        seen = _in_sliding_window(visible, q_pos, k_pos, q_lo, q_hi, SLIDING_WINDOW, True, HAS_SLIDING_WINDOW)
        q0, q1 = _load_head(Q_BASE, offs_m * stride_qc, m_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        do0, do1 = _load_head(DO_BASE, offs_m * stride_doc, m_ok, HEAD_DIM, BLOCK_D0, BLOCK_D1, EMULATE_BF16)
        dk0, dk1, dv0, dv1 = _dkdv_step(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q0, q1, do0, do1, seen, LSE_ROW,
                                        DELTA_ROW, offs_m, m_ok, qk_scale, BLOCK_D1, EMULATE_BF16, SOFTCAP)
    return dk0, dk1, dv0, dv1


@triton.jit
def _mra_bwd_dkdv_own_kernel(
    Q, K, V, KMASK, QPOS, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qc, stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
    stride_dob, stride_doh, stride_doc, stride_dkb, stride_dkh, stride_dkc, stride_dvb, stride_dvh, stride_dvc,
    SCALE, C, C_PAD, HKV, SLIDING_WINDOW,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_KMASK: tl.constexpr, EMULATE_BF16: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SLIDING_WINDOW: tl.constexpr,
):
    # dK/dV of BLOCK_N of a row's own keys: every query head of the kv head, the query blocks from the key block on
    # (causal). HAS_SLIDING_WINDOW: query blocks none of whose positions has this key block in its window are skipped.
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

    qp_base = QPOS + b * C
    k_pos, k_lo, k_hi = _positions(qp_base, offs_n, key_ok, HAS_SLIDING_WINDOW)
    for r in range(REP):  # queries at positions >= the block's first key, for every query head of this kv head
        head = h * REP + r
        q_base = Q + b * stride_qb + head * stride_qh
        do_base = DO + b * stride_dob + head * stride_doh
        row_base = (b * HKV * REP + head) * C_PAD  # LSE and DELTA are (B, Hq, C_PAD) fp32
        for m0 in range(((pid_n * BLOCK_N) // BLOCK_M) * BLOCK_M, C, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < C
            visible = key_ok[:, None] & m_ok[None, :] & (offs_n[:, None] <= offs_m[None, :])
            dk0, dk1, dv0, dv1 = _dkdv_query_block(
                dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, stride_qc, stride_doc, visible, LSE + row_base,
                DELTA + row_base, offs_m, m_ok, qk_scale, qp_base, (k_pos, k_lo, k_hi, SLIDING_WINDOW), HEAD_DIM,
                BLOCK_D0, BLOCK_D1, EMULATE_BF16, SOFTCAP, HAS_SLIDING_WINDOW)

    dk0 = dk0 * SCALE
    dk1 = dk1 * SCALE
    if EMULATE_BF16:
        dk0, dk1 = _round_bf16(dk0), _round_bf16(dk1)
        dv0, dv1 = _round_bf16(dv0), _round_bf16(dv1)
    _store_head(DK + b * stride_dkb + h * stride_dkh, offs_n * stride_dkc, n_ok, dk0, dk1, HEAD_DIM, BLOCK_D0, BLOCK_D1)
    _store_head(DV + b * stride_dvb + h * stride_dvh, offs_n * stride_dvc, n_ok, dv0, dv1, HEAD_DIM, BLOCK_D0, BLOCK_D1)


@triton.jit
def _mra_bwd_dkdv_region_kernel(
    Q, RK, RV, ROWS, ROW_START, RSPAN, RMASK, QPOS, RPOS, DO, LSE, DELTA, DRK, DRV,
    stride_qb, stride_qh, stride_qc, stride_rku, stride_rkh, stride_rks, stride_rvu, stride_rvh, stride_rvs,
    stride_dob, stride_doh, stride_doc, SCALE, C, C_PAD, S, HKV, N_SPLIT, stride_split, SLIDING_WINDOW,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, EMULATE_BF16: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr,
):
    # dK/dV of one shared region (a prompt, or any region of multi-region attention). ROWS lists the rows reading
    # each entry (ascending within an entry; rows reading none are not listed); ROW_START[u]..ROW_START[u+1] are entry
    # u's. The work of one (key block, entry, kv head) — every (row, query head, query block) of the group, in that
    # order — is cut into N_SPLIT contiguous ranges, one per program_id(2). Program s writes its fp32 sum to slice s of
    # DRK/DRV (contiguous (N_SPLIT, U, HKV, S, HEAD_DIM), slices stride_split apart), dK already scaled; the slices are
    # summed in order by _mra_bwd_region_reduce_kernel. With N_SPLIT == 1 DRK/DRV are the gradients.
    # HAS_SLIDING_WINDOW: work items (row, query head, query block) whose query positions cannot reach this key block
    # are skipped, so a block out of every reader's window is never read and gets 0.
    pid_n = tl.program_id(0)
    pid_uh = tl.program_id(1)
    pid_s = tl.program_id(2)
    u = (pid_uh // HKV).to(tl.int64)
    h = (pid_uh % HKV).to(tl.int64)
    qk_scale = SCALE * 1.4426950408889634

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < S
    dk0, dk1 = _zeros_head(BLOCK_N, BLOCK_D0, BLOCK_D1)
    dv0, dv1 = _zeros_head(BLOCK_N, BLOCK_D0, BLOCK_D1)

    n_lo = pid_n * BLOCK_N
    # blocks wholly outside the entry's span of real keys (left or right padding) get zero gradient
    if (n_lo + BLOCK_N > tl.load(RSPAN + 2 * u)) & (n_lo < tl.load(RSPAN + 2 * u + 1)):
        k0, k1 = _load_head(RK + u * stride_rku + h * stride_rkh, offs_n * stride_rks, n_ok, HEAD_DIM, BLOCK_D0,
                            BLOCK_D1, EMULATE_BF16)
        v0, v1 = _load_head(RV + u * stride_rvu + h * stride_rvh, offs_n * stride_rvs, n_ok, HEAD_DIM, BLOCK_D0,
                            BLOCK_D1, EMULATE_BF16)
        key_ok = n_ok & (tl.load(RMASK + u * S + offs_n, mask=n_ok, other=0) != 0)
        k_pos, k_lo, k_hi = _positions(RPOS + u * S, offs_n, key_ok, HAS_SLIDING_WINDOW)
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
            q_base = Q + b * stride_qb + head * stride_qh
            do_base = DO + b * stride_dob + head * stride_doh
            row_base = (b * HKV * REP + head) * C_PAD  # LSE and DELTA are (B, Hq, C_PAD) fp32
            visible = key_ok[:, None] & m_ok[None, :]
            dk0, dk1, dv0, dv1 = _dkdv_query_block(
                dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, stride_qc, stride_doc, visible, LSE + row_base,
                DELTA + row_base, offs_m, m_ok, qk_scale, QPOS + b * C, (k_pos, k_lo, k_hi, SLIDING_WINDOW), HEAD_DIM,
                BLOCK_D0, BLOCK_D1, EMULATE_BF16, SOFTCAP, HAS_SLIDING_WINDOW)

    dk0 = dk0 * SCALE
    dk1 = dk1 * SCALE
    out_off = pid_s.to(tl.int64) * stride_split + (u * HKV + h) * S * HEAD_DIM
    if EMULATE_BF16:
        if DRK.dtype.element_ty == tl.bfloat16:  # the gradient itself (N_SPLIT == 1), not an fp32 partial
            dk0, dk1 = _round_bf16(dk0), _round_bf16(dk1)
            dv0, dv1 = _round_bf16(dv0), _round_bf16(dv1)
    _store_head(DRK + out_off, offs_n * HEAD_DIM, n_ok, dk0, dk1, HEAD_DIM, BLOCK_D0, BLOCK_D1)
    _store_head(DRV + out_off, offs_n * HEAD_DIM, n_ok, dv0, dv1, HEAD_DIM, BLOCK_D0, BLOCK_D1)


@triton.jit
def _mra_bwd_region_reduce_kernel(
    PART_K, PART_V, DPK, DPV, N, N_SPLIT, BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr,
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
    "fwd": _mra_fwd_kernel,
    "bwd_delta": _mra_bwd_delta_kernel,
    "bwd_dq": _mra_bwd_dq_kernel,
    "bwd_dkdv_own": _mra_bwd_dkdv_own_kernel,
    "bwd_dkdv_region": _mra_bwd_dkdv_region_kernel,
    "bwd_region_reduce": _mra_bwd_region_reduce_kernel,
}
"""Kernel name (the key of the tile tables and of the AOT tests) -> ``@triton.jit`` function."""

"""Launchers of the fused selective log-softmax kernels (``logprobs_triton``): the ``"triton"`` backend of
``grpo_mem.ops.logprobs``. They size the grids and the vocabulary splits, chunk the backward over the vocabulary
(``logprobs_triton_tiles._vocab_chunk``), merge the split statistics and launch each kernel on its tensors' device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import logprobs_triton as kernels
from ._device import launch_device
from ._rowstats import finish_row_stats
from .logprobs_triton_tiles import SLS_CUDA_CONFIG, SLS_INTERPRET_CONFIG, _config, _vocab_chunk

__all__ = [
    "linear_logprobs_bwd",
    "linear_logprobs_fwd",
    "selective_log_softmax_bwd",
    "selective_log_softmax_fwd",
    "sls_grad",
    "sls_stats",
]


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
        kernels._linear_logprobs_fwd_kernel[(n_blocks, splits)](
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
    (scale, softcap, inv_t), has_cap = _common(hidden, weight, p)
    chunk = _vocab_chunk(n_tok, vocab, hid, dev)
    n_chunks = triton.cdiv(vocab, chunk)
    bufs = _BwdBuffers.allocate(hidden, weight, chunk, n_chunks, need_dh, need_dw, need_db)
    dummy = lse
    stats = (lse, ent if ent is not None else dummy, g_lp if g_lp is not None else dummy)
    stats += (g_ent if g_ent is not None else dummy, logp)
    flags = dict(HAS_SOFTCAP=has_cap, HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None)
    with launch_device(hidden):
        for i in range(n_chunks):
            v_lo = i * chunk
            w_c = min(chunk, vocab - v_lo)
            _dlogits_launch(hidden, weight, bias, target, stats, bufs, v_lo, w_c, (scale, softcap, inv_t), flags)
            if need_db:  # fixed-order reduction of the row-block partial sums
                bufs.db[v_lo : v_lo + w_c] = bufs.db_part[:, :w_c].sum(0)
            if need_dh:
                _dh_launch(hidden, weight, bufs, v_lo, w_c, i, n_chunks)
            if need_dw:
                _dw_launch(hidden, bufs, v_lo, w_c)
    return bufs.dh, bufs.dw, (bufs.db.to(bias.dtype) if need_db else None)


@dataclass
class _BwdBuffers:
    """What the backward writes: the (N, chunk) d_logits buffer in the operand dtype (columns a multiple of 64), the
    gradients (None where not requested; d_bias in fp32 until the end), the fp32 d_hidden accumulator across chunks
    (d_hidden itself for fp32 hidden; None with one chunk) and the fp32 d_bias partial sums per row block."""

    dlogits: torch.Tensor
    dh: torch.Tensor | None = None
    dw: torch.Tensor | None = None
    db: torch.Tensor | None = None
    dh_acc: torch.Tensor | None = None
    db_part: torch.Tensor | None = None

    @classmethod
    def allocate(cls, hidden, weight, chunk, n_chunks, need_dh, need_dw, need_db) -> _BwdBuffers:
        (n_tok, _), vocab, dev = hidden.shape, weight.shape[0], hidden.device
        width = min(chunk, triton.cdiv(vocab, 64) * 64)  # buffer columns (row stride a multiple of 64 elements)
        bufs = cls(torch.empty((n_tok, width), device=dev, dtype=hidden.dtype))
        if need_dh:
            bufs.dh = torch.empty_like(hidden)
            if n_chunks > 1:
                fp32 = hidden.dtype == torch.float32
                bufs.dh_acc = bufs.dh if fp32 else torch.empty(hidden.shape, device=dev, dtype=torch.float32)
        if need_dw:
            bufs.dw = torch.empty_like(weight)
        if need_db:
            bufs.db = torch.empty(vocab, device=dev, dtype=torch.float32)
            row_blocks = triton.cdiv(n_tok, _config(dev, hidden.dtype, "linear_logprobs_bwd_dlogits")["BLOCK_N"])
            bufs.db_part = torch.empty((row_blocks, width), device=dev, dtype=torch.float32)
        return bufs


def _grid(cfg, rows, cols, brow, bcol):
    """One program per (``brow`` x ``bcol``) output tile of a (rows, cols) output."""
    return (triton.cdiv(rows, cfg[brow]) * triton.cdiv(cols, cfg[bcol]),)


def _launch_opts(cfg):
    """The tile constexprs and launch options of a backward kernel's configuration."""
    return {k: cfg[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_H", "GROUP", "num_warps", "num_stages")}


def _dlogits_launch(hidden, weight, bias, target, stats, bufs, v_lo, w_c, floats, flags):
    """d_logits of vocabulary columns [v_lo, v_lo + w_c) into ``bufs.dlogits`` (and the d_bias partial sums):
    ``stats`` is ``(lse, ent, g_lp, g_ent, logp)`` with placeholders for absent ones, ``floats`` ``(scale, softcap,
    inv_t)``, ``flags`` the HAS_SOFTCAP / HAS_GLP / HAS_GENT constexprs."""
    cfg = _config(hidden.device, hidden.dtype, "linear_logprobs_bwd_dlogits")
    lse, ent, g_lp, g_ent, logp = stats
    dlogits = bufs.dlogits
    kernels._linear_logprobs_bwd_dlogits_kernel[_grid(cfg, hidden.shape[0], w_c, "BLOCK_N", "BLOCK_V")](
        hidden,
        weight[v_lo:],
        bias[v_lo:] if bias is not None else weight,
        target,
        lse,
        ent,
        g_lp,
        g_ent,
        logp,
        dlogits,
        bufs.db_part if bufs.db is not None else lse,
        hidden.shape[0],
        w_c,
        v_lo,
        hidden.shape[1],
        hidden.stride(0),
        weight.stride(0),
        dlogits.stride(0),
        dlogits.shape[1],
        *floats,
        HAS_BIAS=bias is not None,
        HAS_DB=bufs.db is not None,
        **flags,
        PRECISION=_precision(hidden.dtype),
        UPCAST=_upcast(hidden),
        **_launch_opts(cfg),
    )


def _dh_launch(hidden, weight, bufs, v_lo, w_c, i, n_chunks):
    """The GEMM d_hidden += d_logits @ W[v_lo:v_lo + w_c] of chunk ``i``: the first chunk writes, later ones
    accumulate in fp32, the last writes ``bufs.dh`` in the hidden dtype."""
    cfg = _config(hidden.device, hidden.dtype, "linear_logprobs_bwd_dh")
    n_tok, hid = hidden.shape
    last = i == n_chunks - 1
    kernels._linear_logprobs_bwd_dh_kernel[_grid(cfg, n_tok, hid, "BLOCK_N", "BLOCK_H")](
        bufs.dlogits,
        weight[v_lo:],
        bufs.dh_acc if i > 0 else bufs.dh,
        bufs.dh if last else bufs.dh_acc,
        n_tok,
        w_c,
        hid,
        bufs.dlogits.stride(0),
        weight.stride(0),
        ACCUMULATE=i > 0,
        PRECISION=_precision(hidden.dtype),
        UPCAST=_upcast(hidden),
        **_launch_opts(cfg),
    )


def _dw_launch(hidden, bufs, v_lo, w_c):
    """The GEMM d_weight[v_lo:v_lo + w_c] = d_logits^T @ hidden, reduced over all N rows in registers."""
    cfg = _config(hidden.device, hidden.dtype, "linear_logprobs_bwd_dw")
    n_tok, hid = hidden.shape
    kernels._linear_logprobs_bwd_dw_kernel[_grid(cfg, w_c, hid, "BLOCK_V", "BLOCK_H")](
        bufs.dlogits,
        hidden,
        bufs.dw[v_lo:],
        n_tok,
        w_c,
        hid,
        bufs.dlogits.stride(0),
        hidden.stride(0),
        PRECISION=_precision(hidden.dtype),
        UPCAST=_upcast(hidden),
        **_launch_opts(cfg),
    )


def sls_stats(logits, target, v0, p, m, s, sz, zy) -> None:
    """Row statistics of ``logits`` (N, W) contiguous: vocabulary columns ``v0 .. v0 + W`` of the pre-transform logits
    (``p``'s logit scale, soft-cap and temperature applied in the kernel), target (N,) int64 (global ids, -1 ignored).
    Writes the (N,) fp32 ``m``, ``s``, ``zy`` (and ``sz`` with ``p.return_entropy``) in place (see
    ``finish_row_stats``)."""
    n_tok, vocab = logits.shape
    if not n_tok:
        return
    cfg = dict(SLS_CUDA_CONFIG if logits.device.type == "cuda" else SLS_INTERPRET_CONFIG)
    (scale, softcap, inv_t), has_cap = _common(logits, logits, p)
    with launch_device(logits):
        kernels._selective_log_softmax_fwd_kernel[(n_tok,)](
            logits,
            target,
            m,
            s,
            sz,
            zy,
            vocab,
            logits.stride(0),
            v0,
            scale,
            softcap,
            inv_t,
            HAS_SOFTCAP=has_cap,
            HAS_ENTROPY=p.return_entropy,
            BLOCK_V=cfg["BLOCK_V"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )


def sls_grad(logits, out, target, v0, lse, ent, g_lp, g_ent, logp, p) -> None:
    """d_logits of ``logits`` (N, W) contiguous (columns ``v0 .. v0 + W`` as in :func:`sls_stats`) into ``out`` (N, W)
    contiguous, any float dtype (the value rounded once to it). ``lse`` (N,) fp32; ``ent``, ``g_lp``, ``g_ent`` (N,)
    fp32 or None; ``logp`` (N,) fp32 or None: the forward's log-probs, the target entry's term when given."""
    n_tok, vocab = logits.shape
    if not n_tok:
        return
    cfg = dict(SLS_CUDA_CONFIG if logits.device.type == "cuda" else SLS_INTERPRET_CONFIG)
    (scale, softcap, inv_t), has_cap = _common(logits, logits, p)
    dummy = lse
    with launch_device(logits):
        kernels._selective_log_softmax_bwd_kernel[(n_tok, triton.cdiv(vocab, cfg["BLOCK_V"]))](
            logits,
            out,
            target,
            lse,
            ent if ent is not None else dummy,
            g_lp if g_lp is not None else dummy,
            g_ent if g_ent is not None else dummy,
            logp if logp is not None else dummy,
            vocab,
            logits.stride(0),
            v0,
            scale,
            softcap,
            inv_t,
            HAS_GLP=g_lp is not None,
            HAS_GENT=g_ent is not None,
            HAS_SOFTCAP=has_cap,
            HAS_LP_Y=logp is not None,
            BLOCK_V=cfg["BLOCK_V"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )


def selective_log_softmax_fwd(logits, target, p):
    """Triton forward over (N, V) contiguous logits: (logp, entropy or None, lse), each (N,) fp32."""
    stats = torch.zeros((4, logits.shape[0]), device=logits.device, dtype=torch.float32)
    sls_stats(logits, target, 0, p, *stats)
    return finish_row_stats(*stats, target, p.return_entropy)


def selective_log_softmax_bwd(logits, target, lse, ent, g_lp, g_ent, p):
    """Triton backward: d_logits (N, V) in the dtype of ``logits``."""
    out = torch.empty_like(logits)
    sls_grad(logits, out, target, 0, lse, ent, g_lp, g_ent, None, p)
    return out

"""The ``"cublas"`` backend of the fused head (``grpo_mem.ops.logprobs.linear_logprobs``): the logits GEMMs on cuBLAS
(``torch.mm`` with fp32 output), in vocabulary chunks, each chunk's softmax statistics and d_logits from the selective
log-softmax Triton kernels (``logprobs_triton``).

Forward, per vocabulary chunk [v0, v1): ``a = hidden @ W[v0:v1]^T`` (+ bias) as an (N, v1 - v0) fp32 matrix (bf16/fp16
operands, fp32 accumulation and output: ``torch.mm(..., out_dtype=torch.float32)``), then the selective log-softmax
kernel folds it into per-row statistics (max, sum of exponentials, their z-weighted sum, the target logit) with the
logit transform applied in the kernel; the chunks' statistics merge exactly (the Triton head's split merge). Backward,
per chunk: the logits recomputed by the same GEMM, d_logits from the selective log-softmax backward kernel (rounded
once to the operand dtype, as the Triton head's backward does; d_bias from fp32 column sums), then two cuBLAS GEMMs:
``d_hidden += d_logits @ W[v0:v1]`` (an fp32 (N, H) accumulator, fp32 products) and ``d_weight[v0:v1] = d_logits^T @
hidden`` (one rounding to the weight's dtype). The design card's "in chunks with fused selective log-softmax Triton
kernels"; the chunking follows the Triton head's backward (vocabulary outer, so d_weight needs no (V, H) fp32 buffer)
and Cut Cross-Entropy's statistics (Wijmans et al., arXiv 2411.09009).

Memory beyond inputs and gradients: one (N, chunk) fp32 logits matrix (``CHUNK_BYTES`` at most, unless N alone
exceeds it: chunks are at least ``MIN_CHUNK`` columns), in backward also its d_logits in the operand dtype and the
fp32 (N, H) d_hidden accumulator, plus O(N) statistics.

The chunk loop (:func:`chunked_fwd`, :func:`chunked_bwd`) takes its kernels as a :class:`HeadKernels` and runs on any
device. ``KERNELS`` is this backend's: cuBLAS on CUDA (on CPU tensors, under Triton's interpreter, an fp32 matmul of
the upcast operands: the same products, exact in fp32) and the Triton selective log-softmax; tests also plug in the
torch backend's tile functions (tests/ops/test_cuda_backends.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._rowstats import finish_row_stats

__all__ = [
    "CHUNK_BYTES",
    "KERNELS",
    "MIN_CHUNK",
    "HeadKernels",
    "chunked_bwd",
    "chunked_fwd",
    "gemm_f32",
    "linear_logprobs_bwd",
    "linear_logprobs_fwd",
    "vocab_chunk",
]

CHUNK_BYTES = 512 * 2**20
"""The most bytes of one chunk's fp32 logits (N x chunk x 4): 512 MiB, about the size of a bf16 Qwen (151936 x 2048)
LM head. At N = 2048 tokens that is 65536 columns (3 GEMMs of 2048 x 65536 x 2048 per pass over Qwen's vocabulary);
at N = 32768, 4096 columns (38 chunks, each GEMM still 32768 x 4096 x 2048)."""

MIN_CHUNK = 256
"""The narrowest chunk (columns) whatever N is: below it the GEMMs' outputs get too thin to keep a GPU busy."""

INTERPRET_CHUNK = 128
"""Chunk columns for CPU tensors (Triton's interpreter, tests): the test shapes cross several chunk boundaries."""


def vocab_chunk(n_tok: int, vocab: int, device: torch.device) -> int:
    """Columns of one vocabulary chunk for ``n_tok`` tokens: the widest multiple of 128 whose fp32 (n_tok, chunk)
    logits fit ``CHUNK_BYTES`` (at least ``MIN_CHUNK``, at most ``vocab``); ``INTERPRET_CHUNK`` for CPU tensors."""
    if device.type != "cuda":
        return max(1, min(vocab, INTERPRET_CHUNK))
    widest = CHUNK_BYTES // (4 * max(n_tok, 1)) // 128 * 128
    return max(1, min(vocab, max(MIN_CHUNK, widest)))


def gemm_f32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b`` accumulated in fp32 and returned in ``out_dtype``, for a (M, K) and b (K, N) of one float dtype.

    CUDA: one cuBLAS GEMM (``torch.mm``; bf16/fp16 operands with ``out_dtype=torch.float32`` give fp32 products
    without a rounding to the operand dtype, torch >= 2.8). Other devices: an fp32 matmul of the upcast operands
    (products of bf16/fp16 values are exact in fp32: the GPU's math), cast to ``out_dtype``.
    """
    if a.device.type == "cuda":
        if out_dtype == a.dtype:
            return torch.mm(a, b)
        return torch.mm(a, b, out_dtype=out_dtype)
    return torch.mm(a.float(), b.float()).to(out_dtype)


@dataclass(frozen=True)
class HeadKernels:
    """The kernels of the chunk loop.

    ``gemm(a (M, K), b (K, N), out_dtype)`` -> (M, N) ``a @ b`` accumulated in fp32, in ``out_dtype``.
    ``stats(a (N, W) fp32, target (N,) int64, v0, params, m, s, sz, zy)``: the row statistics of vocabulary columns
    ``v0 .. v0 + W`` of pre-transform logits ``a`` (``params``: a ``LogprobParams``), written into the (N,) fp32
    ``m`` (max of z), ``s`` (sum of exp(z - m)), ``sz`` (sum of exp(z - m)·(z - m), with entropy), ``zy`` (the
    target's z where it falls in the chunk, else 0).
    ``grad(a, target, v0, lse, ent, g_lp, g_ent, logp, params, out (N, W))``: d(loss)/d(a) into ``out`` (its dtype),
    loss = Σ g_lp·logp + Σ g_ent·entropy (``ent``, ``g_lp``, ``g_ent``, ``logp`` (N,) fp32 or None).
    """

    gemm: Callable
    stats: Callable
    grad: Callable


def _triton_stats(a, target, v0, p, m, s, sz, zy) -> None:
    from . import logprobs_triton_launch  # triton loads on the first call

    logprobs_triton_launch.sls_stats(a, target, v0, p, m, s, sz, zy)


def _triton_grad(a, target, v0, lse, ent, g_lp, g_ent, logp, p, out) -> None:
    from . import logprobs_triton_launch

    logprobs_triton_launch.sls_grad(a, out, target, v0, lse, ent, g_lp, g_ent, logp, p)


KERNELS = HeadKernels(gemm=gemm_f32, stats=_triton_stats, grad=_triton_grad)
"""The ``"cublas"`` backend's kernels: cuBLAS GEMMs and the Triton selective log-softmax."""


def _logits(kernels: HeadKernels, hidden, weight, bias, v0: int, v1: int) -> torch.Tensor:
    """fp32 (N, v1 - v0) pre-transform logits ``hidden @ weight[v0:v1]^T + bias[v0:v1]``."""
    a = kernels.gemm(hidden, weight[v0:v1].t(), torch.float32)
    return a.add_(bias[v0:v1].float()) if bias is not None else a


def _merge(stats: torch.Tensor):
    """(4, chunks, N) per-chunk (m, s, sz, zy) -> the merged (N,) (m, s, sz, zy), in chunk order."""
    m, s, sz, zy = stats
    m_all = m.amax(0)
    ref = torch.where(torch.isneginf(m_all), 0.0, m_all)  # a row with no finite logit keeps m = -inf, s = 0
    alpha = torch.exp(m - ref)
    term = torch.where(s > 0, alpha * (sz + (m - ref) * s), 0.0)
    return m_all, (alpha * s).sum(0), term.sum(0), zy.sum(0)


def chunked_fwd(kernels: HeadKernels, hidden, weight, bias, target, p, chunk: int):
    """Forward of ``linear_logprobs`` in vocabulary chunks of ``chunk`` columns on ``kernels``.

    Args: hidden (N, H) and weight (V, H) of one float dtype; bias (V,) or None; target (N,) int64, -1 on ignored
    rows; p a ``LogprobParams``. Returns ``(logp, entropy or None, lse)``, each (N,) fp32 (ignored rows 0).
    """
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    n_chunks = max(1, math.ceil(vocab / chunk))
    stats = torch.zeros((4, n_chunks, n_tok), device=hidden.device, dtype=torch.float32)
    for i in range(n_chunks):
        v0, v1 = i * chunk, min(vocab, (i + 1) * chunk)
        kernels.stats(_logits(kernels, hidden, weight, bias, v0, v1), target, v0, p, *stats[:, i])
    return finish_row_stats(*_merge(stats), target, p.return_entropy)


def chunked_bwd(kernels: HeadKernels, hidden, weight, bias, target, grads, p, needs, chunk: int):
    """Backward of ``linear_logprobs`` in vocabulary chunks of ``chunk`` columns on ``kernels``.

    Args: as :func:`chunked_fwd`; ``grads`` = ``(lse, ent, g_lp, g_ent, logp)`` (N,) fp32 (``ent``, ``g_lp``,
    ``g_ent`` or ``logp`` None when absent; ``g_*`` 0 on ignored rows); ``needs`` = ``(need_dh, need_dw, need_db)``.
    Returns ``(dh, dw, db)`` in hidden's, weight's and bias's dtypes, None where not needed.
    """
    lse, ent, g_lp, g_ent, logp = grads
    need_dh, need_dw, need_db = needs
    vocab = weight.shape[0]
    dh = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_dh else None
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty(vocab, device=hidden.device, dtype=torch.float32) if need_db else None
    for v0 in range(0, vocab, chunk):
        v1 = min(vocab, v0 + chunk)
        a = _logits(kernels, hidden, weight, bias, v0, v1)
        dl = torch.empty(a.shape, device=a.device, dtype=torch.float32 if need_db else hidden.dtype)
        kernels.grad(a, target, v0, lse, ent, g_lp, g_ent, logp, p, dl)
        del a
        if need_db:
            db[v0:v1] = dl.sum(0)
            dl = dl.to(hidden.dtype)  # the operand rounding of the GEMMs below
        if need_dh:
            dh += kernels.gemm(dl, weight[v0:v1], torch.float32)
        if need_dw:
            dw[v0:v1] = kernels.gemm(dl.t(), hidden, weight.dtype)
    return (
        dh.to(hidden.dtype) if need_dh else None,
        dw,
        db.to(bias.dtype) if need_db else None,
    )


def linear_logprobs_fwd(hidden, weight, bias, target, p):
    """cuBLAS + Triton forward (:func:`chunked_fwd` with ``KERNELS`` and :func:`vocab_chunk`). hidden (N, H), weight
    (V, H) same dtype, contiguous; bias (V,) or None; target (N,) int64 with -1 on ignored rows. Returns (logp,
    entropy or None, lse), each (N,) fp32."""
    chunk = vocab_chunk(hidden.shape[0], weight.shape[0], hidden.device)
    return chunked_fwd(KERNELS, hidden, weight, bias, target, p, chunk)


def linear_logprobs_bwd(hidden, weight, bias, target, lse, ent, g_lp, g_ent, p, need_dh, need_dw, need_db, logp):
    """cuBLAS + Triton backward (:func:`chunked_bwd`): (dh, dw, db) in the inputs' dtypes, None where not requested;
    g_lp / g_ent (N,) fp32 with zeros on ignored rows, or None; logp: the forward's (N,) fp32 log-probs (the target
    entry's term, exact for confident rows whatever the recomputed logits' last bits)."""
    chunk = vocab_chunk(hidden.shape[0], weight.shape[0], hidden.device)
    grads = (lse, ent, g_lp, g_ent, logp)
    return chunked_bwd(KERNELS, hidden, weight, bias, target, grads, p, (need_dh, need_dw, need_db), chunk)

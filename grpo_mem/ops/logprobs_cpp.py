"""The ``"cpp"`` backend of the fused selective log-softmax (``grpo_mem.ops.logprobs``): the C++ ops of
``csrc/linear_logprobs.cpp`` (loaded by ``_ext``, registered with the dispatcher as ``torch.ops.grpo_mem.*``), their
fake kernels, and the one tile policy they are called with. ``LogprobParams``, the non-tensor options every backend of
the family takes, lives here, below ``logprobs`` and the torch backend, so that a CPU call runs one backend module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _ext

__all__ = [
    "LogprobParams",
    "linear_logprobs_fwd",
    "linear_logprobs_bwd",
    "selective_log_softmax_fwd",
    "selective_log_softmax_bwd",
]


@dataclass(frozen=True)
class LogprobParams:
    """Non-tensor options of the fused head, shared by every backend.

    ``temperature`` divides the logits (> 0), ``logit_scale`` multiplies them before the soft cap, ``softcap`` is the
    final logit soft cap (None: no cap), ``return_entropy`` asks for the entropy output, ``backend`` is the resolved
    backend ("torch", "cpp", "triton" or "cublas").
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    return_entropy: bool = False
    backend: str = "torch"

    @property
    def inv_t(self) -> float:
        return 1.0 / self.temperature


# Tile of the cpp backend, its one tile policy (the C++ ops take their tiles as arguments): one fp32 buffer of
# CPP_BLOCK_N x CPP_BLOCK_V elements (32 MiB); with fewer tokens than CPP_BLOCK_N the vocabulary block widens to keep
# that size (_cpp_blocks); selective_log_softmax folds each row in CPP_BLOCK_V columns. Measured with the bench_head.py
# worker (cpp_block override), fwd+bwd, H=576: N=4096, V=49152: 4096 x 2048 took 10.9 CPU-s vs 12.3 for 2048 x 1024;
# N=1024, V=151936: 1024 x 8192 took 7.9 CPU-s vs 10.0 for 1024 x 2048.
CPP_BLOCK_N = 4096


CPP_BLOCK_V = 2048


def _cpp_blocks(n_tok: int) -> tuple[int, int]:
    """``(block_n, block_v)`` of the cpp linear head for ``n_tok`` tokens."""
    block_n = max(1, min(n_tok, CPP_BLOCK_N))
    block_v = max(CPP_BLOCK_V, (CPP_BLOCK_N * CPP_BLOCK_V // block_n) // 64 * 64)
    return block_n, block_v


def _register_fake_kernels() -> None:
    """Output shapes and dtypes of the C++ ops (``csrc/linear_logprobs.cpp`` registers their CPU kernels), so that
    FakeTensor and ``torch.compile`` can trace through them. Outputs an op does not compute are (0,)."""
    f32 = torch.float32

    @torch.library.register_fake("grpo_mem::linear_logprobs_fwd")
    def _(hidden, weight, bias, target, scale, cap, inv_t, has_cap, want_entropy, block_n, block_v):
        n = hidden.shape[0]
        return tuple(hidden.new_empty((size,), dtype=f32) for size in (n, n if want_entropy else 0, n))

    @torch.library.register_fake("grpo_mem::linear_logprobs_bwd")
    def _(
        hidden,
        weight,
        bias,
        target,
        lse,
        ent,
        g_lp,
        g_ent,
        scale,
        cap,
        inv_t,
        has_cap,
        need_dh,
        need_dw,
        need_db,
        block_n,
        block_v,
    ):
        db_like = bias if bias is not None else weight
        return (
            torch.empty_like(hidden) if need_dh else hidden.new_empty((0,)),
            torch.empty_like(weight) if need_dw else weight.new_empty((0,)),
            torch.empty_like(db_like) if need_db and bias is not None else db_like.new_empty((0,)),
        )

    @torch.library.register_fake("grpo_mem::selective_log_softmax_fwd")
    def _(logits, target, inv_t, want_entropy, block_v):
        n = logits.shape[0]
        return tuple(logits.new_empty((size,), dtype=f32) for size in (n, n if want_entropy else 0, n))

    @torch.library.register_fake("grpo_mem::selective_log_softmax_bwd")
    def _(logits, target, lse, ent, g_lp, g_ent, inv_t, block_v):
        return torch.empty_like(logits)


if _ext.HAS_EXT:
    _register_fake_kernels()


def linear_logprobs_fwd(hidden, weight, bias, target, p: LogprobParams):
    """C++ forward (``torch.ops.grpo_mem.linear_logprobs_fwd``); returns as ``logprobs_torch.linear_logprobs_fwd``."""
    logp, ent, lse = torch.ops.grpo_mem.linear_logprobs_fwd(
        hidden,
        weight,
        bias,
        target,
        p.logit_scale,
        p.softcap or 0.0,
        p.inv_t,
        p.softcap is not None,
        p.return_entropy,
        *_cpp_blocks(hidden.shape[0]),
    )
    return logp, (ent if p.return_entropy else None), lse


def linear_logprobs_bwd(hidden, weight, bias, target, lse, ent, g_lp, g_ent, p, need_dh, need_dw, need_db, logp=None):
    """C++ backward (``torch.ops.grpo_mem.linear_logprobs_bwd``); returns as ``logprobs_torch.linear_logprobs_bwd``
    (``logp`` unused)."""
    grads = torch.ops.grpo_mem.linear_logprobs_bwd(
        hidden,
        weight,
        bias,
        target,
        lse,
        ent,
        g_lp,
        g_ent,
        p.logit_scale,
        p.softcap or 0.0,
        p.inv_t,
        p.softcap is not None,
        need_dh,
        need_dw,
        need_db,
        *_cpp_blocks(hidden.shape[0]),
    )
    return tuple(g if need else None for g, need in zip(grads, (need_dh, need_dw, need_db)))


def selective_log_softmax_fwd(logits, target, p: LogprobParams):
    """C++ forward (``torch.ops.grpo_mem.selective_log_softmax_fwd``); returns as the torch forward."""
    logp, ent, lse = torch.ops.grpo_mem.selective_log_softmax_fwd(
        logits, target, p.inv_t, p.return_entropy, CPP_BLOCK_V
    )
    return logp, (ent if p.return_entropy else None), lse


def selective_log_softmax_bwd(logits, target, lse, ent, g_lp, g_ent, p):
    """C++ backward (``torch.ops.grpo_mem.selective_log_softmax_bwd``): d_logits in the dtype of ``logits``."""
    return torch.ops.grpo_mem.selective_log_softmax_bwd(logits, target, lse, ent, g_lp, g_ent, p.inv_t, CPP_BLOCK_V)

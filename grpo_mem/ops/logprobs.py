"""Fused selective log-softmax: per-token log-probabilities (and entropies) of a linear head without (N, V) logits.

``linear_logprobs(h, W, y)`` equals ``torch.log_softmax(h @ W.T, -1).gather(-1, y[:, None])[:, 0]`` computed in fp32,
tile by tile: the forward keeps O(N) online statistics (running max, sum of exponentials, sum of exponentials times
logit, the target logit) and the backward recomputes each tile and folds it into the gradients. Algorithm after Apple's
Cut Cross-Entropy (Wijmans et al., arXiv 2411.09009) with the entropy term of TRL 1.16's ``ChunkedLogProbFunction``.

Logits are transformed as TRL 1.16's fused head does (``trl/kernels/chunked_logprob.py``, ``_transform``):
``z = softcap * tanh((h W^T + b) * logit_scale / softcap) / temperature`` (no tanh when ``softcap`` is None).

The backends share this math (``_backends.TABLE``, in ``auto``'s order): ``"cublas"`` (``linear_logprobs`` only;
``logprobs_cublas``: cuBLAS GEMMs in vocabulary chunks with the Triton selective log-softmax), ``"triton"``
(``logprobs_triton_launch``, imported on first use), ``"cpp"`` (``logprobs_cpp``: the C++ extension,
``csrc/linear_logprobs.cpp``) and ``"torch"`` (``logprobs_torch``: chunked pure torch). ``LINEAR_BACKENDS`` and ``SLS_BACKENDS`` map each name to its ``(forward,
backward)``. This module holds the public ops, their checks, the autograd Functions and the naive (N, V) references
(``linear_logprobs_ref``) that tests and benchmarks compare against.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from ._backends import TABLE, resolve
from .logprobs_cpp import LogprobParams
from .logprobs_torch import transform_logits

__all__ = [
    "LINEAR_BACKENDS",
    "SLS_BACKENDS",
    "LinearLogprobsFunction",
    "SelectiveLogSoftmaxFunction",
    "linear_logprobs",
    "linear_logprobs_ref",
    "selective_log_softmax",
    "selective_log_softmax_ref",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_float(name: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} float, got {value!r}")
    return value


def _targets(index: torch.Tensor, vocab: int, ignore_index: int, check: bool = True) -> torch.Tensor:
    """int64 (N,) targets with ignored rows mapped to -1.

    An index outside [0, vocab) that is not ``ignore_index`` raises ValueError naming it when ``index`` is on the CPU.
    On an accelerator the check is a device-side assertion (``torch._assert_async``): reading the answer back would
    make every call wait for the device (a host synchronisation per micro-batch), so a bad index surfaces instead as a
    RuntimeError carrying the message below at the next synchronisation, before any result reaches the host.
    ``check`` False: no check (the caller knows the range).
    """
    index = index.to(torch.int64)
    valid = index != ignore_index
    if index.numel() and check:
        _check_range(valid & ((index < 0) | (index >= vocab)), index, vocab, ignore_index, on_host=not index.is_cuda)
    return torch.where(valid, index, torch.full_like(index, -1)).contiguous()


def _check_range(bad: torch.Tensor, index: torch.Tensor, vocab: int, ignore_index: int, *, on_host: bool) -> None:
    """Raise when any of ``bad`` (N,) bool is set: ValueError naming the first bad position (``on_host``), else a
    device-side assertion that does not synchronise."""
    if not on_host:
        torch._assert_async(~bad.any(), f"an index is outside [0, {vocab}) and is not ignore_index={ignore_index}")
        return
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"index[{pos}] = {int(index[pos])} is outside [0, {vocab}) and is not ignore_index={ignore_index}"
        )


def linear_logprobs_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Naive reference of :func:`linear_logprobs`: builds the (N, V) logits in the inputs' dtype.

    Every intermediate (logits, log-softmax) stays in the input dtype, so with fp64 inputs it is the ground truth and
    with bf16 inputs it is the "same-dtype naive" baseline of the accuracy tests. Outputs are cast to fp32 (fp64 inputs
    give fp64 outputs). Differentiable through autograd. Same arguments as :func:`linear_logprobs`.
    """
    z = transform_logits(F.linear(hidden, weight, bias), logit_scale, softcap, 1.0 / temperature)
    return _select(z, index, return_entropy, ignore_index)


def selective_log_softmax_ref(
    logits: torch.Tensor, index: torch.Tensor, *, temperature: float = 1.0, return_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Naive reference of :func:`selective_log_softmax`, computed in the dtype of ``logits`` (fp32 output)."""
    return _select(logits * (1.0 / temperature), index, return_entropy, None)


def _select(z, index, return_entropy, ignore_index):
    out_dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    logsm = torch.log_softmax(z, dim=-1)
    valid = torch.ones_like(index, dtype=torch.bool) if ignore_index is None else index != ignore_index
    safe = torch.where(valid, index, torch.zeros_like(index)).to(torch.int64)
    zero = torch.zeros((), dtype=out_dtype, device=z.device)
    logp = torch.where(valid, logsm.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(out_dtype), zero)
    if not return_entropy:
        return logp
    ent = -(torch.softmax(z, dim=-1) * logsm).sum(-1)
    return logp, torch.where(valid, ent.to(out_dtype), zero)


LINEAR_BACKENDS = {b.name: (b.forward, b.backward) for b in TABLE["linear_logprobs"]}
"""Backend name -> ``(forward, backward)`` of the fused head, read from ``_backends.TABLE``. ``forward(hidden, weight,
bias, target, params)`` returns ``(logp, entropy or None, lse)``, each (N,) fp32; ``backward(hidden, weight, bias,
target, lse, ent, g_lp, g_ent, params, need_dh, need_dw, need_db, logp)`` returns ``(dh, dw, db)``, None where not
needed."""

SLS_BACKENDS = {b.name: (b.forward, b.backward) for b in TABLE["selective_log_softmax"]}
"""Backend name -> ``(forward, backward)`` of :func:`selective_log_softmax`, read from ``_backends.TABLE``:
``forward(logits, target, params)`` -> ``(logp, entropy or None, lse)``; ``backward(logits, target, lse, ent, g_lp,
g_ent, params)`` -> d_logits."""


def _row_grad(g, target):
    """Upstream per-row gradient as contiguous fp32 with ignored rows zeroed, or None."""
    if g is None:
        return None
    return torch.where(target >= 0, g.to(torch.float32), torch.zeros((), device=g.device)).contiguous()


class LinearLogprobsFunction(torch.autograd.Function):
    """Autograd Function of :func:`linear_logprobs` on validated inputs: apply(hidden, weight, bias, target, params)
    -> (logp, entropy or None); ``target`` is int64 (N,) with -1 on ignored rows."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, params: LogprobParams):
        ctx.set_materialize_grads(False)
        logp, ent, lse = LINEAR_BACKENDS[params.backend][0](hidden, weight, bias, target, params)
        # the Triton kernels' backward takes the target term from the saved log-probs (see logprobs_triton._dlogits)
        keep_logp = params.backend in ("triton", "cublas")
        ctx.save_for_backward(hidden, weight, bias, target, lse, ent, logp if keep_logp else None)
        ctx.params = params
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, target, lse, ent, logp = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        g_lp, g_ent = _row_grad(g_lp, target), _row_grad(g_ent, target)
        if (g_lp is None and g_ent is None) or not (need_dh or need_dw or need_db):
            return None, None, None, None, None
        dh, dw, db = LINEAR_BACKENDS[ctx.params.backend][1](
            hidden,
            weight,
            bias,
            target,
            lse,
            ent,
            g_lp,
            g_ent,
            ctx.params,
            need_dh,
            need_dw,
            need_db and bias is not None,
            logp,
        )
        return dh, dw, db, None, None


def _check_linear_inputs(hidden, weight, index, bias, temperature, logit_scale, softcap, ignore_index):
    """``linear_logprobs``' argument checks (its Raises); returns the float hyperparameters as Python floats."""
    for name, x in (("hidden", hidden), ("weight", weight), ("index", index)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (N, H), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (V, H) with H = {hidden.shape[1]}, got shape {tuple(weight.shape)}")
    if index.shape != (hidden.shape[0],):
        raise ValueError(f"index must have shape ({hidden.shape[0]},), got {tuple(index.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden and weight must be fp32, bf16 or fp16, got {hidden.dtype} and {weight.dtype}")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(f"index must be an integer tensor, got {index.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"bias must be fp32, bf16 or fp16, got {bias.dtype}")
    for name, x in (("weight", weight), ("index", index), ("bias", bias)):
        if x is not None and x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device} but hidden is on {hidden.device}")
    temperature = _check_float("temperature", temperature, positive=True)
    logit_scale = _check_float("logit_scale", logit_scale, positive=False)
    if softcap is not None:
        softcap = _check_float("softcap", softcap, positive=True)
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    return temperature, logit_scale, softcap


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    backend: str = "auto",
    check_index: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities (and entropies) of a linear LM head, without building the (N, V) logits.

    Equals, in fp32, ``log_softmax(z, -1).gather(-1, index[:, None])[:, 0]`` and
    ``-(softmax(z) * log_softmax(z)).sum(-1)`` with
    ``z = softcap * tanh((hidden @ weight.T + bias) * logit_scale / softcap) / temperature`` (TRL 1.16's order; no
    tanh when ``softcap`` is None). Extra memory: one (tokens x vocabulary) tile plus O(N) statistics, and an fp32
    d_weight accumulator when the weight is not fp32 (the cpp and torch backends keep it to one vocabulary block).

    Args:
        hidden: (N, H) fp32, bf16 or fp16 hidden states.
        weight: (V, H) head weight, float dtype; gradients flow to it only if it requires grad.
        index: (N,) integer target token ids in [0, V), or ``ignore_index``.
        bias: (V,) head bias or None.
        temperature: > 0, divides the logits.
        logit_scale: finite multiplier applied before the soft cap.
        softcap: final logit soft cap (> 0) or None.
        return_entropy: also return the entropy of each row's distribution.
        ignore_index: rows with this index give log-prob 0, entropy 0 and no gradient.
        backend: "auto" (on CUDA the fastest measured for the GPU and shape, else triton, then cublas; on CPU cpp
            when the extension is built, else torch), "torch", "cpp", "triton" or "cublas" (CUDA, or CPU tensors with
            TRITON_INTERPRET=1).
        check_index: check that ``index`` lies in [0, V) or is ``ignore_index`` (below); False for a caller that
            knows it does (the model layer: token ids the model's embedding has taken), which skips the check's read
            back on CPU tensors.

    Returns:
        log-probs (N,) fp32, and entropies (N,) fp32 (nats) when ``return_entropy``.

    Raises:
        TypeError: non-tensor inputs, non-float hidden/weight, non-integer index, non-float hyperparameters.
        ValueError: bad shapes, an index outside [0, V) that is not ``ignore_index`` (CPU tensors; on CUDA a device-side
            assertion, a RuntimeError at the next synchronisation, so that the call never waits for the device),
            temperature <= 0, softcap <= 0, unknown backend.
        BackendUnavailableError (a ValueError): an explicitly requested backend that cannot run here.
    """
    temperature, logit_scale, softcap = _check_linear_inputs(
        hidden, weight, index, bias, temperature, logit_scale, softcap, ignore_index
    )
    resolved = resolve("linear_logprobs", backend, hidden, shape=(hidden.shape[0], hidden.shape[1], weight.shape[0]))

    # one compute dtype for the GEMM operands (autocast-style mixed inputs): cast differentiably outside the Function
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    hidden = hidden.to(dtype).contiguous()
    weight = weight.to(dtype).contiguous()
    if bias is not None:
        bias = bias.contiguous()
    target = _targets(index, weight.shape[0], ignore_index, check_index)
    params = LogprobParams(temperature, logit_scale, softcap, bool(return_entropy), resolved)
    logp, ent = LinearLogprobsFunction.apply(hidden, weight, bias, target, params)
    return (logp, ent) if return_entropy else logp


class SelectiveLogSoftmaxFunction(torch.autograd.Function):
    """Autograd Function of :func:`selective_log_softmax` on flattened, validated inputs: apply(logits (N, V),
    target (N,) int64, params) -> (logp, entropy or None)."""

    @staticmethod
    def forward(ctx, logits, target, params: LogprobParams):
        ctx.set_materialize_grads(False)
        logp, ent, lse = SLS_BACKENDS[params.backend][0](logits, target, params)
        ctx.save_for_backward(logits, target, lse, ent)
        ctx.params = params
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, target, lse, ent = ctx.saved_tensors
        p = ctx.params
        g_lp, g_ent = _row_grad(g_lp, target), _row_grad(g_ent, target)
        if (g_lp is None and g_ent is None) or not ctx.needs_input_grad[0]:
            return None, None, None
        return SLS_BACKENDS[p.backend][1](logits, target, lse, ent, g_lp, g_ent, p), None, None


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``index`` under ``softmax(logits / temperature)``, and optionally the entropies.

    Equals ``torch.log_softmax(logits.float() / temperature, -1).gather(-1, index[..., None])[..., 0]`` (TRL's
    ``selective_log_softmax``) without an fp32 copy of the logits: rows are folded chunk by chunk in fp32, and the
    backward writes d_logits (same shape and dtype as ``logits``) directly.

    Args:
        logits: (..., V) fp32, bf16 or fp16.
        index: (...) integer ids in [0, V).
        temperature: > 0.
        return_entropy: also return entropies (nats).
        backend: as in :func:`linear_logprobs`.

    Returns:
        log-probs (...) fp32, and entropies (...) fp32 when ``return_entropy``.

    Raises:
        TypeError / ValueError: non-tensor or non-float logits, non-integer index, shape mismatch, index outside
        [0, V) (CPU tensors; on CUDA a device-side assertion, as in :func:`linear_logprobs`), temperature <= 0,
        unknown backend.
        BackendUnavailableError (a ValueError): an explicitly requested backend that cannot run here.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(index, torch.Tensor):
        raise TypeError(f"logits and index must be tensors, got {type(logits).__name__} and {type(index).__name__}")
    if logits.dim() < 1 or logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"logits must be (..., V) fp32, bf16 or fp16, got {logits.dtype} of shape {tuple(logits.shape)}"
        )
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index must have shape {tuple(logits.shape[:-1])}, got {tuple(index.shape)}")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(f"index must be an integer tensor, got {index.dtype}")
    if index.device != logits.device:
        raise ValueError(f"index is on {index.device} but logits is on {logits.device}")
    temperature = _check_float("temperature", temperature, positive=True)
    resolved = resolve("selective_log_softmax", backend, logits)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab).contiguous()
    # no ignore_index here: every index must be a vocabulary id (-2**63 never occurs as one)
    target = _targets(index.reshape(-1), vocab, -(2**63))
    params = LogprobParams(temperature, 1.0, None, bool(return_entropy), resolved)
    logp, ent = SelectiveLogSoftmaxFunction.apply(flat, target, params)
    logp = logp.view(index.shape)
    return (logp, ent.view(index.shape)) if return_entropy else logp

"""Multi-region attention for the completion pass of a GRPO group forward; shared-prefix attention is its one-region
call.

G completions of one prompt attend to that prompt's keys/values and, causally, to their own. Stock scoring
concatenates the prompt K/V in front of every completion (``torch.cat`` in the KV cache, then ``repeat_kv`` for GQA),
so each layer holds G·(Hq/Hkv) copies of the prompt K/V for backward. Here the prompt K/V are read in place. With a
prefix tree (docs/how-it-works.md, "Prefix trees") a row reads several shared regions (its ancestors' segments),
each a tensor of unique entries indexed per row:

* a shared region: for each of its entries, the queries of all rows that read it and the Hq/Hkv query heads of one kv
  head are folded into one ``(n_u·rep·C, d)`` matrix against that entry's ``(S, d)`` keys; rows with index −1 skip it;
* the own region: per-row causal attention over the row's own keys;
* the partial results ``(o_r, l_r)`` (output normalised within the region, log-sum-exp of its scaled scores) merge
  exactly by ``l = logsumexp_r l_r``, ``o = Σ_r e^{l_r − l} o_r``.

Backward is FlashAttention-2's (Dao, arXiv 2307.08691, Alg. 2) applied to each region with the merged output and
log-sum-exp: ``P = exp(S − L)``, ``D = rowsum(dO ∘ O)``, ``dS = P ∘ (dP − D)``. Probabilities are recomputed, so the
autograd graph holds only the inputs, the output and the (B, Hq, C) fp32 log-sum-exp. The region split with an LSE
merge follows Hydragen (arXiv 2402.05099) and ring-flash-attention's ``_update_out_and_lse``; the fused CUDA analogue
of the two-region case is DualKV (arXiv 2605.15422).

Backends (``_backends.TABLE["multi_region_attention"]``, in ``auto``'s order; ``BACKENDS``: name -> ``(forward,
backward)``): ``"triton"`` (``attention_triton_launch``; CUDA, or CPU tensors under ``TRITON_INTERPRET=1``), ``"sdpa"``
(``attention_sdpa``: ATen's FlashAttention-2 and memory-efficient CUDA kernels, fp16/bf16, no soft-capping or sliding
window), ``"cpu"`` (``attention_cpu``: ATen's fused CPU kernels; no soft-capping) and ``"torch"`` (any device,
chunked). This module holds the public ops with their checks, their references, the autograd Function and the sinks.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ._backends import TABLE, resolve
from .attention_torch import reference_attention

__all__ = [
    "BACKENDS",
    "multi_region_attention",
    "multi_region_attention_ref",
    "shared_prefix_attention",
    "shared_prefix_attention_ref",
    "MultiRegionAttentionFunction",
    "MultiRegionAttentionParams",
]

# Elements of one fp32 score matrix chunk in the torch path (4 MiB at fp32). Backward holds about four such matrices
# (S, P, dP, dS) at a time, forward two.
_DEFAULT_CHUNK_ELEMS = 1 << 20


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_float4(name, t, q):
    """``t`` is a 4-D floating tensor of q's dtype on q's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {t.dtype}")
    if t.dtype != q.dtype:
        raise TypeError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _check_bool(name, t, shape, q, what, dtype=torch.bool):
    """``t`` is a bool (or ``dtype``) tensor of ``shape`` (named dims in ``what``, e.g. "(B=3, C=5)") on q's
    device."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        kind = "a bool" if dtype == torch.bool else f"an {str(dtype).removeprefix('torch.')}"
        raise TypeError(f"{name} must be {kind} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {what}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _check_own(q, k, v, key_mask, scale):
    """Validate q, k, v, key_mask and scale; returns ``(B, Hq, Hkv, C, d)``."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float4(name, t, q)
    B, Hq, C, d = q.shape
    if tuple(k.shape[:1]) != (B,) or k.shape[2:] != (C, d):
        raise ValueError(f"k must have shape (B={B}, Hkv, C={C}, d={d}), got {tuple(k.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of kv heads Hkv={Hkv}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if key_mask is not None:
        _check_bool("key_mask", key_mask, (B, C), q, f"(B={B}, C={C})")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    return B, Hq, Hkv, C, d


_CHECKED: dict[int, tuple] = {}  # id -> (weak reference, version, lo, U) of the index tensors ``mark_checked`` saw


def mark_checked(index: torch.Tensor, lo: int, U: int) -> torch.Tensor:
    """``index`` (returned), known to hold values in ``[lo, U)`` until changed in place (read back once, or built so by
    the model layer): the layers of a model pass never read it back again."""
    if id(index) not in _CHECKED:
        weakref.finalize(index, _CHECKED.pop, id(index), None)
    _CHECKED[id(index)] = (weakref.ref(index), index._version, lo, U)
    return index


def _check_region(names, region_k, region_v, index, mask, q, Hkv, lo, sync):
    """Validate one region ``(region_k, region_v, index, mask)`` (``names`` are the four argument names used in
    messages) against q and ``Hkv``; ``index`` values must lie in ``[lo, U)``. Returns ``(U, S)``.

    ``index`` values are checked on the host (one read back, unless ``mark_checked`` saw the tensor) when ``sync``;
    else by ``torch._assert_async``, which on CUDA fails the next synchronising call instead of stalling this one.
    """
    n_k, n_v, n_i, n_m = names
    B, _, _, d = q.shape
    _check_float4(n_k, region_k, q)
    _check_float4(n_v, region_v, q)
    U, Hkv_r, S, d_r = region_k.shape
    if Hkv_r != Hkv or d_r != d:
        raise ValueError(f"{n_k} must have shape (U, Hkv={Hkv}, S, d={d}), got {tuple(region_k.shape)}")
    if region_v.shape != region_k.shape:
        raise ValueError(f"{n_v} shape {tuple(region_v.shape)} must equal {n_k} shape {tuple(region_k.shape)}")
    if U == 0 and B > 0:
        raise ValueError(f"{n_k} holds U=0 entries for B={B} rows")
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{n_i} must be a torch.Tensor, got {type(index).__name__}")
    if index.dtype != torch.int64:
        raise TypeError(f"{n_i} must be int64, got {index.dtype}")
    if tuple(index.shape) != (B,):
        raise ValueError(f"{n_i} must have shape (B={B},), got {tuple(index.shape)}")
    if index.device != q.device:
        raise ValueError(f"{n_i} is on {index.device} but q is on {q.device}")
    seen = _CHECKED.get(id(index))
    if B > 0 and sync and not (seen and seen[0]() is index and seen[1:] == (index._version, lo, U)):
        low, high = torch.stack([index.min(), index.max()]).tolist()
        if low < lo or high >= U:
            raise ValueError(f"{n_i} values must lie in [{lo}, U={U}), got {low if low < lo else high}")
        mark_checked(index, lo, U)
    elif B > 0 and not sync:
        torch._assert_async(((index >= lo) & (index < U)).all(), f"{n_i} values must lie in [{lo}, U={U})")
    _check_bool(n_m, mask, (U, S), q, f"(U={U}, S={S})")
    return U, S


def _check_features(q, sliding_window, sinks, softcap, q_positions):
    """Validate the optional features of :func:`multi_region_attention` (q already checked)."""
    B, Hq, C, _ = q.shape
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
            raise TypeError(f"sliding_window must be a Python int or None, got {type(sliding_window).__name__}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if q_positions is None:
            raise ValueError("sliding_window needs q_positions (B, C) int64 and every region's positions")
    if q_positions is not None:
        _check_bool("q_positions", q_positions, (B, C), q, f"(B={B}, C={C})", torch.int64)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a Python float or None, got {type(softcap).__name__}")
        if not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap must be a finite positive float, got {softcap}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
        if sinks.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"sinks must be a floating tensor (fp16/bf16/fp32/fp64), got {sinks.dtype}")
        if tuple(sinks.shape) != (Hq,):
            raise ValueError(f"sinks must have shape (Hq={Hq},), got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


# Argument names of shared_prefix_attention's one region, for messages; its rows all read a prompt (index >= 0).
_PREFIX_NAMES = ("prefix_k", "prefix_v", "prefix_index", "prefix_mask")


def _check_regions(regions, q, Hkv, sync, prefix, sliding_window=None):
    """Validate ``regions`` (a sequence of 4-tuples, or 5-tuples ending with key positions) and return
    ``(regions as a tuple of 4-tuples, tuple of positions or None per region)``. ``prefix``: the one region of
    :func:`shared_prefix_attention` (messages use its argument names, index -1 is refused); otherwise those of
    :func:`multi_region_attention` (index -1: the row reads nothing of that region). ``sliding_window``: W or None;
    with W every region must carry its positions."""
    if isinstance(regions, torch.Tensor) or not isinstance(regions, (list, tuple)):
        raise TypeError(
            f"regions must be a list or tuple of (region_k, region_v, index, mask) tuples, got {type(regions).__name__}"
        )
    if regions and isinstance(regions[0], torch.Tensor):
        raise TypeError(
            f"regions must be a list or tuple of (region_k, region_v, index, mask) tuples, got a "
            f"{type(regions).__name__} of tensors (one region goes in a list: [(region_k, ...)])"
        )
    out, positions = [], []
    lengths = (4,) if prefix else (4, 5)
    for i, region in enumerate(regions):
        if isinstance(region, torch.Tensor) or not isinstance(region, (list, tuple)) or len(region) not in lengths:
            what = type(region).__name__ if not isinstance(region, (list, tuple)) else f"length {len(region)}"
            raise TypeError(
                f"regions[{i}] must be a 4-tuple (region_k, region_v, index, mask) or a 5-tuple ending "
                f"with positions, got {what}"
            )
        names = (
            _PREFIX_NAMES if prefix else tuple(f"regions[{i}].{n}" for n in ("region_k", "region_v", "index", "mask"))
        )
        U, S = _check_region(names, *region[:4], q, Hkv, 0 if prefix else -1, sync)
        pos = region[4] if len(region) == 5 else None
        if pos is None and sliding_window is not None:
            raise ValueError(f"sliding_window needs regions[{i}]'s key positions (U={U}, S={S}) int64 as a 5th element")
        if pos is not None:
            _check_bool(f"regions[{i}].positions", pos, (U, S), q, f"(U={U}, S={S})", torch.int64)
        out.append(tuple(region[:4]))
        positions.append(pos)
    return tuple(out), tuple(positions)


@dataclass(frozen=True)
class MultiRegionAttentionParams:
    """Non-tensor options of :class:`MultiRegionAttentionFunction`.

    scale: softmax scale applied to ``q·k`` (dimensionless, usually ``d**-0.5``).
    backend: a key of ``BACKENDS`` (already resolved by ``resolve``, never ``"auto"``).
    chunk_elems: upper bound on the elements of one score matrix chunk in the torch path.
    sliding_window: W, keys visible iff ``0 <= pos_q - pos_k < W`` (positions given to the Function), or None.
    softcap: c, scores ``s <- c·tanh(s/c)`` before masking, or None.
    has_sinks: the Function's tensors end with a (Hq,) sink-logit tensor (see :class:`MultiRegionAttentionFunction`).
    out_map: None, or ``(to, back)``: output returned and kept as ``to([out])[0]`` (:func:`multi_region_attention`).
    """

    scale: float
    backend: str
    chunk_elems: int = _DEFAULT_CHUNK_ELEMS
    sliding_window: int | None = None
    softcap: float | None = None
    has_sinks: bool = False
    out_map: tuple | None = None


BACKENDS = {b.name: (b.forward, b.backward) for b in TABLE["multi_region_attention"]}
"""Backend name -> ``(forward, backward)``, read from ``_backends.TABLE``. ``forward(q, k, v, regions, key_mask,
params, positions=None)`` returns ``(out in q's dtype, lse fp32 (B, Hq, C))`` (fp64 for the torch backend's fp64
inputs); ``backward(dout, q, k, v, regions, key_mask, out, lse, params, positions=None)`` returns ``(dq, dk, dv,
[(dregion_k, dregion_v) per region])``. ``positions``: ``(q_positions, region positions)`` with
``params.sliding_window``, else None."""


def multi_region_attention_ref(
    q, k, v, regions, key_mask=None, *, scale, sliding_window=None, sinks=None, softcap=None, q_positions=None
):
    """Naive reference: materialise every row's keys ``[regions' entries; own keys]`` and run masked softmax attention.

    For row b the keys are ``region_k[index[b]]`` of every region with ``index[b] >= 0`` (its positions visible where
    ``mask[index[b]]``), then ``k[b]`` (causal, visible where ``key_mask[b]``), kv heads repeated ``Hq // Hkv`` times;
    one softmax over all of them. With ``sliding_window`` W a key is also hidden unless ``0 <= pos_q - pos_k < W``
    (``q_positions`` for the queries and own keys, each region's 5th element for its keys); with ``softcap`` c the
    scaled scores become ``c·tanh(s/c)`` before masking; with ``sinks`` one more always-visible key of logit
    ``sinks[h]`` and value 0 joins each head's softmax. Computed in the input dtype (fp64 if given fp64), so it serves
    both as the exact truth and as "the naive same-dtype result". A query with no visible key (and no sink) outputs 0.
    Memory: O(B·Hq·C·(ΣS_r + C)); for tests and benchmarks only.

    Args and return: as :func:`multi_region_attention`. Raises ``ValueError``/``TypeError`` on bad input.
    """
    return _reference(q, k, v, regions, key_mask, scale, False, (sliding_window, sinks, softcap, q_positions))


def _reference(q, k, v, regions, key_mask, scale, prefix, features=(None, None, None, None)):
    """Body of the two references (``prefix`` as in :func:`_check_regions`; ``features``: ``(sliding_window, sinks,
    softcap, q_positions)``)."""
    Hkv = _check_own(q, k, v, key_mask, scale)[2]
    W, sinks, softcap, q_pos = features
    _check_features(q, W, sinks, softcap, q_pos)
    regions, positions = _check_regions(regions, q, Hkv, sync=True, prefix=prefix, sliding_window=W)
    return reference_attention(q, k, v, regions, positions, key_mask, scale, features)


def shared_prefix_attention_ref(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask=None, *, scale):
    """Naive reference: materialise ``[prefix_k[prefix_index]; k]`` per row and run masked softmax attention, i.e.
    :func:`multi_region_attention_ref` with the one region ``(prefix_k, prefix_v, prefix_index, prefix_mask)``.

    Equals ``softmax(scale · q [K_p; K]^T + mask) [V_p; V]`` with the prompt K/V of row b gathered from
    ``prefix_k[prefix_index[b]]`` and the kv heads repeated ``Hq // Hkv`` times; computed in the input dtype (fp64 if
    given fp64). A query with no visible key outputs 0. Memory: O(B·Hq·C·(P+C)); for tests and benchmarks only.

    Args and return: as :func:`shared_prefix_attention`. Raises ``ValueError``/``TypeError`` on bad input.
    """
    return _reference(q, k, v, [(prefix_k, prefix_v, prefix_index, prefix_mask)], key_mask, scale, True)


def _split(tensors, params):
    """``(regions, sinks or None, positions or None)`` from the Function's flat tensors (see
    :class:`MultiRegionAttentionFunction`)."""
    n = len(tensors) - params.has_sinks
    n_regions = (n - 1) // 5 if params.sliding_window is not None else n // 4
    regions = [tensors[i : i + 4] for i in range(0, 4 * n_regions, 4)]
    sinks = tensors[4 * n_regions] if params.has_sinks else None
    positions = None
    if params.sliding_window is not None:
        rest = tensors[4 * n_regions + params.has_sinks :]
        positions = (rest[0], tuple(rest[1:]))
    return regions, sinks, positions


def _add_sinks(out, lse, sinks):
    """Merge the sink (one key per head of logit ``sinks[h]``, value 0) into ``(out, lse)``: ``l = logaddexp(l, s_h)``,
    ``o ← e^{l_old − l} o``. Returns ``(out in out's dtype, lse in lse's dtype)``."""
    acc = lse.dtype
    merged = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
    out = (out.to(acc) * torch.exp(lse - merged)[..., None]).to(out.dtype)
    return out, merged


def _sinks_grad(dout, out, lse, sinks):
    """``∂L/∂s_h = −Σ_{b,i} P_sink · D`` with ``P_sink = e^{s_h − L}`` (``L`` the merged LSE) and
    ``D = rowsum(dO ∘ O)``, in the accumulation dtype."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    return -(torch.exp(sinks.to(acc)[None, :, None] - lse) * delta).sum((0, 2))


class MultiRegionAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves only the inputs, the output and the fp32 log-sum-exp; recomputes scores in backward.

    ``forward(q, k, v, key_mask, params, *tensors)`` → ``out``, with ``tensors`` the regions flattened
    (``region_k, region_v, index, mask`` of region 0, then of region 1, ...), then the (Hq,) sinks if
    ``params.has_sinks``, then ``q_positions`` and each region's positions if ``params.sliding_window``; see
    :func:`multi_region_attention` for shapes. ``params`` is a :class:`MultiRegionAttentionParams`;
    ``BACKENDS[params.backend]`` does the work, taking ``positions=`` besides the arguments above. Sinks are merged
    into the backend's ``(out, lse)`` here, on every backend, so the backend's backward sees the merged output and
    LSE, and the sink gradient is computed here.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, params, *tensors):
        regions, sinks, positions = _split(tensors, params)
        out, lse = BACKENDS[params.backend][0](q, k, v, regions, key_mask, params, positions=positions)
        if sinks is not None:
            out, lse = _add_sinks(out, lse, sinks)
        if params.out_map is not None:
            out = params.out_map[0]([out])[0]
        ctx.save_for_backward(q, k, v, key_mask, out, lse, *tensors)
        ctx.params = params
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, key_mask, out, lse, *tensors = ctx.saved_tensors
        if ctx.params.out_map is not None:
            out, dout = ctx.params.out_map[1]([out, dout])
        regions, sinks, positions = _split(tensors, ctx.params)
        bwd = BACKENDS[ctx.params.backend][1]
        dq, dk, dv, dregions = bwd(dout, q, k, v, regions, key_mask, out, lse, ctx.params, positions=positions)
        grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None]
        for (drk, drv), (rk, rv, _, _) in zip(dregions, regions):
            grads += [drk.to(rk.dtype), drv.to(rv.dtype), None, None]
        if sinks is not None:
            grads.append(_sinks_grad(dout, out, lse, sinks).to(sinks.dtype))
        grads += [None] * (len(tensors) + 5 - len(grads))  # positions
        return tuple(grads)


def _call_shape(q, regions) -> tuple[int, int, int]:
    """(head dim, queries B·C, longest region S): the sizes of the call's shape class (``_op_times``), read before the
    regions are validated (a malformed region counts as none)."""
    ok = lambda r: isinstance(r, (list, tuple)) and r and isinstance(r[0], torch.Tensor) and r[0].dim() == 4
    regions = regions if isinstance(regions, (list, tuple)) else ()
    return q.shape[3], q.shape[0] * q.shape[2], max((r[0].shape[2] for r in regions if ok(r)), default=0)


def _attention(q, k, v, regions, key_mask, scale, backend, prefix, features=(None, None, None, None), out_map=None):
    """Validate (``prefix`` as in :func:`_check_regions`; ``features`` as in :func:`_reference`; ``out_map`` as in
    :func:`multi_region_attention`), resolve ``backend`` and run the autograd Function."""
    W, sinks, softcap, q_pos = features
    if out_map is not None and not (isinstance(out_map, tuple) and len(out_map) == 2 and all(map(callable, out_map))):
        raise TypeError(f"out_map must be None or a pair of callables, got {out_map!r}")
    Hkv = _check_own(q, k, v, key_mask, scale)[2]
    _check_features(q, W, sinks, softcap, q_pos)
    needs = {name for name, value in (("softcap", softcap), ("sliding_window", W)) if value is not None}
    backend = resolve("multi_region_attention", backend, q, needs, _call_shape(q, regions))
    sync = next(b for b in TABLE["multi_region_attention"] if b.name == backend).host_checks  # else checks on device
    regions, positions = _check_regions(regions, q, Hkv, sync=sync, prefix=prefix, sliding_window=W)
    params = MultiRegionAttentionParams(
        scale=float(scale),
        backend=backend,
        sliding_window=W,
        softcap=None if softcap is None else float(softcap),
        has_sinks=sinks is not None,
        out_map=out_map,
    )
    tensors = [t for r in regions for t in r] + ([sinks] if sinks is not None else [])
    if W is not None:
        tensors += [q_pos, *positions]
    return MultiRegionAttentionFunction.apply(q, k, v, key_mask, params, *tensors)


def multi_region_attention(
    q,
    k,
    v,
    regions,
    key_mask=None,
    *,
    scale,
    backend="auto",
    sliding_window=None,
    sinks=None,
    softcap=None,
    q_positions=None,
    out_map=None,
):
    """Attention of each row's queries over several shared K/V regions, read in place, and its own causal keys.

    Equals :func:`multi_region_attention_ref`: for row b, with ``rep = Hq // Hkv`` and ``R_b`` the regions b reads::

        K = torch.cat([region_k[index[b]] for r in R_b] + [k[b]], dim=1).repeat_interleave(rep, 0)  # (Hq, Σ S_r + C, d)
        V = likewise from region_v and v[b]
        visible = mask[index[b]] over each region's S_r positions, then (j ≤ i and key_mask[b, j]) over the own C
        out[b] = softmax(scale · q[b] K^T masked by visible) V                  (one softmax over every region)

    without a per-row or GQA-repeated copy of any region's K/V: each entry is read in place once for all its rows, and
    the regions merge by log-sum-exp (Hydragen, arXiv 2402.05099; backward per region: FlashAttention-2, arXiv
    2307.08691). A query with no visible key outputs 0 (zero gradient). Accumulates in fp32 (fp64 for fp64 inputs).

    Args:
        q: (B, Hq, C, d) queries after RoPE; fp16, bf16, fp32, or fp64 (torch and cpu backends).
        k, v: (B, Hkv, C, d) each row's own keys/values after RoPE, q's dtype; causal; ``Hq % Hkv == 0``.
        regions: a list or tuple (possibly empty) of ``(region_k, region_v, index, mask)`` or ``(region_k, region_v,
            index, mask, positions)``: region_k, region_v (U_r, Hkv, S_r, d) of q's dtype and device, U_r >= 1 (S_r may
            differ between regions); index (B,) int64 in [-1, U_r), the entry row b reads, -1 for none; mask (U_r, S_r)
            bool, True at real keys (padding anywhere); positions (U_r, S_r) int64, each key's absolute position (stock
            TRL's ``arange`` over the padded row), required with ``sliding_window``.
        key_mask: (B, C) bool, True where the own key position is real; None means all real.
        scale: softmax scale (``module.scaling``), a finite positive Python float.
        backend: ``"auto"`` (CUDA: the fastest measured for the GPU and shape, else the first of triton, sdpa, torch
            that runs the call; CPU: cpu, then torch), ``"sdpa"`` (fp16/bf16, d % 8 == 0 and <= 256), ``"triton"``
            (both read tensors in place, never synchronise), ``"cpu"`` or ``"torch"``; a backend lacking a feature the
            call needs (sdpa: soft-cap, window; cpu: soft-cap) passes the call to the next that has it.
        sliding_window: W (int >= 1) or None: key j is also hidden from query i unless ``0 <= pos_i - pos_j < W``
            (transformers' sliding-window test); an entry out of every reader's window is not read.
        sinks: (Hq,) floating tensor on q's device, or None: per-head sink logits (gpt-oss ``module.sinks``), one more
            key in each head's softmax with logit ``sinks[h]`` (not scaled) and value 0. Differentiable.
        softcap: c (finite float > 0) or None: scaled scores become ``c·tanh(s/c)`` before masking (Gemma 2).
        q_positions: (B, C) int64 positions of the rows' own queries and keys; required with ``sliding_window``.
        out_map: None, or ``(to, back)``, functions from a list of tensors to a list moving elements, ``back`` undoing
            ``to``: the op returns and keeps ``to([out])[0]``; backward recovers both with one ``back([kept, dout])``
            (the sequence-parallel head exchange's all-to-alls, ``grpo_mem.model.sequence_heads``).

    Returns:
        (B, Hq, C, d) tensor of q's dtype, differentiable in q, k, v, region K/V (summed in fp32 over an entry's rows)
        and ``sinks``. Kept for backward: the inputs, the output and a (B, Hq, C) fp32 log-sum-exp.

    Raises:
        ValueError: a bad shape, ``Hq % Hkv != 0``, an index out of [-1, U_r), mismatched devices, a non-positive
            scale or softcap, ``sliding_window`` < 1 or without positions, non-floating ``sinks``, an unknown backend;
            ``BackendUnavailableError`` (a ValueError) for a requested backend that cannot run here.
        RuntimeError: an index out of range on the sdpa and triton backends (at the next synchronising call on CUDA).
        TypeError: non-tensor arguments, ``regions`` not a sequence of 4- or 5-tuples, non-float or mismatched
            dtypes, non-int64 index or positions, non-bool masks, non-int window, non-float softcap, bad ``out_map``.
    """
    features = (sliding_window, sinks, softcap, q_positions)
    return _attention(q, k, v, regions, key_mask, scale, backend, False, features, out_map)


def shared_prefix_attention(
    q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask=None, *, scale, backend="auto"
):
    """Causal attention of completion queries over ``[own prompt ; own completion]`` without copying the prompt K/V:
    :func:`multi_region_attention` with the one region ``(prefix_k, prefix_v, prefix_index, prefix_mask)`` that every
    row reads. Equals :func:`shared_prefix_attention_ref`, i.e. for each row b, with ``rep = Hq // Hkv``::

        K = torch.cat([prefix_k[prefix_index[b]], k[b]], dim=1).repeat_interleave(rep, 0)   # (Hq, P+C, d)
        V = torch.cat([prefix_v[prefix_index[b]], v[b]], dim=1).repeat_interleave(rep, 0)
        visible[i, j] = prefix_mask[prefix_index[b], j] for j < P; (j − P ≤ i) and key_mask[b, j − P] for j ≥ P
        out[b] = softmax(scale · q[b] K^T masked by visible) V

    Args:
        q, k, v, key_mask, scale, backend: as :func:`multi_region_attention`'s.
        prefix_k, prefix_v: (U, Hkv, P, d) the U unique prompts' keys/values after RoPE, q's dtype; prompts may be
            left-padded to a common P (padding masked by ``prefix_mask``).
        prefix_index: (B,) int64 in [0, U): the prompt of row b. Rows need not be sorted; groups may differ in size.
        prefix_mask: (U, P) bool, True where the prompt key position is real.

    Returns:
        (B, Hq, C, d) tensor of q's dtype, differentiable in q, k, v, prefix_k, prefix_v (prompt gradients summed in
        fp32 over the rows sharing the prompt). Kept for backward: the inputs, the output, a (B, Hq, C) fp32 LSE.

    Raises:
        As :func:`multi_region_attention` (``prefix_index`` must lie in [0, U)).
    """
    return _attention(q, k, v, [(prefix_k, prefix_v, prefix_index, prefix_mask)], key_mask, scale, backend, prefix=True)

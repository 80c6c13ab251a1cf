"""Multi-region attention for the completion pass of a GRPO group forward; shared-prefix attention is its one-region
call.

G completions of one prompt attend to that prompt's keys/values and, causally, to their own. Stock scoring
concatenates the prompt K/V in front of every completion (``torch.cat`` in the KV cache, then ``repeat_kv`` for GQA),
so each layer holds G·(Hq/Hkv) copies of the prompt K/V for backward. Here the prompt K/V are read in place. With a
prefix tree (docs/how-it-works.md, "Prefix trees") a row reads several shared regions (its ancestors' segments), each a tensor of
unique entries indexed per row:

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

Backends (``BACKENDS``: name -> (forward, backward)): ``"torch"`` (any device, chunked so temporaries stay bounded),
``"cpu"`` (the same regions on ATen's fused CPU attention kernels, whose forward returns the log-sum-exp and whose
backward takes the merged output and log-sum-exp), ``"triton"`` (``attention_triton.py``, imported on first use; CUDA,
or CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._backends import aten_cpu_attention, lazy, resolve

__all__ = [
    "BACKENDS",
    "multi_region_attention",
    "multi_region_attention_ref",
    "shared_prefix_attention",
    "shared_prefix_attention_ref",
    "MultiRegionAttentionFunction",
    "MultiRegionAttentionParams",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements of one fp32 score matrix chunk in the torch path (4 MiB at fp32). Backward holds about four such matrices
# (S, P, dP, dS) at a time, forward two.
_DEFAULT_CHUNK_ELEMS = 1 << 20


@dataclass(frozen=True)
class MultiRegionAttentionParams:
    """Non-tensor options of :class:`MultiRegionAttentionFunction`.

    scale: softmax scale applied to ``q·k`` (dimensionless, usually ``d**-0.5``).
    backend: a key of ``BACKENDS`` (already resolved, never ``"auto"``).
    chunk_elems: upper bound on the elements of one score matrix chunk in the torch path.
    sliding_window: W, keys visible iff ``0 <= pos_q - pos_k < W`` (positions given to the Function), or None.
    softcap: c, scores ``s <- c·tanh(s/c)`` before masking, or None.
    has_sinks: the Function's tensors end with a (Hq,) sink-logit tensor (see :class:`MultiRegionAttentionFunction`).
    """

    scale: float
    backend: str
    chunk_elems: int = _DEFAULT_CHUNK_ELEMS
    sliding_window: int | None = None
    softcap: float | None = None
    has_sinks: bool = False


# ----------------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------------


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
        if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
            raise TypeError(f"key_mask must be a bool tensor or None, got {getattr(key_mask, 'dtype', type(key_mask))}")
        _check_bool("key_mask", key_mask, (B, C), q, f"(B={B}, C={C})")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    return B, Hq, Hkv, C, d


def _check_region(names, region_k, region_v, index, mask, q, Hkv, lo, sync):
    """Validate one region ``(region_k, region_v, index, mask)`` (``names`` are the four argument names used in
    messages) against q and ``Hkv``; ``index`` values must lie in ``[lo, U)``. Returns ``(U, S)``.

    ``index`` values are checked on the host (two reads back) when ``sync``; otherwise by ``torch._assert_async``,
    which on CUDA fails the next synchronising call instead of stalling this one (the Triton path reads nothing back).
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
    if B > 0 and sync:
        low, high = int(index.min()), int(index.max())
        if low < lo or high >= U:
            raise ValueError(f"{n_i} values must lie in [{lo}, U={U}), got {low if low < lo else high}")
    elif B > 0:
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


def _check_regions(regions, q, Hkv, sync, prefix, window=False):
    """Validate ``regions`` (a sequence of 4-tuples, or 5-tuples ending with key positions) and return
    ``(regions as a tuple of 4-tuples, tuple of positions or None per region)``. ``prefix``: the one region of
    :func:`shared_prefix_attention` (messages use its argument names, index -1 is refused); otherwise those of
    :func:`multi_region_attention` (index -1: the row reads nothing of that region). ``window``: every region must
    carry its positions."""
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
        if pos is None and window:
            raise ValueError(f"sliding_window needs regions[{i}]'s key positions (U={U}, S={S}) int64 as a 5th element")
        if pos is not None:
            _check_bool(f"regions[{i}].positions", pos, (U, S), q, f"(U={U}, S={S})", torch.int64)
        out.append(tuple(region[:4]))
        positions.append(pos)
    return tuple(out), tuple(positions)


# ----------------------------------------------------------------------------------------------------------------------
# naive reference
# ----------------------------------------------------------------------------------------------------------------------


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


def _window_visible(W, q_pos, k_pos):
    """Bool (..., c, S): ``0 <= q_pos[..., i] - k_pos[..., j] < W`` for q_pos (..., c), k_pos (..., S)."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    return (diff >= 0) & (diff < W)


def _reference(q, k, v, regions, key_mask, scale, prefix, features=(None, None, None, None)):
    """Body of the two references (``prefix`` as in :func:`_check_regions`; ``features``: ``(sliding_window, sinks,
    softcap, q_positions)``)."""
    B, Hq, Hkv, C, d = _check_own(q, k, v, key_mask, scale)
    W, sinks, softcap, q_pos = features
    _check_features(q, W, sinks, softcap, q_pos)
    regions, positions = _check_regions(regions, q, Hkv, sync=True, prefix=prefix, window=W is not None)
    rep = Hq // Hkv
    keys, values, vis = [], [], []
    for (region_k, region_v, index, mask), pos in zip(regions, positions):
        safe = index.clamp(min=0)
        keys.append(region_k[safe])  # (B, Hkv, S_r, d)
        values.append(region_v[safe])
        vis.append((mask[safe] & (index >= 0)[:, None])[:, None, :].expand(B, C, -1))
        if W is not None:
            vis[-1] = vis[-1] & _window_visible(W, q_pos, pos[safe])
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril().expand(B, C, C)
    vis.append(causal if key_mask is None else causal & key_mask[:, None, :])
    if W is not None:
        vis[-1] = vis[-1] & _window_visible(W, q_pos, q_pos)
    keys = torch.cat(keys + [k], dim=2).repeat_interleave(rep, dim=1)  # (B, Hq, ΣS_r + C, d)
    values = torch.cat(values + [v], dim=2).repeat_interleave(rep, dim=1)
    visible = torch.cat(vis, dim=2)[:, None]  # (B, 1, C, ΣS_r + C)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if sinks is not None:  # one more key per head: logit sinks[h], value 0, always visible
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(B, Hq, C, 1)
        scores = torch.cat([scores, sink], dim=-1)
        values = torch.cat([values, values.new_zeros(B, Hq, 1, d)], dim=2)
        visible = torch.cat([visible, visible.new_ones(B, 1, C, 1)], dim=-1)
    scores = scores.masked_fill(~visible, float("-inf"))
    has_key = visible.any(dim=-1, keepdim=True)
    # A row without visible keys would be all -inf (NaN softmax); give it zeros instead, with zero gradient.
    scores = scores.masked_fill(~has_key, 0.0)
    probs = torch.softmax(scores, dim=-1) * has_key
    return torch.matmul(probs, values)


def shared_prefix_attention_ref(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask=None, *, scale):
    """Naive reference: materialise ``[prefix_k[prefix_index]; k]`` per row and run masked softmax attention, i.e.
    :func:`multi_region_attention_ref` with the one region ``(prefix_k, prefix_v, prefix_index, prefix_mask)``.

    Equals ``softmax(scale · q [K_p; K]^T + mask) [V_p; V]`` with the prompt K/V of row b gathered from
    ``prefix_k[prefix_index[b]]`` and the kv heads repeated ``Hq // Hkv`` times; computed in the input dtype (fp64 if
    given fp64). A query with no visible key outputs 0. Memory: O(B·Hq·C·(P+C)); for tests and benchmarks only.

    Args and return: as :func:`shared_prefix_attention`. Raises ``ValueError``/``TypeError`` on bad input.
    """
    return _reference(q, k, v, [(prefix_k, prefix_v, prefix_index, prefix_mask)], key_mask, scale, True)


# ----------------------------------------------------------------------------------------------------------------------
# torch zero-copy path
# ----------------------------------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the torch path: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _groups(index: torch.Tensor, U: int):
    """Rows reading each entry of a region: list of ``(u, rows)`` with ``rows`` an int64 tensor of row indices,
    ascending; entries no row reads are left out, and so are rows with index −1."""
    order = torch.argsort(index, stable=True)
    counts = torch.bincount(index + 1, minlength=U + 1).tolist()  # counts[0]: rows that read nothing
    out, start = [], counts[0]
    for u, n in enumerate(counts[1:]):
        if n:
            out.append((u, order[start : start + n]))
            start += n
    return out


def _query_chunks(rows: torch.Tensor, per_row: int, C: int, budget: int):
    """Split the queries of ``rows`` into chunks ``(rows_chunk, c0, c1)`` of at most ``budget`` score elements.

    ``per_row`` is the number of score elements one query position of one row produces (all heads, all keys).
    Whole rows are grouped while they fit; a row too large on its own is split along its C query positions.
    """
    row_elems = per_row * C
    if row_elems <= budget:
        nb = max(1, budget // max(row_elems, 1))
        return [(rows[i : i + nb], 0, C) for i in range(0, rows.numel(), nb)]
    cl = max(1, budget // max(per_row, 1))
    return [(rows[i : i + 1], c0, min(C, c0 + cl)) for i in range(rows.numel()) for c0 in range(0, C, cl)]


def _take(x: torch.Tensor, rows: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """``x[rows, :, c0:c1]`` for x of shape (B, H, C, ...), via ``index_select`` (faster than advanced indexing)."""
    x = x.index_select(0, rows)
    return x if c0 == 0 and c1 == x.shape[2] else x[:, :, c0:c1]


def _put(x: torch.Tensor, rows: torch.Tensor, c0: int, c1: int, val: torch.Tensor, accumulate: bool = False):
    """``x[rows, :, c0:c1] = val`` (or ``+=``) in place; ``rows`` holds no duplicates."""
    if c0 == 0 and c1 == x.shape[2]:
        (x.index_add_ if accumulate else x.index_copy_)(0, rows, val)
    elif accumulate:
        x[rows, :, c0:c1] += val
    else:
        x[rows, :, c0:c1] = val


def _fold(x: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(n, Hq, c, d) → (Hkv, n·rep·c, d): the queries of one kv head across rows and its query heads, as one matrix."""
    n, Hq, c, d = x.shape
    return x.reshape(n, Hkv, Hq // Hkv, c, d).transpose(0, 1).reshape(Hkv, -1, d)


def _unfold(x: torch.Tensor, n: int, Hq: int, c: int) -> torch.Tensor:
    """Inverse of :func:`_fold` for a trailing dim of any size: (Hkv, n·rep·c, e) → (n, Hq, c, e)."""
    Hkv, _, e = x.shape
    return x.reshape(Hkv, n, Hq // Hkv, c, e).transpose(0, 1).reshape(n, Hq, c, e)


def _completion_visibility(rows, c0, c1, C, rep, key_mask, device, window=None):
    """Bool (n, 1, rep·(c1−c0), C): query position i sees own key j iff j ≤ i and key_mask[row, j] (and, with
    ``window = (W, q_positions)``, ``pos_i − pos_j < W``)."""
    qpos = torch.arange(c0, c1, device=device)
    vis = torch.arange(C, device=device)[None, :] <= qpos[:, None]  # (c, C)
    vis = vis.repeat(rep, 1)[None, None]  # (1, 1, rep·c, C)
    if key_mask is not None:
        vis = vis & key_mask[rows][:, None, None, :]
    if window is not None:
        W, q_pos = window
        pos = q_pos.index_select(0, rows)
        vis = vis & _rep_rows(_window_visible(W, pos[:, c0:c1], pos), rep)[:, None]
    return vis


def _rep_rows(vis, rep):
    """(n, c, S) → (n, rep·c, S): the same rows for each of the ``rep`` query heads of a kv head (the folded order)."""
    n, c, S = vis.shape
    return vis[:, None].expand(n, rep, c, S).reshape(n, rep * c, S)


@dataclass(frozen=True)
class _Features:
    """Score options of the torch path: ``softcap`` c or None; ``window`` None or ``(W, q_positions (B, C))``."""

    softcap: float | None = None
    window: tuple | None = None


def _scores(qx, kx, scale, softcap, keep_tanh=False):
    """``scale · qx kxᵀ`` in qx's dtype, soft-capped to ``c·tanh(s/c)`` when ``softcap``; with ``keep_tanh`` returns
    ``(s, tanh(s/c) or None)`` (the backward's ``ds/ds_raw = 1 − tanh²``)."""
    s = torch.matmul(qx, kx.transpose(-1, -2)).mul_(scale)
    t = None
    if softcap is not None:
        t = s.div_(softcap).tanh_()
        s = t * softcap if keep_tanh else t.mul_(softcap)
    return (s, t) if keep_tanh else s


def _region_visible(kmask, feat, k_pos, u, rc, c0, c1, rep):
    """Visible keys of entry ``u`` for the folded queries of rows ``rc``, positions c0:c1: ``kmask`` (S,) alone, or
    with a window (1, n·rep·c, S)."""
    if feat.window is None:
        return kmask
    W, q_pos = feat.window
    vis = _window_visible(W, q_pos.index_select(0, rc)[:, c0:c1], k_pos[u]) & kmask
    return _rep_rows(vis, rep).reshape(1, -1, kmask.shape[0])


def _live_groups(index, mask, feat, k_pos):
    """:func:`_groups` of a region without the entries whose real keys all lie outside every reader's window (those
    are never read)."""
    groups = _groups(index, mask.shape[0])
    if feat.window is None:
        return groups
    W, q_pos = feat.window
    return [
        (u, rows) for u, rows in groups if (_window_visible(W, q_pos.index_select(0, rows), k_pos[u]) & mask[u]).any()
    ]


def _region_fwd(q, region_k, region_v, mask, groups, Hkv, scale, budget, o_acc, l_acc, feat=_Features(), k_pos=None):
    """Forward over one shared region. Writes the normalised region output into ``o_acc`` and its LSE into ``l_acc``
    at the rows of ``groups`` (see :func:`_groups`); other rows are left as they are. ``feat``: soft-capping and
    window (``k_pos``: the region's (U, S) key positions)."""
    B, Hq, C, d = q.shape
    S = region_k.shape[2]
    acc = o_acc.dtype
    for u, rows in groups:
        ku = region_k[u].to(acc)  # (Hkv, S, d): at most one copy per entry, never per row
        vu = region_v[u].to(acc)
        kmask = mask[u]  # (S,)
        for rc, c0, c1 in _query_chunks(rows, Hq * S, C, budget):
            n, c = rc.numel(), c1 - c0
            qc = _fold(_take(q, rc, c0, c1).to(acc), Hkv)  # (Hkv, M, d)
            s = _scores(qc, ku, scale, feat.softcap)  # (Hkv, M, S)
            s.masked_fill_(~_region_visible(kmask, feat, k_pos, u, rc, c0, c1, Hq // Hkv), float("-inf"))
            lse = torch.logsumexp(s, dim=-1)  # (Hkv, M), -inf where no key visible
            s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
            o = torch.matmul(s, vu)  # (Hkv, M, d), normalised
            _put(o_acc, rc, c0, c1, _unfold(o, n, Hq, c))
            _put(l_acc, rc, c0, c1, _unfold(lse[..., None], n, Hq, c)[..., 0])


def _own_fwd(q, k, v, key_mask, Hkv, scale, budget, o_acc, l_acc, feat=_Features()):
    """Forward over the own region (per-row causal). Same outputs as :func:`_region_fwd`, for every row."""
    B, Hq, C, d = q.shape
    rep = Hq // Hkv
    acc = o_acc.dtype
    all_rows = torch.arange(B, device=q.device)
    for rc, c0, c1 in _query_chunks(all_rows, Hq * C, C, budget):
        n, c = rc.numel(), c1 - c0
        qc = _take(q, rc, c0, c1).to(acc).reshape(n, Hkv, rep * c, d)
        kc, vc = k.index_select(0, rc).to(acc), v.index_select(0, rc).to(acc)  # (n, Hkv, C, d)
        s = _scores(qc, kc, scale, feat.softcap)  # (n, Hkv, rep·c, C)
        s.masked_fill_(~_completion_visibility(rc, c0, c1, C, rep, key_mask, q.device, feat.window), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
        o = torch.matmul(s, vc)  # (n, Hkv, rep·c, d)
        _put(o_acc, rc, c0, c1, o.reshape(n, Hq, c, d))
        _put(l_acc, rc, c0, c1, lse.reshape(n, Hq, c))


def _merge_(o, l, o_r, l_r):
    """In place, ``(o, l)`` ← the exact LSE merge of the normalised partial attentions ``(o, l)`` and ``(o_r, l_r)``:
    ``l = logaddexp(l, l_r)``, ``o = e^{l_old − l} o + e^{l_r − l} o_r``. Queries with no visible key in either keep
    ``o = 0``, ``l = −inf``. ``o_r`` is overwritten (scaled by its weight)."""
    lse = torch.logaddexp(l, l_r)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    o.mul_(torch.exp(l - safe)[..., None])  # exp(-inf) = 0 for an empty side
    o.add_(o_r.mul_(torch.exp(l_r - safe)[..., None]))
    l.copy_(lse)


def _features(params, positions):
    """The :class:`_Features` of ``params`` and ``positions`` (``(q_positions, region positions)`` or None), and the
    region positions (None each without a window)."""
    if params.sliding_window is None:
        return _Features(params.softcap), None
    q_pos, k_pos = positions
    return _Features(params.softcap, (params.sliding_window, q_pos)), k_pos


def _torch_fwd(q, k, v, regions, key_mask, params, positions=None):
    """Torch forward: returns ``(out in q.dtype (B, Hq, C, d), lse (B, Hq, C))``, lse fp32 (fp64 for fp64 inputs).
    Temporaries: two (B, Hq, C, d) accumulators in that dtype and score chunks of ``params.chunk_elems``.
    ``positions``: ``(q_positions, (positions of each region))`` when ``params.sliding_window`` is set."""
    B, Hq, C, d = q.shape
    Hkv = k.shape[1]
    dev, acc = q.device, _acc_dtype(q.dtype)
    o = torch.zeros(B, Hq, C, d, dtype=acc, device=dev)
    lse = torch.full((B, Hq, C), float("-inf"), dtype=acc, device=dev)
    feat, k_pos = _features(params, positions)
    _own_fwd(q, k, v, key_mask, Hkv, params.scale, params.chunk_elems, o, lse, feat)
    if regions:
        o_r, l_r = torch.zeros_like(o), torch.empty_like(lse)
    for i, (region_k, region_v, index, mask) in enumerate(regions):
        l_r.fill_(float("-inf"))  # rows that do not read the region
        pos = None if k_pos is None else k_pos[i]
        _region_fwd(
            q,
            region_k,
            region_v,
            mask,
            _live_groups(index, mask, feat, pos),
            Hkv,
            params.scale,
            params.chunk_elems,
            o_r,
            l_r,
            feat,
            pos,
        )
        _merge_(o, lse, o_r, l_r)
    return o.to(q.dtype), lse


def _region_bwd(
    q, do, lse, delta, region_k, region_v, mask, groups, Hkv, scale, budget, dq, feat=_Features(), k_pos=None
):
    """Backward over one shared region with the merged ``lse`` (−inf replaced by 0) and ``delta = rowsum(dO ∘ O)``,
    ``do`` in the accumulation dtype: adds the region's share to ``dq`` and returns ``(dregion_k, dregion_v)``, summed
    over every row reading an entry and every query head of the kv head."""
    B, Hq, C, d = q.shape
    U, _, S, _ = region_k.shape
    acc = dq.dtype
    drk = torch.zeros(U, Hkv, S, d, dtype=acc, device=q.device)
    drv = torch.zeros_like(drk)
    for u, rows in groups:
        ku, vu = region_k[u].to(acc), region_v[u].to(acc)
        kmask = mask[u]
        for rc, c0, c1 in _query_chunks(rows, Hq * S, C, budget):
            n, c = rc.numel(), c1 - c0
            qc = _fold(_take(q, rc, c0, c1).to(acc), Hkv)  # (Hkv, M, d)
            doc = _fold(_take(do, rc, c0, c1), Hkv)
            lc = _fold(_take(lse, rc, c0, c1)[..., None], Hkv)  # (Hkv, M, 1)
            dc = _fold(_take(delta, rc, c0, c1)[..., None], Hkv)
            p, t = _scores(qc, ku, scale, feat.softcap, keep_tanh=True)  # (Hkv, M, S)
            p.masked_fill_(~_region_visible(kmask, feat, k_pos, u, rc, c0, c1, Hq // Hkv), float("-inf"))
            p.sub_(lc).exp_()
            drv[u] += torch.matmul(p.transpose(1, 2), doc)
            ds = _dscores(torch.matmul(doc, vu.transpose(1, 2)), dc, p, t)
            del p, t
            _put(dq, rc, c0, c1, _unfold(torch.matmul(ds, ku), n, Hq, c).mul_(scale), accumulate=True)
            drk[u] += torch.matmul(ds.transpose(1, 2), qc).mul_(scale)
    return drk, drv


def _dscores(dp, delta, p, t):
    """Gradient of the scaled raw scores, in place in ``dp``: ``dS = P ∘ (dP − D)``, times ``1 − tanh²`` when
    soft-capped (``t`` the tanh, else None)."""
    ds = dp.sub_(delta).mul_(p)
    return ds if t is None else ds.mul_(1 - t.square_())


def _own_bwd(q, k, v, do, lse, delta, key_mask, Hkv, scale, budget, dq, feat=_Features()):
    """Backward over the own region (arguments as :func:`_region_bwd`): adds to ``dq``, returns ``(dk, dv)``."""
    B, Hq, C, d = q.shape
    rep = Hq // Hkv
    dev, acc = q.device, dq.dtype
    dk = torch.zeros(B, Hkv, C, d, dtype=acc, device=dev)
    dv = torch.zeros_like(dk)
    all_rows = torch.arange(B, device=dev)
    for rc, c0, c1 in _query_chunks(all_rows, Hq * C, C, budget):
        n, c = rc.numel(), c1 - c0
        qc = _take(q, rc, c0, c1).to(acc).reshape(n, Hkv, rep * c, d)
        doc = _take(do, rc, c0, c1).reshape(n, Hkv, rep * c, d)
        lc = _take(lse, rc, c0, c1).reshape(n, Hkv, rep * c, 1)
        dc = _take(delta, rc, c0, c1).reshape(n, Hkv, rep * c, 1)
        kc, vc = k.index_select(0, rc).to(acc), v.index_select(0, rc).to(acc)
        p, t = _scores(qc, kc, scale, feat.softcap, keep_tanh=True)  # (n, Hkv, rep·c, C)
        p.masked_fill_(~_completion_visibility(rc, c0, c1, C, rep, key_mask, dev, feat.window), float("-inf"))
        p.sub_(lc).exp_()
        dv.index_add_(0, rc, torch.matmul(p.transpose(-1, -2), doc))
        ds = _dscores(torch.matmul(doc, vc.transpose(-1, -2)), dc, p, t)
        del p, t
        _put(dq, rc, c0, c1, torch.matmul(ds, kc).mul_(scale).reshape(n, Hq, c, d), accumulate=True)
        dk.index_add_(0, rc, torch.matmul(ds.transpose(-1, -2), qc).mul_(scale))
    return dk, dv


def _torch_bwd(dout, q, k, v, regions, key_mask, out, lse, params, positions=None):
    """Torch backward, FlashAttention-2 style per region with the merged ``out``/``lse``.

    Returns ``(dq, dk, dv, [(dregion_k, dregion_v) per region])`` in the accumulation dtype (fp32; fp64 for fp64
    inputs); region gradients are summed in that dtype over every row reading an entry and every query head of the kv
    head (entries no row reads get 0).
    """
    B, Hq, C, d = q.shape
    Hkv = k.shape[1]
    scale, budget = params.scale, params.chunk_elems
    acc = _acc_dtype(q.dtype)
    do = dout.to(acc)
    delta = (do * out.to(acc)).sum(-1)  # (B, Hq, C): D = rowsum(dO ∘ O)
    lse_safe = torch.where(torch.isinf(lse), 0.0, lse)  # empty rows: every score is -inf, so P = 0 there
    dq = torch.zeros(B, Hq, C, d, dtype=acc, device=q.device)
    feat, k_pos = _features(params, positions)
    k_pos = k_pos or (None,) * len(regions)
    dregions = [
        _region_bwd(
            q,
            do,
            lse_safe,
            delta,
            rk,
            rv,
            mask,
            _live_groups(index, mask, feat, pos),
            Hkv,
            scale,
            budget,
            dq,
            feat,
            pos,
        )
        for (rk, rv, index, mask), pos in zip(regions, k_pos)
    ]
    dk, dv = _own_bwd(q, k, v, do, lse_safe, delta, key_mask, Hkv, scale, budget, dq, feat)
    return dq, dk, dv, dregions


# ----------------------------------------------------------------------------------------------------------------------
# ATen fused CPU attention path
# ----------------------------------------------------------------------------------------------------------------------


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility → additive mask (0 visible, −inf hidden) in ``dtype``, as the ATen CPU kernels take it."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _own_layout(q, k, key_mask, Hkv, window=None):
    """The own region as one batched attention: queries (B, Hkv, rep·C, d) against each row's own (B, Hkv, C, d) keys,
    with the (B, 1, rep·C, C) causal-and-padding (and ``window = (W, q_positions)``) additive mask, and the (B, 1, C)
    bool "query sees a key". Folding the query heads of a kv head avoids repeating K/V."""
    B, Hq, C, d = q.shape
    rows = torch.arange(B, device=q.device)
    visible = _completion_visibility(rows, 0, C, C, Hq // Hkv, key_mask, q.device, window)
    seen = visible[:, 0, :C].any(-1)[:, None]  # the rep query heads of a position see the same keys
    return q.reshape(B, Hkv, -1, d), _additive(visible, q.dtype), seen


def _entry_keys(mask, u, rows, feat, k_pos, rep, dtype):
    """What the cpu path reads of entry ``u`` for the folded queries of ``rows``: ``(lo, hi, additive mask
    (1, 1, n·rep·C or 1, hi − lo), seen (n, 1, C) bool or None)``, with keys ``lo:hi`` the span of every key some query
    sees; None when no query sees a key. Without a window the whole entry (queries see every real key); with one only
    the keys in reach, so a long prompt costs O(W + C) keys per query, not O(S)."""
    if feat.window is None:
        return (0, mask.shape[1], _additive(mask[u][None, None, None, :], dtype), None) if mask[u].any() else None
    W, q_pos = feat.window
    vis = _window_visible(W, q_pos.index_select(0, rows), k_pos[u]) & mask[u]  # (n, C, S)
    cols = vis.any(1).any(0).nonzero()
    if cols.numel() == 0:
        return None
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    vis = vis[..., lo:hi]
    n, C, _ = vis.shape
    return lo, hi, _additive(_rep_rows(vis, rep).reshape(1, 1, n * rep * C, hi - lo), dtype), vis.any(-1)[:, None]


def _cpu_fwd(q, k, v, regions, key_mask, params, positions=None):
    """Forward on ATen's fused CPU kernels: one batched call for the own regions and, per region, one call per entry
    that rows read (the queries of those rows folded against its K/V in place; entries with no visible key skipped;
    with a window only the keys in reach of the rows, see :func:`_entry_keys`); merged by LSE. Returns
    ``(out in q.dtype, lse fp32)``."""
    fwd, _ = aten_cpu_attention()
    B, Hq, C, d = q.shape
    Hkv = k.shape[1]
    acc = _acc_dtype(q.dtype)
    feat, k_pos = _features(params, positions)
    q_own, mask_own, seen = _own_layout(q, k, key_mask, Hkv, feat.window)
    o, lse = fwd(q_own, k, v, 0.0, False, attn_mask=mask_own, scale=params.scale)
    o, lse = o.reshape(B, Hq, C, d).to(acc), lse.reshape(B, Hq, C).to(acc)
    lse.masked_fill_(~seen, float("-inf"))  # the kernel reports LSE 0, not −inf, for a query that sees no key
    if regions:
        o_r, l_r = torch.zeros_like(o), torch.empty_like(lse)
    for i, (region_k, region_v, index, mask) in enumerate(regions):
        l_r.fill_(float("-inf"))
        for u, rows in _groups(index, region_k.shape[0]):
            keys = _entry_keys(mask, u, rows, feat, k_pos and k_pos[i], Hq // Hkv, q.dtype)
            if keys is None:
                continue
            lo, hi, add, seen_u = keys
            n = rows.numel()
            qu = _fold(q.index_select(0, rows), Hkv)[None]  # (1, Hkv, n·rep·C, d)
            ou, lu = fwd(
                qu,
                region_k[u : u + 1, :, lo:hi],
                region_v[u : u + 1, :, lo:hi],
                0.0,
                False,
                attn_mask=add,
                scale=params.scale,
            )
            lu = _unfold(lu[0, ..., None].to(acc), n, Hq, C)[..., 0]
            if seen_u is not None:  # (the kernel's output is 0 there)
                lu.masked_fill_(~seen_u, float("-inf"))
            o_r.index_copy_(0, rows, _unfold(ou[0].to(acc), n, Hq, C))
            l_r.index_copy_(0, rows, lu)
        _merge_(o, lse, o_r, l_r)
    return o.to(q.dtype), lse


def _cpu_bwd(dout, q, k, v, regions, key_mask, out, lse, params, positions=None):
    """Backward on ATen's fused CPU kernels: each region's FlashAttention-2 backward given the merged ``out`` and
    ``lse``, so the kernel's ``D = rowsum(dO ∘ O)`` and ``P = exp(S − L)`` are those of the whole attention (the keys
    of :func:`_entry_keys` per entry). Returns as :func:`_torch_bwd` (dq fp32, the others in the inputs' dtype)."""
    _, bwd = aten_cpu_attention()
    B, Hq, C, d = q.shape
    Hkv = k.shape[1]
    feat, k_pos = _features(params, positions)
    lse = torch.where(torch.isinf(lse), 0.0, lse).to(_acc_dtype(q.dtype))  # no key: all P = exp(−inf) = 0
    dout = dout.contiguous()
    dq = torch.zeros(B, Hq, C, d, dtype=_acc_dtype(q.dtype), device=q.device)
    dregions = []
    for i, (region_k, region_v, index, mask) in enumerate(regions):
        drk, drv = torch.zeros_like(region_k), torch.zeros_like(region_v)
        for u, rows in _groups(index, region_k.shape[0]):
            keys = _entry_keys(mask, u, rows, feat, k_pos and k_pos[i], Hq // Hkv, q.dtype)
            if keys is None:
                continue
            lo, hi, add, _ = keys
            n = rows.numel()
            fold = lambda x: _fold(x.index_select(0, rows), Hkv)[None]  # noqa: E731
            fold_l = _fold(lse.index_select(0, rows)[..., None], Hkv)[None, ..., 0]
            g = bwd(
                fold(dout),
                fold(q),
                region_k[u : u + 1, :, lo:hi],
                region_v[u : u + 1, :, lo:hi],
                fold(out),
                fold_l,
                0.0,
                False,
                attn_mask=add,
                scale=params.scale,
            )
            dq.index_add_(0, rows, _unfold(g[0][0].to(dq.dtype), n, Hq, C))
            drk[u, :, lo:hi], drv[u, :, lo:hi] = g[1][0], g[2][0]
        dregions.append((drk, drv))
    q_own, mask_own, _ = _own_layout(q, k, key_mask, Hkv, feat.window)
    g = bwd(
        dout.reshape(B, Hkv, -1, d),
        q_own,
        k,
        v,
        out.reshape(B, Hkv, -1, d),
        lse.reshape(B, Hkv, -1),
        0.0,
        False,
        attn_mask=mask_own,
        scale=params.scale,
    )
    dq += g[0].reshape(B, Hq, C, d)
    return dq, g[1], g[2], dregions


# ----------------------------------------------------------------------------------------------------------------------
# autograd and public API
# ----------------------------------------------------------------------------------------------------------------------


BACKENDS = {
    "torch": (_torch_fwd, _torch_bwd),
    "cpu": (_cpu_fwd, _cpu_bwd),
    "triton": (
        lazy("attention_triton", "multi_region_attention_fwd"),
        lazy("attention_triton", "multi_region_attention_bwd"),
    ),
}
"""Backend name -> ``(forward, backward)``. ``forward(q, k, v, regions, key_mask, params)`` returns ``(out in q's dtype,
lse fp32 (B, Hq, C))`` (fp64 for the torch path's fp64 inputs); ``backward(dout, q, k, v, regions, key_mask, out, lse,
params)`` returns ``(dq, dk, dv, [(dregion_k, dregion_v) per region])``. Each also takes ``positions=``
``(q_positions, region positions)`` for ``params.sliding_window`` (None without)."""


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


def _backend(params, positions):
    """``(forward, backward)`` for ``params``, each taking the backend arguments and returning as ``BACKENDS``. The cpu
    backend runs the torch backend's math when soft-capping is asked for (ATen's fused kernel cannot express it)."""
    name = params.backend
    if name == "cpu" and params.softcap is not None:
        name = "torch"
    fwd, bwd = BACKENDS[name]
    return (lambda *a: fwd(*a, positions=positions)), (lambda *a: bwd(*a, positions=positions))


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
    ``BACKENDS[params.backend]`` does the work (see :func:`_backend` for the torch fallbacks). Sinks are merged
    into the backend's ``(out, lse)`` here, on every backend, so the backend's backward sees the merged output and
    LSE, and the sink gradient is computed here.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, params, *tensors):
        regions, sinks, positions = _split(tensors, params)
        out, lse = _backend(params, positions)[0](q, k, v, regions, key_mask, params)
        if sinks is not None:
            out, lse = _add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, key_mask, out, lse, *tensors)
        ctx.params = params
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, key_mask, out, lse, *tensors = ctx.saved_tensors
        regions, sinks, positions = _split(tensors, ctx.params)
        bwd = _backend(ctx.params, positions)[1]
        dq, dk, dv, dregions = bwd(dout, q, k, v, regions, key_mask, out, lse, ctx.params)
        grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None]
        for (drk, drv), (rk, rv, _, _) in zip(dregions, regions):
            grads += [drk.to(rk.dtype), drv.to(rv.dtype), None, None]
        if sinks is not None:
            grads.append(_sinks_grad(dout, out, lse, sinks).to(sinks.dtype))
        grads += [None] * (len(tensors) + 5 - len(grads))  # positions
        return tuple(grads)


def _attention(q, k, v, regions, key_mask, scale, backend, prefix, features=(None, None, None, None)):
    """Validate (``prefix`` as in :func:`_check_regions`; ``features`` as in :func:`_reference`), resolve ``backend``
    and run the autograd Function."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    backend = resolve("multi_region_attention", backend, q)
    _, _, Hkv, _, _ = _check_own(q, k, v, key_mask, scale)
    W, sinks, softcap, q_pos = features
    _check_features(q, W, sinks, softcap, q_pos)
    # the Triton path must not stall the host on each layer: its index checks run on the device
    regions, positions = _check_regions(regions, q, Hkv, sync=backend != "triton", prefix=prefix, window=W is not None)
    params = MultiRegionAttentionParams(
        scale=float(scale),
        backend=backend,
        sliding_window=W,
        softcap=None if softcap is None else float(softcap),
        has_sinks=sinks is not None,
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
):
    """Attention of each row's queries over several shared K/V regions, read in place, and its own causal keys.

    Equals :func:`multi_region_attention_ref`, i.e. for each row b, with ``rep = Hq // Hkv`` and ``R_b`` the regions
    with ``index[b] >= 0``::

        K = torch.cat([region_k[index[b]] for r in R_b] + [k[b]], dim=1).repeat_interleave(rep, 0)  # (Hq, Σ S_r + C, d)
        V = likewise from region_v and v[b]
        visible = mask[index[b]] over each region's S_r positions, then (j ≤ i and key_mask[b, j]) over the own C
        out[b] = softmax(scale · q[b] K^T masked by visible) V                  (one softmax over every region)

    but never builds a per-row (or GQA-repeated) copy of any region's K/V: each entry is read in place, once for all
    rows that read it, and the regions are merged by log-sum-exp (Hydragen, arXiv 2402.05099; backward FlashAttention-2,
    arXiv 2307.08691, per region with the merged output and LSE). A query with no visible key outputs 0 with zero
    gradient. Query head h uses kv head ``h // rep``. Accumulation is fp32 (fp64 for fp64 inputs).

    Args:
        q: (B, Hq, C, d) queries after RoPE; fp16, bf16, fp32, or fp64 (torch and cpu backends).
        k, v: (B, Hkv, C, d) each row's own keys/values after RoPE, q's dtype; causal (query i sees own keys 0..i).
            ``Hq % Hkv == 0``.
        regions: a list or tuple (possibly empty) of 4-tuples ``(region_k, region_v, index, mask)``, or 5-tuples
            ``(region_k, region_v, index, mask, positions)``:
            region_k, region_v: (U_r, Hkv, S_r, d), q's dtype and device, U_r >= 1 entries (S_r may differ between
            regions); index: (B,) int64 in [-1, U_r), the entry row b reads, -1 for none; mask: (U_r, S_r) bool, True
            at real key positions (padding may sit anywhere in an entry); positions: (U_r, S_r) int64, the absolute
            position of each key (stock TRL's ``arange`` over the padded row), required with ``sliding_window``.
        key_mask: (B, C) bool, True where the own key position is real; None means all real.
        scale: softmax scale (``module.scaling``), a finite positive Python float.
        backend: ``"torch"`` (chunked matmuls, any device), ``"cpu"`` (ATen's fused CPU attention kernels, once for all
            own regions and once per read entry of each region), ``"triton"`` (fp16/bf16/fp32; reads every tensor in
            place with its strides and never synchronises with the host), or ``"auto"`` (triton for fp16/bf16/fp32
            CUDA tensors, cpu for CPU tensors, torch otherwise). ``softcap`` runs in the torch and Triton kernels; the
            cpu backend runs the torch backend's math for it (ATen's fused kernel cannot express it).
            ``sliding_window`` runs on every backend: in the Triton kernels (key tiles no query of a block can reach
            are skipped before their K/V are loaded, so a query costs O(W) keys of work, plus a position check per
            tile of the entry), on the cpu backend through ATen's fused kernel given, per entry, only the keys in
            reach of its rows (the span of keys some query sees) with a per-query mask (3.4x less CPU time than the
            torch math for forward + backward of a Gemma-3-like layer, P=2048, W=512; see docs/kernels.md), on the torch
            backend as masked chunked matmuls. ``sinks`` run on every backend, merged into the backend's output and
            LSE by one elementwise pass, their gradient from the merged LSE.
        sliding_window: W (int >= 1) or None: key j is visible to query i only if ``0 <= pos_i - pos_j < W`` (the
            test of transformers' sliding-window mask, on absolute positions), besides the masks above. A region
            entry none of whose real keys lies in any reader's window is not read at all.
        sinks: (Hq,) floating tensor on q's device, or None: per-head sink logits (gpt-oss ``module.sinks``), one more
            key in each head's softmax with logit ``sinks[h]`` (not scaled) and value 0. Differentiable.
        softcap: c (finite float > 0) or None: the scaled scores become ``c·tanh(s/c)`` before masking (Gemma 2's
            ``attn_logit_softcapping``).
        q_positions: (B, C) int64 absolute positions of the rows' own queries (and own keys); required with
            ``sliding_window``.

    Returns:
        (B, Hq, C, d) tensor of q's dtype. Differentiable in q, k, v, every region_k/region_v (a region's gradient
        is summed in fp32 over all rows reading each entry; entries no row reads get 0) and ``sinks``. Memory kept for
        backward: the inputs, the output and a (B, Hq, C) fp32 log-sum-exp.

    Raises:
        ValueError: bad shapes (q/k/v, a region's K/V, index, mask or positions, key_mask, q_positions, sinks),
            ``Hq % Hkv != 0``, an index out of [-1, U_r), mismatched devices, non-positive scale, ``sliding_window`` <
            1 or without positions, ``softcap`` <= 0, non-floating ``sinks``, unknown backend; ``BackendUnavailableError`` (a
            ValueError) for an explicitly requested backend that cannot run here (``"triton"`` without CUDA or the
            interpreter, or with fp64 inputs).
        RuntimeError: an index out of range on the triton backend (``torch._assert_async``: at once on CPU, at the next
            synchronising call on CUDA).
        TypeError: non-tensor arguments, ``regions`` not a sequence of 4- or 5-tuples, non-float or mismatched
            dtypes, non-int64 index or positions, non-bool masks, non-int ``sliding_window``, non-float ``softcap``.
    """
    return _attention(q, k, v, regions, key_mask, scale, backend, False, (sliding_window, sinks, softcap, q_positions))


def shared_prefix_attention(
    q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask=None, *, scale, backend="auto"
):
    """Causal attention of completion queries over ``[own prompt ; own completion]`` without copying the prompt K/V.

    Equals :func:`shared_prefix_attention_ref`, i.e. for each row b, with ``rep = Hq // Hkv``::

        K = torch.cat([prefix_k[prefix_index[b]], k[b]], dim=1).repeat_interleave(rep, 0)   # (Hq, P+C, d)
        V = torch.cat([prefix_v[prefix_index[b]], v[b]], dim=1).repeat_interleave(rep, 0)
        visible[i, j] = prefix_mask[prefix_index[b], j]                  for j < P
                      = (j − P ≤ i) and key_mask[b, j − P]                for j ≥ P
        out[b] = softmax(scale · q[b] K^T masked by visible) V

    but never builds ``prefix_k[prefix_index]`` or GQA-repeated K/V: the prompt K/V are read in place, once per
    unique prompt, and the two regions are merged by log-sum-exp. It is
    ``multi_region_attention(q, k, v, [(prefix_k, prefix_v, prefix_index, prefix_mask)], key_mask)`` with every row
    reading a prompt. A query with no visible key outputs 0 with zero gradient. Query head h uses kv head
    ``h // rep``. Accumulation is fp32 (fp64 for fp64 inputs).

    Args:
        q: (B, Hq, C, d) completion queries after RoPE; fp16, bf16, fp32, or fp64 (torch backend only, fp64 throughout).
        k, v: (B, Hkv, C, d) the completions' own keys/values after RoPE, q's dtype.
        prefix_k, prefix_v: (U, Hkv, P, d) the U unique prompts' keys/values after RoPE, q's dtype; prompts may be
            left-padded to a common P (padding masked by ``prefix_mask``).
        prefix_index: (B,) int64 in [0, U): the prompt of row b. Rows need not be sorted; groups may differ in size.
        prefix_mask: (U, P) bool, True where the prompt key position is real.
        key_mask: (B, C) bool, True where the completion key position is real; None means all real.
        scale: softmax scale (``module.scaling``), a finite positive Python float.
        backend: ``"torch"`` (chunked matmuls, any device), ``"cpu"`` (ATen's fused CPU attention kernels, called
            once per unique prompt on its folded queries and once for all completions), ``"triton"`` (fp16/bf16/fp32;
            reads q/k/v and the prompt K/V in place with their strides and never synchronises with the host), or
            ``"auto"`` (triton for fp16/bf16/fp32 CUDA tensors, torch for fp64 CUDA tensors, cpu for CPU tensors,
            torch otherwise).

    Returns:
        (B, Hq, C, d) tensor of q's dtype. Differentiable in q, k, v, prefix_k, prefix_v (prompt gradients are summed
        in fp32 over all rows sharing the prompt). Memory kept for backward: the inputs, the output and a
        (B, Hq, C) fp32 log-sum-exp.

    Raises:
        ValueError: bad shapes, ``Hq % Hkv != 0``, ``prefix_index`` out of range, mismatched devices, non-positive
            scale, unknown backend; ``BackendUnavailableError`` (a ValueError) for an explicitly requested backend that
            cannot run here (``"triton"`` without CUDA or the interpreter, or with fp64 inputs).
        RuntimeError: ``prefix_index`` out of range on the triton backend (``torch._assert_async``: at once on CPU, at
            the next synchronising call on CUDA).
        TypeError: non-tensor arguments, non-float q/k/v, non-int64 ``prefix_index``, non-bool masks.
    """
    return _attention(q, k, v, [(prefix_k, prefix_v, prefix_index, prefix_mask)], key_mask, scale, backend, prefix=True)

"""The ``"cpu"`` backend of multi-region attention, and the region helpers it shares with the torch backend
(``attention_torch``) and the references (``attention``): accumulation dtype, sliding-window visibility, the rows of
each entry, folding the query heads of a kv head into one matrix, the exact log-sum-exp merge. They live here so that
a CPU call runs one backend module.

The regions of :func:`grpo_mem.ops.attention.multi_region_attention` run on ATen's fused CPU attention kernels, whose
forward returns the log-sum-exp and whose backward takes the merged output and log-sum-exp. One batched call covers
every row's own region; each region costs one call per entry that rows read, on the queries of those rows folded
against the entry's K/V in place. Sliding windows run in the kernels: per entry, only the keys in reach of its rows
(from the first to the last key some query sees) with a per-query mask (3.4x less CPU time than the torch math for
forward + backward of a Gemma-3-like layer, P=2048, W=512; see docs/kernels.md). Soft-capping cannot be expressed
there: the backend table (``_backends.TABLE``) lists this backend without it, so ``resolve`` hands soft-capped calls
to the torch backend.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = [
    "ScoreFeatures",
    "acc_dtype",
    "aten_cpu_attention",
    "completion_visibility",
    "entry_groups",
    "fold_heads",
    "merge_lse_",
    "multi_region_attention_bwd",
    "multi_region_attention_fwd",
    "own_layout",
    "repeat_rows",
    "score_features",
    "sliding_window_visible",
    "unfold_heads",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the cpu and torch backends: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sliding_window_visible(W: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bool (..., c, S): ``0 <= q_pos[..., i] - k_pos[..., j] < W`` for int64 q_pos (..., c), k_pos (..., S)
    (transformers' sliding-window test)."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    return (diff >= 0) & (diff < W)


_MEMO: dict = {}


def memo(tensors: tuple, extra: tuple, compute):
    """``compute()``, computed once while the tensors ``tensors`` live unchanged (the same objects at the same
    versions) for the hashable ``extra``: the layers of a model pass (and a layer's backward) hand the op the same
    key masks, indices and positions, whose derived masks, entry groups and key spans are then built once per pass,
    not once per layer. An entry goes when one of its tensors does."""
    key = (tuple(map(id, tensors)), tuple(t._version for t in tensors), extra)
    hit = _MEMO.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], tensors)):
        return hit[1]
    value = compute()
    _MEMO[key] = (tuple(weakref.ref(t) for t in tensors), value)
    for t in tensors:
        weakref.finalize(t, _MEMO.pop, key, None)
    return value


def entry_groups(index: torch.Tensor, U: int) -> list[tuple[int, torch.Tensor]]:
    """Rows reading each entry of a region: list of ``(u, rows)`` with ``rows`` an int64 tensor of row indices,
    ascending; entries no row reads are left out, and so are rows with index −1 (``memo``: once per index tensor)."""
    return memo((index,), (U,), lambda: _entry_groups(index, U))


def _entry_groups(index: torch.Tensor, U: int) -> list[tuple[int, torch.Tensor]]:
    order = torch.argsort(index, stable=True)
    counts = torch.bincount(index + 1, minlength=U + 1).tolist()  # counts[0]: rows that read nothing
    out, start = [], counts[0]
    for u, n in enumerate(counts[1:]):
        if n:
            out.append((u, order[start : start + n]))
            start += n
    return out


def fold_heads(x: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(n, Hq, c, d) → (Hkv, n·rep·c, d): the queries of one kv head across rows and its query heads, as one matrix."""
    n, Hq, c, d = x.shape
    return x.reshape(n, Hkv, Hq // Hkv, c, d).transpose(0, 1).reshape(Hkv, -1, d)


def unfold_heads(x: torch.Tensor, n: int, Hq: int, c: int) -> torch.Tensor:
    """Inverse of :func:`fold_heads` for a trailing dim of any size: (Hkv, n·rep·c, e) → (n, Hq, c, e)."""
    Hkv, _, e = x.shape
    return x.reshape(Hkv, n, Hq // Hkv, c, e).transpose(0, 1).reshape(n, Hq, c, e)


def repeat_rows(vis: torch.Tensor, rep: int) -> torch.Tensor:
    """(n, c, S) → (n, rep·c, S): the same rows for each of the ``rep`` query heads of a kv head (the folded order)."""
    n, c, S = vis.shape
    return vis[:, None].expand(n, rep, c, S).reshape(n, rep * c, S)


def completion_visibility(rows, c0, c1, C, rep, key_mask, device, sliding_window=None) -> torch.Tensor:
    """Bool (n, 1, rep·(c1−c0), C): query position i of ``rows`` sees own key j iff j ≤ i and key_mask[row, j] (and,
    with ``sliding_window = (W, q_positions)``, ``pos_i − pos_j < W``)."""
    qpos = torch.arange(c0, c1, device=device)
    vis = torch.arange(C, device=device)[None, :] <= qpos[:, None]  # (c, C)
    vis = vis.repeat(rep, 1)[None, None]  # (1, 1, rep·c, C)
    if key_mask is not None:
        vis = vis & key_mask[rows][:, None, None, :]
    if sliding_window is not None:
        W, q_pos = sliding_window
        pos = q_pos.index_select(0, rows)
        vis = vis & repeat_rows(sliding_window_visible(W, pos[:, c0:c1], pos), rep)[:, None]
    return vis


def merge_lse_(o, l, o_r, l_r) -> None:
    """In place, ``(o, l)`` ← the exact LSE merge of the normalised partial attentions ``(o, l)`` and ``(o_r, l_r)``:
    ``l = logaddexp(l, l_r)``, ``o = e^{l_old − l} o + e^{l_r − l} o_r``. Queries with no visible key in either keep
    ``o = 0``, ``l = −inf``. ``o_r`` is overwritten (scaled by its weight)."""
    lse = torch.logaddexp(l, l_r)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    o.mul_(torch.exp(l - safe)[..., None])  # exp(-inf) = 0 for an empty side
    o.add_(o_r.mul_(torch.exp(l_r - safe)[..., None]))
    l.copy_(lse)


@dataclass(frozen=True)
class ScoreFeatures:
    """Score options of the cpu and torch backends: ``softcap`` c or None; ``sliding_window`` None or
    ``(W, q_positions (B, C) int64)``."""

    softcap: float | None = None
    sliding_window: tuple | None = None


def score_features(params, positions) -> tuple[ScoreFeatures, tuple | None]:
    """The :class:`ScoreFeatures` of ``params`` (a ``MultiRegionAttentionParams``) and ``positions`` (``(q_positions,
    region positions)`` or None), and the region positions (None without a sliding window)."""
    if params.sliding_window is None:
        return ScoreFeatures(params.softcap), None
    q_pos, k_pos = positions
    return ScoreFeatures(params.softcap, (params.sliding_window, q_pos)), k_pos


def aten_cpu_attention():
    """ATen's fused CPU attention kernels ``(forward, backward)`` (the forward returns the log-sum-exp), or None when
    this torch lacks them."""
    ops = torch.ops.aten
    try:
        return ops._scaled_dot_product_flash_attention_for_cpu, ops._scaled_dot_product_flash_attention_for_cpu_backward
    except (AttributeError, RuntimeError):  # pragma: no cover - present in every torch this package supports
        return None


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility → additive mask (0 visible, −inf hidden) in ``dtype``, as the ATen CPU kernels take it."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def own_layout(q, key_mask, Hkv, sliding_window=None):
    """The own region as one batched attention: queries (B, Hkv, rep·C, d) against each row's own (B, Hkv, C, d) keys,
    with the (B, 1, rep·C, C) causal-and-padding (and ``sliding_window = (W, q_positions)``) additive mask, and the
    (B, 1, C) bool "query sees a key". Folding the query heads of a kv head avoids repeating K/V."""
    B, Hq, C, d = q.shape
    keys = tuple(t for t in (key_mask, sliding_window and sliding_window[1]) if t is not None)
    W = sliding_window and sliding_window[0]
    mask, seen = memo(keys, (B, Hq, Hkv, C, W, q.dtype, q.device), lambda: _own_mask(q, key_mask, Hkv, sliding_window))
    return q.reshape(B, Hkv, -1, d), mask, seen


def _own_mask(q, key_mask, Hkv, sliding_window):
    """``own_layout``'s additive mask and "query sees a key", built once per key mask (``memo``)."""
    B, Hq, C, d = q.shape
    rows = torch.arange(B, device=q.device)
    visible = completion_visibility(rows, 0, C, C, Hq // Hkv, key_mask, q.device, sliding_window)
    seen = visible[:, 0, :C].any(-1)[:, None]  # the rep query heads of a position see the same keys
    return additive(visible, q.dtype), seen


MASK_BYTES_LIMIT = 64 * 2**20
"""The largest own-region mask (bytes, ``own_layout``'s 6 per element) built for rows with padding before
``_prefix_lengths`` takes the mask-free path instead. Below it the one batched masked call is faster than the per-row
calls for padding queries (forward + backward, 2 threads: 0.17 against 0.23 s for 16 rows of 256 tokens, rep 4);
above it the mask's memory, quadratic in the pass, is what matters (and the mask-free path was faster too: 0.71
against 0.80 s at 8 rows of 1024 tokens). Without padding the mask-free path makes no per-row call and is taken at
any size."""


def _prefix_lengths(key_mask, sliding_window, batch: int, C: int, rep: int, device) -> torch.Tensor | None:
    """``_own_lengths`` once per key mask (``memo``)."""
    if key_mask is None:
        return _own_lengths(key_mask, sliding_window, batch, C, rep, device)
    return memo(
        (key_mask,),
        (sliding_window is None, batch, C, rep, device),
        lambda: _own_lengths(key_mask, sliding_window, batch, C, rep, device),
    )


def _own_lengths(key_mask, sliding_window, batch: int, C: int, rep: int, device) -> torch.Tensor | None:
    """(B,) int64, the real keys of each row, when the own region takes the path without a mask tensor: no sliding
    window, each row's real keys a prefix of it (right padding only, or no mask), and no padding at all or a mask that
    would exceed ``MASK_BYTES_LIMIT``; else None.

    Then the kernel's own ``is_causal`` serves the queries of real positions, and each row's padding queries (which
    see all of the row's real keys and nothing else) take one unmasked call against those keys. The (B, 1, rep·C, C)
    mask of ``own_layout`` would cost 6 bytes per element, quadratic in C (805 MB for a sequence-parallel shard of
    8192 tokens with rep 2)."""
    if sliding_window is not None:
        return None
    if key_mask is None or bool(key_mask.all()):
        return torch.full((batch,), C, dtype=torch.long, device=device)
    if 6 * batch * rep * C * C <= MASK_BYTES_LIMIT:
        return None
    if C > 1 and bool((key_mask[:, 1:] & ~key_mask[:, :-1]).any()):
        return None  # a real key after a padding one (left padding)
    return key_mask.sum(1)


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, Hkv, C, d) → (B, Hkv·rep, C, d), each kv head repeated for its query heads."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _padded_rows(lengths: torch.Tensor, C: int) -> list[tuple[int, int]]:
    """``(row, real keys)`` of the rows with padding queries."""
    return [(b, n) for b, n in enumerate(lengths.tolist()) if n < C]


def _own_causal_fwd(fwd, q, k, v, lengths, scale, acc):
    """The own region without a mask tensor (``_prefix_lengths``): ``(o acc (B, Hq, C, d), lse acc (B, Hq, C))``;
    a row with no real key gets zero output and −inf LSE."""
    C = q.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    o, lse = fwd(q, k, v, 0.0, True, scale=scale)
    o, lse = o.to(acc), lse.to(acc)
    for b, n in _padded_rows(lengths, C):
        if n == 0:
            o[b], lse[b] = 0, float("-inf")
            continue
        ob, lb = fwd(q[b : b + 1, :, n:], k[b : b + 1, :, :n], v[b : b + 1, :, :n], 0.0, False, scale=scale)
        o[b, :, n:], lse[b, :, n:] = ob[0].to(acc), lb[0].to(acc)
    return o, lse


def _own_causal_bwd(bwd, dout, q, k, v, out, lse, lengths, scale):
    """Backward of ``_own_causal_fwd``, given the merged ``out`` and ``lse``: ``(dq, dk, dv)``."""
    B, Hkv, C, d = k.shape
    rep = q.shape[1] // Hkv
    k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    padded = _padded_rows(lengths, C)
    causal_dout = dout
    if padded:
        causal_dout = dout.clone()
        for b, n in padded:
            causal_dout[b, :, n:] = 0  # with dO = 0 (and so D = 0) nothing flows from these queries here
    dq, dk, dv = bwd(causal_dout, q, k, v, out, lse, 0.0, True, scale=scale)[:3]
    for b, n in padded:
        if n == 0:
            continue
        tail = slice(b, b + 1), slice(None), slice(n, None)
        head = slice(b, b + 1), slice(None), slice(None, n)
        g = bwd(dout[tail], q[tail], k[head], v[head], out[tail], lse[tail], 0.0, False, scale=scale)
        dq[tail] += g[0]
        dk[head] += g[1]
        dv[head] += g[2]
    fold = lambda x: x.reshape(B, Hkv, rep, C, d).sum(2) if rep > 1 else x  # noqa: E731
    return dq, fold(dk), fold(dv)


def _entry_keys(mask, u, rows, feat, k_pos, rep, dtype):
    """``_entry_span`` once per region mask, entry and reader rows (and positions with a sliding window): ``memo``."""
    W = feat.sliding_window
    keys = (mask, rows) if W is None else (mask, rows, W[1], k_pos)
    return memo(keys, (u, rep, dtype, W and W[0]), lambda: _entry_span(mask, u, rows, feat, k_pos, rep, dtype))


def _entry_span(mask, u, rows, feat, k_pos, rep, dtype):
    """What the cpu path reads of entry ``u`` for the folded queries of ``rows``: ``(lo, hi, additive mask
    (1, 1, n·rep·C or 1, hi − lo), seen (n, 1, C) bool or None)``, with keys ``lo:hi`` the span of every key some query
    sees; None when no query sees a key. Without a sliding window the whole entry (queries see every real key); with
    one only the keys in reach, so a long prompt costs O(W + C) keys per query, not O(S)."""
    if feat.sliding_window is None:
        return (0, mask.shape[1], additive(mask[u][None, None, None, :], dtype), None) if mask[u].any() else None
    W, q_pos = feat.sliding_window
    vis = sliding_window_visible(W, q_pos.index_select(0, rows), k_pos[u]) & mask[u]  # (n, C, S)
    cols = vis.any(1).any(0).nonzero()
    if cols.numel() == 0:
        return None
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    vis = vis[..., lo:hi]
    n, C, _ = vis.shape
    return lo, hi, additive(repeat_rows(vis, rep).reshape(1, 1, n * rep * C, hi - lo), dtype), vis.any(-1)[:, None]


def multi_region_attention_fwd(q, k, v, regions, key_mask, params, positions=None):
    """Forward on ATen's fused CPU kernels: one batched call for the own regions and, per region, one call per entry
    that rows read (the queries of those rows folded against its K/V in place; entries with no visible key skipped;
    with a sliding window only the keys in reach of the rows, see :func:`_entry_keys`); merged by LSE. Returns
    ``(out in q.dtype, lse fp32)``. Raises ValueError for ``params.softcap`` (ATen's fused kernel cannot soft-cap).
    """
    if params.softcap is not None:
        raise ValueError(f"the cpu backend cannot soft-cap scores (softcap={params.softcap}): use backend='torch'")
    fwd, _ = aten_cpu_attention()
    B, Hq, C, d = q.shape
    Hkv = k.shape[1]
    acc = acc_dtype(q.dtype)
    feat, k_pos = score_features(params, positions)
    lengths = _prefix_lengths(key_mask, feat.sliding_window, B, C, Hq // Hkv, q.device)
    if lengths is not None:
        o, lse = _own_causal_fwd(fwd, q, k, v, lengths, params.scale, acc)
    else:
        q_own, mask_own, seen = own_layout(q, key_mask, Hkv, feat.sliding_window)
        o, lse = fwd(q_own, k, v, 0.0, False, attn_mask=mask_own, scale=params.scale)
        o, lse = o.reshape(B, Hq, C, d).to(acc), lse.reshape(B, Hq, C).to(acc)
        lse.masked_fill_(~seen, float("-inf"))  # the kernel reports LSE 0, not −inf, for a query that sees no key
    if regions:
        o_r, l_r = torch.zeros_like(o), torch.empty_like(lse)
    for i, (region_k, region_v, index, mask) in enumerate(regions):
        l_r.fill_(float("-inf"))
        for u, rows in entry_groups(index, region_k.shape[0]):
            keys = _entry_keys(mask, u, rows, feat, k_pos and k_pos[i], Hq // Hkv, q.dtype)
            if keys is None:
                continue
            lo, hi, add, seen_u = keys
            n = rows.numel()
            qu = fold_heads(q.index_select(0, rows), Hkv)[None]  # (1, Hkv, n·rep·C, d)
            ou, lu = fwd(
                qu,
                region_k[u : u + 1, :, lo:hi],
                region_v[u : u + 1, :, lo:hi],
                0.0,
                False,
                attn_mask=add,
                scale=params.scale,
            )
            lu = unfold_heads(lu[0, ..., None].to(acc), n, Hq, C)[..., 0]
            if seen_u is not None:  # (the kernel's output is 0 there)
                lu.masked_fill_(~seen_u, float("-inf"))
            o_r.index_copy_(0, rows, unfold_heads(ou[0].to(acc), n, Hq, C))
            l_r.index_copy_(0, rows, lu)
        merge_lse_(o, lse, o_r, l_r)
    return o.to(q.dtype), lse


def multi_region_attention_bwd(dout, q, k, v, regions, key_mask, out, lse, params, positions=None):
    """Backward on ATen's fused CPU kernels: each region's FlashAttention-2 backward given the merged ``out`` and
    ``lse``, so the kernel's ``D = rowsum(dO ∘ O)`` and ``P = exp(S − L)`` are those of the whole attention (the keys
    of :func:`_entry_keys` per entry). Returns as ``attention_torch.multi_region_attention_bwd`` (dq fp32, the others
    in the inputs' dtype)."""
    _, bwd = aten_cpu_attention()
    B, Hq, C, d = q.shape
    Hkv = k.shape[1]
    feat, k_pos = score_features(params, positions)
    lse = torch.where(torch.isinf(lse), 0.0, lse).to(acc_dtype(q.dtype))  # no key: all P = exp(−inf) = 0
    dout = dout.contiguous()
    dq = torch.zeros(B, Hq, C, d, dtype=acc_dtype(q.dtype), device=q.device)
    dregions = []
    for i, (region_k, region_v, index, mask) in enumerate(regions):
        drk, drv = torch.zeros_like(region_k), torch.zeros_like(region_v)
        for u, rows in entry_groups(index, region_k.shape[0]):
            keys = _entry_keys(mask, u, rows, feat, k_pos and k_pos[i], Hq // Hkv, q.dtype)
            if keys is None:
                continue
            lo, hi, add, _ = keys
            n = rows.numel()
            fold = lambda x: fold_heads(x.index_select(0, rows), Hkv)[None]  # noqa: E731
            fold_l = fold_heads(lse.index_select(0, rows)[..., None], Hkv)[None, ..., 0]
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
            dq.index_add_(0, rows, unfold_heads(g[0][0].to(dq.dtype), n, Hq, C))
            drk[u, :, lo:hi], drv[u, :, lo:hi] = g[1][0], g[2][0]
        dregions.append((drk, drv))
    lengths = _prefix_lengths(key_mask, feat.sliding_window, B, C, Hq // Hkv, q.device)
    if lengths is not None:
        dq_own, dk, dv = _own_causal_bwd(bwd, dout, q, k, v, out, lse, lengths, params.scale)
        return dq + dq_own.to(dq.dtype), dk, dv, dregions
    q_own, mask_own, _ = own_layout(q, key_mask, Hkv, feat.sliding_window)
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

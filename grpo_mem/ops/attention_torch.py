"""The ``"torch"`` backend of multi-region attention: the regions of
:func:`grpo_mem.ops.attention.multi_region_attention` as chunked matmuls on any device, in fp32 (fp64 for fp64 inputs).

Forward: per shared region, the queries of every row reading an entry and the Hq/Hkv query heads of a kv head are
folded into one matrix against that entry's keys, read once (``_fold``); the own region is per-row causal; the partial
results merge by log-sum-exp (``_merge_``). Backward: FlashAttention-2's per region with the merged output and LSE.
Score matrices are cut into chunks of at most ``params.chunk_elems`` elements, so temporaries stay bounded. The cpu
backend (``attention_cpu``) reuses the folding, grouping, visibility and merge helpers here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["multi_region_attention_fwd", "multi_region_attention_bwd"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the torch path: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _window_visible(W, q_pos, k_pos):
    """Bool (..., c, S): ``0 <= q_pos[..., i] - k_pos[..., j] < W`` for q_pos (..., c), k_pos (..., S)."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    return (diff >= 0) & (diff < W)


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


def multi_region_attention_fwd(q, k, v, regions, key_mask, params, positions=None):
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


def multi_region_attention_bwd(dout, q, k, v, regions, key_mask, out, lse, params, positions=None):
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

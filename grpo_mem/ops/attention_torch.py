"""The ``"torch"`` backend of multi-region attention: the regions of
:func:`grpo_mem.ops.attention.multi_region_attention` as chunked matmuls on any device, in fp32 (fp64 for fp64 inputs).

Forward: per shared region, the queries of every row reading an entry and the Hq/Hkv query heads of a kv head are
folded into one matrix against that entry's keys, read once (``attention_cpu.fold_heads``); the own region is per-row
causal; the partial results merge by log-sum-exp (``attention_cpu.merge_lse_``). Backward: FlashAttention-2's per
region with the merged output and LSE. Score matrices are cut into chunks of at most ``params.chunk_elems`` elements,
so temporaries stay bounded. The folding, grouping, visibility and merge helpers are the cpu backend's
(``attention_cpu``), which a CPU call runs without this module.
"""

from __future__ import annotations

import torch

from .attention_cpu import (
    ScoreFeatures,
    acc_dtype,
    completion_visibility,
    entry_groups,
    fold_heads,
    merge_lse_,
    repeat_rows,
    score_features,
    sliding_window_visible,
    unfold_heads,
)

__all__ = ["multi_region_attention_fwd", "multi_region_attention_bwd", "reference_attention"]


def reference_attention(q, k, v, regions, positions, key_mask, scale, features):
    """The math of :func:`grpo_mem.ops.attention.multi_region_attention_ref` on validated inputs: every row's keys
    ``[regions' entries; own keys]`` materialised, kv heads repeated, one masked softmax, in the inputs' dtype.

    ``regions``: 4-tuples ``(region_k, region_v, index, mask)``; ``positions``: each region's (U_r, S_r) int64 key
    positions (None without a sliding window); ``features``: ``(sliding_window, sinks, softcap, q_positions)``.
    Returns (B, Hq, C, d) in q's dtype, differentiable through autograd.
    """
    B, Hq, C, d = q.shape
    rep = Hq // k.shape[1]
    W, sinks, softcap, q_pos = features
    keys, values, vis = [], [], []
    for (region_k, region_v, index, mask), pos in zip(regions, positions):
        safe = index.clamp(min=0)
        keys.append(region_k[safe])  # (B, Hkv, S_r, d)
        values.append(region_v[safe])
        vis.append((mask[safe] & (index >= 0)[:, None])[:, None, :].expand(B, C, -1))
        if W is not None:
            vis[-1] = vis[-1] & sliding_window_visible(W, q_pos, pos[safe])
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril().expand(B, C, C)
    vis.append(causal if key_mask is None else causal & key_mask[:, None, :])
    if W is not None:
        vis[-1] = vis[-1] & sliding_window_visible(W, q_pos, q_pos)
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
    with a sliding window (1, n·rep·c, S)."""
    if feat.sliding_window is None:
        return kmask
    W, q_pos = feat.sliding_window
    vis = sliding_window_visible(W, q_pos.index_select(0, rc)[:, c0:c1], k_pos[u]) & kmask
    return repeat_rows(vis, rep).reshape(1, -1, kmask.shape[0])


def _live_groups(index, mask, feat, k_pos):
    """:func:`entry_groups` of a region without the entries whose real keys all lie outside every reader's sliding
    window (those are never read)."""
    groups = entry_groups(index, mask.shape[0])
    if feat.sliding_window is None:
        return groups
    W, q_pos = feat.sliding_window
    return [
        (u, rows)
        for u, rows in groups
        if (sliding_window_visible(W, q_pos.index_select(0, rows), k_pos[u]) & mask[u]).any()
    ]


def _region_fwd(
    q, region_k, region_v, mask, groups, Hkv, scale, budget, o_acc, l_acc, feat=ScoreFeatures(), k_pos=None
):
    """Forward over one shared region. Writes the normalised region output into ``o_acc`` and its LSE into ``l_acc``
    at the rows of ``groups`` (see :func:`entry_groups`); other rows are left as they are. ``feat``: soft-capping and
    sliding window (``k_pos``: the region's (U, S) key positions)."""
    B, Hq, C, d = q.shape
    S = region_k.shape[2]
    acc = o_acc.dtype
    for u, rows in groups:
        ku = region_k[u].to(acc)  # (Hkv, S, d): at most one copy per entry, never per row
        vu = region_v[u].to(acc)
        kmask = mask[u]  # (S,)
        for rc, c0, c1 in _query_chunks(rows, Hq * S, C, budget):
            n, c = rc.numel(), c1 - c0
            qc = fold_heads(_take(q, rc, c0, c1).to(acc), Hkv)  # (Hkv, M, d)
            s = _scores(qc, ku, scale, feat.softcap)  # (Hkv, M, S)
            s.masked_fill_(~_region_visible(kmask, feat, k_pos, u, rc, c0, c1, Hq // Hkv), float("-inf"))
            lse = torch.logsumexp(s, dim=-1)  # (Hkv, M), -inf where no key visible
            s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
            o = torch.matmul(s, vu)  # (Hkv, M, d), normalised
            _put(o_acc, rc, c0, c1, unfold_heads(o, n, Hq, c))
            _put(l_acc, rc, c0, c1, unfold_heads(lse[..., None], n, Hq, c)[..., 0])


def _own_fwd(q, k, v, key_mask, Hkv, scale, budget, o_acc, l_acc, feat=ScoreFeatures()):
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
        s.masked_fill_(
            ~completion_visibility(rc, c0, c1, C, rep, key_mask, q.device, feat.sliding_window), float("-inf")
        )
        lse = torch.logsumexp(s, dim=-1)
        s.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()
        o = torch.matmul(s, vc)  # (n, Hkv, rep·c, d)
        _put(o_acc, rc, c0, c1, o.reshape(n, Hq, c, d))
        _put(l_acc, rc, c0, c1, lse.reshape(n, Hq, c))


def multi_region_attention_fwd(q, k, v, regions, key_mask, params, positions=None):
    """Torch forward: returns ``(out in q.dtype (B, Hq, C, d), lse (B, Hq, C))``, lse fp32 (fp64 for fp64 inputs).
    Temporaries: two (B, Hq, C, d) accumulators in that dtype and score chunks of ``params.chunk_elems``.
    ``positions``: ``(q_positions, (positions of each region))`` when ``params.sliding_window`` is set."""
    B, Hq, C, d = q.shape
    Hkv = k.shape[1]
    dev, acc = q.device, acc_dtype(q.dtype)
    o = torch.zeros(B, Hq, C, d, dtype=acc, device=dev)
    lse = torch.full((B, Hq, C), float("-inf"), dtype=acc, device=dev)
    feat, k_pos = score_features(params, positions)
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
        merge_lse_(o, lse, o_r, l_r)
    return o.to(q.dtype), lse


def _region_bwd(
    q, do, lse, delta, region_k, region_v, mask, groups, Hkv, scale, budget, dq, feat=ScoreFeatures(), k_pos=None
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
            qc = fold_heads(_take(q, rc, c0, c1).to(acc), Hkv)  # (Hkv, M, d)
            doc = fold_heads(_take(do, rc, c0, c1), Hkv)
            lc = fold_heads(_take(lse, rc, c0, c1)[..., None], Hkv)  # (Hkv, M, 1)
            dc = fold_heads(_take(delta, rc, c0, c1)[..., None], Hkv)
            p, t = _scores(qc, ku, scale, feat.softcap, keep_tanh=True)  # (Hkv, M, S)
            p.masked_fill_(~_region_visible(kmask, feat, k_pos, u, rc, c0, c1, Hq // Hkv), float("-inf"))
            p.sub_(lc).exp_()
            drv[u] += torch.matmul(p.transpose(1, 2), doc)
            ds = _dscores(torch.matmul(doc, vu.transpose(1, 2)), dc, p, t)
            del p, t
            _put(dq, rc, c0, c1, unfold_heads(torch.matmul(ds, ku), n, Hq, c).mul_(scale), accumulate=True)
            drk[u] += torch.matmul(ds.transpose(1, 2), qc).mul_(scale)
    return drk, drv


def _dscores(dp, delta, p, t):
    """Gradient of the scaled raw scores, in place in ``dp``: ``dS = P ∘ (dP − D)``, times ``1 − tanh²`` when
    soft-capped (``t`` the tanh, else None)."""
    ds = dp.sub_(delta).mul_(p)
    return ds if t is None else ds.mul_(1 - t.square_())


def _own_bwd(q, k, v, do, lse, delta, key_mask, Hkv, scale, budget, dq, feat=ScoreFeatures()):
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
        p.masked_fill_(~completion_visibility(rc, c0, c1, C, rep, key_mask, dev, feat.sliding_window), float("-inf"))
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
    acc = acc_dtype(q.dtype)
    do = dout.to(acc)
    delta = (do * out.to(acc)).sum(-1)  # (B, Hq, C): D = rowsum(dO ∘ O)
    lse_safe = torch.where(torch.isinf(lse), 0.0, lse)  # empty rows: every score is -inf, so P = 0 there
    dq = torch.zeros(B, Hq, C, d, dtype=acc, device=q.device)
    feat, k_pos = score_features(params, positions)
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

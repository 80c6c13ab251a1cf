"""Launchers of the multi-region attention kernels (``attention_triton``): they validate what only the kernels
need (dtype, int32 offsets), read every tensor in place, size the grids, chain the per-region launches and launch
each kernel on its tensors' device. The ``"triton"`` backend of :func:`grpo_mem.ops.attention.multi_region_attention`.
Tile sizes come from ``attention_triton_tiles``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import attention_triton as kernels
from ._device import launch_device
from .attention_triton_tiles import block_config, head_dim_tiles

__all__ = ["multi_region_attention_fwd", "multi_region_attention_bwd", "region_dkdv_grid"]

# The region dK/dV work is split until the grid has this many programs per SM (see region_dkdv_grid).
_PROGRAMS_PER_SM = 2


# SM count assumed for CPU tensors (Triton's interpreter): an H100 SXM's, so the interpreter runs the split GPUs run.
_DEFAULT_SM_COUNT = 132


_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_I32_MAX = 2**31 - 1


_GRID_YZ_MAX = 65535  # CUDA's limit on a launch grid's y and z dimensions


def region_dkdv_grid(
    B: int,
    U: int,
    Hkv: int,
    rep: int,
    C: int,
    P: int,
    head_dim: int,
    dtype: torch.dtype,
    sm_count: int,
    capability: tuple[int, int] | None = None,
) -> tuple[int, int, int]:
    """Launch grid ``(key blocks, U·Hkv, splits)`` of the region dK/dV kernel for a region of U entries of P keys.

    One (key block, prompt, kv head) alone gives cdiv(P, BLOCK_N)·U·Hkv programs — 16 for a Qwen2.5-1.5B layer
    (Hkv=2, P=512, one prompt) on a 132-SM H100 — each looping over every (row, query head, query block) of the group.
    That loop is cut into ``splits`` contiguous ranges, as many as needed for ``_PROGRAMS_PER_SM`` programs per SM
    (never more than the average work items of a prompt). Each range's fp32 sum goes to its own slice of a partial
    buffer, reduced in slice order: deterministic, no atomics. The buffer holds 2·splits·U·Hkv·P·d fp32 values, under
    2·(2·_PROGRAMS_PER_SM·sm_count)·BLOCK_N·d values whenever splits > 1 (35 MB for 132 SMs at d=128).
    ``capability``: the GPU's ``(major, minor)`` compute capability, whose tiles (``block_config``) the grid follows;
    None for the interpreter's.
    """
    cfg = block_config("bwd_dkdv_region", head_dim, dtype, capability=capability)
    n_blocks = triton.cdiv(P, cfg["BLOCK_N"])
    base = n_blocks * U * Hkv
    if base == 0 or B == 0:
        return (n_blocks, U * Hkv, 1)
    items = triton.cdiv(B, U) * rep * triton.cdiv(C, cfg["BLOCK_M"])  # work items of an average prompt
    splits = max(1, min(triton.cdiv(_PROGRAMS_PER_SM * sm_count, base), items))
    return (n_blocks, U * Hkv, splits)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a cached property, no synchronisation); an H100's otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SM_COUNT


def _capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability ``(major, minor)`` of a CUDA device (cached by torch, no synchronisation), which picks the
    tiles (``block_config``); None for any other device (the interpreter's tiles)."""
    if device.type == "cuda":
        return tuple(torch.cuda.get_device_capability(device))
    return None


def _check_grid_rows(n: int, heads: int, what: str):
    """Raise ValueError if ``n``·``heads`` programs, one per (batch entry or prompt, head), exceed the 65535 CUDA allows
    on a grid's y axis, where the kernels put them (``what`` names ``n`` and the heads in the message)."""
    if n * heads > _GRID_YZ_MAX:
        raise ValueError(
            f"the Triton attention kernels launch one program row per {what}: {n}·{heads} = {n * heads} rows, over "
            f"CUDA's grid limit of {_GRID_YZ_MAX} on axis y; score at most {_GRID_YZ_MAX // heads} at a time "
            "(smaller micro-batches), or use backend='torch'"
        )


def _launch(name, grid, args, head_dim, dtype, interpret, capability=None, **constexprs):
    """Launch kernel ``name`` on the device of its first tensor argument (Triton launches on the current device) with
    the tiles of ``capability`` (see ``block_config``)."""
    if 0 in grid:
        return
    cfg = block_config(
        name,
        head_dim,
        dtype,
        constexprs.get("SOFTCAP", 0.0) > 0,
        constexprs.get("HAS_WINDOW", False),
        capability,
    )
    opts = {} if interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    with launch_device(args[0]):
        kernels.KERNELS[name][grid](*args, **constexprs, **opts)


def _tile_constexprs(name, head_dim, dtype, interpret, softcap=False, window=False, capability=None) -> dict:
    """HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_M, BLOCK_N and EMULATE_BF16 of the attention kernels (``softcap``,
    ``window``: of the soft-capped, windowed build; ``capability``: the GPU's, see ``block_config``)."""
    cfg = block_config(name, head_dim, dtype, softcap, window, capability)
    # Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits and truncates fp32 -> bf16 casts;
    # EMULATE_BF16 gives its dots fp32 copies (exact: products of bf16 values are exact in fp32, and the compiled
    # kernels accumulate in fp32 too) and rounds to nearest-even bf16 wherever the GPU build rounds.
    block_d0, block_d1 = head_dim_tiles(head_dim)
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_D0=block_d0,
        BLOCK_D1=block_d1,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        EMULATE_BF16=interpret and dtype == torch.bfloat16,
    )


def _softcap(params) -> float:
    """The kernels' SOFTCAP constexpr: ``params.softcap``, or 0.0 for none (a constexpr, so a Python float never
    reaches the kernel as a runtime argument, and the uncapped build is the one without it)."""
    return 0.0 if params.softcap is None else float(params.softcap)


def _kernel_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: any strides, except that the last (head-dim) stride must be 1.

    transformers' q/k/v (``(B, C, H, d)`` projections transposed to ``(B, H, C, d)``) and autograd's output gradients
    already have it, so they are read in place; anything else (e.g. a gradient expanded from a scalar) is copied once.
    """
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _check_offsets(**tensors):
    """The kernels compute the batch / prompt part of an offset in int64 and the rest (head, position, head-dim index,
    within one batch entry) in int32: raise ValueError if that rest can pass 2**31 − 1 elements."""
    for name, x in tensors.items():
        span = sum((n - 1) * st for n, st in zip(x.shape[1:], x.stride()[1:]))
        if x.numel() and span > _I32_MAX:
            raise ValueError(
                f"{name} spans {span} elements within one batch entry (shape {tuple(x.shape)}, strides "
                f"{x.stride()}); the Triton kernels need < 2**31"
            )


def _check_dtype(q):
    """Raise ValueError unless ``q`` is fp16, bf16 or fp32."""
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"the Triton attention kernels take fp16, bf16 or fp32 inputs, got {q.dtype} (fp64: use backend='torch')"
        )


def _padded(n: int) -> int:
    """``n`` rounded up to a multiple of 16: the row length of the LSE / D buffers and of the folded query index, so
    the kernels' address arithmetic sees a multiple of 16 (Triton then vectorises and keeps fewer per-element
    offsets; with an arbitrary completion length it spilled at d=256)."""
    return (n + 15) // 16 * 16


def _region_span(mask):
    """``(U, 2)`` int32: first real key of each entry and one past its last (``(S, 0)`` for an entry with none). Key
    tiles wholly outside the span (left or right padding) are skipped. No host synchronisation."""
    U, S = mask.shape
    if S == 0:
        return torch.zeros(U, 2, dtype=torch.int32, device=mask.device)
    pos = torch.arange(S, device=mask.device, dtype=torch.int32)
    # weight key j by S − j: the largest weight among real keys marks the first one; by j + 1: the last one
    start = S - (mask * (S - pos)).amax(dim=1)
    end = (mask * (pos + 1)).amax(dim=1)
    return torch.stack([start, end], dim=1).to(torch.int32)


def _region_rows(index, U):
    """Rows grouped by the entry they read (ascending row index within an entry; rows with index −1 are left out),
    int32 (B,), and CSR offsets int32 (U + 1,): entry u's rows are ``rows[row_start[u]:row_start[u + 1]]``. Sort and
    binary search: no host synchronisation (``bincount`` would read the maximum back to size its output)."""
    sorted_index, rows = torch.sort(index, stable=True)
    bounds = torch.arange(U + 1, device=index.device, dtype=index.dtype)
    row_start = torch.searchsorted(sorted_index, bounds, out_int32=True)  # the −1 rows sort first, before row_start[0]
    return rows.to(torch.int32), row_start


def _region_args(regions, q, positions=None):
    """Per launch, the region tensors ``(region_k, region_v, index, span, mask, key positions)`` with
    ``region_k``/``region_v`` as the kernels read them; with no region, one launch with placeholders (unread:
    HAS_REGION=False). ``positions``: ``(q_positions, region positions)`` with a window, else None (the key positions
    are then the index tensor, unread: HAS_WINDOW=False)."""
    if not regions:
        i64, i32 = (torch.zeros(2, dtype=t, device=q.device) for t in (torch.int64, torch.int32))
        return [(q, q, i64, i32, torch.zeros(1, 1, dtype=torch.bool, device=q.device), i64)]
    k_pos = [None] * len(regions) if positions is None else positions[1]
    return [
        (
            _kernel_view(rk),
            _kernel_view(rv),
            index,
            _region_span(mask),
            mask.contiguous(),
            index if pos is None else pos.contiguous(),
        )
        for (rk, rv, index, mask), pos in zip(regions, k_pos)
    ]


def _window_args(positions, params, q):
    """``(q_positions as the kernels read them, WINDOW, HAS_WINDOW)``: the (B, C) int64 positions (contiguous), the
    window and True with ``params.sliding_window``; a placeholder, 0 and False without."""
    if params.sliding_window is None:
        return torch.zeros(2, dtype=torch.int64, device=q.device), 0, False
    return positions[0].contiguous(), int(params.sliding_window), True


def _named_regions(regions, args):
    """``{"regions[i].region_k": tensor, "regions[i].region_v": tensor}`` of ``_region_args``' output, for
    ``_check_offsets``' messages (empty without regions)."""
    if not regions:
        return {}
    named = {f"regions[{i}].region_k": a[0] for i, a in enumerate(args)}
    named.update({f"regions[{i}].region_v": a[1] for i, a in enumerate(args)})
    return named


def _launch_plan(regions):
    """(HAS_REGION, HAS_OWN, HAS_PREV) of each launch of the forward and dQ kernels: regions 0 … R−2 alone (rows
    reading none of a region do nothing there), then region R−1 with the own region, which writes the result."""
    R = len(regions)
    if R == 0:
        return [(False, True, False)]
    return [(True, i == R - 1, i > 0) for i in range(R)]


@dataclass(frozen=True)
class _Call:
    """What every launch of one forward or backward shares: the tile key (head dim, dtype, interpreter, the GPU's
    compute capability), the shape constants, the scale and soft-cap, the own-key mask and the window (placeholders,
    unread, when absent)."""

    head_dim: int
    dtype: torch.dtype
    interpret: bool
    capability: tuple[int, int] | None
    rep: int
    Hkv: int
    C: int
    c_pad: int
    scale: float
    softcap: float
    kmask: torch.Tensor
    has_kmask: bool
    q_pos: torch.Tensor
    window: int
    has_window: bool

    def tiles(self, name: str) -> dict:
        """:func:`_tile_constexprs` of kernel ``name`` in this call's build."""
        return _tile_constexprs(
            name, self.head_dim, self.dtype, self.interpret, self.softcap > 0, self.has_window, self.capability
        )

    def region_constexprs(self, flags) -> dict:
        """The constexprs of a forward or dQ launch over one region: ``flags`` (HAS_REGION, HAS_OWN, HAS_PREV) and
        this call's head repetition, own-key mask, soft-cap and window."""
        has_region, has_own, has_prev = flags
        return dict(
            REP=self.rep,
            HAS_KMASK=self.has_kmask,
            HAS_REGION=has_region,
            HAS_OWN=has_own,
            HAS_PREV=has_prev,
            SOFTCAP=self.softcap,
            HAS_WINDOW=self.has_window,
        )

    def launch(self, name, grid, args, **constexprs):
        """:func:`_launch` of kernel ``name`` for this call's head dim and dtype."""
        _launch(name, grid, args, self.head_dim, self.dtype, self.interpret, self.capability, **constexprs)


def _call(q, k, key_mask, params, positions, args) -> _Call:
    """The :class:`_Call` of kernel-view ``q`` (B, Hq, C, d) and ``k``; ``args``: ``_region_args``' output (its first
    mask stands in for an absent ``key_mask``)."""
    _, Hq, C, d = q.shape
    Hkv = k.shape[1]
    q_pos, window, has_window = _window_args(positions, params, q)
    kmask = key_mask.contiguous() if key_mask is not None else args[0][4]  # unread when HAS_KMASK=False
    return _Call(
        d,
        q.dtype,
        q.device.type == "cpu",
        _capability(q.device),
        Hq // Hkv,
        Hkv,
        C,
        _padded(C),
        float(params.scale),
        _softcap(params),
        kmask,
        key_mask is not None,
        q_pos,
        window,
        has_window,
    )


def _running(x: torch.Tensor) -> torch.Tensor:
    """The running result between the launches of ``_launch_plan``: fp32 with ``x``'s shape and strides (the kernels
    read PREV with the strides of their output)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=torch.float32, device=x.device)


def multi_region_attention_fwd(q, k, v, regions, key_mask, params, positions=None):
    """Launch the forward kernel, once per region (see ``_launch_plan``). Shapes as
    :func:`grpo_mem.ops.attention.multi_region_attention` (validated there); ``params.scale`` is the softmax scale
    (``params`` a ``MultiRegionAttentionParams``; ``params.softcap``, if set, soft-caps the scaled scores in the
    kernels; ``params.sliding_window``, if set, applies the window to ``positions = (q_positions (B, C) int64,
    (U_r, S_r) int64 key positions per region)`` in the kernels, skipping key tiles no query of a block can reach).

    Tensors are read in place with their strides (only the head-dim stride must be 1; see ``_kernel_view``), and no
    value is read back to the host. With two regions or more, the partial result between launches is a normalised
    fp32 (B, Hq, C, d) buffer (the running output) and the LSE buffer; one region or none needs neither.
    Returns ``(out, lse)``: out (B, Hq, C, d) in q's dtype, with q's strides when q is dense (transformers' transposed
    layout, so ``out.transpose(1, 2)`` is contiguous); lse (B, Hq, C) fp32, a view of a (B, Hq, C rounded up to 16)
    buffer, the natural-log log-sum-exp of the scaled scores over all visible keys (−inf for a query with none).
    Raises ValueError for fp64 inputs, strides too large for int32 offsets within one batch entry, or more than 65535
    (batch entry, kv head) pairs (CUDA's grid limit on the axis they are launched on).
    """
    _check_dtype(q)
    q, k, v = (_kernel_view(x) for x in (q, k, v))
    B, Hq, C, d = q.shape
    out = _kernel_view(torch.empty_like(q))
    c_pad = _padded(C)
    plan = _launch_plan(regions)
    if len(plan) > 1:  # a row reading none of the first regions keeps LSE −inf until the last launch
        lse = torch.full((B, Hq, c_pad), float("-inf"), dtype=torch.float32, device=q.device)[..., :C]
    else:
        lse = torch.empty(B, Hq, c_pad, dtype=torch.float32, device=q.device)[..., :C]
    if B == 0 or C == 0:
        return out, lse
    _check_grid_rows(B, k.shape[1], "(batch entry, kv head)")
    args = _region_args(regions, q, positions)
    _check_offsets(q=q, k=k, v=v, out=out, **_named_regions(regions, args))
    call = _call(q, k, key_mask, params, positions, args)
    partial = _running(out) if len(plan) > 1 else out
    for region, flags in zip(args, plan):
        _fwd_launch(call, q, k, v, region, flags, out if flags[1] else partial, lse, partial)
    return out, lse


def _fwd_launch(call, q, k, v, region, flags, dst, lse, partial):
    """One launch of the forward kernel: ``region`` an entry of ``_region_args``, ``flags`` (HAS_REGION, HAS_OWN,
    HAS_PREV) its entry of ``_launch_plan``; writes ``dst`` (the output, or the running result) and ``lse``."""
    rk, rv, index, span, mask, k_pos = region
    has_region, has_own, has_prev = flags
    meta = call.tiles("fwd")
    call.launch(
        "fwd",
        (triton.cdiv(call.rep * call.c_pad, meta["BLOCK_M"]), q.shape[0] * call.Hkv),
        (
            q,
            k,
            v,
            rk,
            rv,
            index,
            span,
            mask,
            call.kmask,
            call.q_pos,
            k_pos,
            dst,
            lse,
            partial,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *rk.stride()[:3],
            *rv.stride()[:3],
            *dst.stride()[:3],
            call.scale,
            call.C,
            call.c_pad,
            rk.shape[2],
            call.Hkv,
            call.window,
        ),
        **call.region_constexprs(flags),
        **meta,
    )


def multi_region_attention_bwd(dout, q, k, v, regions, key_mask, out, lse, params, positions=None):
    """Launch the backward kernels. ``out``/``lse`` are the forward's results, ``dout`` is (B, Hq, C, d); ``positions``
    as :func:`multi_region_attention_fwd`.

    Returns ``(dq, dk, dv, [(dregion_k, dregion_v) per region])`` in the dtypes of q, k, v and each region's K/V (fp32
    accumulation); dq/dk/dv have the strides of q/k/v when those are dense, the region gradients are contiguous.
    ``D = rowsum(dO ∘ O)`` is computed in fp32 by a small kernel into a (B, Hq, C) tensor; dQ is accumulated over the
    launches of ``_launch_plan`` (with two regions or more, in an fp32 (B, Hq, C, d) buffer). No value is read back
    to the host and no input is copied (see ``_kernel_view``). Raises ValueError as
    :func:`multi_region_attention_fwd`, and for more than 65535 (batch entry, query head) pairs or (region entry, kv
    head) pairs.
    """
    _check_dtype(q)
    q, k, v, out, dout = (_kernel_view(x) for x in (q, k, v, out, dout))
    B, Hq, C, d = q.shape
    dq, dk, dv = (_kernel_view(torch.empty_like(x)) for x in (q, k, v))
    if B == 0 or C == 0:
        zeros = [tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in r[:2]) for r in regions]
        return dq.zero_(), dk.zero_(), dv.zero_(), zeros
    _check_grid_rows(B, Hq, "(batch entry, query head)")  # the delta kernel's; the others have B·Hkv <= B·Hq
    for r in regions:
        _check_grid_rows(r[0].shape[0], r[0].shape[1], "(region entry, kv head)")
    args = _region_args(regions, q, positions)
    _check_offsets(q=q, k=k, v=v, out=out, dout=dout, dq=dq, dk=dk, dv=dv, **_named_regions(regions, args))
    call = _call(q, k, key_mask, params, positions, args)
    if lse.stride() != (Hq * call.c_pad, call.c_pad, 1):  # not the forward's padded buffer: copy into one
        lse = torch.empty(B, Hq, call.c_pad, dtype=torch.float32, device=q.device)[..., :C].copy_(lse)
    delta = _bwd_delta(call, out, dout)
    plan = _launch_plan(regions)
    # rows reading none of the first regions are not written before the last launch: the running dQ starts at zero
    partial = _running(dq).zero_() if len(plan) > 1 else dq
    for region, flags in zip(args, plan):
        _dq_launch(call, (q, k, v, dout, lse, delta), region, flags, dq if flags[1] else partial, partial)
    _dkdv_own_launch(call, (q, k, v, dout, lse, delta), dk, dv)
    dregions = [_region_dkdv(call, (q, dout, lse, delta), region) for region in (args if regions else [])]
    return dq, dk, dv, dregions


def _bwd_delta(call, out, dout):
    """``D = rowsum(dO ∘ O)`` in fp32, (B, Hq, C) in a buffer of rows padded to ``call.c_pad``."""
    B, Hq = out.shape[:2]
    delta = torch.empty(B, Hq, call.c_pad, dtype=torch.float32, device=out.device)
    meta = call.tiles("bwd_delta")
    call.launch(
        "bwd_delta",
        (triton.cdiv(call.C, meta["BLOCK_M"]), B * Hq),
        (out, dout, delta, *out.stride()[:3], *dout.stride()[:3], call.C, call.c_pad, Hq),
        HEAD_DIM=call.head_dim,
        BLOCK_D0=meta["BLOCK_D0"],
        BLOCK_D1=meta["BLOCK_D1"],
        BLOCK_M=meta["BLOCK_M"],
    )
    return delta


def _dq_launch(call, grads_in, region, flags, dst, partial):
    """One launch of the dQ kernel (``region`` and ``flags`` as in :func:`_fwd_launch`): ``grads_in`` is
    ``(q, k, v, dout, lse, delta)``; adds to the running ``partial`` or writes ``dst``."""
    q, k, v, dout, lse, delta = grads_in
    rk, rv, index, span, mask, k_pos = region
    has_region, has_own, has_prev = flags
    meta = call.tiles("bwd_dq")
    call.launch(
        "bwd_dq",
        (triton.cdiv(call.rep * call.c_pad, meta["BLOCK_M"]), q.shape[0] * call.Hkv),
        (
            q,
            k,
            v,
            rk,
            rv,
            index,
            span,
            mask,
            call.kmask,
            call.q_pos,
            k_pos,
            dout,
            lse,
            delta,
            dst,
            partial,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *rk.stride()[:3],
            *rv.stride()[:3],
            *dout.stride()[:3],
            *dst.stride()[:3],
            call.scale,
            call.C,
            call.c_pad,
            rk.shape[2],
            call.Hkv,
            call.window,
        ),
        **call.region_constexprs(flags),
        **meta,
    )


def _dkdv_own_launch(call, grads_in, dk, dv):
    """dK/dV of the rows' own keys into ``dk``, ``dv`` (``grads_in`` as in :func:`_dq_launch`)."""
    q, k, v, dout, lse, delta = grads_in
    meta = call.tiles("bwd_dkdv_own")
    call.launch(
        "bwd_dkdv_own",
        (triton.cdiv(call.C, meta["BLOCK_N"]), q.shape[0] * call.Hkv),
        (
            q,
            k,
            v,
            call.kmask,
            call.q_pos,
            dout,
            lse,
            delta,
            dk,
            dv,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *dout.stride()[:3],
            *dk.stride()[:3],
            *dv.stride()[:3],
            call.scale,
            call.C,
            call.c_pad,
            call.Hkv,
            call.window,
        ),
        REP=call.rep,
        HAS_KMASK=call.has_kmask,
        SOFTCAP=call.softcap,
        HAS_WINDOW=call.has_window,
        **meta,
    )


def _region_dkdv(call, grads_in, region):
    """dK/dV of one shared region (``region`` an entry of ``_region_args``; ``grads_in`` is ``(q, dout, lse,
    delta)``): the region kernel over each entry's rows, its work split for a full GPU (see ``region_dkdv_grid``) and
    the fp32 partial sums reduced in a fixed order. Returns ``(dregion_k, dregion_v)`` contiguous, in the region's
    dtype; entries no row reads get 0."""
    q = grads_in[0]
    region_k, region_v, index = region[:3]
    U, Hkv, S, d = region_k.shape
    drk, drv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (region_k, region_v))
    grid = region_dkdv_grid(q.shape[0], U, Hkv, call.rep, call.C, S, d, q.dtype, _sm_count(q.device), call.capability)
    n_split, n_elems = grid[2], U * Hkv * S * d
    if n_split == 1:
        part_k, part_v = drk, drv
    else:
        part_k, part_v = (torch.empty((n_split, U, Hkv, S, d), dtype=torch.float32, device=q.device) for _ in "kv")
    _dkdv_region_launch(call, grads_in, region, _region_rows(index, U), grid, (part_k, part_v))
    if n_split > 1:
        block = block_config("bwd_region_reduce", d, q.dtype, capability=call.capability)["BLOCK_M"]
        call.launch(
            "bwd_region_reduce",
            (triton.cdiv(n_elems, block),),
            (part_k, part_v, drk, drv, n_elems, n_split),
            BLOCK=block,
            EMULATE_BF16=call.tiles("bwd_dkdv_region")["EMULATE_BF16"],
        )
    return drk, drv


def _dkdv_region_launch(call, grads_in, region, rows, grid, parts):
    """The region dK/dV kernel over ``grid`` (``region_dkdv_grid``), writing the gradients (one split) or each split's
    fp32 partial sums into ``parts``; ``rows``: ``_region_rows``' rows by entry and their CSR offsets."""
    q, dout, lse, delta = grads_in
    region_k, region_v, _, span, mask, k_pos = region
    U, Hkv, S, d = region_k.shape
    part_k, part_v = parts
    call.launch(
        "bwd_dkdv_region",
        grid,
        (
            q,
            region_k,
            region_v,
            *rows,
            span,
            mask,
            call.q_pos,
            k_pos,
            dout,
            lse,
            delta,
            part_k,
            part_v,
            *q.stride()[:3],
            *region_k.stride()[:3],
            *region_v.stride()[:3],
            *dout.stride()[:3],
            call.scale,
            call.C,
            call.c_pad,
            S,
            Hkv,
            grid[2],
            U * Hkv * S * d,
            call.window,
        ),
        REP=call.rep,
        SOFTCAP=call.softcap,
        HAS_WINDOW=call.has_window,
        **call.tiles("bwd_dkdv_region"),
    )

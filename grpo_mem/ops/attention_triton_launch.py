"""Launchers of the multi-region attention kernels (``attention_triton``): they size the grids, chain the
per-region launches and launch each kernel on its tensors' device with the tiles of its GPU. The ``"triton"`` backend
of :func:`grpo_mem.ops.attention.multi_region_attention`. What they check and build before a launch (dtype, int32
offsets, grid rows, the inputs as the kernels read them, the per-region arguments, the launch plan) is in
``attention_triton_inputs``; the tile sizes are in ``attention_triton_tiles``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import attention_triton as kernels
from ._device import launch_device
from .attention_triton_inputs import (
    check_dtype,
    check_grid_rows,
    check_offsets,
    kernel_view,
    launch_plan,
    named_regions,
    padded,
    region_args,
    region_rows,
    running,
    sliding_window_args,
)
from .attention_triton_tiles import block_config, head_dim_tiles

__all__ = ["multi_region_attention_fwd", "multi_region_attention_bwd", "region_dkdv_grid"]

# The region dK/dV work is split until the grid has this many programs per SM (see region_dkdv_grid).
_PROGRAMS_PER_SM = 2


# SM count assumed for CPU tensors (Triton's interpreter): an H100 SXM's, so the interpreter runs the split GPUs run.
_DEFAULT_SM_COUNT = 132


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
        constexprs.get("HAS_SLIDING_WINDOW", False),
        capability,
    )
    opts = {} if interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    with launch_device(args[0]):
        kernels.KERNELS[name][grid](*args, **constexprs, **opts)


def _tile_constexprs(name, head_dim, dtype, interpret, softcap=False, sliding_window=False, capability=None) -> dict:
    """HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_M, BLOCK_N and EMULATE_BF16 of the attention kernels (``softcap``,
    ``sliding_window``: of the soft-capped, sliding-window build; ``capability``: the GPU's, see ``block_config``)."""
    cfg = block_config(name, head_dim, dtype, softcap, sliding_window, capability)
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


@dataclass(frozen=True)
class _Call:
    """What every launch of one forward or backward shares: the tile key (head dim, dtype, interpreter, the GPU's
    compute capability), the shape constants, the scale and soft-cap, the own-key mask and the sliding window
    (placeholders, unread, when absent)."""

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
    sliding_window: int
    has_sliding_window: bool

    def tiles(self, name: str) -> dict:
        """:func:`_tile_constexprs` of kernel ``name`` in this call's build."""
        return _tile_constexprs(
            name, self.head_dim, self.dtype, self.interpret, self.softcap > 0, self.has_sliding_window, self.capability
        )

    def region_constexprs(self, flags) -> dict:
        """The constexprs of a forward or dQ launch over one region: ``flags`` (HAS_REGION, HAS_OWN, HAS_PREV) and
        this call's head repetition, own-key mask, soft-cap and sliding window."""
        has_region, has_own, has_prev = flags
        return dict(
            REP=self.rep,
            HAS_KMASK=self.has_kmask,
            HAS_REGION=has_region,
            HAS_OWN=has_own,
            HAS_PREV=has_prev,
            SOFTCAP=self.softcap,
            HAS_SLIDING_WINDOW=self.has_sliding_window,
        )

    def launch(self, name, grid, args, **constexprs):
        """:func:`_launch` of kernel ``name`` for this call's head dim and dtype."""
        _launch(name, grid, args, self.head_dim, self.dtype, self.interpret, self.capability, **constexprs)


def _call(q, k, key_mask, params, positions, args) -> _Call:
    """The :class:`_Call` of kernel-view ``q`` (B, Hq, C, d) and ``k``; ``args``: ``region_args``' output (its first
    mask stands in for an absent ``key_mask``)."""
    _, Hq, C, d = q.shape
    Hkv = k.shape[1]
    q_pos, sliding_window, has_sliding_window = sliding_window_args(positions, params, q)
    kmask = key_mask.contiguous() if key_mask is not None else args[0][4]  # unread when HAS_KMASK=False
    return _Call(
        d,
        q.dtype,
        q.device.type == "cpu",
        _capability(q.device),
        Hq // Hkv,
        Hkv,
        C,
        padded(C),
        float(params.scale),
        _softcap(params),
        kmask,
        key_mask is not None,
        q_pos,
        sliding_window,
        has_sliding_window,
    )


def multi_region_attention_fwd(q, k, v, regions, key_mask, params, positions=None):
    """Launch the forward kernel, once per region (see ``attention_triton_inputs.launch_plan``). Shapes as
    :func:`grpo_mem.ops.attention.multi_region_attention` (validated there); ``params.scale`` is the softmax scale
    (``params`` a ``MultiRegionAttentionParams``; ``params.softcap``, if set, soft-caps the scaled scores in the
    kernels; ``params.sliding_window``, if set, applies the window to ``positions = (q_positions (B, C) int64,
    (U_r, S_r) int64 key positions per region)`` in the kernels, skipping key tiles no query of a block can reach).

    Tensors are read in place with their strides (only the head-dim stride must be 1; see ``kernel_view``), and no
    value is read back to the host. With two regions or more, the partial result between launches is a normalised
    fp32 (B, Hq, C, d) buffer (the running output) and the LSE buffer; one region or none needs neither.
    Returns ``(out, lse)``: out (B, Hq, C, d) in q's dtype, with q's strides when q is dense (transformers' transposed
    layout, so ``out.transpose(1, 2)`` is contiguous); lse (B, Hq, C) fp32, a view of a (B, Hq, C rounded up to 16)
    buffer, the natural-log log-sum-exp of the scaled scores over all visible keys (−inf for a query with none).
    Raises ValueError for fp64 inputs, strides too large for int32 offsets within one batch entry, or more than 65535
    (batch entry, kv head) pairs (CUDA's grid limit on the axis they are launched on).
    """
    check_dtype(q)
    q, k, v = (kernel_view(x) for x in (q, k, v))
    B, Hq, C, _ = q.shape
    out = kernel_view(torch.empty_like(q))
    c_pad = padded(C)
    plan = launch_plan(regions)
    if len(plan) > 1:  # a row reading none of the first regions keeps LSE −inf until the last launch
        lse = torch.full((B, Hq, c_pad), float("-inf"), dtype=torch.float32, device=q.device)[..., :C]
    else:
        lse = torch.empty(B, Hq, c_pad, dtype=torch.float32, device=q.device)[..., :C]
    if B == 0 or C == 0:
        return out, lse
    check_grid_rows(B, k.shape[1], "(batch entry, kv head)")
    args = region_args(regions, q, positions)
    check_offsets(q=q, k=k, v=v, out=out, **named_regions(regions, args))
    call = _call(q, k, key_mask, params, positions, args)
    partial = running(out) if len(plan) > 1 else out
    for region, flags in zip(args, plan):
        dst = out if flags[1] else partial  # the last launch writes the output, the others the running result
        _region_launch(call, "fwd", (q, k, v), region, flags, (dst, lse, partial), (dst,))
    return out, lse


def _region_launch(call, name, qkv, region, flags, tensors, strided):
    """One launch of the forward or dQ kernel ``name`` over one region: ``qkv`` is ``(q, k, v)``, ``region`` an entry
    of ``region_args``, ``flags`` (HAS_REGION, HAS_OWN, HAS_PREV) its entry of ``launch_plan``. ``tensors``: the
    kernel's tensor arguments after the key positions (forward: the destination, lse, the running result; dQ: dout,
    lse, delta, the destination, the running result); ``strided``: those whose (batch, head, position) strides follow
    q's, k's, v's and the region's (forward: the destination; dQ: dout, the destination)."""
    q, k, v = qkv
    rk, rv, index, span, mask, k_pos = region
    meta = call.tiles(name)
    strides = [st for x in (q, k, v, rk, rv, *strided) for st in x.stride()[:3]]
    call.launch(
        name,
        (triton.cdiv(call.rep * call.c_pad, meta["BLOCK_M"]), q.shape[0] * call.Hkv),
        (q, k, v, rk, rv, index, span, mask, call.kmask, call.q_pos, k_pos, *tensors, *strides)
        + (call.scale, call.C, call.c_pad, rk.shape[2], call.Hkv, call.sliding_window),
        **call.region_constexprs(flags),
        **meta,
    )


def multi_region_attention_bwd(dout, q, k, v, regions, key_mask, out, lse, params, positions=None):
    """Launch the backward kernels. ``out``/``lse`` are the forward's results, ``dout`` is (B, Hq, C, d); ``positions``
    as :func:`multi_region_attention_fwd`.

    Returns ``(dq, dk, dv, [(dregion_k, dregion_v) per region])`` in the dtypes of q, k, v and each region's K/V (fp32
    accumulation); dq/dk/dv have the strides of q/k/v when those are dense, the region gradients are contiguous.
    ``D = rowsum(dO ∘ O)`` is computed in fp32 by a small kernel into a (B, Hq, C) tensor; dQ is accumulated over the
    launches of ``launch_plan`` (with two regions or more, in an fp32 (B, Hq, C, d) buffer). No value is read back
    to the host and no input is copied (see ``kernel_view``). Raises ValueError as
    :func:`multi_region_attention_fwd`, and for more than 65535 (batch entry, query head) pairs or (region entry, kv
    head) pairs.
    """
    check_dtype(q)
    q, k, v, out, dout = (kernel_view(x) for x in (q, k, v, out, dout))
    B, Hq, C, _ = q.shape
    dq, dk, dv = (kernel_view(torch.empty_like(x)) for x in (q, k, v))
    if B == 0 or C == 0:
        zeros = [tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in r[:2]) for r in regions]
        return dq.zero_(), dk.zero_(), dv.zero_(), zeros
    check_grid_rows(B, Hq, "(batch entry, query head)")  # the delta kernel's; the others have B·Hkv <= B·Hq
    for r in regions:
        check_grid_rows(r[0].shape[0], r[0].shape[1], "(region entry, kv head)")
    args = region_args(regions, q, positions)
    check_offsets(q=q, k=k, v=v, out=out, dout=dout, dq=dq, dk=dk, dv=dv, **named_regions(regions, args))
    call = _call(q, k, key_mask, params, positions, args)
    if lse.stride() != (Hq * call.c_pad, call.c_pad, 1):  # not the forward's padded buffer: copy into one
        lse = torch.empty(B, Hq, call.c_pad, dtype=torch.float32, device=q.device)[..., :C].copy_(lse)
    delta = _bwd_delta(call, out, dout)
    plan = launch_plan(regions)
    # rows reading none of the first regions are not written before the last launch: the running dQ starts at zero
    partial = running(dq).zero_() if len(plan) > 1 else dq
    for region, flags in zip(args, plan):
        dst = dq if flags[1] else partial
        _region_launch(call, "bwd_dq", (q, k, v), region, flags, (dout, lse, delta, dst, partial), (dout, dst))
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


def _dkdv_own_launch(call, grads_in, dk, dv):
    """dK/dV of the rows' own keys into ``dk``, ``dv`` (``grads_in`` is ``(q, k, v, dout, lse, delta)``)."""
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
            call.sliding_window,
        ),
        REP=call.rep,
        HAS_KMASK=call.has_kmask,
        SOFTCAP=call.softcap,
        HAS_SLIDING_WINDOW=call.has_sliding_window,
        **meta,
    )


def _region_dkdv(call, grads_in, region):
    """dK/dV of one shared region (``region`` an entry of ``region_args``; ``grads_in`` is ``(q, dout, lse,
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
    _dkdv_region_launch(call, grads_in, region, region_rows(index, U), grid, (part_k, part_v))
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
    fp32 partial sums into ``parts``; ``rows``: ``region_rows``' rows by entry and their CSR offsets."""
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
            call.sliding_window,
        ),
        REP=call.rep,
        SOFTCAP=call.softcap,
        HAS_SLIDING_WINDOW=call.has_sliding_window,
        **call.tiles("bwd_dkdv_region"),
    )

"""What the multi-region attention launchers (``attention_triton_launch``) check and build before a launch: the
inputs as the kernels read them (``kernel_view``), the limits only the kernels have (dtype, int32 offsets within one
batch entry, CUDA's grid rows), the per-region kernel arguments (key spans, rows by entry, sliding-window positions)
and the plan of launches that chains the regions. Plain torch, no Triton: each function reads tensors and shapes and
returns tensors or tuples; nothing here reads a value back to the host.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_dtype",
    "check_grid_rows",
    "check_offsets",
    "kernel_view",
    "launch_plan",
    "named_regions",
    "padded",
    "region_args",
    "region_rows",
    "region_span",
    "running",
    "sliding_window_args",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_I32_MAX = 2**31 - 1


_GRID_YZ_MAX = 65535  # CUDA's limit on a launch grid's y and z dimensions


def check_grid_rows(n: int, heads: int, what: str):
    """Raise ValueError if ``n``·``heads`` programs, one per (batch entry or prompt, head), exceed the 65535 CUDA allows
    on a grid's y axis, where the kernels put them (``what`` names ``n`` and the heads in the message)."""
    if n * heads > _GRID_YZ_MAX:
        raise ValueError(
            f"the Triton attention kernels launch one program row per {what}: {n}·{heads} = {n * heads} rows, over "
            f"CUDA's grid limit of {_GRID_YZ_MAX} on axis y; score at most {_GRID_YZ_MAX // heads} at a time "
            "(smaller micro-batches), or use backend='torch'"
        )


def kernel_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: any strides, except that the last (head-dim) stride must be 1.

    transformers' q/k/v (``(B, C, H, d)`` projections transposed to ``(B, H, C, d)``) and autograd's output gradients
    already have it, so they are read in place; anything else (e.g. a gradient expanded from a scalar) is copied once.
    """
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def check_offsets(**tensors):
    """The kernels compute the batch / prompt part of an offset in int64 and the rest (head, position, head-dim index,
    within one batch entry) in int32: raise ValueError if that rest can pass 2**31 − 1 elements."""
    for name, x in tensors.items():
        span = sum((n - 1) * st for n, st in zip(x.shape[1:], x.stride()[1:]))
        if x.numel() and span > _I32_MAX:
            raise ValueError(
                f"{name} spans {span} elements within one batch entry (shape {tuple(x.shape)}, strides "
                f"{x.stride()}); the Triton kernels need < 2**31"
            )


def check_dtype(q):
    """Raise ValueError unless ``q`` is fp16, bf16 or fp32."""
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"the Triton attention kernels take fp16, bf16 or fp32 inputs, got {q.dtype} (fp64: use backend='torch')"
        )


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of 16: the row length of the LSE / D buffers and of the folded query index, so
    the kernels' address arithmetic sees a multiple of 16 (Triton then vectorises and keeps fewer per-element
    offsets; with an arbitrary completion length it spilled at d=256)."""
    return (n + 15) // 16 * 16


def region_span(mask):
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


def region_rows(index, U):
    """Rows grouped by the entry they read (ascending row index within an entry; rows with index −1 are left out),
    int32 (B,), and CSR offsets int32 (U + 1,): entry u's rows are ``rows[row_start[u]:row_start[u + 1]]``. Sort and
    binary search: no host synchronisation (``bincount`` would read the maximum back to size its output)."""
    sorted_index, rows = torch.sort(index, stable=True)
    bounds = torch.arange(U + 1, device=index.device, dtype=index.dtype)
    row_start = torch.searchsorted(sorted_index, bounds, out_int32=True)  # the −1 rows sort first, before row_start[0]
    return rows.to(torch.int32), row_start


def region_args(regions, q, positions=None):
    """Per launch, the region tensors ``(region_k, region_v, index, span, mask, key positions)`` with
    ``region_k``/``region_v`` as the kernels read them; with no region, one launch with placeholders (unread:
    HAS_REGION=False). ``positions``: ``(q_positions, region positions)`` with a sliding window, else None (the key
    positions are then the index tensor, unread: HAS_SLIDING_WINDOW=False)."""
    if not regions:
        i64, i32 = (torch.zeros(2, dtype=t, device=q.device) for t in (torch.int64, torch.int32))
        return [(q, q, i64, i32, torch.zeros(1, 1, dtype=torch.bool, device=q.device), i64)]
    k_pos = [None] * len(regions) if positions is None else positions[1]
    return [
        (
            kernel_view(rk),
            kernel_view(rv),
            index,
            region_span(mask),
            mask.contiguous(),
            index if pos is None else pos.contiguous(),
        )
        for (rk, rv, index, mask), pos in zip(regions, k_pos)
    ]


def sliding_window_args(positions, params, q):
    """``(q_positions as the kernels read them, SLIDING_WINDOW, HAS_SLIDING_WINDOW)``: the (B, C) int64 positions
    (contiguous), the window length and True with ``params.sliding_window``; a placeholder, 0 and False without."""
    if params.sliding_window is None:
        return torch.zeros(2, dtype=torch.int64, device=q.device), 0, False
    return positions[0].contiguous(), int(params.sliding_window), True


def named_regions(regions, args):
    """``{"regions[i].region_k": tensor, "regions[i].region_v": tensor}`` of ``region_args``' output, for
    ``check_offsets``' messages (empty without regions)."""
    if not regions:
        return {}
    named = {f"regions[{i}].region_k": a[0] for i, a in enumerate(args)}
    named.update({f"regions[{i}].region_v": a[1] for i, a in enumerate(args)})
    return named


def launch_plan(regions):
    """(HAS_REGION, HAS_OWN, HAS_PREV) of each launch of the forward and dQ kernels: regions 0 … R−2 alone (rows
    reading none of a region do nothing there), then region R−1 with the own region, which writes the result."""
    R = len(regions)
    if R == 0:
        return [(False, True, False)]
    return [(True, i == R - 1, i > 0) for i in range(R)]


def running(x: torch.Tensor) -> torch.Tensor:
    """The running result between the launches of ``launch_plan``: fp32 with ``x``'s shape and strides (the kernels
    read PREV with the strides of their output)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=torch.float32, device=x.device)

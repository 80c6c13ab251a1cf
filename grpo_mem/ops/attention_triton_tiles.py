"""Tile sizes of the multi-region attention kernels (``attention_triton``): block sizes, warps and pipeline stages per
kernel, head dim, input dtype and build (soft-capped, windowed), and the split of a head dim into power-of-two column
tiles. Kernel names are the keys of ``attention_triton.KERNELS``. Imports neither the kernels nor their launchers.
"""

from __future__ import annotations

import torch
import triton

__all__ = ["block_config", "head_dim_tiles"]

# kernel name -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for four tiers of head dims: up to 64, up to 128 in one
# head-dim tile, up to 256, and d in (64, 128) as two head-dim tiles (d=80: 64 + 16, d=96: 64 + 32; head_dim_tiles).
# The split tier keeps the 128 tier's tiles except where sm_80 spilled with them (bwd_dq 64×64: 8 to 14 STL) or ptxas
# went to its 255-register cap (fwd 64×64 with 2 stages at d=96; with 3 stages 190 registers). bwd_dkdv_own
# sits at 255 registers on sm_80 without spilling at every tile tried (16×32 to 64×64, 4 or 8 warps, 1 to 3 stages).
# fp32 inputs use the exact (FMA, not tf32) dot, which needs far smaller tiles to stay within the register file.
# bwd_delta has no key tiles (BLOCK_N unused); bwd_region_reduce is elementwise (BLOCK_M elements per program).
# Registers, spills and shared memory of each build for sm_80 and sm_90, compiled with the argument attributes of the
# run-time specialisation, are checked and printed by tests/ops/test_attention_triton_aot.py.
_BLOCKS_16BIT = {
    "fwd": ((64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 3)),
    "bwd_delta": ((64, 0, 4, 1), (32, 0, 4, 1), (16, 0, 4, 1), (32, 0, 4, 1)),
    "bwd_dq": ((64, 32, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 2)),
    "bwd_dkdv_own": ((32, 64, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2)),
    "bwd_dkdv_region": ((32, 64, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2)),
    "bwd_region_reduce": ((1024, 0, 4, 1),) * 4,
}


_BLOCKS_FP32 = {
    "fwd": ((16, 16, 4, 2), (16, 16, 4, 2), (16, 16, 4, 1), (16, 16, 4, 2)),
    "bwd_delta": ((64, 0, 4, 1), (32, 0, 4, 1), (16, 0, 4, 1), (32, 0, 4, 1)),
    "bwd_dq": ((16, 16, 4, 2), (16, 16, 8, 2), (16, 16, 4, 1), (16, 16, 8, 2)),
    "bwd_dkdv_own": ((16, 32, 4, 2), (16, 16, 4, 1), (16, 32, 8, 1), (16, 16, 4, 1)),
    "bwd_dkdv_region": ((16, 32, 4, 2), (16, 32, 4, 2), (16, 32, 8, 1), (16, 32, 4, 2)),
    "bwd_region_reduce": ((1024, 0, 4, 1),) * 4,
}


# Soft-capped builds (SOFTCAP > 0) that need other tiles: (kernel, tier) -> tiles (16-bit inputs). bwd_dq at d=256
# spilled 7 stores on sm_90 with 64×32 (tanh and its derivative on top of 250 registers); 64×16 holds 225, no spill.
_BLOCKS_16BIT_SOFTCAP = {("bwd_dq", 2): (64, 16, 8, 2)}


# Windowed builds (HAS_WINDOW) that need other tiles (with a soft-cap too, these win over the above); each spilled on
# sm_80 or sm_90 with the windowless tile (16-bit: fwd 5 and bwd_dq 131 spill stores at d=256, at d=96 fwd 10,
# bwd_dkdv_own 12, bwd_dkdv_region 2; fp32: fwd one predicate at d=80 and 4 stores at d=256, bwd_dq 1 at d=96
# and 4 at d=256, bwd_dkdv_region 4 at d=64 and 5 at d=256) and holds with the one here. bwd_dkdv_region keeps its
# BLOCK_N (region_dkdv_grid sizes the grid from the windowless configuration).
_BLOCKS_16BIT_WINDOW = {
    ("fwd", 2): (64, 16, 8, 2),
    ("bwd_dq", 2): (32, 32, 4, 2),
    ("fwd", 3): (64, 32, 8, 3),
    ("bwd_dkdv_own", 3): (16, 64, 8, 2),
    ("bwd_dkdv_region", 3): (16, 64, 8, 2),
}


_BLOCKS_FP32_WINDOW = {
    ("fwd", 3): (16, 16, 8, 2),
    ("fwd", 2): (16, 16, 8, 1),
    ("bwd_dq", 2): (16, 16, 8, 1),
    ("bwd_dq", 3): (16, 16, 4, 2),
    ("bwd_dkdv_region", 0): (16, 32, 8, 2),
    ("bwd_dkdv_region", 2): (16, 32, 16, 1),
}


_TIER = {64: 0, 128: 1, 256: 2}


_TIER_SPLIT_128 = 3  # head dims in (64, 128) that run as two head-dim tiles


def block_config(
    name: str, head_dim: int, dtype: torch.dtype = torch.bfloat16, softcap: bool = False, window: bool = False
) -> dict:
    """Shipped launch configuration of kernel ``name`` for ``head_dim`` and input ``dtype`` (``softcap``: the
    soft-capped build; ``window``: the sliding-window build).

    Returns a dict with BLOCK_M, BLOCK_N, num_warps, num_stages. Chosen so that the sm_80 and sm_90 builds have no
    register spills (checked by ``tests/ops/test_attention_triton_aot.py``).
    Raises ValueError for an unknown name or a head dim outside [1, 256].
    """
    if name not in _BLOCKS_16BIT:
        raise ValueError(f"unknown kernel name {name!r}; expected one of {sorted(_BLOCKS_16BIT)}")
    tier = _TIER[max(64, _block_d(head_dim))]
    if tier == _TIER[128] and head_dim_tiles(head_dim)[1]:
        tier = _TIER_SPLIT_128
    block_m, block_n, warps, stages = (_BLOCKS_FP32 if dtype == torch.float32 else _BLOCKS_16BIT)[name][tier]
    if softcap and dtype != torch.float32:
        block_m, block_n, warps, stages = _BLOCKS_16BIT_SOFTCAP.get((name, tier), (block_m, block_n, warps, stages))
    if window:
        table = _BLOCKS_FP32_WINDOW if dtype == torch.float32 else _BLOCKS_16BIT_WINDOW
        block_m, block_n, warps, stages = table.get((name, tier), (block_m, block_n, warps, stages))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def _block_d(head_dim: int) -> int:
    """The head dim rounded up to a power of two (at least 16): the block-size tier of ``block_config``."""
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head dim must be in [1, 256] for the Triton backend, got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim))


def head_dim_tiles(head_dim: int) -> tuple[int, int]:
    """Widths ``(BLOCK_D0, BLOCK_D1)`` of the two head-dim column tiles the kernels use; ``BLOCK_D1 = 0`` means one.

    tl.dot needs power-of-two tiles of at least 16, so one tile is ``_block_d(head_dim)`` wide: 128 for d=80 and d=96,
    where 37% and 25% of every product would be masked padding. Two tiles, the larger power of two below the head dim
    plus the power of two that covers the rest, are used whenever they are narrower than that: (64, 16) for d=80
    (MMA work 80/128 of one tile), (64, 32) for d=96 (96/128); d=64, 128 and 256 stay one tile, as does d=112
    (64 + 64 is no narrower). Raises ValueError for a head dim outside [1, 256].
    """
    full = _block_d(head_dim)
    if full == 16 or full == head_dim:
        return full, 0
    lo = full // 2
    rest = max(16, triton.next_power_of_2(head_dim - lo))
    return (lo, rest) if lo + rest < full else (full, 0)

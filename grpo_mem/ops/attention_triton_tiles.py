"""Tile sizes of the multi-region attention kernels (``attention_triton``): block sizes, warps and pipeline stages per
kernel, head dim, input dtype, build (soft-capped, windowed) and GPU architecture (compute capability), and the split
of a head dim into power-of-two column tiles. Kernel names are the keys of ``attention_triton.KERNELS``. Imports
neither the kernels nor their launchers.
"""

from __future__ import annotations

import torch
import triton

__all__ = ["SHARED_MEMORY_LIMIT", "block_config", "head_dim_tiles"]

# kernel name -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for four tiers of head dims: up to 64, up to 128 in one
# head-dim tile, up to 256, and d in (64, 128) as two head-dim tiles (d=80: 64 + 16, d=96: 64 + 32; head_dim_tiles).
# The split tier keeps the 128 tier's tiles except where sm_80 spilled with them (bwd_dq 64×64: 8 to 14 STL) or ptxas
# went to its 255-register cap (fwd 64×64 with 2 stages at d=96; with 3 stages 190 registers). bwd_dkdv_own
# sits at 255 registers on sm_80 without spilling at every tile tried (16×32 to 64×64, 4 or 8 warps, 1 to 3 stages).
# fp32 inputs use the exact (FMA, not tf32) dot, which needs far smaller tiles to stay within the register file; fp32
# fwd at d=256 runs 8 warps (with 4 it spilled 5 stores on sm_90 under triton 3.6, the GPU image's release; with 8 it
# holds 78 to 104 registers on sm_80/86/90 under 3.6 and 3.9).
# bwd_delta has no key tiles (BLOCK_N unused); bwd_region_reduce is elementwise (BLOCK_M elements per program).
# Registers, spills and shared memory of each build for sm_80, sm_86/89 and sm_90, compiled with the argument
# attributes of the run-time specialisation, are checked and printed by tests/ops/test_attention_triton_aot.py.
_BLOCKS_16BIT = {
    "fwd": ((64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 3)),
    "bwd_delta": ((64, 0, 4, 1), (32, 0, 4, 1), (16, 0, 4, 1), (32, 0, 4, 1)),
    "bwd_dq": ((64, 32, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 2)),
    "bwd_dkdv_own": ((32, 64, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2)),
    "bwd_dkdv_region": ((32, 64, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2)),
    "bwd_region_reduce": ((1024, 0, 4, 1),) * 4,
}


_BLOCKS_FP32 = {
    "fwd": ((16, 16, 4, 2), (16, 16, 4, 2), (16, 16, 8, 1), (16, 16, 4, 2)),
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


# Shared memory a block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes) per compute capability: 163 KB on
# sm_80 (A100), 99 KB on sm_86 (A10G, A40, RTX 30) and sm_89 (L4, L40S, RTX 40), 227 KB on sm_90 (H100, H200)
# (CUDA C++ Programming Guide, compute capabilities table). The AOT tests check every build against these.
SHARED_MEMORY_LIMIT = {(8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448}


# sm_86 and sm_89 (one build: Triton gives them the same PTX but for its target line): the tiles that differ there,
# (kernel, tier) -> tiles (the soft-cap and window tables above still win where they have an entry). 16-bit bwd_dq
# at d=256 needs 102400 B of shared memory with 64×32 tiles, over the 99 KB; 64×16 (the soft-capped tile) needs
# 83968 B. The others spilled on sm_86 only (triton 3.9; LLVM's SLP vectoriser, which Triton turns off for sm_80
# alone, reshapes the code): 16-bit fwd at d=64 (255 registers, 1 spill store; 188 registers with 8 warps), fp32
# bwd_dkdv_own at d=80 (4 stores; d=96 shares the tier) and at d=256 (255 registers; windowed 30 stores; 108 and
# 124 registers, 66560 B, with 16×16), fp32 bwd_dq at d=128 (1 store in a multi-region launch; 86 with 4 warps).
_SM86 = frozenset({(8, 6), (8, 9)})
_BLOCKS_16BIT_SM86 = {("bwd_dq", 2): (64, 16, 8, 2), ("fwd", 0): (64, 64, 8, 2)}
_BLOCKS_FP32_SM86 = {
    ("bwd_dkdv_own", 3): (16, 16, 8, 1),
    ("bwd_dq", 1): (16, 16, 4, 2),
    ("bwd_dkdv_own", 2): (16, 16, 8, 1),
}


# Triton releases before 3.9 (checked: 3.6.0, the GPU image's, which runs its prefetch pass on every architecture)
# build other code; on sm_8x these tiles differ there (over the sm_86 ones), each spilled with the 3.9 tile under
# 3.6.0: 16-bit fwd at d=64 (4 spill stores on sm_80; 175 registers with 8 warps), 16-bit bwd_dkdv_own at d=64 (1 and
# 3 stores on sm_80 / sm_86; 110 registers with 32×32) and d=80 (5 stores on sm_86; 255 registers, no spill, with
# 32×32), fp32 bwd_dq at d=80/96 (2 stores on sm_80 at d=96; 72 registers with 4 warps), fp32 bwd_dkdv_own at
# d=80/96 (4 stores windowed on sm_86; 80 to 114 registers with 16×16 in 4 warps and 2 stages).
_OLD_TRITON = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9)
_SM8X = frozenset({(8, 0), (8, 6), (8, 9)})
_BLOCKS_16BIT_SM8X_OLD_TRITON = {
    ("fwd", 0): (64, 64, 8, 2),
    ("bwd_dkdv_own", 0): (32, 32, 8, 2),
    ("bwd_dkdv_own", 3): (32, 32, 8, 2),
}
_BLOCKS_FP32_SM8X_OLD_TRITON = {("bwd_dq", 3): (16, 16, 4, 2), ("bwd_dkdv_own", 3): (16, 16, 4, 2)}


_TIER = {64: 0, 128: 1, 256: 2}


_TIER_SPLIT_128 = 3  # head dims in (64, 128) that run as two head-dim tiles


def block_config(
    name: str,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    softcap: bool = False,
    sliding_window: bool = False,
    capability: tuple[int, int] | None = None,
) -> dict:
    """Shipped launch configuration of kernel ``name`` for ``head_dim`` and input ``dtype`` (``softcap``: the
    soft-capped build; ``sliding_window``: the sliding-window build) on a GPU of compute ``capability`` ``(major, minor)``.

    ``capability=None`` (Triton's interpreter, or an unknown device) gives the sm_80 / sm_90 tiles; sm_86 and sm_89
    (99 KB of shared memory per block: ``SHARED_MEMORY_LIMIT``) get their own where those need more or spill.
    Returns a dict with BLOCK_M, BLOCK_N, num_warps, num_stages. Chosen so that the sm_80, sm_86/89 and sm_90 builds
    have no register spills and fit the architecture's shared memory under triton 3.9 and 3.6 (some depend on the
    triton release: ``_BLOCKS_*_SM8X_OLD_TRITON``; checked by
    ``tests/ops/test_attention_triton_aot.py``). Raises ValueError for an unknown name or a head dim outside [1, 256].
    """
    if name not in _BLOCKS_16BIT:
        raise ValueError(f"unknown kernel name {name!r}; expected one of {sorted(_BLOCKS_16BIT)}")
    tier = _TIER[max(64, _block_d(head_dim))]
    if tier == _TIER[128] and head_dim_tiles(head_dim)[1]:
        tier = _TIER_SPLIT_128
    block_m, block_n, warps, stages = (_BLOCKS_FP32 if dtype == torch.float32 else _BLOCKS_16BIT)[name][tier]
    if capability is not None and tuple(capability) in _SM86:
        table = _BLOCKS_FP32_SM86 if dtype == torch.float32 else _BLOCKS_16BIT_SM86
        block_m, block_n, warps, stages = table.get((name, tier), (block_m, block_n, warps, stages))
    if _OLD_TRITON and capability is not None and tuple(capability) in _SM8X:
        table = _BLOCKS_FP32_SM8X_OLD_TRITON if dtype == torch.float32 else _BLOCKS_16BIT_SM8X_OLD_TRITON
        block_m, block_n, warps, stages = table.get((name, tier), (block_m, block_n, warps, stages))
    if softcap and dtype != torch.float32:
        block_m, block_n, warps, stages = _BLOCKS_16BIT_SOFTCAP.get((name, tier), (block_m, block_n, warps, stages))
    if sliding_window:
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

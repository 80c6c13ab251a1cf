"""Argument checks of multi-region and shared-prefix attention (and of their references): shapes, dtypes, devices,
index ranges and the optional features, each error naming the bad value."""

from __future__ import annotations

import math

import torch

__all__ = ["check_features", "check_own", "check_regions"]

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


def check_own(q, k, v, key_mask, scale):
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


def check_features(q, sliding_window, sinks, softcap, q_positions):
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


def check_regions(regions, q, Hkv, sync, prefix, window=False):
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

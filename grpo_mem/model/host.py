"""What crosses between host and device on the hot path: a micro-batch's one read back of its prompts and masks
(``read_host``), the checks made on that copy, and the copies of host-built plan tensors to the device
(``to_device``). On CUDA each read back waits for the stream; a step reads once per micro-batch. This module knows
torch, NumPy and the attention op's index checks."""

from __future__ import annotations

import numpy as np
import torch

from ..ops.attention import mark_checked


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a tensor the host built: plan indices, masks, positions) on ``device``. To a CUDA device the copy goes
    from pinned memory without blocking: a plain ``.to("cuda")`` of pageable memory waits for the stream to drain
    (``torch.cuda.set_sync_debug_mode`` reports it), so each would stop the host from queueing work ahead of the GPU.
    The source is never written after the copy (the caching host allocator keeps its pinned block until the copy
    ends)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def read_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The integer tensors ``tensors`` (each (B, w_i), the same B) as int64 NumPy arrays, read from their device in
    one copy (a plan needs the prompts' ids and masks on the host: one read per micro-batch, not one per use)."""
    joined = torch.cat([t.to(torch.int64) for t in tensors], dim=1) if len(tensors) > 1 else tensors[0].to(torch.int64)
    host = joined.cpu().numpy()
    bounds = np.cumsum([t.shape[1] for t in tensors])[:-1]
    return np.split(host, bounds, axis=1)


def check_left_padded(prompt_mask: np.ndarray) -> None:
    """Raise ValueError naming the rows of the (B, P) 0/1 host ``prompt_mask`` that are not left-padded (a 1 followed
    by a 0), which stock TRL would score at other positions."""
    real = prompt_mask.astype(bool)
    bad = np.flatnonzero((real[:, :-1] & ~real[:, 1:]).any(axis=1))
    if bad.size:
        raise ValueError(
            f"prompts must be left-padded (a 1 in the prompt mask followed by a 0), rows {bad[:8].tolist()} are not"
        )


def known_index(index: torch.Tensor, device, mask: torch.Tensor) -> torch.Tensor:
    """A region index the plan built on the host, values in [-1, entries) with ``mask`` (entries, S) the region's key
    mask, on ``device`` and marked so for the attention op's checks (``ops.attention.mark_checked``): no layer reads
    it back."""
    return mark_checked(to_device(index, device), -1, mask.shape[0])

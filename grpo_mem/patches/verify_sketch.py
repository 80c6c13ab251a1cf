"""Gradients kept as sketches: what ``grpo_mem.verify``'s comparisons read, without a second copy of the model's
gradients."""

from __future__ import annotations

import zlib

import torch

SKETCH_BUCKETS = 8192
"""Buckets of a large parameter's gradient sketch; parameters of at most this many elements are kept exactly."""


_SKETCH_BLOCK = 1 << 14  # elements hashed at a time (bounds the pattern and the temporaries: 128 KiB each)


class Sketcher:
    """Linear count sketches of gradients (Charikar et al.'s CountSketch), the same hash for every run of one
    ``verify`` call, so that differences of sketches are sketches of differences.

    A parameter of n <= ``SKETCH_BUCKETS`` elements is kept exactly (in its gradient's dtype). A larger one is reduced to
    ``SKETCH_BUCKETS`` fp64 sums: element i goes to bucket h(i) with sign s(i), both pseudo-random and fixed for the
    call. For any vector x (a gradient, a difference of two) ``||S x||^2`` is an unbiased estimate of ``||x||^2`` with
    variance at most ``2 ||x||^4 / SKETCH_BUCKETS``: a relative standard deviation <= 1.6% on squared norms (0.8% on
    norms), whatever x is. Sketches add: the truth's gradient is sketched chunk by chunk as its backward produces it.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._on: dict = {}

    def _pattern(self, device):
        """The buckets and signs of a block's elements (the block's own shift and sign apply on top), on ``device``."""
        if device not in self._on:
            g = torch.Generator().manual_seed(self.seed)
            idx = torch.randint(SKETCH_BUCKETS, (_SKETCH_BLOCK,), generator=g)
            sign = torch.randint(0, 2, (_SKETCH_BLOCK,), generator=g).double() * 2 - 1
            self._on[device] = (idx.to(device), sign.to(device))
        return self._on[device]

    def add(self, acc: dict, name: str, grad: torch.Tensor, own: bool = False) -> None:
        """Add the sketch of ``grad`` (any shape and floating dtype) to ``acc[name]``: a small parameter's gradient
        itself, in the dtype it first came in (``own``: ``grad`` is handed over, not copied), a large one's fp64
        bucket sums."""
        x = grad.detach().reshape(-1)
        n = x.numel()
        if n <= SKETCH_BUCKETS:
            if name in acc:
                acc[name] += x.to(acc[name].dtype)
            else:
                acc[name] = x if own else x.clone()
            return
        out = acc.get(name)
        if out is None:
            out = acc[name] = torch.zeros(SKETCH_BUCKETS, dtype=torch.float64, device=x.device)
        idx, sign = self._pattern(x.device)
        for block, lo in enumerate(range(0, n, _SKETCH_BLOCK)):
            xb = x[lo : lo + _SKETCH_BLOCK].double()
            m = xb.numel()
            h = zlib.crc32(f"{name}:{block}".encode())  # a shift and a sign per block: blocks do not align
            bucket = (idx[:m] + h) & (SKETCH_BUCKETS - 1)
            out.index_add_(0, bucket, xb.mul_(sign[:m]).mul_(1.0 if h & 1 << 20 else -1.0))

    def add_rows(self, acc: dict, name: str, grad: torch.Tensor, rows: torch.Tensor, shape: tuple) -> None:
        """``add`` of the gradient of a parameter of ``shape`` (rows, width) that is zero but in rows ``rows``
        (distinct int64 indices), given as ``grad`` (len(rows), width): the same sketch as ``add`` of the dense
        gradient, without building it."""
        n_rows, width = shape
        if n_rows * width <= SKETCH_BUCKETS:
            dense = grad.new_zeros(shape)
            dense[rows] = grad
            self.add(acc, name, dense)
            return
        out = acc.get(name)
        if out is None:
            out = acc[name] = torch.zeros(SKETCH_BUCKETS, dtype=torch.float64, device=grad.device)
        idx, sign = self._pattern(grad.device)
        flat = (rows.to(grad.device)[:, None] * width + torch.arange(width, device=grad.device)).reshape(-1)
        block, offset = flat // _SKETCH_BLOCK, flat % _SKETCH_BLOCK
        blocks = block.unique()
        shift = torch.tensor([zlib.crc32(f"{name}:{int(b)}".encode()) for b in blocks], device=grad.device)
        h = shift[torch.searchsorted(blocks, block)]
        bucket = (idx[offset] + h) & (SKETCH_BUCKETS - 1)
        block_sign = torch.where(h & (1 << 20) != 0, 1.0, -1.0).double()
        out.index_add_(0, bucket, grad.detach().reshape(-1).double() * sign[offset] * block_sign)

    def take_grads(self, named, acc: dict | None = None) -> dict:
        """Sketch every ``.grad`` of ``named`` ((name, parameter) pairs) into ``acc`` and drop the ``.grad``s."""
        acc = {} if acc is None else acc
        for name, p in named:
            if p.grad is not None:
                self.add(acc, name, p.grad, own=True)
                p.grad = None
        return acc

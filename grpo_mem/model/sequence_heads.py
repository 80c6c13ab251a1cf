"""The head-split exchange of the sequence-sharded layout (``sequence_parallel``): the attention of a pass run over
all its positions on 1/size of the heads, so every rank keeps 1/size of the pass's K/V.

Inside grpo_mem's attention hook, one all-to-all turns this rank's shard of the pass (its L tokens, all H query and
Hkv K/V heads) into the whole pass (size·L tokens in sequence order) at H/size query heads and Hkv'/size K/V heads,
the rank's head slice; the rank runs the one-rank attention of the pass on those heads (the recorded ancestors' K/V,
the pass's own causal K/V, windows, sinks and soft-capping as without sequence parallelism), records its head slice of
the pass's K/V for later readers, and the inverse all-to-all returns the output to the token shards. This is DeepSpeed
Ulysses' attention (arXiv 2309.14509), with the recorded K/V of every pass kept head-sliced, so the readers of a pass
(deeper trie nodes, the completions) find its K/V on the rank that runs their heads. The backward of each all-to-all
is the inverse all-to-all (``all_to_all_single``, which gloo has). The inverse all-to-all runs inside the attention op
(its ``out_map``): the op keeps the output at this rank's tokens, the tensor the output projection keeps too, and
exchanges it back with its gradient in backward, so a layer keeps one copy of its attention output, not one at each
layout (value heads narrower than the key heads, MLA, are cut after the op and exchanged outside it: two copies).

Grouped-query attention: the rank's K/V heads must be the ones its query heads read. Query head h reads K/V head
h // (H / Hkv); with Hkv % size != 0 each K/V head is repeated to Hkv' = lcm(Hkv, size) heads (``repeat_interleave``,
so query head h reads repeated head h // (H / Hkv'), the copy of the same head), which divides H whenever size
divides H. The copies' gradients are summed back by the repeat's backward, so the result is exact; the recorded K/V
are then Hkv'/size heads a rank, more than Hkv/size (at Hkv = 1, size 2: one head a rank, as without SP). A layer
whose H % size != 0 cannot be split over heads (``head_split`` gives None) and runs the all-gather exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

__all__ = ["HeadSplit", "head_split"]


def head_split(sp, heads: int, kv_heads: int) -> HeadSplit | None:
    """The head split of a layer with ``heads`` query and ``kv_heads`` K/V heads over the SP group ``sp`` (a
    ``sequence_parallel.SequenceParallel``): K/V heads repeated to lcm(kv_heads, size); None when ``heads % size !=
    0`` (the layer then runs the all-gather exchange).

    Raises:
        ValueError: ``heads`` is not a positive multiple of ``kv_heads``.
    """
    if kv_heads < 1 or heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads must be a positive multiple of K/V heads, got {heads} and {kv_heads}")
    if heads % sp.size:
        return None
    return HeadSplit(sp, heads, math.lcm(kv_heads, sp.size) // kv_heads)


def _all_to_all(parts, sp) -> list[torch.Tensor]:
    """``parts`` (size, ...) each, slice j for rank j -> what every rank sent this one, (size, ...) each, slice r from
    rank r: one ``all_to_all_single`` over the parts concatenated along their last dimension (one per part where their
    dtypes differ)."""
    if len({p.dtype for p in parts}) > 1:
        return [r for p in parts for r in _all_to_all([p], sp)]
    send = torch.cat(parts, dim=-1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=sp.group)
    return list(received.split([p.shape[-1] for p in parts], dim=-1))


def _to_heads(xs, sp) -> list[torch.Tensor]:
    """(n, Hh, L, d) of this rank's shard, all heads -> (n, Hh/size, size·L, d) of the whole pass in sequence order,
    this rank's heads (laid out (n, size·L, Hh/size, d) in memory); one all-to-all for all of ``xs``."""
    size, n, L = sp.size, xs[0].shape[0], xs[0].shape[2]
    # (size, n, L, width): the tokens of this shard cut into the head slices, slice j for rank j
    parts = [x.transpose(1, 2).reshape(n, L, size, -1).movedim(2, 0) for x in xs]
    received = _all_to_all(parts, sp)  # slice r: rank r's shard at this rank's heads
    shapes = [(n, size * L, x.shape[1] // size, x.shape[3]) for x in xs]
    return [sp.to_sequence(r.movedim(0, 1).reshape(shape)).transpose(1, 2) for r, shape in zip(received, shapes)]


def _to_tokens(ys, sp) -> list[torch.Tensor]:
    """The inverse of ``_to_heads``: (n, h, size·L, d) of the whole pass at this rank's heads -> (n, size·h, L, d) of
    this rank's shard at all heads (laid out (n, L, size·h, d) in memory)."""
    size, n, L = sp.size, ys[0].shape[0], ys[0].shape[2] // sp.size
    order = sp.order(L, ys[0].device)
    parts = [y.transpose(1, 2).index_select(1, order).reshape(n, size, L, -1).movedim(1, 0) for y in ys]
    received = _all_to_all(parts, sp)  # slice j: this rank's shard at rank j's heads
    shapes = [(n, L, size * y.shape[1], y.shape[3]) for y in ys]
    return [r.movedim(0, 2).reshape(shape).transpose(1, 2) for r, shape in zip(received, shapes)]


class _Exchange(torch.autograd.Function):
    """``_to_heads`` (``heads=True``) or ``_to_tokens``; backward: the other one, of the gradients (each all-to-all
    only moves elements, so its gradient is its inverse)."""

    @staticmethod
    def forward(ctx, sp, heads, *xs):
        ctx.sp, ctx.heads = sp, heads
        return tuple((_to_heads if heads else _to_tokens)(xs, sp))

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *(_to_tokens if ctx.heads else _to_heads)(grads, ctx.sp)


@dataclass(frozen=True)
class HeadSplit:
    """How one layer's attention is split over the heads of the SP group ``sp`` (``head_split``).

    Attributes:
        sp: the ``sequence_parallel.SequenceParallel`` group.
        heads: H, the layer's query heads (a multiple of ``sp.size``).
        repeat: how many copies of each K/V head the exchange sends (Hkv' / Hkv, 1 when size divides Hkv).
    """

    sp: object
    heads: int
    repeat: int

    def scatter(self, query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's shard ``query`` (n, H, L, d), ``key`` (n, Hkv, L, d), ``value`` (n, Hkv, L, dv) -> the whole
        pass at this rank's heads: (n, H/size, size·L, d), (n, Hkv'/size, size·L, d), (n, Hkv'/size, size·L, dv), in
        sequence order (``SequenceParallel.slices``); differentiable."""
        if self.repeat > 1:
            key, value = key.repeat_interleave(self.repeat, 1), value.repeat_interleave(self.repeat, 1)
        return _Exchange.apply(self.sp, True, query, key, value)

    def sinks(self, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's slice of per-query-head sink logits ``sinks`` (H,) (None stays None)."""
        if sinks is None:
            return None
        h = self.heads // self.sp.size
        return sinks[self.sp.rank * h : (self.sp.rank + 1) * h]

    @property
    def out_map(self) -> tuple:
        """``multi_region_attention``'s ``out_map`` for this split: (the all-to-all from this rank's heads to its
        tokens, its inverse), so the op keeps the output at this rank's tokens, the tensor the next layer keeps."""
        return partial(_to_tokens, sp=self.sp), partial(_to_heads, sp=self.sp)

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output ``out`` (n, H/size, size·L, dv) of this rank's heads -> (n, L, H, dv) contiguous, this
        rank's shard at all heads (the layer's attention output); differentiable. Used where ``out_map`` cannot be
        (the output is cut to the value width after the op)."""
        return _Exchange.apply(self.sp, False, out)[0].transpose(1, 2)

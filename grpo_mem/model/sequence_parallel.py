"""Sequence parallelism of the prompt-once path: every pass's tokens split along the sequence over the ranks of a
sequence-parallel (SP) group, the attention exchanging K/V inside grpo_mem's attention hook.

The ranks of an SP group hold the same micro-batch. Each pass (a trie node pass, or the completion pass) of T tokens is
padded to ``size · L`` tokens and cut (``SequenceParallel.split``):

* ``"zigzag"`` (the default): into 2·size chunks of M = ceil(T / (2·size)) tokens; rank r holds chunks r and
  2·size − 1 − r (L = 2·M), one early and one late. Under causal attention a query at position i sees i + 1 keys, so
  the pairs of chunks r and 2·size − 1 − r add up to the same work on every rank (the load balancing of Megatron-LM's
  context parallelism, ``get_batch_on_this_cp_rank``, and of ring-flash-attention's ``zigzag_ring_flash_attn_func``);
* ``"contiguous"``: into ``size`` shards of L = ceil(T / size) tokens in order; rank r's queries see r + 1 shards of
  keys, so the last rank does about twice the mean causal work at size 2. Kept selectable (``SequenceParallel(...,
  split="contiguous")``, ``benchmarks/bench_sp.py --split``) as the reference the zigzag split is measured against;
  both are exact, and no supported case needs it.

Everything but attention is token-local. Attention reaches the K/V of other ranks' tokens by one of two exchanges
(``SequenceParallel.exchange``, ``EXCHANGES``):

``"heads"`` (the default; ``sequence_heads``), DeepSpeed Ulysses' exchange (arXiv 2309.14509): in each layer one
all-to-all turns the rank's q/k/v (its L tokens, all heads) into the whole pass in sequence order at 1/size of the
heads (K/V heads repeated to lcm(Hkv, size) where size does not divide them); the rank runs the one-rank attention of
the pass on its heads (the recorded K/V of the passes on the row's path at the same heads, the pass's own K/V causally,
windows, sinks, soft-capping), records its head slice of the pass's K/V for the readers, and the inverse all-to-all
returns the output to its tokens. So every rank keeps 1/size of every pass's K/V and of their gradients (the readers of
a pass run the same heads on the same rank), and does the same attention work whatever the split. A layer whose query
heads the group size does not divide runs the all-gather exchange instead (exact too; its K/V whole on every rank).

``"gather"`` (selectable: ``SequenceParallel(..., exchange="gather")``, ``benchmarks/bench_sp.py --exchange``): the
queries of each piece of a rank's shard (the shard's two chunks under zigzag, run as separate query rows:
``Shards.fold``) see three kinds of keys, merged exactly by log-sum-exp (``grpo_mem.ops.multi_region_attention``):

* the K/V of the passes on the row's path (a deeper trie node's ancestors; the completions' prompt nodes), recorded
  whole: each pass all-gathers its K/V over the SP group, layer by layer, and records the gathered (n, Hkv, size·L, d)
  tensors, in sequence order, for its readers;
* the same pass's K/V of every token before the piece (fully visible to the piece's queries), read in place from that
  all-gather (``Shards.earlier``);
* the piece's own K/V, causally.

The all-gather's backward is a reduce-scatter (gloo has none: an all-to-all and a sum), which returns to each rank the
gradient that every rank's queries sent to its keys and values. It is ring attention's construction (arXiv
2310.01889) with the ring replaced by one all-gather; every rank then holds the whole K/V of every pass.

Under either exchange a pass is forwarded once per group, only split across the ranks, and its readers attend to all
of its K/V. Positions (RoPE's ``position_ids``, sliding windows) are each token's own in the whole pass
(``Shards.positions``).

The head scores each rank's share of the completion positions: position 0 (predicted by the last prompt token) on the
rank whose shard holds that token, position j ≥ 1 (predicted by completion token j − 1) on the rank holding that
token. One all-gather assembles the (B, C) log-probs on every rank, in sequence order (``gather_scores``). Its
backward keeps this rank's columns of the incoming gradient: every rank computes the same loss from the same (B, C)
values, so that gradient is the same on every rank, and each rank's parameter gradient is its shard's part of the
whole. The parts sum over the SP group to the gradient of the loss without SP: DeepSpeed ZeRO 0-2 under SP sum
gradients over the SP group and average them over data-parallel ranks (they divide the all-reduce by
``world / sp_size``); ZeRO-3's default reduce-scatter divides by the world size, averaging over the SP group too, so
there each share is scaled by ``size`` (``SequenceParallel.grad_scale``).

``SequenceSharded`` is this layout as the window runs it (``window.OneRank``'s hooks for a sharded micro-batch), and
``Shards`` what a pass's attention context carries of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import attention_hook as attn_hook
from .head import completion_head
from .sequence_heads import HeadSplit, head_split
from .store import ForwardedPass, PromptStates
from .window import OneRank

__all__ = [
    "EXCHANGES",
    "SPLITS",
    "SP_CAUSES",
    "SequenceParallel",
    "SequenceSharded",
    "Shards",
    "gather_kv",
    "gather_scores",
]

SPLITS = ("zigzag", "contiguous")
"""How a pass is cut over the ranks (``SequenceParallel.split``): ``"zigzag"`` (the default: 2·size chunks, rank r
holds chunks r and 2·size − 1 − r, the same causal attention work on every rank) or ``"contiguous"`` (size shards in
order: the later ranks' queries see more keys)."""

EXCHANGES = ("heads", "gather")
"""How the attention of a sharded pass reaches the K/V of other ranks' tokens (``SequenceParallel.exchange``):
``"heads"`` (the default: an all-to-all over heads, each rank runs the whole pass on 1/size of the heads and keeps
1/size of its K/V, ``sequence_heads``) or ``"gather"`` (each layer's K/V all-gathered whole on every rank)."""

SP_CAUSES = {
    "linear": "sequence parallelism: the model has linear-attention (recurrent) layers, whose state runs along the "
    "sequence and is not exchanged between the ranks of a sequence-parallel group",
    "router": "sequence parallelism: the MoE router loss (load-balancing statistics over all tokens of the micro-batch) "
    "is not computed across the shards of a sequence-parallel group",
    "images": "sequence parallelism: image inputs are not split along the sequence",
    "hidden": "sequence parallelism: the LM head's input (TRL's Liger loss, use_liger_kernel=True) is not assembled "
    "across the shards of a sequence-parallel group",
    "differ": "sequence parallelism: the ranks of the sequence-parallel group were given different micro-batches "
    "(they must hold the same generation batch)",
}
"""Why a micro-batch cannot be scored with sequence parallelism, by case. There is no stock path to fall back to under
sequence parallelism (stock TRL has none), so these are raised, never warned."""


@dataclass(frozen=True)
class SequenceParallel:
    """A sequence-parallel group as the prompt-once path uses it.

    Attributes:
        group: the ``torch.distributed`` process group of the SP ranks (None: the default, whole-world group).
        rank: this process's rank within ``group``.
        size: the number of ranks in ``group`` (>= 1).
        grad_scale: the factor on each rank's share of the gradient (``gather_scores``' backward): 1 when the
            ranks' gradients are summed over the group (DeepSpeed ZeRO 0-2), ``size`` when they are averaged (ZeRO-3
            with its default ``reduce_scatter``).
        split: how each pass is cut over the ranks, one of ``SPLITS``: ``"zigzag"`` (the default) or
            ``"contiguous"`` (see the module docstring).
        exchange: how attention reaches other ranks' K/V, one of ``EXCHANGES``: ``"heads"`` (the default; a layer
            whose query heads the group size does not divide runs ``"gather"``) or ``"gather"``.

    Raises:
        ValueError: ``split`` is not one of ``SPLITS``, or ``exchange`` not one of ``EXCHANGES``.
    """

    group: object
    rank: int
    size: int
    grad_scale: float = 1.0
    split: str = "zigzag"
    exchange: str = "heads"

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")

    @classmethod
    def of(cls, group, grad_scale: float = 1.0, split: str = "zigzag", exchange: str = "heads") -> SequenceParallel:
        """The SP group ``group`` (a ``ProcessGroup``, or None for the whole world) with this process's rank in it.

        Raises:
            RuntimeError: ``torch.distributed`` is not initialised.
            ValueError: ``split`` is not one of ``SPLITS``, or ``exchange`` not one of ``EXCHANGES``.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("sequence parallelism needs torch.distributed initialised (a process group)")
        return cls(group, dist.get_rank(group), dist.get_world_size(group), float(grad_scale), split, exchange)

    @property
    def pieces(self) -> int:
        """How many contiguous pieces of a pass a rank holds: 2 (zigzag), 1 (contiguous)."""
        return 2 if self.split == "zigzag" else 1

    def shard(self, length: int) -> int:
        """L, the tokens of one rank's shard of a pass of ``length`` tokens: ``pieces · ceil(length / (pieces ·
        size))``, at least ``pieces``."""
        return self.pieces * max(1, math.ceil(length / (self.pieces * self.size)))

    def slices(self, L: int) -> list[tuple[int, int, int]]:
        """The pass padded to ``size · L`` tokens as (rank, start, stop) slices of the ranks' shards, in sequence
        order: contiguous, shard r whole; zigzag with M = L / 2, chunk c (tokens ``c·M … c·M + M − 1``) is the first
        half of rank c's shard for c < size and the second half of rank 2·size − 1 − c's for the others."""
        if self.pieces == 1:
            return [(r, 0, L) for r in range(self.size)]
        M = L // 2
        return [(r, 0, M) for r in range(self.size)] + [(r, M, L) for r in reversed(range(self.size))]

    def order(self, L: int, device=None) -> torch.Tensor:
        """(size · L,) int64: the position in the padded pass of every token of the ranks' shards, rank 0's first."""
        starts, at = {}, 0
        for r, a, b in self.slices(L):
            starts[(r, a)] = at
            at += b - a
        parts = [torch.arange(starts[(r, a)], starts[(r, a)] + b - a) for r, a, b in sorted(self.slices(L))]
        return torch.cat(parts).to(device)

    def indices(self, L: int, device=None) -> torch.Tensor:
        """(L,) int64: the positions in the padded pass of this rank's shard (increasing)."""
        return self.order(L, device)[self.rank * L : (self.rank + 1) * L]

    def locate(self, t: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank, index in its shard) of the tokens at positions ``t`` (int64, any shape) of a pass split in shards of
        ``L``."""
        slot = torch.argsort(self.order(L, t.device))[t]
        return slot // L, slot % L

    def local(self, t: torch.Tensor, L: int, fill=0) -> torch.Tensor:
        """This rank's shard, along dim 1, of ``t`` (n, T, ...) padded with ``fill`` to ``size · L`` tokens."""
        t = self.padded(t, L, fill)
        if self.pieces == 1:
            return t[:, self.rank * L : (self.rank + 1) * L]
        return t.index_select(1, self.indices(L, t.device))

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (n, size · L, ...), the ranks' shards in rank order along dim 1, in sequence order."""
        L = x.shape[1] // self.size
        return x if self.pieces == 1 else x.index_select(1, torch.argsort(self.order(L, x.device)))

    def padded(self, t: torch.Tensor, L: int, fill=0) -> torch.Tensor:
        """``t`` (n, T, ...) padded along dim 1 with ``fill`` to ``size · L`` tokens: the layout of a gathered pass."""
        pad = self.size * L - t.shape[1]
        return torch.cat([t, t.new_full((t.shape[0], pad, *t.shape[2:]), fill)], dim=1) if pad else t

    def same_inputs(self, *tensors: torch.Tensor) -> bool:
        """Whether every rank of the group holds the same ``tensors`` (shapes and values): one all-gather of a
        fingerprint (shapes, and int64 sums of the values weighted by two position-dependent sequences)."""
        parts = []
        for t in tensors:
            flat = t.detach().reshape(-1).long()
            i = torch.arange(flat.numel(), device=flat.device)
            parts += [*t.shape, int((flat * (i % 1009 + 1)).sum()), int((flat * (i % 997 + 7) * (i % 13 + 1)).sum())]
        mine = torch.tensor(parts, dtype=torch.long)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([mine.numel()]), group=self.group)
        if len({int(s) for s in sizes}) > 1:
            return False
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self.group)
        return all(torch.equal(e, mine) for e in everyone)


def _all_gather(x: torch.Tensor, sp: SequenceParallel) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(sp.size)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return parts


class _GatherKV(torch.autograd.Function):
    """(2, n, Hkv, L, d) stacked K/V of this rank's shard -> (2, n, Hkv, size·L, d) of the whole pass in sequence
    order (``SequenceParallel.slices``). Backward: the reduce-scatter of the gradient (each rank gets the sum over
    ranks of its shard's tokens)."""

    @staticmethod
    def forward(ctx, kv, sp):
        ctx.sp = sp
        parts = _all_gather(kv, sp)
        return torch.cat([parts[r][:, :, :, a:b] for r, a, b in sp.slices(kv.shape[3])], dim=3)

    @staticmethod
    def backward(ctx, grad):
        sp = ctx.sp
        slices = sp.slices(grad.shape[3] // sp.size)
        pieces = dict(zip(slices, grad.split([b - a for _, a, b in slices], dim=3)))
        shards = [torch.cat([pieces[k] for k in sorted(pieces) if k[0] == r], dim=3) for r in range(sp.size)]
        send = torch.stack(shards)  # (size, 2, n, Hkv, L, d): shard r goes to rank r
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=sp.group)
        return received.sum(0), None


def gather_kv(key: torch.Tensor, value: torch.Tensor, sp: SequenceParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole pass, from this rank's ``key``/``value`` (n, Hkv, L, d): (n, Hkv, size·L, d) each, in
    sequence order (the padded pass; ``SequenceParallel.slices`` says which rank holds which tokens); differentiable
    (gradients return to the ranks that own the tokens). One collective per call; every rank of the group must call it
    in the same order."""
    kv = _GatherKV.apply(torch.stack([key, value]), sp)
    return kv[0], kv[1]


class _GatherScores(torch.autograd.Function):
    """(n, m) per-rank values -> (size, n, m) of every rank. Backward: this rank's slice of the gradient (every rank
    computes the same loss from the gathered values, see the module docstring)."""

    @staticmethod
    def forward(ctx, x, sp):
        ctx.rank, ctx.scale = sp.rank, sp.grad_scale
        return torch.stack(_all_gather(x, sp))

    @staticmethod
    def backward(ctx, grad):
        own = grad[ctx.rank]
        return (own if ctx.scale == 1.0 else own * ctx.scale), None


def gather_scores(local: torch.Tensor, sp: SequenceParallel, C: int) -> torch.Tensor:
    """(B, C) values of a micro-batch from every rank's ``local`` (B, 1 + L) head output: column 0 (completion position
    0, scored by the rank holding the last prompt token of the row, zero elsewhere) summed over ranks, columns
    ``1 … L`` of rank r at positions 1 + its shard's positions (``SequenceParallel.indices`` of the C − 1 completion
    tokens). Differentiable with the backward described in the module docstring."""
    parts = _GatherScores.apply(local, sp)  # (size, B, 1 + L)
    first = parts[:, :, :1].sum(0)
    rest = sp.to_sequence(parts[:, :, 1:].transpose(0, 1).reshape(local.shape[0], -1))
    return torch.cat([first, rest], dim=1)[:, :C]


@dataclass
class Shards:
    """A pass split along the sequence over a sequence-parallel group (``sequence_parallel``): the queries and own
    keys of the pass's context are this rank's shard; ``mask`` and ``positions`` (n, size·L) cover the whole pass in
    sequence order (the layout of the exchanged K/V, which the context's ``capture`` records: at this rank's heads
    under the head exchange, ``heads``; whole under the all-gather, ``regions``).

    Attributes:
        sp: the ``SequenceParallel`` group.
        mask: (n, size·L) bool, real key positions of the whole pass.
        positions: (n, size·L) int64, positions of the whole pass's tokens.
    """

    sp: SequenceParallel
    mask: torch.Tensor
    positions: torch.Tensor

    def heads(self, heads: int, kv_heads: int) -> HeadSplit | None:
        """The head split (``sequence_heads.head_split``) of a layer with ``heads`` query and ``kv_heads`` K/V heads
        under the ``"heads"`` exchange; None: the layer all-gathers its K/V (``regions``)."""
        return head_split(self.sp, heads, kv_heads) if self.sp.exchange == "heads" else None

    def regions(self, key: torch.Tensor, value: torch.Tensor, layer: int, capture) -> list[tuple]:
        """All-gather this layer's K/V (n, Hkv, L, d) over the group, record the gathered pair in ``capture`` (first
        forward only), and return the regions this rank's query rows read in place (``earlier``)."""
        k_all, v_all = gather_kv(key, value, self.sp)
        if capture is not None:
            capture.setdefault(layer, (k_all, v_all))
        return self.earlier(k_all, v_all)

    def earlier(self, k_all: torch.Tensor, v_all: torch.Tensor) -> list[tuple]:
        """The regions ``(K, V, index, mask, positions)`` of the gathered K/V ``k_all``/``v_all`` (n, Hkv, size·L, d)
        that this rank's query rows (``fold``: piece i of row b is row b·pieces + i) read besides their own keys: the
        tokens of the pass before the row's piece. Rank 0 of a contiguous split has none, but gets shard 0 as a
        region that no row reads (index −1): every rank's attention takes the gathered K/V as an input, so the
        autograd graphs of the ranks have the same shape and run their backward collectives (the all-gather's
        reduce-scatter) in the same order."""
        sp, n, P = self.sp, k_all.shape[0], self.sp.pieces
        L, rows = k_all.shape[2] // sp.size, torch.arange(n, device=k_all.device)

        def region(end: int, index: torch.Tensor) -> tuple:
            return k_all[:, :, :end], v_all[:, :, :end], index, self.mask[:, :end], self.positions[:, :end]

        out, at, i = [], 0, 0
        for r, a, b in sp.slices(L):  # in sequence order, which is also this rank's order of its pieces
            if r == sp.rank:
                if at:
                    index = torch.full((n * P,), -1, dtype=torch.long, device=k_all.device)
                    index[i::P] = rows
                    out.append(region(at, index))
                i += 1
            at += b - a
        return out or [region(L, torch.full((n,), -1, dtype=torch.long, device=k_all.device))]

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's query rows: ``t`` (n, H, L, d) as (n·pieces, H, L / pieces, d), piece i of row b in row
        b·pieces + i (a view when ``t`` is laid out (n, L, H, d) in memory, as the attention's projections give it). A
        piece's queries see its own keys causally and the regions ``earlier`` gives its row."""
        if self.sp.pieces == 1:
            return t
        n, H, L, d = t.shape
        return t.transpose(1, 2).reshape(n * self.sp.pieces, L // self.sp.pieces, H, d).transpose(1, 2)

    def fold_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (n, L) (a key mask, positions) as the folded rows' (n·pieces, L / pieces)."""
        return t.reshape(t.shape[0] * self.sp.pieces, -1)

    def unfold(self, out: torch.Tensor) -> torch.Tensor:
        """(n·pieces, H, L / pieces, d) attention output of the folded rows -> (n, L, H, d) contiguous: a view when the
        kernel wrote ``out`` laid out (rows, L / pieces, H, d), as the ATen and Triton backends do, so the layer's
        output shares the storage the attention keeps for backward."""
        m, H, M, d = out.shape
        return out.transpose(1, 2).reshape(m // self.sp.pieces, self.sp.pieces * M, H, d).contiguous()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """A region's (n,) row index for the folded rows: each piece of row b reads what row b reads."""
        return index if self.sp.pieces == 1 else index.repeat_interleave(self.sp.pieces)


@dataclass(frozen=True)
class SequenceSharded(OneRank):
    """The window's layout of a micro-batch split along the sequence over the group ``sp``: each pass runs this rank's
    shard of its tokens, the head this rank's completion positions, and the (B, C) scores are gathered."""

    sp: SequenceParallel | None = None

    def node_pass(self, mb, spec) -> None:
        """This rank's shard of the pass's tokens through the backbone, its attention over the whole pass (its
        ancestors' K/V and its own causally) through the exchange (``Shards.heads``, ``Shards.regions``); the
        exchanged K/V of all shards are recorded (at this rank's heads under the head exchange). A row's last hidden
        state is kept by the rank holding that token (zero elsewhere, ``ForwardedPass.owner``)."""
        window, sp = mb.window, self.sp
        ids, mask, positions, lengths = window.plan.pass_tokens(spec, mb.device)
        L = sp.shard(ids.shape[1])
        full_positions = positions[:, :1] + torch.arange(sp.size * L, device=mb.device)
        ancestors = [window.plan.trie.path(n)[:-1] for n in spec.nodes]
        fields = dict(
            key_mask=sp.local(mask, L, False),
            positions=sp.local(full_positions, L),
            capture={},
            shards=Shards(sp, sp.padded(mask, L, False), full_positions),
        )
        if spec.depth > 0 and spec.nodes:
            last = int((positions[:, 0] + torch.tensor(lengths, device=mb.device)).max()) - 1
            ctx = window.attending(mb, ancestors, spec.release, last, **fields)
        else:
            reach = int(positions[:, 0].max() + max(lengths) - 1 - positions[:, 0].min())
            ctx = attn_hook.CompletionContext(regions=[], reach=reach, **fields)
        out = mb.causal_lm.base_model(
            input_ids=sp.local(ids, L),
            position_ids=ctx.positions,
            use_cache=False,
            grpo_mem_ctx=attn_hook.context_token(ctx),
        )
        kv = {i: (attn_hook.keep_alive(k, ctx), attn_hook.keep_alive(v, ctx)) for i, (k, v) in ctx.capture.items()}
        hidden = attn_hook.keep_alive(out.last_hidden_state, ctx)
        owner, slot = sp.locate(torch.tensor(lengths, device=mb.device) - 1, L)
        picked = hidden[torch.arange(len(lengths), device=mb.device), slot]
        picked = picked * (owner == sp.rank).to(picked.dtype)[:, None]
        states = PromptStates(kv={i: kv[i] for i in sorted(kv)}, last_hidden=picked)
        window.table.register(
            ForwardedPass(spec=spec, mask=fields["shards"].mask, positions=full_positions, owner=owner), states
        )

    def completion(self, ids, key_mask, ends, width: int):
        """This rank's shard of the completion tokens."""
        sp, L = self.sp, self.sp.shard(width)
        positions = ends[:, None] + torch.arange(sp.size * L, device=ends.device)
        shards = Shards(sp, sp.padded(key_mask, L, False), positions)
        ids, key_mask, positions = sp.local(ids, L), sp.local(key_mask, L, False), sp.local(positions, L)
        return ids, key_mask, positions, sp.size * L, shards

    def completion_hidden(self, out: torch.Tensor, C: int) -> torch.Tensor:
        return out

    def head(self, mb, hidden, ids, mask, options, scored=None):
        """This rank's completion positions through the head (position 0 where this rank holds the row's last prompt
        token, then its shard of positions 1 … C − 1), then the (B, C) log-probs and entropies of every rank
        (``gather_scores``); ``scored`` (the whole rows' scored positions) is not used: this rank scores its own."""
        sp, C, table = self.sp, ids.shape[1], mb.window.table
        owners = [table.passes[pass_id].owner[row] for pass_id, row in map(table.locate, mb.leaves)]
        owned = torch.tensor([bool(o == sp.rank) for o in owners]).to(mask.device)
        first_mask = mask[:, :1] * owned[:, None].to(mask.dtype)
        L = hidden.shape[1] - 1
        ids = torch.cat([ids[:, :1], sp.local(ids[:, 1:], L)], dim=1) if L else ids[:, :1]
        mask = torch.cat([first_mask, sp.local(mask[:, 1:], L)], dim=1) if L else first_mask
        logps, entropy = completion_head(mb.causal_lm, hidden, ids, mask, options)
        entropy = None if entropy is None else gather_scores(entropy, sp, C)
        return gather_scores(logps, sp, C), entropy


def layout(call, touch_unread: bool) -> SequenceSharded:
    """The sequence-sharded layout of a micro-batch split over ``call.sp`` (``mechanisms.TABLE``)."""
    return SequenceSharded(touch_unread=touch_unread, sp=call.sp)

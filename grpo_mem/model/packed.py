"""The packed layer loop: a micro-batch's passes run as few backbone calls, each over one padding-free sequence.

A micro-batch of a window forwards some trie nodes (``PassSpec``s of the plan) and its completions. Run one call per
pass, every decoder layer launches its kernels (norms, projections, MLP) once per pass, each over few tokens: on a
GPU that is launch- and sync-bound where stock runs one large batch. Here the passes that are backpropagated together
(the same release micro-batch) go through the backbone as one call: each pass is a block of ``n x S`` tokens (its
rows right-padded to its width, as the pass would be) of one (1, T) sequence at the blocks' own positions, so
everything per token runs once over T, and only the attention hook knows the blocks
(``PackedContext``): each block attends to its own keys causally and to its ancestors' K/V, in place,
whether an earlier block of the same call (that layer's keys, a view) or a pass kept from an earlier call or micro-batch
(``PassTable.regions``), exactly as its own pass would.

Calls, per micro-batch: one per release of its kept passes (a pass read by a later micro-batch is backpropagated in
that one, so its graph cannot share the backward of this micro-batch's completions), in decreasing release order (a
pass's ancestors are released no earlier than it), then one for the passes released now and the completions. The
hook reads no mask from the model: the call passes a 4-D placeholder that transformers' mask builders return as is,
so no (T x T) mask is built for the packed sequence.

``window.Window`` runs a micro-batch here (``forward``, given the window and its ``MicroBatch``) when the micro-batch
is text on one rank (the ``OneRank`` layout; FSDP and DeepSpeed ranks in lockstep included: their calls follow the
aligned passes' releases). A micro-batch with pass extensions (images, recurrent state, the MoE router loss) or
sequence parallelism runs its passes one call each (``Window.text_pass``), since those mechanisms hand state from pass
to pass outside attention. This module knows torch and the attention hook.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..ops import attention_cpu
from ..ops._backends import resolve
from . import attention_hook as attn_hook
from .last_layer import Cut, Prior
from .plan import PassSpec, known_index, to_device
from .store import ForwardedPass, PromptStates


@dataclass
class PackedContext:
    """Context of a packed call: every pass of a micro-batch that is backpropagated together, each a block of
    ``n x S`` tokens (its rows right-padded to its width, row-major) of the call's one (1, T) sequence, at ``offsets``.
    ``blocks`` are ordered ancestors first: a block's ``regions`` may hold an earlier block's ``capture`` (filled by
    that block in the same layer call, so read after it) or a ``prior`` block's."""

    blocks: list[attn_hook.CompletionContext]
    offsets: list[int]
    masks: dict = field(default_factory=dict)  # (sliding window, dtype) -> the one-call path's additive mask
    after: int | None = None  # the last layer's index once ``last_layer.Cut`` ran it: no attention may follow
    prior: Prior | None = None

    def attend(self, query, key, value, layer: int, kwargs: dict) -> torch.Tensor:
        """The attention hook's work for this call: ``query`` (1, Hq, T, d), ``key``/``value`` (1, Hkv, T, d)
        post-RoPE; each block viewed as its (n, S) rows in place and attended as its own pass would be
        (``attention_hook.attend``), ancestors first, or all of them as one masked attention (``_one_call``).
        Returns (1, T, Hq, dv)."""
        if self.after is not None:
            raise RuntimeError(
                f"grpo_mem: layer {layer} attended after layer {self.after}, taken as the model's last decoder layer"
            )
        views = [self._rows(b, query, key, value) for b in range(len(self.blocks))]
        if self._one_call(query, key, value, kwargs):
            return self._attend_once(query, key, value, layer, kwargs, views)
        outs = [attn_hook.attend(block, *rows, layer, kwargs).flatten(0, 1) for block, rows in zip(self.blocks, views)]
        return torch.cat(outs)[None] if len(outs) > 1 else outs[0][None]

    def _rows(self, b: int, *tensors):
        """Block ``b`` of (1, H, T, d) ``tensors`` as its (n, H, S, d) rows, in place."""
        n, S = self.blocks[b].key_mask.shape
        sl = slice(self.offsets[b], self.offsets[b] + n * S)
        return tuple(t[0, :, sl].unflatten(1, (n, S)).transpose(0, 1) for t in tensors)

    def _key_blocks(self) -> list[attn_hook.CompletionContext]:
        """The blocks whose keys one masked call attends: the prior ones, then this call's."""
        return ([] if self.prior is None else self.prior.blocks) + self.blocks

    def _one_call(self, query, key, value, kwargs) -> bool:
        """Whether every block attends in one masked attention call over the packed tokens: CPU tensors the cpu
        backend takes (``_backends.resolve``), no soft-capping or sinks, key and value heads of one width, every
        region a block's of this call or a prior one (no K/V kept from another micro-batch or release) and a (T x K)
        mask within ``attention_cpu.MASK_BYTES_LIMIT`` (K: the prior and own keys). Then a layer calls ATen's fused
        CPU attention once (forward and backward), as stock does, instead of once per block and region entry; the
        numbers are the same softmax over the same visible keys."""
        T = query.shape[2]
        K = T + (0 if self.prior is None else self.prior.key.shape[2])
        if query.device.type != "cpu" or value.shape[-1] != key.shape[-1] or kwargs.get("s_aux") is not None:
            return False
        if kwargs.get("softcap") is not None or 4 * T * K > attention_cpu.MASK_BYTES_LIMIT or not self._pays(T, K):
            return False
        captures = {id(b.capture) for b in self._key_blocks() if b.capture is not None}
        if any(id(r.kv) not in captures for b in self.blocks for r in b.regions):
            return False
        window = attn_hook.layer_features(kwargs)["sliding_window"]
        if window is not None and window < 1:  # refused by name on the op's path
            return False
        needs = {"sliding_window"} if window is not None else set()
        return resolve("multi_region_attention", "auto", query, needs) == "cpu"

    def _pays(self, T: int, K: int) -> bool:
        """Whether one call's (T x K) scores cost no more than twice the blocks' own (each row's causal keys and the
        regions it reads), or the call is small (T x K <= 512^2), where the launches saved outweigh the extra scores:
        one masked call scores every pair, the blocks only the pairs they read."""
        scores = 0
        for block in self.blocks:
            n, S = block.key_mask.shape
            scores += n * S * (S + 1) // 2 + sum(n * S * r.mask.shape[1] for r in block.regions)
        return T * K <= max(2 * scores, 512 * 512)

    def _attend_once(self, query, key, value, layer: int, kwargs: dict, views) -> torch.Tensor:
        """``attend`` as one masked attention (``_one_call``), each block's K/V recorded as ``attend`` records them."""
        for block, (_, k, v) in zip(self.blocks, views):
            if block.capture is not None:
                block.capture.setdefault(layer, (k, v))
        if self.prior is not None:
            key, value = torch.cat([self.prior.key, key], 2), torch.cat([self.prior.value, value], 2)
        q, k, v = attn_hook.op_tensors((query, key, value))
        scaling, window = kwargs.get("scaling"), attn_hook.layer_features(kwargs)["sliding_window"]
        mask = self.masks.get((window, q.dtype))
        if mask is None:
            mask = self.masks[(window, q.dtype)] = attention_cpu.additive(self._visible(window), q.dtype)[None, None]
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
            )
        return out.transpose(1, 2)

    def _visible(self, window: int | None) -> torch.Tensor:
        """(T, K) bool over this call's queries and the prior keys then its own: query i sees key j iff both are of
        one row, j <= i and j is real, or j is a key a region of i's row shows it (an ancestor block's row, through the
        region's index and mask); with a sliding window W also ``pos_i - pos_j < W``."""
        starts, rows, tpos, real, pos, first, token = {}, [], [], [], [], 0, 0
        for block in self._key_blocks():
            n, S = block.key_mask.shape
            starts[id(block.capture)] = (token, S)
            rows.append(torch.arange(first, first + n).repeat_interleave(S))
            tpos.append(torch.arange(S).repeat(n))
            real.append(block.key_mask.reshape(-1))
            pos.append(block.positions.reshape(-1))
            first, token = first + n, token + n * S
        reads = torch.zeros(first, token, dtype=torch.bool)
        reader = first - sum(b.key_mask.shape[0] for b in self.blocks)  # this call's first row
        for block in self.blocks:
            n, S = block.key_mask.shape
            for region in block.regions:  # a row with index -1 reads nothing of the region
                start, width = starts[id(region.kv)]
                index = region.index.cpu()
                entry = index.clamp(min=0)
                keys = start + entry[:, None] * width + torch.arange(width)
                reads[torch.arange(reader, reader + n)[:, None], keys] = (
                    region.mask.cpu()[entry] & (index >= 0)[:, None]
                )
            reader += n
        rows, tpos, real, pos = (torch.cat(x) for x in (rows, tpos, real, pos))
        q = slice(len(rows) - sum(b.key_mask.numel() for b in self.blocks), len(rows))
        visible = ((rows[q, None] == rows[None, :]) & (tpos[None, :] <= tpos[q, None])) | reads[rows[q]]
        visible &= real[None, :]
        return visible if window is None else visible & (pos[q, None] - pos[None, :] < window)


class _Call:
    """The blocks of one packed call being assembled: token ids, positions, the hook's per-block contexts, and which
    block holds each trie node forwarded in it."""

    def __init__(self):
        self.ids, self.positions, self.blocks, self.offsets = [], [], [], []
        self.node_block: dict[int, tuple[int, int]] = {}  # node -> (block, row)
        self.tokens = 0

    def add(self, ids: torch.Tensor, positions: torch.Tensor, ctx: attn_hook.CompletionContext) -> int:
        """Append a block of (n, S) ``ids`` at ``positions`` with its attention context; returns its index."""
        self.ids.append(ids.reshape(-1))
        self.positions.append(positions.reshape(-1))
        self.blocks.append(ctx)
        self.offsets.append(self.tokens)
        self.tokens += ids.numel()
        return len(self.blocks) - 1

    def inner_regions(self, paths: list[list[int]], device) -> tuple[list[attn_hook.Region], list[list[int]]]:
        """The regions of earlier blocks of this call that rows with ancestor paths ``paths`` read (one per block,
        its capture as K/V: filled when the hook reaches that block, before the readers), and per row the ancestors
        held elsewhere (kept passes, earlier calls)."""
        rows: dict[int, dict[int, int]] = {}
        outside = []
        for b, path in enumerate(paths):
            outside.append([n for n in path if n not in self.node_block])
            for n in path:
                if n in self.node_block:
                    block, row = self.node_block[n]
                    rows.setdefault(block, {})[b] = row
        regions = []
        for block, reads in rows.items():
            index = torch.full((len(paths),), -1, dtype=torch.long)
            index[list(reads)] = torch.tensor(list(reads.values()), dtype=torch.long)
            ctx = self.blocks[block]
            regions.append(
                attn_hook.Region(ctx.capture, known_index(index, device, ctx.key_mask), ctx.key_mask, ctx.positions)
            )
        return regions, outside


def _node_block(window, mb, call: _Call, spec: PassSpec):
    """Add the pass ``spec`` to ``call``; returns (its mask, positions, lengths)."""
    plan = window.plan
    ids, mask, positions, lengths = plan.pass_tokens(spec, mb.device)
    paths = [plan.trie.path(n) for n in spec.nodes]
    ancestors = [path[:-1] for path in paths]
    inner, outside = call.inner_regions(ancestors, mb.device)
    last = max((plan.trie.nodes[n].start + length - 1 for n, length in zip(spec.nodes, lengths)), default=0)
    reach = plan.reach(paths, last) if paths else 0
    ctx = attn_hook.CompletionContext(
        regions=window.regions(mb, outside, spec.release) + inner if any(outside) else inner,
        key_mask=mask,
        positions=positions,
        reach=reach,
        capture={},
    )
    block = call.add(ids, positions, ctx)
    for row, n in enumerate(spec.nodes):
        call.node_block[n] = (block, row)
    return mask, positions, lengths


def _completion_block(window, mb, call: _Call, completion_ids, completion_mask, width: int):
    """Add the completion pass (tokens ``0 … width − 1`` of every row) to ``call``; returns its block index."""
    trie = window.plan.trie
    ends = to_device(torch.tensor([trie.nodes[leaf].end for leaf in mb.leaves], dtype=torch.long), mb.device)
    ids, key_mask = completion_ids[:, :width], completion_mask[:, :width].bool()
    positions = ends[:, None] + torch.arange(width, device=mb.device)
    paths = [trie.path(leaf) for leaf in mb.leaves]
    last = max(trie.nodes[n].end for n in mb.leaves) + width - 1
    inner, outside = call.inner_regions(paths, mb.device)
    ctx = attn_hook.CompletionContext(
        regions=window.regions(mb, outside, window.current) + inner,
        key_mask=key_mask,
        positions=positions,
        reach=window.plan.reach(paths, last),
    )
    return call.add(ids, positions, ctx)


def _run(mb, call: _Call, lengths: dict[int, list[int]]):
    """The backbone on ``call``'s packed sequence, its last layer cut where it can be (``last_layer.Cut``; node block
    b's rows have ``lengths[b]`` real tokens). Returns its final hidden states (T, H) or, cut, (T', H), the call's
    context (held by the hidden states' graph for the replay of checkpointed layers) and the cut or None."""
    ctx = PackedContext(blocks=call.blocks, offsets=call.offsets)
    ids, positions = torch.cat(call.ids)[None], torch.cat(call.positions)[None]
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=mb.device)  # returned as is by the mask builders
    cut = Cut.of(mb.causal_lm.base_model, ctx, call, lengths, mb.device)
    with cut or contextlib.nullcontext():
        out = mb.causal_lm.base_model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=placeholder,
            use_cache=False,
            grpo_mem_ctx=attn_hook.context_token(ctx),
        )
    return attn_hook.keep_alive(out.last_hidden_state[0], ctx), ctx, cut if cut is not None and cut.ran else None


def _register(window, mb, call: _Call, hidden, ctx, cut, passes) -> None:
    """Register every node block of a finished call as its pass: its K/V per layer and each row's last hidden
    state."""
    for block, spec, mask, positions, lengths in passes:
        n, S = mask.shape
        if cut is not None:
            last = cut.last(hidden, block)
        else:
            rows = hidden[call.offsets[block] : call.offsets[block] + n * S].unflatten(0, (n, S))
            last = rows[torch.arange(n, device=mb.device), to_device(torch.tensor(lengths), mb.device) - 1]
        capture = call.blocks[block].capture
        kv = {i: tuple(attn_hook.keep_alive(t, ctx) for t in capture[i]) for i in sorted(capture)}
        window.table.register(ForwardedPass(spec=spec, mask=mask, positions=positions), PromptStates(kv, last))


def forward(window, mb, completion_ids, completion_mask, width: int) -> torch.Tensor | None:
    """Forward micro-batch ``mb``'s passes (``plan.passes_at``) and, with ``width`` > 0, its completions (tokens
    ``0 … width − 1`` of ``completion_ids``/``completion_mask`` (B, C)) in packed calls, registering each pass in the
    window's table as ``Window.text_pass`` does. Returns the (B, width, H) final hidden states of the completion
    tokens, or None when ``width`` is 0."""
    specs = window.plan.passes_at(window.current)
    releases = sorted({s.release for s in specs if s.release != window.current}, reverse=True)
    hidden = None
    for release in [*releases, window.current]:
        call, passes = _Call(), []
        for spec in (s for s in specs if s.release == release):
            passes.append((len(call.blocks), spec, *_node_block(window, mb, call, spec)))
        completion = None
        if release == window.current and width:
            completion = _completion_block(window, mb, call, completion_ids, completion_mask, width)
        if not call.blocks:
            continue
        out, ctx, cut = _run(mb, call, {p[0]: p[-1] for p in passes})
        _register(window, mb, call, out, ctx, cut, passes)
        if completion is not None:
            offset = call.offsets[completion] if cut is None else cut.offset(completion)
            hidden = out[offset : offset + completion_ids.shape[0] * width].unflatten(0, (-1, width))
    return hidden

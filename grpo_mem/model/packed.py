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

from dataclasses import dataclass

import torch

from . import attention_hook as attn_hook
from .plan import PassSpec, known_index, to_device
from .store import ForwardedPass, PromptStates


@dataclass
class PackedContext:
    """Context of a packed call: every pass of a micro-batch that is backpropagated together, each a block of
    ``n x S`` tokens (its rows right-padded to its width, row-major) of the call's one (1, T) sequence, at ``offsets``.
    ``blocks`` are ordered ancestors first: a block's ``regions`` may hold an earlier block's ``capture`` (filled by
    that block in the same layer call, so read after it)."""

    blocks: list[attn_hook.CompletionContext]
    offsets: list[int]

    def attend(self, query, key, value, layer: int, kwargs: dict) -> torch.Tensor:
        """The attention hook's work for this call: ``query`` (1, Hq, T, d), ``key``/``value`` (1, Hkv, T, d)
        post-RoPE; each block viewed as its (n, S) rows in place and attended as its own pass would be
        (``attention_hook.attend``), ancestors first. Returns (1, T, Hq, dv)."""
        outs = []
        for offset, block in zip(self.offsets, self.blocks):
            n, S = block.key_mask.shape
            rows = (t[0, :, offset : offset + n * S].unflatten(1, (n, S)).transpose(0, 1) for t in (query, key, value))
            outs.append(attn_hook.attend(block, *rows, layer, kwargs).flatten(0, 1))
        return torch.cat(outs)[None] if len(outs) > 1 else outs[0][None]


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


def _run(mb, call: _Call) -> torch.Tensor:
    """The backbone on ``call``'s packed sequence; returns its (T, H) final hidden states, holding the call's context
    for the replay of checkpointed layers."""
    ctx = PackedContext(blocks=call.blocks, offsets=call.offsets)
    ids, positions = torch.cat(call.ids)[None], torch.cat(call.positions)[None]
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=mb.device)  # returned as is by the mask builders
    out = mb.causal_lm.base_model(
        input_ids=ids,
        position_ids=positions,
        attention_mask=placeholder,
        use_cache=False,
        grpo_mem_ctx=attn_hook.context_token(ctx),
    )
    return attn_hook.keep_alive(out.last_hidden_state[0], ctx), ctx


def _register(window, mb, call: _Call, hidden, ctx, passes) -> None:
    """Register every node block of a finished call as its pass: its K/V per layer and each row's last hidden
    state."""
    for block, spec, mask, positions, lengths in passes:
        n, S = mask.shape
        offset = call.offsets[block]
        rows = hidden[offset : offset + n * S].unflatten(0, (n, S))
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
        out, ctx = _run(mb, call)
        _register(window, mb, call, out, ctx, passes)
        if completion is not None:
            offset = call.offsets[completion]
            hidden = out[offset : offset + completion_ids.shape[0] * width].unflatten(0, (-1, width))
    return hidden

"""Executing a window's plan: node passes, the completion pass, and the head, micro-batch by micro-batch.

Each ``PassSpec`` of the plan goes through the model once, with gradients, at positions ``start … start + len − 1`` of
its nodes (a node's ``start`` is the number of tokens before it on its prompt's path; in group mode, a prompt's left
padding, so it sits where stock TRL puts it): a root pass is a plain causal pass whose attention records its K/V, a
deeper pass attends to every ancestor's recorded K/V in place plus its own causal K/V
(``grpo_mem.ops.multi_region_attention``) and records its own. The completions then run as one pass at positions
``end … end + C − 2`` (``end``: where the row's prompt ends) attending to every node on their prompt's path plus their own
tokens. Every query-key pair keeps the position difference of stock TRL's left-padded layout, so RoPE scores are the
same up to the rounding of the rotation (exactly stock's positions in group mode). When the MoE router loss is asked
for, every pass also records its router logits and the completion pass runs all C tokens (``Window._router_loss``).

A kept pass (read by a later micro-batch) lives in the window's ``PromptStore`` until its release micro-batch; which
states a reader gets is decided in one place, ``Window._read``. This module knows transformers, not TRL.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from . import attention_hook as attn_hook
from .distributed import fsdp_wrapped
from .head import completion_head
from .plan import PassSpec, WindowPlan
from .sequence_parallel import SequenceParallel, gather_scores
from .store import PromptStates, PromptStore

__all__ = ["Window", "completion_width"]


def completion_width(logits_to_keep: int, *, lockstep: bool, router: bool) -> int:
    """Completion tokens the completion pass runs for C = ``logits_to_keep``: C − 1 (the last one predicts nothing);
    all C when the MoE router loss is asked for (``router``: stock's loss counts the last token's router logits); 1
    when C == 1 in ``lockstep`` (ranks whose micro-batches differ make the same module calls; tied in with zero
    gradient), else 0 then."""
    if router:
        return logits_to_keep
    return logits_to_keep - 1 if logits_to_keep > 1 or not lockstep else 1


class _Tie(torch.autograd.Function):
    """``x`` unchanged; ``others`` join its graph with zero gradients, so their backward runs (and issues its
    collectives) although they contribute nothing."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


class _Touch(torch.autograd.Function):
    """``x`` unchanged; ``others`` join its graph with no gradient (None), so that backward visits the nodes that
    produced them (running the hooks on them) without computing anything through them."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.n = len(others)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *([None] * ctx.n))


def touch(x: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """``x`` unchanged in value; its backward visits the graph of ``others`` (gradient None)."""
    others = [o for o in others if o.requires_grad]
    return _Touch.apply(x, *others) if others and x.requires_grad else x


def tie(x: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """``x`` unchanged in value; the backward of ``x`` also runs through ``others`` (with zero gradient)."""
    others = [o for o in others if o.requires_grad]
    return _Tie.apply(x, *others) if others and x.requires_grad else x


@dataclass
class _Pass:
    """A pass forwarded in this window: its spec, key mask and positions (n, S) (under sequence parallelism, of all
    shards: (n, size·L)), and its states while it belongs to the current micro-batch (a kept pass's states live in the
    store)."""

    spec: PassSpec
    mask: torch.Tensor
    positions: torch.Tensor
    states: PromptStates | None = None
    owner: torch.Tensor | None = None  # sequence parallelism: (n,) the rank holding each row's last token


@dataclass
class Window:
    """A ``WindowPlan`` being executed; ``run`` scores its micro-batches in order.

    Attributes:
        plan: the window's plan.
        current: the micro-batch scored next.
        store: kept passes, until their release.
        record_router: whether the passes of the micro-batch being run record their router logits (the MoE router
            loss is asked for).
        sp: the sequence-parallel group the micro-batch being run is split over (``sequence_parallel``), or None.
    """

    plan: WindowPlan
    current: int = 0
    store: PromptStore = field(default_factory=PromptStore)
    record_router: bool = False
    sp: SequenceParallel | None = None
    _passes: dict[int, _Pass] = field(default_factory=dict)
    _node_pass: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (pass id, row)
    _ids: itertools.count = field(default_factory=itertools.count)
    _inputs: object = None  # the current micro-batch's input provider (``run``'s ``inputs``)
    _linear_layers: bool = False  # whether the model being run has linear-attention layers
    _owned: torch.Tensor | None = (
        None  # sequence parallelism: (B,) whether this rank holds each row's last prompt token
    )

    @property
    def done(self) -> bool:
        """Whether every micro-batch of the window was scored (or the window was abandoned)."""
        return self.current > self.plan.last

    @property
    def mode(self) -> str:
        """The plan's sharing mode, ``"tree"`` or ``"group"``."""
        return self.plan.mode

    @property
    def pending(self) -> int:
        """Kept prompt passes waiting for a later micro-batch's backward."""
        return len(self.store)

    def check_prompts(self, keys: tuple) -> None:
        """Raise ValueError unless ``keys`` (``PromptGrouping.keys``) are the prompts planned for the next
        micro-batch."""
        planned = self.plan.keys[self.current]
        if keys != planned:
            raise ValueError(
                f"micro-batch {self.current} of the window does not hold the prompts planned for it "
                f"({len(set(keys))} unique prompts in {len(keys)} rows, planned {len(set(planned))} in {len(planned)})"
            )

    def shares(self) -> bool:
        """Whether the next micro-batch shares a prompt pass with another row or micro-batch (``WindowPlan.shares``)."""
        return self.plan.shares(self.current)

    def tokens(self, logits_to_keep: int, *, lockstep: bool, router: bool) -> int:
        """Tokens the backbone runs for the next micro-batch on the prompt-once path (``WindowPlan.tokens_at``)."""
        width = completion_width(logits_to_keep, lockstep=lockstep, router=router)
        return self.plan.tokens_at(self.current, width)

    def pass_keys(self, images=None) -> tuple[list, list | None]:
        """The keys of the next micro-batch's passes, and of those that run the vision tower given its bound image
        inputs ``images`` (``VisionPasses``; None: no image inputs, and None for the second list)."""
        passes = self.plan.passes_at(self.current)
        keys = [p.key for p in passes]
        if images is None:
            return keys, None
        return keys, [p.key for p in passes if p.nodes and images.images_of(self.spans(p))]

    def align(self, keys) -> None:
        """Add stand-in passes so that the next micro-batch runs a pass of every key in ``keys`` (the union over
        ranks in lockstep) of this micro-batch (``WindowPlan.align``)."""
        self.plan.align({k for k in keys if k[0] == self.current})

    def end_after_next(self) -> None:
        """Make the next micro-batch the window's last (``WindowPlan.end_after``)."""
        self.plan.end_after(self.current)

    def discard(self) -> int:
        """Drop every kept pass unbackpropagated; returns how many there were."""
        return self.store.discard()

    def _release(self, p: _Pass) -> int:
        """A pass's release micro-batch, moved earlier if the window was cut short (``WindowPlan.end_after``)."""
        return min(p.spec.release, self.plan.last)

    def _read(self, pass_id: int, reader_release: int, views: dict[int, PromptStates]) -> PromptStates:
        """The states of a pass as a reader released at ``reader_release`` gets them: a pass of this micro-batch, its
        own; a kept pass released now, the released view (one per micro-batch); a kept pass released together with
        the reader (a kept pass built on it), its real states; otherwise detached leaves."""
        p = self._passes[pass_id]
        if not p.spec.kept:
            return p.states
        release = self._release(p)
        if release == self.current:
            if pass_id not in views:
                views[pass_id] = self.store.release(pass_id)
            return views[pass_id]
        if reader_release == release:
            return self.store.real(pass_id)
        return self.store.leaves(pass_id)

    def _regions(self, paths: list[list[int]], reader_release: int, views, device) -> list[attn_hook.Region]:
        """One region per pass read by the readers whose nodes are ``paths`` (one list per reader row)."""
        rows: dict[int, dict[int, int]] = {}
        for b, path in enumerate(paths):
            for node in path:
                pass_id, row = self._node_pass[node]
                rows.setdefault(pass_id, {})[b] = row
        regions = []
        for pass_id, reads in rows.items():
            index = torch.full((len(paths),), -1, dtype=torch.long)
            index[list(reads)] = torch.tensor(list(reads.values()), dtype=torch.long)
            states = self._read(pass_id, reader_release, views)
            p = self._passes[pass_id]
            regions.append(attn_hook.Region(kv=states.kv, index=index.to(device), mask=p.mask, positions=p.positions))
        return regions

    def _span(self, paths: list[list[int]], last: int) -> int:
        """The largest query-key position difference of a pass whose last query sits at ``last`` and whose rows
        read the nodes ``paths`` (a path's root holds its smallest positions)."""
        return last - min(self.plan.trie.nodes[path[0]].start for path in paths)

    def _layout(self, nodes: tuple[int, ...], device):
        """(ids, key mask, positions, lengths) of a pass over ``nodes``: right-padded spans at their positions."""
        trie_nodes = [self.plan.trie.nodes[n] for n in nodes] or None
        lengths = [len(n.tokens) for n in trie_nodes] if trie_nodes else [1]
        S = max(lengths)
        ids = torch.zeros(len(lengths), S, dtype=torch.long)
        mask = torch.zeros(len(lengths), S, dtype=torch.bool)
        starts = torch.zeros(len(lengths), dtype=torch.long)
        for i, length in enumerate(lengths):
            mask[i, :length] = True
            if trie_nodes:
                ids[i, :length] = torch.tensor(trie_nodes[i].tokens, dtype=torch.long)
                starts[i] = trie_nodes[i].start
        positions = starts[:, None] + torch.arange(S)
        return ids.to(device), mask.to(device), positions.to(device), lengths

    def _sources(self, nodes: list[int | None], reader_release: int, views):
        """Per pass holding some of ``nodes`` (one per reader row; None: nothing): (its states as these readers get
        them, reader rows (k,) int64, its rows (k,) int64), index tensors on the CPU."""
        by_pass: dict[int, list[tuple[int, int]]] = {}
        for b, node in enumerate(nodes):
            if node is not None:
                pass_id, row = self._node_pass[node]
                by_pass.setdefault(pass_id, []).append((b, row))
        return [
            (
                self._read(pass_id, reader_release, views),
                torch.tensor([b for b, _ in items]),
                torch.tensor([r for _, r in items]),
            )
            for pass_id, items in by_pass.items()
        ]

    def _linear(self, batch: int, lengths: list[int] | None, nodes: list[int | None], release: int, views):
        """The context of a pass's linear-attention layers, whose rows start from the states of ``nodes`` (one per
        row; None: from zero, ``_sources``), or None when the model has no such layers."""
        if not self._linear_layers:
            return None
        from .linear_attention import LinearContext

        sources = self._sources(nodes, release, views)
        return LinearContext(
            batch=batch,
            lengths=lengths,
            capture=None if lengths is None else {},
            sources=[(states.linear, readers, rows) for states, readers, rows in sources],
        )

    def _pass_inputs(self, spec: PassSpec, width: int) -> dict:
        """Extra backbone kwargs of a pass from the micro-batch's input provider (``vision_passes.VisionPasses``: image
        features, the model's positions), asked for each node's span (``spans``)."""
        if self._inputs is None or not spec.nodes:
            return {}
        return self._inputs.prompt_pass(self.spans(spec), width)

    def spans(self, spec: PassSpec) -> list[tuple[int, int, int]]:
        """Per node of ``spec``, ``(b, first, end)``: its tokens are tokens ``first … end − 1`` of the unpadded
        prompt of row b, the first row of the current micro-batch through it (a node's tokens, images and positions
        are the same on every row through it: they depend on the prefix)."""
        trie, reader = self.plan.trie, {}
        for b, leaf in enumerate(self.plan.leaves(self.current)):
            for n in trie.path(leaf):
                reader.setdefault(n, b)
        spans = []
        for n in spec.nodes:  # its span in its prompt: its start less its root's (0 in tree, the padding in group)
            offset = trie.nodes[n].start - trie.nodes[trie.path(n)[0]].start
            spans.append((reader[n], offset, offset + len(trie.nodes[n].tokens)))
        return spans

    def _forward_pass(self, backbone, spec: PassSpec, views, device) -> None:
        """Forward one pass of the schedule; register its nodes (in the store if kept), with its router logits when
        ``record_router``."""
        ids, mask, positions, lengths = self._layout(spec.nodes, device)
        if self.sp is not None:
            self._forward_shard(backbone, spec, views, (ids, mask, positions, lengths))
            return
        extra = self._pass_inputs(spec, ids.shape[1])
        rope_positions = extra.pop("position_ids", positions)  # the model's own (e.g. M-RoPE) positions, if given
        if self.record_router:
            extra["output_router_logits"] = True
        if spec.depth == 0 or not spec.nodes:
            ctx = attn_hook.PromptCapture(linear=self._linear(len(lengths), lengths, [], spec.release, views))
            out = backbone(
                input_ids=ids,
                attention_mask=mask.long(),
                position_ids=rope_positions,
                use_cache=False,
                grpo_mem_ctx=attn_hook.context_token(ctx),
                **extra,
            )
            kv = ctx.kv
        else:
            parents = [self.plan.trie.path(n)[-2] for n in spec.nodes]
            ancestors = [self.plan.trie.path(n)[:-1] for n in spec.nodes]
            regions = self._regions(ancestors, spec.release, views, device)
            last = max(self.plan.trie.nodes[n].start + length - 1 for n, length in zip(spec.nodes, lengths))
            ctx = attn_hook.CompletionContext(
                regions=regions,
                key_mask=mask,
                positions=positions,
                span=self._span(ancestors, last),
                capture={},
                linear=self._linear(len(lengths), lengths, parents, spec.release, views),
            )
            out = backbone(
                input_ids=ids,
                position_ids=rope_positions,
                use_cache=False,
                grpo_mem_ctx=attn_hook.context_token(ctx),
                **extra,
            )
            kv = {i: (attn_hook.keep_alive(k, ctx), attn_hook.keep_alive(v, ctx)) for i, (k, v) in ctx.capture.items()}
        # whatever reads this pass (its K/V, its states, its last hidden state) holds its context, which the replay of
        # its checkpointed layers in backward looks up (a root pass's attention needs none; its linear layers do)
        captured = ctx.linear.capture if ctx.linear is not None else {}
        keeper = ctx if isinstance(ctx, attn_hook.CompletionContext) or captured else None
        hidden = out.last_hidden_state if keeper is None else attn_hook.keep_alive(out.last_hidden_state, keeper)
        linear = {i: tuple(attn_hook.keep_alive(t, ctx) for t in pair) for i, pair in captured.items()}
        last = hidden[torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device) - 1]
        router_logits = self._router_logits(out, ids.numel(), keeper) if self.record_router else ()
        states = PromptStates(
            kv={i: kv[i] for i in sorted(kv)}, last_hidden=last, linear=linear, router_logits=router_logits
        )
        self._register(_Pass(spec=spec, mask=mask, positions=positions), states)

    def _register(self, p: _Pass, states: PromptStates) -> None:
        """Make a forwarded pass readable: its nodes point to it, its states are its own or (kept) the store's."""
        pass_id = next(self._ids)
        p.states = None if p.spec.kept else states
        self._passes[pass_id] = p
        if p.spec.kept:
            self.store.keep(pass_id, states, p.spec.release)
        for row, n in enumerate(p.spec.nodes):
            self._node_pass[n] = (pass_id, row)

    def _forward_shard(self, backbone, spec: PassSpec, views, layout) -> None:
        """``_forward_pass`` under sequence parallelism: this rank's shard of the pass's tokens through the backbone,
        attending to its ancestors, to the earlier shards and causally to its own (``sequence_parallel``); the
        gathered K/V of all shards are recorded. A row's last hidden state is kept by the rank holding that token
        (zero elsewhere, ``_Pass.owner``)."""
        ids, mask, positions, lengths = layout
        sp, device = self.sp, ids.device
        L = sp.shard(ids.shape[1])
        full_positions = positions[:, :1] + torch.arange(sp.size * L, device=device)
        paths = [self.plan.trie.path(n) for n in spec.nodes]
        ancestors = [path[:-1] for path in paths]
        regions = self._regions(ancestors, spec.release, views, device) if spec.depth > 0 and spec.nodes else []
        span = int(positions[:, 0].max() + max(lengths) - 1 - positions[:, 0].min())
        if regions:
            span = self._span(ancestors, int((positions[:, 0] + torch.tensor(lengths, device=device)).max()) - 1)
        ctx = attn_hook.CompletionContext(
            regions=regions,
            key_mask=sp.local(mask, L, False),
            positions=sp.local(full_positions, L),
            span=span,
            capture={},
            shards=attn_hook.Shards(sp, sp.padded(mask, L, False), full_positions),
        )
        out = backbone(
            input_ids=sp.local(ids, L),
            position_ids=ctx.positions,
            use_cache=False,
            grpo_mem_ctx=attn_hook.context_token(ctx),
        )
        kv = {i: (attn_hook.keep_alive(k, ctx), attn_hook.keep_alive(v, ctx)) for i, (k, v) in ctx.capture.items()}
        hidden = attn_hook.keep_alive(out.last_hidden_state, ctx)
        last = torch.tensor(lengths, device=device) - 1
        owner = last // L
        picked = hidden[torch.arange(len(lengths), device=device), last % L]
        picked = picked * (owner == sp.rank).to(picked.dtype)[:, None]
        states = PromptStates(kv={i: kv[i] for i in sorted(kv)}, last_hidden=picked)
        self._register(_Pass(spec=spec, mask=ctx.shards.mask, positions=full_positions, owner=owner), states)

    def _leaf_hidden(self, leaves: list[int], views) -> torch.Tensor:
        """(B, H) final hidden state of each row's last prompt token (its leaf node's last token)."""
        sources = self._sources(leaves, self.current, views)
        parts = [states.last_hidden.index_select(0, rows.to(states.last_hidden.device)) for states, _, rows in sources]
        hidden = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
        order = torch.cat([readers for _, readers, _ in sources])
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[order] = torch.arange(len(order))
        return hidden.index_select(0, inverse.to(hidden.device))

    @staticmethod
    def _router_logits(out, tokens: int, ctx) -> tuple[torch.Tensor, ...]:
        """A pass's per-layer router logits, holding its completion context ``ctx`` (if any) like its other outputs."""
        from . import router

        logits = router.router_logits_of(out, tokens)
        return logits if ctx is None else tuple(attn_hook.keep_alive(z, ctx) for z in logits)

    def _completion_pass(self, backbone, leaves, completion_ids, completion_mask, width: int, views):
        """(B, width, H) final hidden states of completion tokens ``0 … width − 1`` (they predict tokens
        1 … width) and their per-layer router logits (``()`` unless ``record_router``); at the positions the
        micro-batch's input provider gives, if it gives any."""
        device = completion_ids.device
        trie = self.plan.trie
        ends = torch.tensor([trie.nodes[leaf].end for leaf in leaves], dtype=torch.long, device=device)
        ids, key_mask, shards = completion_ids[:, :width], completion_mask[:, :width].bool(), None
        if self.sp is not None:  # this rank's shard of the completion tokens (``sequence_parallel``)
            sp, L = self.sp, self.sp.shard(width)
            positions = ends[:, None] + torch.arange(sp.size * L, device=device)
            shards = attn_hook.Shards(sp, sp.padded(key_mask, L, False), positions)
            ids, key_mask, positions = sp.local(ids, L), sp.local(key_mask, L, False), sp.local(positions, L)
            width = sp.size * L
        else:
            positions = ends[:, None] + torch.arange(width, device=device)
        paths = [trie.path(leaf) for leaf in leaves]
        ctx = attn_hook.CompletionContext(
            regions=self._regions(paths, self.current, views, device),
            key_mask=key_mask,
            positions=positions,
            span=self._span(paths, max(trie.nodes[leaf].end for leaf in leaves) + width - 1),
            linear=self._linear(len(leaves), None, leaves, self.current, views),
            shards=shards,
        )
        rope_positions = None if self._inputs is None else self._inputs.completion_positions(width)
        if rope_positions is None:  # the model's own positions (M-RoPE) if the input provider gives them
            rope_positions = positions
        extra = {"output_router_logits": True} if self.record_router else {}
        out = backbone(
            input_ids=ids,
            position_ids=rope_positions,
            use_cache=False,
            grpo_mem_ctx=attn_hook.context_token(ctx),
            **extra,
        )
        router_logits = self._router_logits(out, ids.numel(), ctx) if self.record_router else ()
        return attn_hook.keep_alive(out.last_hidden_state, ctx), router_logits

    def _router_loss(self, causal_lm, leaves, views, completion_logits, completion_mask) -> torch.Tensor:
        """The micro-batch's MoE router loss: each pass it reads, its tokens weighted by how many of its rows' prompts
        pass through their node; the completion tokens (all C) by the completion mask (``grpo_mem.model.router``)."""
        from . import router

        counts: dict[int, torch.Tensor] = {}
        for leaf in leaves:
            for node in self.plan.trie.path(leaf):
                pass_id, row = self._node_pass[node]
                counts.setdefault(pass_id, torch.zeros(self._passes[pass_id].mask.shape[0]))[row] += 1
        terms = []
        for pass_id, rows in counts.items():
            states, mask = self._read(pass_id, self.current, views), self._passes[pass_id].mask
            if not states.router_logits:
                raise RuntimeError(
                    "the MoE router loss is asked for, but a prompt pass it reads was forwarded without router logits "
                    "(compute_aux_loss must be the same for every micro-batch of a window)"
                )
            terms.append(router.RouterTerm(states.router_logits, (mask * rows.to(mask.device)[:, None]).flatten()))
        terms.append(router.RouterTerm(completion_logits, completion_mask.flatten()))
        return router.load_balancing_loss(terms, router.router_loss_shape(causal_lm))

    def run(self, causal_lm, input_ids, attention_mask, options, *, lockstep: bool = False, inputs=None):
        """Score the window's next micro-batch (``input_ids``/``attention_mask`` (B, P + C), the rows planned for it)
        on the unwrapped ``causal_lm``; ``options``: ``ScoreOptions``. Returns (B, C) fp32 log-probs, entropies (or
        None) and, with ``options.compute_aux_loss``, the 0-d fp32 MoE router loss of the micro-batch's stock rows (else
        None), whose backward also backpropagates every pass released in this micro-batch.

        ``inputs``: the micro-batch's input provider, or None: what its passes add to their backbone calls
        (``vision_passes.VisionPasses``: image features and the model's own positions, per node span).

        ``lockstep``: make the module calls of ranks whose micro-batches differ (with C == 1 the completion pass still
        runs, on token 1, tied in with zero gradient; stand-in passes are tied in likewise).
        """
        C = options.logits_to_keep
        hidden, aux_loss = self._micro_batch(
            causal_lm, input_ids, attention_mask, C, lockstep, options.compute_aux_loss, inputs
        )
        ids, mask = input_ids[:, -C:], attention_mask[:, -C:]
        if self.sp is None:
            logps, entropy = completion_head(causal_lm, hidden, ids, mask, options)
            return logps, entropy, aux_loss
        return (*self._sharded_head(causal_lm, hidden, ids, mask, options), aux_loss)

    def _sharded_head(self, causal_lm, hidden, ids, mask, options):
        """Under sequence parallelism: this rank's completion positions through the head (position 0 where this rank
        holds the row's last prompt token, then its shard of positions 1 … C − 1), then the (B, C) log-probs and
        entropies of every rank (``sequence_parallel.gather_scores``)."""
        sp, C = self.sp, ids.shape[1]
        owned = self._owned.to(mask.device)
        first_mask = mask[:, :1] * owned[:, None].to(mask.dtype)
        L = hidden.shape[1] - 1
        ids = torch.cat([ids[:, :1], sp.local(ids[:, 1:], L)], dim=1) if L else ids[:, :1]
        mask = torch.cat([first_mask, sp.local(mask[:, 1:], L)], dim=1) if L else first_mask
        logps, entropy = completion_head(causal_lm, hidden, ids, mask, options)
        entropy = None if entropy is None else gather_scores(entropy, sp, C)
        return gather_scores(logps, sp, C), entropy

    def _leaf_owned(self, leaves: list[int]) -> torch.Tensor:
        """(B,) bool: whether this rank holds each row's last prompt token (its leaf pass's ``owner``)."""
        owned = []
        for leaf in leaves:
            pass_id, row = self._node_pass[leaf]
            owned.append(bool(self._passes[pass_id].owner[row] == self.sp.rank))
        return torch.tensor(owned)

    def hidden_states(self, causal_lm, input_ids, attention_mask, logits_to_keep: int, *, lockstep: bool = False):
        """The LM head's input for the window's next micro-batch: (B, C, H) final hidden states (the backbone's
        ``last_hidden_state``, final norm applied) at positions P − 1 … P + C − 2, which predict the C completion
        tokens; C = ``logits_to_keep``, dtype the backbone's. Equals ``causal_lm.base_model(input_ids,
        attention_mask).last_hidden_state[:, -C - 1 : -1]``, each prompt pass run once; its backward also
        backpropagates every pass released in this micro-batch. ``run`` applies the head to it; ``lockstep`` as there.
        """
        return self._micro_batch(causal_lm, input_ids, attention_mask, logits_to_keep, lockstep, False)[0]

    def _micro_batch(self, causal_lm, input_ids, attention_mask, C: int, lockstep: bool, aux: bool, inputs=None):
        """(``hidden_states``' result, the micro-batch's router loss when ``aux`` else None), the passes taking what
        the input provider ``inputs`` adds (``run``); advances the window."""
        self.record_router = aux
        P = input_ids.shape[1] - C
        completion_ids, completion_mask = input_ids[:, P:], attention_mask[:, P:]
        leaves = self.plan.leaves(self.current)
        backbone = causal_lm.base_model
        attn_hook.take_over(causal_lm)
        self._linear_layers = attn_hook.has_linear(causal_lm)
        views: dict[int, PromptStates] = {}  # kept passes released in this micro-batch
        self._inputs = inputs
        for spec in self.plan.passes_at(self.current):
            self._forward_pass(backbone, spec, views, input_ids.device)
        hidden = [self._leaf_hidden(leaves, views).unsqueeze(1)]
        width = completion_width(C, lockstep=lockstep, router=aux)
        if width:
            out, completion_router = self._completion_pass(
                backbone, leaves, completion_ids, completion_mask, width, views
            )
            if C > 1:
                hidden.append(out if self.sp is not None else out[:, : C - 1])
            else:
                hidden[0] = tie(hidden[0], [out])
        stand_ins = [p.states.last_hidden for p in self._passes.values() if not p.spec.nodes and not p.spec.kept]
        hidden = tie(torch.cat(hidden, dim=1), stand_ins)
        if fsdp_wrapped(causal_lm):
            # FSDP unshards a wrapped layer for backward in a hook on the outputs of its call. A trie node that no row
            # ends in is read only through its K/V (linear states, router logits) taken inside its layers, so its
            # output gets no gradient and its top layer's backward would run on resharded parameters (freed storage;
            # under checkpointing, a recompute with sharded ones). Its output joins the backward with no gradient:
            # the hooks run first, and torch's own ops compute nothing for it (a deeper node's multi-region attention
            # runs its backward on zeros). A kept pass's output joins its release micro-batch's backward through
            # ``PromptStore.release`` (with zero gradient).
            hidden = touch(
                hidden, [p.states.last_hidden for p in self._passes.values() if p.spec.nodes and not p.spec.kept]
            )
        hidden = self._flush(hidden)
        if self.sp is not None:
            self._owned = self._leaf_owned(leaves)
        aux_loss = self._router_loss(causal_lm, leaves, views, completion_router, completion_mask) if aux else None
        self._finish_micro_batch()
        return hidden, aux_loss

    def _flush(self, anchor: torch.Tensor) -> torch.Tensor:
        """``anchor`` carrying every kept pass released in this micro-batch that nothing in it read."""
        return self.store.flush_into(anchor, None if self.current >= self.plan.last else self.current)

    def _finish_micro_batch(self) -> None:
        """Drop the passes released in this micro-batch (their graphs live in its output); advance."""
        released = [i for i, p in self._passes.items() if self._release(p) <= self.current]
        for pass_id in released:
            del self._passes[pass_id]
        self._node_pass = {n: v for n, v in self._node_pass.items() if v[0] in self._passes}
        self._inputs = None
        self.current += 1

    def skip(self, anchor: torch.Tensor) -> torch.Tensor:
        """Pass over the next micro-batch, scored elsewhere (it shares nothing: ``WindowPlan.shares`` is False); the
        passes released in it are sent into ``anchor``'s backward."""
        if anchor.requires_grad:
            anchor = self._flush(anchor)
        self._finish_micro_batch()
        return anchor

    def abandon(self, anchor: torch.Tensor | None) -> torch.Tensor | None:
        """Stop sharing: every kept pass is sent into ``anchor``'s backward (the gradient its readers so far left on
        its leaves), or discarded when there is no anchor (nothing was backpropagated through it then either)."""
        if anchor is not None and anchor.requires_grad:
            anchor = self.store.flush_into(anchor)
        self.store.discard()
        self._passes.clear()
        self._node_pass.clear()
        self.current = self.plan.last + 1
        return anchor

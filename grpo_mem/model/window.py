"""Executing a window's plan: node passes, the completion pass, and the head, micro-batch by micro-batch.

Each ``PassSpec`` of the plan goes through the model once, with gradients, at positions ``start … start + len − 1`` of
its nodes (a node's ``start`` is the number of tokens before it on its prompt's path; in group mode, a prompt's left
padding, so it sits where stock TRL puts it): a root pass is a plain causal pass whose attention records its K/V, a
deeper pass attends to every ancestor's recorded K/V in place plus its own causal K/V
(``grpo_mem.ops.multi_region_attention``) and records its own. The completions then run as one pass at positions
``end … end + C − 2`` (``end``: where the row's prompt ends) attending to every node on their prompt's path plus their own
tokens. Every query-key pair keeps the position difference of stock TRL's left-padded layout, so RoPE scores are the
same up to the rounding of the rotation (exactly stock's positions in group mode).

A kept pass (read by a later micro-batch) lives in the window's ``PromptStore`` until its release micro-batch; which
states a reader gets is decided in one place, ``Window._read``. This module knows transformers, not TRL.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from . import attention_hook as attn_hook
from .head import completion_head
from .plan import PassSpec, WindowPlan
from .store import PromptStates, PromptStore

__all__ = ["Window"]


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


def tie(x: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """``x`` unchanged in value; the backward of ``x`` also runs through ``others`` (with zero gradient)."""
    others = [o for o in others if o.requires_grad]
    return _Tie.apply(x, *others) if others and x.requires_grad else x


@dataclass
class _Pass:
    """A pass forwarded in this window: its spec, key mask (n, S), and its states while it belongs to the current
    micro-batch (a kept pass's states live in the store)."""

    spec: PassSpec
    mask: torch.Tensor
    states: PromptStates | None = None


@dataclass
class Window:
    """A ``WindowPlan`` being executed; ``run`` scores its micro-batches in order.

    Attributes:
        plan: the window's plan.
        current: the micro-batch scored next.
        store: kept passes, until their release.
    """

    plan: WindowPlan
    current: int = 0
    store: PromptStore = field(default_factory=PromptStore)
    _passes: dict[int, _Pass] = field(default_factory=dict)
    _node_pass: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (pass id, row)
    _ids: itertools.count = field(default_factory=itertools.count)
    _inputs: object = None  # the current micro-batch's input provider (``run``'s ``inputs``)

    @property
    def done(self) -> bool:
        return self.current > self.plan.last

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
            regions.append(attn_hook.Region(kv=dict(enumerate(states.kv)), index=index.to(device),
                                            mask=self._passes[pass_id].mask))  # fmt: skip
        return regions

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

    def _pass_inputs(self, spec: PassSpec, width: int) -> dict:
        """Extra backbone kwargs of a pass from the micro-batch's input provider (``multimodal.VisionPasses``: image
        features, the model's positions), asked for the first row of the micro-batch that ends at each node."""
        if self._inputs is None or not spec.nodes:
            return {}
        leaves = self.plan.leaves(self.current)
        return self._inputs.prompt_pass([leaves.index(n) for n in spec.nodes], width)

    def _forward_pass(self, backbone, spec: PassSpec, views, device) -> None:
        """Forward one pass of the schedule; register its nodes (in the store if kept)."""
        ids, mask, positions, lengths = self._layout(spec.nodes, device)
        extra = self._pass_inputs(spec, ids.shape[1])
        positions = extra.pop("position_ids", positions)
        if spec.depth == 0 or not spec.nodes:
            capture = attn_hook.PromptCapture()
            out = backbone(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=False,
                           grpo_mem_ctx=attn_hook.context_token(capture), **extra)  # fmt: skip
            hidden, kv = out.last_hidden_state, capture.kv
        else:
            ancestors = [self.plan.trie.path(n)[:-1] for n in spec.nodes]
            regions = self._regions(ancestors, spec.release, views, device)
            ctx = attn_hook.CompletionContext(regions=regions, key_mask=mask, capture={})
            out = backbone(input_ids=ids, position_ids=positions, use_cache=False,
                           grpo_mem_ctx=attn_hook.context_token(ctx), **extra)  # fmt: skip
            # whatever reads this pass (its K/V, its last hidden state) holds its context, which the replay of its
            # checkpointed layers in backward looks up
            hidden = attn_hook.keep_alive(out.last_hidden_state, ctx)
            kv = {i: (attn_hook.keep_alive(k, ctx), attn_hook.keep_alive(v, ctx)) for i, (k, v) in ctx.capture.items()}
        last = hidden[torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device) - 1]
        states = PromptStates(kv=[kv[i] for i in sorted(kv)], last_hidden=last)
        pass_id = next(self._ids)
        self._passes[pass_id] = _Pass(spec=spec, mask=mask, states=None if spec.kept else states)
        if spec.kept:
            self.store.keep(pass_id, states, spec.release)
        for row, n in enumerate(spec.nodes):
            self._node_pass[n] = (pass_id, row)

    def _leaf_hidden(self, leaves: list[int], views) -> torch.Tensor:
        """(B, H) final hidden state of each row's last prompt token (its leaf node's last token)."""
        by_pass: dict[int, list[tuple[int, int]]] = {}
        for b, node in enumerate(leaves):
            pass_id, row = self._node_pass[node]
            by_pass.setdefault(pass_id, []).append((b, row))
        parts, order = [], []
        for pass_id, items in by_pass.items():
            states = self._read(pass_id, self.current, views)
            rows = torch.tensor([r for _, r in items], device=states.last_hidden.device)
            parts.append(states.last_hidden.index_select(0, rows))
            order += [b for b, _ in items]
        hidden = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[order] = torch.arange(len(order))
        return hidden.index_select(0, inverse.to(hidden.device))

    def _completion_pass(self, backbone, leaves, completion_ids, completion_mask, width: int, views):
        """(B, width, H) final hidden states of completion tokens ``0 … width − 1``, which predict tokens 1 … width;
        at the positions the micro-batch's input provider gives, if it gives any."""
        device = completion_ids.device
        trie = self.plan.trie
        ctx = attn_hook.CompletionContext(
            regions=self._regions([trie.path(leaf) for leaf in leaves], self.current, views, device),
            key_mask=completion_mask[:, :width].bool(),
        )
        positions = None if self._inputs is None else self._inputs.completion_positions(width)
        if positions is None:
            ends = torch.tensor([trie.nodes[leaf].end for leaf in leaves], dtype=torch.long, device=device)
            positions = ends[:, None] + torch.arange(width, device=device)
        out = backbone(input_ids=completion_ids[:, :width], position_ids=positions, use_cache=False,
                       grpo_mem_ctx=attn_hook.context_token(ctx))  # fmt: skip
        return attn_hook.keep_alive(out.last_hidden_state, ctx)

    def run(self, causal_lm, input_ids, attention_mask, options, *, lockstep: bool = False, inputs=None):
        """Score the window's next micro-batch (``input_ids``/``attention_mask`` (B, P + C), the rows planned for it)
        on the unwrapped ``causal_lm``; ``options``: ``ScoreOptions``. Returns (B, C) fp32 log-probs and entropies
        (or None), whose backward also backpropagates every pass released in this micro-batch.

        ``inputs``: the micro-batch's input provider, or None: what its passes add to their backbone calls
        (``multimodal.VisionPasses``: image features and the model's own positions; group-mode plans only).

        ``lockstep``: make the module calls of ranks whose micro-batches differ (with C == 1 the completion pass still
        runs, on token 1, tied in with zero gradient; stand-in passes are tied in likewise).
        """
        C = options.logits_to_keep
        P = input_ids.shape[1] - C
        completion_ids, completion_mask = input_ids[:, P:], attention_mask[:, P:]
        leaves = self.plan.leaves(self.current)
        backbone = causal_lm.base_model
        attn_hook.take_over(causal_lm)
        views: dict[int, PromptStates] = {}  # kept passes released in this micro-batch
        self._inputs = inputs
        for spec in self.plan.passes_at(self.current):
            self._forward_pass(backbone, spec, views, input_ids.device)
        hidden = [self._leaf_hidden(leaves, views).unsqueeze(1)]
        width = C - 1 if C > 1 or not lockstep else 1
        if width:
            out = self._completion_pass(backbone, leaves, completion_ids, completion_mask, width, views)
            if C > 1:
                hidden.append(out)
            else:
                hidden[0] = tie(hidden[0], [out])
        stand_ins = [p.states.last_hidden for p in self._passes.values() if not p.spec.nodes and not p.spec.kept]
        hidden = tie(torch.cat(hidden, dim=1), stand_ins)
        logps, entropy = completion_head(causal_lm, hidden, completion_ids, completion_mask, options)
        logps = self._flush(logps)
        self._finish_micro_batch()
        return logps, entropy

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

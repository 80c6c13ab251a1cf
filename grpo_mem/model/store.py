"""Prompt passes kept across the micro-batches of one optimizer step, so that each is forwarded and backpropagated once.

A pass whose nodes (prompts, or trie nodes) are read by several micro-batches of a window is forwarded in the first
of them and kept here until its release micro-batch, the last one that reads it. Earlier micro-batches read detached
copies (leaves) whose ``.grad`` sums their gradient; the release micro-batch reads the real states through
``_AddStoredGrad``, so the pass's graph is traversed once, with the whole window's gradient, inside that micro-batch's
backward call. A pass nobody reads at its release is sent into that micro-batch's output by ``flush_into``; ``tie``
and ``touch`` join other graphs to an output the same way, with zero or no gradient.
Parameters must not change within a window (they do not between optimizer steps), which keeps this exact. This module
knows torch only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .plan import PassSpec, to_device


@dataclass
class PromptStates:
    """What readers need of a pass, per row (node) of it.

    Attributes:
        kv: per attention layer index, post-RoPE ``(K, V)`` of shape (n, kv_heads, S, head_dim).
        last_hidden: (n, H), the final hidden state of each row's last real token, which predicts the next token
            (completion token 1 for a prompt's leaf).
        extras: what the pass extensions recorded (``window.PassExtension.record``), by extension name, each per
            layer index a tuple of tensors: ``"linear"``, ``(conv, recurrent)`` at each row's last real token
            (``grpo_mem.model.linear_attention``); ``"router"``, ``(logits,)`` (n*S, E) of the pass's tokens when the
            MoE router loss is asked for (``grpo_mem.model.router``). Empty for a plain text pass.
    """

    kv: dict[int, tuple[torch.Tensor, ...]]
    last_hidden: torch.Tensor
    extras: dict[str, dict[int, tuple[torch.Tensor, ...]]] = field(default_factory=dict)

    def _groups(self) -> list[dict[int, tuple[torch.Tensor, ...]]]:
        return [self.kv] + [self.extras[name] for name in sorted(self.extras)]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the states, in a fixed order (``like``'s)."""
        return [t for group in self._groups() for i in sorted(group) for t in group[i]] + [self.last_hidden]

    def like(self, tensors) -> PromptStates:
        """States of the same layers holding ``tensors`` (in the order of ``tensors()``)."""
        it = iter(tensors)
        kv, *extras = [{i: tuple(next(it) for _ in group[i]) for i in sorted(group)} for group in self._groups()]
        return PromptStates(kv=kv, last_hidden=next(it), extras=dict(zip(sorted(self.extras), extras)))


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


def _grad_or_zeros(leaf: torch.Tensor) -> torch.Tensor:
    """A leaf's summed gradient; zeros when nothing reached it, so that the pass's backward still runs (sharded ranks
    count on every pass being traversed)."""
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


class _AddStoredGrad(torch.autograd.Function):
    """Identity on the real states; backward adds the gradient earlier micro-batches left on the leaves."""

    @staticmethod
    def forward(ctx, n, *tensors):
        ctx.leaves = tensors[n:]
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        out = [
            g if leaf.grad is None else (leaf.grad if g is None else g + leaf.grad)
            for g, leaf in zip(grads, ctx.leaves)
        ]
        return (None, *out, *([None] * len(ctx.leaves)))


class _FlushStored(torch.autograd.Function):
    """Identity on ``anchor`` (an output of the release micro-batch); backward also sends each flushed pass's stored
    gradient into its graph, inside that micro-batch's backward call (where DDP synchronises gradients)."""

    @staticmethod
    def forward(ctx, anchor, n, *tensors):
        ctx.leaves = tensors[n:]
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, *(_grad_or_zeros(leaf) for leaf in ctx.leaves), *([None] * len(ctx.leaves)))


class PromptStore:
    """Passes kept for later micro-batches of a window, keyed by pass id, each with its release micro-batch."""

    def __init__(self):
        self._entries: dict[int, tuple[PromptStates, PromptStates, int]] = {}  # id -> (real, leaves, release)

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, key: int, real: PromptStates, release: int) -> None:
        """Keep ``real`` until micro-batch ``release``; readers before then get detached leaves."""
        leaves = real.like(t.detach().requires_grad_(t.requires_grad) for t in real.tensors())
        self._entries[key] = (real, leaves, release)

    def leaves(self, key: int) -> PromptStates:
        """Detached copies of the states, for a reader whose graph is backpropagated before the release."""
        return self._entries[key][1]

    def real(self, key: int) -> PromptStates:
        """The states themselves, for a kept pass built on them and released in the same micro-batch."""
        return self._entries[key][0]

    def release(self, key: int) -> PromptStates:
        """The states for the release micro-batch: their backward adds the leaves' stored gradient. Removes the entry."""
        real, leaves, _ = self._entries.pop(key)
        tensors = real.tensors()
        return real.like(_AddStoredGrad.apply(len(tensors), *tensors, *leaves.tensors()))

    def flush_into(self, anchor: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        """``anchor`` unchanged in value, carrying in its backward every pass whose release is ``<= upto`` (every
        pass if None); those entries are removed."""
        due = [key for key, (_, _, release) in self._entries.items() if upto is None or release <= upto]
        reals, leaves = [], []
        for key in due:
            real, leaf, _ = self._entries.pop(key)
            reals += real.tensors()
            leaves += leaf.tensors()
        if not reals:
            return anchor
        return _FlushStored.apply(anchor, len(reals), *reals, *leaves)

    def discard(self) -> int:
        """Drop every entry (their graphs are never backpropagated); returns how many there were."""
        n = len(self._entries)
        self._entries.clear()
        return n


@dataclass
class ForwardedPass:
    """A pass forwarded in a window: its spec, key mask and positions (n, S) (under sequence parallelism, of all
    shards), its states while it belongs to the current micro-batch (a kept pass's live in the ``PromptStore``), and
    under sequence parallelism ``owner`` (n,): the rank holding each row's last token."""

    spec: PassSpec
    mask: torch.Tensor
    positions: torch.Tensor
    states: PromptStates | None = None
    owner: torch.Tensor | None = None


class PassTable:
    """The passes forwarded in a window: which pass holds each trie node, and the states a reader gets of it.

    Readers read during a micro-batch ``mb`` (``window.MicroBatch``): ``mb.index`` is the micro-batch being run,
    ``mb.last`` the window's last (a pass's release moves to it when the window is cut short), ``mb.views`` the kept
    passes released in it as read. Attributes: ``store``, the kept passes; ``passes``, pass id -> ``ForwardedPass``."""

    def __init__(self):
        self.store = PromptStore()
        self.passes: dict[int, ForwardedPass] = {}
        self._node_pass: dict[int, tuple[int, int]] = {}  # node -> (pass id, row)
        self._ids = itertools.count()

    def register(self, p: ForwardedPass, states: PromptStates) -> None:
        """Make a forwarded pass readable: its nodes point to it, its states are its own or (kept) the store's."""
        pass_id = next(self._ids)
        p.states = None if p.spec.kept else states
        self.passes[pass_id] = p
        if p.spec.kept:
            self.store.keep(pass_id, states, p.spec.release)
        for row, n in enumerate(p.spec.nodes):
            self._node_pass[n] = (pass_id, row)

    def locate(self, node: int) -> tuple[int, int]:
        """(pass id, row) of the pass holding ``node``."""
        return self._node_pass[node]

    def read(self, pass_id: int, reader_release: int, mb) -> PromptStates:
        """The states of a pass as a reader released at ``reader_release`` gets them: a pass of this micro-batch, its
        own; a kept pass released now, the released view (one per micro-batch, cached in ``mb.views``); a kept pass
        released together with the reader (a kept pass built on it), its real states; otherwise detached leaves."""
        p = self.passes[pass_id]
        if not p.spec.kept:
            return p.states
        release = min(p.spec.release, mb.last)
        if release == mb.index:
            if pass_id not in mb.views:
                mb.views[pass_id] = self.store.release(pass_id)
            return mb.views[pass_id]
        return self.store.real(pass_id) if reader_release == release else self.store.leaves(pass_id)

    def sources(self, nodes: list[int | None], reader_release: int, mb) -> list:
        """Per pass holding some of ``nodes`` (one per reader row; None: nothing): (its states as ``read`` gives them,
        reader rows (k,) int64, its rows (k,) int64), index tensors on the CPU."""
        by_pass: dict[int, list[tuple[int, int]]] = {}
        for b, node in enumerate(nodes):
            if node is not None:
                pass_id, row = self._node_pass[node]
                by_pass.setdefault(pass_id, []).append((b, row))
        return [
            (
                self.read(i, reader_release, mb),
                torch.tensor([b for b, _ in rows]),
                torch.tensor([r for _, r in rows]),
            )
            for i, rows in by_pass.items()
        ]

    def regions(self, paths: list[list[int]], reader_release: int, mb) -> list:
        """Per pass holding nodes of ``paths`` (one root-first list per reader row): (its K/V as ``read`` gives them,
        (B,) int64 CPU index of the entry each row reads (−1: none), its key mask, its positions)."""
        rows: dict[int, dict[int, int]] = {}
        for b, path in enumerate(paths):
            for node in path:
                pass_id, row = self._node_pass[node]
                rows.setdefault(pass_id, {})[b] = row
        out = []
        for pass_id, reads in rows.items():
            index = torch.full((len(paths),), -1, dtype=torch.long)
            index[list(reads)] = torch.tensor(list(reads.values()), dtype=torch.long)
            p = self.passes[pass_id]
            out.append((self.read(pass_id, reader_release, mb).kv, index, p.mask, p.positions))
        return out

    def read_by_rows(self, paths: list[list[int]], mb) -> list:
        """Per pass holding nodes of ``paths`` (one per row of micro-batch ``mb``): (its states as ``read`` gives
        them, its key mask (n, S), (n,) fp32 how many of the paths pass through each of its nodes)."""
        counts: dict[int, torch.Tensor] = {}
        for path in paths:
            for node in path:
                pass_id, row = self._node_pass[node]
                counts.setdefault(pass_id, torch.zeros(self.passes[pass_id].mask.shape[0]))[row] += 1
        return [(self.read(i, mb.index, mb), self.passes[i].mask, n) for i, n in counts.items()]

    def gather_last_hidden(self, leaves: list[int], mb) -> torch.Tensor:
        """(B, H) final hidden state of the last token of each of the nodes ``leaves`` (one per row)."""
        sources = self.sources(leaves, mb.index, mb)
        parts = [
            states.last_hidden.index_select(0, to_device(rows, states.last_hidden.device))
            for states, _, rows in sources
        ]
        hidden = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
        order = torch.cat([readers for _, readers, _ in sources])
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[order] = torch.arange(len(order))
        return hidden.index_select(0, to_device(inverse, hidden.device))

    def unkept_outputs(self, *, stand_in: bool) -> list[torch.Tensor]:
        """The last hidden states of the current micro-batch's passes that are not kept, stand-ins or node passes as
        ``stand_in`` says (a kept pass joins its release micro-batch's backward through the store)."""
        return [
            p.states.last_hidden for p in self.passes.values() if not p.spec.kept and stand_in == (not p.spec.nodes)
        ]

    def drop_released(self, now: int, last: int) -> None:
        """Forget the passes released by micro-batch ``now`` (their graphs live in its output)."""
        for pass_id in [i for i, p in self.passes.items() if min(p.spec.release, last) <= now]:
            del self.passes[pass_id]
        self._node_pass = {n: v for n, v in self._node_pass.items() if v[0] in self.passes}

    def abandon(self, anchor: torch.Tensor | None) -> torch.Tensor | None:
        """Drop every pass; the kept ones are sent into ``anchor``'s backward (the gradient their readers so far left
        on their leaves), or discarded when there is no anchor. Returns ``anchor``, carrying them."""
        if anchor is not None and anchor.requires_grad:
            anchor = self.store.flush_into(anchor)
        self.store.discard()
        self.passes.clear()
        self._node_pass.clear()
        return anchor

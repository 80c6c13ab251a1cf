"""Prompt passes kept across the micro-batches of one optimizer step, so that each is forwarded and backpropagated once.

A pass whose nodes (prompts, or trie nodes) are read by several micro-batches of a window is forwarded in the first
of them and kept here until its release micro-batch, the last one that reads it. Earlier micro-batches read detached
copies (leaves) whose ``.grad`` sums their gradient; the release micro-batch reads the real states through
``_AddStoredGrad``, so the pass's graph is traversed once, with the whole window's gradient, inside that micro-batch's
backward call. A pass nobody reads at its release is sent into that micro-batch's output by ``flush_into``.
Parameters must not change within a window (they do not between optimizer steps), which keeps this exact. This module
knows torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptStates:
    """What readers need of a pass, per row (node) of it.

    Attributes:
        kv: per attention layer index, post-RoPE ``(K, V)`` of shape (n, kv_heads, S, head_dim).
        last_hidden: (n, H), the final hidden state of each row's last real token, which predicts the next token
            (completion token 1 for a prompt's leaf).
        linear: per linear-attention layer index, ``(conv, recurrent)`` at each row's last real token
            (``grpo_mem.model.linear_attention``); empty for a model without such layers.
        router_logits: when the MoE router loss is asked for, per MoE layer the router logits (n*S, E) of the
            pass's tokens (``grpo_mem.model.router``); else empty.
    """

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    last_hidden: torch.Tensor
    linear: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    router_logits: tuple[torch.Tensor, ...] = ()

    def tensors(self) -> list[torch.Tensor]:
        pairs = [self.kv[i] for i in sorted(self.kv)] + [self.linear[i] for i in sorted(self.linear)]
        return [t for pair in pairs for t in pair] + list(self.router_logits) + [self.last_hidden]

    def like(self, tensors) -> PromptStates:
        """States of the same layers holding ``tensors`` (in the order of ``tensors()``)."""
        it = iter(tensors)
        kv = {i: (next(it), next(it)) for i in sorted(self.kv)}
        linear = {i: (next(it), next(it)) for i in sorted(self.linear)}
        router_logits = tuple(next(it) for _ in self.router_logits)
        return PromptStates(kv=kv, last_hidden=next(it), linear=linear, router_logits=router_logits)


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

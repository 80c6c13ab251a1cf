"""Prompt passes kept across the micro-batches of one optimizer step, and what keeping them costs each micro-batch.

A group whose completions are spread over several micro-batches has its prompt forwarded once: ``PromptStore`` keeps
the prompt's states, earlier micro-batches attend to detached copies of them and leave their gradient there, and the
group's last micro-batch backpropagates the prompt graph once with the summed gradient (``_AddStoredGrad``).
``store_schedule`` counts the prompt passes and prompt backward traversals this makes per micro-batch, which ranks in
lockstep compare before sharing. This module knows torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[bytes]:
    """One hashable key per row: equal keys exactly when ``find_groups`` would group the rows together."""
    key = torch.where(prompt_mask.bool(), prompt_ids, torch.full_like(prompt_ids, -1))
    return [row.tobytes() for row in key.to(torch.int64).cpu().numpy()]


@dataclass
class PromptStates:
    """What completions need of a prompt pass: per-layer post-RoPE K/V (n, kv_heads, P, head_dim) and the last prompt
    position's final hidden state (n, H), which predicts completion token 1."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    last_hidden: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [t for pair in self.kv for t in pair] + [self.last_hidden]

    @classmethod
    def from_tensors(cls, tensors) -> PromptStates:
        tensors = list(tensors)
        return cls(kv=list(zip(tensors[:-1:2], tensors[1:-1:2])), last_hidden=tensors[-1])

    @classmethod
    def cat(cls, parts: list[PromptStates]) -> PromptStates:
        if len(parts) == 1:
            return parts[0]
        return cls.from_tensors(torch.cat(ts, 0) for ts in zip(*(p.tensors() for p in parts)))


class _AddStoredGrad(torch.autograd.Function):
    """Identity on the prompt states; backward adds the gradient earlier micro-batches left on their detached leaves,
    so the prompt graph is traversed once, with the whole group's gradient."""

    @staticmethod
    def forward(ctx, n, *tensors):
        ctx.leaves = tensors[n:]
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        out = [g if leaf.grad is None else (leaf.grad if g is None else g + leaf.grad) for g, leaf in zip(grads, ctx.leaves)]
        return (None, *out, *([None] * len(ctx.leaves)))


class _FlushStored(torch.autograd.Function):
    """Identity on ``anchor`` (an output of the window's last micro-batch); backward also sends each pending prompt's
    stored gradient into its graph, inside that micro-batch's backward call (where DDP synchronises gradients)."""

    @staticmethod
    def forward(ctx, anchor, n, *tensors):
        ctx.leaves = tensors[n:]
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, *(leaf.grad for leaf in ctx.leaves), *([None] * len(ctx.leaves)))


class PromptStore:
    """Prompt passes kept across the micro-batches of one optimizer step (gradient-accumulation window).

    A group whose completions are spread over several micro-batches has its prompt forwarded once, in the first of
    them. Until its last micro-batch, completions attend to detached copies (leaves) of the prompt states, whose
    ``.grad`` sums each micro-batch's contribution; the last one attends to the real states and its backward adds the
    stored sum, so the prompt graph is backpropagated once, inside that micro-batch's backward call. Whatever is still
    pending when the window ends is sent into its graph by ``flush_into`` on the window's last output. Parameters
    must not change within a window (they do not between optimizer steps), which keeps this exact.
    """

    def __init__(self):
        self.entries: dict[bytes, tuple[PromptStates, PromptStates]] = {}  # key -> (real, leaves)

    def __len__(self):
        return len(self.entries)

    def keep(self, key: bytes, real: PromptStates) -> PromptStates:
        leaves = PromptStates.from_tensors(t.detach().requires_grad_(t.requires_grad) for t in real.tensors())
        self.entries[key] = (real, leaves)
        return leaves

    def take(self, key: bytes, *, last: bool) -> PromptStates:
        real, leaves = self.entries[key]
        if not last:
            return leaves
        del self.entries[key]
        tensors = real.tensors()
        return PromptStates.from_tensors(_AddStoredGrad.apply(len(tensors), *tensors, *leaves.tensors()))

    def flush_into(self, anchor: torch.Tensor) -> torch.Tensor:
        """Return ``anchor`` unchanged in value, carrying every pending prompt's stored gradient in its backward."""
        reals, leaves = [], []
        for real, leaf in self.entries.values():
            reals += real.tensors()
            leaves += leaf.tensors()
        self.entries.clear()
        if not reals:
            return anchor
        return _FlushStored.apply(anchor, len(reals), *reals, *leaves)


def store_schedule(pending, micro_batches, *, closes: bool) -> list[tuple[int, int]]:
    """What sharing prompt passes through a ``PromptStore`` costs each of the window's remaining micro-batches.

    Args:
        pending: keys (``prompt_keys``) of prompts kept in the store by earlier micro-batches of the window.
        micro_batches: for the current and each later micro-batch of the window, the keys of its rows.
        closes: the last entry of ``micro_batches`` closes the window (pending prompts are flushed into its backward).

    Returns:
        One ``(prompt passes forwarded, prompt graphs backpropagated)`` per micro-batch: exactly the backbone calls
        ``_prompt_states`` makes and the prompt graphs its micro-batch's backward traverses. Ranks whose schedules
        are equal issue the same module calls and backward passes.
    """
    pending = set(pending)
    schedule = []
    for j, keys in enumerate(micro_batches):
        keys = set(keys)
        later = set().union(*map(set, micro_batches[j + 1 :]))
        fresh = {k for k in keys if k not in pending and k not in later}
        kept = {k for k in keys if k not in pending and k in later}
        taken = {k for k in keys if k in pending and k not in later}
        pending = (pending | kept) - taken
        graphs = bool(fresh) + len(taken)
        if closes and j == len(micro_batches) - 1:
            graphs += len(pending)
            pending = set()
        schedule.append((bool(fresh) + len(kept), graphs))
    return schedule

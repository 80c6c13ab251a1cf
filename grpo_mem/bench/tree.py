"""Inputs of the prefix-tree benchmarks (``benchmarks/bench_tree.py``, ``benchmarks/bench_fsdp.py --window``): one
gradient-accumulation window whose prompts share a system prompt, and the providers that score it micro-batch by
micro-batch."""

from __future__ import annotations

from typing import Sequence

from . import group
from .tokens import backbone_tokens


def own_lengths(U: int, q_min: int, q_max: int, seed: int) -> list[int]:
    """The U own-part lengths, uniform in [q_min, q_max], seeded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(q_min, q_max + 1, (U,), generator=g).tolist()


def ideal_ratio(S: int, Qs: Sequence[int], G: int, C: int) -> float:
    """Token-linear work per window, tree over group (:func:`~grpo_mem.bench.tokens.backbone_tokens`):
    (S + ΣQ + U·G·(C − 1)) / (U·S + ΣQ + U·G·(C − 1)), U = len(Qs) prompts of the system prompt (S tokens) and an
    own part of Q_u tokens, G completions of C tokens each."""
    U = len(Qs)
    return backbone_tokens(S + sum(Qs), U * G, C) / backbone_tokens(U * S + sum(Qs), U * G, C)


def make_window(S: int, Qs: Sequence[int], G: int, C: int, groups_per_mb: int, vocab: int, seed: int = 0):
    """``(input_ids, attention_mask, completion_mask)`` of the window, micro-batch after micro-batch.

    Prompt u = the system prompt (S random ids) + Q_u random ids, left-padded to P = S + max Q; G completions each.
    Micro-batch k holds prompts k·groups_per_mb … (k+1)·groups_per_mb − 1, its rows shuffled.
    Shapes: (U·G, P + C) int64, int64 0/1, (U·G, C) int64 0/1.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (S,), generator=g)
    P = S + max(Qs)
    ids, masks = [], []
    for q in Qs:
        prompt = torch.full((P,), group.PAD_ID, dtype=torch.long)
        prompt[P - S - q :] = torch.cat([system, torch.randint(3, vocab, (q,), generator=g)])
        pmask = torch.zeros(P, dtype=torch.long)
        pmask[P - S - q :] = 1
        for _ in range(G):
            comp, cmask = group.random_completion(C, vocab, g)
            ids.append(torch.cat([prompt, comp]))
            masks.append(torch.cat([pmask, cmask]))
    input_ids, attention_mask = torch.stack(ids), torch.stack(masks)
    rows = groups_per_mb * G
    perm = torch.cat([s + torch.randperm(rows, generator=g) for s in range(0, input_ids.shape[0], rows)])
    input_ids, attention_mask = input_ids[perm], attention_mask[perm]
    return input_ids, attention_mask, attention_mask[:, -C:]


def window_fn(provider: str, model, C: int, input_ids, attention_mask, rows: int, min_shared_tokens: int | None):
    """``fn(ids, mask)`` scoring the window's micro-batches (``rows`` rows each) in order; the grpo_mem providers
    through a ``SharingSession`` whose window is the whole of ``input_ids``
    (``grpo_mem.bench.group.make_window_fn``)."""
    if provider in ("trl", "full_seq"):
        return group.make_logprob_fn(provider, model, C)
    P = input_ids.shape[1] - C
    starts = range(0, input_ids.shape[0], rows)
    return group.make_window_fn(
        "grpo_mem" if provider == "grpo_mem_group" else provider,
        model,
        C,
        [input_ids[s : s + rows, :P] for s in starts],
        [attention_mask[s : s + rows, :P] for s in starts],
        min_shared_tokens=min_shared_tokens,
    )

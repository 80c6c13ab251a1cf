"""The prefix tree of a window's unique prompts: which token spans are forwarded once and read by many prompts.

Prompts of an RL batch often start with the same tokens (a system prompt, tool schemas, a few-shot block) and differ
only in a short question. ``PromptTrie`` builds the compressed trie (radix tree) of the unpadded prompts and keeps a
branch point as a node of its own only when it pays for its own forward pass: at least two distinct prompts pass
through it and its span is at least ``min_shared_tokens`` long. Shorter common spans stay inside their children, which
then forward them once each. Every unique prompt ends at a node (a leaf, or an inner node when the prompt is exactly a
shared prefix of others), and a node's positions start where its parent's end, so each row's tokens keep consecutive
positions from 0, the position differences stock TRL's left-padded layout gives.

This module knows torch only (token ids in, token lists out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A shared span shorter than this is forwarded inside each of its children instead of in a pass of its own. Measured
# with ``python benchmarks/bench_tree.py --threshold`` (docs/benchmarks.md, "Prefix-tree sharing"; 8-layer Llama-shaped model,
# 4 prompts of 4 groups sharing S tokens, G=8, C=64): a node of its own took 1.29x / 1.20x the time at S = 16 / 32
# and 0.88x / 0.82x at S = 64 / 128.
DEFAULT_MIN_SHARED_TOKENS = 64


@dataclass
class TrieNode:
    """One span of prompt tokens, forwarded once for every prompt that passes through it.

    Attributes:
        tokens: the span's token ids.
        start: position of its first token (the number of tokens of its ancestors).
        parent: index of the parent node in ``PromptTrie.nodes``, or None for a root.
        depth: number of ancestors.
        prompts: indices (into the prompts given to ``PromptTrie``) of the prompts that pass through it.
    """

    tokens: tuple[int, ...]
    start: int
    parent: int | None
    depth: int
    prompts: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class PromptTrie:
    """Compressed trie of token sequences, with shared nodes only where they pay for their pass.

    Args:
        prompts: unpadded token sequences (lists, tuples or 1-D int tensors); duplicates are allowed and end at the
            same node.
        min_shared_tokens: the shortest span that becomes a node shared by several prompts (>= 1).
        keys: per prompt, what the trie compares instead of its token ids, one hashable per token (same lengths as
            ``prompts``), or None (the ids). Prompts share a span where their keys agree; nodes hold the ids of the
            first prompt through them, so equal keys must imply equal ids (e.g. image tokens keyed by their image:
            ``multimodal.trie_keys``).

    Attributes:
        nodes: the nodes, parents before children, siblings in order of first appearance.
        leaf: per prompt, the node it ends at (its last token is that node's last token).

    Raises:
        ValueError: an empty prompt, ``min_shared_tokens < 1``, or keys of another length than their prompt.
    """

    def __init__(self, prompts, *, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS, keys=None):
        if isinstance(min_shared_tokens, bool) or not isinstance(min_shared_tokens, int) or min_shared_tokens < 1:
            raise ValueError(f"min_shared_tokens must be an int >= 1, got {min_shared_tokens!r}")
        seqs = [tuple(p.tolist()) if isinstance(p, torch.Tensor) else tuple(p) for p in prompts]
        for i, s in enumerate(seqs):
            if not s:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one real token")
        self._ids = seqs
        if keys is not None:
            keys = [tuple(k) for k in keys]
            lengths = [(len(k), len(s)) for k, s in zip(keys, seqs) if len(k) != len(s)]
            if len(keys) != len(seqs) or lengths:
                raise ValueError(
                    f"keys must give one key per token of each of the {len(seqs)} prompts, got "
                    f"{len(keys)} key sequences (lengths vs prompt lengths: {lengths[:3]})"
                )
            seqs = keys
        self.min_shared_tokens = min_shared_tokens
        self.nodes: list[TrieNode] = []
        self.leaf: list[int] = [-1] * len(seqs)
        self._seqs = seqs
        if seqs:
            self._build(list(range(len(seqs))), 0, None, 0)

    @classmethod
    def flat(cls, prompts, starts) -> PromptTrie:
        """Group sharing, the trie with no shared node: prompt i is one root node whose tokens sit at positions
        ``starts[i] …`` (stock TRL's: its left padding in the batch it first appears in). ``prompts`` are distinct.

        Raises:
            ValueError: an empty prompt, or ``starts`` of another length.
        """
        if len(starts) != len(prompts):
            raise ValueError(f"one start per prompt, got {len(starts)} starts for {len(prompts)} prompts")
        trie = cls([], min_shared_tokens=1)
        trie._seqs = trie._ids = [tuple(p.tolist()) if isinstance(p, torch.Tensor) else tuple(p) for p in prompts]
        for i, (seq, start) in enumerate(zip(trie._seqs, starts)):
            if not seq:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one real token")
            trie.nodes.append(TrieNode(tokens=seq, start=int(start), parent=None, depth=0, prompts=[i]))
        trie.leaf = list(range(len(trie._seqs)))
        return trie

    def _build(self, members: list[int], start: int, parent: int | None, depth: int) -> None:
        """Add the subtree of ``members`` (prompts equal on ``[:start]``, none of them ending at ``start``)."""
        seqs = self._seqs
        first = seqs[members[0]]
        if all(seqs[m] == first for m in members):  # one prompt (maybe repeated): its remaining span is one node
            self._add(members, start, len(first), parent, depth)
            return
        end = min(len(seqs[m]) for m in members)  # the members' longest common prefix from `start`
        for m in members[1:]:
            s, i = seqs[m], start
            while i < end and s[i] == first[i]:
                i += 1
            end = i
        if end - start >= self.min_shared_tokens:
            # a shared node: the prompts that are exactly this prefix end here, the others continue below it
            node = self._add(members, start, end, parent, depth)
            for part in self._split([m for m in members if len(seqs[m]) > end], end).values():
                self._build(part, end, node, depth + 1)
            return
        # too short to pay for a pass: each continuation (or the prompts ending at `end`) forwards it itself
        for part in self._split(members, end).values():
            self._build(part, start, parent, depth)

    def _split(self, members: list[int], at: int) -> dict:
        """``members`` by their token at position ``at`` (None: the prompt ends there), in order of appearance."""
        parts: dict = {}
        for m in members:
            s = self._seqs[m]
            parts.setdefault(s[at] if len(s) > at else None, []).append(m)
        return parts

    def _add(self, members: list[int], start: int, end: int, parent: int | None, depth: int) -> int:
        seq = self._ids[members[0]]
        self.nodes.append(
            TrieNode(tokens=seq[start:end], start=start, parent=parent, depth=depth, prompts=list(members))
        )
        index = len(self.nodes) - 1
        for m in members:
            if len(self._seqs[m]) == end:
                self.leaf[m] = index
        return index

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``."""
        out = []
        while node is not None:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def shared_nodes(self) -> list[int]:
        """Nodes read by more than one distinct prompt."""
        return [i for i, n in enumerate(self.nodes) if len({self._seqs[m] for m in n.prompts}) > 1]

    def __repr__(self):
        return f"PromptTrie({len(self._seqs)} prompts, {len(self.nodes)} nodes, {len(self.shared_nodes())} shared)"

"""The plan of a sharing window: the prefix trie of its prompts and the schedule of passes that forward it.

A window is a run of micro-batches within one optimizer step (parameters fixed). Prompts of an RL batch often start
with the same tokens (a system prompt, tool schemas, a few-shot block) and differ only in a short question. Their
unique prompts form a ``PromptTrie`` (a compressed trie, or radix tree): in ``"tree"`` mode a branch point is a node
of its own when at least two distinct prompts pass through it and it is at least ``min_shared_tokens`` long (shorter
common spans stay inside their children, which forward them once each); in ``"group"`` mode the trie has no shared node
and every prompt is one root, forwarded whole at stock TRL's positions. A node's positions start where its parent's
end, so each row's tokens keep the position differences of stock TRL's left-padded layout.

Each node is forwarded once, in the first micro-batch that reads it, and backpropagated once, in the last (its
release). Nodes of one depth with the same first and last micro-batch go through the model together: that set is a
``PassSpec``; the ordered tuple of them is the schedule, built with the plan and executed by
``grpo_mem.model.window.Window``. A plan is never edited: ``WindowPlan.align`` (sharded ranks in lockstep add stand-in
passes for the passes another rank runs) and ``WindowPlan.end_after`` (the optimizer steps early) return new plans.

Words used for prompt pieces across ``grpo_mem.model``: a *span* is a node's run of prompt tokens (``TrieNode.tokens``);
a *slice* ``(b, first, end)`` locates a node's span as tokens ``first … end − 1`` of row b's unpadded prompt
(``WindowPlan.slices``); a pass's *reach* is the largest query-key position difference in it (``WindowPlan.reach``),
which bounds what a sliding attention window can hide. This module knows torch only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from .host import check_left_padded, known_index, read_host, to_device  # noqa: F401  (re-exported)

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


SHARING_MODES = ("tree", "group")


def check_sharing(sharing) -> str:
    """``sharing`` if it is a known sharing mode; raises ``ValueError`` naming it otherwise."""
    if sharing not in SHARING_MODES:
        raise ValueError(f"sharing must be one of {SHARING_MODES}, got {sharing!r}")
    return sharing


@dataclass(frozen=True)
class PromptGrouping:
    """The rows of a micro-batch grouped by prompt, computed once and passed down.

    Two rows hold the same prompt when their masks and their ids at unmasked positions agree (ids in padding slots
    are ignored) and so do their extra keys, if given (e.g. their images: ``multimodal.RowImages``); rows of one
    prompt need not be adjacent.

    Attributes:
        keys: one hashable key per row, equal exactly for rows of one prompt.
        first: (U,) int64 CPU tensor, the first row of each unique prompt, in order of first appearance.
        inverse: (B,) int64 CPU tensor in [0, U), row b's unique prompt.
        extra: the rows' extra keys as given (None if none were).
    """

    keys: tuple
    first: torch.Tensor
    inverse: torch.Tensor
    extra: tuple | None = None
    host: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(
        cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, extra: list | None = None, host: tuple | None = None
    ) -> PromptGrouping:
        """Group the rows of (B, P) left-padded ``prompt_ids`` under their (B, P) 0/1 ``prompt_mask``; ``extra``: B
        hashable keys, more of each row's key (rows group only where these are equal too; an empty one adds
        nothing). ``host``: the two as int64 NumPy arrays if already read (``read_host``), else they are read here
        (one copy); kept as ``host`` for the plan."""
        ids, mask = host if host is not None else read_host(prompt_ids, prompt_mask)
        keys = tuple(row.tobytes() for row in np.where(mask.astype(bool), ids, -1))
        if extra is not None:
            if len(extra) != len(keys):
                raise ValueError(f"extra must hold one key per row ({len(keys)} rows), got {len(extra)}")
            extra = tuple(extra)
            keys = tuple((k, e) if e else k for k, e in zip(keys, extra))
        index: dict[bytes, int] = {}
        inverse = [index.setdefault(k, len(index)) for k in keys]
        first = [0] * len(index)
        for row in reversed(range(len(keys))):
            first[inverse[row]] = row
        first, inverse = torch.tensor(first, dtype=torch.long), torch.tensor(inverse, dtype=torch.long)
        return cls(keys, first, inverse, extra, (ids, mask))

    @classmethod
    def of_micro_batch(cls, input_ids, attention_mask, P: int, extra: list | None = None):
        """(the grouping of the micro-batch ``input_ids``/``attention_mask`` (B, P + C)'s prompts, the (n,) int64 flat
        indices b·C + t of its scored completion positions on the inputs' device), from its one read back from the
        device (prompt ids and whole mask). Raises ValueError for prompts that are not left-padded."""
        ids, mask = read_host(input_ids[:, :P], attention_mask)
        check_left_padded(mask[:, :P])
        grouping = cls.of(input_ids[:, :P], attention_mask[:, :P], extra, (ids, mask[:, :P]))
        return grouping, to_device(torch.from_numpy(np.flatnonzero(mask[:, P:])), input_ids.device)

    @property
    def repeats(self) -> bool:
        """Whether some prompt has several rows."""
        return self.first.numel() < len(self.keys)


def find_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)`` of ``PromptGrouping.of(prompt_ids, prompt_mask)``, on ``prompt_ids``' device."""
    grouping = PromptGrouping.of(prompt_ids, prompt_mask)
    return grouping.first.to(prompt_ids.device), grouping.inverse.to(prompt_ids.device)


@dataclass(frozen=True)
class PassSpec:
    """One backbone pass of a window's schedule.

    Attributes:
        micro_batch: the micro-batch (0-based, in the window) that forwards it.
        depth: depth of its nodes in the trie (0: roots, a plain causal pass).
        release: the micro-batch whose backward backpropagates it; equal to ``micro_batch`` for a pass nothing later
            reads.
        nodes: its trie nodes; empty for a stand-in pass (one token, no reader), which a rank in lockstep runs where
            another rank has a pass of this key.
    """

    micro_batch: int
    depth: int
    release: int
    nodes: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.micro_batch, self.depth, self.release)

    @property
    def kept(self) -> bool:
        return self.release > self.micro_batch


def completion_width(logits_to_keep: int, *, lockstep: bool, router: bool) -> int:
    """Completion tokens the completion pass runs for C = ``logits_to_keep``: C − 1 (the last one predicts nothing);
    all C when the MoE router loss is asked for (``router``: stock's loss counts the last token's router logits); 1
    when C == 1 in ``lockstep`` (ranks whose micro-batches differ make the same module calls; tied in with zero
    gradient), else 0 then."""
    if router:
        return logits_to_keep
    return logits_to_keep - 1 if logits_to_keep > 1 or not lockstep else 1


@dataclass(frozen=True)
class WindowPlan:
    """A window's trie and pass schedule; built with :meth:`build`, never edited (``align`` and ``end_after`` return
    new plans).

    Attributes:
        mode: ``"tree"`` or ``"group"``.
        trie: the window's ``PromptTrie`` (``PromptTrie.flat`` in group mode).
        prompt_of: prompt key (``PromptGrouping.keys``) -> index of the prompt in ``trie``.
        keys: per micro-batch, its rows' prompt keys.
        uses: per node, the micro-batches whose prompts pass through it.
        last: the window's last micro-batch.
        passes: the schedule, ordered by (micro-batch, depth, release): ``schedule(uses, trie, last)``.
    """

    mode: str
    trie: PromptTrie
    prompt_of: dict
    keys: list[tuple]
    uses: list[set[int]]
    last: int
    passes: tuple[PassSpec, ...]

    @classmethod
    def build(
        cls,
        mode: str,
        prompt_ids: list[torch.Tensor],
        prompt_masks: list[torch.Tensor],
        *,
        groupings: list[PromptGrouping] | None = None,
        min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS,
        trie_keys=None,
    ) -> WindowPlan:
        """The plan of the micro-batches whose prompts are ``prompt_ids[i]`` (B_i, P_i) left-padded under
        ``prompt_masks[i]``, in the order they will be scored; ``groupings[i]``: their grouping if already known.
        ``trie_keys(ids, extra) -> tuple``: tree mode, what the trie compares for a prompt of real ids ``ids`` (a
        list) whose row has the extra key ``extra`` (``PromptGrouping.extra``, None without), one key per token
        (``PromptTrie``'s ``keys``); None: the ids.

        Raises:
            ValueError: unknown mode, no micro-batch, lists of different lengths, a prompt with no real token,
                ``min_shared_tokens`` < 1.
        """
        check_sharing(mode)
        if not prompt_ids or len(prompt_ids) != len(prompt_masks):
            raise ValueError(
                f"a window needs one prompt mask per micro-batch, got {len(prompt_ids)} prompt tensors and "
                f"{len(prompt_masks)} masks"
            )
        if groupings is None:
            groupings = [PromptGrouping.of(ids, mask) for ids, mask in zip(prompt_ids, prompt_masks)]
        prompt_of: dict = {}
        tokens, starts, keys = [], [], []
        for ids, mask, grouping in zip(prompt_ids, prompt_masks, groupings):
            ids, mask = grouping.host if grouping.host is not None else read_host(ids, mask)
            firsts: dict = {}
            for row, key in enumerate(grouping.keys):  # the first row of each prompt (``grouping.first``, on the host)
                firsts.setdefault(key, row)
            for key, row in firsts.items():
                if key not in prompt_of:
                    prompt_of[key] = len(tokens)
                    real = mask[row].astype(bool)
                    tokens.append(ids[row][real].tolist())
                    starts.append(int(real.size - real.sum()))
                    if trie_keys is not None:
                        keys.append(trie_keys(tokens[-1], None if grouping.extra is None else grouping.extra[row]))
        if mode == "tree":
            trie = PromptTrie(tokens, min_shared_tokens=min_shared_tokens, keys=keys if trie_keys else None)
        else:
            trie = PromptTrie.flat(tokens, starts)
        uses: list[set[int]] = [set() for _ in trie.nodes]
        for j, grouping in enumerate(groupings):
            for key in set(grouping.keys):
                for node in trie.path(trie.leaf[prompt_of[key]]):
                    uses[node].add(j)
        last = len(groupings) - 1
        return cls(mode, trie, prompt_of, [g.keys for g in groupings], uses, last, schedule(uses, trie, last))

    def check_prompts(self, micro_batch: int, keys: tuple) -> None:
        """Raise ValueError unless ``keys`` (``PromptGrouping.keys``) are the prompts planned for ``micro_batch``."""
        planned = self.keys[micro_batch]
        if keys != planned:
            raise ValueError(
                f"micro-batch {micro_batch} of the window does not hold the prompts planned for it "
                f"({len(set(keys))} unique prompts in {len(keys)} rows, planned {len(set(planned))} in {len(planned)})"
            )

    def passes_at(self, micro_batch: int) -> list[PassSpec]:
        """The passes micro-batch ``micro_batch`` forwards, in order (depth first, then release)."""
        return [p for p in self.passes if p.micro_batch == micro_batch]

    def leaves(self, micro_batch: int) -> list[int]:
        """Per row of micro-batch ``micro_batch``, the trie node its prompt ends at."""
        return [self.trie.leaf[self.prompt_of[k]] for k in self.keys[micro_batch]]

    def shares(self, micro_batch: int) -> bool:
        """Whether scoring micro-batch ``micro_batch`` through the plan saves work or is needed: a node on its rows'
        paths is read by several of its rows' prompts or rows, or by another micro-batch."""
        keys = self.keys[micro_batch]
        if len(set(keys)) < len(keys):
            return True
        nodes = {n for leaf in self.leaves(micro_batch) for n in self.trie.path(leaf)}
        return any(len(self.uses[n]) > 1 or len(self.trie.nodes[n].prompts) > 1 for n in nodes)

    def tokens_at(self, micro_batch: int, completion_width: int) -> int:
        """Tokens the backbone forwards for micro-batch ``micro_batch``: its passes (rows x padded width; a stand-in
        is one token) plus its completion pass (rows x ``completion_width``)."""
        total = len(self.keys[micro_batch]) * completion_width
        for spec in self.passes_at(micro_batch):
            widths = [len(self.trie.nodes[n].tokens) for n in spec.nodes]
            total += len(widths) * max(widths) if widths else 1
        return total

    def pass_keys(self, micro_batch: int, images=None) -> tuple[list, list | None]:
        """The keys of micro-batch ``micro_batch``'s passes, and of those that run the vision tower given its bound
        image inputs ``images`` (``VisionPasses.images_of`` of their slices; None: no image inputs, and None for the
        second list)."""
        passes = self.passes_at(micro_batch)
        if images is None:
            return [p.key for p in passes], None
        vision = [p.key for p in passes if p.nodes and images.images_of(self.slices(micro_batch, p))]
        return [p.key for p in passes], vision

    def end_after(self, micro_batch: int) -> WindowPlan:
        """This plan with ``micro_batch`` as the window's last: later micro-batches are dropped from the schedule and
        every pass still to be released is released in it."""
        last = min(self.last, micro_batch)
        passes = tuple(
            PassSpec(p.micro_batch, p.depth, min(p.release, last), p.nodes)
            for p in self.passes
            if p.micro_batch <= last
        )
        return dataclasses.replace(self, last=last, passes=passes)

    def align(self, keys: set[tuple[int, int, int]]) -> WindowPlan:
        """This plan with a stand-in pass for every pass key in ``keys`` (the union over ranks in lockstep) it lacks,
        so that every rank makes the same backbone calls and backpropagates the same passes in each micro-batch."""
        mine = {p.key for p in self.passes}
        passes = tuple(sorted(self.passes + tuple(PassSpec(*k) for k in keys - mine), key=lambda p: p.key))
        return dataclasses.replace(self, passes=passes)

    def pass_tokens(self, spec: PassSpec, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """(ids, key mask, positions, lengths) of the pass ``spec``: its nodes' spans right-padded to the longest,
        (n, S) int64 / bool / int64 on ``device``, at the nodes' positions; a stand-in pass is one token (id 0 at
        position 0)."""
        nodes = [self.trie.nodes[n] for n in spec.nodes]
        lengths = [len(n.tokens) for n in nodes] or [1]
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
        starts = torch.tensor([n.start for n in nodes] or [0], dtype=torch.long)
        for i, length in enumerate(lengths):
            mask[i, :length] = True
        for i, node in enumerate(nodes):
            ids[i, : lengths[i]] = torch.tensor(node.tokens, dtype=torch.long)
        positions = starts[:, None] + torch.arange(max(lengths))
        return to_device(ids, device), to_device(mask, device), to_device(positions, device), lengths

    def reach(self, paths: list[list[int]], last: int) -> int:
        """The reach of a pass whose last query sits at position ``last`` and whose rows read the nodes ``paths``
        (one root-first path per row): the largest query-key position difference in it."""
        return last - min(self.trie.nodes[path[0]].start for path in paths)

    def slices(self, micro_batch: int, spec: PassSpec) -> list[tuple[int, int, int]]:
        """Per node of ``spec``, its slice ``(b, first, end)``: its span is tokens ``first … end − 1`` of the
        unpadded prompt of row b, the first row of micro-batch ``micro_batch`` through it (a node's tokens, images and
        positions are the same on every row through it: they depend on the prefix)."""
        reader: dict[int, int] = {}
        for b, leaf in enumerate(self.leaves(micro_batch)):
            for n in self.trie.path(leaf):
                reader.setdefault(n, b)
        out = []
        for n in spec.nodes:  # its offset in its prompt: its start less its root's (0 in tree, the padding in group)
            offset = self.trie.nodes[n].start - self.trie.nodes[self.trie.path(n)[0]].start
            out.append((reader[n], offset, offset + len(self.trie.nodes[n].tokens)))
        return out


def schedule(uses: list[set[int]], trie: PromptTrie, last: int) -> tuple[PassSpec, ...]:
    """The passes of nodes used by micro-batches ``uses`` (per node) of a window ending at ``last``.

    A node read by one micro-batch only is released there. A kept node (read by later micro-batches too) is released
    at its root's last use: a kept pass is built on its kept ancestors' real states, so their graphs must be
    backpropagated in the same call, whenever the window ends (``WindowPlan.end_after`` moves them together). Roots,
    and so every prompt in group mode, are released at their own last use.
    """
    release: list[int] = []
    by_key: dict[tuple[int, int, int], list[int]] = {}
    for node, used in enumerate(uses):  # parents come before their children
        first, end = (min(used), min(max(used), last)) if used else (last + 1, last + 1)
        parent = trie.nodes[node].parent
        release.append(release[parent] if end > first and parent is not None else end)
        if first <= last:
            by_key.setdefault((first, trie.nodes[node].depth, release[node]), []).append(node)
    return tuple(PassSpec(*key, tuple(nodes)) for key, nodes in sorted(by_key.items()))

"""The plan of a sharing window: which prompt spans go through the model in which pass, read by which micro-batch.

A window is a run of micro-batches within one optimizer step (parameters fixed). Its unique prompts form a
``PromptTrie``: in ``"tree"`` mode every span several prompts share is a node of its own; in ``"group"`` mode the trie
has no shared node and every prompt is one root, forwarded whole at stock TRL's positions. Each node is forwarded once,
in the first micro-batch that reads it, and backpropagated once, in the last (its release). Nodes of one depth with the
same first and last micro-batch go through the model together: that set is a ``PassSpec``, and the ordered list of
them is the window's schedule, built here once and executed by ``grpo_mem.model.window.Window``. Sharded ranks that must
make the same module calls align their schedules (``WindowPlan.align``): a pass one rank lacks, it runs as a stand-in.

This module knows torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .trie import DEFAULT_MIN_SHARED_TOKENS, PromptTrie

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

    @classmethod
    def of(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, extra: list | None = None) -> PromptGrouping:
        """Group the rows of (B, P) left-padded ``prompt_ids`` under their (B, P) 0/1 ``prompt_mask``; ``extra``: B
        hashable keys, more of each row's key (rows group only where these are equal too; an empty one adds
        nothing)."""
        key = torch.where(prompt_mask.bool(), prompt_ids, torch.full_like(prompt_ids, -1))
        keys = tuple(row.tobytes() for row in key.to(torch.int64).cpu().numpy())
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
        return cls(keys, torch.tensor(first, dtype=torch.long), torch.tensor(inverse, dtype=torch.long), extra)

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


@dataclass
class WindowPlan:
    """A window's trie and pass schedule.

    Build with :meth:`build`. Attributes:
        mode: ``"tree"`` or ``"group"``.
        trie: the window's ``PromptTrie`` (``PromptTrie.flat`` in group mode).
        prompt_of: prompt key (``PromptGrouping.keys``) -> index of the prompt in ``trie``.
        keys: per micro-batch, its rows' prompt keys.
        uses: per node, the micro-batches whose prompts pass through it.
        passes: the schedule, ordered by (micro-batch, depth, release).
        last: the window's last micro-batch (``end_after`` may move it earlier).
    """

    mode: str
    trie: PromptTrie
    prompt_of: dict
    keys: list[tuple]
    uses: list[set[int]]
    passes: list[PassSpec] = field(default_factory=list)
    last: int = 0

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
            for row in grouping.first.tolist():
                key = grouping.keys[row]
                if key not in prompt_of:
                    prompt_of[key] = len(tokens)
                    real = mask[row].bool()
                    tokens.append(ids[row][real].tolist())
                    starts.append(int(real.numel() - real.sum()))
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
        plan = cls(mode, trie, prompt_of, [g.keys for g in groupings], uses, last=len(groupings) - 1)
        plan._schedule()
        return plan

    def _schedule(self) -> None:
        """Passes from the nodes' first use and release (``last`` bounds both).

        A node read by one micro-batch only is released there. A kept node (read by later micro-batches too) is
        released at its root's last use: a kept pass is built on its kept ancestors' real states, so their graphs
        must be backpropagated in the same call, whenever the window ends (``end_after`` moves them together).
        Roots, and so every prompt in group mode, are released at their own last use.
        """
        release: list[int] = []
        by_key: dict[tuple[int, int, int], list[int]] = {}
        for node, used in enumerate(self.uses):  # parents come before their children
            first, last = (min(used), min(max(used), self.last)) if used else (self.last + 1, self.last + 1)
            parent = self.trie.nodes[node].parent
            release.append(release[parent] if last > first and parent is not None else last)
            if first <= self.last:
                by_key.setdefault((first, self.trie.nodes[node].depth, release[node]), []).append(node)
        self.passes = [PassSpec(*key, tuple(nodes)) for key, nodes in sorted(by_key.items())]

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

    def end_after(self, micro_batch: int) -> None:
        """Make ``micro_batch`` the window's last: later micro-batches are dropped from the schedule and every pass
        still to be released is released in it."""
        self.last = min(self.last, micro_batch)
        self.passes = [
            PassSpec(p.micro_batch, p.depth, min(p.release, self.last), p.nodes)
            for p in self.passes
            if p.micro_batch <= self.last
        ]

    def align(self, keys: set[tuple[int, int, int]]) -> None:
        """Add a stand-in pass for every pass key in ``keys`` (the union over ranks in lockstep) this plan lacks, so
        that every rank makes the same backbone calls and backpropagates the same passes in each micro-batch."""
        mine = {p.key for p in self.passes}
        self.passes = sorted(self.passes + [PassSpec(*k) for k in keys - mine], key=lambda p: p.key)

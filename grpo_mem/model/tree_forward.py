"""Prefix-tree group forward: every span shared by several prompts forwarded once, every level read in place.

The unique prompts of a window (one optimizer step's micro-batches, or one call) form a ``PromptTrie``. Each trie
node goes through the model once, with gradients, at positions ``start … start + len − 1``: a root in a plain causal
pass that records its K/V, a deeper node in a pass whose attention reads every ancestor's recorded K/V in place plus
its own causal K/V (``grpo_mem.ops.multi_region_attention``), recording its own. Completions then attend to every node
on their prompt's path plus their own tokens, at positions ``L_b … L_b + C − 2`` (``L_b`` the row's prompt length).
Every query-key pair keeps the position difference of stock TRL's left-padded layout, so RoPE scores are the same up
to the rounding of the rotation.

Across the micro-batches of a window, a node is forwarded in the first micro-batch that needs it. If a later one needs
it too, its pass is kept (``PromptStore``, keyed by pass): consumers in earlier micro-batches read detached copies
whose ``.grad`` sums their gradient; nodes kept for later micro-batches are built on their kept ancestors' real states,
so all kept graphs are backpropagated together, once, in the window's last micro-batch: the passes it reads through
``_AddStoredGrad``, the others flushed into its output. Parameters do not change within a window, which keeps this
exact. This module knows transformers, not TRL.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from . import attention_hook as attn_hook
from .head import completion_head
from .store import PromptStates, PromptStore, prompt_keys
from .trie import DEFAULT_MIN_SHARED_TOKENS, PromptTrie

__all__ = ["TreeWindow", "tree_logprobs"]


@dataclass
class _Pass:
    """One backbone pass over trie nodes of one depth: rows of its states are nodes, ``mask`` (n, S) their real
    positions. ``kept`` passes live in the window's store; the others belong to the micro-batch that made them."""

    mask: torch.Tensor
    kept: bool
    states: PromptStates | None = None  # fresh passes only


@dataclass
class TreeWindow:
    """The trie of a window's unique prompts and the node passes made so far.

    Build with :meth:`plan`; ``tree_logprobs`` scores the window's micro-batches in order through it.

    Attributes:
        trie: the window's ``PromptTrie``.
        prompt_of: prompt key (``prompt_keys``) -> index of the prompt in ``trie``.
        uses: per node, the micro-batches (0-based, in the window's order) whose prompts pass through it.
        last: index of the window's last micro-batch (``end_after`` may move it earlier).
        current: index of the micro-batch being scored next.
        store: kept passes (key: pass id), released in the window's last micro-batch.
        node_pass: node -> (pass id, row of the node in that pass).
        passes_forwarded: node passes run so far (for tests and benchmarks).
    """

    trie: PromptTrie
    prompt_of: dict[bytes, int]
    uses: list[set[int]]
    last: int
    current: int = 0
    store: PromptStore = field(default_factory=PromptStore)
    node_pass: dict[int, tuple[int, int]] = field(default_factory=dict)
    passes: dict[int, _Pass] = field(default_factory=dict)
    passes_forwarded: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def plan(cls, prompt_ids: list[torch.Tensor], prompt_masks: list[torch.Tensor], *, keys=None,
             min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS) -> TreeWindow:  # fmt: skip
        """The window of micro-batches whose prompts are ``prompt_ids[i]`` (B_i, P_i) left-padded under
        ``prompt_masks[i]``, in the order they will be scored; ``keys[i]``: their ``prompt_keys`` if the caller has
        them.

        Raises:
            ValueError: a prompt with no real token; ``min_shared_tokens`` < 1.
        """
        prompt_of: dict[bytes, int] = {}
        tokens, mb_prompts = [], []
        for i, (ids, mask) in enumerate(zip(prompt_ids, prompt_masks)):
            mine = set()
            for row, key in enumerate(prompt_keys(ids, mask) if keys is None else keys[i]):
                if key not in prompt_of:
                    prompt_of[key] = len(tokens)
                    tokens.append(ids[row][mask[row].bool()].tolist())
                mine.add(prompt_of[key])
            mb_prompts.append(mine)
        trie = PromptTrie(tokens, min_shared_tokens=min_shared_tokens)
        uses: list[set[int]] = [set() for _ in trie.nodes]
        for j, mine in enumerate(mb_prompts):
            for p in mine:
                for node in trie.path(trie.leaf[p]):
                    uses[node].add(j)
        return cls(trie=trie, prompt_of=prompt_of, uses=uses, last=len(prompt_ids) - 1)

    def shares(self, keys: list[bytes]) -> bool:
        """Whether scoring the next micro-batch (prompt keys ``keys``) through the tree saves work or is needed: a
        node on its prompts' paths is read by several prompts or micro-batches, or kept passes await release."""
        if self.current >= self.last and len(self.store):
            return True
        if len(set(keys)) < len(keys):  # a prompt repeats within the micro-batch
            return True
        nodes = {n for k in set(keys) for n in self.trie.path(self.trie.leaf[self.prompt_of[k]])}
        return any(len(self.uses[n]) > 1 or len(self.trie.nodes[n].prompts) > 1 for n in nodes)

    def end_after_current(self) -> None:
        """Make the micro-batch scored next the window's last: every kept pass is released in it."""
        self.last = min(self.last, self.current)

    # ------------------------------------------------------------------------------------------------------------------

    def _kept(self, node: int) -> bool:
        """Whether a node first forwarded now is read by a later micro-batch of the window."""
        return any(self.current < j <= self.last for j in self.uses[node])

    def _states(self, pass_id: int, real: bool, views: dict[int, PromptStates]) -> PromptStates:
        """The states of a pass that a consumer reads: a fresh pass's own; a kept pass's real states for a node kept
        alongside it (``real``), else its detached copies, or in the window's last micro-batch its released view."""
        p = self.passes[pass_id]
        if not p.kept:
            return p.states
        if real:
            return self.store.entries[pass_id][0]
        if self.current < self.last:
            return self.store.entries[pass_id][1]
        if pass_id not in views:
            views[pass_id] = self.store.take(pass_id, last=True)
        return views[pass_id]

    def _regions(self, paths: list[list[int]], real: bool, views, device) -> list[attn_hook.Region]:
        """One region per pass read by the consumers whose ancestor nodes are ``paths`` (one list per consumer)."""
        rows: dict[int, dict[int, int]] = {}
        for b, path in enumerate(paths):
            for node in path:
                pass_id, row = self.node_pass[node]
                rows.setdefault(pass_id, {})[b] = row
        regions = []
        for pass_id, reads in rows.items():
            index = torch.full((len(paths),), -1, dtype=torch.long)
            index[list(reads)] = torch.tensor(list(reads.values()), dtype=torch.long)
            states = self._states(pass_id, real, views)
            regions.append(attn_hook.Region(kv=dict(enumerate(states.kv)), index=index.to(device),
                                            mask=self.passes[pass_id].mask, dense=len(reads) == len(paths)))  # fmt: skip
        return regions

    def _forward_nodes(self, backbone, nodes: list[int], kept: bool, views, device) -> None:
        """One pass over ``nodes`` (all of one depth), registered in ``node_pass`` (and the store if ``kept``)."""
        trie = self.trie
        lengths = [len(trie.nodes[n].tokens) for n in nodes]
        S = max(lengths)
        ids = torch.zeros(len(nodes), S, dtype=torch.long)
        mask = torch.zeros(len(nodes), S, dtype=torch.bool)
        for i, n in enumerate(nodes):
            ids[i, : lengths[i]] = torch.tensor(trie.nodes[n].tokens, dtype=torch.long)
            mask[i, : lengths[i]] = True
        ids, mask = ids.to(device), mask.to(device)
        starts = torch.tensor([trie.nodes[n].start for n in nodes], dtype=torch.long, device=device)
        positions = starts[:, None] + torch.arange(S, device=device)
        if trie.nodes[nodes[0]].depth == 0:
            capture = attn_hook.PromptCapture()
            out = backbone(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=False,
                           grpo_mem_ctx=attn_hook.context_token(capture))  # fmt: skip
            hidden, kv = out.last_hidden_state, capture.kv
        else:
            ancestors = [trie.path(n)[:-1] for n in nodes]
            ctx = attn_hook.CompletionContext(regions=self._regions(ancestors, kept, views, device), key_mask=mask, capture={})
            out = backbone(input_ids=ids, position_ids=positions, use_cache=False,
                           grpo_mem_ctx=attn_hook.context_token(ctx))  # fmt: skip
            # whatever reads this pass (its K/V, its last hidden state) holds its context, which the replay of its
            # checkpointed layers in backward looks up
            hidden = attn_hook.keep_alive(out.last_hidden_state, ctx)
            kv = {i: (attn_hook.keep_alive(k, ctx), attn_hook.keep_alive(v, ctx)) for i, (k, v) in ctx.capture.items()}
        last = hidden[torch.arange(len(nodes), device=device), torch.tensor(lengths, device=device) - 1]
        states = PromptStates(kv=[kv[i] for i in sorted(kv)], last_hidden=last)
        pass_id = next(self._ids)
        self.passes_forwarded += 1
        self.passes[pass_id] = _Pass(mask=mask, kept=kept, states=None if kept else states)
        if kept:
            self.store.keep(pass_id, states)
        for row, n in enumerate(nodes):
            self.node_pass[n] = (pass_id, row)

    def _leaf_hidden(self, leaves: list[int], views) -> torch.Tensor:
        """(B, H) final hidden state of each row's last prompt token (its leaf node's last token)."""
        parts, order = [], []
        by_pass: dict[int, list[tuple[int, int]]] = {}
        for b, node in enumerate(leaves):
            pass_id, row = self.node_pass[node]
            by_pass.setdefault(pass_id, []).append((b, row))
        for pass_id, items in by_pass.items():
            states = self._states(pass_id, False, views)
            rows = torch.tensor([r for _, r in items], device=states.last_hidden.device)
            parts.append(states.last_hidden.index_select(0, rows))
            order += [b for b, _ in items]
        hidden = torch.cat(parts, 0)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[order] = torch.arange(len(order))
        return hidden.index_select(0, inverse.to(hidden.device))

    def finish_micro_batch(self) -> None:
        """Advance to the next micro-batch; drop the micro-batch's fresh passes (their graphs live in its output)."""
        for pass_id in [p for p, info in self.passes.items() if not info.kept]:
            del self.passes[pass_id]
        if self.current >= self.last:  # window done: every kept pass was released in this micro-batch's graph
            self.passes.clear()
            self.node_pass.clear()
        else:
            live = set(self.passes)
            self.node_pass = {n: v for n, v in self.node_pass.items() if v[0] in live}
        self.current += 1


def tree_logprobs(causal_lm, input_ids, attention_mask, request, window: TreeWindow | None = None):
    """The prefix-tree computation on an unwrapped causal LM; shapes as in ``grpo_mem.shared_prompt_logprobs``.

    ``window``: the sharing window this micro-batch belongs to (its next one), or None to share within this call
    only. The window's last micro-batch returns log-probs whose backward also completes every kept pass (the caller
    flushes the passes that micro-batch does not read with ``window.store.flush_into``).
    """
    C = request.logits_to_keep
    P = input_ids.shape[1] - C
    device = input_ids.device
    prompt_ids, prompt_mask = input_ids[:, :P], attention_mask[:, :P]
    completion_ids, completion_mask = input_ids[:, P:], attention_mask[:, P:]
    keys = request.prompt_keys if request.prompt_keys is not None else prompt_keys(prompt_ids, prompt_mask)
    if window is None:
        window = TreeWindow.plan([prompt_ids], [prompt_mask], keys=[keys])
    trie = window.trie
    leaves = [trie.leaf[window.prompt_of[k]] for k in keys]
    backbone = causal_lm.base_model
    attn_hook.take_over(causal_lm)

    views: dict[int, PromptStates] = {}  # kept passes released in this (the window's last) micro-batch
    needed = sorted({n for leaf in set(leaves) for n in trie.path(leaf)}, key=lambda n: (trie.nodes[n].depth, n))
    for depth, group in itertools.groupby(needed, key=lambda n: trie.nodes[n].depth):
        todo = [n for n in group if n not in window.node_pass]
        for kept in (True, False):
            nodes = [n for n in todo if window._kept(n) == kept]
            if nodes:
                window._forward_nodes(backbone, nodes, kept, views, device)

    hidden = [window._leaf_hidden(leaves, views).unsqueeze(1)]
    width = C - 1
    if width:
        lengths = prompt_mask.sum(dim=1).to(torch.long)
        ctx = attn_hook.CompletionContext(
            regions=window._regions([trie.path(leaf) for leaf in leaves], False, views, device),
            key_mask=completion_mask[:, :width].bool(),
        )
        positions = lengths[:, None] + torch.arange(width, device=device)
        out = backbone(input_ids=completion_ids[:, :width], position_ids=positions, use_cache=False,
                       grpo_mem_ctx=attn_hook.context_token(ctx))  # fmt: skip
        hidden.append(attn_hook.keep_alive(out.last_hidden_state, ctx))
    window.finish_micro_batch()
    hidden = torch.cat(hidden, dim=1)
    return completion_head(causal_lm, hidden, completion_ids, completion_mask, request)

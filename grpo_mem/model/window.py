"""Executing a window's plan: node passes, the completion pass, and the head, micro-batch by micro-batch.

Each ``PassSpec`` of the plan goes through the model once, with gradients, at its nodes' positions (a node's
``start``: the tokens before it on its prompt's path; in group mode, a prompt's left padding): a root pass is a plain
causal pass whose attention records its K/V, a deeper pass attends to every ancestor's recorded K/V in place plus its
own causal K/V (``grpo_mem.ops.multi_region_attention``) and records its own. The completions then run at positions
``end … end + C − 2`` (``end``: where the row's prompt ends) attending to every node on their prompt's path plus their
own tokens. Every query-key pair keeps the position difference of stock TRL's left-padded layout, so RoPE scores are
the same up to the rounding of the rotation. Text micro-batches on one rank run their passes packed, one backbone call
per release (``packed``); others one call per pass. A kept pass (read by a later micro-batch) lives in the store until
its release micro-batch; which states a reader gets is decided in one place, ``store.PassTable.read``.

The core runs text passes. What else the passes carry comes as pass extensions (``PassExtension``: image inputs,
linear-attention state, the MoE router loss) and one layout (``OneRank``, or ``sequence_parallel.SequenceSharded``),
chosen per micro-batch by the caller (``forward.pass_extensions``) and held, with everything else the micro-batch
shares, by one frozen ``MicroBatch``; this module imports none of them. It knows transformers, not TRL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import attention_hook as attn_hook
from . import packed
from .head import completion_head
from .plan import PassSpec, WindowPlan, completion_width, known_index, to_device
from .store import ForwardedPass, PassTable, PromptStates, tie, touch

__all__ = ["MicroBatch", "OneRank", "Window"]


@dataclass(frozen=True)
class OneRank:
    """The layout of a micro-batch on one rank: every pass whole (the sequence-sharded layout overrides the hooks).
    ``touch_unread``: a pass no row reads joins the backward with no gradient (``store.touch``); True when FSDP shards
    the model: FSDP unshards a layer for backward in a hook on the outputs of its call, and a node no row ends in is
    read only through K/V taken inside its layers, so its top layer's backward would run on resharded parameters."""

    touch_unread: bool = False

    def node_pass(self, mb: MicroBatch, spec: PassSpec) -> None:
        """Forward the pass ``spec`` and register it (``Window.text_pass``)."""
        mb.window.text_pass(mb, spec)

    def completion(self, ids, key_mask, ends, width: int):
        """(ids, key mask, positions, width, shards) of the completion pass; rows' prompts end at ``ends`` (B,)."""
        return ids, key_mask, ends[:, None] + torch.arange(width, device=ends.device), width, None

    def completion_hidden(self, out: torch.Tensor, C: int) -> torch.Tensor:
        """The completion pass's hidden states that predict completion tokens 1 … C − 1."""
        return out[:, : C - 1]

    def head(self, mb: MicroBatch, hidden, ids, mask, options, scored=None):
        """(B, C) fp32 log-probs and entropies (or None) of ``ids`` from ``hidden`` (``head.completion_head``;
        ``scored``: the scored positions if known)."""
        return completion_head(mb.causal_lm, hidden, ids, mask, options, scored)


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch being run, built once by ``Window.run``: its window, index and the window's last micro-batch,
    the causal LM, its rows' leaf nodes, its extensions and layout, and ``views``, the kept passes released in it as
    read (one view each, filled while it runs)."""

    window: Window
    index: int
    last: int
    causal_lm: torch.nn.Module
    leaves: list[int]
    device: torch.device
    extensions: tuple  # of ``extension.PassExtension``
    layout: OneRank
    views: dict[int, PromptStates] = field(default_factory=dict)

    def kwargs(self, spec: PassSpec | None, width: int) -> dict:
        return {k: v for e in self.extensions for k, v in e.call_kwargs(self, spec, width).items()}

    def context(self, starts, lengths, release: int) -> dict:
        return {k: v for e in self.extensions for k, v in e.context(self, starts, lengths, release).items()}

    def record(self, out, ctx, keeper, tokens: int) -> dict:
        records = {e.name: e.record(self, out, ctx, keeper, tokens) for e in self.extensions}
        return {name: r for name, r in records.items() if r}


@dataclass
class Window:
    """A ``WindowPlan`` being executed, micro-batch ``current`` next (``run``); ``align``/``end_after_next`` swap in
    a new plan; ``table``: the forwarded passes and the store of kept ones."""

    plan: WindowPlan
    current: int = 0
    table: PassTable = field(default_factory=PassTable)

    @property
    def done(self) -> bool:
        """Whether every micro-batch of the window was scored (or the window was abandoned)."""
        return self.current > self.plan.last

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def pending(self) -> int:
        """Kept prompt passes waiting for a later micro-batch's backward."""
        return len(self.table.store)

    def check_prompts(self, keys: tuple) -> None:
        """``WindowPlan.check_prompts`` of the next micro-batch."""
        self.plan.check_prompts(self.current, keys)

    def shares(self) -> bool:
        """Whether the next micro-batch shares a prompt pass with another row or micro-batch (``WindowPlan.shares``)."""
        return self.plan.shares(self.current)

    def tokens(self, logits_to_keep: int, *, lockstep: bool, router: bool) -> int:
        """Tokens the backbone runs for the next micro-batch on the prompt-once path (``WindowPlan.tokens_at``)."""
        return self.plan.tokens_at(self.current, completion_width(logits_to_keep, lockstep=lockstep, router=router))

    def pass_keys(self, images=None) -> tuple[list, list | None]:
        """``WindowPlan.pass_keys`` of the next micro-batch."""
        return self.plan.pass_keys(self.current, images)

    def align(self, keys) -> None:
        """Swap in the plan with stand-ins for the keys ``keys`` of the next micro-batch (``WindowPlan.align``)."""
        self.plan = self.plan.align({k for k in keys if k[0] == self.current})

    def end_after_next(self) -> None:
        """Swap in the plan whose last micro-batch is the next one (``WindowPlan.end_after``)."""
        self.plan = self.plan.end_after(self.current)

    def discard(self) -> int:
        """Drop every kept pass unbackpropagated; returns how many there were."""
        return self.table.store.discard()

    def regions(self, mb: MicroBatch, paths: list[list[int]], release: int) -> list[attn_hook.Region]:
        """One region per pass holding nodes of ``paths`` (one list per reader row), as readers released at
        ``release`` get them (``PassTable.regions``)."""
        regions = self.table.regions(paths, release, mb)  # indices in [-1, entries) by construction
        return [attn_hook.Region(kv, known_index(i, mb.device, mask), mask, pos) for kv, i, mask, pos in regions]

    def text_pass(self, mb: MicroBatch, spec: PassSpec) -> None:
        """Forward one pass of the schedule whole and register it, with what the extensions record of it."""
        ids, mask, positions, lengths = self.plan.pass_tokens(spec, mb.device)
        extra = mb.kwargs(spec, ids.shape[1])
        paths = [self.plan.trie.path(n) for n in spec.nodes]
        deeper = spec.depth > 0 and bool(spec.nodes)
        fields = mb.context([path[-2] for path in paths] if deeper else [], lengths, spec.release)
        if deeper:
            last = max(self.plan.trie.nodes[n].start + length - 1 for n, length in zip(spec.nodes, lengths))
            ancestors = [path[:-1] for path in paths]
            ctx = self.attending(
                mb, ancestors, spec.release, last, key_mask=mask, positions=positions, capture={}, **fields
            )
        else:
            ctx = attn_hook.PromptCapture(**fields)
            extra["attention_mask"] = mask.long()
        out = self._call(mb, ctx, ids, positions, extra)
        # whatever reads this pass (its K/V, its states, its last hidden state) holds its context, which the replay of
        # its checkpointed layers in backward looks up (a root pass's attention needs none; its extensions' may)
        keeper = ctx if deeper or fields else None
        kv = {i: tuple(attn_hook.keep_alive(t, ctx) for t in kv) for i, kv in ctx.capture.items()} if deeper else ctx.kv
        hidden = out.last_hidden_state if keeper is None else attn_hook.keep_alive(out.last_hidden_state, keeper)
        last = hidden[torch.arange(len(lengths), device=mb.device), torch.tensor(lengths, device=mb.device) - 1]
        states = PromptStates(kv={i: kv[i] for i in sorted(kv)}, last_hidden=last)
        states.extras.update(mb.record(out, ctx, keeper, ids.numel()))
        self.table.register(ForwardedPass(spec=spec, mask=mask, positions=positions), states)

    def _pass_by_pass(self, mb: MicroBatch, completion_ids, completion_mask, width: int):
        """Forward ``mb``'s passes one call each, then its completion pass; returns the (B, width', H) final hidden
        states of completion tokens ``0 … width − 1`` (they predict tokens 1 … width; width' is the layout's; None if
        ``width`` is 0) and what the extensions record of the completion pass."""
        for spec in self.plan.passes_at(self.current):
            mb.layout.node_pass(mb, spec)
        if not width:
            return None, {}
        trie = self.plan.trie
        ends = torch.tensor([trie.nodes[leaf].end for leaf in mb.leaves], dtype=torch.long, device=mb.device)
        ids, key_mask = completion_ids[:, :width], completion_mask[:, :width].bool()
        ids, key_mask, positions, width, shards = mb.layout.completion(ids, key_mask, ends, width)
        paths, last = [trie.path(leaf) for leaf in mb.leaves], max(trie.nodes[n].end for n in mb.leaves) + width - 1
        fields = mb.context(mb.leaves, None, self.current)
        ctx = self.attending(
            mb, paths, self.current, last, key_mask=key_mask, positions=positions, shards=shards, **fields
        )
        out = self._call(mb, ctx, ids, positions, mb.kwargs(None, width))
        return attn_hook.keep_alive(out.last_hidden_state, ctx), mb.record(out, ctx, ctx, ids.numel())

    def attending(self, mb: MicroBatch, paths, release: int, last: int, **fields) -> attn_hook.CompletionContext:
        """The context of a pass whose rows read the nodes ``paths`` (``regions``), released at ``release``, its last
        query at position ``last``; ``fields``: the context's other fields."""
        reach = self.plan.reach(paths, last)
        return attn_hook.CompletionContext(regions=self.regions(mb, paths, release), reach=reach, **fields)

    @staticmethod
    def _call(mb: MicroBatch, ctx, ids, positions, extra: dict):
        """The backbone on ``ids`` with the context ``ctx``, at ``positions`` unless ``extra`` gives the model's own."""
        rope_positions, token = extra.pop("position_ids", positions), attn_hook.context_token(ctx)
        return mb.causal_lm.base_model(
            input_ids=ids, position_ids=rope_positions, use_cache=False, grpo_mem_ctx=token, **extra
        )

    def run(
        self, causal_lm, input_ids, attention_mask, options, *, lockstep=False, extensions=(), layout=None, scored=None
    ):
        """Score the window's next micro-batch (``input_ids``/``attention_mask`` (B, P + C), the rows planned for it)
        on the unwrapped ``causal_lm`` with its ``PassExtension``s ``extensions`` and ``layout`` (None: ``OneRank()``);
        ``options``: ``ScoreOptions``; ``scored``: the scored completion positions (``Decision.scored``) or None.
        Returns (B, C) fp32 log-probs, entropies (or None) and the 0-d fp32 loss an
        extension adds (the MoE router loss of the micro-batch's stock rows) or None; their backward also
        backpropagates every pass released in this micro-batch. ``lockstep``: make the module calls of ranks whose
        micro-batches differ (with C == 1 the completion pass still runs, on token 1, tied in with zero gradient;
        stand-in passes are tied in likewise)."""
        C = options.logits_to_keep
        mb, hidden, completion = self._micro_batch(
            causal_lm, input_ids, attention_mask, C, lockstep, extensions, layout
        )
        ids, mask = input_ids[:, -C:], attention_mask[:, -C:]
        losses = [loss for e in mb.extensions if (loss := e.loss(mb, completion, mask)) is not None]
        logps, entropy = mb.layout.head(mb, hidden, ids, mask, options, scored)
        self._finish_micro_batch()
        return logps, entropy, (losses[0] if losses else None)

    def hidden_states(
        self, causal_lm, input_ids, attention_mask, C: int, *, lockstep=False, extensions=(), layout=None
    ):
        """The LM head's input for the window's next micro-batch: (B, C, H) final hidden states (final norm applied,
        the backbone's dtype) at positions P − 1 … P + C − 2, which predict the C completion tokens. Equals
        ``causal_lm.base_model(input_ids, attention_mask).last_hidden_state[:, -C - 1 : -1]``, each prompt pass run
        once; its backward also backpropagates every pass released in this micro-batch. Arguments as ``run``."""
        hidden = self._micro_batch(causal_lm, input_ids, attention_mask, C, lockstep, extensions, layout)[1]
        self._finish_micro_batch()
        return hidden

    def _micro_batch(self, causal_lm, input_ids, attention_mask, C: int, lockstep: bool, extensions, layout):
        """(the ``MicroBatch``, the (B, C, H) hidden states that predict the completion tokens, the completion pass's
        records by extension)."""
        attn_hook.take_over(causal_lm)
        leaves, P, layout = self.plan.leaves(self.current), input_ids.shape[1] - C, layout or OneRank()
        mb = MicroBatch(self, self.current, self.plan.last, causal_lm, leaves, input_ids.device, extensions, layout)
        width = completion_width(C, lockstep=lockstep, router=any(e.all_completion_tokens for e in mb.extensions))
        ids, mask = input_ids[:, P:], attention_mask[:, P:]
        if not mb.extensions and type(mb.layout) is OneRank:  # passes backpropagated together: one call
            out, completion = packed.forward(self, mb, ids, mask, width), {}
        else:
            out, completion = self._pass_by_pass(mb, ids, mask, width)
        hidden = [self.table.gather_last_hidden(mb.leaves, mb).unsqueeze(1)]
        if out is not None:
            if C > 1:
                hidden.append(mb.layout.completion_hidden(out, C))
            else:
                hidden[0] = tie(hidden[0], [out])
        hidden = tie(torch.cat(hidden, dim=1), self.table.unkept_outputs(stand_in=True))
        if mb.layout.touch_unread:
            hidden = touch(hidden, self.table.unkept_outputs(stand_in=False))
        return mb, self._flush(hidden), completion

    def _flush(self, anchor: torch.Tensor) -> torch.Tensor:
        """``anchor`` carrying every kept pass released in this micro-batch that nothing in it read."""
        return self.table.store.flush_into(anchor, None if self.current >= self.plan.last else self.current)

    def _finish_micro_batch(self) -> None:
        self.table.drop_released(self.current, self.plan.last)  # their graphs live in this micro-batch's output
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
        self.current = self.plan.last + 1
        return self.table.abandon(anchor)

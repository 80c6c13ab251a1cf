"""A sharing session: one decision per micro-batch, and prompt passes shared across the micro-batches of a window.

Within one optimizer step the parameters do not change, so a prompt (or a span several prompts share) read by several
micro-batches needs one forward and one backward, not one per micro-batch. A ``SharingSession`` owns what that takes:
the window's ``WindowPlan`` and the ``Window`` executing it. For every micro-batch it takes one ``Decision``: whether
the prompt-once path serves the model exactly (and if not, why), what ranks in lockstep agree on (one collective),
whether the micro-batch shares anything, and the passes it runs. Lifecycle::

    session = SharingSession()
    session.begin_window(model, [prompt_ids_1, ...], [prompt_mask_1, ...])   # the window's micro-batches, in order
    for micro_batch in window:
        logps, ent = session.score(model, input_ids, attention_mask, logits_to_keep)   # then backward
    session.close_window()

A caller with a stock path of its own (the TRL patch) splits ``score`` into ``decide`` and ``run`` and passes it in.
This module knows transformers, not TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .distributed import agree, lockstep, unwrap_causal_lm
from .forward import ScoreOptions, run_in_forward, validate_inputs
from .multimodal import RowImages, VisionInputs, trie_keys, warn_tree_to_group
from .plan import PromptGrouping, WindowPlan, check_sharing
from .confirm import confirm_reason
from .confirm import enabled as confirm_enabled
from .router import router_loss_reason
from .support import full_sequence_logprobs, unsupported_reason, warn_fallback
from .trie import DEFAULT_MIN_SHARED_TOKENS
from .window import Window

__all__ = ["Decision", "SharingSession", "shared_prompt_logprobs"]

UNSHARED = "a micro-batch holds no repeated prompt and shares no prompt pass with another micro-batch"


@dataclass(frozen=True)
class Decision:
    """How one micro-batch is scored, decided once by ``SharingSession.decide``.

    Attributes:
        path: ``"tree"`` or ``"group"`` (the prompt-once path in that sharing mode), or ``"stock"``.
        cause: why the path is ``"stock"``, else None.
        micro_batch: the micro-batch's index in the session's window, or None when it is scored on its own.
        rows: B, the micro-batch's rows.
        backbone_tokens: tokens the chosen path runs through the backbone (padded widths counted).
        stock_tokens: tokens stock TRL runs through the backbone for it, B x (P + C).
    """

    path: str
    cause: str | None
    micro_batch: int | None
    rows: int
    backbone_tokens: int
    stock_tokens: int


class SharingSession:
    """Prompt sharing across the micro-batches of one window (a run of micro-batches within one optimizer step).

    Args:
        sharing: ``"tree"``: the window's prompts form a ``PromptTrie``; every span several prompts share (a system
            prompt, a few-shot block) and every prompt is forwarded once per window. ``"group"``: every unique prompt
            is forwarded whole, at stock TRL's positions, once per window. Ranks in lockstep (FSDP, DeepSpeed) align
            their schedules, in either mode.
        min_shared_tokens: tree mode: the shortest span forwarded as a node of its own (``PromptTrie``).
        confirm: confirm what the capability rule admits on a tiny copy of the model, once per class and
            architecture and process (``grpo_mem.model.confirm``); a difference is a fallback cause. None: on
            unless the environment sets ``GRPO_MEM_CONFIRM=0``.

    Attributes:
        window: the open window's ``Window`` (its plan and cursor), or None.
        last_decision: the ``Decision`` ``decide`` took last.

    Raises:
        ValueError: unknown ``sharing``.
    """

    def __init__(
        self, sharing: str = "tree", *, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS, confirm: bool | None = None
    ):
        self.mode = check_sharing(sharing)
        self.confirm = confirm
        self.min_shared_tokens = min_shared_tokens
        self.window: Window | None = None
        # the decision, its window, lockstep, whether the router loss is asked for, the image inputs
        self._pending: tuple[Decision, Window, bool, bool, VisionInputs | None] | None = None
        self.last_decision: Decision | None = None

    @property
    def pending(self) -> int:
        """Prompt passes kept for a later micro-batch of the open window (0 outside a window)."""
        return len(self.window.store) if self.window is not None else 0

    @property
    def in_window(self) -> bool:
        """Whether a window is open with micro-batches left to score."""
        return self.window is not None and not self.window.done

    def begin_window(
        self,
        model,
        prompt_ids: list[torch.Tensor],
        prompt_masks: list[torch.Tensor],
        row_keys: list[list] | None = None,
    ) -> None:
        """Plan a window of ``len(prompt_ids)`` micro-batches; closes the previous window if one is open.

        Args:
            model: the model the window trains (unused; kept for callers that pass it).
            prompt_ids: per micro-batch, (B_i, P_i) int64 left-padded prompt ids, in the order they will be scored.
            prompt_masks: per micro-batch, (B_i, P_i) 0/1 prompt masks.
            row_keys: per micro-batch, its rows' image keys (``VisionInputs.row_keys``; ``b""`` for a row without
                image inputs), or None for text prompts. In tree mode the trie keys image tokens by their images;
                image prompts that cannot be split into nodes (``VisionInputs.tree_cause``) plan the window in group
                mode (warned once, ``multimodal.TREE_TO_GROUP``).

        Raises:
            ValueError: no micro-batch, lists of different lengths, a prompt with no real token.
        """
        self.close_window()
        groupings = None
        if row_keys is not None:
            groupings = [PromptGrouping.of(i, m, k) for i, m, k in zip(prompt_ids, prompt_masks, row_keys)]
        self.window = Window(self._plan(prompt_ids, prompt_masks, groupings))

    def _plan(self, prompt_ids, prompt_masks, groupings: list[PromptGrouping] | None) -> WindowPlan:
        """The plan of these micro-batches in the session's mode; with image keys (``PromptGrouping.extra``), the
        trie keys image tokens by their images, and image prompts with a tree cause take group mode (warned once)."""
        extras = [k for g in groupings or () if g.extra is not None for k in g.extra]
        mode = self.mode
        cause = next((k.tree_cause for k in extras if isinstance(k, RowImages) and k.tree_cause), None)
        if cause is not None and mode == "tree":
            warn_tree_to_group(cause)
            mode = "group"
        keyed = trie_keys if extras and mode == "tree" else None
        return WindowPlan.build(
            mode,
            prompt_ids,
            prompt_masks,
            groupings=groupings,
            trie_keys=keyed,
            min_shared_tokens=self.min_shared_tokens,
        )

    def end_after_next(self) -> None:
        """Make the next micro-batch the window's last (the optimizer steps after it, earlier than planned): what is
        pending is completed in its backward."""
        if self.in_window:
            self.window.plan.end_after(self.window.current)

    def close_window(self) -> None:
        """End the current window. Raises RuntimeError if prompt passes are still pending (a planned micro-batch was
        never scored), since their graphs would never be backpropagated."""
        window, self.window, self._pending = self.window, None, None
        if window is not None and len(window.store):
            pending = window.store.discard()
            raise RuntimeError(
                f"window closed with {pending} prompt passes pending: a planned micro-batch was not scored"
            )

    def shares(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> bool:
        """Whether the window's next micro-batch (whose prompts these are) shares a prompt pass with another row or
        micro-batch, i.e. whether its decision would take the prompt-once path when a stock path is available."""
        if not self.in_window:
            return PromptGrouping.of(prompt_ids, prompt_mask).repeats
        return self.window.plan.shares(self.window.current)

    # ------------------------------------------------------------------------------------------------------------------

    def _window_for(self, grouping: PromptGrouping) -> Window | None:
        """The open window if this micro-batch is its next one (gradients on, the planned prompts), else None.

        Raises:
            ValueError: gradients are on and the prompts are not the ones planned for the window's next micro-batch.
        """
        if not (self.in_window and torch.is_grad_enabled()):
            return None
        planned = self.window.plan.keys[self.window.current]
        if grouping.keys != planned:
            raise ValueError(
                f"micro-batch {self.window.current} of the window does not hold the prompts planned for it "
                f"({len(set(grouping.keys))} unique prompts in {len(grouping.keys)} rows, planned "
                f"{len(set(planned))} in {len(planned)})"
            )
        return self.window

    def decide(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep: int,
        *,
        temperature: float = 1.0,
        cause: str | None = None,
        stock_available: bool = False,
        compute_aux_loss: bool = False,
        vision: VisionInputs | None = None,
    ) -> Decision:
        """Decide how the micro-batch ``input_ids``/``attention_mask`` is scored; ``run`` must follow.

        ``cause``: a reason of the caller's own to take the stock path (e.g. inputs the prompt-once path does not
        take). ``stock_available``: the caller has a stock path, so a micro-batch that shares nothing takes it.
        ``compute_aux_loss``: ``run`` will be asked for the MoE router loss too (a router loss the prompt-once path
        does not reproduce is a cause, ``router_loss_reason``). ``vision``: the micro-batch's image inputs (rows group
        by prompt and images; in tree sharing the trie keys image tokens by their images), or None.
        Ranks in lockstep decide together: every rank must call ``decide`` once per micro-batch (one collective).

        Raises:
            ValueError/TypeError: as ``shared_prompt_logprobs``; prompts that are not the ones planned.
        """
        validate_inputs(input_ids, attention_mask, logits_to_keep, temperature)
        B, T = input_ids.shape
        P = T - logits_to_keep
        extra = None if vision is None else vision.row_keys(P)
        grouping = PromptGrouping.of(input_ids[:, :P], attention_mask[:, :P], extra)
        window = self._window_for(grouping)
        if window is None:
            window = Window(self._plan([input_ids[:, :P]], [attention_mask[:, :P]], [grouping]))
            j = None
        else:
            j = window.current
        causal_lm = unwrap_causal_lm(model)
        reason = cause or unsupported_reason(causal_lm)
        if reason is None and compute_aux_loss:
            reason = router_loss_reason(causal_lm)
        if reason is None and confirm_enabled(self.confirm):  # the same verdict on every rank: no collective
            reason = confirm_reason(causal_lm, compute_aux_loss=compute_aux_loss)
        if reason is None and vision is not None:
            reason = vision.cause(causal_lm, P)
        in_lockstep = lockstep(model)
        current = window.current
        if in_lockstep:
            passes = window.plan.passes_at(current)
            image_passes = None
            if vision is not None:  # the passes that will run the vision tower
                reader = vision.bind(causal_lm, input_ids, attention_mask, P)
                image_passes = [p.key for p in passes if p.nodes and reader.images_of(window.spans(p))]
            reason, keys = agree(reason, [p.key for p in passes], image_passes)
            window.plan.align({k for k in keys if k[0] == current})
        elif reason is None and stock_available and not window.plan.shares(current):
            reason = UNSHARED
        width = logits_to_keep - 1 if logits_to_keep > 1 or not in_lockstep else 1
        width = logits_to_keep if compute_aux_loss else width  # the router loss counts the last completion token
        stock_tokens = B * T
        tokens = stock_tokens if reason else window.plan.tokens_at(current, width)
        decision = Decision(
            path="stock" if reason else window.plan.mode,
            cause=reason,
            micro_batch=j,
            rows=B,
            backbone_tokens=tokens,
            stock_tokens=stock_tokens,
        )
        self._pending = (decision, window, in_lockstep, compute_aux_loss, vision)
        self.last_decision = decision
        return decision

    def run(
        self,
        decision: Decision,
        model,
        input_ids,
        attention_mask,
        logits_to_keep: int,
        *,
        temperature=1.0,
        compute_entropy=False,
        cast_lm_head_to_fp32=False,
        compute_aux_loss=False,
        stock=None,
    ):
        """Score the micro-batch ``decide`` just decided on. Returns (B, C) fp32 log-probs and entropies (or None),
        zero where the completion mask is 0; in a window, each followed by its backward. With ``compute_aux_loss``
        (which ``decide`` must have been told), a third value: the 0-d fp32 MoE router load-balancing loss of the
        micro-batch as the model computes it over its full rows (``grpo_mem.model.router``).

        ``stock``: the caller's stock path, ``stock() -> (log_probs, entropies | None, aux_loss | None)``, run when
        the decision says ``"stock"`` (default: the model's own full-sequence computation, ``full_sequence_logprobs``).

        Raises:
            RuntimeError: ``decision`` is not the one ``decide`` returned last, or was run already, or
                ``compute_aux_loss`` differs from what ``decide`` was told.
            ValueError: a stock decision for a micro-batch with image inputs and no ``stock`` (the default does not
                take images).
        """
        refused = (
            None
            if decision.path != "stock" or stock is not None
            else (
                f"a micro-batch with image inputs falls back ({decision.cause}) but run() was given no stock path taking "
                "them"
            )
        )
        window, in_lockstep, vision = self._take(decision, compute_aux_loss, refused)
        options = ScoreOptions(
            logits_to_keep,
            float(temperature),
            bool(compute_entropy),
            bool(cast_lm_head_to_fp32),
            bool(compute_aux_loss),
        )
        causal_lm = unwrap_causal_lm(model)
        if decision.path == "stock":
            warn_fallback(decision.cause)
            if stock is None:
                logps, entropy, aux_loss = run_in_forward(
                    model,
                    causal_lm,
                    lambda m, ids, mask: full_sequence_logprobs(m, ids, mask, options),
                    input_ids,
                    attention_mask,
                )
            else:
                logps, entropy, aux_loss = stock()
            logps = self._end_sharing(decision, window, logps)
        else:

            def compute(m, ids, mask):
                inputs = None if vision is None else vision.bind(m, ids, mask, ids.shape[1] - logits_to_keep)
                return window.run(m, ids, mask, options, lockstep=in_lockstep, inputs=inputs)

            logps, entropy, aux_loss = run_in_forward(model, causal_lm, compute, input_ids, attention_mask)
        return (logps, entropy, aux_loss) if compute_aux_loss else (logps, entropy)

    def run_hidden(self, decision: Decision, model, input_ids, attention_mask, logits_to_keep: int, *, stock):
        """Like ``run``, but return the LM head's input instead of log-probs: (B, C, H) final hidden states (final norm
        applied, the backbone's dtype) at the positions that predict the C = ``logits_to_keep`` completion tokens, as
        ``model.base_model(input_ids, attention_mask).last_hidden_state[:, -C - 1 : -1]`` gives them; in a window, its
        backward also backpropagates the prompt passes released in this micro-batch.

        Computed in the caller's context, with no call of ``model``'s forward: for a caller that already runs inside
        the (wrapped) model's forward, as TRL's Liger loss does. ``stock() -> (B, C, H)`` is run when the decision says
        ``"stock"`` (warned once per cause).

        Raises:
            RuntimeError: ``decision`` is not the one ``decide`` returned last, or was run already.
        """
        window, in_lockstep, _ = self._take(
            decision, refused="run_hidden() does not take image inputs: decide() them with vision=None and a cause"
        )
        if decision.path == "stock":
            warn_fallback(decision.cause)
            return self._end_sharing(decision, window, stock())
        return window.hidden_states(
            unwrap_causal_lm(model), input_ids, attention_mask, logits_to_keep, lockstep=in_lockstep
        )

    def _take(self, decision: Decision, compute_aux_loss: bool = False, refused: str | None = None):
        """(window, lockstep flag, image inputs) ``decide`` kept for ``decision``; the decision can be run once,
        asking for the router loss as ``decide`` was told. ``refused``: the ValueError's message if the decision has
        image inputs; raised before the decision is taken, so the caller can still run it."""
        if self._pending is None or self._pending[0] is not decision:
            raise RuntimeError("run() takes the decision decide() returned for this micro-batch, once")
        _, window, in_lockstep, decided_aux, vision = self._pending
        if bool(compute_aux_loss) != decided_aux:
            raise RuntimeError(f"run(compute_aux_loss={compute_aux_loss}) after decide(compute_aux_loss={decided_aux})")
        if vision is not None and refused is not None:
            raise ValueError(refused)
        self._pending = None
        return window, in_lockstep, vision

    @staticmethod
    def _end_sharing(decision: Decision, window: Window, anchor: torch.Tensor) -> torch.Tensor:
        """After a stock micro-batch of a window: sharing ends there, what is pending goes into ``anchor``'s backward."""
        if decision.micro_batch is None:
            return anchor
        return window.skip(anchor) if decision.cause == UNSHARED else window.abandon(anchor)

    def score(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep: int,
        *,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        cast_lm_head_to_fp32: bool = False,
        compute_aux_loss: bool = False,
    ):
        """``decide`` then ``run`` with the model's own computation as the stock path; same arguments and returns as
        ``shared_prompt_logprobs``, plus the MoE router loss as a third value with ``compute_aux_loss`` (``run``).
        Outside a window (or without gradients), the micro-batch is shared on its own.

        Raises:
            ValueError: the micro-batch's prompts are not the ones planned for it by ``begin_window``.
        """
        decision = self.decide(
            model, input_ids, attention_mask, logits_to_keep, temperature=temperature, compute_aux_loss=compute_aux_loss
        )
        return self.run(
            decision,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            temperature=temperature,
            compute_entropy=compute_entropy,
            cast_lm_head_to_fp32=cast_lm_head_to_fp32,
            compute_aux_loss=compute_aux_loss,
        )


def shared_prompt_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    cast_lm_head_to_fp32: bool = False,
    sharing: str = "tree",
    confirm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token completion log-probs (and entropies) with each unique prompt forwarded once.

    Same contract and numbers as TRL 1.16's ``GRPOTrainer._get_per_token_logps_and_entropies`` for text models
    (within fp32 rounding), gradients included: each unique prompt row is forwarded once with gradients, its per-layer
    K/V serve every completion of the group, and log-probs come from completion hidden states through a chunked head
    that never builds (B, C, V) logits. Rows of one prompt need not be adjacent: identical prompts (ids and mask,
    padding slots ignored) are found anywhere in the batch. Runs inside one call of ``model``'s forward, so wrappers'
    hooks (DDP, DeepSpeed, FSDP) fire; works on a plain causal LM, a PEFT model, and a model given TRL's fused head.
    With ``sharing="tree"`` (default) the unique prompts' common prefixes are found too (``PromptTrie``): a span that
    several prompts share (a system prompt, a few-shot block) is forwarded once and every prompt's own part attends
    to it in place, at positions that keep stock TRL's position differences (RoPE scores equal up to the rounding of
    the rotation); ``"group"`` forwards each unique prompt whole, at stock TRL's positions. Stateless: nothing is kept
    between calls (``SharingSession`` shares prompts and trie nodes across the micro-batches of an optimizer step).

    Side effect: the first call gives the underlying causal LM a pass-through forward and attention implementation
    (``grpo_mem_<impl>``); calls without grpo_mem compute exactly what they did. ``grpo_mem.restore(model)`` undoes it.
    Where the path cannot be exact (see ``unsupported_reason``) it warns once and runs the model's own computation.

    Args:
        model: transformers causal LM, possibly PEFT- and DDP/DeepSpeed/FSDP-wrapped.
        input_ids: (B, P + C) int64, left-padded prompts followed by right-padded completions.
        attention_mask: (B, P + C) 0/1, same shape.
        logits_to_keep: C, the completion width, 1 <= C < P + C.
        temperature: > 0, the logits are divided by it (after logit scale and final softcap, as TRL does).
        compute_entropy: also return the entropy of each next-token distribution.
        cast_lm_head_to_fp32: run the LM head in fp32 outside autocast (TRL's ``cast_lm_head_to_fp32``).
        sharing: ``"tree"`` or ``"group"``, see above.
        confirm: the first time a model class (and architecture) is scored in the process, confirm the capability
            rule's decision on a tiny copy of it (``grpo_mem.model.confirm``; about a second of CPU); a difference
            falls back with its cause. None: on unless the environment sets ``GRPO_MEM_CONFIRM=0``.

    Returns:
        log_probs: (B, C) fp32, zero where the completion mask is 0.
        entropies: (B, C) fp32 (zero where masked) if ``compute_entropy``, else None.

    Raises:
        ValueError: shape mismatch, ``logits_to_keep`` out of range, ``temperature <= 0``, right-padded prompts,
            unknown ``sharing``.
        TypeError: non-integer ids or ``logits_to_keep``.
    """
    session = SharingSession(sharing, confirm=confirm)
    return session.score(
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        temperature=temperature,
        compute_entropy=compute_entropy,
        cast_lm_head_to_fp32=cast_lm_head_to_fp32,
    )

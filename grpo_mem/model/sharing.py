"""A sharing session: one decision per micro-batch, and prompt passes shared across the micro-batches of a window.

Within one optimizer step the parameters do not change, so a prompt (or a span several prompts share) read by several
micro-batches needs one forward and one backward, not one per micro-batch. A ``SharingSession`` owns what that takes:
the ``Window`` executing the window's plan. For every micro-batch it takes one ``Decision``: whether the prompt-once
path serves the model exactly (and if not, the cause), what ranks in lockstep agree on (one collective), whether the
micro-batch shares anything, and the passes it runs; the decision carries all its run needs. A model's cause is kept
per model state (``forward.model_cause``): a micro-batch of an unchanged model runs no capability check. Lifecycle::

    session = SharingSession()
    session.begin_window([prompt_ids_1, ...], [prompt_mask_1, ...])   # the window's micro-batches, in order
    for micro_batch in window:
        logps, ent = session.score(model, input_ids, attention_mask, logits_to_keep)   # then backward
    session.close_window()

A caller with a stock path of its own (the TRL patch) splits ``score`` into ``decide`` and ``run(decision,
stock=...)``. This module knows transformers, not TRL.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import transformers
from transformers import PreTrainedModel

from . import causes
from .confirm import ENV as CONFIRM_ENV
from .distributed import agree, lockstep, unwrap_causal_lm
from .fallback import full_sequence_logprobs, warn_fallback
from .forward import Decision, Kind, ScoreOptions, model_cause, pass_extensions, run_in_forward, validate_inputs
from .plan import DEFAULT_MIN_SHARED_TOKENS, PromptGrouping, WindowPlan, check_sharing
from .window import Window

if TYPE_CHECKING:
    from .multimodal import VisionInputs

__all__ = ["UNSHARED", "Decision", "Kind", "SharingSession", "shared_prompt_logprobs"]

UNSHARED = "a micro-batch holds no repeated prompt and shares no prompt pass with another micro-batch"
"""The cause of a ``Kind.UNSHARED`` decision."""


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
        sequence_parallel: a ``torch.distributed`` process group (or a ``sequence_parallel.SequenceParallel``) whose
            ranks hold the same micro-batches and split every pass along the sequence; log-probs come back whole on
            every rank, each rank's parameter gradients are its shard's part (they sum over the group to the gradient
            without it). None: none. A micro-batch the path cannot serve then raises (no stock path to fall back to).

    Attributes:
        window: the open window's ``Window`` (its plan, cursor and kept passes: ``window.pending``), or None.

    Raises:
        ValueError: unknown ``sharing``.
        RuntimeError: ``sequence_parallel`` given without ``torch.distributed`` initialised.
    """

    def __init__(
        self,
        sharing: str = "tree",
        *,
        min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS,
        confirm: bool | None = None,
        sequence_parallel=None,
    ):
        self.mode = check_sharing(sharing)
        self.sp = None if sequence_parallel is None else causes.sequence_parallel_of(sequence_parallel)
        self.confirm = confirm
        self.min_shared_tokens = min_shared_tokens
        self.window: Window | None = None
        self._ran: weakref.ref | None = None  # the decision ``run`` (or ``run_hidden``) took last
        self._records: list[list[Decision]] = []  # the lists of the open ``recording`` blocks
        self._images: list | None = None  # per micro-batch of the open window, its planned ``VisionInputs`` or None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Decision]]:
        """Within the block, every ``Decision`` ``decide`` returns is appended to the list yielded, in order
        (``grpo_mem.verify`` reports per micro-batch which path ran, why, and its token counts)."""
        record: list[Decision] = []
        self._records.append(record)
        try:
            yield record
        finally:
            self._records.remove(record)

    @property
    def in_window(self) -> bool:
        """Whether a window is open with micro-batches left to score."""
        return self.window is not None and not self.window.done

    def begin_window(
        self,
        prompt_ids: list[torch.Tensor],
        prompt_masks: list[torch.Tensor],
        images: list[VisionInputs | None] | None = None,
    ) -> None:
        """Plan a window of ``len(prompt_ids)`` micro-batches; closes the previous window if one is open.

        Args:
            prompt_ids: per micro-batch, (B_i, P_i) int64 left-padded prompt ids, in the order they will be scored.
            prompt_masks: per micro-batch, (B_i, P_i) 0/1 prompt masks.
            images: per micro-batch, its image inputs (``multimodal.VisionInputs``, None for a micro-batch without),
                or None for text prompts. Rows group by prompt and images; in tree mode the trie keys image tokens by
                their images, and image prompts that cannot be split into nodes (``VisionInputs.tree_cause``) plan the
                window in group mode (warned once, ``multimodal.TREE_TO_GROUP``). ``decide`` reuses these values
                (their row keys are computed once) for chunks that hold the same tensors.

        Raises:
            ValueError: no micro-batch, lists of different lengths, a prompt with no real token.
        """
        self.close_window()
        groupings = None
        if images is not None and any(v is not None for v in images):
            groupings = [
                PromptGrouping.of(i, m, None if v is None else v.row_keys(i.shape[1]))
                for i, m, v in zip(prompt_ids, prompt_masks, images)
            ]
        self.window = Window(self._plan(prompt_ids, prompt_masks, groupings))
        self._images = None if groupings is None else list(images)

    def _plan(self, prompt_ids, prompt_masks, groupings: list[PromptGrouping] | None) -> WindowPlan:
        """The plan of these micro-batches in the session's mode; with image keys (``PromptGrouping.extra``), the
        trie keys image tokens by their images, and image prompts with a tree cause take group mode (warned once)."""
        extras = [k for g in groupings or () if g.extra is not None for k in g.extra if k]
        mode, keyed = self.mode, None
        if extras:
            from .multimodal import trie_keys, warn_tree_to_group

            cause = next((k.tree_cause for k in extras if k.tree_cause), None)
            if cause is not None and mode == "tree":
                warn_tree_to_group(cause)
                mode = "group"
            keyed = trie_keys if mode == "tree" else None
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
            self.window.end_after_next()

    def close_window(self) -> None:
        """End the current window. Raises RuntimeError if prompt passes are still pending (a planned micro-batch was
        never scored), since their graphs would never be backpropagated."""
        window, self.window, self._images = self.window, None, None
        if window is not None and window.pending:
            pending = window.discard()
            raise RuntimeError(
                f"window closed with {pending} prompt passes pending: a planned micro-batch was not scored"
            )

    def shares(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> bool:
        """Whether the window's next micro-batch (whose prompts these are) shares a prompt pass with another row or
        micro-batch, i.e. whether its decision would take the prompt-once path when a stock path is available."""
        if not self.in_window:
            return PromptGrouping.of(prompt_ids, prompt_mask).repeats
        return self.window.shares()

    def _window_for(self, grouping: PromptGrouping) -> Window | None:
        """The open window if this micro-batch is its next one (gradients on, the planned prompts), else None.

        Raises:
            ValueError: gradients are on and the prompts are not the ones planned for the window's next micro-batch.
        """
        if not (self.in_window and torch.is_grad_enabled()):
            return None
        self.window.check_prompts(grouping.keys)
        return self.window

    def _planned(self, vision: VisionInputs | None) -> VisionInputs | None:
        """The window's planned image value for its next micro-batch when ``vision`` holds its tensors (its row keys
        are computed already), else ``vision``."""
        if vision is None or not self._images or not self.in_window:
            return vision
        planned = self._images[self.window.current]
        return planned if planned is not None and planned.holds(vision) else vision

    def decide(
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
        cause: str | None = None,
        stock_available: bool = False,
        vision: VisionInputs | None = None,
        autocast: Callable | None = None,
    ) -> Decision:
        """Decide how the micro-batch ``input_ids``/``attention_mask`` (B, P + C) is scored; ``run`` (or
        ``run_hidden``) must follow, with the decision only. Scoring options as ``shared_prompt_logprobs``;
        ``compute_aux_loss``: ``run`` also returns the MoE router loss (a router loss the prompt-once path does not
        reproduce is a cause, ``router.router_loss_cause``).

        ``cause``: a cause of the caller's own to take the stock path (e.g. inputs the prompt-once path does not
        take). ``stock_available``: the caller has a stock path, so a micro-batch that shares nothing takes it
        (``Kind.UNSHARED``). ``vision``: the micro-batch's image inputs (rows group by prompt and images; in tree
        sharing the trie keys image tokens by their images), or None. ``autocast``: a context factory (e.g.
        accelerate's ``Accelerator.autocast``) entered around the prompt-once path's model call.
        Ranks in lockstep decide together: every rank must call ``decide`` once per micro-batch (one collective).

        Raises:
            ValueError/TypeError: as ``shared_prompt_logprobs``; prompts that are not the ones planned.
        """
        validate_inputs(input_ids, attention_mask, logits_to_keep, temperature)
        options = ScoreOptions(
            logits_to_keep,
            float(temperature),
            bool(compute_entropy),
            bool(cast_lm_head_to_fp32),
            bool(compute_aux_loss),
        )
        decision = self._decision(model, input_ids, attention_mask, options, cause, stock_available, vision, autocast)
        for record in self._records:
            record.append(decision)
        return decision

    def _decision(self, model, input_ids, attention_mask, options, cause, stock_available, vision, autocast):
        """``decide``'s decision, its inputs validated."""
        logits_to_keep = options.logits_to_keep
        B, T = input_ids.shape
        P = T - logits_to_keep
        vision = self._planned(vision)  # the micro-batch's one read back (prompt ids, masks) gives its grouping:
        grouping, scored = PromptGrouping.of_micro_batch(input_ids, attention_mask, P, vision and vision.row_keys(P))
        window = self._window_for(grouping)
        j = None if window is None else window.current
        if window is None:
            window = Window(self._plan([input_ids[:, :P]], [attention_mask[:, :P]], [grouping]))
        plain = isinstance(model, PreTrainedModel) and "_orig_mod" not in model.__dict__  # no wrapper to look into
        causal_lm = model if plain else unwrap_causal_lm(model)
        split = self.sp if self.sp is not None and self.sp.size > 1 else None
        if split is not None:
            self._refuse(causes.sp_cause(split, causal_lm, options.compute_aux_loss, vision, input_ids, attention_mask))
        if cause is None:  # the model's cause, decided once per model state and confirmation setting
            aux, confirm = options.compute_aux_loss, self.confirm
            setting = (aux, confirm, os.environ.get(CONFIRM_ENV), transformers.__version__)
            cause = model_cause(causal_lm, setting, lambda: causes.model_cause(causal_lm, aux, confirm))
        if cause is None and vision is not None:
            cause = vision.cause(causal_lm, P)
        images = None if vision is None else vision.bind(causal_lm, input_ids, attention_mask, P)
        in_lockstep = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and lockstep(model)
        kind = Kind.FALLBACK if cause else Kind.SHARED
        if in_lockstep:
            keys, image_keys = window.pass_keys(images)
            cause, agreed = agree(cause, keys, image_keys)
            kind = Kind.FALLBACK if cause else Kind.SHARED
            window.align(agreed)
        elif cause is None and stock_available and not window.shares() and self.sp is None:
            cause, kind = UNSHARED, Kind.UNSHARED
        if split is not None:
            self._refuse(cause)
        tokens = (
            B * T if cause else window.tokens(logits_to_keep, lockstep=in_lockstep, router=options.compute_aux_loss)
        )
        return Decision(
            kind,
            cause,
            j,
            tokens,
            B * T,
            window.mode,
            window=window,
            model=model,
            causal_lm=causal_lm,
            input_ids=input_ids,
            attention_mask=attention_mask,
            options=options,
            lockstep=in_lockstep,
            images=images,
            autocast=autocast,
            sp=split,
            scored=scored,
        )

    def _refuse(self, cause: str | None) -> None:
        """Under sequence parallelism, raise ``cause`` (the prompt-once path cannot serve the micro-batch, and there
        is no stock path to fall back to)."""
        if cause is not None:
            if self.in_window:
                self.window.discard()
            raise ValueError(f"grpo_mem cannot score this micro-batch with sequence parallelism: {cause}")

    def _take(self, decision: Decision, refused: str | None) -> None:
        """Check that ``decision`` can run now, and record it as run: not the decision run last, and in a window,
        the window's next micro-batch (outside one, a shared decision's own window not run). ``refused``: the
        ValueError's message if the decision has image inputs; raised before the decision is recorded, so the caller
        can still run it."""
        once = "run() takes the decision decide() returned for this micro-batch, once"
        ran = self._ran is not None and self._ran() is decision
        if ran or (decision.micro_batch is None and decision.kind is Kind.SHARED and decision.window.done):
            raise RuntimeError(f"{once}: it was run")
        if decision.micro_batch is not None and (
            decision.window is not self.window or decision.window.current != decision.micro_batch
        ):
            raise RuntimeError(
                f"{once}: it was taken for micro-batch {decision.micro_batch} of a window that has moved on"
            )
        if decision.images is not None and refused is not None:
            raise ValueError(refused)
        self._ran = weakref.ref(decision)

    def run(self, decision: Decision, *, stock: Callable | None = None):
        """Score the micro-batch ``decision`` was taken for. Returns (log-probs, entropies | None, aux loss | None):
        (B, C) fp32 log-probs and entropies (entropies with ``compute_entropy``), zero where the completion mask is 0;
        in a window, each followed by its backward; with ``compute_aux_loss`` (told ``decide``) the 0-d fp32 MoE
        router loss of the micro-batch as the model computes it over its full rows (``grpo_mem.model.router``).

        ``stock``: the caller's stock path, ``stock() -> (log_probs, entropies | None, aux_loss | None)``, run when
        the decision says ``"stock"`` (default: the model's own full-sequence computation, ``full_sequence_logprobs``).

        Raises:
            RuntimeError: ``decision`` was run already, or is not for the window's next micro-batch.
            ValueError: a stock decision for a micro-batch with image inputs and no ``stock`` (the default does not
                take images).
        """
        refused = None
        if decision.kind is not Kind.SHARED and stock is None:
            refused = (
                f"a micro-batch with image inputs falls back ({decision.cause}) but run() was given no stock path "
                "taking them"
            )
        self._take(decision, refused)
        d, options = decision, decision.options
        if d.kind is Kind.SHARED:

            def compute(m, ids, mask):
                router = options.compute_aux_loss
                extensions, layout = pass_extensions(d.model, m, router=router, images=d.images, sp=d.sp)
                return d.window.run(
                    m, ids, mask, options, lockstep=d.lockstep, extensions=extensions, layout=layout, scored=d.scored
                )

            out = run_in_forward(d.model, d.causal_lm, compute, d.input_ids, d.attention_mask, autocast=d.autocast)
        else:
            warn_fallback(d.cause)
            if stock is None:
                full = lambda causal_lm, ids, mask: full_sequence_logprobs(causal_lm, ids, mask, options)
                out = run_in_forward(d.model, d.causal_lm, full, d.input_ids, d.attention_mask)
            else:
                out = stock()
            out = (self._end_sharing(d, out[0]), *out[1:])
        logps, entropies, aux_loss = out
        return logps, entropies, aux_loss if options.compute_aux_loss else None

    def run_hidden(self, decision: Decision, *, stock: Callable):
        """Like ``run``, but return the LM head's input instead of log-probs: (B, C, H) final hidden states (final norm
        applied, the backbone's dtype) at the positions that predict the C = ``logits_to_keep`` completion tokens, as
        ``model.base_model(input_ids, attention_mask).last_hidden_state[:, -C - 1 : -1]`` gives them; in a window, its
        backward also backpropagates the prompt passes released in this micro-batch.

        Computed in the caller's context, with no call of ``model``'s forward: for a caller that already runs inside
        the (wrapped) model's forward, as TRL's Liger loss does. ``stock() -> (B, C, H)`` is run when the decision says
        ``"stock"`` (warned once per cause).

        Raises:
            RuntimeError: ``decision`` was run already, or is not for the window's next micro-batch.
            ValueError: ``decision`` has image inputs.
        """
        self._take(decision, "run_hidden() does not take image inputs: decide() them with vision=None and a cause")
        d = decision
        if d.sp is not None:
            cause = causes.sequence_parallel_cause("hidden")
            raise ValueError(f"grpo_mem cannot score this micro-batch with sequence parallelism: {cause}")
        if d.kind is not Kind.SHARED:
            warn_fallback(d.cause)
            return self._end_sharing(d, stock())
        C, (extensions, layout) = d.options.logits_to_keep, pass_extensions(d.model, d.causal_lm)
        return d.window.hidden_states(
            d.causal_lm, d.input_ids, d.attention_mask, C, lockstep=d.lockstep, extensions=extensions, layout=layout
        )

    @staticmethod
    def _end_sharing(decision: Decision, anchor: torch.Tensor) -> torch.Tensor:
        """After a stock micro-batch of a window: an unshared one is passed over, a fallback ends sharing; what is
        pending goes into ``anchor``'s backward."""
        if decision.micro_batch is None:
            return anchor
        window = decision.window
        return window.skip(anchor) if decision.kind is Kind.UNSHARED else window.abandon(anchor)

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
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            temperature=temperature,
            compute_entropy=compute_entropy,
            cast_lm_head_to_fp32=cast_lm_head_to_fp32,
            compute_aux_loss=compute_aux_loss,
        )
        logps, entropies, aux_loss = self.run(decision)
        return (logps, entropies, aux_loss) if compute_aux_loss else (logps, entropies)


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
    sequence_parallel=None,
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
    Where the path cannot be exact (``support.unsupported_cause``) it warns once and runs the model's own computation.

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
        sequence_parallel: a ``torch.distributed`` process group whose ranks all call with the same inputs; every
            pass is split along the sequence over them (``SharingSession``, ``grpo_mem.model.sequence_parallel``).

    Returns:
        log_probs: (B, C) fp32, zero where the completion mask is 0.
        entropies: (B, C) fp32 (zero where masked) if ``compute_entropy``, else None.

    Raises:
        ValueError: shape mismatch, ``logits_to_keep`` out of range, ``temperature <= 0``, right-padded prompts,
            unknown ``sharing``; under sequence parallelism, a micro-batch the path cannot serve (the cause named).
        TypeError: non-integer ids or ``logits_to_keep``.
    """
    options = dict(temperature=temperature, compute_entropy=compute_entropy, cast_lm_head_to_fp32=cast_lm_head_to_fp32)
    session = SharingSession(sharing, confirm=confirm, sequence_parallel=sequence_parallel)
    return session.score(model, input_ids, attention_mask, logits_to_keep, **options)

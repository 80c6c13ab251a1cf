"""A sharing session: prompt passes shared across the micro-batches of a window, with an explicit lifecycle.

Within one optimizer step the parameters do not change, so a prompt whose group is spread over several micro-batches
needs one forward and one backward, not one per micro-batch. A ``SharingSession`` owns what that takes: the window's
plan (which prompts each micro-batch holds), the ``PromptStore`` of kept prompt passes, and, for sharded ranks, the
agreement that every rank's plan costs the same module calls. Lifecycle::

    session = SharingSession()
    session.begin_window(model, [prompt_ids_1, ...], [prompt_mask_1, ...])   # the window's micro-batches, in order
    for micro_batch in window:
        logps, ent = session.score(model, input_ids, attention_mask, logits_to_keep)   # then backward
    session.close_window()

The last ``score`` of a window sends every prompt gradient still pending into its own output, so the window's last
backward (where DDP synchronises) completes every prompt graph. This module knows transformers, not TRL.
"""

from __future__ import annotations

import torch

from .distributed import lockstep
from .group_forward import GroupRequest, check_sharing, score
from .store import PromptStore, prompt_keys, store_schedule
from .tree_forward import TreeWindow
from .trie import DEFAULT_MIN_SHARED_TOKENS

__all__ = ["SharingSession"]


class SharingSession:
    """Prompt sharing across the micro-batches of one window (a run of micro-batches within one optimizer step).

    Args:
        sharing: ``"tree"``: the window's prompts form a ``PromptTrie``; every span several prompts share (a system
            prompt, a few-shot block) and every prompt is forwarded once per window (``tree_forward``). ``"group"``:
            every unique prompt is forwarded whole, once per window. Ranks in lockstep (FSDP, DeepSpeed) share by
            group whatever is asked, since a window's trie differs between ranks.
        min_shared_tokens: tree mode: the shortest span forwarded as a node of its own (``PromptTrie``).

    Attributes:
        store: the ``PromptStore`` of prompt passes kept for a later micro-batch of the current window (group mode).
        tree: the current window's ``TreeWindow`` (tree mode), else None.
        sharing: whether the current window shares prompts across micro-batches (False when sharded ranks' plans
            differ, or between windows).
        windows_unshared: how many windows were run without sharing because ranks' plans differed.

    Raises:
        ValueError: unknown ``sharing``.
    """

    def __init__(self, sharing: str = "tree", *, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS):
        self.mode = check_sharing(sharing)
        self.min_shared_tokens = min_shared_tokens
        self.store = PromptStore()
        self.tree: TreeWindow | None = None
        self.sharing = False
        self.windows_unshared = 0
        self._plan: list[list[bytes]] = []
        self._next = 0

    @property
    def in_window(self) -> bool:
        return self._next < len(self._plan)

    def begin_window(self, model, prompt_ids: list[torch.Tensor], prompt_masks: list[torch.Tensor]) -> None:
        """Plan a window of ``len(prompt_ids)`` micro-batches; closes the previous window if one is open.

        Args:
            model: the model the window trains (its wrappers tell whether ranks must agree, see ``lockstep``).
            prompt_ids: per micro-batch, (B_i, P_i) int64 left-padded prompt ids, in the order they will be scored.
            prompt_masks: per micro-batch, (B_i, P_i) 0/1 prompt masks.

        With ranks in lockstep, every rank's ``store_schedule`` is compared (one ``all_gather_object``); the window
        shares prompts only if they are all equal.

        Raises:
            ValueError: no micro-batch, or lists of different lengths.
        """
        if not prompt_ids or len(prompt_ids) != len(prompt_masks):
            raise ValueError(
                f"a window needs one prompt mask per micro-batch, got {len(prompt_ids)} prompt tensors and "
                f"{len(prompt_masks)} masks"
            )
        self.close_window()
        self._plan = [prompt_keys(ids, mask) for ids, mask in zip(prompt_ids, prompt_masks)]
        self._next = 0
        self.sharing = True
        if self.mode == "tree" and not lockstep(model):
            self.tree = TreeWindow.plan(prompt_ids, prompt_masks, keys=self._plan,
                                        min_shared_tokens=self.min_shared_tokens)  # fmt: skip
        elif lockstep(model):
            import torch.distributed as dist

            mine = store_schedule((), self._plan, closes=True)
            schedules = [None] * dist.get_world_size()
            dist.all_gather_object(schedules, mine)
            if any(s != mine for s in schedules):
                self.sharing = False
                self.windows_unshared += 1

    def shares(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> bool:
        """Whether the next micro-batch of the window shares a prompt pass with another micro-batch (so that scoring
        it through grpo_mem saves work even if none of its own prompts repeats)."""
        if not (self.sharing and self.in_window):
            return False
        if self.tree is not None:
            return self.tree.shares(prompt_keys(prompt_ids, prompt_mask))
        keys = set(prompt_keys(prompt_ids, prompt_mask))
        return bool(keys & set(self.store.entries)) or any(keys & set(k) for k in self._plan[self._next + 1 :])

    def score(self, model, input_ids, attention_mask, logits_to_keep: int, *, temperature: float = 1.0,
              compute_entropy: bool = False, cast_lm_head_to_fp32: bool = False):  # fmt: skip
        """Score the window's next micro-batch; same arguments and returns as ``shared_prompt_logprobs``.

        Outside a window (or in a window that does not share), the micro-batch is scored on its own.

        Raises:
            ValueError: the micro-batch's prompts are not the ones planned for it by ``begin_window``.
        """
        P = input_ids.shape[1] - logits_to_keep
        request = GroupRequest(logits_to_keep, float(temperature), bool(compute_entropy), bool(cast_lm_head_to_fp32))
        if not self.in_window:
            return score(model, input_ids, attention_mask, request)
        keys = prompt_keys(input_ids[:, :P], attention_mask[:, :P])
        planned = self._plan[self._next]
        if keys != planned:
            raise ValueError(
                f"micro-batch {self._next} of the window does not hold the prompts planned for it "
                f"({len(set(keys))} unique prompts in {len(keys)} rows, planned {len(set(planned))} in {len(planned)})"
            )
        self._next += 1
        if not self.sharing:
            return score(model, input_ids, attention_mask, request)
        if self.tree is not None:
            self.tree.current = self._next - 1  # micro-batches skipped or scored on the stock path count too
            request.sharing, request.tree, request.prompt_keys = "tree", self.tree, keys
            store = self.tree.store
        else:
            request.store = store = self.store
            request.later = frozenset(k for mb in self._plan[self._next :] for k in mb)
        logps, entropy = score(model, input_ids, attention_mask, request)
        if not self.in_window:  # the window's last micro-batch: complete every pending prompt graph in its backward
            logps = store.flush_into(logps)
        return logps, entropy

    def skip(self) -> None:
        """Pass over the window's next micro-batch (scored elsewhere, e.g. on the stock path). Only valid when it
        shares nothing (``shares`` is False): none of its prompts is kept or planned again."""
        if self.in_window:
            self._next += 1
            if self.tree is not None:
                self.tree.finish_micro_batch()

    def end_after_next(self) -> None:
        """Make the next micro-batch the window's last (the optimizer steps after it, earlier than planned): prompts
        planned for later micro-batches are not kept, and what is pending is completed in its backward."""
        if self.in_window:
            self._plan = self._plan[: self._next + 1]
            if self.tree is not None:
                self.tree.end_after_current()

    def close_window(self) -> None:
        """End the current window. Raises RuntimeError if prompt gradients are still pending (a planned micro-batch
        was never scored), since their prompt graphs would never be backpropagated."""
        tree, self.tree = self.tree, None
        self._plan, self._next, self.sharing = [], 0, False
        for store in (self.store, tree.store if tree is not None else None):
            if store is None or not len(store):
                continue
            pending = len(store)
            store.entries.clear()
            raise RuntimeError(f"window closed with {pending} prompt passes pending: a planned micro-batch was not scored")

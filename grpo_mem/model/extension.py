"""The interface of a pass extension: what a mechanism beyond text attention (image inputs, recurrent state, the MoE
router loss) adds to the passes of a micro-batch that ``window.Window`` runs one call each. A text micro-batch runs
none, so this module is not on its path. It knows torch only."""

from __future__ import annotations

import torch

__all__ = ["PassExtension"]


class PassExtension:
    """What a mechanism beyond text attention adds to the passes of a micro-batch; each hook's default adds nothing.
    ``name``: the key of its records in ``PromptStates.extras``; ``all_completion_tokens``: the completion pass runs
    all C tokens (``completion_width``'s ``router``). Each hook gets ``mb``, the ``window.MicroBatch`` being run."""

    name = ""
    all_completion_tokens = False

    def call_kwargs(self, mb, spec, width: int) -> dict:
        """Extra backbone keyword arguments of the pass ``spec`` (None: the completion pass), ``width`` tokens per row;
        a ``position_ids`` entry replaces the pass's own positions as the model's (e.g. M-RoPE's)."""
        return {}

    def context(self, mb, starts: list[int | None], lengths: list[int] | None, release: int) -> dict:
        """Fields of the pass's attention context: its rows continue the nodes ``starts`` (None or []: nothing), hold
        ``lengths`` real tokens (None: the completion pass); the pass is released in micro-batch ``release``."""
        return {}

    def record(self, mb, out, ctx, keeper, tokens: int) -> dict[int, tuple[torch.Tensor, ...]]:
        """What the pass keeps of its call by layer (``PromptStates.extras[name]``), from the backbone's output ``out``
        over ``tokens`` tokens, its attention context ``ctx`` and ``keeper`` (``attention_hook.keep_alive``, or None)."""
        return {}

    def loss(self, mb, completion: dict, completion_mask: torch.Tensor) -> torch.Tensor | None:
        """A 0-d loss of the micro-batch from the passes its rows read (``PassTable.read_by_rows``) and the
        completion pass's records ``completion`` (by extension name), or None."""
        return None

"""What the passes of one image micro-batch add to their backbone calls (``VisionPasses``, made by
``multimodal.VisionInputs.bind``).

On a model with multi-axis positions a pass gets the image features of the images whose tokens it holds (the model's own
``get_image_features``, once per pass entry: a unique prompt in group sharing, a trie node in tree sharing), which
the model's own forward merges into the embeddings (``mm_encoder_outputs``: its ``get_placeholder_mask`` checks the
image-token count and raises its own error), and the positions the model's own ``compute_3d_position_ids`` gives
the whole row (M-RoPE over prompt + completion), of which each pass takes its tokens' columns (a node's columns are
equal on every row through it: they depend on the prefix only). On a model with 1D positions a prompt pass gets
its rows' own image inputs (a trie node: the entries of the images whose first token it holds) and prompt token
types, and the model's forward encodes, merges and masks (Gemma 3's bidirectional image blocks) as it does for
stock, at the pass's own positions (1D RoPE: a node's positions continue its prefix's, as the row's do).

``VisionPasses`` is the window's pass extension for image micro-batches (``window.PassExtension``). Node slices
``(b, first, end)`` are ``plan.WindowPlan.slices``'. This module knows transformers, not TRL.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from .extension import PassExtension

__all__ = ["VisionPasses", "prompt_columns"]


@functools.lru_cache(maxsize=None)
def _no_cache(method) -> dict:
    """The keyword that tells ``method`` (a model class's method) it has no cache: ``cache=None`` from transformers 5.24
    on (where some models' ``compute_3d_position_ids`` require it), ``past_key_values=None`` before; read from its
    signature."""
    params = inspect.signature(method).parameters
    return {name: None for name in ("cache", "past_key_values") if name in params}


def prompt_columns(
    t: torch.Tensor, slices: list[tuple[int, int, int]], width: int, attention_mask: torch.Tensor, prompt_width: int
) -> torch.Tensor:
    """``t`` (..., B, T)'s prompt columns of ``slices`` right-padded to ``width`` with zeros, (..., len(slices),
    width): entry i holds tokens ``first … end − 1`` of row b's unpadded prompt, ``(b, first, end) = slices[i]``
    (``attention_mask`` (B, T) left-pads the first ``prompt_width`` columns)."""
    out = t.new_zeros(*t.shape[:-2], len(slices), width)
    for i, (b, first, end) in enumerate(slices):
        start = prompt_width - int(attention_mask[b, :prompt_width].sum())
        out[..., i, : end - first] = t[..., b, start + first : start + end]
    return out


@dataclass
class VisionPasses(PassExtension):
    """The image features and positions the passes of one micro-batch take (built by ``VisionInputs.bind``): the
    window's pass extension for image inputs (``call_kwargs``).

    Attributes:
        inputs: the micro-batch's ``multimodal.VisionInputs``.
        base: the model's base model (vision tower, merge, language model).
        input_ids, attention_mask: (B, T) the micro-batch.
        prompt_width: P, the prompt columns of the micro-batch (left-padded prompts, then completions).
    """

    inputs: object
    base: torch.nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    _positions: tuple = ()
    _runs: tuple = ()
    name = "images"

    def call_kwargs(self, mb, spec, width: int) -> dict:
        """``prompt_pass`` of a node pass's slices (nothing for a stand-in), ``completion_positions`` as the
        completion pass's ``position_ids`` where the model has positions of its own."""
        if spec is None:
            positions = self.completion_positions(width)
            return {} if positions is None else {"position_ids": positions}
        return self.prompt_pass(mb.window.plan.slices(mb.index, spec), width) if spec.nodes else {}

    @property
    def multi_axis(self) -> bool:
        """Whether the model computes multi-axis positions of its own (``compute_3d_position_ids``: M-RoPE)."""
        return callable(getattr(self.base, "compute_3d_position_ids", None))

    def positions(self) -> torch.Tensor | None:
        """(3, B, T) int64 positions the model computes for the rows (prompt + completion), as its forward does, or
        None when the model would use ``arange(T)`` (no token types given, or a model with 1D positions), which the
        passes' own positions are."""
        if not self._positions:
            types = self.inputs.mm_token_type_ids if self.multi_axis else None
            self._positions = (
                None
                if types is None
                else self.base.compute_3d_position_ids(
                    input_ids=self.input_ids,
                    image_grid_thw=self.inputs.image_grid_thw,
                    video_grid_thw=None,
                    inputs_embeds=None,
                    attention_mask=self.attention_mask,
                    mm_token_type_ids=types,
                    **_no_cache(type(self.base).compute_3d_position_ids),
                ),
            )
        return self._positions[0]

    def prompt_pass(self, slices: list[tuple[int, int, int]], width: int) -> dict:
        """Extra keyword arguments of the backbone call of a prompt pass whose entry i holds tokens ``first … end-1``
        of row b's unpadded prompt, ``(b, first, end) = slices[i]`` (a whole prompt in group sharing, a trie node in
        tree sharing), right-padded to ``width`` tokens. A model with multi-axis positions (``compute_3d_position_ids``)
        gets ``mm_encoder_outputs`` (the features of the images whose first token the entries hold, computed here
        once) and ``position_ids`` (3, n, width), each only where needed; any other model the rows' own image inputs
        and the slices' token types (``VisionInputs.prompt_inputs``): its forward encodes the images once per pass,
        merges them and builds its own mask from the token types (Gemma 3's bidirectional image blocks), at the pass's
        own positions.

        Raises:
            ValueError: the model's own (``get_placeholder_mask``), when the entries' image tokens do not match their
                image features; with multi-axis positions checked before them, as they assume a match.
        """
        images = self.images_of(slices)
        if not self.multi_axis:
            return self.inputs.prompt_inputs(slices, images, width, self.attention_mask, self.prompt_width)
        kwargs, P = {}, self.prompt_width
        if images:
            starts = [P - int(self.attention_mask[b, :P].sum()) for b, _, _ in slices]  # each row's first real column
            pixel_values, grid = self.inputs.images_at(images)
            features = self.base.get_image_features(pixel_values, grid, return_dict=True)
            merged = torch.cat(features.pooler_output, dim=0)
            ids = torch.cat([self.input_ids[b, s + first : s + end] for (b, first, end), s in zip(slices, starts)])
            self.base.get_placeholder_mask(ids[None], inputs_embeds=merged[:1], image_features=merged)
            kwargs["mm_encoder_outputs"] = {"image": features}
        positions = self.positions()
        if positions is not None:
            kwargs["position_ids"] = prompt_columns(positions, slices, width, self.attention_mask, P)
        return kwargs

    def images_of(self, slices: list[tuple[int, int, int]]) -> list[int]:
        """The chunk's indices of the images whose first token the prompt-pass entries ``slices`` (as ``prompt_pass``)
        hold: the images the pass encodes (none: the pass does not run the vision tower)."""
        P = self.prompt_width
        starts = [P - int(self.attention_mask[b, :P].sum()) for b, _, _ in slices]  # each row's first real column
        return [i for (b, first, end), s in zip(slices, starts) for i in self._images_in(b, s + first, s + end)]

    def _images_in(self, b: int, first: int, end: int) -> list[int]:
        """The chunk's indices of row b's images whose first token lies in prompt columns ``first … end-1``
        (``VisionInputs.images_in``, the runs computed once per micro-batch)."""
        if self.inputs.pixel_values is None:
            return []
        if not self._runs:
            self._runs = (self.inputs.image_runs(self.prompt_width),)
        return self.inputs.images_in(self._runs[0], b, first, end)

    def completion_positions(self, width: int) -> torch.Tensor | None:
        """(3, B, width) positions of completion tokens 0 … width − 1, or None (the passes' own positions)."""
        positions = self.positions()
        return None if positions is None else positions[:, :, self.prompt_width : self.prompt_width + width]


def extension(causal_lm, call) -> VisionPasses:
    """The image mechanism's pass extension (``mechanisms.TABLE``): the call's bound image inputs, ``call.images``."""
    return call.images

"""Image prompts on the prompt-once path: a micro-batch's images, which rows share them, and what each pass adds.

TRL 1.16 hands the scoring method a generation batch's images as one ``pixel_values`` tensor of patch rows (all
images of all rows, in row order), ``image_grid_thw`` (one (t, h, w) patch grid per image), ``num_images`` (images per
row) and ``mm_token_type_ids`` (0 text, 1 image, per token of prompt + completion), and slices them per chunk of rows.
Stock TRL repeats a prompt's images for each of its G rows, so the vision tower runs G times per prompt. Here:

- ``VisionInputs`` holds one chunk's image inputs (``VisionInputs.of_chunk`` slices TRL's arguments as TRL does) and
  keys each row by its images (``RowImages``), so that rows group by (prompt ids, images)
  (``PromptGrouping.of(..., extra=...)``) and, in tree sharing, the trie tells images apart (``trie_keys``: an image
  token is keyed by its image, so prompts share a span while their images are equal and part at the first image
  token where they differ; a shared text prefix before the images, e.g. a system prompt, is a node like any other).
- ``VisionInputs.bind`` gives a ``Window`` what its passes add for one micro-batch (``VisionPasses``): a pass gets the
  image features of the images whose tokens it holds (the model's own ``get_image_features``, once per pass entry: a
  unique prompt in group sharing, a trie node in tree sharing), which the model's own forward merges into the
  embeddings (``mm_encoder_outputs``: its ``get_placeholder_mask`` checks the image-token count and raises its own
  error), and the multi-axis positions the model's own ``compute_3d_position_ids`` gives the whole row
  (Qwen2-VL/2.5-VL/3-VL M-RoPE over prompt + completion), of which each pass takes its tokens' columns (a node's
  columns are equal on every row through it: they depend on the prefix only).

Which models take this path is decided in ``support.vision_language_reason``. This module knows transformers, not TRL.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import torch

__all__ = ["SERVED_INPUTS", "RowImages", "VisionInputs", "VisionPasses", "input_cause", "trie_keys",
           "warn_tree_to_group"]  # fmt: skip

# the scoring method's multimodal arguments this path takes; any other one is a named cause for the stock path
SERVED_INPUTS = frozenset({"pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids"})
TREE_TO_GROUP = "these image prompts cannot be split into trie nodes: their micro-batches use group sharing"

_warned_tree = [False]


def warn_tree_to_group(cause: str) -> None:
    """Warn once per process that image prompts take group sharing although tree sharing was asked for, because of
    ``cause`` (``VisionInputs.tree_cause``)."""
    if not _warned_tree[0]:
        _warned_tree[0] = True
        warnings.warn(f"grpo_mem: {TREE_TO_GROUP} ({cause})", stacklevel=3)


def input_cause(extras: dict) -> str | None:
    """Why the scoring method's multimodal arguments ``extras`` (name -> value, None when not given) cannot take the
    prompt-once path, or None (no image input at all, or only ``SERVED_INPUTS`` with a patch grid per image)."""
    used = sorted(k for k, v in extras.items() if v is not None)
    other = [k for k in used if k not in SERVED_INPUTS]
    if other:
        return f"multimodal or token-type inputs {other}"
    if extras.get("pixel_values") is not None and (extras.get("image_grid_thw") is None or
                                                   extras.get("num_images") is None):  # fmt: skip
        return "pixel_values without image_grid_thw and num_images (images not laid out as patch grids)"
    return None


def _digest(*tensors: torch.Tensor) -> bytes:
    """A digest of the tensors' shapes, dtypes and bytes (equal tensors, equal digests)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(repr((tuple(t.shape), t.dtype)).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def image_keys(parts: list[list[torch.Tensor]]) -> list[bytes]:
    """Per row b, a key of its image tensors ``parts[b]`` (patch rows, grids, token types, in a fixed order): rows
    whose tensors are equal get equal keys, rows with other tensors other keys; a row without tensors gets ``b""``."""
    return [_digest(*row) if row else b"" for row in parts]


@dataclass(frozen=True)
class RowImages:
    """A row's image inputs as a prompt key (``VisionInputs.row_keys``): equal exactly for rows whose prompt token types
    and image tensors are equal, and telling where each image's tokens sit in the prompt.

    Attributes:
        types: ``image_keys`` digest of the row's prompt token types (``b""`` without token types).
        images: per image of the row, in order, its ``image_keys`` digest (patch rows and grid).
        spans: per image, (tokens from its first token to the prompt's end, its token count), or ``()`` when the
            token types that locate them are not given.
        tree_cause: why the row's images cannot sit below a trie root (``VisionInputs.tree_cause``), or None.
    """

    types: bytes
    images: tuple[bytes, ...]
    spans: tuple[tuple[int, int], ...]
    tree_cause: str | None


def trie_keys(ids: list[int], row) -> tuple:
    """What the prompt trie compares for a prompt of real (unpadded) token ids ``ids`` whose row key is ``row``
    (``RowImages``, or anything else for a text prompt): the ids, with each image token keyed by (id, image digest,
    image token count, index in the image) instead.

    So two prompts share a span while their ids and images agree, and part at the first token of the first image that
    differs. An image is never split between trie nodes: the keys of two images' runs agree at their first token only
    when both are the same image in runs of the same length, and then on every token of the run; a node holding an
    image's first token holds all of it, and gets its features (``VisionPasses.prompt_pass``).
    """
    if not isinstance(row, RowImages) or not row.spans:
        return tuple(ids)
    keys = list(ids)
    for (back, count), image in zip(row.spans, row.images):
        first = len(ids) - back
        for i in range(first, first + count):
            keys[i] = (ids[i], image, count, i - first)
    return tuple(keys)


@dataclass(frozen=True)
class VisionInputs:
    """The image inputs of one chunk of B rows, as TRL 1.16 gives them to the model.

    Attributes:
        pixel_values: (N, D) float, the patch rows of every image of the chunk, image after image in row order.
        image_grid_thw: (I, 3) int64, the (t, h, w) patch grid of each image; image i has ``t * h * w`` rows.
        num_images: B ints, the images of each row (0 for a text-only row).
        mm_token_type_ids: (B, T) int, 0 text / 1 image per token of prompt + completion, or None.
    """

    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    num_images: tuple[int, ...]
    mm_token_type_ids: torch.Tensor | None

    @classmethod
    def of_chunk(cls, extras: dict, start: int, end: int, rows: int) -> VisionInputs | None:
        """Rows ``start … end − 1`` of the inputs ``extras`` that TRL passes for ``rows`` rows (``input_cause`` is
        None for them), sliced as TRL's own method slices them per chunk; None when no row has an image input.

        Raises:
            ValueError: ``num_images`` not one count per row, or counts that ``image_grid_thw`` / ``pixel_values``
                do not hold (naming both numbers).
        """
        pixel_values, grid = extras.get("pixel_values"), extras.get("image_grid_thw")
        types = extras.get("mm_token_type_ids")
        if pixel_values is None and types is None:
            return None
        counts = extras.get("num_images")
        counts = [0] * rows if counts is None else [int(n) for n in counts]
        if len(counts) != rows:
            raise ValueError(f"num_images must give one image count per row ({rows} rows), got {len(counts)} counts")
        first_image, last_image = sum(counts[:start]), sum(counts[:end])
        if pixel_values is not None:
            if grid.shape[0] != sum(counts):
                raise ValueError(f"num_images counts {sum(counts)} images but image_grid_thw has {grid.shape[0]} grids")
            patches = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()
            if patches[-1] != pixel_values.shape[0]:
                raise ValueError(f"image_grid_thw holds {patches[-1]} patch rows but pixel_values has "
                                 f"{pixel_values.shape[0]}")  # fmt: skip
            pixel_values = pixel_values[patches[first_image] : patches[last_image]]
            grid = grid[first_image:last_image]
        return cls(pixel_values, grid, tuple(counts[start:end]), None if types is None else types[start:end])

    def as_kwargs(self) -> dict:
        """The chunk as keyword arguments of TRL's scoring method (its stock path)."""
        kwargs = {"num_images": list(self.num_images)} if self.pixel_values is not None else {}
        for name in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs

    def first_images(self) -> list[int]:
        """The chunk's index of each row's first image, then the image count (B + 1 ints)."""
        return torch.tensor([0, *self.num_images]).cumsum(0).tolist()

    def _first_patches(self) -> list[int]:
        """The first patch row of each image, then the patch-row count (I + 1 ints)."""
        return torch.cat([self.image_grid_thw.new_zeros(1), self.image_grid_thw.prod(-1).cumsum(0)]).tolist()

    def images_of(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(patch rows (N', D), grids (I', 3)) of the images of ``rows`` (indices into the chunk), in that order."""
        firsts = self.first_images()
        return self.images_at([i for b in rows for i in range(firsts[b], firsts[b + 1])])

    def images_at(self, images: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(patch rows (N', D), grids (I', 3)) of ``images`` (indices into the chunk's images), in that order."""
        patches = self._first_patches()
        index = torch.tensor([p for i in images for p in range(patches[i], patches[i + 1])], dtype=torch.long)
        return (self.pixel_values.index_select(0, index.to(self.pixel_values.device)),
                self.image_grid_thw[torch.tensor(images, dtype=torch.long).to(self.image_grid_thw.device)])  # fmt: skip

    def image_runs(self, prompt_width: int) -> list[list[tuple[int, int]]]:
        """Per row, the prompt columns ``(first, end)`` of each of its images' tokens: the maximal runs of image token
        type (1) in the first ``prompt_width`` columns, one per image in order, as the model's own
        ``compute_3d_position_ids`` takes them; ``[]`` for every row without images or token types.

        Raises:
            ValueError: a row with image inputs whose prompt holds another number of runs than it has images.
        """
        if self.mm_token_type_ids is None or self.pixel_values is None:
            return [[] for _ in self.num_images]
        image = (self.mm_token_type_ids[:, :prompt_width] == 1).to(torch.int8).cpu()
        edge = torch.zeros(image.shape[0], 1, dtype=torch.int8)
        steps = torch.diff(image, dim=1, prepend=edge, append=edge)  # +1 at a run's first column, -1 after its last
        runs = []
        for b, count in enumerate(self.num_images):
            starts, ends = (steps[b] == 1).nonzero().flatten().tolist(), (steps[b] == -1).nonzero().flatten().tolist()
            if len(starts) != count:
                raise ValueError(f"row {b} has {count} images (num_images) but its prompt holds {len(starts)} runs of "
                                 "image tokens (mm_token_type_ids == 1)")  # fmt: skip
            runs.append(list(zip(starts, ends)))
        return runs

    def row_keys(self, prompt_width: int) -> list:
        """Per row, its ``RowImages`` (its prompt's token types, the first ``prompt_width`` columns; its images' digests
        and where their tokens sit), or ``b""`` for a row with neither token types nor images: rows of one prompt
        have equal keys, rows with other images or types other keys.

        Raises:
            ValueError: as ``image_runs``.
        """
        B = len(self.num_images)
        types = [b""] * B
        if self.mm_token_type_ids is not None:
            types = image_keys([[self.mm_token_type_ids[b, :prompt_width]] for b in range(B)])
        images = []
        if self.pixel_values is not None:
            patches = self._first_patches()
            images = image_keys([[self.pixel_values[patches[i] : patches[i + 1]], self.image_grid_thw[i : i + 1]]
                                 for i in range(len(patches) - 1)])  # fmt: skip
        runs, firsts, cause = self.image_runs(prompt_width), self.first_images(), self.tree_cause()
        keys = []
        for b in range(B):
            own = tuple(images[firsts[b] : firsts[b + 1]])
            spans = tuple((prompt_width - first, end - first) for first, end in runs[b])
            keys.append(RowImages(types[b], own, spans, cause if own else None) if types[b] or own else b"")
        return keys

    def tree_cause(self) -> str | None:
        """Why the chunk's image prompts cannot be split into trie nodes (tree sharing), or None: each image's tokens
        must be located in the prompt (``mm_token_type_ids``) and attend causally, as the Qwen layout's do."""
        if self.pixel_values is not None and self.mm_token_type_ids is None:
            return "image inputs without mm_token_type_ids (the image tokens are not located)"
        return None

    def cause(self, causal_lm, prompt_width: int) -> str | None:
        """Why the chunk cannot take the prompt-once path on ``causal_lm``, a model ``support.unsupported_reason``
        serves: image inputs given to a model without a vision tower, or image tokens in a completion."""
        if causal_lm.config.get_text_config() is causal_lm.config:
            return "image inputs given to a text-only model"
        if self.mm_token_type_ids is not None and bool(self.mm_token_type_ids[:, prompt_width:].any()):
            return "image or video tokens in a completion (images returned by a tool)"
        return None

    def bind(self, causal_lm, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> VisionPasses:
        """What the passes of the micro-batch ``input_ids``/``attention_mask`` (B, T), whose prompts are the first
        ``prompt_width`` columns, add on ``causal_lm`` (its base model has ``compute_3d_position_ids`` and
        ``get_image_features``: ``support.vision_language_reason``)."""
        return VisionPasses(self, causal_lm.base_model, input_ids, attention_mask, prompt_width)


@dataclass
class VisionPasses:
    """The image features and positions the passes of one micro-batch take (built by ``VisionInputs.bind``).

    Attributes:
        inputs: the micro-batch's ``VisionInputs``.
        base: the model's base model (vision tower, merge, language model).
        input_ids, attention_mask: (B, T) the micro-batch.
        prompt_width: P, the prompt columns of the micro-batch (left-padded prompts, then completions).
    """

    inputs: VisionInputs
    base: torch.nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    _positions: tuple = ()
    _runs: tuple = ()

    def positions(self) -> torch.Tensor | None:
        """(3, B, T) int64 positions the model computes for the rows (prompt + completion), as its forward does, or
        None when the model would use ``arange(T)`` (no token types given), which the passes' own positions are."""
        if not self._positions:
            types = self.inputs.mm_token_type_ids
            self._positions = (None if types is None else self.base.compute_3d_position_ids(
                input_ids=self.input_ids, image_grid_thw=self.inputs.image_grid_thw, video_grid_thw=None,
                inputs_embeds=None, attention_mask=self.attention_mask, past_key_values=None, mm_token_type_ids=types,
            ),)  # fmt: skip
        return self._positions[0]

    def prompt_pass(self, spans: list[tuple[int, int, int]], width: int) -> dict:
        """Extra keyword arguments of the backbone call of a prompt pass whose entry i holds tokens ``first … end-1``
        of row b's unpadded prompt, ``(b, first, end) = spans[i]`` (a whole prompt in group sharing, a trie node in
        tree sharing), right-padded to ``width`` tokens: ``mm_encoder_outputs`` (the features of the images whose first
        token the entries hold, computed here once) and ``position_ids`` (3, n, width), each only where needed.

        Raises:
            ValueError: the model's own (``get_placeholder_mask``), when the entries' image tokens do not match their
                image features; checked before the positions, which assume they match.
        """
        kwargs, P = {}, self.prompt_width
        starts = [P - int(self.attention_mask[b, :P].sum()) for b, _, _ in spans]  # each row's first real column
        images = [i for (b, first, end), s in zip(spans, starts) for i in self._images_in(b, s + first, s + end)]
        if images:
            pixel_values, grid = self.inputs.images_at(images)
            features = self.base.get_image_features(pixel_values, grid, return_dict=True)
            merged = torch.cat(features.pooler_output, dim=0)
            ids = torch.cat([self.input_ids[b, s + first : s + end] for (b, first, end), s in zip(spans, starts)])
            self.base.get_placeholder_mask(ids[None], inputs_embeds=merged[:1], image_features=merged)
            kwargs["mm_encoder_outputs"] = {"image": features}
        positions = self.positions()
        if positions is not None:
            kwargs["position_ids"] = positions.new_zeros(3, len(spans), width)
            for i, ((b, first, end), s) in enumerate(zip(spans, starts)):
                kwargs["position_ids"][:, i, : end - first] = positions[:, b, s + first : s + end]
        return kwargs

    def _images_in(self, b: int, first: int, end: int) -> list[int]:
        """The chunk's indices of row b's images whose first token lies in prompt columns ``first … end-1``; all of
        the row's images when their tokens are not located (``VisionInputs.tree_cause``: then a span is a whole
        prompt)."""
        if self.inputs.pixel_values is None:
            return []
        if not self._runs:
            self._runs = (self.inputs.image_runs(self.prompt_width),)
        runs, row_first = self._runs[0][b], self.inputs.first_images()[b]
        if self.inputs.mm_token_type_ids is None:
            return list(range(row_first, row_first + self.inputs.num_images[b]))
        return [row_first + k for k, (start, _) in enumerate(runs) if first <= start < end]

    def completion_positions(self, width: int) -> torch.Tensor | None:
        """(3, B, width) positions of completion tokens 0 … width − 1, or None (the passes' own positions)."""
        positions = self.positions()
        return None if positions is None else positions[:, :, self.prompt_width : self.prompt_width + width]

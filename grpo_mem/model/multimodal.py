"""Image prompts on the prompt-once path: a micro-batch's images, which rows share them, and what each pass adds.

A micro-batch's images (per row: its image tensors and token types, as the TRL patch slices them,
``grpo_mem.patches.trl_images``) are one value, ``VisionInputs``, built once per micro-batch and used both to plan the
window and to decide and run the micro-batch. Stock TRL repeats a prompt's images for each of its G rows, so the vision
tower runs G times per prompt. Here:

- ``VisionInputs`` keys each row by its images (``RowImages``, once per value: ``row_keys``), so that rows group by
  (prompt ids, images) (``PromptGrouping.of(..., extra=...)``) and, in tree sharing, the trie tells images apart
  (``trie_keys``: an image token is keyed by its image, so prompts share a span while their images are equal and part
  at the first image token where they differ; a shared text prefix before the images, e.g. a system prompt, is a
  node like any other). Tree sharing needs each image's tokens located and attending causally: the patch-row layout
  with ``mm_token_type_ids`` (Qwen), and one entry per image located as one run of the model's image token id per
  image (LLaVA, LLaVA-NeXT, Mistral 3, Aya Vision); other image prompts take group sharing
  (``VisionInputs.tree_cause``).
- ``VisionInputs.bind`` gives a ``Window`` what its passes add for one micro-batch (``vision_passes.VisionPasses``).

Which models take this path is decided in ``support.vision_language_cause``. This module knows transformers, not TRL.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field

import torch

from .content_hash import image_keys
from .vision_passes import VisionPasses, prompt_columns

__all__ = ["RowImages", "VisionInputs", "image_token_id", "trie_keys", "warn_tree_to_group"]

TREE_TO_GROUP = "these image prompts cannot be split into trie nodes: their micro-batches use group sharing"

_warned_tree = [False]


def warn_tree_to_group(cause: str) -> None:
    """Warn once per process that image prompts take group sharing although tree sharing was asked for, because of
    ``cause`` (``VisionInputs.tree_cause``)."""
    if not _warned_tree[0]:
        _warned_tree[0] = True
        warnings.warn(f"grpo_mem: {TREE_TO_GROUP} ({cause})", stacklevel=3)


def image_token_id(causal_lm) -> int | None:
    """The token id ``causal_lm``'s processor places once per image feature (``config.image_token_id``, which LLaVA's
    family maps to ``image_token_index``), or None."""
    found = getattr(causal_lm.config, "image_token_id", None)
    return found if isinstance(found, int) else None


def _runs(image: torch.Tensor, counts) -> tuple[list[list[tuple[int, int]]], str | None]:
    """Per row of ``image`` (B, P) bool, the columns ``(first, end)`` of its maximal runs of True, and why they do not
    give one run per image of the B ``counts`` (naming the first such row), or None."""
    image = image.to(torch.int8).cpu()
    edge = torch.zeros(image.shape[0], 1, dtype=torch.int8)
    steps = torch.diff(image, dim=1, prepend=edge, append=edge)  # +1 at a run's first column, -1 after its last
    runs, bad = [], None
    for b, count in enumerate(counts):
        starts, ends = (steps[b] == 1).nonzero().flatten().tolist(), (steps[b] == -1).nonzero().flatten().tolist()
        if len(starts) != count and bad is None:
            bad = f"row {b} has {count} images (num_images) but its prompt holds {len(starts)} runs of image tokens"
        runs.append(list(zip(starts, ends)))
    return runs, bad


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same memory the same way (hence hold the same values)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


@dataclass(frozen=True)
class RowImages:
    """A row's image inputs as a prompt key (``VisionInputs.row_keys``): equal exactly for rows whose prompt token types
    and image tensors are equal, and telling where each image's tokens sit in the prompt.

    Attributes:
        types: ``image_keys`` digest of the row's prompt token types (``b""`` without token types).
        images: per image of the row, in order, its ``image_keys`` digest (patch rows and grid; or its entries, when
            ``VisionInputs.located``), else one digest of all of the row's image entries.
        runs: per image, (tokens from its first token to the prompt's end, its token count), or ``()`` when its
            tokens are not located (``VisionInputs.image_runs``).
        tree_cause: why the row's images cannot sit below a trie root (``VisionInputs.tree_cause``), or None.
    """

    types: bytes
    images: tuple[bytes, ...]
    runs: tuple[tuple[int, int], ...]
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
    if not isinstance(row, RowImages) or not row.runs:
        return tuple(ids)
    keys = list(ids)
    for (back, count), image in zip(row.runs, row.images):
        first = len(ids) - back
        for i in range(first, first + count):
            keys[i] = (ids[i], image, count, i - first)
    return tuple(keys)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (it holds dicts of tensors)
class VisionInputs:
    """The image inputs of one chunk of B rows, as TRL 1.16 gives them to the model.

    Attributes:
        tensors: the image tensors TRL hands the model, by keyword (``pixel_values``, ``image_grid_thw``,
            ``image_sizes``, ``pixel_attention_mask``, ``spatial_shapes``), each with dim 0 running over the chunk's
            patch rows, images, tiles or rows in row order.
        entries: per name of ``tensors``, B ints: the dim-0 entries of each row.
        num_images: B ints, the images of each row (0 for a text-only row).
        num_tiles: B ints, the tiles of each row, or None (no tiled layout).
        token_types: (B, T) int per token of prompt + completion (``token_type_ids``, ``mm_token_type_ids``: 0 text,
            other values image or video), by keyword.
        located: in the layout of one entry per image without token types, when the model's image token id was
            given: per row, the prompt columns ``(first, end)`` of each run of that id (one per image, in order, when
            ``located_cause`` is None); else None.
        located_cause: why those runs are not one per image (e.g. adjacent images without a separator), or None.
    """

    tensors: dict
    entries: dict
    num_images: tuple[int, ...]
    num_tiles: tuple[int, ...] | None
    token_types: dict
    located: tuple | None = None
    located_cause: str | None = None
    _keys: dict = field(default_factory=dict, repr=False)  # prompt width -> ``row_keys``, computed once

    @property
    def pixel_values(self) -> torch.Tensor | None:
        return self.tensors.get("pixel_values")

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        return self.tensors.get("image_grid_thw")

    @property
    def mm_token_type_ids(self) -> torch.Tensor | None:
        return self.token_types.get("mm_token_type_ids")

    @classmethod
    def make(
        cls,
        tensors: dict,
        entries: dict,
        num_images: tuple[int, ...],
        num_tiles: tuple[int, ...] | None,
        token_types: dict,
        *,
        per_image: bool = False,
        prompt_ids: torch.Tensor | None = None,
        image_token: int | None = None,
    ) -> VisionInputs:
        """The value of these fields (see the class); ``per_image``: the layout is one entry per image, whose tokens
        are then located as the runs of ``image_token`` in ``prompt_ids`` (B, P) left-padded prompts when both are
        given and there are no token types (``located``)."""
        located, located_cause = None, None
        if per_image and not token_types and prompt_ids is not None and image_token is not None:
            found, located_cause = _runs(prompt_ids == image_token, num_images)
            located = tuple(tuple(r) for r in found)
            located_cause = located_cause and f"{located_cause} (id {image_token}: one run per image is needed)"
        return cls(tensors, entries, num_images, num_tiles, token_types, located, located_cause)

    def holds(self, other: VisionInputs) -> bool:
        """Whether ``other`` holds the very tensors of this value (the same memory, shapes and strides) and counts:
        a chunk sliced again from the arguments this value was built from, whose ``row_keys`` are this value's."""
        if self is other:
            return True
        if (self.num_images, self.num_tiles, self.located) != (other.num_images, other.num_tiles, other.located):
            return False
        mine, theirs = dict(self.tensors, **self.token_types), dict(other.tensors, **other.token_types)
        return mine.keys() == theirs.keys() and all(_same_tensor(mine[k], theirs[k]) for k in mine)

    def _entries(self, name: str, rows: list[int]) -> list[int]:
        """The dim-0 indices of ``tensors[name]`` that belong to ``rows`` (indices into the chunk), in that order."""
        firsts = [0, *itertools.accumulate(self.entries[name])]
        return [i for b in rows for i in range(firsts[b], firsts[b + 1])]

    def of_rows(self, rows: list[int]) -> dict:
        """The image tensors of ``rows`` (indices into the chunk), in that order, by keyword: what the model's forward
        takes for a batch of those rows."""
        return self._select({name: self._entries(name, rows) for name in self.tensors})

    def _select(self, entries: dict[str, list[int]]) -> dict:
        """Per name of ``tensors``, its dim-0 ``entries[name]`` in that order."""
        out = {}
        for name, t in self.tensors.items():
            out[name] = t.index_select(0, torch.tensor(entries[name], dtype=torch.long, device=t.device))
        return out

    def first_images(self) -> list[int]:
        """The chunk's index of each row's first image, then the image count (B + 1 ints)."""
        return [0, *itertools.accumulate(self.num_images)]

    def _first_patches(self) -> list[int]:
        """The first patch row of each image, then the patch-row count (I + 1 ints; the patch-row layout)."""
        return torch.cat([self.image_grid_thw.new_zeros(1), self.image_grid_thw.prod(-1).cumsum(0)]).tolist()

    def images_at(self, images: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(patch rows (N', D), grids (I', 3)) of ``images`` (indices into the chunk's images), in that order (the
        patch-row layout)."""
        patches = self._first_patches()
        index = torch.tensor([p for i in images for p in range(patches[i], patches[i + 1])], dtype=torch.long)
        return (
            self.pixel_values.index_select(0, index.to(self.pixel_values.device)),
            self.image_grid_thw[torch.tensor(images, dtype=torch.long).to(self.image_grid_thw.device)],
        )

    def image_runs(self, prompt_width: int) -> list[list[tuple[int, int]]]:
        """Per row, the prompt columns ``(first, end)`` of each of its images' tokens, one run per image in order: the
        maximal runs of image token type (1) in the first ``prompt_width`` columns, as the model's own
        ``compute_3d_position_ids`` takes them, or the runs of the model's image token id (``located``); ``[]`` for
        every row when the images' tokens are not located (``tree_cause``).

        Raises:
            ValueError: a row with image inputs whose prompt holds another number of runs of image token type than it
                has images (located runs that do not match are a ``tree_cause`` instead).
        """
        if self.tree_cause() is not None or self.pixel_values is None:
            return [[] for _ in self.num_images]
        if self.located is not None:
            return [list(r) for r in self.located]
        runs, bad = _runs(self.mm_token_type_ids[:, :prompt_width] == 1, self.num_images)
        if bad is not None:
            raise ValueError(f"{bad} (mm_token_type_ids == 1)")
        return runs

    def images_in(self, runs: list, b: int, first: int, end: int) -> list[int]:
        """The chunk's indices of row b's images whose first token lies in prompt columns ``first … end − 1``
        (``runs``: ``image_runs``); all of the row's images when their tokens are not located (``tree_cause``: then
        a slice is a whole prompt)."""
        row_first = self.first_images()[b]
        if self.tree_cause() is not None:
            return list(range(row_first, row_first + self.num_images[b]))
        return [row_first + k for k, (start, _) in enumerate(runs[b]) if first <= start < end]

    def _image_digests(self) -> list[tuple[bytes, ...]]:
        """Per row, the ``image_keys`` keys of its images: one per image in the patch-row layout and when ``located``
        (so the trie can part rows between two images), else one for all of the row's image entries (``()`` for a row
        without any)."""
        B = len(self.num_images)
        if not self.tensors:
            return [()] * B
        if "image_grid_thw" in self.tensors or self.located is not None:
            if self.located is not None:  # one entry per image
                keys = image_keys([[t[i : i + 1] for t in self.tensors.values()] for i in range(sum(self.num_images))])
            else:
                patches = self._first_patches()
                keys = image_keys(
                    [
                        [self.pixel_values[patches[i] : patches[i + 1]], self.image_grid_thw[i : i + 1]]
                        for i in range(len(patches) - 1)
                    ]
                )
            firsts = self.first_images()
            return [tuple(keys[firsts[b] : firsts[b + 1]]) for b in range(B)]
        parts = []
        for b in range(B):
            row = []
            for name, t in self.tensors.items():
                entries = self._entries(name, [b])
                if entries:  # a row's entries are contiguous
                    row.append(t[entries[0] : entries[-1] + 1])
            parts.append(row)
        return [(k,) if k else () for k in image_keys(parts)]

    def row_keys(self, prompt_width: int) -> list:
        """Per row, its ``RowImages`` (its prompt's token types, the first ``prompt_width`` columns; its images' keys
        and, where located (``image_runs``), where their tokens sit), or ``b""`` for a row with neither token types nor
        images: rows of one prompt have equal keys, rows with other images or types other keys.

        Raises:
            ValueError: as ``image_runs``.
        """
        if prompt_width in self._keys:
            return self._keys[prompt_width]
        B = len(self.num_images)
        types = image_keys([[t[b, :prompt_width] for t in self.token_types.values()] for b in range(B)])
        runs, cause = self.image_runs(prompt_width), self.tree_cause()
        keys = []
        for b, own in enumerate(self._image_digests()):
            located = tuple((prompt_width - first, end - first) for first, end in runs[b])
            keys.append(RowImages(types[b], own, located, cause if own else None) if types[b] or own else b"")
        self._keys[prompt_width] = keys
        return keys

    def tree_cause(self) -> str | None:
        """Why the chunk's image prompts cannot be split into trie nodes (tree sharing), or None: each image's tokens
        must be located in the prompt and attend causally, as in the patch-row layout with ``mm_token_type_ids``
        (Qwen2-VL/2.5-VL/3-VL) and in the layout of one entry per image located by the model's image token id, one
        run per image (``located``: LLaVA, LLaVA-NeXT, Mistral 3, Aya Vision). Gemma 3's ``token_type_ids`` make image
        blocks attend bidirectionally, and the other layouts are handed to the model's forward whole per row."""
        if not self.tensors:
            return None
        if "token_type_ids" in self.token_types:
            return "token_type_ids (image blocks attend bidirectionally)"
        if self.located is not None:
            return self.located_cause
        if "image_grid_thw" not in self.tensors:
            names = sorted(self.tensors)
            return f"images given as {names} per image, tile or row (the model's forward takes them whole)"
        if self.mm_token_type_ids is None:
            return "image inputs without mm_token_type_ids (the image tokens are not located)"
        return None

    def prompt_inputs(
        self,
        slices: list[tuple[int, int, int]],
        images: list[int],
        width: int,
        attention_mask: torch.Tensor,
        prompt_width: int,
    ) -> dict:
        """The image inputs of a batch whose entry i holds tokens ``first … end − 1`` of row b's unpadded prompt,
        ``(b, first, end) = slices[i]`` (a node's slice, ``plan.WindowPlan.slices``; left-padded in the first ``prompt_width`` columns of ``attention_mask``
        (B, P + C)), right-padded to ``width``, which encodes the chunk's ``images`` (``VisionPasses.images_of``): the
        tensors of exactly those images when the images are ``located`` (a trie node's), else the slices' rows' (none
        when ``images`` is empty), and the slices' token types (0 on the padding).

        Raises:
            ValueError: a slice that is not a whole prompt holds images not located (``tree_cause`` keeps such plans in
                group mode).
        """
        kwargs = {}
        if images and self.tree_cause() is None and self.located is not None:
            kwargs = self._select(dict.fromkeys(self.tensors, images))
        elif images:
            partial = [
                (b, first, end)
                for b, first, end in slices
                if first or end != int(attention_mask[b, :prompt_width].sum())
            ]
            if partial:
                raise ValueError(f"image inputs handed whole per row cannot be split into trie nodes: slices {partial}")
            kwargs = self.of_rows([b for b, _, _ in slices])
        for name, types in self.token_types.items():
            kwargs[name] = prompt_columns(types, slices, width, attention_mask, prompt_width)
        return kwargs

    def cause(self, causal_lm, prompt_width: int) -> str | None:
        """Why the chunk cannot take the prompt-once path on ``causal_lm``, a model ``support.unsupported_cause``
        serves: image inputs given to a model without a vision tower, or image tokens in a completion."""
        if causal_lm.config.get_text_config() is causal_lm.config:
            return "image inputs given to a text-only model"
        if any(bool(t[:, prompt_width:].any()) for t in self.token_types.values()):
            return "image or video tokens in a completion (images returned by a tool)"
        return None

    def bind(self, causal_lm, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> VisionPasses:
        """What the passes of the micro-batch ``input_ids``/``attention_mask`` (B, T), whose prompts are the first
        ``prompt_width`` columns, add on ``causal_lm`` (a model ``support.vision_language_cause`` admits)."""
        return VisionPasses(self, causal_lm.base_model, input_ids, attention_mask, prompt_width)

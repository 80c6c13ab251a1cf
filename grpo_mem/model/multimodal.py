"""Image prompts on the prompt-once path: a micro-batch's images, which rows share them, and what each pass adds.

TRL 1.16 hands the scoring method a generation batch's images as one ``pixel_values`` tensor of patch rows (all
images of all rows, in row order), ``image_grid_thw`` (one (t, h, w) patch grid per image), ``num_images`` (images per
row) and ``mm_token_type_ids`` (0 text, 1 image, per token of prompt + completion), and slices them per chunk of rows.
Stock TRL repeats a prompt's images for each of its G rows, so the vision tower runs G times per prompt. Here:

- ``VisionInputs`` holds one chunk's image inputs (``VisionInputs.of_chunk`` slices TRL's arguments as TRL does) and
  keys each row by its images, so that rows group by (prompt ids, images) (``PromptGrouping.of(..., extra=...)``).
- ``VisionInputs.bind`` gives a ``Window`` what its passes add for one micro-batch (``VisionPasses``): a prompt pass
  gets the image features of its prompts (the model's own ``get_image_features``, once per unique prompt), which the
  model's own forward merges into the prompt's embeddings (``mm_encoder_outputs``: its ``get_placeholder_mask``
  checks the image-token count and raises its own error), and the multi-axis positions the model's own
  ``compute_3d_position_ids`` gives the whole row (Qwen2-VL/2.5-VL/3-VL M-RoPE over prompt + completion), of which each
  pass takes its tokens' columns.

Which models take this path is decided in ``support.vision_language_reason``. This module knows transformers, not TRL.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import torch

__all__ = ["SERVED_INPUTS", "VisionInputs", "VisionPasses", "input_cause", "warn_tree_to_group"]

# the scoring method's multimodal arguments this path takes; any other one is a named cause for the stock path
SERVED_INPUTS = frozenset({"pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids"})
TREE_TO_GROUP = "tree sharing of image prompts is not implemented: their micro-batches use group sharing"

_warned_tree = [False]


def warn_tree_to_group() -> None:
    """Warn once per process that image prompts take group sharing although tree sharing was asked for."""
    if not _warned_tree[0]:
        _warned_tree[0] = True
        warnings.warn(f"grpo_mem: {TREE_TO_GROUP}", stacklevel=3)


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


_GOLDEN = 0x9E3779B9 - (1 << 32)  # 2**32 / golden ratio (Knuth's multiplicative hashing) as a signed int32


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat integer tensor on its device, no copy for a contiguous ``t`` (int32 words for
    elements of 4 bytes or more, int16 or uint8 otherwise): equal words exactly when the bytes are equal."""
    flat = t.detach().contiguous().view(-1)
    size = flat.element_size()
    return flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8)


def _weights(n: int, device: torch.device, cache: dict) -> torch.Tensor:
    """(n,) odd int32 position weights on ``device`` (z xor z >> 16 | 1, z = i·φ mod 2**32, i = 1 … n), computed
    once per call of ``image_keys`` (``cache``) for its longest tensor."""
    have = cache.get(device)
    if have is None or have.numel() < n:
        z = torch.arange(1, n + 1, dtype=torch.int32, device=device) * _GOLDEN
        cache[device] = have = (z ^ (z >> 16)) | 1
    return have[:n]


def _fingerprint(t: torch.Tensor, cache: dict) -> torch.Tensor:
    """0-d int64 on ``t``'s device: Σ_i word_i · w_i, products wrapping in int32 (``_weights``). Equal tensors give
    equal values; different ones may collide (``image_keys`` then tells them apart exactly)."""
    words = _words(t)
    words = words if words.dtype == torch.int32 else words.to(torch.int32)
    return (words * _weights(words.numel(), words.device, cache)).sum(dtype=torch.int64)


def image_keys(parts: list[list[torch.Tensor]]) -> list[bytes]:
    """Per row b, a key of its image tensors ``parts[b]`` (patch rows, grids, token types, in a fixed order): rows
    whose tensors are equal (shapes, dtypes and bytes) get equal keys, rows with other tensors other keys, exactly;
    a row without tensors gets ``b""``.

    Rows are bucketed by an on-device fingerprint of each tensor (``_fingerprint``; shapes and dtypes too), then
    compared bytewise on device (``torch.equal`` of their words) with the first row of each distinct content in their
    bucket, so no fingerprint collision merges two images. Host traffic: the fingerprints (one int64 per tensor, one
    transfer) and one boolean per comparison; the tensors stay where they are. A key depends only on the row's
    tensors unless two different contents of one call share a fingerprint (then the later one's key also holds its
    rank in that bucket).
    """
    tensors = [t for row in parts for t in row]
    if not tensors:
        return [b""] * len(parts)
    device, cache = tensors[0].device, {}
    values = iter(torch.stack([_fingerprint(t, cache).to(device) for t in tensors]).tolist())
    buckets: dict[tuple, list[int]] = {}  # (shapes, dtypes, fingerprints) -> first row of each distinct content
    keys = []
    for b, row in enumerate(parts):
        if not row:
            keys.append(b"")
            continue
        head = tuple((tuple(t.shape), str(t.dtype), next(values)) for t in row)
        firsts = buckets.setdefault(head, [])
        rank = next((j for j, r in enumerate(firsts)
                     if all(torch.equal(_words(x), _words(y)) for x, y in zip(parts[r], row))), None)  # fmt: skip
        if rank is None:
            rank = len(firsts)
            firsts.append(b)
        keys.append(hashlib.blake2b(repr((head, rank)).encode(), digest_size=16).digest())
    return keys


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

    def images_of(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(patch rows (N', D), grids (I', 3)) of the images of ``rows`` (indices into the chunk), in that order."""
        firsts = torch.tensor([0, *self.num_images]).cumsum(0).tolist()
        patches = torch.cat([self.image_grid_thw.new_zeros(1), self.image_grid_thw.prod(-1).cumsum(0)]).tolist()
        images = [i for b in rows for i in range(firsts[b], firsts[b + 1])]
        index = torch.tensor([p for i in images for p in range(patches[i], patches[i + 1])], dtype=torch.long)
        return (self.pixel_values.index_select(0, index.to(self.pixel_values.device)),
                self.image_grid_thw[torch.tensor(images, dtype=torch.long).to(self.image_grid_thw.device)])  # fmt: skip

    def row_keys(self, prompt_width: int) -> list[bytes]:
        """Per row, the ``image_keys`` key of its images (patch rows and grids) and its prompt's token types (the
        first ``prompt_width`` columns): rows of one prompt have equal keys, rows with other images have other keys."""
        parts = []
        firsts = torch.tensor([0, *self.num_images]).cumsum(0).tolist()
        if self.pixel_values is not None:
            patches = torch.cat([self.image_grid_thw.new_zeros(1), self.image_grid_thw.prod(-1).cumsum(0)]).tolist()
        for b in range(len(self.num_images)):
            row = [] if self.mm_token_type_ids is None else [self.mm_token_type_ids[b, :prompt_width]]
            if self.pixel_values is not None and self.num_images[b]:  # a row's images are contiguous
                first, last = firsts[b], firsts[b + 1]
                row += [self.pixel_values[patches[first] : patches[last]], self.image_grid_thw[first:last]]
            parts.append(row)
        return image_keys(parts)

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

    def prompt_pass(self, rows: list[int], width: int) -> dict:
        """Extra keyword arguments of the backbone call of a prompt pass whose entry i is row ``rows[i]``'s whole
        prompt, right-padded to ``width`` tokens: ``mm_encoder_outputs`` (the prompts' image features, computed here
        once) and ``position_ids`` (3, n, width), each only where needed.

        Raises:
            ValueError: the model's own (``get_placeholder_mask``), when the rows' image tokens do not match their
                image features; checked before the positions, which assume they match.
        """
        kwargs = {}
        if self.inputs.pixel_values is not None and any(self.inputs.num_images[b] for b in rows):
            pixel_values, grid = self.inputs.images_of(rows)
            features = self.base.get_image_features(pixel_values, grid, return_dict=True)
            merged = torch.cat(features.pooler_output, dim=0)
            self.base.get_placeholder_mask(self.input_ids[rows, : self.prompt_width], inputs_embeds=merged[:1],
                                           image_features=merged)  # fmt: skip
            kwargs["mm_encoder_outputs"] = {"image": features}
        positions = self.positions()
        if positions is not None:
            P = self.prompt_width
            kwargs["position_ids"] = positions.new_zeros(3, len(rows), width)
            for i, b in enumerate(rows):
                length = int(self.attention_mask[b, :P].sum())
                kwargs["position_ids"][:, i, :length] = positions[:, b, P - length : P]
        return kwargs

    def completion_positions(self, width: int) -> torch.Tensor | None:
        """(3, B, width) positions of completion tokens 0 … width − 1, or None (the passes' own positions)."""
        positions = self.positions()
        return None if positions is None else positions[:, :, self.prompt_width : self.prompt_width + width]

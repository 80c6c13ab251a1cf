"""TRL 1.16's image arguments: their names, the layouts TRL slices them in per chunk of rows, and the model layer's
image value (``grpo_mem.model.multimodal.VisionInputs``) built from them.

TRL 1.16 hands the scoring method a generation batch's images with ``num_images`` (images per row) in one of several
layouts, and slices them per chunk of rows: ``pixel_values`` as patch rows with ``image_grid_thw`` (a (t, h, w) grid
per image: Qwen2-VL/2.5-VL/3-VL), one entry per image (LLaVA, Gemma 3, Mistral 3; ``image_sizes`` per image:
LLaVA-NeXT), per tile (``num_tiles`` per row: InternVL; with ``pixel_attention_mask`` and ``spatial_shapes`` per tile:
LFM2-VL) or per row (with ``pixel_attention_mask`` per row: Idefics3, SmolVLM); token types per token of prompt +
completion (``mm_token_type_ids`` for Qwen, ``token_type_ids`` for Gemma 3; 0 text). ``chunk_images`` slices them as
TRL's own method does; ``chunk_kwargs`` gives a chunk back as that method's arguments (its stock path).
"""

from __future__ import annotations

import itertools

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..model.multimodal import VisionInputs

__all__ = ["IMAGE_INPUTS", "SERVED_INPUTS", "TOKEN_TYPE_INPUTS", "chunk_images", "chunk_kwargs", "input_cause"]

IMAGE_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
"""The image keyword arguments of TRL 1.16's ``_get_per_token_logps_and_entropies``, in its signature's order."""
SERVED_INPUTS = frozenset(IMAGE_INPUTS) - {"image_position_ids"}
"""Those the prompt-once path takes, in every layout TRL 1.16 slices; any other one is a named cause for the stock
path."""
TOKEN_TYPE_INPUTS = ("token_type_ids", "mm_token_type_ids")
"""(B, T) inputs with one entry per token of prompt + completion, 0 for text."""


def input_cause(extras: dict) -> str | None:
    """Why the scoring method's image arguments ``extras`` (name -> value, None when not given) cannot take the
    prompt-once path, or None (no image input at all, or only ``SERVED_INPUTS``, images counted by ``num_images``,
    tiles with spatial shapes by ``num_tiles``)."""
    used = sorted(k for k, v in extras.items() if v is not None)
    other = [k for k in used if k not in SERVED_INPUTS]
    if other:
        return f"multimodal or token-type inputs {other}"
    if extras.get("pixel_values") is not None and extras.get("num_images") is None:
        return "pixel_values without num_images (images not counted per row)"
    if extras.get("spatial_shapes") is not None and extras.get("num_tiles") is None:
        return "spatial_shapes without num_tiles (tiles not counted per row)"
    return None


def _spans(extras: dict, images: list[int], tiles: list[int] | None, rows: int) -> dict[str, list[int]]:
    """Per image tensor TRL 1.16's scoring method hands the model, its dim-0 entries of each of the ``rows`` rows, in
    the order of TRL's own slicing rules (``images``/``tiles``: ``num_images``/``num_tiles``)."""
    pixel_values, grid = extras.get("pixel_values"), extras.get("image_grid_thw")
    spans: dict[str, list[int]] = {}
    if pixel_values is not None:
        if grid is not None:  # patch rows, a (t, h, w) grid per image (Qwen)
            if grid.shape[0] != sum(images):
                raise ValueError(f"num_images counts {sum(images)} images but image_grid_thw has {grid.shape[0]} grids")
            cells = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()
            firsts = [0, *itertools.accumulate(images)]
            spans["pixel_values"] = [cells[firsts[b + 1]] - cells[firsts[b]] for b in range(rows)]
            spans["image_grid_thw"] = images
        elif extras.get("spatial_shapes") is not None:  # tiles with their own masks and shapes (LFM2-VL)
            spans.update(dict.fromkeys(("pixel_values", "pixel_attention_mask", "spatial_shapes"), tiles))
        elif tiles is not None:  # tiles (InternVL)
            spans["pixel_values"] = tiles
        elif pixel_values.shape[0] == sum(images):  # one entry per image (LLaVA, Gemma 3, LLaVA-NeXT)
            spans["pixel_values"] = images
        else:  # one entry per row, padded with empty images (Idefics3, SmolVLM)
            spans["pixel_values"] = [1] * rows
    if extras.get("pixel_attention_mask") is not None and "pixel_attention_mask" not in spans:
        spans["pixel_attention_mask"] = [1] * rows
    if extras.get("image_sizes") is not None:
        spans["image_sizes"] = images
    _check_counts(extras, spans, images, tiles, grid is not None)
    return spans


def _check_counts(extras: dict, spans: dict, images: list[int], tiles: list[int] | None, patch_rows: bool) -> None:
    """Raise ValueError naming both numbers when an image tensor does not hold the entries its counts give."""
    for name, counts in spans.items():
        held = extras[name].shape[0]
        if held != sum(counts):
            source = (
                "image_grid_thw holds {} patch rows"
                if name == "pixel_values" and patch_rows
                else "num_images counts {} images"
                if counts is images
                else "num_tiles counts {} tiles"
                if counts is tiles
                else f"num_images counts {sum(images)} images and the batch has {{}} rows"
            )
            raise ValueError(f"{source.format(sum(counts))} but {name} has {held}")


def _counts(extras: dict, rows: int) -> dict[str, list[int] | None]:
    """``num_images`` and ``num_tiles`` as lists of ints (None when not given). Raises ValueError unless each gives
    one count per row."""
    counts = {}
    for name in ("num_images", "num_tiles"):
        given = extras.get(name)
        counts[name] = None if given is None else [int(n) for n in given]
        if given is not None and len(counts[name]) != rows:
            raise ValueError(f"{name} must give one count per row ({rows} rows), got {len(counts[name])} counts")
    return counts


def chunk_images(
    extras: dict,
    start: int,
    end: int,
    rows: int,
    prompt_ids: torch.Tensor | None = None,
    image_token: int | None = None,
) -> VisionInputs | None:
    """Rows ``start … end − 1`` of the image arguments ``extras`` that TRL passes for ``rows`` rows (``input_cause``
    is None for them), sliced as TRL's own method slices them per chunk; None when no row has an image input.
    ``prompt_ids`` (rows, P) left-padded prompts and ``image_token`` (``multimodal.image_token_id``): in the layout of
    one entry per image without token types, each image's tokens are located as the runs of that id
    (``VisionInputs.located``).

    Raises:
        ValueError: ``num_images``/``num_tiles`` not one count per row, or counts that the image tensors do not
            hold (naming both numbers).
    """
    types = {k: extras[k][start:end] for k in TOKEN_TYPE_INPUTS if extras.get(k) is not None}
    if extras.get("pixel_values") is None and not types:
        return None
    counts = _counts(extras, rows)
    images, tiles = counts["num_images"] or [0] * rows, counts["num_tiles"]
    spans = _spans(extras, images, tiles, rows)
    tensors = {}
    for name, per_row in spans.items():
        firsts = [0, *itertools.accumulate(per_row)]
        tensors[name] = extras[name][firsts[start] : firsts[end]]
    # one entry per image: ``_spans`` gives pixel_values the image counts themselves
    per_image = spans.get("pixel_values") is images and set(spans) <= {"pixel_values", "image_sizes"}
    from ..model.multimodal import VisionInputs

    return VisionInputs.make(
        tensors,
        {k: tuple(v[start:end]) for k, v in spans.items()},
        tuple(images[start:end]),
        None if tiles is None else tuple(tiles[start:end]),
        types,
        per_image=per_image,
        prompt_ids=None if prompt_ids is None else prompt_ids[start:end],
        image_token=image_token,
    )


def chunk_kwargs(vision: VisionInputs) -> dict:
    """A chunk's image inputs as keyword arguments of TRL's scoring method (its stock path)."""
    kwargs = dict(vision.tensors, **vision.token_types)
    if vision.tensors:
        kwargs["num_images"] = list(vision.num_images)
    if vision.num_tiles is not None:
        kwargs["num_tiles"] = list(vision.num_tiles)
    return kwargs

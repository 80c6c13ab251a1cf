"""Image prompts in ``grpo-mem bench`` (``--image-tokens N``): token counts, inputs and the scoring op per provider.

Every prompt holds one image of N tokens, laid out as Qwen's processor lays it out: ``<|vision_start|>``, N
``<|image_pad|>`` tokens, ``<|vision_end|>``, right after the left padding (after the shared prefix, if any). The
image is a (1, h, w) grid of patches with h·w = merge²·N (merge = the vision config's ``spatial_merge_size``, 2 for
Qwen2.5-VL: 4·N patch rows), random normal pixel rows; every row of a group carries its own copy of its prompt's
image, as TRL 1.16 repeats it per row. The prompt length P counts the N + 2 image tokens.

The op per provider is TRL 1.16's own scoring method, ``GRPOTrainer._get_per_token_logps_and_entropies``, on the
model given TRL's fused head, one call per micro-batch (its multimodal keyword arguments sliced per micro-batch as
TRL slices them), each followed by its backward: ``trl`` as TRL ships it, ``grpo_mem`` patched
(``grpo_mem.patches.trl.patched_method``, group sharing; ``scoring_method`` builds either) with one sharing window over the micro-batches, as
the patch opens it in ``_prepare_inputs`` (each prompt and its image forwarded once for the whole call).
"""

from __future__ import annotations

import inspect
import types
from contextlib import nullcontext

from grpo_mem.bench.presets import PAD_ID

IMAGE_PROVIDERS = ("trl", "grpo_mem")
"""The providers of an image run (each prompt is its own image and text: a tree would share no more than groups)."""


def rows_per_token(config) -> int:
    """Patch rows per image token of a transformers config with a ``vision_config`` (``spatial_merge_size`` ** 2),
    0 for a text-only config."""
    vision = getattr(config, "vision_config", None)
    return 0 if vision is None else getattr(vision, "spatial_merge_size", 1) ** 2


def image_grid(tokens: int, merge: int = 2) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of an image of ``tokens`` image tokens after a ``merge`` x ``merge`` merge: t = 1,
    h = merge·a, w = merge·b with a·b = tokens and a the largest divisor of ``tokens`` not above its square root.

    Raises:
        ValueError: ``tokens`` or ``merge`` < 1.
    """
    if tokens < 1 or merge < 1:
        raise ValueError(f"an image needs tokens >= 1 and merge >= 1, got tokens={tokens}, merge={merge}")
    a = max(d for d in range(1, int(tokens**0.5) + 1) if tokens % d == 0)
    return 1, merge * a, merge * (tokens // a)


def add_images(config, input_ids, attention_mask, P: int, image_tokens: int, *, shared_prefix: int = 0, seed: int = 0):
    """One image per prompt put into the rows of ``grpo_mem.bench.group.make_inputs`` (module docstring), for the
    vision-language transformers ``config``: ``input_ids`` (rows, P + C) int64 and ``attention_mask`` (rows, P + C)
    0/1, prompts left-padded to P; ``input_ids`` is not modified.

    Returns ``(input_ids, extras)``: the ids with the image's tokens after each prompt's padding and shared prefix,
    text ids never equal to the config's image, video or vision start/end token ids; ``extras``: TRL's multimodal
    keyword arguments, ``pixel_values`` (rows·patches, channels·temporal·patch²) fp32 (rows of one prompt: equal
    images; other prompts: other random images), ``image_grid_thw`` (rows, 3) int64, ``num_images`` (rows ones),
    ``mm_token_type_ids`` (rows, P + C) int64 (1 on image tokens).

    Raises:
        ValueError: a prompt too short for its shared prefix and the ``image_tokens`` + 2 image tokens.
    """
    import torch

    specials = torch.tensor(
        [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    )
    lengths = attention_mask[:, :P].sum(1)
    if shared_prefix + image_tokens + 2 > int(lengths.min()):
        raise ValueError(
            f"image_tokens {image_tokens} + 2 vision markers + shared_prefix {shared_prefix} do not fit "
            f"the shortest prompt ({int(lengths.min())} tokens)"
        )
    ids = torch.where(torch.isin(input_ids, specials), torch.full_like(input_ids, 3), input_ids)
    vision = config.vision_config
    grid = image_grid(image_tokens, vision.spatial_merge_size)
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    g = torch.Generator().manual_seed(seed)
    images: dict[bytes, torch.Tensor] = {}
    pixels = []
    for r, s in enumerate((P - lengths + shared_prefix).tolist()):
        key = ids[r, :P].masked_fill(attention_mask[r, :P] == 0, PAD_ID).numpy().tobytes()  # the row's prompt
        ids[r, s : s + image_tokens + 2] = config.image_token_id
        ids[r, s], ids[r, s + image_tokens + 1] = config.vision_start_token_id, config.vision_end_token_id
        if key not in images:
            images[key] = torch.randn(grid[0] * grid[1] * grid[2], width, generator=g)
        pixels.append(images[key])
    rows = ids.shape[0]
    extras = dict(
        pixel_values=torch.cat(pixels),
        image_grid_thw=torch.tensor([grid] * rows),
        num_images=[1] * rows,
        mm_token_type_ids=(ids == config.image_token_id).long(),
    )
    return ids, extras


class _Trainer(types.SimpleNamespace):
    """What TRL's scoring method reads of a trainer; hashable (the patch keeps a sharing session per trainer)."""

    __hash__ = object.__hash__


def scoring_method(provider: str):
    """``(method, trainer, handle)``: TRL 1.16's scoring method ``GRPOTrainer._get_per_token_logps_and_entropies``
    as TRL ships it (``provider`` ``"trl"``; handle None) or patched (``"grpo_mem"``: ``grpo_mem.patches.trl.
    patched_method``, group sharing, no metrics; ``handle.session(trainer)`` is its session), and the trainer stand-in
    it is called on (temperature 1, no autocast, no fused-head fp32 cast), as ``method(trainer, model, input_ids,
    attention_mask, C, batch_size=..., compute_entropy=..., **images)``.

    Raises:
        ValueError: ``provider`` not in :data:`IMAGE_PROVIDERS`.
    """
    from trl import GRPOTrainer

    from grpo_mem.patches.trl import patched_method

    if provider not in IMAGE_PROVIDERS:
        raise ValueError(f"an image run's provider must be one of {IMAGE_PROVIDERS}, got {provider!r}")
    method = inspect.unwrap(GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"])
    trainer = _Trainer(
        accelerator=types.SimpleNamespace(autocast=nullcontext),
        temperature=1.0,
        args=types.SimpleNamespace(cast_lm_head_to_fp32=False),
        _metrics=None,
    )
    if provider == "trl":
        return method, trainer, None
    method, handle = patched_method(method, sharing="group")
    return method, trainer, handle


def make_image_fn(provider: str, model, C: int, prompt_ids, prompt_mask, extras: dict, micro: int):
    """``fn(input_ids, attention_mask) -> (log_probs (B, C) fp32, entropies (B, C) fp32)``, with gradients, called
    once per micro-batch of ``micro`` rows, in order, over and over: TRL's scoring method (``provider`` ``"trl"``) or
    the patched one (``"grpo_mem"``), given the micro-batch's slice of ``extras`` (TRL's multimodal arguments of all
    rows, moved to the model's device, patch rows cast to its dtype). For ``grpo_mem`` the micro-batches of each
    pass over the rows form one sharing window, planned from ``prompt_ids``/``prompt_mask`` (rows, P) and the rows'
    image keys, as the TRL patch plans it.
    ``fn.vision_patch_rows``: patch rows the vision tower encoded in the last complete pass over the rows (a forward
    hook on it).

    Raises:
        ValueError: ``provider`` not in :data:`IMAGE_PROVIDERS`.
    """
    from trl.trainer.utils import add_fused_lm_head

    from grpo_mem.patches.trl_images import chunk_images, chunk_kwargs

    method, trainer, handle = scoring_method(provider)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    rows = prompt_ids.shape[0]
    extras = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in extras.items()}
    extras["pixel_values"] = extras["pixel_values"].to(model.dtype)
    starts = range(0, rows, micro)
    chunks = [chunk_images(extras, s, s + micro, rows) for s in starts]
    calls, encoded = [0], [0]
    model.base_model.visual.register_forward_hook(
        lambda mod, a, kw, out: encoded.__setitem__(0, encoded[0] + int(kw["grid_thw"].prod(-1).sum())),
        with_kwargs=True,
    )

    def fn(input_ids, attention_mask):
        j = calls[0] % len(chunks)
        calls[0] += 1
        if j == 0:
            encoded[0] = 0
        if handle is not None and j == 0:
            handle.session(trainer).begin_window(
                [prompt_ids[s : s + micro] for s in starts], [prompt_mask[s : s + micro] for s in starts], chunks
            )
        lp, ent, _ = method(
            trainer,
            model,
            input_ids,
            attention_mask,
            C,
            batch_size=input_ids.size(0),
            compute_entropy=True,
            **chunk_kwargs(chunks[j]),
        )
        if j == len(chunks) - 1:
            fn.vision_patch_rows = encoded[0]
        return lp, ent

    return fn

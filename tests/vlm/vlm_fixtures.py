"""What the vision-language tests share: tiny models of every image-text family the tests build, their image
batches as TRL hands them to the scoring method, stock TRL's and the patched scoring method on them, a 3-step
GRPOTrainer run on a tiny Qwen2.5-VL, and windows of micro-batches scored both ways.

Two kinds of family: the Qwen ones (``GRID_VISION``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5), whose images are patch
rows with a (t, h, w) grid and M-RoPE positions (batches from ``vlm_batch`` on ``PROMPTS``), and those of ``FAMILIES``
(LLaVA, Gemma 3, Idefics3, ...), whose images are pixel tensors in the family's layout (batches from ``family_batch``
on ``FAMILY_PROMPTS``). ``tiny_vlm`` builds either; ``vlm_with_head`` adds TRL's fused head and counts what the vision
tower encodes.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from helpers import assert_close, grads_of
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from grpo_mem.model.sharing import SharingSession
from grpo_mem.model.fallback import recording_fallbacks
from grpo_mem.patches.trl import patched_method
from grpo_mem.patches.trl_images import chunk_images, chunk_kwargs

IMAGE, BOI, EOI = 120, 118, 119
"""The image placeholder token, and the tokens around an image (Qwen's vision start / end)."""

TEMPERATURE = 0.7


G, C = 3, 5
"""Rows per prompt and completion tokens of ``family_batch``."""


CHANNELS, PATCH = 3, 2


_TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=3,
)


GRID_TEXT = dict(_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
"""The text config of the Qwen families (M-RoPE)."""


FAMILY_TEXT = dict(_TEXT, head_dim=8)
"""The text config of ``FAMILIES`` (with the family's ``model_type``)."""


GRID_VISION = {
    "qwen2_5_vl": dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        window_size=8,
        fullatt_block_indexes=[1],
    ),
    "qwen2_vl": dict(depth=2, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2),
    "qwen3_vl": dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    ),
    "qwen3_5": dict(
        depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, num_position_embeddings=64
    ),
}
"""The vision configs of the Qwen families, by model type."""


_GRID_TEXT_EXTRA = {
    # Qwen3.5: Gated DeltaNet and full attention (interleaved M-RoPE) text layers
    "qwen3_5": dict(
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"],
        rope_parameters=dict(GRID_TEXT["rope_parameters"], mrope_section=[1, 1, 2], mrope_interleaved=True),
    )
}


FAMILY_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=8,
    patch_size=2,
    attention_dropout=0.0,
)
"""The vision config of ``FAMILIES`` (with the family's vision ``model_type``)."""


# (text before the image(s), image grids (t, h, w) in patches, text after): a 4x4 and a 4x8 image, a text-only
# prompt, and the first prompt's ids again with another image
PROMPTS = [
    ([5, 6, 7], [(1, 4, 4)], [8, 9]),
    ([5, 6], [(1, 4, 8)], [10, 11, 12, 13]),
    ([20, 21, 22, 23], [], [24]),
    ([5, 6, 7], [(1, 4, 4)], [8, 9]),
]


# (text before, image sizes (h, w) in pixels, text after): images of two sizes (where the model takes them), a
# text-only prompt, the first prompt's ids again with another image, prompts with two images (6 images for 5
# prompts: TRL takes a tensor with as many entries as images for one entry per image)
FAMILY_PROMPTS = [
    ([5, 6, 7], [(8, 8)], [8, 9]),
    ([5, 6], [(4, 8), (8, 8)], [10, 11, 12, 13]),
    ([20, 21, 22, 23], [], [24]),
    ([5, 6, 7], [(8, 8)], [8, 9]),
    ([30], [(8, 8), (8, 4)], [31, 32]),
]


PINPOINTS = [[8, 8], [8, 16], [16, 8]]
"""LLaVA-NeXT's grid pinpoints here."""


@dataclass
class Family:
    """How a model type is built tiny and how its processor lays out a batch.

    Attributes:
        config: keyword arguments of ``AutoConfig.for_model`` beyond text/vision configs and token ids.
        text_type, vision_type: model types of the sub-configs.
        tokens: image size (h, w) -> the image's placeholder tokens (the processor's count).
        layout: ``"image"`` (an entry per image), ``"row"`` (an entry per row, padded), ``"anyres"`` (LLaVA-NeXT),
            ``"tiles"`` (InternVL) or ``"naflex"`` (LFM2-VL: patch rows, their mask and grid per tile).
        any_size: the model takes images of other sizes than ``image_size`` (else every image is 8x8).
        token_types: the processor gives ``token_type_ids`` (1 on image tokens).
        image_sizes: the processor gives ``image_sizes``, each image's (h, w).
        tower: the vision tower's attribute on the base model.
    """

    config: dict
    text_type: str
    vision_type: str
    tokens: object
    layout: str = "image"
    any_size: bool = False
    token_types: bool = False
    image_sizes: bool = False
    tower: str = "vision_tower"
    entries: object = None

    def tiles(self, size) -> int:
        """The vision tower's inputs for an image of ``size`` (h, w): 1, or its tiles (``entries``)."""
        return 1 if self.entries is None else self.entries(size)


FAMILIES = {
    "llava": Family({}, "llama", "clip_vision_model", lambda size: 16),
    "gemma3": Family(
        dict(mm_tokens_per_image=4, boi_token_id=BOI, eoi_token_id=EOI),
        "gemma3_text",
        "siglip_vision_model",
        lambda size: 4,
        token_types=True,
    ),
    "idefics3": Family(
        dict(scale_factor=2),
        "llama",
        "idefics3_vision",
        lambda size: 4,
        layout="row",
        any_size=True,
        tower="vision_model",
    ),
    "llava_next": Family(
        dict(image_grid_pinpoints=PINPOINTS),
        "llama",
        "clip_vision_model",
        lambda size: anyres_tokens(size),
        layout="anyres",
        any_size=True,
        image_sizes=True,
        entries=lambda size: image_size_to_num_patches(size, PINPOINTS, 8),
    ),
    "lfm2_vl": Family(
        dict(downsample_factor=2),
        "lfm2",
        "siglip2_vision_model",
        lambda size: size[0] * size[1] // 16,
        layout="naflex",
        any_size=True,
    ),
    "smolvlm": Family(
        dict(scale_factor=2),
        "llama",
        "smolvlm_vision",
        lambda size: 4,
        layout="row",
        any_size=True,
        tower="vision_model",
    ),
    "mistral3": Family(
        dict(spatial_merge_size=2),
        "mistral",
        "pixtral",
        lambda size: size[0] * size[1] // 16,
        any_size=True,
        image_sizes=True,
    ),
    "aya_vision": Family(dict(downsample_factor=2), "cohere2", "siglip_vision_model", lambda size: 4),
    "internvl": Family(
        dict(downsample_ratio=0.5),
        "qwen2",
        "internvl_vision",
        lambda size: 4 * internvl_tiles(size),
        layout="tiles",
        any_size=True,
        entries=lambda size: internvl_tiles(size),
    ),
}


def internvl_tiles(size) -> int:
    """InternVL's 8x8 tiles of an image of ``size`` (h, w) in this test: one for a square image, else two."""
    return 1 if size[0] == size[1] else 2


_FAMILY_TEXT_EXTRA = {
    "gemma3_text": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8)
}


def _config(model_type: str):
    """The config of a tiny ``model_type``: a Qwen family of ``GRID_VISION`` or one of ``FAMILIES``."""
    if model_type in GRID_VISION:
        vision = dict(
            GRID_VISION[model_type], patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=1, in_channels=CHANNELS
        )
        return AutoConfig.for_model(
            model_type,
            text_config=dict(GRID_TEXT, **_GRID_TEXT_EXTRA.get(model_type, {})),
            vision_config=vision,
            image_token_id=IMAGE,
            video_token_id=121,
            vision_start_token_id=BOI,
            vision_end_token_id=EOI,
            eos_token_id=3,
            pad_token_id=0,
        )
    family = FAMILIES[model_type]
    text = dict(FAMILY_TEXT, model_type=family.text_type, **_FAMILY_TEXT_EXTRA.get(family.text_type, {}))
    vision = dict(FAMILY_VISION, model_type=family.vision_type)
    return AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        pad_token_id=0,
        eos_token_id=3,
        **family.config,
    )


def tiny_vlm(model_type: str = "qwen2_5_vl", seed: int = 0):
    """A random 2-layer text / 2-block vision ``model_type`` (a key of ``GRID_VISION`` or ``FAMILIES``), fp32, train
    mode, SDPA."""
    config = _config(model_type)
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float().train()


@functools.lru_cache(maxsize=None)
def vlm_with_head(model_type: str):
    """(tiny ``model_type`` with TRL's fused head, list of what each vision-tower call encoded: its images for a Qwen
    family, its pixel entries (images or tiles) for one of ``FAMILIES``), built once per type."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_vlm(model_type)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    encoded: list[int] = []

    def count(module, args, kwargs, out):
        if model_type in GRID_VISION:
            encoded.append(kwargs["grid_thw"].shape[0])
        else:
            encoded.append((args[0] if args else kwargs["pixel_values"]).shape[0])

    tower = "visual" if model_type in GRID_VISION else FAMILIES[model_type].tower
    getattr(model.model, tower).register_forward_hook(count, with_kwargs=True)
    return model, encoded


def vlm_batch(prompts, G: int, C: int, *, seed: int = 0, image_seeds=None):
    """``prompts`` (see ``PROMPTS``; a grid family's layout) each repeated G times, left-padded, with right-padded random completions; each
    prompt's images random (patch rows of normal noise; ``image_seeds[i][k]``, if given, seeds prompt i's image k
    alone: equal seeds and grids, equal images). Returns input_ids, attention_mask (B, P + C), C, and TRL's
    multimodal keyword arguments (pixel_values, image_grid_thw, num_images, mm_token_type_ids)."""
    g = torch.Generator().manual_seed(seed)
    rows, pixels, grids, counts = [], [], [], []
    for i, (before, image_grids, after) in enumerate(prompts):
        tokens, types_ = list(before), [0] * len(before)
        gens = (
            [g] * len(image_grids)
            if image_seeds is None
            else [torch.Generator().manual_seed(s) for s in image_seeds[i]]
        )
        images = [
            torch.randn(t * h * w, CHANNELS * PATCH * PATCH, generator=gen) for (t, h, w), gen in zip(image_grids, gens)
        ]
        for t, h, w in image_grids:
            n = t * h * w // 4
            tokens += [BOI] + [IMAGE] * n + [EOI]
            types_ += [0] + [1] * n + [0]
        tokens += after
        types_ += [0] * len(after)
        for _ in range(G):
            rows.append((tokens, types_))
            pixels += images
            grids += image_grids
            counts.append(len(image_grids))
    P = max(len(t) for t, _ in rows)
    ids = torch.zeros(len(rows), P + C, dtype=torch.long)
    mask, mm_types = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (tokens, types_) in enumerate(rows):
        L = len(tokens)
        ids[b, P - L : P], mask[b, P - L : P], mm_types[b, P - L : P] = torch.tensor(tokens), 1, torch.tensor(types_)
        c = int(torch.randint(1, C + 1, (1,), generator=g))
        ids[b, P : P + c], mask[b, P : P + c] = torch.randint(4, 110, (c,), generator=g), 1
    extras = dict(
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.tensor(grids) if grids else None,
        num_images=counts,
        mm_token_type_ids=mm_types,
    )
    return ids, mask, C, extras


def reorder(extras: dict, order: torch.Tensor) -> dict:
    """TRL's multimodal keyword arguments of a batch for its rows taken in ``order``."""
    whole = chunk_images(extras, 0, len(order), len(order))
    images = [whole.of_rows([int(b)]) for b in order]
    return dict(
        pixel_values=torch.cat([i["pixel_values"] for i in images]),
        image_grid_thw=torch.cat([i["image_grid_thw"] for i in images]),
        num_images=[extras["num_images"][b] for b in order],
        mm_token_type_ids=extras["mm_token_type_ids"][order],
    )


def _image(size, family: Family, g) -> torch.Tensor:
    """(3, 8, 8) pixels: an h x w image of noise in the top-left corner (the rest padding) or a full 8x8 image;
    LLaVA-NeXT: (tiles, 3, 8, 8), the resized image then its 8x8 tiles at the best of the grid pinpoints."""
    if family.layout == "naflex":  # 16 patch rows of 2x2 pixels, the first (h / 2) * (w / 2) real
        pixels = torch.zeros(16, 3 * 2 * 2)
        pixels[: size[0] * size[1] // 4] = torch.randn(size[0] * size[1] // 4, 3 * 2 * 2, generator=g)
        return pixels
    if family.layout in ("anyres", "tiles"):
        return torch.randn(family.tiles(size), 3, 8, 8, generator=g)
    h, w = size if family.any_size else (8, 8)
    pixels = torch.zeros(3, 8, 8)
    pixels[:, :h, :w] = torch.randn(3, h, w, generator=g)
    return pixels


def anyres_tokens(size) -> int:
    """LLaVA-NeXT's placeholder tokens for an image of ``size`` (h, w): its base features, then the tiles' features
    unpadded to the image's aspect ratio with a newline per row, as the model packs them (the processor's count)."""
    model, _ = vlm_with_head("llava_next")
    tiles = FAMILIES["llava_next"].tiles(size)
    with torch.no_grad():
        out = model.model.get_image_features(torch.zeros(1, tiles, 3, 8, 8), torch.tensor([size]))
    return out.pooler_output[0].shape[0]


def family_batch(model_type: str, prompts=FAMILY_PROMPTS, *, seed: int = 0):
    """``prompts`` (see ``FAMILY_PROMPTS``) each repeated G times, left-padded, with right-padded random completions of up to C tokens.
    Returns input_ids, attention_mask (B, P + C) and TRL's multimodal keyword arguments for ``model_type``."""
    family, g = FAMILIES[model_type], torch.Generator().manual_seed(seed)
    rows, images, counts = [], [], []
    for before, sizes, after in prompts:
        pixels = [_image(size, family, g) for size in sizes]
        tokens = list(before)
        for size in sizes:
            tokens += [BOI] + [IMAGE] * family.tokens(size) + [EOI]
        tokens += after
        rows += [tokens] * G
        images += [pixels] * G
        counts += [len(sizes)] * G
    P = max(map(len, rows))
    ids = torch.zeros(len(rows), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, tokens in enumerate(rows):
        ids[b, P - len(tokens) : P], mask[b, P - len(tokens) : P] = torch.tensor(tokens), 1
        c = int(torch.randint(1, C + 1, (1,), generator=g))
        ids[b, P : P + c], mask[b, P : P + c] = torch.randint(4, 110, (c,), generator=g), 1
    extras = dict(num_images=counts)
    if family.layout == "row":  # (B, max images, 3, H, W), empty images as padding; pixel mask per row
        most = max(counts)
        extras["pixel_values"] = torch.zeros(len(rows), most, 3, 8, 8)
        for b, pixels in enumerate(images):
            if pixels:
                extras["pixel_values"][b, : len(pixels)] = torch.stack(pixels)
        extras["pixel_attention_mask"] = (extras["pixel_values"] != 0).any(2).long()
    elif family.layout == "anyres":  # (images, most tiles, 3, H, W), zero tiles as padding; (h, w) per image
        flat = [p for pixels in images for p in pixels]
        extras["pixel_values"] = torch.zeros(len(flat), max(p.shape[0] for p in flat), 3, 8, 8)
        for i, p in enumerate(flat):
            extras["pixel_values"][i, : p.shape[0]] = p
    elif family.layout == "naflex":  # an image is one tile: patch rows, their mask and (h, w) in patches
        sizes = [size for (_, shapes, _) in prompts for _ in range(G) for size in shapes]
        extras["pixel_values"] = torch.stack([p for pixels in images for p in pixels])
        extras["spatial_shapes"] = torch.tensor(sizes) // 2
        extras["pixel_attention_mask"] = (torch.arange(16) < extras["spatial_shapes"].prod(-1)[:, None]).long()
        extras["num_tiles"] = counts
    elif family.layout == "tiles":  # (tiles, 3, H, W), each image's tiles; tiles per row
        extras["pixel_values"] = torch.cat([p for pixels in images for p in pixels])
        extras["num_tiles"] = [sum(p.shape[0] for p in pixels) for pixels in images]
    else:
        extras["pixel_values"] = torch.stack([p for pixels in images for p in pixels])
    if family.token_types:
        extras["token_type_ids"] = (ids == IMAGE).long()
    if family.image_sizes:
        extras["image_sizes"] = torch.tensor([s for (_, sizes, _) in prompts for _ in range(G) for s in sizes])
    return ids, mask, extras


def without_key_biases(grads: dict, ref: dict, tower: str) -> tuple[dict, dict]:
    """The gradients but those of the vision tower's key-projection biases, which are zero in exact arithmetic (no
    rotary positions there: a softmax row does not change when q . b_k is added to each of its scores) and rounding
    noise here: checked to be that, at most 1e-6 of the largest gradient, in both."""
    largest = max(float(g.abs().max()) for g in ref.values())
    noise = [n for n in ref if n.startswith(tower) and n.endswith("k_proj.bias")]
    for name in noise:
        assert max(float(grads[name].abs().max()), float(ref[name].abs().max())) <= 1e-6 * largest, name
    return ({n: g for n, g in grads.items() if n not in noise}, {n: g for n, g in ref.items() if n not in noise})


class _Trainer(types.SimpleNamespace):
    """What the scoring method reads of a trainer."""

    __hash__ = object.__hash__


def _trainer():
    return _Trainer(
        accelerator=types.SimpleNamespace(autocast=nullcontext),
        temperature=TEMPERATURE,
        args=types.SimpleNamespace(cast_lm_head_to_fp32=False),
        _metrics=None,
    )


def stock_method():
    from trl import GRPOTrainer

    return inspect.unwrap(GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"])


def score(method, model, ids, mask, C, extras, batch_size):
    logps, ent, _ = method(_trainer(), model, ids, mask, C, batch_size=batch_size, compute_entropy=True, **extras)
    keep = mask[:, -C:].bool()
    return logps.masked_fill(~keep, 0.0), ent.masked_fill(~keep, 0.0)


_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _processor():
    """Qwen2.5-VL's processor built in memory: the PIL image processor (patch 2, merge 2) and the character
    tokenizer with Qwen's vision tokens; no video processor (it needs torchvision)."""
    from helpers import char_tokenizer
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": _SPECIAL})
    tokenizer.chat_template = _CHAT_TEMPLATE
    images = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=2, temporal_patch_size=1, min_pixels=16, max_pixels=32 * 32
    )
    return ImageOnlyProcessor(image_processor=images, tokenizer=tokenizer, chat_template=_CHAT_TEMPLATE)


def _char_sum_reward(completions, **kwargs):
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def _trainer_vlm(processor):
    """The tiny Qwen2.5-VL matching ``processor``'s special tokens, fp32, SDPA, seeded."""
    vision_start, vision_end, image, video = processor.tokenizer.convert_tokens_to_ids(_SPECIAL)
    eos, pad = processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=dict(GRID_TEXT, vocab_size=96, eos_token_id=eos, pad_token_id=pad),
        vision_config=dict(
            GRID_VISION["qwen2_5_vl"],
            patch_size=PATCH,
            spatial_merge_size=2,
            temporal_patch_size=1,
            in_channels=CHANNELS,
        ),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=vision_start,
        vision_end_token_id=vision_end,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float()


def _image_dataset():
    """Three chat prompts, each one random image (8x8, 8x16, 16x8 pixels) and a short text."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in [(8, 8), (8, 16), (16, 8)]]
    texts = ["what?", "count", "say a"]
    prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}] for t in texts]
    return Dataset.from_dict({"prompt": prompts, "image": images})


_TRAIN_ARGS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=6,
    max_steps=3,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    optim="sgd",
    report_to="none",
    use_cpu=True,
    seed=0,
    save_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
    bf16=False,
    beta=0.0,
    logging_steps=1,
)


def train_vlm(tmp_path, patch: bool, sharing: str = "group", **trainer_args):
    """3 GRPOTrainer steps on the tiny Qwen2.5-VL with the in-memory processor, patched in the ``sharing`` mode or
    stock (``trainer_args``: more GRPOConfig arguments, e.g. a DDP backend); returns (trainer, recorded fallbacks,
    initial weights)."""
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    import grpo_mem

    set_seed(0)
    processor = _processor()
    model = _trainer_vlm(processor)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_char_sum_reward,
        args=GRPOConfig(**dict(_TRAIN_ARGS, output_dir=str(tmp_path)) | trainer_args),
        processing_class=processor,
        train_dataset=_image_dataset(),
    )
    handle = grpo_mem.patch_trl(trainer, group_shuffle=False, sharing=sharing) if patch else None
    try:
        with recording_fallbacks() as fallbacks:
            trainer.train()
    finally:
        if handle is not None:
            handle.revert()
    return trainer, fallbacks, initial


MIN_SHARED = 4


def patched_with(session: SharingSession):
    """TRL's scoring method patched, scoring with ``session``; returns (method, the trainer's metrics)."""
    method, handle = patched_method(stock_method(), sharing=session.mode, log_metrics=True)
    trainer = _trainer()
    trainer._metrics = {"train": defaultdict(list)}
    handle.sessions[trainer] = session
    return (lambda _self, *args, **kwargs: method(trainer, *args, **kwargs)), trainer._metrics["train"]


def stock_and_shared(model, encoded: list, ids, mask, C: int, extras: dict, batch_size: int, sharing: str):
    """(log-probs, entropies, gradients) of stock TRL's method, then of the patched one scoring with a ``sharing``
    session (no fallback, no tree-to-group warning; ``encoded`` cleared before it), and the patched run's metrics."""
    ref_logps, ref_ent = score(stock_method(), model, ids, mask, C, extras, batch_size)
    ref = (ref_logps, ref_ent, grads_of(model, ref_logps, ref_ent))
    encoded.clear()
    method, metrics = patched_with(SharingSession(sharing, min_shared_tokens=MIN_SHARED))
    with recording_fallbacks() as fallbacks, warnings.catch_warnings():
        warnings.simplefilter("error")  # no tree-to-group warning
        logps, ent = score(method, model, ids, mask, C, extras, batch_size)
    assert fallbacks == []
    return ref, (logps, ent, grads_of(model, logps, ent)), metrics


def stock_window(model, ids, mask, C: int, chunks: list) -> tuple[list, dict]:
    """Stock TRL's (log-probs, entropies) of each micro-batch of ``ids``/``mask`` (consecutive, one per ``chunks``
    entry: its ``VisionInputs``), and its gradients summed over them (the model's zeroed after)."""
    refs, start = [], 0
    for chunk in chunks:
        rows = len(chunk.num_images)
        logps, ent = score(
            stock_method(), model, ids[start : start + rows], mask[start : start + rows], C, chunk_kwargs(chunk), rows
        )
        refs.append((logps, ent))
        (logps.sum() + ent.sum()).backward()
        start += rows
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return refs, grads


def tree_window(session: SharingSession, model, ids, mask, C: int, chunks: list, refs: list) -> tuple[int, dict]:
    """The micro-batches of ``stock_window`` scored in ``session``'s open window: each on the tree path, with stock's
    log-probs and entropies ``refs``; returns their backbone tokens and gradients summed (the model's zeroed after)."""
    tokens, start = 0, 0
    for chunk, (ref, ref_ent) in zip(chunks, refs):
        chunk_ids, chunk_mask = ids[start : start + len(chunk.num_images)], mask[start : start + len(chunk.num_images)]
        start += len(chunk.num_images)
        decision = session.decide(
            model, chunk_ids, chunk_mask, C, temperature=TEMPERATURE, compute_entropy=True, vision=chunk
        )
        assert decision.path == "tree", decision.cause
        tokens += decision.backbone_tokens
        logps, ent, _ = session.run(decision)
        assert_close(logps, ref, 1e-5, "log-probs", mask=chunk_mask[:, -C:])
        assert_close(ent, ref_ent, 1e-5, "entropies", mask=chunk_mask[:, -C:])
        (logps.sum() + ent.sum()).backward()
    session.close_window()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return tokens, grads

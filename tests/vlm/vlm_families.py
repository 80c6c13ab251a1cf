"""The vision-language families the tests build at a tiny size (Qwen2-VL, Gemma 3, LLaVA, LLaVA-NeXT, ...): their
configs, models and batches laid out as TRL hands them to the scoring method."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches
from vlm_helpers import TEMPERATURE

IMAGE, BOI, EOI = 120, 118, 119


_PINPOINTS = [[8, 8], [8, 16], [16, 8]]


G, C = 3, 5


_TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=3,
)


_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=8,
    patch_size=2,
    attention_dropout=0.0,
)


# (text before, image sizes (h, w) in pixels, text after): images of two sizes (where the model takes them), a
# text-only prompt, the first prompt's ids again with another image, prompts with two images (6 images for 5
# prompts: TRL takes a tensor with as many entries as images for one entry per image)
PROMPTS = [
    ([5, 6, 7], [(8, 8)], [8, 9]),
    ([5, 6], [(4, 8), (8, 8)], [10, 11, 12, 13]),
    ([20, 21, 22, 23], [], [24]),
    ([5, 6, 7], [(8, 8)], [8, 9]),
    ([30], [(8, 8), (8, 4)], [31, 32]),
]


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
        dict(image_grid_pinpoints=_PINPOINTS),
        "llama",
        "clip_vision_model",
        lambda size: _anyres_tokens(size),
        layout="anyres",
        any_size=True,
        image_sizes=True,
        entries=lambda size: image_size_to_num_patches(size, _PINPOINTS, 8),
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
        lambda size: 4 * _tiles(size),
        layout="tiles",
        any_size=True,
        entries=lambda size: _tiles(size),
    ),
}


def _tiles(size) -> int:
    """InternVL's 8x8 tiles of an image of ``size`` (h, w) in this test: one for a square image, else two."""
    return 1 if size[0] == size[1] else 2


_TEXT_EXTRA = {
    "gemma3_text": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8)
}


def tiny_vlm(model_type: str, seed: int = 0):
    """A random 2-layer text / 2-layer vision ``model_type``, fp32, train mode, SDPA."""
    family = FAMILIES[model_type]
    text = dict(_TEXT, model_type=family.text_type, **_TEXT_EXTRA.get(family.text_type, {}))
    vision = dict(_VISION, model_type=family.vision_type)
    config = AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        pad_token_id=0,
        eos_token_id=3,
        **family.config,
    )
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float().train()


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


def _anyres_tokens(size) -> int:
    """LLaVA-NeXT's placeholder tokens for an image of ``size`` (h, w): its base features, then the tiles' features
    unpadded to the image's aspect ratio with a newline per row, as the model packs them (the processor's count)."""
    model, _ = _vlm("llava_next")
    tiles = FAMILIES["llava_next"].tiles(size)
    with torch.no_grad():
        out = model.model.get_image_features(torch.zeros(1, tiles, 3, 8, 8), torch.tensor([size]))
    return out.pooler_output[0].shape[0]


def vlm_batch(model_type: str, prompts=PROMPTS, *, seed: int = 0):
    """``prompts`` each repeated G times, left-padded, with right-padded random completions of up to C tokens.
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


@functools.lru_cache(maxsize=None)
def _vlm(model_type: str):
    """(tiny ``model_type`` with TRL's fused head, list of the entries each vision-tower call encoded), built once."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_vlm(model_type)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    encoded: list[int] = []

    def count(module, args, kwargs, out):
        encoded.append((args[0] if args else kwargs["pixel_values"]).shape[0])

    getattr(model.model, FAMILIES[model_type].tower).register_forward_hook(count, with_kwargs=True)
    return model, encoded


def _without_key_biases(grads: dict, ref: dict, tower: str) -> tuple[dict, dict]:
    """The gradients but those of the vision tower's key-projection biases, which are zero in exact arithmetic (no
    rotary positions there: a softmax row does not change when q . b_k is added to each of its scores) and rounding
    noise here: checked to be that, at most 1e-6 of the largest gradient, in both."""
    largest = max(float(g.abs().max()) for g in ref.values())
    noise = [n for n in ref if n.startswith(tower) and n.endswith("k_proj.bias")]
    for name in noise:
        assert max(float(grads[name].abs().max()), float(ref[name].abs().max())) <= 1e-6 * largest, name
    return ({n: g for n, g in grads.items() if n not in noise}, {n: g for n, g in ref.items() if n not in noise})

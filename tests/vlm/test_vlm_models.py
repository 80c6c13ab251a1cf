"""Image prompts on the prompt-once path for vision-language models with 1D positions, one per TRL 1.16 input layout:
LLaVA (``pixel_values`` one entry per image), Gemma 3 (the same, plus ``token_type_ids``: bidirectional attention
inside each image block, sliding-window layers with a window shorter than the prompts), Idefics3 (``pixel_values`` and
``pixel_attention_mask`` one entry per row, padded with empty images; SmolVLM likewise), LLaVA-NeXT
(``image_sizes`` per image, any resolution tiles), Mistral 3 (``image_sizes`` per image, images padded to the largest),
Aya Vision (one entry per image, Cohere 2 text layers), InternVL (``pixel_values`` per tile, ``num_tiles`` per row),
LFM2-VL (patch rows, ``pixel_attention_mask`` and ``spatial_shapes`` per tile). Tiny random models built offline, batches laid out by
hand as each processor lays them out.

The patched scoring method and TRL's own must agree: fp32 log-probs and entropies within 1e-5, every parameter
gradient (vision tower included) within 1e-4 of its scale, with a text-only prompt mixed in, two prompts with equal
ids and different images, left padding and chunks splitting groups; the vision tower's inputs are counted with a
forward hook (each unique prompt's images encoded once per chunk); bad image inputs get the model's own error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from helpers import assert_close, assert_grads_close, grads_of
from test_vlm import TEMPERATURE, _score, _stock_method
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from grpo_mem.model.sharing import SharingSession
from grpo_mem.model.support import architecture_reason, recording_fallbacks
from grpo_mem.patches.trl import patched_method
from grpo_mem.patches.trl_images import chunk_images, chunk_kwargs, input_cause

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


def _encoded(model_type: str, prompts: list[int]) -> int:
    """What the vision tower encodes for the images of ``prompts`` (indices into ``PROMPTS``): one entry per image,
    LLaVA-NeXT and InternVL one per tile."""
    return sum(FAMILIES[model_type].tiles(size) for p in prompts for size in PROMPTS[p][1])


def _patched():
    return patched_method(_stock_method(), sharing="group")[0]


@pytest.mark.parametrize(
    "model_type, batch_size",
    [
        ("llava", 15),
        ("llava", 4),
        ("gemma3", 4),
        ("idefics3", 4),
        ("llava_next", 4),
        ("internvl", 4),
        ("lfm2_vl", 4),
        ("smolvlm", 4),
        ("mistral3", 4),
        ("aya_vision", 4),
    ],
)
def test_logprobs_entropies_gradients_match_stock(model_type, batch_size):
    """Whole batch in one chunk, and chunks of 4 rows (groups of 3 split over chunks): numbers and gradients as
    stock; the vision tower encodes each chunk's unique prompts' images once (stock: every row's)."""
    model, encoded = _vlm(model_type)
    assert architecture_reason(model) is None
    ids, mask, extras = vlm_batch(model_type)
    encoded.clear()
    ref_logps, ref_ent = _score(_stock_method(), model, ids, mask, C, extras, batch_size)
    ref_grads = grads_of(model, ref_logps, ref_ent)
    assert sum(encoded) == _encoded(model_type, [b // G for b in range(ids.shape[0])])
    encoded.clear()
    with recording_fallbacks() as fallbacks:
        logps, ent = _score(_patched(), model, ids, mask, C, extras, batch_size)
    grads = grads_of(model, logps, ent)
    assert fallbacks == []
    chunks = [range(s, min(s + batch_size, ids.shape[0])) for s in range(0, ids.shape[0], batch_size)]
    assert sum(encoded) == sum(_encoded(model_type, sorted({b // G for b in rows})) for rows in chunks)
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    tower = f"model.{FAMILIES[model_type].tower}."
    assert any(name.startswith(tower) for name in grads)
    assert_grads_close(*_without_key_biases(grads, ref_grads, tower))


def _without_key_biases(grads: dict, ref: dict, tower: str) -> tuple[dict, dict]:
    """The gradients but those of the vision tower's key-projection biases, which are zero in exact arithmetic (no
    rotary positions there: a softmax row does not change when q . b_k is added to each of its scores) and rounding
    noise here: checked to be that, at most 1e-6 of the largest gradient, in both."""
    largest = max(float(g.abs().max()) for g in ref.values())
    noise = [n for n in ref if n.startswith(tower) and n.endswith("k_proj.bias")]
    for name in noise:
        assert max(float(grads[name].abs().max()), float(ref[name].abs().max())) <= 1e-6 * largest, name
    return ({n: g for n, g in grads.items() if n not in noise}, {n: g for n, g in ref.items() if n not in noise})


def test_window_forwards_each_image_prompt_once():
    """Gemma 3, three micro-batches of one optimizer step, each holding one row of every group: each unique prompt
    (ids, images, token types) goes through the vision tower once in the window; log-probs as stock's per
    micro-batch, gradients as stock's summed over them."""
    model, encoded = _vlm("gemma3")
    ids, mask, extras = vlm_batch("gemma3")
    B, P = ids.shape[0], ids.shape[1] - C
    order = sorted(range(B), key=lambda b: (b % G, b))  # micro-batch i: row i of every group
    whole = chunk_images(extras, 0, B, B)
    ids, mask = ids[order], mask[order]
    extras = dict(
        whole.of_rows(order),
        num_images=[whole.num_images[b] for b in order],
        token_type_ids=extras["token_type_ids"][order],
    )
    size = B // G
    chunks = [chunk_images(extras, s, s + size, B) for s in range(0, B, size)]
    ref_logps = []
    for s, chunk in zip(range(0, B, size), chunks):
        logps, ent = _score(_stock_method(), model, ids[s : s + size], mask[s : s + size], C, chunk_kwargs(chunk), size)
        ref_logps.append(logps)
        (logps.sum() + ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    encoded.clear()
    session = SharingSession("group")
    session.begin_window(
        [ids[s : s + size, :P] for s in range(0, B, size)],
        [mask[s : s + size, :P] for s in range(0, B, size)],
        images=chunks,
    )
    for s, chunk in zip(range(0, B, size), chunks):
        chunk_ids, chunk_mask = ids[s : s + size], mask[s : s + size]
        decision = session.decide(
            model, chunk_ids, chunk_mask, C, temperature=TEMPERATURE, compute_entropy=True, vision=chunk
        )
        assert decision.path == "group"
        logps, ent = session.run(decision)
        assert_close(logps, ref_logps[s // size], 1e-5, "log-probs", mask=chunk_mask[:, -C:])
        (logps.sum() + ent.sum()).backward()
    session.close_window()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert sum(encoded) == _encoded("gemma3", list(range(len(PROMPTS))))
    assert_grads_close(*_without_key_biases(grads, ref_grads, "model.vision_tower."))


def test_gemma3_image_blocks_attend_bidirectionally():
    """The Gemma 3 batch above tests something: without ``token_type_ids`` stock's numbers differ (image tokens
    attend causally), and a window of 4 is shorter than its prompts."""
    model, _ = _vlm("gemma3")
    ids, mask, extras = vlm_batch("gemma3", PROMPTS[:2])
    assert model.config.text_config.sliding_window < int(mask[:, : ids.shape[1] - C].sum(1).min())
    with torch.no_grad():
        bidirectional, _ = _score(_stock_method(), model, ids, mask, C, extras, 6)
        causal, _ = _score(_stock_method(), model, ids, mask, C, dict(extras, token_type_ids=None), 6)
    assert float((bidirectional - causal).abs().max()) > 1e-3


@pytest.mark.parametrize("model_type", ["llava", "idefics3"])
def test_bad_image_inputs_get_the_models_own_error(model_type):
    """Image tokens that do not match the image features: the model's own error, as stock raises it."""
    model, _ = _vlm(model_type)
    ids, mask, extras = vlm_batch(model_type, PROMPTS[:2], seed=3)
    first_image = (ids == IMAGE).int().argmax(1)
    ids[torch.arange(ids.shape[0]), first_image] = 9  # one image token of every row becomes text
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as stock_error:
        _score(_stock_method(), model, ids, mask, C, extras, 6)
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as our_error:
        _score(_patched(), model, ids, mask, C, extras, 6)
    assert type(our_error.value) is type(stock_error.value)


def test_layouts_slice_as_trl_and_key_rows_by_their_images():
    """Per row (Idefics3) and per image (LLaVA) layouts: a chunk's tensors are TRL's slices; rows of one prompt share
    a key, equal ids with other images do not; counts the tensors do not hold are a ValueError naming both."""
    ids, mask, extras = vlm_batch("idefics3")
    chunk = chunk_images(extras, 4, 8, ids.shape[0])
    assert torch.equal(chunk.tensors["pixel_values"], extras["pixel_values"][4:8])
    assert torch.equal(chunk.tensors["pixel_attention_mask"], extras["pixel_attention_mask"][4:8])
    ids, mask, extras = vlm_batch("llava")
    chunk = chunk_images(extras, 4, 8, ids.shape[0])
    assert torch.equal(chunk.tensors["pixel_values"], extras["pixel_values"][5:9])  # rows 4-7: images 5-8
    keys = chunk_images(extras, 0, ids.shape[0], ids.shape[0]).row_keys(ids.shape[1] - C)
    assert keys[0] == keys[2] != keys[9] and keys[6] == b"" and keys[3] != keys[0]
    with pytest.raises(ValueError, match="counts 19 images and the batch has 15 rows but pixel_values has 18"):
        chunk_images(dict(extras, num_images=[2] + extras["num_images"][1:]), 0, 15, 15)
    assert input_cause(dict(extras, image_position_ids=torch.zeros(1))) == (
        "multimodal or token-type inputs ['image_position_ids']"
    )


def test_models_that_compute_their_own_positions_are_a_named_cause():
    """PaliGemma places text at 1-based positions of its own: not the passes' positions, so the stock path."""
    config = AutoConfig.for_model(
        "paligemma",
        text_config=dict(_TEXT, model_type="gemma", head_dim=8),
        vision_config=dict(_VISION, model_type="siglip_vision_model"),
        image_token_id=IMAGE,
    )
    model = AutoModelForImageTextToText.from_config(config)
    assert architecture_reason(model) == "vision-language model computing its own positions in its forward"

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


import pytest
import torch
from helpers import assert_close, assert_grads_close, grads_of
from transformers import AutoConfig, AutoModelForImageTextToText

from vlm_fixtures import (
    FAMILIES,
    FAMILY_PROMPTS,
    FAMILY_TEXT,
    FAMILY_VISION,
    IMAGE,
    TEMPERATURE,
    C,
    G,
    family_batch,
    score,
    stock_method,
    vlm_with_head,
    without_key_biases,
)
from grpo_mem.model.sharing import SharingSession
from grpo_mem.model.fallback import recording_fallbacks
from grpo_mem.model.support import architecture_cause
from grpo_mem.patches.trl import patched_method
from grpo_mem.patches.trl_images import chunk_images, chunk_kwargs, input_cause


def _encoded(model_type: str, prompts: list[int]) -> int:
    """What the vision tower encodes for the images of ``prompts`` (indices into ``FAMILY_PROMPTS``): one entry per image,
    LLaVA-NeXT and InternVL one per tile."""
    return sum(FAMILIES[model_type].tiles(size) for p in prompts for size in FAMILY_PROMPTS[p][1])


def _patched():
    return patched_method(stock_method(), sharing="group")[0]


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
    model, encoded = vlm_with_head(model_type)
    assert architecture_cause(model) is None
    ids, mask, extras = family_batch(model_type)
    encoded.clear()
    ref_logps, ref_ent = score(stock_method(), model, ids, mask, C, extras, batch_size)
    ref_grads = grads_of(model, ref_logps, ref_ent)
    assert sum(encoded) == _encoded(model_type, [b // G for b in range(ids.shape[0])])
    encoded.clear()
    with recording_fallbacks() as fallbacks:
        logps, ent = score(_patched(), model, ids, mask, C, extras, batch_size)
    grads = grads_of(model, logps, ent)
    assert fallbacks == []
    chunks = [range(s, min(s + batch_size, ids.shape[0])) for s in range(0, ids.shape[0], batch_size)]
    assert sum(encoded) == sum(_encoded(model_type, sorted({b // G for b in rows})) for rows in chunks)
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    tower = f"model.{FAMILIES[model_type].tower}."
    assert any(name.startswith(tower) for name in grads)
    assert_grads_close(*without_key_biases(grads, ref_grads, tower))


def test_window_forwards_each_image_prompt_once():
    """Gemma 3, three micro-batches of one optimizer step, each holding one row of every group: each unique prompt
    (ids, images, token types) goes through the vision tower once in the window; log-probs as stock's per
    micro-batch, gradients as stock's summed over them."""
    model, encoded = vlm_with_head("gemma3")
    ids, mask, extras = family_batch("gemma3")
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
        logps, ent = score(stock_method(), model, ids[s : s + size], mask[s : s + size], C, chunk_kwargs(chunk), size)
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
        logps, ent, _ = session.run(decision)
        assert_close(logps, ref_logps[s // size], 1e-5, "log-probs", mask=chunk_mask[:, -C:])
        (logps.sum() + ent.sum()).backward()
    session.close_window()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert sum(encoded) == _encoded("gemma3", list(range(len(FAMILY_PROMPTS))))
    assert_grads_close(*without_key_biases(grads, ref_grads, "model.vision_tower."))


def test_gemma3_image_blocks_attend_bidirectionally():
    """The Gemma 3 batch above tests something: without ``token_type_ids`` stock's numbers differ (image tokens
    attend causally), and a window of 4 is shorter than its prompts."""
    model, _ = vlm_with_head("gemma3")
    ids, mask, extras = family_batch("gemma3", FAMILY_PROMPTS[:2])
    assert model.config.text_config.sliding_window < int(mask[:, : ids.shape[1] - C].sum(1).min())
    with torch.no_grad():
        bidirectional, _ = score(stock_method(), model, ids, mask, C, extras, 6)
        causal, _ = score(stock_method(), model, ids, mask, C, dict(extras, token_type_ids=None), 6)
    assert float((bidirectional - causal).abs().max()) > 1e-3


@pytest.mark.parametrize("model_type", ["llava", "idefics3"])
def test_bad_image_inputs_get_the_models_own_error(model_type):
    """Image tokens that do not match the image features: the model's own error, as stock raises it."""
    model, _ = vlm_with_head(model_type)
    ids, mask, extras = family_batch(model_type, FAMILY_PROMPTS[:2], seed=3)
    first_image = (ids == IMAGE).int().argmax(1)
    ids[torch.arange(ids.shape[0]), first_image] = 9  # one image token of every row becomes text
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as stock_error:
        score(stock_method(), model, ids, mask, C, extras, 6)
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as our_error:
        score(_patched(), model, ids, mask, C, extras, 6)
    assert type(our_error.value) is type(stock_error.value)


def test_layouts_slice_as_trl_and_key_rows_by_their_images():
    """Per row (Idefics3) and per image (LLaVA) layouts: a chunk's tensors are TRL's slices; rows of one prompt share
    a key, equal ids with other images do not; counts the tensors do not hold are a ValueError naming both."""
    ids, mask, extras = family_batch("idefics3")
    chunk = chunk_images(extras, 4, 8, ids.shape[0])
    assert torch.equal(chunk.tensors["pixel_values"], extras["pixel_values"][4:8])
    assert torch.equal(chunk.tensors["pixel_attention_mask"], extras["pixel_attention_mask"][4:8])
    ids, mask, extras = family_batch("llava")
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
    """PaliGemma places text at 1-based positions of its own when given none (seen in what its forward hands its
    language model): not the positions the passes continue, so the stock path. (Measured on this tiny PaliGemma with
    the family prompts' two-image prompt in a group of 3: stock's log-probs move by up to 5.2e-4 when its positions
    start at 0 instead of 1; group sharing differed from stock by as much, tree sharing did not.)"""
    config = AutoConfig.for_model(
        "paligemma",
        text_config=dict(FAMILY_TEXT, model_type="gemma"),
        vision_config=dict(FAMILY_VISION, model_type="siglip_vision_model"),
        image_token_id=IMAGE,
    )
    model = AutoModelForImageTextToText.from_config(config)
    assert architecture_cause(model) == "vision-language model computing its own positions in its forward"


def test_what_the_forward_hands_its_language_model_is_observed(monkeypatch):
    """What a vision-language forward hands its language model is seen in one run on its twin, not read from its
    text: a forward that computes ``0 … T-1`` when given no positions (what the text rule refused: Fuyu's and
    Gemma 4's) is admitted; one that moves the positions it was given, or hands on another keyword, is named."""
    import functools

    from transformers.models.llava import modeling_llava

    from vlm_fixtures import tiny_vlm

    model = tiny_vlm("llava")
    original = modeling_llava.LlavaModel.forward

    def rewritten(change):
        @functools.wraps(original)  # the signature the rule reads stays LLaVA's
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            position_ids, kwargs = change(input_ids, position_ids, kwargs)
            return original(self, input_ids=input_ids, position_ids=position_ids, **kwargs)

        return forward

    def counted(ids, positions, kwargs):
        return (torch.arange(ids.shape[1])[None] if positions is None else positions), kwargs

    for change, cause in (
        (counted, None),
        (lambda ids, p, kw: (p + 1 if p is not None else p, kw), "computing its own positions in its forward"),
        (lambda ids, p, kw: (p, dict(kw, output_router_logits=True)), "more than merged embeddings (output_router"),
    ):
        monkeypatch.setattr(modeling_llava.LlavaModel, "forward", rewritten(change))
        got = architecture_cause(model)
        assert got is None if cause is None else cause in got, got

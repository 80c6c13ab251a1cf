"""Image prompts on the prompt-once path: tiny random Qwen2.5-VL, Qwen2-VL and Qwen3-VL (deepstack on) built offline,
against stock TRL 1.16.

Batches are laid out by hand as Qwen's processor lays them out (``<|vision_start|>``, one ``<|image_pad|>`` per merged
patch, ``<|vision_end|>``; ``mm_token_type_ids`` 1 on image tokens; patch rows of ``in_channels x patch_size^2``
floats per grid cell): images of different sizes in one batch, a text-only prompt mixed in, two prompts with equal
ids and different images, left padding, G completions of random lengths. The patched scoring method and TRL's own
(``GRPOTrainer._get_per_token_logps_and_entropies``, given TRL's fused head) must agree: fp32 log-probs and entropies
within 1e-5, every parameter gradient (vision tower included) within 1e-4 of its scale. The vision tower's inputs are
counted with a forward hook: each unique prompt's images are encoded once.
"""

from __future__ import annotations

import inspect
import types
import warnings
from contextlib import nullcontext

import pytest
import torch
from helpers import assert_close, assert_grads_close, grads_of
from transformers import AutoConfig, AutoModelForImageTextToText

from grpo_mem.model.sharing import Kind, SharingSession
from grpo_mem.model.support import recording_fallbacks
from grpo_mem.patches.trl import patched_method
from grpo_mem.patches.trl_images import chunk_images, chunk_kwargs

IMAGE, VISION_START, VISION_END = 120, 118, 119
TEMPERATURE = 0.7
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
    eos_token_id=3,
    pad_token_id=0,
    bos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
)
_VISION = {
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
}

# (text before the image(s), image grids (t, h, w) in patches, text after): a 4x4 and a 4x8 image, a text-only
# prompt, and the first prompt's ids again with another image
PROMPTS = [
    ([5, 6, 7], [(1, 4, 4)], [8, 9]),
    ([5, 6], [(1, 4, 8)], [10, 11, 12, 13]),
    ([20, 21, 22, 23], [], [24]),
    ([5, 6, 7], [(1, 4, 4)], [8, 9]),
]


def tiny_vlm(model_type: str = "qwen2_5_vl", seed: int = 0):
    """A random 2-layer text / 2-block vision model of ``model_type``, fp32, train mode, SDPA."""
    vision = dict(
        _VISION[model_type], patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=1, in_channels=CHANNELS
    )
    config = AutoConfig.for_model(
        model_type,
        text_config=dict(_TEXT),
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=121,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        eos_token_id=3,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float().train()


def vlm_batch(prompts, G: int, C: int, *, seed: int = 0, image_seeds=None):
    """``prompts`` (see ``PROMPTS``) each repeated G times, left-padded, with right-padded random completions; each
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
            tokens += [VISION_START] + [IMAGE] * n + [VISION_END]
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


def _stock_method():
    from trl import GRPOTrainer

    return inspect.unwrap(GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"])


def _score(method, model, ids, mask, C, extras, batch_size):
    logps, ent, _ = method(_trainer(), model, ids, mask, C, batch_size=batch_size, compute_entropy=True, **extras)
    keep = mask[:, -C:].bool()
    return logps.masked_fill(~keep, 0.0), ent.masked_fill(~keep, 0.0)


_MODELS: dict = {}


def _vlm(model_type: str):
    """(tiny ``model_type`` with TRL's fused head, list of images each vision-tower call encoded), built once."""
    from trl.trainer.utils import add_fused_lm_head

    if model_type not in _MODELS:
        model = tiny_vlm(model_type)
        add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
        encoded: list[int] = []
        model.model.visual.register_forward_hook(
            lambda m, args, kwargs, out: encoded.append(kwargs["grid_thw"].shape[0]), with_kwargs=True
        )
        _MODELS[model_type] = (model, encoded)
    return _MODELS[model_type]


@pytest.fixture
def vlm():
    """The tiny Qwen2.5-VL of ``_vlm`` (the other types run the parity test only, to keep the suite short)."""
    return _vlm("qwen2_5_vl")


def _unique_images(extras, rows: range) -> int:
    """Images of the distinct prompts (ids and images) among ``rows``: here one per prompt index with an image."""
    G = len(extras["num_images"]) // len(PROMPTS)
    return sum(len(PROMPTS[p][1]) for p in sorted({b // G for b in rows}))


@pytest.mark.parametrize(
    "model_type, batch_size", [("qwen2_5_vl", 12), ("qwen2_5_vl", 4), ("qwen2_vl", 4), ("qwen3_vl", 4)]
)
def test_logprobs_entropies_gradients_match_stock(model_type, batch_size):
    """Whole batch in one chunk, and chunks of 4 rows (groups of 3 split over chunks): numbers and gradients as
    stock; the vision tower encodes each chunk's unique prompts' images once (stock: every row's)."""
    model, encoded = _vlm(model_type)
    ids, mask, C, extras = vlm_batch(PROMPTS, G=3, C=5)
    encoded.clear()
    ref_logps, ref_ent = _score(_stock_method(), model, ids, mask, C, extras, batch_size)
    ref_grads = grads_of(model, ref_logps, ref_ent)
    assert sum(encoded) == sum(extras["num_images"])
    encoded.clear()
    with recording_fallbacks() as fallbacks:
        logps, ent = _score(
            patched_method(_stock_method(), sharing="group")[0], model, ids, mask, C, extras, batch_size
        )
    grads = grads_of(model, logps, ent)
    assert fallbacks == []
    chunks = [range(s, min(s + batch_size, ids.shape[0])) for s in range(0, ids.shape[0], batch_size)]
    assert sum(encoded) == sum(_unique_images(extras, rows) for rows in chunks)
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    assert any(name.startswith("model.visual.") for name in grads)
    if model.config.model_type == "qwen3_vl":  # deepstack features reach the loss
        assert any(".deepstack_merger_list." in name for name in grads)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_text_only_batch_on_a_served_model(vlm, sharing):
    """No image input at all: the text path (positions as the model's ``arange``), stock's numbers, no vision call."""
    model, encoded = vlm
    ids, mask, C, _ = vlm_batch([PROMPTS[2], ([30, 31], [], [32, 33, 34, 35])], G=2, C=4, seed=4)
    ref_logps, ref_ent = _score(_stock_method(), model, ids, mask, C, {}, 4)
    ref_grads = grads_of(model, ref_logps, ref_ent)
    encoded.clear()
    with recording_fallbacks() as fallbacks:
        method, _ = patched_method(_stock_method(), sharing=sharing)
        logps, ent = _score(method, model, ids, mask, C, {}, 4)
    assert fallbacks == [] and encoded == []
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    assert_grads_close(grads_of(model, logps, ent), ref_grads)


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_window_forwards_each_image_prompt_once(vlm, sharing):
    """Two micro-batches of one optimizer step, each holding part of every group: each unique prompt (ids and
    images) goes through the vision tower and the language model once in the window; gradients as stock's summed
    over the micro-batches. A tree-mode session plans image prompts in tree mode (here every prompt is a root of its
    own: no common prefix reaches the default ``min_shared_tokens``), without a warning."""
    model, encoded = vlm
    ids, mask, C, extras = vlm_batch(PROMPTS, G=2, C=4, seed=1)
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # rows 2i, 2i + 1 are prompt i's
    ids, mask = ids[order], mask[order]
    extras = reorder(extras, order)
    halves = [chunk_images(extras, s, s + 4, 8) for s in (0, 4)]
    P = ids.shape[1] - C
    ref_logps = []
    for s, half in zip((0, 4), halves):
        logps, ent = _score(_stock_method(), model, ids[s : s + 4], mask[s : s + 4], C, chunk_kwargs(half), 4)
        ref_logps.append(logps)
        (logps.sum() + ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    encoded.clear()
    session = SharingSession(sharing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session.begin_window([ids[:4, :P], ids[4:, :P]], [mask[:4, :P], mask[4:, :P]], images=halves)
    for s, half in zip((0, 4), halves):
        chunk_ids, chunk_mask = ids[s : s + 4], mask[s : s + 4]
        decision = session.decide(
            model, chunk_ids, chunk_mask, C, temperature=TEMPERATURE, compute_entropy=True, vision=half
        )
        assert decision.path == sharing
        logps, ent = session.run(decision)
        assert_close(logps, ref_logps[s // 4], 1e-5, "log-probs", mask=chunk_mask[:, -C:])
        (logps.sum() + ent.sum()).backward()
    session.close_window()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert sum(encoded) == sum(len(p[1]) for p in PROMPTS)  # 3 images for 4 prompts of 2 rows
    assert_grads_close(grads, ref_grads)


def test_images_are_keyed_once_per_micro_batch(vlm, monkeypatch):
    """The image value a window is planned with is the one its micro-batch is decided with: a chunk sliced again from
    the same arguments (as the patched method slices each call's) reuses its row keys (no hashing in ``decide``),
    and decides as a chunk keyed afresh does; bound once, in the decision."""
    from grpo_mem.model import multimodal

    model, _ = vlm
    ids, mask, C, extras = vlm_batch(PROMPTS, G=2, C=4, seed=1)
    P, B = ids.shape[1] - C, ids.shape[0]
    planned = chunk_images(extras, 0, B, B)
    calls = []
    keys = multimodal.image_keys
    monkeypatch.setattr(multimodal, "image_keys", lambda parts: calls.append(len(parts)) or keys(parts))
    session = SharingSession("group")
    session.begin_window([ids[:, :P]], [mask[:, :P]], images=[planned])
    planned_calls = len(calls)
    again = chunk_images(extras, 0, B, B)
    assert again is not planned and planned.holds(again)
    decision = session.decide(model, ids, mask, C, vision=again)
    assert planned_calls == 2 and len(calls) == planned_calls  # token types and images, once each
    fresh = SharingSession("group").decide(model, ids, mask, C, vision=chunk_images(extras, 0, B, B))
    assert len(calls) == 2 * planned_calls
    assert (decision.path, decision.backbone_tokens, decision.stock_tokens) == (
        "group",
        fresh.backbone_tokens,
        B * ids.shape[1],
    )
    assert decision.images.inputs is planned and decision.kind is Kind.SHARED
    session.close_window()


def test_image_tokens_in_completion_are_a_named_cause(vlm):
    """An image token type in a completion (images a tool returned), image inputs given to a text model: the decision
    is the stock path, with its cause."""
    model, _ = vlm
    ids, mask, C, extras = vlm_batch(PROMPTS[:2], G=2, C=4, seed=2)
    extras["mm_token_type_ids"][0, -C] = 1
    vision = chunk_images(extras, 0, 4, 4)
    session = SharingSession("group")
    decision = session.decide(model, ids, mask, C, vision=vision, stock_available=True)
    cause = "image or video tokens in a completion (images returned by a tool)"
    assert (decision.path, decision.cause) == ("stock", cause)
    # the default stock path takes no images: refused, and the decision is still there to run with one that does
    with pytest.raises(ValueError, match="no stock path taking them"):
        session.run(decision)
    with pytest.raises(ValueError, match="run_hidden.. does not take image inputs"):
        session.run_hidden(decision, stock=lambda: None)
    sentinel = torch.zeros(4, C)
    assert session.run(decision, stock=lambda: (sentinel, None, None))[0] is sentinel
    from helpers import tiny_model

    text_model = tiny_model("qwen2", vocab_size=128)  # image inputs given to a model without a vision tower
    decision = SharingSession("group").decide(text_model, ids, mask, C, vision=vision, stock_available=True)
    assert (decision.path, decision.cause) == ("stock", "image inputs given to a text-only model")


def test_bad_image_inputs_get_clear_errors(vlm):
    """Image tokens that do not match the image features: the model's own error, as stock raises it; image counts
    that the grids or the patch rows do not hold: a ValueError naming both numbers."""
    model, _ = vlm
    ids, mask, C, extras = vlm_batch(PROMPTS[:2], G=2, C=4, seed=3)
    first_image = (ids == IMAGE).int().argmax(1)
    ids[torch.arange(ids.shape[0]), first_image] = 9  # one image token of every row becomes text
    extras["mm_token_type_ids"][torch.arange(ids.shape[0]), first_image] = 0
    method, _ = patched_method(_stock_method())
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as stock_error:
        _score(_stock_method(), model, ids, mask, C, extras, 4)
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as our_error:
        _score(method, model, ids, mask, C, extras, 4)
    assert type(our_error.value) is type(stock_error.value)
    ids, mask, C, extras = vlm_batch(PROMPTS[:2], G=2, C=4, seed=3)
    with pytest.raises(ValueError, match="num_images counts 3 images but image_grid_thw has 4 grids"):
        _score(method, model, ids, mask, C, dict(extras, num_images=[1, 1, 1, 0]), 4)
    with pytest.raises(ValueError, match="image_grid_thw holds 96 patch rows but pixel_values has 95"):
        _score(method, model, ids, mask, C, dict(extras, pixel_values=extras["pixel_values"][:-1]), 4)


# ----------------------------------------------------------------------------------------------------------------------
# a GRPOTrainer run: TRL's own image pipeline (processor, generation, shuffling, buffering) on a tiny Qwen2.5-VL

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


def _train(tmp_path, patch: bool, sharing: str = "group", **trainer_args):
    """3 GRPOTrainer steps on the tiny Qwen2.5-VL with the in-memory processor, patched in the ``sharing`` mode or
    stock (``trainer_args``: more GRPOConfig arguments, e.g. a DDP backend); returns (trainer, recorded fallbacks,
    initial weights)."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    import grpo_mem

    set_seed(0)
    processor = _processor()
    vision_start, vision_end, image, video = processor.tokenizer.convert_tokens_to_ids(_SPECIAL)
    eos, pad = processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=dict(_TEXT, vocab_size=96, eos_token_id=eos, pad_token_id=pad),
        vision_config=dict(
            _VISION["qwen2_5_vl"], patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=1, in_channels=CHANNELS
        ),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=vision_start,
        vision_end_token_id=vision_end,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in [(8, 8), (8, 16), (16, 8)]]
    texts = ["what?", "count", "say a"]
    prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}] for t in texts]
    args = GRPOConfig(
        **dict(
            output_dir=str(tmp_path),
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
        | trainer_args
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_char_sum_reward,
        args=args,
        processing_class=processor,
        train_dataset=Dataset.from_dict({"prompt": prompts, "image": images}),
    )
    handle = grpo_mem.patch_trl(trainer, group_shuffle=False, sharing=sharing) if patch else None
    try:
        with recording_fallbacks() as fallbacks:
            trainer.train()
    finally:
        if handle is not None:
            handle.revert()
    return trainer, fallbacks, initial


_STOCK_RUN: dict = {}


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_grpo_trainer_three_steps_match_stock(tmp_path, sharing):
    """3 GRPOTrainer steps (gradient accumulation 2, rows shuffled row by row so groups straddle micro-batches) on a
    tiny Qwen2.5-VL with images of three sizes: every training micro-batch takes the path of the patch's sharing mode
    (tree: the window planned from the buffered batches' image keys), and the weights, vision tower included, end
    within 1e-5 of stock's (SGD, so a gradient difference shows as lr x difference)."""
    if not _STOCK_RUN:  # one stock run serves both modes
        _STOCK_RUN["run"] = _train(tmp_path / "stock", patch=False)
    stock, _, initial = _STOCK_RUN["run"]
    ours, fallbacks, _ = _train(tmp_path / "ours", patch=True, sharing=sharing)
    assert fallbacks == []
    metric = f"grpo_mem/path/{sharing}"
    paths = [log[metric] for log in ours.state.log_history if metric in log]
    assert paths == [1.0, 1.0, 1.0]
    stock_weights = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_weights[name].detach(), 1e-5, name)
    moved = {name: float((p.detach() - initial[name]).abs().max()) for name, p in stock_weights.items()}
    assert max(v for n, v in moved.items() if n.startswith("model.visual.")) > 1e-4  # the vision tower trained

"""What the vision-language tests share: tiny Qwen2.5-VL-shaped models and their image batches, stock TRL's and
the patched scoring method on them, a 3-step GRPOTrainer run, and windows of micro-batches scored both ways."""

from __future__ import annotations

import inspect
import types
import warnings
from collections import defaultdict
from contextlib import nullcontext

import torch
from helpers import assert_close, grads_of
from transformers import AutoConfig, AutoModelForImageTextToText

from grpo_mem.model.sharing import SharingSession
from grpo_mem.model.fallback import recording_fallbacks
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


def _train(tmp_path, patch: bool, sharing: str = "group", **trainer_args):
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


def _patched(session: SharingSession):
    """TRL's scoring method patched, scoring with ``session``; returns (method, the trainer's metrics)."""
    method, handle = patched_method(_stock_method(), sharing=session.mode, log_metrics=True)
    trainer = _trainer()
    trainer._metrics = {"train": defaultdict(list)}
    handle.sessions[trainer] = session
    return (lambda _self, *args, **kwargs: method(trainer, *args, **kwargs)), trainer._metrics["train"]


def stock_and_shared(model, encoded: list, ids, mask, C: int, extras: dict, batch_size: int, sharing: str):
    """(log-probs, entropies, gradients) of stock TRL's method, then of the patched one scoring with a ``sharing``
    session (no fallback, no tree-to-group warning; ``encoded`` cleared before it), and the patched run's metrics."""
    ref_logps, ref_ent = _score(_stock_method(), model, ids, mask, C, extras, batch_size)
    ref = (ref_logps, ref_ent, grads_of(model, ref_logps, ref_ent))
    encoded.clear()
    method, metrics = _patched(SharingSession(sharing, min_shared_tokens=MIN_SHARED))
    with recording_fallbacks() as fallbacks, warnings.catch_warnings():
        warnings.simplefilter("error")  # no tree-to-group warning
        logps, ent = _score(method, model, ids, mask, C, extras, batch_size)
    assert fallbacks == []
    return ref, (logps, ent, grads_of(model, logps, ent)), metrics


def stock_window(model, ids, mask, C: int, chunks: list) -> tuple[list, dict]:
    """Stock TRL's (log-probs, entropies) of each micro-batch of ``ids``/``mask`` (consecutive, one per ``chunks``
    entry: its ``VisionInputs``), and its gradients summed over them (the model's zeroed after)."""
    refs, start = [], 0
    for chunk in chunks:
        rows = len(chunk.num_images)
        logps, ent = _score(
            _stock_method(), model, ids[start : start + rows], mask[start : start + rows], C, chunk_kwargs(chunk), rows
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

"""Tiny offline stand-ins for the hub assets TRL's vision-language GRPO tests load (``trl-internal-testing/...``).

Each model is a random ``AutoConfig.for_model`` configuration at tiny sizes (2 text layers, hidden 32, a 2-block
vision tower), saved in fp32 with its tokenizer (the character-level tokenizer of ``tests/helpers.py`` plus the
family's image tokens), its image processor (the PIL one: torchvision is not installed here) and a small chat template
of our own. The image datasets have the columns of the hub's ``zen-image`` / ``zen-multi-image``
(``conversational_prompt_only``: ``prompt`` as a one-message conversation, ``image`` or ``images``), with random PIL
images of several sizes.

Everything is written as a Hugging Face hub cache (``<cache>/hub/models--trl-internal-testing--<name>/snapshots/...``)
so that, with ``HF_HUB_CACHE`` pointing there and ``HF_HUB_OFFLINE=1``, ``from_pretrained("trl-internal-testing/...")``
resolves to the stand-in without any patching and ``config._name_or_path`` keeps the hub id, as with the real
assets. Two things cannot be a plain cache entry, and ``trl_offline_plugin`` resolves them: processors (their video
or audio sub-processors need torchvision, so the plugin builds them image-only from ``offline_processor.json``) and
datasets (saved with ``DatasetDict.save_to_disk`` under ``<cache>/datasets``).

The models never sample a special token (``generation_config.suppress_tokens``): a hub model with a 150k vocabulary
practically never samples an image token, a 100-token one would within a few steps, and an image token in a
completion is an error of the model's own forward for every model here, stock or patched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ORG = "trl-internal-testing"
REVISION = "0" * 40  # the snapshot's (made-up) commit, named by refs/main
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}IMAGE{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A chat template of our own; ``IMAGE`` is replaced by each family's image markup."""

_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    attention_dropout=0.0,
)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
_QWEN_VISION = dict(patch_size=2, spatial_merge_size=2, temporal_patch_size=1, in_channels=3)
_QWEN_TOKENS = {
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
_QWEN_IDS = {
    "vision_start_token_id": "vision_start_token",
    "vision_end_token_id": "vision_end_token",
    "image_token_id": "image_token",
    "video_token_id": "video_token",
}
_QWEN_IMAGES = (
    "Qwen2VLImageProcessorPil",
    dict(patch_size=2, merge_size=2, temporal_patch_size=1, min_pixels=64, max_pixels=32 * 32),
)
_QWEN35_TEXT = dict(
    _TEXT,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"],
    rope_parameters=dict(_MROPE, partial_rotary_factor=1.0),
)
_QWEN3_VISION = dict(
    _QWEN_VISION,
    depth=2,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    num_position_embeddings=64,
    deepstack_visual_indexes=[],
)


@dataclass(frozen=True)
class TinyVLM:
    """One stand-in: ``model_type`` built by ``AutoConfig.for_model(model_type, **config)``, with token ids filled in
    from ``token_ids`` (config key -> special token name in ``tokens``), a processor ``processor`` (class name in
    transformers) with ``processor_kwargs``, and an image processor (class name, kwargs). ``image_markup`` replaces
    ``IMAGE`` in the chat template (the processor expands its image token to the image's feature count)."""

    model_type: str
    config: dict
    tokens: dict
    token_ids: dict
    processor: str
    image_processor: tuple
    image_markup: str
    processor_kwargs: dict = field(default_factory=dict)


MODELS = {
    "tiny-Qwen2_5_VLForConditionalGeneration": TinyVLM(
        "qwen2_5_vl",
        dict(
            text_config=dict(_TEXT, rope_parameters=_MROPE),
            vision_config=dict(
                _QWEN_VISION,
                depth=2,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=32,
                window_size=8,
                fullatt_block_indexes=[1],
            ),
        ),
        _QWEN_TOKENS,
        _QWEN_IDS,
        "Qwen2_5_VLProcessor",
        _QWEN_IMAGES,
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "tiny-Qwen2VLForConditionalGeneration": TinyVLM(
        "qwen2_vl",
        dict(
            text_config=dict(_TEXT, rope_parameters=_MROPE),
            vision_config=dict(_QWEN_VISION, depth=2, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2),
        ),
        _QWEN_TOKENS,
        _QWEN_IDS,
        "Qwen2VLProcessor",
        _QWEN_IMAGES,
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "tiny-Qwen3_5ForConditionalGeneration-NoThink": TinyVLM(
        "qwen3_5",
        dict(text_config=_QWEN35_TEXT, vision_config=_QWEN3_VISION),
        _QWEN_TOKENS,
        _QWEN_IDS,
        "Qwen3VLProcessor",
        _QWEN_IMAGES,
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "tiny-Qwen3_5MoeForConditionalGeneration-3.6": TinyVLM(
        "qwen3_5_moe",
        dict(
            text_config=dict(
                _QWEN35_TEXT,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
            ),
            vision_config=_QWEN3_VISION,
        ),
        _QWEN_TOKENS,
        _QWEN_IDS,
        "Qwen3VLProcessor",
        _QWEN_IMAGES,
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "tiny-Gemma3ForConditionalGeneration": TinyVLM(
        "gemma3",
        dict(
            text_config=dict(
                _TEXT,
                head_dim=8,
                query_pre_attn_scalar=8,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=16,
                patch_size=4,
                vision_use_head=False,
            ),
            mm_tokens_per_image=4,
        ),
        {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"},
        {"boi_token_index": "boi_token", "eoi_token_index": "eoi_token", "image_token_index": "image_token"},
        "Gemma3Processor",
        ("Gemma3ImageProcessorPil", dict(size={"height": 16, "width": 16})),
        "<start_of_image>",
        dict(image_seq_length=4),
    ),
    "tiny-Gemma4ForConditionalGeneration": TinyVLM(
        "gemma4",
        dict(
            text_config=dict(
                _TEXT,
                head_dim=8,
                global_head_dim=8,
                sliding_window=16,
                hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=128,
                layer_types=["sliding_attention", "full_attention"],
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=8,
                patch_size=4,
                pooling_kernel_size=3,
                position_embedding_size=64,
            ),
            audio_config=None,
        ),
        {
            "boi_token": "<start_of_image>",
            "image_token": "<image_soft_token>",
            "eoi_token": "<end_of_image>",
            "video_token": "<|video|>",
            "audio_token": "<audio_soft_token>",
            "boa_token": "<start_of_audio>",
            "eoa_token": "<end_of_audio>",
        },
        {
            "boi_token_id": "boi_token",
            "eoi_token_id": "eoi_token",
            "image_token_id": "image_token",
            "video_token_id": "video_token",
            "audio_token_id": "audio_token",
            "boa_token_id": "boa_token",
            "eoa_token_index": "eoa_token",
        },
        "Gemma4Processor",
        ("Gemma4ImageProcessorPil", dict(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70)),
        "<image_soft_token>",
        dict(image_seq_length=70),
    ),
    "tiny-LlavaNextForConditionalGeneration": TinyVLM(
        "llava_next",
        dict(
            text_config=dict(_TEXT, model_type="llama"),
            vision_config=dict(
                model_type="clip_vision_model",
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=16,
                patch_size=4,
                projection_dim=16,
            ),
            image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]],
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        ),
        {"image_token": "<image>"},
        {"image_token_index": "image_token"},
        "LlavaNextProcessor",
        (
            "LlavaNextImageProcessorPil",
            dict(
                size={"shortest_edge": 16},
                crop_size={"height": 16, "width": 16},
                image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]],
            ),
        ),
        "<image>",
        dict(patch_size=4, vision_feature_select_strategy="default", num_additional_image_tokens=1),
    ),
}
"""The model stand-ins, by hub name under ``trl-internal-testing/``."""


def snapshot_dir(cache: Path, repo_id: str) -> Path:
    """Where the stand-in of ``repo_id`` lives in the hub cache under ``cache``."""
    return Path(cache) / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / REVISION


def _tokenizer(spec: TinyVLM):
    """The character tokenizer of ``tests/helpers.py`` with the family's special tokens, its image token names as
    attributes (``tokenizer.image_token``, ``tokenizer.boi_token``, ... as the processors read them)."""
    from helpers import char_tokenizer
    from transformers import PreTrainedTokenizerFast

    chars = char_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=chars.backend_tokenizer,
        padding_side="left",
        extra_special_tokens=dict(spec.tokens),
        **chars.special_tokens_map,
    )
    tokenizer.chat_template = CHAT_TEMPLATE.replace("IMAGE", spec.image_markup)
    return tokenizer


def _model(spec: TinyVLM, tokenizer):
    """A random fp32 ``spec.model_type`` whose vocabulary is the tokenizer's and which never samples a special id."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    ids = {key: tokenizer.convert_tokens_to_ids(spec.tokens[name]) for key, name in spec.token_ids.items()}
    special = dict(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    )
    config = dict(spec.config, text_config=dict(spec.config["text_config"], vocab_size=len(tokenizer), **special))
    config = AutoConfig.for_model(spec.model_type, **config, **ids, **special)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).float()
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = special["eos_token_id"], special["pad_token_id"], None
    gen.suppress_tokens = sorted(set(tokenizer.all_special_ids) - {tokenizer.eos_token_id})
    return model


def build_model(cache: Path, name: str) -> Path:
    """Write the stand-in ``trl-internal-testing/<name>`` (``MODELS``) into the hub cache under ``cache``; returns its
    snapshot directory. Raises KeyError for a name ``MODELS`` does not hold."""
    import transformers

    spec = MODELS[name]
    repo_id = f"{ORG}/{name}"
    dest = snapshot_dir(cache, repo_id)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(spec)
    _model(spec, tokenizer).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    image_cls, image_kwargs = spec.image_processor
    getattr(transformers, image_cls)(**image_kwargs).save_pretrained(dest)
    recipe = {"processor_class": spec.processor, "chat_template": tokenizer.chat_template, **spec.processor_kwargs}
    (dest / "offline_processor.json").write_text(json.dumps(recipe, indent=1))
    (dest / "stand_in.txt").write_text(repr(spec))
    refs = dest.parent.parent / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(REVISION)
    return dest


def built_spec(snapshot: Path) -> str | None:
    """The ``repr`` of the ``TinyVLM`` the stand-in in ``snapshot`` was built from (None when there is none), so a
    caller can rebuild stand-ins whose recipe changed."""
    path = Path(snapshot) / "stand_in.txt"
    return path.read_text() if path.is_file() else None


_QUESTIONS = [
    "What color is the sky?",
    "What is in the image?",
    "Describe the picture.",
    "How many shapes?",
    "Is it day or night?",
    "What do you see?",
]
_SIZES = [(16, 16), (16, 32), (32, 16), (24, 24), (32, 32), (16, 24)]


def _images(rng, sizes):
    from PIL import Image

    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]


def build_datasets(cache: Path) -> Path:
    """Write ``zen-image`` and ``zen-multi-image`` (config ``conversational_prompt_only``, splits train/test) under
    ``<cache>/datasets/<name>/<config>`` with ``DatasetDict.save_to_disk``; returns ``<cache>/datasets``. Each prompt
    is one user message (a string), the images random RGB of the sizes in ``_SIZES``; multi-image rows hold 1 or 2."""
    import numpy as np
    from datasets import Dataset, DatasetDict, Features, Image, List, Value

    rng = np.random.default_rng(0)
    root = Path(cache) / "datasets"
    prompt = List({"role": Value("string"), "content": Value("string")})
    rows = [[{"role": "user", "content": q}] for q in _QUESTIONS]
    single = {
        split: Dataset.from_dict(
            {"prompt": rows[:n], "image": _images(rng, _SIZES[:n])},
            features=Features({"prompt": prompt, "image": Image()}),
        )
        for split, n in (("train", 4), ("test", 2))
    }
    DatasetDict(single).save_to_disk(root / "zen-image" / "conversational_prompt_only")
    multi = {
        split: Dataset.from_dict(
            {"prompt": rows[:n], "images": [_images(rng, _SIZES[i : i + 1 + i % 2]) for i in range(n)]},
            features=Features({"prompt": prompt, "images": List(Image())}),
        )
        for split, n in (("train", 4), ("test", 2))
    }
    DatasetDict(multi).save_to_disk(root / "zen-multi-image" / "conversational_prompt_only")
    return root


def image_only(cls: type) -> type:
    """``cls`` (a transformers processor class) without its video/audio sub-processors, so it can be built from an
    image processor and a tokenizer alone; ``cls`` itself when it has no other sub-processor. The others are given
    to ``cls.__init__`` as None and dropped before ``ProcessorMixin.__init__``, which would look their classes up."""
    from transformers import ProcessorMixin

    others = [name for name in cls.get_attributes() if name not in ("image_processor", "tokenizer")]
    if not others:
        return cls

    class _DropMissing(ProcessorMixin):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{k: v for k, v in kwargs.items() if not (k in others and v is None)})

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        missing = {name: None for name in others}
        cls.__init__(
            self, image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **missing, **kwargs
        )

    namespace = {"__init__": __init__, "__module__": __name__, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls, _DropMissing), namespace)


def load_processor(snapshot: Path, **kwargs):
    """The processor of a stand-in written by ``build_model``: its tokenizer and image processor loaded from
    ``snapshot``, put together in the class ``offline_processor.json`` names (``image_only``). ``kwargs`` (TRL passes
    ``padding_side``, ``truncation_side``, ``revision``, ...): the tokenizer takes its padding and truncation sides."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    recipe = json.loads((Path(snapshot) / "offline_processor.json").read_text())
    cls = image_only(getattr(transformers, recipe.pop("processor_class")))
    kwargs = {k: v for k, v in kwargs.items() if k in ("padding_side", "truncation_side")}
    tokenizer = AutoTokenizer.from_pretrained(snapshot, **kwargs)
    images = AutoImageProcessor.from_pretrained(snapshot)
    return cls(image_processor=images, tokenizer=tokenizer, **recipe)

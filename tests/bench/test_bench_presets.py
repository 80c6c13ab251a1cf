"""The architecture rows of the benchmark models (``grpo_mem.bench.presets.BENCH_MODELS``): each builds as its
family with the features it is there to measure, on the llama trunk's shape."""

import pytest
import torch

from grpo_mem.bench.group import build_model
from grpo_mem.bench.presets import BENCH_MODELS, bench_model_config

S, F, L = "sliding_attention", "full_attention", "linear_attention"


@pytest.mark.parametrize(
    "name, cls, layer_types",
    [
        ("gemma3", "Gemma3ForCausalLM", [S, S, S, S, S, F, S, S]),
        ("gpt-oss", "GptOssForCausalLM", [S, F] * 4),
        ("qwen3.5", "Qwen3_5ForCausalLM", [L, L, L, F] * 2),
    ],
)
def test_architecture_rows_build_with_their_family_features(name, cls, layer_types):
    model = build_model(bench_model_config(name))
    config = model.config
    assert type(model).__name__ == cls and model.training
    assert config.layer_types == layer_types
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    ) == (8, 512, 8, 2, 64, 8192)
    attn = [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]
    if name == "gemma3":
        assert config.sliding_window == 128 and config.query_pre_attn_scalar == 64 and config.tie_word_embeddings
    if name == "gpt-oss":
        assert config.sliding_window == 128 and config._attn_implementation == "eager"  # no SDPA path for sinks
        assert all(a.sinks.shape == (8,) for a in attn) and len(attn) == 8
        assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    if name == "qwen3.5":
        assert len(attn) == 2 and config._attn_implementation == "sdpa"
        assert sum(hasattr(layer, "linear_attn") for layer in model.model.layers) == 6
    assert BENCH_MODELS["llama"]["intermediate_size"] == 1408


def test_weights_are_drawn_on_the_device_asked_for():
    """``build_model(device=...)`` draws the weights where the model runs (the GPU check's bench processes drew a
    1.7B model's weights on the CPU for most of their time); the meta device stands in for CUDA here."""
    model = build_model(bench_model_config("llama"), device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    a, b = build_model(bench_model_config("llama"), seed=3), build_model(bench_model_config("llama"), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))

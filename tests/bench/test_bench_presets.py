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


def test_hybrid_rows_build_with_their_state_layers_and_are_admitted():
    """``nemotron-h``: 6 Mamba-2 mixers (state 64, chunks of 128) and 2 attention layers between 8 MLPs, on the trunk's
    hidden 512; ``kimi-linear``: 6 KDA layers to 2 latent attention layers, 4 experts top-2 after a dense first MLP.
    Both take the prompt-once path (the rows measure it)."""
    from grpo_mem.model.linear_attention import hands_off_state
    from grpo_mem.model.mamba2_state import ssd_layers
    from grpo_mem.model.support import unsupported_cause

    model = build_model(bench_model_config("nemotron-h"))
    config = model.config
    assert type(model).__name__ == "NemotronHForCausalLM" and unsupported_cause(model) is None
    kinds = [type(layer.mixer).__name__ for layer in model.model.layers]
    assert kinds == (["NemotronHMamba2Mixer", "NemotronHMLP"] * 3 + ["NemotronHAttention", "NemotronHMLP"]) * 2
    mixers = ssd_layers(model)
    assert len(mixers) == 6 and all((m.chunk_size, m.ssm_state_size, m.num_heads) == (128, 64, 16) for m in mixers)
    assert config.hidden_size == 512
    model = build_model(bench_model_config("kimi-linear"))
    config = model.config
    assert type(model).__name__ == "KimiLinearForCausalLM" and unsupported_cause(model) is None
    assert config.layer_types == [L, L, L, F] * 2 and config.hidden_size == 512
    assert sum(hands_off_state(m) for m in model.modules()) == 6
    assert (config.num_experts, config.num_experts_per_token, config.mlp_layer_types[:2]) == (4, 2, ["dense", "sparse"])

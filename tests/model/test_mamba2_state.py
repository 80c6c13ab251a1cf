"""Mamba-2 (SSD) mixers on the prompt-once path: each node's convolution and SSM state at its last real token, handed
to the rows that continue it, in the pure model (Mamba-2) and the hybrids (Nemotron-H, Bamba, Granite 4.0 hybrid,
Falcon-H1's parallel hybrid); log-probs, entropies and every parameter's gradient against TRL 1.16's own computation,
fp32."""

import pytest
import torch
import transformers
from helpers import (
    VOCAB,
    assert_close,
    make_batch,
    random_tokens,
)
from test_linear_attention import ROWS, _check, check_window, root_pass_states

import grpo_mem
from grpo_mem.model.mamba2_state import hands_off_ssd_state, install, ssd_layers
from grpo_mem.model.support import unsupported_cause

# every tiny model: SSD of 4 heads of 8 channels (hidden 16, expand 2), 2 groups of state 6, kernel 4, chunks of 4
# tokens (every prompt and node crosses chunk boundaries, at other offsets than in stock's layout)
_COMMON = {"vocab_size": VOCAB, "hidden_size": 16, "pad_token_id": 0, "eos_token_id": 3, "bos_token_id": 1}


def mamba2():
    return transformers.Mamba2ForCausalLM(
        transformers.Mamba2Config(
            **_COMMON,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=8,
            expand=2,
            state_size=6,
            n_groups=2,
            conv_kernel=4,
            chunk_size=4,
        )
    )


def nemotron_h():
    return transformers.NemotronHForCausalLM(
        transformers.NemotronHConfig(
            **_COMMON,
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=24,
            mamba_num_heads=4,
            mamba_head_dim=8,
            expand=2,
            ssm_state_size=6,
            n_groups=2,
            conv_kernel=4,
            chunk_size=4,
        )
    )


def _bamba_like(config_cls, model_cls, **extra):
    return model_cls(
        config_cls(
            **_COMMON,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=24,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_expand=2,
            mamba_d_state=6,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=4,
            **extra,
        )
    )


def bamba():
    return _bamba_like(
        transformers.BambaConfig, transformers.BambaForCausalLM, num_hidden_layers=3, attn_layer_indices=[1]
    )


def granitemoehybrid():
    return _bamba_like(
        transformers.GraniteMoeHybridConfig,
        transformers.GraniteMoeHybridForCausalLM,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def falcon_h1():
    return _bamba_like(
        transformers.FalconH1Config,
        transformers.FalconH1ForCausalLM,
        num_hidden_layers=2,
        head_dim=8,
        mamba_d_ssm=32,
    )


BUILDERS = {f.__name__: f for f in (mamba2, nemotron_h, bamba, granitemoehybrid, falcon_h1)}


def _model(arch, checkpointing=False, seed=0):
    torch.manual_seed(seed)
    model = BUILDERS[arch]().float().train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


SYSTEM, SHOTS_A, SHOTS_B = random_tokens(13, 1), random_tokens(6, 2), random_tokens(1, 3)
# a 13-token system prompt, below it nodes of 6 and 1 tokens (a single-token node takes the mixers' recurrent form,
# and is shorter than the convolution's K − 1 = 3: its continuations convolve across two node boundaries), below them
# own parts of 1 to 5 tokens
TREE = [
    SYSTEM + SHOTS_A + random_tokens(4, 20),
    SYSTEM + SHOTS_A + random_tokens(1, 21),
    SYSTEM + SHOTS_B + random_tokens(2, 22),
    SYSTEM + SHOTS_B + random_tokens(5, 23),
]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_group_sharing_matches_stock_trl(arch, checkpointing):
    """Left-padded prompts of 2 to 9 tokens (junk in the padding), 3 completions each, shuffled: every completion
    starts from its prompt's convolution and SSM states, and the prompt's gradient comes back through them."""
    model = _model(arch, checkpointing)
    assert unsupported_cause(model) is None
    ids, mask, C, _ = make_batch([5, 9, 2, 7], 3, 6, shuffle=True, junk_in_padding=True)
    _check(model, ids, mask, C, "group")


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_tree_sharing_matches_stock_trl(monkeypatch, arch, checkpointing):
    """A shared system prompt forwarded once; its states start both nodes below it (one of a single token), whose
    own states start the prompts' own parts and, through them, the completions."""
    model = _model(arch, checkpointing)
    ids, mask, C, _ = make_batch(None, 2, 5, prompts=TREE, shuffle=True, junk_in_padding=True)
    count = _check(model, ids, mask, C, "tree", monkeypatch)
    assert count.passes == [[13], [3, 6, 6], [1, 4]]


def test_segments_shorter_than_the_chunk_scan_in_a_fitted_chunk(monkeypatch):
    """Nemotron-H with a chunk of 64: stock scans every row in chunks of 64; the prompt-once passes (prompts of 2 to 9
    tokens, completions of 6) scan in chunks of 16 (the smallest power of two >= the segment, at least 16), with
    log-probs, entropies and gradients as stock's; the mixers' chunk is 64 again after the call."""
    from transformers.models.nemotron_h import modeling_nemotron_h as modeling

    from grpo_mem.model.mamba2_state import chunk_for

    assert [chunk_for(64, n) for n in (1, 6, 16, 17, 33, 64, 200)] == [16, 16, 16, 32, 64, 64, 64]
    assert chunk_for(4, 2) == 4 and chunk_for(8, 3) == 8  # chunks of at most 16 stay as they are
    torch.manual_seed(0)
    model = nemotron_h()
    model.config.chunk_size = 64
    for m in ssd_layers(model):
        m.chunk_size = 64
    chunks, scan = [], modeling.mamba2_chunk_scan
    monkeypatch.setattr(
        modeling,
        "mamba2_chunk_scan",
        lambda *a, chunk_size, **k: chunks.append(chunk_size) or scan(*a, chunk_size=chunk_size, **k),
    )
    ids, mask, C, _ = make_batch([5, 9, 2, 7], 3, 6, shuffle=True, junk_in_padding=True)
    _check(model.float().train(), ids, mask, C, "group")
    assert set(chunks) == {16, 64} and all(m.chunk_size == 64 for m in ssd_layers(model))


def test_node_states_are_the_models_own_states_at_each_rows_last_token():
    """A root pass over right-padded rows of 1 to 9 tokens records, per mixer and row, the model's own cache states
    after the row's last real token: padding neither decays the SSM state nor enters the convolution's."""
    model = _model("mamba2").eval()
    capture = root_pass_states(model, install)
    assert sorted(capture) == [0, 1]
    for b, row in enumerate(ROWS):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([row]), use_cache=True)
        cache = out.get("cache", out.get("cache_params"))  # ``cache_params`` before transformers 5.24
        for layer, (conv, recurrent) in capture.items():
            own_conv = cache.layers[layer].conv_states[0][..., -3:]  # the cache keeps the last K = 4 inputs
            assert_close(conv[b : b + 1], own_conv, 1e-6, f"conv state, layer {layer}, row {b}")
            assert_close(recurrent[b : b + 1], cache.layers[layer].recurrent_states[0], 1e-6, f"state {layer} {b}")


def test_a_projection_bias_is_refused_by_name_and_restore_unwraps_the_mixers():
    model = _model("mamba2")
    ids, mask, C, _ = make_batch([4, 6], 2, 3)
    grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    mixers = ssd_layers(model)
    assert len(mixers) == 2 and all(hands_off_ssd_state(m) and "forward" in m.__dict__ for m in mixers)
    grpo_mem.restore(model)
    assert not any("forward" in m.__dict__ or "_grpo_mem_linear_forward" in m.__dict__ for m in mixers)
    torch.manual_seed(0)
    config = transformers.Mamba2Config(**{**model.config.to_dict(), "use_bias": True})
    cause = unsupported_cause(transformers.Mamba2ForCausalLM(config))
    assert cause.startswith("Mamba2Mixer has an input projection bias: stock feeds it into the convolution"), cause


@pytest.mark.parametrize("arch", ["nemotron_h", "falcon_h1"])
def test_window_carries_states_across_micro_batches(monkeypatch, arch):
    """Micro-batches of one optimizer step share the system prompt and split groups (gradient checkpointing on): each
    node is forwarded once per window, its convolution and SSM states (and its attention K/V) read by later
    micro-batches through the store; the window's gradient equals stock TRL's summed over its micro-batches."""
    prompt_sets = [[TREE[0], TREE[2]], [TREE[0], TREE[1]], [TREE[3], TREE[1]], [TREE[2]]]
    passes = check_window(monkeypatch, _model(arch, True), prompt_sets, 4)
    assert sorted(t for p in passes for t in p) == sorted([13, 3, 6, 6, 1, 4])


class _OneInput:
    """A sequence-parallel group stand-in whose ranks hold the same micro-batch."""

    def same_inputs(self, input_ids, attention_mask):
        return True


@pytest.mark.parametrize("arch", ["mamba2", "falcon_h1"])
def test_sequence_parallelism_refuses_the_mixers_by_name(arch):
    """An SSM state runs along the sequence: a micro-batch split over a sequence-parallel group falls back, named."""
    from grpo_mem.model.causes import sp_cause
    from grpo_mem.model.sequence_parallel import SP_CAUSES

    ids, mask, _, _ = make_batch([4, 6], 2, 3)
    assert sp_cause(_OneInput(), _model(arch), False, None, ids, mask) == SP_CAUSES["linear"]


def test_grpo_training_on_nemotron_h_matches_stock(tmp_path, monkeypatch):
    """Nemotron-H (Mamba-2 mixers, attention and MLP blocks) through GRPOTrainer as users run it: generation with the
    model's own cache, 3 steps of 2 accumulated micro-batches of 2 rows (groups of 4 split over them), gradient
    checkpointing on; every step on the prompt-once path, gradients within 1e-4 and weights within 1e-5 of stock
    TRL's."""
    import helpers
    from helpers import assert_grads_close, train_recorded

    def tiny(arch, seed=0, **_):
        model = _model("nemotron_h", seed=seed)
        model.config.use_cache = True
        return model

    monkeypatch.setattr(helpers, "tiny_model", tiny)
    args = dict(
        arch="nemotron_h",
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        optim="sgd",
        learning_rate=0.5,
    )
    stock, stock_rec = train_recorded(tmp_path / "stock", "grpo", patch=False, **args)
    ours, ours_rec = train_recorded(tmp_path / "ours", "grpo", patch=True, **args)
    assert ours.state.global_step == 3
    assert [h["grpo_mem/path/stock"] for h in ours.state.log_history if "grpo_mem/path/stock" in h] == [0.0] * 3
    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_close(g_ours, g_stock, 1e-4)
    stock_params = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_params[name].detach(), 1e-5, name)

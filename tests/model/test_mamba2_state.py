"""Mamba-2 (SSD) mixers on the prompt-once path: each node's convolution and SSM state at its last real token, handed
to the rows that continue it, in the pure model (Mamba-2) and the hybrids (Nemotron-H, Bamba, Granite 4.0 hybrid,
Falcon-H1's parallel hybrid); log-probs, entropies and every parameter's gradient against TRL 1.16's own computation,
fp32."""

import warnings

import pytest
import torch
import transformers
from helpers import (
    VOCAB,
    CountPasses,
    assert_close,
    begin_window,
    grads_of,
    make_batch,
    random_tokens,
    stock_logps,
    stock_window,
    weighted_backward,
)
from test_linear_attention import assert_grads_near

import grpo_mem
from grpo_mem.model import attention_hook as attn_hook
from grpo_mem.model.linear_attention import LinearContext
from grpo_mem.model.mamba2_state import hands_off_ssd_state, install, ssd_layers
from grpo_mem.model.sharing import SharingSession
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


def _check(model, ids, mask, C, sharing, monkeypatch=None):
    """Stock TRL's numbers and ours (a one-micro-batch window; tree nodes from 2 shared tokens) agree."""
    ref, ref_e = stock_logps(model, ids, mask, C, temperature=0.7, compute_entropy=True)
    ref_g = grads_of(model, ref, ref_e)
    count = CountPasses(monkeypatch) if monkeypatch is not None else None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        session = SharingSession(sharing, min_shared_tokens=2)
        session.begin_window([ids[:, :-C]], [mask[:, :-C]])
        ours, ours_e = session.score(model, ids, mask, C, temperature=0.7, compute_entropy=True)
    assert_close(ours, ref, 1e-5, "log-probs")
    assert_close(ours_e, ref_e, 1e-5, "entropies")
    assert_grads_near(grads_of(model, ours, ours_e), ref_g, 1e-4)
    return count


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


def test_node_states_are_the_models_own_states_at_each_rows_last_token():
    """A root pass over right-padded rows of 1 to 9 tokens records, per mixer and row, the model's own cache states
    after the row's last real token: padding neither decays the SSM state nor enters the convolution's."""
    model = _model("mamba2").eval()
    rows = [random_tokens(n, 40 + n) for n in (9, 1, 5, 2)]
    S = max(map(len, rows))
    ids = torch.tensor([r + [7] * (S - len(r)) for r in rows])  # junk padding
    mask = torch.tensor([[1] * len(r) + [0] * (S - len(r)) for r in rows])
    impl = attn_hook.take_over(model)
    install(model)
    try:
        ctx = attn_hook.PromptCapture(linear=LinearContext(batch=len(rows), lengths=list(map(len, rows)), capture={}))
        with torch.no_grad():
            model.backbone(
                input_ids=ids, attention_mask=mask, use_cache=False, grpo_mem_ctx=attn_hook.context_token(ctx)
            )
    finally:
        attn_hook.give_back(model, impl)
    assert sorted(ctx.linear.capture) == [0, 1]
    for b, row in enumerate(rows):
        with torch.no_grad():
            cache = model(input_ids=torch.tensor([row]), use_cache=True).cache
        for layer, (conv, recurrent) in ctx.linear.capture.items():
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
    model = _model(arch, True)
    C = 4
    batches = [
        make_batch(None, 2, C, prompts=p, seed=i, shuffle=True, junk_in_padding=True)[:2]
        for i, p in enumerate(prompt_sets)
    ]
    ref, ref_grads = stock_window(model, batches, C)
    count = CountPasses(monkeypatch)
    session = SharingSession(min_shared_tokens=2)
    begin_window(session, batches, C)
    for (ids, mask), (r, re) in zip(batches, ref):
        logps, ent = session.score(model, ids, mask, C, compute_entropy=True)
        assert_close(logps, r, 1e-5, "log-probs")
        assert_close(ent, re, 1e-5, "entropies")
        weighted_backward(logps, ent, seed=ids.shape[1])  # the weighting of stock_window's grads_of
    ours_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    session.close_window()  # raises if a kept pass was never released
    assert sorted(t for p in count.passes for t in p) == sorted([13, 3, 6, 6, 1, 4])
    assert_grads_near(ours_grads, ref_grads, 1e-4)

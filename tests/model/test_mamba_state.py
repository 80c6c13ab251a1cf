"""Mamba-1 mixers (mamba, falcon_mamba) on the prompt-once path: each node's convolution and SSM state at its last real
token, handed to the rows that continue it; the reference mixer against transformers' own forward, and log-probs,
entropies and gradients against TRL 1.16's own computation, fp32."""

import pytest
import torch
from helpers import (
    EOS,
    VOCAB,
    CountPasses,
    assert_close,
    check_against_stock,
    check_window_against_stock,
    make_batch,
    random_tokens,
)
from transformers import (
    FalconMambaConfig,
    FalconMambaForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)

import grpo_mem
from grpo_mem.model.mamba_state import mamba_layers, mixer_ref, takes_state
from grpo_mem.model.support import unsupported_cause

ARCHS = {"mamba": (MambaConfig, MambaForCausalLM), "falcon_mamba": (FalconMambaConfig, FalconMambaForCausalLM)}


def tiny_mamba(arch="mamba", seed=0, **overrides):
    """A tiny random Mamba-1 model: 2 layers, hidden 32, intermediate 64, SSM state 8, convolution kernel 4, train
    mode; the Δ bias raised so the SSM state decays within a few tokens and the last tokens weigh as much as the
    first."""
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        expand=2,
        time_step_rank=4,
        pad_token_id=0,
        eos_token_id=EOS,
        bos_token_id=1,
        **overrides,
    )
    model = model_cls(config).float()
    with torch.no_grad():
        for mixer in mamba_layers(model):
            mixer.dt_proj.bias.add_(1.0)
    return model.train()


# ----------------------------------------------------------------------------------------------------------------------
# the reference mixer and the hand-off
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_mixer_ref_is_the_mixers_own_forward(arch):
    """From zero states, with and without a mask of left padding, ``mixer_ref`` is the mixer's own forward."""
    mixer = tiny_mamba(arch).backbone.layers[1].mixer
    x = torch.randn(3, 7, 32)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3], mask[2, :6] = 0, 0
    for m in (None, mask):
        assert_close(mixer_ref(mixer, x, m)[0], mixer(x, attention_mask=m), 1e-6, f"{arch} mask={m is not None}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_segments_continued_from_their_states_equal_one_piece(arch):
    """A sequence cut into segments of 5, 1, 2 and 4 tokens (two shorter than the convolution's K − 1 = 3), each run
    from the states the previous one ended with, gives the mixer's own output on the whole sequence (fp32, 1e-6); the
    gradients of the input and of every parameter, flowing back through the handed states, are the whole sequence's
    (1e-5 of each one's largest entry)."""
    mixer = tiny_mamba(arch).backbone.layers[0].mixer
    x, w = torch.randn(2, 12, 32), torch.randn(2, 12, 32)

    def grads(out, inp):
        mixer.zero_grad(set_to_none=True)
        (out * w).sum().backward()
        return {"x": inp.grad, **{n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}}

    whole_in = x.clone().requires_grad_()
    whole = mixer(whole_in)
    ref = grads(whole, whole_in)
    cut_in = x.clone().requires_grad_()
    outs, conv, ssm, at = [], None, None, 0
    for n in (5, 1, 2, 4):
        y, conv, ssm = mixer_ref(mixer, cut_in[:, at : at + n], None, conv, ssm)
        outs.append(y)
        at += n
    pieces = torch.cat(outs, 1)
    assert_close(pieces, whole, 1e-6, f"{arch} output")
    for name, g in grads(pieces, cut_in).items():
        assert_close(g, ref[name], 1e-5 * float(ref[name].abs().max()), f"{arch} grad {name}")


def test_mamba_models_are_supported_by_capability_and_a_bias_is_named():
    for arch in ARCHS:
        model = tiny_mamba(arch)
        assert unsupported_cause(model) is None
        assert [m.layer_idx for m in model.modules() if takes_state(m)] == [0, 1]
    biased = tiny_mamba("mamba", use_bias=True)
    assert unsupported_cause(biased) == (
        "a Mamba in_proj bias (use_bias=True): stock feeds it to the convolution at left-padding positions"
    )


def test_wrappers_are_removed_by_restore_and_a_plain_call_is_stock():
    model = tiny_mamba().eval()
    ids, mask, C, _ = make_batch([4, 6], 2, 3, junk_in_padding=True)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
        wrapped = [model.backbone, *mamba_layers(model)]
        assert all("forward" in m.__dict__ for m in wrapped)
        assert_close(model(input_ids=ids, attention_mask=mask).logits, before, 0.0, "a call without a context")
    grpo_mem.restore(model)
    assert not any("forward" in m.__dict__ or "_grpo_mem_linear_forward" in m.__dict__ for m in wrapped)


# ----------------------------------------------------------------------------------------------------------------------
# exactness against stock TRL
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_group_sharing_matches_stock_trl(arch, checkpointing):
    """Left-padded prompts of 1 to 9 tokens (junk in the padding; two shorter than K − 1), 3 completions each,
    shuffled: every completion starts from its prompt's states, and the prompt's gradient comes back through them."""
    model = tiny_mamba(arch)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids, mask, C, _ = make_batch([5, 9, 1, 2], 3, 6, shuffle=True, junk_in_padding=True)
    check_against_stock(model, ids, mask, C, "group")


SYSTEM = random_tokens(9, 1)
TREE = [SYSTEM + random_tokens(5, 10), SYSTEM + random_tokens(1, 11), SYSTEM + random_tokens(2, 12), SYSTEM]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tree_sharing_hands_a_nodes_states_to_its_children(monkeypatch, checkpointing):
    """A shared 9-token prefix forwarded once as the trie's root node; its states start the child nodes (of 5, 1 and 2
    tokens, in one pass) and the completions of the prompt that is the prefix itself."""
    model = tiny_mamba("falcon_mamba" if checkpointing else "mamba")
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids, mask, C, _ = make_batch(None, 2, 5, prompts=TREE, shuffle=True, junk_in_padding=True)
    count = CountPasses(monkeypatch)
    check_against_stock(model, ids, mask, C, "tree")
    assert count.passes == [[9], [1, 2, 5]]


def test_window_carries_states_across_micro_batches(monkeypatch):
    """Micro-batches of one optimizer step share the 9-token prefix and split groups (checkpointing on): each node is
    forwarded once per window, later micro-batches read its states through the store, and the window's gradient is
    stock TRL's summed over its micro-batches."""
    model = tiny_mamba()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    prompt_sets = [[TREE[0], TREE[2]], [TREE[0], TREE[1]], [TREE[3], TREE[1]]]
    C = 4
    batches = [
        make_batch(None, 2, C, prompts=p, seed=i, shuffle=True, junk_in_padding=True)[:2]
        for i, p in enumerate(prompt_sets)
    ]
    count = CountPasses(monkeypatch)
    check_window_against_stock(model, batches, C)
    assert sorted(t for p in count.passes for t in p) == [1, 2, 5, 9]


def test_a_block_that_drops_the_relay_or_a_cache_in_a_pass_is_an_error():
    """A block that stops handing its attention mask to its mixer would run that mixer from zero states: the backbone
    counts the mixers that got the pass's context and raises; a pass given a cache is refused."""
    model = tiny_mamba().eval()
    ids, mask, C, _ = make_batch([4, 6], 2, 3)
    block = model.backbone.layers[1]
    block.forward = lambda hidden, cache=None, attention_mask=None, **kw: type(block).forward(block, hidden)
    with pytest.raises(RuntimeError, match=r"1 of the 2 Mamba mixers of MambaModel got the pass's context"):
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    del block.forward
    with pytest.raises(ValueError, match=r"must not carry a cache"):
        model.backbone(input_ids=ids, cache=object(), grpo_mem_ctx="unused")
    grpo_mem.restore(model)


def tiny_jamba(attention: bool, seed=0):
    """A tiny random Jamba (3 layers, hidden 32, MoE of 4 experts in layer 1), train mode: every layer a Mamba layer,
    or (``attention``) the middle one an attention layer."""
    torch.manual_seed(seed)
    config = JambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2 if attention else 8,
        attn_layer_offset=1 if attention else 4,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        pad_token_id=0,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    return JambaForCausalLM(config).float().train()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_jamba_of_mamba_layers_matches_stock_trl(checkpointing):
    """Jamba whose layers are all Mamba layers (one with an MoE feed-forward): its decoder layers get the context and
    relay it to their mixers; group sharing of left-padded prompts and a trie with a child node, against stock TRL."""
    model = tiny_jamba(attention=False)
    assert unsupported_cause(model) is None
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids, mask, C, _ = make_batch([5, 9, 1, 2], 2, 4, shuffle=True, junk_in_padding=True)
    check_against_stock(model, ids, mask, C, "group")
    ids, mask, C, _ = make_batch(None, 2, 4, prompts=TREE, shuffle=True, junk_in_padding=True)
    check_against_stock(model, ids, mask, C, "tree")


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_jamba_with_attention_layers_matches_stock_trl(sharing):
    """Jamba with attention layers: its attention takes and computes no positions (no RoPE), which the rule admits
    beside handed recurrent layers; attention K/V and Mamba states in one pass, against stock TRL."""
    model = tiny_jamba(attention=True)
    assert unsupported_cause(model) is None
    prompts = TREE if sharing == "tree" else None
    ids, mask, C, _ = make_batch(prompts or [5, 9, 1, 2], 2, 4, prompts=prompts, shuffle=True, junk_in_padding=True)
    check_against_stock(model, ids, mask, C, sharing)

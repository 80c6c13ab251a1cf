"""grpo_mem.shared_prompt_logprobs against TRL 1.16's own _get_per_token_logps_and_entropies, fp32."""

import re
import warnings

import pytest
import torch
from helpers import (
    VOCAB,
    assert_close,
    assert_grads_close,
    grads_of,
    make_batch,
    stock_logps,
    tiny_model,
)

import grpo_mem
from grpo_mem.model.plan import PassSpec, WindowPlan, find_groups

CASES = {
    "mixed_prompts": dict(prompt_lens=[5, 9, 7], G=3, C=6),
    "C1": dict(prompt_lens=[4, 6], G=3, C=1),
    "G1": dict(prompt_lens=[4, 6, 3], G=1, C=5),
    "unequal_groups_shuffled": dict(prompt_lens=[6, 3, 8], G=0, C=7, group_sizes=[1, 4, 2], shuffle=True),
}


def _run_both(model, ids, mask, C, temperature, entropy=True):
    ref, ref_e = stock_logps(model, ids, mask, C, temperature=temperature, compute_entropy=entropy)
    ref_g = grads_of(model, ref, ref_e)
    ours, ours_e = grpo_mem.shared_prompt_logprobs(
        model, ids, mask, C, temperature=temperature, compute_entropy=entropy
    )
    ours_g = grads_of(model, ours, ours_e)
    return (ours, ours_e, ours_g), (ref, ref_e, ref_g)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_stock_trl(arch, checkpointing, case):
    cfg = dict(CASES[case])
    model = tiny_model(arch)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids, mask, C, _ = make_batch(cfg.pop("prompt_lens"), cfg.pop("G"), cfg.pop("C"), **cfg)
    temperature = 0.7 if case != "C1" else 1.0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        (ours, ours_e, ours_g), (ref, ref_e, ref_g) = _run_both(model, ids, mask, C, temperature)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (ids.shape[0], C)
    assert_close(ours, ref, 1e-5, "log-probs")
    assert_close(ours_e, ref_e, 1e-5, "entropies")
    assert_grads_close(ours_g, ref_g, 1e-4)


def test_peft_lora_and_disabled_adapter():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    )
    lora.train()
    ids, mask, C, _ = make_batch([6, 4], 3, 5, shuffle=True, seed=3)
    (ours, ours_e, ours_g), (ref, ref_e, ref_g) = _run_both(lora, ids, mask, C, 0.9)
    assert any("lora_" in n for n in ref_g)
    assert_close(ours, ref, 1e-5, "log-probs")
    assert_close(ours_e, ref_e, 1e-5, "entropies")
    assert_grads_close(ours_g, ref_g)
    with torch.no_grad(), lora.disable_adapter():  # TRL's PEFT reference caller
        ref, _ = stock_logps(lora, ids, mask, C, temperature=0.9)
        ours, _ = grpo_mem.shared_prompt_logprobs(lora, ids, mask, C, temperature=0.9)
    with torch.no_grad():
        enabled, _ = grpo_mem.shared_prompt_logprobs(lora, ids, mask, C, temperature=0.9)
    assert_close(ours, ref, 1e-5, "reference log-probs")
    assert (ours - enabled).abs().max() > 1e-3  # the adapter really was off


def test_no_grad_callers_chunked():
    """Old log-probs / separate reference model: no grad, eval mode, batch_size chunking as TRL does it."""
    model = tiny_model("qwen2").eval()
    ids, mask, C, _ = make_batch([5, 8, 6, 7], 4, 6, seed=5)
    with torch.no_grad():
        ref, _ = stock_logps(model, ids, mask, C, batch_size=8)
        ours = torch.cat(
            [
                grpo_mem.shared_prompt_logprobs(model, ids[s : s + 8], mask[s : s + 8], C)[0]
                for s in range(0, ids.shape[0], 8)
            ]
        )
    assert not ours.requires_grad
    assert_close(ours, ref, 1e-5, "log-probs")


def test_each_prompt_forwarded_once():
    model = tiny_model("llama")
    ids, mask, C, _ = make_batch([5, 9, 7], 4, 6, shuffle=True)
    rows = []
    handle = model.model.embed_tokens.register_forward_hook(lambda m, i, o: rows.append(tuple(i[0].shape)))
    grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    handle.remove()
    P = ids.shape[1] - C
    # one packed backbone call: the 3 unique prompts once (each right-padded to the longest), then the completions
    # without their last token
    assert rows == [(1, 3 * P + ids.shape[0] * (C - 1))]


def test_gradient_reaches_prompt_and_first_completion_token():
    model = tiny_model("llama")
    ids, mask, C, _ = make_batch([6, 4], 3, 5)
    emb = model.model.embed_tokens
    seen = {}

    def keep(module, args, out):
        out.retain_grad()
        seen[len(seen)] = out

    handle = emb.register_forward_hook(keep)
    logps, _ = grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    handle.remove()
    logps[:, 0].sum().backward()  # only completion token 1: predicted from the last prompt position
    # one packed call; its first block holds the 2 unique prompts (6 and 4 real tokens), right-padded to 6 each
    prompts = seen[0].grad[0, : 2 * 6].unflatten(0, (2, 6))
    for u, length in enumerate((6, 4)):
        assert prompts[u, length - 1].abs().sum() > 0  # the last prompt position predicts completion token 1
        assert prompts[u, : length - 1].abs().sum() > 0  # earlier prompt tokens, through attention
    for name in ("k_proj", "v_proj"):
        assert model.model.layers[0].self_attn.__getattr__(name).weight.grad.abs().sum() > 0


def test_completions_do_not_leak_and_padding_is_inert():
    model = tiny_model("qwen2").eval()
    ids, mask, C, owner = make_batch([6, 4], 3, 6, seed=7)
    with torch.no_grad():
        base, _ = grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
        changed = ids.clone()
        changed[1, -C:] = torch.randint(4, VOCAB, (C,))  # another completion of row 0's prompt
        other, _ = grpo_mem.shared_prompt_logprobs(model, changed, mask, C)
        assert torch.equal(other[0], base[0]) and torch.equal(other[2:], base[2:])
        junk_ids, junk_mask, _, _ = make_batch([6, 4], 3, 6, seed=7, junk_in_padding=True)
        assert torch.equal(junk_mask, mask) and not torch.equal(junk_ids, ids)
        junk, _ = grpo_mem.shared_prompt_logprobs(model, junk_ids, junk_mask, C)
    assert_close(junk, base, 1e-6, "log-probs with junk in padding slots")
    assert (base[mask[:, -C:] == 0] == 0).all()


def test_find_groups_ignores_padding_slots_and_order():
    ids = torch.tensor([[0, 5, 6], [9, 5, 6], [0, 5, 7], [7, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1]])
    first, inverse = find_groups(ids, mask)
    assert first.tolist() == [0, 2, 3] and inverse.tolist() == [0, 0, 1, 2]


def test_reentrant_checkpointing_falls_back_exactly():
    model = tiny_model("llama")
    model.train()
    model.gradient_checkpointing_enable({"use_reentrant": True})
    model.enable_input_require_grads()
    ids, mask, C, _ = make_batch([5, 7], 3, 4)
    with pytest.warns(UserWarning, match="reentrant"):
        (ours, _, ours_g), (ref, _, ref_g) = _run_both(model, ids, mask, C, 1.0)
    assert_close(ours, ref, 1e-5)
    assert_grads_close(ours_g, ref_g)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature must be > 0, got 0.0"),
        (dict(temperature=-1.0), "temperature must be > 0, got -1.0"),
        (dict(logits_to_keep=0), "logits_to_keep must be in"),
        (dict(logits_to_keep=12), "got 12"),
        (dict(mask_cols=11), "does not match"),
        (dict(right_pad=True), "left-padded"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    model = tiny_model("llama")
    ids, mask, C, _ = make_batch([3, 5], 2, 4)  # width 9... shapes below adapt
    ids, mask = ids[:, :12] if ids.shape[1] >= 12 else ids, mask
    C = kwargs.pop("logits_to_keep", 4)
    if kwargs.pop("mask_cols", None):
        mask = mask[:, :-1]
    if kwargs.pop("right_pad", False):
        mask = mask.clone()
        mask[0, 0], mask[0, ids.shape[1] - C - 1] = 1, 0
    if C == 12:
        C = ids.shape[1] + 3
        match = f"got {C}"
    with pytest.raises(ValueError, match=match):
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C, **kwargs)


def test_restore_gives_the_model_back():
    model = tiny_model("llama")
    impl = model.config._attn_implementation
    ids, mask, C, _ = make_batch([3, 5], 2, 4)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
        assert model.config._attn_implementation == f"grpo_mem_{impl}"
        during = model(input_ids=ids, attention_mask=mask).logits  # pass-through is exact
        grpo_mem.restore(model)
        after = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == impl and "forward" not in model.__dict__
    assert torch.equal(before, during) and torch.equal(before, after)


def _prompts(*rows, P=None):
    """(ids, mask) of prompts given as token lists, left-padded to ``P`` (default: the longest)."""
    P = P or max(len(r) for r in rows)
    ids = torch.tensor([[0] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_window_plan_forwards_each_prompt_at_its_first_use_and_releases_it_at_its_last():
    """Group mode: a is split over micro-batches 0-1, b over 1-2, c only in 2. Each prompt is one pass of its own
    release (a kept pass is backpropagated at its last use), at stock TRL's positions (its left padding)."""
    a, b, c = [5, 6, 7], [8, 9], [10, 11, 12, 13]
    mbs = [_prompts(a, a, P=4), _prompts(a, b, P=4), _prompts(b, c, P=4)]  # one width, as TRL pads a generation batch
    plan = WindowPlan.build("group", [m[0] for m in mbs], [m[1] for m in mbs])
    assert [(p.key, len(p.nodes)) for p in plan.passes] == [((0, 0, 1), 1), ((1, 0, 2), 1), ((2, 0, 2), 1)]
    assert [plan.trie.nodes[n].start for n in range(3)] == [1, 2, 0]  # each prompt's left padding
    assert [plan.shares(j) for j in range(3)] == [True, True, True]
    assert plan.tokens_at(2, 4) == 2 * 4 + 4  # completion pass + c's pass (b was forwarded in micro-batch 1)
    ended = plan.end_after(1)  # the optimizer steps early: b is released in micro-batch 1, c never forwarded
    assert [p.key for p in ended.passes] == [(0, 0, 1), (1, 0, 1)]
    aligned = ended.align({(1, 0, 1), (1, 1, 1)})  # another rank in lockstep runs a depth-1 pass there: a stand-in
    assert aligned.passes[-1] == PassSpec(1, 1, 1, ())


def test_window_plan_tree_mode_shares_a_prefix_and_counts_unshared_micro_batches():
    system = list(range(20, 90))  # 70 tokens: a node of its own at the default threshold (64)
    mbs = [_prompts(system + [1, 2], system + [1, 2], P=72), _prompts(system + [3], P=72), _prompts([4, 5], P=72)]
    plan = WindowPlan.build("tree", [m[0] for m in mbs], [m[1] for m in mbs])
    shared = plan.trie.nodes[0]
    assert len(shared.tokens) == 70 and sorted(plan.uses[0]) == [0, 1]
    assert [p.key for p in plan.passes] == [(0, 0, 1), (0, 1, 0), (1, 1, 1), (2, 0, 2)]
    assert [plan.shares(j) for j in range(3)] == [True, True, False]


def test_restore_unregisters_the_hook_once_unused(monkeypatch):
    """The hook and its mask function are registered while a model runs them and removed with the last one."""
    from transformers import AttentionInterface

    from grpo_mem.model import support
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register("test_impl", ALL_ATTENTION_FUNCTIONS["sdpa"])  # an implementation of its own
    AttentionMaskInterface.register("test_impl", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    monkeypatch.setattr(support, "SUPPORTED_ATTENTION", support.SUPPORTED_ATTENTION | {"test_impl"})
    models = [tiny_model("llama"), tiny_model("llama", seed=1)]
    ids, mask, C, _ = make_batch([5, 7], 2, 3)
    for m in models:
        m.set_attn_implementation("test_impl")
        with torch.no_grad():
            grpo_mem.shared_prompt_logprobs(m, ids, mask, C)
    assert "grpo_mem_test_impl" in ALL_ATTENTION_FUNCTIONS and "grpo_mem_test_impl" in ALL_MASK_ATTENTION_FUNCTIONS
    grpo_mem.restore(models[0])
    assert "grpo_mem_test_impl" in ALL_ATTENTION_FUNCTIONS  # still used by the other model
    grpo_mem.restore(models[1])
    assert "grpo_mem_test_impl" not in ALL_ATTENTION_FUNCTIONS
    assert "grpo_mem_test_impl" not in ALL_MASK_ATTENTION_FUNCTIONS
    assert all(m.config._attn_implementation == "test_impl" for m in models)


@pytest.mark.parametrize(
    "arch, overrides, lora, named",
    [
        ("llama", {}, 0.1, r"lora_dropout\.default: Dropout\(p=0\.1\)"),
        ("phi3", dict(resid_pdrop=0.1), 0.0, r"resid_attn_dropout: Dropout\(p=0\.1\)"),
        (
            "starcoder2",
            dict(residual_dropout=0.1),
            0.0,
            r"Starcoder2Attention\.residual_dropout = 0\.1",
        ),
        (
            "mixtral",
            dict(router_jitter_noise=0.1, num_local_experts=2, num_experts_per_tok=1),
            0.0,
            r"MixtralSparseMoeBlock\.jitter_noise = 0\.1",
        ),
    ],
    ids=["lora", "phi3", "starcoder2-functional", "mixtral-router-jitter"],
)
def test_active_dropout_is_named(arch, overrides, lora, named):
    """Dropout with p > 0 in a module in training mode is a named fallback cause: a dropout module (PEFT's
    lora_dropout, Phi-3's residual nn.Dropout) until TRL's disable_dropout_in_model sets its p to 0; a probability
    the module keeps for functional dropout (Starcoder2's residual dropout) or noise (Mixtral's router jitter) also
    after it. Not in eval mode."""
    from trl.trainer.utils import disable_dropout_in_model

    from grpo_mem.model.support import unsupported_cause

    model = tiny_model(arch, **overrides)
    if lora:
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(r=4, lora_dropout=lora, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, config).get_base_model()
    model.train()
    assert unsupported_cause(model) is not None and re.search(named, unsupported_cause(model))
    model.eval()
    assert unsupported_cause(model) is None
    model.train()
    disable_dropout_in_model(model)
    cause = unsupported_cause(model)
    assert cause is None if r"Dropout\(p=" in named else re.search(named, cause)

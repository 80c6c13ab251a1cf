"""Sliding windows, attention sinks and attention-logit softcapping on the prompt-once path, against stock TRL.

Tiny random Gemma 3 (one sliding, one global layer), Gemma 2 (window, attention softcap, final-logit softcap),
gpt-oss (window, learnable sinks, experts), Mistral (one window for every layer) and Qwen2 with
``use_sliding_window``, each with a window of 8 tokens, far shorter than the prompts: a shared system prompt longer
than the window, completions crossing the window edge, left padding with junk ids in the padding slots, gradient
checkpointing on. fp32 log-probs and entropies within 1e-5 of stock TRL 1.16, every gradient (sinks included) within
1e-4 of its scale.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_close, assert_grads_close, grads_of, make_batch, stock_logps, tiny_model, train_recorded

import grpo_mem
from grpo_mem.model.sharing import SharingSession

WINDOW = 8
MODELS = {
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "gemma2": dict(
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),  # caps that bind on these scores
    "gpt_oss": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"]),
}


def _tokens(n, seed):
    return torch.randint(5, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _tokens(66, 1)  # a trie node (>= 64 tokens), far longer than the window
PROMPTS = [SYSTEM + _tokens(5, 2), SYSTEM + _tokens(11, 3), SYSTEM + _tokens(2, 4), _tokens(9, 5)]


def _model(arch):
    model = tiny_model(arch, **MODELS[arch]).train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


@pytest.mark.parametrize("sharing", ["tree", "group"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_windowed_model_matches_stock_trl(arch, sharing):
    model = _model(arch)
    ids, mask, C, _ = make_batch(None, 3, 12, prompts=PROMPTS, shuffle=True, junk_in_padding=True)
    ref, ref_e = stock_logps(model, ids, mask, C, temperature=0.7, compute_entropy=True)
    ref_g = grads_of(model, ref, ref_e)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        ours, ours_e = grpo_mem.shared_prompt_logprobs(
            model, ids, mask, C, temperature=0.7, compute_entropy=True, sharing=sharing
        )
    ours_g = grads_of(model, ours, ours_e)
    assert_close(ours, ref, 1e-5, "log-probs")
    assert_close(ours_e, ref_e, 1e-5, "entropies")
    assert_grads_close(ours_g, ref_g, 1e-4)
    if arch == "gpt_oss":
        assert any(n.endswith("sinks") for n in ours_g)


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_window_of_micro_batches_with_split_groups(arch):
    """Two micro-batches of one optimizer step, each with part of every group: the system prompt's node is kept
    from the first to the second; log-probs per micro-batch and the summed gradient equal stock TRL's."""
    model = _model(arch)
    C = 10
    batches = [
        make_batch(None, 2, C, prompts=PROMPTS[:3], seed=s, shuffle=True, junk_in_padding=True)[:2] for s in (0, 1)
    ]
    ref, ref_grads = [], None
    for ids, mask in batches:
        logps, _ = stock_logps(model, ids, mask, C)
        g = grads_of(model, logps, None, seed=ids.shape[1])
        ref.append(logps)
        ref_grads = g if ref_grads is None else {k: v + g[k] for k, v in ref_grads.items()}
    session = SharingSession()
    session.begin_window([ids[:, :-C] for ids, _ in batches], [mask[:, :-C] for _, mask in batches])
    with session.recording() as decisions:
        for (ids, mask), r in zip(batches, ref):
            logps, _ = session.score(model, ids, mask, C)
            assert_close(logps.detach(), r, 1e-5, "log-probs")
            g = torch.Generator().manual_seed(ids.shape[1])  # the weighting grads_of uses
            (logps * torch.randn(logps.shape, generator=g)).sum().backward()
    session.close_window()
    assert [d.path for d in decisions] == ["tree"] * len(batches)
    ours_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_grads_close(ours_grads, ref_grads, 1e-4)


SYSTEM_TEXT = "You are a careful assistant. Answer briefly: "  # 1 token a character: 5x the window


@pytest.mark.parametrize("arch", ["gemma3_text", "gemma2", "gpt_oss"])
def test_patched_grpo_training_matches_stock(tmp_path, arch):
    """Three GRPO steps, gradient accumulation 2, each micro-batch half a group: weights within 1e-5 of stock (for
    gpt-oss with TRL's default router loss coefficient, so its load-balancing loss too)."""
    from helpers import PROMPTS as TEXT_PROMPTS

    args = dict(
        max_steps=3,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        num_generations=4,
        max_completion_length=12,
        optim="sgd",
        arch=arch,
        model_args=MODELS[arch],
        prompts=[SYSTEM_TEXT + p for p in TEXT_PROMPTS],
    )
    stock, _ = train_recorded(tmp_path / "stock", "grpo", patch=False, **args)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        ours, _ = train_recorded(tmp_path / "ours", "grpo", patch=True, group_shuffle=True, **args)
    assert ours.state.global_step == stock.state.global_step == 3
    logged = [h for h in ours.state.log_history if "grpo_mem/path/stock" in h]
    assert len(logged) == 3 and all(h["grpo_mem/path/stock"] == 0 and h["grpo_mem/token_ratio"] < 1 for h in logged)
    stock_params = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_params[name].detach(), 1e-5, name)


def test_bad_window_and_sinks_get_clear_errors():
    """A window of 0 (which stock's mask turns into rows with no key) is refused by name; sinks of the wrong shape,
    which fail stock TRL in the model's own attention, are refused by the attention op naming both shapes."""
    ids, mask, C, _ = make_batch(None, 2, 4, prompts=PROMPTS[:2])
    model = tiny_model("mistral", sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    model = tiny_model("gpt_oss", **MODELS["gpt_oss"])
    model.model.layers[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError):
        stock_logps(model, ids, mask, C)
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq=4,\), got \(3,\)"):
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C)


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_value_heads_narrower_than_key_heads(sharing):
    """Multi-head latent attention (DeepSeek-V3 here; Kimi Linear's too) has value heads of 16 against query/key heads
    of 24 (16 without RoPE + 8 with): the hook runs the op at the key width with zero value columns and cuts the output
    back (before this, a ValueError "v shape must equal k shape" on any such model whose tiny copy had equal widths)."""
    from helpers import VOCAB, check_against_stock
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "deepseek_v3",
        **dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2),
        **dict(num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        **dict(kv_lora_rank=16, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1),
        **dict(n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [5, 6, 7, 8, 12, 13, 14]] if sharing == "tree" else None
    ids, mask, C, _ = make_batch(prompts or [5, 9, 2, 7], 2, 4, prompts=prompts, shuffle=True, junk_in_padding=True)
    check_against_stock(model, ids, mask, C, sharing)

"""Models loaded with ``attn_implementation="flash_attention_2"``: taken over, exact, generation unchanged.

No GPU or flash-attn here, so a stand-in is registered as ``flash_attention_2`` for the duration of each test. It
behaves like transformers' flash-attention wrapper where that matters to grpo_mem: it reads
``module.config._attn_implementation`` to pick its kernel and fails for any name but its own (the wrapper passes that
name to ``lazy_import_flash_attention``), it receives the 2-D padding mask (or None) that FA2's mask interface
produces, and it computes causal attention (bottom-right aligned, as flash-attn does when queries are fewer than
keys) in torch. Before the fix, taking such a model over raised ValueError ("Could not find the currently requested
flash attention implementation at grpo_mem_flash_attention_2").
"""

import pytest
import torch
from helpers import assert_close, assert_grads_close, grads_of, make_batch, stock_logps, tiny_model
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import grpo_mem

FA2 = "flash_attention_2"


def _flash_stand_in(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    is_causal=None,
    **kwargs,
):
    impl = module.config._attn_implementation
    if impl != FA2:
        raise ValueError(f"Could not find the currently requested flash attention implementation at {impl}")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"flash attention takes a 2-D padding mask, got shape {tuple(attention_mask.shape)}")
    B, H, S, D = query.shape
    Sk = key.shape[2]
    rep = H // key.shape[1]
    k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    scores = query @ k.transpose(-1, -2) * (scaling if scaling is not None else D**-0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = torch.ones(S, Sk, dtype=torch.bool).tril(Sk - S)  # bottom-right causal
    if sliding_window is not None:  # flash-attn's window_size=(W - 1, W - 1), bottom-right aligned
        visible = visible & torch.ones(S, Sk, dtype=torch.bool).triu(Sk - S - sliding_window + 1)
    visible = visible.expand(B, 1, S, Sk)
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # rows of padding see nothing: zeros, as flash-attn leaves them
    return (probs @ v).transpose(1, 2).contiguous(), None


@pytest.fixture
def flash_stand_in():
    original = ALL_ATTENTION_FUNCTIONS[FA2]
    AttentionInterface.register(FA2, _flash_stand_in)
    try:
        yield
    finally:
        AttentionInterface.register(FA2, original)


def _fa2_model(arch="llama", **kw):
    model = tiny_model(arch, **kw)
    model.config._attn_implementation = FA2  # as from_pretrained(attn_implementation=...) leaves it
    return model


# the flash path reads a layer's window and softcap from the keywords the module passes (the hook reads the same)
FA2_MODELS = {
    "llama": {},
    "qwen2": {},
    "gemma2": dict(sliding_window=4, attn_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("arch", sorted(FA2_MODELS))
def test_flash_attention_2_model_matches_stock(flash_stand_in, arch):
    model = _fa2_model(arch, **FA2_MODELS[arch]).train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    ids, mask, C, _ = make_batch([6, 9, 4], 3, 5, seed=4, shuffle=True)
    ref, ref_e = stock_logps(model, ids, mask, C, compute_entropy=True)
    ref_g = grads_of(model, ref, ref_e)
    ours, ours_e = grpo_mem.shared_prompt_logprobs(model, ids, mask, C, compute_entropy=True)
    assert model.config._attn_implementation == "grpo_mem_" + FA2
    ours_g = grads_of(model, ours, ours_e)
    assert_close(ours, ref, 1e-5, "log-probs")
    assert_close(ours_e, ref_e, 1e-5, "entropies")
    assert_grads_close(ours_g, ref_g, 1e-4)
    grpo_mem.restore(model)
    assert model.config._attn_implementation == FA2


def test_generation_unchanged_after_take_over_and_revert(flash_stand_in):
    model = _fa2_model().eval()
    ids, mask, C, _ = make_batch([5, 8], 1, 3, seed=2)
    prompt_ids, prompt_mask = ids[:, :-C], mask[:, :-C]

    def generate():
        return model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=0
        )

    before = generate()
    with torch.no_grad():
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    during = generate()  # through the hook, which passes each call on to the flash implementation
    grpo_mem.restore(model)
    after = generate()
    assert model.config._attn_implementation == FA2
    assert torch.equal(before, during) and torch.equal(before, after)

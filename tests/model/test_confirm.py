"""Admitted means confirmed: the first scoring of a (class, architecture) is checked on a tiny copy built from its
config (``grpo_mem.model.confirm``), and a difference from the model's own forward is a named fallback.

A broken class the capability rule admits (a learned per-channel query scale applied after RoPE, behind a method
call the rule does not read) is caught by the gradient comparison; a supported model is confirmed once and cached;
``confirm=False`` turns it off; the user's parameters and random streams are untouched and no collective runs.
HunYuan v1 and Dory, which the rule admitted before, fall back by name (``test_architectures`` checks their numbers
against their own forward).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import (  # fresh_verdicts: autouse, the confirmation on and forgotten around each test
    build_tiny,
    check_architecture,
    fresh_verdicts,  # noqa: F401
    grads_of,
    make_batch,
    stock_logps,
    tiny_model,
)
from transformers import LlamaForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, eager_attention_forward

import grpo_mem
from grpo_mem.model import backbone_probe, confirm, fallback, support
from grpo_mem.model.sharing import SharingSession
from grpo_mem.patches.trl import patch_trl

ALL_ATTENTION_FUNCTIONS = modeling_llama.ALL_ATTENTION_FUNCTIONS
PROMPTS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 20], [5, 6, 7, 8, 30, 31, 32]]


class ScaledAfterRopeAttention(LlamaAttention):
    """Llama attention with a learned per-channel query scale after RoPE, valued 1 (so log-probs are unchanged) but
    with a gradient that depends on the absolute positions: the prompt-once passes' positions give it another one.
    The scale is applied by a method, which the capability rule does not read."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        query_states = self.rescale(query_states)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()), attn_weights

    def rescale(self, query):
        return query * (1 + self.scale - self.scale.detach())


class ScaledAfterRopeLlama(LlamaForCausalLM):
    """A causal LM class whose layers use ``ScaledAfterRopeAttention`` (built from any Llama config)."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn.__class__ = ScaledAfterRopeAttention
            layer.self_attn.scale = torch.nn.Parameter(torch.ones(layer.self_attn.head_dim))


# defined in transformers' Llama module as far as the rule's remote-code and registry checks can tell
for _cls in (ScaledAfterRopeAttention, ScaledAfterRopeLlama):
    _cls.__module__ = modeling_llama.__name__


def _broken(seed=0):
    torch.manual_seed(seed)
    return ScaledAfterRopeLlama(tiny_model("llama").config).train()


def _batch():
    ids, mask, C, _ = make_batch(None, 2, 4, prompts=PROMPTS, shuffle=True, junk_in_padding=True)
    return ids, mask, C


def _tree(model, ids, mask, C, confirm_first):
    """Tree-mode scores of one window whose trie has the shared prefix as a node, and the fallback causes."""
    session = SharingSession("tree", min_shared_tokens=3, confirm=confirm_first)
    session.begin_window([ids[:, :-C]], [mask[:, :-C]])
    with fallback.isolated_fallbacks() as causes:
        logps, entropy = session.score(model, ids, mask, C, compute_entropy=True)
    return logps, entropy, causes


def test_a_broken_class_the_rule_admits_is_caught_by_its_gradient():
    model = _broken()
    assert support.unsupported_cause(model) is None  # the rule does not see the scale
    ids, mask, C = _batch()
    ref, ref_e = stock_logps(model, ids, mask, C, compute_entropy=True)
    ref_g = grads_of(model, ref, ref_e)
    # unconfirmed, the prompt-once path gets the scale's gradient wrong (its log-probs are right)
    logps, entropy, causes = _tree(model, ids, mask, C, confirm_first=False)
    assert causes == []
    assert float((logps - ref).abs().max()) < 1e-5
    g = grads_of(model, logps, entropy)
    name = "model.layers.0.self_attn.scale"
    assert float((g[name] - ref_g[name]).norm() / ref_g[name].norm()) > 1e-2
    grpo_mem.restore(model)
    # confirmed first: the stock path, by name, with the model's own numbers
    logps, entropy, causes = _tree(model, ids, mask, C, confirm_first=True)
    assert len(causes) == 1 and causes[0].startswith("not confirmed: a tiny ScaledAfterRopeLlama"), causes
    assert "self_attn.scale differs by" in causes[0], causes
    assert float((logps - ref).abs().max()) < 1e-5
    g = grads_of(model, logps, entropy)
    assert all(float((g[n] - r).abs().max()) <= 1e-4 * float(r.abs().max()) + 1e-9 for n, r in ref_g.items())


def test_a_supported_model_is_confirmed_once_per_class_and_architecture(monkeypatch):
    model = tiny_model("llama")
    ids, mask, C = _batch()
    runs = []
    compare = confirm._compare
    monkeypatch.setattr(confirm, "_compare", lambda *a: runs.append(a[0]) or compare(*a))
    ref, _ = stock_logps(model, ids, mask, C)
    for _ in range(2):
        with fallback.recording_fallbacks() as causes:
            logps, _ = grpo_mem.shared_prompt_logprobs(model, ids, mask, C, sharing="group")
        assert causes == [] and float((logps - ref).abs().max()) < 1e-5
    other = tiny_model("llama", seed=1)  # other weights, same architecture: the same verdict
    grpo_mem.shared_prompt_logprobs(other, ids, mask, C)
    assert runs == ["LlamaForCausalLM"]
    ((key, verdict),) = confirm.verdicts().items()
    assert key[:3] == ("transformers.models.llama.modeling_llama.LlamaForCausalLM", "sdpa", False)
    assert verdict.cause is None and verdict.router_cause is None and verdict.cpu_s > 0
    wider = tiny_model("llama", attention_bias=True)  # another architecture: confirmed on its own
    grpo_mem.shared_prompt_logprobs(wider, ids, mask, C)
    assert runs == ["LlamaForCausalLM"] * 2 and len(confirm.verdicts()) == 2


def test_confirm_false_leaves_the_rule_alone(monkeypatch):
    model = _broken()
    ids, mask, C = _batch()
    with fallback.recording_fallbacks() as causes:
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C, confirm=False)
    assert causes == [] and confirm.verdicts() == {}
    monkeypatch.setenv(confirm.ENV, "0")  # the environment's switch, where no option is given
    with fallback.recording_fallbacks() as causes:
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    assert causes == [] and confirm.verdicts() == {}

    class Trainer:
        pass

    import trl

    with patch_trl(trl.GRPOTrainer, confirm=False) as handle:  # the option travels to the trainers' sessions
        assert handle.confirm is False and handle.session(Trainer()).confirm is False
    with patch_trl(trl.GRPOTrainer, confirm=True) as handle:
        assert handle.session(Trainer()).confirm is True
    with patch_trl(trl.GRPOTrainer) as handle:  # no option: the environment decides when the session decides
        assert handle.session(Trainer()).confirm is None


def test_the_confirmation_leaves_parameters_random_streams_and_process_groups_alone(monkeypatch):
    import torch.distributed as dist
    from transformers.integrations import deepspeed as hf_deepspeed

    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cpu_state = torch.get_rng_state()
    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "reduce_scatter",
        "new_group",
        "init_process_group",
    ):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: pytest.fail(f"collective {_n} during confirmation"))

    class Zero3:  # what a DeepSpeed ZeRO-3 run leaves in transformers: zero.Init would partition (collectives)
        def is_zero3(self):
            return True

    zero3 = Zero3()
    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", weakref.ref(zero3))
    deepspeed = pytest.importorskip("deepspeed")
    monkeypatch.setattr(deepspeed.zero, "Init", lambda *a, **k: pytest.fail("zero.Init during confirmation"))
    threads = torch.get_num_threads()
    verdict = confirm.confirmation(model)
    assert verdict.cause is None
    assert hf_deepspeed._hf_deepspeed_config_weak_ref() is zero3
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.get_num_threads() == threads
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert not model.config._attn_implementation.startswith("grpo_mem_")
    # deterministic: computed again from scratch, the same verdict (every rank reaches it alone)
    confirm.forget()
    assert confirm.confirmation(model).cause is None


def test_the_router_loss_is_confirmed_for_moe(monkeypatch):
    model = tiny_model("qwen3_moe")
    asked = []
    scores = confirm._scores
    monkeypatch.setattr(confirm, "_scores", lambda *a, **k: asked.append(k["aux"]) or scores(*a, **k))
    verdict = confirm.confirmation(model)
    assert verdict.cause is None and verdict.router_cause is None
    assert asked == [True, True, True]  # the model's own forward, tree and group, each with the router loss


def _needs(model_type):
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this transformers (Dory is new in 5.24)")


@pytest.mark.parametrize("model_type", ["hunyuan_v1_dense", "hunyuan_v1_moe", "dory"])
def test_types_admitted_wrongly_before_fall_back_by_name(model_type):
    _needs(model_type)
    shifted = "'s hidden states depend on the absolute positions (every position moved by 7"
    causes = {
        "hunyuan_v1_dense": f"not confirmed: a tiny HunYuanDenseV1ForCausalLM{shifted}",
        "hunyuan_v1_moe": f"not confirmed: a tiny HunYuanMoEV1ForCausalLM{shifted}",
        "dory": "DoryModel runs its layers several times per forward",
    }
    row = check_architecture(model_type)  # the fallback matches the model's own forward, per parameter
    assert row.status == "fallback" and row.cause.startswith(causes[model_type]), row


def test_the_shift_check_sees_a_learned_transform_after_rope():
    """``confirm.shift_cause``: a Llama's hidden states are the same with every position moved by 7 (RoPE scores
    depend on distances only); HunYuan v1's, whose query and key norms with a weight follow RoPE, are not; the
    model's training mode is restored."""
    _needs("hunyuan_v1_dense")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    assert confirm.shift_cause("LlamaForCausalLM", tiny_model("llama").train(), ids) is None
    model = build_tiny("hunyuan_v1_dense").train()
    assert confirm.shift_cause("HunYuan", model, ids) is None  # norm weights of 1: no transform yet
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=generator))
    cause = confirm.shift_cause("HunYuan", model, ids)
    assert cause is not None and "depend on the absolute positions" in cause and model.training, cause


def test_dory_head_and_hunyuan_norms_are_caught_without_the_rules(monkeypatch):
    """The confirmation's comparison is the backstop: with the rule's checks and the shift check off, it still
    refuses both, by name."""
    monkeypatch.setattr(confirm, "shift_cause", lambda cls_name, model, ids: None)
    observe = backbone_probe.layer_calls  # Dory's loop over its layers unseen: each layer's first call only
    monkeypatch.setattr(backbone_probe, "layer_calls", lambda *a: ({k: v[:1] for k, v in observe(*a)[0].items()}, None))
    for model_type in ("hunyuan_v1_dense", "dory"):
        _needs(model_type)
        model = build_tiny(model_type)
        if model_type == "dory":
            assert support.head_cause(model).startswith("the output embeddings are a DoryLMHead")
            monkeypatch.setattr(support, "head_cause", lambda causal_lm: None)
        assert support.unsupported_cause(model) is None
        cause = confirm.confirm_cause(model)
        assert cause is not None and cause.startswith(f"not confirmed: a tiny {type(model).__name__}"), cause
        assert "differs from its own forward" in cause


@pytest.mark.parametrize("kind", ["vlm", "gated_deltanet"])
def test_vision_language_text_config_and_gated_deltanet_are_confirmed(kind):
    if kind == "vlm":
        from vlm_fixtures import tiny_vlm

        model = tiny_vlm("qwen2_5_vl")
    else:
        model = tiny_model("qwen3_5", layers=3).train()  # linear, full, linear attention
    cause = support.unsupported_cause(model)
    if cause is not None:
        pytest.skip(f"the capability rule refuses {type(model).__name__} on this transformers ({cause})")
    verdict = confirm.confirmation(model)
    assert verdict.cause is None, verdict.cause

"""How a backbone runs its layers and each layer its attention, observed on stand-ins (``grpo_mem.model.
backbone_probe``), not read from source: layers run once per forward, keyword arguments handed down to the attention
interface, one interface call per layer, the features it is handed. Across the architecture sweep the observed
rule reaches every cause the source reads reached (Falcon's is now where it is: ``FalconModel`` calls its blocks
without its keyword arguments); here, forwards rewritten so that source text and behaviour disagree."""

from __future__ import annotations

import types

import torch
from helpers import check_against_stock, make_batch, tiny_model
from transformers import LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.llama import modeling_llama

from grpo_mem.model import support


def test_a_rewritten_backbone_is_judged_by_what_it_runs(monkeypatch):
    """A wrapper with the same behaviour (no ``**kwargs`` in its text) is admitted; a backbone running a layer twice,
    or calling its layers without the keyword arguments, is named."""
    model = tiny_model("llama").train()
    original = modeling_llama.LlamaModel.forward

    def wrapped(self, *args, **kw):  # the source rule counted "**kwargs" and refused this
        return original(self, *args, **kw)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", wrapped)
    assert support.unsupported_cause(model) is None

    def looped(self, *args, **kw):  # every layer twice: a prompt pass would record one K/V per layer
        original(self, *args, **kw)
        return original(self, *args, **kw)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", looped)
    assert (
        support.unsupported_cause(model)
        == "LlamaModel runs its layers several times per forward (recurrent loops over layers)"
    )
    layer_forward = modeling_llama.LlamaDecoderLayer.forward

    def dropping(self, hidden_states, *args, **kw):  # the layer calls attention without the model's kwargs
        kept = {k: v for k, v in kw.items() if k in ("attention_mask", "position_ids", "position_embeddings", "cache")}
        return layer_forward(self, hidden_states, *args, **kept)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", original)
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", dropping)
    assert (
        support.unsupported_cause(model) == "LlamaDecoderLayer does not pass its keyword arguments on to its attention"
    )


def test_attention_calling_the_interface_twice_or_without_a_feature_is_named(monkeypatch):
    model = tiny_model("llama").train()
    original = modeling_llama.LlamaAttention.forward

    def twice(self, hidden_states, position_embeddings, attention_mask, **kw):  # differential attention's shape
        original(self, hidden_states, position_embeddings, attention_mask, **kw)
        return original(self, hidden_states, position_embeddings, attention_mask, **kw)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", twice)
    cause = support.unsupported_cause(model)
    assert cause == "LlamaAttention calls the attention interface more than once per layer (differential attention)"
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", original)
    model.config.attn_logit_softcapping = 30.0  # asked of the attention, never handed the interface by Llama
    cause = support.unsupported_cause(model)
    assert (
        cause
        == "attention logit softcapping applied outside the attention interface (LlamaAttention passes no softcap=)"
    )


def _llama_attention(module, hidden_states, position_embeddings, attention_mask, interface, **kwargs):
    """Llama's attention computed through ``interface`` (what ``LlamaAttention.forward`` does without a cache)."""
    shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    q, k, v = (
        proj(hidden_states).view(shape).transpose(1, 2) for proj in (module.q_proj, module.k_proj, module.v_proj)
    )
    q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
    out, weights = interface(module, q, k, v, attention_mask, dropout=0.0, scaling=module.scaling, **kwargs)
    return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


class Delegating(modeling_llama.LlamaAttention):
    """Llama's attention reached through a subclass whose forward never names the registry."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)


class HandAttention(modeling_llama.LlamaAttention):
    """Attention computed by the modeling file's eager function whatever the config names: no interface call."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        eager = modeling_llama.eager_attention_forward
        return _llama_attention(self, hidden_states, position_embeddings, attention_mask, eager, **kwargs)


_OWN = types.ModuleType("own_registry_modeling")
_OWN.ALL_ATTENTION_FUNCTIONS = AttentionInterface()  # a modeling file's own registry (Doge's shape)


class OwnRegistry(modeling_llama.LlamaAttention):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        impl = self.config._attn_implementation
        interface = _OWN.ALL_ATTENTION_FUNCTIONS.get_interface(impl, modeling_llama.eager_attention_forward)
        return _llama_attention(self, hidden_states, position_embeddings, attention_mask, interface, **kwargs)


OwnRegistry.__module__ = _OWN.__name__


def test_which_modules_call_the_attention_interface_is_observed(monkeypatch):
    """Which modules attend through transformers' attention interface is seen in their calls, not read from their
    forward's text: a subclass delegating to Llama's forward (its text names no registry) is admitted and exact
    against stock TRL; attention computed by hand leaves its layers without attention, and one looked up in a
    modeling file's own registry is named."""
    monkeypatch.setitem(__import__("sys").modules, _OWN.__name__, _OWN)
    for cls, cause in (
        (Delegating, None),
        (HandAttention, "attention is not computed through transformers' attention interface (HandAttention)"),
        (OwnRegistry, "OwnRegistry dispatches through its own attention registry, not transformers'"),
    ):
        model = tiny_model("llama").train()
        for layer in model.model.layers:
            layer.self_attn.__class__ = cls
        assert support.unsupported_cause(model) == cause, cls.__name__
    ids, mask, C, _ = make_batch([5, 7], G=2, C=4, seed=3)
    model = tiny_model("llama").train()
    for layer in model.model.layers:
        layer.self_attn.__class__ = Delegating
    check_against_stock(model, ids, mask, C, "tree")


def test_the_probes_leave_the_model_and_the_registry_as_they_were():
    model = tiny_model("llama").train()
    names = set(ALL_ATTENTION_FUNCTIONS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    for module in model.modules():
        module.register_forward_pre_hook(lambda m, args: seen.append(type(m).__name__))
    assert support.unsupported_cause(model) is None
    assert seen == [] and set(ALL_ATTENTION_FUNCTIONS) == names
    assert all(torch.equal(before[k], v) and v.device.type == "cpu" for k, v in model.state_dict().items())
    assert isinstance(model, LlamaForCausalLM) and model.config._attn_implementation == "sdpa"


def test_a_rope_kernel_that_takes_no_meta_tensor_is_run_on_zeroed_copies(monkeypatch):
    """A RoPE function replaced by a kernel that refuses meta tensors (Liger's Triton kernel on CUDA): the layer's
    attention runs again on zeroed copies on the device of its parameters, and the model is admitted."""
    model = tiny_model("llama").train()
    rope = modeling_llama.apply_rotary_pos_emb
    devices = []

    def kernel(q, k, *args, **kwargs):
        devices.append(q.device.type)
        if q.device.type == "meta":
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton")
        return rope(q, k, *args, **kwargs)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", kernel)
    assert support.unsupported_cause(model) is None
    assert devices == ["meta", "cpu"] * 2  # each of the 2 layers: the meta run, then the copies

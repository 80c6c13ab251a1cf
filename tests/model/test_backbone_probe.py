"""How a backbone runs its layers and each layer its attention, observed on stand-ins (``grpo_mem.model.
backbone_probe``), not read from source: layers run once per forward, keyword arguments handed down to the attention
interface, one interface call per layer, the features it is handed. Across the architecture sweep the observed
rule reaches every cause the source reads reached (Falcon's is now where it is: ``FalconModel`` calls its blocks
without its keyword arguments); here, forwards rewritten so that source text and behaviour disagree."""

from __future__ import annotations

import torch
from helpers import tiny_model
from transformers import LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
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

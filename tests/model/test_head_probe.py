"""The LM head admitted by what the causal LM's forward computes (``grpo_mem.model.head_probe``), not its source.

Every head the completion head reproduces is admitted across the architecture sweep (logit scale, logits scaling,
Falcon-H1's multiplier, final soft caps); here: what the source patterns let through or could not read, and that the
probe leaves the model as it found it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import stock_logps, tiny_model
from transformers import LlamaForCausalLM

from grpo_mem.model import support


def _llama():
    return tiny_model("llama").train()


def test_a_logit_scale_left_to_the_fused_head_is_admitted():
    """A config naming ``logit_scale`` on a model whose forward does not apply it (Aya Vision before transformers
    5.25): TRL 1.16's fused head, like grpo_mem's, applies the config's scale, so the model is admitted."""
    model = _llama()
    model.config.logit_scale = 2.0
    assert support.unsupported_cause(model) is None


def test_logits_changed_after_the_head_are_refused_and_a_rewritten_forward_is_judged_by_its_numbers(monkeypatch):
    model = _llama()
    original = LlamaForCausalLM.forward

    def centred(self, *args, **kwargs):  # a transform no pattern names: logits minus their mean
        out = original(self, *args, **kwargs)
        out.logits = out.logits - out.logits.mean(-1, keepdim=True)
        return out

    monkeypatch.setattr(LlamaForCausalLM, "forward", centred)
    assert "does not make its logits as grpo_mem's head does" in support.unsupported_cause(model)

    def same(self, *args, **kwargs):  # rewritten, same numbers (a wrapper the source patterns could not read)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", same)
    assert support.unsupported_cause(model) is None


def test_a_forward_running_its_backbone_twice_or_reaching_into_it_is_named(monkeypatch):
    model = _llama()
    original = LlamaForCausalLM.forward

    def twice(self, *args, **kwargs):
        self.model(input_ids=kwargs["input_ids"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", twice)
    assert support.unsupported_cause(model) == "the causal LM's forward calls its backbone 2 times, not once"

    def reaching(self, *args, **kwargs):  # reads a module of the backbone: not lent to the probe
        self.model.embed_tokens(kwargs["input_ids"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", reaching)
    cause = support.unsupported_cause(model)
    assert cause.startswith("the causal LM's forward could not be run on a stand-in backbone"), cause
    assert "'embed_tokens'" in cause


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_leaves_the_model_untouched_and_runs_none_of_its_hooks(dtype):
    model = tiny_model("llama", dtype=dtype).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    children = dict(model.named_children())
    seen = []
    for module in (model, model.model, model.lm_head):
        module.register_forward_pre_hook(lambda m, args: seen.append(type(m).__name__))
    rng = torch.get_rng_state()
    assert support.unsupported_cause(model) is None
    assert seen == [] and dict(model.named_children()) == children
    assert torch.equal(torch.get_rng_state(), rng)  # the stand-ins come from a private generator
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ids = torch.randint(3, 100, (2, 9))
    mask = torch.ones_like(ids)
    logps, _ = stock_logps(model, ids, mask, 4)  # still the model it was
    assert torch.isfinite(logps).all()

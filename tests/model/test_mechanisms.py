"""The mechanism table (``grpo_mem.model.mechanisms``): every consumer reads its answers from the table, so a new
mechanism is one row; the context fields, keywords and recurrent kinds it declares are the ones the code uses."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from grpo_mem.model import attention_hook, causes, forward, handed, mechanisms, support
from grpo_mem.model.extension import PassExtension
from grpo_mem.ops.attention import multi_region_attention
from tests import helpers


def test_context_fields_are_declared_once_and_filled_by_their_extension():
    """The fields of the attention contexts beyond the text pass's own are each the field of one row, and the recurrent
    row's extension fills exactly its declared fields."""
    text_completion = {"regions", "key_mask", "positions", "reach", "capture"}
    extra = {f.name for f in dataclasses.fields(attention_hook.CompletionContext)} - text_completion
    declared = mechanisms.context_fields()
    assert extra == set(declared)
    capture_extra = {f.name for f in dataclasses.fields(attention_hook.PromptCapture)} - {"kv"}
    assert capture_extra <= set(declared)
    recurrent = next(m for m in mechanisms.TABLE if m.extension == "linear_attention:extension")
    ext = mechanisms.resolve(recurrent.extension)(helpers.tiny_model("qwen3_5_text", layers=3), mechanisms.CALL)
    window = type("W", (), {"table": type("T", (), {"sources": staticmethod(lambda *a: [])})()})()
    mb = type("MB", (), {"window": window})()
    assert set(ext.context(mb, [None, None], [3, 4], 0)) == set(recurrent.context)


def test_every_named_function_resolves():
    """Each row's and each recurrent kind's functions exist where the table names them; bad names are refused."""
    for m in mechanisms.TABLE:
        for target in (m.cause, m.extension, m.layout):
            if target is not None:
                assert callable(mechanisms.resolve(target)), (m.name, target)
        if m.keyword is not None:
            assert m.feature in inspect.signature(multi_region_attention).parameters, m.feature
    for kind in mechanisms.RECURRENT:
        for name in ("claims", "state_cause", "install"):
            assert callable(mechanisms.resolve(f"{kind.module}:{name}")), (kind.module, name)
    with pytest.raises(ValueError, match="'router'"):
        mechanisms.resolve("router")


def test_hook_features_follow_the_keyword_rows():
    """The hook hands ``multi_region_attention`` each keyword row's value, converted as the row says."""
    sinks = torch.zeros(4)
    got = attention_hook.layer_features({"sliding_window": 8.0, "softcap": 30, "s_aux": sinks, "other": 1})
    assert got == {"sliding_window": 8, "softcap": 30.0, "sinks": sinks}
    assert type(got["sliding_window"]) is int and type(got["softcap"]) is float
    assert attention_hook.layer_features({}) == {m.feature: None for m in mechanisms.keywords()}


class _Cached(torch.nn.Module):
    """A stand-in recurrent layer's interface (what ``linear_attention.is_candidate`` reads)."""

    def __init__(self, **attrs):
        super().__init__()
        self.layer_idx, self.conv_kernel_size = 0, 4
        for k, v in attrs.items():
            setattr(self, k, v)

    def forward(self, hidden_states, cache_params=None):
        return hidden_states


def test_recurrent_kinds_claim_in_order():
    """A candidate goes to the first kind that claims it: Mamba-2's interface, then any state-space module, then the
    rest; the kinds' causes name what they found."""
    ssd = dict(ssm_state_size=8, num_heads=2, head_dim=4, chunk_size=16)
    first = lambda m: next(k.module for k in mechanisms.RECURRENT if k.claims(m))  # noqa: E731
    assert first(_Cached(**ssd)) == "mamba2_state"
    assert first(_Cached(ssm_state_size=8)) == "mamba_state"
    assert first(_Cached()) == "linear_attention"
    assert "not one of the Mamba-1 mixers" in handed._cause(_Cached(ssm_state_size=8), None)
    assert mechanisms.has_recurrent(torch.nn.Sequential(_Cached())) and not mechanisms.has_recurrent(
        torch.nn.Linear(2, 2)
    )


class _Tag(PassExtension):
    name = "tag"

    def context(self, mb, starts, lengths, release):
        return {}


def test_a_new_mechanism_is_one_row(monkeypatch):
    """A row added to the table reaches the admission rule, the sequence-parallel causes and the pass extensions,
    present only where its test says; nothing else changes."""
    model = helpers.tiny_model("llama")
    assert support.unsupported_cause(model) is None
    row = mechanisms.Mechanism(
        "a test mechanism",
        lambda lm, call: getattr(lm.config, "test_mechanism", False),
        cause=lambda lm: "a test mechanism is not served",
        sequence_parallel="hidden",
        extension=lambda lm, call: _Tag(),
    )
    monkeypatch.setattr(mechanisms, "TABLE", (*mechanisms.TABLE, row))
    assert support.unsupported_cause(model) is None
    assert forward.pass_extensions(model, model)[0] == ()
    model.config.test_mechanism = True
    assert support.unsupported_cause(model) == "a test mechanism is not served"
    assert [type(e) for e in forward.pass_extensions(model, model)[0]] == [_Tag]
    same = type("SP", (), {"same_inputs": lambda self, *a: True})()
    ids = torch.ones(2, 3, dtype=torch.long)
    assert causes.sp_cause(same, model, False, None, ids, ids) == causes.sequence_parallel_cause("hidden")
    model.config.test_mechanism = False
    assert causes.sp_cause(same, model, False, None, ids, ids) is None
    assert causes.sp_cause(same, model, True, None, ids, ids) == causes.sequence_parallel_cause("router")

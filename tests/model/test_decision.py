"""The decision a ``SharingSession`` takes per micro-batch (``forward.Decision``): its fields and kinds for the
tree, group, unshared and fallback cases (the scores each run gives equal stock TRL's), the model's cause kept per
model state (a warm call runs none of the capability checks, a changed model is decided again), the session's
record of its decisions, and the fallback warnings' owner (``model.fallback``)."""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch
from helpers import assert_close, make_batch, stock_logps, tiny_model

from grpo_mem.model import causes, fallback
from grpo_mem.model.forward import Decision, Kind
from grpo_mem.model.sharing import UNSHARED, SharingSession

C = 4


@pytest.fixture
def model():
    return tiny_model("llama", seed=3)


def _counting(monkeypatch) -> list:
    """Count ``causes.model_cause`` calls (the capability checks a cold decision runs)."""
    calls = []
    own = causes.model_cause
    monkeypatch.setattr(causes, "model_cause", lambda *a, **k: calls.append(1) or own(*a, **k))
    return calls


@pytest.mark.parametrize("sharing", ["tree", "group"])
def test_shared_decision_fields_and_scores(model, sharing):
    """A micro-batch of repeated prompts: shared on its own (no window), the mode's path, fewer backbone tokens than
    stock's B x (P + C); run gives (log-probs, entropies, None), equal to stock TRL's."""
    ids, mask, _, _ = make_batch([5, 7], G=3, C=C, seed=1)
    ref, ref_ent = stock_logps(model, ids, mask, C, compute_entropy=True)
    session = SharingSession(sharing, min_shared_tokens=2)
    decision = session.decide(model, ids, mask, C, compute_entropy=True)
    assert (decision.kind, decision.cause, decision.micro_batch, decision.mode) == (Kind.SHARED, None, None, sharing)
    assert decision.path == sharing and decision.stock_tokens == ids.numel()
    assert 0 < decision.backbone_tokens < decision.stock_tokens
    logps, ent, aux = session.run(decision)
    assert aux is None
    assert_close(logps, ref, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    with pytest.raises(RuntimeError, match="once: it was run"):
        session.run(decision)


def test_unshared_and_fallback_decisions(model):
    """Unique prompts with a stock path: ``UNSHARED`` (the caller's stock runs); a cause of the caller's or of the
    model: ``FALLBACK`` with that cause, the model's own computation by default (equal to stock TRL's)."""
    ids, mask, _, _ = make_batch([5, 6], G=1, C=C, seed=2)
    ref, _ = stock_logps(model, ids, mask, C)
    session = SharingSession("tree")
    unshared = session.decide(model, ids, mask, C, stock_available=True)
    assert (unshared.kind, unshared.cause, unshared.path) == (Kind.UNSHARED, UNSHARED, "stock")
    assert unshared.backbone_tokens == unshared.stock_tokens == ids.numel()
    sentinel = torch.zeros(ids.shape[0], C)
    with pytest.warns(UserWarning, match="no repeated prompt"):
        fallback._warned.discard(UNSHARED)
        out = session.run(unshared, stock=lambda: (sentinel, None, None))
    assert len(out) == 3 and out[0] is sentinel and out[1:] == (None, None)
    refused = session.decide(model, ids, mask, C, cause="the caller's own")
    assert (refused.kind, refused.cause, refused.path) == (Kind.FALLBACK, "the caller's own", "stock")
    with fallback.isolated_fallbacks() as recorded:
        logps, ent, aux = session.run(refused)
    assert recorded == ["the caller's own"] and ent is None and aux is None
    assert_close(logps, ref, 1e-5, "log-probs", mask=mask[:, -C:])


def test_decision_is_a_small_frozen_value():
    """Frozen, typed (no ``Any``), nothing mutable of its own: what ran is the session's record."""
    fields = {f.name: f.type for f in dataclasses.fields(Decision)}
    assert "Any" not in " ".join(map(str, fields.values())) and not any(n.startswith("_") for n in fields)
    assert fields["kind"] == "Kind" and fields["cause"] == "str | None"
    ids, mask, _, _ = make_batch([5], G=2, C=C)
    decision = SharingSession("group").decide(tiny_model("llama"), ids, mask, C)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.cause = "edited"


def test_recording_collects_what_decide_returns(model):
    """``SharingSession.recording`` yields the decisions ``decide`` returned inside the block, in order, and stops
    collecting when the block ends."""
    batches = [make_batch([5], G=2, C=C, seed=4)[:2], make_batch([6, 7], G=1, C=C, seed=5)[:2]]
    session = SharingSession("group")
    with session.recording() as decisions:
        first = session.decide(model, *batches[0], C)
        second = session.decide(model, *batches[1], C, stock_available=True)
    session.decide(model, *batches[0], C)
    assert len(decisions) == 2 and decisions[0] is first and decisions[1] is second
    assert [d.kind for d in decisions] == [Kind.SHARED, Kind.UNSHARED]


def test_model_cause_kept_until_the_model_changes(model, monkeypatch):
    """The capability checks run once per model state: a warm call runs none of them (nor the support, confirmation,
    versions code); a dropout switched on, eval mode, a changed config are decided again, each with its cause."""
    calls = _counting(monkeypatch)
    ids, mask, _, _ = make_batch([5, 7], G=2, C=C, seed=6)
    session = SharingSession("tree", min_shared_tokens=2)
    dropout = model.model.layers[0].mlp.dropout = torch.nn.Dropout(0.0)  # off (as TRL's disable_dropout leaves it)
    model.train()
    assert session.decide(model, ids, mask, C).kind is Kind.SHARED and len(calls) == 1
    ran = set()

    def profile(frame, event, arg):
        if event == "call":
            ran.add(frame.f_globals.get("__name__", ""))

    sys.setprofile(profile)
    try:
        assert session.decide(model, ids, mask, C).kind is Kind.SHARED
    finally:
        sys.setprofile(None)
    checks = {"grpo_mem.model.support", "grpo_mem.model.confirm", "grpo_mem.versions", "grpo_mem.model.causes"}
    assert len(calls) == 1 and not ran & checks, sorted(ran & checks)
    dropout.p = 0.1  # switched on, in training mode
    decided = session.decide(model, ids, mask, C)
    assert decided.kind is Kind.FALLBACK and "dropout is active in training" in decided.cause and len(calls) == 2
    model.eval()
    assert session.decide(model, ids, mask, C).kind is Kind.SHARED and len(calls) == 3
    model.config.alibi = True
    assert session.decide(model, ids, mask, C).cause == "ALiBi position biases" and len(calls) == 4
    del model.config.alibi
    assert session.decide(model, ids, mask, C).kind is Kind.SHARED and len(calls) == 4  # the eval state, kept


def test_warnings_owner_records_and_isolates():
    """``warn_fallback`` warns once per cause and records every time; ``isolated_fallbacks`` warns nothing, reaches
    no enclosing record and leaves the process's warned causes as they were; ``restoring_warnings`` forgets what was
    first warned inside it."""
    cause = "a cause of test_decision"
    fallback._warned.discard(cause)
    with fallback.recording_fallbacks() as outer:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fallback.isolated_fallbacks() as inner:
                fallback.warn_fallback(cause)
                fallback.warn_fallback(cause)
        assert inner == [cause, cause] and outer == [] and caught == [] and cause not in fallback._warned
        with fallback.restoring_warnings(), pytest.warns(UserWarning, match=cause):
            fallback.warn_fallback(cause)
        assert cause not in fallback._warned and outer == [cause]
        with pytest.warns(UserWarning, match=cause):
            fallback.warn_fallback(cause)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallback.warn_fallback(cause)
        assert caught == [] and outer == [cause] * 3
    fallback._warned.discard(cause)

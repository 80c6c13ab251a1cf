"""Prefix-tree sharing: the trie, and log-probs/entropies/gradients against TRL 1.16's own computation, fp32."""

import warnings

import pytest
import torch
from helpers import (
    CountPasses,
    assert_close,
    assert_grads_close,
    assert_weights_close,
    begin_window,
    grads_of,
    make_batch,
    random_tokens,
    stock_logps,
    stock_window,
    tiny_model,
    train_recorded,
    weighted_backward,
)

import grpo_mem
from grpo_mem.model.sharing import SharingSession
from grpo_mem.model.plan import PromptTrie

SYSTEM = random_tokens(70, 1)
SHOTS_A, SHOTS_B = random_tokens(68, 2), random_tokens(66, 3)


def _shape(trie):
    """(tokens, start, parent, depth) per node and the leaf of each prompt."""
    return [(len(n.tokens), n.start, n.parent, n.depth) for n in trie.nodes], trie.leaf


# ----------------------------------------------------------------------------------------------------------------------
# the trie
# ----------------------------------------------------------------------------------------------------------------------


def test_trie_system_prompt_questions_and_prompt_equal_to_prefix():
    prompts = [SYSTEM + [5, 6, 7], SYSTEM + [8, 9], [10, 11, 12], SYSTEM, SYSTEM + [5, 6, 7]]
    trie = PromptTrie(prompts, min_shared_tokens=32)
    nodes, leaf = _shape(trie)
    assert nodes == [(70, 0, None, 0), (3, 70, 0, 1), (2, 70, 0, 1), (3, 0, None, 0)]
    assert leaf == [1, 2, 3, 0, 1]  # the prompt equal to the system prompt ends at the shared node
    assert trie.shared_nodes() == [0]
    assert trie.nodes[0].prompts == [0, 1, 3, 4]


def test_trie_three_levels():
    prompts = [SYSTEM + SHOTS_A + [5], SYSTEM + SHOTS_A + [6, 7], SYSTEM + SHOTS_B + [8], SYSTEM + SHOTS_B + [9, 4]]
    nodes, leaf = _shape(PromptTrie(prompts, min_shared_tokens=32))
    assert nodes == [
        (70, 0, None, 0),
        (68, 70, 0, 1),
        (1, 138, 1, 2),
        (2, 138, 1, 2),
        (66, 70, 0, 1),
        (1, 136, 4, 2),
        (2, 136, 4, 2),
    ]
    assert leaf == [2, 3, 5, 6]


def test_trie_short_common_span_stays_in_children():
    prompts = [SYSTEM[:10] + SHOTS_A + [5], SYSTEM[:10] + SHOTS_A + [6], SYSTEM[:10] + SHOTS_B + [7]]
    nodes, leaf = _shape(PromptTrie(prompts, min_shared_tokens=32))
    # the 10 tokens all share are too few for a pass of their own: the family of SHOTS_A forwards them in its node
    assert nodes == [(78, 0, None, 0), (1, 78, 0, 1), (1, 78, 0, 1), (77, 0, None, 0)]
    assert leaf == [1, 2, 3]
    nodes, _ = _shape(PromptTrie(prompts, min_shared_tokens=8))
    assert nodes[0] == (10, 0, None, 0) and nodes[1] == (68, 10, 0, 1)


def test_trie_no_common_prefix_is_one_node_per_prompt():
    prompts = [[4, 5, 6], [7, 8], [4, 9]]
    nodes, leaf = _shape(PromptTrie(prompts, min_shared_tokens=1))
    assert nodes == [(1, 0, None, 0), (2, 1, 0, 1), (1, 1, 0, 1), (2, 0, None, 0)]
    nodes, leaf = _shape(PromptTrie(prompts, min_shared_tokens=2))
    assert nodes == [(3, 0, None, 0), (2, 0, None, 0), (2, 0, None, 0)] and leaf == [0, 2, 1]


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[4, 5], []], {}, "prompt 1 is empty"),
        ([[4, 5]], {"min_shared_tokens": 0}, "min_shared_tokens must be an int >= 1, got 0"),
    ],
)
def test_trie_bad_input(prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PromptTrie(prompts, **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# exactness against stock TRL
# ----------------------------------------------------------------------------------------------------------------------


TREES = {
    # a shared 70-token system prompt, own parts of different lengths (left padding), one prompt equal to the system prompt
    "system": [SYSTEM + random_tokens(5, 10), SYSTEM + random_tokens(9, 11), SYSTEM + random_tokens(2, 12), SYSTEM],
    # system prompt -> two few-shot blocks -> questions
    "three_levels": [
        SYSTEM + SHOTS_A + random_tokens(4, 20),
        SYSTEM + SHOTS_A + random_tokens(7, 21),
        SYSTEM + SHOTS_B + random_tokens(3, 22),
        SYSTEM + SHOTS_B + random_tokens(6, 23),
    ],
    # nothing in common: one node per prompt, the group path's work
    "no_common_prefix": [random_tokens(6, 30), random_tokens(9, 31), random_tokens(4, 32)],
}
PASSES = {
    "system": [[70], [2, 5, 9]],
    "three_levels": [[70], [66, 68], [3, 4, 6, 7]],
    "no_common_prefix": [[4, 6, 9]],
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_tree_matches_stock_trl(monkeypatch, arch, checkpointing, tree):
    model = tiny_model(arch)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids, mask, C, _ = make_batch(None, 3, 6, prompts=TREES[tree], shuffle=True, junk_in_padding=True)
    ref, ref_e = stock_logps(model, ids, mask, C, temperature=0.7, compute_entropy=True)
    ref_g = grads_of(model, ref, ref_e)
    count = CountPasses(monkeypatch)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        ours, ours_e = grpo_mem.shared_prompt_logprobs(model, ids, mask, C, temperature=0.7, compute_entropy=True)
    ours_g = grads_of(model, ours, ours_e)
    assert count.passes == PASSES[tree]  # each node forwarded once, nodes of one depth in one pass
    assert_close(ours, ref, 1e-5, "log-probs")
    assert_close(ours_e, ref_e, 1e-5, "entropies")
    assert_grads_close(ours_g, ref_g, 1e-4)


def test_group_mode_forwards_each_prompt_whole(monkeypatch):
    model = tiny_model("llama")
    ids, mask, C, _ = make_batch(None, 2, 5, prompts=TREES["system"])
    count = CountPasses(monkeypatch)
    ref, _ = stock_logps(model, ids, mask, C)
    ours, _ = grpo_mem.shared_prompt_logprobs(model, ids, mask, C, sharing="group")
    assert count.passes == [[70, 72, 75, 79]]  # the trie with no shared node: one pass, every prompt whole
    assert_close(ours, ref, 1e-5, "log-probs")
    with pytest.raises(ValueError, match="sharing must be one of .* got 'trie'"):
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C, sharing="trie")


def _window(prompt_sets, G, C, seed=0):
    """One batch per micro-batch; each holds some completions of some prompts (groups split across them)."""
    return [
        make_batch(None, G, C, prompts=prompts, seed=seed + i, shuffle=True, junk_in_padding=True)[:2]
        for i, prompts in enumerate(prompt_sets)
    ]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("truncate", [False, True])
def test_window_forwards_each_node_once_and_sums_gradients(monkeypatch, checkpointing, truncate):
    """Micro-batches of one optimizer step share the system prompt and split groups: every node is forwarded once
    per window, the window's gradient equals stock TRL's summed over its micro-batches."""
    fam = TREES["three_levels"]
    prompt_sets = [[fam[0], fam[2]], [fam[0], fam[1]], [fam[3], fam[1]], [fam[2]]]
    model = tiny_model("qwen2")
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    C = 5
    batches = _window(prompt_sets, 2, C)
    scored = batches[:3] if truncate else batches  # the optimizer steps early, after the third micro-batch
    P = [ids.shape[1] - C for ids, _ in batches]
    ref, ref_grads = stock_window(model, scored, C)

    count = CountPasses(monkeypatch)
    session = SharingSession(min_shared_tokens=32)
    begin_window(session, batches, C)
    outputs = []
    for j, (ids, mask) in enumerate(scored):
        if truncate and j == 2:
            session.end_after_next()
        assert session.shares(ids[:, : P[j]], mask[:, : P[j]])
        logps, ent = session.score(model, ids, mask, C, compute_entropy=True)
        outputs.append((logps.detach(), ent.detach()))
        weighted_backward(logps, ent, seed=ids.shape[1])  # the weighting of stock_window's grads_of
    ours_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    session.close_window()  # raises if a kept pass was never released

    # system prompt and few-shot blocks once each, questions once each, all across the window
    assert sorted(t for p in count.passes for t in p) == sorted([70, 68, 66, 4, 7, 3, 6])
    for (o, oe), (r, re) in zip(outputs, ref):
        assert_close(o, r, 1e-5, "log-probs")
        assert_close(oe, re, 1e-5, "entropies")
    assert_grads_close(ours_grads, ref_grads, 1e-4)


SYSTEM_TEXT = "You are a careful assistant. Think it through first, then answer briefly: "  # 1 token a character


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_patched_training_with_a_system_prompt_matches_stock(tmp_path, monkeypatch, kind):
    """Three optimizer steps of 4 micro-batches, each holding half a group of one of the step's 2 prompts: the system
    prompt is forwarded once per step, and the weights after training equal stock TRL's."""
    from helpers import PROMPTS

    prompts = [SYSTEM_TEXT + p for p in PROMPTS]
    args = dict(
        max_steps=3,
        gradient_accumulation_steps=4,
        per_device_train_batch_size=2,
        num_generations=4,
        optim="sgd",
        beta=0.04,
        prompts=prompts,
    )
    stock, stock_rec = train_recorded(tmp_path / "stock", kind, patch=False, **args)
    count = CountPasses(monkeypatch)
    ours, ours_rec = train_recorded(tmp_path / "ours", kind, patch=True, group_shuffle=True, **args)
    assert ours.state.global_step == stock.state.global_step == 3
    # one optimizer step = one window: the system prompt once, each prompt's own part once
    assert sum(p.count(len(SYSTEM_TEXT)) for p in count.passes) == 3, count.passes
    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_close(g_ours, g_stock, 1e-4)
    assert_weights_close(ours.model, stock.model, 1e-5)


def test_decision_is_one_value_run_once():
    """A decision carries what its run needs and runs once, for the window's next micro-batch only; its kind says
    what it does: shared (the log-probs of stock), unshared (the caller's stock path; the window passes over it and
    goes on sharing) or fallback (the window stops sharing)."""
    from grpo_mem.model.sharing import UNSHARED, Kind

    model = tiny_model()
    C = 4
    shared = make_batch([5, 7], G=2, C=C, seed=3)[:2]
    unshared = make_batch([6, 8], G=1, C=C, seed=4)[:2]
    ref, _ = stock_logps(model, *shared, C)
    session = SharingSession("group")
    begin_window(session, [shared, unshared, shared], C)
    first = session.decide(model, *shared, C, compute_entropy=True)
    again = session.decide(model, *shared, C)  # decided twice: only one of them can run
    assert first == again and first.kind is Kind.SHARED and first.path == "group" and first.micro_batch == 0
    logps, ent, _ = session.run(first)
    assert_close(logps, ref, 1e-5, "log-probs", mask=shared[1][:, -C:])
    assert ent is not None and session.window.pending == 1  # the prompts are read again by micro-batch 2
    with pytest.raises(RuntimeError, match="once: it was run"):
        session.run(first)
    with pytest.raises(RuntimeError, match="window that has moved on"):
        session.run(again)
    (logps.sum() + ent.sum()).backward()
    skipped = session.decide(model, *unshared, C, stock_available=True)
    assert (skipped.kind, skipped.cause, skipped.path, skipped.micro_batch) == (Kind.UNSHARED, UNSHARED, "stock", 1)
    stock = torch.full((2, C), -1.0, requires_grad=True)
    assert session.run(skipped, stock=lambda: (stock, None, None))[0] is stock
    last = session.decide(model, *shared, C)
    assert last.kind is Kind.SHARED and last.backbone_tokens < last.stock_tokens
    assert_close(session.run(last)[0], ref, 1e-5, "log-probs", mask=shared[1][:, -C:])
    assert session.window.pending == 0 and not session.in_window
    session.close_window()


def test_run_hidden_gives_the_backbones_hidden_states():
    """``run_hidden`` runs the decision's prompt-once path up to the head: the backbone's final hidden states at the
    positions that predict the completion tokens, as a full-sequence forward gives them; the stock path is the
    caller's."""
    model = tiny_model()
    C = 4
    ids, mask = make_batch([5, 7], G=2, C=C, seed=5)[:2]
    with torch.no_grad():
        ref = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -C - 1 : -1]
    session = SharingSession("tree", min_shared_tokens=2)
    decision = session.decide(model, ids, mask, C)
    hidden = session.run_hidden(decision, stock=lambda: None)
    assert hidden.shape == ref.shape and decision.path == "tree"
    assert_close(hidden, ref, 1e-5, "hidden states", mask=mask[:, -C:, None])
    stock = session.decide(model, ids, mask, C, cause="the caller's own")
    assert session.run_hidden(stock, stock=lambda: ref) is ref and stock.kind.name == "FALLBACK"

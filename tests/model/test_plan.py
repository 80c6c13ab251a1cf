"""Unit tests of ``grpo_mem.model.plan``: the prompt trie, the pass schedule, new plans from old ones, token counts.

Every expectation is written out by hand from the trie's and the schedule's rules (module docstring of ``plan``)."""

import pytest
import torch

from grpo_mem.model.plan import PassSpec, PromptGrouping, PromptTrie, WindowPlan, completion_width

SYS = list(range(100, 108))  # 8 tokens: a shared node at min_shared_tokens <= 8


def _batch(*prompts, P=None):
    """(ids, mask) of left-padded ``prompts`` (lists of ids) to width ``P`` (default: the longest)."""
    P = P or max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _plan(mode, batches, **kwargs):
    return WindowPlan.build(mode, [b[0] for b in batches], [b[1] for b in batches], **kwargs)


def test_trie_splits_at_shared_prefixes_of_at_least_min_shared_tokens():
    """Three prompts behind an 8-token system prompt, two of them also sharing 3 more tokens, and one prompt that is
    exactly the system prompt: at threshold 3 the trie is SYS -> {[1,2,3] -> {[4], [5]}, [9]}, the 4th prompt ends at
    SYS; at threshold 4 the 3-token branch point is no node of its own: its children forward it themselves."""
    prompts = [SYS + [1, 2, 3, 4], SYS + [1, 2, 3, 5], SYS + [9], SYS]
    trie = PromptTrie(prompts, min_shared_tokens=3)
    assert [(n.tokens, n.start, n.parent, n.depth, n.prompts) for n in trie.nodes] == [
        (tuple(SYS), 0, None, 0, [0, 1, 2, 3]),
        ((1, 2, 3), 8, 0, 1, [0, 1]),
        ((4,), 11, 1, 2, [0]),
        ((5,), 11, 1, 2, [1]),
        ((9,), 8, 0, 1, [2]),
    ]
    assert trie.leaf == [2, 3, 4, 0] and trie.path(3) == [0, 1, 3] and trie.shared_nodes() == [0, 1]
    assert trie.nodes[2].end == 12
    coarse = PromptTrie(prompts, min_shared_tokens=4)
    assert [(n.tokens, n.start, n.parent) for n in coarse.nodes] == [
        (tuple(SYS), 0, None),
        ((1, 2, 3, 4), 8, 0),
        ((1, 2, 3, 5), 8, 0),
        ((9,), 8, 0),
    ]
    assert PromptTrie(prompts, min_shared_tokens=9).nodes[0].tokens == tuple(SYS + [1, 2, 3])  # SYS+A: 11 tokens
    assert PromptTrie(prompts, min_shared_tokens=12).leaf == [0, 1, 2, 3]  # no shared node: one root per prompt


def test_trie_keys_and_flat_tries_and_errors():
    """Keys decide what is shared (nodes hold the ids of the first prompt); a flat trie is one root per prompt at the
    given starts; empty prompts, bad thresholds and keys of other lengths are refused naming the value."""
    keyed = PromptTrie([[1, 2, 3], [1, 2, 4]], min_shared_tokens=1, keys=[["a", "b", "c"], ["a", "x", "d"]])
    assert [n.tokens for n in keyed.nodes] == [(1,), (2, 3), (2, 4)]
    flat = PromptTrie.flat([[5, 6], [7]], [3, 0])
    assert [(n.tokens, n.start, n.parent) for n in flat.nodes] == [((5, 6), 3, None), ((7,), 0, None)]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        PromptTrie([[1], []])
    with pytest.raises(ValueError, match="min_shared_tokens must be an int >= 1, got 0"):
        PromptTrie([[1]], min_shared_tokens=0)
    with pytest.raises(ValueError, match="keys must give one key per token"):
        PromptTrie([[1, 2]], keys=[["a"]])
    with pytest.raises(ValueError, match="one start per prompt, got 1 starts for 2 prompts"):
        PromptTrie.flat([[1], [2]], [0])


def test_grouping_ignores_padding_ids_and_groups_anywhere():
    ids = torch.tensor([[9, 1, 2], [7, 1, 2], [0, 3, 4], [5, 1, 2]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1, 1]])
    grouping = PromptGrouping.of(ids, mask)
    assert grouping.first.tolist() == [0, 2] and grouping.inverse.tolist() == [0, 0, 1, 0] and grouping.repeats
    with pytest.raises(ValueError, match="extra must hold one key per row \\(4 rows\\), got 1"):
        PromptGrouping.of(ids, mask, extra=[b""])


def test_schedule_forwards_each_node_at_its_first_use_and_releases_kept_nodes_with_their_root():
    """Tree mode, threshold 3, three micro-batches: mb0 = {SYS+A+4, SYS+A+5}, mb1 = {SYS+A+4}, mb2 = {SYS+9} (A =
    [1,2,3]). SYS is read by 0-2 (kept, released at 2); A by 0-1, kept: released with its root, at 2; leaf [4] by 0-1,
    released with its root too; [5] only by 0; [9] only by 2."""
    A = [1, 2, 3]
    batches = [_batch(SYS + A + [4], SYS + A + [5]), _batch(SYS + A + [4]), _batch(SYS + [9])]
    plan = _plan("tree", batches, min_shared_tokens=3)
    assert [sorted(u) for u in plan.uses] == [[0, 1, 2], [0, 1], [0, 1], [0], [2]]
    assert plan.passes == (
        PassSpec(0, 0, 2, (0,)),
        PassSpec(0, 1, 2, (1,)),
        PassSpec(0, 2, 0, (3,)),
        PassSpec(0, 2, 2, (2,)),
        PassSpec(2, 1, 2, (4,)),
    )
    assert [p.kept for p in plan.passes] == [True, True, False, True, False]
    assert plan.passes_at(1) == [] and plan.leaves(0) == [2, 3] and plan.leaves(2) == [4]
    assert [plan.shares(j) for j in range(3)] == [True, True, True]


def test_end_after_and_align_return_new_plans_and_leave_the_old_one_unchanged():
    A = [1, 2, 3]
    batches = [_batch(SYS + A + [4], SYS + A + [5]), _batch(SYS + A + [4]), _batch(SYS + [9])]
    plan = _plan("tree", batches, min_shared_tokens=3)
    before = plan.passes
    ended = plan.end_after(0)  # the optimizer steps after micro-batch 0: everything kept is released there
    assert ended is not plan and plan.passes == before and plan.last == 2
    assert ended.last == 0
    assert ended.passes == (
        PassSpec(0, 0, 0, (0,)),
        PassSpec(0, 1, 0, (1,)),
        PassSpec(0, 2, 0, (3,)),
        PassSpec(0, 2, 0, (2,)),
    )
    aligned = plan.align({(1, 0, 1), (0, 0, 2)})  # another rank runs a root pass in micro-batch 1: a stand-in here
    assert plan.passes == before and len(aligned.passes) == len(before) + 1
    assert aligned.passes_at(1) == [PassSpec(1, 0, 1, ())]
    with pytest.raises(AttributeError):
        plan.last = 5  # frozen


def test_token_counts_pass_tokens_reach_and_slices():
    """mb0 of the tree plan runs SYS (8), A (3), [4] and [5] (two rows of 1: one pass of width 1 each, as their
    releases differ) and 2 rows of completions; a stand-in pass counts one token."""
    A = [1, 2, 3]
    batches = [_batch(SYS + A + [4], SYS + A + [5]), _batch(SYS + A + [4]), _batch(SYS + [9])]
    plan = _plan("tree", batches, min_shared_tokens=3)
    assert plan.tokens_at(0, completion_width(5, lockstep=False, router=False)) == 8 + 3 + 1 + 1 + 2 * 4
    assert plan.tokens_at(1, 4) == 4 and plan.align({(1, 0, 1)}).tokens_at(1, 4) == 4 + 1
    assert [
        completion_width(C, lockstep=ls, router=r) for C, ls, r in [(5, 0, 0), (1, 0, 0), (1, 1, 0), (3, 0, 1)]
    ] == [
        4,
        0,
        1,
        3,
    ]
    spec = PassSpec(2, 1, 2, (4,))
    ids, mask, positions, lengths = plan.pass_tokens(spec, "cpu")
    assert ids.tolist() == [[9]] and mask.tolist() == [[True]] and positions.tolist() == [[8]] and lengths == [1]
    ids, mask, positions, lengths = plan.pass_tokens(PassSpec(0, 2, 0, (3, 4)), "cpu")  # right-padded spans
    assert lengths == [1, 1] and positions.tolist() == [[11], [8]]
    ids, mask, positions, lengths = plan.pass_tokens(PassSpec(1, 0, 1, ()), "cpu")  # a stand-in: one token
    assert (ids.tolist(), mask.tolist(), positions.tolist(), lengths) == ([[0]], [[True]], [[0]], [1])
    assert plan.reach([[0, 1], [0]], 11) == 11
    assert plan.slices(0, PassSpec(0, 2, 0, (3,))) == [(1, 11, 12)]  # row 1 of mb0 is the first through [5]
    group = _plan("group", [_batch([5, 6], [7, 8, 9])])  # group mode: a root's slice starts at 0 after its padding
    assert [n.start for n in group.trie.nodes] == [1, 0]
    assert group.slices(0, group.passes[0]) == [(0, 0, 2), (1, 0, 3)]


def test_build_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="sharing must be one of"):
        _plan("forest", [_batch([1])])
    with pytest.raises(ValueError, match="got 2 prompt tensors and 1 masks"):
        WindowPlan.build("tree", [torch.ones(1, 1, dtype=torch.long)] * 2, [torch.ones(1, 1)])
    ids, mask = _batch([1, 2])
    plan = _plan("tree", [(ids, mask)])
    with pytest.raises(ValueError, match="micro-batch 0 of the window does not hold the prompts planned"):
        plan.check_prompts(0, PromptGrouping.of(*_batch([3, 4])).keys)

"""Unit tests of ``grpo_mem.model.store``: kept passes, their release and flush, the pass table's reads, tie and touch.

Each gradient is computed by hand: a pass's state is ``real = 2·x`` for a leaf ``x``, readers weigh it by constants,
so ``x.grad`` is 2 × (the sum of every reader's weight), whichever micro-batch the reader was in."""

import types

import pytest
import torch

from grpo_mem.model.plan import PassSpec
from grpo_mem.model.store import ForwardedPass, PassTable, PromptStates, PromptStore, tie, touch


def _states(x: torch.Tensor) -> PromptStates:
    """States of one row: K/V of layer 0 and a last hidden state, all 2·x; a linear extra of layer 1."""
    real = 2 * x
    return PromptStates(kv={0: (real, real * 1)}, last_hidden=real * 1, extras={"linear": {1: (real * 1, real * 1)}})


def test_tensors_and_like_keep_one_order():
    x = torch.ones(2)
    s = PromptStates(kv={1: (x, x + 1), 0: (x + 2, x + 3)}, last_hidden=x + 9, extras={"r": {0: (x + 4,)}})
    assert [int(t[0]) for t in s.tensors()] == [3, 4, 1, 2, 5, 10]  # kv by layer, extras by name and layer, last
    copy = s.like(t * 10 for t in s.tensors())
    assert int(copy.kv[1][1][0]) == 20 and int(copy.extras["r"][0][0][0]) == 50 and int(copy.last_hidden[0]) == 100


def test_readers_before_the_release_reach_the_graph_once_at_the_release():
    """A reader in an earlier micro-batch (weight 3 on the leaves) and the release reader (weight 5) give
    x.grad = 2·(3 + 5) = 16, the pass's graph traversed once (in the release backward)."""
    x = torch.ones(3, requires_grad=True)
    store = PromptStore()
    store.keep(7, _states(x), release=2)
    leaves = store.leaves(7)
    assert not leaves.kv[0][0].grad_fn and leaves.kv[0][0].requires_grad and len(store) == 1
    (3 * leaves.kv[0][0]).sum().backward()
    assert x.grad is None and leaves.kv[0][0].grad.tolist() == [3.0] * 3
    assert store.real(7).kv[0][0].grad_fn is not None  # a pass built on it in its release window reads these
    view = store.release(7)
    assert len(store) == 0
    (5 * view.kv[0][0]).sum().backward()
    assert x.grad.tolist() == [16.0] * 3


def test_flush_sends_due_passes_into_the_anchor_and_keeps_the_others():
    """Pass 1 (release 1, read by a leaf reader with weight 3) is due at ``upto=1``: the anchor's backward gives its
    x.grad = 2·3; pass 2 (release 2) stays; an unread due pass still runs its backward, with zeros."""
    x, y, z = (torch.ones(2, requires_grad=True) for _ in range(3))
    store = PromptStore()
    store.keep(1, _states(x), release=1)
    store.keep(2, _states(y), release=2)
    store.keep(3, _states(z), release=0)
    (3 * store.leaves(1).last_hidden).sum().backward()
    anchor = torch.ones(1, requires_grad=True)
    out = store.flush_into(anchor * 1, upto=1)
    assert len(store) == 1 and store.flush_into(anchor, upto=1) is anchor  # nothing due any more
    out.sum().backward()
    assert x.grad.tolist() == [6.0, 6.0] and z.grad.tolist() == [0.0, 0.0] and y.grad is None
    assert store.discard() == 1 and len(store) == 0


def _table_with_passes():
    """A table at micro-batch 1 of a window ending at 2: pass 0 (node 0) of micro-batch 1 itself, pass 1 (node 1)
    kept until 1, pass 2 (node 2) kept until 2."""
    table = PassTable()
    xs = [torch.full((1,), float(i + 1), requires_grad=True) for i in range(3)]
    specs = [PassSpec(1, 0, 1, (0,)), PassSpec(0, 0, 1, (1,)), PassSpec(0, 0, 2, (2,))]
    for spec, x in zip(specs, xs):
        table.register(ForwardedPass(spec=spec, mask=torch.ones(1, 1, dtype=torch.bool), positions=None), _states(x))
    return table, xs


def test_table_reads_by_release():
    table, xs = _table_with_passes()
    mb = types.SimpleNamespace(index=1, last=2, views={})
    assert [table.locate(n) for n in range(3)] == [(0, 0), (1, 0), (2, 0)] and len(table.store) == 2
    own = table.read(0, 1, mb)
    assert own.kv[0][0].grad_fn is not None and own is table.passes[0].states  # a pass of this micro-batch
    released = table.read(1, 1, mb)
    assert table.read(1, 2, mb) is released and mb.views == {1: released}  # released once, one view
    assert table.read(2, 2, mb) is table.store.real(2)  # a reader released with it: the real states
    assert table.read(2, 1, mb) is table.store.leaves(2)  # anyone else: detached leaves
    cut = types.SimpleNamespace(index=1, last=1, views={})  # the window was cut after micro-batch 1
    table2, _ = _table_with_passes()
    assert table2.read(2, 1, cut).kv[0][0].grad_fn is not None  # pass 2 is released now
    table.drop_released(1, 2)
    assert list(table.passes) == [2]
    with pytest.raises(KeyError):
        table.locate(0)
    anchor = table.abandon(torch.ones(1, requires_grad=True) * 1)
    anchor.sum().backward()
    assert xs[2].grad.tolist() == [0.0] and len(table.store) == 0 and not table.passes


def test_gather_last_hidden_orders_rows_and_sources():
    table, _ = _table_with_passes()
    mb = types.SimpleNamespace(index=1, last=2, views={})
    hidden = table.gather_last_hidden([2, 0, 2], mb)  # rows read nodes 2, 0, 2: states 2·3, 2·1, 2·3
    assert hidden.flatten().tolist() == [6.0, 2.0, 6.0]
    sources = table.sources([None, 2, 0], 1, mb)
    assert [(s[1].tolist(), s[2].tolist()) for s in sources] == [([1], [0]), ([2], [0])]


def test_tie_gives_zero_gradients_and_touch_none():
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    out = tie(a * 1, [b * 1])
    out.sum().backward()
    assert a.grad.tolist() == [1.0, 1.0] and b.grad.tolist() == [0.0, 0.0, 0.0]
    c = torch.ones(2, requires_grad=True)
    visited = []
    d = c * 1
    d.register_hook(lambda g: visited.append(g))
    touch(a * 1, [d]).sum().backward()
    assert c.grad is None and visited == [None]  # its graph is visited (hooks run) with no gradient through it
    assert touch(a, []) is a and tie(a, [torch.ones(1)]) is a  # nothing that requires grad: unchanged

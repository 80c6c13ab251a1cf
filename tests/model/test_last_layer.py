"""The last decoder layer of a packed call cut to what is read (``model/last_layer.py``): each node row's last token
and the completions run it whole, the rest of the prompt only as far as its K/V; against stock TRL."""

import pytest
import torch
from helpers import check_against_stock, make_batch, random_tokens, tiny_model

from grpo_mem.model import last_layer, packed


def _cuts(monkeypatch) -> list:
    """Every ``Cut`` a packed call made, recorded as it ends."""
    cuts, end = [], last_layer.Cut.__exit__

    def record(self, *exc):
        cuts.append(self)
        return end(self, *exc)

    monkeypatch.setattr(last_layer.Cut, "__exit__", record)
    return cuts


@pytest.mark.parametrize("one_call", [True, False])
def test_only_the_tokens_read_run_the_last_layer_and_scores_equal_stock(monkeypatch, one_call):
    """A tree of a 12-token root and three children, two of one token (a last token with none of its own row's keys
    before it): the final norm sees one token per node row plus the completions, and log-probs, entropies and
    every gradient equal stock TRL's, with each layer's attention one masked call or block by block."""
    if not one_call:
        monkeypatch.setattr(packed.PackedContext, "_one_call", lambda self, *a: False)
    model = tiny_model("llama", layers=3)
    prefix = random_tokens(12, 1)
    ids, mask, C, _ = make_batch(None, 2, 4, prompts=[prefix + [5], prefix + [6], prefix + [7, 8, 9]], seed=2)
    norms, cuts = [], _cuts(monkeypatch)
    hook = model.model.norm.register_forward_hook(lambda m, i, o: norms.append(i[0].shape[1]))
    check_against_stock(model, ids, mask, C, "tree")
    hook.remove()
    assert len(cuts) == 1 and cuts[0].ran
    width = int(mask[:, -C:].sum(1).max()) - 1  # the completions' tokens that are inputs: all but the last
    assert norms[1:] == [1 + 3 + ids.shape[0] * width]  # stock's call first; ours: root, three children, completions
    assert [len(v) for v in cuts[0].lengths.values()] in ([1, 3], [4])


def test_a_hooked_or_checkpointed_last_layer_runs_whole_and_equals_stock(monkeypatch):
    """A forward hook on the last layer's MLP (the stop would skip its other half) or gradient checkpointing keeps
    the layer whole; the numbers equal stock's either way."""
    model = tiny_model("llama")
    ids, mask, C, _ = make_batch([6, 9], 3, 4, seed=4)
    last = model.model.layers[-1]
    assert last_layer._observed(last) is None
    handle = last.mlp.register_forward_hook(lambda *a: None)
    assert last_layer._observed(last) == "hooks on its modules"
    cuts = _cuts(monkeypatch)
    check_against_stock(model, ids, mask, C, "group")
    assert cuts == []
    handle.remove()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    assert last_layer._observed(last) == "gradient checkpointing"
    check_against_stock(model, ids, mask, C, "group")
    assert cuts == []


def test_per_token_arguments_are_cut_and_unknown_layouts_refused():
    """(1, T, ...) tensors along dim 1 and integer (T,) ones along dim 0, nested in tuples and dicts; a tensor with T
    elsewhere (a multimodal RoPE's (3, 1, T) positions, a float (T,)) refuses the cut."""
    T, index = 5, torch.tensor([4, 0])
    cos, ids, mask = torch.randn(1, T, 8), torch.arange(T), torch.ones(1, 1, 1, 1)
    args, kwargs = last_layer._cut_args(((cos,), {"p": (cos, cos), "c": ids, "m": mask, "s": "token"}), T, index)
    assert torch.equal(args[0], cos[:, [4, 0]]) and torch.equal(kwargs["p"][1], cos[:, [4, 0]])
    assert torch.equal(kwargs["c"], torch.tensor([4, 0])) and kwargs["m"] is mask and kwargs["s"] == "token"
    assert torch.equal(last_layer._cut_args(cos, T, slice(0, 3)), cos[:, :3])
    for unknown in (torch.zeros(3, 1, T), torch.zeros(T)):
        with pytest.raises(last_layer._Unknown):
            last_layer._cut_args({"x": unknown}, T, index)


def test_a_layer_after_the_cut_one_is_an_error(monkeypatch):
    """Were the layer taken as last not the one the model runs last, the next layer raises (never a silent wrong
    number): its per-token arguments no longer match the cut hidden states, or, where it takes none, its attention
    finds the call's context closed."""
    model = tiny_model("llama")
    ids, mask, C, _ = make_batch([6, 9], 3, 4, seed=4)
    monkeypatch.setattr(last_layer, "decoder_stack", lambda base: base.layers[:1])
    with pytest.raises(RuntimeError, match="taken as the model's last decoder layer|must match the size"):
        check_against_stock(model, ids, mask, C, "group")
    closed = packed.PackedContext(blocks=[], offsets=[], after=1)
    with pytest.raises(RuntimeError, match="layer 0 attended after layer 1"):
        closed.attend(*(torch.zeros(1, 1, 1, 4),) * 3, 0, {})

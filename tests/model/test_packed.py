"""The packed layer loop: one backbone call per release of a micro-batch's passes, attention per block or, on CPU when
it pays, as one masked call over the packed tokens; both paths against stock TRL and each other."""

import pytest
import torch
from helpers import OpNames, assert_close, assert_grads_close, grads_of, make_batch, stock_logps, tiny_model

import grpo_mem
from grpo_mem.model import last_layer, packed
from grpo_mem.model.sharing import SharingSession

FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _score(model, ids, mask, C, sharing="tree"):
    """log-probs, entropies (temperature 0.7) and their gradients through grpo_mem in one micro-batch, with the
    forward's ops counted."""
    with OpNames() as ops:
        logps, ent = grpo_mem.shared_prompt_logprobs(
            model, ids, mask, C, temperature=0.7, compute_entropy=True, sharing=sharing
        )
    return logps, ent, grads_of(model, logps, ent), ops.names


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_one_call_per_layer_and_the_blocks_agree_with_stock(monkeypatch, sharing):
    """A small text micro-batch on CPU: one backbone call; each decoder layer's attention one call of ATen's fused
    CPU kernel, as stock's (the last layer's too, cut to the node rows' last tokens and the completions reading the
    nodes' K/V: ``last_layer``); log-probs, entropies and gradients equal stock TRL's, and equal (to rounding) those of the
    per-block path, which calls the kernel once per block and region entry, and those of the uncut last layer."""
    model = tiny_model("llama")
    ids, mask, C, _ = make_batch([6, 9, 4], 3, 5, shuffle=True, seed=11)
    ref, ref_e = stock_logps(model, ids, mask, C, temperature=0.7, compute_entropy=True)
    ref_g = grads_of(model, ref, ref_e)
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    once = _score(model, ids, mask, C, sharing)
    hook.remove()
    assert len(calls) == 1 and calls[0][0] == 1  # one packed call
    with monkeypatch.context() as m:
        m.setattr(last_layer.Cut, "of", classmethod(lambda *a: None))
        whole = _score(model, ids, mask, C, sharing)
    assert once[3].count(FLASH) == whole[3].count(FLASH) == model.config.num_hidden_layers
    monkeypatch.setattr(packed.PackedContext, "_one_call", lambda self, *a: False)
    blocks = _score(model, ids, mask, C, sharing)
    assert blocks[3].count(FLASH) > 2 * model.config.num_hidden_layers
    keep = mask[:, -C:]
    for ours in (once, blocks, whole):
        assert_close(ours[0], ref, 1e-5, "log-probs", keep)
        assert_close(ours[1], ref_e, 1e-5, "entropies", keep)
        assert_grads_close(ours[2], ref_g)
    assert_close(once[0], blocks[0], 2e-6, "one call against the blocks", keep)
    assert_close(once[0], whole[0], 2e-6, "the cut last layer against the whole", keep)


def test_a_pass_kept_from_an_earlier_micro_batch_is_read_in_place():
    """A window of two micro-batches splitting a group: the second reads the prompt pass the first kept (its K/V
    read in place through a region), so its call attends block by block; each micro-batch's log-probs equal stock's
    and the window's summed gradient equals stock's."""
    model = tiny_model("qwen2")
    ids, mask, C, _ = make_batch([7, 5], 4, 4, seed=3)  # rows 0-3 prompt 0, 4-7 prompt 1
    order = torch.tensor([0, 1, 4, 2, 5, 3, 6, 7])
    ids, mask = ids[order], mask[order]
    halves = [(0, 4), (4, 8)]
    ref_g, ours_g = {}, {}
    session = SharingSession("group")
    P = ids.shape[1] - C
    session.begin_window([ids[a:b, :P] for a, b in halves], [mask[a:b, :P] for a, b in halves])
    for a, b in halves:
        ref, ref_e = stock_logps(model, ids[a:b], mask[a:b], C, compute_entropy=True)
        for n, g in grads_of(model, ref, ref_e).items():
            ref_g[n] = ref_g.get(n, 0) + g
    for a, b in halves:
        with OpNames() as ops:
            logps, ent = session.score(model, ids[a:b], mask[a:b], C, compute_entropy=True)
        ref, _ = stock_logps(model, ids[a:b], mask[a:b], C)
        assert_close(logps, ref.detach(), 1e-5, f"log-probs of rows {a}-{b}", mask[a:b, -C:])
        for n, g in grads_of(model, logps, ent).items():
            ours_g[n] = ours_g.get(n, 0) + g
        if a == 4:  # the kept prompt is read in place: one kernel call per block and region entry
            assert ops.names.count(FLASH) > model.config.num_hidden_layers
    session.close_window()
    assert_grads_close(ours_g, ref_g)

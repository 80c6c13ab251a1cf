"""Image prompts on the prompt-once path: tiny random Qwen2.5-VL, Qwen2-VL and Qwen3-VL (deepstack on) built offline,
against stock TRL 1.16.

Batches are laid out by hand as Qwen's processor lays them out (``<|vision_start|>``, one ``<|image_pad|>`` per merged
patch, ``<|vision_end|>``; ``mm_token_type_ids`` 1 on image tokens; patch rows of ``in_channels x patch_size^2``
floats per grid cell): images of different sizes in one batch, a text-only prompt mixed in, two prompts with equal
ids and different images, left padding, G completions of random lengths. The patched scoring method and TRL's own
(``GRPOTrainer._get_per_token_logps_and_entropies``, given TRL's fused head) must agree: fp32 log-probs and entropies
within 1e-5, every parameter gradient (vision tower included) within 1e-4 of its scale. The vision tower's inputs are
counted with a forward hook: each unique prompt's images are encoded once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_close, assert_grads_close, grads_of

from vlm_fixtures import IMAGE, PROMPTS, TEMPERATURE, reorder, score, stock_method, train_vlm, vlm_batch, vlm_with_head
from grpo_mem.model.sharing import Kind, SharingSession
from grpo_mem.model.fallback import recording_fallbacks
from grpo_mem.patches.trl import patched_method
from grpo_mem.patches.trl_images import chunk_images, chunk_kwargs


@pytest.fixture
def vlm():
    """The tiny Qwen2.5-VL of ``vlm_with_head`` (the other types run the parity test only, to keep the suite short)."""
    return vlm_with_head("qwen2_5_vl")


def _unique_images(extras, rows: range) -> int:
    """Images of the distinct prompts (ids and images) among ``rows``: here one per prompt index with an image."""
    G = len(extras["num_images"]) // len(PROMPTS)
    return sum(len(PROMPTS[p][1]) for p in sorted({b // G for b in rows}))


@pytest.mark.parametrize(
    "model_type, batch_size", [("qwen2_5_vl", 12), ("qwen2_5_vl", 4), ("qwen2_vl", 4), ("qwen3_vl", 4)]
)
def test_logprobs_entropies_gradients_match_stock(model_type, batch_size):
    """Whole batch in one chunk, and chunks of 4 rows (groups of 3 split over chunks): numbers and gradients as
    stock; the vision tower encodes each chunk's unique prompts' images once (stock: every row's)."""
    model, encoded = vlm_with_head(model_type)
    ids, mask, C, extras = vlm_batch(PROMPTS, G=3, C=5)
    encoded.clear()
    ref_logps, ref_ent = score(stock_method(), model, ids, mask, C, extras, batch_size)
    ref_grads = grads_of(model, ref_logps, ref_ent)
    assert sum(encoded) == sum(extras["num_images"])
    encoded.clear()
    with recording_fallbacks() as fallbacks:
        logps, ent = score(patched_method(stock_method(), sharing="group")[0], model, ids, mask, C, extras, batch_size)
    grads = grads_of(model, logps, ent)
    assert fallbacks == []
    chunks = [range(s, min(s + batch_size, ids.shape[0])) for s in range(0, ids.shape[0], batch_size)]
    assert sum(encoded) == sum(_unique_images(extras, rows) for rows in chunks)
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    assert any(name.startswith("model.visual.") for name in grads)
    if model.config.model_type == "qwen3_vl":  # deepstack features reach the loss
        assert any(".deepstack_merger_list." in name for name in grads)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_text_only_batch_on_a_served_model(vlm, sharing):
    """No image input at all: the text path (positions as the model's ``arange``), stock's numbers, no vision call."""
    model, encoded = vlm
    ids, mask, C, _ = vlm_batch([PROMPTS[2], ([30, 31], [], [32, 33, 34, 35])], G=2, C=4, seed=4)
    ref_logps, ref_ent = score(stock_method(), model, ids, mask, C, {}, 4)
    ref_grads = grads_of(model, ref_logps, ref_ent)
    encoded.clear()
    with recording_fallbacks() as fallbacks:
        method, _ = patched_method(stock_method(), sharing=sharing)
        logps, ent = score(method, model, ids, mask, C, {}, 4)
    assert fallbacks == [] and encoded == []
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    assert_grads_close(grads_of(model, logps, ent), ref_grads)


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_window_forwards_each_image_prompt_once(vlm, sharing):
    """Two micro-batches of one optimizer step, each holding part of every group: each unique prompt (ids and
    images) goes through the vision tower and the language model once in the window; gradients as stock's summed
    over the micro-batches. A tree-mode session plans image prompts in tree mode (here every prompt is a root of its
    own: no common prefix reaches the default ``min_shared_tokens``), without a warning."""
    model, encoded = vlm
    ids, mask, C, extras = vlm_batch(PROMPTS, G=2, C=4, seed=1)
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # rows 2i, 2i + 1 are prompt i's
    ids, mask = ids[order], mask[order]
    extras = reorder(extras, order)
    halves = [chunk_images(extras, s, s + 4, 8) for s in (0, 4)]
    P = ids.shape[1] - C
    ref_logps = []
    for s, half in zip((0, 4), halves):
        logps, ent = score(stock_method(), model, ids[s : s + 4], mask[s : s + 4], C, chunk_kwargs(half), 4)
        ref_logps.append(logps)
        (logps.sum() + ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    encoded.clear()
    session = SharingSession(sharing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session.begin_window([ids[:4, :P], ids[4:, :P]], [mask[:4, :P], mask[4:, :P]], images=halves)
    for s, half in zip((0, 4), halves):
        chunk_ids, chunk_mask = ids[s : s + 4], mask[s : s + 4]
        decision = session.decide(
            model, chunk_ids, chunk_mask, C, temperature=TEMPERATURE, compute_entropy=True, vision=half
        )
        assert decision.path == sharing
        logps, ent, _ = session.run(decision)
        assert_close(logps, ref_logps[s // 4], 1e-5, "log-probs", mask=chunk_mask[:, -C:])
        (logps.sum() + ent.sum()).backward()
    session.close_window()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert sum(encoded) == sum(len(p[1]) for p in PROMPTS)  # 3 images for 4 prompts of 2 rows
    assert_grads_close(grads, ref_grads)


def test_images_are_keyed_once_per_micro_batch(vlm, monkeypatch):
    """The image value a window is planned with is the one its micro-batch is decided with: a chunk sliced again from
    the same arguments (as the patched method slices each call's) reuses its row keys (no hashing in ``decide``),
    and decides as a chunk keyed afresh does; bound once, in the decision."""
    from grpo_mem.model import multimodal

    model, _ = vlm
    ids, mask, C, extras = vlm_batch(PROMPTS, G=2, C=4, seed=1)
    P, B = ids.shape[1] - C, ids.shape[0]
    planned = chunk_images(extras, 0, B, B)
    calls = []
    keys = multimodal.image_keys
    monkeypatch.setattr(multimodal, "image_keys", lambda parts: calls.append(len(parts)) or keys(parts))
    session = SharingSession("group")
    session.begin_window([ids[:, :P]], [mask[:, :P]], images=[planned])
    planned_calls = len(calls)
    again = chunk_images(extras, 0, B, B)
    assert again is not planned and planned.holds(again)
    decision = session.decide(model, ids, mask, C, vision=again)
    assert planned_calls == 2 and len(calls) == planned_calls  # token types and images, once each
    fresh = SharingSession("group").decide(model, ids, mask, C, vision=chunk_images(extras, 0, B, B))
    assert len(calls) == 2 * planned_calls
    assert (decision.path, decision.backbone_tokens, decision.stock_tokens) == (
        "group",
        fresh.backbone_tokens,
        B * ids.shape[1],
    )
    assert decision.images.inputs is planned and decision.kind is Kind.SHARED
    session.close_window()


def test_image_tokens_in_completion_are_a_named_cause(vlm):
    """An image token type in a completion (images a tool returned), image inputs given to a text model: the decision
    is the stock path, with its cause."""
    model, _ = vlm
    ids, mask, C, extras = vlm_batch(PROMPTS[:2], G=2, C=4, seed=2)
    extras["mm_token_type_ids"][0, -C] = 1
    vision = chunk_images(extras, 0, 4, 4)
    session = SharingSession("group")
    decision = session.decide(model, ids, mask, C, vision=vision, stock_available=True)
    cause = "image or video tokens in a completion (images returned by a tool)"
    assert (decision.path, decision.cause) == ("stock", cause)
    # the default stock path takes no images: refused, and the decision is still there to run with one that does
    with pytest.raises(ValueError, match="no stock path taking them"):
        session.run(decision)
    with pytest.raises(ValueError, match="run_hidden.. does not take image inputs"):
        session.run_hidden(decision, stock=lambda: None)
    sentinel = torch.zeros(4, C)
    assert session.run(decision, stock=lambda: (sentinel, None, None))[0] is sentinel
    from helpers import tiny_model

    text_model = tiny_model("qwen2", vocab_size=128)  # image inputs given to a model without a vision tower
    decision = SharingSession("group").decide(text_model, ids, mask, C, vision=vision, stock_available=True)
    assert (decision.path, decision.cause) == ("stock", "image inputs given to a text-only model")


def test_bad_image_inputs_get_clear_errors(vlm):
    """Image tokens that do not match the image features: the model's own error, as stock raises it; image counts
    that the grids or the patch rows do not hold: a ValueError naming both numbers."""
    model, _ = vlm
    ids, mask, C, extras = vlm_batch(PROMPTS[:2], G=2, C=4, seed=3)
    first_image = (ids == IMAGE).int().argmax(1)
    ids[torch.arange(ids.shape[0]), first_image] = 9  # one image token of every row becomes text
    extras["mm_token_type_ids"][torch.arange(ids.shape[0]), first_image] = 0
    method, _ = patched_method(stock_method())
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as stock_error:
        score(stock_method(), model, ids, mask, C, extras, 4)
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as our_error:
        score(method, model, ids, mask, C, extras, 4)
    assert type(our_error.value) is type(stock_error.value)
    ids, mask, C, extras = vlm_batch(PROMPTS[:2], G=2, C=4, seed=3)
    with pytest.raises(ValueError, match="num_images counts 3 images but image_grid_thw has 4 grids"):
        score(method, model, ids, mask, C, dict(extras, num_images=[1, 1, 1, 0]), 4)
    with pytest.raises(ValueError, match="image_grid_thw holds 96 patch rows but pixel_values has 95"):
        score(method, model, ids, mask, C, dict(extras, pixel_values=extras["pixel_values"][:-1]), 4)


# ----------------------------------------------------------------------------------------------------------------------
# a GRPOTrainer run: TRL's own image pipeline (processor, generation, shuffling, buffering) on a tiny Qwen2.5-VL


_STOCK_RUN: dict = {}


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_grpo_trainer_three_steps_match_stock(tmp_path, sharing):
    """3 GRPOTrainer steps (gradient accumulation 2, rows shuffled row by row so groups straddle micro-batches) on a
    tiny Qwen2.5-VL with images of three sizes: every training micro-batch takes the path of the patch's sharing mode
    (tree: the window planned from the buffered batches' image keys), and the weights, vision tower included, end
    within 1e-5 of stock's (SGD, so a gradient difference shows as lr x difference)."""
    if not _STOCK_RUN:  # one stock run serves both modes
        _STOCK_RUN["run"] = train_vlm(tmp_path / "stock", patch=False)
    stock, _, initial = _STOCK_RUN["run"]
    ours, fallbacks, _ = train_vlm(tmp_path / "ours", patch=True, sharing=sharing)
    assert fallbacks == []
    metric = f"grpo_mem/path/{sharing}"
    paths = [log[metric] for log in ours.state.log_history if metric in log]
    assert paths == [1.0, 1.0, 1.0]
    stock_weights = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_weights[name].detach(), 1e-5, name)
    moved = {name: float((p.detach() - initial[name]).abs().max()) for name, p in stock_weights.items()}
    assert max(v for n, v in moved.items() if n.startswith("model.visual.")) > 1e-4  # the vision tower trained

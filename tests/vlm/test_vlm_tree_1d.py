"""Tree sharing of image prompts on models with 1D positions and one image entry per image (LLaVA, LLaVA-NeXT with
``image_sizes``, Mistral 3), against TRL 1.16's own method on the tiny offline models of ``test_vlm_models``.

The images are located as the runs of the model's image token id (``VisionInputs.located``), one per image; a trie
node's pass hands the model's forward the entries of the images whose first token it holds, at the pass's own
positions. Every prompt starts with the same 8-token system prompt; after it: image A then text (twice, with two
endings: they share the A node), text then image B, text only, and two images A, C / A, D (the rows part between the
images). fp32 log-probs and entropies within 1e-5 of stock's, every gradient (vision tower included) within 1e-4 of
its scale; the vision tower's inputs are counted (each image once per unique prefix holding it). Two images without a
separator make one run for two images: group sharing, warned once.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, assert_grads_close
from vlm_fixtures import (
    BOI,
    EOI,
    FAMILIES,
    IMAGE,
    MIN_SHARED,
    C,
    G,
    family_batch,
    patched_with,
    score,
    stock_and_shared,
    stock_method,
    stock_window,
    tree_window,
    vlm_with_head,
    without_key_biases,
)

from grpo_mem.model import multimodal
from grpo_mem.model.multimodal import TREE_TO_GROUP
from grpo_mem.model.sharing import SharingSession
from grpo_mem.patches.trl import METRIC_PREFIX
from grpo_mem.patches.trl_images import chunk_images

SYSTEM = [40, 41, 42, 43, 44, 45, 46, 47]
SIZE = (8, 8)
PROMPTS = [
    (SYSTEM, [SIZE], [8, 9]),
    (SYSTEM + [15], [SIZE], [10, 11, 12]),
    (SYSTEM, [SIZE], [13, 14]),
    (SYSTEM + [20, 21, 22], [], []),
    (SYSTEM, [SIZE, SIZE], [9]),
    (SYSTEM, [SIZE, SIZE], [9]),
]
SAME_AS_A = [(2, 0), (4, 0), (5, 0)]  # (prompt, image): image A (prompt 0's first image)
UNIQUE_IMAGE_PREFIXES = 4  # A once (prompts 0, 2, 4, 5 share its node), B, C, D once; stock: every row's 7 G


def tree_batch(model_type: str, prompts=PROMPTS, same=SAME_AS_A):
    """``vlm_fixtures.family_batch`` of ``prompts``, each image ``same`` made equal to prompt 0's first image."""
    ids, mask, extras = family_batch(model_type, prompts, seed=4)
    entries, i = {}, 0
    for p, (_, sizes, _) in enumerate(prompts):
        for _ in range(G):
            for k in range(len(sizes)):
                entries.setdefault((p, k), []).append(i)
                i += 1
    pixels = extras["pixel_values"].clone()
    for target in same:
        pixels[entries[target]] = pixels[entries[(0, 0)][0]].clone()
    return ids, mask, dict(extras, pixel_values=pixels)


def _tree_tokens(image_tokens: int, rows: int) -> int:
    """The backbone tokens of ``PROMPTS`` in one micro-batch: per trie depth, its nodes x its widest node, and the
    completion pass (rows x (C - 1)); an image is BOI, ``image_tokens`` image tokens, EOI."""
    n = image_tokens + 2
    depth1 = 3 * (n + 4)  # BOI A EOI (prompts 0, 2, 4, 5); 15 BOI B EOI 10 11 12 (widest); 20 21 22
    depth2 = 4 * (n + 1)  # 8 9; 13 14; BOI C EOI 9 (widest); BOI D EOI 9
    return len(SYSTEM) + depth1 + depth2 + rows * (C - 1)


@pytest.mark.parametrize(
    "model_type, batch_size", [("llava", 18), ("llava", 4), ("llava_next", 18), ("mistral3", 18), ("aya_vision", 18)]
)
def test_tree_of_image_prompts_matches_stock(model_type, batch_size):
    """The whole batch in one chunk (the trie's tokens, each image once per unique prefix) and chunks of 4 rows
    (groups of 3 split over chunks): log-probs, entropies and gradients as stock's, every chunk on the tree path."""
    model, encoded = vlm_with_head(model_type)
    ids, mask, extras = tree_batch(model_type)
    ref, ours, metrics = stock_and_shared(model, encoded, ids, mask, C, extras, batch_size, "tree")
    (ref_logps, ref_ent, ref_grads), (logps, ent, grads) = ref, ours
    chunks = -(-ids.shape[0] // batch_size)
    assert metrics[METRIC_PREFIX + "path/tree"] == [1.0] * chunks
    if chunks == 1:
        tiles = FAMILIES[model_type].tiles(SIZE)
        assert sum(encoded) == UNIQUE_IMAGE_PREFIXES * tiles
        image_tokens = int((ids[0] == IMAGE).sum())  # prompt 0: one image
        assert metrics[METRIC_PREFIX + "backbone_tokens"] == [float(_tree_tokens(image_tokens, ids.shape[0]))]
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    tower = f"model.{FAMILIES[model_type].tower}."
    assert any(name.startswith(tower) for name in grads)
    assert_grads_close(*without_key_biases(grads, ref_grads, tower))


def _join_images(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of (ids, mask) (B, P + C) with each EOI BOI between two images dropped (re-left-padded)."""
    P = ids.shape[1] - C
    out_ids, out_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    out_ids[:, P:], out_mask[:, P:] = ids[:, P:], mask[:, P:]
    for b in range(ids.shape[0]):
        tokens = ids[b, P - int(mask[b, :P].sum()) : P].tolist()
        keep = [
            t
            for i, t in enumerate(tokens)
            if not ((t == EOI and tokens[i + 1 : i + 2] == [BOI]) or (t == BOI and tokens[i - 1 : i] == [EOI]))
        ]
        out_ids[b, P - len(keep) : P], out_mask[b, P - len(keep) : P] = torch.tensor(keep), 1
    return out_ids, out_mask


def test_adjacent_images_take_group_sharing_warned(monkeypatch):
    """Two images with no token between them are one run of the image token for two images: the chunk has a tree
    cause naming the row, takes group sharing with one warning, and scores as stock."""
    model, _ = vlm_with_head("llava")
    ids, mask, extras = tree_batch("llava", PROMPTS[3:], same=[])
    ids, mask = _join_images(ids, mask)
    P = ids.shape[1] - C
    vision = chunk_images(extras, 0, ids.shape[0], ids.shape[0], ids[:, :P], IMAGE)
    assert vision.tree_cause() == (
        "row 3 has 2 images (num_images) but its prompt holds 1 runs of image tokens "
        f"(id {IMAGE}: one run per image is needed)"
    )
    ref_logps, ref_ent = score(stock_method(), model, ids, mask, C, extras, 9)
    monkeypatch.setattr(multimodal, "_warned_tree", [False])
    method, metrics = patched_with(SharingSession("tree", min_shared_tokens=MIN_SHARED))
    with pytest.warns(UserWarning, match=f"{TREE_TO_GROUP} \\(row 3 has 2 images"):
        logps, ent = score(method, model, ids, mask, C, extras, 9)
    assert metrics[METRIC_PREFIX + "path/group"] == [1.0]
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])


def test_runs_key_each_image_and_locate_its_tokens():
    """Row keys in the one-entry-per-image layout: one digest per image (A shared by prompts 0, 2, 4, 5's first
    image), spans at the runs of the image token id; without the id the images are not located (a tree cause)."""
    ids, mask, extras = tree_batch("llava")
    B, P = ids.shape[0], ids.shape[1] - C
    keys = chunk_images(extras, 0, B, B, ids[:, :P], IMAGE).row_keys(P)
    a = keys[0].images[0]
    assert keys[3 * G] == b"" and [len(keys[b * G].images) for b in (0, 1, 2, 4, 5)] == [1, 1, 1, 2, 2]
    assert keys[2 * G].images[0] == keys[4 * G].images[0] == keys[5 * G].images[0] == a != keys[G].images[0]
    assert keys[4 * G].images[1] != keys[5 * G].images[1]
    assert keys[0].runs == ((16 + 1 + 2, 16),)  # from the image's first token: 16 image tokens, EOI, 8 9
    assert keys[4 * G].runs == ((16 + 2 + 16 + 2, 16), (16 + 2, 16))  # A EOI BOI C EOI 9; C EOI 9
    whole = chunk_images(extras, 0, B, B)
    assert whole.located is None and "per image, tile or row" in whole.tree_cause()


def test_window_of_three_micro_batches_shares_image_nodes():
    """LLaVA, three micro-batches of one optimizer step each holding one row of every group (``begin_window`` with
    the rows' located image keys): every node forwarded once in the window, each image once per unique prefix;
    log-probs as stock's per micro-batch, gradients as stock's summed over them."""
    model, encoded = vlm_with_head("llava")
    ids, mask, extras = tree_batch("llava")
    B, P, size = ids.shape[0], ids.shape[1] - C, ids.shape[0] // G
    order = [b * G + i for i in range(G) for b in range(size)]  # micro-batch i: row i of every group
    ids, mask = ids[order], mask[order]
    rows = chunk_images(extras, 0, B, B)
    extras = dict(rows.of_rows(order), num_images=[rows.num_images[b] for b in order])
    chunks = [chunk_images(extras, s, s + size, B, ids[:, :P], IMAGE) for s in range(0, B, size)]
    refs, ref_grads = stock_window(model, ids, mask, C, chunks)
    encoded.clear()
    session = SharingSession("tree", min_shared_tokens=MIN_SHARED)
    session.begin_window(
        [ids[s : s + size, :P] for s in range(0, B, size)],
        [mask[s : s + size, :P] for s in range(0, B, size)],
        images=chunks,
    )
    tokens, grads = tree_window(session, model, ids, mask, C, chunks, refs)
    assert sum(encoded) == UNIQUE_IMAGE_PREFIXES
    assert tokens == _tree_tokens(int((ids[0] == IMAGE).sum()), B)  # every node in micro-batch 0
    assert_grads_close(*without_key_biases(grads, ref_grads, "model.vision_tower."))

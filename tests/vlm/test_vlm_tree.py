"""Tree sharing of image prompts: a text prefix shared before different images and before equal ones, against TRL
1.16's own method on tiny random Qwen2.5-VL, Qwen2-VL, Qwen3-VL and Qwen3.5 (Gated DeltaNet) built offline.

The trie keys each image token by its image (``multimodal.trie_keys``), so rows share a node while their ids and
images agree and part at the first image token where they differ; a node pass gets the features of the images whose
tokens it holds, once. Every prompt here starts with the same 8-token system prompt (a node at ``min_shared_tokens=4``)
and the batch holds, after it: image X then text (twice, with two endings: they share the X node), image Y, text only,
and two images X, Y / X, Z (the rows part between the images). Numbers are checked against stock's: fp32 log-probs and
entropies within 1e-5, every gradient (vision tower included) within 1e-4 of its scale; the vision tower's calls are
counted with a forward hook (each image once per unique prefix that holds it).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_close, assert_grads_close

from vlm_fixtures import (
    IMAGE,
    MIN_SHARED,
    patched_with,
    reorder,
    score,
    stock_and_shared,
    stock_method,
    stock_window,
    tree_window,
    vlm_batch,
    vlm_with_head,
)
from grpo_mem.model import multimodal
from grpo_mem.model.multimodal import TREE_TO_GROUP, VisionInputs
from grpo_mem.model.sharing import SharingSession
from grpo_mem.model.plan import PromptTrie
from grpo_mem.patches.trl import METRIC_PREFIX
from grpo_mem.patches.trl_images import chunk_images

SYSTEM = [40, 41, 42, 43, 44, 45, 46, 47]
X, Y, Z = (1, 4, 4), (1, 4, 8), (1, 4, 4)  # 4, 8 and 4 image tokens after the 2x2 merge
# (text before the images, their grids, text after) and the seed of each image (equal seed and grid: equal image)
TREE_PROMPTS = [
    (SYSTEM, [X], [8, 9]),
    (SYSTEM, [Y], [10, 11, 12]),
    (SYSTEM, [X], [13, 14]),
    (SYSTEM + [20, 21, 22], [], []),
    (SYSTEM, [X, Y], [9]),
    (SYSTEM, [X, Z], [9]),
]
IMAGE_SEEDS = [[100], [101], [100], [], [100, 101], [100, 102]]
# the vision tower's images: X once (its node holds it for prompts 0, 2, 4, 5), Y once after the system prompt
# (prompt 1) and once after X (prompt 4), Z once; stock encodes every row's
UNIQUE_IMAGE_PREFIXES = 4


def _passes_tokens(rows: int, C: int) -> int:
    """The backbone tokens of ``TREE_PROMPTS`` in one micro-batch of ``rows`` rows, by the trie's passes (rows x the
    widest node of each depth) and the completion pass (rows x (C - 1))."""
    system = 8  # depth 0: the system prompt, once
    depth1 = 3 * 13  # VS X VE (6, shared by prompts 0, 2, 4, 5); VS Y VE 10 11 12 (13); 20 21 22 (3)
    depth2 = 4 * 11  # 8 9 (2); 13 14 (2); VS Y VE 9 (11); VS Z VE 9 (7): the prompts part after the X node
    return system + depth1 + depth2 + rows * (C - 1)


@pytest.mark.parametrize(
    "model_type, batch_size, sharing",
    [
        ("qwen2_5_vl", 12, "tree"),
        ("qwen2_5_vl", 5, "tree"),
        ("qwen2_vl", 12, "tree"),
        ("qwen3_vl", 12, "tree"),
        ("qwen3_5", 12, "tree"),
        ("qwen3_5", 12, "group"),
    ],
)
def test_tree_of_image_prompts_matches_stock(model_type, batch_size, sharing):
    """The whole batch in one chunk, and chunks of 5 rows (groups of 2 split over chunks, each chunk its own trie):
    log-probs, entropies and gradients as stock's; every chunk on the tree path. In one chunk: each image encoded once
    per unique prefix holding it, and the backbone tokens are the trie's (the system prompt counted once). Qwen3.5
    with images in group sharing too (each unique prompt's images once: 7)."""
    model, encoded = vlm_with_head(model_type)
    ids, mask, C, extras = vlm_batch(TREE_PROMPTS, G=2, C=4, seed=5, image_seeds=IMAGE_SEEDS)
    ref, ours, metrics = stock_and_shared(model, encoded, ids, mask, C, extras, batch_size, sharing)
    (ref_logps, ref_ent, ref_grads), (logps, ent, grads) = ref, ours
    chunks = -(-ids.shape[0] // batch_size)
    assert metrics[METRIC_PREFIX + f"path/{sharing}"] == [1.0] * chunks
    if sharing == "group":
        assert sum(encoded) == sum(len(grids) for _, grids, _ in TREE_PROMPTS)
    elif chunks == 1:
        assert sum(encoded) == UNIQUE_IMAGE_PREFIXES
        assert metrics[METRIC_PREFIX + "backbone_tokens"] == [float(_passes_tokens(ids.shape[0], C))]
        assert metrics[METRIC_PREFIX + "stock_tokens"] == [float(ids.numel())]
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    assert any(name.startswith("model.visual.") for name in grads)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("in_lockstep", [False, True])
def test_window_of_two_micro_batches_shares_image_nodes(vlm_tree_model, monkeypatch, in_lockstep):
    """Every group split over the two micro-batches of one optimizer step (``begin_window`` with the rows' image keys):
    each node is forwarded once in the window, each image once per unique prefix, and the gradients are stock's summed
    over the micro-batches. In lockstep (the decision's collective stood in: another rank has a depth-3 pass where
    this one has none), a stand-in pass runs too and the numbers do not change."""
    from grpo_mem.model import sharing

    model, encoded = vlm_tree_model
    ids, mask, C, extras = vlm_batch(TREE_PROMPTS, G=2, C=4, seed=6, image_seeds=IMAGE_SEEDS)
    order = torch.cat([torch.arange(0, 12, 2), torch.arange(1, 12, 2)])  # rows 2i, 2i + 1 are prompt i's
    ids, mask, extras = ids[order], mask[order], reorder(extras, order)
    halves = [chunk_images(extras, s, s + 6, 12) for s in (0, 6)]
    P = ids.shape[1] - C
    ref_logps, ref_grads = stock_window(model, ids, mask, C, halves)
    asked = []  # per decision: (its pass keys, the keys of those that run the vision tower)

    def agree(reason, keys, image_passes):
        asked.append((set(keys), set(image_passes)))
        return reason, set(keys) | {(0, 3, 1)}

    if in_lockstep:  # two ranks up (the session asks ``lockstep`` only then), in lockstep
        from types import SimpleNamespace

        monkeypatch.setattr(
            sharing,
            "dist",
            SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 2),
        )
        monkeypatch.setattr(sharing, "lockstep", lambda model: True)
        monkeypatch.setattr(sharing, "agree", agree)
    encoded.clear()
    session = SharingSession("tree", min_shared_tokens=MIN_SHARED)
    session.begin_window([ids[:6, :P], ids[6:, :P]], [mask[:6, :P], mask[6:, :P]], images=halves)
    tokens, grads = tree_window(session, model, ids, mask, C, halves, ref_logps)
    assert sum(encoded) == UNIQUE_IMAGE_PREFIXES
    assert tokens == _passes_tokens(12, C) + in_lockstep  # every node in micro-batch 0; a stand-in is one token
    assert_grads_close(grads, ref_grads)
    if in_lockstep:  # micro-batch 0 runs every pass: the system prompt's root pass holds no image, deeper ones do
        (keys0, images0), (keys1, images1) = asked
        assert images0 and images0 < keys0 and min(k[1] for k in keys0 - images0) == 0 and images1 == set()


def test_ranks_running_the_vision_tower_in_other_passes_fall_back(monkeypatch):
    """``agree`` with two ranks (the collective stood in): equal pass keys and equal image passes share; one rank's
    pass with images where the other's has none, or other pass keys with images on a rank, fall back on both."""
    import torch.distributed as dist

    from grpo_mem.model.distributed import IMAGE_PASSES_DIFFER, agree

    def run(mine, other):
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj, other]))
        return agree(None, *mine)[0]

    keys = [(0, 0, 0), (0, 1, 0)]
    assert run((keys, [(0, 1, 0)]), (None, keys, [(0, 1, 0)])) is None
    assert run((keys, None), (None, keys, None)) is None  # text prompts on both ranks
    assert run((keys, [(0, 1, 0)]), (None, keys, [])) == IMAGE_PASSES_DIFFER  # a text-only pass on the other rank
    assert run((keys, [(0, 1, 0)]), (None, keys, None)) == IMAGE_PASSES_DIFFER  # no image input on the other rank
    assert run((keys, [(0, 1, 0)]), (None, keys[:1], [])) == IMAGE_PASSES_DIFFER  # a stand-in on this rank
    assert run((keys, None), (None, keys[:1], None)) is None  # text: stand-ins serve


@pytest.fixture
def vlm_tree_model():
    return vlm_with_head("qwen2_5_vl")


@pytest.mark.parametrize("cause", ["patched", "no token types"])
def test_tree_cause_plans_group_sharing_warned_once(vlm_tree_model, monkeypatch, cause):
    """Image prompts that cannot be split into trie nodes (``VisionInputs.tree_cause``: e.g. non-causal image
    attention, or image tokens not located for lack of ``mm_token_type_ids``) take group sharing in a tree-mode
    session, warned once by name, with stock's numbers."""
    model, _ = vlm_tree_model
    ids, mask, C, extras = vlm_batch(TREE_PROMPTS[:3], G=2, C=4, seed=7, image_seeds=IMAGE_SEEDS[:3])
    if cause == "patched":
        monkeypatch.setattr(VisionInputs, "tree_cause", lambda self: "image blocks attend bidirectionally")
        expected = "image blocks attend bidirectionally"
    else:
        extras = dict(extras, mm_token_type_ids=None)
        expected = "image inputs without mm_token_type_ids"
    ref_logps, _ = score(stock_method(), model, ids, mask, C, extras, 6)
    monkeypatch.setattr(multimodal, "_warned_tree", [False])  # warned once per process
    method, metrics = patched_with(SharingSession("tree", min_shared_tokens=MIN_SHARED))
    with pytest.warns(UserWarning, match=f"{TREE_TO_GROUP} \\({expected}"):
        logps, _ = score(method, model, ids, mask, C, extras, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score(method, model, ids, mask, C, extras, 6)
    assert metrics[METRIC_PREFIX + "path/group"] == [1.0, 1.0]
    assert_close(logps, ref_logps, 1e-5, "log-probs", mask=mask[:, -C:])


def test_trie_parts_rows_at_the_first_image_that_differs():
    """Row keys and trie keys: prompts with equal ids and a first image in common share the trie up to the second
    image's first token; an image is one key per token (id, image, run length, index); run counts that do not match
    num_images are a ValueError."""
    prompts = [(SYSTEM, [X, Y], [9]), (SYSTEM, [X, Z], [9]), (SYSTEM, [X, Y], [9])]
    ids, mask, C, extras = vlm_batch(prompts, G=1, C=2, image_seeds=[[1, 2], [1, 3], [4, 2]])
    P = ids.shape[1] - C
    vision = chunk_images(extras, 0, 3, 3)
    keys = vision.row_keys(P)
    assert keys[0].images[0] == keys[1].images[0] != keys[2].images[0]  # X, X, then another image of X's grid
    # (tokens from the image's first token to the prompt's end, image tokens): 8 system tokens, then VS X VE VS Y VE 9
    assert keys[0].runs == ((16, 4), (10, 8)) and keys[1].runs == ((12, 4), (6, 4))
    real = [ids[b, P - int(mask[b, :P].sum()) : P].tolist() for b in range(3)]
    trie = PromptTrie(real, min_shared_tokens=1, keys=[multimodal.trie_keys(r, k) for r, k in zip(real, keys)])
    shared = trie.nodes[trie.path(trie.leaf[0])[0]]
    assert shared.prompts == [0, 1, 2] and len(shared.tokens) == 9  # the system prompt and X's vision-start token
    first_images = {trie.nodes[trie.path(trie.leaf[b])[1]].tokens[:2] for b in range(3)}
    assert first_images == {(IMAGE, IMAGE)}  # ids are the real ones
    assert trie.path(trie.leaf[0])[1] == trie.path(trie.leaf[1])[1] != trie.path(trie.leaf[2])[1]
    bad = dict(extras, num_images=[3, 2, 1], image_grid_thw=extras["image_grid_thw"])
    with pytest.raises(ValueError, match="row 0 has 3 images \\(num_images\\) but its prompt holds 2 runs"):
        chunk_images(bad, 0, 3, 3).row_keys(P)
    with pytest.raises(ValueError, match="keys must give one key per token"):
        PromptTrie(real, keys=[k[:-1] for k in real])

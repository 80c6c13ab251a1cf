"""The one token count of the benchmarks (``grpo_mem.bench.tokens``) against what a tiny run's backbone forwards."""

import pytest
from helpers import VOCAB, tiny_model

from grpo_mem.bench import estimate, group, tree
from grpo_mem.bench.tokens import backbone_tokens, token_counts
from grpo_mem.model.sharing import SharingSession


def _forwarded(model, fn, ids, mask) -> int:
    """Tokens the backbone's input embedding takes during the second of two calls of ``fn`` (the first installs)."""
    count = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, args, out: count.append(args[0].numel()))
    try:
        for _ in range(2):
            count.clear()
            logps, _ = fn(ids, mask)
            logps.sum().backward()
            model.zero_grad(set_to_none=True)
    finally:
        handle.remove()
    return sum(count)


def _session_fn(model, mode: str, ids, mask, C: int):
    session = SharingSession(mode, min_shared_tokens=4)
    P = ids.shape[1] - C

    def fn(input_ids, attention_mask):
        session.begin_window([input_ids[:, :P]], [attention_mask[:, :P]])
        try:
            return session.score(model, input_ids, attention_mask, C, compute_entropy=True)
        finally:
            session.close_window()

    return fn


def test_counts_are_what_a_tiny_run_forwards():
    """2 prompts of a 12-token system prompt and 6 own tokens (no padding), G=3 completions of C=5 tokens, one
    micro-batch: stock TRL forwards every row's P + C tokens (6 x 23 = 138), group sharing each prompt once and C - 1
    tokens of each row (2 x 18 + 6 x 4 = 60), tree sharing the system prompt once (12 + 2 x 6 + 24 = 48)."""
    S, Qs, G, C = 12, [6, 6], 3, 5
    ids, mask, _ = tree.make_window(S, Qs, G, C, groups_per_mb=2, vocab=VOCAB, seed=0)
    P, rows = S + max(Qs), ids.shape[0]
    model = tiny_model()
    got = {mode: _forwarded(model, _session_fn(model, mode, ids, mask, C), ids, mask) for mode in ("group", "tree")}
    got["trl"] = _forwarded(model, group.make_logprob_fn("trl", model, C), ids, mask)
    counts = token_counts(G, P, C, groups=2)
    assert got == {"trl": 138, "group": 60, "tree": 48}
    assert got["trl"] == counts["trl_lm"] and got["group"] == counts["grpo_mem_lm"] == backbone_tokens(2 * P, rows, C)
    assert got["tree"] == backbone_tokens(S + sum(Qs), rows, C)
    assert tree.ideal_ratio(S, Qs, G, C) == pytest.approx(got["tree"] / got["group"])
    assert counts["ideal_ratio"] == pytest.approx(got["group"] / got["trl"])


def test_images_sequence_parallelism_and_bad_values():
    """An image prompt counts its patch rows once (grpo_mem) or per row (stock); with k ranks a pass is cut into k
    shards of ceil(T / k) tokens (the estimate's per-rank counts); bad values are named."""
    c = token_counts(8, 512, 64, groups=2, image_tokens=256, rows_per_token=4)
    assert c == dict(
        patch_rows=1024,
        trl_vision=16384,
        trl_lm=2 * 8 * 576,
        grpo_mem_vision=2048,
        grpo_mem_lm=2 * 512 + 16 * 63,
        ideal_ratio=(2048 + 2032) / (16384 + 9216),
    )
    assert backbone_tokens(1000, 8, 64, sp_size=4) == 250 + 8 * 16
    assert estimate.rank_tokens("grpo_mem", 1000, 64, 8, sp_size=4) == (250, 8 * 16)
    assert estimate.rank_tokens("trl", 1000, 64, 8) == (8000, 512)
    assert backbone_tokens(7, 3, 1) == 7  # C = 1: the completion pass runs nothing
    for kwargs, message in (
        (dict(prompt_tokens=-1, rows=1, C=2), "prompt_tokens must be >= 0, got -1"),
        (dict(prompt_tokens=1, rows=1, C=0), "C must be >= 1, got 0"),
        (dict(prompt_tokens=1, rows=1, C=2, sp_size=0), "sp_size must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=message):
            backbone_tokens(**kwargs)

"""Tokens through the backbone in one scoring step, grpo_mem against stock TRL: the one count the benchmarks,
``grpo-mem bench`` and the memory estimates use.

grpo_mem forwards each prompt once and then one completion pass, in which a row runs C − 1 of its C completion tokens:
the hidden state at the prompt's last position predicts completion token 0, completion token j predicts token j + 1,
and the last completion token predicts nothing (``grpo_mem.model.window.completion_width``; the model's own count,
``WindowPlan.tokens_at``, is the same sum with each pass's padded width). Stock TRL forwards every row's prompt and
completion, P + C tokens.
"""

from __future__ import annotations

import math


def backbone_tokens(prompt_tokens: int, rows: int, C: int, *, sp_size: int = 1) -> int:
    """Tokens grpo_mem's backbone runs on one rank: ``ceil(prompt_tokens / k) + rows · ceil((C − 1) / k)``, k =
    ``sp_size``.

    Args:
        prompt_tokens: tokens of the prompt passes, each prompt (or prefix-tree node) counted once; with k > 1, one
            pass's tokens (a pass is cut along the sequence into k shards).
        rows: completions scored (G per prompt).
        C: completion tokens per row (the completion width, >= 1).
        sp_size: sequence-parallel group size k (each pass split into k shards of ceil(T / k) tokens,
            ``grpo_mem.model.sequence_parallel``); 1 without sequence parallelism.

    Raises:
        ValueError: a negative ``prompt_tokens`` or ``rows``, ``C`` or ``sp_size`` below 1 (naming the value).
    """
    for name, value, least in (("prompt_tokens", prompt_tokens, 0), ("rows", rows, 0), ("C", C, 1)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if sp_size < 1:
        raise ValueError(f"sp_size must be >= 1, got {sp_size}")
    return math.ceil(prompt_tokens / sp_size) + rows * math.ceil((C - 1) / sp_size)


def token_counts(G: int, P: int, C: int, groups: int = 1, image_tokens: int = 0, rows_per_token: int = 4) -> dict:
    """Tokens through the vision tower (patch rows) and the language model in one scoring step of ``groups``
    prompts of P tokens (``image_tokens`` of them image tokens, each ``rows_per_token`` patch rows: 4 with
    Qwen2.5-VL's 2 x 2 merge) with G completions of C.

    Stock TRL sends every row's image copy and its P + C tokens; grpo_mem each prompt's image and prompt once and
    each completion's C − 1 tokens (:func:`backbone_tokens`). Returns a dict of ints: ``patch_rows`` (per image),
    ``trl_vision`` = groups·G·patch_rows, ``trl_lm`` = groups·G·(P + C), ``grpo_mem_vision`` = groups·patch_rows,
    ``grpo_mem_lm`` = groups·P + groups·G·(C − 1), and the float ``ideal_ratio`` = (vision + LM tokens of grpo_mem) /
    (those of stock TRL): (Nv + P + G·(C − 1)) / (G·(Nv + P + C)) with Nv = patch_rows, (P + G·(C − 1)) / (G·(P + C))
    without an image.
    """
    patches = image_tokens * rows_per_token
    counts = dict(
        patch_rows=patches,
        trl_vision=groups * G * patches,
        trl_lm=groups * G * (P + C),
        grpo_mem_vision=groups * patches,
        grpo_mem_lm=backbone_tokens(groups * P, groups * G, C),
    )
    counts["ideal_ratio"] = (counts["grpo_mem_vision"] + counts["grpo_mem_lm"]) / (
        counts["trl_vision"] + counts["trl_lm"]
    )
    return counts

"""Multi-turn rollouts through TRL's ``rollout_func``: tool results inside the completions, masked out of the loss
(``env_mask``, TRL's ``tool_mask``), with the rows of a group sharing their prompt or each row's prompt ending in a
token of its own (as an environment's ``reset()`` that adds text to each rollout's prompt does).

A stand-in for the rollout (no generation): each row's completion is a model turn, a 3-token tool result and a second
model turn ending in EOS, drawn from the row's index and the step, so stock and patched training see the same rows.
Patched training equals stock TRL's (every step's gradients, the final weights), and the prompt-once path runs:
rows whose prompts differ share the 74-token system prompt and the question (tree sharing), although no prompt
repeats.
"""

import pytest
import torch
from helpers import (
    EOS,
    MULTI_TURN_ARGS,
    SYSTEM_PROMPT,
    VOCAB,
    assert_trained_like_stock_on_the_tree_path,
    train_recorded,
)


ARGS = dict(
    MULTI_TURN_ARGS,
    max_steps=3,
    max_completion_length=12,
    prompts=[SYSTEM_PROMPT + p for p in ("1+2=", "What is 7-3?", "Say hi", "Count: 1 2 3")],
)


def stand_in_rollout(own_token: bool):
    """A ``rollout_func`` (prompts, trainer) -> prompt_ids, completion_ids, logprobs, env_mask; ``own_token``: each
    row's prompt gets one token of its own after the dataset's prompt."""

    def rollout(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        for row, prompt in enumerate(prompts):
            g = torch.Generator().manual_seed(1000 * trainer.state.global_step + row)

            def turn(most):
                return torch.randint(4, VOCAB, (int(torch.randint(1, most + 1, (1,), generator=g)),), generator=g)

            ids = trainer.processing_class(prompt)["input_ids"] + ([4 + row % (VOCAB - 4)] if own_token else [])
            first, tool, second = turn(3).tolist(), turn(3).tolist(), turn(3).tolist()
            completion = first + tool + second + [EOS]
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append([0.0] * len(completion))
            out["env_mask"].append([1] * len(first) + [0] * len(tool) + [1] * (len(second) + 1))
        return out

    return rollout


@pytest.fixture(autouse=True)
def _silence_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16


@pytest.mark.parametrize("own_token", [False, True], ids=["shared-prompt", "row-token"])
def test_rollout_func_with_tool_results_trains_like_stock(tmp_path, own_token):
    kwargs = dict(ARGS, trainer_kwargs=dict(rollout_func=stand_in_rollout(own_token)))
    stock, stock_rec = train_recorded(tmp_path / "stock", "grpo", patch=False, **kwargs)
    ours, ours_rec = train_recorded(tmp_path / "ours", "grpo", patch=True, **kwargs)
    # every micro-batch on the prompt-once path, the system prompt and questions forwarded once
    assert_trained_like_stock_on_the_tree_path(stock, stock_rec, ours, ours_rec, ARGS["max_steps"])

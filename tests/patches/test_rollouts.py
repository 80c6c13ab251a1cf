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
from helpers import EOS, SYSTEM_PROMPT, VOCAB, assert_close, assert_grads_close, train_recorded


ARGS = dict(
    max_steps=3,
    gradient_accumulation_steps=2,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=12,
    optim="sgd",
    beta=0.04,
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
    assert ours.state.global_step == stock.state.global_step == ARGS["max_steps"]
    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_close(g_ours, g_stock, 1e-4)
    stock_params = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_params[name].detach(), 1e-5, name)
    logged = [h for h in ours.state.log_history if "grpo_mem/token_ratio" in h]
    assert len(logged) == ARGS["max_steps"]
    for log in logged:  # every micro-batch on the prompt-once path, the system prompt and questions forwarded once
        assert log["grpo_mem/path/tree"] == 1.0 and log["grpo_mem/path/stock"] == 0.0, log
        assert log["grpo_mem/token_ratio"] < 0.5, log

"""Tool-calling GRPO through TRL's own loop: ``GRPOTrainer(tools=...)`` and ``GRPOTrainer(environment_factory=...)``.

Offline: a character-level tokenizer with Qwen3's chat-template tokens, TRL's Qwen3 chat template (which renders the
tools' JSON schemas into the system prompt, about 650 tokens here) and its response template (which parses the
model's ``<tool_call>`` blocks), and a stand-in for generation (``_generate_single_turn``): on its first turn a row
calls the ``add`` tool or answers, drawn from the step and its place in the batch, and after a tool result it
answers. TRL runs the tools, appends their results inside the completion and masks them out of the loss
(``tool_mask``). An environment's ``reset()`` appends text of its own to each rollout's prompt, so that no prompt
repeats. Patched training equals stock TRL's (every step's gradients, the final weights) and the prompt-once path
runs, the tool schemas and the question forwarded once per micro-batch (tree sharing).
"""

import itertools
import string

import pytest
import torch
from helpers import MULTI_TURN_ARGS, assert_trained_like_stock_on_the_tree_path, char_tokenizer, train_recorded
from trl import GRPOTrainer

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHAT_TOKENS += ["<think>", "</think>"]

QUESTIONS = ["What is 1+2?", "Add 7 and 3.", "Sum of 4 and 5?", "Compute 2+2."]

ARGS = dict(
    MULTI_TURN_ARGS,
    max_steps=2,
    max_completion_length=128,
    prompts=[[{"role": "user", "content": q}] for q in QUESTIONS],
)


def tool_tokenizer():
    """``char_tokenizer`` with the characters of JSON and the chat markup, Qwen3's turn and tool-call markers as single
    tokens, ``<|im_end|>`` as EOS, decoding without separators, and TRL's Qwen3 chat and response templates."""
    from tokenizers import decoders
    from trl.chat_template_utils import add_response_schema, qwen3_chat_template

    tokenizer = char_tokenizer("<>|_{}[]#", tuple(CHAT_TOKENS), eos="<|im_end|>")
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # the templates' text back as it was rendered
    tokenizer.chat_template = qwen3_chat_template
    return add_response_schema(tokenizer)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class Calculator:
    """An environment: ``reset`` appends a rollout number of its own to the user's message; ``add`` is its tool."""

    rollouts = itertools.count()

    def reset(self, **kwargs) -> str:
        return f" (run {next(Calculator.rollouts)})"

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


def stand_in_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """``GRPOTrainer._generate_single_turn`` without a model: per row, a tool call of ``add`` or an answer (after a
    tool result: an answer), drawn from the step, the row's place and its prompt's length, so that stock and patched
    training see the same completions. Returns (completion ids, no sampling log-probs)."""
    tokenizer = self.processing_class
    completions = []
    for row, ids in enumerate(prompt_ids):
        g = torch.Generator().manual_seed(1000 * self.state.global_step + 10 * row + len(ids))
        answered = tokenizer.convert_tokens_to_ids("<tool_response>") in ids
        if not answered and (row + self.state.global_step) % 2 == 0:
            a, b = torch.randint(0, 10, (2,), generator=g).tolist()
            text = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>'
        else:
            n = int(torch.randint(1, 7, (1,), generator=g))
            letters = torch.randint(0, 26, (n,), generator=g).tolist()
            text = "".join(string.ascii_lowercase[i] for i in letters) + "<|im_end|>"
        completions.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return completions, None


@pytest.fixture(autouse=True)
def _stand_in_generation(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", stand_in_turn)


def completion_length(completions, completion_ids, **kwargs):
    """A reward with spread within a group: the completion's length in tokens, tool results included, modulo 7."""
    return [float(len(ids) % 7) for ids in completion_ids]


def _train(tmp_path, patch, trainer_kwargs):
    Calculator.rollouts = itertools.count()
    return train_recorded(
        tmp_path,
        "grpo",
        patch=patch,
        processing_class=tool_tokenizer(),
        reward_funcs=completion_length,
        trainer_kwargs=trainer_kwargs,
        **ARGS,
    )


@pytest.mark.parametrize("how", ["tools", "environment_factory"])
def test_tool_calling_trains_like_stock(tmp_path, how):
    trainer_kwargs = dict(tools=[add]) if how == "tools" else dict(environment_factory=Calculator)
    stock, stock_rec = _train(tmp_path / "stock", False, trainer_kwargs)
    ours, ours_rec = _train(tmp_path / "ours", True, trainer_kwargs)
    calls = [h["tools/call_frequency"] for h in stock.state.log_history if "tools/call_frequency" in h]
    assert calls and all(c > 0 for c in calls), calls  # tool results sit inside the completions
    # the tool schemas and the question forwarded once per micro-batch, whether a prompt repeats or not
    assert_trained_like_stock_on_the_tree_path(stock, stock_rec, ours, ours_rec, ARGS["max_steps"])

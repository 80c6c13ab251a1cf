"""reasoning-gym tasks as a TRL prompt dataset plus an exact reward function.

A task is a ``reasoning_gym`` procedural dataset (``reasoning_gym.create_dataset(name, size=, seed=, **config)``) whose
entries hold ``question`` and ``answer``. Each entry becomes one chat prompt: a system message asking for the bare
answer (:func:`system_prompt`) and the question as the user message, unchanged. A model without a chat template (a
base model such as Gemma 3 270M) gets the same content as plain text instead (:meth:`Task.prompt`), ending in
``"Answer:"`` for the model to continue. The reward of a completion is
``dataset.score_answer(extract_answer(completion), entry)``, the task's own scorer, applied to the answer text pulled
out of the completion (see :func:`extract_answer`).

With ``few_shot=K`` the system message also holds K solved examples of the same task (:func:`few_shot_examples`),
so every prompt starts with the same long prefix, as RL prompts with instructions and demonstrations do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

DEFAULT_TASK = "chain_sum"

DEFAULT_TASK_CONFIGS: dict[str, dict[str, Any]] = {
    # Sums/differences of two one-digit numbers: SmolLM2-135M-Instruct gets some but not all of a group of 8 right,
    # which is what gives GRPO a signal. At reasoning-gym's default difficulty its reward is all zeros.
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
}
"""Task configurations used when no ``--task-config`` is given; other tasks get reasoning-gym's defaults."""

DEFAULT_SYSTEM_PROMPTS: dict[str, str] = {
    # Measured on SmolLM2-135M-Instruct, 12 chain_sum questions x 8 samples, 32 new tokens: at temperature 0.7 this
    # system prompt gave mean reward 0.39 with 10/12 groups mixed; the question followed by "Reply with just the
    # number." and the default system prompt gave 0.15 (8/12 mixed) at temperature 1.0.
    "chain_sum": "You are a calculator. Reply with only the resulting number.",
}
"""System prompts of tasks that have one tuned for the default model; see :func:`system_prompt` for the others."""

FEW_SHOT_SEED_OFFSET = 1_000_000
"""Few-shot examples come from the dataset seed ``seed + FEW_SHOT_SEED_OFFSET``. reasoning-gym's procedural datasets
draw entry ``i`` from ``random.Random(seed + i)``, so the examples' generator seeds never meet the training entries'
(``seed`` ... ``seed + size - 1``) while ``size`` is below the offset; examples whose question is also a training
question are skipped as well."""

NUMERIC_SYSTEM_PROMPT = "Reply with only the final number."
TEXT_SYSTEM_PROMPT = "Reply with only the final answer."

# A signed decimal number with optional thousands separators: "-4", "+12", "1,000", "3.50". A sign counts only when it
# touches the digits, so in "5 - 9 = -4" the numbers are 5, 9 and -4.
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_LEAD_IN = re.compile(r"^(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?\s*", re.IGNORECASE)
_CHAT_MARKERS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


def extract_answer(completion: str, *, numeric: bool, first_line: bool = False) -> str | None:
    """The answer a completion gives, as text for the task's ``score_answer``; ``None`` when it gives none.

    The completion is first cut at the first chat marker such as ``<|im_end|>`` and, with ``first_line`` (plain-text
    prompts, whose base model goes on past its answer with new "Question:" lines), at the end of its first non-empty
    line: ``" 7\n\nQuestion: 2 + 2"`` → ``" 7"``. Then, first match wins:

    1. the content of the last ``<answer>...</answer>`` tag (reasoning-gym's own answer format);
    2. the content of the last ``\\boxed{...}``;
    3. numeric tasks: the last number in the text, thousands commas removed (``"3 + 4 = 7."`` → ``"7"``,
       ``"5 - 9 = -4"`` → ``"-4"``), the usual "last number" rule of GSM8K-style graders;
    4. other tasks: the last non-empty line, without an ``Answer:`` / ``The answer is`` lead-in and without one
       trailing full stop.

    Args:
        completion: decoded completion text (str).
        numeric: whether the task's answers are numbers (:attr:`Task.numeric`).
        first_line: keep only the first non-empty line (:attr:`Task.chat` is False).

    Raises:
        TypeError: ``completion`` is not a ``str``.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    text = completion
    for marker in _CHAT_MARKERS:
        text = text.split(marker, 1)[0]
    if first_line:
        text = text.lstrip().split("\n", 1)[0]
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    if numeric:
        numbers = _NUMBER.findall(text)
        if not numbers:
            return None
        return numbers[-1].replace(",", "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    answer = _LEAD_IN.sub("", lines[-1]).strip()
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1].rstrip()
    return answer or None


def _is_number(text: str) -> bool:
    try:
        Decimal(text.replace(",", ""))
    except (InvalidOperation, ValueError):
        return False
    return True


def completion_text(completion: Any) -> str:
    """Text of one TRL completion: a ``str`` (standard format) or a list of chat messages (conversational format,
    the assistant message contents are joined).

    Raises:
        TypeError: any other type.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    raise TypeError(f"completion must be a str or a list of chat messages, got {type(completion).__name__}")


@dataclass
class Task:
    """A reasoning-gym dataset, its prompts in TRL's conversational (or standard, plain-text) format and its reward.

    Attributes:
        name: reasoning-gym dataset name (e.g. ``"chain_sum"``).
        config: keyword arguments given to ``reasoning_gym.create_dataset``.
        data: the reasoning-gym dataset (indexable; entries are dicts with ``question``, ``answer``, ``metadata``).
        numeric: True when every answer in ``data`` parses as a decimal number; selects the extraction rule and
            the default system prompt.
        system: system message of every prompt (empty: none); with few-shot examples, the task's system prompt
            followed by :func:`few_shot_block` of :attr:`examples`.
        examples: the few-shot entries (reasoning-gym entries of the same dataset and config) in the system message.
        few_shot_seed: dataset seed the examples were drawn from (``None`` without examples).
        chat: True: prompts are chat messages (for a tokenizer with a chat template); False: plain text.
    """

    name: str
    config: dict[str, Any]
    data: Any
    numeric: bool

    system: str = ""
    examples: list[dict[str, Any]] = field(default_factory=list)
    few_shot_seed: int | None = None
    chat: bool = True

    def prompt(self, index: int) -> list[dict[str, str]] | str:
        """Prompt of entry ``index``. Chat (:attr:`chat`): the system message :attr:`system` (if any), then the
        question as is. Plain text: :attr:`system` and a blank line (if any), then ``"Question: <question>\nAnswer:"``,
        the layout of the few-shot examples (:func:`few_shot_block`)."""
        question = str(self.data[index]["question"])
        if not self.chat:
            return (f"{self.system}\n\n" if self.system else "") + f"Question: {question}\nAnswer:"
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return messages + [{"role": "user", "content": question}]

    def score(self, completion: Any, index: int) -> float:
        """Reward in [0, 1] of one completion for entry ``index``: the task's ``score_answer`` on the extracted answer."""
        answer = extract_answer(completion_text(completion), numeric=self.numeric, first_line=not self.chat)
        return float(self.data.score_answer(answer, self.data[index]))

    def hf_dataset(self):
        """``datasets.Dataset`` with columns ``prompt`` (chat messages or str) and ``rg_index`` (int, entry index)."""
        from datasets import Dataset

        n = len(self.data)
        return Dataset.from_dict({"prompt": [self.prompt(i) for i in range(n)], "rg_index": list(range(n))})

    def reward_func(self):
        """A TRL reward function: ``f(prompts, completions, rg_index, **kwargs) -> list[float]``.

        TRL passes dataset columns as keyword lists aligned with ``completions``; ``rg_index`` locates each entry.
        Its ``__name__`` (TRL's metric name, ``rewards/<name>/mean``) is ``score_<task>``.
        """

        def reward(prompts=None, completions=None, rg_index=None, **kwargs) -> list[float]:
            if completions is None or rg_index is None:
                raise ValueError("reward needs `completions` and the dataset column `rg_index`")
            if len(completions) != len(rg_index):
                raise ValueError(f"{len(completions)} completions but {len(rg_index)} rg_index values")
            return [self.score(c, int(i)) for c, i in zip(completions, rg_index)]

        reward.__name__ = f"score_{self.name}"
        return reward


def system_prompt(name: str, numeric: bool) -> str:
    """Default system prompt of task ``name``: :data:`DEFAULT_SYSTEM_PROMPTS` ``[name]`` if tuned, else
    :data:`NUMERIC_SYSTEM_PROMPT` or :data:`TEXT_SYSTEM_PROMPT`."""
    if name in DEFAULT_SYSTEM_PROMPTS:
        return DEFAULT_SYSTEM_PROMPTS[name]
    return NUMERIC_SYSTEM_PROMPT if numeric else TEXT_SYSTEM_PROMPT


def few_shot_block(examples: list[dict[str, Any]]) -> str:
    """The examples as text for the system message: ``"Solved examples:"``, then per entry ``"Question: <question>"``
    and ``"Answer: <answer>"`` on two lines, entries separated by a blank line. The answer is reasoning-gym's exact
    ``entry["answer"]``, the bare answer the task's system prompt asks for."""
    return "Solved examples:\n\n" + "\n\n".join(f"Question: {e['question']}\nAnswer: {e['answer']}" for e in examples)


def few_shot_examples(data: Any, k: int, *, name: str, config: dict[str, Any], seed: int) -> tuple[list[dict], int]:
    """``k`` solved entries of task ``name`` for the system prompt, none of them a question of ``data``.

    They are the first ``k`` entries of ``reasoning_gym.create_dataset(name, seed=seed + FEW_SHOT_SEED_OFFSET,
    **config)`` whose question is neither in ``data`` (the training entries, made with ``seed``) nor an earlier
    example; at most ``max(8 k, k + 64)`` entries are drawn.

    Returns:
        (the entries, the dataset seed they came from).

    Raises:
        ValueError: ``k`` < 1, ``len(data)`` >= :data:`FEW_SHOT_SEED_OFFSET` (the seed ranges could meet), or fewer
            than ``k`` distinct new questions among the draws (a task with few possible questions).
    """
    import reasoning_gym

    if not isinstance(k, int) or k < 1:
        raise ValueError(f"few-shot k must be an int >= 1, got {k!r}")
    if len(data) >= FEW_SHOT_SEED_OFFSET:
        raise ValueError(f"{len(data)} training entries: few-shot examples need fewer than {FEW_SHOT_SEED_OFFSET}")
    fs_seed = seed + FEW_SHOT_SEED_OFFSET
    draws = max(8 * k, k + 64)
    pool = reasoning_gym.create_dataset(name, size=draws, seed=fs_seed, **config)
    seen = {str(data[i]["question"]) for i in range(len(data))}
    examples = []
    for i in range(draws):
        entry = pool[i]
        question = str(entry["question"])
        if question in seen:
            continue
        seen.add(question)
        examples.append(entry)
        if len(examples) == k:
            return examples, fs_seed
    raise ValueError(
        f"--few-shot {k}: only {len(examples)} of {draws} {name} entries drawn from seed {fs_seed} have a question "
        f"that is neither a training question nor an earlier example; use a smaller K or a task config with more "
        f"distinct questions"
    )


def _create_dataset(name: str, size: int, seed: int, config: dict[str, Any] | None):
    """``(reasoning-gym dataset, the config it was made with)``; the errors of :func:`make_task` about these."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(f"unknown reasoning-gym task {name!r}; known: {', '.join(sorted(DATASETS))}")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if config is None:
        config = dict(DEFAULT_TASK_CONFIGS.get(name, {}))
    if not isinstance(config, dict):
        raise TypeError(f"task config must be a dict, got {type(config).__name__}")
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **config), config
    except (TypeError, AssertionError) as exc:  # reasoning-gym validates its configs with assert
        raise ValueError(f"task {name!r} rejects config {config!r}: {exc}") from exc


def make_task(
    name: str = DEFAULT_TASK,
    *,
    size: int,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    system: str | None = None,
    few_shot: int = 0,
    chat: bool = True,
) -> Task:
    """Build a :class:`Task` of ``size`` entries.

    Args:
        name: reasoning-gym dataset name (``reasoning_gym.factory.DATASETS`` lists them).
        size: number of entries (int >= 1).
        seed: dataset seed (int).
        config: dataset options; ``None`` takes :data:`DEFAULT_TASK_CONFIGS` ``[name]`` or reasoning-gym's defaults.
        system: system message of every prompt; ``None`` = :func:`system_prompt`, ``""`` = no system message (the
            chat template may then insert its own default).
        few_shot: number of solved examples appended to the system message (:func:`few_shot_examples`; int >= 0).
        chat: chat-message prompts (True) or plain-text ones (False, for a model without a chat template).

    Raises:
        ValueError: unknown task name, ``size`` < 1, ``few_shot`` < 0, options the dataset rejects, or too few
            distinct few-shot questions.
        TypeError: ``config`` is not a dict.
    """
    data, config = _create_dataset(name, size, seed, config)
    numeric = all(_is_number(str(data[i]["answer"])) for i in range(len(data)))
    if system is None:
        system = system_prompt(name, numeric)
    elif not isinstance(system, str):
        raise TypeError(f"system must be a str, got {type(system).__name__}")
    if not isinstance(few_shot, int) or few_shot < 0:
        raise ValueError(f"few_shot must be an int >= 0, got {few_shot!r}")
    examples, fs_seed = [], None
    if few_shot:
        examples, fs_seed = few_shot_examples(data, few_shot, name=name, config=config, seed=seed)
        block = few_shot_block(examples)
        system = f"{system}\n\n{block}" if system else block
    return Task(
        name=name,
        config=config,
        data=data,
        numeric=numeric,
        system=system,
        examples=examples,
        few_shot_seed=fs_seed,
        chat=bool(chat),
    )

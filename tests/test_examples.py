"""The scripts in examples/ run as a user runs them, offline, on tiny models saved in tmp_path.

Each example is a subprocess (``HF_HUB_OFFLINE=1``) given a tiny random Llama policy with a character tokenizer that
has a chat template (and for the LoRA example a tiny Llama sequence classifier as the reward model), 2 optimizer
steps. Checked: the exit status, ``grpo_mem.verify`` passing on the trainer before training (it raises otherwise),
and in the run's ``trainer_state.json`` every logged step on the prompt-once path (``grpo_mem/path/stock`` 0), the
backbone running under half of stock TRL's tokens, and a finite loss; for the LoRA example the reward model's reward
logged and the adapter saved.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import char_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _tokenizer():
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _llama_config(tok, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(policy directory, reward-model directory): a 2-layer random Llama causal LM and a 2-layer random Llama
    sequence classifier (one label), each saved with the chat-templated character tokenizer."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    tok = _tokenizer()
    root = tmp_path_factory.mktemp("example_models")
    torch.manual_seed(0)
    policy, reward = root / "policy", root / "reward"
    LlamaForCausalLM(_llama_config(tok)).save_pretrained(policy)
    LlamaForSequenceClassification(_llama_config(tok, num_labels=1)).save_pretrained(reward)
    for d in (policy, reward):
        tok.save_pretrained(d)
    return str(policy), str(reward)


def _run_example(script: str, out_dir, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRPO_MEM_CONFIRM"}  # as a user runs it: confirmation on
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_WAIT_POLICY="PASSIVE",
        PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    )
    common = ["--output-dir", str(out_dir), "--max-steps", "2", "--num-prompts", "8", "--num-generations", "4"]
    common += ["--per-device-train-batch-size", "8", "--max-completion-length", "8", "--no-bf16"]
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *common, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _check_logged_steps(out_dir) -> list[dict]:
    history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "grpo_mem/token_ratio" in h]
    assert len(steps) == 2, history
    for h in steps:
        assert h["grpo_mem/path/stock"] == 0.0, h  # no micro-batch fell back to TRL's own method
        assert h["grpo_mem/path/tree"] + h["grpo_mem/path/group"] == 1.0, h
        # each prompt of ~150 tokens forwarded once for its 4 completions of at most 8 tokens
        assert 0 < h["grpo_mem/backbone_tokens"] < 0.5 * h["grpo_mem/stock_tokens"], h
        assert h["grpo_mem/token_ratio"] == pytest.approx(h["grpo_mem/backbone_tokens"] / h["grpo_mem/stock_tokens"])
        assert math.isfinite(h["loss"]), h
    return steps


def test_grpo_basic(tiny_models, tmp_path):
    policy, _ = tiny_models
    proc = _run_example("grpo_basic.py", tmp_path / "out", "--model", policy)
    assert "verify: passed=True" in proc.stdout, proc.stdout
    _check_logged_steps(tmp_path / "out")


def test_grpo_lora_reward_model(tiny_models, tmp_path):
    policy, reward = tiny_models
    proc = _run_example("grpo_lora_reward_model.py", tmp_path / "out", "--model", policy, "--reward-model", reward)
    assert "verify: passed=True" in proc.stdout, proc.stdout
    steps = _check_logged_steps(tmp_path / "out")
    # the reward model scored the completions (its rewards are random numbers here, so their std is not 0)
    assert all(h["rewards/reward/std"] > 0 for h in steps), steps
    assert (tmp_path / "out" / "adapter_config.json").is_file()

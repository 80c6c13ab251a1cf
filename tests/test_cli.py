"""The ``grpo-mem train`` main job: answer extraction and reward, settings validation, and one real training step on a
tiny Llama (SmolLM2's tokenizer) through the command line, patched and stock, compared with each other."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from grpo_mem.job.tasks import extract_answer, make_task
from grpo_mem.job.train import TrainSettings

# ---------------------------------------------------------------------------------------------------------------
# Answer extraction and the exact reward


@pytest.mark.parametrize(
    "completion, numeric, expected",
    [
        ("7", True, "7"),
        ("The final answer to this arithmetic problem is 7.", True, "7"),
        ("5 - 9 = -4", True, "-4"),
        ("1-6=-5", True, "-5"),
        ("It is 1,000 exactly.", True, "1000"),
        ("3.50", True, "3.50"),
        ("<answer> 12 </answer> and later 5", True, "12"),
        ("so \\boxed{-3} it is, not 4", True, "-3"),
        ("The answer is 8.<|im_end|>9", True, "8"),
        ("no digits here", True, None),
        ("", True, None),
        ("Answer: Paris.", False, "Paris"),
        ("thinking...\nThe answer is blue", False, "blue"),
        ("\n \n", False, None),
    ],
)
def test_extract_answer(completion, numeric, expected):
    assert extract_answer(completion, numeric=numeric) == expected


def test_extract_answer_rejects_non_str():
    with pytest.raises(TypeError, match="int"):
        extract_answer(7, numeric=True)


def test_reward_is_score_answer_of_the_extracted_answer():
    task = make_task("chain_sum", size=6, seed=3)
    assert task.numeric
    assert task.system  # a tuned system prompt for chain_sum
    reward = task.reward_func()
    assert reward.__name__ == "score_chain_sum"
    for i in range(len(task.data)):
        entry = task.data[i]
        answer = entry["answer"]
        wrong = str(int(answer) + 1)
        completions = [
            answer,
            f"The final answer to this arithmetic problem is {answer}.",
            [{"role": "assistant", "content": f"{entry['metadata']['expression']} = {answer}"}],
            wrong,
            "I cannot say.",
        ]
        got = reward(prompts=None, completions=completions, rg_index=[i] * len(completions))
        want = [task.data.score_answer(a, entry) for a in (answer, answer, answer, wrong, None)]
        assert got == want
        assert got[:3] == [1.0, 1.0, 1.0] and got[4] == 0.0 and got[3] < 1.0
        prompt = task.prompt(i)
        assert prompt[0] == {"role": "system", "content": task.system}
        assert prompt[1] == {"role": "user", "content": entry["question"]}
    with pytest.raises(ValueError, match="2 completions but 1"):
        reward(completions=["1", "2"], rg_index=[0])


def test_make_task_rejects_bad_input():
    with pytest.raises(ValueError, match="no_such_task"):
        make_task("no_such_task", size=2)
    with pytest.raises(ValueError, match="size"):
        make_task("chain_sum", size=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_generations": 3}, "16 must be a multiple of num_generations = 3"),
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"steps": 0}, "steps must be an int >= 1, got 0"),
        ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
        ({"learning_rate": -1e-5}, "learning_rate must be > 0"),
        ({"threads": 0}, "threads must be an int >= 1, got 0"),
    ],
)
def test_settings_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainSettings(**kwargs).validate()


# ---------------------------------------------------------------------------------------------------------------
# The offline model cache


def test_cache_root_and_offline(monkeypatch, tmp_path):
    from pathlib import Path

    from grpo_mem.job.smollm2 import cache_root, force_offline

    monkeypatch.setenv("GRPO_MEM_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("GRPO_MEM_CACHE")
    assert cache_root() == Path.home() / ".cache" / "grpo_mem"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    force_offline()
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "1"


def test_ensure_smollm2_reuses_a_finished_conversion_and_refuses_a_partial_one(tmp_path):
    from grpo_mem.job.smollm2 import ensure_smollm2, gguf_path

    assert gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_path().stat().st_size > 50 * 2**20
    done = tmp_path / "done"
    done.mkdir()
    (done / "config.json").write_text("{}")
    (done / "grpo_mem_conversion.json").write_text("{}")
    assert ensure_smollm2(done, verbose=False) == done  # nothing converted: the call returns the directory as is
    assert sorted(p.name for p in done.iterdir()) == ["config.json", "grpo_mem_conversion.json"]
    partial = tmp_path / "partial"
    partial.mkdir()
    with pytest.raises(FileExistsError, match="partial"):
        ensure_smollm2(partial, verbose=False)


# ---------------------------------------------------------------------------------------------------------------
# One step of the real job on a tiny model, through the command line


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama (hidden 32) with SmolLM2's tokenizer and chat template.

    Random weights would emit random tokens, almost never a number, so every reward would be 0 and the loss and
    gradient trivially 0. To give the run real advantages, a constant is put into embedding feature 0 (it survives
    the small random layers, so the final norm's feature 0 is about sqrt(hidden)) and the untied head gives the digit
    tokens and EOS large weights on that feature: completions are then short digit strings, sometimes right.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_mem.job.smollm2 import load_gguf_tokenizer

    tok = load_gguf_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    digits = tok.convert_tokens_to_ids([str(d) for d in range(10)])
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[digits, 0] = 1.4
        model.lm_head.weight[tok.eos_token_id, 0] = 1.2
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _train(model_dir, out_dir, *extra):
    """Run ``python -m grpo_mem.cli train`` for one step; return its summary.json."""
    cmd = [
        sys.executable, "-m", "grpo_mem.cli", "train", "--model", str(model_dir), "--steps", "1",
        "--num-generations", "8", "--per-device-train-batch-size", "16", "--max-completion-length", "6",
        "--learning-rate", "1e-3", "--seed", "1", "--output-dir", str(out_dir), *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", GRPO_MEM_CACHE=str(out_dir / "cache"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grpo-mem train:" in proc.stdout and "peak RSS" in proc.stdout
    assert not (out_dir / "cache").exists()  # --model given: nothing converted, nothing downloaded
    return json.loads((out_dir / "summary.json").read_text())


def _check_summary(s, patched):
    assert s["patched"] is patched
    assert s["task"] == "chain_sum" and s["settings"]["num_generations"] == 8
    assert len(s["steps"]) == 1
    row = s["steps"][0]
    assert row["step"] == 1
    assert 0.0 <= row["reward"] <= 1.0 and row["reward_std"] >= 0.0
    assert 1.0 <= row["completion_mean_length"] <= 6.0
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    assert row["learning_rate"] == pytest.approx(1e-3)
    # Memory: the step's peak is at least the RSS before training and, being sampled, at most the kernel's
    # whole-process high-water mark (1 MB slack for the two reads' rounding).
    assert 100.0 < s["rss_before_train_mb"] <= row["peak_rss_mb"] <= s["ru_maxrss_mb"] + 1.0
    assert s["totals"]["peak_rss_mb"] == row["peak_rss_mb"]
    assert 0.0 < row["step_time_s"] <= s["train_time_s"] <= s["wall_time_s"]
    assert s["conversion_time_s"] == 0.0
    assert s["totals"]["reward_first"] == s["totals"]["reward_last"] == row["reward"]
    png = open(s["files"]["png"], "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_train_one_step_patched_matches_stock(tiny_model_dir, tmp_path):
    patched = _train(tiny_model_dir, tmp_path / "patched")
    stock = _train(tiny_model_dir, tmp_path / "stock", "--no-patch")
    _check_summary(patched, True)
    _check_summary(stock, False)
    p, s = patched["steps"][0], stock["steps"][0]
    # The precondition of a meaningful comparison: some completions were rewarded, some not.
    assert 0.0 < s["reward"] < 1.0 and s["reward_std"] > 0.0 and s["frac_reward_zero_std"] < 1.0
    # Generation precedes scoring, so the same seed gives the same completions and rewards; the loss and the
    # gradient norm then come from grpo_mem's prompt-once path vs stock TRL's full forward: equal to fp32 rounding.
    assert p["reward"] == s["reward"] and p["reward_std"] == s["reward_std"]
    assert p["completion_mean_length"] == s["completion_mean_length"]
    assert s["grad_norm"] > 0.0
    assert p["loss"] == pytest.approx(s["loss"], rel=1e-4, abs=1e-6)
    assert p["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-4)
    assert patched["grpo_mem_warnings"] == []  # the patched run took the prompt-once path, no fallback


def test_cli_rejects_bad_flags(capsys):
    from grpo_mem.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "0"])
    assert exc.value.code == 2
    assert "expected an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--task-config", "[1, 2]"])
    assert "expected a JSON object" in capsys.readouterr().err
    assert main(["train", "--model", "/nonexistent/dir", "--steps", "1"]) == 2
    assert "/nonexistent/dir" in capsys.readouterr().err

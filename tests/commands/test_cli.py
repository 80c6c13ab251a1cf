"""The ``grpo-mem train`` main job: answer extraction and reward, settings validation, few-shot prompts, flags
generated from the settings, light package imports and the OpenMP policy, and real 2-step ``--compare`` runs through
the command line on a tiny Llama (SmolLM2's tokenizer, chat prompts) and a tiny sliding-window Gemma 3 (the same
tokenizer without chat template, plain-text prompts): stock and patched, compared with each other."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from grpo_mem.commands.tasks import extract_answer, make_task
from grpo_mem.commands.train_settings import TrainSettings

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


@pytest.mark.parametrize(
    "completion, expected",
    [
        (" 7\n\nQuestion: What is 2 + 2?\nAnswer: 4", "7"),
        ("\n\n -3 \nQuestion: 8", "-3"),
        (" no number\n5", None),
    ],
)
def test_extract_answer_first_line_of_a_base_model_continuation(completion, expected):
    """Plain-text prompts end in "Answer:"; a base model answers and goes on with new questions, whose numbers must
    not count."""
    assert extract_answer(completion, numeric=True, first_line=True) == expected


def test_plain_text_prompts_for_a_model_without_chat_template():
    chat = make_task("chain_sum", size=4, seed=3, few_shot=2)
    plain = make_task("chain_sum", size=4, seed=3, few_shot=2, chat=False)
    assert plain.system == chat.system and not plain.chat
    for i in range(4):
        question = plain.data[i]["question"]
        assert plain.prompt(i) == f"{plain.system}\n\nQuestion: {question}\nAnswer:"
        assert chat.prompt(i)[-1] == {"role": "user", "content": question}
        answer = plain.data[i]["answer"]
        assert plain.score(f" {answer}\n\nQuestion: 1 + 1 = ?\nAnswer: 2", i) == 1.0
        assert plain.score(" unsure\n" + answer, i) == 0.0  # the answer on a later line does not count
    assert plain.hf_dataset()["prompt"] == [plain.prompt(i) for i in range(4)]
    no_system = make_task("chain_sum", size=1, system="", chat=False)
    assert no_system.prompt(0) == f"Question: {no_system.data[0]['question']}\nAnswer:"


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
        ({"num_generations": 1}, "num_generations must be an int >= 2 .*, got 1"),
        ({"num_generations": 0}, "num_generations must be an int >= 2 .*, got 0"),
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

    from grpo_mem.commands.gguf_models import cache_root, force_offline

    monkeypatch.setenv("GRPO_MEM_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("GRPO_MEM_CACHE")
    assert cache_root() == Path.home() / ".cache" / "grpo_mem"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    force_offline()
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "1"


@pytest.mark.parametrize(
    "name, file", [("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"), ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf")]
)
def test_ensure_model_reuses_a_finished_conversion_and_refuses_a_partial_one(tmp_path, name, file):
    from grpo_mem.commands.gguf_models import GGUF_MODELS, ensure_model, gguf_path

    assert list(GGUF_MODELS) == ["smollm2-135m", "gemma3-270m"]
    assert gguf_path(name).name == file and gguf_path(name).stat().st_size > 50 * 2**20
    done = tmp_path / "done"
    done.mkdir()
    (done / "config.json").write_text("{}")
    (done / "grpo_mem_conversion.json").write_text("{}")
    assert ensure_model(name, done, verbose=False) == done  # nothing converted: the call returns the directory as is
    assert sorted(p.name for p in done.iterdir()) == ["config.json", "grpo_mem_conversion.json"]
    partial = tmp_path / "partial"
    partial.mkdir()
    with pytest.raises(FileExistsError, match="partial"):
        ensure_model(name, partial, verbose=False)
    with pytest.raises(ValueError, match="unknown GGUF model 'gemma-3'; known: smollm2-135m, gemma3-270m"):
        ensure_model("gemma-3", done)


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

    from grpo_mem.commands.gguf_models import load_gguf_tokenizer

    tok = load_gguf_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return _bias_to_digits_and_save(
        LlamaForCausalLM(config), tok, tmp_path_factory.mktemp("tiny_llama"), embed=4.0, digit=1.4, eos=1.2
    )


def _bias_to_digits_and_save(model, tok, path, *, embed: float, digit: float, eos: float):
    """Set embedding feature 0 of every token to ``embed`` and the head weights of the digit tokens and EOS on that
    feature to ``digit`` and ``eos`` (see ``tiny_model_dir``); save model and tokenizer into ``path``, return it."""
    digits = tok.convert_tokens_to_ids([str(d) for d in range(10)])
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = embed
        model.lm_head.weight[digits, 0] = digit
        model.lm_head.weight[tok.eos_token_id, 0] = eos
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


_TORCH_WATCH = """
import os, sys


class _TorchWatch:
    # Record OMP_WAIT_POLICY as it is when this process first imports torch (libgomp reads it then).
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            with open(os.environ["GRPO_MEM_TEST_OMP_LOG"], "a") as f:
                f.write(f"{os.getpid()} {os.environ.get('OMP_WAIT_POLICY', '<unset>')}\\n")
        return None


sys.meta_path.insert(0, _TorchWatch())
"""


def _cli_env(tmp_path, **extra):
    """Environment of a ``python -m grpo_mem.cli`` child: no OMP_WAIT_POLICY (the CLI must set it), and a
    ``sitecustomize`` that logs the variable's value into ``tmp_path/omp.log`` when each process imports torch."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_TORCH_WATCH)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = os.pathsep.join([str(hook), REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["GRPO_MEM_TEST_OMP_LOG"] = str(tmp_path / "omp.log")
    env.update(extra)
    return env


def _omp_log(tmp_path) -> list[str]:
    path = tmp_path / "omp.log"
    return [line.split()[1] for line in path.read_text().splitlines()] if path.exists() else []


STEPS = 2


def _train(model_dir, out_dir, *extra):
    """Run ``python -m grpo_mem.cli train`` for STEPS steps; return the top-level summary.json."""
    cmd = [
        sys.executable,
        "-m",
        "grpo_mem.cli",
        "train",
        "--device",  # the CPU path (auto would take a GPU where there is one)
        "cpu",
        "--model",
        str(model_dir),
        "--steps",
        str(STEPS),
        "--num-generations",
        "8",
        "--per-device-train-batch-size",
        "16",
        "--max-completion-length",
        "6",
        "--learning-rate",
        "1e-3",
        "--seed",
        "1",
        "--output-dir",
        str(out_dir),
        *extra,
    ]
    out_dir.mkdir(parents=True)
    env = _cli_env(out_dir, GRPO_MEM_CACHE=str(out_dir / "cache"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grpo-mem train:" in proc.stdout and "peak RSS" in proc.stdout
    assert not (out_dir / "cache").exists()  # --model given: nothing converted, nothing downloaded
    # The command line set the OpenMP wait policy before torch loaded (in every process that loaded it), without
    # re-executing itself.
    assert _omp_log(out_dir) and set(_omp_log(out_dir)) == {"PASSIVE"}
    return proc.stdout, json.loads((out_dir / "summary.json").read_text())


def _check_summary(s, patched, few_shot):
    assert s["patched"] is patched
    assert (s["device"], s["dtype"]) == ("cpu", "fp32") and "peak_cuda_allocated_mb" not in s["totals"]
    assert s["task"] == "chain_sum" and s["settings"]["num_generations"] == 8
    assert s["few_shot"] == few_shot and s["settings"]["few_shot"] == few_shot
    assert s["system_prompt"].count("\nQuestion: ") == few_shot
    tokens = s["prompt_tokens"]
    assert s["system_prompt_tokens"] < tokens["shared_prefix"] <= tokens["min"] <= tokens["max"]
    assert tokens["max"] + 6 <= s["max_position_embeddings"] == 256
    assert [r["step"] for r in s["steps"]] == list(range(1, STEPS + 1))
    for row in s["steps"]:
        assert 0.0 <= row["reward"] <= 1.0 and row["reward_std"] >= 0.0
        assert 1.0 <= row["completion_mean_length"] <= 6.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        assert row["learning_rate"] == pytest.approx(1e-3)
        # Memory: the step's peak is at least the RSS before training and, being sampled, at most the kernel's
        # whole-process high-water mark (1 MB slack for the two reads' rounding).
        assert 100.0 < s["rss_before_train_mb"] <= row["peak_rss_mb"] <= s["ru_maxrss_mb"] + 1.0
        assert 0.0 < row["step_time_s"] <= s["train_time_s"] <= s["wall_time_s"]
    assert s["totals"]["peak_rss_mb"] == max(r["peak_rss_mb"] for r in s["steps"])
    assert s["conversion_time_s"] == 0.0
    assert s["totals"]["reward_first"] == s["steps"][0]["reward"]
    assert s["totals"]["reward_last"] == s["steps"][-1]["reward"]
    _check_png(s["files"]["png"])


def _check_png(path):
    png = open(path, "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_train_compare_stock_and_patched_with_few_shot(tiny_model_dir, tmp_path):
    """``--compare --few-shot 2``: a stock and a patched run of the real job in fresh processes, same seeds; equal
    rewards at every step, loss and gradient norm equal to fp32 rounding; one summary and one figure of both."""
    out = tmp_path / "cmp"
    stdout, c = _train(tiny_model_dir, out, "--compare", "--few-shot", "2")
    assert c["compare"] is True and set(c["runs"]) == {"stock", "patched"}
    stock, patched = c["runs"]["stock"], c["runs"]["patched"]
    _check_summary(stock, False, 2)
    _check_summary(patched, True, 2)
    assert json.loads((out / "stock" / "summary.json").read_text()) == stock
    assert "--patch=false" in c["commands"]["stock"] and "--patch=true" in c["commands"]["patched"]
    assert not any(a.startswith("--compare") for a in c["commands"]["stock"] + c["commands"]["patched"])
    assert stock["system_prompt"] == patched["system_prompt"] and stock["prompt_tokens"] == patched["prompt_tokens"]
    # The precondition of a meaningful comparison: some completions were rewarded, some not.
    assert any(0.0 < r["reward"] < 1.0 and r["reward_std"] > 0.0 for r in stock["steps"])
    # Generation precedes scoring, so the same seed gives the same completions and rewards as long as the updates
    # agree; the loss and the gradient norm come from grpo_mem's prompt-once path vs stock TRL's full forward.
    for s, p in zip(stock["steps"], patched["steps"]):
        assert p["reward"] == s["reward"] and p["reward_std"] == s["reward_std"]
        assert p["completion_mean_length"] == s["completion_mean_length"]
        assert s["grad_norm"] > 0.0
        assert p["loss"] == pytest.approx(s["loss"], rel=1e-4, abs=1e-6)
        assert p["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-4)
    assert patched["grpo_mem_warnings"] == []  # the patched run took the prompt-once path, no fallback
    assert c["rewards_identical"] is True and c["reward_max_abs_diff"] == 0.0
    assert c["reward_abs_diff"] == [0.0] * STEPS and c["steps_compared"] == list(range(1, STEPS + 1))
    assert c["grad_norm_max_rel_diff"] < 1e-4
    r = c["ratios"]
    assert r["peak_rss_mb"] == pytest.approx(patched["totals"]["peak_rss_mb"] / stock["totals"]["peak_rss_mb"])
    assert r["step_time_median_s"] == pytest.approx(
        patched["totals"]["step_time_median_s"] / stock["totals"]["step_time_median_s"]
    )
    assert r["peak_rss_mb"] < 1.0  # stock TRL materialises (16, P+C, 49152) fp32 logits; the patch does not
    _check_png(c["files"]["png"])
    assert "max |Δ reward| per step = 0 (identical rewards)" in stdout and "patched / stock: peak RSS" in stdout


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    """A 2-layer random Gemma 3 (hidden 32; one sliding-window layer of window 16, one global layer) with SmolLM2's
    tokenizer stripped of its chat template, so the job builds plain-text prompts as for the real Gemma 3 270M base
    model. Its few-shot prompts (92 tokens) cross the window. Digits and EOS are made likely as in ``tiny_model_dir``
    (feature 0 of the final hidden state is about 3 here, not sqrt(32), hence larger head weights), so rewards are
    mixed."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from grpo_mem.commands.gguf_models import load_gguf_tokenizer

    tok = load_gguf_tokenizer()
    tok.chat_template = None
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    # Gemma multiplies embeddings by sqrt(hidden): feature 0 enters the layers as 4, as in tiny_model_dir.
    return _bias_to_digits_and_save(
        Gemma3ForCausalLM(config),
        tok,
        tmp_path_factory.mktemp("tiny_gemma3"),
        embed=4.0 / config.hidden_size**0.5,
        digit=2.6,
        eos=2.4,
    )


def test_train_compare_on_a_sliding_window_base_model_with_plain_prompts(tiny_gemma3_dir, tmp_path):
    """``--compare --few-shot 2`` on a tiny Gemma 3 without chat template: plain-text prompts that cross its
    16-token window; equal rewards, loss and gradient norm between stock TRL and the patch."""
    stdout, c = _train(tiny_gemma3_dir, tmp_path / "cmp", "--compare", "--few-shot", "2")
    stock, patched = c["runs"]["stock"], c["runs"]["patched"]
    _check_summary(stock, False, 2)
    _check_summary(patched, True, 2)
    assert stock["prompt_format"] == patched["prompt_format"] == "plain"
    assert stock["prompt_tokens"]["min"] > 16  # every prompt crosses the sliding window
    assert any(0.0 < r["reward"] < 1.0 and r["reward_std"] > 0.0 for r in stock["steps"])
    assert any(s["grad_norm"] > 0.0 for s in stock["steps"])
    for s, p in zip(stock["steps"], patched["steps"]):
        assert p["reward"] == s["reward"] and p["completion_mean_length"] == s["completion_mean_length"]
        assert (s["grad_norm"] > 0.0) == (s["frac_reward_zero_std"] < 1.0)  # zero advantages: zero gradient
        assert p["loss"] == pytest.approx(s["loss"], rel=1e-4, abs=1e-6)
        assert p["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-4)
    assert c["rewards_identical"] is True and c["grad_norm_max_rel_diff"] < 1e-4
    # The attention hook serves sliding windows: the patched run took the prompt-once path, with no fallback.
    assert patched["grpo_mem_warnings"] == []
    P = stock["prompt_tokens"]["max"]
    for r in patched["steps"]:
        assert r["paths"] and sum(r["paths"].get(k, 0.0) for k in ("tree", "group")) == 1.0
        # 2 prompts of 8 completions (width C <= 6) per step: each prompt forwarded at most once, not 8 times, so
        # the backbone's tokens over stock's, (2 P' + 16 C) / (16 (P + C)) with P' <= P, are at most this bound.
        assert 0.0 < r["token_ratio"] <= (P + 8 * 6) / (8 * (P + 6)) + 1e-12


def test_cli_reports_setup_errors(capsys):
    from grpo_mem.cli import main

    assert main(["train", "--model", "/nonexistent/dir", "--steps", "1"]) == 2
    assert "/nonexistent/dir" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Flags from the settings dataclass; light imports


def _parse(*argv):
    from grpo_mem.commands.train import build_parser

    return build_parser().parse_settings(list(argv))


def test_flags_come_from_the_settings_dataclass(capsys):
    import dataclasses

    from grpo_mem.commands.flags import to_argv

    assert _parse() == TrainSettings()
    with pytest.raises(SystemExit) as exc:
        _parse("--help")
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for f in dataclasses.fields(TrainSettings):
        flag = "--" + f.name.replace("_", "-")
        assert flag in help_text, flag
        assert "--" + f.name + " " not in help_text or "_" not in f.name  # one spelling per flag
    assert "--no-patch" in help_text and "--no-gradient-checkpointing" in help_text
    assert "(default: 16)" in help_text  # defaults shown

    s = _parse(
        "--no-patch",
        "--no-gradient-checkpointing",
        "--task-config",
        '{"min_terms": 3}',
        "--steps",
        "2",
        "--learning-rate",
        "3e-4",
        "--threads",
        "1",
        "--loss-type",
        "grpo",
    )
    assert (s.patch, s.gradient_checkpointing, s.task_config, s.steps) == (False, False, {"min_terms": 3}, 2)
    assert (s.learning_rate, s.threads, s.loss_type) == (3e-4, 1, "grpo")
    assert _parse("--patch", "false").patch is False and _parse("--patch").patch is True
    # The inverse: settings -> flags -> the same settings.
    assert to_argv(TrainSettings()) == []
    assert _parse(*to_argv(s)) == s
    odd = TrainSettings(system_prompt="-- answer briefly --", extra={"top_p": 0.9}, patch=False)
    assert _parse(*to_argv(odd)) == odd


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
        (["--threads", "-2"], "argument --threads: expected an integer >= 1, got -2"),
        (["--max-completion-length", "x"], "argument --max-completion-length: expected an integer, got 'x'"),
        (["--task-config", "[1, 2]"], "argument --task-config: expected a JSON object, got '[1, 2]'"),
        (["--task-config", "{"], "argument --task-config: not valid JSON"),
        (["--learning-rate", "fast"], "argument --learning-rate: invalid float value: 'fast'"),
        (["--num-generations", "3"], "16 must be a multiple of num_generations = 3"),
        (["--temperature", "0"], "temperature must be > 0, got 0.0"),
        (["--steps", "1", "--bogus"], "unrecognized arguments: --bogus"),
        (["--num-generations", "0"], "argument --num-generations: expected an integer >= 2, got 0"),
        (
            ["--num-generations", "1"],
            "argument --num-generations: expected an integer >= 2, got 1: GRPO requires at least 2 generations per "
            "prompt to calculate the advantages",
        ),
        # TRL's GRPOConfig built from the flags, before anything is loaded (the model directory does not exist)
        (["--model", "/nonexistent", "--extra", '{"nope": 1}'], "error: --extra: 'nope' is not a GRPOConfig option\n"),
        (
            ["--extra", '{"temprature": 1, "zz": 2}'],
            "--extra: 'temprature', 'zz' are not GRPOConfig options ('temprature': did you mean 'temperature'?)",
        ),
        (
            ["--model", "/nonexistent", "--loss-type", "nonsense"],
            "error: loss_type must be one of TRL's grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo; got 'nonsense'",
        ),
        (["--extra", '{"loss_type": "nonsense"}'], "got 'nonsense'"),
        (
            ["--compare", "--extra", '{"num_generations": 1}'],
            "GRPOConfig rejects these options: GRPO requires at least 2 generations per prompt",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_value(argv, message, capsys):
    from grpo_mem.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: grpo-mem train") and message in err, err
    error = err[err.index("grpo-mem train: error: ") :]
    assert error.count("\n") == 1 and error.endswith("\n"), err  # one line after the usage, no traceback


def test_unwritable_output_dir_fails_before_anything_is_built(tmp_path, monkeypatch, capsys):
    """``grpo-mem train`` (and ``--compare``) with an ``--output-dir`` that cannot be written (a file in the way,
    itself or as a parent; a directory refusing new files) prints one line and returns 2 before the model, the
    tokenizer or a child run is touched, and creates nothing."""
    from grpo_mem.commands import compare, flags, train

    def never(*args, **kwargs):
        raise AssertionError("built something before checking --output-dir")

    monkeypatch.setattr(train, "_setup", never)
    monkeypatch.setattr(train, "_make_trainer", never)
    monkeypatch.setattr(compare.subprocess, "run", never)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out, extra in ((blocker, []), (blocker / "run", []), (blocker / "run", ["--compare"])):
        assert train.main(["--output-dir", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert (
            err == f"grpo-mem train: error: --output-dir {out} is not writable ({blocker} is a file, not a directory)\n"
        )

    # run() and run_compare(), called as functions, check it too, before anything is built
    bad = str(blocker / "run")
    for fn, settings in (
        (train.run, TrainSettings(output_dir=bad)),
        (compare.run_compare, TrainSettings(output_dir=bad, compare=True)),
    ):
        with pytest.raises(ValueError, match=f"--output-dir {bad} is not writable"):
            fn(settings)

    def refuse(dir=None):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(flags.tempfile, "TemporaryFile", refuse)  # as root, chmod cannot make a directory refuse
    assert train.main(["--output-dir", str(tmp_path / "new" / "run")]) == 2
    assert capsys.readouterr().err == (
        f"grpo-mem train: error: --output-dir {tmp_path / 'new' / 'run'} is not writable ({tmp_path}: Permission denied)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_cli_commands(capsys):
    from grpo_mem.cli import COMMANDS, main

    assert "train" in COMMANDS
    for argv in ([], ["nope"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "train" in capsys.readouterr().out


def test_version_is_defined_once_and_printed(capsys):
    """``grpo-mem --version`` prints ``grpo_mem.__version__``, which setup.py installs (read from the package's
    ``__init__.py``, not written a second time)."""
    import re

    import grpo_mem
    from grpo_mem.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"grpo-mem {grpo_mem.__version__}\n"
    with open(os.path.join(REPO, "setup.py")) as f:
        assert not re.search(r"version=[\"']", f.read())
    proc = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, GRPO_MEM_SKIP_EXT="1"),
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == grpo_mem.__version__, proc.stderr


_LIGHT_IMPORTS = r"""
import os, sys

def heavy():
    return sorted(m for m in ("torch", "transformers", "trl") if m in sys.modules)

import grpo_mem
import grpo_mem.ops
assert heavy() == [], heavy()
assert set(grpo_mem.__all__) >= {"PatchHandle", "SharingSession", "patch_trl", "restore", "shared_prompt_logprobs", "verify"}
assert "patch_trl" in dir(grpo_mem)
try:
    grpo_mem.no_such_name
except AttributeError as exc:
    assert "no_such_name" in str(exc)
else:
    raise AssertionError("no AttributeError")
import grpo_mem.cli  # sets the OpenMP policy, imports no heavy library either
assert heavy() == [], heavy()
assert os.environ["OMP_WAIT_POLICY"] == sys.argv[1], os.environ["OMP_WAIT_POLICY"]
assert callable(grpo_mem.patch_trl) and callable(grpo_mem.restore) and callable(grpo_mem.shared_prompt_logprobs)
assert grpo_mem.PatchHandle.__name__ == "PatchHandle"
from grpo_mem.model.sharing import SharingSession
assert grpo_mem.SharingSession is SharingSession
from grpo_mem import patch_trl
from grpo_mem.patches.trl import patch_trl as direct
assert patch_trl is direct
from grpo_mem.ops import HAS_EXT, linear_logprobs
from grpo_mem.ops.logprobs import linear_logprobs as direct
assert linear_logprobs is direct and isinstance(HAS_EXT, bool)
print("ok", heavy())
"""


def test_import_grpo_mem_is_light_and_resolves_lazily():
    """``import grpo_mem`` / ``import grpo_mem.ops`` load neither torch, transformers nor TRL; the public names
    resolve on access; ``grpo_mem.cli`` sets OMP_WAIT_POLICY=PASSIVE, or keeps a value already set."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run(
        [sys.executable, "-c", _LIGHT_IMPORTS, "PASSIVE"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "ok"
    keep = "import os, grpo_mem.cli; print(os.environ['OMP_WAIT_POLICY'])"
    proc = subprocess.run(
        [sys.executable, "-c", keep],
        capture_output=True,
        text=True,
        env=dict(env, OMP_WAIT_POLICY="ACTIVE"),
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ACTIVE", proc.stderr[-3000:]


def test_module_entry_points_print_help():
    for cmd in (["-m", "grpo_mem.cli", "train", "--help"], ["-m", "grpo_mem", "train", "--help"]):
        proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("usage: grpo-mem train") and "--no-patch" in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# --few-shot and --compare: prompts, refusals, flags


def test_few_shot_system_prompt_holds_k_solved_examples_from_disjoint_seeds():
    import re

    import reasoning_gym

    from grpo_mem.commands.tasks import FEW_SHOT_SEED_OFFSET, few_shot_block, system_prompt

    size, seed, k = 32, 5, 16
    task = make_task("chain_sum", size=size, seed=seed, few_shot=k)
    plain = make_task("chain_sum", size=size, seed=seed)
    assert plain.examples == [] and plain.few_shot_seed is None and plain.system == system_prompt("chain_sum", True)
    # The training entries are unchanged; every prompt carries the same system message (the shared prefix).
    assert [task.data[i] for i in range(size)] == [plain.data[i] for i in range(size)]
    assert all(task.prompt(i)[0] == {"role": "system", "content": task.system} for i in range(size))
    assert task.system == plain.system + "\n\n" + few_shot_block(task.examples)
    # K examples, read back from the text, each a real entry of the few-shot dataset with its exact answer.
    pairs = re.findall(r"^Question: (.*)\nAnswer: (.*)$", task.system, flags=re.MULTILINE)
    assert len(pairs) == len(task.examples) == k
    assert task.few_shot_seed == seed + FEW_SHOT_SEED_OFFSET
    pool = reasoning_gym.create_dataset("chain_sum", size=8 * k, seed=task.few_shot_seed, **task.config)
    pool_seeds = {pool[i]["question"]: task.few_shot_seed + i for i in range(len(pool))}  # Random(seed + index)
    training_questions = {task.data[i]["question"] for i in range(size)}
    for (question, answer_text), entry in zip(pairs, task.examples):
        assert question == entry["question"] and answer_text == entry["answer"]
        assert question not in training_questions
        assert pool_seeds[question] not in range(seed, seed + size)  # generator seeds disjoint from training
        # Correct by reasoning-gym's own scorer, through the job's own answer extraction, and by arithmetic.
        assert pool.score_answer(extract_answer(answer_text, numeric=True), entry) == 1.0
        assert int(answer_text) == eval(entry["metadata"]["expression"])  # "a + b" / "a - b" of one-digit numbers
    assert len({q for q, _ in pairs}) == k  # no repeated example


def test_few_shot_refuses_what_the_task_cannot_supply():
    with pytest.raises(ValueError, match="few_shot must be an int >= 0, got -1"):
        make_task("chain_sum", size=4, few_shot=-1)
    # Two one-digit terms: 200 possible questions, so 300 distinct examples cannot exist.
    with pytest.raises(ValueError, match=r"--few-shot 300: only \d+ of 2400 chain_sum entries"):
        make_task("chain_sum", size=4, few_shot=300)


def test_few_shot_refuses_prompts_longer_than_the_model(tiny_model_dir, tmp_path, capsys):
    """The tiny model has 256 positions: 16 examples do not fit, and the error gives the token counts."""
    import re

    from grpo_mem.cli import main

    argv = [
        "train",
        "--model",
        str(tiny_model_dir),
        "--output-dir",
        str(tmp_path),
        "--steps",
        "1",
        "--max-completion-length",
        "6",
    ]
    assert main([*argv, "--few-shot", "16"]) == 2
    err = capsys.readouterr().err
    m = re.search(
        r"--few-shot 16 makes prompts of up to (\d+) tokens \(the system message with the examples: (\d+) "
        r"tokens\); with --max-completion-length 6 that exceeds the model's 256 positions "
        r"\(max_position_embeddings\): at most 250 prompt tokens fit",
        err,
    )
    assert m, err
    assert int(m.group(1)) > 250 and int(m.group(2)) < int(m.group(1))
    assert not (tmp_path / "summary.json").exists()


def test_compare_and_few_shot_flags(capsys):
    from grpo_mem.cli import main
    from grpo_mem.commands.compare import run_command
    from grpo_mem.commands.train import run

    s = _parse("--compare", "--few-shot", "3", "--steps", "2")
    assert (s.compare, s.few_shot, s.patch) == (True, 3, True)
    assert (_parse().compare, _parse().few_shot) == (False, 0)
    stock = run_command(s, False, "out/stock")
    assert stock[:4] == [sys.executable, "-m", "grpo_mem.cli", "train"]
    child = _parse(*stock[4:])
    assert (child.compare, child.patch, child.few_shot, child.steps, child.output_dir) == (
        False,
        False,
        3,
        2,
        "out/stock",
    )
    assert _parse(*run_command(s, True, "p")[4:]).patch is True
    with pytest.raises(ValueError, match="compare=True is grpo_mem.commands.compare.run_compare"):
        run(s)
    for argv, message in [
        (["--few-shot", "-1"], "argument --few-shot: expected an integer >= 0, got -1"),
        (["--few-shot", "two"], "argument --few-shot: expected an integer, got 'two'"),
        (["--compare", "--no-patch"], "compare runs both stock TRL and the patch; drop --no-patch"),
        (["--compare", "maybe"], "argument --compare: Truthy value expected: got maybe"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["train", *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err, err


def test_compare_runs_reports_reward_differences():
    from grpo_mem.commands.compare import compare_runs

    def summary(rewards, peaks, times):
        steps = [
            {"step": i + 1, "reward": r, "peak_rss_mb": m, "step_time_s": t, "loss": 0.0, "grad_norm": 1.0}
            for i, (r, m, t) in enumerate(zip(rewards, peaks, times))
        ]
        return {
            "steps": steps,
            "rss_before_train_mb": 100.0,
            "ru_maxrss_mb": max(peaks),
            "train_time_s": sum(times),
            "totals": {
                "peak_rss_mb": max(peaks),
                "step_time_median_s": sorted(times)[len(times) // 2],
                "step_time_mean_s": sum(times) / len(times),
            },
        }

    stock = summary([0.5, 0.25, 0.75], [500.0, 900.0, 900.0], [4.0, 4.0, 4.0])
    patched = summary([0.5, 0.5, 0.75], [300.0, 400.0, 500.0], [1.0, 2.0, 3.0])
    c = compare_runs(stock, patched)
    assert c["reward_abs_diff"] == [0.0, 0.25, 0.0] and c["reward_max_abs_diff"] == 0.25
    assert c["rewards_identical"] is False
    r = c["ratios"]
    assert r["peak_rss_mb"] == pytest.approx(500 / 900) and r["peak_rss_above_start_mb"] == pytest.approx(400 / 800)
    assert r["peak_rss_median_mb"] == pytest.approx(450 / 900)  # steps 2.. (step 1 is before AdamW's moments)
    assert r["step_time_median_s"] == pytest.approx(2 / 4) and r["train_time_s"] == pytest.approx(6 / 12)
    assert compare_runs(stock, stock)["rewards_identical"] is True


# ---------------------------------------------------------------------------------------------------------------
# The token saving the patch logs: read from log_history, printed, summarised, plotted


def _log_history():
    """A ``trainer.state.log_history`` as TRL 1.16 leaves it with ``logging_steps=1``: one entry per step, then the
    train summary; step 1 carries the patch's metrics, step 2 does not (a grpo_mem that does not log them)."""
    return [
        {
            "loss": 0.01,
            "grad_norm": 0.5,
            "learning_rate": 2e-5,
            "reward": 0.25,
            "reward_std": 0.4,
            "completions/mean_length": 5.0,
            "grpo_mem/backbone_tokens": 310.0,
            "grpo_mem/stock_tokens": 1240.0,
            "grpo_mem/token_ratio": 0.25,
            "grpo_mem/path/tree": 0.5,
            "grpo_mem/path/group": 0.0,
            "grpo_mem/path/stock": 0.5,
            "step": 1,
        },
        {
            "loss": 0.02,
            "grad_norm": 0.6,
            "learning_rate": 2e-5,
            "reward": 0.5,
            "reward_std": 0.5,
            "completions/mean_length": 4.0,
            "step": 2,
        },
        {"train_runtime": 9.0, "train_loss": 0.015, "step": 2},
    ]


def _run_summary(rows, patched, out):
    from grpo_mem.commands.report import totals

    return {
        "model": "/m/tiny",
        "task": "chain_sum",
        "patched": patched,
        "few_shot": 0,
        "settings": {"num_generations": 8},
        "prompt_tokens": {"min": 40, "max": 43, "mean": 41.5, "shared_prefix": 32},
        "steps": rows,
        "totals": totals(rows),
        "rss_before_train_mb": 600.0,
        "ru_maxrss_mb": 1000.0,
        "train_time_s": 9.0,
        "wall_time_s": 10.0,
        "conversion_time_s": 0.0,
        "grpo_mem_warnings": [],
        "files": {"json": str(out / "summary.json"), "png": str(out / "summary.png")},
    }


def test_token_saving_from_log_history_is_printed_summarised_and_plotted(tmp_path):
    from grpo_mem.commands.report import format_summary, plot_summary, step_rows

    records = [
        {"step": 1, "step_time_s": 2.0, "peak_rss_mb": 900.0},
        {"step": 2, "step_time_s": 3.0, "peak_rss_mb": 950.0},
    ]
    rows = step_rows(records, _log_history())
    assert [(r["step"], r["reward"], r["loss"], r["peak_rss_mb"]) for r in rows] == [
        (1, 0.25, 0.01, 900.0),
        (2, 0.5, 0.02, 950.0),
    ]
    assert (rows[0]["backbone_tokens"], rows[0]["stock_tokens"], rows[0]["token_ratio"]) == (310.0, 1240.0, 0.25)
    assert rows[0]["paths"] == {"tree": 0.5, "group": 0.0, "stock": 0.5}
    assert (rows[1]["backbone_tokens"], rows[1]["token_ratio"], rows[1]["paths"]) == (None, None, {})
    summary = _run_summary(rows, True, tmp_path)
    assert summary["totals"]["token_ratio_mean"] == 0.25  # over the steps that logged a ratio
    text = format_summary(summary).splitlines()
    assert text[2].endswith("backbone tokens / stock")
    assert text[3].endswith("tokens 0.250x stock (stock 0.50, tree 0.50)") and text[4].endswith("950    3.00  -")
    assert "backbone tokens / stock TRL's: mean over steps 0.250" in text
    plot_summary(summary, tmp_path / "summary.png")
    _check_png(tmp_path / "summary.png")
    # Stock TRL logs none of the keys: nothing about them is printed, the totals say None
    stock_rows = step_rows(
        records, [{k: v for k, v in e.items() if not k.startswith("grpo_mem/")} for e in _log_history()]
    )
    stock = _run_summary(stock_rows, False, tmp_path)
    assert stock["totals"]["token_ratio_mean"] is None and "backbone" not in format_summary(stock)
    plot_summary(stock, tmp_path / "stock.png")
    _check_png(tmp_path / "stock.png")


def test_compare_shows_the_patched_runs_token_saving(tmp_path):
    from grpo_mem.commands.compare import compare_runs, format_compare, plot_compare
    from grpo_mem.commands.report import step_rows

    records = [{"step": 1, "step_time_s": 2.0, "peak_rss_mb": 900.0}]
    patched = _run_summary(step_rows(records, _log_history()[:1]), True, tmp_path)
    stock = _run_summary(step_rows(records, [{"reward": 0.25, "step": 1}]), False, tmp_path)
    c = {
        "runs": {"stock": stock, "patched": patched},
        **compare_runs(stock, patched),
        "files": {"json": "s.json", "png": str(tmp_path / "cmp.png")},
    }
    assert c["token_ratio_mean"] == 0.25
    text = format_compare(c)
    assert text.splitlines()[2].endswith("patched tokens / stock") and text.splitlines()[3].endswith("  0.250")
    assert "tokens the patched run's backbone forwarded / stock TRL's: 0.250 (mean over steps)" in text
    plot_compare(c, tmp_path / "cmp.png")
    _check_png(tmp_path / "cmp.png")
    c = {"runs": {"stock": stock, "patched": stock}, **compare_runs(stock, stock), "files": c["files"]}
    assert c["token_ratio_mean"] is None and "backbone" not in format_compare(c)


_WITHOUT_CLI_EXTRA = r"""
import sys
for name in ("reasoning_gym", "gguf", "matplotlib", "datasets"):
    sys.modules[name] = None  # importing it now raises ModuleNotFoundError
import grpo_mem
import grpo_mem.model
import grpo_mem.patches.trl
assert callable(grpo_mem.shared_prompt_logprobs) and callable(grpo_mem.patch_trl)
from grpo_mem.cli import main
assert main(["train", "--steps", "1"]) == 2
print("ok")
"""


def test_library_imports_without_the_cli_extra():
    """The library needs none of the ``cli`` extra's packages; the command line says which extra to install."""
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_CLI_EXTRA], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert "grpo-mem train: error: reasoning_gym, gguf, datasets, matplotlib not installed" in proc.stderr
    assert 'pip install "grpo_mem[cli]"' in proc.stderr

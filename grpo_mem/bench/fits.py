"""Will ``grpo-mem bench``'s scoring step fit this machine? Its peak memory under stock TRL
(:func:`estimate_stock_memory`) and under grpo_mem (:func:`estimate_grpo_mem_memory`), estimated part by part from a
model's sizes (:mod:`grpo_mem.bench.estimate`) and the tokens each runs, the memory available
(:func:`available_memory_bytes`), and which providers run (:func:`plan_runs`): all of them where stock's estimate fits,
grpo_mem's alone where only stock's does not, none (the refusal, instead of swapping) where grpo_mem's does not fit
either. Units: bytes (GB = 10**9 bytes in messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_mem.bench.estimate import DTYPES, GB, ModelShape, activation_elements, kv_layer_bytes
from grpo_mem.bench.tokens import backbone_tokens

TRL_HEAD_TILE = 4096
"""Positions per tile of TRL 1.16's fused LM head (``trl/kernels/chunked_logprob.py``)."""
PROCESS_BASE_BYTES = 1.0 * GB
"""Resident memory of a worker before the op: Python, torch, transformers and TRL imported (about 0.6-1 GB here)."""
GRPO_MEM_HEAD_TILE = 4096 * 2048
"""fp32 elements of one tile of grpo_mem's fused LM head (``grpo_mem/ops/logprobs_cpp.py``: ``CPP_BLOCK_N`` positions by
``CPP_BLOCK_V`` vocabulary columns, the vocabulary block widening for fewer positions; 32 MiB)."""


@dataclass
class MemoryEstimate:
    """Estimated peak of a scoring step, in bytes, by part: stock TRL's (``method="trl"``,
    :func:`estimate_stock_memory`) or grpo_mem's (``"grpo_mem"``, :func:`estimate_grpo_mem_memory`, which adds the
    prompts' K/V gradients, ``prompt_kv``). ``tokens``: the backbone's tokens whose activations are alive at the peak;
    ``patch_rows``: the vision tower's."""

    weights: float
    gradients: float
    activations: float
    head: float
    process: float
    tokens: int
    vision: float = 0.0
    patch_rows: int = 0
    method: str = "trl"
    prompt_kv: float = 0.0

    @property
    def total(self) -> float:
        parts = (self.weights, self.gradients, self.activations, self.prompt_kv, self.vision, self.head)
        return sum(parts) + self.process

    def describe(self) -> str:
        """``"<total> GB (<each part>)"``, one line."""
        saved = f"saved activations {self.activations / GB:.1f} for {self.tokens} tokens"
        if self.method == "trl":
            saved += " per micro-batch"
        else:
            saved += (
                f" (each prompt once, one micro-batch's completions), prompt K/V gradients {self.prompt_kv / GB:.1f}"
            )
        vision = f"vision tower activations {self.vision / GB:.1f} for {self.patch_rows} patch rows, "
        return (
            f"{self.total / GB:.1f} GB (weights {self.weights / GB:.1f}, gradients {self.gradients / GB:.1f}, "
            f"{saved}, {vision if self.patch_rows else ''}LM head {self.head / GB:.1f}, process {self.process / GB:.1f})"
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
    _check_inputs(shape, dtype, image_tokens)
    tokens = micro * (P + C)
    head_rows = min(tokens if device == "cpu" else micro * C, TRL_HEAD_TILE)
    return _from_tokens(
        shape,
        "trl",
        dtype,
        device,
        tokens=tokens,
        patch_rows=micro * image_tokens * shape.rows_per_token,
        head=5 * head_rows * shape.vocab * 4,
    )


def estimate_grpo_mem_memory(
    shape: ModelShape,
    *,
    micro: int,
    groups: int,
    P: int,
    C: int,
    dtype: str = "fp32",
    device: str = "cpu",
    image_tokens: int = 0,
) -> MemoryEstimate:
    """Peak memory of grpo_mem's forward + backward of the step :func:`estimate_stock_memory` estimates for stock TRL,
    in bytes (an estimate): ``groups`` prompts of P tokens, their completions of C tokens in micro-batches of
    ``micro`` rows, one gradient-accumulation window (each prompt forwarded once for the window, as the TRL patch and
    ``grpo-mem bench`` run it).

    Derived as the stock estimate, part by part, from the tokens grpo_mem runs instead of stock's micro·(P + C):

    - weights, gradients and process: the same;
    - saved activations: the same per-token formula (:func:`~grpo_mem.bench.estimate.activation_elements`) for
      ``backbone_tokens(groups·P, micro, C)`` = groups·P + micro·(C − 1) tokens
      (:func:`~grpo_mem.bench.tokens.backbone_tokens`): every prompt of the window once, alive until the window's
      last backward (group sharing: tree sharing forwards no more), and one micro-batch's completions, each of C − 1
      tokens. One group of G rows in one micro-batch: P + G·(C − 1) tokens where stock has G·(P + C);
    - prompt K/V gradients (``prompt_kv``): the completion passes accumulate them for every layer before the prompt
      pass's backward, ``layers · 2·kv_dim · groups·P`` elements of ``dtype`` (:func:`~grpo_mem.bench.estimate.activation_bytes`'s
      ``prompt_kv`` without checkpointing);
    - vision tower: each prompt's image once, groups·image_tokens·rows_per_token patch rows (stock: every row's copy);
    - LM head: grpo_mem's fused head builds no (tokens × vocab) logits; two fp32 tiles of at most
      ``GRPO_MEM_HEAD_TILE`` elements are alive (the forward's and the backward's), ``2 · min(micro·C·vocab,
      GRPO_MEM_HEAD_TILE) · 4`` bytes, taken at the C++ head's tile on CUDA too.

    Not fitted to a measurement, and cautious: on the SmolLM2-135M shape of the README's ``grpo-mem bench`` run
    (P=512, G=8, C=64, fp32, CPU) it gives 2.55 GB above the weights and the process base where that run measured
    1.49 GB (stock: 13.27 GB estimated, 11.58 GB measured), so a shape it refuses may still fit.

    Raises ValueError as :func:`estimate_stock_memory`, and for ``micro`` or ``groups`` below 1.
    """
    _check_inputs(shape, dtype, image_tokens)
    for name, value in (("micro", micro), ("groups", groups)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    width = _width(dtype)
    return _from_tokens(
        shape,
        "grpo_mem",
        dtype,
        device,
        tokens=backbone_tokens(groups * P, micro, C),
        patch_rows=groups * image_tokens * shape.rows_per_token,
        head=2 * min(micro * C * shape.vocab, GRPO_MEM_HEAD_TILE) * 4,
        prompt_kv=shape.layers * kv_layer_bytes(shape, groups * P, width),
    )


def _check_inputs(shape: ModelShape, dtype: str, image_tokens: int) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if image_tokens < 0 or (image_tokens and not shape.rows_per_token):
        raise ValueError(
            f"image_tokens must be >= 0, and 0 for a text-only model, got {image_tokens} "
            f"({'no ' if not shape.rows_per_token else ''}vision tower)"
        )


def _width(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def _from_tokens(
    shape: ModelShape,
    method: str,
    dtype: str,
    device: str,
    *,
    tokens: int,
    patch_rows: int,
    head: float,
    prompt_kv: float = 0.0,
) -> MemoryEstimate:
    """The parts both scoring estimates share, from the backbone's ``tokens`` and the vision tower's ``patch_rows``
    alive at the peak: weights and gradients, saved activations (``activation_elements`` per token and layer), the
    vision tower's (``18·hidden + 5·intermediate`` of its block per patch row and block), the process base; the
    ``head`` and ``prompt_kv`` bytes as given."""
    width = _width(dtype)
    per_row_block = 18 * shape.vision_hidden + 5 * shape.vision_intermediate
    return MemoryEstimate(
        weights=shape.n_params * width,
        gradients=shape.n_params * width,
        activations=tokens * shape.layers * activation_elements(shape) * width,
        head=head,
        process=PROCESS_BASE_BYTES if device == "cpu" else 0.0,
        tokens=tokens,
        vision=patch_rows * shape.vision_layers * per_row_block * width,
        patch_rows=patch_rows,
        method=method,
        prompt_kv=prompt_kv,
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


def check_fits(estimate: MemoryEstimate, available: float, where: str, also: str = "") -> str | None:
    """None if ``estimate`` fits in ``available`` bytes, else the one-line message refusing the run: whose step
    (stock TRL's or grpo_mem's, after ``estimate.method``) needs what, ``also`` (a clause added after the memory
    available), and what to lower."""
    if estimate.total <= available:
        return None
    who = "stock TRL's" if estimate.method == "trl" else "grpo_mem's"
    return (
        f"refusing to run: {who} scoring step of this shape needs about {estimate.describe()}, more than "
        f"the {available / GB:.1f} GB available ({where}){also}. Lower --per-device-train-batch-size (saved "
        "activations grow with it), --prompt-length or --max-completion-length, use --dtype bf16, or pick a "
        "smaller --model."
    )


def plan_runs(stock: MemoryEstimate, grpo_mem: MemoryEstimate, available: float, where: str) -> str | None:
    """Which providers of a ``grpo-mem bench`` run fit ``available`` bytes (``where``: where that figure comes from).

    Returns:
        None when stock TRL's estimate fits: every provider runs. Otherwise the reason stock TRL is not run, on one
        line, ``"stock not run (estimated X GB > Y GB available)"``: grpo_mem's estimate fits, its providers run
        alone.

    Raises:
        ValueError: grpo_mem's estimate does not fit either: the refusal (:func:`check_fits` of grpo_mem's estimate,
            naming stock TRL's total too).
    """
    if check_fits(stock, available, where) is None:
        return None
    stock_needs = f", and stock TRL's about {stock.total / GB:.1f} GB"
    if (refusal := check_fits(grpo_mem, available, where, stock_needs)) is not None:
        raise ValueError(refusal)
    return f"stock not run (estimated {stock.total / GB:.1f} GB > {available / GB:.1f} GB available)"

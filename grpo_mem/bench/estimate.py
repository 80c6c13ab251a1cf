"""A model's sizes (:func:`model_shape`), what one token keeps for backward (:func:`activation_elements`), and the
peak memory per GPU of a whole GRPO training step on paper.

:func:`estimate_grpo_step` estimates that peak (ZeRO-3, gradient checkpointing, bf16) for stock TRL, grpo_mem, and
grpo_mem with sequence parallelism; :func:`longest_prompt` searches the longest prompt that fits a device under it. No
GPU measured these: they are estimates, each assumption stated. ``grpo-mem bench``'s scoring step on this machine,
stock TRL's against grpo_mem's, is estimated in :mod:`grpo_mem.bench.fits`. Units: bytes (GB = 10**9 bytes in
messages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from grpo_mem.bench.tokens import backbone_tokens

GB = 1e9
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""Weight and activation dtypes: the flag's spelling -> torch's name."""


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
    heads: int = 0
    kv_heads: int = 0
    """Query and K/V heads of the attention layers (0: not known; :func:`kv_share` then assumes the all-gather)."""


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
        heads=heads,
        kv_heads=kv_heads,
    )


def kv_share(shape: ModelShape, sp_size: int, exchange: str = "heads") -> float:
    """The share of a pass's K/V (and of their gradients) one rank of a sequence-parallel group of ``sp_size`` keeps:
    under the ``"heads"`` exchange (``grpo_mem.model.sequence_heads``) lcm(Hkv, k) / (k · Hkv), its slice of the K/V
    heads repeated to lcm(Hkv, k), where k divides the query heads; 1 otherwise (the all-gather: every rank keeps the
    whole K/V), and under ``"gather"``.

    Raises:
        ValueError: ``exchange`` is not ``"heads"`` or ``"gather"``.
    """
    if exchange not in ("heads", "gather"):
        raise ValueError(f"exchange must be 'heads' or 'gather', got {exchange!r}")
    k, h, hkv = sp_size, shape.heads, shape.kv_heads
    if exchange == "gather" or k == 1 or not hkv or h % k:
        return 1.0
    return math.lcm(hkv, k) / (k * hkv)


def activation_elements(shape: ModelShape) -> int:
    """Elements one token saves for backward in one decoder layer, ``8·hidden + 4·q_dim + 6·kv_dim +
    5·intermediate``: norm inputs and outputs, q/k/v before and after RoPE, the attention output and its log-sum-exp,
    the MLP's gate, up, activation and product (fitted to CPU peaks, see :func:`grpo_mem.bench.fits.estimate_stock_memory`)."""
    return 8 * shape.hidden + 4 * shape.q_dim + 6 * shape.kv_dim + 5 * shape.intermediate


# ------------------------------------------------------------------------------ a GRPO training step on GPUs (paper)
METHODS = ("trl", "grpo_mem")
"""Scoring methods of :func:`estimate_grpo_step`: stock TRL (every row forwards its prompt) and grpo_mem (each prompt
forwarded once per group, its K/V read in place by the group's completions)."""
ZERO3_BYTES_PER_PARAM = 16
"""Model-state bytes per parameter before ZeRO-3 shards them: bf16 weight (2) and gradient (2), fp32 master weight and
Adam's two moments (4 + 4 + 4); mixed-precision Adam as the ZeRO paper counts it (arXiv 1910.02054, section 3.1)."""
H100_BYTES = 80 * GB
"""The budget of one H100 80GB (it holds 80 GiB = 85.9·10**9 bytes; the difference is left as a margin)."""
DEVICE_RESERVE_BYTES = 8 * GB
"""Device memory besides the step's tensors: CUDA context and kernels, NCCL buffers, allocator fragmentation. A guess:
10 % of an 80 GB device."""
HEAD_WORKSPACE_BYTES = 2 * 4096 * 32768 * 4
"""The fused LM head's workspace: two fp32 tiles of 4096 positions by 32768 vocabulary columns (TRL 1.16's
``TOKEN_CHUNK_SIZE`` and ``_CHUNKED_LOGPROB_CHUNK_SIZE``); grpo_mem's fused head, which builds no logits either, is
taken at the same size."""
QWEN3_8B_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}
"""Qwen3-8B's sizes, from ``config.json`` of the Hugging Face Hub repository ``Qwen/Qwen3-8B``."""


def _check_step(method: str, P: int, C: int, G: int, sp_size: int, world: int) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for name, v in (("P", P), ("C", C), ("G", G), ("sp_size", sp_size), ("world", world)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if method == "trl" and sp_size != 1:
        raise ValueError(f"stock TRL's GRPOTrainer refuses sequence parallelism: sp_size must be 1, got {sp_size}")
    if world % sp_size:
        raise ValueError(f"sp_size must divide world={world}, got {sp_size}")


def rank_tokens(method: str, P: int, C: int, G: int, sp_size: int = 1) -> tuple[int, int]:
    """(prompt tokens, completion tokens) one rank runs through the trunk for one group of G completions of C tokens
    after a prompt of P tokens. Stock TRL: G·P and G·C (one pass of G rows). grpo_mem: ceil(P / k) and
    G·ceil((C − 1) / k) (:func:`~grpo_mem.bench.tokens.backbone_tokens`: the last completion token predicts nothing),
    with k = ``sp_size`` (each pass split along the sequence into k shards of ceil(T / k) tokens,
    ``grpo_mem.model.sequence_parallel``). Raises ValueError as :func:`estimate_grpo_step`."""
    _check_step(method, P, C, G, sp_size, sp_size)
    if method == "trl":
        return G * P, G * C
    return backbone_tokens(P, 0, C, sp_size=sp_size), backbone_tokens(0, G, C, sp_size=sp_size)


def kv_layer_bytes(shape: ModelShape, tokens: int, width: int) -> float:
    """Bytes of one layer's K and V for ``tokens`` tokens: ``2 · kv_dim · tokens · width``."""
    return 2 * shape.kv_dim * tokens * width


def activation_bytes(
    shape: ModelShape,
    *,
    method: str,
    P: int,
    C: int,
    G: int,
    sp_size: int = 1,
    width: int = 2,
    checkpointing: bool = True,
    exchange: str = "heads",
) -> dict[str, float]:
    """Activation memory of one rank at the peak of a group's scoring forward + backward, in bytes, by part.

    With T = this rank's prompt + completion tokens (:func:`rank_tokens`) and E = :func:`activation_elements`:

    - ``layer_inputs``: with ``checkpointing`` (transformers' non-reentrant gradient checkpointing, TRL's default),
      each layer's input and the final norm's, ``(layers + 1) · hidden · T`` elements; without it every layer's
      saved activations, ``layers · E · T``;
    - ``layer_activations``: with ``checkpointing``, one layer's activations recomputed in backward for the tokens of
      one pass (stock: T; grpo_mem: the larger of the prompt and completion passes), ``E`` per token; 0 without;
    - ``prompt_kv`` (grpo_mem): the prompt pass records every layer's K/V for the completion pass; under
      checkpointing they are kept outside the checkpointed layers, and their gradients, which the completion pass's
      backward accumulates for every layer before the prompt pass's backward consumes them, are as large: twice
      ``layers`` prompt K/V. Without checkpointing the K/V are among the saved activations, and only their gradients
      count. Under sequence parallelism (``sp_size`` k > 1) a rank records the whole prompt's (k·ceil(P / k) tokens)
      K/V at its share of the heads, :func:`kv_share` (1/k under the head exchange where k divides the K/V heads;
      the whole K/V under the all-gather);
    - ``kv_transient`` (k > 1): with checkpointing, the exchanged K/V of the layer being run (or re-run in backward)
      and its gradient, for the larger pass; without checkpointing, the completion pass's exchanged K/V of every layer
      (the prompt's are in ``prompt_kv``), saved for its backward; both at :func:`kv_share` of the heads.

    Attention is taken as a flash-style kernel (SDPA or FlashAttention: no P × P matrix is stored).

    Args:
        shape: the model's sizes (:func:`model_shape`).
        method: ``"trl"`` or ``"grpo_mem"``.
        P, C, G: prompt tokens, completion tokens, completions per prompt (one group per micro-batch).
        sp_size: sequence-parallel group size (grpo_mem only).
        width: bytes per activation element (2: bf16, 4: fp32).
        checkpointing: gradient checkpointing on.
        exchange: the sequence-parallel K/V exchange, ``"heads"`` (the default) or ``"gather"`` (:func:`kv_share`).

    Raises:
        ValueError: an unknown ``method`` or ``exchange``, a size below 1, ``sp_size`` > 1 with ``"trl"``.
    """
    tp, tc = rank_tokens(method, P, C, G, sp_size)
    E = activation_elements(shape)
    k = sp_size
    out = dict(layer_inputs=0.0, layer_activations=0.0, prompt_kv=0.0, kv_transient=0.0)
    if checkpointing:
        out["layer_inputs"] = (shape.layers + 1) * shape.hidden * (tp + tc) * width
        out["layer_activations"] = E * width * ((tp + tc) if method == "trl" else max(tp, tc))
    else:
        out["layer_inputs"] = shape.layers * E * (tp + tc) * width
    if method == "grpo_mem":
        out.update(_kv_parts(shape, tp, tc, k, width, checkpointing, kv_share(shape, k, exchange)))
    return out


def _kv_parts(
    shape: ModelShape, tp: int, tc: int, k: int, width: int, checkpointing: bool, share: float
) -> dict[str, float]:
    """``prompt_kv`` and ``kv_transient`` of :func:`activation_bytes` for grpo_mem, from this rank's prompt and
    completion tokens ``tp``, ``tc``, the sequence-parallel size ``k`` and the rank's ``share`` of the K/V heads."""
    prompt_layer = kv_layer_bytes(shape, k * tp, width) * share  # k·ceil(P/k): the whole (padded) prompt
    completion_layer = kv_layer_bytes(shape, k * tc, width) * share
    out = {"prompt_kv": shape.layers * prompt_layer * (2 if checkpointing or k > 1 else 1), "kv_transient": 0.0}
    if k > 1:
        out["kv_transient"] = (
            2 * max(prompt_layer, completion_layer) if checkpointing else shape.layers * completion_layer
        )
    return out


@dataclass
class StepEstimate:
    """Estimated peak memory per GPU of one GRPO training step, in bytes, by part (:func:`estimate_grpo_step`)."""

    method: str
    sp_size: int
    P: int
    C: int
    G: int
    model_states: float
    gathered_weights: float
    layer_inputs: float
    layer_activations: float
    prompt_kv: float
    kv_transient: float
    head: float
    reserve: float

    PARTS = (
        "model_states",
        "gathered_weights",
        "layer_inputs",
        "layer_activations",
        "prompt_kv",
        "kv_transient",
        "head",
        "reserve",
    )

    def parts(self) -> dict[str, float]:
        """``{part: bytes}`` in the order of ``PARTS``."""
        return {p: getattr(self, p) for p in self.PARTS}

    @property
    def total(self) -> float:
        return sum(self.parts().values())


def estimate_grpo_step(
    shape: ModelShape,
    *,
    method: str,
    P: int,
    C: int,
    G: int,
    sp_size: int = 1,
    world: int = 8,
    reserve: float = DEVICE_RESERVE_BYTES,
) -> StepEstimate:
    """Peak memory per GPU of one GRPO training step, in bytes: an estimate on paper (no GPU measured it).

    Setting: ``world`` GPUs under DeepSpeed ZeRO-3 (weights, gradients and Adam states sharded over all of them,
    sequence-parallel ranks included, as DeepSpeed's ALST does), bf16 weights and activations, gradient checkpointing
    on (TRL's default), ``beta = 0`` (TRL's default: no reference model), ``per_device_train_batch_size`` = one group
    (G completions of one prompt). Generation (vLLM or ``generate``) is not counted: its memory is that of the
    inference engine, the same for every method here. Parts:

    - ``model_states``: ``n_params · ZERO3_BYTES_PER_PARAM / world``;
    - ``gathered_weights``: ZeRO-3's working set, the bf16 weights and gradients of two decoder layers (the one running
      and the one prefetched) and of the LM head, gathered whole;
    - ``layer_inputs``, ``layer_activations``, ``prompt_kv``, ``kv_transient``: :func:`activation_bytes` (bf16,
      checkpointing on);
    - ``head``: ``HEAD_WORKSPACE_BYTES``, the fused LM head's tiles (no (tokens, vocab) logits, stock or grpo_mem);
    - ``reserve``: CUDA context, NCCL buffers, fragmentation (``DEVICE_RESERVE_BYTES`` by default).

    Args:
        shape: the model's sizes (:func:`model_shape`; ``QWEN3_8B_CONFIG`` for Qwen3-8B).
        method: ``"trl"`` (stock: every row forwards prompt + completion) or ``"grpo_mem"`` (the prompt forwarded once
            per group, its K/V shared in place, the fused head on completion positions).
        P, C, G: prompt tokens, completion tokens, completions per prompt.
        sp_size: sequence-parallel group size k (grpo_mem only): each rank runs 1/k of every pass's tokens and holds
            the whole prompt's K/V at its share of the heads (:func:`kv_share`, the head exchange).
        world: GPUs the model states are sharded over; ``sp_size`` must divide it.
        reserve: bytes set aside besides tensors.

    Raises:
        ValueError: an unknown ``method``, a size below 1, ``sp_size`` > 1 with ``"trl"``, ``sp_size`` not dividing
            ``world``.
    """
    _check_step(method, P, C, G, sp_size, world)
    width = 2
    layer_params = 2 * shape.hidden * (shape.q_dim + shape.kv_dim) + 3 * shape.hidden * shape.intermediate
    gathered = 2 * (2 * layer_params + shape.vocab * shape.hidden) * width
    act = activation_bytes(shape, method=method, P=P, C=C, G=G, sp_size=sp_size, width=width, checkpointing=True)
    return StepEstimate(
        method=method,
        sp_size=sp_size,
        P=P,
        C=C,
        G=G,
        model_states=shape.n_params * ZERO3_BYTES_PER_PARAM / world,
        gathered_weights=gathered,
        head=HEAD_WORKSPACE_BYTES,
        reserve=reserve,
        **act,
    )


def longest_prompt(
    shape: ModelShape,
    *,
    method: str,
    C: int,
    G: int,
    sp_size: int = 1,
    world: int = 8,
    budget: float = H100_BYTES,
    reserve: float = DEVICE_RESERVE_BYTES,
    limit: int = 1 << 24,
) -> int:
    """The largest prompt length P (tokens, at most ``limit``) whose :func:`estimate_grpo_step` total fits in
    ``budget`` bytes; 0 if not even P = 1 fits. Bisection: the estimate grows with P.

    Raises:
        ValueError: as :func:`estimate_grpo_step`.
    """

    def fits(P: int) -> bool:
        est = estimate_grpo_step(shape, method=method, P=P, C=C, G=G, sp_size=sp_size, world=world, reserve=reserve)
        return est.total <= budget

    if not fits(1):
        return 0
    lo, hi = 1, limit + 1  # fits(lo), and hi is the first length assumed not to fit
    if fits(limit):
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo

"""Whether the prompt-once path serves a model exactly, and what runs when it does not.

``unsupported_reason`` names why a model (or a call) cannot take the prompt-once path; ``warn_fallback`` reports the
fallback once per cause; ``full_sequence_logprobs`` is the stock-equivalent computation the fallback runs. This module
knows transformers, not TRL.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from . import attention_hook as attn_hook
from .head import completion_head

# Decoder-only text architectures whose layers take RoPE positions from `position_ids` and call the attention
# interface with `module.layer_idx`; each is exact here unless a per-call check below says otherwise.
SUPPORTED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "olmo", "olmo2", "phi3", "smollm3", "qwen3_moe"}
)
# RoPE variants whose frequencies do not depend on the sequence length (dynamic/NTK and longrope do).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
SUPPORTED_ATTENTION = frozenset({"sdpa", "eager", "flash_attention_2", "flash_attention_3"})


_warned: set[str] = set()
_fallback_records: list[list[str]] = []


def warn_fallback(cause: str) -> None:
    """Warn once per process and cause that the stock path is used (and tell ``recording_fallbacks`` blocks)."""
    for record in _fallback_records:
        record.append(cause)
    if cause not in _warned:
        _warned.add(cause)
        warnings.warn(f"grpo_mem: falling back to the stock full-sequence path: {cause}", stacklevel=3)


@contextlib.contextmanager
def recording_fallbacks():
    """Within the block, collect every cause ``warn_fallback`` is given (each time, not once per process) into the
    list it yields: ``grpo_mem.verify`` reports per micro-batch which path ran and why."""
    record: list[str] = []
    _fallback_records.append(record)
    try:
        yield record
    finally:
        _fallback_records.remove(record)



def _reentrant_checkpointing(model) -> bool:
    """Whether a checkpointed layer of ``model`` would run reentrant checkpointing (which drops kwarg gradients)."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            func = module._gradient_checkpointing_func
            if not isinstance(func, functools.partial) or func.keywords.get("use_reentrant", True) is not False:
                return True
    return False


def unsupported_reason(causal_lm, seq_len: int) -> str | None:
    """Why the prompt-once path cannot be exact for ``causal_lm`` on sequences of ``seq_len`` tokens, or None."""
    config = causal_lm.config
    if config.get_text_config() is not config:
        return "vision-language (multi-config) model"
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"architecture {config.model_type!r} is not among the supported {sorted(SUPPORTED_MODEL_TYPES)}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} (sliding-window or linear-attention layers)"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and seq_len > window:
        return f"sliding window {window} shorter than the sequence ({seq_len} tokens)"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type!r} depends on the sequence length"
    if attn_hook.inner_implementation(causal_lm) not in SUPPORTED_ATTENTION:
        return f"attention implementation {attn_hook.inner_implementation(causal_lm)!r}"
    if causal_lm.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout is active"
    if _reentrant_checkpointing(causal_lm):
        return "reentrant gradient checkpointing drops gradients of tensors passed as kwargs"
    return None



def full_sequence_logprobs(causal_lm, input_ids, attention_mask, request):
    """Stock-equivalent path: the whole prompt+completion sequence per row, the head on completion positions only."""
    C = request.logits_to_keep
    out = causal_lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out.last_hidden_state[:, -C - 1 : -1]
    return completion_head(causal_lm, hidden, input_ids[:, -C:], attention_mask[:, -C:], request)


@contextlib.contextmanager
def restoring_warnings():
    """Within the block fallbacks warn as usual; afterwards the causes first warned inside it are forgotten, so that
    they still warn once later (``grpo_mem.verify`` runs before training)."""
    before = set(_warned)
    try:
        yield
    finally:
        _warned.intersection_update(before)


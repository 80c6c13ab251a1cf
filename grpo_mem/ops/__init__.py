"""Kernels and their launchers. Each op family is a public module (``attention``, ``logprobs``: entry points, checks,
autograd Functions, plain-torch references) beside one module per backend (``<family>_torch``, ``attention_cpu``,
``logprobs_cpp``, and the CUDA library-kernel backends ``attention_sdpa`` and ``logprobs_cublas``; the CPU backend
module also holds what the family's backends share, so a CPU call runs one) and, for Triton, the ``@triton.jit``
kernels (``<family>_triton``), their tile tables
(``<family>_triton_tiles``) and their launchers (``<family>_triton_launch``). ``_backends.TABLE`` lists every op's
backends with what each can run; ``_backends.resolve`` picks one (on CUDA in the order of ``_op_times``, the measured
per-op times).

The names below are resolved on first access (PEP 562 ``__getattr__``), so ``import grpo_mem.ops`` loads neither torch
nor the kernels; ``grpo_mem.ops.linear_logprobs`` imports ``grpo_mem.ops.logprobs`` (and torch) when first used.
"""

from __future__ import annotations

import importlib

_EXPORTS: dict[str, str] = {
    "multi_region_attention": "attention",
    "multi_region_attention_ref": "attention",
    "shared_prefix_attention": "attention",
    "shared_prefix_attention_ref": "attention",
    "HAS_EXT": "_ext",
    "linear_logprobs": "logprobs",
    "linear_logprobs_ref": "logprobs",
    "selective_log_softmax": "logprobs",
    "selective_log_softmax_ref": "logprobs",
}
"""Public name -> submodule of this package that defines it."""

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    try:
        submodule = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

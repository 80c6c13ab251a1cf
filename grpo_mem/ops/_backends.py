"""Which backend runs an op: one table for every op, one place that reads the environment, one error type.

``resolve(op, backend, tensor)`` turns ``backend="auto"`` into the fastest backend that can run on ``tensor``'s device
and dtype, and checks an explicitly requested one. ``auto`` prefers, in order, the entries of ``TABLE[op]``: Triton
for CUDA tensors, the CPU kernels (``cpp``: this package's C++ extension; ``cpu``: ATen's fused CPU attention) for CPU
tensors, and the chunked torch code, which runs anywhere.

Triton runs on CUDA, or on CPU tensors under its interpreter, which works only if ``TRITON_INTERPRET=1`` was set
before triton was first imported (``triton.language``'s helpers are wrapped for the interpreter at import time).
"""

from __future__ import annotations

import importlib
import os

import torch

from . import _ext

__all__ = ["BackendUnavailableError", "TABLE", "aten_cpu_attention", "lazy", "resolve", "triton_status"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
# op -> backends in ``auto``'s order of preference, each with the dtypes it takes (None: any)
TABLE: dict[str, tuple[tuple[str, tuple | None], ...]] = {
    "linear_logprobs": (("triton", None), ("cpp", None), ("torch", None)),
    "selective_log_softmax": (("triton", None), ("cpp", None), ("torch", None)),
    "multi_region_attention": (("triton", _FLOAT), ("cpu", None), ("torch", None)),
}


def lazy(module: str, name: str):
    """A function that calls ``grpo_mem.ops.<module>.<name>``, importing the module on its first call (the Triton
    launchers: an op's table of backends names them without importing triton)."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class BackendUnavailableError(ValueError):
    """An explicitly requested backend cannot run these tensors here (the message says why)."""


def triton_status(device: torch.device) -> tuple[bool, str]:
    """Whether Triton kernels can run on ``device``, and why not."""
    try:
        import triton.language.standard as tl_standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as exc:  # pragma: no cover - triton ships with torch on Linux
        return False, f"triton is not importable ({exc})"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            return False, "tensors are on cpu; triton needs CUDA, or CPU tensors with TRITON_INTERPRET=1"
        if not isinstance(tl_standard.sum, InterpretedFunction):
            return False, "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import"
        return True, ""
    return False, f"tensors are on {device}; triton needs CUDA, or CPU tensors with TRITON_INTERPRET=1"


def aten_cpu_attention():
    """ATen's fused CPU attention kernels ``(forward, backward)`` (the forward returns the log-sum-exp), or None when
    this torch lacks them."""
    ops = torch.ops.aten
    try:
        return ops._scaled_dot_product_flash_attention_for_cpu, ops._scaled_dot_product_flash_attention_for_cpu_backward
    except (AttributeError, RuntimeError):  # pragma: no cover - present in every torch this package supports
        return None


def _why_not(name: str, tensor: torch.Tensor) -> str:
    """Empty when backend ``name`` can run on ``tensor``'s device, else the reason."""
    device = tensor.device
    if name == "triton":
        return triton_status(device)[1]
    if name == "cpp":
        if not _ext.HAS_EXT:
            return f"the grpo_mem._C extension is not loaded: {_ext.LOAD_ERROR}"
        return "" if device.type == "cpu" else f"it runs on CPU tensors only, got device {device}"
    if name == "cpu":
        if aten_cpu_attention() is None:
            return "this torch has no fused CPU attention kernels"
        return "" if device.type == "cpu" else f"it runs on CPU tensors only, got device {device}"
    return ""  # torch


def resolve(op: str, backend: str, tensor: torch.Tensor) -> str:
    """The backend that runs ``op`` on ``tensor`` (its device and dtype decide).

    Args:
        op: a key of ``TABLE``.
        backend: ``"auto"`` or one of ``TABLE[op]``'s backends.
        tensor: the op's main input.

    Raises:
        ValueError: unknown ``op`` or ``backend``.
        BackendUnavailableError: an explicitly requested backend cannot run ``tensor`` here.
    """
    if op not in TABLE:
        raise ValueError(f"op must be one of {sorted(TABLE)}, got {op!r}")
    names = [name for name, _ in TABLE[op]]
    if backend != "auto" and backend not in names:
        raise ValueError(f"backend for {op} must be 'auto' or one of {names}, got {backend!r}")
    for name, dtypes in TABLE[op]:
        if backend not in ("auto", name):
            continue
        why = _why_not(name, tensor)
        if not why and dtypes is not None and tensor.dtype not in dtypes:
            why = f"it takes {[str(d).removeprefix('torch.') for d in dtypes]}, got {tensor.dtype}"
        if not why and (backend != "auto" or name != "triton" or tensor.device.type == "cuda"):
            return name  # auto never picks the interpreter: it is a correctness tool, not a backend
        if backend == name:
            raise BackendUnavailableError(f"backend={name!r} cannot run {op} here: {why}")
    return "torch"

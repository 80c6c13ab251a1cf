"""Which backend runs an op: one table of every op's backends with what each can do, one function that reads it, one
error type.

``TABLE[op]`` lists the op's backends in ``auto``'s order of preference, each a :class:`Backend` carrying its forward
and backward (the Triton launchers and the CUDA library-kernel backends are imported on their first call), the input
dtypes it takes, the optional features of the op it computes and the tests of whether it can run on a device and a
shape. ``resolve(op, backend, tensor, needs, shape)`` turns ``backend="auto"`` into the first backend that runs
``tensor``'s device, dtype and shape and computes the features ``needs``, and checks an explicitly requested one.
On CUDA the Triton kernels first (the kernels a GPU run has checked against fp64: benchmarks/results/gpu), then the
library kernels (``sdpa``: ATen's FlashAttention-2 and memory-efficient attention; ``cublas``: the head as chunked
cuBLAS GEMMs with a Triton selective log-softmax; not yet run on a GPU, so ``auto`` takes them only where a measurement
put them first); then the CPU kernels (``cpp``: this package's C++ extension; ``cpu``: ATen's fused CPU attention),
then the chunked torch code, which runs anywhere and computes everything. On CUDA a committed table of measured per-op
times (``_op_times``) reorders ``auto``'s choice by what ran fastest on that GPU at that shape class; shapes and GPUs
it has not measured keep the table's order.

Triton runs on CUDA, or on CPU tensors under its interpreter, which works only if ``TRITON_INTERPRET=1`` was set
before triton was first imported (``triton.language``'s helpers are wrapped for the interpreter at import time).

The way back from the kernels: a process-wide preference (``GRPO_MEM_BACKEND=auto|triton|torch|cpp`` in the
environment, or ``patch_trl(backend=...)``, which takes precedence while its patch is active) that every call left at
``backend="auto"`` follows (``preferred``). ``"torch"`` runs every op through torch operations only, on any device
(Triton is then never imported by this package); ``"cpp"`` names the CPU kernels (this package's C++ head, ATen's
fused CPU attention); a preference that cannot run a call's tensors (``"triton"`` on CPU tensors without the
interpreter, ``"cpp"`` on CUDA tensors, fp64) leaves that call to ``auto``'s choice. ``RESOLVED`` records the backend
each op last resolved to, which ``verify`` reports. The names and the variable live in the torch-free
``_preference``, with which ``import grpo_mem`` refuses a misspelt ``GRPO_MEM_BACKEND``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import _ext, attention_cpu, attention_torch, logprobs_cpp, logprobs_torch
from ._preference import BACKEND_ENV, CHOICES, check_choice, env_preference

__all__ = [
    "BACKEND_ENV",
    "CHOICES",
    "Backend",
    "BackendUnavailableError",
    "RESOLVED",
    "TABLE",
    "check_choice",
    "env_preference",
    "lazy",
    "preferred",
    "resolve",
    "set_preference",
    "triton_status",
]

_OP_NAME = {"cpp": {"multi_region_attention": "cpu"}}
"""Preference -> op -> that op's backend of the same kind where its name differs (the CPU kernels of attention are
ATen's, named ``"cpu"`` in the table)."""

_PINNED: str | None = None  # set_preference's value (patch_trl's backend=); None: the environment decides

RESOLVED: dict[str, str] = {}
"""op -> the backend its latest call resolved to (what ran), for reports."""


def lazy(module: str, name: str):
    """A function that calls ``grpo_mem.ops.<module>.<name>``, importing the module on its first call (so the table
    names the Triton launchers without importing triton). Its ``target`` is ``(module, name)``."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.target = (module, name)
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


def _cpu_only(device: torch.device) -> str:
    return "" if device.type == "cpu" else f"it runs on CPU tensors only, got device {device}"


def _triton_here(device: torch.device) -> str:
    return triton_status(device)[1]


def _extension_here(device: torch.device) -> str:
    if not _ext.HAS_EXT:
        return f"the grpo_mem._C extension is not loaded: {_ext.LOAD_ERROR}"
    return _cpu_only(device)


def _aten_cpu_here(device: torch.device) -> str:
    if attention_cpu.aten_cpu_attention() is None:
        return "this torch has no fused CPU attention kernels"
    return _cpu_only(device)


def _anywhere(device: torch.device) -> str:
    return ""


def _fused_cuda_here(device: torch.device) -> str:
    """Empty where ATen's FlashAttention-2 runs on ``device`` (CUDA, compute capability 8.0 or newer), else why not."""
    if device.type != "cuda":
        return f"it runs on CUDA tensors only, got device {device}"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch was built without FlashAttention"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"FlashAttention-2 needs compute capability 8.0 or newer, got {torch.cuda.get_device_capability(device)}"
    return ""


def _flash_head_dim(q: torch.Tensor) -> str:
    """Empty where FlashAttention-2 takes q's head dim (a multiple of 8, at most 256), else why not."""
    d = q.shape[-1]
    return (
        ""
        if d % 8 == 0 and d <= 256
        else f"FlashAttention-2 takes head dims that are multiples of 8 up to 256, got {d}"
    )


def _cublas_here(device: torch.device) -> str:
    """Empty where the chunked cuBLAS head runs: its Triton selective log-softmax runs, and on CUDA this torch's
    ``mm`` takes ``out_dtype`` (fp32 products of bf16/fp16 operands)."""
    why = triton_status(device)[1]
    if not why and device.type == "cuda" and not hasattr(torch.ops.aten.mm, "dtype"):
        why = f"torch {torch.__version__} has no mm(..., out_dtype=) (torch >= 2.8)"
    return why


@dataclass(frozen=True)
class Backend:
    """One way to run an op.

    name: what ``backend=`` selects. forward, backward: the op's two halves on this backend (signatures per op: see
    the op's module). dtypes: the input dtypes it takes (None: any). features: the optional features of the op it
    computes (``"softcap"``, ``"sliding_window"``); ``resolve`` passes over a backend that lacks one the call asks for.
    why_not: device -> "" when it can run tensors on that device, else the reason. interpreted_on_cpu: it runs CPU
    tensors only under an interpreter (Triton's), a correctness tool that ``auto`` never picks. takes: the op's main
    tensor -> "" when its shape fits the backend's kernels, else the reason (None: every shape). host_checks: its
    argument checks may read values back to the host; False for the backends that never synchronise, whose checks
    then run on the device (``torch._assert_async``).
    """

    name: str
    forward: Callable
    backward: Callable
    dtypes: tuple[torch.dtype, ...] | None = None
    features: frozenset[str] = frozenset()
    why_not: Callable[[torch.device], str] = _anywhere
    interpreted_on_cpu: bool = False
    takes: Callable[[torch.Tensor], str] | None = None
    host_checks: bool = True


def _backend(name: str, module, op: str, **capabilities) -> Backend:
    """The :class:`Backend` ``name`` whose halves are ``<op>_fwd`` / ``<op>_bwd`` of ``module``: a module, or the name
    of one of this package's modules to import on the first call (the Triton launchers: triton loads only if used)."""
    if isinstance(module, str):
        return Backend(name, lazy(module, f"{op}_fwd"), lazy(module, f"{op}_bwd"), **capabilities)
    return Backend(name, getattr(module, f"{op}_fwd"), getattr(module, f"{op}_bwd"), **capabilities)


_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_ATTENTION_FEATURES = frozenset({"softcap", "sliding_window"})
_TRITON = dict(why_not=_triton_here, interpreted_on_cpu=True, host_checks=False)

TABLE: dict[str, tuple[Backend, ...]] = {
    "multi_region_attention": (
        _backend(
            "triton",
            "attention_triton_launch",
            "multi_region_attention",
            dtypes=_FLOAT,
            **_TRITON,
            features=_ATTENTION_FEATURES,
        ),
        _backend(
            "sdpa",
            "attention_sdpa",
            "multi_region_attention",
            dtypes=(torch.float16, torch.bfloat16),
            why_not=_fused_cuda_here,
            takes=_flash_head_dim,
            host_checks=False,
        ),
        _backend(
            "cpu",
            attention_cpu,
            "multi_region_attention",
            features=frozenset({"sliding_window"}),
            why_not=_aten_cpu_here,
        ),
        _backend("torch", attention_torch, "multi_region_attention", features=_ATTENTION_FEATURES),
    ),
    "linear_logprobs": (
        _backend("triton", "logprobs_triton_launch", "linear_logprobs", **_TRITON),
        _backend("cublas", "logprobs_cublas", "linear_logprobs", **dict(_TRITON, why_not=_cublas_here)),
        _backend("cpp", logprobs_cpp, "linear_logprobs", why_not=_extension_here),
        _backend("torch", logprobs_torch, "linear_logprobs"),
    ),
    "selective_log_softmax": (
        _backend("triton", "logprobs_triton_launch", "selective_log_softmax", **_TRITON),
        _backend("cpp", logprobs_cpp, "selective_log_softmax", why_not=_extension_here),
        _backend("torch", logprobs_torch, "selective_log_softmax"),
    ),
}
"""op -> its backends in ``auto``'s order of preference. The last of each op runs anywhere and computes every
feature, so ``auto`` always finds one."""


def _why_not(entry: Backend, tensor: torch.Tensor) -> str:
    """Empty when ``entry`` can run on ``tensor``'s device, dtype and shape, else the reason."""
    why = entry.why_not(tensor.device)
    if not why and entry.dtypes is not None and tensor.dtype not in entry.dtypes:
        why = f"it takes {[str(d).removeprefix('torch.') for d in entry.dtypes]}, got {tensor.dtype}"
    if not why and entry.takes is not None:
        why = entry.takes(tensor)
    return why


def set_preference(name: str | None) -> str | None:
    """Make ``name`` (one of ``CHOICES``) every op's preferred backend in this process, over ``GRPO_MEM_BACKEND``;
    None gives the decision back to the environment. Returns the previous pinned value (None when there was none), to
    restore it. Process-wide on purpose: a backward or a checkpointed layer's recomputation runs in autograd's threads
    and must resolve as its forward did.

    Raises:
        ValueError: ``name`` is not None and not one of ``CHOICES``.
    """
    global _PINNED
    if name is not None:
        check_choice(name)
    previous, _PINNED = _PINNED, name
    return previous


def preferred() -> tuple[str, str]:
    """The preferred backend of every op and where it comes from: ``(name, "patch_trl")`` when pinned by
    ``set_preference``, else ``(GRPO_MEM_BACKEND's value, "GRPO_MEM_BACKEND")``, else ``("auto", "default")``.

    Raises:
        ValueError: ``GRPO_MEM_BACKEND`` holds a value that is not one of ``CHOICES`` (checked at ``import grpo_mem``
            and by ``patch_trl``, and read again at every call: a value set later fails the first op, never ignored).
    """
    if _PINNED is not None:
        return _PINNED, "patch_trl"
    # env_preference's reading, inline: every op calls this, and a call into _preference would add a module to the
    # per-op path (tests/test_structure.py's TEXT_PATH); a bad value goes through it for its error
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if value and value not in CHOICES:
        env_preference()
    return (value, BACKEND_ENV) if value else ("auto", "default")


def resolve(
    op: str,
    backend: str,
    tensor: torch.Tensor,
    needs: frozenset[str] | set[str] = frozenset(),
    shape: tuple[int, ...] | None = None,
) -> str:
    """The backend that runs ``op`` on ``tensor`` (its device, dtype and shape decide) with the optional features
    ``needs``.

    ``auto`` follows the process's preference (``preferred``) where that backend can run ``tensor``; otherwise, and
    without a preference, it takes the first backend that runs ``tensor`` and computes every feature in ``needs``
    (never Triton's interpreter), in ``TABLE[op]``'s order, except on CUDA: there the backends measured for this GPU,
    op, dtype and shape class come first, fastest first (``_op_times``: the committed table of measured per-op times,
    read once), then the others in the table's order. An explicitly requested backend that cannot run ``tensor``
    raises; one that runs it but lacks a feature is passed over for the next backend of the table that has it (the
    cpu attention backend without soft-capping hands such calls to the torch backend).

    Args:
        op: a key of ``TABLE``.
        backend: ``"auto"`` or the name of one of ``TABLE[op]``'s backends.
        tensor: the op's main input.
        needs: optional features the call asks for (a subset of what the op's last backend computes).
        shape: the call's sizes that ``_op_times.shape_class`` reads (attention: (head dim, queries, longest region);
            the head: (tokens, hidden, vocabulary)); None: no measured order.

    Raises:
        ValueError: unknown ``op``, ``backend`` or feature in ``needs``; a ``GRPO_MEM_BACKEND`` that is not one of
            ``CHOICES``.
        BackendUnavailableError: an explicitly requested backend cannot run ``tensor`` here.
    """
    name = _resolve(op, backend, tensor, needs, shape)
    RESOLVED[op] = name
    return name


def _candidates(op: str, backend: str, tensor: torch.Tensor, shape) -> list[Backend]:
    """The backends ``_resolve`` tries in order: from the requested one on in the table's order; for ``auto`` on
    CUDA, the measured ones first (``_op_times.ranked``)."""
    entries = list(TABLE[op])
    if backend != "auto":
        return entries[[entry.name for entry in entries].index(backend) :]
    if tensor.device.type == "cuda" and shape is not None:
        from . import _op_times  # CUDA only: a CPU call never reads the table

        order = _op_times.ranked(op, [entry.name for entry in entries], tensor, shape)
        entries.sort(key=lambda entry: order.index(entry.name))
    return entries


def _resolve(op: str, backend: str, tensor: torch.Tensor, needs, shape=None) -> str:
    if backend == "auto" and op in TABLE:
        preference = preferred()[0]
        if preference != "auto":
            try:
                return _resolve(op, _OP_NAME.get(preference, {}).get(op, preference), tensor, needs)
            except BackendUnavailableError:
                pass  # the preferred backend cannot run these tensors: auto's choice
    if op not in TABLE:
        raise ValueError(f"op must be one of {sorted(TABLE)}, got {op!r}")
    if not set(needs) <= TABLE[op][-1].features:
        raise ValueError(f"needs for {op} must be a subset of {sorted(TABLE[op][-1].features)}, got {sorted(needs)}")
    names = [entry.name for entry in TABLE[op]]
    if backend != "auto" and backend not in names:
        raise ValueError(f"backend for {op} must be 'auto' or one of {names}, got {backend!r}")
    on_cpu = tensor.device.type == "cpu"
    for entry in _candidates(op, backend, tensor, shape):
        why = _why_not(entry, tensor)
        if entry.name == backend and why:
            raise BackendUnavailableError(f"backend={backend!r} cannot run {op} here: {why}")
        if why or not set(needs) <= entry.features:
            continue
        if entry.name == backend or not (on_cpu and entry.interpreted_on_cpu):
            return entry.name
    raise BackendUnavailableError(f"no backend of {op} runs {tensor.dtype} tensors on {tensor.device} with {needs}")

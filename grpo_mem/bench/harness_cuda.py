"""CUDA side of the benchmark harness: time and memory of an op on a GPU, as a ``measure.Measurement``.

Used by the ``--device cuda`` paths of ``benchmarks/bench_head.py``, ``benchmarks/bench_group.py`` and
``grpo-mem bench``; the rows go through ``results.measurement_rows`` (same CSV columns as on CPU, ``device`` = the
GPU's name).

- ``wall_time`` [s]: CUDA events recorded around each call on the current stream (``torch.cuda.Event(
  enable_timing=True)``, ``elapsed_time``), after ``warmup`` untimed calls; the GPU is idle at each call's start
  (``torch.cuda.synchronize()`` after ``setup``). ``cpu_time`` is not recorded on CUDA.
- ``peak_tensor`` [MB]: ``torch.cuda.max_memory_allocated()`` during one call minus ``torch.cuda.memory_allocated()``
  just before it (peak statistics reset first): the op's own peak allocation through PyTorch's caching allocator.
  The absolute peak (inputs and weights included) is returned as ``cuda_peak_allocated_bytes``.
"""

from __future__ import annotations

import gc
from typing import Any, Callable

from grpo_mem.bench.measure import Measurement

__all__ = ["cuda_device_name", "cuda_unavailable_reason", "measure_cuda"]


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device is usable, else the sentence to print before skipping."""
    try:
        import torch
    except ImportError:
        return "--device cuda: torch is not installed"
    if not torch.cuda.is_available():
        return (
            f"--device cuda: no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False); "
            "nothing measured"
        )
    return None


def cuda_device_name() -> str:
    """``"cuda (<device name>)"`` of the current device."""
    import torch

    return f"cuda ({torch.cuda.get_device_name()})"


def measure_cuda(
    fn: Callable[[], Any],
    *,
    setup: Callable[[], None] | None = None,
    warmup: int = 3,
    repeats: int = 20,
    memory_repeats: int = 1,
) -> tuple[Measurement, int]:
    """Time ``fn()`` with CUDA events and measure its peak CUDA allocation.

    Args:
        fn: the op on CUDA tensors, called with no arguments; its return value is dropped before the next call.
        setup: run before every call (e.g. dropping gradients), not measured.
        warmup, repeats, memory_repeats: untimed calls, timed calls (>= 1), calls under the memory statistics.

    Returns:
        (``Measurement`` with ``times_s`` and ``peak_tensor_bytes``, the absolute peak allocated bytes of the
        last memory call).

    Raises:
        RuntimeError: no CUDA device. ValueError: a count out of range.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(cuda_unavailable_reason())
    if warmup < 0 or repeats < 1 or memory_repeats < 0:
        raise ValueError(
            f"need warmup >= 0, repeats >= 1, memory_repeats >= 0; got {warmup}, {repeats}, {memory_repeats}"
        )
    setup = setup or (lambda: None)
    m = Measurement(warmup=warmup, threads=torch.get_num_threads())
    for _ in range(warmup):
        setup()
        out = fn()
        del out
    for _ in range(repeats):
        setup()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        del out
        m.times_s.append(start.elapsed_time(end) / 1e3)
    absolute = 0
    for _ in range(memory_repeats):
        setup()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        del out
        absolute = torch.cuda.max_memory_allocated()
        m.peak_tensor_bytes.append(absolute - base)
    return m, absolute

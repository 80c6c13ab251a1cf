"""Wall time, CPU time and peak memory of an op in the current process.

:func:`measure` (warm-up, timed calls, memory calls) and :func:`measure_once` (one call timed and measured at once, for
an op too slow to run twice) return a :class:`Measurement`: raw samples that
:func:`grpo_mem.bench.results.measurement_rows` turns into CSV rows.

Metrics (the ``metric`` column; units in the ``unit`` column):

- ``wall_time`` [s]: ``time.perf_counter`` around one call of the op, after ``warmup`` untimed calls; p20/p50/p80 over
  the timed repeats. No tracker or sampler runs during the timed calls.
- ``cpu_time`` [s]: user + system CPU seconds of the whole process (all threads) during the same timed calls
  (``resource.getrusage``). On a shared machine it moves less with other processes' load than wall time does.
- ``peak_rss_above_base`` [MB = 10**6 bytes]: the process's peak resident set size during one call minus its resident
  set size just before the call (after ``gc.collect()`` and ``malloc_trim(0)``). The peak is read from ``VmHWM`` after
  resetting it through ``/proc/self/clear_refs`` (Linux >= 4.0); where that is not possible a thread samples
  ``/proc/self/statm`` every millisecond instead (it can miss peaks shorter than that). This counts everything the op
  makes resident: tensors, kernels' internal scratch, allocator slack.
- ``peak_tensor`` [MB]: the largest total size of tensor storages created during the call and alive at the same time,
  seen by :class:`TensorMemoryTracker` (a ``TorchDispatchMode``). Storages made outside the dispatcher (scratch
  buffers inside a C++ kernel) are not seen; storages that exist before the call (weights, inputs) are not counted.

Timed calls run under glibc's default allocator settings. Before the memory calls the harness fixes glibc's mmap
threshold at 64 KiB (``mallopt(M_MMAP_THRESHOLD)``, which also stops its dynamic adjustment) and trims the heap, so
every allocation above 64 KiB is its own ``mmap``, returned to the OS on free, and RSS follows live memory.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import resource
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MB = 10**6  # bytes per MB in every memory metric
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------------------------------------- memory
def current_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (``/proc/self/statm``, field 2 times the page size)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def _read_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found in /proc/self/status")


def _reset_hwm() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; False if the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _read_hwm_bytes() <= current_rss_bytes() + 4 * PAGE_BYTES
    except OSError:
        return False


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_free_memory() -> None:
    """``gc.collect()`` then glibc ``malloc_trim(0)`` (a no-op where glibc is absent), so RSS reflects live memory."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def fix_mmap_threshold(nbytes: int = 65536) -> bool:
    """Make glibc serve every allocation above ``nbytes`` with its own ``mmap`` (freed straight back to the OS) and stop
    its dynamic threshold adjustment; True if glibc accepted it. Irreversible for the process."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


class PeakRSS:
    """Context manager measuring the peak RSS of this process inside the block, minus the RSS at entry.

    ``with PeakRSS() as p: op()`` then ``p.peak_above_base`` (bytes, >= 0), ``p.base`` (bytes), ``p.method``
    (``"vmhwm"`` or ``"sampler"``). Call :func:`release_free_memory` before entering for a clean base.
    """

    def __init__(self, sample_interval_s: float = 1e-3):
        self.sample_interval_s = sample_interval_s
        self.base = 0
        self.peak = 0
        self.peak_above_base = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            time.sleep(self.sample_interval_s)

    def __enter__(self) -> "PeakRSS":
        self.base = current_rss_bytes()
        self.peak = self.base
        if _reset_hwm():
            self.method = "vmhwm"
        else:
            self.method = "sampler"
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, current_rss_bytes())
        else:
            self.peak = _read_hwm_bytes()
        self.peak_above_base = max(0, self.peak - self.base)


class TensorMemoryTracker(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the block and alive at the same time.

    Usage: ``with TensorMemoryTracker() as t: op()`` then ``t.peak_bytes``; ``t.live_bytes`` is what is still alive
    (e.g. parameter gradients the op created). Every operator output that goes through the dispatcher (forward and,
    on CPU, backward, which runs on the calling thread) is attributed to its storage; a storage counts once however
    many views share it and is released when its last reference dies (``weakref.finalize``). Not counted: tensors
    existing before the block, outputs sharing an input's storage (views, in-place and ``out=`` ops), memory a C++
    kernel allocates without a tensor (scratch). Storages grown in place by ``resize_`` count at the size first seen.

    Implemented with ``torch.utils._python_dispatch.TorchDispatchMode`` (as torch's own
    ``torch.distributed._tools.mem_tracker`` does, re-written here).
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def _release(self, key: int) -> None:
        n = self._sizes.pop(key, 0)
        self.live_bytes -= n

    def _account(self, t, input_keys: set[int]) -> None:
        storage = t.untyped_storage()
        n = storage.nbytes()
        key = storage.data_ptr()
        # An output sharing an input's storage (view, in-place or out= op) allocated nothing new
        if n == 0 or key in self._sizes or key in input_keys:
            return
        self._sizes[key] = n
        self.live_bytes += n
        weakref.finalize(storage, self._release, key)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        input_keys = {
            x.untyped_storage().data_ptr()
            for x in tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor) and x.device.type != "meta"
        }
        out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self._account(leaf, input_keys)
        return out


# ------------------------------------------------------------------------------------------------------ measurement
def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(p50, p20, p80) of ``values`` with linear interpolation (numpy's default); NaNs if ``values`` is empty."""
    if not values:
        return (math.nan, math.nan, math.nan)
    v = sorted(values)

    def q(p: float) -> float:
        pos = p * (len(v) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    return (q(0.5), q(0.2), q(0.8))


@dataclass
class Measurement:
    """Raw samples of one op in one process. Times in seconds, memory in bytes."""

    times_s: list[float] = field(default_factory=list)
    cpu_times_s: list[float] = field(default_factory=list)
    peak_rss_above_base_bytes: list[int] = field(default_factory=list)
    peak_tensor_bytes: list[int] = field(default_factory=list)
    base_rss_bytes: int = 0
    rss_method: str = ""
    mmap_threshold_fixed: bool = False
    warmup: int = 0
    threads: int = 0

    def metrics(self) -> dict[str, tuple[str, tuple[float, float, float], int]]:
        """``{metric: (unit, (p50, p20, p80), n_samples)}`` for the CSV; memory in MB (10**6 bytes)."""
        out = {"wall_time": ("s", percentiles(self.times_s), len(self.times_s))}
        if self.cpu_times_s:
            out["cpu_time"] = ("s", percentiles(self.cpu_times_s), len(self.cpu_times_s))
        if self.peak_rss_above_base_bytes:
            out["peak_rss_above_base"] = (
                "MB",
                percentiles([b / MB for b in self.peak_rss_above_base_bytes]),
                len(self.peak_rss_above_base_bytes),
            )
        if self.peak_tensor_bytes:
            out["peak_tensor"] = (
                "MB",
                percentiles([b / MB for b in self.peak_tensor_bytes]),
                len(self.peak_tensor_bytes),
            )
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def measure(
    fn: Callable[[], Any],
    *,
    setup: Callable[[], None] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    min_repeats: int = 1,
    time_budget_s: float | None = None,
    memory_repeats: int = 1,
    track_tensors: bool = True,
) -> Measurement:
    """Time ``fn()`` and measure its peak memory in the current process.

    Order: ``warmup`` untimed calls; then timed calls (wall and CPU time), at most ``repeats``, stopping early once
    ``min_repeats`` are done and their total exceeds ``time_budget_s``; then (glibc's mmap threshold fixed, see the
    module docstring) ``memory_repeats`` calls under :class:`PeakRSS` (and :class:`TensorMemoryTracker` if
    ``track_tensors``), each from a freshly released base. ``setup()`` (e.g. dropping parameter gradients with
    ``model.zero_grad(set_to_none=True)``) runs before every call, outside timing and memory
    measurement. ``fn``'s return value is dropped before the next call.

    Args:
        fn: the op; called with no arguments. Runs on CPU tensors (no device synchronisation is done).
        setup: called before each call of ``fn``, not measured.
        warmup, repeats, min_repeats, memory_repeats: counts, ``warmup >= 0``, ``1 <= min_repeats <= repeats``,
            ``memory_repeats >= 0``.
        time_budget_s: seconds of timed calls after which to stop early (``None``: always ``repeats``).
        track_tensors: also run :class:`TensorMemoryTracker` during the memory calls.

    Returns:
        :class:`Measurement` with ``times_s`` and ``cpu_times_s`` (seconds), ``peak_rss_above_base_bytes`` and
        ``peak_tensor_bytes`` (bytes), one entry per call.

    Raises:
        ValueError: a count out of range, naming it.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not 1 <= min_repeats <= repeats:
        raise ValueError(f"min_repeats must be in [1, repeats={repeats}], got {min_repeats}")
    if memory_repeats < 0:
        raise ValueError(f"memory_repeats must be >= 0, got {memory_repeats}")

    setup = setup or (lambda: None)
    m = Measurement(warmup=warmup, threads=torch.get_num_threads())
    if track_tensors and memory_repeats:
        # Entering a dispatch mode the first time imports ~900 modules (~150 MB here): pay that before any base
        with TensorMemoryTracker():
            (torch.zeros(2) + 1).sum()
    for _ in range(warmup):
        setup()
        out = fn()
        del out
    _timed_calls(m, fn, setup, repeats, min_repeats, time_budget_s)
    if memory_repeats:
        m.mmap_threshold_fixed = fix_mmap_threshold()
    _memory_calls(m, fn, setup, memory_repeats, track_tensors)
    return m


def _timed_calls(m: Measurement, fn, setup, repeats: int, min_repeats: int, time_budget_s: float | None) -> None:
    """:func:`measure`'s timed calls, appended to ``m.times_s`` and ``m.cpu_times_s``."""
    total = 0.0
    for i in range(repeats):
        setup()
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        m.cpu_times_s.append(_cpu_seconds() - c0)
        del out
        m.times_s.append(dt)
        total += dt
        if time_budget_s is not None and i + 1 >= min_repeats and total >= time_budget_s:
            break


def _memory_calls(m: Measurement, fn, setup, memory_repeats: int, track_tensors: bool) -> None:
    """:func:`measure`'s memory calls, each from a freshly released base, appended to ``m``."""
    for _ in range(memory_repeats):
        setup()
        release_free_memory()
        tracker = TensorMemoryTracker() if track_tensors else None
        with PeakRSS() as rss:
            if tracker is not None:
                with tracker:
                    out = fn()
                    del out
            else:
                out = fn()
                del out
        m.base_rss_bytes = rss.base
        m.rss_method = rss.method
        m.peak_rss_above_base_bytes.append(rss.peak_above_base)
        if tracker is not None:
            m.peak_tensor_bytes.append(tracker.peak_bytes)


def measure_once(fn: Callable[[], Any], *, setup: Callable[[], None] | None = None) -> Measurement:
    """One call of ``fn()``, timed (wall and CPU time) and memory-measured (peak RSS above base) at once: for an op
    too slow to run twice (``grpo-mem bench``'s single forward + backward).

    Unlike :func:`measure`, the timed call runs with glibc's mmap threshold already fixed (every allocation above
    64 KiB a fresh ``mmap``, so RSS follows live memory): its page faults are part of the time, a few per cent for
    an op that allocates gigabytes. No :class:`TensorMemoryTracker` runs (its per-op Python dispatch would be timed
    too), so ``peak_tensor_bytes`` stays empty. ``setup()`` runs first, unmeasured.

    Returns:
        :class:`Measurement` with one entry each in ``times_s``, ``cpu_times_s`` (seconds) and
        ``peak_rss_above_base_bytes`` (bytes).
    """
    m = Measurement(warmup=0, threads=torch.get_num_threads())
    m.mmap_threshold_fixed = fix_mmap_threshold()
    if setup is not None:
        setup()
    release_free_memory()
    with PeakRSS() as rss:
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        cpu = _cpu_seconds() - c0
        del out
    m.times_s.append(dt)
    m.cpu_times_s.append(cpu)
    m.base_rss_bytes = rss.base
    m.rss_method = rss.method
    m.peak_rss_above_base_bytes.append(rss.peak_above_base)
    return m

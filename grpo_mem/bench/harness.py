"""Shared benchmark harness: isolated runs, wall time, peak memory, long-format CSV, plot, markdown table.

Every benchmark script in ``benchmarks/`` and ``grpo-mem bench`` build on this module (the sweep runner,
:mod:`grpo_mem.bench.sweep`, drives it for most of them). The pattern (after Liger-Kernel's
``benchmark/scripts/utils.py`` and ml-cross-entropy's ``benchmark/memory.py``, re-written here):

1. The script defines a *worker*: a module-level function ``worker(args: dict) -> dict`` that builds its inputs, calls
   :func:`measure` on the op and returns ``measurement.to_dict()`` (plus any JSON-serialisable extras, e.g. a checksum
   of the output so the parent can compare providers).
2. The parent calls :func:`run_isolated` once per (configuration, provider): the worker runs in a *fresh* Python
   process, so every peak-memory figure starts from that process's own base and no allocator state leaks between
   configurations. A run that fails, times out or goes over the RSS budget comes back as ``{"skipped": reason}``
   instead of raising.
3. The parent turns results into CSV rows with :func:`measurement_rows` / :func:`skipped_rows`, writes them with
   :func:`write_csv`, plots with :func:`plot_csv` and prints :func:`markdown_table` for docs/.

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

CSV columns, exactly: ``op, provider, mode, metric, unit, x_name, x_value, p50, p20, p80, config, device, timestamp,
version``. ``mode`` is ``fwd``, ``bwd`` or ``full`` (forward + backward); ``config`` is a JSON object of everything that
defines the configuration (and ``"skipped": reason`` on skipped rows, whose p-columns are empty); ``version`` holds the
grpo_mem, torch, transformers and trl versions.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime as _dt
import functools
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CSV_COLUMNS = (
    "op",
    "provider",
    "mode",
    "metric",
    "unit",
    "x_name",
    "x_value",
    "p50",
    "p20",
    "p80",
    "config",
    "device",
    "timestamp",
    "version",
)
MODES = ("fwd", "bwd", "full")
MB = 10**6  # bytes per MB in every memory metric
# The directory holding the ``grpo_mem`` package: the repository root in a source checkout (for :func:`versions`)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PAGE = os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------------------------------------- memory
def current_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (``/proc/self/statm``, field 2 times the page size)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


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
        return _read_hwm_bytes() <= current_rss_bytes() + 4 * _PAGE
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


# ----------------------------------------------------------------------------------------------- isolated processes
def _load_target(target: str) -> Callable[[dict], dict]:
    """``"module:function"`` (module importable on ``sys.path``) or ``"path/to/file.py:function"``."""
    if ":" not in target:
        raise ValueError(f"target must look like 'module:function' or 'file.py:function', got {target!r}")
    mod_name, fn_name = target.rsplit(":", 1)
    if mod_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(mod_name))[0], mod_name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{fn_name!r} is not a function of {mod_name!r}")
    return fn


def _child_rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _parent_import_path() -> str:
    """This process's ``sys.path`` as a ``PYTHONPATH`` value (absolute, in order, ``""`` read as the working
    directory), so that a child imports the same modules from the same places (``benchmarks/`` when the parent is a
    script there, a source checkout ahead of an installed copy)."""
    seen: list[str] = []
    for p in sys.path:
        p = os.path.abspath(p or os.getcwd())
        if p not in seen:
            seen.append(p)
    return os.pathsep.join(seen)


# The child's entry point. ``python -c`` (like ``-m``) puts the working directory first on ``sys.path``, where any stray
# module (a ``kernels.py``, a ``trl.py``) would shadow a library; the child drops it and imports only along the
# parent's path.
_CHILD_MAIN = "import sys; sys.path.pop(0); from grpo_mem.bench.harness import _worker_main; sys.exit(_worker_main())"


def _watch(proc, t0: float, *, timeout_s: float, rss_budget_mb: float, poll_s: float) -> tuple[int, str | None]:
    """Poll the child ``proc`` until it exits; kill it once over ``rss_budget_mb`` or ``timeout_s`` (counted from
    ``t0``). Returns (its peak sampled RSS in bytes, the reason it was killed or None)."""
    peak = 0
    while proc.poll() is None:
        rss = _child_rss_bytes(proc.pid)
        peak = max(peak, rss)
        reason = None
        if rss > rss_budget_mb * MB:
            reason = f"over the RSS budget of {rss_budget_mb:.0f} MB (killed at {rss / MB:.0f} MB)"
        elif time.perf_counter() - t0 > timeout_s:
            reason = f"over the time limit of {timeout_s:.0f} s"
        if reason:
            proc.kill()
            proc.wait()
            return peak, reason
        time.sleep(poll_s)
    return peak, None


def _failure(returncode: int, err_path: str) -> tuple[str, str]:
    """(reason, last 20 stderr lines) of a child that exited with ``returncode``: the exception line of its last
    traceback, else its last stderr line."""
    with open(err_path) as f:
        lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    exc = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", ln)]
    tail = exc[-1] if exc else (lines[-1] if lines else "(no stderr)")
    return f"worker exited with code {returncode}: {tail[:300]}", "\n".join(lines[-20:])


def run_isolated(
    target: str,
    args: dict,
    *,
    timeout_s: float = 1800.0,
    rss_budget_mb: float = 16000.0,
    threads: int = 2,
    env: dict[str, str] | None = None,
    poll_s: float = 0.05,
) -> dict:
    """Run ``target(args)`` in a fresh Python process and return its result dict.

    The child runs ``grpo_mem.bench.harness``'s worker entry (``--worker TARGET``) with ``args`` passed as a JSON
    file and this process's ``sys.path`` as its ``PYTHONPATH`` (nothing else on its path); it sets
    ``torch.set_num_threads(threads)`` (and ``OMP_NUM_THREADS``), runs ``target(args)`` and writes the returned dict as
    JSON. The parent polls the child's RSS every ``poll_s`` seconds and kills it once it exceeds ``rss_budget_mb``.

    Args:
        target: ``"module:function"`` (e.g. ``"grpo_mem.bench.group:worker"``, importable in this process) or
            ``"path/file.py:function"``. The function takes one dict and returns a JSON-serialisable dict.
        args: JSON-serialisable arguments for ``target``.
        timeout_s: wall-clock limit of the child in seconds.
        rss_budget_mb: RSS limit of the child in MB (10**6 bytes); the limit of what a configuration may use.
        threads: intra-op threads of the child.
        env: extra environment variables for the child.

    Returns:
        The child's dict, with ``"child_peak_rss_mb"`` (parent-sampled peak RSS of the child, MB) and
        ``"child_wall_s"`` added; or ``{"skipped": reason, "stderr_tail": ..., ...}`` if the child failed (reason
        ends with its exception line), timed out or went over the budget. Never raises for a failed child.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    child_env = dict(os.environ)
    child_env["OMP_NUM_THREADS"] = str(threads)
    child_env["TOKENIZERS_PARALLELISM"] = "false"
    child_env["PYTHONPATH"] = _parent_import_path()
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        child_env.update(env)
    with tempfile.TemporaryDirectory(prefix="grpo_mem_bench_") as tmp:
        args_path = os.path.join(tmp, "args.json")
        out_path = os.path.join(tmp, "out.json")
        err_path = os.path.join(tmp, "stderr.txt")
        with open(args_path, "w") as f:
            json.dump(args, f)
        cmd = [
            sys.executable,
            "-c",
            _CHILD_MAIN,
            "--worker",
            target,
            "--args",
            args_path,
            "--out",
            out_path,
            "--threads",
            str(threads),
        ]
        t0 = time.perf_counter()
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=child_env)
            peak, reason = _watch(proc, t0, timeout_s=timeout_s, rss_budget_mb=rss_budget_mb, poll_s=poll_s)
        wall = time.perf_counter() - t0
        stderr_tail = ""
        if reason is None and proc.returncode != 0:
            reason, stderr_tail = _failure(proc.returncode, err_path)
        if reason is None and not os.path.exists(out_path):
            reason = "worker wrote no result"
        if reason is not None:
            return {"skipped": reason, "stderr_tail": stderr_tail, "child_peak_rss_mb": peak / MB, "child_wall_s": wall}
        with open(out_path) as f:
            result = json.load(f)
    result.setdefault("child_peak_rss_mb", peak / MB)
    result.setdefault("child_wall_s", wall)
    return result


def _worker_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one benchmark worker (used by run_isolated).")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--args", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)
    with open(ns.args) as f:
        args = json.load(f)
    result = _load_target(ns.worker)(args)
    if not isinstance(result, dict):
        raise TypeError(f"worker {ns.worker} must return a dict, got {type(result).__name__}")
    with open(ns.out, "w") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------------------------------------------------- CSV rows
@functools.lru_cache(maxsize=None)
def versions() -> str:
    """``"grpo_mem=X;torch=Y;transformers=Z;trl=W"``; ``X`` from package metadata, else ``grpo_mem.__version__``, plus
    ``+g<commit>`` when the repository is a git checkout (``.dirty`` if ``grpo_mem/`` differs from that commit).
    Missing packages read ``none``."""
    from importlib import metadata

    def ver(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "grpo_mem":
                try:
                    return getattr(importlib.import_module("grpo_mem"), "__version__", "src")
                except Exception:
                    return "none"
            return "none"

    gm = ver("grpo_mem")
    # A source checkout only: an installed copy's directory may sit inside some unrelated repository
    if os.path.exists(os.path.join(_REPO, ".git")):
        try:
            sha = subprocess.run(
                ["git", "-C", _REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            if sha:
                dirty = subprocess.run(
                    ["git", "-C", _REPO, "status", "--porcelain", "--", "grpo_mem"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout.strip()
                gm += f"+g{sha}" + (".dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return ";".join([f"grpo_mem={gm}"] + [f"{n}={ver(n)}" for n in ("torch", "transformers", "trl")])


@functools.lru_cache(maxsize=None)
def device_name(threads: int | None = None) -> str:
    """``"cpu (<model name>, <threads> threads)"`` from ``/proc/cpuinfo``."""
    name = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu ({name}, {threads} threads)" if threads else f"cpu ({name})"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def measurement_rows(
    op: str,
    provider: str,
    mode: str,
    x_name: str,
    x_value: Any,
    measurement: Measurement | dict,
    config: dict,
    *,
    device: str | None = None,
    version: str | None = None,
    timestamp: str | None = None,
) -> list[dict]:
    """CSV rows (dicts keyed by :data:`CSV_COLUMNS`) for every metric in ``measurement``.

    ``config`` is stored as sorted JSON; the number of samples of each metric is added to it as ``"n"``.
    Raises ValueError for a ``mode`` outside :data:`MODES`.
    """
    _check_mode(mode)
    if isinstance(measurement, dict):
        measurement = Measurement.from_dict(measurement)
    device = device or device_name(measurement.threads or None)
    version = version or versions()
    timestamp = timestamp or _now()
    rows = []
    for metric, (unit, (p50, p20, p80), n) in measurement.metrics().items():
        cfg = dict(config, n=n)
        if metric == "peak_rss_above_base":
            cfg["rss_method"] = measurement.rss_method
            cfg["base_rss_mb"] = round(measurement.base_rss_bytes / MB, 1)
            cfg["mmap_threshold_fixed"] = measurement.mmap_threshold_fixed
        rows.append(
            dict(
                op=op,
                provider=provider,
                mode=mode,
                metric=metric,
                unit=unit,
                x_name=x_name,
                x_value=x_value,
                p50=p50,
                p20=p20,
                p80=p80,
                config=json.dumps(cfg, sort_keys=True),
                device=device,
                timestamp=timestamp,
                version=version,
            )
        )
    return rows


def skipped_rows(
    op: str,
    provider: str,
    mode: str,
    x_name: str,
    x_value: Any,
    config: dict,
    reason: str,
    *,
    metrics: Iterable[tuple[str, str]] = (
        ("wall_time", "s"),
        ("cpu_time", "s"),
        ("peak_rss_above_base", "MB"),
        ("peak_tensor", "MB"),
    ),
    device: str | None = None,
    version: str | None = None,
    timestamp: str | None = None,
) -> list[dict]:
    """Rows recording that ``provider`` could not run this configuration: empty p-columns, ``"skipped": reason`` in
    ``config``. ``metrics`` are ``(metric, unit)`` pairs."""
    _check_mode(mode)
    device = device or device_name()
    version = version or versions()
    timestamp = timestamp or _now()
    cfg = json.dumps(dict(config, skipped=reason), sort_keys=True)
    return [
        dict(
            op=op,
            provider=provider,
            mode=mode,
            metric=metric,
            unit=unit,
            x_name=x_name,
            x_value=x_value,
            p50="",
            p20="",
            p80="",
            config=cfg,
            device=device,
            timestamp=timestamp,
            version=version,
        )
        for metric, unit in metrics
    ]


def write_csv(rows: Iterable[dict], path: str, *, append: bool = False) -> None:
    """Write ``rows`` (dicts with exactly the keys of :data:`CSV_COLUMNS`) to ``path``, header first; NaN floats are
    written as empty cells.

    With ``append`` and an existing file, rows are added without a second header. Raises ValueError if a row's keys
    differ from :data:`CSV_COLUMNS`.
    """
    rows = list(rows)
    for r in rows:
        if set(r) != set(CSV_COLUMNS):
            raise ValueError(f"row keys must be exactly {CSV_COLUMNS}, got {sorted(r)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not (append and os.path.exists(path))
    with open(path, "w" if new else "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(
                {k: (("" if math.isnan(v) else repr(float(v))) if isinstance(v, float) else v) for k, v in r.items()}
            )


def read_csv(path: str) -> list[dict]:
    """Rows of a harness CSV as dicts; ``p50/p20/p80`` as floats (NaN when empty), ``config`` parsed from JSON."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("p50", "p20", "p80"):
            r[k] = float(r[k]) if r[k] not in ("", None) else math.nan
        r["config"] = json.loads(r["config"]) if r["config"] else {}
    return rows


# ------------------------------------------------------------------------------------------------- plot and tables
def plot_csv(
    csv_path: str,
    png_path: str,
    *,
    op: str | None = None,
    metrics: Sequence[str] = ("wall_time", "peak_rss_above_base"),
    panel_keys: Sequence[str] = (),
    log_x: bool = False,
    log_y: bool = False,
    title: str | None = None,
) -> None:
    """Plot a harness CSV to a PNG (matplotlib, Agg backend).

    One row of panels per metric; one column per distinct value of the ``config`` keys in ``panel_keys`` (e.g.
    ``("model", "G")``); in each panel one line per provider: p50 against ``x_value`` with a p20..p80 band. Skipped
    rows are left out; ``log_x`` (base 2) and ``log_y`` set log axes. Raises ValueError if no row matches ``op`` and
    ``metrics``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = [
        r
        for r in read_csv(csv_path)
        if (op is None or r["op"] == op)
        and r["metric"] in metrics
        and "skipped" not in r["config"]
        and not math.isnan(r["p50"])
    ]
    if not rows:
        raise ValueError(f"no measured rows for op={op!r}, metrics={list(metrics)} in {csv_path}")

    def panel_of(r):
        return tuple(r["config"].get(k) for k in panel_keys)

    panels = sorted(
        {panel_of(r) for r in rows},
        key=lambda t: tuple((0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)) for x in t),
    )
    mets = [m for m in metrics if any(r["metric"] == m for r in rows)]
    providers = sorted({r["provider"] for r in rows})
    fig, axes = plt.subplots(
        len(mets), len(panels), figsize=(3.6 * len(panels) + 1, 3.0 * len(mets)), squeeze=False, constrained_layout=True
    )
    for i, met in enumerate(mets):
        for j, pan in enumerate(panels):
            ax = axes[i][j]
            for prov in providers:
                pts = [r for r in rows if r["metric"] == met and r["provider"] == prov and panel_of(r) == pan]
                if not pts:
                    continue
                pts.sort(key=lambda r: float(r["x_value"]))
                xs = [float(r["x_value"]) for r in pts]
                ax.plot(xs, [r["p50"] for r in pts], marker="o", label=prov)
                ax.fill_between(xs, [r["p20"] for r in pts], [r["p80"] for r in pts], alpha=0.2)
            unit = next(r["unit"] for r in rows if r["metric"] == met)
            ax.set_xlabel(rows[0]["x_name"])
            ax.set_ylabel(f"{met} [{unit}]")
            if log_x:
                ax.set_xscale("log", base=2)
            if log_y:
                ax.set_yscale("log")
                # Plain numbers, minor ticks labelled when the panel spans few decades (matplotlib's thresholds)
                ax.yaxis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=False))
                ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.6)))
            xs_all = sorted({float(r["x_value"]) for r in rows})
            ax.set_xticks(xs_all)
            ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            if panel_keys:
                ax.set_title(", ".join(f"{k}={v}" for k, v in zip(panel_keys, pan)), fontsize=9)
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, floatfmt: str = ".3g") -> str:
    """A GitHub markdown table. Floats are formatted with ``floatfmt``, from 1000 up as integers (NaN and None print
    as ``-``); numeric
    columns (all cells numbers) are right-aligned. Raises ValueError if a row's length differs from ``headers``."""
    rows = [list(r) for r in rows]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row has {len(r)} cells, headers have {len(headers)}: {r}")

    def fmt(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 1000 else format(v, floatfmt)
        return str(v)

    numeric = [
        all(isinstance(r[j], (int, float)) or r[j] is None for r in rows) and bool(rows) for j in range(len(headers))
    ]
    cells = [[fmt(v) for v in r] for r in rows]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if numeric[j] else "---" for j in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_worker_main())

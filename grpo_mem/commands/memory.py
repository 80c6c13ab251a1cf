"""Per-step peak resident memory (RSS), peak CUDA allocation (on CUDA) and wall time of a training run.

The process RSS is sampled from ``/proc/self/statm`` by a background thread every ``interval_s`` seconds (default
5 ms); a :class:`StepStatsCallback` resets the running maximum at each optimizer-step boundary, so each step's peak
covers everything between ``on_step_begin`` and ``on_step_end`` of transformers' ``Trainer`` -- for TRL's GRPO that
includes generation, reward scoring, the log-prob forwards and the backward. Spikes shorter than the sampling interval
can be missed; ``ru_maxrss`` (:func:`ru_maxrss_mb`, the kernel's exact high-water mark for the whole process life) is
reported beside it as an upper bound.

Linux only (``/proc``). Units: MB = 2**20 bytes, seconds.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_MB = float(2**20)


def current_rss_mb() -> float:
    """Resident set size of this process now, in MB, read from ``/proc/self/statm`` (second field, pages)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES / _MB


def ru_maxrss_mb() -> float:
    """Peak RSS of this process since it started (``getrusage(RUSAGE_SELF).ru_maxrss``), in MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MB if sys.platform == "darwin" else peak / 1024.0  # bytes on macOS, KiB on Linux


class RssSampler:
    """Background thread that tracks the maximum RSS seen since the last :meth:`reset`.

    Use as a context manager or with :meth:`start` / :meth:`stop`. The thread is a daemon and sleeps between reads,
    so its cost is one small file read per interval.

    Args:
        interval_s: seconds between samples (float > 0), default 0.005.

    Raises:
        ValueError: ``interval_s`` <= 0.
        OSError: ``/proc/self/statm`` is unreadable (not Linux).
    """

    def __init__(self, interval_s: float = 0.005):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._peak = current_rss_mb()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0

    def _sample(self) -> None:
        rss = current_rss_mb()
        with self._lock:
            if rss > self._peak:
                self._peak = rss
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> "RssSampler":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="grpo_mem-rss", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def reset(self) -> None:
        """Start a new peak window at the current RSS."""
        rss = current_rss_mb()
        with self._lock:
            self._peak = rss

    def peak_mb(self) -> float:
        """Maximum RSS (MB) since the last :meth:`reset`, including a read made now."""
        self._sample()
        with self._lock:
            return self._peak

    def __enter__(self) -> "RssSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def make_step_stats_callback(sampler: RssSampler, cuda: bool = False):
    """A ``transformers.TrainerCallback`` recording, per optimizer step, its wall time and peak RSS, and with
    ``cuda`` the step's peak CUDA allocation.

    The returned callback has ``records``: a list of dicts ``{"step": int, "step_time_s": float, "peak_rss_mb":
    float}``, one per optimizer step (what the trainer logged at that step is in ``trainer.state.log_history``); with
    ``cuda`` also ``"peak_cuda_allocated_mb"``: ``torch.cuda.max_memory_allocated()`` of the current device (MB,
    tensors the caching allocator handed out, not the memory it reserved), its peak statistics reset at each step's
    start, read after a ``torch.cuda.synchronize()`` at its end; the step time is taken after that synchronisation
    too.
    """
    from transformers import TrainerCallback

    if cuda:
        import torch

    class StepStatsCallback(TrainerCallback):
        def __init__(self):
            self.records: list[dict] = []
            self._t0: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            sampler.reset()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
            record = {"step": state.global_step, "step_time_s": elapsed, "peak_rss_mb": sampler.peak_mb()}
            if cuda:
                record["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / _MB
            self.records.append(record)
            self._t0 = None

    return StepStatsCallback()

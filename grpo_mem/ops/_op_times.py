"""Measured per-op times that order ``auto``'s choice on CUDA: which backend ran an op fastest on this GPU, in this
dtype, at this shape class.

The table is ``op_times.csv`` beside this module (installed with the package), in the benchmarks' long format
(``grpo_mem.bench.results.CSV_COLUMNS``): one row per (op, backend = ``provider``, shape class = ``x_value``,
GPU = ``device``) with the forward + backward wall time (``mode`` "full", ``metric`` "wall_time", seconds in ``p50``).
``grpo_mem.bench.op_times`` measures and writes it; the GPU check's rows are committed to it. It is read once, at the
first ``auto`` resolution of a CUDA tensor (``_backends.resolve``); a CPU call never reads it.

A shape class names the sizes that decide which kernel is faster, rounded up to powers of two (one measurement
stands for its neighbours; the head dim and the hidden size are exact): attention ``"<dtype> d=<head dim>
q=<queries> k=<longest region>"``, the head ``"<dtype> n=<tokens> h=<hidden> v=<vocabulary>"``. A class, GPU or dtype
that no row measured gives no order: ``auto`` keeps ``TABLE``'s (Triton before the library kernels, which no GPU run has checked yet).
"""

from __future__ import annotations

import csv
import math
import os

import torch

__all__ = ["TABLE_PATH", "load", "ranked", "reset", "shape_class", "timings"]

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "op_times.csv")
"""The committed table (package data)."""

_SIZES = {
    "multi_region_attention": (("d", False), ("q", True), ("k", True)),
    "linear_logprobs": (("n", True), ("h", False), ("v", True)),
}
"""op -> the names of its shape's sizes and whether each is rounded up to a power of two."""

_TIMES: dict[tuple[str, str, str], dict[str, float]] | None = None
"""(device, op, shape class) -> {backend: seconds}, read from the table once (None: not read yet)."""

_DEVICE_NAMES: dict[int, str] = {}
"""CUDA device index -> ``"cuda (<name>)"``, the table's ``device`` column for it (read once per device)."""


def shape_class(op: str, dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """The shape class of a call of ``op`` (a key of ``_SIZES``) on ``dtype`` inputs of sizes ``shape``
    (attention: (head dim d, queries B·C, longest region S) -> ``"bfloat16 d=128 q=4096 k=2048"``; the head:
    (tokens N, hidden H, vocabulary V) -> ``"bfloat16 n=2048 h=2048 v=262144"``).

    Raises:
        ValueError: unknown ``op``, or ``shape`` of another length than the op's sizes.
    """
    if op not in _SIZES:
        raise ValueError(f"op must be one of {sorted(_SIZES)}, got {op!r}")
    names = _SIZES[op]
    if len(shape) != len(names):
        raise ValueError(f"{op} shape must be ({', '.join(n for n, _ in names)}), got {tuple(shape)}")
    parts = [f"{name}={_round(int(size)) if pow2 else int(size)}" for (name, pow2), size in zip(names, shape)]
    return " ".join([str(dtype).removeprefix("torch.")] + parts)


def _round(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0)."""
    return 0 if n <= 0 else 1 << math.ceil(math.log2(n))


def load(path: str = TABLE_PATH) -> dict[tuple[str, str, str], dict[str, float]]:
    """Read a table: ``{(device, op, shape class): {backend: p50 seconds}}`` from its rows of mode "full" and metric
    "wall_time" with a time (a later row of the same key and backend replaces an earlier one). A missing file is an
    empty table.

    Raises:
        ValueError: the file lacks one of the columns read (op, provider, mode, metric, x_value, p50, device).
    """
    times: dict[tuple[str, str, str], dict[str, float]] = {}
    if not os.path.exists(path):
        return times
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"op", "provider", "mode", "metric", "x_value", "p50", "device"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path} lacks the columns {sorted(missing)}")
        for row in reader:
            if row["mode"] == "full" and row["metric"] == "wall_time" and row["p50"] not in ("", None):
                times.setdefault((row["device"], row["op"], row["x_value"]), {})[row["provider"]] = float(row["p50"])
    return times


def timings() -> dict[tuple[str, str, str], dict[str, float]]:
    """The committed table, read on the first call (``load(TABLE_PATH)``)."""
    global _TIMES
    if _TIMES is None:
        _TIMES = load(TABLE_PATH)
    return _TIMES


def reset(times: dict | None = None) -> None:
    """Forget the table read (the next ``timings()`` reads it again), or use ``times`` (``load``'s form) in its place:
    for tests and for a process that has just measured."""
    global _TIMES
    _TIMES = times


def device_key(device: torch.device) -> str:
    """``"cuda (<name>)"`` of a CUDA device, the ``device`` column its rows carry (as ``grpo_mem.bench.harness_cuda``
    writes it); read once per device index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_NAMES:
        _DEVICE_NAMES[index] = f"cuda ({torch.cuda.get_device_name(index)})"
    return _DEVICE_NAMES[index]


def ranked(op: str, backends: list[str], tensor: torch.Tensor, shape: tuple[int, ...]) -> list[str]:
    """``backends`` (in the table's order) reordered for a call of ``op`` on ``tensor`` (a CUDA tensor: its device
    and dtype) with sizes ``shape``: the measured ones first, fastest first, then the rest in their order."""
    measured = timings().get((device_key(tensor.device), op, shape_class(op, tensor.dtype, shape)), {})
    known = sorted((name for name in backends if name in measured), key=measured.__getitem__)
    return known + [name for name in backends if name not in measured]

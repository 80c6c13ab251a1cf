"""The benchmark harness, one import for a benchmark script: isolated runs, wall time, peak memory, long-format CSV,
plot, markdown table. Its three parts live in their own modules and are re-exported here:

- :mod:`grpo_mem.bench.measure`: time and peak memory of an op in the current process (the metrics and how each is
  read);
- :mod:`grpo_mem.bench.isolate`: :func:`run_isolated`, a worker in a fresh process;
- :mod:`grpo_mem.bench.results`: the CSV's rows, writing and reading them, :func:`plot_csv`, :func:`markdown_table`.

Every benchmark script in ``benchmarks/`` and ``grpo-mem bench`` build on them (the sweep runner,
:mod:`grpo_mem.bench.sweep`, drives them for most of them). The pattern (after Liger-Kernel's
``benchmark/scripts/utils.py`` and ml-cross-entropy's ``benchmark/memory.py``, re-written here):

1. The script defines a *worker*: a module-level function ``worker(args: dict) -> dict`` that builds its inputs, calls
   :func:`measure` on the op and returns ``measurement.to_dict()`` (plus any JSON-serialisable extras, e.g. a checksum
   of the output so the parent can compare providers).
2. The parent calls :func:`run_isolated` once per (configuration, provider): the worker runs in a *fresh* Python
   process, so every peak-memory figure starts from that process's own base and no allocator state leaks between
   configurations. A run that fails, times out or goes over the RSS budget comes back as ``{"skipped": reason}``
   instead of raising.
3. The parent turns results into CSV rows with :func:`measurement_rows` / :func:`skipped_rows`, writes them with
   :func:`write_csv`, plots with :func:`plot_csv` and prints :func:`markdown_table` for the docs.
"""

from __future__ import annotations

from grpo_mem.bench.isolate import run_isolated
from grpo_mem.bench.measure import (
    MB,
    Measurement,
    PeakRSS,
    TensorMemoryTracker,
    current_rss_bytes,
    fix_mmap_threshold,
    measure,
    measure_once,
    percentiles,
    release_free_memory,
)
from grpo_mem.bench.results import (
    CSV_COLUMNS,
    MODES,
    device_name,
    markdown_table,
    measurement_rows,
    now_utc,
    plot_csv,
    read_csv,
    skipped_rows,
    versions,
    write_csv,
)

__all__ = [
    "CSV_COLUMNS",
    "MB",
    "MODES",
    "Measurement",
    "PeakRSS",
    "TensorMemoryTracker",
    "current_rss_bytes",
    "device_name",
    "fix_mmap_threshold",
    "markdown_table",
    "measure",
    "measure_once",
    "measurement_rows",
    "now_utc",
    "percentiles",
    "plot_csv",
    "read_csv",
    "release_free_memory",
    "run_isolated",
    "skipped_rows",
    "versions",
    "write_csv",
]

"""Fresh-process runs: :func:`run_isolated` runs a worker ``target(args) -> dict`` in a new Python process and returns
its dict, or why it was skipped (failed, over the time limit or the RSS budget), so that every peak-memory figure
starts from that process's own base and no allocator state leaks between configurations.

``python -m grpo_mem.bench.isolate --worker TARGET --args FILE --out FILE`` is the child's entry point
(:func:`_worker_main`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

import torch

from grpo_mem.bench.measure import MB, PAGE_BYTES


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (``torch.distributed.run``'s ``--master_port`` for a
    multi-process benchmark or test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            return int(f.read().split()[1]) * PAGE_BYTES
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
_CHILD_MAIN = "import sys; sys.path.pop(0); from grpo_mem.bench.isolate import _worker_main; sys.exit(_worker_main())"


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


def _child_env(threads: int, env: dict[str, str] | None) -> dict[str, str]:
    """The child's environment: this process's, with ``OMP_NUM_THREADS=threads``, tokenizers single-threaded, this
    process's import path as ``PYTHONPATH`` and unbuffered output (unless set), then ``env`` over it."""
    child_env = dict(os.environ)
    child_env["OMP_NUM_THREADS"] = str(threads)
    child_env["TOKENIZERS_PARALLELISM"] = "false"
    child_env["PYTHONPATH"] = _parent_import_path()
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        child_env.update(env)
    return child_env


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

    The child runs this module's worker entry (``--worker TARGET``) with ``args`` passed as a JSON file and this
    process's ``sys.path`` as its ``PYTHONPATH`` (nothing else on its path); it sets ``torch.set_num_threads(threads)``
    (and ``OMP_NUM_THREADS``), runs ``target(args)`` and writes the returned dict as JSON. The parent polls the
    child's RSS every ``poll_s`` seconds and kills it once it exceeds ``rss_budget_mb``.

    Args:
        target: ``"module:function"`` (e.g. ``"grpo_mem.bench.group_worker:worker"``, importable in this process) or
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
    with tempfile.TemporaryDirectory(prefix="grpo_mem_bench_") as tmp:
        args_path = os.path.join(tmp, "args.json")
        out_path = os.path.join(tmp, "out.json")
        err_path = os.path.join(tmp, "stderr.txt")
        with open(args_path, "w") as f:
            json.dump(args, f)
        cmd = [sys.executable, "-c", _CHILD_MAIN, "--worker", target, "--args", args_path, "--out", out_path]
        cmd += ["--threads", str(threads)]
        t0 = time.perf_counter()
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=_child_env(threads, env))
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
    """The child's entry: run ``--worker TARGET`` on the JSON ``--args`` file with ``--threads`` torch threads and
    write its dict to ``--out``. Raises TypeError if the worker returns something else than a dict."""
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


if __name__ == "__main__":
    sys.exit(_worker_main())

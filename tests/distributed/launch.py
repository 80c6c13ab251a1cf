"""Launch a worker script of this folder on 2 CPU processes (gloo) under a timeout.

Every multi-process test goes through :func:`launch`: ``python -m torch.distributed.run`` on a free local port, one
thread per rank, DeepSpeed's CPU accelerator, and ``PYTHONPATH`` giving the workers this folder, the tests' shared
helpers (``tests/``, ``tests/vlm/``) and the repository. A hang (ranks issuing different collectives) fails the
calling test after ``timeout`` seconds instead of stalling the suite. The CPU workarounds the workers apply are in
``docs/distributed.md`` ("Sharded training on CPU").
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mem.bench.isolate import free_port

HERE = Path(__file__).resolve().parent
TIMEOUT = 420  # seconds per 2-process run; a healthy one takes 15-60 s on 2 shared cores


def end_worker() -> None:
    """End a worker process once its work and its last collective are done, without the interpreter's teardown.

    A rank of the suite's 2-process runs has aborted twice on this machine (exit code -6, "terminate called without
    an active exception", a C++ thread still joinable when it is destroyed), in a DDP and an FSDP2 run, each passing
    when run again; interpreter teardown is where such threads are destroyed. The other rank then gets SIGTERM and
    the test fails. Output is flushed first; nothing is left to run after the worker's last barrier.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_env() -> dict:
    """The environment of a launched worker: the calling process's, with the workers' import path and CPU settings."""
    tests = HERE.parent
    path = os.pathsep.join(str(p) for p in (HERE, tests, tests / "vlm", tests.parent))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu")


def launch(script: str, *args, nproc: int = 2, timeout: float = TIMEOUT) -> str:
    """Run ``script`` (a file of this folder) on ``nproc`` ranks with ``args``; fail the test on a timeout or error.
    Returns what the ranks printed (stdout).

    Raises:
        pytest.fail.Exception: the run did not finish in ``timeout`` seconds, or a rank exited non-zero (the last
            4000 characters of stderr are shown).
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        "--master_addr=127.0.0.1",
        str(HERE / script),
        *map(str, args),
    ]
    try:
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        pytest.fail(f"{script} {args} did not finish in {timeout} s (ranks out of step?): {tail!r}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout

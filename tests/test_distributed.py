"""2-process DDP (gloo, CPU): patched and stock TRL runs end with the same weights and the same accounting."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(kind: str, patch: str, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{HERE.parent}", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "--master_addr=127.0.0.1", str(HERE / "dist_worker.py"), kind, patch, str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_two_process_training_matches_stock(tmp_path, kind):
    stock = _run(kind, "stock", tmp_path / "stock.json")
    ours = _run(kind, "patch", tmp_path / "ours.json")
    assert stock["world_size"] == ours["world_size"] == 2
    assert ours["grpo_mem_used"] and not stock["grpo_mem_used"]
    assert ours["global_step"] == stock["global_step"] == 3
    assert ours["lrs"] == stock["lrs"] and len(ours["lrs"]) == 3
    assert ours["epochs"] == stock["epochs"]
    for name, ref in stock["weights"].items():
        err = max(abs(a - b) for a, b in zip(ours["weights"][name], ref, strict=True))
        assert err <= 1e-5, f"{name}: max |diff| {err:.3e}"

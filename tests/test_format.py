"""The tree is formatted with the project's formatter (``ruff format``, configured in ``ruff.toml``)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tree_is_ruff_formatted():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, f"run `ruff format .` at the repository root:\n{out.stdout}{out.stderr}"

"""The shape of the house: module sizes, the import graph, what the text path runs and imports, what a plain
``patch_trl()`` installs, and the size of tracked files.

Every check reads the source tree or runs a small subprocess (seconds in all); none times anything.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_mem"

MAX_LINES = 500
"""The most lines a module of ``grpo_mem/`` may have, the Triton kernel files excepted."""

KERNEL_FILES = {"grpo_mem/ops/attention_triton.py", "grpo_mem/ops/logprobs_triton.py"}
"""Modules of ``@triton.jit`` kernel bodies, exempt from ``MAX_LINES`` (a kernel reads as one screen, unformatted)."""

MAX_WINDOW_LINES = 300
"""The most lines of ``grpo_mem/model/window.py``, the core executor of a step's prompt window."""

TEXT_PATH = {
    "grpo_mem.model.sharing",
    "grpo_mem.model.window",
    "grpo_mem.model.packed",
    "grpo_mem.model.last_layer",
    "grpo_mem.model.plan",
    "grpo_mem.model.host",
    "grpo_mem.model.store",
    "grpo_mem.model.attention_hook",
    "grpo_mem.model.head",
    "grpo_mem.model.forward",
    "grpo_mem.model.mechanisms",
    "grpo_mem.ops.attention",
    "grpo_mem.ops.attention_cpu",
    "grpo_mem.ops.logprobs",
    "grpo_mem.ops.logprobs_cpp",
    "grpo_mem.ops._backends",
}
"""The 16 modules whose code a warm ``shared_prompt_logprobs`` call and its backward may run on a plain attention
model on the CPU: the session, the window's core, its packed calls and their last layer, its plan and store, what
crosses between host and device, the attention hook, the LM head, the model's forward, the mechanism table (whose
presence tests choose a micro-batch's extensions), and the CPU kernels with their dispatch."""

OPTIONAL = (
    "grpo_mem.model.multimodal",
    "grpo_mem.model.vision_passes",
    "grpo_mem.model.linear_attention",
    "grpo_mem.model.router",
    "grpo_mem.model.sequence_parallel",
    "grpo_mem.model.sequence_heads",
    "grpo_mem.patches.trl_sp",
)
"""Modules of the image, linear-state, router and sequence-parallel extensions: a text model never imports them."""


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file: at the top, in functions, under ``TYPE_CHECKING``."""
    tree = ast.parse(modules[name].read_text())
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            found |= {f"{source}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_module_sizes():
    """No module over ``MAX_LINES`` lines but the kernel files; the window's core under ``MAX_WINDOW_LINES``."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    over = {f: n for f, n in sizes.items() if n > MAX_LINES and f not in KERNEL_FILES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
    assert sizes["grpo_mem/model/window.py"] < MAX_WINDOW_LINES, sizes["grpo_mem/model/window.py"]


def test_no_import_cycle():
    """The package's import graph, type-only and function-level imports included, has no cycle (a package's
    ``__init__`` is a module like the others; ``importlib`` calls by name are not imports)."""
    modules = _modules()
    graph = {name: _imports(name, modules) for name in modules}
    assert _cycles(graph) == []


def test_cycle_finder_sees_a_type_only_cycle(tmp_path):
    """The graph reader counts an ``if TYPE_CHECKING:`` import and a function-level one (a cycle through them is
    found)."""
    a = tmp_path / "a.py"
    b = tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    b.write_text("def f():\n    from . import a\n")
    modules = {"grpo_mem.x.a": a, "grpo_mem.x.b": b}
    graph = {name: _imports(name, modules) for name in modules}
    assert graph == {"grpo_mem.x.a": {"grpo_mem.x.b"}, "grpo_mem.x.b": {"grpo_mem.x.a"}}
    assert _cycles(graph) == [["grpo_mem.x.a", "grpo_mem.x.b"]]


_TEXT_CALL = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    import grpo_mem

    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    G, P, C = 4, 6, 5
    ids = torch.randint(1, 64, (G, P + C))
    ids[:, :P] = ids[:1, :P]
    mask = torch.ones_like(ids)

    def step():
        logps = grpo_mem.shared_prompt_logprobs(model, ids, mask, C)[0]
        logps.sum().backward()
        return logps

    first = step()
    ran = set()

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("grpo_mem"):
                ran.add(name)

    sys.setprofile(profile)
    second = step()
    sys.setprofile(None)
    imported = sorted(m for m in sys.modules if m.startswith("grpo_mem"))
    json.dump(dict(ran=sorted(ran), imported=imported, same=bool(torch.equal(first, second))), sys.stdout)
    """
)


def test_text_path_modules():
    """A warm ``shared_prompt_logprobs`` call and its backward on a plain Llama run code of ``TEXT_PATH`` only (at
    most 16 modules); scoring imports none of the image, linear-state, router and sequence-parallel modules."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), GRPO_MEM_BACKEND="auto")
    out = subprocess.run(
        [sys.executable, "-c", _TEXT_CALL], check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout)
    assert seen["same"]
    assert set(seen["ran"]) <= TEXT_PATH, sorted(set(seen["ran"]) - TEXT_PATH)
    assert len(seen["ran"]) <= 16
    assert not set(OPTIONAL) & set(seen["imported"]), sorted(set(OPTIONAL) & set(seen["imported"]))


def test_plain_patch_leaves_sequence_parallelism_out():
    """``patch_trl()`` without sequence parallelism imports nothing of ``grpo_mem.patches.trl_sp``; reverting
    restores the trainer's methods."""
    code = textwrap.dedent(
        """
        import sys
        import grpo_mem
        from trl import GRPOTrainer
        before = dict(vars(GRPOTrainer))
        handle = grpo_mem.patch_trl()
        assert "grpo_mem.patches.trl_sp" not in sys.modules, "trl_sp imported by a plain patch"
        handle.revert()
        assert dict(vars(GRPOTrainer)) == before
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_no_large_tracked_file():
    """No tracked file over 1 MB outside ``benchmarks/results/`` (wheels and downloads stay out of the repository)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=ROOT, check=True).stdout
    large = {}
    for name in files.decode().split("\0"):
        path = ROOT / name
        if name and not name.startswith("benchmarks/results/") and path.is_file():
            if path.stat().st_size > 1_000_000:
                large[name] = path.stat().st_size
    assert not large, large

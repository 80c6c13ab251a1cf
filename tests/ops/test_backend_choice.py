"""The way back from the kernels: ``GRPO_MEM_BACKEND`` and ``patch_trl(backend=...)`` choose every op's backend,
are validated by name, are what ran (``_backends.RESOLVED``), and ``torch`` needs no Triton at all."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_close, grads_of, make_batch, make_trainer, stock_logps, tiny_model

import grpo_mem
from grpo_mem.ops import _backends
from grpo_mem.ops._backends import BACKEND_ENV, RESOLVED, preferred, resolve

OPS = ("multi_region_attention", "linear_logprobs")


@pytest.fixture(autouse=True)
def _no_pin():
    previous = _backends.set_preference(None)
    yield
    _backends.set_preference(previous)


def test_environment_chooses_every_op(monkeypatch):
    t = torch.zeros(2)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert preferred() == ("auto", "default")
    auto = {op: resolve(op, "auto", t) for op in OPS}
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert preferred() == ("torch", BACKEND_ENV)
    assert {op: resolve(op, "auto", t) for op in OPS} == {op: "torch" for op in OPS}
    assert all(RESOLVED[op] == "torch" for op in OPS)
    monkeypatch.setenv(BACKEND_ENV, " CPP ")  # case and blanks forgiven; cpp names ATen's CPU attention kernels
    assert {op: resolve(op, "auto", t) for op in OPS} == {"multi_region_attention": "cpu", "linear_logprobs": "cpp"}
    # a preferred backend without a feature the call needs hands the call on, as an explicit one does
    assert resolve("multi_region_attention", "auto", t, {"softcap"}) == "torch"
    # triton cannot run CPU tensors without the interpreter: auto's choice, not an error
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert {op: resolve(op, "auto", t) for op in OPS} == auto
    # an explicit backend= of a call still wins over the preference
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert resolve("linear_logprobs", "cpp", t) == "cpp" and resolve("multi_region_attention", "cpu", t) == "cpu"


@pytest.mark.parametrize("value", ["tritn", "cuda", "1"])
def test_bad_environment_value_names_itself_and_the_choices(monkeypatch, value):
    monkeypatch.setenv(BACKEND_ENV, value)
    with pytest.raises(
        ValueError, match=rf"GRPO_MEM_BACKEND must be one of \['auto', 'triton', 'torch', 'cpp'\], got '{value}'"
    ):
        resolve("linear_logprobs", "auto", torch.zeros(1))
    model = tiny_model()
    ids, mask, C, _ = make_batch([5, 7], 2, 3)
    with pytest.raises(ValueError, match="GRPO_MEM_BACKEND must be one of"):
        grpo_mem.shared_prompt_logprobs(model, ids, mask, C)


_IMPORT_CASES = r"""
import os, sys

out = []
for value in sys.argv[1:]:
    os.environ["GRPO_MEM_BACKEND"] = value
    for name in [m for m in sys.modules if m == "grpo_mem" or m.startswith("grpo_mem.")]:
        del sys.modules[name]
    try:
        import grpo_mem
        out.append("ok")
    except ValueError as exc:
        out.append(str(exc))
out.append(sorted(m for m in ("torch", "transformers", "trl") if m in sys.modules))
print(repr(out))
"""


def test_import_grpo_mem_refuses_a_bad_environment_value_without_torch():
    """``import grpo_mem`` checks GRPO_MEM_BACKEND against the backend names (one fresh interpreter, several values,
    the package dropped from ``sys.modules`` between them): a bad value raises ValueError naming it and the
    choices; good ones (case and blanks forgiven, empty = auto) import; torch is never imported."""
    values = ["nonsense", " Torch ", "", "cuda", "auto"]
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_CASES, *values], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    choices = "['auto', 'triton', 'torch', 'cpp']"
    assert eval(proc.stdout) == [
        f"GRPO_MEM_BACKEND must be one of {choices}, got 'nonsense'",
        "ok",
        "ok",
        f"GRPO_MEM_BACKEND must be one of {choices}, got 'cuda'",
        "ok",
        [],
    ]


def test_command_line_refuses_a_bad_environment_value_in_one_line():
    """``python -m grpo_mem`` (the ``grpo-mem`` command) with a misspelt GRPO_MEM_BACKEND prints one line naming the
    value and exits with status 2, no traceback, before parsing its arguments."""
    env = dict(os.environ, GRPO_MEM_BACKEND="tritn")
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_mem", "bench", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "grpo-mem: error: GRPO_MEM_BACKEND must be one of ['auto', 'triton', 'torch', 'cpp'], got 'tritn'"
    ]


def test_patch_trl_refuses_a_bad_environment_value_before_patching(monkeypatch):
    """A GRPO_MEM_BACKEND set after the import fails ``patch_trl()`` (also with ``backend=`` given: the environment
    decides again after ``revert``), and nothing is patched."""
    from trl import GRPOTrainer

    before = dict(vars(GRPOTrainer))
    monkeypatch.setenv(BACKEND_ENV, "tritn")
    for kwargs in ({}, {"backend": "torch"}):
        with pytest.raises(ValueError, match=r"GRPO_MEM_BACKEND must be one of \['auto', .*\], got 'tritn'"):
            grpo_mem.patch_trl(**kwargs)
    assert dict(vars(GRPOTrainer)) == before


def test_patch_trl_backend_pins_validates_and_reverts(monkeypatch):
    from trl import GRPOTrainer, RLOOTrainer

    monkeypatch.setenv(BACKEND_ENV, "cpp")
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'triton', 'torch', 'cpp'\], got 'gpu'"):
        grpo_mem.patch_trl(backend="gpu")
    assert preferred() == ("cpp", BACKEND_ENV)  # nothing changed by the refused call
    with grpo_mem.patch_trl(GRPOTrainer, backend="torch") as handle:
        assert handle.backend == "torch" and preferred() == ("torch", "patch_trl")  # over the environment
        with pytest.raises(ValueError, match=r"pins backend='torch', got backend='triton'.*process-wide"):
            grpo_mem.patch_trl(RLOOTrainer, backend="triton")
        with grpo_mem.patch_trl(RLOOTrainer, backend="torch"):
            assert preferred() == ("torch", "patch_trl")
        assert preferred() == ("torch", "patch_trl")  # the other handle's revert leaves this one's pin
        assert grpo_mem.patch_trl(GRPOTrainer, backend="auto") is handle and preferred() == ("auto", "patch_trl")
    assert preferred() == ("cpp", BACKEND_ENV)


def test_torch_backend_scores_like_stock_and_is_what_ran(monkeypatch):
    """GRPO_MEM_BACKEND=torch: the prompt-once path runs the torch backends of attention and the head (RESOLVED
    says so) and gives stock TRL's log-probs, entropies and gradients (a tree-shared batch: multi-region attention)."""
    monkeypatch.setenv(BACKEND_ENV, "torch")
    _tree_batch_like_stock("cpu", "torch", 2e-5)


def _tree_batch_like_stock(device: str, backend: str | dict, tol: float) -> None:
    """A tiny Llama scored with tree sharing (two prompts behind a shared system prompt: multi-region attention) on
    ``device``: both ops ran on ``backend`` (a name, or op -> name) and the log-probs, entropies and gradients are
    stock TRL's within ``tol`` (gradients relative to each parameter's largest)."""
    model = tiny_model(layers=2).to(device)
    system = list(range(5, 17))
    ids, mask, C, _ = make_batch(None, 3, 4, prompts=[system + [20, 21], system + [30, 31, 32]], seed=3)
    ids, mask = ids.to(device), mask.to(device)
    RESOLVED.clear()
    lp, ent = grpo_mem.shared_prompt_logprobs(model, ids, mask, C, compute_entropy=True, sharing="tree")
    expected = (
        backend if isinstance(backend, dict) else dict.fromkeys(("multi_region_attention", "linear_logprobs"), backend)
    )
    assert RESOLVED == expected
    ours = grads_of(model, lp, ent)
    ref_lp, ref_ent = stock_logps(model, ids, mask, C, compute_entropy=True)
    ref = grads_of(model, ref_lp, ref_ent)
    keep = mask[:, -C:]
    assert_close(lp * keep, ref_lp, tol, "log-probs")
    assert_close(ent * keep, ref_ent, tol, "entropies")
    for name in ref:
        assert_close(ours[name], ref[name], tol * max(1.0, ref[name].abs().max().item()), name)


def test_patched_trainer_runs_the_pinned_backend(tmp_path):
    trainer, handle = make_trainer(patch=True, output_dir=tmp_path, backend="torch")
    ids, mask, C, _ = make_batch([4, 6], 2, 3)
    with handle:  # reverted (and the pin given back) even if an assertion fails
        RESOLVED.clear()
        with torch.no_grad():
            ours, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
        assert set(RESOLVED.values()) == {"torch"}
        report = grpo_mem.verify(trainer, print_report=False)
        assert report.passed, str(report)
        assert report.backend == "attention torch, head torch (patch_trl(backend='torch'))", str(report)
    assert preferred()[1] != "patch_trl"
    with torch.no_grad():
        stock, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    assert_close(ours * mask[:, -C:], stock * mask[:, -C:], 1e-5)


def test_torch_backend_needs_no_triton(tmp_path):
    """With triton unimportable, GRPO_MEM_BACKEND=torch scores and differentiates (what a CUDA user falls back to
    when the Triton kernels misbehave: the torch backends run on any device with torch operations only)."""
    script = textwrap.dedent(
        """
        import importlib.abc, os, sys

        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked by the test")

        sys.meta_path.insert(0, NoTriton())
        os.environ["GRPO_MEM_BACKEND"] = "torch"
        sys.path[:0] = ["tests"]
        from helpers import make_batch, tiny_model
        import grpo_mem
        from grpo_mem.ops._backends import RESOLVED

        model = tiny_model(layers=1)
        ids, mask, C, _ = make_batch([5, 7], 2, 3)
        lp, ent = grpo_mem.shared_prompt_logprobs(model, ids, mask, C, compute_entropy=True)
        (lp.sum() + ent.sum()).backward()
        assert "triton" not in sys.modules and RESOLVED == {"multi_region_attention": "torch", "linear_logprobs": "torch"}
        print("ok", sorted(RESOLVED.items()))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


@pytest.mark.xdist_group("large")  # beside the kernels' largest cases in the GPU check (--dist loadgroup)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preference", ["torch", "auto"])
def test_cuda_backends_score_like_stock(monkeypatch, preference):
    """On CUDA (fp32 weights, tree sharing): the torch backends and auto's choice (with no measured table: Triton for
    attention and the head) each give stock TRL's log-probs, entropies and gradients, and RESOLVED names the backends
    that ran."""
    monkeypatch.setenv(BACKEND_ENV, preference)
    auto = {"multi_region_attention": "triton", "linear_logprobs": "triton"}
    _tree_batch_like_stock("cuda", "torch" if preference == "torch" else auto, 1e-4)

"""Run TRL's own vision-language GRPO tests offline, stock and with ``grpo_mem.patch_trl()``, and compare.

    python tests/upstream/run_trl_vlm.py --trl-tests /work/.mirror/huggingface+trl/repo@main
    python tests/upstream/run_trl_vlm.py --trl-tests ~/src/trl/tests --patched -k "Qwen2_5"

``--trl-tests`` is TRL's ``tests`` directory, or a TRL git directory (bare or not) with an optional ``@REV`` (default
``HEAD``), whose ``tests/`` is extracted to the cache with ``git archive``: TRL's test file is executed from there,
never copied into this repository. The hub assets those tests load are replaced by the tiny stand-ins of
``offline_assets`` (built once into ``--cache``), resolved by ``trl_offline_plugin`` with ``HF_HUB_OFFLINE=1``.

Selected: the class ``TestGRPOTrainerVLM`` of ``tests/test_grpo_trainer.py``, minus ``DESELECTED`` (each with its
reason, printed). Each mode runs in its own pytest process. Prints one row per test: the stock outcome, the patched
outcome, the scoring path the patched run logged (mean of TRL's logged ``grpo_mem/path/<name>`` fractions over the
test's steps), how far the patched run's gradients are from stock's at the first optimizer step with a non-zero
gradient (largest difference of per-parameter gradient norms over the largest norm, and the step; same seed, so the
same generations until then, and only rounding should differ)
and grpo_mem's fallback causes, then one summary line. Exit status 0 when every test that passes stock
passes patched, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TEST_FILE = "tests/test_grpo_trainer.py"
SELECT = "TestGRPOTrainerVLM"

DESELECTED = {
    "test_train_vlm_and_vllm": "needs vLLM and a vLLM server (not installed; TRL itself marks it skip)",
    "test_train_with_tools_multimodal_response": "hub-only: hard-codes token ids of the hub Qwen3.5 tokenizer "
    "(248058, ...) in a fake generate and loads the hub reward model tiny-Qwen2ForSequenceClassification-2.5",
    "test_train_vlm_and_liger": "the installed liger-kernel cannot patch Qwen2.5-VL under transformers 5.23 "
    "(ImportError: LigerQwen2_5_VLCausalLMOutputWithPast), and its RMSNorm/SwiGLU Triton kernels need a GPU",
}
"""Substring of a test id -> why it is not run here (it cannot pass stock here either)."""


def trl_tests_root(spec: str, cache: Path) -> Path:
    """The directory holding TRL's ``tests/`` package for ``spec`` (see the module docstring). Raises ValueError when
    ``spec`` is neither a tests directory nor a git directory holding ``tests/test_grpo_trainer.py`` at that rev."""
    path, _, rev = spec.partition("@")
    path = Path(path).expanduser()
    if (path / "test_grpo_trainer.py").is_file():
        return path.resolve().parent
    if (path / TEST_FILE).is_file() and not rev:
        return path.resolve()
    rev = rev or "HEAD"
    git = ["git", f"--git-dir={path / '.git' if (path / '.git').exists() else path}"]
    found = subprocess.run([*git, "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"--trl-tests {spec!r}: not a tests directory, nor a git directory with revision {rev!r}")
    commit = found.stdout.strip()
    root = cache / "trl-tests" / commit
    if not (root / TEST_FILE).is_file():
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run([*git, "archive", commit, "tests"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    if not (root / TEST_FILE).is_file():
        raise ValueError(f"--trl-tests {spec!r}: {TEST_FILE} is not in revision {commit}")
    return root


def build_assets(cache: Path) -> None:
    """Build every stand-in of ``offline_assets`` into ``cache`` unless it is already there."""
    sys.path[:0] = [str(HERE), str(REPO / "tests")]
    import offline_assets

    for name in offline_assets.MODELS:
        snapshot = offline_assets.snapshot_dir(cache, f"{offline_assets.ORG}/{name}")
        if offline_assets.built_spec(snapshot) != repr(offline_assets.MODELS[name]):
            print(f"building the stand-in of {offline_assets.ORG}/{name}", flush=True)
            offline_assets.build_model(cache, name)
    if not (cache / "datasets" / "zen-multi-image").is_dir():
        offline_assets.build_datasets(cache)


def _env(mode: str, cache: Path, report: Path, group_shuffle: bool, fp32: bool) -> dict:
    """The pytest process's environment: offline, the stand-in cache, and the plugin's settings."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_CACHE=str(cache / "hub"),
        HF_HOME=str(cache / "hf_home"),
        GRPO_MEM_UPSTREAM_MODE=mode,
        GRPO_MEM_UPSTREAM_CACHE=str(cache),
        GRPO_MEM_UPSTREAM_REPORT=str(report),
        GRPO_MEM_UPSTREAM_GROUP_SHUFFLE=str(int(group_shuffle)),
        GRPO_MEM_UPSTREAM_FP32=str(int(fp32)),
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), str(HERE)]),
    )


def run_mode(
    mode: str,
    root: Path,
    cache: Path,
    keyword: str | None,
    deselect: bool = True,
    group_shuffle: bool = False,
    fp32: bool = False,
) -> tuple[dict, str, str]:
    """Run the selected tests in one pytest process with ``mode`` ("stock" or "patched"), ``DESELECTED`` left out
    when ``deselect``; returns the plugin's per-test records, pytest's summary line, and the process's wall and CPU
    time ("123 s wall, 200 s CPU")."""
    report = cache / f"report-{mode}.json"
    report.unlink(missing_ok=True)
    env = _env(mode, cache, report, group_shuffle, fp32)
    ini = cache / "pytest.ini"
    ini.write_text("[pytest]\n")
    expr = " and ".join([SELECT] + [f"not {key}" for key in DESELECTED if deselect] + [f"({keyword})"] * bool(keyword))
    cmd = [sys.executable, "-m", "pytest", "-p", "trl_offline_plugin", "-p", "no:cacheprovider", "-c", str(ini)]
    cmd += [
        "--rootdir",
        str(root),
        "-q",
        "-rA",
        "--tb=short",
        "-W",
        "ignore::DeprecationWarning",
        TEST_FILE,
        "-k",
        expr,
    ]
    start, cpu = time.time(), _children_cpu()
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    times = f"{time.time() - start:.0f} s wall, {_children_cpu() - cpu:.0f} s CPU"
    (cache / f"pytest-{mode}.log").write_text(done.stdout + done.stderr)
    lines = [
        line.strip("= ")
        for line in done.stdout.splitlines()
        if " in " in line and ("passed" in line or "failed" in line or "error" in line or "deselected" in line)
    ]
    if not report.is_file():
        raise RuntimeError(f"the {mode} run wrote no report; its output is in {cache / f'pytest-{mode}.log'}")
    return json.loads(report.read_text()), (lines[-1] if lines else "no pytest summary"), times


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _path_text(record: dict) -> str:
    paths = record.get("paths") or {}
    return ", ".join(f"{name} {share:.2f}" for name, share in paths.items() if share > 0) or "-"


def _gradient_difference(stock: dict, patched: dict) -> str:
    """Largest difference between the two runs' per-parameter gradient norms at the first optimizer step with a
    gradient, relative to the largest of them, and that step (``"3e-07 @2"``); ``"-"`` when either run has none,
    ``"steps differ"`` / ``"names differ"`` when the runs' steps or parameters do."""
    a, b = stock.get("first_step_grad_norms"), patched.get("first_step_grad_norms")
    if not a or not b:
        return "-"
    if stock.get("first_step") != patched.get("first_step") or set(a) != set(b):
        return "steps differ" if set(a) == set(b) else "names differ"
    worst = max(abs(a[n] - b[n]) for n in a) / max(a.values())
    return f"{worst:.0e} @{stock['first_step']}"


def print_table(stock: dict, patched: dict) -> bool:
    """Print one row per test; returns whether every test that passed stock passed patched."""
    ids = sorted(set(stock) | set(patched))
    short = {i: i.split("::")[-1].replace("trl-internal-testing/tiny-", "") for i in ids}
    width = max([len(s) for s in short.values()] + [4])
    head = f"{'stock':<8} {'patched':<8} {'patched path':<22} {'1st grads':<13} grpo_mem fallback causes"
    print(f"{'test':<{width}}  {head}")
    ok = True
    for i in ids:
        s, p = stock.get(i, {}), patched.get(i, {})
        ok &= s.get("outcome") != "passed" or p.get("outcome") == "passed"
        causes = "; ".join(p.get("fallbacks") or []) or "-"
        print(
            f"{short[i]:<{width}}  {s.get('outcome', '-'):<8} {p.get('outcome', '-'):<8} {_path_text(p):<22} "
            f"{_gradient_difference(s, p):<13} {causes}"
        )
        for label, record in (("stock", s), ("patched", p)):
            if record.get("error") and record.get("outcome") != "passed":
                print(f"{'':<{width}}  {label}: {record['error']}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trl-tests", required=True, help="TRL's tests directory, or a TRL git directory[@REV]")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--stock", action="store_true", help="run stock TRL only")
    modes.add_argument("--patched", action="store_true", help="run with grpo_mem.patch_trl() only")
    parser.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "grpo_mem_trl_vlm"),
        help="where the stand-ins, the extracted tests and the logs go (default: %(default)s)",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild the stand-ins")
    parser.add_argument("-k", dest="keyword", help="a further pytest -k expression")
    parser.add_argument("--no-deselect", action="store_true", help="run the DESELECTED tests too (to see them fail)")
    parser.add_argument(
        "--group-shuffle",
        action="store_true",
        help="patch with group_shuffle=True (micro-batches then differ from stock's)",
    )
    parser.add_argument("--fp32", action="store_true", help="train in fp32 (TRL's GRPOConfig defaults to bf16)")
    args = parser.parse_args(argv)
    cache = Path(args.cache).resolve()
    if args.rebuild and cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    try:
        root = trl_tests_root(args.trl_tests, cache)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    build_assets(cache)
    print(
        "deselected (they cannot pass stock here either):"
        if not args.no_deselect
        else "deselection off; usually left out:"
    )
    for key, reason in DESELECTED.items():
        print(f"  {key}: {reason}")
    results, summaries = {}, []
    modes = ["stock"] * (not args.patched) + ["patched"] * (not args.stock)
    for mode in modes:
        results[mode], summary, times = run_mode(
            mode,
            root,
            cache,
            args.keyword,
            deselect=not args.no_deselect,
            group_shuffle=args.group_shuffle,
            fp32=args.fp32,
        )
        summaries.append(f"{mode}: {summary} ({times})")
    ok = print_table(results.get("stock", {}), results.get("patched", {}))
    print("; ".join(summaries) + f"; TRL tests from {root}; logs in {cache}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

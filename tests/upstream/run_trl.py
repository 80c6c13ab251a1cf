"""Run TRL's own GRPO and RLOO tests offline, stock and with ``grpo_mem.patch_trl()``, and compare.

    python tests/upstream/run_trl.py --select grpo --trl-tests /work/.mirror/huggingface+trl/repo@main
    python tests/upstream/run_trl.py --select grpo-vlm,rloo --trl-tests ~/src/trl/tests --patched -k "peft"

``--select`` names one or more of ``SELECTIONS`` (comma-separated): ``grpo`` the class ``TestGRPOTrainer`` of TRL's
``tests/test_grpo_trainer.py``, ``grpo-vlm`` its ``TestGRPOTrainerVLM``, ``rloo`` the classes ``TestRLOOTrainer`` and
``TestRLOOTrainerVLM`` of ``tests/test_rloo_trainer.py``; each minus its ``deselected`` tests (each with its reason,
printed; matched by exact name, with or without parameters). ``--trl-tests`` is TRL's ``tests`` directory, or a TRL
git directory (bare or not) with an optional ``@REV`` (default ``HEAD``), whose ``tests/`` is extracted to the cache
with ``git archive``: TRL's test files are executed from there, never copied into this repository. The hub assets
those tests load are replaced by the tiny stand-ins of ``offline_assets`` (built once into ``--cache``), resolved by
``trl_offline_plugin`` with ``HF_HUB_OFFLINE=1``.

Each mode runs in its own pytest process. Prints one row per test: the stock outcome, the patched outcome, the
scoring path the patched run logged (mean of TRL's logged ``grpo_mem/path/<name>`` fractions over the test's steps),
how far the patched run's gradients are from stock's at the first optimizer step with a non-zero gradient (largest
difference of per-parameter gradient norms over the largest norm, and the step; same seed, so the same generations
until then, and only rounding should differ) and grpo_mem's fallback causes; then per class and mode the count of
each outcome, the largest first-step gradient difference, and one summary line. Exit status 0 when every test that
passes stock passes patched, 1 otherwise, 2 on a usage error.
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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@dataclass(frozen=True)
class Selection:
    """TRL test classes of one file, and the tests of theirs not run here (name -> why)."""

    test_file: str
    classes: tuple[str, ...]
    deselected: dict[str, str]


_VLLM = "needs vLLM and a vLLM server (not installed; TRL itself marks it skip)"
_LIGER = (
    "enables Liger (use_liger_kernel=True): its Triton kernels need a GPU, and it swaps them into transformers' model "
    "classes for the rest of the session, so most later tests fail too (RuntimeError: 0 active drivers)"
)
_HUB_IDS = (
    "hub-only: a fake generate returns token ids of the hub Qwen tokenizer (151643 pad, 151645 <|im_end|>, 151657 "
    "<tool_call>, ...), out of a character-level stand-in's vocabulary (IndexError) or meaning other tokens"
)
_HUB_ROWS = "hub-only: asserts the hub zen dataset's exact prompts and row count (17) in the sampled batches"
_MAIN_ONLY = (
    "fails stock: checks TRL main's fix for issue 5222 (no 'ref' adapter when LoRA uses target_parameters), which the "
    "installed TRL 1.16.0 predates (AssertionError: 'ref' in peft_config)"
)
_ENTROPY_FIX = (
    "fails stock: checks TRL main's fix that detaches entropies when no entropy bonus is active, which the installed "
    "TRL 1.16.0 predates (assert not entropies.requires_grad)"
)
_GRPO_LIGER = [
    *(f"test_train_loss_types[{loss}-True]" for loss in ("bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")),
    "test_liger_kernel_with_peft_lm_head_raises",
    "test_liger_kernel_with_peft_non_lm_head_target_allowed",
    "test_liger_kernel_with_peft_modules_to_save_lm_head_allowed",
    "test_liger_kernel_with_peft_prompt_learning_raises",
    "test_train_with_off_policy_mask_with_liger",
    "test_compute_liger_loss_passes_vllm_is_ratio",
    "test_train_with_bias_correction_kl[True]",
    "test_train_delta_clipping[True]",
]
_GRPO_VLLM = [
    "test_train_vllm_and_peft",
    "test_train_vllm_structured_outputs",
    "test_train_vllm_importance_sampling_correction",
    "test_train_vllm_with_additional_generation_kwargs",
]
_GRPO_HUB_IDS = [
    "test_train_with_tools",
    "test_train_with_multiple_environments",
    "test_train_with_environment_factory",
    "test_train_with_environment_owned_reward",
    "test_train_with_environment_owned_data",
    "test_train_with_malformed_tool_calls",
    "test_train_with_mask_truncated_completions",
]

SELECTIONS = {
    "grpo-vlm": Selection(
        "tests/test_grpo_trainer.py",
        ("TestGRPOTrainerVLM",),
        {
            "test_train_vlm_and_vllm": _VLLM,
            "test_train_with_tools_multimodal_response": "hub-only: hard-codes token ids of the hub Qwen3.5 tokenizer "
            "(248058, ...) in a fake generate",
            "test_train_vlm_and_liger": "the installed liger-kernel cannot patch Qwen2.5-VL under transformers 5.23 "
            "(ImportError: LigerQwen2_5_VLCausalLMOutputWithPast), and its RMSNorm/SwiGLU Triton kernels need a GPU",
        },
    ),
    "grpo": Selection(
        "tests/test_grpo_trainer.py",
        ("TestGRPOTrainer",),
        {
            **dict.fromkeys(_GRPO_VLLM, _VLLM),
            **dict.fromkeys(_GRPO_LIGER, _LIGER),
            **dict.fromkeys(_GRPO_HUB_IDS, _HUB_IDS),
            "test_prepare_input_called_with_correct_data": _HUB_ROWS,
            "test_train_moe_peft_model": _MAIN_ONLY,
            "test_entropy_bonus_flows_gradients": _ENTROPY_FIX,
        },
    ),
    "rloo": Selection(
        "tests/test_rloo_trainer.py",
        ("TestRLOOTrainer", "TestRLOOTrainerVLM"),
        {
            **dict.fromkeys(_GRPO_VLLM[:2] + _GRPO_VLLM[3:] + ["test_train_vlm_and_vllm"], _VLLM),
            "test_train_with_mask_truncated_completions": _HUB_IDS,
            "test_prepare_input_called_with_correct_data": _HUB_ROWS,
            "test_train_moe_peft_model": _MAIN_ONLY,
        },
    ),
}
"""What ``--select`` can name."""


def trl_tests_root(spec: str, cache: Path, files: list[str]) -> Path:
    """The directory holding TRL's ``tests/`` package for ``spec`` (see the module docstring). Raises ValueError when
    ``spec`` is neither a tests directory nor a git directory holding every one of ``files`` (``tests/...``) at that
    rev."""
    path, _, rev = spec.partition("@")
    path = Path(path).expanduser()
    if (path / Path(files[0]).name).is_file():
        return path.resolve().parent
    if (path / files[0]).is_file() and not rev:
        return path.resolve()
    rev = rev or "HEAD"
    git = ["git", f"--git-dir={path / '.git' if (path / '.git').exists() else path}"]
    found = subprocess.run([*git, "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"--trl-tests {spec!r}: not a tests directory, nor a git directory with revision {rev!r}")
    commit = found.stdout.strip()
    root = cache / "trl-tests" / commit
    if not all((root / file).is_file() for file in files):
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run([*git, "archive", commit, "tests"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    missing = [file for file in files if not (root / file).is_file()]
    if missing:
        raise ValueError(f"--trl-tests {spec!r}: {', '.join(missing)} not in revision {commit}")
    return root


def build_assets(cache: Path) -> None:
    """Build every stand-in of ``offline_assets`` into ``cache`` unless it is already there."""
    sys.path[:0] = [str(HERE), str(REPO / "tests")]
    import offline_assets

    for name, spec in offline_assets.STAND_INS.items():
        snapshot = offline_assets.snapshot_dir(cache, f"{offline_assets.ORG}/{name}")
        if offline_assets.built_spec(snapshot) != offline_assets.stamp(spec):
            print(f"building the stand-in of {offline_assets.ORG}/{name}", flush=True)
            offline_assets.build_model(cache, name)
    if not all((cache / "datasets" / name).is_dir() for name in offline_assets.DATASETS):
        offline_assets.build_datasets(cache)


@dataclass(frozen=True)
class Run:
    """One run's settings: the node ids (``file::class``) to collect, the names to deselect, a further ``-k``."""

    nodes: list[str]
    deselect: list[str]
    keyword: str | None = None
    group_shuffle: bool = False
    fp32: bool = False
    threads: int = 1


def _env(mode: str, cache: Path, report: Path, run: Run) -> dict:
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
        GRPO_MEM_UPSTREAM_DESELECT=json.dumps(run.deselect),
        GRPO_MEM_UPSTREAM_GROUP_SHUFFLE=str(int(run.group_shuffle)),
        GRPO_MEM_UPSTREAM_FP32=str(int(run.fp32)),
        OMP_NUM_THREADS=str(run.threads),
        MKL_NUM_THREADS=str(run.threads),
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), str(HERE)]),
    )


def run_mode(mode: str, root: Path, cache: Path, run: Run) -> tuple[dict, str, str]:
    """Run ``run``'s tests in one pytest process with ``mode`` ("stock" or "patched"); returns the plugin's per-test
    records, pytest's summary line, and the process's wall and CPU time ("123 s wall, 200 s CPU")."""
    report = cache / f"report-{mode}.json"
    report.unlink(missing_ok=True)
    ini = cache / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-p", "trl_offline_plugin", "-p", "no:cacheprovider", "-c", str(ini)]
    cmd += ["--rootdir", str(root), "-q", "-rA", "--tb=short", "-W", "ignore::DeprecationWarning", *run.nodes]
    cmd += ["-k", run.keyword] if run.keyword else []
    start, cpu = time.time(), _children_cpu()
    done = subprocess.run(cmd, cwd=root, env=_env(mode, cache, report, run), capture_output=True, text=True)
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


def _gradient_difference(stock: dict, patched: dict) -> float | str | None:
    """Largest difference between the two runs' per-parameter gradient norms at the first optimizer step with a
    gradient, relative to the largest of them; None when either run has none, ``"steps differ"`` / ``"names
    differ"`` when the runs' steps or parameters do."""
    a, b = stock.get("first_step_grad_norms"), patched.get("first_step_grad_norms")
    if not a or not b:
        return None
    if stock.get("first_step") != patched.get("first_step") or set(a) != set(b):
        return "steps differ" if set(a) == set(b) else "names differ"
    return max(abs(a[n] - b[n]) for n in a) / max(a.values())


def _gradient_text(stock: dict, patched: dict) -> str:
    worst = _gradient_difference(stock, patched)
    if worst is None or isinstance(worst, str):
        return worst or "-"
    return f"{worst:.0e} @{stock['first_step']}"


def print_table(stock: dict, patched: dict) -> bool:
    """Print one row per test; returns whether every test that passed stock passed patched."""
    ids = sorted(set(stock) | set(patched))
    classes = {i.split("::")[-2] for i in ids if i.count("::") >= 2}
    keep = 2 if len(classes) > 1 else 1
    short = {i: "::".join(i.split("::")[-keep:]).replace("trl-internal-testing/tiny-", "") for i in ids}
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
            f"{_gradient_text(s, p):<13} {causes}"
        )
        for label, record in (("stock", s), ("patched", p)):
            if record.get("error") and record.get("outcome") != "passed":
                print(f"{'':<{width}}  {label}: {record['error']}")
    return ok


def print_classes(results: dict) -> None:
    """Per class: each mode's outcome counts, the patched runs' scoring paths, the largest first-step gradient
    difference (and its test)."""
    stock, patched = results.get("stock", {}), results.get("patched", {})
    by_class: dict[str, list[str]] = {}
    for i in sorted(set(stock) | set(patched)):
        by_class.setdefault(i.split("::")[-2] if i.count("::") >= 2 else "-", []).append(i)
    for cls, ids in by_class.items():
        counts = {
            mode: ", ".join(f"{n} {k}" for k, n in sorted(Counter(r[i].get("outcome", "-") for i in ids).items()))
            for mode, r in results.items()
        }
        paths = Counter(
            max(patched[i]["paths"], key=patched[i]["paths"].get) for i in ids if patched.get(i, {}).get("paths")
        )
        grads = [
            (d, i) for i in ids if isinstance(d := _gradient_difference(stock.get(i, {}), patched.get(i, {})), float)
        ]
        worst = max(grads, default=None)
        print(
            f"{cls}: "
            + "; ".join(f"{mode} {text}" for mode, text in counts.items())
            + (f"; patched tests by main path: {dict(paths)}" if paths else "")
            + (f"; largest 1st-step gradient difference {worst[0]:.0e} ({worst[1].split('::')[-1]})" if worst else "")
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--select", required=True, help=f"comma-separated, of: {', '.join(SELECTIONS)}")
    parser.add_argument("--trl-tests", required=True, help="TRL's tests directory, or a TRL git directory[@REV]")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--stock", action="store_true", help="run stock TRL only")
    modes.add_argument("--patched", action="store_true", help="run with grpo_mem.patch_trl() only")
    parser.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "grpo_mem_trl"),
        help="where the stand-ins, the extracted tests and the logs go (default: %(default)s)",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild the stand-ins")
    parser.add_argument("-k", dest="keyword", help="a further pytest -k expression")
    parser.add_argument("--no-deselect", action="store_true", help="run the deselected tests too (to see them fail)")
    parser.add_argument(
        "--group-shuffle",
        action="store_true",
        help="patch with group_shuffle=True (micro-batches then differ from stock's)",
    )
    parser.add_argument("--fp32", action="store_true", help="train in fp32 (TRL's configs default to bf16)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's CPU threads in the pytest processes (default: %(default)s; the tiny models gain nothing from "
        "more, and on a busy machine each extra thread waits for a core)",
    )
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    names = [name.strip() for name in args.select.split(",") if name.strip()]
    unknown = [name for name in names if name not in SELECTIONS]
    if unknown or not names:
        print(f"--select: unknown {unknown or args.select!r}; choose from {', '.join(SELECTIONS)}", file=sys.stderr)
        return 2
    chosen = [SELECTIONS[name] for name in names]
    cache = Path(args.cache).resolve()
    if args.rebuild and cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    try:
        root = trl_tests_root(args.trl_tests, cache, sorted({s.test_file for s in chosen}))
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    build_assets(cache)
    deselected = {key: reason for s in chosen for key, reason in s.deselected.items()}
    print(
        "deselected (they cannot pass stock here either):"
        if not args.no_deselect
        else "deselection off; usually left out:"
    )
    for key, reason in deselected.items():
        print(f"  {key}: {reason}")
    run = Run(
        nodes=[f"{s.test_file}::{cls}" for s in chosen for cls in s.classes],
        deselect=[] if args.no_deselect else sorted(deselected),
        keyword=args.keyword,
        group_shuffle=args.group_shuffle,
        fp32=args.fp32,
        threads=args.threads,
    )
    results, summaries = {}, []
    for mode in ["stock"] * (not args.patched) + ["patched"] * (not args.stock):
        results[mode], summary, times = run_mode(mode, root, cache, run)
        summaries.append(f"{mode}: {summary} ({times})")
    ok = print_table(results.get("stock", {}), results.get("patched", {}))
    print_classes(results)
    print("; ".join(summaries) + f"; TRL tests from {root}; logs in {cache}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

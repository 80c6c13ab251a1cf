"""The one-shot GPU check: everything a first run on a GPU should tell, in one command, with at most 8 result files.

    python benchmarks/gpu_check.py --out DIR [--device cuda|cpu] [--tiny] [--budget-s 1170] [--phases env,perf,...]
        [--backend auto|triton|torch|cpp] [-k EXPR]

Phases, in order, each in its own process with its own time limit (a crash or an illegal address in one poisons
only that process; the later phases still run), none started once ``--budget-s`` seconds are spent, and each
limited to what is left of the budget:

- ``env``: versions (python, torch, triton, transformers, trl, accelerate, datasets, peft, regex, pyarrow,
  tokenizers, huggingface_hub, grpo_mem), the device's properties and Triton's shared-memory limit, ``nvidia-smi``'s
  clocks, temperature and power -> ``env.txt``.
- ``perf``: where the time goes. ``torch.profiler`` over a warm scoring window (every micro-batch's completion
  log-probs and entropies, forward and backward) of a full-depth Qwen3-1.7B (28 layers, random bf16 weights drawn on
  the device), first at P=2048, C=512, G=8 (2 micro-batches of 4), then at P=16384, C=64, G=8 (micro-batches of 1: a
  stock row keeps about 57 GB of activations), stock TRL against grpo_mem under each backend preference that runs
  another pair of attention and head backends there (``auto`` first; ``--backend`` does not narrow it): wall time
  (CUDA events), peak memory (``max_memory_allocated``), kernel time by category, kernel launches, host
  synchronisations, GPU idle share -> ``perf.csv`` (long format, rows written as each provider ends) and a summary
  per shape in run.log. CPU: the CPU profiler, launching ATen ops and host reads as
  ``benchmarks/bench_launches.py`` counts them, peak RSS above base.
- ``kernels``: ``pytest tests/ops/test_triton_cuda.py`` (the kernels against fp64 truth in bf16/fp16/fp32 at realistic
  shapes, NaN-poisoned allocator; with ``pytest-xdist`` installed, in 6 processes) -> ``kernels.xml`` (JUnit) and
  ``kernels.csv`` (every error measurement and every compiled kernel's registers, spills and shared memory, merged from
  the test processes' CSVs). CPU: the same tests at toy shapes under ``TRITON_INTERPRET=1`` (``--tiny``: a subset).
- ``verify``: ``grpo_mem.verify`` on a 4-layer Qwen3-1.7B-shaped model (hidden 2048, 16/8 heads of 128, vocabulary
  151936, bf16 weights, SDPA), random weights, on 2 prompts sharing 256 tokens x 8 completions (P=512, C=256, 2
  micro-batches of 8), with gradient checkpointing off and then on -> ``verify.txt``.
- ``train``: 8 GRPOTrainer steps stock vs patched (``tests/helpers.make_trainer``: character tokenizer, 2-layer Llama
  of hidden 256, 4/2 heads), fp32 with SGD and bf16 autocast with AdamW: per step loss, reward, completion length,
  gradient norm and (fp32) the largest gradient difference, final weights, wall time, peak memory -> ``train.json``.
- ``bench``: ``grpo-mem bench --device cuda --dtype bf16`` (run as ``python -m grpo_mem.commands.bench``, which needs
  none of the cli extra) on a Qwen3-1.7B config (P=2048, C=512, G=8) and on the long-prompt setting (P=16384, C=64,
  G=8) with a Qwen3.5-4B-shaped model cut to 4 layers (3 Gated DeltaNet + 1 full attention); both config.json files
  are written here, nothing is downloaded -> ``bench/bench.csv`` (both runs' rows; a chart can be drawn from it
  with ``grpo_mem.bench.results.plot_csv``).

``--tiny`` (CI, with ``--device cpu``) runs every phase at toy sizes: perf on a 2-layer Qwen3 of hidden 64 in fp32
(P=64, C=16, G=4, then P=128, C=8), the kernels subset under the interpreter, verify on the same toy Qwen3, 2
training steps, and the two bench settings on toy configs in fp32.

Files under ``--out`` (no deeper than one folder): ``run.log`` (each phase's command and the tail of its output; its
last line: each phase's status and seconds), ``env.txt``, ``perf.csv``, ``kernels.xml``, ``kernels.csv``,
``verify.txt``, ``train.json``, ``bench/bench.csv``. Everything else (pytest's per-process CSVs, the Triton cache,
trainer output directories, bench's own output directories, matplotlib's cache) goes under a temporary directory.

``--backend`` sets ``GRPO_MEM_BACKEND`` for every phase's process (read by ``grpo_mem.ops._backends.resolve`` for
``backend="auto"``): ``torch`` gets memory numbers when the Triton path is broken. The exit status is 0 when every
chosen phase passed, 1 otherwise, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import csv
import functools
import gc
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("env", "perf", "kernels", "verify", "train", "bench")
"""In the order they run: where the time goes first (the next GPU run's first question), then the regression checks."""
BACKENDS = ("auto", "triton", "torch", "cpp")
LIMITS = {"env": 60, "perf": 240, "kernels": 240, "verify": 150, "train": 150, "bench": 330}
"""Seconds each phase may take on a GPU (``--budget-s`` may cut them further)."""
TINY_LIMITS = {"env": 60, "perf": 120, "kernels": 300, "verify": 120, "train": 180, "bench": 300}
DEFAULT_BUDGET_S = float(sum(LIMITS.values()))
"""``--budget-s``'s default: every phase its whole limit (1170 s); a run under a shorter outer limit passes less."""
RESULT_FILES = (
    "run.log",
    "env.txt",
    "perf.csv",
    "kernels.xml",
    "kernels.csv",
    "verify.txt",
    "train.json",
    "bench/bench.csv",
)
"""Everything the check writes under ``--out``: at most 8 files, none deeper than one folder (easy to copy off)."""
LOG_TAIL_LINES = 300
"""Lines of each phase's output copied into run.log (the whole output stays under the work directory)."""

# ---------------------------------------------------------------------------------------------------------- models

QWEN3_1_7B = dict(
    model_type="qwen3",
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
)
"""Qwen3-1.7B's config.json sizes (Qwen/Qwen3-1.7B on the Hugging Face Hub; written from the published values)."""

QWEN3_5_4B_4L = dict(
    model_type="qwen3_5_text",
    hidden_size=2560,
    intermediate_size=9216,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    vocab_size=248320,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=262144,
    attention_dropout=0.0,
)
"""Qwen3.5-4B's text model cut to 4 layers (one full-attention period): hidden 2560, MLP 9216, 16/4 heads of 256,
partial RoPE (1/4) of theta 1e7, vocabulary 248320, tied (the Megatron arguments published for Qwen3.5-4B); the
Gated DeltaNet heads (16 key / 32 value heads of 128) are transformers' Qwen3_5TextConfig defaults."""

TINY_QWEN3 = dict(
    QWEN3_1_7B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_QWEN3_5 = dict(
    QWEN3_5_4B_4L,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    vocab_size=512,
)


def settings(tiny: bool) -> dict:
    """Sizes of every phase: full (GPU) or toy (``--tiny``)."""
    if not tiny:
        return dict(
            perf=dict(
                name="qwen3-1.7b",
                model=QWEN3_1_7B,
                dtype="bfloat16",
                # P=16384: one row per micro-batch, as stock's 16448-token row holds about 57 GB of activations and two
                # 113 GB (grpo_mem.bench.fits.estimate_stock_memory)
                shapes=[dict(P=2048, C=512, G=8, micro=4, repeats=3), dict(P=16384, C=64, G=8, micro=1, repeats=2)],
            ),
            verify_model=dict(QWEN3_1_7B, num_hidden_layers=4),
            verify_batch=dict(G=8, P=512, C=256, groups=2, shared_prefix=256, micro=8),
            train=dict(steps=8, batch=8, generations=4, completion=32, hidden=256, heads=4, kv_heads=2),
            bench=[
                ("qwen3-1.7b", QWEN3_1_7B, dict(P=2048, C=512, G=8, micro=4, repeats=3, dtype="bf16")),
                ("qwen3.5-4b-4layers", QWEN3_5_4B_4L, dict(P=16384, C=64, G=8, micro=4, repeats=3, dtype="bf16")),
            ],
        )
    return dict(
        perf=dict(
            name="qwen3-tiny",
            model=TINY_QWEN3,
            dtype="float32",
            shapes=[dict(P=64, C=16, G=4, micro=2, repeats=3), dict(P=128, C=8, G=4, micro=1, repeats=2)],
        ),
        verify_model=TINY_QWEN3,
        verify_batch=dict(G=4, P=32, C=16, groups=2, shared_prefix=8, micro=4),
        train=dict(steps=2, batch=4, generations=4, completion=8, hidden=48, heads=4, kv_heads=2),
        bench=[
            ("qwen3-tiny", TINY_QWEN3, dict(P=64, C=16, G=4, micro=4, repeats=1, dtype="fp32")),
            ("qwen3.5-tiny", TINY_QWEN3_5, dict(P=128, C=8, G=4, micro=4, repeats=1, dtype="fp32")),
        ],
    )


# ------------------------------------------------------------------------------------------------------ the driver


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="where the result files go (created)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the phases run")
    p.add_argument("--tiny", action="store_true", help="toy sizes (CI: --device cpu --tiny)")
    p.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="start no phase once this many seconds are spent"
    )
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="GRPO_MEM_BACKEND for every phase's process")
    p.add_argument("-k", dest="select", default=None, help="kernels phase: pytest -k expression")
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)  # the temporary directory (set by the driver)
    p.add_argument("--run-phase", default=None, choices=PHASES, help=argparse.SUPPRESS)  # inside a phase's process
    return p


def parse(argv=None) -> argparse.Namespace:
    """Parsed flags; exits with status 2 naming a bad --phases entry or a non-positive --budget-s."""
    parser = build_parser()
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in chosen if p not in PHASES]
    if bad or not chosen:
        parser.error(f"--phases must be a comma-separated subset of {','.join(PHASES)}, got {args.phases!r}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    args.phases = [p for p in PHASES if p in chosen]
    return args


class Log:
    """run.log, written as the phases end (what finished is there even if an outer limit kills the check)."""

    def __init__(self, path: str):
        self.path = path
        open(path, "w").close()

    def write(self, text: str) -> None:
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")


def phase_env(args, work: str) -> dict:
    """The environment of every phase's process: caches under ``work``, offline hub, the backend choice."""
    env = dict(os.environ)
    env.update(
        TRITON_CACHE_DIR=os.path.join(work, "triton"),
        MPLCONFIGDIR=os.path.join(work, "mpl"),
        HF_HOME=os.path.join(work, "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
        OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH")) if p)
    if args.backend:
        env["GRPO_MEM_BACKEND"] = args.backend
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def phase_command(args, phase: str, work: str) -> list[str]:
    """The command line of ``phase``: pytest for kernels, this script with ``--run-phase`` for the others."""
    if phase == "kernels":
        cmd = [sys.executable, "-m", "pytest", os.path.join(REPO, "tests/ops/test_triton_cuda.py"), "-q", "-rfE"]
        if args.device == "cuda":  # the model-level check of the way back: torch and Triton backends against stock
            cmd.insert(4, os.path.join(REPO, "tests/ops/test_backend_choice.py::test_cuda_backends_score_like_stock"))
        cmd += ["-p", "no:cacheprovider", "--durations=15", f"--junitxml={os.path.join(args.out, 'kernels.xml')}"]
        cmd += ["-o", f"cache_dir={os.path.join(work, 'pytest_cache')}"]
        select = args.select or "not under_interpreter"
        if args.device == "cpu" and args.tiny and not args.select:
            # CI runs every toy case through the module's own interpreter test; the check exercises a few
            select = "(tree-r2 and bf16) or (linear_logprobs and qwen-2k- and fp32) or (selective and bf16)"
        cmd += ["-k", select]
        if args.device == "cuda" and _has_xdist():
            # compiling dominates; the cases with the largest fp64 truths share one process (xdist_group "large")
            cmd += ["-n", "6", "--dist", "loadgroup"]
        return cmd
    cmd = [sys.executable, os.path.abspath(__file__), "--run-phase", phase, "--out", args.out, "--work", work]
    cmd += ["--device", args.device] + (["--tiny"] if args.tiny else [])
    return cmd


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def run_phase(args, phase: str, work: str, limit: float, log: Log) -> tuple[str, float]:
    """Run ``phase`` in its own process for at most ``limit`` seconds; log its command and output tail; returns
    (status, seconds): "ok", "FAILED(rc)", "TIMEOUT"."""
    env = phase_env(args, work)
    env["GPU_CHECK_DEADLINE"] = str(time.time() + limit)  # the perf phase skips what cannot finish before it
    if phase == "kernels":
        env["GPU_CHECK_CSV"] = os.path.join(work, "kernels_rows.csv")
        if args.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
    cmd = phase_command(args, phase, work)
    out_path = os.path.join(work, f"{phase}.out")
    log.write(f"\n===== {phase} (limit {limit:.0f} s): {' '.join(cmd)}")
    start = time.perf_counter()
    with open(out_path, "w") as out:
        # its own process group, so that a timeout also ends what it started (xdist workers, bench's children)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"FAILED({rc})"
        except subprocess.TimeoutExpired:
            status = "TIMEOUT"
            _kill_group(proc)
    seconds = time.perf_counter() - start
    with open(out_path, errors="replace") as f:
        lines = f.read().splitlines()
    if len(lines) > LOG_TAIL_LINES:
        log.write(f"[... {len(lines) - LOG_TAIL_LINES} earlier lines in {out_path}]")
    log.write("\n".join(lines[-LOG_TAIL_LINES:]))
    if phase == "kernels":
        merged = merge_kernel_csvs(work, os.path.join(args.out, "kernels.csv"))
        log.write(f"kernels.csv: {merged} rows")
        xml = os.path.join(args.out, "kernels.xml")
        if not os.path.exists(xml):  # pytest writes it only when it ends; kernels.csv holds what was measured
            with open(xml, "w") as f:
                f.write(
                    f'<testsuites><testsuite name="kernels" tests="0" failures="0" errors="1"><testcase '
                    f'name="kernels phase"><error message="{status} after {time.perf_counter() - start:.0f} s: '
                    f'see run.log and kernels.csv"/></testcase></testsuite></testsuites>\n'
                )
    log.write(f"===== {phase}: {status} in {seconds:.1f} s")
    return status, seconds


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL 10 s later if it is still there."""
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def merge_kernel_csvs(work: str, dest: str) -> int:
    """The test processes' CSVs (``kernels_rows.csv`` and ``kernels_rows.csv.gw*``) into ``dest``: every error row,
    each compiled kernel once; returns the number of rows written."""
    rows, seen, columns = [], set(), None
    for path in sorted(glob.glob(os.path.join(work, "kernels_rows.csv*"))):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = columns or reader.fieldnames
            for row in reader:
                key = tuple(row.values())
                if row.get("kind") == "kernel" and key in seen:
                    continue
                seen.add(key)
                rows.append(row)
    if columns is None:
        return 0
    with open(dest, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def main(argv=None) -> int:
    args = parse(argv)
    args.out = os.path.abspath(args.out)
    if args.run_phase:
        return RUNNERS[args.run_phase](args)
    os.makedirs(os.path.join(args.out, "bench"), exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_check-")
    log = Log(os.path.join(args.out, "run.log"))
    log.write(
        f"gpu_check: device {args.device}{' (tiny)' if args.tiny else ''}, phases {','.join(args.phases)}, budget "
        f"{args.budget_s:.0f} s, GRPO_MEM_BACKEND={args.backend or os.environ.get('GRPO_MEM_BACKEND', '(unset)')}, "
        f"work directory {work}"
    )
    limits = TINY_LIMITS if args.tiny else LIMITS
    start = time.perf_counter()
    results = {}
    for phase in args.phases:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 5:
            results[phase] = ("skipped(budget)", 0.0)
            continue
        results[phase] = run_phase(args, phase, work, min(limits[phase], left), log)
    table = " | ".join(f"{p} {s} {t:.0f}s" for p, (s, t) in results.items())
    log.write(f"gpu_check summary ({time.perf_counter() - start:.0f} s): {table}")
    return 0 if all(s == "ok" for s, _ in results.values()) else 1


# ------------------------------------------------------------------------------------------------- phase: env


def run_env(args) -> int:
    from importlib import metadata

    lines = [f"python {sys.version.split()[0]} ({sys.executable})"]
    for name in (
        "torch",
        "triton",
        "transformers",
        "trl",
        "accelerate",
        "datasets",
        "peft",
        "regex",
        "pyarrow",
        "tokenizers",
        "huggingface_hub",
        "safetensors",
        "pytest",
        "pytest-xdist",
        "matplotlib",
    ):
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    import torch

    import grpo_mem

    lines.append(f"grpo_mem {grpo_mem.__version__} from {os.path.dirname(grpo_mem.__file__)}")
    lines.append(f"GRPO_MEM_BACKEND={os.environ.get('GRPO_MEM_BACKEND', '(unset)')}")
    lines.append(f"torch CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
    ok = True
    if args.device == "cuda":
        if not torch.cuda.is_available():
            lines.append("ERROR: --device cuda but torch sees no CUDA device")
            ok = False
        else:
            lines += _cuda_env_lines(torch)
    lines.append(f"cpus {len(os.sched_getaffinity(0))}")
    lines.append(_command(["git", "-C", REPO, "log", "-1", "--format=%H %s"]))
    with open(os.path.join(args.out, "env.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


def _cuda_env_lines(torch) -> list[str]:
    """Device 0's properties, Triton's view of it, ``nvidia-smi``'s clocks/temperature/power and the CUDA tools'
    versions, as ``env.txt`` lines."""
    p = torch.cuda.get_device_properties(0)
    lines = [
        f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB"
    ]
    for attr in ("shared_memory_per_block_optin", "shared_memory_per_multiprocessor", "L2_cache_size"):
        lines.append(f"  {attr} {getattr(p, attr, '?')}")
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(0)
        lines.append(f"triton device properties: {props}")
    except Exception as exc:  # noqa: BLE001 - report whatever failed
        lines.append(f"triton device properties: failed: {exc!r}")
    lines.append(
        _command(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,clocks.sm,clocks.mem,"
                "clocks.max.sm,temperature.gpu,power.draw,power.limit,memory.used,memory.total",
                "--format=csv",
            ]
        )
    )
    lines.append(_command(["nvcc", "--version"])[-200:])
    lines.append(_command(["compute-sanitizer", "--version"])[-120:])
    lines.append(_command(["cuobjdump", "--version"])[-120:])
    return lines


def _command(cmd: list[str]) -> str:
    """``cmd``'s output, or why it did not run."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return f"$ {' '.join(cmd[:2])}\n{(proc.stdout + proc.stderr).strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"$ {cmd[0]}: {exc}"


# ------------------------------------------------------------------------------------------------- phase: perf

PERF_OPS = ("multi_region_attention", "linear_logprobs")
"""The ops whose backends the perf phase compares (``grpo_mem.ops._backends.TABLE``'s keys)."""
PERF_CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "_mra_")),
    ("head", ("logprob", "log_softmax", "entropy", "cross_entropy", "_forward_kernel", "_backward_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::bmm", "aten::addmm", "aten::matmul")),
    ("memset", ("memset", "fill", "zero")),
    (
        "copies",
        (
            "memcpy",
            "copy",
            "cat",
            "index",
            "gather",
            "scatter",
            "clone",
            "stack",
            "embedding",
            "repeat",
            "slice_backward",
        ),
    ),
    ("elementwise", ("elementwise", "reduce", "norm", "softmax")),
)
"""Kernel time by category: the first category one of whose patterns is a substring of the lower-cased kernel name
(CUDA: the device kernel's, e.g. ``_mra_fwd_kernel``, ``flash_fwd_kernel``, ``nvjet_hsh_...``,
``vectorized_elementwise_kernel<4, FillFunctor<...>>``, ``Memcpy DtoH``; CPU: the ATen op's, ``aten::mm``).
grpo_mem's Triton kernels are ``_mra_*`` (attention) and ``_linear_logprobs_*``/``_selective_log_softmax_*`` (head);
TRL's Triton head kernels are ``_forward_kernel``/``_backward_kernel``. A fused head's own GEMM work counts as head,
a head computed by cuBLAS GEMMs as gemm. On CPU an ATen op matching none is elementwise when torch tags it pointwise
or reduction. The rest: ``other``."""
CATEGORY_NAMES = tuple(name for name, _ in PERF_CATEGORIES) + ("other",)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that block the host until the device is done (PyTorch reads a value, ``item`` or
``nonzero``'s size, by an asynchronous copy and a ``cudaStreamSynchronize``)."""
PERF_METRICS = (
    ("wall_time", "s"),
    ("peak_memory", "MB"),
    ("launches", "kernels"),
    ("host_syncs", "syncs"),
    ("gpu_idle_share", "fraction"),
    ("busy_time", "ms"),
    ("profiled_wall_time", "s"),
) + tuple((f"kernel_time_{c}", "ms") for c in CATEGORY_NAMES)
"""perf.csv's metrics, one row each per (shape, provider): see :func:`run_perf`."""


def classify_kernel(name: str) -> str:
    """The category of :data:`PERF_CATEGORIES` of a kernel (or CPU op) named ``name``; ``"other"`` if none."""
    low = name.lower()
    for category, patterns in PERF_CATEGORIES:
        if any(p in low for p in patterns):
            return category
    return "elementwise" if low.startswith("aten::") and _pointwise_or_reduction(low[6:]) else "other"


@functools.lru_cache(maxsize=None)
def _pointwise_or_reduction(op: str) -> bool:
    import torch

    packet = getattr(torch.ops.aten, op, None)
    tags = {t for o in (packet.overloads() if packet is not None else ()) for t in getattr(packet, o).tags}
    return bool(tags & {torch.Tag.pointwise, torch.Tag.reduction})


def busy_us(intervals) -> float:
    """Microseconds covered by the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclass(frozen=True)
class PerfDevice:
    """What the perf phase does differently per device (:data:`PERF_DEVICES`).

    activities: the profiler's (``torch.profiler.ProfilerActivity`` names). mark, seconds: a clock, ``seconds(a, b)``
    between two ``mark()``s, waiting for the device. peak_mb: the peak memory in MB of ``fn()``, what it measures named
    by ``memory``. kernels: ``(name, start_us, end_us, self_us)`` of the events of the profile ``prof`` that are
    kernel time. counts: ``(launches, host syncs)`` of the profiled call, from ``prof`` or by counting ``call()``, one
    more step.
    free: run between shapes. name: the CSV's ``device``.
    """

    activities: tuple[str, ...]
    mark: Callable
    seconds: Callable
    peak_mb: Callable
    memory: str
    kernels: Callable
    counts: Callable
    free: Callable
    name: Callable


def _cuda_mark():
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _cuda_seconds(start, end) -> float:
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _cuda_peak_mb(fn) -> float:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 1e6


def _raw_events(prof) -> list:
    """The profiler's raw Kineto events (``name()``, ``device_type()``, ``start_ns()``, ``end_ns()``):
    ``torch.profiler``'s ``events()`` would first build a Python tree of every event, about 100 us each, 10 s for one
    28-layer grpo_mem call."""
    return prof.profiler.kineto_results.events()


def _cuda_kernels(prof) -> list:
    """The device's kernels, copies and memsets (the device-side copy of the :data:`STEP_LABEL` range left out)."""
    from torch.autograd import DeviceType

    raw = [e for e in _raw_events(prof) if e.device_type() == DeviceType.CUDA and e.name() != STEP_LABEL]
    return [(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3, (e.end_ns() - e.start_ns()) / 1e3) for e in raw]


def _cuda_counts(prof, call) -> tuple[int, int]:
    """Kernel launches (the device's kernels; copies and memsets are none) and host syncs (:func:`syncs_in_step`)."""
    launches = [k for k in _cuda_kernels(prof) if not k[0].startswith(("Memcpy", "Memset"))]
    return len(launches), syncs_in_step(_raw_events(prof))


def syncs_in_step(raw) -> int:
    """The :data:`SYNC_CALLS` among Kineto events ``raw`` that start inside the host-side :data:`STEP_LABEL` range."""
    from torch.autograd import DeviceType

    step = next(e for e in raw if e.name() == STEP_LABEL and e.device_type() == DeviceType.CPU)
    lo, hi = step.start_ns(), step.end_ns()
    return sum(1 for e in raw if e.name() in SYNC_CALLS and lo <= e.start_ns() <= hi)


def _cuda_free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _cuda_name() -> str:
    from grpo_mem.bench.harness_cuda import cuda_device_name

    return cuda_device_name()


def _cpu_peak_mb(fn) -> float:
    from grpo_mem.bench.measure import PeakRSS, release_free_memory

    release_free_memory()
    with PeakRSS() as peak:
        fn()
    return peak.peak_above_base / 1e6


def _cpu_kernels(prof) -> list:
    """The profiled ATen ops (and this package's ``grpo_mem::`` ops) that run a kernel of their own on CPU (views,
    allocations and composite ops left out: ``grpo_mem.bench.launches.launches_kernel``), with their self time."""
    from torch.autograd import DeviceType

    from grpo_mem.bench.launches import launches_kernel

    ops = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.name.startswith(("aten::", "grpo_mem::"))]
    ops = [e for e in ops if launches_kernel(e.name)]
    return [(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total) for e in ops]


def _cpu_counts(prof, call) -> tuple[int, int]:
    """The launching ATen ops and host reads of ``call()`` (``grpo_mem.bench.launches``, as
    ``benchmarks/bench_launches.py`` counts them)."""
    from grpo_mem.bench.launches import count_call

    counts = count_call(call)
    return counts.total_launches, counts.host_reads()


def _cpu_name() -> str:
    import torch

    from grpo_mem.bench.results import device_name

    return device_name(torch.get_num_threads())


PERF_DEVICES = {
    "cuda": PerfDevice(
        ("CPU", "CUDA"),
        _cuda_mark,
        _cuda_seconds,
        _cuda_peak_mb,
        "max_memory_allocated",
        _cuda_kernels,
        _cuda_counts,
        _cuda_free,
        _cuda_name,
    ),
    "cpu": PerfDevice(
        ("CPU",),
        time.perf_counter,
        lambda start, end: end - start,
        _cpu_peak_mb,
        "rss_above_base",
        _cpu_kernels,
        _cpu_counts,
        gc.collect,
        _cpu_name,
    ),
}
"""The device-specific parts of the perf phase; everything else runs the same on both."""


def perf_providers(device: str, dtype) -> list[tuple[str, str | None]]:
    """``(provider, backend preference)`` of each run: stock TRL (``("trl", None)``), then grpo_mem under each
    preference of ``grpo_mem.ops._backends.CHOICES`` (``auto`` first) that runs another pair of backends of
    :data:`PERF_OPS` on ``device`` ``dtype`` tensors than the ones before: ``grpo_mem[<name>]`` when both ops run the
    backend ``<name>``, else ``grpo_mem[<attention>/<head>]``. A backend of ``TABLE`` that runs there but that no
    preference reaches is printed."""
    import torch

    from grpo_mem.ops import _backends

    probe = torch.empty(1, dtype=dtype, device=device)
    out, seen = [("trl", None)], set()
    for preference in ("auto",) + tuple(c for c in _backends.CHOICES if c != "auto"):
        previous = _backends.set_preference(preference)
        try:
            pair = tuple(_backends.resolve(op, "auto", probe) for op in PERF_OPS)
        finally:
            _backends.set_preference(previous)
        if pair not in seen:
            seen.add(pair)
            out.append((f"grpo_mem[{pair[0] if pair[0] == pair[1] else '/'.join(pair)}]", preference))
    for i, op in enumerate(PERF_OPS):
        runs = [
            e.name
            for e in _backends.TABLE[op]
            if not e.why_not(probe.device)
            and (e.dtypes is None or dtype in e.dtypes)
            and not (device == "cpu" and e.interpreted_on_cpu)
        ]
        missed = [name for name in runs if name not in {p[i] for p in seen}]
        if missed:
            print(f"perf: {op} backends {missed} run here but no backend preference selects them", flush=True)
    return out


def perf_batches(shape: dict, vocab: int, device: str) -> list:
    """One prompt group of ``shape["G"]`` completions (``grpo_mem.bench.group.make_inputs``: P, C as given) as
    micro-batches of ``shape["micro"]`` rows, ``(input_ids, attention_mask)`` each, on ``device``."""
    from grpo_mem.bench.group import make_inputs

    ids, mask, _ = make_inputs(shape["G"], shape["P"], shape["C"], 1, vocab)
    ids, mask, m = ids.to(device), mask.to(device), shape["micro"]
    return [(ids[i : i + m], mask[i : i + m]) for i in range(0, ids.shape[0], m)]


def perf_measure(dev: PerfDevice, model, batches: list, C: int, preference: str | None, repeats: int) -> dict:
    """One provider at one shape (see :func:`run_perf`): stock TRL's scoring window (``preference`` None) or
    grpo_mem's tree-sharing window under the backend ``preference``; returns the metrics of :data:`PERF_METRICS`
    (``wall_time``: the list of timed calls' seconds) and ``ran``, the backend each op of :data:`PERF_OPS` ran."""
    from grpo_mem.bench.launches import scoring_step
    from grpo_mem.ops import _backends

    previous = _backends.set_preference(preference)
    try:
        step = scoring_step("trl" if preference is None else "grpo_mem_tree", model, batches, C)

        def call():
            model.zero_grad(set_to_none=True)
            step()

        _backends.RESOLVED.clear()
        call()  # warm-up: compilation, the model's one-time installs
        ran = {op: _backends.RESOLVED.get(op, "-") for op in PERF_OPS} if preference else {}
        times = []

        def timed():
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                start = dev.mark()
                step()
                times.append(dev.seconds(start, dev.mark()))

        peak = dev.peak_mb(timed)
        model.zero_grad(set_to_none=True)
        prof, profiled = _profiled(dev, step)
        launches, syncs = dev.counts(prof, call)
    finally:
        _backends.set_preference(previous)
    return dict(
        _kernel_metrics(dev.kernels(prof), profiled),
        ran=ran,
        wall_time=times,
        peak_memory=peak,
        launches=launches,
        host_syncs=syncs,
        profiled_wall_time=profiled,
    )


STEP_LABEL = "gpu_check.perf.step"
"""The ``record_function`` range around the profiled call: host syncs are counted inside it (leaving out the
profiler's own synchronisation when it stops)."""


def _profiled(dev: PerfDevice, step) -> tuple[object, float]:
    """``step()`` once under ``torch.profiler`` with ``dev``'s activities, inside a :data:`STEP_LABEL` range: the
    profile and the call's seconds."""
    import torch

    activities = [getattr(torch.profiler.ProfilerActivity, a) for a in dev.activities]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function(STEP_LABEL):
            start = dev.mark()
            step()
            end = dev.mark()
    return prof, dev.seconds(start, end)


def _kernel_metrics(kernels: list, wall_s: float) -> dict:
    """Kernel time by category and busy time (ms) of the profiled call's ``kernels``, and its idle share,
    1 - busy / ``wall_s``, both from the profiled call (the profiler's own host overhead counts as idle)."""
    by_category = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for name, _, _, self_us in kernels:
        by_category[classify_kernel(name)] += self_us / 1e3
    busy_ms = busy_us((start, end) for _, start, end, _ in kernels) / 1e3
    idle = max(0.0, 1.0 - busy_ms / 1e3 / wall_s)
    return dict({f"kernel_time_{c}": t for c, t in by_category.items()}, busy_time=busy_ms, gpu_idle_share=idle)


def perf_rows(provider: str, shape: dict, config: dict, dev: PerfDevice, metrics: dict | None, reason: str = ""):
    """perf.csv's rows (``grpo_mem.bench.results`` long format, op ``perf``) of one provider at one shape: one per
    metric of :data:`PERF_METRICS`, or, with ``metrics`` None, rows recording why it was skipped."""
    from grpo_mem.bench import measure, results

    if metrics is None:
        return results.skipped_rows(
            "perf", provider, "full", "P", shape["P"], config, reason, metrics=PERF_METRICS, device=dev.name()
        )
    key = dict(
        op="perf",
        provider=provider,
        mode="full",
        x_name="P",
        x_value=shape["P"],
        device=dev.name(),
        timestamp=results.now_utc(),
        version=results.versions(),
    )
    config = dict(config, **{op: name for op, name in metrics["ran"].items()})
    rows = []
    for metric, unit in PERF_METRICS:
        value = metrics[metric]
        p50, p20, p80 = measure.percentiles(value) if metric == "wall_time" else (value, value, value)
        n = len(value) if metric == "wall_time" else 1
        rows.append(
            dict(
                key,
                metric=metric,
                unit=unit,
                p50=p50,
                p20=p20,
                p80=p80,
                config=json.dumps(dict(config, n=n), sort_keys=True),
            )
        )
    return rows


def run_perf(args) -> int:
    """Where the time goes: for each shape of ``settings()["perf"]`` (the more important first), a model of random
    weights drawn on the device, then per provider (:func:`perf_providers`) one warm-up call of the scoring window
    (every micro-batch's log-probs and entropies and their backward), ``repeats`` timed calls (their peak memory), one
    call under ``torch.profiler`` (kernel time by category, launches, host syncs, idle share) -> ``perf.csv``, rows
    written as each provider ends; a summary per shape on stdout (run.log). A provider that cannot finish before the
    phase's deadline (``GPU_CHECK_DEADLINE``), or raises, gets skipped rows saying why; a raise fails the phase."""
    import torch

    s = settings(args.tiny)["perf"]
    dev, dtype = PERF_DEVICES[args.device], getattr(torch, s["dtype"])
    providers = perf_providers(args.device, dtype)
    print(f"perf: providers {[p for p, _ in providers]} on {dev.name()}, {s['dtype']}", flush=True)
    state = dict(status=0, written=False, longest=0.0, path=os.path.join(args.out, "perf.csv"))
    for shape in s["shapes"]:
        _perf_shape(args, s, dev, shape, providers, state)
    return state["status"]


def _perf_shape(args, s: dict, dev: PerfDevice, shape: dict, providers: list, state: dict) -> None:
    """Every provider at ``shape`` (see :func:`run_perf`), its rows appended to ``state["path"]``, then the shape's
    summary printed."""
    import traceback

    from grpo_mem.bench import results
    from grpo_mem.bench.group import build_model

    model_cfg = s["model"]
    model = build_model(model_cfg, dtype=s["dtype"], device=args.device)
    batches = perf_batches(shape, model_cfg["vocab_size"], args.device)
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", "inf"))
    summary = []
    for provider, preference in providers:
        config = dict(
            shape,
            model=s["name"],
            model_layers=model_cfg["num_hidden_layers"],
            hidden=model_cfg["hidden_size"],
            dtype=s["dtype"],
            micro_batches=len(batches),
            sharing=None if preference is None else "tree",
            preference=preference,
            memory=dev.memory,
        )
        left, start, metrics, reason = deadline - time.time(), time.perf_counter(), None, ""
        if left < 1.5 * state["longest"] + 10:
            reason = (
                f"{left:.0f} s left before the phase's limit; the longest provider so far took {state['longest']:.0f} s"
            )
        else:
            try:
                metrics = perf_measure(dev, model, batches, shape["C"], preference, shape["repeats"])
            except Exception as exc:  # noqa: BLE001 - recorded, the other providers still run
                traceback.print_exc()
                reason, state["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", 1
        dev.free()  # what the provider (or its failure's traceback) held, before the next one
        state["longest"] = max(state["longest"], time.perf_counter() - start)
        results.write_csv(
            perf_rows(provider, shape, config, dev, metrics, reason), state["path"], append=state["written"]
        )
        state["written"] = True
        summary.append((provider, metrics, reason))
        print(
            f"perf P={shape['P']} C={shape['C']} {provider}: {'done' if metrics else 'skipped: ' + reason}", flush=True
        )
    del model, batches
    dev.free()
    print(perf_summary(shape, summary), flush=True)


def perf_summary(shape: dict, summary: list) -> str:
    """The run.log table of one shape: per provider wall time (p50) and its ratio to stock TRL's, peak memory,
    launches, host syncs, idle share and the three largest kernel-time categories."""
    import statistics

    from grpo_mem.bench.results import markdown_table

    stock = next((statistics.median(m["wall_time"]) for p, m, _ in summary if p == "trl" and m), float("nan"))
    lines = []
    for provider, m, reason in summary:
        if m is None:
            lines.append([provider] + [None] * 6 + [f"skipped: {reason}"[:60]])
            continue
        wall = statistics.median(m["wall_time"])
        times = {c: m[f"kernel_time_{c}"] for c in CATEGORY_NAMES}
        total = max(sum(times.values()), 1e-9)
        where = ", ".join(f"{c} {t / total:.0%}" for c, t in sorted(times.items(), key=lambda kv: -kv[1])[:3])
        lines.append(
            [provider, wall, wall / stock, m["peak_memory"], m["launches"], m["host_syncs"], m["gpu_idle_share"], where]
        )
    title = f"perf P={shape['P']}, C={shape['C']}, G={shape['G']}, micro-batches of {shape['micro']}:"
    headers = ["provider", "wall s", "x stock", "peak MB", "launches", "host syncs", "idle", "kernel time"]
    return title + "\n" + markdown_table(headers, lines)


# ---------------------------------------------------------------------------------------------- phase: verify


def _model(config: dict, dtype, device: str):
    """A randomly initialised causal LM of ``config`` (a config.json dict) in ``dtype`` on ``device``, SDPA."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = dict(config)
    cfg_obj = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg_obj, attn_implementation="sdpa", dtype=dtype)
    return model


def run_verify(args) -> int:
    import torch

    import grpo_mem
    from grpo_mem.bench.group import make_inputs

    s = settings(args.tiny)
    b = s["verify_batch"]
    device = args.device
    model = _model(s["verify_model"], torch.bfloat16, device)
    ids, attn, cmask = make_inputs(
        b["G"], b["P"], b["C"], b["groups"], s["verify_model"]["vocab_size"], shared_prefix=b["shared_prefix"]
    )
    P = b["P"]
    batch = {
        "prompt_ids": ids[:, :P].to(device),
        "prompt_mask": attn[:, :P].to(device),
        "completion_ids": ids[:, P:].to(device),
        "completion_mask": cmask.to(device),
    }
    lines = [
        f"verify: {s['verify_model']['num_hidden_layers']}-layer {s['verify_model']['model_type']} of hidden "
        f"{s['verify_model']['hidden_size']}, vocabulary {s['verify_model']['vocab_size']}, bf16 weights, {device}; "
        f"{b['groups']} prompts x G={b['G']}, P={P}, C={b['C']}, shared prefix {b['shared_prefix']}, micro-batch "
        f"{b['micro']}"
    ]
    passed = True
    for checkpointing in (False, True):
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        report = grpo_mem.verify(model, batch, micro_batch_size=b["micro"], print_report=False)
        seconds = time.perf_counter() - start
        peak = (
            f", peak {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB above base"
            if device == "cuda"
            else ""
        )
        paths = sorted({m.path for m in report.micro_batches})
        lines += [
            "",
            f"--- gradient checkpointing {'on (non-reentrant)' if checkpointing else 'off'}: "
            f"{'PASSED' if report.passed else 'FAILED'} in {seconds:.1f} s{peak}; paths {paths}",
            str(report),
        ]
        passed = passed and report.passed and paths == ["prompt-once"]
    lines.append(f"\nverify: {'PASSED' if passed else 'FAILED'} (both runs passed, every micro-batch prompt-once)")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "verify.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if passed else 1


# ----------------------------------------------------------------------------------------------- phase: train


def _train_one(s: dict, work: str, device: str, patched: bool, precision: str) -> dict:
    """One training run of ``make_trainer`` (stock or patched): per-step log, gradients and final weights."""
    import torch
    from helpers import GradientRecorder, make_trainer

    t = s["train"]
    args = dict(
        max_steps=t["steps"],
        per_device_train_batch_size=t["batch"],
        num_generations=t["generations"],
        max_completion_length=t["completion"],
        use_cpu=device == "cpu",
        bf16=precision == "bf16",
        optim="sgd" if precision == "fp32" else "adamw_torch",
        learning_rate=1e-2 if precision == "fp32" else 1e-4,
    )
    model_args = dict(
        hidden_size=t["hidden"],
        intermediate_size=2 * t["hidden"],
        num_attention_heads=t["heads"],
        num_key_value_heads=t["kv_heads"],
    )
    out = os.path.join(work, f"train-{precision}-{'patched' if patched else 'stock'}")
    trainer, handle = make_trainer(patch=patched, group_shuffle=None, output_dir=out, model_args=model_args, **args)
    record = GradientRecorder()
    trainer.add_callback(record)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        if handle is not None:
            handle.revert()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    steps = [h for h in trainer.state.log_history if "loss" in h]
    keep = ("loss", "reward", "grad_norm", "completions/mean_length", "entropy")
    return dict(
        seconds=round(seconds, 2),
        peak_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1) if device == "cuda" else None,
        steps=[{k: h.get(k) for k in keep} for h in steps],
        grads=[{n: g.float().cpu() for n, g in step.items()} for step in record.grads],
        weights={n: p.detach().float().cpu() for n, p in trainer.model.named_parameters()},
    )


def _compare_runs(stock: dict, ours: dict, precision: str) -> dict:
    """Per step: whether the sampled batch matched (reward and completion length equal), the loss difference and
    (matched steps) the largest per-parameter gradient difference over that parameter's largest entry; the final
    weights' largest difference; ``passed`` by the bounds of ``tests/patches/test_patch_trl.py`` in fp32 (gradients
    1e-4 relative, weights 1e-5 absolute when every step matched) and finite, stock-close losses in bf16."""
    import math

    per_step, ok = [], True
    for i, (a, b) in enumerate(zip(stock["steps"], ours["steps"])):
        same = a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
        finite = all(v is None or math.isfinite(v) for v in (b["loss"], b["grad_norm"]))
        row = dict(step=i + 1, same_batch=same, loss_stock=a["loss"], loss_patched=b["loss"], finite=finite)
        ok = ok and finite
        if same and i < len(stock["grads"]) and i < len(ours["grads"]):
            rel = max(
                ((ours["grads"][i][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                for n, g in stock["grads"][i].items()
            )
            row["max_grad_rel_diff"] = rel
            if precision == "fp32":
                ok = ok and rel <= 1e-4
            else:
                ok = ok and abs(b["loss"] - a["loss"]) <= 1e-2 + 2e-2 * abs(a["loss"])
        per_step.append(row)
    all_same = all(r["same_batch"] for r in per_step) and len(per_step) == len(stock["steps"]) > 0
    wdiff = max((ours["weights"][n] - w).abs().max().item() for n, w in stock["weights"].items())
    if precision == "fp32" and all_same:
        ok = ok and wdiff <= 1e-5
    return dict(steps=per_step, all_steps_same_batch=all_same, final_weight_max_abs_diff=wdiff, passed=bool(ok))


def run_train(args) -> int:
    s = settings(args.tiny)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    result = dict(device=args.device, settings=s["train"], runs={})
    passed = True
    for precision in ("fp32", "bf16"):
        if precision == "bf16" and args.device == "cuda":
            import torch

            if not torch.cuda.is_bf16_supported():
                continue
        stock = _train_one(s, args.work, args.device, False, precision)
        ours = _train_one(s, args.work, args.device, True, precision)
        cmp = _compare_runs(stock, ours, precision)
        passed = passed and cmp["passed"]
        result["runs"][precision] = {
            "stock": {k: stock[k] for k in ("seconds", "peak_mib", "steps")},
            "patched": {k: ours[k] for k in ("seconds", "peak_mib", "steps")},
            "compare": cmp,
        }
        print(f"train {precision}: passed {cmp['passed']}; {json.dumps(cmp)}", flush=True)
    result["passed"] = passed
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    return 0 if passed else 1


# ----------------------------------------------------------------------------------------------- phase: bench


def run_bench(args) -> int:
    s = settings(args.tiny)
    dest = os.path.join(args.out, "bench")
    os.makedirs(dest, exist_ok=True)
    csvs, status = [], 0
    env = dict(os.environ)
    for name, config, b in s["bench"]:
        model_dir = os.path.join(args.work, name)
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        out_dir = os.path.join(args.work, f"bench-{name}")
        cmd = [sys.executable, "-m", "grpo_mem.commands.bench", "--model", model_dir, "--device", args.device]
        cmd += ["--dtype", b["dtype"], "--prompt-length", str(b["P"]), "--max-completion-length", str(b["C"])]
        cmd += ["--num-generations", str(b["G"]), "--per-device-train-batch-size", str(b["micro"])]
        cmd += ["--repeats", str(b["repeats"]), "--output-dir", out_dir]
        print(f"$ {' '.join(cmd)}", flush=True)
        if args.tiny:
            rc = _bench_in_process(cmd[3:])
        else:
            rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        print(f"bench {name}: exit status {rc}", flush=True)
        status = status or rc
        if os.path.exists(os.path.join(out_dir, "bench.csv")):
            csvs.append(os.path.join(out_dir, "bench.csv"))
        # after each setting, so that a phase stopped at its time limit still returns the settings that ran
        _concat_csv(csvs, os.path.join(dest, "bench.csv"))
    if long := os.environ.get("GRPO_MEM_GPU_CHECK_LONG"):  # off by default: the long-prompt grid of bench_long.py
        # "1": its whole grid (P 4K-32K, C 64/512/4K, G 8/16, stock TRL vs grpo_mem); else an --only list, M/P/C/G,...
        cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_long.py"), "--device", args.device]
        cmd += ["--csv", os.path.join(dest, "long.csv"), "--png", os.path.join(dest, "long.png")]
        cmd += [] if long == "1" else ["--only", long]
        status = status or subprocess.run(cmd, cwd=REPO, env=env).returncode
    return 0 if status == 0 and len(csvs) == len(s["bench"]) else 1


def _bench_in_process(argv: list[str]) -> int:
    """``grpo-mem bench``'s ``main(argv)`` in this process with each provider run in this process too (``--tiny``:
    a fresh process per provider costs about 30 s of imports on a 2-core CI machine; the CLI's own tests cover the
    isolation). Memory figures are then not per provider; only the plumbing is checked."""
    import importlib

    import grpo_mem.bench.sweep as sweep
    from grpo_mem.commands import bench

    def in_process(target: str, **_):
        module, name = target.split(":")
        return getattr(importlib.import_module(module), name)

    original, sweep.isolated = sweep.isolated, in_process
    try:
        return bench.main(argv)
    finally:
        sweep.isolated = original


def _concat_csv(paths: list[str], dest: str) -> None:
    """The long-format CSVs of each bench run (same columns) as one file."""
    if not paths:
        return
    with open(dest, "w") as out:
        for i, path in enumerate(paths):
            with open(path) as f:
                lines = f.read().splitlines(keepends=True)
            out.writelines(lines if i == 0 else lines[1:])


RUNNERS = {"env": run_env, "perf": run_perf, "verify": run_verify, "train": run_train, "bench": run_bench}

if __name__ == "__main__":
    sys.exit(main())

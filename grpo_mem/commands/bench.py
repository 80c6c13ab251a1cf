"""``grpo-mem bench``: will grpo_mem help on my model? One scoring forward + backward, stock TRL against grpo_mem.

For a model shape (a preset, or a local HF model directory's ``config.json``: only the configuration is read, the
weights are random, nothing is downloaded) and a batch shape (G completions of C tokens per prompt of P tokens), each
provider scores the completions and backpropagates once, in its own fresh process (the benchmark library's sweep,
:mod:`grpo_mem.bench.sweep`; the op and providers of :mod:`grpo_mem.bench.group`): stock TRL 1.16 (``trl``), then
grpo_mem in each sharing mode the installed grpo_mem offers (``grpo_mem``: each group's prompt once;
``grpo_mem_tree`` when ``shared_prompt_logprobs`` takes ``sharing="tree"``). With ``--image-tokens N`` (a
vision-language model such as the ``qwen2.5-vl-3b`` preset) every prompt holds one image of N tokens and the providers
are TRL's own scoring method and the patched one (:mod:`grpo_mem.bench.vision`). Printed: wall time, CPU time,
peak memory above the process's base, their ratios to stock TRL, and the largest log-prob difference from stock TRL.
Written: ``bench.csv`` (:mod:`grpo_mem.bench.results`' long format) and ``bench.png`` in ``--output-dir``.

``--device`` and ``--dtype`` default to ``auto``, resolved as ``grpo-mem train`` resolves them: CUDA where torch sees a
GPU (bf16 there when it supports it), else CPU and fp32.

Before running, the peak memory of stock TRL's step and of grpo_mem's is estimated (:mod:`grpo_mem.bench.fits`) and
compared with the memory this machine has available (``MemAvailable`` of ``/proc/meminfo``; CUDA: free device memory).
Where stock's estimate does not fit, one line says so with the estimate, stock TRL is not run (its CSV rows say why,
the table's ratios are ``-``) and grpo_mem's providers run alone; a shape whose grpo_mem estimate does not fit either is
refused with the estimate and what to lower, instead of swapping. Each child is also killed if its resident set grows
past the available memory (:func:`~grpo_mem.bench.isolate.run_isolated`'s RSS budget).

Child processes run with ``OMP_WAIT_POLICY=PASSIVE`` unless the variable is set (see ``grpo_mem.cli``: spinning OpenMP
threads cost several times the time on cores shared with other processes).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Sequence

from grpo_mem.bench.estimate import DTYPES, GB, ModelShape, model_shape
from grpo_mem.bench.fits import (
    MemoryEstimate,
    available_memory_bytes,
    estimate_grpo_mem_memory,
    estimate_stock_memory,
    plan_runs,
)
from grpo_mem.bench.presets import PRESETS, ModelSpec, resolve_model
from grpo_mem.commands.flags import DefaultsFormatter, check_output_dir, non_negative_int, num_generations, positive_int
from grpo_mem.commands.train_settings import DEVICES, resolve_device
from grpo_mem.commands.train_settings import DTYPES as DTYPE_FLAGS

OP = "group_logprobs"
"""The CSV's ``op``: the same op as ``benchmarks/bench_group.py`` measures."""

WORKER = "grpo_mem.bench.group_worker:worker"

DESCRIPTION = (
    "One scoring forward + backward (log-probs and entropies of every completion token) of stock TRL 1.16 and of "
    "grpo_mem (each sharing mode), each in a fresh process, on a randomly initialised model of the given shape. "
    "Prints wall time, CPU time, peak memory above base, ratios to stock TRL and the largest log-prob difference; "
    "writes bench.csv and bench.png into --output-dir. Where stock TRL's estimated peak does not fit the available "
    "memory, runs grpo_mem alone; refuses shapes whose grpo_mem estimate does not fit either."
)


# ------------------------------------------------------------------------------------------------------- arguments


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``grpo-mem bench``'s flags to ``parser`` (a subcommand's parser or a standalone one); returns it. A flag
    that ``grpo-mem train`` or TRL's ``GRPOConfig`` also has takes their name (``--num-generations``,
    ``--per-device-train-batch-size``, ``--max-completion-length``, ``--output-dir``, ``--threads``)."""
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        metavar="NAME|DIR",
        help=f"a preset ({', '.join(PRESETS)}) or a local HF model directory (only its config.json is "
        "read; random weights)",
    )
    parser.add_argument(
        "--prompt-length", type=positive_int, default=512, metavar="P", help="prompt width P (prompts left-padded)"
    )
    parser.add_argument(
        "--max-completion-length",
        type=positive_int,
        default=64,
        metavar="C",
        help="completion width C (completions of C/2 to C tokens, right-padded)",
    )
    parser.add_argument(
        "--num-generations", type=num_generations, default=8, metavar="G", help="completions per prompt (>= 2)"
    )
    parser.add_argument(
        "--groups",
        type=positive_int,
        default=1,
        metavar="N",
        help="prompts, each with G completions (grpo-mem train's per-device-train-batch-size x "
        "gradient-accumulation-steps / G)",
    )
    parser.add_argument(
        "--per-device-train-batch-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="rows per micro-batch, a divisor of groups x G (default: G); gradients accumulate over "
        "the micro-batches, grpo_mem shares prompts across them as its TRL patch does",
    )
    parser.add_argument(
        "--shared-prefix-length",
        type=non_negative_int,
        default=0,
        metavar="S",
        help="tokens at the start of every prompt that all prompts share (for the tree sharing mode)",
    )
    parser.add_argument(
        "--image-tokens",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="image tokens in each prompt (counted in --prompt-length), one image per prompt, for a "
        "vision-language model (qwen2.5-vl-3b); 0: text only",
    )
    return _add_run_arguments(parser)


def _add_run_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of how each run goes (precision, device, threads, repeats) and where its files go."""
    parser.add_argument(
        "--dtype",
        choices=DTYPE_FLAGS,
        default="auto",
        help="weights and activations: fp32, bf16, or auto (bf16 on a CUDA GPU that supports it, else fp32)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where the model runs: cpu, cuda, or auto (cuda when torch sees a GPU, else cpu), as grpo-mem train",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=_cpu_count(), metavar="N", help="torch intra-op threads of each run"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        metavar="N",
        help="calls per provider: 1 times and measures memory in the same call; N > 1 times N calls "
        "(p50) and measures memory (peak RSS and live tensors) in one more",
    )
    parser.add_argument(
        "--output-dir", default="grpo-mem-bench", metavar="DIR", help="where bench.csv and bench.png go"
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser of ``grpo-mem bench`` (``python -m grpo_mem.commands.bench``)."""
    parser = argparse.ArgumentParser(prog="grpo-mem bench", description=DESCRIPTION, formatter_class=DefaultsFormatter)
    return add_arguments(parser)


# -------------------------------------------------------------------------------------------------------- running
def providers_to_run(image_tokens: int = 0) -> list[str]:
    """Stock TRL first, then every grpo_mem sharing mode (only ``grpo_mem`` with images:
    image prompts take group sharing)."""
    from grpo_mem.bench.group import PROVIDERS
    from grpo_mem.bench.vision import IMAGE_PROVIDERS

    if image_tokens:
        return list(IMAGE_PROVIDERS)
    return ["trl"] + [name for name, p in PROVIDERS.items() if p.sharing is not None]


@dataclass
class BenchConfig:
    """A validated ``grpo-mem bench`` invocation."""

    model: ModelSpec
    shape: ModelShape
    P: int
    C: int
    G: int
    groups: int
    micro: int
    shared_prefix: int
    image_tokens: int
    dtype: str
    device: str
    threads: int
    repeats: int
    output: str

    def worker_args(self, provider: str) -> dict:
        return dict(
            model_config=self.model.config,
            provider=provider,
            G=self.G,
            P=self.P,
            C=self.C,
            groups=self.groups,
            micro=self.micro,
            shared_prefix=self.shared_prefix,
            image_tokens=self.image_tokens,
            dtype=DTYPES[self.dtype],
            device=self.device,
            repeats=self.repeats,
            min_repeats=self.repeats,
            time_budget_s=None,
            single_call=self.repeats == 1,
            plain_forward_check=False,
        )

    def token_counts(self) -> dict:
        """Tokens through the vision tower and the language model, stock vs grpo_mem, and their ideal ratio
        (:func:`grpo_mem.bench.tokens.token_counts`)."""
        from grpo_mem.bench.tokens import token_counts

        return token_counts(self.G, self.P, self.C, self.groups, self.image_tokens, self.shape.rows_per_token)

    def csv_config(self) -> dict:
        counts = self.token_counts()
        images = {k: v for k, v in counts.items() if k != "ideal_ratio"} if self.image_tokens else {}
        return dict(
            model=self.model.name,
            model_source=self.model.source,
            n_params=self.shape.n_params,
            G=self.G,
            P=self.P,
            C=self.C,
            groups=self.groups,
            micro=self.micro,
            shared_prefix=self.shared_prefix,
            dtype=self.dtype,
            threads=self.threads,
            repeats=self.repeats,
            ideal_ratio=round(counts["ideal_ratio"], 4),
            **({"image_tokens": self.image_tokens} | images),
        )


def validate(args: argparse.Namespace) -> BenchConfig:
    """Turn parsed flags into a :class:`BenchConfig`, ``--device``/``--dtype`` resolved as ``grpo-mem train`` resolves
    them (:func:`~grpo_mem.commands.train_settings.resolve_device`: ``auto`` is CUDA where torch sees a GPU, bf16
    there when it supports it, else CPU and fp32). Raises ValueError naming the flag at fault: ``--output-dir`` that
    cannot be written (:func:`~grpo_mem.commands.flags.check_output_dir`), ``--device cuda`` without a GPU, a shape
    the flags do not make."""
    check_output_dir(args.output_dir)  # first: before any model (creates nothing, so a refused run leaves no folder)
    device, dtype = resolve_device(args.device, args.dtype)
    spec = resolve_model(args.model)
    shape = model_shape(spec.config)
    P, C, G, groups = args.prompt_length, args.max_completion_length, args.num_generations, args.groups
    rows = G * groups
    micro = args.per_device_train_batch_size or G
    if rows % micro:
        raise ValueError(
            f"--per-device-train-batch-size {micro} must divide the {rows} rows (--groups {groups} x "
            f"--num-generations {G})"
        )
    shortest = P - P // (8 if groups == 1 else 4)
    if args.shared_prefix_length > shortest:
        raise ValueError(
            f"--shared-prefix-length {args.shared_prefix_length} is longer than the shortest prompt "
            f"({shortest} tokens: prompts are left-padded by P/8, or P/4 beyond the first group)"
        )
    _check_image_tokens(args, spec, shape, shortest)
    if shape.max_positions is not None and P + C > shape.max_positions:
        raise ValueError(
            f"--prompt-length + --max-completion-length = {P + C} exceeds the model's "
            f"max_position_embeddings {shape.max_positions}"
        )
    return BenchConfig(
        model=spec,
        shape=shape,
        P=P,
        C=C,
        G=G,
        groups=groups,
        micro=micro,
        shared_prefix=args.shared_prefix_length,
        image_tokens=args.image_tokens,
        dtype=dtype,
        device=device,
        threads=args.threads,
        repeats=args.repeats,
        output=args.output_dir,
    )


def _check_image_tokens(args: argparse.Namespace, spec: ModelSpec, shape: ModelShape, shortest: int) -> None:
    """Raises ValueError naming ``--image-tokens`` when it is negative, given for a text-only model, or does not fit
    the shortest prompt with its two vision markers and the shared prefix."""
    n = args.image_tokens
    if n < 0:
        raise ValueError(f"--image-tokens must be >= 0, got {n}")
    if n and not shape.rows_per_token:
        raise ValueError(
            f"--image-tokens {n} needs a vision-language model; --model {args.model} ({spec.name}) is text-only"
        )
    if n and n + 2 + args.shared_prefix_length > shortest:
        raise ValueError(
            f"--image-tokens {n} + 2 vision markers + --shared-prefix-length {args.shared_prefix_length}"
            f" do not fit the shortest prompt ({shortest} tokens: prompts are left-padded by P/8, or P/4 "
            f"beyond the first group)"
        )


def _fail(message: str) -> int:
    print(f"grpo-mem bench: error: {message}", file=sys.stderr)
    return 2


@dataclass
class MemoryPlan:
    """What fits: stock TRL's and grpo_mem's estimated peaks, the memory available to them (bytes) and where that
    figure comes from, the host's (the children's RSS budget), and why stock TRL is not run (None: it runs;
    :func:`~grpo_mem.bench.fits.plan_runs`)."""

    stock: MemoryEstimate
    grpo_mem: MemoryEstimate
    available: float
    where: str
    host_available: float
    stock_not_run: str | None

    def line(self) -> str:
        """The one line printed before the runs: the estimates against the memory available."""
        memory = f"{self.available / GB:.1f} GB available ({self.where})"
        if self.stock_not_run is None:
            return (
                f"grpo-mem bench: stock TRL estimated at {self.stock.describe()}, grpo_mem at "
                f"{self.grpo_mem.total / GB:.1f} GB; {memory}"
            )
        return (
            f"grpo-mem bench: stock TRL not run: estimated at {self.stock.describe()}, more than the {memory}; "
            f"grpo_mem alone, estimated at {self.grpo_mem.describe()}"
        )


def _memory_guard(cfg: BenchConfig) -> MemoryPlan:
    """Estimate both peaks and compare them with the memory available (:func:`~grpo_mem.bench.fits.plan_runs`).
    Raises ValueError with the refusal when grpo_mem's does not fit either."""
    sizes = dict(micro=cfg.micro, P=cfg.P, C=cfg.C, dtype=cfg.dtype, device=cfg.device, image_tokens=cfg.image_tokens)
    stock = estimate_stock_memory(cfg.shape, **sizes)
    mine = estimate_grpo_mem_memory(cfg.shape, groups=cfg.groups, **sizes)
    try:
        available, where = available_memory_bytes(cfg.device)
        host_available = available if cfg.device == "cpu" else available_memory_bytes("cpu")[0]
    except OSError as exc:  # no /proc/meminfo: run unguarded rather than not at all
        print(f"grpo-mem bench: warning: available memory unknown ({exc}); the memory guard is off", file=sys.stderr)
        available, where, host_available = math.inf, "unknown", math.inf
    return MemoryPlan(stock, mine, available, where, host_available, plan_runs(stock, mine, available, where))


def _measure(cfg: BenchConfig, plan: MemoryPlan) -> list:
    """Each provider in a fresh process, through the benchmark library's sweep (stock TRL's cell skipped, with the
    reason in its CSV rows, where ``plan`` does not run it); the sweep's outcomes."""
    from tqdm import tqdm

    from grpo_mem.bench.measure import MB
    from grpo_mem.bench.sweep import Cell, Sweep, isolated

    config = dict(
        cfg.csv_config(),
        estimated_stock_peak_gb=round(plan.stock.total / GB, 2),
        estimated_grpo_mem_peak_gb=round(plan.grpo_mem.total / GB, 2),
    )
    cells = [
        Cell(
            prov,
            cfg.P,
            config,
            cfg.worker_args(prov),
            name="grpo-mem bench",
            skip=plan.stock_not_run if prov == "trl" else None,
        )
        for prov in providers_to_run(cfg.image_tokens)
    ]
    device = None
    if cfg.device == "cuda":
        from grpo_mem.bench.harness_cuda import cuda_device_name

        device = cuda_device_name()
    bar = tqdm(total=len(cells), desc="grpo-mem bench", unit="run", file=sys.stderr, dynamic_ncols=True)
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    budget_mb = 0.95 * plan.host_available / MB
    sweep = Sweep(
        OP,
        "P",
        isolated(WORKER, threads=cfg.threads, env=env, timeout_s=3600.0, rss_budget_mb=budget_mb),
        device=device,
        report=lambda line: bar.write(line, file=sys.stderr),
    )
    outcomes = sweep.run(cells, on_outcome=lambda _: bar.update())
    bar.close()
    return outcomes


def _write_and_print(cfg: BenchConfig, outcomes: list) -> list[dict]:
    """bench.csv and bench.png into ``cfg.output``, the table on stdout; returns
    :func:`~grpo_mem.commands.bench_report.summarize`'s rows."""
    from grpo_mem.bench.results import write_csv
    from grpo_mem.commands.bench_report import default_row, plot, summarize, table, verdict

    default, mode = default_row(cfg.image_tokens)
    summary = summarize(outcomes, default)
    os.makedirs(cfg.output, exist_ok=True)
    csv_path = os.path.join(cfg.output, "bench.csv")
    png_path = os.path.join(cfg.output, "bench.png")
    write_csv([row for outcome in outcomes for row in outcome.rows], csv_path)
    title = (
        f"grpo-mem bench: {cfg.model.name}, {cfg.dtype}, G={cfg.G}, P={cfg.P}, C={cfg.C}, groups={cfg.groups}, "
        f"micro-batch {cfg.micro}"
    )
    plotted = any("skipped" not in r for r in summary)
    if plotted:
        plot(summary, png_path, title)
    elif os.path.exists(png_path):  # not this run's
        os.remove(png_path)
    print(f"\n{title}\n")
    print(table(summary))
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if plotted else ""))
    print(verdict(summary, mode, cfg.image_tokens))
    return summary


def _ideal_line(cfg: BenchConfig) -> str:
    """The token counts and ideal ratio, as printed before the runs."""
    c = cfg.token_counts()
    if not cfg.image_tokens:
        return f"ideal token ratio (P+G·(C−1))/(G·(P+C)) = {c['ideal_ratio']:.3f}"
    return (
        f"{cfg.image_tokens} image tokens per prompt ({c['patch_rows']} patch rows); vision tower patch rows "
        f"{c['trl_vision']} stock vs {c['grpo_mem_vision']} grpo_mem, language-model tokens {c['trl_lm']} vs "
        f"{c['grpo_mem_lm']}; ideal ratio (Nv+P+G·(C−1))/(G·(Nv+P+C)) = {c['ideal_ratio']:.3f}"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``grpo-mem bench`` for parsed flags; returns the exit status: 0 when every provider ran (stock TRL aside
    where its estimate does not fit and grpo_mem's does: then grpo_mem runs alone), 1 when one was skipped (failed,
    over the time limit or the RSS budget; the table says why), 2 for invalid flags or a refused shape (nothing
    run)."""
    try:
        cfg = validate(args)
        plan = _memory_guard(cfg)
    except ValueError as exc:
        return _fail(str(exc))
    print(
        f"grpo-mem bench: {cfg.model.name} ({cfg.shape.n_params / 1e6:.0f}M parameters, random weights, "
        f"{cfg.dtype}, {cfg.device}, {cfg.threads} threads); {cfg.groups} prompt(s) x G={cfg.G} completions, "
        f"P={cfg.P}, C={cfg.C}, {cfg.G * cfg.groups // cfg.micro} micro-batch(es) of {cfg.micro} rows"
        + (f", shared prefix {cfg.shared_prefix}" if cfg.shared_prefix else "")
        + "; "
        + _ideal_line(cfg),
        file=sys.stderr,
    )
    print(plan.line(), file=sys.stderr)
    summary = _write_and_print(cfg, _measure(cfg, plan))
    return 0 if all("skipped" not in r or r.get("not_run") for r in summary) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``grpo-mem bench`` as a function: parse ``argv`` (default ``sys.argv[1:]``), run, return the exit status."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    from grpo_mem.commands.gguf_models import force_offline

    force_offline()
    sys.exit(main())

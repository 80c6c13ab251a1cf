"""The longest prompt a GRPO training step fits on one 8-GPU H100 node, on paper: stock TRL, grpo_mem, and grpo_mem
with sequence parallelism (an estimate from ``grpo_mem.bench.estimate``; no GPU measured it).

For each method the script bisects the prompt length P whose estimated peak per GPU
(``grpo_mem.bench.estimate.estimate_grpo_step``) still fits the budget, and prints the parts of that peak. The setting,
every assumption stated in ``estimate_grpo_step`` and ``activation_bytes``:

- model: Qwen3-8B (``QWEN3_8B_CONFIG``: 36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate
  12288, vocab 151936, untied embeddings; from ``config.json`` of the Hub repository ``Qwen/Qwen3-8B``), 8.19·10**9
  parameters counted on the meta device;
- a group of G = 8 completions of C = 1024 tokens per prompt, ``per_device_train_batch_size`` = one group;
- 8 GPUs, DeepSpeed ZeRO-3 over all of them (16 bytes per parameter before sharding: bf16 weight and gradient, fp32
  master weight and Adam moments), bf16 activations, gradient checkpointing on (TRL's default), ``beta = 0`` (no
  reference model), flash-style attention (no P × P matrix), the fused LM head (no logits), generation not counted;
- budget 80·10**9 bytes per GPU, of which 8·10**9 reserved for the CUDA context, NCCL and fragmentation.

Qwen3-8B's native context is 32,768 tokens (``max_position_embeddings`` 40960); longer prompts need its YaRN rope
scaling. The estimate counts memory only, not positions.

Usage (from the repository root)::

    python benchmarks/longest_prompt.py                  # the table (markdown)
    python benchmarks/longest_prompt.py -C 2048 -G 16    # another group shape
    python benchmarks/longest_prompt.py --sp-size 4      # grpo_mem + sp_size 4 in the last row
"""

from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the checkout's grpo_mem

from grpo_mem.bench import estimate  # noqa: E402
from grpo_mem.bench.results import markdown_table  # noqa: E402

GB = estimate.GB


def rows(C: int = 1024, G: int = 8, sp_size: int = 8, world: int = 8, budget: float = estimate.H100_BYTES) -> list:
    """``[(label, P, StepEstimate at P)]`` for stock TRL, grpo_mem and grpo_mem with ``sp_size``: P the longest prompt
    (tokens) whose estimate fits ``budget`` bytes per GPU (``estimate.longest_prompt``)."""
    shape = estimate.model_shape(estimate.QWEN3_8B_CONFIG)
    out = []
    for label, method, k in (
        ("stock TRL", "trl", 1),
        ("grpo_mem", "grpo_mem", 1),
        (f"grpo_mem + sp_size {sp_size}", "grpo_mem", sp_size),
    ):
        P = estimate.longest_prompt(shape, method=method, C=C, G=G, sp_size=k, world=world, budget=budget)
        out.append((label, P, estimate.estimate_grpo_step(shape, method=method, P=P, C=C, G=G, sp_size=k, world=world)))
    return out


def table(found: list) -> str:
    """Markdown table of :func:`rows`: the longest prompt and, in GB per GPU, each part of the estimate at it."""
    headers = ["method", "longest prompt P (tokens)", *[f"{p} (GB)" for p in estimate.StepEstimate.PARTS], "total (GB)"]
    body = [
        [label, P, *[round(v / GB, 1) for v in est.parts().values()], round(est.total / GB, 1)]
        for label, P, est in found
    ]
    return markdown_table(headers, body, floatfmt=".1f")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-C", type=int, default=1024, help="completion tokens (default 1024)")
    ap.add_argument("-G", type=int, default=8, help="completions per prompt (default 8)")
    ap.add_argument("--sp-size", type=int, default=8, help="sequence-parallel group size of the last row (default 8)")
    ap.add_argument("--world", type=int, default=8, help="GPUs ZeRO-3 shards over (default 8)")
    ap.add_argument("--budget-gb", type=float, default=estimate.H100_BYTES / GB, help="GB per GPU (default 80)")
    args = ap.parse_args(argv)
    found = rows(args.C, args.G, args.sp_size, args.world, args.budget_gb * GB)
    print(
        f"Qwen3-8B, G={args.G}, C={args.C}, ZeRO-3 over {args.world} GPUs, bf16, gradient checkpointing, "
        f"{args.budget_gb:g} GB per GPU (an estimate, not a measurement):\n"
    )
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())

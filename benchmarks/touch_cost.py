"""Memory and CPU time of ``store.touch`` (how a trie node's pass joins the backward under FSDP), one process.

Usage: ``python benchmarks/touch_cost.py CKPT TOUCH`` (CKPT, TOUCH: 0 or 1; one fresh process per setting). No FSDP
here: ``touch`` is forced on or off, so the difference is its own cost. One micro-batch of 4 groups (G=8, C=64,
own parts 32-96 tokens) under a 512-token system prompt, a pass no row ends in, on the 8-layer hidden-512 Llama of
the group benchmark; tree sharing, forward + backward, 1 thread. Prints one JSON line: wall and CPU seconds of 3
timed calls, peak live tensor bytes (``TensorMemoryTracker``) and peak RSS above base of one call, in MB.
"""

import json
import sys

import torch

import grpo_mem.model.forward as forward
from grpo_mem.bench import group, harness
from grpo_mem.bench.presets import bench_model_config
from grpo_mem.bench.tree import make_window, own_lengths


def main(ckpt: bool, on: bool) -> dict:
    torch.set_num_threads(1)
    forward.fsdp_wrapped = lambda model: on  # what ``forward.pass_extensions`` asks once per model
    model = group.build_model(bench_model_config("llama"))
    if ckpt:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    U, G, C = 4, 8, 64
    ids, mask, cmask = make_window(512, own_lengths(U, 32, 96, seed=0), G, C, U, model.config.vocab_size, seed=1)
    P = ids.shape[1] - C
    fn = group.make_window_fn("grpo_mem_tree", model, C, [ids[:, :P]], [mask[:, :P]])

    def op():
        lp, _ = fn(ids, mask)
        (lp * cmask.float()).sum().backward()

    m = harness.measure(
        op, setup=lambda: model.zero_grad(set_to_none=True), warmup=1, repeats=3, memory_repeats=1
    ).to_dict()
    return {
        "checkpointing": ckpt,
        "touch": on,
        "wall_s": m["times_s"],
        "cpu_s": m["cpu_times_s"],
        "tensor_MB": [b / 2**20 for b in m["peak_tensor_bytes"]],
        "rss_MB": [b / 2**20 for b in m["peak_rss_above_base_bytes"]],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] == "1", sys.argv[2] == "1")))

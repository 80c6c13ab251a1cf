"""One rank of the 2-process (gloo, CPU) image-prompt runs, launched by test_distributed.py through
torch.distributed.run.

Usage: vlm_dist_worker.py STACK SHARING RUNS OUT [ROWS]. STACK: ddp | fsdp2 | zero3 (set up as
``dist_worker``'s ``stack_args`` does). SHARING: group | tree. RUNS: ``stock``, ``patch`` or ``stock,patch``
(one after the other in this process; run R's result goes to ``OUT-R.json``). Trains ``test_vlm._train``'s 3
GRPOTrainer steps (tiny Qwen2.5-VL, images of three sizes, gradient accumulation 2, ROWS rows per micro-batch, default
2: each rank's window holds one group; 3: a group and half of another, so the ranks plan different passes); rank 0
writes the world
size, the distributed type, global_step, the grad norms, grpo_mem's logged path per step in the SHARING mode, the
fallbacks every rank recorded, whether every parameter was sharded, and the final weights (gathered from shards).
"""

import json
import sys
from pathlib import Path

import torch


def main(stack: str, sharing: str, runs: str, out: str, rows: str = "2") -> None:
    """Train each of ``runs`` (``stock``, ``patch``, comma-separated) in turn in this process; rank 0 writes run R's
    result to ``OUT-R.json``."""
    from dist_worker import _is_sharded, gathered_weights, reset_accelerate, stack_args
    from vlm_fixtures import train_vlm

    extra = stack_args(stack)
    for number, patch in enumerate(runs.split(",")):
        if number:
            reset_accelerate()
        # 2 rows per rank's micro-batch: the generation batch is the single-process test's 8 rows (2 prompts x 4)
        trainer, fallbacks, _ = train_vlm(
            Path(f"{out}-{patch}.run"),
            patch == "patch",
            sharing=sharing,
            per_device_train_batch_size=int(rows),
            **extra,
        )
        weights = gathered_weights(trainer)
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, [str(f) for f in fallbacks])
        if trainer.accelerator.is_main_process:
            logs = trainer.state.log_history
            metric = f"grpo_mem/path/{sharing}"
            result = {
                "world_size": trainer.accelerator.num_processes,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "global_step": trainer.state.global_step,
                "grad_norms": [h["grad_norm"] for h in logs if "grad_norm" in h],
                "path": [h[metric] for h in logs if metric in h],
                "fallbacks": gathered,
                "sharded": _is_sharded(trainer),
                "weights": weights,
            }
            with open(f"{out}-{patch}.json", "w") as f:
                json.dump(result, f)
        torch.distributed.barrier()


if __name__ == "__main__":
    from launch import end_worker

    main(*sys.argv[1:])
    end_worker()

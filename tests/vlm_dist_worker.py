"""One rank of the 2-process (gloo, CPU, DDP) image-prompt run, launched by test_distributed.py through
torch.distributed.run.

Usage: vlm_dist_worker.py PATCH OUT_JSON. PATCH: patch | stock. Trains ``test_vlm._train``'s 3 GRPOTrainer steps
(tiny Qwen2.5-VL, images of three sizes, gradient accumulation 2, 2 rows per micro-batch) with DDP over gloo; rank 0
writes the world size, the distributed type, global_step, the grad norms, grpo_mem's logged path per step, the
fallbacks every rank recorded, and the final weights.
"""

import json
import sys
from pathlib import Path

import torch


def main(patch: str, out: str) -> None:
    from test_vlm import _train

    # 2 rows per rank's micro-batch: the generation batch is the single-process test's 8 rows (2 prompts x 4)
    trainer, fallbacks, _ = _train(Path(out + ".run"), patch == "patch", ddp_backend="gloo",
                                   per_device_train_batch_size=2)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, [str(f) for f in fallbacks])
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        logs = trainer.state.log_history
        result = {
            "world_size": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "global_step": trainer.state.global_step,
            "grad_norms": [h["grad_norm"] for h in logs if "grad_norm" in h],
            "group_path": [h["grpo_mem/path/group"] for h in logs if "grpo_mem/path/group" in h],
            "fallbacks": gathered,
            "weights": {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()},
        }
        with open(out, "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""One rank of the 2-process (gloo) parity run, launched by test_distributed.py through torch.distributed.run.

Usage: dist_worker.py KIND PATCH OUT_JSON — trains 3 optimizer steps with gradient accumulation 2 and writes, from
rank 0, the final weights' checksum vectors, global_step, the learning rate after every step and the logged epochs.
"""

import json
import sys

import torch
from helpers import make_trainer
from transformers import TrainerCallback


class _Lrs(TrainerCallback):
    def __init__(self):
        self.lrs = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def main(kind: str, patch: str, out: str) -> None:
    trainer, handle = make_trainer(
        kind, patch=patch == "patch", output_dir=out + ".run", max_steps=3, gradient_accumulation_steps=2,
        per_device_train_batch_size=2, num_generations=4, lr_scheduler_type="cosine", warmup_steps=1, optim="sgd",
        beta=0.04, ddp_backend="gloo",
    )  # fmt: skip
    lrs = _Lrs()
    trainer.add_callback(lrs)
    trainer.train()
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        result = {
            "world_size": trainer.accelerator.num_processes,
            "global_step": trainer.state.global_step,
            "lrs": lrs.lrs,
            "epochs": [h.get("epoch") for h in trainer.state.log_history],
            "grpo_mem_used": "_grpo_mem_previous_forward" in model.__dict__,
            "weights": {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()},
        }
        with open(out, "w") as f:
            json.dump(result, f)
    if handle is not None:
        handle.revert()
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""One rank of the sequence-parallel TRL runs, launched by test_trl_sequence_parallel.py.

Usage: trl_sp_worker.py KIND STAGE MODE OUT_JSON [OPTIONS]

- KIND: grpo | rloo. STAGE: zero2 | zero3 (DeepSpeed on CPU/gloo, as dist_worker.py runs it), or fsdp2: FSDP2 with
  each decoder layer sharded (as dist_worker.py runs it) and ``ParallelismConfig(cp_size=2)`` (context parallelism);
  its reference is stock TRL on one process without FSDP.
- MODE ``sp``: ``ParallelismConfig(sp_size=2, sp_backend="deepspeed")`` after ``grpo_mem.patch_trl(sequence_parallel=True)``
  on 2 processes
  (one data-parallel rank) or 4 (two, ``dp_replicate_size=2``): grpo_mem scores every pass split along the sequence
  over the two ranks of a group. MODE ``ref``: stock TRL (not patched), the same configuration without
  ``parallelism_config`` on 1 process (or 2: data parallel).
- OPTIONS: comma-separated names of ``OPTIONS`` (generation ending early, ZeRO-3 gathering per module).

Every micro-batch TRL's loss receives (prompt and completion ids and masks, advantages, old and reference log-probs,
the token count) is recorded on every rank. Rank 0 writes every rank's records, the trainer's batch arithmetic, the
final weights (gathered), what the attention registry holds after the model was prepared, and whether TRL's refusal is
back after ``revert()``.
"""

import json
import os
import sys
import types

import torch

SP = 2
ARGS = {
    "max_steps": 3,
    "per_device_train_batch_size": 4,
    "num_generations": 4,
    "gradient_accumulation_steps": 2,
    "steps_per_generation": 4,  # generation every 4 micro-batches, optimizer step every 2: old log-probs are computed
    "max_completion_length": 6,
    "beta": 0.04,  # a reference model: its log-probs are scored too
    "scale_rewards": "batch",  # the std over the whole generation batch: duplicated ranks would change it
    "optim": "sgd",
    "learning_rate": 0.1,
    "logging_steps": 1,
}


OPTIONS = {
    # a row ends at any of 3/4 of the vocabulary (TRL's completion mask still cuts at the tokenizer's EOS only): the
    # generation batches end before max_completion_length, at a step the stand-in ranks must not extend
    "early_stop": lambda: {"generation_kwargs": {"eos_token_id": [i for i in range(3, _vocab()) if i % 4]}},
    # ZeRO-3 gathers each module's parameters in every generation forward (TRL gathers them all once by default)
    "per_module_gather": lambda: {"ds3_gather_for_generation": False},
}
"""Optional configurations the tests ask for by name (the worker's fifth argument, comma-separated)."""


def _vocab() -> int:
    from helpers import VOCAB

    return VOCAB


def _record(trainer) -> list:
    """Record every micro-batch's inputs to TRL's loss."""
    records = []
    compute_loss = type(trainer).compute_loss

    def recorded(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        records.append(
            {
                k: (v.detach().cpu().tolist() if isinstance(v, torch.Tensor) else v)
                for k, v in inputs.items()
                if k
                in (
                    "prompt_ids",
                    "prompt_mask",
                    "completion_ids",
                    "completion_mask",
                    "advantages",
                    "old_per_token_logps",
                    "ref_per_token_logps",
                    "num_items_in_batch",
                )
            }
        )
        return compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    trainer.compute_loss = types.MethodType(recorded, trainer)
    return records


def _count_generation_and_rewards(trainer) -> dict:
    """Count, on this rank, the model's ``generate`` calls (transformers' ``GenerationMixin.generate``: per call the
    rows and width of its input, the model forwards it ran, and whether it ran with ``synced_gpus``) and the calls of
    each reward function."""
    from transformers.generation.utils import GenerationMixin

    counts = {"generate": [], "rewards": 0}
    generate = GenerationMixin.generate

    def counted_generate(self, *args, **kwargs):
        forwards = [0]
        hook = self.register_forward_pre_hook(lambda module, inputs: forwards.__setitem__(0, forwards[0] + 1))
        try:
            out = generate(self, *args, **kwargs)
        finally:
            hook.remove()
        rows, width = kwargs["input_ids"].shape
        counts["generate"].append(
            {"rows": rows, "width": width, "forwards": forwards[0], "synced": kwargs.get("synced_gpus")}
        )
        return out

    def counted(func):
        def reward(*args, **kwargs):
            counts["rewards"] += 1
            return func(*args, **kwargs)

        return reward

    GenerationMixin.generate = counted_generate
    trainer.reward_funcs = [counted(f) for f in trainer.reward_funcs]
    return counts


def _attention_state(trainer) -> dict:
    """The model's attention implementation and whether the registry maps any name to DeepSpeed's Ulysses wrapper."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation
    core = impl.removeprefix("grpo_mem_")  # grpo_mem's hook wraps the model's own implementation
    return {
        "impl": impl,
        "core_impl": core,
        "ulysses": any(
            getattr(fn, "__module__", "").startswith("deepspeed") for _, fn in ALL_ATTENTION_FUNCTIONS.items()
        ),
        "core": ALL_ATTENTION_FUNCTIONS[core] is ALL_ATTENTION_FUNCTIONS._global_mapping[core],
    }


def _sharded(trainer) -> bool:
    """Whether every parameter of the trained model is a DTensor (sharded by FSDP2)."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in trainer.accelerator.unwrap_model(trainer.model).parameters())


def _self_attn_hooks(trainer) -> int:
    """The forward pre-hooks on the model's ``self_attn`` modules (accelerate's context-parallel preparation would
    register one on each, dropping the attention mask)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return sum(len(m._forward_pre_hooks) for name, m in model.named_modules() if name.endswith("self_attn"))


def _paths(trainer) -> dict:
    """grpo_mem's logged paths, summed over the logged steps (empty for stock TRL)."""
    return {
        k: sum(h[k] for h in trainer.state.log_history if k in h)
        for k in ("grpo_mem/path/tree", "grpo_mem/path/group", "grpo_mem/path/stock")
    }


def _refused_after_revert(config_cls, pc) -> str:
    """TRL's error for an SP config once the patch is reverted ("" if none)."""
    try:
        config_cls(output_dir="unused", parallelism_config=pc, report_to="none", bf16=False)
    except ValueError as exc:
        return str(exc)
    return ""


def main(kind: str, stage: str, mode: str, out: str, options: str = "") -> None:
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from dist_worker import SYSTEM, gathered_weights, stack_args
    from helpers import PROMPTS, make_trainer
    from trl import GRPOConfig, RLOOConfig

    import grpo_mem
    from grpo_mem.patches import sp_ranks, trl_sp

    cp = stage == "fsdp2"
    args = dict(ARGS, **(stack_args(stage) if mode == "sp" or not cp else {}))
    for name in filter(None, options.split(",")):
        args.update(OPTIONS[name]())
    # before the config: it lifts TRL's refusal of sp_size > 1
    handle = grpo_mem.patch_trl(sequence_parallel=True) if mode == "sp" else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pc = (
        # with data parallelism too, FSDP2 shards over dp_shard x cp
        ParallelismConfig(cp_size=SP, dp_shard_size=max(1, world // SP) if mode == "sp" else 1)
        if cp
        else ParallelismConfig(
            sp_size=SP,
            sp_backend="deepspeed",
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
            # accelerate sizes DeepSpeed's train_batch_size by the data-parallel size it is told (1 unless given)
            dp_replicate_size=max(1, world // SP) if mode == "sp" else 1,
        )
    )
    if kind == "rloo":
        args.pop("scale_rewards")
    if mode == "sp":
        args["parallelism_config"] = pc
    # a 74-token system prompt before every prompt: one trie node, forwarded once per window and split over the ranks
    prompts = [SYSTEM + p for p in PROMPTS]
    trainer, _ = make_trainer(kind, patch=False, output_dir=out + ".run", prompts=prompts, **args)
    seed_after_init = torch.initial_seed()
    # before training (the model not yet prepared): verify compares the local computation on each rank (under ZeRO-3
    # the parameters are partitions until DeepSpeed's engine gathers them, so verify cannot run there before train())
    verified = grpo_mem.verify(trainer).passed if handle is not None and stage in ("zero2", "fsdp2") else None
    records = _record(trainer)
    counts = _count_generation_and_rewards(trainer)
    trainer.train()
    weights = gathered_weights(trainer)
    found = sp_ranks.sp_group(trainer)
    result = {
        "records": records,
        "seed_after_init": seed_after_init,
        "generation_batch_size": trainer.args.generation_batch_size,
        "steps_per_generation": trainer.args.steps_per_generation,
        "global_step": trainer.state.global_step,
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "gradient_reduction": trl_sp.sp_gradient_reduction(trainer),
        "attention": _attention_state(trainer),
        "sp_group": None if found is None else list(found[1:]),
        "adapter_skipped": ("_prepare_cp" if cp else "deepspeed_ulysses_dl_adapter") in trainer.accelerator.__dict__,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "sharded": _sharded(trainer),
        "mask_hooks": _self_attn_hooks(trainer),
        "weights": weights if torch.distributed.get_rank() == 0 else None,
        "decisions": _paths(trainer),
        "verified": verified,
        "counts": counts,
    }
    if handle is not None:
        handle.revert()
        config_cls = GRPOConfig if kind == "grpo" else RLOOConfig
        result["refused_after_revert"] = _refused_after_revert(config_cls, pc)
        result["adapter_restored"] = not {"_prepare_cp", "deepspeed_ulysses_dl_adapter"} & set(
            vars(trainer.accelerator)
        )
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, result)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"world_size": len(gathered), "ranks": gathered}, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    from launch import end_worker

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main(*sys.argv[1:])
    end_worker()

"""One rank of the 2-process (gloo, CPU) parity runs, launched by test_distributed.py through torch.distributed.run.

Usage: dist_worker.py STACK OUT CASE [CASE ...]

- STACK: ddp | fsdp2 | zero2 | zero3. CASE: ``KIND:SCENARIO:ARCH`` (KIND grpo | rloo; ARCH a ``helpers.tiny_model``
  architecture). Each case trains stock, then patched, one after the other in this process (the launch and its
  imports once for every case of a stack); rank 0 writes run R of a case to ``OUT/KIND-SCENARIO-ARCH-R.json``.
- SCENARIO: ``split`` (default) trains 3 optimizer steps with gradient accumulation 2 on groups of 8 completions, so
  each rank holds half a group spread over two micro-batches of 2. ``uneven`` gives the ranks different prompts,
  group sizes and completion lengths (one rank's micro-batches without a repeated prompt, the other's with) to show
  the ranks keep issuing the same collectives. ``tree``: 6 prompts sharing a 74-token system prompt, two pairs of
  them a 64-token few-shot block too; each rank's window holds 3 of them, so the ranks' tries differ in depth and
  width from step to step. ``tree1``: the same in one micro-batch per step, so the trie nodes no row ends in (the
  system prompt, a shared few-shot block) are passes of that micro-batch, not kept ones.

Rank 0 writes the final weights (gathered from their shards), global_step, the learning rate after every step, the
logged epochs and the grad norms.

The sharded stacks run on CPU with the workarounds in docs/distributed.md ("Sharded training on CPU"): DeepSpeed uses its CPU
accelerator over gloo with a pre-built ``PartialState``; FSDP2 needs accelerate's state promoted from MULTI_CPU to
FSDP, which accelerate 1.15 does not do on CPU (it silently wraps in DDP instead).
"""

import json
import os
import sys

import torch
from transformers import TrainerCallback


class _Record(TrainerCallback):
    def __init__(self):
        self.lrs = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def _promote_cpu_fsdp() -> None:
    """Make accelerate honour an FSDP plugin on MULTI_CPU (it drops it there), as a user on CPU would have to."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # every later AcceleratorState() re-reads the distributed type from PartialState: promote again each time
        plugin = fsdp_plugin or self.__dict__.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if fsdp_plugin is not None:
                if self._mixed_precision != "no":
                    fsdp_plugin.set_mixed_precision(self._mixed_precision)
                self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


def stack_args(stack: str, *, bf16: bool = False) -> dict:
    """GRPOConfig/RLOOConfig arguments that run STACK with 2 CPU processes (and the process setup it needs)."""
    if stack == "ddp":
        return dict(ddp_backend="gloo")
    if stack == "fsdp2":
        _promote_cpu_fsdp()
        # as users configure it: every module class in the model's ``_no_split_modules`` (each decoder layer) sharded
        # on its own, resharded after each call; transformers' default policy too, explicit here
        return dict(
            ddp_backend="gloo",
            fsdp="full_shard",
            fsdp_config={
                "fsdp_version": 2,
                "reshard_after_forward": True,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            },
        )
    if stack in ("zero2", "zero3"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        import accelerate
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skips a 60 s JIT build used for inference
        accelerate.PartialState(backend="gloo")
        config = {
            # persistence threshold 0: even this tiny model's parameters are partitioned (the default 1e5 elements
            # would keep all of them whole, and the head weight would never need gathering)
            "zero_optimization": {"stage": int(stack[-1]), "stage3_param_persistence_threshold": 0},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": "auto"},
        }
        return dict(deepspeed=config, use_cpu=False, accelerator_config={"use_configured_state": True})
    raise ValueError(f"unknown stack {stack!r}")


def _count_kept_prompts() -> list:
    """A counter of prompt passes kept for a later micro-batch (groups split over micro-batches) on this rank."""
    from grpo_mem.model.store import PromptStore

    count = [0]
    keep = PromptStore.keep

    def counted(self, *args, **kwargs):
        count[0] += 1
        return keep(self, *args, **kwargs)

    PromptStore.keep = counted
    return count


def _record_passes() -> list:
    """Every node pass this rank forwards with gradients (training windows), as (window number, micro-batch, pass key,
    stand-in, root spans of 64+ tokens): the last counts the trie roots of at least 64 tokens in the pass (the
    scenario's system prompt)."""
    import itertools

    from grpo_mem.model import packed
    from grpo_mem.model.window import Window

    seen, numbers = [], itertools.count()
    forward_pass, block = Window.text_pass, packed._node_block

    def record(window, spec):
        roots = sum(
            window.plan.trie.nodes[n].parent is None and len(window.plan.trie.nodes[n].tokens) >= 64 for n in spec.nodes
        )
        if torch.is_grad_enabled():
            number = window.__dict__.setdefault("_test_number", next(numbers))
            seen.append((number, spec.micro_batch, spec.key, not spec.nodes, roots))

    def recorded(window, mb, spec):  # a pass run as a call of its own
        record(window, spec)
        return forward_pass(window, mb, spec)

    def recorded_block(window, mb, call, spec):  # a pass run as a block of a packed call
        record(window, spec)
        return block(window, mb, call, spec)

    Window.text_pass, packed._node_block = recorded, recorded_block
    return seen


SYSTEM = "You are a careful assistant. Think it through first, then answer briefly: "  # 74 tokens, 1 a character
SHOTS_A = "Example: 12+30=42. Example: 7*6=42. Example: 50-8=42. Now you: "  # 64 tokens
SHOTS_B = "Worked: twelve and thirty make forty-two; six sevens are too. Q: "  # 64 tokens
TREE_PROMPTS = [
    SYSTEM + SHOTS_A + "1+2=",
    SYSTEM + SHOTS_A + "9*9=",
    SYSTEM + SHOTS_B + "Say hi",
    SYSTEM + SHOTS_B + "x",
    SYSTEM + "Spell cat",
    SYSTEM + "Count: 1 2 3",
]


def _pass_summary(passes: list) -> dict:
    """Per window of this rank, in order: its own pass keys (stand-ins excluded) and how many passes held the
    system prompt as a root node."""
    windows: dict = {}
    for window, _, key, stand_in, roots in passes:
        own, system = windows.setdefault(window, ([], [0]))
        if not stand_in:
            own.append(list(key))
        system[0] += roots
    return {
        "own_keys": [w[0] for w in windows.values()],
        "system_passes": [w[1][0] for w in windows.values()],
        "stand_ins": sum(p[3] for p in passes),
    }


def _is_sharded(trainer) -> bool:
    """Whether every parameter is held in shards (FSDP2 DTensors, ZeRO-3 partitions)."""
    from torch.distributed.tensor import DTensor

    params = list(trainer.accelerator.unwrap_model(trainer.model).parameters())
    return all(isinstance(p, DTensor) or getattr(p, "ds_tensor", None) is not None for p in params)


def wrapped_layers(trainer) -> list[int]:
    """[decoder layers sharded by FSDP on their own, decoder layers] of the trained model."""
    from torch.distributed.fsdp import FSDPModule

    layers = [
        m
        for m in trainer.accelerator.unwrap_model(trainer.model).modules()
        if type(m).__name__.endswith("DecoderLayer")
    ]
    return [sum(isinstance(m, FSDPModule) for m in layers), len(layers)]


def gathered_weights(trainer) -> dict:
    """Every parameter as a full fp64 list, gathered from FSDP2 / ZeRO-3 shards (a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    model = trainer.accelerator.unwrap_model(trainer.model)
    params = dict(model.named_parameters())
    if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().double().flatten().tolist() for n, p in params.items()}
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().flatten().tolist()
        for n, p in params.items()
    }


def _scenario_args(scenario: str) -> dict:
    """GRPOConfig arguments of ``scenario`` (see the module docstring)."""
    args = dict(
        max_steps=3,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        num_generations=8,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        optim="sgd",
        beta=0.04,
        gradient_checkpointing=True,
    )
    if scenario == "uneven":
        args.update(num_generations=4, per_device_train_batch_size=3)
    if scenario == "tree":  # each rank's window: 3 of the 6 prompts (a group of 2 per micro-batch)
        args.update(
            num_generations=2,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=3,
            prompts=TREE_PROMPTS,
            max_completion_length=6,
        )
    if scenario == "tree1":  # the same 3 prompts per rank and step, in one micro-batch (no gradient accumulation)
        args.update(
            num_generations=2,
            per_device_train_batch_size=6,
            gradient_accumulation_steps=1,
            prompts=TREE_PROMPTS,
            max_completion_length=6,
        )
    return args


def _result(trainer, record, kept: list, summaries: list, weights: dict) -> dict:
    """What rank 0 writes: the run's accounting, grpo_mem's passes on every rank, and the final weights."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "global_step": trainer.state.global_step,
        "lrs": record.lrs,
        "epochs": [h.get("epoch") for h in trainer.state.log_history],
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "grpo_mem_used": "_grpo_mem_previous_forward" in model.__dict__,
        "sharded": _is_sharded(trainer),
        "wrapped_layers": wrapped_layers(trainer),
        "prompts_kept": kept[0],
        # windows whose own pass structures differed between the ranks (aligned by stand-in passes)
        "passes_differ": sum(
            len({repr(k) for k in per_window}) > 1 for per_window in zip(*(r["own_keys"] for r in summaries))
        ),
        "stand_ins": [r["stand_ins"] for r in summaries],
        "system_passes": [r["system_passes"] for r in summaries],
        "weights": weights,
    }


def reset_accelerate() -> None:
    """Forget the accelerate state a finished trainer set up (its accelerator, gradient state and plugins), keeping the
    process group and the configured ``PartialState``, so that the next trainer of this process sets up its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def main(stack: str, out: str, *cases: str) -> None:
    """Train each case (``KIND:SCENARIO:ARCH``) stock, then patched, in turn in this process, from the same seed;
    rank 0 writes each run's result to ``OUT/KIND-SCENARIO-ARCH-R.json`` (R: stock, patch)."""
    from helpers import make_trainer

    extra = stack_args(stack)
    kept = _count_kept_prompts()
    passes = _record_passes()
    number = 0
    for case in cases:
        kind, scenario, arch = case.split(":")
        for patch in ("stock", "patch"):
            if number:
                reset_accelerate()
            number += 1
            kept[0] = 0
            passes.clear()
            name = os.path.join(out, f"{kind}-{scenario}-{arch}-{patch}")
            trainer, handle = make_trainer(
                kind, patch=patch == "patch", arch=arch, output_dir=f"{name}.run", **_scenario_args(scenario), **extra
            )
            record = _Record()
            trainer.add_callback(record)
            trainer.train()
            weights = gathered_weights(trainer)
            summaries = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(summaries, _pass_summary(passes))
            if trainer.accelerator.is_main_process:
                with open(f"{name}.json", "w") as f:
                    json.dump(_result(trainer, record, kept, summaries, weights), f)
            if handle is not None:
                handle.revert()
            torch.distributed.barrier()


if __name__ == "__main__":
    from launch import end_worker

    main(*sys.argv[1:])
    end_worker()

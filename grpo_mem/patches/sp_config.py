"""The configuration side of grpo_mem's sequence parallelism for TRL's GRPO/RLOO trainers: what the config classes'
``__post_init__`` accept and how, the seed of each rank, how the gradient of an SP group is combined.

Two routes ask for an SP group (``sp_ranks.sp_size_of``): DeepSpeed's ``sp_size`` (``sp_backend="deepspeed"``, a ZeRO
config) and accelerate's ``cp_size`` with FSDP2 (context parallelism). Both are served by the same sequence-sharded
layout (``grpo_mem.model.sequence_parallel``); what differs is where the group comes from (``sp_ranks.sp_group``) and
how the framework combines its ranks' gradients (``sp_gradient_reduction``). Installed by ``grpo_mem.patches.trl_sp``;
nothing here is imported without sequence parallelism.
"""

from __future__ import annotations

import contextlib

from .sp_ranks import context_parallel, layout, sp_size_of

CP_CAUSE = (
    "context parallelism (cp_size > 1) is accelerate's FSDP2 route (ParallelismConfig.fsdp_dim_names shards over "
    "dp_shard x cp; AcceleratorState refuses cp_size without an FSDP2 plugin on GPUs): grpo_mem serves it only with "
    "FSDP2 (fsdp='full_shard', fsdp_config={'fsdp_version': 2, ...}); with DeepSpeed use sp_size"
)
"""Why ``cp_size > 1`` is refused with a DeepSpeed config (``unserved``); with FSDP2 it is served."""


def size_name(args) -> str:
    """``"cp_size=N"`` or ``"sp_size=N"``: the setting of ``args`` that asks for the SP group, for messages."""
    return f"{'cp' if context_parallel(args) else 'sp'}_size={sp_size_of(args)}"


def unserved(args) -> str | None:
    """Why grpo_mem cannot train ``args``' sequence parallelism exactly, or None. ``cp_size`` with a DeepSpeed
    config is ``CP_CAUSE``; whether a ``cp_size`` run is FSDP2 is accelerate's to check (``AcceleratorState`` on
    GPUs, ``ParallelismConfig._validate_accelerator``), and again ``trl_sp``'s when the dataloader is built."""
    name = size_name(args)
    if context_parallel(args):
        if getattr(args, "deepspeed", None) is not None:
            return CP_CAUSE
    elif getattr(args, "deepspeed", None) is None:
        return f"{name} runs through DeepSpeed Ulysses: pass a ZeRO config as deepspeed=..."
    if getattr(args, "use_vllm", False):
        return (
            f"use_vllm=True with {name}: TRL's vLLM generation gathers prompts and slices completions over all "
            "processes, not over data-parallel ranks"
        )
    if getattr(args, "use_liger_kernel", False):
        return f"use_liger_kernel=True with {name}: Liger's fused GRPO loss scores whole sequences on each rank"
    return None


@contextlib.contextmanager
def _world_as_data_parallel(cls, sp: int, name: str):
    """While open, ``cls``' ``world_size`` (a config class) is the data-parallel size ``world // sp``, except while
    transformers' ``TrainingArguments.__post_init__`` runs: it fills the DeepSpeed config's ``train_batch_size`` from
    the world size (``HfTrainerDeepSpeedConfig.trainer_config_process``, transformers 5.24.0), which
    ``deepspeed.zero.Init`` checks against the world before accelerate corrects it for SP. TRL's own
    ``__post_init__`` body, around it, reads the DP size. Both class attributes are restored on exit."""
    from transformers import TrainingArguments

    world = cls.world_size  # the property the class has (its own, or TrainingArguments')
    parent = TrainingArguments.__dict__["__post_init__"]
    inside = []  # non-empty while TrainingArguments.__post_init__ runs

    def world_size(self):
        total = world.fget(self)
        if inside:
            return total
        if total % sp:
            raise ValueError(f"parallelism_config.{name} does not divide the world size {total}")
        return total // sp

    def __post_init__(self):
        inside.append(True)
        try:
            return parent(self)
        finally:
            inside.pop()

    own = cls.__dict__.get("world_size")
    cls.world_size = property(world_size)
    TrainingArguments.__post_init__ = __post_init__
    try:
        yield
    finally:
        TrainingArguments.__post_init__ = parent
        if own is None:
            del cls.world_size
        else:
            cls.world_size = own


def patched_post_init(original):
    """``GRPOConfig``/``RLOOConfig.__post_init__`` around TRL's ``original``: with ``sp_size > 1`` and
    ``sp_backend="deepspeed"``, or ``cp_size > 1`` (``sp_ranks.sp_size_of``), TRL's refusal is skipped and TRL's own
    checks and batch arithmetic run with ``world_size`` equal to the data-parallel size; anything else is TRL's own.

    Raises:
        ValueError: what ``unserved`` names (``sp_size`` without a DeepSpeed config, ``cp_size`` with one, vLLM,
            Liger's loss), the group size not dividing the world size, several SP groups without the
            ``parallelism_config`` saying how many (``dp_replicate_size`` for ``sp_size``, ``dp_shard_size`` for
            ``cp_size``), ZeRO-3 with ``reduce_scatter=False`` (DeepSpeed then reduces SP gradients
            inconsistently), and whatever TRL's own ``__post_init__`` raises.
    """

    def __post_init__(self):
        pc = self.parallelism_config
        sp = sp_size_of(self)
        if sp == 1:
            return original(self)
        cause, name = unserved(self), size_name(self)
        if cause is not None:
            raise ValueError(f"grpo_mem cannot train with sequence parallelism: {cause}")
        self.parallelism_config = None  # TRL's refusal reads it; nothing else in __post_init__ does
        try:
            with _world_as_data_parallel(type(self), sp, name):
                original(self)
        finally:
            self.parallelism_config = pc
        groups = self.world_size // sp if self.world_size % sp == 0 else None
        if groups is not None and groups > 1 and pc.data_parallel_size != groups:
            size = "dp_shard_size" if context_parallel(self) else "dp_replicate_size"
            why = (
                "FSDP2 shards over dp_shard x cp"
                if context_parallel(self)
                else "accelerate sizes DeepSpeed's batch by it"
            )
            raise ValueError(
                f"sequence parallelism with {size_name(self)} on {self.world_size} processes makes {groups} "
                f"data-parallel groups, but parallelism_config has data_parallel_size={pc.data_parallel_size}: pass "
                f"ParallelismConfig(..., {size}={groups}) ({why})"
            )
        zero = _zero_config(self)
        if zero.get("stage") == 3 and not zero.get("reduce_scatter", True):
            raise ValueError(
                f"grpo_mem cannot train with sequence parallelism: ZeRO-3 with reduce_scatter=False and {size_name(self)}: "
                "DeepSpeed then sums the SP ranks' gradients in buckets up to reduce_bucket_size and averages them in "
                "larger ones (stage3.py __avg_scatter_contiguous_grads vs reduce_scatter_coalesced); keep reduce_scatter"
            )

    __post_init__.__wrapped_original__ = original
    return __post_init__


def _zero_config(args) -> dict:
    """The ``zero_optimization`` block of ``args``' processed DeepSpeed config (empty without one)."""
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}
    return config.get("zero_optimization", {}) or {}


def sp_gradient_reduction(trainer) -> str | None:
    """How the framework combines the gradients of the ranks of one SP group, for a trainer with sequence
    parallelism (None without): ``"sum"`` under DeepSpeed ZeRO 0-2 (every reduction divides by world // sp_size);
    ``"mean"`` under ZeRO-3 with ``reduce_scatter`` (DeepSpeed's default: ``reduce_scatter_coalesced`` divides by
    the world size; functions in ``trl_sp``'s docstring) and under FSDP2 with ``cp_size`` (its reduce-scatter over
    the flattened ``dp_shard_cp`` mesh dimension, and the all-reduce over ``dp_replicate``, average: torch
    ``_fully_shard._fsdp_collectives._get_gradient_divide_factors`` without a divide factor set, torch 2.13). Each
    averages over data-parallel ranks. With ``"sum"`` the SP ranks' losses must add up to their DP rank's loss; with
    ``"mean"`` each must be the group size times its share. DeepSpeed 0.20.2 makes ZeRO-3 sum over the SP group too
    (deepspeedai/DeepSpeed#8854, as transformers 5.25's ``deepspeed_sp_compute_loss`` reads it), so ZeRO-3 is
    ``"mean"`` only before that release (``deepspeed_sums_sp_gradients``)."""
    if layout(trainer) is None:
        return None
    if context_parallel(trainer.args):
        return "mean"
    if _zero_config(trainer.args).get("stage") == 3 and not deepspeed_sums_sp_gradients():
        return "mean"
    return "sum"


ZERO3_SUMS_FROM = (0, 20, 2)
"""The DeepSpeed release from which ZeRO-3 sums the gradients of an SP group (deepspeedai/DeepSpeed#8854)."""


def deepspeed_sums_sp_gradients(version: str | None = None) -> bool:
    """Whether the installed DeepSpeed (``version``: this release instead) sums an SP group's gradients under ZeRO-3
    (from ``ZERO3_SUMS_FROM``) rather than averaging them. A development or local build counts as its release."""
    import importlib.metadata
    import re

    release = version if version is not None else importlib.metadata.version("deepspeed")
    parts = re.match(r"(\d+)\.(\d+)\.(\d+)", release)
    if parts is None:
        raise ValueError(f"cannot read a DeepSpeed release from {release!r}")
    return tuple(int(p) for p in parts.groups()) >= ZERO3_SUMS_FROM


def config_classes(owner) -> list:
    """The TRL config classes whose ``__post_init__`` refuses sequence parallelism for the trainer ``owner`` (a class):
    ``GRPOConfig`` for ``GRPOTrainer`` and its subclasses, ``RLOOConfig`` for ``RLOOTrainer``'s; none for an
    instance (its config is built already)."""
    import trl

    if not isinstance(owner, type):
        return []
    pairs = ((trl.GRPOTrainer, trl.GRPOConfig), (trl.RLOOTrainer, trl.RLOOConfig))
    return [config for trainer, config in pairs if issubclass(owner, trainer)]


def patched_set_seed(original):
    """TRL's module-level ``set_seed`` (accelerate's) with ``device_specific=True`` seeding ``seed + dp_rank`` under
    sequence parallelism (``seed + process_index`` otherwise, as accelerate does)."""

    def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False):
        lay = _state_layout() if device_specific else None
        if lay is not None:
            return original(seed + lay.dp_rank, device_specific=False, deterministic=deterministic)
        return original(seed, device_specific=device_specific, deterministic=deterministic)

    set_seed.__wrapped_original__ = original
    return set_seed


def _state_layout():
    """``sp_ranks.Layout`` from accelerate's ``AcceleratorState`` (the trainer's ``parallelism_config``), or None."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return None
    return layout(AcceleratorState())


def reseed(trainer) -> None:
    """Seed this rank as TRL's ``__init__`` seeds a data-parallel rank (``seed + dp_rank``), for a trainer built before
    the hooks were installed; nothing without sequence parallelism."""
    lay = layout(trainer)
    if lay is not None:
        from accelerate.utils import set_seed

        set_seed(trainer.args.seed + lay.dp_rank)

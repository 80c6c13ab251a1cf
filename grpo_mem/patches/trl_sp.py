"""Sequence parallelism for TRL's GRPO/RLOO trainers: the TRL, accelerate and DeepSpeed side.

A user asks for it as for TRL's SFT: ``GRPOConfig(parallelism_config=ParallelismConfig(sp_size=N,
sp_backend="deepspeed", sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation=...)), deepspeed=...)``
after ``grpo_mem.patch_trl()``. The ``sp_size`` consecutive ranks of one sequence-parallel (SP) group, as DeepSpeed
builds them (``parallel_state_sp.initialize_sequence_parallel``: ranks ``d*N .. d*N+N-1`` form group ``d``), act as
ONE data-parallel (DP) rank ``d`` of ``world // N``: they read the same prompts, hold the same completions, rewards
and advantages, and every global quantity TRL computes (the generation batch, reward statistics, the loss
normaliser) is the one a run on ``world // N`` processes without SP computes, step by step. What this module changes:

- **The configuration.** ``GRPOConfig``/``RLOOConfig.__post_init__`` refuse ``sp_size > 1``; the patch's
  ``patched_post_init`` lifts that for ``sp_backend="deepspeed"`` only (``cp_size > 1`` stays refused: see
  ``CP_CAUSE``), and runs TRL's own ``__post_init__`` with ``world_size`` seen as the DP size, so that
  ``generation_batch_size``, ``steps_per_generation`` and the divisibility checks are those of the DP run.
- **The data.** ``get_train_dataloader``/``get_eval_dataloader`` run under ``data_parallel``: accelerate shards the
  prompts over the DP ranks (``process_index // N`` of ``world // N``), so the SP ranks of a group read the same.
- **accelerate's Ulysses setup.** ``Accelerator._prepare_deepspeed`` (accelerate 1.15, accelerator.py:2395-2431) calls
  ``UlyssesSPAttentionHF.register_with_transformers``: it builds the SP groups (kept: grpo_mem and DeepSpeed's ZeRO
  use them) and replaces the entry of the core implementation (``"sdpa"``, ...) in the local mapping of
  transformers' ``ALL_ATTENTION_FUNCTIONS`` with a wrapper that all-to-alls every attention call of every model in the
  process over the SP group, dropping the attention mask. transformers' Trainer then wraps the train dataloader in
  ``UlyssesSPDataLoaderAdapter`` (trainer.py:1805, through ``Accelerator.deepspeed_ulysses_dl_adapter``), which
  shards tensor batches along the sequence and needs ``input_ids``/``position_ids`` (a GRPO batch is a list of
  prompt records). The patch replaces that hook on the trainer's accelerator by ``_skip_ulysses_adapter``: the
  dataloader is kept whole, and the attention registry gets its core function back (``restore_attention``), so
  generation and every stock forward run the whole sequence with the model's own attention; grpo_mem's attention
  hook shards its own scoring. The Trainer's step count multiplies the dataloader length by ``sp_size`` for that
  adapter (trainer.py:2516): ``set_initial_training_values`` runs with an SP size of 1 there.
- **Generation and scoring** (``_prepare_inputs``, ``compute_loss``) run under ``data_parallel``: the accelerator
  reports ``process_index``/``num_processes`` of the DP rank, and ``gather``/``gather_object``/``reduce`` (the
  accelerator's and those TRL's modules import) gather over all ranks and keep the SP group leaders' parts: what
  a gather over the DP ranks returns, with every rank still in every collective (lockstep for ZeRO-3).
- **Same completions.** Every SP rank generates (ZeRO-3 needs every rank in generation's forwards); ``_generate``'s
  outputs and the random states (Python, NumPy, torch CPU and device) are then broadcast from the group leader, so
  the group holds the leader's completions even if a kernel were not deterministic. TRL seeds each process with
  ``seed + process_index`` (``set_seed(device_specific=True)``); under SP, ``seed + dp_rank``.

Gradients: DeepSpeed reduces over all ranks (``seq_data_parallel_group``). ZeRO 1/2 divide by ``world / sp_size``
(stage_1_and_2.py:1508, 1688, 2380): summed over the SP group, averaged over DP ranks. ZeRO-3 does so only in its
contiguous all-reduce path (stage3.py:1878, 2279); with ``reduce_scatter`` (its default) every bucket goes through
``reduce_scatter_coalesced``, which divides by the world size (coalesced_collectives.py:124): averaged over the SP
group too. ``sp_gradient_reduction`` tells which; ZeRO-3 with ``reduce_scatter=False`` mixes both by bucket size and
is refused.
"""

from __future__ import annotations

import contextlib
import random
import sys
from dataclasses import dataclass

import torch

CP_CAUSE = (
    "context parallelism (cp_size > 1) shards the batch along the sequence before the model's forward "
    "(accelerate's torch context-parallel buffers over FSDP2); GRPO builds its scoring inputs after generation, and "
    "grpo_mem's prompt-once passes have no ring-attention exchange, so it stays refused: use sp_size"
)
"""Why ``cp_size > 1`` stays refused (TRL's own error is raised)."""

SP_METHODS = (
    "get_train_dataloader",
    "get_eval_dataloader",
    "compute_loss",
    "_generate",
    "set_initial_training_values",
)
"""Trainer methods ``patch_trl`` wraps for sequence parallelism (``make_method``); each is TRL's own without it."""


@dataclass(frozen=True)
class Layout:
    """This rank's place under sequence parallelism: DeepSpeed's SP groups are ``sp_size`` consecutive ranks.

    Attributes:
        sp_size, sp_rank: size of the SP group and this rank's index in it.
        dp_size, dp_rank: number of SP groups (data-parallel ranks) and this rank's group.
    """

    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int

    @property
    def leader(self) -> int:
        """Global rank of this SP group's first rank."""
        return self.dp_rank * self.sp_size


def sp_size_of(args) -> int:
    """The sequence-parallel size ``args`` (a ``TrainingArguments``) asks grpo_mem to serve: ``parallelism_config``'s
    ``sp_size`` with ``sp_backend="deepspeed"`` and ``cp_size`` 1, else 1."""
    pc = getattr(args, "parallelism_config", None)
    if pc is None or not pc.sp_enabled or pc.cp_enabled or pc.sp_backend != "deepspeed":
        return 1
    return int(pc.sp_size)


def layout(trainer_or_args) -> Layout | None:
    """This rank's ``Layout`` for a trainer (or its ``TrainingArguments``) that trains with sequence parallelism, or
    None (no SP, or no process group). Raises ValueError when ``sp_size`` does not divide the world size."""
    args = getattr(trainer_or_args, "args", trainer_or_args)
    sp = sp_size_of(args)
    if sp == 1 or not torch.distributed.is_initialized():
        return None
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if world % sp:
        raise ValueError(f"parallelism_config.sp_size={sp} does not divide the world size {world}")
    return Layout(sp_size=sp, sp_rank=rank % sp, dp_size=world // sp, dp_rank=rank // sp)


def _groups_built() -> bool:
    """Whether DeepSpeed's sequence-parallel groups exist (accelerate builds them when it prepares the model)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None


def ready(trainer) -> bool:
    """Whether ``trainer`` trains with sequence parallelism and its SP groups exist (from the start of ``train()``;
    before it, e.g. in ``grpo_mem.verify``, its ranks score on their own)."""
    return layout(trainer) is not None and _groups_built()


def sp_group(trainer) -> tuple | None:
    """``(group, rank, size)``: DeepSpeed's sequence-parallel process group of this rank (the one accelerate passed to
    DeepSpeed as ``mpu``, over which ZeRO sums gradients), this rank's index in it and its size; None when
    ``trainer`` does not train with sequence parallelism.

    Raises:
        RuntimeError: the SP groups do not exist yet (they are built when accelerate prepares the model for
            DeepSpeed, at the start of ``train()``), or DeepSpeed's group disagrees with ``Layout``.
    """
    lay = layout(trainer)
    if lay is None:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if not _groups_built():
        raise RuntimeError(
            "the sequence-parallel groups do not exist yet: accelerate builds them when it prepares the model for "
            "DeepSpeed (at the start of train())"
        )
    group = parallel_state_sp.get_sequence_parallel_group()
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    if (rank, size) != (lay.sp_rank, lay.sp_size):
        raise RuntimeError(f"DeepSpeed's SP group (rank {rank} of {size}) is not the expected {lay}")
    return group, rank, size


def sequence_parallel(trainer):
    """The ``SequenceParallel`` group grpo_mem's scoring splits ``trainer``'s passes over (``sp_group``, with the
    gradient scale ``sp_gradient_reduction`` asks for), or None without sequence parallelism.

    Raises:
        RuntimeError: as ``sp_group``.
    """
    found = sp_group(trainer)
    if found is None:
        return None
    from ..model.sequence_parallel import SequenceParallel

    group, rank, size = found
    scale = {"sum": 1.0, "mean": float(size)}[sp_gradient_reduction(trainer)]
    return SequenceParallel(group, rank, size, scale)


# ---------------------------------------------------------------------------------------------------- configuration


def unserved(args) -> str | None:
    """Why grpo_mem cannot train ``args``' sequence parallelism exactly, or None."""
    sp = sp_size_of(args)
    if getattr(args, "deepspeed", None) is None:
        return f"sp_size={sp} runs through DeepSpeed Ulysses: pass a ZeRO config as deepspeed=..."
    if getattr(args, "use_vllm", False):
        return (
            f"use_vllm=True with sp_size={sp}: TRL's vLLM generation gathers prompts and slices completions over all "
            "processes, not over data-parallel ranks"
        )
    if getattr(args, "use_liger_kernel", False):
        return f"use_liger_kernel=True with sp_size={sp}: Liger's fused GRPO loss scores whole sequences on each rank"
    return None


def _dp_world_class(cls, sp: int, reader):
    """``cls`` whose ``world_size`` is the data-parallel size (world // sp) when read by the function ``reader`` (TRL's
    ``__post_init__`` body) and the world size for everyone else: ``TrainingArguments.__post_init__`` fills the
    DeepSpeed config's ``train_batch_size`` from it, which ``deepspeed.zero.Init`` checks against the world before
    accelerate corrects it for SP."""

    def world_size(self):
        world = cls.world_size.fget(self)
        if sys._getframe(1).f_code is not reader:
            return world
        if world % sp:
            raise ValueError(f"parallelism_config.sp_size={sp} does not divide the world size {world}")
        return world // sp

    return type(cls.__name__, (cls,), {"world_size": property(world_size), "__module__": cls.__module__})


def patched_post_init(original):
    """``GRPOConfig``/``RLOOConfig.__post_init__`` around TRL's ``original``: with ``sp_size > 1`` and
    ``sp_backend="deepspeed"`` (``cp_size`` 1), TRL's refusal is skipped and TRL's own checks and batch arithmetic
    run with ``world_size`` equal to the data-parallel size; anything else is TRL's own.

    Raises:
        ValueError: what ``unserved`` names (no DeepSpeed config, vLLM, Liger's loss), ``sp_size`` not dividing the
            world size, several SP groups without ``dp_replicate_size`` saying how many, ZeRO-3 with ``reduce_scatter=False`` (DeepSpeed then reduces SP gradients inconsistently),
            and whatever TRL's own ``__post_init__`` raises.
    """

    def __post_init__(self):
        pc = self.parallelism_config
        sp = sp_size_of(self)
        if sp == 1:
            return original(self)
        cause = unserved(self)
        if cause is not None:
            raise ValueError(f"grpo_mem cannot train with sequence parallelism: {cause}")
        cls = type(self)
        self.parallelism_config = None  # TRL's refusal reads it; nothing else in __post_init__ does
        self.__class__ = _dp_world_class(cls, sp, original.__code__)
        try:
            original(self)
        finally:
            self.__class__ = cls
            self.parallelism_config = pc
        groups = self.world_size // sp if self.world_size % sp == 0 else None
        if groups is not None and groups > 1 and pc.data_parallel_size != groups:
            raise ValueError(
                f"sequence parallelism with sp_size={sp} on {self.world_size} processes makes {groups} data-parallel "
                f"groups, but parallelism_config has data_parallel_size={pc.data_parallel_size}: pass "
                f"ParallelismConfig(..., dp_replicate_size={groups}) (accelerate sizes DeepSpeed's batch by it)"
            )
        zero = _zero_config(self)
        if zero.get("stage") == 3 and not zero.get("reduce_scatter", True):
            raise ValueError(
                f"grpo_mem cannot train with sequence parallelism: ZeRO-3 with reduce_scatter=False and sp_size={sp}: "
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
    """How DeepSpeed combines the gradients of the ranks of one SP group, for a trainer with sequence parallelism
    (None without): ``"sum"`` under ZeRO 0-2 (every reduction divides by world // sp_size: stage_1_and_2.py:1508,
    1688, 2380), ``"mean"`` under ZeRO-3 with ``reduce_scatter`` (DeepSpeed's default: ``reduce_scatter_coalesced``
    divides by the world size, coalesced_collectives.py:124). Both average over data-parallel ranks. With ``"sum"``
    the SP ranks' losses must add up to their DP rank's loss; with ``"mean"`` each must be sp_size times its share."""
    if layout(trainer) is None:
        return None
    return "mean" if _zero_config(trainer.args).get("stage") == 3 else "sum"


def config_classes(owner) -> list:
    """The TRL config classes whose ``__post_init__`` refuses sequence parallelism for the trainer ``owner`` (a class):
    ``GRPOConfig`` for ``GRPOTrainer`` and its subclasses, ``RLOOConfig`` for ``RLOOTrainer``'s."""
    import trl

    if not isinstance(owner, type):
        return []
    pairs = ((trl.GRPOTrainer, trl.GRPOConfig), (trl.RLOOTrainer, trl.RLOOConfig))
    return [config for trainer, config in pairs if issubclass(owner, trainer)]


def _state_layout() -> Layout | None:
    """``Layout`` from accelerate's ``AcceleratorState`` (the trainer's ``parallelism_config``), or None."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return None
    return layout(AcceleratorState())


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


_MODULE_PATCHES = {"set_seed": patched_set_seed}


def module_patches(owner) -> list:
    """``(module, name, replacement)`` for the module-level functions of TRL's trainer modules (those of the TRL
    classes in the trainer class ``owner``'s MRO, e.g. ``trl.trainer.grpo_trainer``) that sequence parallelism
    changes: ``set_seed`` (``patched_set_seed``). Empty for a trainer instance (built already)."""
    if not isinstance(owner, type):
        return []
    return [
        (module, name, make(vars(module)[name]))
        for module in _trl_modules(owner)
        for name, make in _MODULE_PATCHES.items()
        if name in vars(module)
    ]


def reseed(trainer) -> None:
    """Seed this rank as TRL's ``__init__`` seeds a data-parallel rank (``seed + dp_rank``), for a trainer built before
    the patch; nothing without sequence parallelism."""
    lay = layout(trainer)
    if lay is not None:
        from accelerate.utils import set_seed

        set_seed(trainer.args.seed + lay.dp_rank)


# ---------------------------------------------------------------------------------------------------- data parallel


def _trl_modules(cls) -> list:
    """The modules of the TRL classes in ``cls``' MRO (the trainer code that calls module-level gathers)."""
    seen = []
    for c in cls.__mro__:
        module = sys.modules.get(c.__module__)
        if c.__module__.startswith("trl.") and module is not None and module not in seen:
            seen.append(module)
    return seen


def keep_leaders(gathered: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The SP group leaders' rows of an all-rank gather (``(world * n, ...)``, rank-major): ``(dp_size * n, ...)``."""
    rest = gathered.shape[1:]
    return gathered.reshape(lay.dp_size, lay.sp_size, -1, *rest)[:, 0].reshape(-1, *rest)


def _gather(lay: Layout, data):
    from accelerate.utils import gather, recursively_apply

    return recursively_apply(keep_leaders, gather(data), lay)


def _gather_object(lay: Layout, obj):
    out = [None] * (lay.dp_size * lay.sp_size)
    torch.distributed.all_gather_object(out, obj)
    return [x for part in out[:: lay.sp_size] for x in part]


def _reduce(lay: Layout, data, reduction: str = "sum", scale: float = 1.0):
    from accelerate.utils import gather, recursively_apply

    if reduction not in ("sum", "mean", "max"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'max', got {reduction!r}")

    def one(tensor):
        per_rank = keep_leaders(gather(tensor.reshape(1, *tensor.shape)), lay)  # (dp_size, *shape)
        if reduction == "max":
            return per_rank.max(0).values
        total = per_rank.sum(0)
        return total / lay.dp_size if reduction == "mean" else total

    return recursively_apply(one, data, error_on_other_type=True)


class _DataParallelAccelerator:
    """Mixed into the trainer's accelerator's class while ``data_parallel`` is open."""

    _grpo_mem_view = True

    @property
    def num_processes(self):
        return self._grpo_mem_layout.dp_size

    @property
    def process_index(self):
        return self._grpo_mem_layout.dp_rank

    def gather(self, tensor):
        return _gather(self._grpo_mem_layout, tensor)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        return _reduce(self._grpo_mem_layout, tensor, reduction, scale)


_VIEW_CLASSES: dict = {}


def _view_class(cls):
    view = _VIEW_CLASSES.get(cls)
    if view is None:
        view = _VIEW_CLASSES[cls] = type(cls.__name__, (_DataParallelAccelerator, cls), {"__module__": cls.__module__})
    return view


@contextlib.contextmanager
def data_parallel(trainer):
    """While open, TRL's code of ``trainer`` sees its SP group as one data-parallel rank: the accelerator's
    ``process_index``/``num_processes`` are the DP rank and size, and its ``gather``/``reduce`` and the ``gather``/
    ``gather_object`` of TRL's trainer modules return the DP ranks' data (every rank still joins every collective).
    Nothing changes without sequence parallelism; re-entrant. Assumes the SP ranks hold the same data (what this
    module arranges)."""
    lay = layout(trainer)
    accelerator = getattr(trainer, "accelerator", None)
    if lay is None or accelerator is None or getattr(accelerator, "_grpo_mem_view", False):
        yield
        return
    cls = accelerator.__class__
    swaps = []
    for module in _trl_modules(type(trainer)):
        for name, fn in (("gather", _gather), ("gather_object", _gather_object)):
            if name in vars(module):
                swaps.append((module, name, vars(module)[name]))
                setattr(module, name, _bind(fn, lay))
    accelerator.__dict__["_grpo_mem_layout"] = lay
    accelerator.__class__ = _view_class(cls)
    try:
        yield
    finally:
        accelerator.__class__ = cls
        accelerator.__dict__.pop("_grpo_mem_layout", None)
        for module, name, previous in reversed(swaps):
            setattr(module, name, previous)


def _bind(fn, lay):
    def bound(data):
        return fn(lay, data)

    return bound


# ------------------------------------------------------------------------------------------------- Ulysses undone


def _ulysses_of(fn):
    """The ``UlyssesSPAttentionHF`` a DeepSpeed registration wrapper closes over, or None."""
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None or "uattn" not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index("uattn")].cell_contents


def restore_attention() -> list[str]:
    """Undo ``UlyssesSPAttentionHF.register_with_transformers``' attention override: every entry of transformers'
    ``ALL_ATTENTION_FUNCTIONS`` that is DeepSpeed's Ulysses wrapper gets back the core function it wrapped (the
    class-wide one, or the local override it replaced). Returns the implementation names restored. DeepSpeed's
    process groups (``parallel_state_sp``) are left as they are."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    restored = []
    for name, fn in list(ALL_ATTENTION_FUNCTIONS._local_mapping.items()):
        uattn = _ulysses_of(fn)
        if uattn is None:
            continue
        if ALL_ATTENTION_FUNCTIONS._global_mapping.get(name) is uattn.attn:
            del ALL_ATTENTION_FUNCTIONS[name]
        else:
            ALL_ATTENTION_FUNCTIONS[name] = uattn.attn
        restored.append(name)
    return restored


def _skip_ulysses_adapter(dataloader, model):
    """Stands for ``Accelerator.deepspeed_ulysses_dl_adapter`` on a trainer grpo_mem serves: transformers' Trainer
    calls it right after accelerate prepared the model (and registered Ulysses' attention). The dataloader stays
    whole, and the attention registry gets its core functions back."""
    restore_attention()
    return dataloader


# ------------------------------------------------------------------------------------------ same generation in group


def _rng_states(device: torch.device) -> dict:
    import numpy as np

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type != "cpu":
        states[device.type] = torch.get_device_module(device.type).get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    import numpy as np

    random.setstate(states.pop("python"))
    np.random.set_state(states.pop("numpy"))
    torch.set_rng_state(states.pop("torch"))
    for device_type, state in states.items():
        torch.get_device_module(device_type).set_rng_state(state)


def share_generation(trainer, outputs):
    """``outputs`` (``_generate``'s) of this SP group's leader on every rank of the group, and the leader's random
    states (Python, NumPy, torch CPU and the accelerator's device) on every rank; ``outputs`` unchanged without
    sequence parallelism, and before ``train()`` built the SP groups (``grpo_mem.verify`` generating on an unprepared
    trainer: the ranks are no group yet). A collective of the SP group (``broadcast_object_list``)."""
    if layout(trainer) is None or not _groups_built():
        return outputs
    found = sp_group(trainer)
    group, rank, _ = found
    device = trainer.accelerator.device
    payload = [outputs, _rng_states(device)]
    src = torch.distributed.get_global_rank(group, 0)
    torch.distributed.broadcast_object_list(
        payload, src=src, group=group, device=None if device.type == "cpu" else device
    )
    if rank != 0:
        _set_rng_states(payload[1])
    return payload[0]


# ------------------------------------------------------------------------------------------------- trainer methods


def _make_dataloader(original, handle):
    def get_dataloader(self, *args, **kwargs):
        if layout(self) is None:
            return original(self, *args, **kwargs)
        handle.remember(self.accelerator, "deepspeed_ulysses_dl_adapter", _skip_ulysses_adapter)
        with data_parallel(self):
            return original(self, *args, **kwargs)

    return get_dataloader


def _make_compute_loss(original, handle):
    def compute_loss(self, *args, **kwargs):
        with data_parallel(self):
            return original(self, *args, **kwargs)

    return compute_loss


def _make_generate(original, handle):
    def _generate(self, *args, **kwargs):
        return share_generation(self, original(self, *args, **kwargs))

    return _generate


def _make_initial_values(original, handle):
    def set_initial_training_values(self, args, *rest, **kwargs):
        if layout(self) is None:
            return original(self, args, *rest, **kwargs)
        total = self.get_total_train_batch_size(args)  # world // sp_size data-parallel ranks: right as it is
        own = {
            name: self.__dict__[name] for name in ("get_sp_size", "get_total_train_batch_size") if name in self.__dict__
        }
        self.get_sp_size = lambda: 1  # the dataloader is not multiplied by Ulysses' adapter here
        self.get_total_train_batch_size = lambda _args: total
        try:
            return original(self, args, *rest, **kwargs)
        finally:
            del self.get_sp_size, self.get_total_train_batch_size
            self.__dict__.update(own)

    return set_initial_training_values


_MAKERS = {
    "get_train_dataloader": _make_dataloader,
    "get_eval_dataloader": _make_dataloader,
    "compute_loss": _make_compute_loss,
    "_generate": _make_generate,
    "set_initial_training_values": _make_initial_values,
}


def make_method(name: str, original, handle):
    """The wrapper of the trainer method ``name`` (one of ``SP_METHODS``) around ``original``, recording instance
    state it sets with ``handle.remember``. Each wrapper is ``original`` itself when the trainer has no sequence
    parallelism."""
    wrapper = _MAKERS[name](original, handle)
    wrapper.__name__ = name
    wrapper.__wrapped_original__ = original
    return wrapper

"""Where a rank stands in a sequence-parallel (SP) group, and what TRL's code sees of the group's ranks.

Two routes give grpo_mem an SP group, and both put its ranks consecutively: DeepSpeed's ``sp_size`` groups
(deepspeed 0.19.8 ``parallel_state_sp.initialize_sequence_parallel``: ranks ``d*N .. d*N+N-1`` form group ``d``), and
accelerate's ``cp_size`` dimension of the FSDP2 device mesh (accelerate 1.15 ``ParallelismConfig._get_mesh`` orders
the mesh ``dp_replicate, dp_shard, cp``: ``cp`` is the innermost dimension). grpo_mem's TRL patch lets each group act
as ONE data-parallel (DP) rank ``d`` of ``world // N``. This module holds the pieces that make it so at run time: the
rank's ``Layout``, the group itself (``sp_group``), the DP view TRL's code gets of the accelerator and of its trainer
modules' gathers (``data_parallel``), the group leader's generation and random states shared in the group
(``share_generation``), and DeepSpeed Ulysses' attention override undone (``skip_ulysses_adapter``). The installer is
``grpo_mem.patches.trl_sp``; nothing here is imported without sequence parallelism.
"""

from __future__ import annotations

import contextlib
import random
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """This rank's place under sequence parallelism: an SP group is ``sp_size`` (or ``cp_size``) consecutive ranks.

    Attributes:
        sp_size, sp_rank: size of the SP group and this rank's index in it.
        dp_size, dp_rank: number of SP groups (data-parallel ranks) and this rank's group.
    """

    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int


def sp_size_of(args) -> int:
    """The sequence-parallel size ``args`` (a ``TrainingArguments``, or accelerate's ``AcceleratorState``) asks grpo_mem
    to serve: ``parallelism_config``'s ``cp_size`` when above 1 (``context_parallel``), else its ``sp_size`` with
    ``sp_backend="deepspeed"``, else 1 (accelerate refuses ``cp_size`` and ``sp_size`` both above 1)."""
    pc = getattr(args, "parallelism_config", None)
    if context_parallel(args):
        return int(pc.cp_size)
    if pc is None or not pc.sp_enabled or pc.cp_enabled or pc.sp_backend != "deepspeed":
        return 1
    return int(pc.sp_size)


def context_parallel(args) -> bool:
    """Whether ``args`` (as ``sp_size_of``) asks for the group through accelerate's context-parallel (``cp``) mesh
    dimension, FSDP2's route, rather than through DeepSpeed's sequence-parallel groups."""
    pc = getattr(args, "parallelism_config", None)
    return pc is not None and pc.cp_enabled and not pc.sp_enabled


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


def _parallel_state_sp():
    """deepspeed 0.19.8's ``parallel_state_sp`` module, after checking the two names read of it.

    Raises:
        TypeError: the installed DeepSpeed lacks ``_SEQUENCE_PARALLEL_GROUP`` (the group accelerate's
            ``Accelerator._prepare_deepspeed`` builds through ``UlyssesSPAttentionHF.register_with_transformers``; no
            public accessor says whether it exists without raising) or ``get_sequence_parallel_group``.
    """
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    missing = [
        n for n in ("_SEQUENCE_PARALLEL_GROUP", "get_sequence_parallel_group") if not hasattr(parallel_state_sp, n)
    ]
    if missing:
        raise TypeError(f"deepspeed's parallel_state_sp lacks {missing}, which grpo_mem reads (written against 0.19.8)")
    return parallel_state_sp


def _cp_mesh(trainer):
    """The ``cp`` dimension of ``trainer``'s accelerate device mesh (``Accelerator.torch_device_mesh``, built in
    ``Accelerator.__init__`` from the ``parallelism_config``), or None where there is none."""
    mesh = getattr(getattr(trainer, "accelerator", None), "torch_device_mesh", None)
    if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["cp"]


def groups_built(trainer) -> bool:
    """Whether ``trainer``'s SP groups serve its scoring: from the start of ``train()``, where accelerate prepares the
    model. Under context parallelism, the ``cp`` dimension of its accelerator's device mesh once the model is
    sharded by FSDP2 (``torch.distributed.fsdp.FSDPModule``; the mesh exists from the accelerator's creation, but
    before ``train()``, e.g. in ``grpo_mem.verify``, the ranks score on their own as under DeepSpeed); else
    DeepSpeed's sequence-parallel groups (built when accelerate prepares the model)."""
    if context_parallel(getattr(trainer, "args", None)):
        from torch.distributed.fsdp import FSDPModule

        return _cp_mesh(trainer) is not None and isinstance(getattr(trainer, "model", None), FSDPModule)
    return _parallel_state_sp()._SEQUENCE_PARALLEL_GROUP is not None


def sp_group(trainer) -> tuple | None:
    """``(group, rank, size)``: this rank's sequence-parallel process group, its index in it and its size; None when
    ``trainer`` does not train with sequence parallelism. The group is the ``cp`` dimension of the accelerator's
    device mesh under context parallelism (its process group: FSDP2 reduce-scatters gradients over the flattened
    ``dp_shard_cp`` dimension that contains it), else DeepSpeed's SP group (the one accelerate passed to DeepSpeed
    as ``mpu``, over which ZeRO sums gradients).

    Raises:
        RuntimeError: the SP groups do not exist yet (DeepSpeed's are built when accelerate prepares the model, at
            the start of ``train()``), or the group disagrees with ``Layout`` (consecutive ranks).
    """
    lay = layout(trainer)
    if lay is None:
        return None
    if not groups_built(trainer):
        raise RuntimeError(
            "the sequence-parallel groups do not exist yet: accelerate builds them when it prepares the model for "
            "DeepSpeed (at the start of train()), and the cp mesh dimension with the Accelerator"
        )
    cp = _cp_mesh(trainer) if context_parallel(trainer.args) else None
    group = _parallel_state_sp().get_sequence_parallel_group() if cp is None else cp.get_group()
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    if (rank, size) != (lay.sp_rank, lay.sp_size):
        source = "DeepSpeed's SP group" if cp is None else "accelerate's cp mesh dimension"
        raise RuntimeError(f"{source} (rank {rank} of {size}) is not the expected {lay}")
    return group, rank, size


# ---------------------------------------------------------------------------------------------------- data parallel


def trl_modules(cls) -> list:
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
    """accelerate's ``gather`` over all ranks, keeping the SP group leaders' parts: the DP ranks' gather."""
    from accelerate.utils import gather, recursively_apply

    return recursively_apply(keep_leaders, gather(data), lay)


def _gather_object(lay: Layout, obj):
    """accelerate's ``gather_object`` over the DP ranks (every rank joins the all-rank gather)."""
    out = [None] * (lay.dp_size * lay.sp_size)
    torch.distributed.all_gather_object(out, obj)
    return [x for part in out[:: lay.sp_size] for x in part]


def _reduce(lay: Layout, data, reduction: str = "sum"):
    """accelerate's ``Accelerator.reduce`` over the DP ranks. ValueError for another ``reduction``."""
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


class DataParallelState:
    """accelerate's ``AcceleratorState`` as one DP rank sees it: ``num_processes``/``process_index`` are the DP size and
    rank, everything else is the real state's. ``Accelerator.num_processes``/``process_index`` (accelerate 1.15) are
    properties reading ``self.state``: the accelerator's ``state`` attribute is the seam."""

    def __init__(self, state, lay: Layout):
        self._state, self._lay = state, lay

    @property
    def num_processes(self) -> int:
        return self._lay.dp_size

    @property
    def process_index(self) -> int:
        return self._lay.dp_rank

    def __getattr__(self, name):
        return getattr(self._state, name)


def _bind(fn, lay):
    def bound(data, *args, **kwargs):
        return fn(lay, data, *args, **kwargs)

    return bound


_MODULE_GATHERS = {"gather": _gather, "gather_object": _gather_object}
"""The module-level functions of TRL's trainer modules ``data_parallel`` replaces, by name."""


@contextlib.contextmanager
def data_parallel(trainer):
    """While open, TRL's code of ``trainer`` sees its SP group as one data-parallel rank: the accelerator's ``state``
    (so its ``process_index``/``num_processes``) is a ``DataParallelState``, its ``gather``/``reduce`` and the
    ``gather``/``gather_object`` of TRL's trainer modules (TRL 1.16 ``grpo_trainer``/``rloo_trainer`` import them from
    ``accelerate.utils``) return the DP ranks' data (every rank still joins every collective). Each is an attribute of
    the accelerator instance or the module, set on entry and restored on exit. Nothing changes without sequence
    parallelism; re-entrant. Assumes the SP ranks hold the same data (what ``trl_sp`` arranges)."""
    lay = layout(trainer)
    accelerator = getattr(trainer, "accelerator", None)
    if lay is None or accelerator is None or isinstance(accelerator.__dict__.get("state"), DataParallelState):
        yield
        return
    swaps = [
        (m, name, vars(m)[name]) for m in trl_modules(type(trainer)) for name in _MODULE_GATHERS if name in vars(m)
    ]
    mine = {
        "state": DataParallelState(accelerator.state, lay),
        "gather": _bind(_gather, lay),
        "reduce": _bind(_reduce, lay),
    }
    own = {name: accelerator.__dict__[name] for name in mine if name in accelerator.__dict__}
    for module, name, _ in swaps:
        setattr(module, name, _bind(_MODULE_GATHERS[name], lay))
    accelerator.__dict__.update(mine)
    try:
        yield
    finally:
        for name in mine:
            accelerator.__dict__.pop(name)
        accelerator.__dict__.update(own)
        for module, name, previous in reversed(swaps):
            setattr(module, name, previous)


# ------------------------------------------------------------------------------------------------- Ulysses undone


def attention_functions() -> dict:
    """What transformers' ``ALL_ATTENTION_FUNCTIONS`` maps each implementation name to now (a local override or the
    class-wide function), read through its public mapping interface."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return dict(ALL_ATTENTION_FUNCTIONS.items())


def skip_ulysses_adapter(before: dict, dataloader, model):
    """Stands for ``Accelerator.deepspeed_ulysses_dl_adapter(dl, model)`` (accelerate 1.15) on a trainer grpo_mem
    serves: transformers' ``Trainer._inner_training_loop`` calls it right after accelerate prepared the model, where
    ``UlyssesSPAttentionHF.register_with_transformers`` (deepspeed 0.19.8) replaced the core implementation's entry of
    ``ALL_ATTENTION_FUNCTIONS`` with a wrapper that all-to-alls every attention call over the SP group. The dataloader
    stays whole (``UlyssesSPDataLoaderAdapter`` would shard tensor batches along the sequence; a GRPO batch is a list
    of prompt records), and every entry maps again to what it mapped to in ``before`` (``attention_functions()``
    before the model was prepared): generation and every stock forward run the whole sequence with the model's own
    attention, and grpo_mem's attention hook shards its own scoring. DeepSpeed's process groups are kept."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fn in attention_functions().items():
        if name in before and fn is not before[name]:
            ALL_ATTENTION_FUNCTIONS[name] = before[name]
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
    if layout(trainer) is None or not groups_built(trainer):
        return outputs
    group, rank, _ = sp_group(trainer)
    device = trainer.accelerator.device
    payload = [outputs, _rng_states(device)]
    src = torch.distributed.get_global_rank(group, 0)
    torch.distributed.broadcast_object_list(
        payload, src=src, group=group, device=None if device.type == "cpu" else device
    )
    if rank != 0:
        _set_rng_states(payload[1])
    return payload[0]

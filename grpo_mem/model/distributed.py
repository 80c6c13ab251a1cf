"""Wrappers and ranks: the causal LM inside DDP/FSDP/DeepSpeed/PEFT wrappers, and the decisions sharded ranks take
together so that they make the same module calls (``lockstep``)."""

from __future__ import annotations

import sys

import torch
from transformers import PreTrainedModel


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside DDP/DeepSpeed/FSDP/compile wrappers and a PEFT model."""
    if isinstance(model, PreTrainedModel) and "_orig_mod" not in model.__dict__:
        return model  # no wrapper (accelerate's unwrap would return it unchanged, after a package-metadata lookup)
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and type(model).__module__.startswith("peft"):
        model = get_base()
    return model


def lockstep(model: torch.nn.Module) -> bool:
    """Whether every rank must run the same sequence of module calls and backward passes for ``model``.

    True when a process group of more than one rank is up and ``model`` (possibly wrapped) is sharded by FSDP
    (``fully_shard`` or FSDP1) or driven by DeepSpeed (any ZeRO stage). There parameters are all-gathered per module
    call (FSDP, ZeRO-3) and gradients are reduced by hooks in the order they become ready (ZeRO), so ranks taking
    different paths through the model would issue different collectives and hang or mix up their gradients.
    Plain DDP reduces fixed buckets at the window's last backward and needs no lockstep.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, (FSDPModule, FullyShardedDataParallel)):
        return True
    if "deepspeed" in sys.modules:
        from deepspeed import DeepSpeedEngine

        if isinstance(model, DeepSpeedEngine):
            return True
    inner = unwrap_causal_lm(model)
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in inner.modules()) or any(
        hasattr(p, "ds_id") for p in inner.parameters()
    )


def fsdp_wrapped(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a submodule of it is sharded by FSDP (``fully_shard`` or FSDP1), i.e. a wrapped module's
    parameters are unsharded for its backward by a hook on the outputs of its call."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


# image features are computed inside a prompt pass, so every rank must run the vision tower in the same passes
IMAGE_PASSES_DIFFER = (
    "sharded ranks would run the vision tower in different prompt passes of a micro-batch with "
    "image inputs (other passes, or a pass with images on one rank only)"
)


def agree(cause: str | None, pass_keys: list, image_passes: list | None = None) -> tuple[str | None, set]:
    """What every rank in lockstep decides for a micro-batch, from one ``all_gather_object`` (every rank calls it once
    per micro-batch): the fallback cause and the union of the ranks' pass keys (``PassSpec.key``) for the micro-batch.

    The cause is this rank's, one naming another rank when only another rank falls back, ``IMAGE_PASSES_DIFFER``
    when some rank has image inputs (``image_passes``: the keys of its passes that run the vision tower, None without
    image inputs) and the ranks' pass keys or image-pass keys differ, or None when no rank falls back."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (cause, list(pass_keys), image_passes))
    union = {tuple(k) for _, keys, _ in gathered for k in keys}
    if cause is None and any(r is not None for r, _, _ in gathered):
        cause = "another rank falls back, and sharded ranks must run the same module calls"
    if cause is None and any(images is not None for _, _, images in gathered):
        plans = {(frozenset(map(tuple, keys)), frozenset(map(tuple, images or ()))) for _, keys, images in gathered}
        if len(plans) > 1:
            cause = IMAGE_PASSES_DIFFER
    return cause, union


def clear_zero3_grads_before_first_backward(model: torch.nn.Module) -> None:
    """Zero a ZeRO-3 optimizer's accumulated gradient partitions when ``model`` (the DeepSpeed engine) has run no
    backward yet in the current accumulation cycle; a no-op on any other model, and once a backward has run.

    ZeRO-3 starts each cycle by overwriting a parameter's gradient partition with its first gradient of the cycle's
    first backward (``micro_step_id == 0``) and adds every later one, without clearing the partitions in
    ``zero_grad``. A parameter that receives no gradient in that first backward but does in a later one would have
    it added to the previous optimizer step's. Stock TRL reaches every parameter in every micro-batch; a window does
    not: a kept image prompt pass is backpropagated in its release micro-batch, so the vision tower's first gradient
    of the cycle arrives in a later backward. Call it after the engine's forward of the micro-batch (which advances
    ``micro_step_id`` past a finished backward)."""
    if "deepspeed" not in sys.modules:
        return
    from deepspeed import DeepSpeedEngine

    if not isinstance(model, DeepSpeedEngine) or model.zero_optimization_stage() != 3:
        return
    optimizer = getattr(model, "optimizer", None)
    buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if buffer is not None and getattr(optimizer, "micro_step_id", None) == 0 and torch.is_grad_enabled():
        buffer.zero_()

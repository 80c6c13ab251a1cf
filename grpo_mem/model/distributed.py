"""Wrappers and ranks: the causal LM inside DDP/FSDP/DeepSpeed/PEFT wrappers, and the decisions sharded ranks take
together so that they make the same module calls (``lockstep``)."""

from __future__ import annotations

import sys

import torch


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside DDP/DeepSpeed/FSDP/compile wrappers and a PEFT model."""
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


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """``flag`` OR-ed over the ranks of the default process group (one all-reduce; NCCL needs ``device`` on CUDA)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _collective_device(model: torch.nn.Module) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_fallback(model: torch.nn.Module, reason: str | None) -> str | None:
    """The fallback decision every rank in lockstep takes (one all-reduce, so every rank must call it): this rank's
    ``reason``, a reason naming another rank when only another rank falls back, None when no rank does."""
    if any_rank(reason is not None, _collective_device(model)):
        return reason or "another rank falls back, and sharded ranks must run the same module calls"
    return None

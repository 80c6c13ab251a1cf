"""The CUDA device a Triton launch must run on.

Triton launches a kernel on the *current* CUDA device, not on the device of its tensor arguments. With
``device_map`` spreading a model over several GPUs in one process, a layer on ``cuda:1`` called while ``cuda:0`` is
current would launch on the wrong device (an illegal memory access, or a "pointer argument cannot be accessed"
error). Every launcher enters :func:`launch_device` of its tensors first.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

__all__ = ["launch_device"]


def launch_device(tensor: torch.Tensor):
    """Context manager under which a Triton kernel taking ``tensor`` must be launched.

    Returns ``torch.cuda.device(tensor.device)`` for a CUDA tensor (makes its device current for the duration, restores
    the previous one after), and a ``contextlib.nullcontext()`` for any other device (CPU tensors under Triton's
    interpreter, meta tensors). Creating the context does not initialise CUDA; entering it does.
    """
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return nullcontext()

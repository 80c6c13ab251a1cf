"""Which CUDA device a Triton launch runs on.

Triton launches a kernel on the *current* CUDA device (and its current stream), not on the device of the tensors it
is given. With ``device_map`` spreading a model over several GPUs in one process, the current device is usually
cuda:0 while a layer's tensors live on cuda:3: the launch then reads another GPU's addresses (illegal memory access or
wrong results). Every launcher therefore launches under ``launch_device(tensor)``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

__all__ = ["launch_device"]


def launch_device(tensor: torch.Tensor):
    """Context manager to launch a Triton kernel on ``tensor``'s device.

    Args:
        tensor: any tensor the kernel reads or writes (all of a launch's tensors are on one device).

    Returns:
        ``torch.cuda.device(tensor.device)`` for a CUDA tensor (makes its device current, restores the previous one
        on exit); ``contextlib.nullcontext()`` for any other device (CPU tensors under ``TRITON_INTERPRET=1``).
    """
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return nullcontext()

"""What ``grpo_mem.verify`` must leave as it found it (gradients, modes, RNG states, forwards, autocast, dtypes), and
its clock and memory readings."""

from __future__ import annotations

import contextlib
import random
import sys
import warnings

import torch

from ..model import fallback
from ..model.distributed import unwrap_causal_lm
from ..model.forward import installed, restore


@contextlib.contextmanager
def preserved(model):
    params = list(model.parameters())
    grads = [p.grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    rng = (random.getstate(), torch.random.get_rng_state())
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    causal_lm = unwrap_causal_lm(model)
    had_forward = "forward" in causal_lm.__dict__
    previous_forward = causal_lm.__dict__.get("forward")
    had_grpo_mem = installed(causal_lm)
    attn_impl = causal_lm.config._attn_implementation
    for p in params:
        p.grad = None
    try:
        with warnings.catch_warnings(), fallback.restoring_warnings():
            warnings.filterwarnings("ignore", message="grpo_mem: falling back")
            yield
    finally:
        for p in params:
            p.grad = None
        for p, g in zip(params, grads):
            p.grad = g
        for m, training in modes:
            m.training = training
        random.setstate(rng[0])
        torch.random.set_rng_state(rng[1])
        if np_state is not None:
            numpy.random.set_state(np_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if not had_grpo_mem:
            restore(causal_lm)
        elif causal_lm.config._attn_implementation != attn_impl:
            restore(causal_lm, forward=False)
        if had_forward:
            causal_lm.forward = previous_forward
        else:
            causal_lm.__dict__.pop("forward", None)


@contextlib.contextmanager
def cast_model(model, trainer, dtype: torch.dtype):
    """The model in ``dtype`` (fp32 or fp64; floating parameters and buffers cast in place and back: exact from
    bf16/fp16 to fp32 and from fp32 to fp64) and no autocast, neither the caller's nor the trainer's
    ``accelerator.autocast()``."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    dtypes = [t.dtype for t in tensors]
    device_type = tensors[0].device.type if tensors else "cpu"
    for t in tensors:
        t.data = t.data.to(dtype)
    try:
        with no_autocast(trainer, device_type):
            yield
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)


@contextlib.contextmanager
def no_autocast(trainer, device_type: str):
    """No autocast inside, neither the caller's nor the trainer's ``accelerator.autocast()``."""
    accelerator = getattr(trainer, "accelerator", None)
    had = accelerator is not None and "autocast" in accelerator.__dict__
    previous = accelerator.__dict__.get("autocast") if accelerator is not None else None
    if accelerator is not None:
        accelerator.autocast = lambda *a, **k: torch.autocast(device_type, enabled=False)
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        if accelerator is not None:
            if had:
                accelerator.autocast = previous
            else:
                del accelerator.autocast


class PeakMemory:
    """Peak memory of the block above its start: on CUDA ``torch.cuda.max_memory_allocated`` (its peak statistic is
    reset at entry, as ``reset_peak_memory_stats`` does), elsewhere the process's peak RSS
    (``grpo_mem.bench.measure.PeakRSS``). ``peak_mb`` (MB = 1e6 bytes) and ``kind`` after the block."""

    def __init__(self, device: torch.device):
        self.device, self.peak_mb, self.kind = device, 0.0, ""

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from ..bench.measure import PeakRSS

            self.rss = PeakRSS().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = (torch.cuda.max_memory_allocated(self.device) - self.base) / 1e6
            self.kind = "CUDA allocated"
        else:
            self.rss.__exit__(*exc)
            self.peak_mb, self.kind = self.rss.peak_above_base / 1e6, "RSS"
        return False


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""The recurrent layers of a backbone whose states grpo_mem hands from a prompt to its continuations.

Imported by ``support`` only for a config whose ``layer_types`` name such layers: Gated DeltaNet layers and short
convolutions (``linear_attention``), Mamba-1 mixers (``mamba_state``), Mamba-2 mixers (``mamba2_state``). This module
knows torch only.
"""

from __future__ import annotations

import torch

from .linear_attention import linear_layers
from .mamba_state import mamba_layers, relayed_layer

__all__ = ["handed_layers", "relayed_layer"]


def handed_layers(base: torch.nn.Module) -> tuple[list[torch.nn.Module], str | None]:
    """(the Gated DeltaNet, short-convolution, Mamba-1 and Mamba-2 layers of ``base`` whose states grpo_mem hands on:
    ``linear_attention.linear_layers``, ``mamba_state.mamba_layers``, ``mamba2_state.ssd_layers``; why a Mamba-2
    mixer's states cannot be handed on, or None). ``mamba2_state`` is imported only when ``base`` has state-space
    modules (an integer ``ssm_state_size``)."""
    layers = linear_layers(base) + mamba_layers(base)
    if not any(isinstance(getattr(m, "ssm_state_size", None), int) for m in base.modules()):
        return layers, None
    from .mamba2_state import ssd_cause, ssd_layers

    return layers + ssd_layers(base), ssd_cause(base)

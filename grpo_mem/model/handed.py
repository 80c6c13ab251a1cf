"""The recurrent layers of a backbone whose states grpo_mem hands from a prompt to its continuations.

Imported by ``support`` only for a config whose ``layer_types`` name such layers. Every candidate (a module with an
integer ``layer_idx`` and ``conv_kernel_size`` whose forward takes a cache: ``linear_attention.is_candidate``) is
sorted by its interface and admitted by its behaviour: Mamba-2 mixers (the integer attributes of
``mamba2_state.is_ssd_mixer``) by ``mamba2_state``, other state-space mixers (an integer ``ssm_state_size``) by
``mamba_state`` (Mamba-1), every other by ``linear_attention`` (Gated DeltaNet, Kimi Delta Attention, short
convolutions). This module knows torch only.
"""

from __future__ import annotations

import torch

from .linear_attention import hand_off_cause, is_candidate
from .mamba_state import mixer_cause, relayed_layer

__all__ = ["handed_layers", "relayed_layer"]


def _cause(module: torch.nn.Module, width: int | None) -> str | None:
    """Why the candidate ``module``'s states are not handed on, or None (by the module that serves its kind)."""
    if not isinstance(getattr(module, "ssm_state_size", None), int):
        return hand_off_cause(module, width)
    from .mamba2_state import _mixer_cause, is_ssd_mixer

    return _mixer_cause(module) if is_ssd_mixer(module) else mixer_cause(module)


def handed_layers(base: torch.nn.Module, width: int | None = None) -> tuple[list[torch.nn.Module], str | None]:
    """(the recurrent layers of ``base`` whose states grpo_mem hands on: Gated DeltaNet and Kimi Delta Attention
    layers, short convolutions, Mamba-1 and Mamba-2 mixers; why the first other candidate's states cannot be, or
    None). ``width``: the backbone's hidden size, the input width of a layer without an integer ``hidden_size``.
    ``mamba2_state`` is imported only when ``base`` has state-space modules (an integer ``ssm_state_size``)."""
    layers, causes = [], []
    for module in base.modules():
        if not is_candidate(module):
            continue
        cause = _cause(module, width)
        if cause is None:
            layers.append(module)
        else:
            causes.append(cause)
    return layers, (causes[0] if causes else None)

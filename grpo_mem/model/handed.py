"""The recurrent layers of a backbone whose states grpo_mem hands from a prompt to its continuations.

Imported by ``support`` only for a config whose ``layer_types`` name such layers. Every candidate (a module with an
integer ``layer_idx`` and ``conv_kernel_size`` whose forward takes a cache: ``linear_attention.is_candidate``) is
sorted by its interface to the first kind of ``mechanisms.RECURRENT`` that claims it and admitted by that kind's
judgement of its behaviour: Mamba-2 mixers (the integer attributes of ``mamba2_state.is_ssd_mixer``) by
``mamba2_state``, other state-space mixers (an integer ``ssm_state_size``) by ``mamba_state`` (Mamba-1), every other
by ``linear_attention`` (Gated DeltaNet, Kimi Delta Attention, short convolutions). This module knows torch only.
"""

from __future__ import annotations

import torch

from .linear_attention import is_candidate
from .mamba_state import relayed_layer
from . import mechanisms

__all__ = ["handed_layers", "relayed_layer"]


def _cause(module: torch.nn.Module, width: int | None) -> str | None:
    """Why the candidate ``module``'s states are not handed on, or None: the answer of the first kind of
    ``mechanisms.RECURRENT`` that claims it (every candidate is claimed: the last kind takes the rest)."""
    kind = next(k for k in mechanisms.RECURRENT if k.claims(module))
    return kind.state_cause(module, width)


def handed_layers(base: torch.nn.Module, width: int | None = None) -> tuple[list[torch.nn.Module], str | None]:
    """(the recurrent layers of ``base`` whose states grpo_mem hands on: Gated DeltaNet and Kimi Delta Attention
    layers, short convolutions, Mamba-1 and Mamba-2 mixers; why the first other candidate's states cannot be, or why
    none can where several candidates share a layer index, or None). ``width``: the backbone's hidden size, the input width of a layer without an integer ``hidden_size``.
    ``mamba2_state`` is imported only when ``base`` has state-space modules (an integer ``ssm_state_size``)."""
    layers, causes = [], []
    candidates = [m for m in base.modules() if is_candidate(m)]
    shared = _shared_index_cause(candidates)
    if shared is not None:
        return [], shared
    for module in candidates:
        cause = _cause(module, width)
        if cause is None:
            layers.append(module)
        else:
            causes.append(cause)
    return layers, (causes[0] if causes else None)


def _shared_index_cause(candidates: list[torch.nn.Module]) -> str | None:
    """Why the candidates cannot be handed on when several of them share a layer index (Inkling's four short
    convolutions per layer, told apart by ``state_idx``), or None: grpo_mem keeps one module's states per layer
    index."""
    seen: dict[int, list[torch.nn.Module]] = {}
    for module in candidates:
        seen.setdefault(module.layer_idx, []).append(module)
    for index, modules in seen.items():
        if len(modules) > 1:
            kinds = sorted({type(m).__name__ for m in modules})
            return (
                f"{len(modules)} recurrent modules of layer {index} ({', '.join(kinds)}) keep states of their own "
                "under one layer index; grpo_mem hands on one module's states per layer"
            )
    return None

"""What the prompt-once path serves beyond causal attention over text: one table row per mechanism.

A mechanism is something a model or a call brings that the passes must carry or the admission must judge: a sliding
window, attention-logit soft-capping and attention sinks (keywords each attention module hands the attention interface
and the hook applies), recurrent state handed from a prompt to its continuations, image inputs, the MoE router loss,
the sequence-sharded layout of sequence parallelism, and dropout. ``TABLE`` holds one :class:`Mechanism` per
mechanism, declaring a cheap presence test, its admission answer, its sequence-parallel answer, its pass extension or
layout and the attention-context fields it adds. The admission rule (``support.unsupported_cause`` and the attention
keywords each module must hand on), the cause chain (``causes.model_cause``, ``causes.sp_cause``), the pass
extensions of a micro-batch (``forward.pass_extensions``) and the hook (``attention_hook.layer_features``) iterate it,
so a new mechanism is one module and one row.

``RECURRENT`` lists the kinds of recurrent layer whose states are handed on (Mamba-2 mixers, Mamba-1 mixers, then
Gated DeltaNet and Kimi Delta Attention layers and short convolutions), one :class:`Recurrent` row per module, each
module offering ``claims(module)``, ``state_cause(module, width)`` and ``install(causal_lm)``: a new recurrent layer
is one file and one row. ``handed.handed_layers`` sorts each candidate to the first kind that claims it;
``forward.pass_extensions`` installs every kind.

A row names its functions as ``"module:attribute"`` of ``grpo_mem.model``, imported on first use (as
``ops._backends.lazy`` names the Triton launchers), so a text model imports no mechanism's module; a row may also
give a function itself (``resolve``). The consumers read ``TABLE`` and ``RECURRENT`` from this module at each use,
the hook's keywords once at import. This module knows torch only.
"""

from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "CALL",
    "Call",
    "Mechanism",
    "RECURRENT",
    "Recurrent",
    "TABLE",
    "context_fields",
    "has_recurrent",
    "keywords",
    "resolve",
]


def resolve(target: str | Callable) -> Callable:
    """The function ``target`` names (``"module:attribute"`` of ``grpo_mem.model``), its module imported now; a
    callable ``target`` is itself (a row may give its function directly).

    Raises:
        ValueError: ``target`` is neither callable nor ``"module:attribute"``.
    """
    if callable(target):
        return target
    module, sep, name = str(target).partition(":")
    if not sep or not module or not name:
        raise ValueError(f"a mechanism's function is named 'module:attribute', got {target!r}")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


@dataclass(frozen=True)
class Call:
    """What a micro-batch's call brings beside the model: ``router`` (TRL's ``compute_aux_loss``: the MoE router loss
    is part of the loss), ``images`` (its bound image inputs, a ``vision_passes.VisionPasses``, or None) and ``sp``
    (its ``sequence_parallel.SequenceParallel`` group, or None)."""

    router: bool = False
    images: object = None
    sp: object = None


CALL = Call()  # a call bringing nothing beside the model (admission of the model alone)


@dataclass(frozen=True)
class Mechanism:
    """One mechanism the prompt-once path serves.

    Attributes:
        name: what it is, in the field's words.
        present: ``(causal_lm, call) -> bool``, whether the model (the unwrapped causal LM) or the ``Call`` brings it;
            cheap: config fields, module attributes, the call's inputs.
        cause: ``"module:attribute"`` of ``(causal_lm) -> str | None``, why the path cannot serve it in this model's
            current state (its admission answer where present), or None when what ``present`` finds is served.
        sequence_parallel: the key of ``sequence_parallel.SP_CAUSES`` naming why a sequence-sharded micro-batch
            cannot carry it, or None where the sequence-sharded layout serves it.
        extension: ``"module:attribute"`` of ``(causal_lm, call) -> extension.PassExtension`` adding it to the
            passes (a layout: ``window.OneRank``'s replacement), or None where the passes need nothing of it.
        context: the fields of the attention contexts (``attention_hook.CompletionContext``, ``PromptCapture``) it
            fills, from its extension's ``context`` or its layout.
        keyword: the attention-interface keyword each attention module that ``asks`` for it must hand on, which the
            hook applies (``attention_hook.layer_features``), or None.
        asks: ``(text_config, attention_module) -> bool`` for a keyword mechanism: whether this module must hand it.
        feature: the ``multi_region_attention`` keyword the hook passes the keyword's value as.
        convert: the type the hook converts the keyword's value to (None: passed as handed, e.g. a tensor).
        layout: ``"module:attribute"`` of ``(call, touch_unread) -> layout`` running the micro-batch's passes in
            place of ``window.OneRank(touch_unread)`` (``touch_unread``: FSDP shards the model), or None.
    """

    name: str
    present: Callable[[torch.nn.Module, Call], bool]
    cause: str | None = None
    sequence_parallel: str | None = None
    extension: str | None = None
    context: tuple[str, ...] = ()
    keyword: str | None = None
    asks: Callable | None = None
    feature: str | None = None
    convert: type | None = None
    layout: str | None = None


@dataclass(frozen=True)
class Recurrent:
    """One kind of recurrent layer whose states grpo_mem hands from a prompt to its continuations, served by the
    module ``module`` of ``grpo_mem.model``: its ``claims(module) -> bool`` (the kind's interface: integer attributes,
    a forward taking a cache), ``state_cause(module, width) -> str | None`` (why a claimed layer's states cannot be
    handed on exactly, judged by behaviour on its meta twin: ``recurrent_probe``) and ``install(causal_lm) -> int``
    (wrap the kind's layers so a pass's context runs them; idempotent). ``hint``: a test on a candidate layer that
    needs no import of ``module`` (False: the module cannot claim it)."""

    name: str
    module: str
    hint: Callable[[torch.nn.Module], bool]

    def claims(self, layer: torch.nn.Module) -> bool:
        return self.hint(layer) and resolve(f"{self.module}:claims")(layer)

    def state_cause(self, layer: torch.nn.Module, width: int | None) -> str | None:
        return resolve(f"{self.module}:state_cause")(layer, width)

    def install(self, causal_lm: torch.nn.Module) -> int:
        return resolve(f"{self.module}:install")(causal_lm)


def _state_space(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "ssm_state_size", None), int)


RECURRENT: tuple[Recurrent, ...] = (
    Recurrent("Mamba-2 (SSD) mixers", "mamba2_state", _state_space),
    Recurrent("Mamba-1 mixers", "mamba_state", _state_space),
    Recurrent("Gated DeltaNet and Kimi Delta Attention layers, short convolutions", "linear_attention", lambda m: True),
)
"""The recurrent kinds, in the order a candidate layer is offered to them (the first that claims it serves it)."""


def _text_config(causal_lm):
    return causal_lm.config.get_text_config()


def _windowed(config, module=None) -> bool:
    """Whether ``config`` asks for sliding-window attention (per-layer ``layer_types`` or a global window)."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _softcapped(config, module=None) -> bool:
    return getattr(config, "attn_logit_softcapping", None) is not None


def _sinks(config, module) -> bool:
    """Whether ``module`` (an attention module, or the whole model) has learned sink logits (a parameter named
    ``*sinks``: gpt-oss)."""
    return any(name.endswith("sinks") for name, _ in module.named_parameters())


_RECURRENT_PRESENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ``has_recurrent``'s answer


def has_recurrent(causal_lm: torch.nn.Module, call: Call = CALL) -> bool:
    """Whether ``causal_lm`` has recurrent-state layers: modules with an integer ``layer_idx`` and an integer
    ``conv_kernel_size``, as transformers' Gated DeltaNet layers, short convolutions and Mamba mixers have (whether
    grpo_mem can hand their states on is each ``RECURRENT`` kind's ``state_cause``). Decided once per model; its
    passes then carry the ``linear_attention.LinearState`` extension."""
    known = _RECURRENT_PRESENT.get(causal_lm)
    if known is None:
        known = _RECURRENT_PRESENT[causal_lm] = any(
            isinstance(getattr(m, "layer_idx", None), int) and isinstance(getattr(m, "conv_kernel_size", None), int)
            for m in causal_lm.modules()
        )
    return known


TABLE: tuple[Mechanism, ...] = (
    Mechanism(
        "a sliding window",
        lambda lm, call: _windowed(_text_config(lm)),
        keyword="sliding_window",
        asks=_windowed,
        feature="sliding_window",
        convert=int,
    ),
    Mechanism(
        "attention logit softcapping",
        lambda lm, call: _softcapped(_text_config(lm)),
        keyword="softcap",
        asks=_softcapped,
        feature="softcap",
        convert=float,
    ),
    Mechanism(
        "attention sinks",
        lambda lm, call: _sinks(None, lm),
        keyword="s_aux",
        asks=_sinks,
        feature="sinks",
    ),
    Mechanism(
        "dropout",
        lambda lm, call: lm.training,
        cause="support:dropout_cause",
    ),
    Mechanism(
        "image inputs",
        lambda lm, call: call.images is not None,
        sequence_parallel="images",
        extension="vision_passes:extension",
    ),
    Mechanism(
        "recurrent state",
        has_recurrent,
        sequence_parallel="linear",
        extension="linear_attention:extension",
        context=("linear",),
    ),
    Mechanism(
        "the MoE router loss",
        lambda lm, call: call.router,
        cause="router:router_loss_cause",
        sequence_parallel="router",
        extension="router:extension",
    ),
    Mechanism(
        "the sequence-sharded layout",
        lambda lm, call: call.sp is not None,
        context=("shards",),
        layout="sequence_parallel:layout",
    ),
)
"""Every mechanism, in the order the cause chain asks them and the passes carry their extensions."""


def keywords() -> tuple[Mechanism, ...]:
    """The rows of ``TABLE`` that the attention modules hand the attention interface as a keyword."""
    return tuple(m for m in TABLE if m.keyword is not None)


def context_fields() -> dict[str, str]:
    """Attention-context field -> the name of the one mechanism that fills it."""
    return {field: m.name for m in TABLE for field in m.context}

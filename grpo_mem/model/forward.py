"""The model-forward plumbing of grpo_mem: the options of one scoring call and the ``Decision`` it is decided into
(``SharingSession.decide``), input checks, a model's fallback cause kept until its state changes, and the pass-through
forward through which every grpo_mem computation runs inside one call of the (possibly wrapped) model.

Running inside the model's forward matters: DDP, DeepSpeed and FSDP hooks of a wrapping module fire once per call, as
they do for stock TRL, and accelerate's mixed-precision autocast applies. The computation itself (a ``Window``'s
micro-batch, or the full-sequence fallback) travels as a string token naming it in a registry of this module, since
FSDP2's root pre-forward hook rebuilds containers it finds in kwargs. This module knows transformers, not TRL.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import itertools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers.modeling_outputs import ModelOutput

from . import attention_hook as attn_hook
from . import mechanisms
from .distributed import clear_zero3_grads_before_first_backward, fsdp_wrapped
from .window import OneRank

if TYPE_CHECKING:
    from .sequence_parallel import SequenceParallel
    from .vision_passes import VisionPasses
    from .window import Window


@dataclass(frozen=True)
class ScoreOptions:
    """Non-tensor options of one scoring call (``shared_prompt_logprobs``' arguments)."""

    logits_to_keep: int
    temperature: float = 1.0
    compute_entropy: bool = False
    cast_lm_head_to_fp32: bool = False
    compute_aux_loss: bool = False


class Kind(enum.Enum):
    """What a decision does with its micro-batch.

    - ``SHARED``: the prompt-once path, in the window's sharing mode.
    - ``UNSHARED``: the caller's stock path, because the micro-batch shares nothing (no repeated prompt, no prompt pass
      read by another micro-batch): the window passes over it and goes on sharing.
    - ``FALLBACK``: the stock path, because the prompt-once path cannot serve the micro-batch exactly (the cause says
      why): the window stops sharing there.
    """

    SHARED = "shared"
    UNSHARED = "unshared"
    FALLBACK = "fallback"


@dataclass(frozen=True)
class Decision:
    """How one micro-batch is scored, decided once by ``SharingSession.decide`` and run once by ``run`` (or
    ``run_hidden``); the session, not the decision, records what was run.

    Attributes:
        kind: ``Kind.SHARED``, ``UNSHARED`` or ``FALLBACK``.
        cause: why the micro-batch takes the stock path (``kind`` not ``SHARED``), else None.
        micro_batch: the micro-batch's index in the session's window, or None when it is scored on its own.
        backbone_tokens: tokens the chosen path runs through the backbone (padded widths counted).
        stock_tokens: tokens stock TRL runs through the backbone for it, B x (P + C).
        mode: the window's sharing mode, ``"tree"`` or ``"group"``.

    What the run takes (not compared, not shown): ``window`` (the ``Window`` that runs it), ``model`` (as given to
    ``decide``) and its unwrapped ``causal_lm``, ``input_ids``/``attention_mask`` (B, P + C), ``options``, ``lockstep``
    (ranks make the same module calls), ``images`` (the bound image inputs, or None), ``autocast`` (a context factory
    entered around the prompt-once path's model call, or None), ``sp`` (the group the micro-batch is split over, or
    None) and ``scored`` (the flat indices of the scored completion positions on the inputs' device, from the
    decision's one read of the masks: ``head.completion_head``'s).
    """

    kind: Kind
    cause: str | None
    micro_batch: int | None
    backbone_tokens: int
    stock_tokens: int
    mode: str
    window: Window = field(repr=False, compare=False)
    model: torch.nn.Module = field(repr=False, compare=False)
    causal_lm: torch.nn.Module = field(repr=False, compare=False)
    input_ids: torch.Tensor = field(repr=False, compare=False)
    attention_mask: torch.Tensor = field(repr=False, compare=False)
    options: ScoreOptions = field(repr=False, compare=False)
    lockstep: bool = field(repr=False, compare=False)
    images: VisionPasses | None = field(repr=False, compare=False)
    autocast: Callable | None = field(repr=False, compare=False)
    sp: SequenceParallel | None = field(repr=False, compare=False)
    scored: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def path(self) -> str:
        """``"tree"`` or ``"group"`` (the prompt-once path in that sharing mode), or ``"stock"``."""
        return self.mode if self.kind is Kind.SHARED else "stock"


@dataclass
class LogprobsOutput(ModelOutput):
    """log_probs, entropy: (B, C) fp32, zero where the completion mask is 0 (entropy None unless asked); aux_loss:
    0-d fp32 MoE router load-balancing loss (None unless asked)."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def validate_inputs(input_ids, attention_mask, logits_to_keep, temperature) -> None:
    """Raise ``ValueError``/``TypeError`` for inputs stock TRL would score wrongly or not at all, from their shapes
    and types (reads nothing back; the prompts' left padding is checked on the host copy the plan reads:
    ``plan.check_left_padded``)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D (B, P+C) tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(getattr(attention_mask, 'shape', ()))} does not match input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(f"logits_to_keep must be an int, got {logits_to_keep!r}")
    if not 0 < logits_to_keep < input_ids.shape[1]:
        raise ValueError(
            f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}] (sequence length {input_ids.shape[1]}), "
            f"got {logits_to_keep}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


# ----------------------------------------------------------------------------------------------------------------------
# a model's fallback cause, kept per model until what it depends on changes

_IMPLEMENTATION_FIELD = "_attn_implementation_internal"  # the hook's take-over renames it (``model_state`` reads past)


def config_state(config) -> str:
    """A transformers config's fields (nested configs' too, the attention implementation field left out) as one
    string: equal while the config is unchanged."""
    items = (
        (k, config_state(v) if hasattr(v, "get_text_config") else v)
        for k, v in vars(config).items()
        if k != _IMPLEMENTATION_FIELD
    )
    return repr((type(config).__module__, type(config).__qualname__, tuple(items)))


def model_state(causal_lm) -> tuple:
    """What a model's fallback cause (``SharingSession``, ``support.unsupported_cause``) depends on that can change
    between calls on the same model object, as a hashable value: each module's class, parameter names, training mode,
    dropout probability (``p``) and gradient-checkpointing setting; the config's fields (``config_state``); the
    attention implementation the model runs without grpo_mem's hook; whether gradients are on. Not in it: attributes
    a module's forward reads as a dropout probability (``self.attention_dropout``, set from the config when built)."""
    modules = tuple(
        (
            type(m),
            tuple(m._parameters),
            m.training,
            p if isinstance(p := m.__dict__.get("p"), (int, float)) else None,  # a dropout probability
            getattr(m, "gradient_checkpointing", None),
            m.__dict__.get("_gradient_checkpointing_func"),
        )
        for m in causal_lm.modules()
    )
    implementation = attn_hook.inner_implementation(causal_lm)
    return modules, config_state(causal_lm.config), implementation, torch.is_grad_enabled()


_CAUSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # causal LM -> {key: its cause (str | None)}
_MAX_KEYS = 8  # per model (training and no-grad scoring alternate: two keys in a run)


def model_cause(causal_lm, setting: tuple, compute: Callable[[], str | None]) -> str | None:
    """``causal_lm``'s fallback cause under ``setting`` (what else the cause depends on: the call's options, the
    confirmation's setting) and its current ``model_state``: ``compute()`` the first time, then the kept value, until
    ``forget_causes``."""
    key = (model_state(causal_lm), setting)
    kept = _CAUSES.get(causal_lm)
    if kept is None:
        kept = _CAUSES[causal_lm] = {}
    if key in kept:
        return kept[key]
    if len(kept) >= _MAX_KEYS:
        kept.clear()
    cause = kept[key] = compute()
    return cause


def forget_causes() -> None:
    """Drop every kept model cause (the next call of each model decides again)."""
    _CAUSES.clear()


_FORWARD_MARK = "_grpo_mem_previous_forward"


def _autocasts_of(fn, depth: int = 0) -> list:
    """The ``torch.autocast`` contexts that wrappers of ``fn`` enter around the model's own forward, outermost first.

    accelerate's ``prepare`` (mixed precision) replaces an instance's forward by ``convert_outputs_to_fp32(
    torch.autocast(...)(forward))``: the autocast instance sits in the decorator's closure, the inner forward behind
    ``__wrapped__`` / ``model_forward``. Other wrappers are walked the same way; nothing is called.
    """
    if fn is None or depth > 16:
        return []
    if isinstance(fn, torch.autocast):
        return [fn]
    found = []
    inner = [getattr(fn, "__func__", None), getattr(fn, "__wrapped__", None), getattr(fn, "model_forward", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # empty cell
            continue
    for obj in inner:
        if obj is not None and (callable(obj) or isinstance(obj, torch.autocast)):
            found += _autocasts_of(obj, depth + 1)
    return found


def install_forward(causal_lm) -> None:
    """Give ``causal_lm`` a forward that also accepts ``grpo_mem=token`` (a token from ``run_in_forward``);
    idempotent.

    Without that kwarg the model's previous forward (TRL's fused head, if installed) runs unchanged. With it, the named
    computation runs inside the forward call, under the autocast the previous forward was wrapped in (accelerate's
    mixed precision), so grpo_mem and the stock path compute in the same precision.

    The forward is a ``_Forward`` bound to ``causal_lm`` that closes over nothing else: the previous forward stays in
    the instance's ``__dict__`` and is read at each call, so ``copy.deepcopy``, ``pickle`` and ``torch.save`` give a
    copy whose forward is bound to the copy and runs the copy's own previous forward (its own weights).
    """
    if _FORWARD_MARK in causal_lm.__dict__:
        return
    previous = causal_lm.__dict__.get("forward")
    causal_lm.forward = _Forward(causal_lm)
    causal_lm.__dict__[_FORWARD_MARK] = previous


class _Forward:
    """grpo_mem's pass-through forward of one causal LM (``install_forward``): ``__call__(*args, grpo_mem=None,
    **kwargs)``.

    Everything it uses is looked up on ``module`` at call time (the previous instance forward under ``_FORWARD_MARK``,
    else the class's forward), and a copy of it (``copy.deepcopy``, ``pickle``: ``__reduce__``) is bound to the copy
    of ``module`` made in the same operation. A bound method of a closure, as before, kept calling the original.
    ``inspect.signature`` reports the class forward's signature, as ``functools.wraps`` did: ``generate`` and TRL
    validate model kwargs against it."""

    __slots__ = ("module",)

    def __init__(self, module):
        self.module = module

    def __reduce__(self):
        return _Forward, (self.module,)

    @property
    def __signature__(self):
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __call__(self, *args, grpo_mem: str | None = None, **kwargs):
        causal_lm = self.module
        previous = causal_lm.__dict__.get(_FORWARD_MARK)
        if grpo_mem is None:
            if previous is not None:
                return previous(*args, **kwargs)
            return type(causal_lm).forward(causal_lm, *args, **kwargs)
        compute = _CALLS.get(grpo_mem)
        if compute is None:
            raise RuntimeError(f"grpo_mem: unknown or finished computation {grpo_mem!r}")
        with contextlib.ExitStack() as stack:
            for a in _autocasts_of(previous):
                stack.enter_context(
                    torch.autocast(a.device, dtype=a.fast_dtype, enabled=a._enabled, cache_enabled=a._cache_enabled)
                )
            logps, entropy, aux_loss = compute(causal_lm, kwargs["input_ids"], kwargs["attention_mask"])
        return LogprobsOutput(log_probs=logps, entropy=entropy, aux_loss=aux_loss)


class _Call:
    """A computation run inside the model's forward: ``fn(causal_lm, input_ids, attention_mask)`` -> (log-probs,
    entropies | None, aux loss | None), with the inputs as the model's wrappers handed them on."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, causal_lm, input_ids, attention_mask):
        return self.fn(causal_lm, input_ids, attention_mask)


_CALLS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_CALL_IDS = itertools.count()


def run_in_forward(model, causal_lm, fn, input_ids, attention_mask, *, autocast=None):
    """Run ``fn(causal_lm, input_ids, attention_mask)`` inside one call of ``model`` (the wrapper around
    ``causal_lm``, or ``causal_lm`` itself); returns its (log-probs, entropies | None, aux loss | None).

    Autocast is entered here only: ``autocast()`` (a context factory, e.g. accelerate's ``Accelerator.autocast``; None:
    none) around the call of ``model``, and inside it the autocast contexts ``causal_lm``'s own forward was wrapped in
    (``install_forward``)."""
    install_forward(causal_lm)
    call = _Call(fn)
    token = f"grpo_mem:call:{next(_CALL_IDS)}"
    _CALLS[token] = call
    with autocast() if autocast is not None else contextlib.nullcontext():
        out = model(input_ids=input_ids, attention_mask=attention_mask, grpo_mem=token)
    if "deepspeed" in sys.modules:  # a window's later backward may reach parameters this one does not
        clear_zero3_grads_before_first_backward(model)
    return out.log_probs, out.entropy, out.aux_loss


def installed(causal_lm) -> bool:
    """Whether ``install_forward`` gave ``causal_lm`` grpo_mem's forward."""
    return _FORWARD_MARK in causal_lm.__dict__


def own_forward(causal_lm):
    """The instance forward ``causal_lm`` has of its own (e.g. TRL's fused head), past grpo_mem's; None if none."""
    if installed(causal_lm):
        return causal_lm.__dict__[_FORWARD_MARK]
    return causal_lm.__dict__.get("forward")


def restore(causal_lm, *, forward: bool = True) -> None:
    """Undo ``install_forward`` (unless ``forward=False``) and the attention take-over on ``causal_lm``; no-op on an
    untouched model. On a copy of a scored model (``copy.deepcopy``, ``pickle``) it removes the pass-through forwards
    the copy carries (bound to the copy), leaving no grpo_mem state on it."""
    if forward and _FORWARD_MARK in causal_lm.__dict__:
        previous = causal_lm.__dict__.pop(_FORWARD_MARK)
        if previous is None:
            causal_lm.__dict__.pop("forward", None)
        else:
            causal_lm.forward = previous
    impl = causal_lm.config._attn_implementation or ""
    if impl.startswith(attn_hook.PREFIX):
        attn_hook.hand_back(causal_lm, attn_hook.inner_implementation(causal_lm))
    else:  # a copy of a taken-over model: its linear-attention layers' pass-through forwards (bound to the copy)
        attn_hook.restore_forwards(causal_lm)
    causal_lm.__dict__.pop(attn_hook.TAKEN, None)  # a copy's marker (None)


# model -> (its class, whether FSDP shards it or a module of it), decided once per model object and class
_FSDP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pass_extensions(model, causal_lm, *, router: bool = False, images=None, sp=None) -> tuple[tuple, OneRank]:
    """The pass extensions and layout of a micro-batch the window runs on ``causal_lm`` (inside ``model``, possibly
    wrapped), chosen from the model's capabilities and the call (``window.Window.run``'s ``extensions``, ``layout``).

    Extensions: those of the mechanisms of ``mechanisms.TABLE`` that the model or the call brings, in the table's
    order (image inputs ``images``, a ``vision_passes.VisionPasses``; the recurrent state, when
    ``mechanisms.has_recurrent``; the MoE router loss when ``router``). Layout: the first present mechanism's
    (``sequence_parallel.SequenceSharded`` over ``sp``, a ``SequenceParallel``, when given), else ``window.OneRank``;
    either with ``touch_unread`` when FSDP shards the model (``distributed.fsdp_wrapped`` of ``causal_lm``, decided
    once per ``model`` object and class: ``fully_shard`` swaps the class of what it shards, FSDP1 wraps it in a new
    object). Each mechanism's module is imported only when the micro-batch takes it.
    """
    call = mechanisms.Call(router=router, images=images, sp=sp)
    present = [m for m in mechanisms.TABLE if (m.extension or m.layout) and m.present(causal_lm, call)]
    extensions = tuple(mechanisms.resolve(m.extension)(causal_lm, call) for m in present if m.extension)
    known = _FSDP.get(model)
    if known is None or known[0] is not type(model):
        known = _FSDP[model] = (type(model), fsdp_wrapped(causal_lm))
    layouts = [m.layout for m in present if m.layout]
    return extensions, (mechanisms.resolve(layouts[0])(call, known[1]) if layouts else OneRank(touch_unread=known[1]))

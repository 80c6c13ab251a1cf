"""Mamba-1 mixers (``mamba``, ``falcon_mamba``, ``jamba``'s) on the prompt-once path: each node's convolution and SSM
state, handed on.

A Mamba-1 mixer (Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", arXiv 2312.00752)
projects each token to an input x and a gate z, runs a causal depthwise convolution of kernel K over x, then the
selective scan h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t x_t, y_t = (C_t · h_t + D x_t) silu(z_t). A row that continues a
prompt (a trie node below the root, or a completion) starts from what the prompt ended with: its last K − 1 convolution
inputs (rows, intermediate, K − 1) and its SSM state h (rows, intermediate, d_state). transformers' mixer reads both
from its cache, but its multi-token scan (``mamba_selective_scan``, 5.24 and 5.25 alike) always starts from a zero
state, so a continuation cannot run through the mixer's own forward: ``mixer_ref`` is that forward's torch path
(convolution over [previous inputs ++ segment], then the sequential scan from h0) written out op for op, run for
every mixer call that carries a grpo_mem context; a call without one runs the mixer unchanged. Which mixers: the
classes of ``_MIXERS`` (their math is ``mixer_ref``'s), admitted by behaviour (``mixer_cause``: on the mixer's meta
twin, its own forward keeps both states in its cache and ``mixer_ref`` keeps states of the same shapes and continues
from both), their numbers confirmed on a tiny copy (``confirm``).

The pass's ``linear_attention.LinearContext`` does the rest as for Gated DeltaNet: rows from a zero state (roots) run
left-aligned with their padding masked, as stock TRL's left padding (the mixer's ``apply_mask_to_padding_states``:
masked inputs leave a zero state zero and, without an ``in_proj`` bias, feed zeros to the convolution), rows from a
parent's state run per length unpadded, and each state's gradient reaches the parent's pass through a differentiable
gather. Mamba backbones pass their blocks no keyword arguments but the attention mask, so the context token travels in
its place (``_Relay``) from the backbone; Jamba's decoder layers get the backbone's keyword arguments but hand their
mixer only the mask, so there the relay starts at the layer. Whether a backbone, block or layer hands the relay on is
observed on its meta twin with its children standing in (``_hands_relay``, ``recurrent_probe.reaches``), not read
from its source. This module knows torch and transformers' Mamba modules.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from . import attention_hook as attn_hook
from .attention_hook import WRAPPED_FORWARD, own_class
from .linear_attention import LinearContext, _HandOff, _LayerForward, cache_parameter
from .recurrent_probe import continues_cause, observe, reaches

__all__ = ["backbone_cause", "install", "mamba_layers", "mixer_cause", "mixer_ref", "selective_scan_ref", "takes_state"]

# the Mamba-1 mixers compared against stock (tests/model/test_mamba_state.py), and whether each normalises Δ, B and C
_MIXERS = {
    ("transformers.models.mamba.modeling_mamba", "MambaMixer"): False,
    ("transformers.models.falcon_mamba.modeling_falcon_mamba", "FalconMambaMixer"): True,
    ("transformers.models.jamba.modeling_jamba", "JambaMambaMixer"): True,
}
# mixers whose decoder layer gets the backbone's keyword arguments (the context token) and hands its mixer only the
# attention mask: the relay starts at that layer (Jamba); the others' backbones pass no keyword arguments on (Mamba)
_LAYER_RELAY = frozenset({"JambaMambaMixer"})


def _own_bind(twin: torch.nn.Module, original):
    return _LayerForward(twin).bind(original, cache_parameter(own_class(twin)), {})


def _ref_bind(twin: torch.nn.Module, original):
    return _ref_call(twin)


def mixer_cause(module: torch.nn.Module) -> str | None:
    """Why ``module`` is no Mamba-1 mixer whose states grpo_mem hands on, or None.

    In: one of the classes of ``_MIXERS`` (module types: what ``mixer_ref`` computes is their math, confirmed on
    numbers by ``tests/model/test_mamba_state.py`` and at run time by ``confirm``), an integer ``layer_idx``, and by
    behaviour (``recurrent_probe.observe``, on the mixer's meta twin): its own forward keeps a convolution and an SSM
    state in its cache, and ``mixer_ref`` keeps states of the same shapes, continues from both and its output
    depends on both (``recurrent_probe.continues_cause``)."""
    cls = own_class(module)
    if (cls.__module__, cls.__name__) not in _MIXERS or not isinstance(getattr(module, "layer_idx", None), int):
        return f"{cls.__name__} is not one of the Mamba-1 mixers grpo_mem's reference scan computes"
    name = f"{cls.__name__} (layer {module.layer_idx})"
    own = observe(module, "mamba-own", _own_bind, _HandOff)
    if own.conv is None or own.recurrent is None:
        why = f": it {own.error}" if own.error else ""
        return f"{name} does not keep a convolution and an SSM state in its cache{why}"
    ref = observe(module, "mamba-ref", _ref_bind, _HandOff)
    cause = continues_cause(f"grpo_mem's reference scan of {name}", ref)
    if cause is None and (ref.conv, ref.recurrent) != (own.conv, own.recurrent):
        cause = (
            f"grpo_mem's reference scan of {name} keeps states of shapes {ref.conv} and {ref.recurrent}, its own "
            f"forward {own.conv} and {own.recurrent}"
        )
    return cause


def claims(module: torch.nn.Module) -> bool:
    """Whether this module serves the recurrent layer ``module`` (``mechanisms.RECURRENT``): a state-space module (an
    integer ``ssm_state_size``) that the Mamba-2 kind before it left; ``mixer_cause`` names one it cannot serve."""
    return isinstance(getattr(module, "ssm_state_size", None), int)


def state_cause(module: torch.nn.Module, width: int | None = None) -> str | None:
    """``mixer_cause`` (``mechanisms.Recurrent.state_cause``; a mixer's input width is its own)."""
    return mixer_cause(module)


def takes_state(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Mamba-1 mixer whose states grpo_mem hands on (``mixer_cause`` is None)."""
    cls = own_class(module)
    return (cls.__module__, cls.__name__) in _MIXERS and mixer_cause(module) is None


def mamba_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``takes_state`` recognises."""
    return [m for m in model.modules() if takes_state(m)]


def backbone_cause(base: torch.nn.Module, handed: list, otherwise: str) -> str | None:
    """Why ``base``, a backbone without attention modules whose recurrent layers ``handed`` grpo_mem hands on, cannot
    take the prompt-once path, or None. ``otherwise``: the cause when ``handed`` holds other than Mamba-1 mixers.

    In: every block of the backbone's layer list holds one Mamba-1 mixer (``takes_state``), no convolution outside
    them, the backbone hands the attention mask to each block and each block to its mixer (the context's relay), and
    no ``in_proj`` bias (stock's left padding would feed the bias to the convolution at pad positions, a number of
    pads a prompt pass does not reproduce).
    """
    if not handed or not all(takes_state(m) for m in handed):
        return otherwise
    mixers = {id(m) for m in handed}
    lists = [m for m in base.children() if isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1:
        return f"{type(base).__name__} has {len(lists)} layer lists, not one list of Mamba blocks"
    relayed = [block for block in lists[0] if relayed_layer(block)]
    plain = [block for block in lists[0] if not any(block is r for r in relayed)]
    checked: set[type] = set()
    for i, block in enumerate(lists[0]):
        if any(block is r for r in relayed):
            continue
        held = [m for m in block.modules() if id(m) in mixers]
        if len(held) != 1 or getattr(block, "mixer", None) is not held[0]:
            return f"layer {i} ({type(block).__name__}) is not one Mamba block around its mixer"
        if own_class(block) not in checked and not _hands_relay(block, held, held[0].hidden_size):
            return f"{type(block).__name__} does not hand its attention mask to its mixer"
        checked.add(own_class(block))
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Conv1d) and not any(module is getattr(m, "conv1d", None) for m in handed):
            return f"a convolution over the sequence ({name}) outside the Mamba mixers"
    width = handed[0].hidden_size
    if plain and not _hands_relay(base, plain, width, backbone=True):
        return f"{type(base).__name__} does not hand its attention mask to its blocks"
    if relayed and not _hands_relay(base, relayed, width, backbone=True, token=True):
        return f"{type(base).__name__} does not pass its keyword arguments on to its layers"
    if any(m.in_proj.bias is not None for m in handed):
        return "a Mamba in_proj bias (use_bias=True): stock feeds it to the convolution at left-padding positions"
    return None


# ----------------------------------------------------------------------------------------------------------------------
# the reference mixer


def selective_scan_ref(x, dt, A, B, C, D, z, delta_bias, h0=None):
    """The selective scan of a Mamba-1 mixer from the state ``h0``: transformers 5.24's ``mamba_selective_scan``
    (recurrent branch, ``delta_softplus=True``) op for op, with an initial state.

    Args:
        x: (b, I, L) the convolved inputs; dt: (b, I, L) Δ before its bias; A: (I, N) fp32; B, C: (b, L, N);
        D: (I,) fp32; z: (b, I, L) the gate; delta_bias: (I,) fp32; h0: (b, I, N) or None (zeros of ``x``'s dtype).

    Returns:
        y (b, I, L) fp32 (``x``'s dtype promoted with fp32), h (b, I, N) the state after the last token.
    """
    dt = F.softplus(dt + delta_bias.to(dt.dtype)[..., None])
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = dt[:, :, :, None] * B[:, None, :, :].float() * x[:, :, :, None].float()
    h = x.new_zeros(x.shape[0], x.shape[1], A.shape[-1]) if h0 is None else h0
    ys = []
    for t in range(x.shape[-1]):
        h = discrete_A[:, :, t] * h + deltaB_u[:, :, t]
        ys.append(torch.matmul(h.to(x.dtype), C[:, t, :].unsqueeze(-1))[:, :, 0])
    y = torch.stack(ys, dim=-1) + x * D[None, :, None]
    return y * F.silu(z), h


def mixer_ref(module, hidden, attention_mask=None, conv_state=None, ssm_state=None):
    """A Mamba-1 mixer's forward (``MambaMixer`` / ``FalconMambaMixer``, transformers 5.24, torch path) on ``hidden``
    continued from the states a previous segment ended with; with both states None it equals ``module(hidden,
    attention_mask=attention_mask)``.

    Args:
        module: the mixer (``takes_state``). hidden: (b, L, H) its input. attention_mask: (b, L) 1/True at real tokens,
            or None. conv_state: (b, I, K − 1) the last K − 1 convolution inputs before ``hidden`` (zeros before a
            sequence's start), or None. ssm_state: (b, I, N) the SSM state, or None (zeros).

    Returns:
        (output (b, L, H) in ``hidden``'s dtype, conv state (b, I, K − 1) and SSM state (b, I, N) after the last
        token).
    """
    dtype, L, keep = hidden.dtype, hidden.shape[1], module.conv_kernel_size - 1
    if attention_mask is not None:
        hidden = (hidden * attention_mask[:, :, None]).to(dtype)
    x, gate = module.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)
    A = -torch.exp(module.A_log.float())
    full = x if conv_state is None else torch.cat([conv_state.to(x.dtype), x], -1)
    padded = F.pad(full, (max(0, keep - full.shape[-1]), 0))
    conv_final = padded[..., padded.shape[-1] - keep :]
    weight = module.conv1d.weight
    x = F.conv1d(full.to(weight.dtype), weight, module.conv1d.bias, padding=keep, groups=weight.shape[0])
    x = module.act(x[:, :, : full.shape[-1]]).to(full.dtype)[:, :, -L:].transpose(1, 2)
    if attention_mask is not None:
        x = (x * attention_mask[:, :, None]).to(x.dtype)
    time_step, B, C = torch.split(
        module.x_proj(x), [module.time_step_rank, module.ssm_state_size, module.ssm_state_size], dim=-1
    )
    if _MIXERS[own_class(module).__module__, own_class(module).__name__]:
        time_step, B, C = module.dt_layernorm(time_step), module.b_layernorm(B), module.c_layernorm(C)
    if hasattr(module.config, "_is_quantized") and hasattr(module, "dt_layernorm"):
        time_step = (module.dt_proj(time_step) - module.dt_proj.bias).transpose(1, 2)
    else:
        time_step = module.dt_proj.weight @ time_step.transpose(1, 2)
    y, h = selective_scan_ref(
        x.transpose(1, 2), time_step, A, B, C, module.D.float(), gate, module.dt_proj.bias.float(), ssm_state
    )
    return module.out_proj(y.transpose(1, 2).to(dtype)), conv_final, h


# ----------------------------------------------------------------------------------------------------------------------
# the forward wrappers


class _Relay:
    """What a backbone's blocks get as their attention mask during a grpo_mem pass: the pass's context token, and how
    many mixers read it (each mixer call of the pass must, or the backbone did not hand the mask on)."""

    __slots__ = ("calls", "token")

    def __init__(self, token: str):
        self.token, self.calls = token, 0


class _Forward(_LayerForward):
    """The forward ``install`` gives a backbone (``mixers`` > 0: the mixers it holds) or a mixer: ``__call__(*args,
    **kwargs)``; bound to ``module`` only, so that copies compute with their own weights (``_LayerForward``)."""

    __slots__ = ("mixers",)

    def __init__(self, module: torch.nn.Module, mixers: int = 0):
        super().__init__(module)
        self.mixers = mixers

    def __reduce__(self):
        return _Forward, (self.module, self.mixers)

    def __call__(self, *args, **kwargs):
        return (self._backbone if self.mixers else self._mixer)(self._original(), *args, **kwargs)

    def _backbone(self, original, *args, **kwargs):
        token = kwargs.pop(attn_hook.CTX_KWARG, None)
        if token is None:
            return original(*args, **kwargs)
        if any(kwargs.get(name) is not None for name in ("cache", "cache_params", "past_key_values")):
            raise ValueError("grpo_mem: a pass with a grpo_mem context must not carry a cache (use_cache=False)")
        kwargs["attention_mask"] = relay = _Relay(token)
        out = original(*args, **kwargs)
        if relay.calls != self.mixers:
            raise RuntimeError(
                f"grpo_mem: {relay.calls} of the {self.mixers} Mamba mixers of {type(self.module).__name__} got the "
                "pass's context (the backbone no longer hands its attention mask to every mixer)"
            )
        return out

    def _mixer(self, original, hidden_states, *args, **kwargs):
        relay = kwargs.get("attention_mask")
        if not isinstance(relay, _Relay):
            return original(hidden_states, *args, **kwargs)
        relay.calls += 1
        linear = getattr(attn_hook.lookup_context(relay.token), "linear", None)
        if not isinstance(linear, LinearContext):
            raise RuntimeError(  # noqa: TRY004 (a context freed too early, not a caller's wrong type)
                f"grpo_mem: Mamba mixer {self.module.layer_idx} got context {relay.token!r} without recurrent states "
                "(freed before its layer was replayed, or built without them)"
            )
        return linear.run(_ref_call(self.module), self.module.layer_idx, hidden_states)


def _ref_call(module: torch.nn.Module):
    """``layer_call(x, cache, attention_mask)`` for ``LinearContext.run``: ``mixer_ref`` of ``module`` from the states
    of ``cache`` (a ``linear_attention._HandOff``), its final states recorded there."""

    def layer_call(x, cache, attention_mask):
        y, cache.final_conv, cache.final_recurrent = mixer_ref(
            module,
            x,
            attention_mask,
            cache.get_conv_state(module.layer_idx),
            cache.get_recurrent_state(module.layer_idx),
        )
        return y

    return layer_call


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its mixers ``takes_state`` recognises


def _wrap(module: torch.nn.Module, mixers: int = 0) -> None:
    if WRAPPED_FORWARD not in module.__dict__:
        module.__dict__[WRAPPED_FORWARD] = module.__dict__.get("forward")
        module.forward = _Forward(module, mixers)


def install(model: torch.nn.Module) -> int:
    """Wrap the forward of every Mamba-1 mixer of ``model`` (``takes_state``) and of its backbone (idempotent): a
    backbone call with a context token (``attention_hook.CTX_KWARG``) hands it to the mixers in place of the attention
    mask, and a mixer given it runs ``mixer_ref`` through the context's ``linear`` (a ``LinearContext``); any other
    call runs unchanged. ``attention_hook.restore_forwards`` undoes it. Returns how many mixers are wrapped (found once
    per model); none: nothing is wrapped."""
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = mamba_layers(model)
    relayed = [m for m in layers if own_class(m).__name__ in _LAYER_RELAY]
    if len(relayed) < len(layers):
        _wrap(model.base_model, mixers=len(layers) - len(relayed))
    for layer in relay_layers(model.base_model, relayed):
        _wrap(layer, mixers=1)
    for module in layers:
        _wrap(module)
    return len(layers)


def relay_layers(base: torch.nn.Module, relayed: list) -> list[torch.nn.Module]:
    """The decoder layers of ``base`` (in its layer lists) that hold a mixer of ``relayed``, one each."""
    ids = {id(m) for m in relayed}
    return [
        layer
        for child in base.children()
        if isinstance(child, torch.nn.ModuleList)
        for layer in child
        if any(id(m) in ids for m in layer.modules())
    ]


def relayed_layer(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s only token mixing is one Mamba-1 mixer whose context ``install`` relays from the layer's
    keyword arguments, handed on as the mixer's attention mask (the layer need not pass its keyword arguments on):
    a mixer of ``_LAYER_RELAY`` that receives, run on the layer's meta twin, the relay the layer is given as its
    attention mask (``_hands_relay``)."""
    mixers = [m for m in layer.modules() if takes_state(m)]
    if len(mixers) != 1 or own_class(mixers[0]).__name__ not in _LAYER_RELAY:
        return False
    return _hands_relay(layer, mixers, mixers[0].hidden_size)


def _hands_relay(outer, inner: list, width: int, backbone: bool = False, token: bool = False) -> bool:
    """Whether each module of ``inner`` gets the relay (a ``_Relay``, as the attention mask) that ``outer`` is called
    with, or, with ``token``, the context token among its keyword arguments; observed on ``outer``'s meta twin
    (``recurrent_probe.reaches``), called as a pass calls it: a backbone (``backbone``) with its embeddings and
    ``use_cache=False``, a layer or block with its hidden states."""
    relay = _Relay("probe")
    x = torch.zeros(1, 2, width, device="meta")
    # the token travels beside a mask the mask builders return as is (what ``packed`` passes), not one they read
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device="meta")
    given = {attn_hook.CTX_KWARG: relay.token, "attention_mask": placeholder} if token else {"attention_mask": relay}
    if backbone:  # (no positions: a backbone reads them as values, e.g. to find packed sequences)
        got = reaches(outer, inner, lambda twin: twin(inputs_embeds=x, use_cache=False, **given))
    else:
        got = reaches(outer, inner, lambda twin: twin(x, **given))
    if got is None:
        return False
    if token:
        return all(g.get(attn_hook.CTX_KWARG) == relay.token for g in got)
    return all(g.get("attention_mask") is relay for g in got)

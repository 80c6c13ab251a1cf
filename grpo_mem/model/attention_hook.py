"""The attention hook of the group forward, registered through transformers' attention interface.

A model taken over by grpo_mem runs with the attention implementation ``grpo_mem_<inner>`` (``inner`` being what it
had: ``sdpa``, ``eager``, ``flash_attention_2``...). Without a grpo_mem context among the attention kwargs the hook
calls ``inner`` unchanged, so every other use of the model (generation, evaluation, stock TRL calls) computes exactly
what it computed before. With a context token, passed as the model-forward kwarg ``grpo_mem_ctx`` and carried by
transformers down to every attention call, it either records each layer's prompt K/V (prompt pass) or attends
completion queries to that K/V plus their own causal K/V (completion pass).

The token travels as a forward kwarg on purpose: under non-reentrant gradient checkpointing transformers re-runs each
layer in backward with the kwargs it was first called with, so the recomputation finds the same context, the same
prompt K/V tensors, and gradient reaches the prompt's graph. A global switch would have been reset by then.

The token is a plain string naming the context in a registry of this module, never the context object itself. Wrappers
rebuild what they find in a layer's kwargs: FSDP2's forward pre-hook collects every tensor that requires grad from
args and kwargs (dataclasses and dicts included), routes them through its post-backward autograd function and rebuilds
the containers around the results (``dataclasses.replace``), so a context object would reach layer 1 as a copy whose
recorded K/V are lost, and the prompt K/V would be fed to every layer's post-backward hook. A string holds no tensor
and equals any copy of itself, so nothing a wrapper does to kwargs can change what the hook finds.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.configuration_utils import PretrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from ..ops.attention import multi_region_attention
from .mechanisms import keywords

PREFIX = "grpo_mem_"
CTX_KWARG = "grpo_mem_ctx"
TAKEN = "_grpo_mem_attention"  # instance attribute of a taken-over model: its ``_TakenOver`` (a copy's: None)


@dataclass
class PromptCapture:
    """Context of the prompt pass: each layer's post-RoPE K/V, (U, kv_heads, P, head_dim), keyed by layer index.

    Each layer records once; the replay of a checkpointed layer in backward finds its entry and leaves it alone, so the
    completion pass and its own replay always read the tensors of the first forward.
    """

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    linear: object = None  # the pass's ``linear_attention.LinearContext``, read by its linear-attention layers


@dataclass
class Region:
    """K/V that queries of a pass read in place, one entry per prompt or trie node.

    Attributes:
        kv: per layer, post-RoPE ``(K, V)`` of shape (U, kv_heads, S, head_dim) (a capture's ``kv``).
        index: (B,) int64, the entry row b reads; -1: row b reads nothing of this region.
        mask: (U, S) bool, real (non-padding) key positions of each entry.
        positions: (U, S) int64, the position of each key (what a sliding window is measured on).
    """

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    index: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor


@dataclass
class CompletionContext:
    """Context of a pass whose queries attend to K/V recorded by earlier passes plus, causally, their own.

    Used by the completion pass (regions: the prompt, or every trie node on the row's path) and by the pass of a trie
    node below the root (regions: its ancestors), which also records its own K/V in ``capture``.

    Attributes:
        regions: the K/V read in place, merged exactly with the pass's own causal K/V (log-sum-exp).
        key_mask: (B, T) bool, real positions of the pass's own tokens (right padding).
        positions: (B, T) int64, the positions of the pass's own tokens (its ``position_ids``).
        reach: the largest query-key position difference in the pass (``plan.WindowPlan.reach``; a sliding window
            wider than it hides nothing and is dropped, so the fused kernels keep serving the pass).
        capture: per layer, the pass's own post-RoPE K/V (B, kv_heads, T, head_dim) once recorded; None: not kept.
        linear: the pass's ``linear_attention.LinearContext``, read by its linear-attention layers, or None.
        shards: under sequence parallelism, the pass's ``sequence_parallel.Shards``: ``shards.heads(H, Hkv)`` the
            layer's head split (an all-to-all to the whole pass at this rank's heads, attended as on one rank, its
            K/V recorded at those heads), or, where that is None, ``shards.regions(key, value, layer, capture)`` the
            regions of the pass's earlier tokens (recording the all-gathered K/V), read by the query rows
            ``shards.fold`` makes of this rank's shard; None: whole.
    """

    regions: list[Region]
    key_mask: torch.Tensor
    positions: torch.Tensor
    reach: int
    capture: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    linear: object = None
    shards: object = None


# token -> live context. Entries go away with their context: a prompt capture lives for its pass; a completion context
# is also held by the autograd graph of its pass (``keep_alive``) for the replay of checkpointed layers in backward.
_CONTEXTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_COUNTER = itertools.count()
_PROMPT_TAG, _COMPLETION_TAG = "grpo_mem:prompt:", "grpo_mem:completion:"


def context_token(ctx) -> str:
    """Register ``ctx`` (a ``PromptCapture``, ``CompletionContext`` or ``packed.PackedContext``) and return the
    string that names it, to pass to the model as ``grpo_mem_ctx=token``.

    The registry holds ``ctx`` weakly: the caller keeps it alive for as long as a layer may look it up.
    """
    tag = _PROMPT_TAG if isinstance(ctx, PromptCapture) else _COMPLETION_TAG
    token = f"{tag}{next(_COUNTER)}"
    _CONTEXTS[token] = ctx
    return token


class _KeepAlive(torch.autograd.Function):
    """Identity whose graph node holds a context until the graph is freed (after the backward that replays it)."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.keep = keep
        ctx.set_materialize_grads(False)  # no gradient stays none (``store.touch``): nothing computed upstream
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def keep_alive(x: torch.Tensor, ctx: CompletionContext) -> torch.Tensor:
    """``x`` unchanged in value; while ``x``'s graph lives (checkpointed layers replay in its backward), so does
    ``ctx``."""
    return _KeepAlive.apply(x, ctx) if x.requires_grad else x


def lookup_context(token):
    """The live context named by ``token`` (``context_token``); None for a prompt capture already gone (the replay of
    a checkpointed layer). Raises TypeError for anything but such a token, RuntimeError for a freed completion
    context."""
    if not isinstance(token, str) or not token.startswith((_PROMPT_TAG, _COMPLETION_TAG)):
        raise TypeError(f"{CTX_KWARG} must be a token from context_token(), got {type(token).__name__} {token!r}")
    ctx = _CONTEXTS.get(token)
    if ctx is None and token.startswith(_COMPLETION_TAG):
        raise RuntimeError(f"grpo_mem: completion context {token!r} was freed before its layers were replayed")
    return ctx


def _is_flash(impl: str) -> bool:
    """Whether ``impl`` is a flash-attention implementation, by transformers' own test (``"flash"`` in the name)."""
    return "flash" in impl


class _ConfigView:
    """A model config that reports ``impl`` as its attention implementation; every other attribute is the config's."""

    def __init__(self, config, impl: str):
        self._config = config
        self._attn_implementation = impl

    def __getattr__(self, name):
        return getattr(self._config, name)


class _ModuleView:
    """An attention module as transformers' flash-attention wrapper sees it: itself, except that its config names the
    wrapped implementation. The wrapper passes ``module.config._attn_implementation`` on to pick the flash kernel, so
    with the model switched to ``grpo_mem_flash_attention_2`` every inner call would otherwise look for a kernel of
    that name."""

    def __init__(self, module, impl: str):
        self._module = module
        self.config = _ConfigView(module.config, impl)

    def __getattr__(self, name):
        return getattr(self._module, name)


_FEATURES = tuple((m.keyword, m.feature, m.convert) for m in keywords())


def layer_features(kwargs) -> dict:
    """The attention features a layer hands the attention interface, as ``multi_region_attention`` keywords: those of
    the keyword mechanisms of ``mechanisms.TABLE``, None where the layer hands none.

    Modules pass them as keyword arguments, which is what transformers' flash-attention path reads too:
    ``sliding_window`` (this layer's sliding window W, None for a full-attention layer; a key is visible iff
    ``0 <= i - j < W``, the test of transformers' sliding-window mask), ``softcap`` (Gemma 2's
    ``attn_logit_softcapping``) and ``s_aux`` (gpt-oss's per-head learnable sink logits, as ``sinks``). The eager
    and SDPA paths read the sliding window from the mask instead, which the model builds from the same per-layer
    setting.
    """
    features = {}
    for keyword, feature, convert in _FEATURES:
        value = kwargs.get(keyword)
        features[feature] = value if value is None or convert is None else convert(value)
    return features


def own_class(module) -> type:
    """``module``'s class as its library defined it: FSDP2's ``fully_shard`` swaps in a subclass defined by torch."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch."))


def module_eager(module):
    """The eager attention function of ``module``'s modeling file (``eager_attention_forward``), which transformers'
    ``get_interface`` hands the module for ``"eager"`` (eager is not in the registry: each model has its own, e.g.
    gpt-oss's with sinks), or None."""
    return getattr(sys.modules.get(own_class(module).__module__), "eager_attention_forward", None)


def op_tensors(tensors: tuple) -> tuple:
    """``(query, key, value, key_1, value_1, ...)`` as the attention op takes them: in autocast's dtype under autocast
    (as SDPA runs; the op keeps its own accumulation), each value zero-padded to the key width where the value heads
    are narrower (MLA: DeepSeek-V2/V3, Kimi; zero columns give zero outputs under the same attention weights, cut back
    after the op).

    Raises:
        TypeError: the tensors' dtypes differ outside autocast.
    """
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        tensors = tuple(t.to(dtype) for t in tensors)
    elif len({t.dtype for t in tensors}) > 1:
        raise TypeError(f"query/key/value dtypes differ outside autocast: {sorted({str(t.dtype) for t in tensors})}")
    pad = tensors[1].shape[-1] - tensors[2].shape[-1]
    if pad:
        tensors = tuple(F.pad(t, (0, pad)) if i >= 2 and i % 2 == 0 else t for i, t in enumerate(tensors))
    return tensors


def attend(ctx: CompletionContext, query, key, value, layer: int, kwargs: dict):
    """Attention of a pass whose queries read ``ctx.regions`` plus, causally, their own keys: ``query`` (B, Hq, T, d),
    ``key``/``value`` (B, Hkv, T, d) post-RoPE; returns (B, T, Hq, dv), contiguous. Records the pass's own K/V in
    ``ctx.capture`` (first call of the layer only) and, under sequence parallelism, runs the layer's exchange."""
    shard_regions, shards, key_mask, positions = [], ctx.shards, ctx.key_mask, ctx.positions
    split = None if shards is None else shards.heads(query.shape[1], key.shape[1])
    if split is not None:  # the whole pass at this rank's heads: attention as on one rank (``sequence_heads``)
        query, key, value = split.scatter(query, key, value)
        key_mask, positions, shards = shards.mask, shards.positions, None
        kwargs["s_aux"] = split.sinks(kwargs.get("s_aux"))
    if shards is not None:
        shard_regions = shards.regions(key, value, layer, ctx.capture)
    elif ctx.capture is not None:
        ctx.capture.setdefault(layer, (key, value))
    region_kv = [t for r in ctx.regions for t in r.kv[layer]] + [t for r in shard_regions for t in r[:2]]
    tensors = op_tensors((query, key, value, *region_kv))
    device, dv = query.device.type, value.shape[-1]
    scaling = kwargs.get("scaling")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = tensors[:3]
    indices = [r.index for r in ctx.regions]
    if shards is not None:  # the pieces of this rank's shard as query rows (``Shards.fold``)
        q, k, v = (shards.fold(t) for t in (q, k, v))
        key_mask, positions = shards.fold_rows(key_mask), shards.fold_rows(positions)
        indices = [shards.rows(i) for i in indices]
    kv = iter(tensors[3:])
    regions = [(next(kv), next(kv), i, r.mask, r.positions) for i, r in zip(indices, ctx.regions)]
    regions += [(next(kv), next(kv), *r[2:]) for r in shard_regions]
    features = layer_features(kwargs)
    if features["sliding_window"] is not None and features["sliding_window"] > ctx.reach:
        features["sliding_window"] = None
    # under the head split the op returns this rank's tokens at all heads (and keeps only them); value heads
    # narrower than the key heads are cut first, then exchanged
    out_map = split.out_map if split is not None and dv == key.shape[-1] else None
    with torch.autocast(device, enabled=False):
        out = multi_region_attention(
            q, k, v, regions, key_mask, scale=scale, q_positions=positions, out_map=out_map, **features
        )
    if split is not None:
        return out.transpose(1, 2) if out_map else split.gather(out[..., :dv])
    out = out.transpose(1, 2).contiguous() if shards is None else shards.unfold(out)
    return out if out.shape[-1] == dv else out[..., :dv].contiguous()


def _make_hook(inner: str):
    flash = _is_flash(inner)

    def grpo_mem_attention(module, query, key, value, attention_mask, **kwargs):
        token = kwargs.pop(CTX_KWARG, None)
        inner_fn = module_eager(module) if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]
        inner_module = _ModuleView(module, inner) if flash else module
        if token is None or module not in _SERVED:  # no context, or a vision tower's attention the kwargs reached
            return inner_fn(inner_module, query, key, value, attention_mask, **kwargs)
        layer = module.layer_idx
        ctx = lookup_context(token)
        if hasattr(ctx, "attend"):  # a context that runs attention itself (``packed.PackedContext``)
            return ctx.attend(query, key, value, layer, kwargs), None
        if not isinstance(ctx, CompletionContext):
            # prompt pass; a capture already gone means the replay of a checkpointed layer, which records nothing
            if ctx is not None:
                ctx.kv.setdefault(layer, (key, value))
            return inner_fn(inner_module, query, key, value, attention_mask, **kwargs)
        return attend(ctx, query, key, value, layer, kwargs), None

    grpo_mem_attention.__name__ = f"grpo_mem_attention_{inner}"
    return grpo_mem_attention


def hook_name(inner: str) -> str:
    """Name under which the hook wrapping the attention implementation ``inner`` is registered."""
    return inner if inner.startswith(PREFIX) else PREFIX + inner


def ensure_registered(inner: str) -> str:
    """Register the hook around ``inner`` (idempotent) and return its name.

    The hook goes into the local mapping of transformers' global ``ALL_ATTENTION_FUNCTIONS`` instance, which its
    public ``__setitem__`` / ``__delitem__`` manage. ``inner``'s mask function is registered under the hook's name
    with ``AttentionMaskInterface.register``: transformers' mask creation looks names up in the class's global
    mapping only (a name missing there gets no mask at all). ``hand_back`` removes both.

    Raises:
        ValueError: ``inner`` is not a registered transformers attention implementation (nor ``"eager"``, which
            each model defines in its own modeling file).
    """
    name = hook_name(inner)
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    if inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {inner!r} is not registered in transformers' AttentionInterface")
    ALL_ATTENTION_FUNCTIONS[name] = _make_hook(inner)
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def _unregister(name: str) -> None:
    try:
        del ALL_ATTENTION_FUNCTIONS[name]
    except KeyError:  # not in the local mapping: registered by someone else, not ours to remove
        pass
    # transformers offers no unregister for mask functions; the class-level mapping is where register put it
    AttentionMaskInterface._global_mapping.pop(name, None)


# hook name -> models running it; the hook is unregistered when the last one gives it back
_USERS: dict[str, weakref.WeakSet] = {}
# the modules of the language models taken over: only their attention calls take a context. A vision-language model's
# forward may hand its keyword arguments (the context token among them) to its vision tower too (transformers 5.24's
# LLaVA does), whose attention runs through the same interface and must compute what it computed before.
_SERVED: weakref.WeakSet = weakref.WeakSet()
_LANGUAGE_MODEL_NAMES = ("language_model", "text_model")


def language_model_of(base) -> tuple[str, torch.nn.Module | None]:
    """(attribute name, module) of the language model (text decoder) of a vision-language base model; ("", None)
    when it has none."""
    for name in _LANGUAGE_MODEL_NAMES:
        if isinstance(getattr(base, name, None), torch.nn.Module):
            return name, getattr(base, name)
    return "", None


def inner_implementation(model) -> str:
    """The attention implementation the model had before grpo_mem took it over."""
    impl = model.config._attn_implementation or "eager"
    return impl[len(PREFIX) :] if impl.startswith(PREFIX) else impl


# instance attribute of a module whose forward a pass extension wrapped (``linear_attention.install``): the forward it
# replaced (None: the class's), which ``restore_forwards`` puts back
WRAPPED_FORWARD = "_grpo_mem_linear_forward"


def restore_forwards(model) -> None:
    """Give every module of ``model`` whose forward a pass extension wrapped (``WRAPPED_FORWARD``) the forward it
    had; a no-op on a model without such modules."""
    for module in model.modules():
        if WRAPPED_FORWARD in module.__dict__:
            own = module.__dict__.pop(WRAPPED_FORWARD)
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own


def take_over(model) -> str | None:
    """Switch ``model`` (a transformers ``PreTrainedModel``) to the hook; return the implementation it had, or None
    when it already ran the hook. The switch is exact for every call without a grpo_mem context.

    A model whose config already names the hook without having been taken over (one built from a taken-over model's
    config, e.g. a reference model loaded with its policy's ``attn_implementation``) is taken over here: its
    implementation is the one the name wraps. A copy of a taken-over model (``copy.deepcopy``, ``pickle``) names its own
    implementation again (``_TakenOver``) and is taken over like any model when scored."""
    impl = model.config._attn_implementation or "eager"
    if impl.startswith(PREFIX) and taken_over(model):
        return None
    impl = impl[len(PREFIX) :] if impl.startswith(PREFIX) else impl
    name = ensure_registered(impl)
    _switch(model, name, flash=_is_flash(impl))
    model.__dict__[TAKEN] = _TakenOver(_configs_of(model))
    _SERVED.update((language_model_of(model.base_model)[1] or model).modules())
    _USERS.setdefault(name, weakref.WeakSet()).add(model)
    return impl


def taken_over(model) -> bool:
    """Whether ``take_over`` switched ``model`` itself to the hook (and ``hand_back`` has not undone it)."""
    return isinstance(model.__dict__.get(TAKEN), _TakenOver)


def hand_back(model, impl: str) -> None:
    """Restore the attention implementation ``impl`` that ``take_over`` returned; the hook is unregistered once no
    model runs it."""
    _switch(model, impl, flash=_is_flash(impl))
    model.__dict__.pop(TAKEN, None)
    for module in model.modules():
        _SERVED.discard(module)
    restore_forwards(model)
    name = hook_name(impl)
    users = _USERS.get(name)
    if users is not None:
        users.discard(model)
        if not users:
            del _USERS[name]
            _unregister(name)


class _TakenOver:
    """What ``take_over`` changed on a model that a copy of the model must not keep: the configs (the model's and its
    sub-models', at any depth) whose attention implementation now names the hook.

    The hook's registries (``_SERVED``, ``_USERS``) hold the taken-over model and its modules, not a copy
    of them; a copy's configs would still name the hook, which is unregistered when the last model taken over gives it
    back (and was never registered in a process that only loads the copy). So a copy made by ``copy.deepcopy`` or
    ``pickle``/``torch.save`` (``__reduce__``) renames its own copies of these configs back to the implementation each
    wrapped (``_plain_copies``), and its marker is None: it is a model grpo_mem has not taken over, computing what it
    computed before, and is taken over like any other when scored."""

    __slots__ = ("configs",)

    def __init__(self, configs: list):
        self.configs = configs

    def __reduce__(self):
        return _plain_copies, (self.configs,)


def _configs_of(model) -> list:
    """The distinct config objects of ``model`` and of every transformers sub-model in it."""
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(module, PreTrainedModel) and config is not None:
            configs.setdefault(id(config), config)
    return list(configs.values())


def _plain_copies(configs: list) -> None:
    """Rename every attention implementation of ``configs`` (copies, made with the model that holds them) and of their
    sub-configs that names the hook back to the implementation it wraps; a copied model's ``TAKEN`` becomes None."""
    stack, seen = list(configs), set()
    while stack:
        config = stack.pop()
        if id(config) in seen:
            continue
        seen.add(id(config))
        impl = config.__dict__.get("_attn_implementation_internal")
        if isinstance(impl, str) and impl.startswith(PREFIX):
            config._attn_implementation_internal = impl[len(PREFIX) :]
        for key in getattr(config, "sub_configs", None) or {}:
            sub = getattr(config, key, None)
            if isinstance(sub, PretrainedConfig):
                stack.append(sub)
    return None


def _switch(model, impl: str, *, flash: bool) -> None:
    # ``set_attn_implementation`` preloads any implementation whose name contains "flash" as a flash kernel of that
    # name (and would need flash-attn importable to switch back): for a flash model, set the config directly, which
    # is what that method does once its checks pass. The config keeps "flash" in the hook's name, so transformers'
    # flash-specific mask and generation paths stay on.
    if flash:
        model.config._attn_implementation = impl
    else:
        model.set_attn_implementation(impl)

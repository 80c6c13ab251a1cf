"""What a recurrent layer does with the states a cache hands it: observed by running it, not read from its source.

grpo_mem hands the recurrent states a prompt ends with (a causal convolution's last K − 1 inputs, a scan's state) to
the rows that continue it through a cache of its own, which the layer's forward reads and writes
(``linear_attention._HandOff``). Whether a layer works with that cache is a question of behaviour: which cache methods
it calls, which states it writes and with which shapes, whether its output depends on the states it is given, and
whether autograd can differentiate through them. transformers moves this code between functions from release to
release (5.25 moved the convolution and the scans of every such layer out of its ``forward`` into shared
``causal_conv1d_forward`` / ``mamba2_scan_forward`` functions and added cache methods its layers call), so ``observe``
runs the layer instead of reading it: a twin of the layer on the meta device (``meta_twin``: the layer's own class and
attributes, its parameters meta tensors of their full shapes; no memory, no hook, no collective, the user's module
untouched) is called through the very code that will serve it, once from zero states on left-padded rows, then from
given states over several tokens and over one, and autograd's graph says what depends on what. The numbers are the
run-time confirmation's (``confirm``: the same path on a tiny copy, compared with the model's own forward).

``reaches`` answers the other behavioural question the hand-off asks: whether a keyword (the pass's context, or the
relay standing in for the attention mask) that a module is called with arrives at some of its submodules.

Observations are kept per layer class and structure (``forget`` drops them). This module knows torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .attention_hook import WRAPPED_FORWARD, own_class

__all__ = [
    "CACHE_PARAMETERS",
    "Observed",
    "continues_cause",
    "forget",
    "kernel_cause",
    "meta_twin",
    "observe",
    "reaches",
]

CACHE_PARAMETERS = ("cache", "cache_params", "past_key_values")
"""The names under which a recurrent layer's forward takes its cache (transformers 5.24 renamed ``cache_params`` and
the short convolutions' ``past_key_values`` to ``cache``)."""

_ROWS, _TOKENS = 2, 3  # two rows (transformers masks padding only for a batch of several), several tokens and one
# instance attributes a twin leaves behind: forwards set on the instance (accelerate's hook, kernels' ``kernelize``,
# grpo_mem's own wrappers) and accelerate's hook; the twin runs its class's forward
_DROPPED = frozenset({"forward", "_hf_hook", "_old_forward", "_kernel_repo", WRAPPED_FORWARD})


def _meta(t: torch.Tensor) -> torch.Tensor:
    """An empty meta tensor of ``t``'s full shape (a DeepSpeed ZeRO-3 parameter keeps it in ``ds_shape``) and dtype."""
    shape = getattr(t, "ds_shape", None) or t.shape
    return torch.empty(tuple(shape), dtype=t.dtype, device="meta")


def meta_twin(module: torch.nn.Module, replace: dict | None = None) -> torch.nn.Module:
    """A module of ``module``'s own class (FSDP2's subclass looked through) with its
    attributes, whose parameters, buffers and tensor attributes are empty meta tensors of their full shapes, and whose
    submodules are twins too, or ``replace[id(submodule)]`` where given. Hooks, forwards set on instances and
    accelerate's hook are left behind: running the twin computes shapes only, allocates nothing, runs no hook or
    collective, and leaves ``module`` as it was."""
    replace = replace or {}
    twin = object.__new__(_twin_class(module))
    state = {}
    for key, value in module.__dict__.items():
        if key in _DROPPED:
            continue
        if key == "_parameters":
            value = {n: None if p is None else _parameter(p) for n, p in value.items()}
        elif key == "_buffers":
            value = {n: None if b is None else _meta(b) for n, b in value.items()}
        elif key == "_modules":
            value = {n: None if c is None else replace.get(id(c)) or meta_twin(c, replace) for n, c in value.items()}
        elif "hooks" in key and isinstance(value, dict):
            value = type(value)()
        elif isinstance(value, torch.Tensor):
            value = _meta(value)
        state[key] = value
    twin.__dict__.update(state)
    return twin


def _twin_class(module: torch.nn.Module) -> type:
    """``module``'s class, looking through the subclass FSDP2's ``fully_shard`` swaps in (defined in
    ``torch.distributed``)."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed"))


def _parameter(p: torch.Tensor) -> torch.nn.Parameter:
    grad = p.requires_grad and (p.is_floating_point() or p.is_complex())
    return torch.nn.Parameter(_meta(p), requires_grad=grad)


class _Recorder:
    """What a layer gets as its cache during an observation: the serving cache, each method call recorded in
    ``calls`` and each attribute the cache lacks in ``missing``."""

    __slots__ = ("_cache", "_calls", "_missing")

    def __init__(self, cache, calls: list, missing: list):
        self._cache, self._calls, self._missing = cache, calls, missing

    def __getattr__(self, name):
        try:
            value = getattr(self._cache, name)
        except AttributeError:
            self._missing.append(name)
            raise
        if callable(value):
            self._calls.append(name)
        return value


@dataclass(frozen=True)
class Observed:
    """What a layer did when run through a hand-off (``observe``).

    Attributes:
        calls: the cache methods it called, in first-call order.
        conv, recurrent: the shapes of the convolution and recurrent states it wrote from zero states (rows first),
            or None where it wrote none.
        reads: the (tokens, state) pairs, state "conv" or "recurrent", whose given state its output over that many
            tokens depends on.
        carries: the (tokens, "recurrent") pairs whose recurrent state after the call depends on the one given.
        error: what went wrong (the call raised, a method the cache lacks, states of other shapes), or None.
    """

    calls: tuple[str, ...] = ()
    conv: tuple[int, ...] | None = None
    recurrent: tuple[int, ...] | None = None
    reads: frozenset = frozenset()
    carries: frozenset = frozenset()
    error: str | None = None


_OBSERVED: dict[tuple, Observed] = {}


def forget() -> None:
    """Drop every kept observation."""
    _OBSERVED.clear()


def _key(module: torch.nn.Module, purpose: str, width: int | None) -> tuple:
    """What an observation depends on: the purpose, the layer's class, its parameters' shapes and dtypes and its plain
    settings (not its ``layer_idx``: the layers of one class in a model are observed once)."""
    params = tuple((n, tuple(_meta(p).shape), str(p.dtype)) for n, p in module.named_parameters())
    plain = tuple(
        sorted(
            (k, v)
            for k, v in module.__dict__.items()
            if isinstance(v, (int, float, str, bool)) and k != "layer_idx" and not k.startswith("__")
        )
    )
    return purpose, own_class(module), width, params, plain


def observe(module: torch.nn.Module, purpose: str, bind: Callable, hand_off: Callable, width: int | None = None):
    """What ``module`` does when run through a hand-off (an ``Observed``), on its meta twin; kept per ``purpose``,
    class and structure.

    Args:
        module: a recurrent layer (an integer ``layer_idx``), left untouched.
        purpose: what the observation is for (a key: ``"linear"``, ``"ssd"``, ...).
        bind: ``bind(twin, original) -> layer_call(x, hand_off, attention_mask)``: the call that serves the layer
            (``linear_attention._LayerForward.bind``), given its twin and the twin's own forward
            ``original(x, **kwargs)``, which records the calls made on the cache it is given.
        hand_off: ``hand_off(conv, recurrent) -> cache`` with ``final_conv`` and ``final_recurrent`` after a call
            (``linear_attention._HandOff``).
        width: the layer's input width, where it has no integer ``hidden_size``.
    """
    width = _width(module, width)
    key = _key(module, purpose, width)
    seen = _OBSERVED.get(key)
    if seen is None:
        seen = _OBSERVED[key] = _observe(module, bind, hand_off, width)
    return seen


def _width(module: torch.nn.Module, width: int | None) -> int | None:
    """The width of ``module``'s input: its integer ``hidden_size``, else ``width``, else the input width of its first
    linear layer (a short convolution's input projection)."""
    if isinstance(getattr(module, "hidden_size", None), int):
        return module.hidden_size
    if width is not None:
        return width
    return next((m.in_features for m in module.modules() if isinstance(m, torch.nn.Linear)), None)


def _observe(module, bind, hand_off, width) -> Observed:
    calls: list[str] = []
    missing: list[str] = []
    if not isinstance(width, int):
        return Observed(error="has no integer hidden_size and no linear layer (the width of its input)")
    twin = meta_twin(module)
    own = own_class(module).forward
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)

    def original(x, **kwargs):
        kwargs = {
            k: _Recorder(v, calls, missing) if k in CACHE_PARAMETERS and v is not None else v for k, v in kwargs.items()
        }
        return own(twin, x, **kwargs)

    seen: dict = {}
    try:
        with torch.inference_mode(False), torch.enable_grad():
            _run(bind(twin, original), hand_off, width, dtype, seen)
    except Exception as e:  # the layer's own code, or grpo_mem's, on the hand-off: named, never raised
        what = " ".join(str(e).split())[:160]
        lacks = f"calls cache.{missing[0]}, which grpo_mem's hand-off does not have" if missing else None
        seen["error"] = lacks or f"raised {type(e).__name__}: {what}"
    return Observed(calls=tuple(dict.fromkeys(calls)), **seen)


def _shape(t) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def _output(y) -> torch.Tensor:
    return y[0] if isinstance(y, (tuple, list)) else y


def _run(layer_call: Callable, hand_off: Callable, width: int, dtype, seen: dict) -> None:
    """The three calls of ``observe`` (from zero states on left-padded rows, then from given states over ``_TOKENS``
    tokens and over one) and what autograd's graph says of them, as ``Observed``'s fields into ``seen`` (the state
    shapes as soon as the first call wrote them)."""
    meta = {"device": "meta", "dtype": dtype}
    zero = hand_off(None, None)
    mask = torch.ones(_ROWS, _TOKENS, dtype=torch.bool, device="meta")
    layer_call(torch.zeros(_ROWS, _TOKENS, width, **meta), zero, mask)
    shapes = {"conv": _shape(zero.final_conv), "recurrent": _shape(zero.final_recurrent)}
    seen.update(shapes)
    given = {
        n: torch.zeros(s, dtype=t.dtype, device="meta", requires_grad=True)
        for (n, s), t in zip(shapes.items(), (zero.final_conv, zero.final_recurrent))
        if s is not None
    }
    reads, carries, error = set(), set(), None
    for tokens in (_TOKENS, 1) if given else ():
        cache = hand_off(given.get("conv"), given.get("recurrent"))
        y = _output(layer_call(torch.zeros(_ROWS, tokens, width, **meta), cache, None))
        names = list(given)
        grads = torch.autograd.grad(y.float().sum(), [given[n] for n in names], allow_unused=True, retain_graph=True)
        reads |= {(tokens, n) for n, g in zip(names, grads) if g is not None}
        after = {"conv": _shape(cache.final_conv), "recurrent": _shape(cache.final_recurrent)}
        if error is None and after != shapes:
            error = f"writes states of shapes {after} after {tokens} given token(s), {shapes} from zero states"
        final = cache.final_recurrent
        if "recurrent" in given and final is not None and final.requires_grad:
            (g,) = torch.autograd.grad(final.float().sum(), [given["recurrent"]], allow_unused=True)
            if g is not None:
                carries.add((tokens, "recurrent"))
    seen.update(reads=frozenset(reads), carries=frozenset(carries), error=error)


def continues_cause(name: str, seen: Observed) -> str | None:
    """Why a layer named ``name`` that behaved as ``seen`` (``observe``) cannot be continued from a prompt's states by
    the call observed, or None: it must write a convolution state, and, if it reads a recurrent state, write one; its
    output over several tokens and over one must depend on every state it writes, and its recurrent state after the
    call on the one it was given."""
    if seen.error is not None:
        return f"{name} run with grpo_mem's state hand-off {seen.error}"
    if seen.conv is None:
        return f"{name} keeps no convolution state in its cache (no update_conv_state)"
    if "get_recurrent_state" in seen.calls and seen.recurrent is None:
        return f"{name} reads a recurrent state from its cache but writes none"
    for tokens, span in ((_TOKENS, "several tokens"), (1, "one token")):
        for state in ("conv", "recurrent") if seen.recurrent is not None else ("conv",):
            kind = "convolution" if state == "conv" else "recurrent"
            if (tokens, state) not in seen.reads:
                return f"{name}'s output over {span} does not depend on the {kind} state its cache hands it"
        if seen.recurrent is not None and (tokens, "recurrent") not in seen.carries:
            return f"{name}'s recurrent state after {span} does not depend on the one its cache handed it"
    return None


def kernel_cause(module: torch.nn.Module) -> str | None:
    """Why ``module``'s states cannot be handed on because a Hub kernel took over its cache handling, or None: its
    forward, or a function it calls with its cache (``causal_conv1d_forward``, ``mamba2_scan_forward``, ...: the
    ``*_forward`` functions transformers 5.25 lists in ``use_kernelized_func``), replaced by ``kernels.kernelize``
    (``from_pretrained(use_kernels=True)``, 5.25's default; ``USE_HUB_KERNELS=0`` turns it off), which leaves its
    repository in the instance's ``_kernel_repo``. Kernels of the arithmetic (the chunked delta rule, the convolution,
    the SSD scan), which take the states as arguments, are no cause."""
    swapped = [("forward", module)] + [
        (name, f) for name, f in (module.__dict__.get("_kernel_funcs") or {}).items() if name.endswith("_forward")
    ]
    for name, owner in swapped:
        repo = getattr(owner, "__dict__", {}).get("_kernel_repo")
        if repo is not None:
            return (
                f"{own_class(module).__name__}'s {name} is a Hub kernel ({repo}, from use_kernels) that handles the "
                "cache itself: load the model with use_kernels=False or USE_HUB_KERNELS=0"
            )
    return None


def _stand_in(module: torch.nn.Module, got: list | None = None) -> torch.nn.Module:
    """``module``'s meta twin (its attributes kept) whose forward returns its first argument, keeping the keyword
    arguments of each call in ``got`` where given."""
    twin = meta_twin(module)

    def forward(*args, **kwargs):
        if got is not None:
            got.append(kwargs)
        return args[0] if args else kwargs.get("hidden_states")

    twin.forward = forward
    return twin


def reaches(module: torch.nn.Module, inner: list[torch.nn.Module], call: Callable) -> list[dict] | None:
    """The keyword arguments each module of ``inner`` (submodules of ``module``) is called with when ``call(twin)``
    runs ``module``'s meta twin, in the order of ``inner`` (a module called several times: its last call's); None
    where ``call`` raised or some module of ``inner`` was not called. In the twin, each module of ``inner`` and each
    other direct child of ``module`` (not a module list or dict, none of ``inner``'s ancestors) returns its first
    argument: only ``module``'s own forward runs (a decoder layer's norms and MoE block do not)."""
    got = {id(m): [] for m in inner}
    stand_ins = {id(m): _stand_in(m, got[id(m)]) for m in inner}
    held = {id(d) for m in module.children() for d in m.modules() if id(d) in got}
    for child in module.children():
        plain = not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict))
        if id(child) not in stand_ins and plain and not any(id(d) in held for d in child.modules()):
            stand_ins[id(child)] = _stand_in(child)
    try:
        with torch.inference_mode(False), torch.no_grad():
            call(meta_twin(module, stand_ins))
    except Exception:  # the module's own code with stand-ins on the meta device: no answer
        return None
    calls = [got[id(m)] for m in inner]
    return None if not all(calls) else [c[-1] for c in calls]

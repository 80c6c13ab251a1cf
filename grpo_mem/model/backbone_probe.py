"""How a backbone runs its decoder layers: observed by running its forward on stand-ins, not read from its source.

grpo_mem's context reaches each attention call as a keyword argument the backbone hands its layers
(``attention_hook``), and a prompt pass records one K/V per layer, so each layer must run once per forward. Both are
questions of behaviour. ``layer_calls`` runs the backbone's own forward (its class's, on a twin: ``meta_twin``; the
user's module is untouched, no hook of theirs or collective runs, nothing of the model's size is allocated) over
zero CPU hidden states (``inputs_embeds``, no attention mask), with each layer of the named layer lists replaced by a
stand-in that returns its input and records the keywords of every call, the input embeddings by a stand-in, and every
other child (final norm, rotary embeddings, per-layer-type rotary lists, ...) by a CPU copy of its own class with its
weights, buffers and tensors zeroed (a stand-in where that copy would hold more than 2^20 elements). The numbers are
the run-time confirmation's (``confirm``). ``language_model_calls`` observes what a vision-language forward hands
its language model the same way. This module knows torch and transformers' attention registry.
"""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_hook import CTX_KWARG, _ConfigView, own_class
from .recurrent_probe import _meta, _stand_in, meta_twin

__all__ = [
    "ARGS",
    "GIVEN",
    "PROBE_TOKEN",
    "AttentionCalls",
    "LayerRun",
    "attention_calls",
    "language_model_calls",
    "layer_calls",
]

PROBE_TOKEN = "grpo_mem_probe"
"""The value of the context keyword the backbone is called with: a layer call that holds it was handed it."""

_TOKENS = 4
ARGS = "*args"  # the key under which a layer call's positional arguments after the hidden states are recorded
# the key under which ``language_model_calls`` records whether the positions given were handed on
GIVEN = "position_ids given"
_LARGEST = 1 << 20  # elements of a child copied to the CPU; a larger one becomes a stand-in
_LARGEST_ATTENTION = 1 << 27  # elements of an attention module copied (zeros) where it cannot run on meta


def _zero_own(module: torch.nn.Module, device="cpu") -> None:
    """Make ``module``'s own meta parameters, buffers and tensor attributes (not its children's) zeros on
    ``device``."""
    for kind in ("_parameters", "_buffers"):
        for key, value in module.__dict__[kind].items():
            if value is not None and value.device.type == "meta":
                zeros = torch.zeros(value.shape, dtype=value.dtype, device=device)
                module.__dict__[kind][key] = torch.nn.Parameter(zeros, False) if kind == "_parameters" else zeros
    for key, value in list(vars(module).items()):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            module.__dict__[key] = torch.zeros(value.shape, dtype=value.dtype, device=device)


def _zeroed_copy(child: torch.nn.Module, largest: int | None = None, device="cpu") -> torch.nn.Module:
    """A module of ``child``'s class and attributes whose parameters, buffers and tensor attributes are zeros of
    their full shapes on ``device``; where they exceed ``_LARGEST`` elements a stand-in returning its first argument,
    or, given ``largest``, ValueError past that many."""
    tensors = itertools.chain(child.parameters(), child.buffers())
    elements = sum(_meta(t).numel() for t in tensors)
    if elements > (largest or _LARGEST):
        if largest is not None:
            raise ValueError(f"{type(child).__name__} holds {elements} elements, more than a CPU copy may ({largest})")
        return _stand_in(child)
    twin = meta_twin(child)
    for module in twin.modules():
        _zero_own(module, device)
    return twin


def _layer_stand_in(layer: torch.nn.Module, got: list, pair: bool) -> torch.nn.Module:
    """``layer``'s meta twin whose forward records its keywords in ``got`` and returns its input, or (its input, None)
    where ``pair`` (a layer returning hidden states and attention weights, Bamba's)."""
    twin = meta_twin(layer)

    def forward(*args, **kwargs):
        got.append({**kwargs, ARGS: args[1:]})
        x = args[0] if args else kwargs.get("hidden_states")
        return (x, None) if pair else x

    twin.forward = forward
    return twin


def layer_calls(base: torch.nn.Module, lists: list[str], width: int) -> tuple[dict[int, list[dict]], str | None]:
    """The keyword arguments of every call of each layer in ``base``'s module lists named ``lists``, when ``base``'s
    forward runs once on stand-ins (see the module docstring) with the context keyword ``CTX_KWARG=PROBE_TOKEN``.

    Args:
        base: a transformers backbone (left untouched).
        lists: names of ``base``'s ``torch.nn.ModuleList`` children holding its decoder layers.
        width: the width of the hidden states its forward takes as ``inputs_embeds``.

    Returns:
        ({id(layer): [kwargs of each call, in order]}, None), or ({}, what the forward raised): a layer that was not
        run has an empty list.
    """
    layers = [layer for name in lists for layer in getattr(base, name)]
    try:
        embeddings = base.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        embeddings = None
    held = {id(getattr(base, name)) for name in lists}
    others = {}
    for child in base.children():
        if id(child) not in held:
            for member in list(child) if isinstance(child, torch.nn.ModuleList) else [child]:
                others[id(member)] = _stand_in(member) if member is embeddings else _zeroed_copy(member)
    hidden = torch.zeros(1, _TOKENS, width)
    error = None
    for pair in (False, True):  # a layer's output: its hidden states, or (hidden states, attention weights)
        got = {id(layer): [] for layer in layers}
        replace = {**others, **{id(layer): _layer_stand_in(layer, got[id(layer)], pair) for layer in layers}}
        twin = meta_twin(base, replace)
        _zero_own(twin)  # the backbone's own tensors (CTRL's position encoding)
        try:
            with torch.inference_mode(False), torch.no_grad():
                twin(inputs_embeds=hidden, use_cache=False, **{CTX_KWARG: PROBE_TOKEN})
        except Exception as e:  # noqa: BLE001 - the backbone's own code on stand-ins: named by the caller
            error = error or f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
            continue
        return got, None
    return {}, error


_IMPLEMENTATION = "grpo_mem_probe"  # registered only while ``attention_calls`` runs
_RECORDS: dict[int, AttentionCalls] = {}  # id(attention twin) -> its record, while ``attention_calls`` runs


@dataclass
class LayerRun:
    """What one run of a decoder layer on its twin observed (``attention_calls``).

    Attributes:
        attention: per attention module asked about, what it was handed and handed the attention interface.
        children: id(direct child of the layer) -> the keyword arguments its stand-in was last called with.
    """

    attention: list[AttentionCalls]
    children: dict[int, dict]


@dataclass
class AttentionCalls:
    """What one attention module did in one run of its decoder layer (``attention_calls``).

    Attributes:
        handed: the keyword arguments its forward was called with (None: it was not called).
        interface: the keyword arguments of each of its calls of an attention interface, in order.
        own_registry: whether a call looked its function up in a registry of its modeling file's own, not
            transformers' ``ALL_ATTENTION_FUNCTIONS`` (Doge's).
    """

    handed: dict | None = None
    interface: list[dict] = field(default_factory=list)
    own_registry: bool = False


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention interface while ``attention_calls`` runs: records the call's keywords, returns an empty
    (B, T, heads, value head_dim) output and no weights."""
    _RECORDS[id(module)].interface.append(kwargs)
    batch, heads, tokens = query.shape[:3]
    return query.new_empty(batch, tokens, heads, value.shape[-1]), None


def _recording_own(module, *args, **kwargs):
    """``_recording_attention`` for a call looked up in a modeling file's own registry: also notes that."""
    _RECORDS[id(module)].own_registry = True
    return _recording_attention(module, *args, **kwargs)


def _own_registries(attention: list[torch.nn.Module]) -> list:
    """The attention registries other than transformers' that the modeling files of ``attention`` hold as their
    ``ALL_ATTENTION_FUNCTIONS`` (a module attribute, as transformers' own is one)."""
    own = {}
    for module in attention:
        registry = getattr(sys.modules.get(own_class(module).__module__), "ALL_ATTENTION_FUNCTIONS", None)
        if registry is not None and registry is not ALL_ATTENTION_FUNCTIONS and hasattr(registry, "__setitem__"):
            own[id(registry)] = registry
    return list(own.values())


def _meta_of(value):
    """``value`` with every tensor, in tuples, lists and dicts too, an empty meta tensor of its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_meta_of(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta_of(v) for k, v in value.items()}
    return value


def _attention_twin(module: torch.nn.Module, record: AttentionCalls, device) -> torch.nn.Module:
    """``module``'s meta twin (given a ``device``: its zeroed copy there), its config naming the recording
    implementation, its forward recording its keywords."""
    twin = meta_twin(module) if device is None else _zeroed_copy(module, _LARGEST_ATTENTION, device)
    twin.__dict__["config"] = _ConfigView(module.config, _IMPLEMENTATION)
    own = type(twin).forward.__get__(twin)

    def forward(*args, **kwargs):
        record.handed = kwargs
        return own(*args, **kwargs)

    twin.forward = forward
    _RECORDS[id(twin)] = record
    return twin


def attention_calls(
    layer: torch.nn.Module, attention: list[torch.nn.Module], kwargs: dict, width: int
) -> tuple[LayerRun | None, str | None]:
    """What each module of ``attention`` (modules inside the decoder ``layer`` that may call an attention interface)
    is handed, and hands the attention interface, when ``layer``'s forward runs once on its twin.

    The layer is called with hidden states (1, 4, ``width``) and ``kwargs`` (what its backbone handed it,
    ``layer_calls``); its attention modules run their own forward up to a recording attention interface, every other
    direct child of the layer (norms, MLP, MoE block) is a stand-in returning its input (a tuple of it where the
    layer unpacks one). First on the meta device (nothing computed or allocated); where that raises (an attention module
    reading its data: JetMoE's mixture of attention heads routes by value; a RoPE function replaced by a kernel that
    takes no meta tensor: Liger's Triton kernel on CUDA), again with zeroed copies of the attention modules, in their
    dtype, on the device of their parameters (the CPU for meta ones), if each holds at most 2^27 elements; the
    hidden states and keywords follow them there. Each module's config names a recording implementation, registered in
    transformers' registry and in any registry of the modules' modeling files' own while this runs: a module that
    never calls the interface records no call. The user's modules are untouched.

    Returns:
        (a ``LayerRun``, None), or (None, what the layer's forward raised).
    """
    dtype = next((p.dtype for p in layer.parameters() if p.is_floating_point()), torch.float32)
    device = next((p.device for m in attention for p in m.parameters()), torch.device("cpu"))
    device = torch.device("cpu") if device.type == "meta" else device
    own = _own_registries(attention)
    ALL_ATTENTION_FUNCTIONS[_IMPLEMENTATION] = _recording_attention
    for registry in own:
        registry[_IMPLEMENTATION] = _recording_own
    try:
        hidden = torch.empty(1, _TOKENS, width, dtype=dtype, device="meta")
        records, error = _run_layer(layer, attention, _meta_of(kwargs), hidden, None)
        if error is not None:  # run on zeroed copies where the layer's code needs data or a real device
            hidden = torch.zeros(1, _TOKENS, width, dtype=dtype, device=device)
            records, error = _run_layer(layer, attention, _moved(kwargs, device, dtype), hidden, device)
        return records, error
    finally:
        del ALL_ATTENTION_FUNCTIONS[_IMPLEMENTATION]
        for registry in own:
            del registry[_IMPLEMENTATION]
        _RECORDS.clear()


def _moved(value, device, dtype):
    """``value`` with every tensor, in tuples, lists and dicts too, on ``device``, floating ones in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device, dtype) for k, v in value.items()}
    return value


def _run_layer(layer, attention, kwargs: dict, hidden: torch.Tensor, device):
    """``attention_calls``'s runs on ``hidden`` and ``kwargs`` (attention twins on the meta device, or zeroed copies on
    ``device``): (a ``LayerRun``, None) or (None, the error)."""
    outputs: dict[int, int] = {}  # id(child) -> how many values its stand-in returns (1: its input alone)
    last: list[int] = [0]  # the child whose stand-in ran last
    for _ in range(4):  # a child whose caller unpacks n values returns its input n times in the next run
        records = [AttentionCalls() for _ in attention]
        try:
            replace = {id(m): _attention_twin(m, r, device) for m, r in zip(attention, records, strict=True)}
        except ValueError as e:  # too large for a CPU copy
            return None, f"ValueError: {e}"
        held = {id(d) for child in layer.children() for d in child.modules() if id(d) in replace}
        seen: dict[int, dict] = {}
        for child in layer.children():
            plain = not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict))
            if id(child) not in replace and plain and not any(id(d) in held for d in child.modules()):
                replace[id(child)] = _repeating_stand_in(child, outputs, last, seen)
        handed = dict(kwargs)
        args = handed.pop(ARGS, ())
        try:
            with torch.inference_mode(False), torch.no_grad():
                meta_twin(layer, replace)(hidden, *args, **handed)
        except Exception as e:  # noqa: BLE001 - the layer's own code on its twin: named by the caller
            unpacked = _UNPACKED.search(str(e)) if isinstance(e, ValueError) else None
            if unpacked and last[0] and outputs.get(last[0], 1) == 1:
                outputs[last[0]] = int(unpacked.group(1))
                continue
            return None, f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        return LayerRun(records, seen), None
    return None, "the layer unpacks the outputs of its children in ways the stand-ins do not match"


_UNPACKED = re.compile(r"not enough values to unpack \(expected (\d+), got 1\)")


def _repeating_stand_in(
    module: torch.nn.Module, outputs: dict[int, int], last: list[int], seen: dict
) -> torch.nn.Module:
    """``module``'s meta twin returning its first argument, or a tuple of it ``outputs[id(module)]`` times; each
    call notes ``id(module)`` in ``last`` and its keywords in ``seen[id(module)]``."""
    twin = meta_twin(module)
    key = id(module)

    def forward(*args, **kwargs):
        last[0] = key
        seen[key] = kwargs
        x = args[0] if args else kwargs.get("hidden_states")
        n = outputs.get(key, 1)
        return x if n == 1 else (x,) * n

    twin.forward = forward
    return twin


class _LanguageModelOutput(BaseModelOutputWithPast):
    """The stand-in language model's output: its last hidden state, and None for any other field a forward reads
    (Gemma 4's ``shared_kv_states`` in transformers 5.23)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def language_model_calls(base: torch.nn.Module, name: str, width: int, vocab: int, avoid: set[int]):
    """The keyword arguments of every call of ``base``'s language model (its child ``name``) when ``base``'s forward
    (a vision-language base model's, on its twin: parameters on the meta device, nothing of the model's size
    allocated, the user's modules untouched) runs on a text prompt, twice: with ``position_ids`` 3 … 6, then with
    none. Each run gets ``input_ids`` (1, 4) of token ids below ``vocab`` outside ``avoid`` (image and other special
    tokens), no attention mask and the context keyword ``CTX_KWARG=PROBE_TOKEN``; the input embeddings are a
    stand-in returning zeros (1, 4, ``width``) on the CPU (a mask's construction reads the positions' values), the
    language model a stand-in recording its keywords and returning those embeddings as its last hidden state. Each
    record also holds ``ARGS``, its positional arguments, and ``GIVEN``, whether the ``position_ids`` handed on are
    the tensor given.

    Returns:
        ([kwargs of each call with positions given], [… with none given], None), or ([], [], what the forward
        raised).
    """
    runs: list[list[dict]] = []  # one list of calls per run
    given = torch.arange(3, 3 + _TOKENS)[None]
    language_model = getattr(base, name)
    embeddings = base.get_input_embeddings()
    zeros = meta_twin(embeddings)
    zeros.forward = lambda ids, *args, **kwargs: torch.zeros(*ids.shape, width)

    def forward(*args, **kwargs):
        runs[-1].append({**kwargs, ARGS: args, GIVEN: kwargs.get("position_ids") is given})
        embeds = kwargs.get("inputs_embeds")
        return _LanguageModelOutput(last_hidden_state=embeds if embeds is not None else args[0])

    twin_lm = meta_twin(language_model, {id(embeddings): zeros})
    twin_lm.forward = forward
    twin = meta_twin(base, {id(language_model): twin_lm, id(embeddings): zeros})
    ids = torch.tensor([[t for t in range(1, vocab) if t not in avoid][:_TOKENS]])
    try:
        with torch.inference_mode(False), torch.no_grad():
            for positions in ({"position_ids": given}, {}):
                runs.append([])
                twin(input_ids=ids, use_cache=False, **positions, **{CTX_KWARG: PROBE_TOKEN})
    except Exception as e:  # noqa: BLE001 - the model's own code on its twin: named by the caller
        return [], [], f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    return runs[0], runs[1], None

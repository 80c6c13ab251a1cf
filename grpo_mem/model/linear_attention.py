"""Gated DeltaNet layers (Qwen3.5, Qwen3-Next) and their kin on the prompt-once path: each node's states, handed on.

A Gated DeltaNet layer keeps per value head a recurrent state S (dk, dv), updated token by token by the gated delta rule
(Yang et al., "Gated Delta Networks", arXiv 2412.06464), and before it runs a causal depthwise convolution of kernel K
over the projected q/k/v. A row that continues a prompt (a trie node below the root, or a completion) must start where
the prompt ended: from S at the prompt's last token and the last K − 1 convolution inputs. transformers' layer reads
and writes these two states through its cache argument (``cache``; ``cache_params`` before transformers 5.24:
``get_conv_state`` / ``update_conv_state`` /
``get_recurrent_state`` / ``update_recurrent_state``; 5.25 also asks ``get_recurrent_states_to_keep`` and passes
``state_idx=``), so grpo_mem runs the layer's own forward with a cache of its own (``_HandOff``): its states are the
parents' (gathered by row, differentiable, so gradient flows back into the prompt), and it records the states each
node ends with. Kimi Delta Attention and the short convolutions of LFM2/LFM3 (a convolution state only) work the same
way.

Which layers: a candidate (``is_candidate``: an integer ``layer_idx`` and ``conv_kernel_size``, a cache parameter)
is admitted by what it does, not by its source (``hand_off_cause``): run once on its meta twin through this very
hand-off (``recurrent_probe``), it must write its states through the cache and its output must depend on the states
it is handed; the run-time confirmation (``confirm``) then compares the numbers on a tiny copy.

Padding. A pass holds right-padded spans, and a padding token would still move the state (its decay comes from the
zeroed hidden state plus a bias). The rows of a node pass are therefore re-laid for these layers only: rows starting
from a zero state (roots) go left-aligned into one call with their padding masked (zero inputs keep a zero state zero,
exactly as stock TRL's left padding does), rows starting from a parent's state go in one call per length (no padding).
The completion pass needs no final state: its right padding follows the real tokens and changes nothing they compute.

Gradient checkpointing: a replayed layer finds its context through the same ``grpo_mem_ctx`` token, recomputes the same
operations and records nothing new. ``LinearState`` is the window's pass extension that builds each pass's context and
keeps the states it records (``PromptStates.extras["linear"]``). This module knows torch and transformers' cache
protocol.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import attention_hook as attn_hook
from .attention_hook import WRAPPED_FORWARD, own_class
from .extension import PassExtension
from .recurrent_probe import CACHE_PARAMETERS, continues_cause, kernel_cause, observe

__all__ = [
    "LinearContext",
    "LinearState",
    "hand_off_cause",
    "hands_off_state",
    "install",
    "is_candidate",
    "linear_layers",
]


PADDING_BIAS = (
    "stock feeds it into the convolution at each left-padding position, so its prompts' first tokens depend on the "
    "batch's padding"
)
"""Why an input projection bias refuses a recurrent layer (``hand_off_cause``, ``mamba2_state``): the layer zeroes
its input at padding, the bias makes it nonzero again before the convolution reads it."""


@functools.lru_cache(maxsize=None)
def cache_parameter(cls: type) -> str | None:
    """The name under which ``cls.forward`` takes its cache (``cache``, ``cache_params`` or ``past_key_values``), from
    its signature (which transformers' ``deprecate_kwarg`` wrapper keeps through ``__wrapped__``); None when it takes
    none."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_PARAMETERS if name in params), None)


def is_candidate(module: torch.nn.Module) -> bool:
    """Whether ``module`` looks like a recurrent layer transformers runs with a cache: an integer ``layer_idx``, an
    integer ``conv_kernel_size`` and a forward taking a cache parameter (``cache_parameter``); what it does with the
    cache is ``hand_off_cause``'s question."""
    return (
        isinstance(getattr(module, "layer_idx", None), int)
        and isinstance(getattr(module, "conv_kernel_size", None), int)
        and cache_parameter(own_class(module)) is not None
    )


def _bind(twin: torch.nn.Module, original: Callable) -> Callable:
    return _LayerForward(twin).bind(original, cache_parameter(own_class(twin)), {})


def hand_off_cause(module: torch.nn.Module, width: int | None = None) -> str | None:
    """Why the states of ``module`` (``is_candidate``) cannot be handed from a prompt to its continuations by running
    its own forward with grpo_mem's cache (``_HandOff``), or None; ``width``: its input width, where it has no
    integer ``hidden_size``.

    Decided by behaviour (``recurrent_probe``): run once on its meta twin through the call that serves it, the layer
    must write a convolution state through its cache and, if it reads a recurrent state, write one, and its output over
    several tokens and over one must depend on each state it is handed (Gated DeltaNet, Kimi Delta Attention: both;
    LFM2/LFM3 short convolutions: the convolution state only); a forward or state function swapped for a Hub kernel is
    refused by name (``recurrent_probe.kernel_cause``). An input projection with a bias (a ``torch.nn.Linear`` child
    other than the output projection, read from the module: LFM2's ``conv_bias=True``) is refused by name: the layer
    zeroes its input at left padding but the projection adds its bias there, which the convolution then reads, so
    stock's scores of a prompt's first K − 1 tokens depend on how much padding precedes it in the batch."""
    name = f"{own_class(module).__name__} (layer {module.layer_idx})"
    biased = [
        child
        for child, m in module.named_children()
        if isinstance(m, torch.nn.Linear) and m.bias is not None and not child.startswith(("out_proj", "o_proj"))
    ]
    if biased:
        return f"{name} has an input projection bias ({biased[0]}.bias): {PADDING_BIAS}"
    cause = kernel_cause(module)
    if cause is None:
        cause = continues_cause(name, observe(module, "linear", _bind, _HandOff, width))
    return cause


def claims(module: torch.nn.Module) -> bool:
    """Whether this module serves the recurrent layer ``module`` (``mechanisms.RECURRENT``): every candidate
    (``is_candidate``) the state-space kinds before it left."""
    return is_candidate(module)


state_cause = hand_off_cause  # the kind's admission answer (``mechanisms.Recurrent.state_cause``)


def hands_off_state(module: torch.nn.Module, width: int | None = None) -> bool:
    """Whether ``module`` is a layer whose states grpo_mem hands from a prompt to its continuations through the
    layer's own forward: a candidate (``is_candidate``) that is no state-space mixer (an integer ``ssm_state_size``:
    ``mamba_state``, ``mamba2_state``) and that ``hand_off_cause`` admits."""
    if not is_candidate(module) or isinstance(getattr(module, "ssm_state_size", None), int):
        return False
    return hand_off_cause(module, width) is None


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``hands_off_state`` recognises."""
    return [m for m in model.modules() if hands_off_state(m)]


# ----------------------------------------------------------------------------------------------------------------------
# the cache handed to a layer


class _HandOff:
    """The cache protocol of transformers' linear-attention layers, for one layer call over ``n`` rows.

    ``conv`` (n, conv_dim, K − 1) and ``recurrent`` (n, Hv, dk, dv) are the rows' initial states, or both None (zero
    states). After the call, ``final_conv`` (n, conv_dim, K − 1) and ``final_recurrent`` (n, Hv, dk, dv, fp32 as the
    delta rule computes it) hold the states after the call's last token; a short convolution has no recurrent state
    (``recurrent`` and ``final_recurrent`` stay None).
    """

    def __init__(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None):
        self.conv, self.recurrent = conv, recurrent
        self._final_conv: torch.Tensor | None = None
        self._read_conv: torch.Tensor | None = None
        self.final_recurrent: torch.Tensor | None = None

    @property
    def final_conv(self) -> torch.Tensor | None:
        """The convolution state after the call: what ``update_conv_state`` kept, or, for a layer that took its
        single-token path (KDA updates the state it read in place, ``causal_conv1d_update``), the state it read."""
        return self._final_conv if self._final_conv is not None else self._read_conv

    @final_conv.setter
    def final_conv(self, state: torch.Tensor | None) -> None:
        self._final_conv = state

    def get_conv_state(self, layer_idx, state_idx=0):
        if self.conv is None:
            return None
        # a copy: a single-token path writes the new state into what it read (autograd records the write)
        self._read_conv = self.conv.clone()
        return self._read_conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def is_recording_past(self, layer_idx):
        return True  # never the in-place single-token update: states here are graph nodes, not buffers

    def update_conv_state(self, conv_inputs, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        """``conv_inputs`` (n, conv_dim, L) preceded by the initial state: what the causal convolution reads."""
        full = conv_inputs if self.conv is None else torch.cat([self.conv.to(conv_inputs.dtype), conv_inputs], -1)
        keep = conv_kernel_size - 1  # the inputs a continuation's first token convolves with, zeros before the start
        padded = F.pad(full, (max(0, keep - full.shape[-1]), 0))
        self._final_conv = padded[..., padded.shape[-1] - keep :]
        return full

    def update_recurrent_state(self, recurrent, layer_idx, state_idx=0, **kwargs):
        self.final_recurrent = recurrent
        return recurrent

    def get_recurrent_states_to_keep(self, layer_idx=None):
        """0: no state after an intermediate token is kept (transformers 5.25 asks before its chunked scans, for
        speculative decoding); only the state after the call's last token, through ``update_recurrent_state``."""
        return 0

    def increase_count(self, layer_idx, state_idx=0):
        """Nothing to count: transformers 5.25 calls it beside the in-place single-token convolution update, which
        ``is_recording_past`` never lets a layer take here."""


# ----------------------------------------------------------------------------------------------------------------------
# a pass's context


def _gather(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], rows: torch.Tensor, batch: int):
    """(len(rows), ...): each reader row's entry in the part that names it. ``parts``: (source (m, ...), reader rows
    (k,), source rows (k,)), int64 index tensors on the CPU; every row of ``rows`` is named by exactly one part."""
    part_of = torch.full((batch,), -1, dtype=torch.long)
    entry_of = torch.full((batch,), -1, dtype=torch.long)
    for i, (_, readers, entries) in enumerate(parts):
        part_of[readers], entry_of[readers] = i, entries
    part, entry = part_of[rows], entry_of[rows]
    used = part.unique().tolist()
    pieces = [parts[i][0].index_select(0, entry[part == i].to(parts[i][0].device)) for i in used]
    if len(pieces) == 1:
        return pieces[0]
    order = torch.cat([(part == i).nonzero()[:, 0] for i in used])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return torch.cat(pieces).index_select(0, inverse.to(pieces[0].device))


@dataclass
class LinearContext:
    """What the linear-attention layers of one pass need (``attention_hook`` contexts carry it as ``.linear``).

    Attributes:
        batch: rows of the pass.
        lengths: real tokens of each row (right padding after them), or None for the completion pass (no state is
            recorded; rows may be right-padded freely).
        sources: where rows start: (per layer ``(conv, recurrent)`` of a parent pass, reader rows (k,) int64, rows of
            that pass (k,) int64); a row named by no source starts from zero states. The states of a source are those
            of ``PromptStates.extras["linear"]``: conv (m, conv_dim, K − 1), recurrent (m, Hv, dk, dv).
        capture: per layer, ``(conv, recurrent)`` at each row's last real token, (batch, ...), once recorded; None: not
            recorded.
    """

    batch: int
    lengths: list[int] | None
    sources: list[tuple[dict, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    capture: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self):
        for _, readers, _ in self.sources:
            if len(readers) and (int(readers.min()) < 0 or int(readers.max()) >= self.batch):
                raise ValueError(f"source reader rows must lie in [0, {self.batch}), got {readers.tolist()}")
        if self.lengths is not None and len(self.lengths) != self.batch:
            raise ValueError(f"lengths must name {self.batch} rows, got {len(self.lengths)}")
        started = torch.zeros(self.batch, dtype=torch.bool)
        for _, readers, _ in self.sources:
            started[readers.cpu()] = True
        self._started = started.tolist()

    def _initial(self, layer: int, rows: torch.Tensor):
        """(conv, recurrent) initial states of ``rows`` (all started, or all from zero: then (None, None)); recurrent
        is None for a layer without one (a short convolution)."""
        if not self._started[int(rows[0])]:
            return None, None
        conv = _gather([(s[layer][0], r, e) for s, r, e in self.sources], rows, self.batch)
        if any(s[layer][1] is None for s, _, _ in self.sources):
            return conv, None
        recurrent = _gather([(s[layer][1], r, e) for s, r, e in self.sources], rows, self.batch)
        return conv, recurrent

    def _groups(self) -> list[list[int]]:
        """Rows called together: every row from zero states in one call, the others by length."""
        zero = [b for b in range(self.batch) if not self._started[b]]
        by_length: dict[int, list[int]] = {}
        for b in range(self.batch):
            if self._started[b]:
                by_length.setdefault(self.lengths[b], []).append(b)
        return ([zero] if zero else []) + list(by_length.values())

    def run(self, layer_call: Callable, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output (batch, S, H) on the pass's right-padded hidden states ``hidden`` (batch, S, H), zero at
        padding of node passes; records the final states when ``capture`` is not None. ``layer_call(x, cache,
        attention_mask)``: the layer's own forward with its other keyword arguments bound."""
        if self.lengths is None:  # completion pass: every row continues its prompt, no state recorded
            cache = _HandOff(*self._initial(layer, torch.arange(self.batch)))
            return layer_call(hidden, cache, None)
        groups = self._groups()
        outputs, finals = [], []
        for group in groups:
            y, cache = self._run_group(layer_call, layer, hidden, group)
            outputs.append(y)
            finals.append((cache.final_conv, cache.final_recurrent))
        order = torch.tensor([b for group in groups for b in group])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(self.batch)
        if self.capture is not None:
            states = []
            for parts in zip(*finals):  # conv, then recurrent (None throughout for a short convolution)
                if parts[0] is None:
                    states.append(None)
                    continue
                t = torch.cat(parts) if len(parts) > 1 else parts[0]
                states.append(t.index_select(0, inverse.to(t.device)))
            self.capture.setdefault(layer, tuple(states))
        out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        return out.index_select(0, inverse.to(out.device))

    def _run_group(self, layer_call, layer, hidden, group):
        """One layer call over the rows ``group`` of the pass, left-aligned to their longest (padding masked, so a
        zero state stays zero through it); returns their output right-padded to the pass's width and the cache."""
        device, (S, H) = hidden.device, hidden.shape[1:]
        rows = torch.tensor(group)
        lengths = torch.tensor([self.lengths[b] for b in group])
        width = int(lengths.max())
        shift = (width - lengths)[:, None]  # position j of the call holds token j − shift of the row
        real = torch.arange(width)[None, :] >= shift
        x = hidden.index_select(0, rows.to(device))
        if not bool(real.all()) or width != S:
            source = (torch.arange(width)[None, :] - shift).clamp(min=0)
            x = x.gather(1, source.to(device)[..., None].expand(-1, -1, H))
        cache = _HandOff(*self._initial(layer, rows))
        y = layer_call(x, cache, None if bool(real.all()) else real.to(device))
        keep = torch.arange(S)[None, :] < lengths[:, None]
        if not bool(keep.all()) or width != S:
            back = (torch.arange(S)[None, :] + shift).clamp(max=width - 1)
            y = y.gather(1, back.to(device)[..., None].expand(-1, -1, y.shape[2]))
            y = y * keep.to(device=device, dtype=y.dtype)[..., None]
        return y, cache


# ----------------------------------------------------------------------------------------------------------------------
# the forward wrapper


class _LayerForward:
    """The forward ``install`` gives a linear-attention layer: ``__call__(hidden_states, *args, **kwargs)``.

    Bound to ``module`` and closing over nothing else (the layer's previous instance forward stays in its
    ``__dict__`` under ``attention_hook.WRAPPED_FORWARD``, read at each call), so that ``copy.deepcopy`` and ``pickle``
    (``__reduce__``) give a copy of the layer whose forward is bound to the copy and computes with the copy's
    weights."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __reduce__(self):
        return _LayerForward, (self.module,)

    @property
    def __signature__(self):
        return inspect.signature(self._original())

    def _original(self) -> Callable:
        own = self.module.__dict__.get(WRAPPED_FORWARD)
        return own if own is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, hidden_states, *args, **kwargs):
        module, original = self.module, self._original()
        token = kwargs.pop(attn_hook.CTX_KWARG, None)
        if token is None:
            return original(hidden_states, *args, **kwargs)
        ctx = attn_hook.lookup_context(token)
        linear = getattr(ctx, "linear", None)
        if not isinstance(linear, LinearContext):
            raise RuntimeError(
                f"grpo_mem: linear-attention layer {module.layer_idx} got context {token!r} without linear-attention "
                "states (freed before its layer was replayed, or built without them)"
            )
        if args or any(kwargs.get(name) is not None for name in CACHE_PARAMETERS):
            raise ValueError("grpo_mem: a pass with a grpo_mem context must not carry a cache (use_cache=False)")
        for name in (*CACHE_PARAMETERS, "attention_mask"):
            kwargs.pop(name, None)
        layer_call = self.bind(original, cache_parameter(own_class(module)), kwargs)
        return linear.run(layer_call, module.layer_idx, hidden_states)

    def bind(self, original: Callable, cache_name: str, kwargs: dict) -> Callable:
        """``layer_call(x, cache, attention_mask)`` for ``LinearContext.run``: ``original`` with ``kwargs`` and the
        cache (a ``_HandOff``) under ``cache_name``."""

        def layer_call(x, cache, attention_mask):
            return original(x, **{cache_name: cache}, attention_mask=attention_mask, **kwargs)

        return layer_call


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its layers ``hands_off_state`` recognises


def install(model: torch.nn.Module) -> int:
    """Wrap the forward of every layer of ``model`` that ``hands_off_state`` recognises (idempotent): a call with a
    context token (``attention_hook.CTX_KWARG``) runs the context's ``linear`` (a ``LinearContext``); any other call
    runs the layer's forward unchanged. ``attention_hook.restore_forwards`` undoes it. Returns how many layers are
    wrapped. The layers are found once per model."""
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = linear_layers(model)
    wrap(layers, _LayerForward)
    return len(layers)


def wrap(layers: list[torch.nn.Module], wrapper: type[_LayerForward]) -> None:
    """Give each module of ``layers`` not wrapped yet the forward ``wrapper(module)``, keeping its own instance
    forward (or None) under ``attention_hook.WRAPPED_FORWARD``."""
    for module in layers:
        if WRAPPED_FORWARD not in module.__dict__:
            module.__dict__[WRAPPED_FORWARD] = module.__dict__.get("forward")
            module.forward = wrapper(module)


_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the recurrent kinds it may hold


class LinearState(PassExtension):
    """The window's pass extension for a model with linear-attention layers (``mechanisms.has_recurrent``): each
    pass's context carries a ``LinearContext`` whose rows start from the states their parent node (a completion row:
    its leaf) ended with, and each node pass keeps the states its rows end with (``PromptStates.extras["linear"]``).

    Build with ``extension(causal_lm)``, which wraps the model's recurrent layers first."""

    name = "linear"

    def context(self, mb, starts, lengths, release):
        batch = len(starts) if lengths is None else len(lengths)
        sources = mb.window.table.sources(starts, release, mb)
        parts = [(states.extras.get(self.name, {}), readers, rows) for states, readers, rows in sources]
        capture = None if lengths is None else {}
        return {"linear": LinearContext(batch=batch, lengths=lengths, capture=capture, sources=parts)}

    def record(self, mb, out, ctx, keeper, tokens):
        captured = ctx.linear.capture or {}
        return {
            i: tuple(None if t is None else attn_hook.keep_alive(t, ctx) for t in pair) for i, pair in captured.items()
        }


def extension(causal_lm: torch.nn.Module, call=None) -> LinearState:
    """The recurrent-state mechanism's pass extension (``mechanisms.TABLE``): every recurrent kind of
    ``mechanisms.RECURRENT`` whose ``hint`` some module of ``causal_lm`` meets wraps its layers (``install``; the
    kinds are found once per model, a kind's module imported only for a model that may hold it), then a
    ``LinearState``, whose contexts every kind's wrapped layers read."""
    from . import mechanisms

    kinds = _KINDS.get(causal_lm)
    if kinds is None:
        modules = list(causal_lm.modules())
        kinds = _KINDS[causal_lm] = tuple(k for k in mechanisms.RECURRENT if any(k.hint(m) for m in modules))
    for kind in kinds:
        kind.install(causal_lm)
    return LinearState()

"""Mamba-2 (SSD) mixers on the prompt-once path: each node's convolution and SSM state at its end, handed on.

A Mamba-2 mixer (Dao & Gu, "Transformers are SSMs", arXiv 2405.21060) projects each token to a gate z, the convolution
inputs xBC and a step dt, runs a causal depthwise convolution of kernel K over xBC, and then the selective state-space
scan over heads: per head h the state S_h (head_dim, d_state) evolves as S_t = exp(dt_t A_h) S_{t−1} + dt_t x_t B_tᵀ
and the output is y_t = S_t C_t + D_h x_t. A row that continues a prompt (a trie node below the root, or a completion)
must start where the prompt ended: from S at the prompt's last token and the last K − 1 convolution inputs.

transformers' mixers (``Mamba2Mixer``, and the copies ``NemotronHMamba2Mixer``, ``BambaMixer``,
``GraniteMoeHybridMambaLayer``, ``FalconH1Mixer``, ``Zamba2MambaMixer``) read and write both states through their cache
argument with the protocol of the Gated DeltaNet layers, and their chunked scan (``mamba2_chunk_scan``, the SSD
algorithm's ``initial_states`` slot) continues a segment of any length from the state read (transformers 5.25 moved
both into shared ``causal_conv1d_forward`` / ``mamba2_scan_forward`` functions; the protocol is the same). So grpo_mem
runs the mixer's own forward with the hand-off cache of ``linear_attention`` (``_HandOff``, driven by its
``LinearContext``): its states are the parents' (gathered by row, differentiable), and it records the states each node
ends with. A mixer is one by its interface (``is_ssd_mixer``: the integer attributes of a Mamba-2 mixer) and is
admitted by its behaviour on its meta twin through ``SSDForward`` (``_mixer_cause``, ``recurrent_probe``).

One call differs: a single-token segment with a state takes the mixer's recurrent form
(``mamba2_selective_state_update``), which writes the new SSM state in place (``state.copy_``) after reading it for
the output: into the state it was given (transformers 5.24) or into a clone of it that it then hands to the cache
(5.25). An in-place write into a tensor the output's graph saved would fail autograd, so the state handed to such a
call is a ``_RecordedState`` view of the parent's state, whose ``copy_`` (and its clones' ``copy_``) is recorded as
the call's final state instead of performed: the output's graph keeps the state it read, the record is the new
state's graph node.

Padding is stock's, exactly: a left-padded prompt's padding is masked by the mixer (``apply_mask_to_padding_states``)
before its input projection and after its convolution, so its x and B are zero and a zero state stays zero through it
(the decay exp(dt A) of a zero state is zero); ``LinearContext`` lays rows out so that no padding follows a real token
of a node pass. A mixer whose input projection has a bias would feed that bias into the convolution at every padding
position, so the number of stock's padding tokens would matter: refused (``ssd_cause``).

This module knows torch and transformers' cache protocol; it is imported only for a model with such mixers.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .attention_hook import own_class
from .linear_attention import PADDING_BIAS, _HandOff, _LayerForward, cache_parameter, is_candidate, wrap
from .recurrent_probe import continues_cause, kernel_cause, observe

__all__ = ["SSDForward", "hands_off_ssd_state", "install", "is_ssd_mixer", "ssd_cause", "ssd_layers"]

_SSD_ATTRIBUTES = ("layer_idx", "conv_kernel_size", "ssm_state_size", "num_heads", "head_dim", "chunk_size")


def is_ssd_mixer(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a Mamba-2 mixer's interface: integer ``_SSD_ATTRIBUTES`` and a forward taking a cache
    (``linear_attention.is_candidate``); what it does with the cache is ``_mixer_cause``'s question."""
    return all(isinstance(getattr(module, a, None), int) for a in _SSD_ATTRIBUTES) and is_candidate(module)


def _bind(twin: torch.nn.Module, original) -> object:
    return SSDForward(twin).bind(original, cache_parameter(own_class(twin)), {})


def _mixer_cause(module: torch.nn.Module) -> str | None:
    """Why the states of the Mamba-2 mixer ``module`` cannot be handed on exactly, or None: an input projection bias
    (read from the module), a Hub kernel handling its cache (``recurrent_probe.kernel_cause``), or what it does when
    run once on its meta twin through ``SSDForward`` (``recurrent_probe.continues_cause``: it must write both states
    through its cache, and its output over several tokens and over one must depend on both states it is handed)."""
    if getattr(getattr(module, "in_proj", None), "bias", None) is not None:
        return f"{type(module).__name__} has an input projection bias: {PADDING_BIAS}"
    name = f"{own_class(module).__name__} (layer {module.layer_idx})"
    return kernel_cause(module) or continues_cause(name, observe(module, "ssd", _bind, _HandOff))


claims = is_ssd_mixer  # the kind's interface (``mechanisms.RECURRENT``)


def state_cause(module: torch.nn.Module, width: int | None = None) -> str | None:
    """``_mixer_cause`` (``mechanisms.Recurrent.state_cause``; a mixer's input width is its own)."""
    return _mixer_cause(module)


def hands_off_ssd_state(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Mamba-2 mixer whose states grpo_mem hands from a prompt to its continuations
    (``is_ssd_mixer`` and no cause of its own)."""
    return is_ssd_mixer(module) and _mixer_cause(module) is None


def ssd_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``hands_off_ssd_state`` recognises."""
    return [m for m in model.modules() if hands_off_ssd_state(m)]


def ssd_cause(model: torch.nn.Module) -> str | None:
    """Why a Mamba-2 mixer of ``model`` cannot hand its states on (the first such mixer's cause), or None."""
    return next((c for m in model.modules() if is_ssd_mixer(m) and (c := _mixer_cause(m)) is not None), None)


# ----------------------------------------------------------------------------------------------------------------------
# the cache a mixer call gets


class _RecordedState(torch.Tensor):
    """A view of an SSM state (n, heads, head_dim, d_state) handed to a single-token call: ``copy_`` into it records
    its source as the call's final state (on ``_sink``, a ``_SSDCache``) and leaves the view as it is; every other
    operation computes on it as on a plain tensor and returns plain tensors."""

    _sink: _SSDCache

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[0], _RecordedState):
            args[0]._sink.final_recurrent = args[1]
            return args[0]
        if func is torch.Tensor.clone and isinstance(args[0], _RecordedState):  # transformers 5.25 writes into a clone
            return _recorded(_plain(super().__torch_function__(func, types, args, kwargs)), args[0]._sink)
        return _plain(super().__torch_function__(func, types, args, kwargs))


def _recorded(state: torch.Tensor, sink: _SSDCache) -> _RecordedState:
    """``state`` as a ``_RecordedState`` whose writes go to ``sink``."""
    view = state.as_subclass(_RecordedState)
    view._sink = sink
    return view


def _plain(value):
    """``value`` (a tensor, or a tuple or list of them) with each ``_RecordedState`` as a plain tensor view."""
    if isinstance(value, _RecordedState):
        return value.as_subclass(torch.Tensor)
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    return value


class _SSDCache:
    """``_HandOff``'s protocol for one Mamba-2 mixer call: the convolution state and the chunked scan's final SSM state
    go to ``hand_off`` (a ``linear_attention._HandOff``) as they do for Gated DeltaNet; in a single-token call the
    SSM state is a ``_RecordedState``, whose recorded write becomes ``hand_off``'s final state."""

    def __init__(self, hand_off: _HandOff, single_token: bool):
        self.hand_off, self.single_token = hand_off, single_token

    @property
    def final_recurrent(self):
        return self.hand_off.final_recurrent

    @final_recurrent.setter
    def final_recurrent(self, value):
        self.hand_off.final_recurrent = value

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.hand_off.get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx, state_idx=0):
        state = self.hand_off.get_recurrent_state(layer_idx, state_idx)
        if state is None or not self.single_token:
            return state
        return _recorded(state, self)

    def is_recording_past(self, layer_idx):
        return True  # the convolution state goes through update_conv_state, never the in-place single-token update

    def update_conv_state(self, conv_inputs, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        return self.hand_off.update_conv_state(conv_inputs, layer_idx, state_idx, conv_kernel_size, **kwargs)

    def update_recurrent_state(self, recurrent, layer_idx, state_idx=0, **kwargs):
        """The state after the call; a ``_RecordedState`` (transformers 5.25's single-token form hands back the clone
        it wrote into) stands for the write recorded into it, if any."""
        if isinstance(recurrent, _RecordedState):
            return self.final_recurrent
        return self.hand_off.update_recurrent_state(recurrent, layer_idx, state_idx, **kwargs)

    def get_recurrent_states_to_keep(self, layer_idx=None):
        return self.hand_off.get_recurrent_states_to_keep(layer_idx)

    def increase_count(self, layer_idx, state_idx=0):
        return self.hand_off.increase_count(layer_idx, state_idx)


MIN_CHUNK = 16
"""The shortest chunk ``fitted_chunk`` gives a scan: Triton's matrix products (mamba_ssm's fused scan) take tiles of at
least 16 along each dimension."""


def chunk_for(chunk_size: int, length: int) -> int:
    """The chunk a segment of ``length`` tokens is scanned in by a mixer whose chunk is ``chunk_size``: the smallest
    power of two >= ``length``, at least ``MIN_CHUNK``, at most ``chunk_size`` (``chunk_size`` itself when it is
    shorter than ``MIN_CHUNK`` or ``length`` reaches it)."""
    if length >= chunk_size or chunk_size <= MIN_CHUNK:
        return chunk_size
    return min(chunk_size, max(MIN_CHUNK, 1 << (length - 1).bit_length()))


@contextlib.contextmanager
def fitted_chunk(module: torch.nn.Module, length: int):
    """Run ``module`` (a Mamba-2 mixer) with its ``chunk_size`` set to ``chunk_for(chunk_size, length)`` for a call on
    segments of ``length`` tokens, restored after.

    The SSD scan's output does not depend on the chunk length: chunking splits one sum (the semiseparable matrix's
    products, Dao & Gu, arXiv 2405.21060, section 6) into diagonal blocks and the states between them, so any chunk
    gives the same values up to rounding (stock's own rows put chunk boundaries at other tokens than a prompt-once
    pass does already). What the chunk changes is cost: transformers' torch scan (``mamba2_chunk_scan`` without
    mamba_ssm, transformers 5.24) pads each row to a multiple of the chunk and keeps (chunk, chunk) blocks per head,
    chunk values a token, for backward. A completion pass of C = 64 tokens under Nemotron-H's chunk of 128 would pay
    twice its tokens and twice the cost a token; prompt-once passes are short segments (completions, trie nodes),
    stock's rows are long ones."""
    chunk_size = module.chunk_size
    module.chunk_size = chunk_for(chunk_size, length)
    try:
        yield
    finally:
        module.chunk_size = chunk_size


class SSDForward(_LayerForward):
    """The forward ``install`` gives a Mamba-2 mixer: as ``_LayerForward`` (the pass's
    ``LinearContext`` runs it), its cache a ``_SSDCache`` over the context's hand-off, and no ``position_ids`` (a
    mixer has no positions; its decoder layer may hand them on in its keyword arguments)."""

    __slots__ = ()

    def __reduce__(self):
        return SSDForward, (self.module,)

    def bind(self, original, cache_name: str, kwargs: dict):
        """``_LayerForward.bind``, the mixer's cache a ``_SSDCache``; raises RuntimeError after a single-token call
        from a state that recorded no new SSM state."""
        kwargs.pop("position_ids", None)

        def layer_call(x, hand_off, attention_mask):
            single = x.shape[1] == 1 and hand_off.recurrent is not None
            cache = _SSDCache(hand_off, single)
            with fitted_chunk(self.module, x.shape[1]):
                out = original(x, **{cache_name: cache}, attention_mask=attention_mask, **kwargs)
            if single and hand_off.final_recurrent is None:
                raise RuntimeError(
                    f"grpo_mem: Mamba-2 mixer {self.module.layer_idx} wrote no SSM state in a single-token call "
                    "(its recurrent form no longer updates the state it is given with copy_)"
                )
            return out

        return layer_call


_MIXERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its mixers ``hands_off_ssd_state`` admits


def install(model: torch.nn.Module) -> int:
    """Wrap the forward of every Mamba-2 mixer of ``model`` that ``hands_off_ssd_state`` recognises with
    ``SSDForward`` (idempotent; ``attention_hook.restore_forwards`` undoes it): a call with a context token runs the
    context's ``linear`` (``linear_attention.LinearContext``), any other the mixer's forward unchanged. Returns how
    many mixers are wrapped; they are found once per model."""
    mixers = _MIXERS.get(model)
    if mixers is None:
        mixers = _MIXERS[model] = ssd_layers(model)
    wrap(mixers, SSDForward)
    return len(mixers)

"""The last decoder layer of a packed call runs a prompt's tokens only as far as their K/V.

A prompt or trie node forwarded in a packed call (``packed``) is read by later tokens through each layer's K/V only,
and by the head through each row's last token only (its final hidden state predicts the first completion token). In
the last decoder layer the rest of its work (attention output, output projection, MLP) is read by nobody: stock TRL
computes it too, but here it would be kept for backward, 1/L of the prompt's activations (the long-prompt benchmark's
largest unneeded term: 19 % of the peak with 4 layers, ``docs/benchmarks.md``). So the last layer runs twice, over
parts of the call's tokens:

1. over every node block's tokens, stopped inside the attention hook as soon as their K/V are recorded (``_KVOnly``
   raises ``_Recorded``: no attention, no output projection, no MLP);
2. over each node row's last token and the completion tokens: a last token is a block of its own that reads its
   row's ancestors as the row does, plus its own row's K/V recorded in step 1 before it, plus itself.

The model's final norm then sees those tokens only, and ``Cut`` says where each lies. Exact: every number that is read
is computed from the same inputs as before (the last token's own K/V are recomputed from the same hidden state).

It applies when the call's decoder stack is found (a ``ModuleList`` whose layer i holds a module with ``layer_idx``
i), its last layer is the one the model runs last (checked: no attention may run after it), every tensor the layer
is called with is per token as (1, T, ...) or (T,) or carries no T, and nothing else observes the layer's inside: no
hook on its submodules (DeepSpeed ZeRO-3's, accelerate's, a user's: the stop would skip their post-forward half), no
gradient checkpointing (there the layer keeps only its input anyway), no compiled or replaced ``forward``. Otherwise
the layer runs whole, as before. Passes run one call each (``Window.text_pass``: images, recurrent state, the router
loss, sequence parallelism) are not cut: a recurrent last layer must run every position for its state.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import attention_hook as attn_hook
from .host import known_index, to_device


@dataclass
class Prior:
    """Keys of a packed call that its queries do not hold: the blocks of an earlier call of the same layer
    (step 1 of ``Cut``, which recorded their K/V and stopped), at ``offsets`` of its (1, Hkv, Tp, d)
    ``key`` and ``value``."""

    blocks: list[attn_hook.CompletionContext]
    offsets: list[int]
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None


class _Recorded(Exception):
    """The K/V-only run of the last layer recorded its blocks' K/V: the rest of the layer is skipped."""


class _KVOnly:
    """Hook context of step 1: records each node block's K/V (views of the layer's keys and values), hands the
    layer's keys and values to step 2 (``prior``, a ``Prior``) and stops."""

    def __init__(self, packed_ctx, blocks: int, prior):
        self.packed, self.blocks, self.prior = packed_ctx, blocks, prior
        self.layer = None

    def attend(self, query, key, value, layer: int, kwargs: dict):
        for b in range(self.blocks):
            _, k, v = self.packed._rows(b, query, key, value)
            self.packed.blocks[b].capture.setdefault(layer, (k, v))
        self.layer, self.prior.key, self.prior.value = layer, key, value
        raise _Recorded


_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> its decoder stack or None


def decoder_stack(base) -> torch.nn.ModuleList | None:
    """The decoder layers of ``base`` (its language model's, for a vision-language model): the ``ModuleList`` whose
    layer i holds a module with ``layer_idx == i`` for every i, or None."""
    if base not in _STACKS:
        root = attn_hook.language_model_of(base)[1] or base
        found = None
        for module in root.modules():
            if (
                isinstance(module, torch.nn.ModuleList)
                and len(module)
                and all(
                    any(getattr(m, "layer_idx", None) == i for m in layer.modules()) for i, layer in enumerate(module)
                )
            ):
                found = module
                break
        _STACKS[base] = found
    return _STACKS[base]


def _observed(layer: torch.nn.Module) -> str | None:
    """Why ``layer``'s inside may not be stopped half-way or run twice, or None."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training:
        return "gradient checkpointing"
    if "forward" in vars(layer) or getattr(layer, "_compiled_call_impl", None) is not None:
        return "a replaced or compiled forward"
    for module in layer.modules():
        hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
        if module is not layer and (any(hooks) or hasattr(module, "_hf_hook")):
            return "hooks on its modules"
    return None


class _Unknown(Exception):
    """A tensor argument of the layer holds the sequence length where ``_cut_args`` does not know its meaning."""


def _cut_args(value, T: int, index):
    """``value`` (a layer argument, nested in tuples, lists and dicts) with each per-token tensor cut to ``index`` (a
    slice or an index tensor): (1, T, ...) along dim 1, integer (T,) along dim 0. Raises ``_Unknown`` for a tensor with T
    elsewhere in its shape."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == T:
            return value[:, index] if isinstance(index, slice) else value.index_select(1, index)
        if value.dim() == 1 and value.shape[0] == T and not value.is_floating_point():  # cache positions
            return value[index] if isinstance(index, slice) else value.index_select(0, index)
        if T in value.shape:
            raise _Unknown
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_cut_args(v, T, index) for v in value)
    if isinstance(value, dict):
        return {k: _cut_args(v, T, index) for k, v in value.items()}
    return value


_IDENTITY: dict[tuple[int, str], torch.Tensor] = {}  # (rows, device) -> arange(rows) there, marked in range


def _own_index(lengths: list[int], device, mask: torch.Tensor) -> torch.Tensor:
    """The index of step 2's region of each row's own earlier keys: row i reads entry i, or nothing (-1) where its
    last token is its first. Where every row has earlier keys it is one tensor per row count and device for the
    process, so a backend deriving per-index bookkeeping from it (the torch backend's entry groups, read back once
    per index tensor) does so once, not once per call."""
    if min(lengths) > 1:
        key = (len(lengths), str(device))
        if key not in _IDENTITY:
            _IDENTITY[key] = known_index(torch.arange(len(lengths)), device, mask)
        return _IDENTITY[key]
    own = torch.tensor([i if length > 1 else -1 for i, length in enumerate(lengths)], dtype=torch.long)
    return known_index(own, device, mask)


class Cut:
    """The last layer of one packed call run in two steps (module docstring); a context manager that puts the two
    steps in place of the layer's ``forward`` for the call.

    After the call, ``ran`` says whether it ran cut; then the final hidden states (T', H) hold, in order, each node
    block's rows' last tokens (``last(b)``) and then the blocks after the node blocks (from ``offset(b)``); else the
    call's (T, H) layout."""

    def __init__(self, layer: torch.nn.Module, packed_ctx, call, lengths: dict[int, list[int]], device):
        self.layer, self.packed, self.call, self.lengths, self.device = layer, packed_ctx, call, lengths, device
        self.ran = False
        self.keep = ()  # step 1's and step 2's contexts, alive for the call (the hook holds them weakly)
        self._firsts: dict[int, int] = {}
        blocks = len(lengths)
        self._rest = call.offsets[blocks] if blocks < len(call.blocks) else call.tokens  # where the node blocks end

    @classmethod
    def of(cls, base, packed_ctx, call, lengths: dict[int, list[int]], device) -> Cut | None:
        """The cut of ``call``'s last layer, or None where it does not apply (no node block leading the call, the
        decoder stack not found, or its last layer observed: ``_observed``)."""
        nodes = sorted(lengths)
        if not nodes or nodes != list(range(len(nodes))):
            return None
        stack = decoder_stack(base)
        if stack is None or _observed(stack[-1]) is not None:
            return None
        return cls(stack[-1], packed_ctx, call, lengths, device)

    def __enter__(self):
        inner = self.layer.forward

        def forward(*args, **kwargs):
            return self._forward(inner, args, kwargs)

        self.layer.forward = forward
        return self

    def __exit__(self, *exc):
        del self.layer.forward
        return False

    def _forward(self, inner, args, kwargs):
        packed, blocks = self.packed, len(self.lengths)
        if attn_hook.CTX_KWARG not in kwargs:
            return inner(*args, **kwargs)
        keep, index, second = self._second_step()
        try:
            head_args = _cut_args((args, kwargs), self.call.tokens, slice(0, self._rest))
            tail_args = _cut_args((args, kwargs), self.call.tokens, to_device(index, self.device))
        except _Unknown:
            return inner(*args, **kwargs)
        kv_only = _KVOnly(packed, blocks, second.prior)
        head_args[1][attn_hook.CTX_KWARG] = attn_hook.context_token(kv_only)
        try:
            inner(*head_args[0], **head_args[1])
        except _Recorded:
            pass
        else:  # the layer attends through no hooked attention: run it whole
            return inner(*args, **kwargs)
        tail_args[1][attn_hook.CTX_KWARG] = attn_hook.context_token(second)
        packed.after = kv_only.layer  # no attention may run after this layer (``PackedContext.attend``)
        self.ran, self.keep = True, (kv_only, second, keep)
        return inner(*tail_args[0], **tail_args[1])

    def _second_step(self):
        """(contexts kept alive, the call's token index of step 2, its ``packed.PackedContext``): each node block's last
        tokens (a block per node block) and then every token after the node blocks."""
        call, blocks = self.call, len(self.lengths)
        index, contexts, offsets, first = [], [], [], 0
        for b in range(blocks):
            ctx, lengths = call.blocks[b], torch.tensor(self.lengths[b], dtype=torch.long)
            n, S = ctx.key_mask.shape
            index.append(call.offsets[b] + torch.arange(n) * S + lengths - 1)
            before = torch.arange(S)[None, :] < (lengths - 1)[:, None]  # the row's own keys before its last token
            mask = to_device(before, self.device)
            region = attn_hook.Region(ctx.capture, _own_index(self.lengths[b], self.device, mask), mask, ctx.positions)
            last = to_device(lengths - 1, self.device)[:, None]
            contexts.append(
                attn_hook.CompletionContext(
                    regions=[*ctx.regions, region],
                    key_mask=torch.ones(n, 1, dtype=torch.bool, device=self.device),
                    positions=ctx.positions.gather(1, last),
                    reach=ctx.reach,
                )
            )
            offsets.append(first)
            self._firsts[b] = first
            first += n
        index.append(torch.arange(self._rest, call.tokens))
        for b in range(blocks, len(call.blocks)):
            contexts.append(call.blocks[b])
            offsets.append(first + call.offsets[b] - self._rest)
        prior = Prior(blocks=call.blocks[:blocks], offsets=call.offsets[:blocks])
        return contexts, torch.cat(index), type(self.packed)(blocks=contexts, offsets=offsets, prior=prior)

    def last(self, hidden: torch.Tensor, b: int) -> torch.Tensor:
        """(n, H): the final hidden states of node block ``b``'s rows' last tokens, from the cut call's ``hidden``."""
        first = self._firsts[b]
        return hidden[first : first + len(self.lengths[b])]

    def offset(self, b: int) -> int:
        """Where the tokens of block ``b`` (a block after the node blocks) start in the cut call's hidden states."""
        return self.call.offsets[b] - self._rest + sum(len(v) for v in self.lengths.values())

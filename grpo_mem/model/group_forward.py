"""Prompt-once group forward: completion log-probs and entropies with each unique prompt forwarded once.

Stock TRL forwards ``cat(prompt, completion)`` for every row. Here the unique prompts of a batch go through the model
once, with gradients, recording each layer's K/V; the completions then run as a second pass whose attention reads that
K/V (``grpo_mem.model.attention_hook``) at the positions stock TRL uses, ``arange(P + C)`` including left padding. The last
prompt position's hidden state predicts completion token 1; the completion pass only needs tokens 1..C-1, since the
last token predicts nothing that is scored.

This module knows transformers, not TRL.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import ModelOutput

from . import attention_hook as attn_hook
from .distributed import agree_fallback, lockstep, unwrap_causal_lm
from .head import completion_head
from .store import PromptStates, PromptStore, prompt_keys
from .support import full_sequence_logprobs, unsupported_reason, warn_fallback
from .tree_forward import TreeWindow, tree_logprobs

class _Tie(torch.autograd.Function):
    """``x`` unchanged; ``others`` join its graph with zero gradients, so their backward runs (and issues its
    collectives) although they contribute nothing."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def find_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group identical prompt rows.

    Two rows are the same prompt when their masks and their ids at unmasked positions agree; ids in padding slots are
    ignored. Rows of one prompt need not be adjacent.

    Args:
        prompt_ids: (B, P) int64 token ids.
        prompt_mask: (B, P) 0/1 or bool.

    Returns:
        first: (U,) int64, the first row of each unique prompt, in order of first appearance.
        inverse: (B,) int64 in [0, U), row b's unique prompt.
    """
    key = torch.where(prompt_mask.bool(), prompt_ids, torch.full_like(prompt_ids, -1))
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.full((int(inverse.max()) + 1,), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    order = torch.argsort(first)  # renumber unique prompts by first appearance
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return first[order], rank[inverse]


SHARING_MODES = ("tree", "group")


def check_sharing(sharing) -> str:
    """``sharing`` if it is a known sharing mode; raises ``ValueError`` naming it otherwise."""
    if sharing not in SHARING_MODES:
        raise ValueError(f"sharing must be one of {SHARING_MODES}, got {sharing!r}")
    return sharing


def validate_inputs(input_ids, attention_mask, logits_to_keep, temperature) -> None:
    """Raise ``ValueError``/``TypeError`` for inputs stock TRL would score wrongly or not at all."""
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
    prompt_mask = attention_mask[:, : input_ids.shape[1] - logits_to_keep].bool()
    right_padded = (prompt_mask[:, :-1] & ~prompt_mask[:, 1:]).any(dim=1)
    if bool(right_padded.any()):
        rows = right_padded.nonzero().flatten().tolist()
        raise ValueError(
            f"prompts must be left-padded (a 1 in the prompt mask followed by a 0), rows {rows[:8]} are not"
        )


@dataclass
class GroupRequest:
    """Non-tensor options of one prompt-once call, passed to the model forward as the ``grpo_mem`` kwarg.

    ``store``/``later``: in a training micro-batch of a ``SharingSession`` window, the window's ``PromptStore`` and
    the keys (``prompt_keys``) of prompts that a later micro-batch of the same window will use again.
    ``lockstep``: the model is sharded over ranks that must make the same module calls (``lockstep``).
    ``sharing``: ``"tree"`` (prefix-tree sharing, ``tree_forward``) or ``"group"`` (each unique prompt forwarded
    whole); ranks in lockstep use ``"group"``. ``tree``: the sharing window's ``TreeWindow`` in tree mode.
    ``prompt_keys``: the rows' ``prompt_keys``, when the caller has computed them already.
    """

    logits_to_keep: int
    temperature: float = 1.0
    compute_entropy: bool = False
    cast_lm_head_to_fp32: bool = False
    store: PromptStore | None = None
    later: frozenset = frozenset()
    lockstep: bool = False
    sharing: str = "group"
    tree: TreeWindow | None = None
    prompt_keys: list[bytes] | None = None


@dataclass
class GroupLogprobsOutput(ModelOutput):
    """log_probs, entropy: (B, C) fp32, zero where the completion mask is 0 (entropy None unless asked)."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def _prompt_pass(backbone, prompt_ids, prompt_mask) -> PromptStates:
    capture = attn_hook.PromptCapture()
    token = attn_hook.context_token(capture)
    out = backbone(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=False, grpo_mem_ctx=token)
    return PromptStates(kv=[capture.kv[i] for i in sorted(capture.kv)], last_hidden=out.last_hidden_state[:, -1])


def _prompt_states(backbone, prompt_ids, prompt_mask, first, request: GroupRequest) -> PromptStates:
    """States of the unique prompts (rows ``first``), from the window's store where it has them."""
    store = request.store
    if store is None:
        return _prompt_pass(backbone, prompt_ids[first], prompt_mask[first])
    keys = prompt_keys(prompt_ids[first], prompt_mask[first])
    parts: list[PromptStates | None] = [None] * len(keys)
    fresh = [u for u, key in enumerate(keys) if key not in store.entries and key not in request.later]
    if fresh:  # used by this micro-batch only: one batched pass, backpropagated by this micro-batch
        rows = first[fresh]
        states = _prompt_pass(backbone, prompt_ids[rows], prompt_mask[rows])
        for i, u in enumerate(fresh):
            parts[u] = PromptStates.from_tensors(t[i : i + 1] for t in states.tensors())
    for u, key in enumerate(keys):
        if parts[u] is not None:
            continue
        if key in store.entries:
            parts[u] = store.take(key, last=key not in request.later)
        else:  # first of several micro-batches: its own pass, since its graph is backpropagated at another time
            row = first[u : u + 1]
            parts[u] = store.keep(key, _prompt_pass(backbone, prompt_ids[row], prompt_mask[row]))
    return PromptStates.cat(parts)


def prompt_once_logprobs(causal_lm, input_ids, attention_mask, request: GroupRequest):
    """The prompt-once computation on an unwrapped causal LM; shapes as in ``grpo_mem.shared_prompt_logprobs``."""
    C = request.logits_to_keep
    P = input_ids.shape[1] - C
    prompt_ids, prompt_mask = input_ids[:, :P], attention_mask[:, :P]
    completion_ids, completion_mask = input_ids[:, P:], attention_mask[:, P:]
    first, inverse = find_groups(prompt_ids, prompt_mask)
    backbone = causal_lm.base_model
    attn_hook.take_over(causal_lm)

    states = _prompt_states(backbone, prompt_ids, prompt_mask, first, request)
    hidden = [states.last_hidden.index_select(0, inverse).unsqueeze(1)]
    # With C == 1 nothing needs the completion pass; in lockstep it still runs (on token 1, its output tied in with
    # zero gradient) so that this rank makes the same module calls as ranks whose completions are longer.
    width = C - 1 if C > 1 or not request.lockstep else 1
    if width:
        region = attn_hook.Region(kv=dict(enumerate(states.kv)), index=inverse, mask=prompt_mask[first].bool(),
                                  dense=True)  # fmt: skip
        ctx = attn_hook.CompletionContext(regions=[region], key_mask=completion_mask[:, :width].bool())
        positions = torch.arange(P, P + width, device=input_ids.device).unsqueeze(0)
        completion_out = backbone(
            input_ids=completion_ids[:, :width], position_ids=positions, use_cache=False,
            grpo_mem_ctx=attn_hook.context_token(ctx),
        )
        out = attn_hook.keep_alive(completion_out.last_hidden_state, ctx)
        if C > 1:
            hidden.append(out)
        elif out.requires_grad:
            hidden[0] = _Tie.apply(hidden[0], out)
    hidden = torch.cat(hidden, dim=1)
    return completion_head(causal_lm, hidden, completion_ids, completion_mask, request)


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
    """Give ``causal_lm`` a forward that also accepts ``grpo_mem=GroupRequest(...)`` (idempotent).

    Without that kwarg the model's previous forward (TRL's fused head, if installed) runs unchanged. With it, the
    prompt-once computation runs inside the forward call, so DDP/DeepSpeed/FSDP hooks of a wrapping module fire once
    per call as they do for stock TRL, under the autocast the previous forward was wrapped in (accelerate's mixed
    precision), so both paths compute in the same precision.
    """
    if _FORWARD_MARK in causal_lm.__dict__:
        return
    previous = causal_lm.__dict__.get("forward")
    inner_forward = causal_lm.forward
    # precision the model's own forward runs under (accelerate's mixed-precision wrapper): grpo_mem calls get the same
    autocasts = [(a.device, a.fast_dtype, a._enabled, a._cache_enabled) for a in _autocasts_of(previous)]

    @functools.wraps(type(causal_lm).forward)
    def forward(self, *args, grpo_mem: GroupRequest | None = None, **kwargs):
        if grpo_mem is None:
            return inner_forward(*args, **kwargs)
        if args:
            raise TypeError("the grpo_mem forward takes input_ids and attention_mask as keywords")
        with contextlib.ExitStack() as stack:
            for device, dtype, enabled, cache in autocasts:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache))
            return _forward_group(self, kwargs["input_ids"], kwargs["attention_mask"], grpo_mem)

    causal_lm.forward = types.MethodType(forward, causal_lm)
    causal_lm.__dict__[_FORWARD_MARK] = previous


def restore(causal_lm) -> None:
    """Undo ``install_forward`` and the attention take-over on ``causal_lm``; no-op on an untouched model."""
    if _FORWARD_MARK in causal_lm.__dict__:
        previous = causal_lm.__dict__.pop(_FORWARD_MARK)
        if previous is None:
            causal_lm.__dict__.pop("forward", None)
        else:
            causal_lm.forward = previous
    impl = causal_lm.config._attn_implementation or ""
    if impl.startswith(attn_hook.PREFIX):
        attn_hook.give_back(causal_lm, attn_hook.inner_implementation(causal_lm))


def _forward_group(causal_lm, input_ids, attention_mask, request: GroupRequest) -> GroupLogprobsOutput:
    reason = unsupported_reason(causal_lm, input_ids.shape[1])
    if request.lockstep:
        reason = agree_fallback(causal_lm, reason)
    if reason is not None:
        warn_fallback(reason)
        logps, entropy = full_sequence_logprobs(causal_lm, input_ids, attention_mask, request)
    elif request.sharing == "tree" and not request.lockstep:
        logps, entropy = tree_logprobs(causal_lm, input_ids, attention_mask, request, request.tree)
    else:
        logps, entropy = prompt_once_logprobs(causal_lm, input_ids, attention_mask, request)
    return GroupLogprobsOutput(log_probs=logps, entropy=entropy)


def shared_prompt_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    cast_lm_head_to_fp32: bool = False,
    sharing: str = "tree",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token completion log-probs (and entropies) with each unique prompt forwarded once.

    Same contract and numbers as TRL 1.16's ``GRPOTrainer._get_per_token_logps_and_entropies`` for text models
    (within fp32 rounding), gradients included: each unique prompt row is forwarded once with gradients, its per-layer
    K/V serve every completion of the group, and log-probs come from completion hidden states through a chunked head
    that never builds (B, C, V) logits. Rows of one prompt need not be adjacent: identical prompts (ids and mask,
    padding slots ignored) are found anywhere in the batch. Runs inside one call of ``model``'s forward, so wrappers'
    hooks (DDP, DeepSpeed, FSDP) fire; works on a plain causal LM, a PEFT model, and a model given TRL's fused head.
    With ``sharing="tree"`` (default) the unique prompts' common prefixes are found too (``PromptTrie``): a span that
    several prompts share (a system prompt, a few-shot block) is forwarded once and every prompt's own part attends
    to it in place, at positions that keep stock TRL's position differences (RoPE scores equal up to the rounding of
    the rotation); ``"group"`` forwards each unique prompt whole, at stock TRL's positions. Ranks in lockstep
    (FSDP, DeepSpeed) use ``"group"``. Stateless: nothing is kept between calls (``grpo_mem.model.sharing.
    SharingSession`` shares prompts and trie nodes across the micro-batches of an optimizer step).

    Side effect: the first call gives the underlying causal LM a pass-through forward and attention implementation
    (``grpo_mem_<impl>``); calls without grpo_mem compute exactly what they did. ``grpo_mem.restore(model)`` undoes it.
    Where the path cannot be exact (see ``unsupported_reason``) it warns once and runs the full-sequence path.

    Args:
        model: transformers causal LM, possibly PEFT- and DDP/DeepSpeed/FSDP-wrapped.
        input_ids: (B, P + C) int64, left-padded prompts followed by right-padded completions.
        attention_mask: (B, P + C) 0/1, same shape.
        logits_to_keep: C, the completion width, 1 <= C < P + C.
        temperature: > 0, the logits are divided by it (after logit scale and final softcap, as TRL does).
        compute_entropy: also return the entropy of each next-token distribution.
        cast_lm_head_to_fp32: run the LM head in fp32 outside autocast (TRL's ``cast_lm_head_to_fp32``).
        sharing: ``"tree"`` or ``"group"``, see above.

    Returns:
        log_probs: (B, C) fp32, zero where the completion mask is 0.
        entropies: (B, C) fp32 (zero where masked) if ``compute_entropy``, else None.

    Raises:
        ValueError: shape mismatch, ``logits_to_keep`` out of range, ``temperature <= 0``, right-padded prompts,
            unknown ``sharing``.
        TypeError: non-integer ids or ``logits_to_keep``.
    """
    request = GroupRequest(logits_to_keep, float(temperature), bool(compute_entropy), bool(cast_lm_head_to_fp32),
                           sharing=check_sharing(sharing))  # fmt: skip
    return score(model, input_ids, attention_mask, request)


def score(model, input_ids, attention_mask, request: GroupRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``shared_prompt_logprobs`` with its options (and a sharing session's store) in ``request``; validates the
    inputs and sets ``request.lockstep`` from ``model``."""
    validate_inputs(input_ids, attention_mask, request.logits_to_keep, request.temperature)
    install_forward(unwrap_causal_lm(model))
    request.lockstep = lockstep(model)
    out = model(input_ids=input_ids, attention_mask=attention_mask, grpo_mem=request)
    return out.log_probs, out.entropy


__all__ = [
    "GroupRequest",
    "GroupLogprobsOutput",
    "find_groups",
    "install_forward",
    "prompt_once_logprobs",
    "restore",
    "score",
    "shared_prompt_logprobs",
    "validate_inputs",
]

"""The stock path: what runs when the prompt-once path cannot serve a micro-batch, and the warnings that say so.

``full_sequence_logprobs`` is the model's own forward over the whole sequence (the default stock path of
``SharingSession.run``). ``warn_fallback`` is the one place a fallback is reported: warned once per process and
cause, and handed to every open ``recording_fallbacks`` block. ``isolated_fallbacks`` (record, warn nothing, leave
the process's record as it was) and ``restoring_warnings`` (warn as usual, forget afterwards what was first warned in
the block) serve callers that score before or beside training: ``grpo_mem.verify``, the suite. This module knows torch
and transformers' model outputs, not TRL.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

from ..ops.logprobs import selective_log_softmax

__all__ = [
    "forward_params",
    "full_sequence_logprobs",
    "isolated_fallbacks",
    "recording_fallbacks",
    "restoring_warnings",
    "warn_fallback",
]

_warned: set[str] = set()  # the causes warned in this process
_records: list[list[str]] = []  # the lists of the open ``recording_fallbacks`` blocks


def warn_fallback(cause: str) -> None:
    """Warn once per process and cause that the stock path is used (``UserWarning``, "grpo_mem: falling back to the
    stock full-sequence path: <cause>"), and append ``cause`` to every open ``recording_fallbacks`` block's list."""
    for record in _records:
        record.append(cause)
    if cause not in _warned:
        _warned.add(cause)
        warnings.warn(f"grpo_mem: falling back to the stock full-sequence path: {cause}", stacklevel=3)


@contextlib.contextmanager
def recording_fallbacks():
    """Within the block, collect every cause ``warn_fallback`` is given (each time, not once per process) into the
    list it yields: ``grpo_mem.verify`` reports per micro-batch which path ran and why."""
    record: list[str] = []
    _records.append(record)
    try:
        yield record
    finally:
        _records.remove(record)


@contextlib.contextmanager
def isolated_fallbacks():
    """Within the block, ``warn_fallback`` warns nothing and reaches no enclosing ``recording_fallbacks`` block; it
    records into the list yielded. Afterwards the process's warned causes are as before the block."""
    records, warned = list(_records), set(_warned)
    _records[:] = []
    try:
        with warnings.catch_warnings(), recording_fallbacks() as causes:
            warnings.simplefilter("ignore")
            yield causes
    finally:
        _records[:] = records
        _warned.clear()
        _warned.update(warned)


@contextlib.contextmanager
def restoring_warnings():
    """Within the block fallbacks warn as usual; afterwards the causes first warned inside it are forgotten, so that
    they still warn once later (``grpo_mem.verify`` runs before training)."""
    before = set(_warned)
    try:
        yield
    finally:
        _warned.intersection_update(before)


@functools.lru_cache(maxsize=None)
def forward_params(cls: type) -> frozenset:
    """The parameter names of ``cls.forward``."""
    return frozenset(inspect.signature(cls.forward).parameters)


def full_sequence_logprobs(causal_lm, input_ids, attention_mask, request):
    """The model's own computation: its class forward over the whole (B, P+C) sequence, logits of the C positions
    that predict the completion divided by the temperature, then log-probs (and entropies) as TRL 1.16 computes them
    from logits. Returns (log-probs, entropies | None, aux loss | None): (B, C) fp32 each, zero where the completion
    mask is 0, and with ``request.compute_aux_loss`` (a ``forward.ScoreOptions``) the model's own MoE router loss (its
    ``aux_loss`` output).

    The class forward is called directly (not the module): this runs inside the model's own forward call, whose
    wrappers' hooks have fired already; instance-level forward replacements (TRL's fused head, grpo_mem's) are not
    the model's computation.
    """
    C = request.logits_to_keep
    params = forward_params(type(causal_lm))
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "use_cache" in params:
        kwargs["use_cache"] = False
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = C + 1
    if request.compute_aux_loss:
        kwargs["output_router_logits"] = True
    out = type(causal_lm).forward(causal_lm, **kwargs)
    logits = out.logits[:, -C - 1 : -1]
    targets = input_ids[:, -C:].to(logits.device)
    result = selective_log_softmax(
        logits, targets, temperature=request.temperature, return_entropy=request.compute_entropy
    )
    logps, entropy = result if request.compute_entropy else (result, None)
    keep = attention_mask[:, -C:].bool().to(logps.device)
    logps = logps.masked_fill(~keep, 0.0)
    aux_loss = out.aux_loss if request.compute_aux_loss else None
    return logps, (None if entropy is None else entropy.masked_fill(~keep, 0.0)), aux_loss

"""Why a micro-batch cannot take the prompt-once path, where that takes more than a look at the call: the model's own
cause (the capability rule, the router loss, the confirmation on a tiny copy) and sequence parallelism's.

``SharingSession.decide`` asks ``model_cause`` once per model and state (``forward.model_cause`` keeps the answer
until ``forward.model_state`` changes), so a micro-batch of an unchanged model runs none of this; the sequence-parallel
checks run only for a session given a group. The router and sequence-parallel modules are imported only by the
calls that need them. This module knows transformers, not TRL.
"""

from __future__ import annotations

from . import mechanisms
from .confirm import confirm_cause
from .confirm import enabled as confirm_enabled
from .support import unsupported_cause

__all__ = ["model_cause", "sequence_parallel_cause", "sequence_parallel_of", "sp_cause"]


def model_cause(causal_lm, compute_aux_loss: bool, confirm: bool | None) -> str | None:
    """Why the prompt-once path cannot serve ``causal_lm`` (an unwrapped transformers causal LM) exactly, or None:
    ``support.unsupported_cause`` of the call (``compute_aux_loss``: the router loss is part of it; the admission
    answers of the mechanisms of ``mechanisms.TABLE`` it brings, such as a router loss the path does not reproduce),
    then, when the confirmation is on (``confirm.enabled(confirm)``), a tiny copy whose numbers differ
    (``confirm.confirm_cause``)."""
    cause = unsupported_cause(causal_lm, mechanisms.Call(router=compute_aux_loss))
    if cause is None and confirm_enabled(confirm):  # the same verdict on every rank: no collective
        cause = confirm_cause(causal_lm, compute_aux_loss=compute_aux_loss)
    return cause


def sequence_parallel_of(group):
    """``group`` (a ``torch.distributed`` process group or a ``sequence_parallel.SequenceParallel``) as a
    ``SequenceParallel``.

    Raises:
        RuntimeError: a process group without ``torch.distributed`` initialised (``SequenceParallel.of``).
    """
    from .sequence_parallel import SequenceParallel

    return group if isinstance(group, SequenceParallel) else SequenceParallel.of(group)


def sequence_parallel_cause(name: str) -> str:
    """The cause ``sequence_parallel.SP_CAUSES`` names ``name`` (``"hidden"``, ``"differ"``, ...)."""
    from .sequence_parallel import SP_CAUSES

    return SP_CAUSES[name]


def sp_cause(sp, causal_lm, compute_aux_loss: bool, vision, input_ids, attention_mask) -> str | None:
    """Why the micro-batch ``input_ids``/``attention_mask`` (B, P + C) cannot be split over the sequence-parallel
    group ``sp`` (``sequence_parallel.SP_CAUSES``), or None: the ranks hold different micro-batches (one collective,
    so every rank of the group calls it), or the micro-batch brings a mechanism of ``mechanisms.TABLE`` that the
    sequence-sharded layout does not carry (its ``sequence_parallel`` key: image inputs, recurrent state, the MoE
    router loss). ``vision``: the micro-batch's image inputs, or None."""
    if not sp.same_inputs(input_ids, attention_mask):
        return sequence_parallel_cause("differ")
    call = mechanisms.Call(router=compute_aux_loss, images=vision, sp=sp)
    key = next(
        (m.sequence_parallel for m in mechanisms.TABLE if m.sequence_parallel and m.present(causal_lm, call)), None
    )
    return None if key is None else sequence_parallel_cause(key)

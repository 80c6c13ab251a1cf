"""The completion LM head: per-token log-probs and entropies from hidden states, logits computed as TRL computes them."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..ops.logprobs import linear_logprobs


def logit_transform(config) -> tuple[float, float | None]:
    """(logit_scale, final_logit_softcapping) of a text config, resolved the way TRL 1.16's fused head does.

    Scale attributes, first found wins: ``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``, then
    ``logits_scaling`` (a divisor, a multiplier on ``hyperclovax``); none means 1.0.
    """
    text = config.get_text_config()
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if text.model_type == "hyperclovax" else 1 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def _lm_head_params(causal_lm):
    """The LM head's weight and bias as plain tensors (FSDP2 DTensors gathered)."""
    head = causal_lm.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        DTensor = ()
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    return weight, bias


def _gather_zero3(*params):
    """Gather ZeRO-3 partitioned parameters for a direct read of the head weight (a null context otherwise).

    A ZeRO-3 parameter is recognised by its own ``ds_status``, not by transformers' global ZeRO-3 flag, which only
    the HF Trainer sets (a model given to ``deepspeed.initialize`` directly has partitioned parameters without it).
    Whether to gather depends only on the parameters' status, which is the same on every rank that made the same
    module calls, so ranks in lockstep enter the collective together.
    """
    zero3 = [p for p in params if p is not None and hasattr(p, "ds_status")]
    if not zero3:
        return nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    pending = {id(p): p for p in zero3 if p.ds_status != ZeroParamStatus.AVAILABLE}
    return deepspeed.zero.GatheredParameters(list(pending.values())) if pending else nullcontext()


def completion_head(causal_lm, hidden, completion_ids, completion_mask, request, scored=None):
    """Log-probs (and entropies) of ``completion_ids`` given the hidden states that predict them.

    Args:
        causal_lm: the unwrapped transformers causal LM (its output embeddings and config are read).
        hidden: (B, C, H) hidden states; ``hidden[:, t]`` predicts ``completion_ids[:, t]``.
        completion_ids: (B, C) int64.
        completion_mask: (B, C) 0/1; only positions with 1 are scored.
        request: ``ScoreOptions`` (temperature, compute_entropy, cast_lm_head_to_fp32).
        scored: (n,) int64, the flat indices (b·C + t) where ``completion_mask`` is 1, ascending, on the head's
            device, if known (``SharingSession.decide`` takes them from its one read of the masks); None: found here
            (a read back from the device).

    Returns:
        (B, C) fp32 log-probs and (B, C) fp32 entropies or None, zero where the mask is 0.
    """
    weight, bias = _lm_head_params(causal_lm)
    scale, softcap = logit_transform(causal_lm.config)
    shape = completion_mask.shape
    if scored is None:  # the scored positions, read once (a boolean index reads its count back each time)
        scored = completion_mask.bool().to(weight.device).flatten().nonzero().squeeze(1)
    scored = scored.to(weight.device)
    rows = hidden.to(weight.device).flatten(0, 1).index_select(0, scored)
    if request.cast_lm_head_to_fp32:
        rows = rows.float()
    gather = _gather_zero3(weight, bias)
    if not isinstance(gather, nullcontext) and torch.is_grad_enabled() and weight.requires_grad:
        # Inside the model's forward (where grpo_mem always runs) DeepSpeed gathers a ZeRO-3 parameter on access and
        # registers it with the running module, which re-gathers it for the backward. Outside, the gradient would
        # reach an empty shard.
        raise RuntimeError(
            "grpo_mem: the LM head weight is a ZeRO-3 partition read outside the model's forward with gradients "
            "enabled; call through the model (shared_prompt_logprobs does) or under torch.no_grad()"
        )
    # the kernel accumulates in fp32 itself: autocast must not re-cast its tiles
    with torch.autocast(rows.device.type, enabled=False), gather:
        out = linear_logprobs(
            rows,
            weight,
            completion_ids.to(weight.device).flatten().index_select(0, scored),
            bias=bias,
            temperature=request.temperature,
            logit_scale=scale,
            softcap=softcap,
            return_entropy=request.compute_entropy,
            check_index=False,  # the completion ids went through the model's embedding
        )
    logps, entropy = out if request.compute_entropy else (out, None)

    def place(values):  # (B, C), zero where unscored; connected to the graph even when no position is scored
        flat = torch.zeros(shape.numel(), dtype=torch.float32, device=values.device)
        return flat.index_copy(0, scored, values.float()).view(shape)

    return place(logps), (None if entropy is None else place(entropy))

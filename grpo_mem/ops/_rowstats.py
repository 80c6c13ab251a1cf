"""Row statistics of a streamed (chunked) log-softmax turned into log-probs, entropies and log-sum-exp; shared by
the torch and Triton launchers of ``logprobs``."""

from __future__ import annotations

import torch

__all__ = ["finish_row_stats"]


def finish_row_stats(m, s, sz, zy, target, want_entropy):
    """(logp, entropy or None, lse), each (N,) fp32, from a streamed softmax's row statistics: running max ``m``,
    sum of exp(z - m) ``s``, sum of exp(z - m)·z ``sz`` and the target logit ``zy``; rows with ``target < 0`` give 0.
    logp = zy - lse, entropy = log s - sz / s (the max cancels), lse = m + log s."""
    valid = target >= 0
    log_s = torch.log(s)
    lse = m + log_s
    zero = torch.zeros_like(lse)
    logp = torch.where(valid, zy - lse, zero)
    ent = torch.where(valid, log_s - sz / s, zero) if want_entropy else None
    return logp, ent, lse

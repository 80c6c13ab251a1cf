"""Kernels and their launchers, one kernel family per module, each beside its plain-torch reference."""

from .attention import (
    multi_region_attention,
    multi_region_attention_ref,
    shared_prefix_attention,
    shared_prefix_attention_ref,
)
from ._ext import HAS_EXT
from .logprobs import linear_logprobs, linear_logprobs_ref, selective_log_softmax, selective_log_softmax_ref

__all__ = [
    "multi_region_attention", "multi_region_attention_ref", "shared_prefix_attention", "shared_prefix_attention_ref",
]
__all__ += ["HAS_EXT", "linear_logprobs", "linear_logprobs_ref", "selective_log_softmax", "selective_log_softmax_ref"]

"""Kernels and their launchers, one kernel family per module, each beside its plain-torch reference."""

from .attention import shared_prefix_attention, shared_prefix_attention_ref

__all__ = ["shared_prefix_attention", "shared_prefix_attention_ref"]

"""Kernels and their launchers, one kernel family per module, each beside its plain-torch reference."""

"""Patches of foreign libraries; the only package of grpo_mem that knows TRL."""

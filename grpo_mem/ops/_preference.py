"""The backends a process may prefer and the environment variable that names one, without torch.

``import grpo_mem`` checks ``GRPO_MEM_BACKEND`` against these names (:func:`env_preference`) before torch loads, so
a misspelt value fails at the import instead of at the first op; ``grpo_mem.ops._backends`` reads the names from here
(its ``TABLE`` holds the backends themselves).
"""

from __future__ import annotations

import os

BACKEND_ENV = "GRPO_MEM_BACKEND"
"""The environment variable naming the preferred backend of every op (one of ``CHOICES``; unset or empty: auto)."""

CHOICES = ("auto", "triton", "torch", "cpp")
"""What ``GRPO_MEM_BACKEND`` and ``patch_trl(backend=...)`` accept."""


def check_choice(name, source: str = "backend") -> str:
    """``name`` if it is one of ``CHOICES``, else ValueError naming ``source``, the value and the choices."""
    if not isinstance(name, str) or name not in CHOICES:
        raise ValueError(f"{source} must be one of {list(CHOICES)}, got {name!r}")
    return name


def env_preference() -> str | None:
    """``GRPO_MEM_BACKEND``'s value, stripped and lower-cased (``" CPP "`` is ``"cpp"``); None when it is unset or
    empty.

    Raises:
        ValueError: the value is not one of ``CHOICES`` (the message names the value and the choices).
    """
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    return check_choice(value, BACKEND_ENV) if value else None

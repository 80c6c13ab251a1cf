"""How one micro-batch is scored: a ``Decision``, taken once by ``SharingSession.decide`` and run once by
``SharingSession.run`` (or ``run_hidden``), carrying everything the run needs. This module knows torch only."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Decision", "Kind"]


class Kind(enum.Enum):
    """What a decision does with its micro-batch.

    - ``SHARED``: the prompt-once path, in the window's sharing mode.
    - ``UNSHARED``: the caller's stock path, because the micro-batch shares nothing (no repeated prompt, no prompt pass
      read by another micro-batch): the window passes over it and goes on sharing.
    - ``FALLBACK``: the stock path, because the prompt-once path cannot serve the micro-batch exactly (the cause says
      why): the window stops sharing there.
    """

    SHARED = "shared"
    UNSHARED = "unshared"
    FALLBACK = "fallback"


class _Runs:
    """Whether a decision was run (it can be run once)."""

    __slots__ = ("done",)

    def __init__(self):
        self.done = False


@dataclass(frozen=True)
class Decision:
    """How one micro-batch is scored, decided once by ``SharingSession.decide`` and run once.

    Attributes:
        kind: ``Kind.SHARED``, ``UNSHARED`` or ``FALLBACK``.
        cause: why the micro-batch takes the stock path (``kind`` not ``SHARED``), else None.
        micro_batch: the micro-batch's index in the session's window, or None when it is scored on its own.
        backbone_tokens: tokens the chosen path runs through the backbone (padded widths counted).
        stock_tokens: tokens stock TRL runs through the backbone for it, B x (P + C).
        mode: the window's sharing mode, ``"tree"`` or ``"group"``.

    What the run takes (not compared, not shown): ``window`` (the ``Window`` that runs it), ``model`` (as given to
    ``decide``) and its unwrapped ``causal_lm``, ``input_ids``/``attention_mask`` (B, P + C), ``options``
    (``forward.ScoreOptions``), ``lockstep`` (ranks make the same module calls), ``images`` (the bound image inputs,
    ``vision_passes.VisionPasses``, or None), ``autocast`` (a context factory entered around the prompt-once path's
    model call, or None) and ``sp`` (the ``sequence_parallel.SequenceParallel`` group the micro-batch is split over, or
    None).
    """

    kind: Kind
    cause: str | None
    micro_batch: int | None
    backbone_tokens: int
    stock_tokens: int
    mode: str
    window: Any = field(repr=False, compare=False, default=None)
    model: torch.nn.Module | None = field(repr=False, compare=False, default=None)
    causal_lm: torch.nn.Module | None = field(repr=False, compare=False, default=None)
    input_ids: torch.Tensor | None = field(repr=False, compare=False, default=None)
    attention_mask: torch.Tensor | None = field(repr=False, compare=False, default=None)
    options: Any = field(repr=False, compare=False, default=None)
    lockstep: bool = field(repr=False, compare=False, default=False)
    images: Any = field(repr=False, compare=False, default=None)
    autocast: Callable | None = field(repr=False, compare=False, default=None)
    sp: Any = field(repr=False, compare=False, default=None)
    _runs: _Runs = field(repr=False, compare=False, default_factory=_Runs)

    @property
    def path(self) -> str:
        """``"tree"`` or ``"group"`` (the prompt-once path in that sharing mode), or ``"stock"``."""
        return self.mode if self.kind is Kind.SHARED else "stock"

    @property
    def ran(self) -> bool:
        """Whether the decision was run."""
        return self._runs.done

    def mark_run(self) -> None:
        """Record that the decision is being run (``SharingSession`` refuses to run it again)."""
        self._runs.done = True

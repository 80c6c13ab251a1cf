"""Whether a configuration asks for sequence parallelism, and how its hooks reach a trainer: the one place the TRL patch
decides it, without importing ``grpo_mem.patches.trl_sp`` unless the answer is yes.

A configuration asks when a trainer's ``args.parallelism_config`` (accelerate's ``ParallelismConfig``) has
``sp_size > 1`` or ``cp_size > 1``, or the caller passes ``patch_trl(sequence_parallel=True)``. A trainer built while a class patch made
without that argument is active gets the hooks from the class's patched ``__init__`` (``make_init``) when its own
config asks.
"""

from __future__ import annotations

import functools

from .handle import PatchHandle


def asks_for_sequence_parallel(owner) -> bool:
    """Whether ``owner`` is a trainer whose ``args.parallelism_config`` has ``sp_size > 1`` or ``cp_size > 1``."""
    pc = getattr(getattr(owner, "args", None), "parallelism_config", None)
    return pc is not None and max(pc.sp_size or 1, pc.cp_size or 1) > 1


def sequence_parallel_asked(owners: list, sequence_parallel: bool | None) -> bool:
    """Whether ``patch_trl`` installs the SP hooks on ``owners``: ``sequence_parallel`` when given, else whether a
    target trainer's config asks. Checked before anything is patched.

    Raises:
        ValueError: ``sequence_parallel=False`` for a trainer whose config asks for it.
        TypeError: the answer is yes and a hook's target changed (``trl_sp.check_hooks``).
    """
    asking = [o for o in owners if asks_for_sequence_parallel(o)]
    if sequence_parallel is False and asking:
        raise ValueError(
            f"sequence_parallel=False, but this {type(asking[0]).__name__}'s parallelism_config has sp_size="
            f"{asking[0].args.parallelism_config.sp_size}, cp_size={asking[0].args.parallelism_config.cp_size}: its "
            "ranks would each score whole sequences; pass sequence_parallel=True or None"
        )
    wanted = bool(asking) if sequence_parallel is None else sequence_parallel
    if wanted:
        from .trl_sp import check_hooks

        for owner in owners:
            check_hooks(owner)
    return wanted


def install_sequence_parallel(handle: PatchHandle, owners: list) -> None:
    """Install ``trl_sp``'s hooks on ``owners`` (trainer classes or instances) through ``handle``; TypeError, and
    nothing changed, when one of their targets changed (``trl_sp.check_hooks``)."""
    from . import trl_sp

    trl_sp.install(handle, owners)
    handle.sequence_parallel = True


def make_init(original, handle: PatchHandle):
    """A trainer class's ``__init__`` under a patch made without ``sequence_parallel``: TRL's ``original``, then the
    SP hooks installed on the new trainer if its config asks for them."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if handle.active and asks_for_sequence_parallel(self):
            install_sequence_parallel(handle, [self])

    __init__.__wrapped_original__ = original
    return __init__

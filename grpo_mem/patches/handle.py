"""What ``patch_trl`` changed, the state its patched methods keep, and the registry of active patches.

A ``PatchHandle`` records every attribute the patch set (on trainer classes or instances, TRL's config classes and
modules, an accelerator) with the value it replaced, and ``revert`` puts each back. The registry keeps the active
handles by their targets, pins the kernels' backend they ask for, and decides what a second ``patch_trl`` call on a
patched target does (``repatch``, ``covering_handle``).
"""

from __future__ import annotations

import contextlib
import types
import weakref

from ..model.forward import restore
from ..model.sharing import SharingSession
from ..ops._backends import set_preference
from .checks import _MARK, LOGPS_METHOD


class PatchHandle:
    """What ``patch_trl`` changed, the state the patched methods keep, and how to undo it. Usable as a context
    manager (reverts on exit).

    Attributes:
        sessions: per trainer, the ``SharingSession`` sharing prompt passes across its micro-batches.
        models: the models the patched methods routed through grpo_mem (``revert`` restores exactly these).
        group_shuffle: whether ``_prepare_inputs`` shuffles by whole groups.
        sharing: the sessions' sharing mode, ``"tree"`` or ``"group"``.
        log_metrics: whether training micro-batches' decisions go into the trainer's logged metrics.
        confirm: whether the sessions confirm each admitted model on a tiny copy first (``grpo_mem.model.confirm``;
            None: unless ``GRPO_MEM_CONFIRM=0``).
        sequence_parallel: whether this handle installed the sequence-parallel hooks (``grpo_mem.patches.trl_sp``)
            on one of its targets; only then is ``trl_sp`` imported, and a session of a trainer with sequence
            parallelism splits its passes over the SP group. False for ``patched_method``'s private handles.
        backend: the kernels' backend this patch pins process-wide while active (``"triton"``, ``"torch"``,
            ``"cpp"``, ``"auto"``), or None: ``GRPO_MEM_BACKEND`` decides (``grpo_mem.ops._backends.preferred``).
        active: False once reverted.
    """

    def __init__(
        self,
        key,
        *,
        group_shuffle: bool,
        sharing: str = "tree",
        log_metrics: bool = True,
        confirm: bool | None = None,
        backend: str | None = None,
    ):
        self._key = key
        self._entries = []  # (owner, name, previous value or _MISSING)
        self.sessions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.models: weakref.WeakSet = weakref.WeakSet()
        self.group_shuffle = group_shuffle
        self.sharing = sharing
        self.log_metrics = log_metrics
        self.confirm = confirm
        self.sequence_parallel = False
        self.backend = backend
        self.liger_causes: dict = {}  # owner -> why its Liger loss path is not served (``checks.liger_support``)
        self.active = True

    def session(self, trainer) -> SharingSession:
        """The trainer's ``SharingSession`` (created on first use, in the handle's sharing mode; again when the
        trainer's sequence-parallel groups come into being at the start of ``train()``)."""
        sp = None
        if self.sequence_parallel:  # the SP group once it exists (before ``train()`` the ranks score on their own)
            from . import trl_sp

            sp = trl_sp.sequence_parallel(trainer) if trl_sp.ready(trainer) else None
        session = self.sessions.get(trainer)
        if session is None or (session.sp is not None) != (sp is not None):
            session = self.sessions[trainer] = SharingSession(self.sharing, confirm=self.confirm, sequence_parallel=sp)
        return session

    def data_parallel(self, trainer):
        """A context in which TRL's code of ``trainer`` sees its SP group as one data-parallel rank
        (``grpo_mem.patches.sp_ranks.data_parallel``); a no-op where this handle installed no SP hooks."""
        if not self.sequence_parallel:
            return contextlib.nullcontext()
        from .sp_ranks import data_parallel

        return data_parallel(trainer)

    def remember(self, owner, name: str, value) -> None:
        """Set ``owner``'s attribute ``name`` (a class, module or instance) to ``value`` for as long as the patch is
        active: ``revert`` restores what it was (idempotent per owner and name)."""
        if any(o is owner and n == name for o, n, _ in self._entries):
            return
        previous = vars(owner).get(name, _MISSING)
        setattr(owner, name, value)
        self._entries.append((owner, name, previous))

    def replace_method(self, owner, name: str, make) -> None:
        """Replace the method ``name`` of ``owner`` (a trainer class, or an instance: bound in its ``__dict__``) by
        ``make(original, self)``, ``original`` the function it resolves to on the class; ``revert`` restores it."""
        if isinstance(owner, type):
            self.remember(owner, name, make(getattr(owner, name), self))
        else:
            self.remember(owner, name, types.MethodType(make(getattr(type(owner), name), self), owner))

    def unserved_liger(self, trainer) -> str | None:
        """Why ``trainer``'s Liger loss path (``use_liger_kernel=True`` on TRL 1.10-1.13) is TRL's own, or None."""
        for owner, cause in self.liger_causes.items():
            if owner is trainer or (isinstance(owner, type) and isinstance(trainer, owner)):
                return cause
        return None

    def revert(self) -> None:
        """Put every patched attribute back as it was and give the models this patch touched their own forward and
        attention back (the attention hook is unregistered once no model runs it); idempotent."""
        if not self.active:
            return
        for owner, name, previous in reversed(self._entries):
            if previous is _MISSING:
                if isinstance(owner, type):
                    delattr(owner, name)
                else:
                    owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, previous)
        for model in list(self.models):
            restore(model)
        self.models.clear()
        self.sessions.clear()
        _ACTIVE.pop(self._key, None)
        self.active = False
        pin_backend()

    @property
    def targets(self):
        trainers = [o for o, _, _ in self._entries if hasattr(o, LOGPS_METHOD)]  # not configs, modules, accelerators
        return sorted({getattr(o, "__name__", type(o).__name__) for o in trainers})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.revert()
        return False

    def __repr__(self):
        return f"PatchHandle(targets={self.targets}, active={self.active})"


_MISSING = object()
_ACTIVE: dict = {}


def covers(handle: PatchHandle, trainer) -> bool:
    """Whether ``handle`` patched ``trainer`` itself or one of its classes."""
    return any(o is trainer or (isinstance(o, type) and isinstance(trainer, o)) for o, _, _ in handle._entries)


def active_handle(trainer) -> PatchHandle | None:
    """The active ``PatchHandle`` whose patch covers ``trainer`` (its class or the instance), or None."""
    return next((handle for handle in _ACTIVE.values() if covers(handle, trainer)), None)


def register(handle: PatchHandle) -> None:
    """Make ``handle`` active under its key and pin the backend it asks for."""
    _ACTIVE[handle._key] = handle
    pin_backend()


def registered(key) -> PatchHandle | None:
    """The active handle of the targets ``key`` (their ids), or None."""
    return _ACTIVE.get(key)


def pin_backend() -> None:
    """Pin the kernels' backend (``_backends.set_preference``) to the one the active handles ask for, or give the
    decision back to ``GRPO_MEM_BACKEND`` when none asks (``patch_trl`` keeps the active handles' requests equal)."""
    asked = {h.backend for h in _ACTIVE.values() if h.backend is not None}
    set_preference(asked.pop() if asked else None)


def check_backend(key, backend: str | None) -> None:
    """ValueError when another active handle pins a different backend (the pin is process-wide); ``backend`` was
    validated by ``patch_trl``."""
    if backend is None:
        return
    for other_key, other in _ACTIVE.items():
        if other_key != key and other.backend not in (None, backend):
            raise ValueError(
                f"the patch of {', '.join(other.targets)} pins backend={other.backend!r}, got backend={backend!r}: "
                "the kernels' backend is process-wide; revert that handle first, or patch with the same backend"
            )


def _differences(handle: PatchHandle, options: dict) -> str:
    """ "" if ``handle`` has these options (name -> value), else what differs: ``"sharing='tree', got
    sharing='group'"``."""
    differ = [(name, getattr(handle, name), value) for name, value in options.items() if getattr(handle, name) != value]
    return "; ".join(f"{name}={old!r}, got {name}={new!r}" for name, old, new in differ)


def repatch(handle: PatchHandle, options: dict) -> PatchHandle:
    """``handle`` with ``options`` (``group_shuffle``, ``sharing``, ``confirm``, ``backend``): unchanged if they agree;
    else, if no sharing window is open, the new options and no sessions (each trainer's next window starts a session
    in the new mode); else ValueError."""
    differ = _differences(handle, options)
    if not differ:
        return handle
    if any(session.in_window for session in handle.sessions.values()):
        raise ValueError(
            f"the patch of {', '.join(handle.targets)} has {differ}, and a sharing window is open "
            "(mid-step): call patch_trl again between optimizer steps, or revert the handle first"
        )
    check_backend(handle._key, options["backend"])
    for name, value in options.items():
        setattr(handle, name, value)
    handle.sessions.clear()
    pin_backend()
    return handle


def covering_handle(owner, options: dict) -> PatchHandle | None:
    """The active handle that already routes ``owner`` through grpo_mem (``owner`` an instance of a patched class),
    or None. Raises ValueError when its ``options`` differ: the class's patch would change for every instance."""
    if not getattr(getattr(owner, LOGPS_METHOD), _MARK, False):
        return None
    covering = [h for h in _ACTIVE.values() if any(o in (owner, type(owner)) for o, _, _ in h._entries)]
    if not covering:
        return None
    differ = _differences(covering[0], options)
    if differ:
        raise ValueError(
            f"this {type(owner).__name__} is covered by the patch of {', '.join(covering[0].targets)}, "
            f"which has {differ}: revert that handle first, or patch the class with the options you want"
        )
    return covering[0]

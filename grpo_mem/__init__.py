"""grpo_mem: prompt-once, memory-lean scoring of GRPO-family completions, as a revertible patch of TRL.

Public entry points:

- ``shared_prompt_logprobs(model, input_ids, attention_mask, logits_to_keep, ...)``: completion log-probs and
  entropies with each unique prompt forwarded once; same numbers as TRL's ``_get_per_token_logps_and_entropies``.
- ``patch_trl(target=None)``: route ``GRPOTrainer``/``RLOOTrainer`` (or one trainer) through it; returns a
  ``PatchHandle`` with ``revert()``. TRL itself is imported only when ``patch_trl`` is called.
- ``SharingSession(sharing="tree")``: the same scoring with a window of several micro-batches (a group spread over
  micro-batches keeps its prompt forwarded once); what ``patch_trl`` runs for each trainer.
- ``restore(model)``: give a model its own forward and attention implementation back.
- ``verify(trainer_or_model, batch=None)``: grpo_mem against stock TRL on one batch of the user's own model
  (log-probs, entropies, gradients, in the trainer's precision); returns a ``VerifyReport``.
- ``grpo_mem.ops``: the kernels (fused selective log-softmax, shared-prefix attention).

The names are resolved on first access (PEP 562 ``__getattr__``): ``import grpo_mem`` imports neither torch nor
transformers, so a program (the ``grpo-mem`` command line) can set process-wide variables such as ``OMP_WAIT_POLICY``
after importing the package and before torch loads.

Raises (at import): ValueError when the environment variable ``GRPO_MEM_BACKEND`` is set to a value that is not one
of ``auto``, ``triton``, ``torch``, ``cpp`` (the message names the value and the choices), rather than at the first
op. The ``grpo-mem`` command line (the installed script, or ``python -m grpo_mem``) prints that message as one
line, ``grpo-mem: error: ...``, and exits with status 2 instead (no traceback).
"""

from __future__ import annotations

import importlib
import os
import sys

from .ops._preference import env_preference

__version__ = "0.1.0"


def _command_line() -> bool:
    """Whether this process is a ``grpo-mem`` command: its installed script, or ``python -m`` of a module of this
    package (``sys.argv[0]`` is ``"-m"`` only while runpy imports the packages of the module it was asked to run)."""
    return os.path.basename(sys.argv[0]) == "grpo-mem" or sys.argv[:1] == ["-m"]


try:
    env_preference()  # a misspelt GRPO_MEM_BACKEND fails here, before any work (torch is not imported)
except ValueError as exc:
    if not _command_line():
        raise
    print(f"grpo-mem: error: {exc}", file=sys.stderr)
    sys.exit(2)

_EXPORTS: dict[str, tuple[str, str]] = {
    "PatchHandle": ("grpo_mem.patches.handle", "PatchHandle"),
    "patch_trl": ("grpo_mem.patches.trl", "patch_trl"),
    "restore": ("grpo_mem.model.forward", "restore"),
    "SharingSession": ("grpo_mem.model.sharing", "SharingSession"),
    "shared_prompt_logprobs": ("grpo_mem.model.sharing", "shared_prompt_logprobs"),
    "verify": ("grpo_mem.patches.verify", "verify"),
}
"""Public name -> (module, attribute in that module)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    try:
        module_name, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the module exists but something it imports does not: a real error
            raise
        raise AttributeError(f"grpo_mem.{name} is not available: module {module_name} does not exist") from exc
    value = getattr(module, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

"""What the TRL patch relies on, checked before anything is changed: the TRL release, the signatures of the methods it
replaces, and the trainer attributes the patched methods read. Not a version range: a release that keeps all of these
is patched, one that changed them is refused with the difference named.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

from .. import versions
from .trl_images import IMAGE_INPUTS

MIN_TRL = versions.minimum("trl")  # the lower bound of the tested range (grpo_mem.versions.TESTED)
# Releases refused by name although their signatures pass, as (major, minor[, micro]) -> why. Empty: every release
# from 1.10 to 1.16 passes the checks below and the parity tests (docs/compatibility.md, "TRL releases tested").
KNOWN_BAD_TRL: dict[tuple[int, ...], str] = {}
LOGPS_METHOD = "_get_per_token_logps_and_entropies"
PREPARE_METHOD = "_prepare_inputs"
LOGPS_PARAMS = (
    "self",
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
    *IMAGE_INPUTS,
)
PREPARE_PARAMS = ("self", "generation_batch")
# TRL 1.10-1.13 with use_liger_kernel: compute_loss -> compute_liger_loss, which takes the policy's final hidden states
# at the completion positions from this method and hands them to its fused linear GRPO loss. 1.14+ have no such path.
LIGER_LOSS_METHOD = "compute_liger_loss"
HIDDEN_METHOD = "_get_last_hidden_state"
HIDDEN_PARAMS = (
    "self",
    "unwrapped_model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "image_position_ids",
)
_MARK = "__grpo_mem_patch__"
# TRL 1.14.x: _get_per_token_logps_and_entropies(self, model, *args, batch_size=None, compute_aux_loss=False, **kwargs)
# only dispatches, to this method (or, with use_liger_kernel, to _chunked_logps, which takes the same arguments but
# batch_size); its callers pass 1.16's parameters, so the dispatcher is replaced like 1.16's method.
DISPATCH_TARGET = "_full_logits_logps"


def _trl_version() -> tuple[tuple[int, ...], str]:
    import trl
    from packaging.version import Version

    return Version(trl.__version__).release, trl.__version__


def check_trl_version() -> None:
    """Raise ``RuntimeError`` for TRL older than ``MIN_TRL`` or a release in ``KNOWN_BAD_TRL``.

    Newer releases are not refused by number: a release outside the tested range (``grpo_mem.versions.TESTED``) is
    warned about once (``UntestedReleaseWarning``), and ``patch_trl`` checks the methods' signatures and the trainer
    attributes it reads instead, and refuses (``TypeError``) a release that changed them. An installed transformers
    outside its tested range is warned about here too (before any model is scored).
    """
    release, full = _trl_version()
    if release[:2] < MIN_TRL:
        raise RuntimeError(
            f"grpo_mem needs TRL >= {MIN_TRL[0]}.{MIN_TRL[1]} (older releases score completions differently), found "
            f"trl {full}"
        )
    for bad, why in KNOWN_BAD_TRL.items():
        if release[: len(bad)] == bad:
            raise RuntimeError(f"grpo_mem does not patch trl {full}: {why}")
    versions.check_tested("trl")
    versions.check_tested("transformers")
    versions.check_tested("accelerate")


def check_not_async(owner) -> None:
    """Refuse TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo.AsyncGRPOTrainer``, or a subclass) by name.

    It does not score through ``GRPOTrainer``'s ``_get_per_token_logps_and_entropies``, the method ``patch_trl``
    replaces: its ``compute_loss`` forwards each micro-batch as packed prefix tries of its own
    (``trl.experimental.async_grpo.packing.TreeRow``, each shared token forwarded once, through FlashAttention-3 tree
    attention on CUDA), so it already shares prompts, and there is nothing of its loss path for the patch to stand in.

    Raises:
        TypeError: ``owner`` (a trainer class or instance) is an AsyncGRPOTrainer, naming it and why.
    """
    cls = owner if isinstance(owner, type) else type(owner)
    if any(c.__name__ == "AsyncGRPOTrainer" and c.__module__.startswith("trl.") for c in cls.__mro__):
        raise TypeError(
            f"grpo_mem does not patch TRL's AsyncGRPOTrainer ({cls.__name__}): it scores in its compute_loss over "
            "packed prefix tries of its own (each shared token forwarded once, FlashAttention-3 tree attention on "
            "CUDA), not through GRPOTrainer's _get_per_token_logps_and_entropies, the method patch_trl replaces; "
            "train it without patch_trl, or use GRPOTrainer with patch_trl"
        )


def check_signature(owner, name: str, expected: tuple[str, ...]) -> None:
    fn = getattr(owner, name, None)
    if fn is None:
        raise TypeError(f"{getattr(owner, '__name__', type(owner).__name__)} has no method {name}")
    fn = getattr(fn, "__wrapped_original__", fn)
    signature = inspect.signature(fn)
    params = tuple(signature.parameters)
    if isinstance(owner, type) or params[:1] == ("self",):
        got = params
    else:  # bound method of an instance
        got = ("self", *params)
    kinds = {p.kind for p in signature.parameters.values()}
    dispatcher = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds
    if got != expected and name == LOGPS_METHOD and dispatcher and hasattr(owner, DISPATCH_TARGET):
        check_signature(owner, DISPATCH_TARGET, expected)  # TRL 1.14.x
        return
    if got != expected:
        raise TypeError(f"{name} of {owner!r} has parameters {got}, grpo_mem was written against {expected}")


# what the patched methods read of a trainer, checked before patching (names, then on first use the attributes)
TRAINER_ATTRS = ("_buffered_inputs", "_step", "num_iterations", "temperature", "accelerator", "args")
ARGS_ATTRS = ("steps_per_generation", "per_device_train_batch_size")
# set by the Trainer's training loop, not by ``__init__``: looked for in the sources of the trainer's classes
LOOP_ATTRS = ("current_gradient_accumulation_steps",)


def _set_in_sources(cls, attr: str) -> bool:
    """Whether ``self.<attr>`` is assigned in the module of ``cls`` or of one of its bases."""
    for base in cls.__mro__[:-1]:
        module = inspect.getmodule(base)
        with contextlib.suppress(OSError, TypeError):
            if f"self.{attr} =" in inspect.getsource(module):
                return True
    return False


def check_trainer_attrs(owner) -> None:
    """Raise ``TypeError`` unless ``owner`` (a trainer class or instance) has the attributes the patch reads: on an
    instance the attributes themselves; on a class, their assignments in ``__init__`` and the shuffle in
    ``_prepare_inputs`` that ``group_shuffle`` replaces."""
    if isinstance(owner, type):
        init_src = inspect.getsource(owner.__init__)
        missing = [a for a in TRAINER_ATTRS if f"self.{a}" not in init_src and not hasattr(owner, a)]
        prepare_src = inspect.getsource(inspect.unwrap(getattr(owner, PREPARE_METHOD)))
        if "shuffle_sequence_dict(" not in prepare_src:
            missing.append("shuffle_sequence_dict (in _prepare_inputs)")
        missing += [f"args.{a}" for a in ARGS_ATTRS if a not in prepare_src + init_src]
    else:
        missing = [a for a in TRAINER_ATTRS if not hasattr(owner, a)]
        missing += [f"args.{a}" for a in ARGS_ATTRS if not hasattr(getattr(owner, "args", None), a)]
    cls = owner if isinstance(owner, type) else type(owner)
    missing += [a for a in LOOP_ATTRS if not _set_in_sources(cls, a)]
    if not hasattr(importlib.import_module(cls.__module__), "shuffle_sequence_dict"):
        missing.append(f"{cls.__module__}.shuffle_sequence_dict")
    if missing:
        name = getattr(owner, "__name__", type(owner).__name__)
        raise TypeError(f"{name} lacks {missing}, which the grpo_mem patch reads (written against TRL 1.16)")


def liger_support(owner) -> tuple[bool, str | None]:
    """How the patch serves ``use_liger_kernel=True`` on ``owner`` (a trainer class or instance): (whether to replace
    ``HIDDEN_METHOD``, why TRL's Liger loss cannot be served, or None).

    Without ``LIGER_LOSS_METHOD`` (TRL 1.14+, RLOO) the flag only swaps Liger's layer kernels into the model, which the
    prompt-once path calls as the stock forward does: nothing to replace. With it, the hidden-state method is replaced
    when its signature is TRL 1.10-1.13's; otherwise the cause names the difference (the caller warns when it applies).
    """
    if not hasattr(owner, LIGER_LOSS_METHOD):
        return False, None
    try:
        check_signature(owner, HIDDEN_METHOD, HIDDEN_PARAMS)
    except TypeError as err:
        return False, (
            f"use_liger_kernel=True: TRL's Liger loss scores the policy through its own {HIDDEN_METHOD}, which grpo_mem "
            f"does not replace here ({err})"
        )
    return True, None

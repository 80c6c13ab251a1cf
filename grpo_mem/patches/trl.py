"""The TRL patch: with ``grpo_mem.verify``, which builds on it, the only code of grpo_mem that knows TRL.

Two methods of ``GRPOTrainer``/``RLOOTrainer`` (written against TRL 1.16; 1.10-1.15 pass the parity tests too) are
replaced by reference, on the class or on one trainer instance, and put back by ``PatchHandle.revert()``:

- ``_get_per_token_logps_and_entropies``: every caller (policy with gradients, old log-probs, separate reference
  model, PEFT reference with the adapter disabled) goes through ``shared_prompt_logprobs`` chunk by chunk, inside
  ``accelerator.autocast()`` as stock does. Inputs the prompt-once path does not cover (vision inputs,
  ``token_type_ids``, the MoE aux loss, unsupported models, a chunk with no repeated prompt) go to the stock method,
  with one warning per cause.
- ``_prepare_inputs``: TRL shuffles the generation batch row by row before splitting it into micro-batches, so a
  micro-batch rarely holds two completions of one prompt. During this method only (with ``group_shuffle``), the
  module's ``shuffle_sequence_dict`` is replaced by a group-aware shuffle (whole groups in random order, rows in
  random order within each group); the same rows reach training, each exactly once. It also plans the trainer's
  ``SharingSession`` window (the micro-batches up to the end of the gradient-accumulation window), so a prompt
  spread over several of them is forwarded and backpropagated once.

The patch keeps its state on its ``PatchHandle`` (sessions per trainer, the models it touched), never on the
trainer; before touching anything it checks what it relies on: the two methods' signatures and the trainer attributes
it reads (not a version range), plus a floor (TRL >= 1.10) and a list of releases refused by name.
"""

from __future__ import annotations

import importlib
import inspect
import types
import weakref

import torch

from ..model.distributed import agree_fallback, lockstep, unwrap_causal_lm
from ..model.group_forward import check_sharing, find_groups, restore, shared_prompt_logprobs
from ..model.support import unsupported_reason, warn_fallback
from ..model.sharing import SharingSession

MIN_TRL = (1, 10)
# Releases refused by name although their signatures pass, as (major, minor[, micro]) -> why. Empty: every release
# from 1.10 to 1.16 passes the checks below and the parity tests (README, "TRL releases tested").
KNOWN_BAD_TRL: dict[tuple[int, ...], str] = {}
LOGPS_METHOD = "_get_per_token_logps_and_entropies"
PREPARE_METHOD = "_prepare_inputs"
LOGPS_PARAMS = (
    "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
    "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
PREPARE_PARAMS = ("self", "generation_batch")
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

    Newer releases are not refused by number: ``patch_trl`` checks the methods' signatures and the trainer attributes
    it reads instead, and refuses (``TypeError``) a release that changed them.
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


def _check_signature(owner, name: str, expected: tuple[str, ...]) -> None:
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
        _check_signature(owner, DISPATCH_TARGET, expected)  # TRL 1.14.x
        return
    if got != expected:
        raise TypeError(f"{name} of {owner!r} has parameters {got}, grpo_mem was written against {expected}")


def group_shuffle(seq_dict: dict, batch_size: int) -> dict:
    """Shuffle a TRL generation batch by whole groups: groups in random order, rows in random order within a group.

    Groups are rows with identical prompts (``prompt_ids``/``prompt_mask``, padding ignored). With the rows laid out
    group after group, splitting into micro-batches of ``batch_size`` keeps a group whole whenever ``batch_size`` is
    a multiple of its size, and spreads it over consecutive micro-batches when ``batch_size`` is smaller. Values that
    are not sequences (0-d tensors, None) are kept as they are; lists and tensors are permuted in unison.
    Randomness comes from ``torch.randperm``, as in TRL's ``shuffle_sequence_dict``.
    """
    if seq_dict.get("prompt_ids") is None or seq_dict.get("prompt_mask") is None:
        raise ValueError(f"group_shuffle needs prompt_ids and prompt_mask, got keys {sorted(seq_dict)}")
    _, inverse = find_groups(seq_dict["prompt_ids"], seq_dict["prompt_mask"])
    inverse = inverse.cpu()
    n_groups = int(inverse.max()) + 1
    group_order = torch.randperm(n_groups)
    rows = []
    for g in group_order.tolist():
        members = (inverse == g).nonzero().flatten()
        rows.append(members[torch.randperm(members.numel())])
    permutation = torch.cat(rows)

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in seq_dict.items()}


# what the patched methods read of a trainer, checked before patching (names, then on first use the attributes)
TRAINER_ATTRS = ("_buffered_inputs", "_step", "num_iterations", "temperature", "accelerator", "args")
ARGS_ATTRS = ("steps_per_generation", "per_device_train_batch_size")


def _check_trainer_attrs(owner) -> None:
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
    if missing:
        name = getattr(owner, "__name__", type(owner).__name__)
        raise TypeError(f"{name} lacks {missing}, which the grpo_mem patch reads (written against TRL 1.16)")


def _make_logps(original, handle: PatchHandle):
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **extras,
    ):  # fmt: skip
        def stock(ids, mask):
            return original(
                self, model, ids, mask, logits_to_keep, batch_size=ids.shape[0], compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss, **extras,
            )  # fmt: skip

        used = sorted(k for k, v in extras.items() if v is not None)
        if used:
            reason = f"multimodal or token-type inputs {used}"
        elif compute_aux_loss:
            reason = "the MoE load-balancing aux loss is requested"
        else:
            reason = unsupported_reason(unwrap_causal_lm(model), input_ids.shape[1])
        # sharded ranks decide together: one rank on the stock path and another on ours would issue different
        # collectives (and hang)
        in_lockstep = lockstep(model)
        if in_lockstep:
            reason = agree_fallback(model, reason)
        if reason is not None:
            warn_fallback(reason)
            return original(
                self, model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extras,
            )  # fmt: skip

        # The training micro-batch _prepare_inputs planned (gradients on, its rows in one chunk) is scored through the
        # trainer's sharing session; every other call (no-grad callers, reference model) on its own.
        planned = handle._planned.pop(self, None)
        session = handle.sessions.get(self)
        batch_size = batch_size or input_ids.size(0)
        if not (planned == input_ids.shape[0] == batch_size and torch.is_grad_enabled() and model.training):
            session = None
        handle.models.add(unwrap_causal_lm(model))
        all_logps, all_entropies = [], []
        P = input_ids.shape[1] - logits_to_keep
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            first, _ = find_groups(ids[:, :P], mask[:, :P])
            shared = session is not None and session.shares(ids[:, :P], mask[:, :P])
            # in lockstep ours runs anyway: exact, and the same module calls as on ranks whose prompts repeat
            if first.numel() == ids.shape[0] and not shared and not in_lockstep:
                warn_fallback("a micro-batch holds no repeated prompt")
                if session is not None:
                    session.skip()
                logps, entropies, _ = stock(ids, mask)
            else:
                options = dict(temperature=self.temperature, compute_entropy=compute_entropy,
                               cast_lm_head_to_fp32=bool(getattr(self.args, "cast_lm_head_to_fp32", False)))
                with self.accelerator.autocast():
                    if session is not None:
                        logps, entropies = session.score(model, ids, mask, logits_to_keep, **options)
                    else:
                        logps, entropies = shared_prompt_logprobs(model, ids, mask, logits_to_keep, **options,
                                                                  sharing=handle.sharing)  # fmt: skip
            all_logps.append(logps)
            all_entropies.append(entropies)
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return logps, entropies, None

    _get_per_token_logps_and_entropies.__wrapped_original__ = original
    setattr(_get_per_token_logps_and_entropies, _MARK, True)
    return _get_per_token_logps_and_entropies


def _window_prompts(trainer) -> tuple[list, list]:
    """Prompt ids and masks of the micro-batches from the current one to the end of its gradient-accumulation window
    (windows start where ``_step`` is a multiple of the accumulation steps), within the current generation buffer."""
    buffered = trainer._buffered_inputs
    spg = trainer.args.steps_per_generation
    generate_every = spg * trainer.num_iterations
    step = trainer._step
    window_end = step - step % trainer.current_gradient_accumulation_steps
    window_end += trainer.current_gradient_accumulation_steps
    ids, masks = [], []
    while True:
        batch = buffered[step % spg]
        P = batch["prompt_ids"].shape[1]
        ids.append(batch["prompt_ids"])
        masks.append(batch["prompt_mask"][:, :P])
        step += 1
        # stop at the window's end, and where the buffer wraps or is regenerated
        if step >= window_end or step % spg == 0 or step % generate_every == 0:
            return ids, masks


def _make_prepare(original, handle: PatchHandle):
    def _prepare_inputs(self, generation_batch):
        module = importlib.import_module(type(self).__module__)
        batch_size = self.args.per_device_train_batch_size
        stock_shuffle = module.shuffle_sequence_dict
        if handle.group_shuffle:
            module.shuffle_sequence_dict = lambda seq_dict: group_shuffle(seq_dict, batch_size)
        try:
            inputs = original(self, generation_batch)
        finally:
            module.shuffle_sequence_dict = stock_shuffle
        if self.model.training and self._buffered_inputs:
            session = handle.sessions.setdefault(self, SharingSession(handle.sharing))
            if self._step % self.current_gradient_accumulation_steps == 0 or not session.in_window:
                model = getattr(self, "model_wrapped", None) or self.model
                session.begin_window(model, *_window_prompts(self))
            if self.accelerator.sync_gradients:  # the Trainer steps after this micro-batch (a short last window)
                session.end_after_next()
            handle._planned[self] = inputs["prompt_ids"].shape[0]
        return inputs

    _prepare_inputs.__wrapped_original__ = original
    setattr(_prepare_inputs, _MARK, True)
    return _prepare_inputs


class PatchHandle:
    """What ``patch_trl`` changed, the state the patched methods keep, and how to undo it. Usable as a context
    manager (reverts on exit).

    Attributes:
        sessions: per trainer, the ``SharingSession`` sharing prompt passes across its micro-batches.
        models: the models the patched methods routed through grpo_mem (``revert`` restores exactly these).
        group_shuffle: whether ``_prepare_inputs`` shuffles by whole groups.
        sharing: the sessions' sharing mode, ``"tree"`` or ``"group"``.
        active: False once reverted.
    """

    def __init__(self, key, *, group_shuffle: bool, sharing: str = "tree"):
        self._key = key
        self._entries = []  # (owner, name, previous value or _MISSING)
        self.sessions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._planned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trainer -> rows planned next
        self.models: weakref.WeakSet = weakref.WeakSet()
        self.group_shuffle = group_shuffle
        self.sharing = sharing
        self.active = True

    def revert(self) -> None:
        """Put every patched method back as it was and give the models this patch touched their own forward and
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
        self._planned.clear()
        _ACTIVE.pop(self._key, None)
        self.active = False

    @property
    def targets(self):
        return sorted({getattr(o, "__name__", type(o).__name__) for o, _, _ in self._entries})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.revert()
        return False

    def __repr__(self):
        return f"PatchHandle(targets={self.targets}, active={self.active})"


_MISSING = object()
_ACTIVE: dict = {}


def _default_targets():
    import trl

    return [trl.GRPOTrainer, trl.RLOOTrainer]


def patch_trl(target=None, *, group_shuffle: bool = True, sharing: str = "tree") -> PatchHandle:
    """Route TRL's GRPO/RLOO log-prob computation through grpo_mem's prompt-once path.

    Args:
        target: None patches the classes ``trl.GRPOTrainer`` and ``trl.RLOOTrainer``; a trainer class patches that
            class; a trainer instance patches only that instance.
        group_shuffle: make the generation-batch shuffle group-aware, so micro-batches hold whole groups. Either
            way, a prompt whose completions are spread over the micro-batches of one optimizer step is forwarded
            once (``SharingSession``).
        sharing: ``"tree"``: a span shared by several prompts of an optimizer step (system prompt, few-shot block)
            is forwarded once per step and each prompt's own part once, at positions that keep stock TRL's position
            differences; ``"group"``: each unique prompt is forwarded whole, once per step. Sharded ranks in lockstep
            (FSDP, DeepSpeed) share by group either way.

    Returns:
        A ``PatchHandle``; ``handle.revert()`` (or leaving ``with patch_trl(...):``) restores everything. Calling
        ``patch_trl`` again on a patched target returns the same active handle.

    Raises:
        RuntimeError: the installed TRL is older than 1.10 or a release refused by name (``KNOWN_BAD_TRL``).
        ValueError: unknown ``sharing``.
        TypeError: a target lacks the methods or the attributes the patch reads, or the methods' signatures differ
            from TRL 1.16's (nothing is changed then).
    """
    check_trl_version()
    check_sharing(sharing)
    owners = _default_targets() if target is None else [target]
    key = tuple(id(o) for o in owners)
    if key in _ACTIVE:
        return _ACTIVE[key]
    for owner in owners:
        _check_signature(owner, LOGPS_METHOD, LOGPS_PARAMS)
        _check_signature(owner, PREPARE_METHOD, PREPARE_PARAMS)
        if getattr(getattr(owner, LOGPS_METHOD), _MARK, False):
            # already routed through grpo_mem, e.g. an instance of a patched class: the covering handle stands
            covering = [h for h in _ACTIVE.values() if any(o in (owner, type(owner)) for o, _, _ in h._entries)]
            if covering:
                return covering[0]
        _check_trainer_attrs(owner)
        cls = owner if isinstance(owner, type) else type(owner)
        if not hasattr(importlib.import_module(cls.__module__), "shuffle_sequence_dict"):
            raise TypeError(f"{cls.__module__} has no shuffle_sequence_dict, which the grpo_mem patch swaps")

    handle = PatchHandle(key, group_shuffle=group_shuffle, sharing=sharing)
    for owner in owners:
        for name, make in ((LOGPS_METHOD, _make_logps), (PREPARE_METHOD, _make_prepare)):
            if isinstance(owner, type):
                previous = owner.__dict__.get(name, _MISSING)
                original = getattr(owner, name)
                setattr(owner, name, make(original, handle))
            else:
                previous = owner.__dict__.get(name, _MISSING)
                original = getattr(type(owner), name)
                owner.__dict__[name] = types.MethodType(make(original, handle), owner)
            handle._entries.append((owner, name, previous))
    _ACTIVE[key] = handle
    return handle

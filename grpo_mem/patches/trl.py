"""The TRL patch: the only module of grpo_mem that knows TRL.

Two methods of ``GRPOTrainer``/``RLOOTrainer`` (TRL 1.16) are replaced by reference, on the class or on one trainer
instance, and put back by ``PatchHandle.revert()``:

- ``_get_per_token_logps_and_entropies``: every caller (policy with gradients, old log-probs, separate reference
  model, PEFT reference with the adapter disabled) goes through ``shared_prompt_logprobs`` chunk by chunk, inside
  ``accelerator.autocast()`` as stock does. Inputs the prompt-once path does not cover (vision inputs,
  ``token_type_ids``, the MoE aux loss, unsupported models, a chunk with no repeated prompt) go to the stock method,
  with one warning per cause.
- ``_prepare_inputs``: TRL shuffles the generation batch row by row before splitting it into micro-batches, so a
  micro-batch rarely holds two completions of one prompt. During this method only, the module's
  ``shuffle_sequence_dict`` is replaced by a group-aware shuffle (whole groups in random order, rows in random order
  within each group); the same rows reach training, each exactly once.
"""

from __future__ import annotations

import importlib
import inspect
import types

import torch

from ..model.group_forward import (
    PromptStore,
    find_groups,
    joint_fallback,
    lockstep,
    prompt_keys,
    store_schedule,
    restore_all,
    shared_prompt_logprobs,
    unsupported_reason,
    unwrap_causal_lm,
    warn_fallback,
)

SUPPORTED_TRL = ((1, 16), (1, 17))  # [lower, upper)
LOGPS_METHOD = "_get_per_token_logps_and_entropies"
PREPARE_METHOD = "_prepare_inputs"
LOGPS_PARAMS = (
    "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
    "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
PREPARE_PARAMS = ("self", "generation_batch")
_MARK = "__grpo_mem_patch__"


def _trl_version() -> tuple[int, int, str]:
    import trl

    parts = trl.__version__.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0), trl.__version__


def check_trl_version() -> None:
    """Raise ``RuntimeError`` unless the installed TRL is in the tested range (1.16.x)."""
    major, minor, full = _trl_version()
    (lo, hi) = SUPPORTED_TRL
    if not lo <= (major, minor) < hi:
        raise RuntimeError(
            f"grpo_mem patches TRL {lo[0]}.{lo[1]}.x only (the loss path it replaces is pinned to that release), "
            f"found trl {full}"
        )


def _check_signature(owner, name: str, expected: tuple[str, ...]) -> None:
    fn = getattr(owner, name, None)
    if fn is None:
        raise TypeError(f"{getattr(owner, '__name__', type(owner).__name__)} has no method {name}")
    fn = getattr(fn, "__wrapped_original__", fn)
    params = tuple(inspect.signature(fn).parameters)
    if isinstance(owner, type) or params[:1] == ("self",):
        got = params
    else:  # bound method of an instance
        got = ("self", *params)
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


def _make_logps(original):
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
        reason = joint_fallback(model, reason)
        in_lockstep = lockstep(model)
        if reason is not None:
            warn_fallback(reason)
            return original(
                self, model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extras,
            )  # fmt: skip

        # A training micro-batch (gradients on) shares prompt passes with the other micro-batches of its
        # gradient-accumulation window, as planned by the patched _prepare_inputs for exactly these rows.
        plan = self.__dict__.pop("_grpo_mem_plan", None)
        store = later = None
        if (plan is not None and plan["store"] is not None and torch.is_grad_enabled() and model.training
                and plan["rows"] == input_ids.shape[0]):  # fmt: skip
            store, later, final = plan["store"], plan["later"], plan["final"]
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies = [], []
        P = input_ids.shape[1] - logits_to_keep
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            first, _ = find_groups(ids[:, :P], mask[:, :P])
            shared = store is not None and any(
                k in later or k in store.entries for k in prompt_keys(ids[first, :P], mask[first, :P])
            )
            # in lockstep ours runs anyway: exact, and the same module calls as on ranks whose prompts repeat
            if first.numel() == ids.shape[0] and not shared and not in_lockstep:
                warn_fallback("a micro-batch holds no repeated prompt")
                logps, entropies, _ = stock(ids, mask)
            else:
                with self.accelerator.autocast():
                    logps, entropies = shared_prompt_logprobs(
                        model, ids, mask, logits_to_keep, temperature=self.temperature,
                        compute_entropy=compute_entropy,
                        cast_lm_head_to_fp32=bool(getattr(self.args, "cast_lm_head_to_fp32", False)),
                        _store=store, _later=later,
                    )  # fmt: skip
            all_logps.append(logps)
            all_entropies.append(entropies)
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        if store is not None and final:
            logps = store.flush_into(logps)
        return logps, entropies, None

    _get_per_token_logps_and_entropies.__wrapped_original__ = original
    setattr(_get_per_token_logps_and_entropies, _MARK, True)
    return _get_per_token_logps_and_entropies


def _batch_keys(batch) -> list[bytes]:
    P = batch["prompt_ids"].shape[1]
    return prompt_keys(batch["prompt_ids"], batch["prompt_mask"][:, :P])


def _window_plan(trainer, inputs) -> dict:
    """How the micro-batch about to be trained shares prompt passes within its gradient-accumulation window.

    ``later``: prompts that a later micro-batch of the same window and generation buffer holds, when this
    micro-batch does not close the window (``accelerator.sync_gradients`` is False: the Trainer sets it before each
    micro-batch, True on the window's last; windows start where ``_step`` is a multiple of the accumulation steps).
    ``final``: close the window, resolving every pending prompt in this micro-batch's backward.

    Sharded ranks (``lockstep``) share prompts across micro-batches only when every rank's ``store_schedule`` for
    the rest of the window is the same (one ``all_gather_object``); otherwise each of their micro-batches forwards
    its own prompts for this window, which is exact and makes the same module calls on every rank.
    """
    store = trainer.__dict__.setdefault("_grpo_mem_store", PromptStore())
    final = bool(trainer.accelerator.sync_gradients)
    coming: list[list[bytes]] = []
    buffered = getattr(trainer, "_buffered_inputs", None)
    spg = trainer.args.steps_per_generation
    if not final and buffered:
        index = trainer._step % spg
        generate_every = spg * trainer.num_iterations
        window_end = trainer._step - trainer._step % trainer.current_gradient_accumulation_steps
        window_end += trainer.current_gradient_accumulation_steps
        step = trainer._step + 1
        # micro-batches still to come from this window and buffer (regeneration starts a new one)
        while step < window_end and step % spg > index and step % generate_every != 0:
            coming.append(_batch_keys(buffered[step % spg]))
            step += 1
    plan = {"store": store, "later": frozenset(k for keys in coming for k in keys), "final": final,
            "rows": inputs["prompt_ids"].shape[0]}  # fmt: skip
    if lockstep(getattr(trainer, "model_wrapped", None) or trainer.model):
        import torch.distributed as dist

        closes = final or (step == window_end)
        mine = store_schedule(store.entries, [_batch_keys(inputs), *coming], closes=closes)
        schedules = [None] * dist.get_world_size()
        dist.all_gather_object(schedules, mine)
        if any(s != mine for s in schedules):
            if len(store):
                raise RuntimeError(f"grpo_mem: sharded ranks diverged mid-window with prompts pending: {schedules}")
            plan.update(later=frozenset(), final=False, store=None)
    return plan


def _make_prepare(original):
    def _prepare_inputs(self, generation_batch):
        module = importlib.import_module(type(self).__module__)
        if not hasattr(module, "shuffle_sequence_dict"):
            return original(self, generation_batch)
        batch_size = self.args.per_device_train_batch_size
        stock_shuffle = module.shuffle_sequence_dict
        module.shuffle_sequence_dict = lambda seq_dict: group_shuffle(seq_dict, batch_size)
        try:
            inputs = original(self, generation_batch)
        finally:
            module.shuffle_sequence_dict = stock_shuffle
        if self.model.training:
            self.__dict__["_grpo_mem_plan"] = _window_plan(self, inputs)
        return inputs

    _prepare_inputs.__wrapped_original__ = original
    setattr(_prepare_inputs, _MARK, True)
    return _prepare_inputs


class PatchHandle:
    """What ``patch_trl`` changed, and how to undo it. Usable as a context manager (reverts on exit)."""

    def __init__(self, key, entries):
        self._key = key
        self._entries = entries  # (owner, name, previous value or _MISSING)
        self.active = True

    def revert(self) -> None:
        """Put every patched method back as it was and give touched models their own forward and attention back;
        idempotent."""
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
        restore_all()
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


def patch_trl(target=None, *, group_shuffle: bool = True) -> PatchHandle:
    """Route TRL's GRPO/RLOO log-prob computation through grpo_mem's prompt-once path.

    Args:
        target: None patches the classes ``trl.GRPOTrainer`` and ``trl.RLOOTrainer``; a trainer class patches that
            class; a trainer instance patches only that instance.
        group_shuffle: also make the generation-batch shuffle group-aware, so micro-batches hold whole groups.

    Returns:
        A ``PatchHandle``; ``handle.revert()`` (or leaving ``with patch_trl(...):``) restores everything. Calling
        ``patch_trl`` again on a patched target returns the same active handle.

    Raises:
        RuntimeError: the installed TRL is not 1.16.x.
        TypeError: a target lacks the methods, or their signatures differ from TRL 1.16's (nothing is changed then).
    """
    check_trl_version()
    owners = _default_targets() if target is None else [target]
    key = tuple(id(o) for o in owners)
    if key in _ACTIVE:
        return _ACTIVE[key]
    for owner in owners:
        _check_signature(owner, LOGPS_METHOD, LOGPS_PARAMS)
        if group_shuffle:
            _check_signature(owner, PREPARE_METHOD, PREPARE_PARAMS)
        if getattr(getattr(owner, LOGPS_METHOD), _MARK, False):
            # already routed through grpo_mem, e.g. an instance of a patched class: the covering handle stands
            covering = [h for h in _ACTIVE.values() if any(o in (owner, type(owner)) for o, _, _ in h._entries)]
            if covering:
                return covering[0]

    methods = [(LOGPS_METHOD, _make_logps)] + ([(PREPARE_METHOD, _make_prepare)] if group_shuffle else [])
    entries = []
    for owner in owners:
        for name, make in methods:
            if isinstance(owner, type):
                previous = owner.__dict__.get(name, _MISSING)
                original = getattr(owner, name)
                setattr(owner, name, make(original))
            else:
                previous = owner.__dict__.get(name, _MISSING)
                original = getattr(type(owner), name)
                owner.__dict__[name] = types.MethodType(make(original), owner)
            entries.append((owner, name, previous))
    handle = PatchHandle(key, entries)
    _ACTIVE[key] = handle
    return handle


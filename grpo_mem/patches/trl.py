"""The TRL patch: with ``grpo_mem.patches.verify``, the only code of grpo_mem that knows TRL.

Two methods of ``GRPOTrainer``/``RLOOTrainer`` (written against TRL 1.16; 1.10-1.15 pass the parity tests too), and
on TRL 1.10-1.13 a third, are replaced by reference, on the class or on one trainer instance, and put back by
``PatchHandle.revert()``:

- ``_get_per_token_logps_and_entropies``: every caller (policy with gradients, old log-probs, separate reference
  model, PEFT reference with the adapter disabled) is scored chunk by chunk through the trainer's
  ``SharingSession``, which takes one decision per chunk (``SharingSession.decide``: prompt-once in tree or group
  mode, or TRL's own method with the cause, warned once per cause) and runs it. Inputs only TRL's own method takes
  (image inputs outside ``trl_images.SERVED_INPUTS``) are a cause the patch names; the MoE router aux loss is
  returned per chunk as TRL computes it (``grpo_mem.model.router``). For the policy's training
  micro-batches, the decision's token counts and path go into TRL's logged metrics (``grpo_mem/...``).
- ``_prepare_inputs``: TRL shuffles the generation batch row by row before splitting it into micro-batches, so a
  micro-batch rarely holds two completions of one prompt. Only with ``group_shuffle=True`` (not the default: it
  changes objectives that depend on which rows share a micro-batch), during this method only, the module's
  ``shuffle_sequence_dict`` is replaced by a group-aware shuffle (whole groups in random order, rows in random order
  within each group); the same rows reach training, each exactly once. It also opens the session's
  window (the micro-batches up to the end of the gradient-accumulation window), so a prompt spread over several of
  them is forwarded and backpropagated once.
- ``_get_last_hidden_state`` (TRL 1.10-1.13, ``use_liger_kernel=True``): ``compute_liger_loss`` takes the policy's
  (B, C, H) final hidden states from it for Liger's fused linear GRPO loss; they come from the same decision and
  window (``SharingSession.run_hidden``), before the head. Where that method differs from 1.10-1.13's, it is left
  alone and a trainer with the flag warns once (``checks.liger_support``). TRL 1.14+ keep the log-prob method under
  the flag and only swap Liger's layer kernels into the model, which the prompt-once path calls like stock.

The patch keeps its state on its ``PatchHandle`` (``grpo_mem.patches.handle``: a session per trainer, the models it
touched), never on the trainer; before touching anything it checks what it relies on (``grpo_mem.patches.checks``).
Sequence parallelism's hooks (``grpo_mem.patches.trl_sp``) are installed only where it is asked for
(``grpo_mem.patches.sp_request``); a plain patch does not import them.
"""

from __future__ import annotations

import importlib

import torch

from ..model.distributed import unwrap_causal_lm
from ..model.plan import check_sharing, find_groups
from ..model.sharing import Decision
from ..model.fallback import warn_fallback
from ..ops._backends import check_choice, env_preference
from . import trl_images
from .checks import (
    _MARK,
    HIDDEN_METHOD,
    HIDDEN_PARAMS,
    LOGPS_METHOD,
    LOGPS_PARAMS,
    PREPARE_METHOD,
    PREPARE_PARAMS,
    check_not_async,
    check_signature,
    check_trainer_attrs,
    check_trl_version,
    liger_support,
)
from .handle import PatchHandle, check_backend, covering_handle, register, registered, repatch
from .sp_request import install_sequence_parallel, make_init, sequence_parallel_asked

METRIC_PREFIX = "grpo_mem/"
PATHS = ("tree", "group", "stock")


def group_shuffle(seq_dict: dict) -> dict:
    """Shuffle a TRL generation batch by whole groups: groups in random order, rows in random order within a group.

    Groups are rows with identical prompts (``prompt_ids``/``prompt_mask``, padding ignored). With the rows laid out
    group after group, splitting into micro-batches of B rows keeps a group whole whenever B is a multiple of its
    size, and spreads it over consecutive micro-batches when B is smaller. Values that
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


def log_decision(trainer, decision: Decision) -> None:
    """Add a training micro-batch's decision to TRL's metrics (averaged over the step when TRL logs): tokens the
    backbone ran, tokens stock TRL would have run, their ratio, and one 0/1 entry per path."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None or "train" not in metrics:
        return
    train = metrics["train"]
    train[METRIC_PREFIX + "backbone_tokens"].append(float(decision.backbone_tokens))
    train[METRIC_PREFIX + "stock_tokens"].append(float(decision.stock_tokens))
    train[METRIC_PREFIX + "token_ratio"].append(decision.backbone_tokens / decision.stock_tokens)
    for path in PATHS:
        train[f"{METRIC_PREFIX}path/{path}"].append(float(decision.path == path))


def _image_inputs(extras: dict, model, prompt_ids) -> tuple[str | None, dict]:
    """(why the prompt-once path does not take the image arguments ``extras``, or None; ``chunk_images``' keyword
    arguments for them, empty when none is given): the text path opens no image code."""
    if all(v is None for v in extras.values()):
        return None, {}
    cause = trl_images.input_cause(extras)
    from ..model.multimodal import image_token_id

    return cause, dict(prompt_ids=prompt_ids, image_token=image_token_id(unwrap_causal_lm(model)))


def _stock_call(original, trainer, model, ids, mask, logits_to_keep, chunk_size, options, extras):
    """TRL's own method ``original`` on one chunk, as a ``SharingSession.run`` stock path."""

    def stock():
        out = original(
            trainer,
            model,
            ids,
            mask,
            logits_to_keep,
            batch_size=chunk_size,
            compute_entropy=options["compute_entropy"],
            compute_aux_loss=options["compute_aux_loss"],
            **extras,
        )
        return out[0], out[1], (out[2] if len(out) > 2 else None)

    return stock


def patched_logps_method(original, handle: PatchHandle):
    """The patched ``_get_per_token_logps_and_entropies`` around TRL's ``original``, keeping its state on ``handle``."""

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **extras,
    ):
        cause, located = _image_inputs(extras, model, input_ids[:, : input_ids.shape[1] - logits_to_keep])
        B = input_ids.size(0)
        # inputs the prompt-once path does not take: the call is one decision, scored by TRL whole (it slices them)
        step = B if cause is not None else (batch_size or B)
        session = handle.session(self)
        handle.models.add(unwrap_causal_lm(model))
        training = torch.is_grad_enabled() and model.training
        options = dict(
            temperature=self.temperature,
            compute_entropy=compute_entropy,
            cast_lm_head_to_fp32=bool(getattr(self.args, "cast_lm_head_to_fp32", False)),
            compute_aux_loss=compute_aux_loss,
        )
        outs = []
        for start in range(0, B, step):
            ids, mask = input_ids[start : start + step], attention_mask[start : start + step]
            vision = None
            if located and cause is None:
                vision = trl_images.chunk_images(extras, start, start + ids.shape[0], B, **located)
            chunk_extras = extras if vision is None else trl_images.chunk_kwargs(vision)
            chunk_size = batch_size if cause is not None else ids.shape[0]

            stock = _stock_call(original, self, model, ids, mask, logits_to_keep, chunk_size, options, chunk_extras)
            decision = session.decide(
                model,
                ids,
                mask,
                logits_to_keep,
                **options,
                cause=cause,
                stock_available=True,
                vision=vision,
                autocast=self.accelerator.autocast,
            )
            outs.append(session.run(decision, stock=stock))
            if training and handle.log_metrics:
                log_decision(self, decision)
        logps = torch.cat([o[0] for o in outs], dim=0)
        entropies = torch.cat([o[1] for o in outs], dim=0) if compute_entropy else None
        # TRL's own method: the mean of the per-chunk losses (a stock call scored whole returned that mean already)
        aux_loss = torch.stack([o[2] for o in outs]).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss

    _get_per_token_logps_and_entropies.__wrapped_original__ = original
    setattr(_get_per_token_logps_and_entropies, _MARK, True)
    return _get_per_token_logps_and_entropies


def patched_method(original, *, sharing: str = "tree", confirm: bool | None = None, log_metrics: bool = False):
    """TRL's scoring method ``original`` (an unbound ``_get_per_token_logps_and_entropies``) patched on a private
    ``PatchHandle`` (installed on no class or trainer; ``group_shuffle`` off, no sequence-parallel hooks): the one way
    to call the patched method directly, e.g. ``method(trainer, model, input_ids, attention_mask, logits_to_keep,
    ...)``. Returns ``(method, handle)``; ``handle.session(trainer)`` is the trainer's ``SharingSession`` (to open a
    window with ``begin_window``). It scores on this process alone, without the trainer's sequence parallelism
    (``verify`` compares the local computation). Raises ValueError for an unknown ``sharing``."""
    handle = PatchHandle(
        None, group_shuffle=False, sharing=check_sharing(sharing), log_metrics=log_metrics, confirm=confirm
    )
    return patched_logps_method(original, handle), handle


def patched_hidden_method(original, handle: PatchHandle):
    """The patched ``_get_last_hidden_state`` of TRL 1.10-1.13 (``compute_liger_loss``'s source of the policy's (B, C, H)
    hidden states for Liger's fused GRPO loss) around TRL's ``original``, keeping its state on ``handle``: the same
    decision, fallback and metrics as the log-prob method, with the window's hidden states instead of log-probs."""

    def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        extras = dict(zip(HIDDEN_PARAMS[5:], args), **kwargs)
        session = handle.session(self)
        causal_lm = unwrap_causal_lm(unwrapped_model)
        handle.models.add(causal_lm)
        # the wrapped model tells whether ranks run in lockstep; TRL already runs this inside its forward
        wrapped = getattr(self, "model_wrapped", None)
        model = wrapped if wrapped is not None and unwrap_causal_lm(wrapped) is causal_lm else unwrapped_model
        used = sorted(k for k, v in extras.items() if v is not None)  # image prompts: not on this path yet
        cause = f"multimodal inputs {used} on TRL's Liger hidden-state path" if used else None
        decision = session.decide(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            temperature=self.temperature,
            cause=cause,
            stock_available=True,
        )
        hidden = session.run_hidden(
            decision,
            stock=lambda: original(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, **extras),
        )
        if torch.is_grad_enabled() and unwrapped_model.training and handle.log_metrics:
            log_decision(self, decision)
        return hidden

    _get_last_hidden_state.__wrapped_original__ = original
    setattr(_get_last_hidden_state, _MARK, True)
    return _get_last_hidden_state


def _window_prompts(trainer) -> tuple[list, list, list | None]:
    """Prompt ids, masks and image inputs (``VisionInputs`` or None per micro-batch; None if no micro-batch has
    images) of the micro-batches from the current one to the end of its gradient-accumulation window (windows start where ``_step`` is a multiple of the
    accumulation steps), within the current generation buffer."""
    buffered = trainer._buffered_inputs
    spg = trainer.args.steps_per_generation
    generate_every = spg * trainer.num_iterations
    step = trainer._step
    window_end = step - step % trainer.current_gradient_accumulation_steps
    window_end += trainer.current_gradient_accumulation_steps
    ids, masks, images = [], [], []
    while True:
        batch = buffered[step % spg]
        P = batch["prompt_ids"].shape[1]
        ids.append(batch["prompt_ids"])
        masks.append(batch["prompt_mask"][:, :P])
        extras = {k: batch.get(k) for k in trl_images.IMAGE_INPUTS}
        cause, located = _image_inputs(extras, trainer.model, batch["prompt_ids"])
        images.append(
            None
            if cause is not None or not located
            else trl_images.chunk_images(extras, 0, len(ids[-1]), len(ids[-1]), **located)
        )
        step += 1
        # stop at the window's end, and where the buffer wraps or is regenerated
        if step >= window_end or step % spg == 0 or step % generate_every == 0:
            return ids, masks, None if all(v is None for v in images) else images


def _make_prepare(original, handle: PatchHandle):
    def _prepare_inputs(self, generation_batch):
        module = importlib.import_module(type(self).__module__)
        stock_shuffle = module.shuffle_sequence_dict
        if handle.group_shuffle:
            module.shuffle_sequence_dict = group_shuffle
        try:
            with handle.data_parallel(self):  # an SP group generates and scores as one data-parallel rank
                inputs = original(self, generation_batch)
        finally:
            module.shuffle_sequence_dict = stock_shuffle
        if getattr(self.args, "use_liger_kernel", False):
            cause = handle.unserved_liger(self)
            if cause is not None:
                warn_fallback(cause)
        if self.model.training and self._buffered_inputs:
            session = handle.session(self)
            if self._step % self.current_gradient_accumulation_steps == 0 or not session.in_window:
                session.begin_window(*_window_prompts(self))
            if self.accelerator.sync_gradients:  # the Trainer steps after this micro-batch (a short last window)
                session.end_after_next()
        return inputs

    _prepare_inputs.__wrapped_original__ = original
    setattr(_prepare_inputs, _MARK, True)
    return _prepare_inputs


def _default_targets():
    import trl

    return [trl.GRPOTrainer, trl.RLOOTrainer]


def patch_trl(
    target=None,
    *,
    group_shuffle: bool = False,
    sharing: str = "tree",
    confirm: bool | None = None,
    backend: str | None = None,
    sequence_parallel: bool | None = None,
) -> PatchHandle:
    """Route TRL's GRPO/RLOO log-prob computation through grpo_mem's prompt-once path.

    Args:
        target: None patches the classes ``trl.GRPOTrainer`` and ``trl.RLOOTrainer``; a trainer class patches that
            class; a trainer instance patches only that instance.
        group_shuffle: False (default): TRL's own row shuffle, so every micro-batch and optimizer step holds the
            rows stock TRL gives it; a prompt whose completions are spread over the micro-batches of one optimizer
            step is still forwarded once (``SharingSession``). True: shuffle the generation batch by whole groups,
            so micro-batches hold whole groups. The same rows train, each once, but which rows share a micro-batch or
            an optimizer step changes, and with it every objective that depends on that: BNPO's per-micro-batch
            token normalisation, ``top_entropy_quantile``'s per-micro-batch quantile, the entropy bonus's
            per-micro-batch mean, and rows split over optimizer steps (``steps_per_generation`` > gradient
            accumulation).
        sharing: ``"tree"``: a span shared by several prompts of an optimizer step (system prompt, few-shot block)
            is forwarded once per step and each prompt's own part once, at positions that keep stock TRL's position
            differences; ``"group"``: each unique prompt is forwarded whole, once per step. Sharded ranks in lockstep
            (FSDP, DeepSpeed) align their schedules in either mode.
        confirm: the first time a model class (with its architecture-relevant config) is scored in the process,
            confirm on a tiny random copy built from its config that the prompt-once path matches the model's own
            forward (log-probs, entropies, every parameter's gradient, the router loss; about a second of CPU, no
            collective, the user's parameters and random streams untouched); a difference falls back with its
            cause (``grpo_mem.model.confirm``). False: the capability rule alone decides. None: on unless the
            environment sets ``GRPO_MEM_CONFIRM=0``.
        backend: the kernels every op runs while the patch is active, process-wide, over the ``GRPO_MEM_BACKEND``
            environment variable: ``"auto"`` (Triton on CUDA; the C++/ATen kernels on CPU), ``"triton"``,
            ``"torch"`` (torch operations only, on any device: the way back if a compiled kernel misbehaves on your
            GPU), ``"cpp"`` (the CPU kernels). A backend that cannot run a call's tensors (Triton on CPU, cpp on
            CUDA) leaves that call to ``"auto"``. None (default): ``GRPO_MEM_BACKEND`` decides, else auto.
            ``grpo_mem.verify`` reports which backends ran.
        sequence_parallel: whether to install the sequence-parallel hooks (``grpo_mem.patches.trl_sp``: DeepSpeed
            Ulysses through accelerate, ``parallelism_config.sp_size > 1``). True: on the targets; for a class, TRL's
            configs then accept ``sp_size > 1`` while the patch is active (call it before building the config).
            None (default): only where a configuration asks: a target trainer whose ``args.parallelism_config`` has
            ``sp_size > 1``, or, under a class patch, a trainer built with such a config (the patched ``__init__``
            installs them on that trainer). False: never. Without them ``trl_sp`` is not even imported.

    Returns:
        A ``PatchHandle``; ``handle.revert()`` (or leaving ``with patch_trl(...):``) restores everything. Calling
        ``patch_trl`` again on a patched target returns the same active handle, re-patched with the new
        ``group_shuffle``, ``sharing``, ``confirm`` and ``backend`` if they differ (its sharing sessions start again
        in the new mode), the SP hooks added if asked; an instance of a patched class gets its class's handle when
        the options agree.

    Raises:
        RuntimeError: the installed TRL is older than 1.10 or a release refused by name (``KNOWN_BAD_TRL``).
        ValueError: unknown ``sharing`` or ``backend``, or a ``GRPO_MEM_BACKEND`` in the environment that is not one
            of the backends (checked even when ``backend`` is given); another active patch pinning a different
            ``backend``; ``sequence_parallel=False`` for a trainer whose config asks for it; or options that differ from the
            active patch's (naming both values) where they cannot be changed: a sharing window is open (mid-step:
            prompt passes planned or pending), or the target is an instance of a patched class (the class's patch
            would change for every instance).
        TypeError: ``sequence_parallel`` is not None, True or False (naming the value); the target is TRL's
            AsyncGRPOTrainer (``checks.check_not_async``: it scores through packed prefix tries of its own); a target
            lacks the methods or the attributes the patch reads, or the methods' signatures differ
            from TRL 1.16's, or (with sequence parallelism) a hooked TRL/accelerate/transformers function changed
            (``trl_sp.check_hooks``); nothing is changed then.
    """
    options = _checked_options(group_shuffle, sharing, confirm, backend, sequence_parallel)
    owners = _default_targets() if target is None else [target]
    with_sp = sequence_parallel_asked(owners, sequence_parallel)
    key = tuple(id(o) for o in owners)
    handle = registered(key)
    if handle is not None:
        handle = repatch(handle, options)
    else:
        handle = _covering(owners, options) or _new_handle(key, owners, options, auto=sequence_parallel is None)
    if with_sp:
        install_sequence_parallel(handle, owners)
    return handle


def _checked_options(
    group_shuffle: bool, sharing: str, confirm: bool | None, backend: str | None, sequence_parallel: bool | None
) -> dict:
    """The handle's options, once ``sequence_parallel`` (None, True or False: TypeError otherwise, so that ``"no"``
    does not turn it on), the TRL release, ``sharing``, ``backend`` and ``GRPO_MEM_BACKEND`` (which decides again once
    the patch is reverted) passed their checks."""
    if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be None, True or False, got {sequence_parallel!r}")
    check_trl_version()
    check_sharing(sharing)
    if backend is not None:
        check_choice(backend)
    env_preference()
    return dict(sharing=sharing, group_shuffle=group_shuffle, confirm=confirm, backend=backend)


def _covering(owners: list, options: dict) -> PatchHandle | None:
    """Check each owner's patched methods' signatures (TypeError); the active handle already covering one (an instance
    of a patched class), or None."""
    for owner in owners:
        check_not_async(owner)
        check_signature(owner, LOGPS_METHOD, LOGPS_PARAMS)
        check_signature(owner, PREPARE_METHOD, PREPARE_PARAMS)
        covering = covering_handle(owner, options)
        if covering is not None:
            return covering
    return None


def _new_handle(key, owners: list, options: dict, auto: bool) -> PatchHandle:
    """A new active handle with the patched methods installed on ``owners``, once their attributes and the backend
    passed their checks; ``auto``: a class's patched ``__init__`` installs the SP hooks on a trainer whose config asks
    for them."""
    for owner in owners:
        check_trainer_attrs(owner)
    check_backend(key, options["backend"])
    handle = PatchHandle(key, **options)
    for owner in owners:
        _install(handle, owner, init_hook=auto and isinstance(owner, type))
    register(handle)
    return handle


def _install(handle: PatchHandle, owner, init_hook: bool) -> None:
    """Replace ``owner``'s (a trainer class or instance) patched methods with grpo_mem's, bound to ``handle``, which
    records what each replaced so that ``revert`` restores it; ``init_hook``: also its ``__init__``
    (``sp_request.make_init``)."""
    methods = [(LOGPS_METHOD, patched_logps_method), (PREPARE_METHOD, _make_prepare)]
    serve_liger, cause = liger_support(owner)
    if serve_liger:
        methods.append((HIDDEN_METHOD, patched_hidden_method))
    elif cause is not None:
        handle.liger_causes[owner] = cause
    if init_hook:
        methods.append(("__init__", make_init))
    for name, make in methods:
        handle.replace_method(owner, name, make)

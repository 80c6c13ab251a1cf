"""Sequence parallelism for TRL's GRPO/RLOO trainers: the TRL, accelerate and DeepSpeed hooks, installed only when asked.

A user asks for it through accelerate's ``ParallelismConfig``, and says so to the patch:
``grpo_mem.patch_trl(sequence_parallel=True)``, then either DeepSpeed's route, ``GRPOConfig(parallelism_config=
ParallelismConfig(sp_size=N, sp_backend="deepspeed", sp_handler=DeepSpeedSequenceParallelConfig(...)),
deepspeed=...)``, or FSDP2's, ``GRPOConfig(parallelism_config=ParallelismConfig(cp_size=N), fsdp="full_shard",
fsdp_config={"fsdp_version": 2, ...})`` (context parallelism). ``patch_trl`` also installs these hooks on a trainer
whose ``args.parallelism_config`` has ``sp_size > 1`` or ``cp_size > 1`` (given as the target, or built while a class
patch is active); a plain ``patch_trl()`` never imports this module. The ``N`` consecutive ranks of one
sequence-parallel (SP) group (DeepSpeed's SP group, or the ``cp`` dimension of accelerate's device mesh:
``sp_ranks``) act as ONE data-parallel (DP) rank of ``world // N``: they read the same prompts, hold the same
completions, rewards and advantages, and every global quantity TRL computes (the generation batch, reward statistics,
the loss normaliser) is the one a run on ``world // N`` processes without SP computes, step by step; grpo_mem's
scoring splits every pass over the group (``grpo_mem.model.sequence_parallel``). What ``install`` changes, each hook
checked first by ``check_hooks`` (written against TRL 1.16.0, transformers 5.24.0, accelerate 1.15.0, deepspeed
0.19.8):

- **The configuration** (``sp_config``). ``GRPOConfig``/``RLOOConfig.__post_init__`` refuse ``sp_size > 1`` and
  ``cp_size > 1``; ``patched_post_init`` lifts that for ``sp_backend="deepspeed"`` with a ZeRO config and for
  ``cp_size`` without one (``sp_config.CP_CAUSE``), and runs TRL's own ``__post_init__`` with ``world_size`` seen as
  the DP size, so that ``generation_batch_size``, ``steps_per_generation`` and the divisibility checks are those of
  the DP run.
- **The data.** ``get_train_dataloader``/``get_eval_dataloader``: under DeepSpeed SP they run under
  ``sp_ranks.data_parallel`` (accelerate shards the prompts over the DP ranks, so the SP ranks of a group read the
  same), the accelerator's ``deepspeed_ulysses_dl_adapter`` becomes ``sp_ranks.skip_ulysses_adapter`` (the
  dataloader kept whole, DeepSpeed Ulysses' attention override undone), and ``set_initial_training_values`` runs with
  an SP size of 1, as the dataloader is not multiplied by that adapter. Under ``cp_size`` accelerate's
  ``prepare_data_loader`` already gives the ``cp`` ranks the same batches (it divides the process index by the
  ``cp`` size of the mesh); the accelerator's ``_prepare_cp`` becomes ``skip_torch_context_parallel`` (it would hook
  every ``self_attn`` module to drop the attention mask and force causal attention, wrong for left-padded prompts
  and generation) and the trainer's ``_prepare_context_parallel_inputs`` returns the inputs untouched with no
  context (transformers' ``Trainer.training_step`` would shard tensor buffers with torch's experimental
  ``context_parallel`` ring attention, SDPA only, on a GRPO batch that is still a list of prompts).
- **Generation and scoring** (``_prepare_inputs`` through the patch handle, ``compute_loss``) run under
  ``data_parallel``. The group leader alone generates the group's batch (``_generate_single_turn``; its
  completions, sampled log-probs and random states are broadcast to the group, ``sp_ranks.share_generation``).
  Under ZeRO-3 and FSDP2 each generation forward is a parameter collective of every rank (ZeRO-3's gathering,
  FSDP2's per-module unshard), so there the other ranks run TRL's own generation on one stand-in row of one token
  (``stand_in_prompts``) that a stopping criterion ends after its first token, and every rank generates with
  ``synced_gpus=True`` (``generating_in_lockstep``): transformers 5.24's ``generate`` then has a finished rank keep
  calling the model's forward, one cached token per step, until every rank has finished, so each rank joins the
  same collectives (TRL's ``unwrap_model_for_generation`` gather, the prefill, one forward per step) and the leader
  stops when its own rows do. With vLLM, and under ZeRO-3/FSDP2 with transformers' continuous batching or image
  inputs, every SP rank generates the whole batch and takes the leader's outputs. ``_generate``'s outputs and random states are
  the leader's in every case. Reward functions that are plain callables run on the leader alone (``_calculate_rewards``:
  the other ranks join its gather with zeros, which the data-parallel gather drops; a reward function with side
  effects runs once per group); reward models (``nn.Module``) run on every rank, as their forward may be a
  collective. TRL seeds each process with ``seed + process_index`` (``set_seed(device_specific=True)``); under SP,
  ``seed + dp_rank``.

Gradients (``sp_config.sp_gradient_reduction``, consumed as ``SequenceParallel.grad_scale``): DeepSpeed reduces over
all ranks (``seq_data_parallel_group``). ZeRO 1/2 divide by ``world / sp_size`` (deepspeed 0.19.8
``DeepSpeedZeroOptimizer.average_tensor``, ``gradient_reduction_w_predivide``, ``allreduce_bucket``): summed over the
SP group, averaged over DP ranks. ZeRO-3 does so only in its contiguous path
(``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_contiguous_grads``, ``allreduce_bucket``); with ``reduce_scatter`` (its
default) every bucket goes through ``reduce_scatter_coalesced``, which divides by the world size: averaged over the SP
group too (before deepspeed 0.20.2; from it ZeRO-3 sums over the SP group as ZeRO 1/2 do: deepspeedai/DeepSpeed#8854,
``sp_config.deepspeed_sums_sp_gradients``). ZeRO-3 with ``reduce_scatter=False`` mixes both and is refused. FSDP2 under ``cp_size`` reduce-scatters
over the flattened ``dp_shard_cp`` mesh dimension (accelerate's ``fsdp_dim_names``) and averages: over the SP group
too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

from .sp_config import (  # noqa: F401 (CP_CAUSE and unserved: re-exported)
    CP_CAUSE,
    config_classes,
    patched_post_init,
    patched_set_seed,
    reseed,
    sp_gradient_reduction,
    unserved,
)
from .sp_ranks import (
    attention_functions,
    context_parallel,
    data_parallel,
    groups_built,
    layout,
    share_generation,
    skip_ulysses_adapter,
    sp_group,
    trl_modules,
)

SP_METHODS = (
    "get_train_dataloader",
    "get_eval_dataloader",
    "compute_loss",
    "_generate",
    "_generate_single_turn",
    "_calculate_rewards",
    "set_initial_training_values",
    "_prepare_context_parallel_inputs",
)
"""Trainer methods ``install`` wraps (``make_method``); each is TRL's own on a trainer without SP."""

_MARK = "__grpo_mem_sp__"


def ready(trainer) -> bool:
    """Whether ``trainer`` trains with sequence parallelism and its SP groups exist (from the start of ``train()``;
    before it, e.g. in ``grpo_mem.verify``, its ranks score on their own)."""
    return layout(trainer) is not None and groups_built(trainer)


def sequence_parallel(trainer):
    """The ``SequenceParallel`` group grpo_mem's scoring splits ``trainer``'s passes over (``sp_ranks.sp_group``, with
    the gradient scale ``sp_gradient_reduction`` asks for), or None without sequence parallelism.

    Raises:
        RuntimeError: as ``sp_ranks.sp_group``.
    """
    found = sp_group(trainer)
    if found is None:
        return None
    from ..model.sequence_parallel import SequenceParallel

    group, rank, size = found
    scale = {"sum": 1.0, "mean": float(size)}[sp_gradient_reduction(trainer)]
    return SequenceParallel(group, rank, size, scale)


# ------------------------------------------------------------------------------------------------- trainer methods


def _make_dataloader(original, handle):
    def get_dataloader(self, *args, **kwargs):
        if layout(self) is None:
            return original(self, *args, **kwargs)
        # before accelerate prepares the model in train(): DeepSpeed registers its Ulysses attention there, and
        # accelerate's _prepare_cp its attention-mask hooks
        if context_parallel(self.args):
            check_fsdp2(self.accelerator)
            handle.remember(self.accelerator, "_prepare_cp", skip_torch_context_parallel)
            # accelerate's prepare_data_loader gives the cp ranks of the mesh the same batches itself
            return original(self, *args, **kwargs)
        skip = functools.partial(skip_ulysses_adapter, attention_functions())
        handle.remember(self.accelerator, "deepspeed_ulysses_dl_adapter", skip)
        with data_parallel(self):
            return original(self, *args, **kwargs)

    return get_dataloader


def check_fsdp2(accelerator) -> None:
    """Raise ``ValueError`` unless ``accelerator`` trains with FSDP2 (``Accelerator.is_fsdp2``): the only stack
    under which grpo_mem serves ``cp_size > 1`` (``sp_config.CP_CAUSE``)."""
    if not accelerator.is_fsdp2:
        raise ValueError(
            f"grpo_mem cannot train with sequence parallelism: the accelerator's distributed type is "
            f"{accelerator.distributed_type}, not FSDP version 2; {CP_CAUSE}"
        )


def skip_torch_context_parallel(*args):
    """Stands for ``Accelerator._prepare_cp(*args)`` (accelerate 1.15, called by ``Accelerator.prepare`` under
    ``cp_size > 1``) on a trainer grpo_mem serves: returns ``args`` unchanged. accelerate's would set torch's
    ring-attention rotate method, keep ``context_parallel`` over the ``cp`` mesh for ``maybe_context_parallel``,
    and register a forward pre-hook on every ``self_attn`` module that drops the attention mask and passes
    ``is_causal=True`` (``big_modeling._attach_context_parallel_hooks``): left-padded prompts and generation would
    attend to padding. grpo_mem's hook splits its own scoring passes over the ``cp`` group."""
    return args


def _make_context_parallel_inputs(original, handle):
    def _prepare_context_parallel_inputs(self, model, inputs, *args, **kwargs):
        if not context_parallel(self.args) or layout(self) is None:
            return original(self, model, inputs, *args, **kwargs)
        # no torch buffer sharding: the batch is still a list of prompts here, and grpo_mem splits its passes itself
        return contextlib.nullcontext, inputs

    return _prepare_context_parallel_inputs


def _make_compute_loss(original, handle):
    def compute_loss(self, *args, **kwargs):
        with data_parallel(self):
            return original(self, *args, **kwargs)

    return compute_loss


def _make_generate(original, handle):
    def _generate(self, *args, **kwargs):
        return share_generation(self, original(self, *args, **kwargs))

    return _generate


def sharded_generation(trainer) -> bool:
    """Whether every forward of ``trainer``'s generation is a collective of every rank: FSDP2 (each module's
    parameters are unsharded by an all-gather over the ``dp_shard_cp`` mesh before its forward) or DeepSpeed ZeRO-3
    (TRL's ``unwrap_model_for_generation`` gathers the partitioned parameters with every rank, and with
    ``ds3_gather_for_generation=False`` each module's forward does)."""
    if trainer.accelerator.is_fsdp2:
        return True
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


class _FinishedAtOnce:
    """A stopping criterion (transformers' ``StoppingCriteria`` protocol: ``(input_ids, scores) -> (B,) bool``) that
    finishes every row after its first generated token."""

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def generating_in_lockstep(trainer, stand_in: bool):
    """While open, the model TRL generates with (``accelerator.unwrap_model(trainer.model_wrapped)``, as TRL 1.16's
    ``unwrap_model_for_generation`` yields it) generates with ``synced_gpus=True`` (transformers 5.24
    ``GenerationMixin.generate``: every rank keeps calling the model's forward until every rank's rows have
    finished, so each step's parameter collectives are joined by all); with ``stand_in`` each row also finishes
    after its first token. transformers sets ``synced_gpus`` itself under ZeRO-3 only: an FSDP2 model prepared by
    accelerate carries no mark of ``is_fsdp_managed_module``. The ``generate`` bound on the model instance is removed
    on exit."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    own = model.__dict__.get("generate")
    options = {"synced_gpus": True}
    if stand_in:
        from transformers import StoppingCriteriaList

        options["stopping_criteria"] = StoppingCriteriaList([_FinishedAtOnce()])
    model.generate = functools.partial(model.generate, **options)
    try:
        yield
    finally:
        del model.generate
        if own is not None:
            model.generate = own


def stand_in_prompts(trainer, prompt_ids: list) -> list:
    """The one row a rank that does not generate passes to TRL's generation while its leader generates
    ``prompt_ids`` (lists of token ids): the first token of the longest prompt, or the whole longest prompt under
    chunked prefill (``generation_config.prefill_chunk_size``: its prefill then takes as many forwards as the
    leader's, whose batch is left-padded to that width)."""
    longest = max(prompt_ids, key=len)
    chunked = getattr(trainer.generation_config, "prefill_chunk_size", None) is not None
    return [list(longest) if chunked else list(longest[:1])]


def _make_generate_single_turn(original, handle):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        if not ready(self) or getattr(self, "use_vllm", False):  # vLLM: every rank generates, _generate shares
            return original(self, prompt_ids, images, multimodal_fields, *args, **kwargs)
        leader = sp_group(self)[1] == 0
        # images: the vision tower's forwards are not a text stand-in's; continuous batching (generate_batch) has no
        # lockstep: the whole batch on every rank
        whole = images is not None or multimodal_fields or getattr(self, "use_transformers_continuous_batching", False)
        if not sharded_generation(self):  # no collective in a forward: the others wait for the leader's outputs
            outputs = original(self, prompt_ids, images, multimodal_fields, *args, **kwargs) if leader else None
        elif leader or whole:
            with generating_in_lockstep(self, stand_in=False):
                outputs = original(self, prompt_ids, images, multimodal_fields, *args, **kwargs)
        else:
            with generating_in_lockstep(self, stand_in=True):
                original(self, stand_in_prompts(self, prompt_ids), images, multimodal_fields, *args, **kwargs)
            outputs = None  # the leader's completions and log-probs replace it
        return share_generation(self, outputs)

    return _generate_single_turn


def _zero_rewards(prompts, **kwargs):
    """A non-leader rank's stand-in for a reward function: zeros, dropped by the data-parallel gather."""
    return [0.0] * len(prompts)


def _make_calculate_rewards(original, handle):
    def _calculate_rewards(self, inputs, prompts, *args, **kwargs):
        if not ready(self) or sp_group(self)[1] == 0:
            return original(self, inputs, prompts, *args, **kwargs)
        import torch

        funcs = self.reward_funcs
        self.reward_funcs = [f if isinstance(f, torch.nn.Module) else _zero_rewards for f in funcs]
        try:
            return original(self, inputs, prompts, *args, **kwargs)
        finally:
            self.reward_funcs = funcs

    return _calculate_rewards


def _make_initial_values(original, handle):
    def set_initial_training_values(self, args, *rest, **kwargs):
        if layout(self) is None:
            return original(self, args, *rest, **kwargs)
        total = self.get_total_train_batch_size(args)  # world // sp_size data-parallel ranks: right as it is
        own = {
            name: self.__dict__[name] for name in ("get_sp_size", "get_total_train_batch_size") if name in self.__dict__
        }
        self.get_sp_size = lambda: 1  # the dataloader is not multiplied by Ulysses' adapter here
        self.get_total_train_batch_size = lambda _args: total
        try:
            return original(self, args, *rest, **kwargs)
        finally:
            del self.get_sp_size, self.get_total_train_batch_size
            self.__dict__.update(own)

    return set_initial_training_values


_MAKERS = {
    "get_train_dataloader": _make_dataloader,
    "get_eval_dataloader": _make_dataloader,
    "compute_loss": _make_compute_loss,
    "_generate": _make_generate,
    "_generate_single_turn": _make_generate_single_turn,
    "_calculate_rewards": _make_calculate_rewards,
    "set_initial_training_values": _make_initial_values,
    "_prepare_context_parallel_inputs": _make_context_parallel_inputs,
}


def make_method(name: str, original, handle):
    """The wrapper of the trainer method ``name`` (one of ``SP_METHODS``) around ``original``, recording instance
    state it sets with ``handle.remember``. Each wrapper is ``original`` itself when the trainer has no sequence
    parallelism."""
    wrapper = _MAKERS[name](original, handle)
    wrapper.__name__ = name
    wrapper.__wrapped_original__ = original
    setattr(wrapper, _MARK, True)
    return wrapper


# ------------------------------------------------------------------------------------------------ checks, install

_TRAINER_PARAMS = {
    "get_train_dataloader": ("self",),
    "get_eval_dataloader": ("self", "eval_dataset"),
    "compute_loss": ("self", "model", "inputs"),
    "_generate": ("self",),
    "_generate_single_turn": ("self", "prompt_ids", "images", "multimodal_fields"),
    "_calculate_rewards": ("self", "inputs", "prompts"),
    "set_initial_training_values": ("self", "args", "dataloader"),
    "get_sp_size": ("self",),
    "get_total_train_batch_size": ("self", "args"),
    "_prepare_context_parallel_inputs": ("self", "model", "inputs"),
}
"""The leading parameters each hooked or overridden trainer method is called with (TRL 1.16.0, transformers 5.24.0)."""
_ACCELERATOR_PARAMS = {
    "deepspeed_ulysses_dl_adapter": ("self", "dl", "model"),
    "gather": ("self", "tensor"),
    "reduce": ("self", "tensor", "reduction"),
    "_prepare_cp": ("self",),
}
"""accelerate 1.15.0's ``Accelerator`` methods replaced on the trainer's accelerator."""
_MODULE_PARAMS = {
    "set_seed": ("seed", "device_specific", "deterministic"),
    "gather": ("tensor",),
    "gather_object": ("object",),
}
"""Module-level functions of TRL's trainer modules replaced while patched (``set_seed``) or under ``data_parallel``."""


def _params(fn) -> tuple:
    return tuple(inspect.signature(getattr(fn, "__wrapped_original__", fn)).parameters)


def _changed(where: str, owner, expected: dict) -> list[str]:
    """What differs from ``expected`` (name -> leading parameters) among ``owner``'s attributes."""
    out = []
    for name, params in expected.items():
        fn = getattr(owner, name, None)
        if fn is None:
            out.append(f"{where}.{name} is missing")
        elif _params(fn)[: len(params)] != params:
            out.append(f"{where}.{name} has parameters {_params(fn)}, grpo_mem relies on {params}")
    return out


def check_hooks(owner) -> None:
    """Raise ``TypeError`` naming every hook whose target changed, before anything is installed on ``owner`` (a
    trainer class or instance): the trainer methods (``_TRAINER_PARAMS``), accelerate's ``Accelerator``
    (``_ACCELERATOR_PARAMS``, and ``num_processes``/``process_index`` properties reading ``state``, ``is_fsdp2`` and
    ``torch_device_mesh`` for ``cp_size``), TRL's modules'
    ``set_seed``/``gather``/``gather_object``, the config classes' ``__post_init__(self)``, and transformers'
    ``TrainingArguments.world_size`` property and ``__post_init__``, ``GenerationMixin.generate``'s
    ``stopping_criteria`` and ``synced_gpus``. DeepSpeed's ``parallel_state_sp`` is checked
    where it is first read (``sp_ranks.groups_built``: importing DeepSpeed takes seconds)."""
    from accelerate import Accelerator
    from transformers import GenerationMixin, TrainingArguments

    cls = owner if isinstance(owner, type) else type(owner)
    changed = _changed(cls.__name__, cls, _TRAINER_PARAMS) + _changed("Accelerator", Accelerator, _ACCELERATOR_PARAMS)
    for module in trl_modules(cls):
        present = {name: p for name, p in _MODULE_PARAMS.items() if name in vars(module)}
        changed += _changed(module.__name__, module, present)
    for name in ("num_processes", "process_index", "is_fsdp2", "torch_device_mesh"):
        if not isinstance(inspect.getattr_static(Accelerator, name, None), property):
            changed.append(f"Accelerator.{name} is not a property")
    missing = {"stopping_criteria", "synced_gpus"} - set(_params(GenerationMixin.generate))
    if missing:  # generating_in_lockstep passes both
        changed.append(f"GenerationMixin.generate lacks the parameters {sorted(missing)}")
    if not isinstance(inspect.getattr_static(TrainingArguments, "world_size", None), property):
        changed.append("TrainingArguments.world_size is not a property")
    for config in [TrainingArguments, *config_classes(owner)]:
        if "__post_init__" not in vars(config) or _params(vars(config)["__post_init__"]) != ("self",):
            changed.append(f"{config.__name__}.__post_init__ is not a method of (self)")
    if changed:
        raise TypeError(
            "grpo_mem's sequence-parallel hooks were written against TRL 1.16.0, transformers 5.24.0 and accelerate "
            f"1.15.0; changed here: {'; '.join(changed)}"
        )


def install(handle, owners: list) -> None:
    """Install the sequence-parallel hooks on ``owners`` (trainer classes or instances) through ``handle`` (the
    ``PatchHandle``, whose ``revert`` restores each): the trainer methods of ``SP_METHODS``, the config classes'
    ``__post_init__`` and TRL's modules' ``set_seed`` for a class; for an instance, its methods and its seed
    (``reseed``: built before the hooks). An owner whose methods are wrapped already (a class patched with SP, or
    one of its trainers) is left as it is.

    Raises:
        TypeError: as ``check_hooks``, for any owner (nothing is changed then).
    """
    for owner in owners:
        check_hooks(owner)
    for owner in owners:
        if all(getattr(getattr(owner, name), _MARK, False) for name in SP_METHODS):
            continue
        for name in SP_METHODS:
            handle.replace_method(owner, name, functools.partial(make_method, name))
        for config in config_classes(owner):
            handle.remember(config, "__post_init__", patched_post_init(config.__dict__["__post_init__"]))
        if isinstance(owner, type):
            for module in trl_modules(owner):
                if "set_seed" in vars(module):
                    handle.remember(module, "set_seed", patched_set_seed(vars(module)["set_seed"]))
        else:
            reseed(owner)

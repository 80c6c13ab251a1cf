"""Sequence parallelism for TRL's GRPO/RLOO trainers: the TRL, accelerate and DeepSpeed hooks, installed only when asked.

A user asks for it as for TRL's SFT, and says so to the patch: ``grpo_mem.patch_trl(sequence_parallel=True)``, then
``GRPOConfig(parallelism_config=ParallelismConfig(sp_size=N, sp_backend="deepspeed",
sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation=...)), deepspeed=...)``. ``patch_trl`` also installs
these hooks on a trainer whose ``args.parallelism_config`` has ``sp_size > 1`` (given as the target, or built while a
class patch is active); a plain ``patch_trl()`` never imports this module. The ``sp_size`` consecutive ranks of one
sequence-parallel (SP) group act as ONE data-parallel (DP) rank of ``world // N`` (``grpo_mem.patches.sp_ranks``):
they read the same prompts, hold the same completions, rewards and advantages, and every global quantity TRL computes
(the generation batch, reward statistics, the loss normaliser) is the one a run on ``world // N`` processes without SP
computes, step by step. What ``install`` changes, each hook checked first by ``check_hooks`` (written against TRL
1.16.0, transformers 5.24.0, accelerate 1.15.0, deepspeed 0.19.8):

- **The configuration.** ``GRPOConfig``/``RLOOConfig.__post_init__`` refuse ``sp_size > 1``; ``patched_post_init``
  lifts that for ``sp_backend="deepspeed"`` only (``cp_size > 1`` stays refused: ``CP_CAUSE``), and runs TRL's own
  ``__post_init__`` with ``world_size`` seen as the DP size (``_world_as_data_parallel``), so that
  ``generation_batch_size``, ``steps_per_generation`` and the divisibility checks are those of the DP run.
- **The data.** ``get_train_dataloader``/``get_eval_dataloader`` run under ``sp_ranks.data_parallel``: accelerate shards
  the prompts over the DP ranks, so the SP ranks of a group read the same. The accelerator's
  ``deepspeed_ulysses_dl_adapter`` becomes ``sp_ranks.skip_ulysses_adapter`` (the dataloader kept whole, DeepSpeed
  Ulysses' attention override undone); ``set_initial_training_values`` runs with an SP size of 1, as the dataloader
  is not multiplied by that adapter.
- **Generation and scoring** (``_prepare_inputs`` through the patch handle, ``compute_loss``) run under
  ``data_parallel``. The group leader alone generates (``_generate_single_turn``; its completions, sampled
  log-probs and random states are broadcast to the group, ``sp_ranks.share_generation``), except under ZeRO-3, whose
  parameter gathering for generation is a collective of every rank, and with vLLM: there every SP rank generates and
  takes the leader's outputs. ``_generate``'s outputs and random states are the leader's in every case. Reward
  functions that are plain callables run on the leader alone (``_calculate_rewards``: the other ranks join its
  gather with zeros, which the data-parallel gather drops; a reward function with side effects runs once per
  group); reward models (``nn.Module``) run on every rank, as their forward may be a collective. TRL seeds each
  process with ``seed + process_index`` (``set_seed(device_specific=True)``); under SP, ``seed + dp_rank``.

Gradients: DeepSpeed reduces over all ranks (``seq_data_parallel_group``). ZeRO 1/2 divide by ``world / sp_size``
(deepspeed 0.19.8 ``DeepSpeedZeroOptimizer.average_tensor``, ``gradient_reduction_w_predivide``,
``allreduce_bucket``): summed over the SP group, averaged over DP ranks. ZeRO-3 does so only in its contiguous path
(``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_contiguous_grads``, ``allreduce_bucket``); with ``reduce_scatter`` (its
default) every bucket goes through ``reduce_scatter_coalesced``, which divides by the world size: averaged over the SP
group too. ``sp_gradient_reduction`` tells which; ZeRO-3 with ``reduce_scatter=False`` mixes both and is refused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

from .sp_ranks import (
    attention_functions,
    data_parallel,
    groups_built,
    layout,
    share_generation,
    skip_ulysses_adapter,
    sp_group,
    sp_size_of,
    trl_modules,
)

CP_CAUSE = (
    "context parallelism (cp_size > 1) shards the batch along the sequence before the model's forward "
    "(accelerate's torch context-parallel buffers over FSDP2); GRPO builds its scoring inputs after generation, and "
    "grpo_mem's prompt-once passes have no ring-attention exchange, so it stays refused: use sp_size"
)
"""Why ``cp_size > 1`` stays refused (TRL's own error is raised)."""

SP_METHODS = (
    "get_train_dataloader",
    "get_eval_dataloader",
    "compute_loss",
    "_generate",
    "_generate_single_turn",
    "_calculate_rewards",
    "set_initial_training_values",
)
"""Trainer methods ``install`` wraps (``make_method``); each is TRL's own on a trainer without SP."""

_MARK = "__grpo_mem_sp__"


def ready(trainer) -> bool:
    """Whether ``trainer`` trains with sequence parallelism and its SP groups exist (from the start of ``train()``;
    before it, e.g. in ``grpo_mem.verify``, its ranks score on their own)."""
    return layout(trainer) is not None and groups_built()


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


# ---------------------------------------------------------------------------------------------------- configuration


def unserved(args) -> str | None:
    """Why grpo_mem cannot train ``args``' sequence parallelism exactly, or None."""
    sp = sp_size_of(args)
    if getattr(args, "deepspeed", None) is None:
        return f"sp_size={sp} runs through DeepSpeed Ulysses: pass a ZeRO config as deepspeed=..."
    if getattr(args, "use_vllm", False):
        return (
            f"use_vllm=True with sp_size={sp}: TRL's vLLM generation gathers prompts and slices completions over all "
            "processes, not over data-parallel ranks"
        )
    if getattr(args, "use_liger_kernel", False):
        return f"use_liger_kernel=True with sp_size={sp}: Liger's fused GRPO loss scores whole sequences on each rank"
    return None


@contextlib.contextmanager
def _world_as_data_parallel(cls, sp: int):
    """While open, ``cls``' ``world_size`` (a config class) is the data-parallel size ``world // sp``, except while
    transformers' ``TrainingArguments.__post_init__`` runs: it fills the DeepSpeed config's ``train_batch_size`` from
    the world size (``HfTrainerDeepSpeedConfig.trainer_config_process``, transformers 5.24.0), which
    ``deepspeed.zero.Init`` checks against the world before accelerate corrects it for SP. TRL's own
    ``__post_init__`` body, around it, reads the DP size. Both class attributes are restored on exit."""
    from transformers import TrainingArguments

    world = cls.world_size  # the property the class has (its own, or TrainingArguments')
    parent = TrainingArguments.__dict__["__post_init__"]
    inside = []  # non-empty while TrainingArguments.__post_init__ runs

    def world_size(self):
        total = world.fget(self)
        if inside:
            return total
        if total % sp:
            raise ValueError(f"parallelism_config.sp_size={sp} does not divide the world size {total}")
        return total // sp

    def __post_init__(self):
        inside.append(True)
        try:
            return parent(self)
        finally:
            inside.pop()

    own = cls.__dict__.get("world_size")
    cls.world_size = property(world_size)
    TrainingArguments.__post_init__ = __post_init__
    try:
        yield
    finally:
        TrainingArguments.__post_init__ = parent
        if own is None:
            del cls.world_size
        else:
            cls.world_size = own


def patched_post_init(original):
    """``GRPOConfig``/``RLOOConfig.__post_init__`` around TRL's ``original``: with ``sp_size > 1`` and
    ``sp_backend="deepspeed"`` (``cp_size`` 1), TRL's refusal is skipped and TRL's own checks and batch arithmetic
    run with ``world_size`` equal to the data-parallel size; anything else is TRL's own.

    Raises:
        ValueError: what ``unserved`` names (no DeepSpeed config, vLLM, Liger's loss), ``sp_size`` not dividing the
            world size, several SP groups without ``dp_replicate_size`` saying how many, ZeRO-3 with
            ``reduce_scatter=False`` (DeepSpeed then reduces SP gradients inconsistently), and whatever TRL's own
            ``__post_init__`` raises.
    """

    def __post_init__(self):
        pc = self.parallelism_config
        sp = sp_size_of(self)
        if sp == 1:
            return original(self)
        cause = unserved(self)
        if cause is not None:
            raise ValueError(f"grpo_mem cannot train with sequence parallelism: {cause}")
        self.parallelism_config = None  # TRL's refusal reads it; nothing else in __post_init__ does
        try:
            with _world_as_data_parallel(type(self), sp):
                original(self)
        finally:
            self.parallelism_config = pc
        groups = self.world_size // sp if self.world_size % sp == 0 else None
        if groups is not None and groups > 1 and pc.data_parallel_size != groups:
            raise ValueError(
                f"sequence parallelism with sp_size={sp} on {self.world_size} processes makes {groups} data-parallel "
                f"groups, but parallelism_config has data_parallel_size={pc.data_parallel_size}: pass "
                f"ParallelismConfig(..., dp_replicate_size={groups}) (accelerate sizes DeepSpeed's batch by it)"
            )
        zero = _zero_config(self)
        if zero.get("stage") == 3 and not zero.get("reduce_scatter", True):
            raise ValueError(
                f"grpo_mem cannot train with sequence parallelism: ZeRO-3 with reduce_scatter=False and sp_size={sp}: "
                "DeepSpeed then sums the SP ranks' gradients in buckets up to reduce_bucket_size and averages them in "
                "larger ones (stage3.py __avg_scatter_contiguous_grads vs reduce_scatter_coalesced); keep reduce_scatter"
            )

    __post_init__.__wrapped_original__ = original
    return __post_init__


def _zero_config(args) -> dict:
    """The ``zero_optimization`` block of ``args``' processed DeepSpeed config (empty without one)."""
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}
    return config.get("zero_optimization", {}) or {}


def sp_gradient_reduction(trainer) -> str | None:
    """How DeepSpeed combines the gradients of the ranks of one SP group, for a trainer with sequence parallelism
    (None without): ``"sum"`` under ZeRO 0-2 (every reduction divides by world // sp_size), ``"mean"`` under ZeRO-3
    with ``reduce_scatter`` (DeepSpeed's default: ``reduce_scatter_coalesced`` divides by the world size; functions
    in the module docstring). Both average over data-parallel ranks. With ``"sum"`` the SP ranks' losses must add up
    to their DP rank's loss; with ``"mean"`` each must be sp_size times its share."""
    if layout(trainer) is None:
        return None
    return "mean" if _zero_config(trainer.args).get("stage") == 3 else "sum"


def config_classes(owner) -> list:
    """The TRL config classes whose ``__post_init__`` refuses sequence parallelism for the trainer ``owner`` (a class):
    ``GRPOConfig`` for ``GRPOTrainer`` and its subclasses, ``RLOOConfig`` for ``RLOOTrainer``'s; none for an
    instance (its config is built already)."""
    import trl

    if not isinstance(owner, type):
        return []
    pairs = ((trl.GRPOTrainer, trl.GRPOConfig), (trl.RLOOTrainer, trl.RLOOConfig))
    return [config for trainer, config in pairs if issubclass(owner, trainer)]


def patched_set_seed(original):
    """TRL's module-level ``set_seed`` (accelerate's) with ``device_specific=True`` seeding ``seed + dp_rank`` under
    sequence parallelism (``seed + process_index`` otherwise, as accelerate does)."""

    def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False):
        lay = _state_layout() if device_specific else None
        if lay is not None:
            return original(seed + lay.dp_rank, device_specific=False, deterministic=deterministic)
        return original(seed, device_specific=device_specific, deterministic=deterministic)

    set_seed.__wrapped_original__ = original
    return set_seed


def _state_layout():
    """``sp_ranks.Layout`` from accelerate's ``AcceleratorState`` (the trainer's ``parallelism_config``), or None."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return None
    return layout(AcceleratorState())


def reseed(trainer) -> None:
    """Seed this rank as TRL's ``__init__`` seeds a data-parallel rank (``seed + dp_rank``), for a trainer built before
    the hooks were installed; nothing without sequence parallelism."""
    lay = layout(trainer)
    if lay is not None:
        from accelerate.utils import set_seed

        set_seed(trainer.args.seed + lay.dp_rank)


# ------------------------------------------------------------------------------------------------- trainer methods


def _make_dataloader(original, handle):
    def get_dataloader(self, *args, **kwargs):
        if layout(self) is None:
            return original(self, *args, **kwargs)
        # before accelerate prepares the model in train() and DeepSpeed registers its Ulysses attention
        skip = functools.partial(skip_ulysses_adapter, attention_functions())
        handle.remember(self.accelerator, "deepspeed_ulysses_dl_adapter", skip)
        with data_parallel(self):
            return original(self, *args, **kwargs)

    return get_dataloader


def _make_compute_loss(original, handle):
    def compute_loss(self, *args, **kwargs):
        with data_parallel(self):
            return original(self, *args, **kwargs)

    return compute_loss


def _make_generate(original, handle):
    def _generate(self, *args, **kwargs):
        return share_generation(self, original(self, *args, **kwargs))

    return _generate


def generates_once(trainer) -> bool:
    """Whether only the SP group's leader generates: sequence parallelism ready (``ready``), no vLLM, DeepSpeed below
    ZeRO-3 (ZeRO-3 gathers the parameters for generation with every rank)."""
    if not ready(trainer) or getattr(trainer, "use_vllm", False):
        return False
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return plugin is None or plugin.zero_stage < 3


def _make_generate_single_turn(original, handle):
    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        if not generates_once(self):
            return original(self, prompt_ids, *args, **kwargs)
        _, rank, _ = sp_group(self)
        # the other ranks' placeholder is never used: the leader's completions and log-probs replace it
        outputs = original(self, prompt_ids, *args, **kwargs) if rank == 0 else None
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
    "_generate_single_turn": ("self", "prompt_ids"),
    "_calculate_rewards": ("self", "inputs", "prompts"),
    "set_initial_training_values": ("self", "args", "dataloader"),
    "get_sp_size": ("self",),
    "get_total_train_batch_size": ("self", "args"),
}
"""The leading parameters each hooked or overridden trainer method is called with (TRL 1.16.0, transformers 5.24.0)."""
_ACCELERATOR_PARAMS = {
    "deepspeed_ulysses_dl_adapter": ("self", "dl", "model"),
    "gather": ("self", "tensor"),
    "reduce": ("self", "tensor", "reduction"),
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
    (``_ACCELERATOR_PARAMS``, and ``num_processes``/``process_index`` properties reading ``state``), TRL's modules'
    ``set_seed``/``gather``/``gather_object``, the config classes' ``__post_init__(self)``, and transformers'
    ``TrainingArguments.world_size`` property and ``__post_init__``. DeepSpeed's ``parallel_state_sp`` is checked
    where it is first read (``sp_ranks.groups_built``: importing DeepSpeed takes seconds)."""
    from accelerate import Accelerator
    from transformers import TrainingArguments

    cls = owner if isinstance(owner, type) else type(owner)
    changed = _changed(cls.__name__, cls, _TRAINER_PARAMS) + _changed("Accelerator", Accelerator, _ACCELERATOR_PARAMS)
    for module in trl_modules(cls):
        present = {name: p for name, p in _MODULE_PARAMS.items() if name in vars(module)}
        changed += _changed(module.__name__, module, present)
    for name in ("num_processes", "process_index"):
        if not isinstance(inspect.getattr_static(Accelerator, name, None), property):
            changed.append(f"Accelerator.{name} is not a property")
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

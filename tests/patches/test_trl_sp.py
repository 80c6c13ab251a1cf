"""Sequence parallelism's hooks, in one process: installed only when asked (``patch_trl(sequence_parallel=True)``, or a
trainer whose config has ``sp_size > 1``), never imported by a plain patch; ``patch_trl(sequence_parallel=True)``
lifts TRL's refusal of ``sp_size > 1`` (``sp_backend="deepspeed"``) and of ``cp_size > 1`` (FSDP2) for GRPOConfig and
RLOOConfig while active, with TRL's batch arithmetic on the data-parallel size, refuses with a named cause what it
cannot serve (``cp_size`` with DeepSpeed, a non-FSDP2 accelerator), refuses changed hook targets by name, and ``revert()`` restores every patched attribute. The
multi-process data path is in tests/distributed/test_trl_sequence_parallel.py."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REFUSAL = "does not support sequence-dim parallelism"


def _config(cls, tmp_path, **kwargs):
    from accelerate import ParallelismConfig

    pc = kwargs.pop("pc", None) or ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    return cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, parallelism_config=pc, **kwargs)


@pytest.mark.parametrize("value", ["no", 0, 1, "False"])
def test_sequence_parallel_takes_only_none_true_false(value):
    """``patch_trl(sequence_parallel=...)`` refuses anything but None/True/False with a TypeError naming the value
    (``"no"`` used to turn it on), before patching anything."""
    from trl import GRPOTrainer

    import grpo_mem

    before = dict(vars(GRPOTrainer))
    with pytest.raises(TypeError, match=rf"sequence_parallel must be None, True or False, got {value!r}"):
        grpo_mem.patch_trl(sequence_parallel=value)
    assert dict(vars(GRPOTrainer)) == before


@pytest.mark.parametrize("name", ["GRPOConfig", "RLOOConfig"])
def test_refusal_lifted_only_for_deepspeed_sp_while_patched(tmp_path, name):
    import trl
    from accelerate import ParallelismConfig

    import grpo_mem

    cls = getattr(trl, name)
    stock = cls.__dict__["__post_init__"]
    with pytest.raises(ValueError, match=REFUSAL):
        _config(cls, tmp_path, deepspeed={"zero_optimization": {"stage": 2}})
    with grpo_mem.patch_trl(), pytest.raises(ValueError, match=REFUSAL):  # a plain patch leaves TRL's refusal alone
        _config(cls, tmp_path, deepspeed={"zero_optimization": {"stage": 2}})
    handle = grpo_mem.patch_trl(sequence_parallel=True)
    try:
        # past TRL's refusal: one process cannot hold an SP group of 2
        with pytest.raises(ValueError, match="sp_size=2 does not divide the world size 1"):
            _config(cls, tmp_path, deepspeed={"zero_optimization": {"stage": 2}})
        with pytest.raises(ValueError, match=r"sp_size=2 runs through DeepSpeed Ulysses: pass a ZeRO config"):
            _config(cls, tmp_path)
        with pytest.raises(ValueError, match=r"use_liger_kernel=True with sp_size=2"):
            _config(cls, tmp_path, deepspeed={"zero_optimization": {"stage": 2}}, use_liger_kernel=True)
        with pytest.raises(ValueError, match=r"use_vllm=True with sp_size=2"):
            _config(cls, tmp_path, deepspeed={"zero_optimization": {"stage": 2}}, use_vllm=True)
        # context parallelism: past TRL's refusal too, DeepSpeed's route is sp_size
        with pytest.raises(ValueError, match="cp_size=2 does not divide the world size 1"):
            _config(cls, tmp_path, pc=ParallelismConfig(cp_size=2))
        with pytest.raises(ValueError, match=r"grpo_mem serves it only with FSDP2.*with DeepSpeed use sp_size"):
            _config(cls, tmp_path, pc=ParallelismConfig(cp_size=2), deepspeed={"zero_optimization": {"stage": 2}})
        with pytest.raises(ValueError, match=r"use_vllm=True with cp_size=2"):
            _config(cls, tmp_path, pc=ParallelismConfig(cp_size=2), use_vllm=True)
        plain = _config(cls, tmp_path, pc=ParallelismConfig())  # no SP: TRL's own arithmetic
        assert plain.generation_batch_size == plain.per_device_train_batch_size * plain.steps_per_generation
    finally:
        handle.revert()
    assert cls.__dict__["__post_init__"] is stock
    with pytest.raises(ValueError, match=REFUSAL):
        _config(cls, tmp_path, deepspeed={"zero_optimization": {"stage": 2}})


def test_sp_groups_with_data_parallelism_need_the_data_parallel_size(tmp_path, monkeypatch):
    """On 4 processes with sp_size=2 (two data-parallel groups) the config must say dp_replicate_size=2, which
    accelerate sizes DeepSpeed's batch by; without it DeepSpeed would fail later on a batch-size assertion."""
    import trl

    import grpo_mem

    monkeypatch.setattr(trl.GRPOConfig, "world_size", property(lambda self: 4))
    with (
        grpo_mem.patch_trl(sequence_parallel=True),
        pytest.raises(ValueError, match=r"makes 2 data-parallel groups.*dp_replicate_size=2"),
    ):
        _config(trl.GRPOConfig, tmp_path, deepspeed={"zero_optimization": {"stage": 2}})


def test_context_parallel_groups_with_data_parallelism_need_dp_shard_size(tmp_path, monkeypatch):
    """On 4 processes with cp_size=2 the config must say dp_shard_size=2 (FSDP2 shards over dp_shard x cp; accelerate
    refuses cp_size with dp_replicate_size alone)."""
    import trl
    from accelerate import ParallelismConfig

    import grpo_mem

    monkeypatch.setattr(trl.GRPOConfig, "world_size", property(lambda self: 4))
    with grpo_mem.patch_trl(sequence_parallel=True):
        with pytest.raises(ValueError, match=r"cp_size=2 on 4 processes makes 2 data-parallel groups.*dp_shard_size=2"):
            _config(trl.GRPOConfig, tmp_path, pc=ParallelismConfig(cp_size=2))
        config = _config(trl.GRPOConfig, tmp_path, pc=ParallelismConfig(cp_size=2, dp_shard_size=2))
        # TRL's batch arithmetic on the 2 data-parallel ranks
        assert config.generation_batch_size == config.per_device_train_batch_size * 2 * config.steps_per_generation


def test_context_parallel_needs_fsdp2_and_skips_torch_context_parallel():
    """The cp route refuses an accelerator that is not FSDP2, naming ``CP_CAUSE``; the stand-in for accelerate's
    ``Accelerator._prepare_cp`` returns what it is given and registers no attention-mask hook. (The stand-in for the
    Trainer's ``_prepare_context_parallel_inputs`` runs in the 2-process test: stock's indexes the GRPO batch, a
    list of prompts, by ``"input_ids"``.)"""
    import types

    from grpo_mem.patches import trl_sp

    with pytest.raises(ValueError, match=r"MULTI_CPU, not FSDP version 2; context parallelism \(cp_size > 1\)"):
        trl_sp.check_fsdp2(types.SimpleNamespace(is_fsdp2=False, distributed_type="MULTI_CPU"))
    trl_sp.check_fsdp2(types.SimpleNamespace(is_fsdp2=True, distributed_type="FSDP"))
    model = torch.nn.Module()
    model.self_attn = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert trl_sp.skip_torch_context_parallel(model, optimizer) == (model, optimizer)
    assert not model.self_attn._forward_pre_hooks


def test_keep_leaders_is_the_data_parallel_gather():
    """An all-rank gather of 4 ranks (SP groups {0, 1}, {2, 3}) keeps ranks 0 and 2, in order."""
    from grpo_mem.patches.sp_ranks import Layout, keep_leaders

    per_rank = [torch.full((3, 2), float(r)) for r in range(4)]
    kept = keep_leaders(torch.cat(per_rank), Layout(sp_size=2, sp_rank=0, dp_size=2, dp_rank=0))
    assert torch.equal(kept, torch.cat([per_rank[0], per_rank[2]]))


def test_plain_patch_and_a_trainer_without_sp_never_import_it():
    """A plain ``patch_trl()``, a trainer built under it and a scored micro-batch (equal to stock TRL's log-probs)
    import none of the sequence-parallel modules; ``revert()`` leaves the trainer and config classes as they were.
    In a fresh process: the suite imports them elsewhere."""
    code = textwrap.dedent(
        """
        import sys, tempfile
        import torch
        import grpo_mem
        from helpers import make_batch, make_trainer
        from trl import GRPOConfig, GRPOTrainer
        before = {cls: dict(vars(cls)) for cls in (GRPOTrainer, GRPOConfig)}
        handle = grpo_mem.patch_trl()
        trainer, _ = make_trainer(patch=False, output_dir=tempfile.mkdtemp())
        ids, mask, C, _ = make_batch([4, 6], 2, 3)
        with torch.no_grad():
            ours, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
            assert not {"grpo_mem.patches.trl_sp", "grpo_mem.patches.sp_ranks"} & set(sys.modules)
            assert not handle.sequence_parallel
            handle.revert()
            stock, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
        assert all(dict(vars(cls)) == vars_before for cls, vars_before in before.items())
        print(float(((ours - stock) * mask[:, -C:]).abs().max()))
        """
    )
    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]))
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) <= 1e-5


def _watched() -> dict:
    """Every namespace the SP hooks may change: trainer and config classes, TRL's trainer modules, TrainingArguments."""
    import trl
    from transformers import TrainingArguments

    owners = [trl.GRPOTrainer, trl.RLOOTrainer, trl.GRPOConfig, trl.RLOOConfig, TrainingArguments]
    owners += [sys.modules[trl.GRPOTrainer.__module__], sys.modules[trl.RLOOTrainer.__module__]]
    return {owner: dict(vars(owner)) for owner in owners}


def test_sequence_parallel_true_installs_every_hook_and_revert_restores_them():
    import trl

    import grpo_mem
    from grpo_mem.patches.trl_sp import SP_METHODS

    before = _watched()
    with grpo_mem.patch_trl(sequence_parallel=True) as handle:
        assert handle.sequence_parallel
        for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
            assert all(getattr(vars(cls)[name], "__grpo_mem_sp__", False) for name in SP_METHODS)
            module = sys.modules[cls.__module__]
            assert vars(module)["set_seed"].__wrapped_original__ is before[module]["set_seed"]
        for config in (trl.GRPOConfig, trl.RLOOConfig):
            assert vars(config)["__post_init__"].__wrapped_original__ is before[config]["__post_init__"]
        assert grpo_mem.patch_trl(sequence_parallel=True) is handle  # idempotent: nothing wrapped twice
        assert vars(trl.GRPOTrainer)["compute_loss"].__wrapped_original__ is before[trl.GRPOTrainer]["compute_loss"]
    assert _watched() == before


def test_a_trainer_whose_config_asks_gets_the_hooks(tmp_path, monkeypatch):
    """Under a plain class patch, a trainer built with ``parallelism_config.sp_size > 1`` gets the SP hooks on itself
    (the patched ``__init__``), as does a trainer given to ``patch_trl``; ``sequence_parallel=False`` refuses it;
    ``revert()`` restores the trainer and every class. Without a process group the hooks run TRL's own code."""
    from accelerate import ParallelismConfig
    from helpers import make_trainer
    from transformers import Trainer

    import grpo_mem
    from grpo_mem.patches.trl_sp import SP_METHODS

    pc = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    create = Trainer.create_accelerator_and_postprocess

    def create_then_ask(self):  # accelerate refuses SP on one process: the config asks once the accelerator exists
        create(self)
        self.args.parallelism_config = pc

    monkeypatch.setattr(Trainer, "create_accelerator_and_postprocess", create_then_ask)
    before = _watched()
    with grpo_mem.patch_trl() as handle:
        assert not handle.sequence_parallel
        trainer, _ = make_trainer(patch=False, output_dir=tmp_path)
        assert handle.sequence_parallel and set(SP_METHODS) <= set(vars(trainer))
        assert len(trainer.get_train_dataloader()) > 0  # no process group: TRL's own dataloader
    assert not set(SP_METHODS) & set(vars(trainer)) and _watched() == before
    with pytest.raises(ValueError, match="sequence_parallel=False, but this GRPOTrainer's parallelism_config has sp_"):
        grpo_mem.patch_trl(trainer, sequence_parallel=False)
    with grpo_mem.patch_trl(trainer) as handle:
        assert handle.sequence_parallel and set(SP_METHODS) <= set(vars(trainer))
    assert not set(SP_METHODS) & set(vars(trainer)) and _watched() == before


def test_changed_hook_target_is_refused_by_name(monkeypatch):
    """A TRL whose ``compute_loss`` no longer takes ``(model, inputs)`` is refused with the difference named, and
    nothing is patched."""
    from trl import GRPOTrainer

    import grpo_mem
    from grpo_mem.patches.checks import LOGPS_METHOD

    def compute_loss(self, batch):
        raise AssertionError("never called")

    monkeypatch.setattr(GRPOTrainer, "compute_loss", compute_loss)
    before = _watched()
    match = r"GRPOTrainer\.compute_loss has parameters \('self', 'batch'\), grpo_mem relies on \('self', 'model', 'inputs'\)"
    with pytest.raises(TypeError, match=match):
        grpo_mem.patch_trl(GRPOTrainer, sequence_parallel=True)
    assert _watched() == before and not getattr(vars(GRPOTrainer)[LOGPS_METHOD], "__grpo_mem_patch__", False)


def test_trl_reads_the_data_parallel_size_and_deepspeed_the_world(tmp_path, monkeypatch):
    """On 4 processes with sp_size=2: TRL's ``generation_batch_size`` is that of 2 data-parallel ranks, while the
    DeepSpeed config's ``train_batch_size`` (filled by transformers' ``TrainingArguments.__post_init__``) counts all 4;
    both class attributes the patch set for it are restored."""
    import trl
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    import grpo_mem

    monkeypatch.setattr(trl.GRPOConfig, "world_size", property(lambda self: 4))
    world_size, post_init = vars(trl.GRPOConfig)["world_size"], vars(TrainingArguments)["__post_init__"]
    zero = {"zero_optimization": {"stage": 2}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    pc = ParallelismConfig(sp_size=2, sp_backend="deepspeed", dp_replicate_size=2)
    with grpo_mem.patch_trl(sequence_parallel=True):
        args = _config(trl.GRPOConfig, tmp_path, pc=pc, deepspeed=dict(zero, gradient_accumulation_steps="auto"))
    assert args.generation_batch_size == args.per_device_train_batch_size * 2 * args.steps_per_generation
    batch = args.hf_deepspeed_config.config["train_batch_size"]
    assert batch == args.per_device_train_batch_size * args.gradient_accumulation_steps * 4
    assert vars(trl.GRPOConfig)["world_size"] is world_size and vars(TrainingArguments)["__post_init__"] is post_init


def test_a_stand_in_row_finishes_after_its_first_token_and_leaves_no_trace(tmp_path):
    """``generating_in_lockstep`` (one process in a gloo group of 1, as ``synced_gpus`` needs a process group): TRL's
    generation model generates with ``synced_gpus=True``; as a stand-in its one row ends after ONE new token where the
    leader's configuration (``max_new_tokens=6``, TRL's ``generation_config``) runs 6; the ``generate`` bound on the
    instance is gone on exit. ``stand_in_prompts``: the longest prompt's first token, or that whole prompt under
    chunked prefill (as many prefill forwards as the leader's left-padded batch)."""
    import torch.distributed as dist
    from helpers import make_trainer

    from grpo_mem.patches.trl_sp import generating_in_lockstep, stand_in_prompts

    trainer, _ = make_trainer(patch=False, output_dir=tmp_path, max_completion_length=6)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    prompts = [[5, 6], [7, 8, 9], [10]]
    assert stand_in_prompts(trainer, prompts) == [[7]]
    ids = torch.tensor(stand_in_prompts(trainer, prompts))
    config = trainer.generation_config
    config.eos_token_id = None  # no row ends by chance: the leader's runs max_new_tokens
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for stand_in, new_tokens in ((True, 1), (False, 6)):
            with generating_in_lockstep(trainer, stand_in=stand_in):
                assert model.generate.keywords["synced_gpus"] is True
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            assert out.shape == (1, 1 + new_tokens), (stand_in, out.shape)
            assert "generate" not in vars(model)
    finally:
        dist.destroy_process_group()
    config.prefill_chunk_size = 2
    assert stand_in_prompts(trainer, prompts) == [[7, 8, 9]]


@pytest.mark.parametrize(
    "stage,release,expected",
    [
        (3, "0.19.8", "mean"),
        (3, "0.20.1", "mean"),
        (3, "0.20.2", "sum"),
        (3, "0.21.0.dev0+abc", "sum"),
        (2, "0.19.8", "sum"),
    ],
)
def test_zero3_sums_the_sp_gradients_from_deepspeed_0_20_2(monkeypatch, stage, release, expected):
    """How a DeepSpeed SP group's gradients combine follows the installed DeepSpeed: ZeRO-3 averages them before
    0.20.2 and sums them from it (deepspeedai/DeepSpeed#8854, the switch transformers 5.25's
    ``deepspeed_sp_compute_loss`` makes), ZeRO 1/2 always sum. The multi-process check of 0.19.8's averaging is
    tests/distributed/test_trl_sequence_parallel.py; no DeepSpeed from 0.20.2 was installable here."""
    import importlib.metadata
    from types import SimpleNamespace

    from grpo_mem.patches import sp_config
    from grpo_mem.patches.sp_ranks import Layout

    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: release if name == "deepspeed" else real_version(name)
    )
    monkeypatch.setattr(sp_config, "layout", lambda trainer: Layout(sp_size=2, sp_rank=0, dp_size=1, dp_rank=0))
    args = SimpleNamespace(
        parallelism_config=None, hf_deepspeed_config=SimpleNamespace(config={"zero_optimization": {"stage": stage}})
    )
    assert sp_config.sp_gradient_reduction(SimpleNamespace(args=args)) == expected
    with pytest.raises(ValueError, match="cannot read a DeepSpeed release from 'main'"):
        sp_config.deepspeed_sums_sp_gradients("main")

"""Sequence parallelism's hooks, in one process: installed only when asked (``patch_trl(sequence_parallel=True)``, or a
trainer whose config has ``sp_size > 1``), never imported by a plain patch; ``patch_trl(sequence_parallel=True)``
lifts TRL's refusal of ``sp_size > 1`` (``sp_backend="deepspeed"``) for GRPOConfig and RLOOConfig while active, with
TRL's batch arithmetic on the data-parallel size, keeps ``cp_size > 1`` refused, refuses with a named cause what it
cannot serve, refuses changed hook targets by name, and ``revert()`` restores every patched attribute. The
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


@pytest.mark.parametrize("name", ["GRPOConfig", "RLOOConfig"])
def test_refusal_lifted_only_for_deepspeed_sp_while_patched(tmp_path, name):
    import trl
    from accelerate import ParallelismConfig

    import grpo_mem

    cls = getattr(trl, name)
    stock = cls.__dict__["__post_init__"]
    with pytest.raises(ValueError, match=REFUSAL):
        _config(cls, tmp_path, deepspeed={"zero_optimization": {"stage": 2}})
    with grpo_mem.patch_trl():  # a plain patch leaves TRL's refusal alone
        with pytest.raises(ValueError, match=REFUSAL):
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
        with pytest.raises(ValueError, match=REFUSAL):  # context parallelism stays TRL's refusal
            _config(cls, tmp_path, pc=ParallelismConfig(cp_size=2))
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
    from accelerate import ParallelismConfig

    import grpo_mem

    monkeypatch.setattr(trl.GRPOConfig, "world_size", property(lambda self: 4))
    with grpo_mem.patch_trl(sequence_parallel=True):
        with pytest.raises(ValueError, match=r"makes 2 data-parallel groups.*dp_replicate_size=2"):
            _config(trl.GRPOConfig, tmp_path, deepspeed={"zero_optimization": {"stage": 2}})


def test_keep_leaders_is_the_data_parallel_gather():
    """An all-rank gather of 4 ranks (SP groups {0, 1}, {2, 3}) keeps ranks 0 and 2, in order."""
    from grpo_mem.patches.sp_ranks import Layout, keep_leaders

    per_rank = [torch.full((3, 2), float(r)) for r in range(4)]
    kept = keep_leaders(torch.cat(per_rank), Layout(sp_size=2, sp_rank=0, dp_size=2, dp_rank=0))
    assert torch.equal(kept, torch.cat([per_rank[0], per_rank[2]]))

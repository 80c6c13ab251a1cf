"""The accelerate config files shipped in configs/accelerate mean what docs/distributed.md says: read as ``accelerate launch
--config_file FILE script.py`` reads them, they give FSDP2 (fully_shard, reshard after forward) and DeepSpeed ZeRO-3,
the stacks the 2-process tests in test_distributed.py run."""

from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"


def _launch_args(name: str):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / name), "train.py"])
    return _validate_launch_command(args)[0]


def test_fsdp2_config(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    env = prepare_multi_gpu_env(_launch_args("fsdp2.yaml"))
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.activation_checkpointing is False


def test_zero3_config():
    pytest.importorskip("deepspeed")
    args = _launch_args("zero3.yaml")
    assert args.use_deepspeed and int(args.zero_stage) == 3 and args.mixed_precision == "bf16"
    assert args.num_processes == 2 and args.offload_param_device == "none"

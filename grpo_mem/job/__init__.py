"""The ``grpo-mem train`` main job: SmolLM2-135M-Instruct (offline), a reasoning-gym task, TRL's GRPOTrainer on CPU.

Modules: :mod:`~grpo_mem.job.smollm2` (GGUF to HF directory, once), :mod:`~grpo_mem.job.tasks` (prompts, answer
extraction, exact reward, few-shot examples), :mod:`~grpo_mem.job.memory` (per-step peak RSS and step time),
:mod:`~grpo_mem.job.train` (the settings, one run, its summary and plot, the ``train`` command),
:mod:`~grpo_mem.job.compare` (``train --compare``: stock and patched runs in fresh processes, one figure),
:mod:`~grpo_mem.job.flags` (command-line flags from a settings dataclass). The ``grpo-mem`` entry point and its
command table live in :mod:`grpo_mem.cli`.
"""

"""The ``grpo-mem train`` main job: SmolLM2-135M-Instruct (offline), a reasoning-gym task, TRL's GRPOTrainer on CPU.

Modules: :mod:`~grpo_mem.job.smollm2` (GGUF to HF directory, once), :mod:`~grpo_mem.job.tasks` (prompts, answer
extraction, exact reward), :mod:`~grpo_mem.job.memory` (per-step peak RSS and step time),
:mod:`~grpo_mem.job.train` (the run, its summary and plot). The command line lives in :mod:`grpo_mem.cli`.
"""

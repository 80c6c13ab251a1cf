"""The ``grpo-mem`` commands: each command module has ``main(argv) -> int`` (:data:`grpo_mem.cli.COMMANDS`).

- :mod:`~grpo_mem.commands.train`: ``grpo-mem train``, the main job: SmolLM2-135M-Instruct or Gemma 3 270M (offline), a
  reasoning-gym task, TRL's GRPOTrainer on CUDA when available, else CPU (one run, the ``train`` command); made of
  :mod:`~grpo_mem.commands.train_settings` (the settings, one per flag, and TRL's config from them),
  :mod:`~grpo_mem.commands.gguf_models` (GGUF to HF directory, once), :mod:`~grpo_mem.commands.tasks` (prompts, answer
  extraction, exact reward, few-shot examples), :mod:`~grpo_mem.commands.memory` (per-step peak RSS and step time),
  :mod:`~grpo_mem.commands.report` (per-step rows from TRL's logs, the token saving, the printed summary and the
  figure) and :mod:`~grpo_mem.commands.compare` (``train --compare``: stock and patched runs in fresh processes).
- :mod:`~grpo_mem.commands.bench`: ``grpo-mem bench``, on the benchmark library :mod:`grpo_mem.bench`.
- :mod:`~grpo_mem.commands.flags`: command-line flags from a settings dataclass.

These modules need the ``cli`` extra (``pip install "grpo_mem[cli]"``: reasoning-gym, gguf, datasets, matplotlib);
the library (``grpo_mem.patch_trl`` and below) does not.
"""

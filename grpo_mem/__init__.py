"""grpo_mem: prompt-once, memory-lean scoring of GRPO-family completions, as a revertible patch of TRL.

Public entry points:

- ``shared_prompt_logprobs(model, input_ids, attention_mask, logits_to_keep, ...)``: completion log-probs and
  entropies with each unique prompt forwarded once; same numbers as TRL's ``_get_per_token_logps_and_entropies``.
- ``patch_trl(target=None)``: route ``GRPOTrainer``/``RLOOTrainer`` (or one trainer) through it; returns a
  ``PatchHandle`` with ``revert()``. TRL itself is imported only when ``patch_trl`` is called.
- ``restore(model)``: give a model its own forward and attention implementation back.
- ``verify(trainer_or_model, batch=None)``: grpo_mem against stock TRL on one batch of the user's own model
  (log-probs, entropies, gradients, in the trainer's precision); returns a ``VerifyReport``.
- ``grpo_mem.ops``: the kernels (fused selective log-softmax, shared-prefix attention).
"""

from .model.group_forward import restore, shared_prompt_logprobs
from .patches.trl import PatchHandle, patch_trl
from .verify import VerificationError, VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "PatchHandle",
    "VerificationError",
    "VerifyReport",
    "patch_trl",
    "restore",
    "shared_prompt_logprobs",
    "verify",
]

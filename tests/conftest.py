"""Suite-wide settings: the numerical confirmation (``grpo_mem.model.confirm``) is off unless a test turns it on.

Most tests check the prompt-once path itself against stock TRL, and some count its passes or perturb its pieces;
a confirmation run on a tiny copy the first time a class is scored in the process would add passes (or fall back)
in whichever test comes first. ``test_confirm`` turns it on; ``test_architectures`` confirms every admitted type.
Set in the environment, so multi-process workers inherit it.
"""

import os

os.environ.setdefault("GRPO_MEM_CONFIRM", "0")

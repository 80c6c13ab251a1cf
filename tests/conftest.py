"""Suite-wide settings: the numerical confirmation (``grpo_mem.model.confirm``) is off unless a test turns it on.

Most tests check the prompt-once path itself against stock TRL, and some count its passes or perturb its pieces;
a confirmation run on a tiny copy the first time a class is scored in the process would add passes (or fall back)
in whichever test comes first. ``test_confirm`` turns it on; ``test_architectures`` confirms every admitted type.
Set in the environment, so multi-process workers inherit it.
"""

import os

os.environ.setdefault("GRPO_MEM_CONFIRM", "0")

# One torch thread per xdist worker when several share the cores: two workers of two threads each on a 2-core machine
# (with the 2-process runs beside them) oversubscribe it, and waiting OpenMP threads spin on the cores the others need
# (the same tiny test took 0.7 s in one run of the suite and 17.5 s in the next). Subprocesses keep their own setting.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    import torch

    torch.set_num_threads(1)

"""``python -m grpo_mem``: the ``grpo-mem`` command line (:mod:`grpo_mem.cli`)."""

import sys

from grpo_mem.cli import main

sys.exit(main())

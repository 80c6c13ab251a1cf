"""``grpo_mem.bench.harness_cuda`` under the name the scripts here import: ``import harness_cuda`` (see ``harness.py``
here for why it moved)."""

import os
import sys

# The checkout's package, as when the harness lived here: the scripts measure the code they sit beside
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from grpo_mem.bench import harness_cuda as _harness_cuda  # noqa: E402

sys.modules[__name__] = _harness_cuda

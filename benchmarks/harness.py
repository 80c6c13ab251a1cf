"""``grpo_mem.bench.harness`` under the name the scripts here (and their tests) import: ``import harness``.

The harness moved into the package so that ``grpo-mem bench`` can use it from an installed copy; this module replaces
itself in ``sys.modules`` by the package's, so ``harness.X`` (private names and monkeypatching included) is the
package module's ``X``.
"""

import os
import sys

# The checkout's package, as when the harness lived here: the scripts measure the code they sit beside
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from grpo_mem.bench import harness as _harness  # noqa: E402

sys.modules[__name__] = _harness

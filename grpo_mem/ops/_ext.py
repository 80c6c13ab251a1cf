"""The one place that loads the optional C++ extension ``grpo_mem._C`` (sources in ``csrc/``).

``HAS_EXT`` is True when it loaded, else ``LOAD_ERROR`` is the reason it did not. Loading it registers its kernels with
the dispatcher as ``torch.ops.grpo_mem.*`` (CPU kernels; their fake kernels are registered by ``logprobs_cpp``), which
is how the ops are called; the module itself holds nothing else.
The package works without it: ``backend="auto"`` then uses the torch paths. Setting ``GRPO_MEM_SKIP_EXT`` in the
environment skips the build (setup.py) and also skips loading an already built extension at import time.
"""

from __future__ import annotations

import os

import torch  # noqa: F401  (the extension links against libtorch: load torch's libraries first)

HAS_EXT = False
LOAD_ERROR: str | None = None

# The x86-64 build uses AVX2/FMA instructions (setup.py): load it only where torch itself dispatches to AVX2 or above.
_CPU_CAPABILITY = torch.backends.cpu.get_cpu_capability()
_NEEDS_AVX2 = os.uname().machine == "x86_64"

if os.environ.get("GRPO_MEM_SKIP_EXT"):
    LOAD_ERROR = "GRPO_MEM_SKIP_EXT is set"
elif _NEEDS_AVX2 and _CPU_CAPABILITY not in ("AVX2", "AVX512"):
    LOAD_ERROR = f"the extension is built for AVX2 but torch reports CPU capability {_CPU_CAPABILITY}"
else:
    try:
        from grpo_mem import _C  # type: ignore[attr-defined]  # noqa: F401  (registers torch.ops.grpo_mem.*)
    except ImportError as exc:  # not built (pure-Python install) or built against another torch
        LOAD_ERROR = f"{type(exc).__name__}: {exc}"
    else:
        HAS_EXT = True

"""The Triton kernels' tests, run by Triton's interpreter on CPU tensors: one fresh ``TRITON_INTERPRET=1`` process for
every file's selection (Triton fixes interpreter mode at its first import; one process pays the imports once).

In the main process these tests skip (``helpers.needs_interpreter``); on a CUDA machine ``test_triton_cuda.py``'s cases
run directly and are left out here."""

import importlib.util

import pytest
import torch
from helpers import INTERPRETING, run_under_interpreter

# the CUDA-only checks of test_triton_cuda.py (host synchronisations, compiled kernels, the op-times writer) and the
# reader of JITFunctions have nothing to run under the interpreter
_CUDA_KERNELS_ONLY = (
    "not no_host_sync and not host_syncs and not compiled_kernel_rows and not op_times_writer_on_cuda"
    " and not (fp16 and not d128 and attention)"
)
RUNS = [
    ("tests/ops/test_attention.py", "triton"),
    ("tests/ops/test_attention_features.py", "triton"),
    ("tests/ops/test_multi_region_attention.py", "triton and not launch"),
    ("tests/ops/test_logprobs.py", "triton_interpreter"),
    ("tests/ops/test_triton_cuda.py", _CUDA_KERNELS_ONLY),
    ("tests/patches/test_liger.py", "rope_kernel_in_the_prompt_once_path"),
]


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    """About four minutes of CPU time, hence slow-marked (CI runs it)."""
    if INTERPRETING:
        pytest.skip("this process has the interpreter: the Triton tests ran here directly")
    pytest.importorskip("triton")
    runs = [
        (path, select)
        for path, select in RUNS
        if not (path.endswith("test_triton_cuda.py") and torch.cuda.is_available())
        and not (path.endswith("test_liger.py") and importlib.util.find_spec("liger_kernel") is None)
    ]
    run_under_interpreter(runs)

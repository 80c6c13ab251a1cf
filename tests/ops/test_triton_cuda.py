"""The compiled Triton kernels and the CUDA library-kernel backends on CUDA at realistic shapes, against fp64 truth,
with bounds derived from a torch reference's own rounding; in CPU CI the same cases at toy shapes under Triton's
interpreter (the sdpa cases need CUDA; the cublas head runs there with fp32 matmuls for its GEMMs).

Backends: every attention case on ``"triton"``, and on ``"sdpa"`` (ATen's FlashAttention-2 / memory-efficient kernels,
``grpo_mem.ops.attention_sdpa``) where it runs (fp16/bf16, no soft-cap or sliding window); every head case on
``"triton"`` and ``"cublas"`` (``grpo_mem.ops.logprobs_cublas``). Each case checks that the named backend ran.

What runs: ``multi_region_attention`` (forward and every gradient: q, k, v, each region's K/V, sinks) at head dims 64,
96, 128 and 256, with a sliding window, a score soft-cap, attention sinks, and a two-region tree node (a system prompt
every row reads plus a per-group prompt); ``linear_logprobs`` (log-probs, entropies, d_hidden, d_weight) at 2K tokens
x the 152K vocabulary of Qwen, with temperature and a soft-cap, and at 32K tokens x 152K vocabulary (bf16 only: its
fp64 truth is computed in row chunks); ``selective_log_softmax`` (log-probs, entropies, d_logits) at 4K x 152K. Each
in bf16, fp16 and fp32 (except where said).

How it is judged. For every case the inputs are drawn once, cast to the tested dtype, and then:

- the truth is the plain-torch reference (``multi_region_attention_ref``, ``linear_logprobs_ref``'s computation in row
  chunks, ``selective_log_softmax_ref``) evaluated in fp64 on those same rounded inputs, so input rounding is not
  counted as an error;
- the naive reference is the same torch code run in the tested dtype (for the head: logits in the tested dtype,
  log-softmax in fp32, as TRL computes it), i.e. what a user gets without grpo_mem at that precision;
- the kernel's error against the truth (max absolute, per tensor) must satisfy
  ``err <= K x naive_err + eps(dtype) x max|truth|``: K = 2 in bf16/fp16 (the criterion of the CPU attention tests),
  K = 16 in fp32 (a blocked summation order against the reference's: under the interpreter, with exact exp/log, the
  ratio reached 5.2 at the toy shapes; compiled, ``ex2``/``lg2`` approximations of about 2 ulp add to it; 16 x stays
  well below the CPU suite's absolute 1e-5 bound), and eps(dtype) x max|truth| is one unit of
  rounding of the tensor's largest entry, the error of merely storing the exact result in that dtype.

Every measured error, the naive error and the bound go into a CSV (``GPU_CHECK_CSV``, one file per process) that
``benchmarks/gpu_check.py`` merges into ``kernels.csv``; on CUDA the same CSV also gets one row per compiled kernel
(name, dtype signature, registers, spills, shared memory, warps, stages) read from the JIT functions' device caches.

Memory nobody wrote is NaN: on CUDA, right before each kernel call the caching allocator is emptied and then
pre-filled (allocate, fill with NaN, free; large and small pools), so a buffer read before it is written poisons the
result instead of reading zeros. Also cuda-only: the forward and backward make no host synchronisation
(``torch.cuda.set_sync_debug_mode("error")``) and are bitwise deterministic.

Sizes: CUDA runs the realistic shapes (``GPU_CHECK_SIZES=toy`` selects the toy ones, e.g. under compute-sanitizer);
under ``TRITON_INTERPRET=1`` (CPU) the toy shapes run, through ``tests/ops/test_interpreter.py`` in CI.
Without CUDA or the interpreter every case skips.
"""

import csv
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import INTERPRETING, attention_inputs

from grpo_mem.ops import (
    linear_logprobs,
    multi_region_attention,
    multi_region_attention_ref,
    selective_log_softmax,
    selective_log_softmax_ref,
)
from grpo_mem.ops._backends import RESOLVED
from grpo_mem.ops.logprobs import _select
from grpo_mem.ops.logprobs_torch import transform_logits

CUDA = torch.cuda.is_available() and not INTERPRETING
DEVICE = "cuda" if CUDA else "cpu"
TOY = not CUDA or os.environ.get("GPU_CHECK_SIZES", "full") == "toy"
runs_here = pytest.mark.skipif(
    not (CUDA or INTERPRETING),
    reason="needs CUDA; in CPU CI run at toy shapes by tests/ops/test_interpreter.py",
)
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled kernels)")
large = pytest.mark.xdist_group("large")
"""The cases whose fp64 truths take 5-40 GiB: one xdist process runs them one after another (``--dist loadgroup``;
the first GPU check ran them in 6 processes at once and 5 of 8 ran out of the H100's 80 GB)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FACTOR = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 16.0}
"""K of the bound ``err <= K x naive_err + eps(dtype) x max|truth|`` (module docstring)."""

ROWS: list[dict] = []
"""The CSV rows of this process: one per compared tensor ("error") and per compiled kernel ("kernel")."""


# ----------------------------------------------------------------------------------------------------------------------
# comparison, allocator poisoning, the CSV
# ----------------------------------------------------------------------------------------------------------------------


def check_against_truth(case: str, dtype: torch.dtype, ours: dict, naive: dict, truth: dict) -> None:
    """Every tensor of ``truth`` (fp64): ours within ``K x`` the naive reference's max error plus one rounding unit
    of the largest truth entry; records each comparison in ``ROWS``; asserts after recording all of them."""
    failures = []
    eps = torch.finfo(dtype).eps
    for name, t in truth.items():
        assert name in ours, f"{case}: no {name} from the kernel"
        o, n = ours[name], naive[name]
        assert o.shape == t.shape, f"{case}/{name}: shape {tuple(o.shape)} != {tuple(t.shape)}"
        err = (o.double() - t).abs().max().item() if t.numel() else 0.0
        naive_err = (n.double() - t).abs().max().item() if t.numel() else 0.0
        scale = t.abs().max().item() if t.numel() else 0.0
        bound = FACTOR[dtype] * naive_err + eps * scale
        ok = err <= bound  # NaN fails
        ROWS.append(
            {
                "kind": "error",
                "case": case,
                "dtype": str(dtype).removeprefix("torch."),
                "tensor": name,
                "max_abs_err": f"{err:.3e}",
                "naive_err": f"{naive_err:.3e}",
                "bound": f"{bound:.3e}",
                "ratio": f"{err / naive_err:.3f}" if naive_err else "",
                "max_abs_truth": f"{scale:.3e}",
                "ok": ok,
            }
        )
        if not ok:
            failures.append(
                f"{name}: error {err:.3e} > {FACTOR[dtype]} x naive {naive_err:.3e} + {eps:.1e} x {scale:.3e}"
            )
    write_csv()
    assert not failures, f"{case} {dtype}: " + "; ".join(failures)


def poison_allocator(gib: float) -> None:
    """CUDA only: release the caching allocator's free blocks, then fill ``gib`` GiB of the large pool and 64 MiB of
    the small pool (blocks of at most 1 MiB) with NaN and free them, so the next allocations get NaN-filled memory."""
    if not CUDA:
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = torch.full((int(gib * 2**30) // 4,), float("nan"), device="cuda")
    small = [torch.full((2**18 - 64 * i,), float("nan"), device="cuda") for i in range(64)]
    torch.cuda.synchronize()
    del big, small


def _kernel_rows() -> list[dict]:
    """One row per compiled kernel in this process: the JIT functions of the attention and head kernel modules,
    each entry of their device caches (``fn.device_caches[device][0]``, key -> CompiledKernel)."""
    rows = []
    for name, fn in jit_functions():
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for kernel in kernels.values():
                if hasattr(kernel, "_init_handles"):
                    kernel._init_handles()  # n_regs/n_spills are read when the binary is loaded
                meta = kernel.metadata
                sig = getattr(kernel.src, "signature", {}) if hasattr(kernel, "src") else {}
                dtypes = sorted({str(v) for v in (sig.values() if isinstance(sig, dict) else []) if "*" in str(v)})
                rows.append(
                    {
                        "kind": "kernel",
                        "case": name,
                        "dtype": " ".join(dtypes),
                        "n_regs": getattr(kernel, "n_regs", ""),
                        "n_spills": getattr(kernel, "n_spills", ""),
                        "shared": getattr(meta, "shared", ""),
                        "num_warps": getattr(meta, "num_warps", ""),
                        "num_stages": getattr(meta, "num_stages", ""),
                        "constants": _constants(kernel),
                    }
                )
    return rows


def jit_functions() -> list[tuple[str, object]]:
    """(name, JITFunction) of every Triton kernel and helper of the attention and head kernel modules; an autotuner's
    or a heuristic's wrapped function is looked through (a JITFunction's own ``fn`` is its Python function: the first
    GPU check unwrapped that too and found no compiled kernel)."""
    from triton.runtime.jit import JITFunction, KernelInterface

    from grpo_mem.ops import attention_triton, logprobs_triton

    found = []
    for module in (attention_triton, logprobs_triton):
        for name, fn in sorted(vars(module).items()):
            while not isinstance(fn, JITFunction) and isinstance(getattr(fn, "fn", None), KernelInterface):
                fn = fn.fn
            if isinstance(fn, JITFunction):
                found.append((name, fn))
    return found


def _constants(kernel) -> str:
    """The kernel's constexpr values (tile sizes, head dim, features), compactly."""
    src = getattr(kernel, "src", None)
    consts = getattr(src, "constants", None) or {}
    names = getattr(getattr(src, "fn", None), "arg_names", None) or []
    items = []
    for k, v in consts.items():
        k = k[0] if isinstance(k, tuple) and len(k) == 1 else k  # triton 3.x keys constants by (argument index,)
        k = names[k] if isinstance(k, int) and k < len(names) else k
        if isinstance(v, (int, float, bool)) or v is None:
            items.append(f"{k}={v}")
    return " ".join(items)


COLUMNS = (
    "kind",
    "case",
    "dtype",
    "tensor",
    "max_abs_err",
    "naive_err",
    "bound",
    "ratio",
    "max_abs_truth",
    "ok",
    "n_regs",
    "n_spills",
    "shared",
    "num_warps",
    "num_stages",
    "constants",
)


def write_csv(with_kernels: bool = False) -> None:
    """``ROWS`` and (``with_kernels``, CUDA) the compiled kernels into ``$GPU_CHECK_CSV`` (suffixed with the xdist
    worker's name), when that variable is set; rewritten after every case, so a run stopped at its time limit keeps
    what it measured."""
    path = os.environ.get("GPU_CHECK_CSV")
    if not path:
        return
    rows = list(ROWS)
    if CUDA and with_kernels:
        try:
            rows += _kernel_rows() or [{"kind": "kernel", "case": "no compiled kernel found in the device caches"}]
        except Exception as exc:  # noqa: BLE001 - a triton release with other internals: keep the error rows
            rows.append({"kind": "kernel", "case": f"reading the device caches failed: {exc!r}"[:300]})
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = f"{path}.{worker}" if worker else path
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


@pytest.mark.skipif(INTERPRETING, reason="the interpreter's kernels are not JITFunctions")
def test_compiled_kernel_rows_find_every_kernel():
    """The kernel rows of kernels.csv read each launched kernel's JITFunction: every ``*_kernel`` of both modules is
    found (here, without a GPU, their device caches are empty)."""
    names = {name for name, _ in jit_functions()}
    kernels = {n for n in names if n.endswith("_kernel")}
    assert {"_mra_fwd_kernel", "_mra_bwd_dq_kernel", "_linear_logprobs_fwd_kernel"} <= kernels
    assert len(kernels) == 12, sorted(kernels)


@pytest.fixture(scope="module", autouse=True)
def kernels_into_csv():
    """After the module: the compiled kernels' resources join the CSV."""
    yield
    write_csv(with_kernels=True)


# ----------------------------------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------------------------------

# name -> (full shape, toy shape, features); a shape is (B, Hq, Hkv, C, d, regions as (U, S, index, mask), own lens).
# Full shapes: Qwen3-1.7B's heads (16/8, d=128) at the bench setting (C=512 over a 2048-token prompt), and the head
# layouts of the families that use each feature (gpt-oss: d=64 with sinks and a window; Gemma 2: soft-cap at d=256).


def _rows(B, U):
    return [b * U // B for b in range(B)]


ATTENTION = {
    "d64": (
        (8, 16, 4, 256, 64, [(1, 1536, [0] * 8, ("right", [1400]))], [256, 200, 256, 17, 256, 256, 130, 256]),
        (2, 4, 2, 5, 64, [(1, 9, [0] * 2, ("right", [7]))], [5, 3]),
        {},
    ),
    "d96": (
        (8, 12, 4, 256, 96, [(2, 1024, _rows(8, 2), ("left", [1024, 700]))], None),
        (2, 2, 1, 4, 96, [(2, 7, [0, 1], ("left", [7, 4]))], [4, 2]),
        {},
    ),
    "d128": (
        (8, 16, 8, 512, 128, [(1, 2048, [0] * 8, ("right", [1900]))], [512, 300, 512, 1, 512, 512, 64, 512]),
        (2, 2, 1, 4, 128, [(1, 8, [0] * 2, ("right", [6]))], [4, 2]),
        {},
    ),
    "d256": (
        (8, 16, 4, 256, 256, [(1, 2048, [0] * 8, ("right", [2000]))], [256, 256, 100, 256, 256, 256, 256, 31]),
        (2, 2, 1, 4, 256, [(1, 6, [0] * 2, ("right", [5]))], [4, 3]),
        {},
    ),
    "window": (
        (8, 16, 8, 256, 128, [(2, 1536, _rows(8, 2), ("right", [1536, 900]))], [256, 256, 256, 256, 80, 256, 256, 256]),
        (2, 2, 1, 5, 64, [(2, 10, [0, 1], ("right", [10, 7]))], [5, 3]),
        {"sliding_window": (512, 5)},
    ),
    "softcap": (
        (8, 8, 4, 256, 256, [(1, 1024, [0] * 8, ("right", [1000]))], None),
        (2, 2, 1, 4, 256, [(1, 6, [0] * 2, ("right", [6]))], [4, 3]),
        {"softcap": 50.0},
    ),
    "sinks": (
        (8, 16, 2, 256, 64, [(1, 1024, [0] * 8, ("right", [1024]))], [256, 256, 256, 256, 256, 10, 256, 256]),
        (2, 4, 2, 5, 64, [(1, 7, [0] * 2, ("right", [7]))], [5, 3]),
        {"sinks": True, "sliding_window": (128, 4)},
    ),
    "tree-r2": (
        (
            8,
            16,
            8,
            256,
            128,
            [(1, 1024, [0] * 8, ("right", [1024])), (2, 512, _rows(8, 2), ("left", [512, 300]))],
            [256, 100, 256, 256, 256, 256, 7, 256],
        ),
        (3, 2, 1, 4, 64, [(1, 6, [0] * 3, ("right", [6])), (2, 5, [0, 0, 1], ("left", [5, 3]))], [4, 2, 4]),
        {},
    ),
}


def _positions(meta, B, C, device):
    """Absolute positions as stock TRL numbers a padded tree row: region r's keys after regions 0..r-1's, the own
    keys after all regions. Returns (q_positions (B, C), [positions (U_r, S_r)])."""
    pos, start = [], 0
    for _, mask in meta:
        U, S = mask.shape
        pos.append((start + torch.arange(S, device=device)).expand(U, S).contiguous())
        start += S
    return (start + torch.arange(C, device=device)).expand(B, C).contiguous(), pos


def attention_case(name: str, seed: int = 0):
    """(tensors, meta, key_mask, grad_out, features) of case ``name`` at this run's size, on DEVICE, tensors fp64."""
    full, toy, feats = ATTENTION[name]
    B, Hq, Hkv, C, d, regions, lens = toy if TOY else full
    tensors, meta, key_mask, grad_out = attention_inputs(B, Hq, Hkv, C, d, regions, lens, torch.float64, seed)
    tensors = {n: x.to(DEVICE) for n, x in tensors.items()}
    meta = [(i.to(DEVICE), m.to(DEVICE)) for i, m in meta]
    key_mask = None if key_mask is None else key_mask.to(DEVICE)
    features = {}
    if "softcap" in feats:
        features["softcap"] = feats["softcap"]
    if "sliding_window" in feats:
        features["sliding_window"] = feats["sliding_window"][1 if TOY else 0]
    if feats.get("sinks"):
        tensors["sinks"] = torch.randn(Hq, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        tensors["sinks"] = tensors["sinks"].to(DEVICE)
    return tensors, meta, key_mask, grad_out.to(DEVICE), features


def attention_run(fn, tensors, meta, key_mask, grad_out, features, dtype, poison_gib=0.0, **kw):
    """{"out", "dq", "dk", "dv", "drk0", "drv0", ..., "dsinks"} of ``fn`` on the inputs cast to ``dtype``."""
    leaves = {n: x.detach().to(dtype).requires_grad_(True) for n, x in tensors.items()}
    regions = [(leaves[f"rk{i}"], leaves[f"rv{i}"], idx, mask) for i, (idx, mask) in enumerate(meta)]
    feats = dict(features)
    if "sinks" in leaves:
        feats["sinks"] = leaves["sinks"]
    if feats.get("sliding_window") is not None:
        q_pos, k_pos = _positions(meta, leaves["q"].shape[0], leaves["q"].shape[2], leaves["q"].device)
        feats["q_positions"] = q_pos
        regions = [r + (p,) for r, p in zip(regions, k_pos)]
    scale = leaves["q"].shape[-1] ** -0.5
    poison_allocator(poison_gib)
    out = fn(leaves["q"], leaves["k"], leaves["v"], regions, key_mask, scale=scale, **feats, **kw)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype))
    return {"out": out.detach(), **{"d" + n: g for n, g in zip(leaves, grads)}}


def _sdpa_runs(case: str, dtype: str) -> bool:
    """The sdpa backend (ATen's FlashAttention-2 / memory-efficient CUDA kernels) takes the case: CUDA, fp16/bf16, no
    soft-cap or sliding window (its own region: dense causal without padding, the efficient kernel with it)."""
    return CUDA and dtype != "fp32" and not ({"softcap", "sliding_window"} & set(ATTENTION[case][2]))


ATTENTION_RUNS = [
    pytest.param(case, dtype, backend, id=f"{case}-{dtype}" + ("" if backend == "triton" else f"-{backend}"))
    for case in ATTENTION
    for dtype in DTYPES
    for backend in ("triton", "sdpa")
    if backend == "triton" or _sdpa_runs(case, dtype)
]
"""(case, dtype, backend): every case on Triton; on CUDA also the sdpa backend where it runs."""


@runs_here
@pytest.mark.parametrize("case,dtype,backend", ATTENTION_RUNS)
def test_attention(case, dtype, backend):
    if INTERPRETING and dtype == "fp16" and case != "d128":
        pytest.skip("the interpreter runs fp16 like bf16 (widened, rounded by EMULATE_BF16): one case is enough there")
    dt = DTYPES[dtype]
    inputs = attention_case(case)
    rounded = {n: x.to(dt).double() for n, x in inputs[0].items()}  # the truth sees the kernel's rounded inputs
    truth = attention_run(multi_region_attention_ref, rounded, *inputs[1:], torch.float64)
    naive = attention_run(multi_region_attention_ref, *inputs, dt)
    ours = attention_run(multi_region_attention, *inputs, dt, poison_gib=1.0, backend=backend)
    assert RESOLVED["multi_region_attention"] == backend  # not passed on to another backend
    for name, x in ours.items():
        assert x.dtype == dt, f"{name}: {x.dtype} != {dt}"
    check_against_truth(f"attention/{case}" + ("" if backend == "triton" else f"/{backend}"), dt, ours, naive, truth)


# ----------------------------------------------------------------------------------------------------------------------
# the head: linear_logprobs and selective_log_softmax
# ----------------------------------------------------------------------------------------------------------------------

# name -> (full (N, H, V), toy (N, H, V), keyword arguments, dtypes)
HEAD = {
    "qwen-2k": ((2048, 2048, 151936), (20, 48, 300), {}, tuple(DTYPES)),
    "qwen-2k-t0.7-cap30": ((2048, 2048, 151936), (12, 32, 200), {"temperature": 0.7, "softcap": 30.0}, tuple(DTYPES)),
    "qwen-32k": ((32768, 2048, 151936), (40, 32, 260), {}, ("bf16",)),
}
TRUTH_ROWS = 2048
"""Rows per chunk of the chunked references (the (rows, V) logits of 32K x 152K do not fit in fp64 at once)."""


def head_inputs(shape, seed=0):
    """hidden (N, H), weight (V, H) at a realistic logit spread (std about 2), targets (N,) with a few ignored rows
    and upstream gradients g_lp, g_ent (N,), all fp64 on DEVICE."""
    N, H, V = shape
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, device=DEVICE, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, device=DEVICE, dtype=torch.float64) * (2.0 / H**0.5)
    index = torch.randint(0, V, (N,), generator=g, device=DEVICE)
    index[:: max(N // 7, 1)] = -100
    g_lp = torch.randn(N, generator=g, device=DEVICE, dtype=torch.float64)
    g_ent = torch.randn(N, generator=g, device=DEVICE, dtype=torch.float64)
    return hidden, weight, index, g_lp, g_ent


def head_reference(hidden, weight, index, g_lp, g_ent, kw, logits_dtype):
    """Chunked ``linear_logprobs_ref``: the logits GEMM in ``logits_dtype`` (fp64: the truth; the input dtype: the
    naive reference), then soft-cap, temperature and log-softmax in fp64 (truth) or fp32 (naive, as TRL); gradients summed over chunks in fp64/fp32 and returned in the
    input dtype. {"logp", "entropy", "d_hidden", "d_weight"}."""
    acc = torch.float64 if logits_dtype == torch.float64 else torch.float32
    w = weight.detach().to(logits_dtype).requires_grad_(True)
    logp, ent, dh, dw = [], [], [], torch.zeros(weight.shape, dtype=acc, device=weight.device)
    for lo in range(0, hidden.shape[0], TRUTH_ROWS):
        h = hidden[lo : lo + TRUTH_ROWS].detach().to(logits_dtype).requires_grad_(True)
        z = transform_logits(F.linear(h, w).to(acc), 1.0, kw.get("softcap"), 1.0 / kw.get("temperature", 1.0))
        lp, en = _select(z, index[lo : lo + TRUTH_ROWS], True, -100)
        gh, gw = torch.autograd.grad(
            (lp * g_lp[lo : lo + TRUTH_ROWS].to(lp.dtype) + en * g_ent[lo : lo + TRUTH_ROWS].to(en.dtype)).sum(), [h, w]
        )
        logp.append(lp.detach())
        ent.append(en.detach())
        dh.append(gh.to(hidden.dtype))
        dw += gw.to(acc)
    return {"logp": torch.cat(logp), "entropy": torch.cat(ent), "d_hidden": torch.cat(dh), "d_weight": dw.to(w.dtype)}


HEAD_RUNS = [
    pytest.param(case, dtype, backend, id=f"{case}-{dtype}" + ("" if backend == "triton" else f"-{backend}"))
    for case, spec in HEAD.items()
    for dtype in spec[3]
    for backend in ("triton", "cublas")
]
"""(case, dtype, backend): the fused Triton head and the chunked cuBLAS one (its Triton selective log-softmax runs
under the interpreter too, with fp32 matmuls for the GEMMs)."""


@large
@runs_here
@pytest.mark.parametrize("case,dtype,backend", HEAD_RUNS)
def test_linear_logprobs(case, dtype, backend):
    full, toy, kw, _ = HEAD[case]
    if not TOY and case == "qwen-32k" and torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("32K x 152K needs about 40 GiB for its fp64 truth")
    dt = DTYPES[dtype]
    hidden, weight, index, g_lp, g_ent = head_inputs(toy if TOY else full)
    hidden, weight = hidden.to(dt), weight.to(dt)
    truth = head_reference(hidden.double(), weight.double(), index, g_lp, g_ent, kw, torch.float64)
    naive = head_reference(hidden, weight, index, g_lp, g_ent, kw, dt)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    poison_allocator(4.0 if case == "qwen-32k" else 1.0)
    lp, en = linear_logprobs(h, w, index, return_entropy=True, backend=backend, **kw)
    assert RESOLVED["linear_logprobs"] == backend
    gh, gw = torch.autograd.grad((lp * g_lp.float() + en * g_ent.float()).sum(), [h, w])
    ours = {"logp": lp.detach(), "entropy": en.detach(), "d_hidden": gh, "d_weight": gw}
    assert gh.dtype == dt and gw.dtype == dt and lp.dtype == torch.float32
    del h, w
    name = f"linear_logprobs/{case}" + ("" if backend == "triton" else f"/{backend}")
    check_against_truth(name, dt, ours, naive, truth)


def sls_run(logits, index, g_lp, g_ent, dtype, upcast, poison_gib=0.0, **kw):
    """{"logp", "entropy", "d_logits"} of ``selective_log_softmax`` (``upcast``: the torch reference on the logits
    cast to ``upcast``) on the logits cast to ``dtype``, d_logits in ``dtype``."""
    x = logits.detach().to(dtype).requires_grad_(True)
    if upcast is not None:
        lp, en = selective_log_softmax_ref(x.to(upcast), index, temperature=0.7, return_entropy=True)
    else:
        poison_allocator(poison_gib)
        lp, en = selective_log_softmax(x, index, temperature=0.7, return_entropy=True, **kw)
    (g,) = torch.autograd.grad((lp * g_lp.to(lp.dtype) + en * g_ent.to(en.dtype)).sum(), [x])
    return {"logp": lp.detach(), "entropy": en.detach(), "d_logits": g}


@large
@runs_here
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_selective_log_softmax(dtype):
    dt = DTYPES[dtype]
    N, V = (6, 300) if TOY else (4096, 151936)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    logits = (torch.randn(N, V, generator=g, device=DEVICE, dtype=torch.float64) * 3).to(dt)
    index = torch.randint(0, V, (N,), generator=g, device=DEVICE)
    g_lp = torch.randn(N, generator=g, device=DEVICE, dtype=torch.float64)
    g_ent = torch.randn(N, generator=g, device=DEVICE, dtype=torch.float64)
    truth = sls_run(logits.double(), index, g_lp, g_ent, torch.float64, torch.float64)
    naive = sls_run(logits, index, g_lp, g_ent, dt, torch.float32)
    ours = sls_run(logits, index, g_lp, g_ent, dt, None, poison_gib=1.0, backend="triton")
    assert ours["d_logits"].dtype == dt
    check_against_truth("selective_log_softmax/4k-152k", dt, ours, naive, truth)


# ----------------------------------------------------------------------------------------------------------------------
# cuda-only: no host synchronisation, bitwise determinism
# ----------------------------------------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("case", ["tree-r2", "sinks"])
def test_attention_no_host_sync_and_deterministic(case):
    """Forward and backward of the Triton path under ``set_sync_debug_mode("error")`` (a host synchronisation
    raises), twice: bitwise equal outputs and gradients."""
    inputs = attention_case(case)
    results = []
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            results.append(attention_run(multi_region_attention, *inputs, torch.bfloat16, backend="triton"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), f"{case}/{name} differs between two identical runs"


@cuda_only
def test_sdpa_attention_no_host_sync():
    """The sdpa backend's forward and backward under ``set_sync_debug_mode("error")``: its region plans (sorts,
    scatters, prefix sums) stay on the device. Not bitwise deterministic: FlashAttention-2's backward adds dQ with
    atomics (deterministic only under ``torch.use_deterministic_algorithms``)."""
    for case in ("tree-r2", "d64"):  # key_mask None (dense causal own region) and padded own keys (efficient kernel)
        inputs = attention_case(case)
        if case == "tree-r2":
            inputs = (inputs[0], inputs[1], None, *inputs[3:])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            attention_run(multi_region_attention, *inputs, torch.bfloat16, backend="sdpa")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert RESOLVED["multi_region_attention"] == "sdpa"


@large
@cuda_only
@pytest.mark.parametrize("backend", ["triton", "cublas"])
def test_head_no_host_sync_and_deterministic(backend):
    hidden, weight, index, g_lp, g_ent = head_inputs((20, 48, 300) if TOY else (2048, 2048, 151936))
    results = []
    for _ in range(2):
        h = hidden.to(torch.bfloat16).requires_grad_(True)
        w = weight.to(torch.bfloat16).requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            lp, en = linear_logprobs(h, w, index, return_entropy=True, backend=backend)
            gh, gw = torch.autograd.grad((lp * g_lp.float() + en * g_ent.float()).sum(), [h, w])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((lp, en, gh, gw))
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_weight"), *results):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


@cuda_only
def test_op_times_writer_on_cuda(tmp_path):
    """``grpo_mem.bench.op_times`` on CUDA at toy shapes: CUDA-event times for every backend that runs here (skipped
    rows for the CPU ones), read back under the device key and shape classes that ``resolve`` looks up on this GPU."""
    from grpo_mem.bench import op_times
    from grpo_mem.ops import _op_times

    shapes = (op_times.AttentionShape(B=2, Hq=4, Hkv=2, C=64, d=64, S=128), op_times.HeadShape(N=64, H=64, V=1000))
    rows = op_times.measure_all("cuda", torch.bfloat16, shapes, repeats=2, warmup=1)
    path = tmp_path / "op_times.csv"
    op_times.write_csv(rows, str(path))
    times = _op_times.load(str(path))
    key = _op_times.device_key(torch.device("cuda"))
    found = {
        shape.op: times[(key, shape.op, _op_times.shape_class(shape.op, torch.bfloat16, shape.sizes()))]
        for shape in shapes
    }
    assert set(found["multi_region_attention"]) == {"sdpa", "triton", "torch"}, found
    assert set(found["linear_logprobs"]) == {"cublas", "triton", "torch"}, found
    assert all(t > 0 for by_backend in found.values() for t in by_backend.values())


SCORING_SYNC_BUDGET = 4
"""Host synchronisations a warm scoring call of grpo_mem's own code may make on CUDA: reading the prompts for the
plan (one copy per micro-batch), the grouping, the left-padding check and the head's scored positions. Plan indices,
masks and positions go to the GPU from pinned memory without blocking (``plan.to_device``)."""


@cuda_only
def test_scoring_call_host_syncs():
    """A warm ``shared_prompt_logprobs`` call and its backward on a tiny Llama on CUDA under
    ``set_sync_debug_mode("warn")``: every synchronising CUDA operation is recorded where it came from (rows of kind
    "sync" in kernels.csv; the first GPU run found a read-back per head call and one per plan index copy); grpo_mem's
    kernels launch none, its model code at most ``SCORING_SYNC_BUDGET``."""
    import warnings

    from helpers import tiny_model

    from grpo_mem.model.sharing import shared_prompt_logprobs

    model = tiny_model().cuda()
    B, P, C = 8, 24, 8
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (B, P + C), generator=g)
    ids[:4, :P], ids[4:, :P] = ids[0, :P], ids[4, :P]
    mask = torch.ones_like(ids)
    mask[:4, :3] = 0
    ids, mask = ids.cuda(), mask.cuda()

    def call():
        lp, ent = shared_prompt_logprobs(model, ids, mask, C, compute_entropy=True)
        (lp.sum() + ent.sum()).backward()

    call()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = [f"{w.filename.split('site-packages/')[-1].split('grpo_mem/')[-1]}:{w.lineno}" for w in syncs]
    for place in sorted(set(where)):
        ROWS.append({"kind": "sync", "case": place, "tensor": str(where.count(place))})
    write_csv()
    ours = [w for w, s in zip(where, syncs) if "/grpo_mem/" in s.filename]
    assert not [w for w in ours if w.startswith("ops/")], where
    assert len(ours) <= SCORING_SYNC_BUDGET, where

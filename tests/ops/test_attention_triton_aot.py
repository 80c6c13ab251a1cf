"""The multi-region (and shared-prefix) attention kernels, compiled ahead of time for sm_80, sm_86 (which sm_89 shares)
and sm_90 without a GPU:

* at their shipped block sizes for that architecture, for head dims 64, 80, 96, 128 and 256, in bf16 and fp32, with
  the argument attributes Triton's launcher specialises on at run time (pointers 16-byte aligned, integer arguments
  that are multiples of 16 marked so): no spill (no STL store to local memory in the SASS), at most 255 registers and
  shared memory within the architecture's limit per block (``SHARED_MEMORY_LIMIT``). Prints one table row per build
  (-s).
* sm_89's build is sm_86's: the same TTGIR and PTX but for the ``.target`` line, the same registers.
* their TTIR has no int32 scalar product in a pointer offset (each overflows once a batch entry or prompt starts past
  2**31 elements).
"""

import re

import pytest
import torch

triton = pytest.importorskip("triton")

import aot  # noqa: E402  (tests/ops/aot.py)
from grpo_mem.ops import attention_triton as kernels  # noqa: E402
from grpo_mem.ops import attention_triton_launch as launch  # noqa: E402
from grpo_mem.ops.attention_triton_tiles import SHARED_MEMORY_LIMIT, block_config  # noqa: E402

POINTERS_IN = {"Q", "K", "V", "RK", "RV", "OUT", "DO", "DQ", "DK", "DV"}
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REP = 4  # GQA ratio of the builds (the query-head loop bound is a constexpr)
HEAD_DIMS = (64, 80, 96, 128, 256)
# Integer arguments Triton's launcher marks tt.divisibility=16 at run time whatever the lengths are: C_PAD (C rounded
# up to 16 by the launcher) and the strides (head dims here are multiples of 16). C and S are the batch's longest
# completion and a region's length: arbitrary, so unmarked (the general case; a multiple of 16 only adds information).
# N and stride_split (U·Hkv·S·d) are multiples of 16 when d is.
DIVISIBLE_INTS = {"C_PAD", "N", "stride_split"}
# Architectures built: sm_80 (A100; 163 KB of shared memory per block), sm_86 (A10G, A40, RTX 30; 99 KB) and sm_90
# (H100, H200; 227 KB). sm_89 (L4, L40S, RTX 40; 99 KB) gets sm_86's tiles and Triton builds it as sm_86 but for the
# PTX target (test_sm89_builds_as_sm86), so it is not built again.
ARCHS = (80, 86, 90)
CAPABILITY = {80: (8, 0), 86: (8, 6), 89: (8, 9), 90: (9, 0)}


# Launch variants of the forward and dQ kernels (HAS_REGION, HAS_OWN, HAS_PREV; see attention_triton_inputs.launch_plan):
# "one_region" is the only launch with one region (shared-prefix attention), "last" the last of R >= 2 launches (it
# also reads the fp32 partial result), "partial" an earlier one (writes the fp32 partial result).
VARIANTS = {"one_region": (True, True, False), "last": (True, True, True), "partial": (True, False, True)}


def kernel_types(name: str, fn, dtype: str, variant: str = "one_region") -> dict:
    types = {}
    for arg in fn.arg_names:
        if arg in ("OUT", "DQ") and not VARIANTS[variant][1]:
            types[arg] = "*fp32"  # a partial launch writes the fp32 running result
        elif arg in POINTERS_IN:
            types[arg] = f"*{dtype}"
        elif arg in ("DRK", "DRV", "DPK", "DPV"):
            # the region kernel writes fp32 partial sums when its work is split (realistic shapes); the reduction
            # writes the gradients in the input dtype
            types[arg] = "*fp32" if name == "bwd_dkdv_region" else f"*{dtype}"
        elif arg in ("LSE", "DELTA", "PART_K", "PART_V", "PREV"):
            types[arg] = "*fp32"
        elif arg in ("RIDX", "QPOS", "RPOS"):
            types[arg] = "*i64"
        elif arg in ("RSPAN", "ROWS", "ROW_START"):
            types[arg] = "*i32"
        elif arg in ("RMASK", "KMASK"):
            types[arg] = "*i1"
        elif arg == "SCALE":
            types[arg] = "fp32"
        elif arg.startswith("stride_") or arg in ("C", "C_PAD", "S", "HKV", "HQ", "N", "N_SPLIT", "SLIDING_WINDOW"):
            types[arg] = "i32"
    return types


def kernel_constexprs(
    name: str,
    fn,
    dtype: str,
    head_dim: int,
    variant: str = "one_region",
    softcap: float = 0.0,
    sliding_window: bool = False,
    arch: int = 90,
) -> dict:
    cfg = block_config(name, head_dim, TORCH_DTYPE[dtype], softcap > 0, sliding_window, CAPABILITY[arch])
    has_region, has_own, has_prev = VARIANTS[variant]
    # the launcher's own tile constexprs (head-dim tiles included), compiled as on a GPU
    every = dict(
        launch._tile_constexprs(
            name,
            head_dim,
            TORCH_DTYPE[dtype],
            interpret=False,
            softcap=softcap > 0,
            sliding_window=sliding_window,
            capability=CAPABILITY[arch],
        ),
        REP=REP,
        BLOCK=cfg["BLOCK_M"],
        HAS_KMASK=True,  # the register-heavier variant
        HAS_REGION=has_region,
        HAS_OWN=has_own,
        HAS_PREV=has_prev,
        SOFTCAP=softcap,
        HAS_SLIDING_WINDOW=sliding_window,
    )
    return {n: v for n, v in every.items() if n in fn.arg_names}


def divisibility_attrs(fn, sig: dict) -> dict:
    """The specialisation Triton's launcher makes at run time for torch allocations and aligned shapes: pointers
    16-byte aligned, every stride and the DIVISIBLE_INTS multiples of 16 (``tt.divisibility``). Without it the build is
    not the one that runs (loads cannot be vectorised) and its register count is meaningless."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if sig[n].startswith("*") or n.startswith("stride_") or n in DIVISIBLE_INTS
    }


def build_args(name, dtype, head_dim, variant="one_region", softcap=0.0, sliding_window=False, arch=90):
    fn = kernels.KERNELS[name]
    cons = kernel_constexprs(name, fn, dtype, head_dim, variant, softcap, sliding_window, arch)
    sig = aot.signature_for(fn, kernel_types(name, fn, dtype, variant), cons)
    return fn, sig, cons, divisibility_attrs(fn, sig)


def report(name, dtype, arch, head_dim, variant="one_region", softcap=0.0, sliding_window=False):
    fn, sig, cons, attrs = build_args(name, dtype, head_dim, variant, softcap, sliding_window, arch)
    cfg = block_config(name, head_dim, TORCH_DTYPE[dtype], softcap > 0, sliding_window, CAPABILITY[arch])
    r = aot.compile_report(fn, sig, cons, arch, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], attrs=attrs)
    return r, cfg


def _compiled_kernels_or_skip():
    if not isinstance(kernels.KERNELS["fwd"], triton.runtime.jit.JITFunction):
        pytest.skip("TRITON_INTERPRET=1 was set when triton was imported: kernels are interpreted, not compiled")


# bf16 (the training dtype; fp16 ships the same tiles) and fp32 (exact "ieee" dots, own tiles), every architecture,
# every head dim. The two small kernels do not depend on the dtype's dot tiles: bf16 only.
SMALL = ("bwd_delta", "bwd_region_reduce")
CASES = [
    (n, t, a, d)
    for t in ("bf16", "fp32")
    for a in ARCHS
    for d in HEAD_DIMS
    for n in kernels.KERNELS
    if not (t == "fp32" and n in SMALL) and not (n == "bwd_region_reduce" and d != 128)
]


def _check_build(name, dtype, arch, head_dim, variant="one_region", softcap=0.0, sliding_window=False):
    _compiled_kernels_or_skip()
    try:
        aot.cuobjdump_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    r, cfg = report(name, dtype, arch, head_dim, variant, softcap, sliding_window)
    features = (" softcap" if softcap else "") + (" window" if sliding_window else "")
    print(
        f"\n| {name} | {variant}{features} | {dtype} | sm_{arch} | d={head_dim} | BLOCK_M={cfg['BLOCK_M']} "
        f"BLOCK_N={cfg['BLOCK_N']} warps={cfg['num_warps']} stages={cfg['num_stages']} | regs {r['regs']} "
        f"| spill stores {r['spill_stores']} | local {r['local']} B | stack {r['stack']} B "
        f"| shared {r['shared']} B |"
    )
    assert 0 < r["regs"] <= 255
    limit = SHARED_MEMORY_LIMIT[CAPABILITY[arch]]
    assert r["shared"] <= limit, f"{name} d={head_dim} {dtype}: shared memory {r['shared']} B > sm_{arch}'s {limit} B"
    # a spill is a store to local memory (STL); stack bytes alone are a call frame (fp32 division slow path)
    assert r["spill_stores"] == 0 and r["local"] == 0, f"{name} d={head_dim} {dtype} spills on sm_{arch}: {r}"


@pytest.mark.parametrize("name, dtype, arch, head_dim", CASES, ids=[f"{n}-{t}-sm{a}-d{d}" for n, t, a, d in CASES])
def test_aot_compiles_without_spills(name, dtype, arch, head_dim):
    _check_build(name, dtype, arch, head_dim)


def test_sm89_builds_as_sm86():
    """sm_89 is not in the matrix: Triton's NVIDIA pipeline gives it sm_86's TTGIR and PTX but for the PTX ``.target``
    line (its passes test ``capability // 10``; ``>= 89`` only admits fp8 types, ``== 80`` turns off LLVM's SLP
    vectoriser, so sm_80 is built on its own), and ptxas gives the two the same registers, spills and shared memory.
    Shown on the build nearest its limits (bwd_dq bf16 d=256 at sm_86's tiles)."""
    _compiled_kernels_or_skip()
    try:
        aot.cuobjdump_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert block_config("bwd_dq", 256, capability=(8, 9)) == block_config("bwd_dq", 256, capability=(8, 6))
    assert SHARED_MEMORY_LIMIT[(8, 9)] == SHARED_MEMORY_LIMIT[(8, 6)]
    builds = {}
    for arch in (86, 89):
        fn, sig, cons, attrs = build_args("bwd_dq", "bf16", 256, arch=arch)
        cfg = block_config("bwd_dq", 256, torch.bfloat16, capability=CAPABILITY[arch])
        r = aot.compile_report(
            fn, sig, cons, arch, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], attrs=attrs, asm=True
        )
        builds[arch] = dict(
            r,
            arch=None,
            ptx=re.sub(r"\.target sm_\d+", "", r["ptx"]),
            ttgir=r["ttgir"].replace(f"cuda:{arch}", "cuda:N"),
        )
    assert builds[86]["ttgir"] == builds[89]["ttgir"]
    assert builds[86]["ptx"] == builds[89]["ptx"]
    assert builds[86] == builds[89], {
        a: {k: v for k, v in b.items() if k not in ("ptx", "ttgir")} for a, b in builds.items()
    }


# the other launches of the forward and dQ kernels with two regions or more (see VARIANTS)
MULTI_CASES = [
    (n, v, t, a, d)
    for n in ("fwd", "bwd_dq")
    for v in ("last", "partial")
    for t in ("bf16", "fp32")
    for a in ARCHS
    for d in (64, 128)
]


@pytest.mark.parametrize(
    "name, variant, dtype, arch, head_dim",
    MULTI_CASES,
    ids=[f"{n}-{v}-{t}-sm{a}-d{d}" for n, v, t, a, d in MULTI_CASES],
)
def test_aot_multi_region_launches_compile_without_spills(name, variant, dtype, arch, head_dim):
    _check_build(name, dtype, arch, head_dim, variant)


# the soft-capped builds (Gemma 2) of the kernels that compute scores, bf16, at Gemma 2's head dims (256) and 128
SOFTCAP_CASES = [
    (n, a, d) for n in ("fwd", "bwd_dq", "bwd_dkdv_own", "bwd_dkdv_region") for a in ARCHS for d in (128, 256)
]


@pytest.mark.parametrize("name, arch, head_dim", SOFTCAP_CASES, ids=[f"{n}-sm{a}-d{d}" for n, a, d in SOFTCAP_CASES])
def test_aot_softcap_compiles_without_spills(name, arch, head_dim):
    _check_build(name, "bf16", arch, head_dim, softcap=50.0)


# the sliding-window builds (HAS_SLIDING_WINDOW: Gemma 2/3, gpt-oss, Mistral layers) of the kernels that compute scores, at the
# head dims whose tiers have windowed tiles of their own (_BLOCKS_16BIT_WINDOW, _BLOCKS_FP32_WINDOW: 96 stands for the
# two-tile tier with 80, 256 is Gemma's), soft-capped too (Gemma 2) for the kernels whose 16-bit d=256 tiles depend on
# both. The other head dims (64, 80, 128) build without spills with the windowless tiles (checked once by a sweep).
_SCORE_KERNELS = ("fwd", "bwd_dq", "bwd_dkdv_own", "bwd_dkdv_region")
WINDOW_CASES = [(n, t, a, d, 0.0) for t in ("bf16", "fp32") for d in (96, 256) for n in _SCORE_KERNELS for a in ARCHS]
WINDOW_CASES += [("bwd_dkdv_region", "fp32", a, 64, 0.0) for a in ARCHS]
WINDOW_CASES += [(n, "bf16", a, 256, 50.0) for n in ("fwd", "bwd_dq") for a in ARCHS]


@pytest.mark.parametrize(
    "name, dtype, arch, head_dim, softcap",
    WINDOW_CASES,
    ids=[f"{n}-{t}-sm{a}-d{d}{'-softcap' if sc else ''}" for n, t, a, d, sc in WINDOW_CASES],
)
def test_aot_sliding_window_compiles_without_spills(name, dtype, arch, head_dim, softcap):
    _check_build(name, dtype, arch, head_dim, softcap=softcap, sliding_window=True)


# ----------------------------------------------------------------------------------------------------------------------
# int64 pointer offsets, read from the TTIR
# ----------------------------------------------------------------------------------------------------------------------

_DEF = re.compile(r"^\s*(%[\w.#-]+)(?::\d+)?\s*=\s*([\w.]+)\b(.*)$")
_OPERAND = re.compile(r"%[\w.-]+(?:#\d+)?")


def ttir(
    name: str,
    dtype: str = "bf16",
    head_dim: int = 128,
    arch: int = 90,
    inline: bool = False,
    variant: str = "one_region",
    sliding_window: bool = False,
    **overrides,
) -> str:
    """The TTIR text of one kernel, built as ``triton.compile`` builds it (same signature, constexprs and attrs).

    ``inline=True`` also runs the backend's TTIR passes (the inliner among them), so the @triton.jit helpers' bodies
    appear at every call site; ``overrides`` replace shipped constexprs (e.g. BLOCK_D0=128)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn, sig, cons, attrs = build_args(name, dtype, head_dim, variant, sliding_window=sliding_window)
    unknown = sorted(set(overrides) - set(cons))
    if unknown:
        raise ValueError(f"{name} has no constexprs {unknown}")
    cons = {**cons, **overrides}
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    src = ASTSource(fn, sig, cons, attrs)
    mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
    if inline:
        mod = backend.make_ttir(mod, {}, options, arch)
    return str(mod)


def i32_scalar_products_in_offsets(text: str) -> list[str]:
    """Lines ``%x = arith.muli %a, %b : i32`` (a scalar int32 product of two run-time values, e.g. a batch index times
    a stride) from which the offset operand of some ``tt.addptr`` is computed, following the def-use chain back
    through every operation in between. A product by a compile-time constant (``pid_m * BLOCK_M``: a position within
    one sequence, bounded by its length, which the launcher checks against int32) is not reported."""
    defs = {}
    addptr_offsets = []
    for line in text.splitlines():
        code = line.split(" loc(")[0]
        m = _DEF.match(code)
        if not m:
            continue
        res, op, rest = m.groups()
        operands = _OPERAND.findall(rest)
        defs[res] = (op, operands, code.strip())
        if op == "tt.addptr":
            addptr_offsets.append(operands[1])
    found, seen = [], set()
    stack = list(addptr_offsets)
    while stack:
        v = stack.pop()
        if v in seen or v not in defs:
            continue
        seen.add(v)
        op, operands, code = defs[v]
        if op == "tt.load":  # a loaded value (e.g. the prompt index) is data, not arithmetic on the offset
            continue
        if op == "arith.muli" and code.rstrip().endswith(": i32"):
            if not any(defs.get(o, ("",))[0] == "arith.constant" for o in operands):
                found.append(code)
        stack.extend(operands)
    return sorted(set(found))


def test_ttir_checker_finds_an_int32_batch_offset():
    """The checker itself: a kernel computing ``b * stride`` in int32 is flagged, the int64 version is not."""
    _compiled_kernels_or_skip()
    text = """
    %b = arith.divsi %pid, %hkv : i32 loc(#loc1)
    %off = arith.muli %b, %stride_qb : i32 loc(#loc2)
    %p = tt.addptr %Q, %off : !tt.ptr<bf16>, i32 loc(#loc3)
    %b64 = arith.extsi %b : i32 to i64 loc(#loc4)
    %s64 = arith.extsi %stride_kb : i32 to i64 loc(#loc4)
    %off64 = arith.muli %b64, %s64 : i64 loc(#loc5)
    %pk = tt.addptr %K, %off64 : !tt.ptr<bf16>, i64 loc(#loc3)
    %u = tt.load %pidx : !tt.ptr<i64> loc(#loc6)
    %c64_i32 = arith.constant 64 : i32 loc(#loc7)
    %m0 = arith.muli %pid, %c64_i32 : i32 loc(#loc8)
    %pm = tt.addptr %LSE, %m0 : !tt.ptr<f32>, i32 loc(#loc3)
    """
    assert i32_scalar_products_in_offsets(text) == ["%off = arith.muli %b, %stride_qb : i32"]


OFFSET_CASES = [(n, "one_region", False) for n in kernels.KERNELS]
OFFSET_CASES += [(n, v, False) for n in ("fwd", "bwd_dq") for v in ("last", "partial")]
# windowed builds: the position pointers QPOS + b·C and RPOS + u·S take int64 row offsets too
OFFSET_CASES += [(n, "one_region", True) for n in ("fwd", "bwd_dq", "bwd_dkdv_own", "bwd_dkdv_region")]


@pytest.mark.parametrize(
    "name, variant, sliding_window",
    OFFSET_CASES,
    ids=[f"{n}-{v}{'-window' if w else ''}" for n, v, w in OFFSET_CASES],
)
def test_pointer_offsets_are_int64(name, variant, sliding_window):
    _compiled_kernels_or_skip()
    text = ttir(name, variant=variant, sliding_window=sliding_window)
    assert "tt.addptr" in text
    bad = i32_scalar_products_in_offsets(text)
    assert bad == [], f"{name}: int32 scalar products in pointer offsets:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------------------------------------------
# head dims 80 and 96: two head-dim tiles, no padded MMA work
# ----------------------------------------------------------------------------------------------------------------------

_DOT = re.compile(r"tt\.dot .*?: tensor<(\d+)x(\d+)x\w+> \* tensor<(\d+)x(\d+)x\w+>")


def dot_work(text: str) -> int:
    """Σ M·N·K over the ``tt.dot`` operations of a TTIR text (each static occurrence once)."""
    total = 0
    for m, k, k2, n in (tuple(int(x) for x in g) for g in _DOT.findall(text)):
        assert k == k2, (m, k, k2, n)
        total += m * n * k
    return total


def test_dot_work_counts_each_product():
    text = """
    %s = tt.dot %a, %b, %c : tensor<64x64xbf16> * tensor<64x32xbf16> -> tensor<64x32xf32> loc(#loc1)
    %t = tt.dot %a1, %b1, %s, inputPrecision = ieee : tensor<64x16xbf16> * tensor<16x32xbf16> -> tensor<64x32xf32>
    """
    assert dot_work(text) == 64 * 32 * 64 + 64 * 32 * 16


@pytest.mark.parametrize("head_dim", (80, 96))
@pytest.mark.parametrize("name", ("fwd", "bwd_dq", "bwd_dkdv_own", "bwd_dkdv_region"))
def test_head_dims_80_96_do_no_padded_mma_work(name, head_dim):
    """d=80 and d=96 used to run with one 128-wide head-dim tile (37% and 25% of every product masked padding). The
    launcher now gives them two power-of-two tiles (64 + 16, 64 + 32): the build at the shipped constexprs has no tensor
    128 long in any dimension, and its MMA work (Σ M·N·K over tt.dot, helpers inlined) is exactly d/128 of the same
    kernel built with one 128-wide tile at the same BLOCK_M/BLOCK_N."""
    _compiled_kernels_or_skip()
    cons = launch._tile_constexprs(name, head_dim, torch.bfloat16, interpret=False)
    assert (cons["BLOCK_D0"], cons["BLOCK_D1"]) == (64, head_dim - 64), cons
    text = ttir(name, "bf16", head_dim, inline=True)
    dims = {int(x) for shape in re.findall(r"tensor<((?:\d+x)+)", text) for x in shape.rstrip("x").split("x")}
    assert 128 not in dims, f"{name} d={head_dim}: a 128-long tensor dimension in the build: {sorted(dims)}"
    assert "tt.call" not in text  # every helper inlined, so each product is counted where it runs
    padded = ttir(name, "bf16", head_dim, inline=True, BLOCK_D0=128, BLOCK_D1=0)
    work, padded_work = dot_work(text), dot_work(padded)
    assert work > 0 and work * 128 == padded_work * head_dim, (work, padded_work)

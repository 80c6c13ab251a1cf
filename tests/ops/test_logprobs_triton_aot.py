"""Every Triton kernel of grpo_mem.ops.logprobs_triton compiles ahead of time for sm_80, sm_86 (sm_89 builds as sm_86:
see test_attention_triton_aot.test_sm89_builds_as_sm86) and sm_90 (no GPU needed) as
the build that runs: the launchers are called on meta tensors of a Qwen2.5-7B head shape with kernel recorders in
place of the kernels, and each recorded launch is specialised exactly as Triton's runtime does it
(``native_specialize_impl``: 16-byte aligned pointers and integers divisible by 16 get ``tt.divisibility=16``, an
integer 1 becomes a constant). 0 spills on every architecture, shared memory within its limit per block. Prints
registers / spills / shared memory (-s)."""

import contextlib
import functools
import re
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

import aot  # noqa: E402  (tests/ops/aot.py)
from helpers import FakeKernel  # noqa: E402
from grpo_mem.ops import logprobs as lp_mod  # noqa: E402
from grpo_mem.ops import logprobs_triton as kernels  # noqa: E402
from grpo_mem.ops import logprobs_triton_launch as tri  # noqa: E402
from grpo_mem.ops import logprobs_triton_tiles as tiles  # noqa: E402
from grpo_mem.ops.attention_triton_tiles import SHARED_MEMORY_LIMIT  # noqa: E402

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Qwen2.5-7B's head (H=3584, V=152064) scoring 32767 tokens (N not a multiple of 16: the row masks stay general);
# H100 SXM: 132 SMs (NVIDIA H100 datasheet), which sets the launchers' split counts.
SHAPE = dict(N=32767, H=3584, V=152064)
H100_SMS = 132


@contextlib.contextmanager
def cuda_launchers(on_launch):
    """The head launchers as they run on an H100 (CUDA tile configs, vocabulary chunks and split counts), with every
    kernel replaced by a recorder that calls ``on_launch(name, grid, args, kwargs)`` instead of launching."""

    with contextlib.ExitStack() as stack:
        for name in kernels.KERNELS:
            stack.enter_context(mock.patch.object(kernels, f"_{name}_kernel", FakeKernel(name, on_launch)))
        cuda = torch.device("cuda")
        config, chunk = tri._config, tri._vocab_chunk
        stack.enter_context(mock.patch.object(tri, "_config", lambda device, dt, name: config(cuda, dt, name)))
        stack.enter_context(mock.patch.object(tri, "_vocab_chunk", lambda n, v, h, device: chunk(n, v, h, cuda)))
        stack.enter_context(mock.patch.object(tri, "_num_programs_target", lambda device: 4 * H100_SMS))
        stack.enter_context(mock.patch.object(tri, "_upcast", lambda t: False))
        stack.enter_context(mock.patch.object(tri, "SLS_INTERPRET_CONFIG", tiles.SLS_CUDA_CONFIG))
        yield


def head_inputs(dtype: str, n=SHAPE["N"], h=SHAPE["H"], v=SHAPE["V"]):
    tdt = TORCH_DTYPE[dtype]
    meta = dict(device="meta")
    hidden, weight = torch.empty(n, h, dtype=tdt, **meta), torch.empty(v, h, dtype=tdt, **meta)
    bias, target = torch.empty(v, dtype=tdt, **meta), torch.empty(n, dtype=torch.int64, **meta)
    p = lp_mod.LogprobParams(temperature=0.7, softcap=30.0, return_entropy=True, backend="triton")
    return hidden, weight, bias, target, p


@functools.lru_cache(maxsize=None)
def runtime_launches(dtype: str) -> dict:
    """{kernel name: (args, kwargs)} of one launch of every head kernel as the CUDA launchers make it, recorded with
    meta tensors (no memory, data_ptr 0: aligned like CUDA allocations). Every optional feature on: bias, soft cap,
    entropy, both upstream gradients, d_bias. The backward launches its kernels once per vocabulary chunk; the last
    launch is kept (the d_hidden kernel's accumulating one, with the most work)."""
    launches = {}
    with cuda_launchers(lambda name, grid, args, kwargs: launches.__setitem__(name, (args, kwargs))):
        hidden, weight, bias, target, p = head_inputs(dtype)
        logp, ent, lse = tri.linear_logprobs_fwd(hidden, weight, bias, target, p)
        tri.linear_logprobs_bwd(hidden, weight, bias, target, lse, ent, lse, lse, p, True, True, True, logp)
        logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device="meta")
        logp, ent, lse = tri.selective_log_softmax_fwd(logits, target, p)
        tri.selective_log_softmax_bwd(logits, target, lse, ent, lse, lse, p)
    assert sorted(launches) == sorted(kernels.KERNELS), sorted(launches)
    return launches


def runtime_build(name: str, dtype: str) -> dict:
    """signature, constexprs, attrs and launch options of the recorded launch of ``name``, specialised as Triton's
    runtime does (``JITFunction.run`` -> ``native_specialize_impl`` -> ``BaseBackend.parse_attr``)."""
    fn = kernels.KERNELS[name]
    args, kwargs = runtime_launches(dtype)[name]
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update({k: val for k, val in kwargs.items() if k in names})
    options = {k: val for k, val in kwargs.items() if k not in names}
    sig, cons, attrs = {}, {}, {}
    for i, (param, arg_name) in enumerate(zip(fn.params, names)):
        val = values[arg_name]
        if param.is_constexpr:
            sig[arg_name], cons[arg_name] = "constexpr", val
            continue
        ty, spec = native_specialize_impl(BaseBackend, val, False, True, True)
        if ty == "constexpr":
            sig[arg_name], cons[arg_name] = "constexpr", spec
        else:
            sig[arg_name] = ty
            if spec:
                attrs[(i,)] = BaseBackend.parse_attr(spec)
    return dict(fn=fn, signature=sig, constexprs=cons, attrs=attrs, options=options)


def report(name, dtype, arch):
    b = runtime_build(name, dtype)
    return aot.compile_report(b["fn"], b["signature"], b["constexprs"], arch, attrs=b["attrs"], **b["options"]), b


# bf16 (the training dtype; fp16 ships the same tiles) for every kernel on every architecture; fp32 (3xTF32 dots,
# own block sizes) for the GEMM kernels on every architecture. sm_80: A100 (163 KB of shared memory per block); sm_86:
# A10G, A40, RTX 30 (99 KB; sm_89's L4, L40S, RTX 40 build the same); sm_90: H100, H200 (227 KB).
ARCHS = (80, 86, 90)
CAPABILITY = {80: (8, 0), 86: (8, 6), 90: (9, 0)}
CASES = [(name, "bf16", arch) for arch in ARCHS for name in kernels.KERNELS]
CASES += [(name, "fp32", arch) for arch in ARCHS for name in kernels.KERNELS if name.startswith("linear_logprobs")]


def test_runtime_specialisation():
    """The recorded launches get the divisibility the runtime gives: aligned pointers (chunk slices of the weight
    included), H, the strides, the split and chunk lengths; N = 32767 does not."""
    b = runtime_build("linear_logprobs_fwd", "bf16")
    divisible = {b["fn"].arg_names[i] for (i,) in b["attrs"]}
    assert {"HIDDEN", "WEIGHT", "H", "V", "stride_hn", "stride_wv", "V_PER_SPLIT"} <= divisible, divisible
    b = runtime_build("linear_logprobs_bwd_dh", "bf16")
    divisible = {b["fn"].arg_names[i] for (i,) in b["attrs"]}
    assert {"DLOGITS", "WEIGHT", "DH_ACC", "DH_OUT", "H", "V_CHUNK", "stride_dn", "stride_wv"} <= divisible, divisible
    assert "N" not in divisible and b["signature"]["N"] == "i32"
    assert b["constexprs"]["ACCUMULATE"] is True  # the recorded launch is the last of several chunks


@pytest.mark.parametrize("name, dtype, arch", CASES, ids=[f"{n}-{d}-sm{a}" for n, d, a in CASES])
def test_aot_compiles_without_spills(name, dtype, arch):
    try:
        aot.cuobjdump_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    r, b = report(name, dtype, arch)
    cons = {k: v for k, v in b["constexprs"].items() if k.startswith("BLOCK_")}
    print(
        f"\n| {name} | {dtype} | sm_{arch} | {cons} {b['options']} | regs {r['regs']} | spills {r['spills']} B "
        f"| stack {r['stack']} B | shared {r['shared']} B |"
    )
    assert 0 < r["regs"] <= 255
    limit = SHARED_MEMORY_LIMIT[CAPABILITY[arch]]
    assert r["shared"] <= limit, f"{name} {dtype}: shared memory {r['shared']} B > sm_{arch}'s {limit} B"
    assert r["spills"] == 0 and r["stack"] == 0, f"{name} spills on sm_{arch}: {r}"


@pytest.mark.parametrize("name", list(kernels.KERNELS))
def test_no_i32_pointer_offsets(name):
    """No scalar 32-bit product reaches a pointer offset in any head kernel's TTIR (such an offset,
    e.g. ``split * V_PER_SPLIT`` or ``pid * BLOCK_V`` before a widening, wraps past 2**31 elements on the GPU)."""
    b = runtime_build(name, "bf16")
    bad = aot.i32_pointer_offsets(aot.ttir(b["fn"], b["signature"], b["constexprs"], attrs=b["attrs"]))
    assert not bad, f"{name}: i32 products feeding pointer offsets:\n" + "\n".join(bad)


def stores_in_loops(ttir_text: str) -> list[str]:
    """``tt.store`` lines that sit inside an ``scf.for`` body of a TTIR text (stores once per loop iteration)."""
    depth, loops, found = 0, [], []
    for raw in ttir_text.splitlines():
        line = re.sub(r"\s+loc\(.*$", "", raw).strip()
        if re.search(r"\bscf\.for\b", line):
            loops.append(depth + 1)
        if re.search(r"\btt\.store\b", line) and loops:
            found.append(line)
        depth += line.count("{") - line.count("}")
        while loops and depth < loops[-1]:
            loops.pop()
    return found


BWD_KERNELS = [n for n in kernels.KERNELS if n.startswith("linear_logprobs_bwd")]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", BWD_KERNELS)
def test_backward_stores_each_output_once(name, dtype):
    """No backward kernel round-trips an output (an fp32 d_hidden / d_weight slab) through HBM per
    tile: every tt.store is outside the kernel's loops (the output tile is reduced in registers and stored once), and
    no atomics (deterministic)."""
    b = runtime_build(name, dtype)
    text = aot.ttir(b["fn"], b["signature"], b["constexprs"], attrs=b["attrs"])
    assert re.search(r"\btt\.store\b", text), "kernel stores nothing?"
    assert not stores_in_loops(text), f"{name}: stores inside a loop:\n" + "\n".join(stores_in_loops(text))
    assert "tt.atomic" not in text, f"{name} uses atomics"


def test_stores_in_loops_finds_loop_stores():
    text = """
    %0 = scf.for %i = %a to %b step %c iter_args(%x = %y) -> (f32) : i32 {
      scf.if %p {
        tt.store %ptr, %v : !tt.ptr<f32> loc(#loc1)
      }
      scf.yield %x : f32
    }
    tt.store %ptr2, %w : !tt.ptr<f32>
"""
    assert stores_in_loops(text) == ["tt.store %ptr, %v : !tt.ptr<f32>"]


@pytest.mark.parametrize("dtype, n", [("bf16", SHAPE["N"]), ("fp32", SHAPE["N"]), ("bf16", 131072)])
def test_backward_scratch_memory_and_grid(dtype, n):
    """The backward's own allocations beyond its outputs at Qwen2.5-7B's head (meta tensors, H100 launch sizes): the
    (N, chunk) d_logits buffer no larger than the weight, the fp32 d_hidden accumulator and small d_bias partials;
    no (V, H) fp32 d_weight slab (2.2 GB here, which the old fused kernels allocated). Every backward launch has at
    least 2 programs per H100 SM."""
    from torch.utils._python_dispatch import TorchDispatchMode

    h, v = SHAPE["H"], SHAPE["V"]
    hidden, weight, bias, target, p = head_inputs(dtype, n=n)
    grids = []
    with cuda_launchers(lambda name, grid, args, kwargs: grids.append((name, grid))):
        logp, ent, lse = tri.linear_logprobs_fwd(hidden, weight, bias, target, p)
        created = []

        class Allocations(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.__name__.split(".")[0] in (
                    "empty",
                    "zeros",
                    "empty_like",
                    "zeros_like",
                    "empty_strided",
                    "full",
                    "new_empty",
                    "new_zeros",
                    "clone",
                    "_to_copy",
                ):
                    created.append(out)
                return out

        with Allocations():
            dh, dw, db = tri.linear_logprobs_bwd(
                hidden, weight, bias, target, lse, ent, lse, lse, p, True, True, True, logp
            )
    outputs = {id(x.untyped_storage()) for x in (dh, dw, db)}
    scratch = [x for x in created if id(x.untyped_storage()) not in outputs]
    nbytes = sum(x.untyped_storage().nbytes() for x in scratch)
    big = [tuple(x.shape) for x in scratch if x.dtype == torch.float32 and x.numel() >= v * h]
    assert not big, f"(V, H)-sized fp32 scratch allocated: {big}"
    budget = max(weight.nbytes, n * tiles.CHUNK_V_MIN * weight.element_size()) + n * h * 4 + 64 * 2**20
    assert nbytes <= budget, f"backward scratch {nbytes / 1e9:.2f} GB > {budget / 1e9:.2f} GB: " + str(
        [(tuple(x.shape), x.dtype) for x in scratch]
    )
    small = [
        (name, grid)
        for name, grid in grids
        if name.startswith("linear_logprobs_bwd") and grid[0] * (grid[1] if len(grid) > 1 else 1) < 2 * H100_SMS
    ]
    assert not small, f"launches with fewer than {2 * H100_SMS} programs: {small}"


def test_i32_pointer_offsets_finds_products():
    """The checker follows casts, loop induction variables and loop-carried values; 64-bit products pass."""
    text = """
  tt.func public @k(%X: !tt.ptr<f32>, %N: i32, %S: i32) {
    %pid = tt.get_program_id x : i32 loc(#loc1)
    %lo = arith.muli %pid, %N : i32 loc(#loc2)
    %c1 = arith.constant 1 : i32
    %p0 = scf.for %i = %lo to %N step %c1 iter_args(%acc = %X) -> (!tt.ptr<f32>)  : i32 {
      %p1 = tt.addptr %X, %i : !tt.ptr<f32>, i32 loc(#loc3)
      scf.yield %p1 : !tt.ptr<f32>
    }
    %w = arith.extsi %pid : i32 to i64
    %s64 = arith.extsi %S : i32 to i64
    %ok = arith.muli %w, %s64 : i64
    %p2 = tt.addptr %X, %ok : !tt.ptr<f32>, i64
    %bad = arith.muli %pid, %S : i32
    %bad64 = arith.extsi %bad : i32 to i64
    %c2 = arith.constant 2 : i32
    %q0 = scf.for %j = %c1 to %N step %c1 iter_args(%off = %c1) -> (i32)  : i32 {
      %p3 = tt.addptr %X, %off : !tt.ptr<f32>, i32
      %nxt = arith.addi %off, %bad : i32
      scf.yield %nxt : i32
    }
    %p4 = tt.addptr %X, %bad64 : !tt.ptr<f32>, i64
    tt.return
  }
"""
    found = aot.i32_pointer_offsets(text)
    assert len(found) == 3, found
    assert sum("%lo = arith.muli" in f for f in found) == 1 and sum("%bad = arith.muli" in f for f in found) == 2
    assert not any("%ok" in f.split(" -> ")[0] for f in found)


_LAYOUT_OP = re.compile(r"tt\.(load|store) (%[\w.$-]+).*:\s*tensor<[^,]*!tt\.ptr<[^>]*>, (#[\w.]+)>")


def reused_across_layouts(ttgir_text: str) -> list[tuple[str, str, str]]:
    """(pointer, load layout, store layout) for every pointer tensor that a kernel both loads and stores in different
    distributed layouts: an element stored by one thread is later loaded by another, so the store must be made
    visible (a CTA barrier) before the next load of it."""
    loads, stores = {}, {}
    for line in ttgir_text.splitlines():
        m = _LAYOUT_OP.search(re.sub(r" loc\(.*$", "", line))
        if m:
            # Triton names SSA values after the Python variable and rematerialises the pointer tensor once per
            # layout (%ptrs_204 for the load, %ptrs_205 for the store): match on the variable name
            stem = re.sub(r"_\d+$", "", m.group(2))
            (loads if m.group(1) == "load" else stores)[stem] = m.group(3)
    return [(p, loads[p], stores[p]) for p in sorted(loads) if p in stores and loads[p] != stores[p]]


@pytest.mark.parametrize(
    "name, dtype, arch",
    [c for c in CASES if "_bwd_d" in c[0]],
    ids=[f"{n}-{d}-sm{a}" for n, d, a in CASES if "_bwd_d" in n],
)
def test_slab_reuse_is_ordered_by_a_barrier(name, dtype, arch):
    """Memory a backward kernel both loads and stores (the old fused kernels' per-tile fp32 slabs; now the fp32
    d_hidden accumulator, loaded as DH_ACC and stored as DH_OUT, the same tensor between chunks): when the build loads
    it in one layout and stores it in another, an element may be stored by another thread than the one that loaded
    it, so the store must wait for the CTA's loads: a barrier (ttg.barrier in the TTGIR, from tl.debug_barrier)
    between them."""
    from triton.backends.compiler import GPUTarget

    b = runtime_build(name, dtype)
    src = triton.compiler.ASTSource(b["fn"], b["signature"], b["constexprs"], b["attrs"])
    ttgir = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=b["options"]).asm["ttgir"]
    mismatched = reused_across_layouts(ttgir)
    has_barrier = re.search(r"\b(gpu|ttg)\.barrier\b", ttgir) is not None
    assert has_barrier or not mismatched, f"{name}: slab loaded/stored in different layouts {mismatched}, no barrier"


def test_parse_resource_usage():
    text = """
Resource usage:
 Common:
  GLOBAL:0
 Function _k:
  REG:53 STACK:8 SHARED:1024 LOCAL:16 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    assert aot.parse_resource_usage(text) == dict(regs=53, stack=8, static_shared=1024, local=16)
    with pytest.raises(ValueError, match="_other"):
        aot.parse_resource_usage(text, "_other")
    with pytest.raises(ValueError, match="no type"):
        aot.signature_for(kernels.KERNELS["selective_log_softmax_fwd"], {}, {})

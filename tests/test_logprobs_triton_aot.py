"""Every Triton kernel of grpo_mem.ops.logprobs_triton compiles ahead of time for sm_80 and sm_90 (no GPU needed) at
its shipped block sizes, with 0 spills on sm_90. Prints registers / spills / shared memory per kernel (run with -s)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from grpo_mem.ops import aot  # noqa: E402
from grpo_mem.ops import logprobs_triton as tri  # noqa: E402

# runtime argument types per kernel; pointers get the input dtype where they carry hidden/weight/logits
POINTERS_IN = {"HIDDEN", "WEIGHT", "BIAS", "LOGITS", "DLOGITS"}
INT_ARGS = {"N", "V", "H", "stride_hn", "stride_wv", "stride_n", "V_PER_SPLIT", "N_PER_SPLIT"}
FLOAT_ARGS = {"scale", "softcap", "inv_t"}


def kernel_types(fn, dtype: str) -> dict:
    types = {}
    for name in fn.arg_names:
        if name in POINTERS_IN:
            types[name] = f"*{dtype}"
        elif name == "TARGET":
            types[name] = "*i64"
        elif name in INT_ARGS:
            types[name] = "i32"
        elif name in FLOAT_ARGS:
            types[name] = "fp32"
        elif name.isupper() and not name.startswith(("HAS_", "BLOCK_")) and name not in ("PRECISION", "UPCAST"):
            types[name] = "*fp32"  # statistics, gradients slabs
    return types


TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def kernel_constexprs(name: str, fn, dtype: str) -> dict:
    cfg = tri.SHIPPED_CONFIGS[(name, TORCH_DTYPE[dtype])]
    cons = {k: v for k, v in cfg.items() if k.startswith("BLOCK_")}
    for arg in fn.arg_names:
        if arg.startswith("HAS_"):
            cons[arg] = True  # every optional feature on: the register-heaviest variant
    if "PRECISION" in fn.arg_names:
        cons["PRECISION"] = tri._precision(TORCH_DTYPE[dtype])
    if "UPCAST" in fn.arg_names:
        cons["UPCAST"] = False
    return cons


def report(name, dtype, arch):
    fn = tri.KERNELS[name]
    cons = kernel_constexprs(name, fn, dtype)
    sig = aot.signature_for(fn, kernel_types(fn, dtype), cons)
    cfg = tri.SHIPPED_CONFIGS[(name, TORCH_DTYPE[dtype])]
    return aot.compile_report(fn, sig, cons, arch, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


# bf16 (the training dtype) for every kernel on both architectures; fp32 (3xTF32 dots, own block sizes) for the GEMM
# kernels on both
CASES = [(name, "bf16", arch) for arch in (80, 90) for name in tri.KERNELS]
CASES += [(name, "fp32", arch) for arch in (80, 90) for name in tri.KERNELS if name.startswith("linear_logprobs")]


@pytest.mark.parametrize("name, dtype, arch", CASES, ids=[f"{n}-{d}-sm{a}" for n, d, a in CASES])
def test_aot_compiles_without_spills(name, dtype, arch):
    try:
        aot.cuobjdump_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    r = report(name, dtype, arch)
    cfg = tri.SHIPPED_CONFIGS[(name, TORCH_DTYPE[dtype])]
    print(f"\n| {name} | {dtype} | sm_{arch} | {cfg} | regs {r['regs']} | spills {r['spills']} B | stack {r['stack']} B "
          f"| shared {r['shared']} B |")
    assert 0 < r["regs"] <= 255
    assert r["shared"] <= (227 if arch == 90 else 163) * 1024, f"shared memory {r['shared']} B exceeds sm_{arch}"
    if arch == 90:
        assert r["spills"] == 0 and r["stack"] == 0, f"{name} spills on sm_90: {r}"


@pytest.mark.parametrize("name", list(tri.KERNELS))
def test_no_i32_pointer_offsets(name):
    """No scalar 32-bit product reaches a pointer offset in any head kernel's TTIR (issue 8 item 3: such an offset,
    e.g. ``split * V_PER_SPLIT`` or ``pid * BLOCK_V`` before a widening, wraps past 2**31 elements on the GPU)."""
    fn = tri.KERNELS[name]
    cons = kernel_constexprs(name, fn, "bf16")
    sig = aot.signature_for(fn, kernel_types(fn, "bf16"), cons)
    bad = aot.i32_pointer_offsets(aot.ttir(fn, sig, cons))
    assert not bad, f"{name}: i32 products feeding pointer offsets:\n" + "\n".join(bad)


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
        aot.signature_for(tri.KERNELS["selective_log_softmax_fwd"], {}, {})

"""The shared-prefix attention kernels compile ahead of time for sm_80 and sm_90 (no GPU needed) at their shipped block
sizes, for head dims 64 and 128, with 0 spills on sm_90. Prints registers / spills / shared memory per build (-s)."""


import pytest
import torch

triton = pytest.importorskip("triton")

from grpo_mem.ops import aot  # noqa: E402
from grpo_mem.ops import attention_triton as spa  # noqa: E402

POINTERS_IN = {"Q", "K", "V", "PK", "PV", "OUT", "DO", "DQ", "DK", "DV", "DPK", "DPV"}
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REP = 4  # GQA ratio of the builds (the query-head loop bound is a constexpr)


def kernel_types(fn, dtype: str) -> dict:
    types = {}
    for name in fn.arg_names:
        if name in POINTERS_IN:
            types[name] = f"*{dtype}"
        elif name in ("LSE", "DELTA"):
            types[name] = "*fp32"
        elif name == "PIDX":
            types[name] = "*i64"
        elif name in ("PSTART", "ROWS", "ROW_START"):
            types[name] = "*i32"
        elif name in ("PMASK", "KMASK"):
            types[name] = "*i8"
        elif name == "SCALE":
            types[name] = "fp32"
        elif name.startswith("stride_") or name in ("C", "P", "HKV"):
            types[name] = "i32"
    return types


def kernel_constexprs(name: str, fn, dtype: str, head_dim: int) -> dict:
    cfg = spa.block_config(name, head_dim, TORCH_DTYPE[dtype])
    cons = dict(REP=REP, HEAD_DIM=head_dim, BLOCK_D=spa._block_d(head_dim), BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"], EMULATE_BF16=False)
    if "HAS_KMASK" in fn.arg_names:
        cons["HAS_KMASK"] = True  # the register-heavier variant
    return cons


def divisibility_attrs(fn, sig: dict) -> dict:
    """The specialisation Triton's launcher makes at run time for torch allocations and head dims 64/128: pointers
    16-byte aligned and every stride a multiple of 16 (``tt.divisibility``). Without it the build is not the one that
    runs (loads cannot be vectorised) and its register count is meaningless."""
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
            if sig[n].startswith("*") or n.startswith("stride_")}


def compile_with_attrs(fn, sig, cons, attrs, arch, num_warps, num_stages) -> dict:
    """aot.compile_report with the argument attributes the launcher's run-time build gets."""
    return aot.compile_report(fn, sig, cons, arch, num_warps=num_warps, num_stages=num_stages, attrs=attrs)


def report(name, dtype, arch, head_dim):
    fn = spa.KERNELS[name]
    cons = kernel_constexprs(name, fn, dtype, head_dim)
    sig = aot.signature_for(fn, kernel_types(fn, dtype), cons)
    cfg = spa.block_config(name, head_dim, TORCH_DTYPE[dtype])
    r = compile_with_attrs(fn, sig, cons, divisibility_attrs(fn, sig), arch, cfg["num_warps"], cfg["num_stages"])
    return r, cfg


# bf16 (the training dtype; fp16 ships the same tiles) on both architectures; fp32 (exact "ieee" dots, own tiles) on
# sm_90. Head dims 64 and 128.
CASES = [(n, "bf16", a, d) for a in (80, 90) for d in (64, 128) for n in spa.KERNELS]
CASES += [(n, "fp32", 90, d) for d in (64, 128) for n in spa.KERNELS]


@pytest.mark.parametrize("name, dtype, arch, head_dim", CASES, ids=[f"{n}-{t}-sm{a}-d{d}" for n, t, a, d in CASES])
def test_aot_compiles_without_spills(name, dtype, arch, head_dim):
    if not isinstance(spa.KERNELS[name], triton.runtime.jit.JITFunction):
        pytest.skip("TRITON_INTERPRET=1 was set when triton was imported: kernels are interpreted, not compiled")
    try:
        aot.cuobjdump_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    r, cfg = report(name, dtype, arch, head_dim)
    print(f"\n| {name} | {dtype} | sm_{arch} | d={head_dim} | BLOCK_M={cfg['BLOCK_M']} BLOCK_N={cfg['BLOCK_N']} "
          f"warps={cfg['num_warps']} stages={cfg['num_stages']} | regs {r['regs']} | spills {r['spills']} B "
          f"| stack {r['stack']} B | shared {r['shared']} B |")
    assert 0 < r["regs"] <= 255
    assert r["shared"] <= (227 if arch == 90 else 163) * 1024, f"shared memory {r['shared']} B exceeds sm_{arch}"
    if arch == 90 or dtype == "bf16":
        assert r["spills"] == 0 and r["stack"] == 0, f"{name} d={head_dim} {dtype} spills on sm_{arch}: {r}"

"""Ahead-of-time compile a Triton kernel for an NVIDIA architecture without a GPU, and read its resource usage.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))`` builds PTX and a cubin on
any machine; the register count and spills (local memory) are then read from the cubin with the ``cuobjdump`` that
Triton ships (``triton/backends/nvidia/bin``), since ``n_regs`` / ``n_spills`` need a GPU to load the kernel.
Used by the kernel tests to show that the shipped block sizes compile for sm_80 / sm_90 and do not spill.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

__all__ = ["compile_report", "count_spill_stores", "cuobjdump_path", "parse_resource_usage", "signature_for"]

_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def cuobjdump_path() -> str:
    """Path of the ``cuobjdump`` bundled with Triton's NVIDIA backend; FileNotFoundError if it is not there."""
    import triton.backends.nvidia as nvidia

    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"cuobjdump not found at {path}")
    return path


def parse_resource_usage(text: str, kernel_name: str | None = None) -> dict:
    """Parse ``cuobjdump --dump-resource-usage`` output: dict(regs=, stack=, static_shared=, local=) for the function
    ``kernel_name`` (or the only function). Raises ValueError if no (or an ambiguous) function line is found."""
    entries = {}
    current = None
    for line in text.splitlines():
        m_fn = re.search(r"Function ([\w$.]+):", line)
        if m_fn:
            current = m_fn.group(1)
            continue
        m_use = _USAGE.search(line)
        if m_use and current is not None:
            regs, stack, shared, local = (int(x) for x in m_use.groups())
            entries[current] = dict(regs=regs, stack=stack, static_shared=shared, local=local)
    if kernel_name is not None:
        if kernel_name not in entries:
            raise ValueError(f"no resource usage for {kernel_name!r} in cuobjdump output: {sorted(entries)}")
        return entries[kernel_name]
    if len(entries) != 1:
        raise ValueError(f"expected one function in cuobjdump output, found {sorted(entries)}")
    return next(iter(entries.values()))


def count_spill_stores(sass: str) -> int:
    """Number of ``STL`` (store to thread-local memory) instructions in ``cuobjdump -sass`` output: register spills
    (and local arrays, which Triton kernels do not use)."""
    return len(re.findall(r"\bSTL(?:\.\w+)*\s", sass))


def signature_for(fn, types: dict, constexprs: dict) -> dict:
    """Triton signature dict in argument order: ``types[name]`` (e.g. "*bf16", "i32", "fp32") for runtime arguments,
    "constexpr" for names in ``constexprs``. Raises ValueError naming any argument left without a type."""
    names = fn.arg_names
    missing = [n for n in names if n not in types and n not in constexprs]
    if missing:
        raise ValueError(f"no type given for arguments {missing} of {fn.__name__}")
    unknown = sorted(n for n in set(types) | set(constexprs) if n not in names)
    if unknown:
        raise ValueError(f"{fn.__name__} has no arguments {unknown}")
    return {n: ("constexpr" if n in constexprs else types[n]) for n in names}


def compile_report(
    fn, signature: dict, constexprs: dict, arch: int, *, num_warps: int = 4, num_stages: int = 3, attrs=None
) -> dict:
    """AOT-compile ``fn`` (a ``triton.jit`` function) for ``sm_<arch>`` and report its resources.

    Args:
        fn: the JITFunction.
        signature: {argument name: Triton type string or "constexpr"} for every argument (see ``signature_for``).
        constexprs: {name: value} for the constexpr arguments.
        attrs: Triton's argument attributes (e.g. 16-byte alignment hints it adds at run time), passed to
            ``ASTSource`` so the build matches the one that runs; None for none.
        arch: compute capability as an int, e.g. 80 or 90.
        num_warps, num_stages: launch options the kernel ships with.

    Returns:
        dict(regs=registers per thread, spills=bytes of local memory per thread (spill stores land there; 0 means no
        spills), stack=stack bytes, local=local bytes, shared=dynamic shared memory bytes Triton allocates,
        static_shared=static shared bytes in the cubin, spill_stores=number of local-memory stores (``STL``) in the
        SASS, arch=arch, num_warps=, num_stages=). A register spill shows as ``STL`` instructions (and usually as
        stack bytes); stack bytes without any ``STL`` are a call frame (e.g. the IEEE fp32 division slow path), not a
        spill.

    Raises:
        ValueError: bad ``arch``; triton's CompilationError if the kernel does not compile.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    if not isinstance(arch, int) or arch < 70:
        raise ValueError(f"arch must be an int compute capability >= 70, got {arch!r}")
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{fn.__name__}.sm{arch}.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([cuobjdump_path(), "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([cuobjdump_path(), "-sass", path], capture_output=True, text=True, check=True).stdout
    usage = parse_resource_usage(out, compiled.metadata.name)
    return dict(
        regs=usage["regs"],
        spills=usage["local"],
        stack=usage["stack"],
        local=usage["local"],
        shared=int(compiled.metadata.shared),
        static_shared=usage["static_shared"],
        spill_stores=count_spill_stores(sass),
        arch=arch,
        num_warps=num_warps,
        num_stages=num_stages,
    )

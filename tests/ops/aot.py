"""Ahead-of-time compile a Triton kernel for an NVIDIA architecture without a GPU, and read its resource usage.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))`` builds PTX and a cubin on
any machine; the register count and spills (local memory) are then read from the cubin with the ``cuobjdump`` that
Triton ships (``triton/backends/nvidia/bin``), since ``n_regs`` / ``n_spills`` need a GPU to load the kernel.
Test-only tooling: used by the AOT kernel tests (tests/ops/test_*_aot.py) to show that the shipped block sizes compile
for sm_80, sm_86/89 and sm_90 within each one's shared memory and do not spill.

A build's report depends only on the kernel sources, the Triton release (which bundles ptxas and cuobjdump) and the
build's arguments, and compiling the whole matrix takes minutes on 2 cores, so ``compile_report`` keeps what it
found in ``RECORD`` (a JSON file beside this module), keyed by those: a build whose key is recorded is not compiled
again, anything else is. The record is written only by ``GRPO_MEM_AOT_RECORD=1 python -m pytest -p no:xdist
tests/ops/test_attention_triton_aot.py tests/ops/test_logprobs_triton_aot.py`` (one process), which compiles every
build afresh; a change to any kernel source or another Triton release invalidates the whole record, so a stale one
costs time, never a check.

``ttir`` gives a kernel's Triton IR after inlining (no GPU either) and ``i32_pointer_offsets`` finds the 32-bit scalar
products that reach a pointer offset in it: an offset such as ``b * stride_b`` computed in i32 wraps once it passes
2**31 elements, silently, on the GPU only.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import json
import os
import re
import subprocess
import tempfile

__all__ = [
    "compile_report",
    "count_spill_stores",
    "cuobjdump_path",
    "i32_pointer_offsets",
    "parse_resource_usage",
    "signature_for",
    "ttir",
]

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


RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aot_record.json")
"""The recorded reports of ``compile_report`` (see the module docstring)."""
RECORD_ENV = "GRPO_MEM_AOT_RECORD"
_KERNEL_SOURCES = ("grpo_mem/ops/*triton*.py",)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sources_key() -> str:
    """Hash of what every build depends on besides its arguments: the Triton release and the kernel sources (the
    kernels, their tiles and launchers: ``_KERNEL_SOURCES``) and this module."""
    import triton

    h = hashlib.sha256(triton.__version__.encode())
    files = sorted(f for pattern in _KERNEL_SOURCES for f in glob.glob(os.path.join(_ROOT, pattern)))
    for path in [*files, os.path.abspath(__file__)]:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + f.read())
    return h.hexdigest()


class _Record:
    """``RECORD`` loaded once: reports by build key, valid only for the current ``_sources_key``; in record mode
    (``RECORD_ENV=1``) every build is compiled and the file rewritten at exit."""

    def __init__(self):
        self.recording = os.environ.get(RECORD_ENV) == "1"
        if self.recording and os.environ.get("PYTEST_XDIST_WORKER"):
            raise RuntimeError(f"{RECORD_ENV}=1 writes {RECORD} from one process: run pytest with -p no:xdist")
        self.sources = _sources_key()
        self.builds: dict = {}
        if not self.recording and os.path.exists(RECORD):
            with open(RECORD) as f:
                data = json.load(f)
            if data.get("sources") == self.sources:
                self.builds = data["builds"]
        elif self.recording:
            atexit.register(self.write)

    def write(self) -> None:
        """The record as JSON, one build a line."""
        lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(self.builds.items())]
        with open(RECORD, "w") as f:
            f.write(f'{{"sources": {json.dumps(self.sources)}, "builds": {{\n' + ",\n".join(lines) + "\n}}\n")


_RECORD: _Record | None = None


def _record() -> _Record:
    global _RECORD
    if _RECORD is None:
        _RECORD = _Record()
    return _RECORD


def build_key(fn, signature: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int, attrs) -> str:
    """The key of one build in ``RECORD``: the kernel's name and every argument of the build."""
    spec = (fn.__module__, fn.__name__, sorted(signature.items()), sorted(constexprs.items()), attrs, arch)
    return hashlib.sha256(repr((*spec, num_warps, num_stages)).encode()).hexdigest()[:24]


def compile_report(
    fn,
    signature: dict,
    constexprs: dict,
    arch: int,
    *,
    num_warps: int = 4,
    num_stages: int = 3,
    attrs=None,
    asm: bool = False,
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
        asm: also return the build's TTGIR and PTX text (keys ``ttgir``, ``ptx``).

    Returns:
        dict(regs=registers per thread, spills=bytes of local memory per thread (spill stores land there; 0 means no
        spills), stack=stack bytes, local=local bytes, shared=dynamic shared memory bytes Triton allocates,
        static_shared=static shared bytes in the cubin, spill_stores=number of local-memory stores (``STL``) in the
        SASS, arch=arch, num_warps=, num_stages=). A register spill shows as ``STL`` instructions (and usually as
        stack bytes); stack bytes without any ``STL`` are a call frame (e.g. the IEEE fp32 division slow path), not a
        spill.

    A build recorded in ``RECORD`` for the current sources gives its recorded report without compiling (not with
    ``asm``, whose text is not recorded).

    Raises:
        ValueError: bad ``arch``; triton's CompilationError if the kernel does not compile.
    """
    if not isinstance(arch, int) or arch < 70:
        raise ValueError(f"arch must be an int compute capability >= 70, got {arch!r}")
    record = _record()
    key = build_key(fn, signature, constexprs, arch, num_warps, num_stages, attrs)
    if not asm and key in record.builds:
        return dict(record.builds[key])
    report = _compile(fn, signature, constexprs, arch, num_warps, num_stages, attrs, asm)
    if record.recording:
        record.builds[key] = {k: v for k, v in report.items() if k not in ("ttgir", "ptx")}
    return report


def _compile(fn, signature, constexprs, arch, num_warps, num_stages, attrs, asm) -> dict:
    """``compile_report``'s build (no record involved)."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{fn.__name__}.sm{arch}.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run(
            [cuobjdump_path(), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
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
        **({"ttgir": compiled.asm["ttgir"], "ptx": compiled.asm["ptx"]} if asm else {}),
    )


def ttir(fn, signature: dict, constexprs: dict, *, attrs=None, arch: int = 90, num_warps: int = 4) -> str:
    """Triton IR (TTIR) text of ``fn`` for ``sm_<arch>`` after Triton's TTIR passes (helpers inlined, canonicalised),
    built without a GPU: ``ASTSource(fn, signature, constexprs, attrs).make_ir(...)`` then the backend's "ttir" stage.
    Arguments as in :func:`compile_report`. Raises triton's CompilationError if the kernel does not build."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    options = backend.parse_options(dict(num_warps=num_warps))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
    )
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    return str(stages["ttir"](module, {}))


_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)$")
_VALUE = re.compile(r"%[\w.$-]+")
_FOR = re.compile(
    r"scf\.for\s+(%[\w.$-]+)\s*=\s*(%[\w.$-]+)\s+to\s+(%[\w.$-]+)\s+step\s+(%[\w.$-]+)"
    r"(?:\s+iter_args\((.*?)\))?"
)
_LOC = re.compile(r"\s+loc\(.*$")
# ops whose operands are not offsets of their result (a loaded value, a comparison, a constant, a pointer)
_LEAF_OPS = {
    "tt.load",
    "arith.cmpi",
    "arith.constant",
    "tt.make_range",
    "tt.get_program_id",
    "tt.addptr",
    "tt.get_num_programs",
}


def _result_type(rest: str) -> str:
    rest = _LOC.sub("", rest)
    return rest.rsplit(" : ", 1)[-1].strip() if " : " in rest else ""


def i32_pointer_offsets(ttir_text: str) -> list[str]:
    """Scalar 32-bit products that feed a pointer offset in ``ttir_text`` (the text of :func:`ttir`).

    For every ``tt.addptr`` the offset operand is traced back through its definitions (integer arithmetic, casts,
    splat/broadcast/expand_dims, select values, ``scf.for`` induction variables and loop-carried values), stopping at
    loads, comparisons, constants, ranges and program ids. Every ``arith.muli`` with the scalar result type ``i32``
    found on the way is reported: that product wraps past 2**31 before any later widening to i64 (e.g.
    ``b * stride_b``). Products of tensors (in-block ``arange * stride`` offsets) are not reported.

    Returns:
        sorted unique strings ``"<muli line> -> <addptr line>"`` (locations stripped, first addptr reached); empty
        when every scalar product on a pointer offset is 64-bit.
    """
    defs: dict[str, tuple[str, list[str], str, str]] = {}  # name -> (op, operand names, result type, line)
    addptrs: list[tuple[str, str]] = []
    loops: list[tuple[int, list[str]]] = []  # (brace depth of the body, iter_arg names) of open scf.for
    depth = 0
    for raw in ttir_text.splitlines():
        line = _LOC.sub("", raw).strip()
        m_for = _FOR.search(line)
        if m_for:
            iv, lb = m_for.group(1), m_for.group(2)
            defs[iv] = ("scf.for.iv", [lb], "", line)
            carried = []
            for pair in (m_for.group(5) or "").split(","):
                if "=" in pair:
                    arg, init = (x.strip() for x in pair.split("=", 1))
                    defs[arg] = ("scf.for.iter_arg", [init], "", line)
                    carried.append(arg)
            loops.append((depth + line.count("{") - line.count("}"), carried))
        elif line.startswith("scf.yield") and loops and loops[-1][0] == depth:
            for arg, val in zip(loops[-1][1], _VALUE.findall(line.split(" : ")[0])):
                defs[arg][1].append(val)
        m_def = _DEF.match(line)
        if m_def and not m_for:
            name, op, rest = m_def.groups()
            operands = _VALUE.findall(rest.split(" : ")[0])
            if op == "arith.select":
                operands = operands[1:]
            defs[name] = (op, operands, _result_type(rest), line)
            if op == "tt.addptr" and len(operands) == 2:
                addptrs.append((operands[1], line))
        depth += line.count("{") - line.count("}")
        while loops and depth < loops[-1][0]:
            loops.pop()
    found = set()
    for offset, ptr_line in addptrs:
        stack, seen = [offset.split("#")[0]], set()
        while stack:
            v = stack.pop()
            if v in seen or v not in defs:
                continue
            seen.add(v)
            op, operands, rtype, line = defs[v]
            if op == "arith.muli" and rtype == "i32":
                found.add(f"{line} -> {ptr_line}")
            if op not in _LEAF_OPS:
                stack.extend(x.split("#")[0] for x in operands)
    return sorted(found)

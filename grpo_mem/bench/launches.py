"""Counts of what a call asks of the device, on any device: the ATen ops that launch a kernel and the reads of device
data by the host, each read with the source line that made it; and the scoring step they are counted on (stock TRL's
own method, grpo_mem's group and tree sharing), shared by ``benchmarks/bench_launches.py`` (the CPU proxy of launch
cost) and the ``perf`` phase of ``benchmarks/gpu_check.py``.

Launches (:func:`op_kind`): every op that reaches the dispatcher below autograd (a ``TorchDispatchMode`` sees it once,
with the ops of the backward) and is none of: a view or other metadata-only op (the schema's ``is_view``, or one of
:data:`VIEW_OPS`), an allocation without a kernel (:data:`ALLOC_OPS`) or a scalar read (``_local_scalar_dense``: a
copy to the host, counted as a read). On CUDA each such op is one kernel launch or more (a GEMM with its epilogue, a
reduction in two passes), so the count is a lower bound of the launches and a proxy of their cost on any device.

Host reads (:func:`host_read`): ops whose result the host must wait for on CUDA: ``_local_scalar_dense`` (``item``,
``int``, ``float``, ``bool`` of a tensor), ops tagged ``data_dependent_output``, and ops whose output shape depends on
data (tag ``dynamic_output_shape``: ``nonzero``, ``masked_select``, the ``unique`` family, ``bincount``, ...), with
the exceptions that do not read (``index.Tensor`` with integer indices, ``repeat_interleave`` given ``output_size``,
``one_hot`` given ``num_classes``), plus ``index_put_`` with a bool mask; and the Python-level ``Tensor.tolist``,
``Tensor.numpy`` and ``Tensor.item``, patched on ``torch.Tensor`` during the count (``tolist`` of a CPU tensor never
reaches the dispatcher). Each read is attributed to the innermost frame inside ``grpo_mem/``, ``trl/`` or
``transformers/`` (this module excepted), else to the innermost frame outside torch; reads made inside the CPU-only
kernels (:func:`backend_files`), which a GPU never runs, are marked.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEW_OPS = frozenset(
    {"_unsafe_view", "_reshape_alias", "alias", "lift_fresh", "_conj", "_neg_view", "view_as_real", "view_as_complex"}
)
"""Metadata-only ops whose schema does not mark them as views (``_unsafe_view`` returns a "new" tensor on paper)."""

ALLOC_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_"})
"""Allocations and storage metadata: no kernel runs (the CUDA caching allocator answers most of them)."""

SCALAR_READ = "_local_scalar_dense"

PROJECT_ROOTS = ("grpo_mem", "trl", "transformers")
"""A host read is attributed to the innermost frame under a folder of one of these names."""

PATCHED_METHODS = ("tolist", "numpy", "item")
"""``torch.Tensor`` methods that read device data into Python objects, patched during a count."""

_THIS = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def op_kind(func, args=(), kwargs=None) -> str:
    """What dispatching ``func`` costs: ``"view"`` (metadata only), ``"alloc"`` (memory without a kernel), ``"read"``
    (a scalar copied to the host) or ``"launch"`` (a kernel)."""
    name = func.overloadpacket.__name__
    if name == SCALAR_READ:
        return "read"
    if name in ALLOC_OPS:
        return "alloc"
    if getattr(func, "is_view", False) or name in VIEW_OPS:
        return "view"
    return "launch"


@functools.lru_cache(maxsize=None)
def launches_kernel(name: str) -> bool:
    """Whether a profiler event of the op ``name`` (``"aten::mm"``, ``"grpo_mem::linear_logprobs_fwd"``; the profiler
    does not say which overload) is kernel time: an op of another namespace, or an ATen op one of whose overloads
    (``out=`` variants aside) :func:`op_kind` calls a launch and has a kernel of its own (a composite such as
    ``aten::linear`` or ``aten::to`` only calls other ops)."""
    namespace, _, op = name.partition("::")
    if namespace != "aten":
        return True
    packet = getattr(torch.ops.aten, op, None)
    for overload in packet.overloads() if packet is not None else ():
        func = getattr(packet, overload)
        if "out" in overload or op_kind(func) != "launch":
            continue
        try:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
                return True
        except RuntimeError:  # a TorchScript-only overload (aten::to.prim_Device)
            continue
    return False


def _has_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def host_read(func, args=(), kwargs=None) -> str | None:
    """The op's name when dispatching ``func`` on ``args`` makes the host wait for the device on CUDA (see the module
    docstring), else None."""
    name = func.overloadpacket.__name__
    kwargs = kwargs or {}
    if name == "index" or name in ("index_put", "index_put_", "_index_put_impl_"):
        return f"{name} (bool mask)" if len(args) > 1 and _has_bool_index(args[1]) else None
    tags = func.tags
    if torch.Tag.data_dependent_output not in tags and torch.Tag.dynamic_output_shape not in tags:
        return None
    if name == "repeat_interleave" and (kwargs.get("output_size") is not None or len(args) > 3):
        return None
    if name == "one_hot" and kwargs.get("num_classes", args[1] if len(args) > 1 else -1) != -1:
        return None
    return name


def source_of(frame) -> tuple[str, bool]:
    """``("path:line (function)", under_cpu_kernel)`` of the frame a read is attributed to (see the module docstring),
    walking out from ``frame``. ``under_cpu_kernel``: the outermost frame in a backend's module (the backend that the
    op's dispatch called) is a CPU-only backend's (:func:`backend_files`); a helper of such a module called by another
    backend (the torch attention backend's ``attention_cpu.entry_groups``) counts as that backend's."""
    fallback, chosen, backend = None, None, None
    modules = backend_files()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        rel = _project_path(path)
        if rel is not None:
            chosen = chosen or f"{rel}:{frame.f_lineno} ({frame.f_code.co_name})"
            backend = rel if rel in modules else backend
        elif fallback is None and path != _THIS and not path.startswith(_TORCH_DIR):
            fallback = f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return chosen or fallback or "<unknown>", bool(backend and modules[backend])


@functools.lru_cache(maxsize=None)
def backend_files() -> dict[str, bool]:
    """``grpo_mem/ops/<module>.py`` -> whether it is CPU-only, for each module holding a backend's halves in
    ``grpo_mem.ops._backends.TABLE``; CPU-only: every backend there refuses CUDA tensors (today
    ``attention_cpu.py``, ATen's fused CPU attention, and ``logprobs_cpp.py``, the C++ head of ``grpo_mem._C``).
    Reads made under them are counted apart: a GPU never runs them."""
    from grpo_mem.ops import _backends

    files: dict[str, bool] = {}
    cuda = torch.device("cuda")
    for entries in _backends.TABLE.values():
        for entry in entries:
            cpu_only = bool(entry.why_not(cuda))
            for fn in (entry.forward, entry.backward):
                module = getattr(fn, "target", (None,))[0]
                name = (f"grpo_mem.ops.{module}" if module else fn.__module__).replace(".", "/") + ".py"
                files[name] = files.get(name, True) and cpu_only
    return files


def _project_path(path: str) -> str | None:
    """``path`` from its project folder on (``grpo_mem/model/window.py``), or None outside :data:`PROJECT_ROOTS` and
    for this module."""
    if path == _THIS:
        return None
    parts = path.split(os.sep)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in PROJECT_ROOTS:
            return "/".join(parts[i:])
    return None


@dataclass
class Counts:
    """What one counted call did: ``launches`` (op name -> launching ops), ``views``, ``allocs`` (numbers of the ops
    left out) and ``reads``: one ``(what, source, under_cpu_kernel)`` per host read, in call order."""

    launches: Counter = field(default_factory=Counter)
    views: int = 0
    allocs: int = 0
    reads: list = field(default_factory=list)

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    def host_reads(self, outside_cpu_kernels: bool = False) -> int:
        """Host reads of the call; with ``outside_cpu_kernels``, those not made under a CPU-only kernel."""
        return sum(1 for _, _, in_kernel in self.reads if not (outside_cpu_kernels and in_kernel))

    def read_sources(self, outside_cpu_kernels: bool = False) -> Counter:
        """``(what, source) -> count`` of the host reads (see :meth:`host_reads`)."""
        return Counter((w, s) for w, s, k in self.reads if not (outside_cpu_kernels and k))


class LaunchCounter(TorchDispatchMode):
    """Fills a :class:`Counts` with every op dispatched while it is active (see the module docstring). ``quiet`` > 0
    while a patched Tensor method runs: its own ops are that one read."""

    def __init__(self, counts: Counts):
        super().__init__()
        self.counts, self.quiet = counts, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.quiet:
            kind = op_kind(func, args, kwargs)
            if kind == "launch":
                self.counts.launches[func.overloadpacket.__name__] += 1
            elif kind == "view":
                self.counts.views += 1
            elif kind == "alloc":
                self.counts.allocs += 1
            what = SCALAR_READ if kind == "read" else host_read(func, args, kwargs)
            if what is not None:
                self.counts.reads.append((what, *source_of(sys._getframe(1))))
        return func(*args, **(kwargs or {}))

    def patched(self, name: str, original: Callable) -> Callable:
        """``torch.Tensor.<name>`` that records one read at its caller and runs ``original`` quietly."""

        def method(tensor, *args, **kwargs):
            if self.quiet:
                return original(tensor, *args, **kwargs)
            self.counts.reads.append((f"Tensor.{name}", *source_of(sys._getframe(1))))
            self.quiet += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self.quiet -= 1

        return method


def count_call(fn: Callable[[], object]) -> Counts:
    """Run ``fn()`` once under a :class:`LaunchCounter`, with :data:`PATCHED_METHODS` of ``torch.Tensor`` patched for
    the call (restored after it, also when it raises); returns its :class:`Counts`."""
    counts = Counts()
    counter = LaunchCounter(counts)
    saved = {name: torch.Tensor.__dict__.get(name) for name in PATCHED_METHODS}
    for name in PATCHED_METHODS:
        setattr(torch.Tensor, name, counter.patched(name, getattr(torch.Tensor, name)))
    try:
        with counter:
            fn()
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)
    return counts


# ---------------------------------------------------------------------------------------------- the scoring step
PROVIDERS = {"trl": None, "grpo_mem_group": "group", "grpo_mem_tree": "tree"}
"""Provider (the CSV's ``provider``, as in ``benchmarks/bench_tree.py``) -> grpo_mem's sharing mode; ``trl`` is stock
TRL's own ``GRPOTrainer._get_per_token_logps_and_entropies``."""


def scoring_step(provider: str, model, micro_batches: list, C: int, *, seed: int = 0) -> Callable[[], None]:
    """``step()``: one gradient-accumulation window of scoring: per micro-batch ``(input_ids (rows, P + C) int64,
    attention_mask (rows, P + C) 0/1)``, its completion log-probs and entropies (temperature 1) and their backward
    with fixed random weights (``torch.autograd.backward``: no loss ops), gradients accumulating in the parameters.
    ``trl`` runs stock TRL's own method (on a :class:`grpo_mem.patches.verify_inputs.Scorer`, TRL's fused head added
    to the model where absent); ``grpo_mem_group``/``grpo_mem_tree`` a ``grpo_mem.SharingSession`` window over the
    micro-batches, as ``patch_trl`` runs it. Raises ValueError for an unknown provider."""
    if provider not in PROVIDERS:
        raise ValueError(f"provider must be one of {tuple(PROVIDERS)}, got {provider!r}")
    g = torch.Generator().manual_seed(seed)
    dev = micro_batches[0][0].device
    weights = [tuple(torch.randn(ids.shape[0], C, generator=g).to(dev) for _ in "le") for ids, _ in micro_batches]
    if PROVIDERS[provider] is None:
        score, begin, end = _stock_scorer(model, C), (lambda: None), (lambda: None)
    else:
        import grpo_mem

        session = grpo_mem.SharingSession(PROVIDERS[provider])
        prompts = ([ids[:, :-C] for ids, _ in micro_batches], [mask[:, :-C] for _, mask in micro_batches])
        begin, end = (lambda: session.begin_window(*prompts)), session.close_window

        def score(ids, mask):
            return session.score(model, ids, mask, C, compute_entropy=True)

    def step() -> None:
        begin()
        for (ids, mask), w in zip(micro_batches, weights):
            torch.autograd.backward(score(ids, mask), w)
        end()

    return step


def _stock_scorer(model, C: int) -> Callable:
    """``score(input_ids, attention_mask) -> (log_probs, entropies)`` by stock TRL's own method."""
    import trl

    from grpo_mem.patches.verify_inputs import Scorer, stock_method

    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:  # TRL releases without a fused head compute the logits in the method itself
        add_fused_lm_head = None
    if add_fused_lm_head is not None and "fused_lm_head" not in inspect.signature(model.forward).parameters:
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    self_obj, method = Scorer(model, 1.0), stock_method(trl.GRPOTrainer)

    def score(ids, mask):
        logps, ent, _ = method(self_obj, model, ids, mask, C, batch_size=ids.shape[0], compute_entropy=True)
        return logps, ent

    return score

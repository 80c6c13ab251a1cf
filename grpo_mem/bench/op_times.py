"""Measured per-op times, the table ``auto`` reads on CUDA (``grpo_mem.ops._op_times``): each op on each backend at
each shape, forward + backward, in the benchmarks' long-format CSV (``grpo_mem.bench.results``).

``measure(shape, backend, dtype, device)`` times one (op, backend, shape) and returns its rows (``mode`` "full",
``metric`` "wall_time" and, on CUDA, "peak_tensor"; ``x_value`` the shape class ``resolve`` looks up); a backend that
cannot run the call gives one skipped row. ``measure_all(device)`` does it for every backend of both ops at
``DEFAULT_SHAPES``; ``write_csv(rows, path)`` writes the table. The GPU check calls them on CUDA; its rows are
committed to ``grpo_mem/ops/op_times.csv`` (never numbers from anywhere else).

Timing: on CUDA, CUDA events around each call after warm-up calls (``harness_cuda.measure_cuda``); on CPU,
``time.perf_counter`` around each call. Inputs are drawn on the device; gradients are dropped between calls.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import ClassVar

from grpo_mem.bench.measure import Measurement
from grpo_mem.bench.results import measurement_rows, skipped_rows
from grpo_mem.bench.results import write_csv as _write_rows

__all__ = ["DEFAULT_SHAPES", "AttentionShape", "HeadShape", "measure", "measure_all", "write_csv"]


@dataclass(frozen=True)
class AttentionShape:
    """``multi_region_attention`` with one shared region of U entries of S keys read by B rows of C queries (rows
    spread evenly over the entries), Hq query heads and Hkv kv heads of dim d, no padding."""

    B: int
    Hq: int
    Hkv: int
    C: int
    d: int
    S: int
    U: int = 1
    op: ClassVar[str] = "multi_region_attention"

    def sizes(self) -> tuple[int, int, int]:
        """(head dim, queries, longest region): what the shape class reads."""
        return self.d, self.B * self.C, self.S


@dataclass(frozen=True)
class HeadShape:
    """``linear_logprobs`` of N tokens, hidden size H, vocabulary V (with entropies)."""

    N: int
    H: int
    V: int
    op: ClassVar[str] = "linear_logprobs"

    def sizes(self) -> tuple[int, int, int]:
        return self.N, self.H, self.V


DEFAULT_SHAPES = (
    AttentionShape(B=4, Hq=16, Hkv=8, C=512, d=128, S=2048),
    AttentionShape(B=4, Hq=16, Hkv=8, C=64, d=128, S=16384),
    HeadShape(N=4 * 512, H=2048, V=151936),
    HeadShape(N=4 * 64, H=2048, V=151936),
)
"""Qwen3-1.7B (16 query and 8 kv heads of 128, hidden 2048, vocabulary 151936) at the GPU check's perf settings:
P=2048, C=512 and P=16384, C=64, G=8 in micro-batches of 4 rows (one prompt each)."""


def _attention_call(shape: AttentionShape, backend: str, dtype, device):
    """(call, setup) of one forward + backward of ``shape`` on ``backend``."""
    import torch

    from grpo_mem.ops import multi_region_attention

    g = torch.Generator(device=device).manual_seed(0)
    draw = lambda *size: torch.randn(*size, generator=g, device=device, dtype=dtype).requires_grad_()  # noqa: E731
    q, k, v = draw(shape.B, shape.Hq, shape.C, shape.d), *(draw(shape.B, shape.Hkv, shape.C, shape.d) for _ in "kv")
    rk, rv = (draw(shape.U, shape.Hkv, shape.S, shape.d) for _ in "kv")
    index = torch.arange(shape.B, device=device) * shape.U // shape.B
    mask = torch.ones(shape.U, shape.S, dtype=torch.bool, device=device)
    grad = torch.randn(q.shape, generator=g, device=device, dtype=dtype)
    leaves = (q, k, v, rk, rv)

    def call():
        out = multi_region_attention(q, k, v, [(rk, rv, index, mask)], None, scale=shape.d**-0.5, backend=backend)
        out.backward(grad)

    return call, lambda: [setattr(x, "grad", None) for x in leaves]


def _head_call(shape: HeadShape, backend: str, dtype, device):
    import torch

    from grpo_mem.ops import linear_logprobs

    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(shape.N, shape.H, generator=g, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(shape.V, shape.H, generator=g, device=device) * shape.H**-0.5).to(dtype).requires_grad_()
    index = torch.randint(0, shape.V, (shape.N,), generator=g, device=device)

    def call():
        logp, ent = linear_logprobs(hidden, weight, index, return_entropy=True, backend=backend)
        (logp.sum() + ent.sum()).backward()

    return call, lambda: [setattr(x, "grad", None) for x in (hidden, weight)]


def _cpu_measure(call, setup, warmup: int, repeats: int) -> Measurement:
    m = Measurement(warmup=warmup)
    for i in range(warmup + repeats):
        setup()
        start = time.perf_counter()
        call()
        if i >= warmup:
            m.times_s.append(time.perf_counter() - start)
    return m


def measure(shape, backend: str, dtype, device: str, *, repeats: int = 10, warmup: int = 3) -> list[dict]:
    """Rows of one op (``shape``: an :class:`AttentionShape` or :class:`HeadShape`) on ``backend`` in ``dtype``
    (a torch dtype) on ``device`` ("cuda", "cuda:1", "cpu"), forward + backward.

    Returns the CSV rows (``grpo_mem.bench.results.CSV_COLUMNS``): ``provider`` the backend, ``x_name`` "shape class",
    ``x_value`` ``_op_times.shape_class(op, dtype, shape.sizes())``, ``device`` "cuda (<name>)" as ``resolve`` looks
    it up (CPU: the processor), ``config`` the concrete shape and dtype. A backend that cannot run the call (the
    ``BackendUnavailableError`` of an explicit request) gives one skipped wall-time row naming why.

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    import torch

    from grpo_mem.bench.harness_cuda import measure_cuda
    from grpo_mem.ops._backends import BackendUnavailableError, resolve
    from grpo_mem.ops._op_times import device_key, shape_class

    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    dev = torch.device(device)
    cls = shape_class(shape.op, dtype, shape.sizes())
    config = dict(asdict(shape), dtype=str(dtype).removeprefix("torch."))
    where = device_key(dev) if dev.type == "cuda" else None
    make = _attention_call if isinstance(shape, AttentionShape) else _head_call
    try:
        probe = torch.empty(0, shape.d if isinstance(shape, AttentionShape) else shape.H, device=dev, dtype=dtype)
        resolve(shape.op, backend, probe)  # refuses a backend that cannot run here
        call, setup = make(shape, backend, dtype, dev)
    except BackendUnavailableError as exc:
        return skipped_rows(
            shape.op, backend, "full", "shape class", cls, config, str(exc), metrics=[("wall_time", "s")], device=where
        )
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            m = measure_cuda(call, setup=setup, warmup=warmup, repeats=repeats)[0]
    else:
        m = _cpu_measure(call, setup, warmup, repeats)
    return measurement_rows(shape.op, backend, "full", "shape class", cls, m, config, device=where)


def measure_all(device: str = "cuda", dtype=None, shapes=DEFAULT_SHAPES, **kwargs) -> list[dict]:
    """:func:`measure` of every backend of each shape's op (``_backends.TABLE``) in ``dtype`` (default bf16); rows of
    the backends that cannot run there are skipped rows. ``kwargs`` go to :func:`measure`."""
    import torch

    from grpo_mem.ops._backends import TABLE

    dtype = dtype or torch.bfloat16
    return [
        row
        for shape in shapes
        for entry in TABLE[shape.op]
        for row in measure(shape, entry.name, dtype, device, **kwargs)
    ]


def write_csv(rows: list[dict], path: str, *, append: bool = False) -> None:
    """Write ``rows`` as the table (``grpo_mem.bench.results.write_csv``: header first; ``append`` adds to a file)."""
    _write_rows(rows, path, append=append)

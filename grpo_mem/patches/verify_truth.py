"""The truth ``grpo_mem.verify`` judges by: stock TRL's method on the model widened one module at a time (fp32 for a
bf16/fp16 run, fp64 for an fp32 one), its gradients streamed into sketches, and the fp32-storage floor (every module's
outputs rounded to fp32)."""

from __future__ import annotations

import contextlib
import time
import types
import weakref

import torch

from ..model.distributed import unwrap_causal_lm
from .verify_inputs import Setup
from .verify_runs import Run, checkpointed_layers, chunk_ranges, row_chunk, score
from .verify_state import cast_model, no_autocast, sync


class _Upcast(torch.autograd.Function):
    """``p`` (a parameter) in ``dtype`` for one module call; its gradient goes to ``sink(name, grad)`` in ``dtype``
    (summed there at the truth's precision) instead of ``p.grad``."""

    @staticmethod
    def forward(ctx, p, dtype, sink, name):
        ctx.sink, ctx.name = sink, name
        return p.detach().to(dtype)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.name, grad)
        return None, None, None, None


class _UpcastRows(torch.autograd.Function):
    """Rows ``rows`` of ``p`` (an embedding table) in ``dtype``; their gradient goes to
    ``sink(name, grad, rows, p.shape)`` instead of ``p.grad``."""

    @staticmethod
    def forward(ctx, p, rows, dtype, sink, name):
        ctx.sink, ctx.name, ctx.rows, ctx.shape = sink, name, rows, tuple(p.shape)
        return p.detach()[rows].to(dtype)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.name, grad, ctx.rows, ctx.shape)
        return None, None, None, None, None


@contextlib.contextmanager
def upcast_per_module(model, dtype: torch.dtype, sink):
    """The model's floating parameters and buffers seen in ``dtype`` by each module only while it runs: a forward
    pre-hook puts copies in ``dtype`` in the module's ``_parameters``/``_buffers`` (exact: bf16/fp16 -> fp32 and
    fp32 -> fp64 are widenings), the forward hook puts the originals back. A copy a backward formula saves (a linear
    layer's weight) is not kept: saved-tensor hooks store the original parameter and widen it again when the backward
    reads it. So at most one module's weights exist in ``dtype`` at a time, besides the activations. An
    ``nn.Embedding`` (without ``max_norm``) called with its ids widens only the rows the ids use, and its ids are
    renumbered into them (what it avoids: a vocabulary table in fp64, Gemma 3's 262144 x 640 x 8 B = 1.3 GB, and
    as much for its gradient). Gradients (``dtype``) go to ``sink(name, grad)`` (an embedding's:
    ``sink(name, rows_grad, rows, shape)``), not to ``.grad``. Everything is put back on exit, also after an error."""
    widener = _Widener(model, dtype, sink)
    handles = []
    for module in model.modules():
        if module._parameters or module._buffers:
            plain = not isinstance(module, torch.nn.Embedding) or module.max_norm is not None
            handles.append(module.register_forward_pre_hook(widener.pre if plain else widener.pre_embedding))
            handles.append(module.register_forward_hook(widener.post))
    try:
        with torch.autograd.graph.saved_tensors_hooks(widener.pack, widener.unpack):
            yield
    finally:
        for h in handles:
            h.remove()
        widener.put_back()


class _Widener:
    """The hooks of ``upcast_per_module`` and what they share: the widened copies alive (id -> (weakref, original))
    and, per module, the stack of what its pre-hooks swapped in (a module may run re-entrantly)."""

    def __init__(self, model, dtype: torch.dtype, sink):
        self.dtype, self.sink = dtype, sink
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.copies: dict[int, tuple] = {}
        self.stacks: dict[int, list] = {}

    def widen(self, t, grad: bool):
        if grad and t.requires_grad and torch.is_grad_enabled():
            w = _Upcast.apply(t, self.dtype, self.sink, self.names.get(id(t), ""))
        else:
            w = t.detach().to(self.dtype)
        self.copies[id(w)] = (weakref.ref(w), t)
        return w

    def pre(self, module, args):
        swapped = []
        for store, grad in ((module._parameters, True), (module._buffers, False)):
            for key, t in list(store.items()):
                if t is not None and t.is_floating_point() and t.dtype != self.dtype:
                    store[key] = self.widen(t, grad)
                    swapped.append((store, key, t))
        self.stacks.setdefault(id(module), []).append(swapped)

    def pre_embedding(self, module, args):
        """An ``nn.Embedding`` called with its token ids: only the rows the ids use, widened, and the ids renumbered
        into them (the same values and gradients; a whole vocabulary table in fp64 is what this avoids)."""
        weight = module._parameters.get("weight")
        ids = args[0] if args else None
        if not (isinstance(ids, torch.Tensor) and weight is not None and weight.dtype != self.dtype):
            return self.pre(module, args)
        rows, local = torch.unique(ids, return_inverse=True)
        if weight.requires_grad and torch.is_grad_enabled():
            compact = _UpcastRows.apply(weight, rows, self.dtype, self.sink, self.names.get(id(weight), ""))
        else:
            compact = weight.detach()[rows].to(self.dtype)
        swapped = [(module._parameters, "weight", weight)]
        module._parameters["weight"] = compact
        pad = module.padding_idx
        if pad is not None:
            hit = (rows == pad).nonzero()
            module.padding_idx = int(hit[0, 0]) if len(hit) else None
            swapped.append((module.__dict__, "padding_idx", pad))
        for key, t in list(module._buffers.items()):
            if t is not None and t.is_floating_point() and t.dtype != self.dtype:
                module._buffers[key] = t.to(self.dtype)
                swapped.append((module._buffers, key, t))
        self.stacks.setdefault(id(module), []).append(swapped)
        return (local, *args[1:])

    def post(self, module, args, out):
        for store, key, t in self.stacks[id(module)].pop():
            store[key] = t

    def pack(self, t):
        entry = self.copies.get(id(t))
        if entry is not None and entry[0]() is t:
            return ("widened", entry[1])
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 2 and packed[0] == "widened":
            return packed[1].detach().to(self.dtype)
        return packed

    def put_back(self) -> None:
        """Every original back in its module (also those of modules whose forward raised before their post-hook)."""
        for stack in self.stacks.values():
            for swapped in stack:
                for store, key, t in swapped:
                    store[key] = t
        self.copies.clear()


class _Round(torch.autograd.Function):
    """``t`` rounded to ``dtype`` and back (values and, in the backward, gradients)."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


@contextlib.contextmanager
def rounded_outputs(model, dtype: torch.dtype):
    """Every module's floating output tensors (a tensor, or the tensors of a tuple/list) rounded to ``dtype`` and back,
    and the gradients flowing back into them too: an exact computation that stores every intermediate in ``dtype``."""

    def hook(module, args, out):
        if isinstance(out, torch.Tensor):
            return _Round.apply(out, dtype) if out.is_floating_point() else out
        if isinstance(out, (tuple, list)) and not hasattr(out, "keys"):
            items = [
                _Round.apply(t, dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in out
            ]
            return type(out)(items) if type(out) in (tuple, list) else out
        return out

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def exact_head(causal_lm, temperature: float):
    """``causal_lm``'s calls with ``fused_lm_head=True`` (TRL's fused head) answered in the model's own dtype: its
    logits over the labelled positions (``logits_to_keep``), divided by ``temperature``, through ``log_softmax``;
    log-probs and entropies (rows, T - 1), 0 where the label is -100, as TRL's head lays them out."""
    had = "forward" in causal_lm.__dict__
    fused = causal_lm.forward

    def forward(*args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return fused(*args, labels=labels, **kwargs) if labels is not None else fused(*args, **kwargs)
        valid = labels != -100
        columns = valid.any(0).nonzero()
        first = max(int(columns[0]) if len(columns) else labels.shape[1] - 1, 1)  # first labelled column
        kwargs["use_cache"] = False
        out = fused(*args, logits_to_keep=labels.shape[1] - first + 1, **kwargs)
        logp = torch.log_softmax(out.logits[:, :-1] / temperature, -1)
        target, keep = labels[:, first:], valid[:, first:]
        token = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0].masked_fill(~keep, 0)
        entropy = -(logp.exp() * logp).sum(-1).masked_fill(~keep, 0)
        pad = token.new_zeros(labels.shape[0], first - 1)
        return types.SimpleNamespace(
            log_probs=torch.cat([pad, token], 1),
            entropy=torch.cat([pad, entropy], 1),
            aux_loss=getattr(out, "aux_loss", None),
        )

    causal_lm.forward = forward
    try:
        yield
    finally:
        if had:
            causal_lm.forward = fused
        else:
            causal_lm.__dict__.pop("forward", None)


def _act_bytes(setup: Setup) -> int:
    """Bytes per element of the activations of the trainer's run (its autocast dtype, else the weights')."""
    if setup.low_dtype is not None:
        return setup.low_dtype.itemsize
    param = next((p for p in setup.model.parameters() if p.is_floating_point()), None)
    return 4 if param is None else param.dtype.itemsize


def widened_truth(
    setup: Setup,
    dtype: torch.dtype,
    entropy_coef: float,
    seed: int,
    backward: bool,
    timings: dict,
    round_to: torch.dtype | None = None,
) -> Run:
    """Stock TRL's method on the model widened to ``dtype`` (fp32 for low-precision runs, fp64 for fp32 runs), with
    gradients only if ``backward``, in row chunks no larger than grpo_mem's micro-batches (in bytes).

    The model is widened one module at a time (``upcast_per_module``): no whole copy in ``dtype``; with gradients, its
    decoder layers are checkpointed (``checkpointed_layers``), so that a row in ``dtype`` takes no more than
    grpo_mem's micro-batch. TRL's fused head (which reads the head's weight outside the head module and computes in
    fp32 whatever the weights' dtype) is replaced by the model's own logits and a log-softmax in ``dtype``. A model the
    per-module widening cannot run (a parameter read outside its module's call) is widened whole in place instead
    (``cast_model``). ``round_to``: every module's outputs and their gradients rounded to that dtype
    (``rounded_outputs``; timed as "fp32 floor")."""
    device = setup.ids.device
    sync(device)
    t = time.perf_counter()
    causal_lm = unwrap_causal_lm(setup.model)
    scale = dtype.itemsize / _act_bytes(setup)
    rows = row_chunk(setup, scale)
    setup.truth_rows[f"{str(dtype).replace('torch.float', 'fp')} truth"] = rows
    chunks = chunk_ranges(setup, rows)
    sink: dict = {}

    def add(name, grad, rows=None, shape=None):
        if rows is None:
            setup.sketcher.add(sink, name, grad)
        else:
            setup.sketcher.add_rows(sink, name, grad, rows, shape)

    def rounding():
        return rounded_outputs(setup.model, round_to) if round_to is not None else contextlib.nullcontext()

    def run(widen):
        sink.clear()
        checkpointed = checkpointed_layers(causal_lm) if backward else contextlib.nullcontext()
        with (
            widen,
            no_autocast(setup.self_obj, device.type),
            exact_head(causal_lm, setup.temperature),
            rounding(),
            checkpointed,
        ):
            torch.manual_seed(seed)
            name = f"{str(dtype).replace('torch.float', 'fp')} truth" + (" floor" if round_to is not None else "")
            return score(setup.stock_fn, setup, entropy_coef, backward=backward, chunks=chunks, sink=sink, label=name)

    try:
        truth = run(upcast_per_module(setup.model, dtype, add))
        setup.truth_mode = "per module"
    except (RuntimeError, TypeError):  # e.g. a weight read outside its module in the model's dtype
        for p in setup.model.parameters():
            p.grad = None
        truth = run(cast_model(setup.model, None, dtype))
        setup.truth_mode = "whole model"
    sync(device)
    timings["truth" if round_to is None else "fp32 floor"] = time.perf_counter() - t
    return truth

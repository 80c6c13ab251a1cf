"""The scored runs of ``grpo_mem.verify``: the batch scored micro-batch by micro-batch (or in row chunks) with the
fixed TRL-like loss and its backward, and what keeps stock TRL's reference run within the patched step's memory (row
chunks, checkpointed decoder layers, a narrower TRL head tile)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from ..model.distributed import unwrap_causal_lm
from .verify_inputs import Setup

ENTROPY_COEF = 0.1


@dataclass
class Run:
    logps: torch.Tensor
    entropies: torch.Tensor
    grads: dict  # {name: fp64 sketch} (see Sketcher)
    entropy_coef: float


def chunk_ranges(setup, rows: int) -> list[tuple[int, int]]:
    """Each micro-batch of ``setup.slices`` cut into row chunks of at most ``rows`` rows."""
    return [(a, min(a + rows, hi)) for lo, hi in setup.slices for a in range(lo, hi, rows)]


def score(
    fn,
    setup: Setup,
    entropy_coef,
    before_call=None,
    after_call=None,
    backward: bool = True,
    chunks=None,
    sink=None,
    label: str = "scoring",
) -> Run:
    """Score the batch with ``fn`` (TRL's method or the patched one) in ``chunks`` (row ranges; default the
    micro-batches ``setup.slices``), each followed by the backward of its share of the fixed loss (the loss is a sum
    over rows, so chunks of a micro-batch add up to its gradient); returns log-probs, entropies (fp32, or fp64 from an
    fp64 truth) and the sketch of the summed gradients (the ``.grad``s are dropped). ``entropy_coef`` None:
    ``ENTROPY_COEF`` if the method's entropies carry gradient (TRL < 1.14 computes them without gradient unless the
    entropy bonus is on), else 0; the coefficient used is returned for the other runs. ``before_call(i)`` /
    ``after_call()`` run around call i. ``backward=False``: forwards only, under ``torch.no_grad()`` (no gradients
    returned). ``sink``: the sketches the truth's per-module gradients were added to during its backwards. ``label``:
    the run's name on ``setup.bar``, which counts its calls."""
    model, self_obj, ids, mask = setup.model, setup.self_obj, setup.ids, setup.mask
    C = setup.loss_mask.shape[1]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    all_logps, all_ent = [], []
    chunks = chunks or setup.slices
    if setup.bar is not None:
        setup.bar.total += len(chunks)
        setup.bar.set_description(f"grpo_mem.verify: {label}")
    for i, (lo, hi) in enumerate(chunks):
        if before_call is not None:
            before_call(i)
        # forward under the trainer's mixed precision, as accelerate's prepared forward applies it in training (TRL
        # < 1.15's method enters no autocast itself; 1.15+ enters the same one again inside); backward outside any
        # autocast, as in training, also when verify is called inside one
        with self_obj.accelerator.autocast(), torch.set_grad_enabled(backward):
            logps, ent, aux = fn(
                self_obj,
                model,
                ids[lo:hi],
                mask[lo:hi],
                C,
                batch_size=hi - lo,
                compute_entropy=True,
                compute_aux_loss=setup.aux_coef != 0.0,
                **setup.extras,
            )
        if after_call is not None:
            after_call()
        acc = torch.float64 if logps.dtype == torch.float64 else torch.float32  # the fp64 truth stays fp64
        if backward:
            if entropy_coef is None:
                entropy_coef = ENTROPY_COEF if ent.requires_grad else 0.0
            _backward(setup, lo, hi, logps, ent, aux, entropy_coef, acc)
        all_logps.append(logps.detach().to(acc))
        all_ent.append(ent.detach().to(acc))
        del logps, ent, aux
        if setup.bar is not None:
            setup.bar.update()
    grads = setup.sketcher.take_grads(named, sink) if backward else {}
    for _, p in named:
        p.grad = None
    return Run(torch.cat(all_logps), torch.cat(all_ent), grads, entropy_coef)


def _backward(setup: Setup, lo: int, hi: int, logps, ent, aux, entropy_coef: float, acc: torch.dtype) -> None:
    """The backward of rows ``lo:hi``'s share of the fixed loss (module docstring of ``verify``), in ``acc``, outside
    any autocast, as in training; with the MoE router loss weighted as the trainer weights it."""
    m, (a, n_tok) = setup.loss_mask[lo:hi].to(acc), setup.weights
    loss = -(a[lo:hi, None] * m * logps.to(acc)).sum() / n_tok - entropy_coef * (m * ent.to(acc)).sum() / n_tok
    if aux is not None:  # the MoE router loss: its gradient is compared
        loss = loss + setup.aux_coef * aux.to(acc)
    with torch.autocast(logps.device.type, enabled=False):
        loss.backward()


def stock_entropy_coef(setup: Setup) -> float:
    """The entropy term's coefficient of the fixed loss: ``ENTROPY_COEF`` where stock TRL's method returns entropies
    that carry gradient, else 0 (TRL 1.10-1.13 compute them under ``torch.no_grad()`` unless the trainer's entropy
    bonus is on; grpo_mem's always carry it, and the loss then uses them only where stock's do). Observed on one
    forward of stock's method over the first row (the first micro-batch where the call carries multimodal inputs), no
    backward, before grpo_mem's run, so that every run weighs the same loss. Call it as stock's run is called (inside
    ``checkpointed_layers`` and ``trl_head_tile``), or TRL's fused head allocates its full vocabulary tile."""
    lo, hi = setup.slices[0]
    hi = hi if setup.extras else lo + 1
    with setup.self_obj.accelerator.autocast(), torch.enable_grad():
        _, ent, _ = setup.stock_fn(
            setup.self_obj,
            setup.model,
            setup.ids[lo:hi],
            setup.mask[lo:hi],
            setup.loss_mask.shape[1],
            batch_size=hi - lo,
            compute_entropy=True,
            compute_aux_loss=setup.aux_coef != 0.0,
            **setup.extras,
        )
    return ENTROPY_COEF if ent.requires_grad else 0.0


def row_chunk(setup: Setup, scale: float) -> int:
    """Rows per chunk of a stock-path run whose activations take ``scale`` x the bytes per token of the model's own
    dtype: as many full rows (P + C tokens each) as fit in the most tokens grpo_mem's path ran through the backbone in
    one micro-batch, at least 1, at most the micro-batch. Whole micro-batches where the loss is not a sum over rows
    (the MoE router loss, computed over the call's tokens) or the call carries multimodal inputs."""
    width, mb = setup.ids.shape[1], max(hi - lo for lo, hi in setup.slices)
    if setup.aux_coef != 0.0 or setup.extras:
        return mb
    return max(1, min(mb, int(setup.budget_tokens / (scale * width))))


@contextlib.contextmanager
def trl_head_tile(setup: Setup):
    """TRL's fused head (``trl.trainer.utils.add_fused_lm_head``) with vocabulary tiles as wide as the head's input
    (the hidden size, rounded down to a multiple of 128, at least 128; at most the vocabulary rounded up to 128, where
    the vocabulary fits in one tile: the same sums as TRL's; at most TRL's own width), so that a tile of fp32 logits
    takes no more than the call's hidden states in fp32. TRL's own code path: its module constant
    ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (32768 in 1.16), which it passes as ``chunk_size`` to its
    ``_ChunkedLogProbFunction``. Its kernel folds each tile into online log-sum-exp statistics, so a narrower tile
    changes only the order of the fp32 sums over the vocabulary (1-2 ulps measured:
    ``tests/patches/test_verify.py::test_trl_head_tile_changes_only_summation_order``). Why: on CPU TRL scores
    every position of a row (P + C - 1 per row), allocates its full tile width whatever the
    vocabulary, and its torch fallback holds about 9 fp32 copies of a tile at once in the backward, which made
    stock's call peak above the patched step's. TRL releases without the constant: nothing changes."""
    import importlib

    try:
        utils = importlib.import_module("trl.trainer.utils")
    except ImportError:
        utils = None
    own = getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", None)
    if not isinstance(own, int):
        yield
        return
    head = unwrap_causal_lm(setup.model).get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        yield
        return
    vocab, hidden = weight.shape
    columns = min(max(128, hidden // 128 * 128), -(-vocab // 128) * 128)
    utils._CHUNKED_LOGPROB_CHUNK_SIZE = min(own, columns)
    try:
        yield
    finally:
        utils._CHUNKED_LOGPROB_CHUNK_SIZE = own


@contextlib.contextmanager
def checkpointed_layers(model):
    """Each block of the model's longest ``nn.ModuleList`` (its decoder layers) run under non-reentrant activation
    checkpointing (``torch.utils.checkpoint``): only the layers' inputs are kept, one layer's activations are
    recomputed at a time in the backward. The values are the same (the recomputation repeats the same operations, with
    the same RNG state). Nothing changes if the layers checkpoint already (``gradient_checkpointing``) or there are
    none."""
    from torch.utils.checkpoint import checkpoint

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    layers = max(lists, key=len, default=[])
    if not layers or any(getattr(m, "gradient_checkpointing", False) for m in layers):
        yield
        return
    own = [(layer, layer.__dict__.get("forward")) for layer in layers]
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer, forward in own:
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward

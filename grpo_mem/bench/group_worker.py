"""One provider of the group-scoring op (:mod:`grpo_mem.bench.group`) measured in a fresh process: the worker
(target ``grpo_mem.bench.group_worker:worker`` of ``isolate.run_isolated``) builds the model and the batch, warms the
provider up on a tiny group, measures the op (wall and CPU time, peak RSS or CUDA allocation, live tensors), and
returns the log-probs, entropies, gradient norm and per-parameter gradient sketches the sweep compares across
providers run in separate processes."""

from __future__ import annotations

import math
import warnings

from grpo_mem.bench import measure, results
from grpo_mem.bench.group import Provider, build_model, make_inputs, make_logprob_fn, make_window_fn, provider_named

WARMUP_SHAPE = dict(G=2, P=16, C=8)
"""The tiny group every worker scores once (forward + backward) before measuring: lazy imports and one-time installs
happen there instead of in a full-size untimed call."""


# ----------------------------------------------------------------------------------------------------- measurement
def grad_norm(model) -> float:
    """L2 norm over every parameter gradient (fp64 accumulation)."""
    sq = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    return math.sqrt(sq)


SKETCH_WIDTH = 32


_SKETCH_CHUNK = 1 << 22


def grad_sketches(model, width: int = SKETCH_WIDTH) -> dict[str, list[float]]:
    """Per parameter with a gradient (by name): ``[its gradient's L2 norm, then a count sketch of it]``, floats.

    The sketch adds each entry, with a random sign, into one of ``width`` random buckets; signs and buckets are drawn
    from a generator seeded by the parameter's name, so two processes sketch a parameter alike. It is linear: the
    sketch of two gradients' difference is the difference of their sketches, whose squared norm estimates the
    difference's (unbiased, relative spread about sqrt(2 / width)); ``sweep.compare_with_reference`` compares
    providers run in separate processes per parameter that way. Costs two random draws per entry (after measuring).
    """
    import zlib

    import torch

    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().flatten()
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        sketch = torch.zeros(width, dtype=torch.float64, device=g.device)
        for start in range(0, g.numel(), _SKETCH_CHUNK):
            part = g[start : start + _SKETCH_CHUNK].double()
            buckets = torch.randint(width, (part.numel(),), generator=generator).to(g.device)
            signs = torch.randint(2, (part.numel(),), generator=generator).to(g.device, torch.float64) * 2 - 1
            sketch.index_add_(0, buckets, part * signs)
        out[name] = [float(g.double().norm())] + sketch.tolist()
    return out


def measure_group(
    args: dict,
    model,
    fn,
    input_ids,
    attention_mask,
    completion_mask,
    *,
    micro: int | None = None,
    plain_forward_check: bool = True,
) -> dict:
    """Warm ``fn`` up on a tiny group, then measure the op on the real inputs in micro-batches of ``micro`` rows
    (default: all rows at once); the result dict of :func:`worker`.

    ``args``: provider, C, and optionally warmup, repeats, min_repeats, time_budget_s (``measure.measure``'s), or
    single_call (True: one call timed and memory-measured at once, ``measure.measure_once``; CPU only).
    ``plain_forward_check``: after measuring, compare the log-probs with a plain no-grad full-sequence forward
    (``logp_max_abs_diff_vs_plain_forward``); costs one more forward of every row.
    """
    import torch

    _warm_up(args["provider"], model, input_ids.device)
    cmask = completion_mask.float()
    last = {}
    B = input_ids.size(0)
    step = micro or B

    def op():
        lps, ents = [], []
        for s in range(0, B, step):
            lp, ent = fn(input_ids[s : s + step], attention_mask[s : s + step])
            (lp * cmask[s : s + step]).sum().backward()
            lps.append(lp.detach())
            ents.append(ent.detach())
        last["lp"], last["ent"] = torch.cat(lps), torch.cat(ents)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = measure_op(op, lambda: model.zero_grad(set_to_none=True), input_ids.device, args)
    if plain_forward_check:
        ref = _plain_forward_logps(model, input_ids, attention_mask, args["C"]) * cmask
        res["logp_max_abs_diff_vs_plain_forward"] = float((last["lp"] * cmask - ref).abs().max())
    res["log_probs"] = (last["lp"] * cmask).tolist()
    res["entropies"] = (last["ent"] * cmask).tolist()
    res["grad_norm"] = grad_norm(model)
    res["grad_sketches"] = grad_sketches(model)
    res["n_params"] = sum(p.numel() for p in model.parameters())
    res["fallback_warnings"] = sorted({str(w.message) for w in caught if "grpo_mem" in str(w.message)})
    return res


def _warm_up(provider: str, model, device) -> None:
    """One forward + backward of ``provider``'s op on a tiny group (:data:`WARMUP_SHAPE`), unmeasured."""
    w = WARMUP_SHAPE
    tiny_ids, tiny_mask, tiny_cmask = (
        x.to(device)
        for x in make_inputs(w["G"], w["P"], w["C"], 1, model.config.get_text_config().vocab_size, seed=123)
    )
    lp, _ = make_logprob_fn(provider, model, w["C"])(tiny_ids, tiny_mask)
    (lp * tiny_cmask).sum().backward()


def measure_op(op, setup, device, args: dict) -> dict:
    """``op()`` measured on ``device`` (a ``torch.device``) with ``setup()`` before every call, as ``args`` says
    (warmup, repeats, min_repeats, time_budget_s, single_call: see :func:`measure_group`); on CUDA by
    :mod:`grpo_mem.bench.harness_cuda`, with the device name and absolute peak (MB). The measurement as a dict."""
    from grpo_mem.bench import harness_cuda

    if device.type == "cuda":
        m, absolute = harness_cuda.measure_cuda(
            op, setup=setup, warmup=max(1, args.get("warmup", 0)), repeats=args.get("repeats", 3)
        )
        return dict(m.to_dict(), cuda_device=harness_cuda.cuda_device_name(), cuda_peak_allocated_mb=absolute / 1e6)
    if args.get("single_call"):
        return measure.measure_once(op, setup=setup).to_dict()
    return measure.measure(
        op,
        setup=setup,
        warmup=args.get("warmup", 0),
        repeats=args.get("repeats", 3),
        min_repeats=args.get("min_repeats", 1),
        time_budget_s=args.get("time_budget_s", 20.0),
        memory_repeats=1,
    ).to_dict()


def _plain_forward_logps(model, input_ids, attention_mask, C: int):
    """Log-probs (rows, C) fp32 of the last ``C`` tokens by a plain no-grad forward of the full sequences, log_softmax
    over the whole vocabulary: the reference :func:`measure_group` checks against after measuring (so nothing here
    is timed or counted)."""
    import torch

    with torch.no_grad():
        hidden = model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state[:, -C - 1 : -1]
        logits = model.get_output_embeddings()(hidden).float()
        return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -C:, None])[..., 0]


# ---------------------------------------------------------------------------------------------------------- worker
def worker(args: dict) -> dict:
    """One (configuration, provider) in a fresh process (target ``grpo_mem.bench.group_worker:worker`` of
    ``isolate.run_isolated``).

    ``args``: ``model_config`` (a config.json's content, see :func:`build_model`), provider, G, P, C, and optionally
    groups (1), micro (rows per micro-batch, a divisor of groups·G; default all rows), shared_prefix (0),
    image_tokens (0; N > 0: one image of N tokens per prompt, :mod:`grpo_mem.bench.vision`, providers ``trl`` and
    ``grpo_mem``, no plain-forward check), dtype
    ("float32"), device ("cpu"), seed (0), plain_forward_check (True), warmup, repeats, min_repeats, time_budget_s,
    single_call (see :func:`measure_group`).

    Returns the measurement dict plus ``log_probs``/``entropies`` of the last call (lists, masked entries 0),
    ``grad_norm`` (L2 over all parameter gradients), ``grad_sketches`` (per parameter, :func:`grad_sketches`),
    ``fallback_warnings`` (grpo_mem's fallback messages),
    ``n_params``, ``prompt_passes_per_call`` (grpo_mem over several micro-batches, else None),
    ``vision_patch_rows`` (image runs: patch rows the vision tower encoded in the last call, else None) and ``version``
    (``results.versions()`` as this process saw the code).

    Raises:
        ValueError: unknown provider, ``micro`` not dividing the rows, bad ``shared_prefix``.
    """
    version = results.versions()
    device = args.get("device", "cpu")
    seed = args.get("seed", 0)
    G, groups = args["G"], args.get("groups", 1)
    B = G * groups
    micro = args.get("micro") or B
    if micro < 1 or B % micro:
        raise ValueError(f"micro must divide the {B} rows (groups={groups} x G={G}), got {micro}")
    prov = provider_named(args["provider"])
    model = build_model(args["model_config"], seed=seed, dtype=args.get("dtype", "float32"), device=device)
    input_ids, attention_mask, completion_mask, extras = _worker_inputs(args, model, seed)
    fn = _scoring_fn(prov, model, args, input_ids, attention_mask, extras, micro)
    res = measure_group(
        args,
        model,
        fn,
        input_ids,
        attention_mask,
        completion_mask,
        micro=micro,
        plain_forward_check=args.get("plain_forward_check", True) and extras is None,
    )
    return dict(
        res,
        version=version,
        prompt_passes_per_call=getattr(fn, "prompt_passes_per_call", None),
        vision_patch_rows=getattr(fn, "vision_patch_rows", None),
    )


def _worker_inputs(args: dict, model, seed: int):
    """:func:`worker`'s batch on the model's device: ``(input_ids, attention_mask, completion_mask, extras)``, extras
    TRL's image arguments (one image per prompt, :func:`grpo_mem.bench.vision.add_images`) or None without images."""
    G, P, C, groups = args["G"], args["P"], args["C"], args.get("groups", 1)
    shared_prefix, image_tokens = args.get("shared_prefix", 0), args.get("image_tokens", 0)
    input_ids, attention_mask, completion_mask = make_inputs(
        G, P, C, groups, model.config.get_text_config().vocab_size, seed=seed + 1, shared_prefix=shared_prefix
    )
    extras = None
    if image_tokens:
        from grpo_mem.bench.vision import add_images

        input_ids, extras = add_images(
            model.config, input_ids, attention_mask, P, image_tokens, shared_prefix=shared_prefix, seed=seed + 7
        )
    device = args.get("device", "cpu")
    return (*(x.to(device) for x in (input_ids, attention_mask, completion_mask)), extras)


def _scoring_fn(prov: Provider, model, args: dict, input_ids, attention_mask, extras, micro: int):
    """The op of provider ``prov`` on micro-batches of ``micro`` rows: an image run's, a sharing window over several
    micro-batches (grpo_mem providers), or one call per micro-batch."""
    P, C, B = args["P"], args["C"], input_ids.size(0)
    if extras is not None:
        from grpo_mem.bench.vision import make_image_fn

        return make_image_fn(prov.name, model, C, input_ids[:, :P], attention_mask[:, :P], extras, micro)
    if prov.sharing is not None and micro < B:
        return make_window_fn(
            prov.name,
            model,
            C,
            [input_ids[s : s + micro, :P] for s in range(0, B, micro)],
            [attention_mask[s : s + micro, :P] for s in range(0, B, micro)],
        )
    return make_logprob_fn(prov.name, model, C)

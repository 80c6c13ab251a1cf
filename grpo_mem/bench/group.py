"""The group-scoring op that ``grpo-mem bench`` and ``benchmarks/bench_group.py`` measure, per provider.

The op, on B = groups·G rows (G completions of each prompt; prompts left-padded to width P, completions right-padded
to width C and ended by EOS): per-token log-probs and entropies of every completion token, then
``(log_probs * completion_mask).sum().backward()`` into freshly ``None``-ed parameter gradients, over micro-batches of
``micro`` rows (gradients accumulated, as TRL does when ``per_device_train_batch_size`` < B).

Providers (:data:`PROVIDERS`):

- ``trl``: stock TRL 1.16. The model gets TRL's fused head, ``trl.trainer.utils.add_fused_lm_head(model,
  outputs=("log_probs", "entropy"))``, and is called as ``GRPOTrainer._get_per_token_logps_and_entropies`` calls it:
  ``model(input_ids=, attention_mask=, labels=labels, fused_lm_head=True)``, labels = ids with -100 on padding and on
  the prompt. Every row forwards prompt + completion. On CPU TRL's head scores all P + C - 1 positions per row (its
  compact mode is for Triton devices only).
- ``full_seq``: the backbone on the full prompt + completion sequence, then TRL's chunked head
  (``trl.kernels.ChunkedLogProbFunction``) on the completion positions with a real label only, as TRL's compact mode
  does on GPU: the full-sequence baseline with a completion-only head.
- ``grpo_mem``: ``grpo_mem.shared_prompt_logprobs`` on the plain model, each prompt forwarded once, its K/V shared by
  the group's completions ("group" sharing). Over several micro-batches it runs as the TRL patch does within one
  gradient-accumulation window (a ``SharingSession``): each prompt is forwarded once for the whole window.
- ``grpo_mem_tree``: the same with ``sharing="tree"`` (prompts' common prefixes forwarded once too); only offered when
  ``shared_prompt_logprobs`` has a ``sharing`` parameter (:func:`available_providers`).

A further sharing mode is one more :class:`Provider` entry in :data:`PROVIDERS`.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from grpo_mem.bench import measure, results
from grpo_mem.bench.presets import EOS_ID, PAD_ID

WARMUP_SHAPE = dict(G=2, P=16, C=8)
"""The tiny group every worker scores once (forward + backward) before measuring: lazy imports and one-time installs
happen there instead of in a full-size untimed call."""


@dataclass(frozen=True)
class Provider:
    """One way of scoring the op: ``name`` is the CSV's ``provider`` column; ``sharing`` is the grpo_mem sharing
    mode (``None`` for the stock paths); ``description`` is a short phrase for tables and help."""

    name: str
    sharing: str | None
    description: str


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("trl", None, "stock TRL 1.16 (fused head, full prompt + completion per row)"),
        Provider("full_seq", None, "full sequence per row, head on completion tokens only"),
        Provider("grpo_mem", "group", "grpo_mem, each group's prompt forwarded once"),
        Provider("grpo_mem_tree", "tree", "grpo_mem, prompts' shared prefixes forwarded once"),
    )
}


def _accepts(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def available_providers() -> list[str]:
    """Names of the providers this installation can run, in :data:`PROVIDERS` order: the stock ones, ``grpo_mem``,
    and every other sharing mode when ``grpo_mem.shared_prompt_logprobs`` takes a ``sharing`` parameter."""
    import grpo_mem

    has_sharing = _accepts(grpo_mem.shared_prompt_logprobs, "sharing")
    return [p.name for p in PROVIDERS.values() if p.sharing in (None, "group") or has_sharing]


def ideal_ratio(G: int, P: int, C: int) -> float:
    """(P + G·C) / (G·(P + C)): tokens through the trunk with the prompt once, over tokens with it G times."""
    return (P + G * C) / (G * (P + C))


# ------------------------------------------------------------------------------------------------- model and inputs
def model_config(spec: dict[str, Any]):
    """A transformers config from ``spec``, the content of a ``config.json`` (a dict with ``model_type``; keys it
    lacks take the config class's defaults). Raises ValueError without ``model_type``."""
    from transformers import AutoConfig

    if "model_type" not in spec:
        raise ValueError(f"a model config needs 'model_type', got keys {sorted(spec)}")
    cls = type(AutoConfig.for_model(spec["model_type"]))
    return cls.from_dict(dict(spec))


def model_class(config):
    """The transformers auto class building ``config``: ``AutoModelForImageTextToText`` when it has a
    ``vision_config`` (a vision-language model), else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def build_model(spec: dict[str, Any], *, seed: int = 0, dtype: str = "float32"):
    """A randomly initialised causal LM (or vision-language model, :func:`model_class`) of the config ``spec`` (see
    :func:`model_config`): weights from ``torch.manual_seed(seed)``, ``dtype`` ("float32" or "bfloat16"), SDPA
    attention (eager for a class without SDPA support, such as gpt-oss with its sinks), train mode, dropout 0 if the
    config has ``attention_dropout``. Nothing is downloaded."""
    import torch

    config = model_config(spec)
    if hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0
    torch.manual_seed(seed)
    auto = model_class(config)
    sdpa = getattr(auto._model_mapping.get(type(config), None), "_supports_sdpa", True)
    model = auto.from_config(config, attn_implementation="sdpa" if sdpa else "eager", dtype=getattr(torch, dtype))
    return model.train()


def random_completion(C: int, vocab: int, g):
    """One completion: length uniform in [C/2, C] (1 if C = 1), random ids in [3, vocab), EOS last, right-padded to
    C; returns ``(ids (C,) int64, mask (C,) int64 0/1)``, drawn from the ``torch.Generator`` ``g``."""
    import torch

    n = int(torch.randint(C // 2, C + 1, (1,), generator=g)) if C > 1 else 1
    comp = torch.randint(3, vocab, (C,), generator=g)
    comp[n - 1] = EOS_ID
    comp[n:] = PAD_ID
    cmask = torch.zeros(C, dtype=torch.long)
    cmask[:n] = 1
    return comp, cmask


def make_inputs(G: int, P: int, C: int, groups: int, vocab: int, seed: int = 0, shared_prefix: int = 0):
    """``(input_ids, attention_mask, completion_mask)`` of ``groups`` prompts with ``G`` completions each.

    Prompt g is left-padded to width P (g = 0: P/8 padding slots, later ones P/4), holding random ids in [3, vocab);
    its first ``shared_prefix`` real tokens are the same in every prompt. Completions have lengths uniform in
    [C/2, C], end with EOS and are right-padded to C. With 2 or more groups the rows are shuffled, as TRL shuffles its
    generation batch, so a group's rows are not adjacent.
    Shapes: (groups·G, P + C) int64, int64 0/1, (groups·G, C) int64 0/1.

    Raises:
        ValueError: ``shared_prefix`` negative or longer than the shortest prompt (P - P/4 tokens with 2+ groups).
    """
    import torch

    shortest = P - P // (8 if groups == 1 else 4)
    if not 0 <= shared_prefix <= shortest:
        raise ValueError(
            f"shared_prefix must be in [0, {shortest}] (the shortest prompt's length for P={P}, "
            f"groups={groups}), got {shared_prefix}"
        )
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared_prefix,), generator=g) if shared_prefix else None
    ids, masks = [], []
    for k in range(groups):
        pad = P // (8 if k == 0 else 4)
        prompt = torch.randint(3, vocab, (P,), generator=g)
        prompt[:pad] = PAD_ID
        if prefix is not None:
            prompt[pad : pad + shared_prefix] = prefix
        pmask = torch.ones(P, dtype=torch.long)
        pmask[:pad] = 0
        for _ in range(G):
            comp, cmask = random_completion(C, vocab, g)
            ids.append(torch.cat([prompt, comp]))
            masks.append(torch.cat([pmask, cmask]))
    input_ids, attention_mask = torch.stack(ids), torch.stack(masks)
    if groups > 1:
        perm = torch.randperm(input_ids.size(0), generator=g)
        input_ids, attention_mask = input_ids[perm], attention_mask[perm]
    return input_ids, attention_mask, attention_mask[:, -C:]


# -------------------------------------------------------------------------------------------------------- providers
def _provider(name: str) -> Provider:
    if name not in PROVIDERS:
        raise ValueError(f"provider must be one of {tuple(PROVIDERS)}, got {name!r}")
    return PROVIDERS[name]


def _sharing_kwargs(fn: Callable, sharing: str) -> dict:
    """``{"sharing": sharing}`` when ``fn`` takes it, ``{}`` for "group" when it does not (the only mode then)."""
    if _accepts(fn, "sharing"):
        return {"sharing": sharing}
    if sharing != "group":
        raise ValueError(f"sharing mode {sharing!r} needs a grpo_mem whose {fn.__qualname__} takes 'sharing'")
    return {}


def make_logprob_fn(provider: str, model, C: int):
    """``fn(input_ids, attention_mask) -> (log_probs (B, C) fp32, entropies (B, C) fp32)`` for ``provider``, with
    gradients; one call scores one micro-batch on its own. Raises ValueError for an unknown provider."""
    import torch

    prov = _provider(provider)
    if provider == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=("log_probs", "entropy"))

        def fn(input_ids, attention_mask):
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            labels[:, :-C] = -100
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
            return out.log_probs[:, -C:], out.entropy[:, -C:]

    elif provider == "full_seq":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        backbone = model.get_decoder()
        head = model.get_output_embeddings()

        def fn(input_ids, attention_mask):
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            hidden = hidden[:, -C - 1 : -1]  # position t predicts token t + 1
            targets = input_ids[:, -C:]
            keep = attention_mask[:, -C:].bool()
            lp, ent, *_ = ChunkedLogProbFunction.apply(
                hidden[keep],
                head.weight,
                head.bias,
                targets[keep],
                1.0,
                _CHUNKED_LOGPROB_CHUNK_SIZE,
                None,
                1.0,
                ("log_probs", "entropy"),
            )
            zeros = hidden.new_zeros(keep.shape, dtype=torch.float32)
            return zeros.masked_scatter(keep, lp), zeros.masked_scatter(keep, ent)

    else:
        import grpo_mem

        kwargs = _sharing_kwargs(grpo_mem.shared_prompt_logprobs, prov.sharing)

        def fn(input_ids, attention_mask):
            return grpo_mem.shared_prompt_logprobs(model, input_ids, attention_mask, C, compute_entropy=True, **kwargs)

    return fn


def make_window_fn(
    provider: str, model, C: int, prompt_ids: list, prompt_masks: list, *, min_shared_tokens: int | None = None
):
    """A grpo_mem provider over the micro-batches of one gradient-accumulation window, as the TRL patch runs it:
    ``fn(input_ids, attention_mask)`` called once per micro-batch, in order, through a ``SharingSession`` whose window
    is ``prompt_ids``/``prompt_masks`` (per micro-batch, its (rows, P) prompt ids and mask); the window restarts after
    its last micro-batch. ``min_shared_tokens``: the tree mode's threshold (``PromptTrie``; default its own). Each
    prompt is forwarded once per window and backpropagated in the window's last backward.

    ``fn.prompt_passes_per_call`` (set after each completed window) counts prompt passes per window (for the tree
    mode, passes over trie nodes): calls of the input embedding inside ``fn`` other than each micro-batch's one
    completion pass (C > 1).

    Raises:
        ValueError: ``provider`` is not a grpo_mem provider.
    """
    from grpo_mem.model.sharing import SharingSession

    prov = _provider(provider)
    if prov.sharing is None:
        raise ValueError(f"a sharing window needs a grpo_mem provider, got {provider!r}")
    n_micro = len(prompt_ids)
    options = {} if min_shared_tokens is None else {"min_shared_tokens": min_shared_tokens}
    session, state = SharingSession(prov.sharing, **options), {"calls": 0, "prompt_passes": 0, "inside": False}

    def count(module, args, out):
        if state["inside"]:  # only this fn's calls, not other users of the model
            state["prompt_passes"] += 1

    model.get_input_embeddings().register_forward_hook(count)

    def fn(input_ids, attention_mask):
        if state["calls"] % n_micro == 0:  # the window's first micro-batch opens it
            session.begin_window(prompt_ids, prompt_masks)
        state["calls"] += 1
        state["inside"] = True
        try:
            lp, ent = session.score(model, input_ids, attention_mask, C, compute_entropy=True)
        finally:
            state["inside"] = False
        state["prompt_passes"] -= C > 1  # the micro-batch's completion pass
        if state["calls"] % n_micro == 0:
            fn.prompt_passes_per_call = state["prompt_passes"] / (state["calls"] // n_micro)
        return lp, ent

    return fn


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
        res = _measure_op(args, model, op, input_ids.device)
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


def _measure_op(args: dict, model, op, device) -> dict:
    """``op`` measured as :func:`measure_group` says (on CUDA by :mod:`grpo_mem.bench.harness_cuda`, with the device
    name and absolute peak), parameter gradients dropped before every call; the measurement as a dict."""
    from grpo_mem.bench import harness_cuda

    def setup():
        model.zero_grad(set_to_none=True)

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


def worker(args: dict) -> dict:
    """One (configuration, provider) in a fresh process (target ``grpo_mem.bench.group:worker`` of
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
    prov = _provider(args["provider"])
    model = build_model(args["model_config"], seed=seed, dtype=args.get("dtype", "float32")).to(device)
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

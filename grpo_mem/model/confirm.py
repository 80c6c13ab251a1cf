"""Numerical confirmation of what the capability rule admits: admitted means confirmed.

``support.unsupported_cause`` decides from the model's code and config whether the prompt-once path is exact. The
first time a model class is scored with a given architecture (its config's architecture-relevant fields), this
module confirms that decision on numbers: it builds a tiny random model of the same class from the user's config
(``tiny_config``: 2 layers, or enough to hold every kind of layer a per-layer list names; small hidden size, head
counts and vocabulary; the same flags; what the config class validates kept true; fp32; the same attention
implementation), runs its text backbone with every position moved (``shift_cause``: hidden states that move with
the positions depend on more than their distances, which the prompt-once passes do not keep), then scores one small
batch of prompts sharing a prefix (left padding, 2 completions each) on the prompt-once path (tree and group
sharing) and with the model's own forward, and compares log-probs, entropies, every parameter's gradient and, for a
model whose router loss the path reproduces, that loss and its gradients. A difference is a fallback cause; the verdict is kept per process, keyed by (class, attention implementation,
checkpointing, the tiny config). The prompt-once path is run as the session runs a shared micro-batch, without the
session (``_prompt_once``: a ``Window`` over a one-micro-batch ``WindowPlan``): this module sits below ``sharing``.

What the confirmation never does: touch the user's parameters (the copy is built from the config), change the
user's random streams (the copy is built inside ``torch.random.fork_rng`` from a fixed seed, its weights are drawn
from a private ``torch.Generator``), run collectives (the copy is unwrapped, unsharded, on CPU, built by its class's
constructor, which DeepSpeed ZeRO-3's ``zero.Init`` does not wrap). Being deterministic on its fixed seed, it
reaches the same verdict on every rank of a sharded run without communicating.

Covered alike: MoE models (the router loss too), Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) and vision-language
models (the class built from its whole tiny config, vision tower included, scored on text prompts; their image path
is not confirmed here). Not confirmed: a copy that cannot be built from the config at tiny sizes, or that raises, or
that the capability rule itself refuses, is a fallback cause (``UNBUILT``, named); flash-attention models are
confirmed with SDPA (the copy runs on CPU in fp32, which flash kernels do not take). Cost: about 0.1-0.6 s of CPU
per (class, architecture) on one thread (``Verdict.cpu_s``). Off: ``confirm=False`` (``patch_trl``,
``SharingSession``, ``shared_prompt_logprobs``) or ``GRPO_MEM_CONFIRM=0``, except with a transformers release outside
the tested range (``grpo_mem.versions.TESTED``), where it is always on: such a release serves only the model classes
the confirmation passes. This module knows torch and transformers, not TRL.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

import torch

from .. import versions
from ..ops._backends import RESOLVED
from . import attention_hook as attn_hook
from . import support
from .fallback import forward_params, full_sequence_logprobs
from .forward import ScoreOptions, config_state, forget_causes, pass_extensions, restore, run_in_forward
from .plan import WindowPlan
from .tiny_config import build_tiny, shrink, tiny_config
from .window import Window

__all__ = [
    "ENV",
    "Verdict",
    "confirm_cause",
    "confirmation",
    "enabled",
    "forget",
    "grad_difference",
    "shrink",
    "tiny_config",
    "verdicts",
]

ENV = "GRPO_MEM_CONFIRM"
"""Environment variable: ``0`` turns the confirmation off where no ``confirm=`` option is given."""

SEED = 1234
LOGP_ATOL = 1e-5  # log-probs and entropies (fp32, vocabulary 128: |log p| < 10, so ~100 fp32 ulps)
GRAD_RTOL = 1e-4  # per parameter, relative to the larger of its gradient's norm and GRAD_FLOOR x the global norm
GRAD_FLOOR = 1e-3
TEMPERATURE = 0.7
MAX_PARAMS = 16_000_000  # a tiny copy larger than this is not built (a config with sizes ``shrink`` does not know)
UNBUILT = "not confirmed: a tiny {cls} could not be built from the model's config ({error})"

# three prompts of 5-7 tokens sharing a 4-token prefix (a trie node of its own in tree sharing), 2 completions each
_PROMPTS = ([5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 20], [5, 6, 7, 8, 30, 31, 32])
_COMPLETION = 4
SHIFT = 7  # positions the shift check moves every token by
SHIFT_RTOL = 1e-4  # its largest hidden-state difference, relative to the largest hidden state (fp32 RoPE: ~1e-6)
SHIFTED = "hidden states depend on the absolute positions"  # in the shift check's cause
_MIN_SHARED_TOKENS = 3


@dataclass(frozen=True)
class Verdict:
    """The confirmation of one (class, architecture).

    Attributes:
        cause: why the prompt-once path is not confirmed (a fallback cause for every call), or None.
        router_cause: why the MoE router loss is not confirmed (a cause for calls asking for it), or None.
        cpu_s, wall_s: what the confirmation cost (process CPU time and wall time, seconds).
    """

    cause: str | None
    router_cause: str | None
    cpu_s: float
    wall_s: float


_VERDICTS: dict[tuple, Verdict] = {}
_NOT_ARCHITECTURE = frozenset({"_name_or_path", "name_or_path", "architectures", "transformers_version"})


def verdicts() -> dict[tuple, Verdict]:
    """The verdicts of this process, by key (class, attention implementation, checkpointing, tiny config JSON)."""
    return dict(_VERDICTS)


def forget() -> None:
    """Drop every verdict and every model's kept cause (``forward.model_cause``): the next scoring call of each model
    decides and confirms again."""
    _VERDICTS.clear()
    forget_causes()


def _build(cls, config, impl: str, checkpointed: bool, generator: torch.Generator):
    """The tiny model: ``cls`` from ``config`` on CPU in fp32, train mode, weights perturbed from ``generator`` (so
    that norm weights and scales initialised to constants differ per channel)."""
    # the class's own constructor, not ``from_config``: transformers wraps only the latter (and ``from_pretrained``) in
    # DeepSpeed ZeRO-3's ``zero.Init``, which would partition the copy across ranks (a collective)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.0f} M parameters at the tiny sizes (sizes the generic rule does not know)")
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(SEED)
        model = cls(config).float()
    model.set_attn_implementation(impl)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.mul_(1 + 0.2 * noise).add_(0.02 * torch.randn(p.shape, generator=generator))
    model.train()
    if checkpointed and model.supports_gradient_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def _batch(generator: torch.Generator, vocab: int):
    """(input_ids, attention_mask, C): the prompts left-padded, 2 completions each of 1-C random tokens."""
    P, C = max(len(p) for p in _PROMPTS), _COMPLETION
    ids, mask = [], []
    for prompt in _PROMPTS:
        for _ in range(2):
            row = torch.randint(4, vocab, (P + C,), generator=generator)  # junk in the padding
            m = torch.zeros(P + C, dtype=torch.long)
            row[P - len(prompt) : P] = torch.tensor(prompt)
            m[P - len(prompt) : P] = 1
            m[P : P + int(torch.randint(1, C + 1, (1,), generator=generator))] = 1
            ids.append(row)
            mask.append(m)
    return torch.stack(ids), torch.stack(mask), C


def _weights(generator: torch.Generator, shape) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _prompt_once(model, ids, mask, options: ScoreOptions, sharing: str):
    """(log-probs, entropies, aux loss | None) of ``model`` on the prompt-once path in mode ``sharing``, as
    ``SharingSession.run`` computes a shared micro-batch: a ``Window`` over the plan of one micro-batch, run inside
    one call of the model's forward (``run_in_forward``)."""
    C = options.logits_to_keep
    plan = WindowPlan.build(sharing, [ids[:, :-C]], [mask[:, :-C]], min_shared_tokens=_MIN_SHARED_TOKENS)
    window = Window(plan)

    def compute(causal_lm, input_ids, attention_mask):
        extensions, layout = pass_extensions(model, causal_lm, router=options.compute_aux_loss)
        return window.run(causal_lm, input_ids, attention_mask, options, extensions=extensions, layout=layout)

    return run_in_forward(model, model, compute, ids, mask)


def _scores(model, ids, mask, C, weights, *, sharing: str | None, aux: bool):
    """(log-probs, entropies, gradients of the weighted sum, aux loss | None, its gradients | None) of ``model`` on
    the prompt-once path in mode ``sharing`` (None: the model's own forward)."""
    options = ScoreOptions(logits_to_keep=C, temperature=TEMPERATURE, compute_entropy=True, compute_aux_loss=aux)
    if sharing is None:
        logps, entropy, aux_loss = full_sequence_logprobs(model, ids, mask, options)
    else:
        logps, entropy, aux_loss = _prompt_once(model, ids, mask, options, sharing)
    loss = (logps * weights[0]).sum() + (entropy * weights[1]).sum()
    loss.backward(retain_graph=aux)
    grads = _grads(model)
    aux_grads = None
    if aux:
        aux_loss.backward()
        aux_grads = _grads(model)
    return logps.detach(), entropy.detach(), grads, aux_loss, aux_grads


def grad_difference(ours: dict, ref: dict, rtol: float = GRAD_RTOL) -> str | None:
    """Which parameter's gradient differs most beyond ``rtol`` (described), or None: every parameter's gradient
    ``ours[name]`` within ``rtol`` of the larger of ``ref[name]``'s norm and ``GRAD_FLOOR`` x the global norm of
    ``ref`` (a parameter whose exact gradient is ~0, e.g. a key bias, is measured against the floor, not its noise).
    ``ours``/``ref``: parameter name -> gradient tensor."""
    missing = sorted(set(ref) ^ set(ours))
    if missing:
        return f"{missing[0]} has a gradient on one path only"
    total = sum(float(g.double().pow(2).sum()) for g in ref.values()) ** 0.5
    worst, worst_name = 0.0, None
    for name, r in ref.items():
        scale = max(float(r.double().norm()), GRAD_FLOOR * total, 1e-30)
        rel = float((ours[name].double() - r.double()).norm()) / scale
        if rel > worst:
            worst, worst_name = rel, name
    if worst > rtol:
        return f"the gradient of {worst_name} differs by {worst:.1e} of its norm"
    return None


def shift_cause(cls_name: str, model, ids) -> str | None:
    """Why the tiny ``model``'s hidden states depend on where its tokens sit, not only on their distances, or None.

    The prompt-once passes place a prompt at other positions than stock TRL (tree sharing keeps each node's position
    differences, which is all relative RoPE scores depend on), so the text backbone, run in eval mode without
    gradients on the tokens ``ids`` (1, T) (no padding) at ``position_ids`` 0 … T − 1 and again at ``SHIFT`` …
    ``SHIFT`` + T − 1, must give the same last hidden states, up to ``SHIFT_RTOL`` of their largest. Observed, not read:
    a learned transform of the rotated queries or keys (a norm with a weight after RoPE: HunYuan v1), a scale by the
    absolute position, absolute position tables. A backbone whose forward takes no ``position_ids`` has nothing to
    shift (None)."""
    base = attn_hook.language_model_of(model.base_model)[1] or model.base_model
    if "position_ids" not in forward_params(attn_hook.own_class(base)):
        return None
    positions = torch.arange(ids.shape[1])[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = [base(input_ids=ids, position_ids=positions + s, use_cache=False)[0] for s in (0, SHIFT)]
    finally:
        model.train(was_training)
    err = float((out[1] - out[0]).abs().max() / out[0].abs().max().clamp_min(1e-30))
    if not err <= SHIFT_RTOL:
        return (
            f"not confirmed: a tiny {cls_name}'s {SHIFTED} (every position moved by {SHIFT} changes them by "
            f"{err:.1e} of their largest): the prompt-once passes place prompts at other positions than stock"
        )
    return None


def _compare(cls_name: str, model, ids, mask, C, generator, aux: bool) -> tuple[str | None, str | None]:
    keep = mask[:, -C:].bool()
    weights = _weights(generator, (ids.shape[0], C))
    ref = _scores(model, ids, mask, C, weights, sharing=None, aux=aux)
    for sharing in ("tree", "group"):
        ours = _scores(model, ids, mask, C, weights, sharing=sharing, aux=aux)
        where = f"not confirmed: a tiny {cls_name} on the prompt-once path ({sharing} sharing)"
        for what, i in (("log-probs", 0), ("entropies", 1)):
            err = float(((ours[i] - ref[i]).abs() * keep).max())
            if not err <= LOGP_ATOL:
                return f"{where} differs from its own forward: {what} by {err:.1e}", None
        difference = grad_difference(ours[2], ref[2])
        if difference is not None:
            return f"{where} differs from its own forward: {difference}", None
        if aux:
            err = abs(float(ours[3]) - float(ref[3]))
            difference = (
                f"the router loss by {err:.1e}"
                if not err <= LOGP_ATOL * max(1.0, abs(float(ref[3])))
                else (grad_difference(ours[4], ref[4]))
            )
            if difference is not None:
                return None, f"{where} differs from its own forward in the router loss: {difference}"
    return None, None


def _tiny(config) -> tuple[object | None, str]:
    """(the tiny config of ``config``, its architecture fields as JSON), or (None, "unbuilt: " and why it could not
    be made)."""
    try:
        tiny = tiny_config(config)
        fields = {k: v for k, v in tiny.to_dict().items() if k not in _NOT_ARCHITECTURE}
        return tiny, json.dumps(fields, sort_keys=True, default=str)
    except Exception as e:  # transformers' config validation at the tiny values
        return None, f"unbuilt: {type(e).__name__}: {e}"


_TEXTS: dict[str, str] = {}  # ``forward.config_state`` -> its tiny config's text (``_tiny``), made once per config


def _key(causal_lm, cls) -> tuple:
    """The verdict key of ``causal_lm``: class, attention implementation (SDPA for flash attention: the copy runs on
    CPU), gradient checkpointing, tiny config text."""
    impl = attn_hook.inner_implementation(causal_lm)
    impl = "sdpa" if attn_hook._is_flash(impl) else impl
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in causal_lm.modules())
    state = config_state(causal_lm.config)
    text = _TEXTS.get(state)
    if text is None:
        text = _TEXTS[state] = _tiny(causal_lm.config)[1]
    return (f"{cls.__module__}.{cls.__qualname__}", impl, checkpointed, text)


def confirmation(causal_lm) -> Verdict:
    """The verdict for ``causal_lm`` (an unwrapped transformers causal LM the capability rule admits): computed on a
    tiny copy the first time its (class, architecture) is seen in this process, then taken from the cache."""
    cls = attn_hook.own_class(causal_lm)
    key = _key(causal_lm, cls)
    verdict = _VERDICTS.get(key)
    if verdict is not None:
        return verdict
    config, text = _tiny(causal_lm.config)
    error = text[len("unbuilt: ") :] if config is None else None
    wall, cpu = time.perf_counter(), time.process_time()
    resolved = dict(RESOLVED)
    generator = torch.Generator().manual_seed(SEED)
    cause = router_cause = None
    with torch.inference_mode(False), torch.enable_grad(), _no_autocast(), _one_thread():
        model = None
        if config is not None:
            try:  # one layer of each kind, or two where one cannot be built (``tiny_config.build_tiny``)
                model = build_tiny(causal_lm.config, lambda tiny: _build(cls, tiny, key[1], key[2], generator))
            except Exception as e:  # transformers' own model code at the tiny sizes
                error = f"{type(e).__name__}: {e}"
        if model is None:
            cause = UNBUILT.format(cls=cls.__name__, error=" ".join(str(error).split())[:160])
        else:
            admitted = support.unsupported_cause(model)
            if admitted is not None:
                cause = f"not confirmed: a tiny {cls.__name__} is not admitted ({admitted})"
            else:
                ids, mask, C = _batch(generator, model.config.get_text_config().vocab_size)
                cause = _shift_cause(cls.__name__, model, ids[:1, -C - len(_PROMPTS[0]) :])
                if cause is None:
                    cause, router_cause = _confirm_built(cls.__name__, model, ids, mask, C, generator)
        # the tiny copy's ops ran on CPU: what the user's model ran stays the record (``verify`` reports it)
        RESOLVED.clear()
        RESOLVED.update(resolved)
    verdict = Verdict(cause, router_cause, time.process_time() - cpu, time.perf_counter() - wall)
    _VERDICTS[key] = verdict
    return verdict


def _confirm_built(cls_name: str, model, ids, mask, C, generator) -> tuple[str | None, str | None]:
    """(cause, router cause) of the built tiny ``model``: ``_compare`` with the router loss where the model has one
    (``_router_confirmable``). A failure asking for the router loss refuses the router loss only, and the scores are
    compared again without it: a config whose layers are all dense (Flint's ``mlp_only_layers`` naming every layer)
    has no router logits, and its class's ``load_balancing_loss_func`` raises on none (transformers 5.24)."""
    aux = _router_confirmable(model)
    router_cause = None
    for ask in (True, False) if aux else (False,):
        try:
            cause, router = _compare(cls_name, model, ids, mask, C, generator, ask)
            return cause, router_cause or router
        except Exception as e:  # the tiny model's own forward or the path fails: nothing confirmed
            error = f"{type(e).__name__}: {e}"
            if ask:
                router_cause = f"not confirmed: the router loss of a tiny {cls_name} raised {error}"[:300]
        finally:
            restore(model)  # the attention hook is registered only while models run it
            model.zero_grad(set_to_none=True)
    return f"not confirmed: scoring a tiny {cls_name} raised {error}"[:300], router_cause


def _shift_cause(cls_name: str, model, ids) -> str | None:
    """``shift_cause``, or the cause naming what its run raised."""
    try:
        return shift_cause(cls_name, model, ids)
    except Exception as e:  # the tiny model's own forward
        return f"not confirmed: a tiny {cls_name}'s backbone raised {type(e).__name__}: {e}"[:300]


def _router_confirmable(model) -> bool:
    """Whether the model's forward can return a router loss (``output_router_logits``) that the prompt-once path
    reproduces (``router.router_loss_cause``); the router module is imported only for such a model."""
    if "output_router_logits" not in forward_params(type(model)) and not hasattr(
        model.config.get_text_config(), "output_router_logits"
    ):
        return False
    from .router import router_loss_cause

    return router_loss_cause(model) is None


@contextlib.contextmanager
def _one_thread():
    """Tiny ops on one intra-op thread: the copy's matrices are too small to split, and the threads of a busy machine
    would mostly wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _no_autocast():
    """Autocast off (CPU and CUDA) within the block: the tiny copy runs in fp32."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def enabled(option: bool | None) -> bool:
    """Whether to confirm: always with a transformers release outside the tested range (``grpo_mem.versions``:
    warned once, and only what the confirmation passes takes the prompt-once path); else ``option`` when given, else
    on unless the environment sets ``GRPO_MEM_CONFIRM=0``."""
    if not versions.check_tested("transformers"):
        return True
    return bool(option) if option is not None else os.environ.get(ENV, "1").strip() != "0"


def confirm_cause(causal_lm, *, compute_aux_loss: bool = False) -> str | None:
    """Why the numerical confirmation refuses ``causal_lm`` (``confirmation``), or None; with ``compute_aux_loss``
    also a router loss that was not confirmed."""
    verdict = confirmation(causal_lm)
    return verdict.cause or (verdict.router_cause if compute_aux_loss else None)

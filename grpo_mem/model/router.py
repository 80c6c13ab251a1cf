"""The MoE load-balancing (router aux) loss of a micro-batch scored on the prompt-once path.

Stock TRL 1.16 asks the backbone for ``output_router_logits`` and computes transformers'
``load_balancing_loss_func(router_logits, E, k, attention_mask)`` (Switch Transformer, arXiv 2101.03961, eqs. 4-6,
with Mixtral's top-k) over the (B, P + C) rows of each scored chunk. With z_{l,t} the router logits of MoE layer l at
token t, p_{l,t} = softmax(z_{l,t}) and m_t the attention mask:

    f_e = Σ_{l,t} m_t·[e ∈ topk_k(p_{l,t})] / Σ_{l,t} m_t      P_e = Σ_{l,t} m_t·p_{l,t,e} / Σ_{l,t} m_t
    loss = E·Σ_e f_e·P_e

Both factors are weighted means over tokens, so the sums need each token once with a weight: the number of stock rows
that hold it. A prompt token forwarded once by a node pass enters with weight "rows of the chunk whose prompt passes
through that node" (G for a group), a completion token with its completion mask, padding with 0 — the same sums as
stock's, up to summation order. Gradients flow through p (the top-k indicator has none), as in stock.

Which models compute this loss is recognised from the model's own modeling module: its ``load_balancing_loss_func``
must compute Mixtral's loss (the one TRL's fused head calls for every family, and the one the family modules of
transformers 5.x copy), judged by its numbers on random router logits, not by its source (``reproduces_loss``).
Anything else is a named fallback cause. ``RouterLoss`` is the window's
pass extension that records each pass's router logits and computes the loss. This module knows torch and
transformers, not TRL.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from . import attention_hook as attn_hook
from .attention_hook import own_class
from .extension import PassExtension

__all__ = [
    "RouterLoss",
    "RouterLossShape",
    "RouterTerm",
    "load_balancing_loss",
    "reproduces_loss",
    "router_logits_of",
    "router_loss_cause",
    "router_loss_shape",
]


# (E, k, layers, rows, tokens per row, masked): the cases a modeling module's loss must agree with
# ``load_balancing_loss`` on, in fp64 (one row fully padded but for one token, top-k of 1 and of more)
_LOSS_CASES = ((4, 2, 2, 3, 5, True), (6, 1, 1, 2, 4, False), (8, 3, 3, 2, 6, True))


@functools.cache
def reproduces_loss(fn) -> bool:
    """Whether ``fn`` (a modeling module's ``load_balancing_loss_func``) computes the loss ``load_balancing_loss``
    reproduces (transformers' Mixtral loss), judged by its numbers: called as ``fn(router_logits, E, k,
    attention_mask)`` on random fp64 router logits of several layers, with and without padding, it must return
    ``load_balancing_loss`` of the unpadded tokens within 1e-5 (relative; it sums in fp32). A function that raises, or whose numbers
    differ, is not recognised; one rewritten with the same math is."""
    generator = torch.Generator().manual_seed(0)
    for E, k, layers, rows, tokens, masked in _LOSS_CASES:
        logits = tuple(torch.randn(rows * tokens, E, generator=generator, dtype=torch.float64) for _ in range(layers))
        mask = torch.ones(rows, tokens, dtype=torch.long)
        if masked:
            mask[0, :-1] = 0
            mask[1:, : tokens // 2] = torch.randint(0, 2, (rows - 1, tokens // 2), generator=generator)
        try:
            got = fn(logits, E, k, mask if masked else None)
        except Exception:  # noqa: BLE001 - another signature or other code: not the loss reproduced
            return False
        want = load_balancing_loss([RouterTerm(logits, mask.flatten().double())], RouterLossShape(E, k))
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            return False
        if not abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want))):
            return False
    return True


@dataclass(frozen=True)
class RouterLossShape:
    """E (``num_experts``, the loss's number of bins and factor) and k (``num_experts_per_tok``) of a model."""

    num_experts: int
    top_k: int


def router_loss_shape(causal_lm) -> RouterLossShape:
    """E and k of ``causal_lm``'s text config, read as TRL 1.16's fused head reads them.

    Raises:
        ValueError: the config has no integer ``num_experts`` / ``num_experts_per_tok``.
    """
    config = causal_lm.config.get_text_config()
    values = [getattr(config, name, None) for name in ("num_experts", "num_experts_per_tok")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"num_experts and num_experts_per_tok must be positive ints, got {values}")
    return RouterLossShape(*values)


def router_loss_cause(causal_lm) -> str | None:
    """Why the prompt-once path cannot give ``causal_lm``'s router aux loss as stock computes it, or None.

    Recognised: the model's modeling module defines ``load_balancing_loss_func`` computing Mixtral's loss
    (``reproduces_loss``), the text config gives integer ``num_experts`` and ``num_experts_per_tok``, and the backbone
    records ``router_logits`` when asked for ``output_router_logits``.
    """
    cls = own_class(causal_lm)
    fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
    if fn is None:
        return f"{cls.__module__} defines no load_balancing_loss_func (no MoE router loss grpo_mem recognises)"
    if not reproduces_loss(fn):
        return f"{cls.__module__}.load_balancing_loss_func is not the router loss grpo_mem reproduces (Mixtral's)"
    try:
        router_loss_shape(causal_lm)
    except ValueError as err:
        return f"the router loss of {cls.__name__} has no expert counts in its config ({err})"
    recorded = getattr(own_class(causal_lm.base_model), "_can_record_outputs", None)
    if not isinstance(recorded, dict) or "router_logits" not in recorded:
        return f"{type(causal_lm.base_model).__name__} does not record router_logits"
    return None


def router_logits_of(output, tokens: int) -> tuple[torch.Tensor, ...]:
    """The per-layer router logits a backbone pass over ``tokens`` (n x S) tokens recorded: each (n*S, E).

    Raises:
        RuntimeError: the output holds no router logits, or one layer's are not (``tokens``, E).
    """
    logits = getattr(output, "router_logits", None)
    if not isinstance(logits, tuple) or not logits:
        raise RuntimeError(f"the backbone returned no router_logits for output_router_logits=True ({type(logits)})")
    for i, z in enumerate(logits):
        if not isinstance(z, torch.Tensor) or z.dim() != 2 or z.shape[0] != tokens:
            raise RuntimeError(
                f"router logits of MoE layer {i} have shape {tuple(getattr(z, 'shape', ()))}, expected ({tokens}, E)"
            )
    return logits


@dataclass
class RouterTerm:
    """Router logits of one pass and the weight of each of its tokens.

    Attributes:
        logits: per MoE layer, (N, E) router logits of the pass's N = n x S tokens (any float dtype).
        weights: (N,) float, how many stock rows of the scored chunk hold each token (0 for padding and for tokens
            of rows outside the chunk).
    """

    logits: tuple[torch.Tensor, ...]
    weights: torch.Tensor


def load_balancing_loss(terms: list[RouterTerm], shape: RouterLossShape) -> torch.Tensor:
    """The load-balancing loss of stock rows whose tokens are ``terms`` with multiplicities: equals transformers'
    ``load_balancing_loss_func(router_logits, E, k, attention_mask)`` on the rows themselves (each token as many
    times as its weight), without repeating anything. Returns a 0-d fp32 tensor on the first layer's device,
    differentiable in the router logits.

    Raises:
        ValueError: no term, or a term whose weights do not match its logits' rows.
    """
    if not terms or not terms[0].logits:
        raise ValueError("load_balancing_loss needs at least one term with router logits")
    device = terms[0].logits[0].device
    E, k = shape.num_experts, shape.top_k
    tokens_sum = torch.zeros(E, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for term in terms:
        w = term.weights.to(device=device, dtype=torch.float32)
        if any(z.shape[0] != w.numel() for z in term.logits):
            raise ValueError(f"weights of {w.numel()} tokens for router logits {[tuple(z.shape) for z in term.logits]}")
        w_k = w.repeat_interleave(k)
        for z in term.logits:
            probs = torch.softmax(z.to(device), dim=-1)
            _, selected = torch.topk(probs, k, dim=-1)
            tokens_sum = tokens_sum.scatter_add(0, selected.reshape(-1), w_k)
            prob_sum = prob_sum + (probs.float() * w[:, None]).sum(dim=0)
            total = total + w.sum()
    return torch.sum((tokens_sum / total) * (prob_sum / total)) * E


@dataclass(frozen=True)
class RouterLoss(PassExtension):
    """The window's pass extension for the MoE router loss: every pass asks the backbone for its router logits and
    keeps them (``PromptStates.extras["router"]``, per MoE layer ``(logits,)``), the completion pass runs all C
    tokens, and ``loss`` is ``load_balancing_loss`` over the passes the micro-batch's rows read, each node's tokens
    weighted by how many rows' prompts pass through it, and the completion tokens by the completion mask.

    Attributes:
        shape: E and k of the model (``router_loss_shape``).
    """

    shape: RouterLossShape
    name = "router"
    all_completion_tokens = True

    def call_kwargs(self, mb, spec, width):
        return {"output_router_logits": True}

    def record(self, mb, out, ctx, keeper, tokens):
        logits = router_logits_of(out, tokens)
        if keeper is not None:  # held like the pass's other outputs (``attention_hook.keep_alive``)
            logits = tuple(attn_hook.keep_alive(z, keeper) for z in logits)
        return {i: (z,) for i, z in enumerate(logits)}

    def loss(self, mb, completion, completion_mask):
        """The micro-batch's 0-d fp32 router loss.

        Raises:
            RuntimeError: a pass the rows read was forwarded without router logits (``compute_aux_loss`` changed
                within a window).
        """
        terms = []
        paths = [mb.window.plan.trie.path(leaf) for leaf in mb.leaves]
        for states, mask, rows in mb.window.table.read_by_rows(paths, mb):
            if not states.extras.get(self.name):
                raise RuntimeError(
                    "the MoE router loss is asked for, but a prompt pass it reads was forwarded without router "
                    "logits (compute_aux_loss must be the same for every micro-batch of a window)"
                )
            terms.append(
                RouterTerm(_by_layer(states.extras[self.name]), (mask * rows.to(mask.device)[:, None]).flatten())
            )
        terms.append(RouterTerm(_by_layer(completion[self.name]), completion_mask.flatten()))
        return load_balancing_loss(terms, self.shape)


def _by_layer(record: dict[int, tuple[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(record[i][0] for i in sorted(record))


def extension(causal_lm, call=None) -> RouterLoss:
    """The router-loss mechanism's pass extension (``mechanisms.TABLE``) for ``causal_lm``'s E and k.

    Raises:
        ValueError: the config has no integer ``num_experts`` / ``num_experts_per_tok`` (``router_loss_shape``).
    """
    return RouterLoss(router_loss_shape(causal_lm))

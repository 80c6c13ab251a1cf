"""The LM head judged by what the causal LM's forward computes, not by its source text.

grpo_mem scores completions from the backbone's last hidden state ``h`` with one linear layer and the config's logit
scale and soft cap (``head.logit_transform``; ``ops.linear_logprobs``: ``z = softcap * tanh((h W^T + b) * scale /
softcap)``). Whether the model's own forward makes its logits the same way is observed: its forward (the class's,
so no hook of the user's runs) is called once with the backbone replaced by a stand-in that returns known hidden
states and the output embeddings replaced by a narrow linear layer of the same vocabulary, and the logits it returns
must equal that formula on those hidden states. Whatever the forward adds between the backbone and the logits (a
multiplier, a division of the hidden states, a cap, a norm, a second head, a slice of the vocabulary) changes the
numbers and is named; the user's parameters are neither read nor touched and no collective runs (the stand-ins are
plain modules, on the device of the output embeddings, or the CPU for a model on the meta device). The swap is
undone before returning; the model must not be called from another thread meanwhile.
"""

from __future__ import annotations

import torch

from .attention_hook import own_class
from .head import logit_transform

__all__ = ["head_cause", "head_probe_cause"]

_TOKENS = 3
_WIDTH = 8  # the stand-in hidden size: the forward only passes the hidden states on, whatever their width
_SPREAD = 24.0  # the largest |logit| the probe makes before the soft cap (so the cap, or its absence, shows)


class _Output(dict):
    """The stand-in backbone's output: ``last_hidden_state`` (also at index 0); any other field reads None (the
    router logits an MoE forward turns into its auxiliary loss, ``past_key_values``, ...)."""

    def __getattr__(self, name):
        return self.get(name)

    def __getitem__(self, key):
        return self.get(key) if isinstance(key, str) else (self.get("last_hidden_state"),)[key]

    def to_tuple(self):
        return (self.get("last_hidden_state"),)


class _Backbone(torch.nn.Module):
    """Returns ``hidden`` whatever it is called with; counts its calls. Reads the real backbone's plain attributes
    (a multiplier, its config: Falcon-H1's ``self.model.lm_head_multiplier``), never its modules or tensors."""

    def __init__(self, hidden: torch.Tensor, real: torch.nn.Module):
        super().__init__()
        self.hidden, self.calls = hidden, 0
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(object.__getattribute__(self, "_real"), name)
            if isinstance(value, (torch.nn.Module, torch.Tensor)) or callable(value):
                raise AttributeError(f"the stand-in backbone does not lend the backbone's {name!r}") from None  # noqa: TRY004
            return value

    def forward(self, *args, **kwargs):
        self.calls += 1
        return _Output(last_hidden_state=self.hidden)


def _stand_ins(head: torch.nn.Linear, scale: float, device) -> tuple[torch.Tensor, torch.nn.Linear]:
    """Hidden states (1, _TOKENS, _WIDTH) and a linear layer (_WIDTH -> the head's vocabulary), fp32, drawn from a
    private generator and scaled so that the largest |scale * (h W^T + b)| is ``_SPREAD``."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, _TOKENS, _WIDTH, generator=generator)
    probe = torch.nn.Linear(_WIDTH, head.out_features, bias=head.bias is not None, device="meta")
    probe = probe.to_empty(device="cpu").requires_grad_(False)  # no draw from the global generator
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=generator))
        if probe.bias is not None:
            probe.bias.copy_(torch.randn(probe.bias.shape, generator=generator))
        peak = (torch.nn.functional.linear(hidden, probe.weight, probe.bias) * scale).abs().max()
        factor = _SPREAD / max(float(peak), 1e-6)
        probe.weight.mul_(factor)
        if probe.bias is not None:
            probe.bias.mul_(factor)
    return hidden.to(device), probe.to(device)


def _expected(hidden, probe, scale: float, softcap: float | None) -> torch.Tensor:
    """The completion head's logits for ``hidden`` (fp64)."""
    bias = None if probe.bias is None else probe.bias.double()
    z = torch.nn.functional.linear(hidden.double(), probe.weight.double(), bias) * scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def head_probe_cause(causal_lm, forward, base_name: str, head_name: str) -> str | None:
    """Why ``forward`` (the causal LM class's forward) does not make ``causal_lm``'s logits as grpo_mem's completion
    head does, or None (see the module docstring).

    Args:
        causal_lm: an unwrapped transformers causal LM whose output embeddings are a ``torch.nn.Linear``.
        forward: the function to call as ``forward(causal_lm, input_ids=..., attention_mask=...)``.
        base_name, head_name: the names of the backbone and of the output embeddings among its children.

    Returns:
        None, or the cause: the forward fails on the stand-ins, calls the backbone other than once, returns no
        (1, T, V) logits, or logits off by more than rounding (1e-4 of the largest logit in fp32, 2e-2 in a
        16-bit dtype) from the formula.
    """
    head = getattr(causal_lm, head_name)
    scale, softcap = logit_transform(causal_lm.config)
    device = head.weight.device if head.weight.device.type != "meta" else torch.device("cpu")
    hidden, probe = _stand_ins(head, scale, device)
    children = causal_lm._modules
    backbone = _Backbone(hidden, children[base_name])
    base, children[base_name], children[head_name] = children[base_name], backbone, probe
    ids = torch.zeros(1, _TOKENS, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            out = forward(causal_lm, input_ids=ids, attention_mask=torch.ones_like(ids))
    except Exception as e:  # noqa: BLE001 - a forward that cannot run on the stand-ins is named, not admitted
        return (
            f"the causal LM's forward could not be run on a stand-in backbone to observe its LM head "
            f"({type(e).__name__}: {' '.join(str(e).split())[:120]})"
        )
    finally:
        children[base_name], children[head_name] = base, head
    if backbone.calls != 1:
        return f"the causal LM's forward calls its backbone {backbone.calls} times, not once"
    logits = getattr(out, "logits", None)
    want = _expected(hidden, probe, scale, softcap)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != tuple(want.shape):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        return f"the causal LM's forward returns logits of shape {shape}, not {tuple(want.shape)} from its LM head"
    # the config's transform applied by the forward, or left to the fused head (TRL 1.16's reads it from the config
    # too: Aya Vision's forward before transformers 5.25 applies no logit scale); relative to each one's largest logit
    candidates = (want, _expected(hidden, probe, 1.0, None))
    error = min(float((logits.double() - c).abs().max()) / max(float(c.abs().max()), 1e-12) for c in candidates)
    if not error <= (1e-4 if logits.dtype in (torch.float32, torch.float64) else 2e-2):
        made = f"{scale:g} * {head_name}(hidden_states)"
        made = f"{softcap:g} * tanh({made} / {softcap:g})" if softcap is not None else made
        return (
            f"the causal LM's forward does not make its logits as grpo_mem's head does: they are off by {error:.3g} of the largest logit "
            f"from {made} (the config's logit scale and soft cap)"
        )
    return None


def head_cause(causal_lm) -> str | None:
    """Why the completion head (one linear layer on the backbone's last hidden state, then logit scale and softcap)
    would not compute ``causal_lm``'s own logits, or None: the output embeddings' interface here, what the forward
    computes from the backbone's output observed by ``head_probe`` (on stand-ins, never the user's parameters)."""
    base, head = causal_lm.base_model, causal_lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"the output embeddings are a {type(head).__name__}, not one linear layer"
    own_params = sorted(n for n, _ in head.named_parameters())
    if type(head).forward is not torch.nn.Linear.forward or not set(own_params) <= {"weight", "bias"}:
        extra = ", ".join(n for n in own_params if n not in ("weight", "bias")) or "its own forward"
        return f"the output embeddings are a {type(head).__name__}, a linear layer with more ({extra})"
    own = {id(p) for p in base.parameters()} | {id(p) for p in head.parameters()}
    extra = [n for n, p in causal_lm.named_parameters() if id(p) not in own]
    if extra:
        return f"the LM head has parameters beyond one linear layer ({extra[0]})"
    names = [n for n, m in causal_lm.named_children() if m is head]
    if not names:
        return "the output embeddings are not a direct child of the causal LM"
    bases = [n for n, m in causal_lm.named_children() if m is base]
    if not bases:
        return "the backbone is not a direct child of the causal LM"
    return head_probe_cause(causal_lm, own_class(causal_lm).forward, bases[0], names[0])

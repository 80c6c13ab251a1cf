"""Support by capability: every causal LM type transformers ships, built tiny, is exact or a named fallback.

For each type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model (fp32, train mode, non-reentrant gradient
checkpointing where supported) scores left-padded prompts with a shared prefix, 2 completions each, through the group
and the tree path. Where ``unsupported_cause`` is None, both must take the prompt-once path and match stock TRL 1.16
(``_get_per_token_logps_and_entropies``); otherwise both must fall back with that cause and match the model's own
forward (``model(input_ids, attention_mask).logits``). Log-probs and entropies within 1e-5, every parameter gradient
within 1e-4 of its scale (elementwise, and as a vector with a floor at 1e-3 of the global norm). Where the rule
admits a type, the runtime's confirmation (``grpo_mem.model.confirm``, on a copy built from the config with its
weights perturbed) must agree. The tiny configs are the runtime's (``confirm.shrink``), so a type the sweep cannot
build is one the runtime cannot confirm and refuses. Types that cannot be built tiny offline are reported with the
cause.

The fast suite runs ``FAST`` (every cause at least once); ``-m slow`` runs every type. The support table of
docs/supported-models.md is this sweep's output: ``python tests/model/test_architectures.py`` writes
``benchmarks/results/architectures.csv`` and prints the markdown rows; ``python benchmarks/docs_tables.py`` writes them
into the page.
"""

from __future__ import annotations

import csv
import os
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch
from helpers import REPO, grads_of, make_batch, stock_logps
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import grpo_mem
from grpo_mem.model.confirm import confirmation, grad_difference, shrink
from grpo_mem.model.sharing import SharingSession
from grpo_mem.model.fallback import isolated_fallbacks
from grpo_mem.model.support import unsupported_cause

TEMPERATURE = 0.7
# three prompts of 5-7 tokens sharing a 4-token prefix (left padding, and a trie node in tree mode), 2 completions
# each of up to 4 tokens
PROMPTS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 20], [5, 6, 7, 8, 30, 31, 32]]
MIN_SHARED_TOKENS = 3
MAX_PARAMS = 16_000_000


class NotBuilt(Exception):
    """The type cannot be built and run tiny here (the message says why)."""


def build_tiny(model_type: str):
    """A tiny random fp32 ``AutoModelForCausalLM`` of ``model_type``, built offline from its default config.

    Raises:
        NotBuilt: the config or model cannot be built at tiny sizes, or is still over ``MAX_PARAMS`` parameters.
    """
    try:
        base = AutoConfig.for_model(model_type)
        config = type(base).from_dict(shrink(base.to_dict()))
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if n > MAX_PARAMS:
            raise NotBuilt(f"{n / 1e6:.0f} M parameters at the tiny sizes (sub-configs keep their full sizes)")
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).float()
    except NotBuilt:
        raise
    except Exception as e:  # any failure of transformers' own config or model code at these sizes
        raise NotBuilt(f"{type(e).__name__}: {' '.join(str(e).split())[:160]}") from e


@dataclass
class Row:
    """One type's outcome: ``status`` "prompt-once", "fallback" or "not built"; ``cause`` the fallback's cause or why
    the type was not built; ``model_class`` the causal LM class built."""

    model_type: str
    status: str
    cause: str = ""
    model_class: str = ""


def _own_logps(model, ids, mask, C):
    """The model's own forward: (B, C) fp32 log-probs and entropies of the completion tokens, zero where masked."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -C - 1 : -1].float() / TEMPERATURE
    logsm = logits.log_softmax(-1)
    keep = mask[:, -C:].bool()
    logps = logsm.gather(-1, ids[:, -C:, None])[..., 0].masked_fill(~keep, 0.0)
    entropy = -(logsm.exp() * logsm).sum(-1).masked_fill(~keep, 0.0)
    return logps, entropy


def _ours(model, ids, mask, C, sharing):
    """grpo_mem's scores and the fallback causes recorded while computing them."""
    with isolated_fallbacks() as causes:
        if sharing == "group":
            logps, entropy = grpo_mem.shared_prompt_logprobs(
                model, ids, mask, C, temperature=TEMPERATURE, compute_entropy=True, sharing="group"
            )
        else:  # a window of one micro-batch whose trie has the 4-token prefix as a node of its own
            session = SharingSession("tree", min_shared_tokens=MIN_SHARED_TOKENS)
            session.begin_window([ids[:, :-C]], [mask[:, :-C]])
            logps, entropy = session.score(model, ids, mask, C, temperature=TEMPERATURE, compute_entropy=True)
    return logps, entropy, causes


def _assert_close(what, ours, ref, keep, atol=1e-5):
    err = ((ours - ref).abs() * keep).max()
    assert err <= atol, f"{what}: max |diff| {err:.3e} > {atol}"


def _assert_grads_close(what, ours, ref, rel=1e-4):
    """Every parameter's gradient within ``rel`` of its own scale, elementwise (max |diff| against its max) and as a
    vector (``confirm.grad_difference``: norm of the difference against its norm, floored at 1e-3 of the global
    norm); a parameter whose exact gradient is zero (e.g. a key bias, which softmax ignores) is measured against
    1e-3 of the largest gradient instead of its rounding noise."""
    assert ours.keys() == ref.keys(), f"{what}: gradients of different parameters {sorted(set(ours) ^ set(ref))[:4]}"
    difference = grad_difference(ours, ref, rel)
    assert difference is None, f"{what}: {difference}"
    top = max(float(r.abs().max()) for r in ref.values())
    for name, r in ref.items():
        scale = max(float(r.abs().max()), 1e-3 * top, 1e-30)
        err = float((ours[name] - r).abs().max())
        assert err <= rel * scale, f"{what}: {name} max |diff| {err:.3e} > {rel} x {scale:.3e}"


class _CauseFailed(Exception):
    """``unsupported_cause`` itself raised: a grpo_mem failure, never taken for one of the reference."""


def _cause(model):
    try:
        return unsupported_cause(model)
    except Exception as e:
        raise _CauseFailed(f"unsupported_cause raised {type(e).__name__}: {e}") from e


def check_architecture(model_type: str) -> Row:
    """Build ``model_type`` tiny and check both sharing modes against the right reference (see the module docstring).

    Raises:
        AssertionError: a wrong number, an unexpected path or cause, or a crash of grpo_mem where the reference runs.
    """
    try:
        model = build_tiny(model_type)
        model.train()
        if model.supports_gradient_checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        ids, mask, C, _ = make_batch(None, 2, 4, prompts=PROMPTS, shuffle=True, junk_in_padding=True)
        keep = mask[:, -C:].float()
        own, own_e = _own_logps(model, ids, mask, C)
        cause = _cause(model)
        if cause is None:  # stock TRL is the reference (and agrees with the model's own forward)
            verdict = confirmation(model)  # and the runtime's confirmation, on a copy built from the config, agrees
            assert verdict.cause is None, f"{model_type}: {verdict.cause}"
            ref, ref_e = stock_logps(model, ids, mask, C, temperature=TEMPERATURE, compute_entropy=True)
            _assert_close(f"{model_type} stock TRL vs own forward", ref.detach(), own.detach(), keep)
        else:
            ref, ref_e = own, own_e
        ref_g = grads_of(model, ref, ref_e)
    except NotBuilt as e:
        return Row(model_type, "not built", str(e))
    except (AssertionError, _CauseFailed):
        raise
    except Exception as e:  # the reference itself fails at these sizes: nothing to compare with
        message = " ".join(str(e).split())[:120]
        return Row(model_type, "not built", f"its own forward or backward fails tiny: {type(e).__name__}: {message}")
    for sharing in ("group", "tree"):
        logps, entropy, causes = _ours(model, ids, mask, C, sharing)
        assert causes == ([] if cause is None else [cause]), f"{model_type} {sharing}: fallbacks {causes}"
        what = f"{model_type} {sharing}"
        _assert_close(f"{what} log-probs", logps, ref, keep)
        _assert_close(f"{what} entropies", entropy, ref_e, keep)
        _assert_grads_close(what, grads_of(model, logps, entropy), ref_g)
    grpo_mem.restore(model)
    status = "prompt-once" if cause is None else "fallback"
    return Row(model_type, status, cause or "", type(model).__name__)


# every kind of outcome at least once: prompt-once (dense, MoE, logit scale/softcap, QK-norm, partial RoPE, Gated
# DeltaNet hybrid), and each family of fallback causes
FAST = [
    "llama",
    "qwen3_moe",
    "cohere",
    "granite",
    "olmo2",
    "phi3",
    "gpt_neox",  # prompt-once
    "gemma3_text",
    "qwen3_next",
    "recurrent_gemma",
    "mamba",
    "jamba",  # sliding window, Gated DeltaNet, recurrence
    "gpt_oss",
    "gpt2",
    "opt",
    "bloom",  # sinks, absolute positions, ALiBi
    "bert",
    "electra",
    "modernbert-decoder",
    "inkling_text",
    "bart",  # BERT-style, heads, encoder-decoder
    "llama4_text",  # no backbone returning last_hidden_state
]
ALL = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("model_type", FAST)
def test_architecture(model_type):
    row = check_architecture(model_type)
    assert row.status != "not built", f"{model_type}: {row.cause}"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in ALL if t not in FAST])
def test_architecture_sweep(model_type):
    check_architecture(model_type)


def test_remote_code_is_named_and_an_fsdp2_wrapper_class_is_not():
    """A causal LM class defined outside transformers (remote code) falls back by name; FSDP2's wrapper subclass,
    defined in torch, is looked through."""
    from helpers import tiny_model
    from torch.distributed.fsdp import FSDPModule
    from transformers import LlamaForCausalLM

    from grpo_mem.model.support import architecture_cause

    model = tiny_model("llama")
    assert architecture_cause(model) is None
    for module in [model, *model.model.layers]:  # what fully_shard does to each module it shards
        cls = type(module)
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": FSDPModule.__module__})
    assert architecture_cause(model) is None
    model.__class__ = type("RemoteLlama", (LlamaForCausalLM,), {"__module__": "transformers_modules.x"})
    assert architecture_cause(model) == "remote code (transformers_modules.x.RemoteLlama)"


def write_table(path: str) -> list[Row]:
    """Run the sweep over every type; write ``path`` (CSV: model_type, model_class, status, cause) and return the
    rows. A type whose check fails is written with status "FAILED" and the assertion, so the table never hides it."""
    rows = []
    for model_type in ALL:
        try:
            rows.append(check_architecture(model_type))
        except Exception as e:  # AssertionError, or grpo_mem crashing where the reference runs
            rows.append(Row(model_type, "FAILED", f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"))
        print(rows[-1], file=sys.stderr, flush=True)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["model_type", "model_class", "status", "cause"])
        out.writerows([r.model_type, r.model_class, r.status, r.cause] for r in rows)
    return rows


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    root = REPO
    table = write_table(os.path.join(root, "benchmarks", "results", "architectures.csv"))
    print("| model type | class | path | cause |\n|---|---|---|---|")
    for r in table:
        print(f"| `{r.model_type}` | {r.model_class} | {r.status} | {r.cause.replace('|', '/')} |")

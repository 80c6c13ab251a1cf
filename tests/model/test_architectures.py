"""Support by capability: every causal LM type transformers ships, built tiny, is exact or a named fallback.

For each type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model (fp32, train mode, non-reentrant gradient
checkpointing where supported) scores left-padded prompts with a shared prefix, 2 completions each, through the group
and the tree path. Where ``unsupported_cause`` is None, both must take the prompt-once path and match stock TRL 1.16
(``_get_per_token_logps_and_entropies``); otherwise both must fall back with that cause and match the model's own
forward (``model(input_ids, attention_mask).logits``). Log-probs and entropies within 1e-5, every parameter gradient
within 1e-4 of its scale (elementwise, and as a vector with a floor at 1e-3 of the global norm). Where the rule
admits a type, the runtime's confirmation (``grpo_mem.model.confirm``, on a copy built from the config with its
weights perturbed) must agree. The tiny configs are the runtime's (``grpo_mem.model.tiny_config``), so a type the sweep
cannot build is one the runtime cannot confirm and refuses: a type the rule admits that cannot be built or run tiny
fails the sweep (``helpers._admitted_unbuilt``). Other types that cannot be built tiny offline are reported with the
reason.

The check is ``helpers.check_architecture`` (``test_confirm`` runs it too). The fast suite runs ``FAST`` (every cause at least once); ``-m slow`` runs every type. The support table of
docs/supported-models.md is this sweep's output: ``python tests/model/test_architectures.py`` writes
``benchmarks/results/architectures.csv`` and prints the markdown rows (``... test_architectures.py TYPE ...``: those
rows only); ``python benchmarks/docs_tables.py`` writes them
into the page.
"""

from __future__ import annotations

import csv
import os
import sys
import warnings

import pytest
from helpers import REPO, ArchitectureRow, check_architecture
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# every kind of outcome at least once: prompt-once (dense, MoE, logit scale/softcap, QK-norm, partial RoPE, Gated
# DeltaNet hybrid, Mamba-1), and each family of fallback causes
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
    "recurrent_gemma",  # sliding window, Gated DeltaNet, recurrence
    "mamba",
    "falcon_mamba",
    "jamba",  # Mamba-1 state hand-off (Jamba: all-Mamba layers at the tiny size)
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


def write_table(path: str, only: list[str] | None = None) -> list[ArchitectureRow]:
    """Run the sweep over every type (``only``: over these, the other rows kept as ``path`` holds them); write ``path``
    (CSV: model_type, model_class, status, cause) and return the rows. A type whose check fails is written with status
    "FAILED" and the assertion, so the table never hides it.

    Raises:
        ValueError: a type of ``only`` that transformers does not ship as a causal LM.
    """
    unknown = sorted(set(only or ()) - set(ALL))
    if unknown:
        raise ValueError(f"not causal LM types of this transformers: {unknown}")
    kept = {}
    if only:
        with open(path, newline="") as f:
            kept = {r["model_type"]: ArchitectureRow(**r) for r in csv.DictReader(f)}
    rows = []
    for model_type in ALL:
        if only and model_type not in only and model_type in kept:
            rows.append(kept[model_type])
            continue
        try:
            rows.append(check_architecture(model_type))
        except Exception as e:  # AssertionError, or grpo_mem crashing where the reference runs
            rows.append(ArchitectureRow(model_type, "FAILED", f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"))
        print(rows[-1], file=sys.stderr, flush=True)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["model_type", "model_class", "status", "cause"])
        out.writerows([r.model_type, r.model_class, r.status, r.cause] for r in rows)
    return rows


if __name__ == "__main__":
    import argparse

    warnings.simplefilter("ignore")
    parser = argparse.ArgumentParser(description="The architecture sweep: one row per causal LM type.")
    parser.add_argument("types", nargs="*", help="only these types (the other rows kept as the table holds them)")
    parser.add_argument(
        "--out",
        default=os.path.join(REPO, "benchmarks", "results", "architectures.csv"),
        help="the CSV to write (default: benchmarks/results/architectures.csv, the newest tested transformers')",
    )
    cli = parser.parse_args()
    table = write_table(cli.out, cli.types or None)
    print("| model type | class | path | cause |\n|---|---|---|---|")
    for r in table:
        print(f"| `{r.model_type}` | {r.model_class} | {r.status} | {r.cause.replace('|', '/')} |")

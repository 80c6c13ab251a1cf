"""The run-time confirmation's tiny config (``confirm``): a model's config at tiny sizes that its config class still
validates, with the same flags and the same kinds of layers.

``tiny_config(config)`` takes the user's config (``PretrainedConfig``) and returns one of the same class: few layers
(``tiny_layers``: 2, or as many as it takes to hold every kind of layer the config's per-layer lists and layer-index
lists name, never more than the user's model has), the sizes of ``TINY_SIZES``, dropout and router jitter off, and
everything else as given. What transformers' strict config classes check stays true, by general rules rather than
per model type:

- every per-layer list (a list as long as the layer count: ``layer_types``, ``mlp_layer_types``,
  ``num_attention_heads_per_layer``, ...) is cut (or repeated) to the tiny layer count, and a per-layer list of sizes
  is scaled with its size (``num_attention_heads_per_layer`` with ``num_attention_heads``); a list whose length does
  not follow the layer count in the class's default config is kept whole (``fixed_lists``: Falcon-H1's five
  ``ssm_multipliers``); a list of layer indices (``mlp_only_layers``, ``hybrid_layer_ids``, ...) keeps the indices
  below it;
- a field the config class derives from others in ``__post_init__`` (Zamba2's ``mamba_headdim`` or Zamba's
  ``attention_head_dim``; found by building the config without it and comparing) is left out, so the class derives it
  again from the tiny sizes;
- Mamba-2's head identity, ``num_heads * head_dim == expand * hidden_size`` (``Mamba2Config``, ``BambaConfig``,
  ``GraniteMoeHybridConfig`` validate it), is kept by setting the head count from the tiny width and head size, with a
  group count that divides it;
- a router never picks more experts per token than the user's (ZAYA's config accepts only top-1);
- a kind of layer that cannot be built alone is built twice (``build_tiny``: Zamba's hybrid layers share one block).

This module knows transformers' config dicts, not models or TRL.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

__all__ = ["TINY_SIZES", "as_built", "build_tiny", "shrink", "tiny_config", "tiny_layers"]

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")
# a backbone split into sections whose layer counts sum to the layer count (Dory's recurrent middle section)
_SECTION_KEYS = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
# Mamba-2 heads: (expansion factor, head count, head size, group count) spellings; the width is expand x hidden size
_SSM_HEADS = (
    ("expand", "num_heads", "head_dim", "n_groups"),
    ("mamba_expand", "mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
)
MAX_LAYERS = 8
TINY_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    n_embd=64,
    d_model=64,
    intermediate_size=128,
    ffn_dim=128,
    n_inner=128,
    num_attention_heads=4,
    n_head=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    n_positions=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    rotary_dim=8,
    sliding_window=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=3,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    ffn_hidden_size=128,
    expert_ffn_hidden_size=32,
    zero_expert_num=2,
    moe_topk=2,
    num_experts_per_token=2,
    mamba_d_ssm=32,
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_d_state=16,
    mamba_chunk_size=8,
    linear_num_heads=4,
    linear_head_dim=16,
)
"""The sizes of a tiny config (``shrink``): every key present in the config with an integer value gets these."""
# sizes a config may leave None (derived from others); the tiny config sets them to a consistent value
_DERIVED = dict(head_dim=16, num_key_value_heads=4, num_experts_per_tok=2)
# experts per token: the tiny size or the user's, the smaller
_TOP_K = frozenset({"num_experts_per_tok", "moe_topk", "num_experts_per_token"})
# keys ``shrink`` sets itself: never taken for derived ones
_SET = frozenset(
    [*TINY_SIZES, *_LAYER_KEYS, *_SECTION_KEYS, *_TOKEN_KEYS, *sum(_SSM_HEADS, ())]
    + ["qk_head_dim", "n_group", "num_expert_group", "topk_group"]
)


def _index_list(key: str, v, full: int) -> bool:
    """Whether ``v`` is a list of layer indices (increasing, each below ``full``) under a key naming layers."""
    return (
        ("layer" in key or "idx" in key)
        and isinstance(v, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < full for i in v)
        and all(a < b for a, b in itertools.pairwise(v))
    )


def tiny_layers(
    d: dict, full: int | None, fixed: frozenset[str] = frozenset(), repeats: int = 1
) -> tuple[int, list[str], list[str]]:
    """(how many layers the tiny model keeps, the keys of ``d`` that are per-layer lists, the keys that are lists of
    layer indices) for a config dict ``d`` of ``full`` layers; the keys in ``fixed`` are lists of a fixed length that
    only happens to be ``full`` (``fixed_lists``).

    The count is the smallest that holds the first ``repeats`` layers of every kind a per-layer list or an index list
    tells apart (at least 2, at most ``MAX_LAYERS``, never more than ``full``), rounded up to an even count per section
    for a backbone split into sections (``n_input_layers``/``n_recurrent_layers``/``n_output_layers``).
    """
    if not full:
        return 2, [], []
    per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == full and k not in fixed]
    indices = [k for k, v in d.items() if k not in per_layer and _index_list(k, v, full)]
    patterns = [d[k] for k in per_layer] + [[i in d[k] for i in range(full)] for k in indices]
    n = 2
    for pattern in patterns:
        seen: list[str] = []
        for i, v in enumerate(pattern):
            if seen.count(repr(v)) < repeats:
                n = max(n, i + 1)
            seen.append(repr(v))
    n = min(n, MAX_LAYERS, full)
    if all(isinstance(d.get(k), int) for k in _SECTION_KEYS):  # an even number of layers per section (a config
        n = len(_SECTION_KEYS) * 2 * -(-n // (2 * len(_SECTION_KEYS)))  # may store each layer as two blocks)
    return n, per_layer, indices


def _per_layer(k: str, v: list, n: int, d: dict) -> list:
    """The per-layer list ``d[k] == v`` for ``n`` layers: cut or repeated; a list of sizes scaled as its size is
    (``intermediate_size`` itself, or ``num_attention_heads`` for ``num_attention_heads_per_layer``)."""
    v = [v[i % len(v)] for i in range(n)]
    size = k if k in TINY_SIZES else next((s for s in TINY_SIZES if k.startswith(s + "_per_layer")), None)
    if size is None or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    full = d.get(size) if isinstance(d.get(size), int) and d.get(size) else max(v)
    return [max(1, round(TINY_SIZES[size] * x / full)) for x in v]


def shrink(
    d: dict, derived: frozenset[str] = frozenset(), fixed: frozenset[str] = frozenset(), repeats: int = 1
) -> dict:
    """A config dict (``PretrainedConfig.to_dict()``, nested sub-configs included) at the tiny sizes (``TINY_SIZES``),
    dropout and router jitter off, every per-layer list and layer-index list fitted to the kept layers
    (``tiny_layers``; ``fixed``: lists that are not per-layer; ``repeats``: layers of each kind), Mamba-2's head identity kept, the keys in ``derived``
    left out (the config class derives them); every other field (the flags) as given."""
    key = next((k for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    full = d.get(key) if key else None
    n, per_layer, indices = tiny_layers(d, full, fixed, repeats)
    out = {}
    for k, v in d.items():
        if k in derived:
            continue
        if isinstance(v, dict) and "model_type" in v:
            out[k] = shrink(v)
        elif k in per_layer:
            out[k] = _per_layer(k, v, n, d)
        elif k in indices:
            out[k] = [i for i in v if i < n]
        elif k == key:
            out[k] = n
        elif k in _LAYER_KEYS and isinstance(v, int):
            out[k] = min(v, 2)
        elif isinstance(v, dict) and k.startswith("per_layer") and all(str(i).isdigit() for i in v):
            out[k] = {i: c for i, c in v.items() if int(i) < n}
        elif k in _TOP_K and isinstance(v, int) and not isinstance(v, bool):
            out[k] = min(v, TINY_SIZES[k])  # a top-1 router stays top-1 (ZAYA's config accepts only 1)
        elif k in TINY_SIZES and isinstance(v, int) and not isinstance(v, bool) or k in _TOKEN_KEYS:
            out[k] = TINY_SIZES[k]
        elif k in _DERIVED and v is None and key is not None:
            out[k] = _DERIVED[k]
        elif isinstance(v, float) and ("dropout" in k or "pdrop" in k or "jitter" in k):
            out[k] = 0.0
        else:
            out[k] = v
    if "qk_rope_head_dim" in out and "head_dim" in out:  # multi-head latent attention rotates head_dim channels
        out["head_dim"] = out["qk_rope_head_dim"]
    if "kv_lora_rank" in out and "num_key_value_heads" in out:  # latent attention: a key and value per query head
        out["num_key_value_heads"] = out.get("num_attention_heads")
    if isinstance(out.get("qk_head_dim"), int) and "qk_nope_head_dim" in out:  # stored, not derived
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    for groups in ("n_group", "num_expert_group"):  # group-limited routing: one group of the tiny experts
        if isinstance(out.get(groups), int):
            out.update({groups: 1, "topk_group": 1})
    _ssm_heads(out)
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and key is not None:
        out["rope_parameters"] = dict(rope, mrope_section=_split(rope["mrope_section"], _rotary_half(out)))
    if key is not None and all(isinstance(out.get(k), int) for k in _SECTION_KEYS):
        out.update({k: n // len(_SECTION_KEYS) for k in _SECTION_KEYS})
    return out


def _ssm_heads(out: dict) -> None:
    """Mamba-2's identity heads x head size == expand x hidden size, kept in place in the tiny config ``out``: the
    head size stays tiny, the head count follows from the width, the group count divides the head count. A config
    with its own SSM width (``mamba_d_ssm``, Falcon-H1) is left alone."""
    if "mamba_d_ssm" in out:
        return
    for expand, heads, dim, groups in _SSM_HEADS:
        values = [out.get(k) for k in (expand, heads, dim, "hidden_size")]
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            width = out[expand] * out["hidden_size"]
            out[heads] = max(1, width // out[dim])
            out[dim] = width // out[heads]
            if isinstance(out.get(groups), int) and out[groups] > 0:
                out[groups] = math.gcd(out[groups], out[heads])


def _rotary_half(d: dict) -> int:
    """Half the rotated channels of a head of the (tiny) text config ``d``."""
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    factor = d.get("partial_rotary_factor") or (d.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
    return int(head_dim * factor) // 2


def _split(sections: list[int], total: int) -> list[int]:
    """``sections`` (multi-axis RoPE's channels per axis) rescaled to sum to ``total``, each at least 1."""
    scaled = [max(1, round(s * total / sum(sections))) for s in sections]
    scaled[scaled.index(max(scaled))] += total - sum(scaled)
    return scaled


def derived_fields(config, d: dict) -> frozenset[str]:
    """The integer fields of ``config`` (its ``to_dict()`` is ``d``) that its class derives from other fields: an
    attribute that is no dataclass field of the class, or a field whose default is None or a string (``"auto"``), and
    that the config built again from ``d`` without it has with the same value. Fields ``shrink`` sets itself are not
    asked about."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(config))} if dataclasses.is_dataclass(config) else {}
    found = set()
    for k, v in d.items():
        if k in _SET or not isinstance(v, int) or isinstance(v, bool):
            continue
        if k in defaults and not (defaults[k] is None or isinstance(defaults[k], str)):
            continue
        try:
            again = type(config).from_dict({f: w for f, w in d.items() if f != k})
        except Exception:  # the class cannot do without it: not derived
            continue
        if getattr(again, k, None) == v:
            found.add(k)
    return frozenset(found)


def _default(config) -> dict | None:
    """The class's default config of ``config`` as a dict, or None where the class has none."""
    try:
        return type(config)().to_dict()
    except Exception:  # a class that cannot be built without arguments
        return None


def fixed_lists(config) -> frozenset[str]:
    """The list fields of ``config`` whose length does not follow the layer count: in the class's default config
    their length is not its layer count (Falcon-H1's five ``ssm_multipliers``, whatever the layer count)."""
    default = _default(config)
    if default is None:  # every list as long as the layer count is per-layer
        return frozenset()
    full = next((default[k] for k in _LAYER_KEYS if isinstance(default.get(k), int)), None)
    return frozenset(k for k, v in default.items() if isinstance(v, list) and len(v) != full)


def as_built(config, d: dict) -> dict:
    """``d`` (``config.to_dict()``) with each per-layer list cut to the layers the model has: a config whose layer
    count was lowered after it was made (``config.num_hidden_layers = 2``, as tests and held-out sweeps do) keeps
    its class's lists of the default length, of which the model reads the first entries only, while the class's
    validators ask for lists as long as the layer count (Laguna's ``num_attention_heads_per_layer``, the
    ``layer_types`` of Cohere 2 MoE, EXAONE-MoE, Kimi Linear, Mellum, MiMo-V2-Flash, MiniMax-M3). A per-layer list is
    one whose length is the layer count in the class's default config; lists of other lengths are left alone."""
    key = next((k for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    default = _default(config) if key is not None else None
    if default is None:
        return d
    full = next((default[k] for k in _LAYER_KEYS if isinstance(default.get(k), int)), None)
    per_layer = {k for k, v in default.items() if isinstance(v, list) and len(v) == full}
    return {k: v[: d[key]] if k in per_layer and isinstance(v, list) and len(v) > d[key] else v for k, v in d.items()}


def tiny_config(config, repeats: int = 1):
    """A config of the same class as ``config`` (a transformers ``PretrainedConfig``) at the tiny sizes
    (``shrink`` of its lists as the model has them, ``as_built``; its derived fields left to the class, ``repeats``
    layers of each kind), fp32.

    Raises:
        Exception: whatever transformers' config class raises for the tiny values (its validation).
    """
    d = config.to_dict()
    d.pop("dtype", None)
    d.pop("torch_dtype", None)
    d = as_built(config, d)
    return type(config).from_dict(shrink(d, derived_fields(config, d), fixed_lists(config), repeats))


def build_tiny(config, build):
    """``build(tiny config)`` of ``config`` with one layer of each kind (``tiny_config``), or, where that raises,
    with two: a kind whose weights its layers share cannot be built alone (Zamba ties every hybrid layer's shared
    transformer to the first one's, and transformers 5.24 raises when no other hybrid layer exists).

    Raises:
        Exception: what the config class or ``build`` raised for one layer of each kind, where two do not help.
    """
    try:
        return build(tiny_config(config))
    except Exception as first:  # the config's validation or the model's constructor at the tiny sizes
        try:
            again = tiny_config(config, repeats=2)
        except Exception:  # two layers of each kind are no config either: the first failure is the cause
            raise first from None
        if again.to_dict() == tiny_config(config).to_dict():
            raise
        try:
            return build(again)
        except Exception:  # two did not help: the first failure is the cause
            raise first from None

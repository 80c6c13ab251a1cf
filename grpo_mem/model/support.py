"""Whether the prompt-once path serves a model exactly.

``unsupported_cause`` names why a model (or a call) cannot take the prompt-once path, the fallback's cause (what
runs then, and the warning: ``grpo_mem.model.fallback``). The session keeps a model's cause until the model's state
changes (``forward.model_state``), so none of this runs per micro-batch. Support is decided from the model as built
(its modules, their forward methods, its config), not from a list of model types; ``tests/model/test_architectures.py``
checks the decision on every causal LM type transformers ships. This module knows transformers, not TRL.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch

from . import attention_hook as attn_hook
from . import mechanisms
from .attention_hook import language_model_of
from .fallback import forward_params
from .head_probe import head_cause

# RoPE variants whose frequencies do not depend on the sequence length (dynamic/NTK and longrope do; "proportional",
# of LFM3 and Gemma 4, leaves ``seq_len`` unused in transformers 5.24's ``_compute_proportional_rope_parameters``).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
SUPPORTED_ATTENTION = frozenset({"sdpa", "eager", "flash_attention_2", "flash_attention_3"})

# ---------------------------------------------------------------------------------------------- what the model is made of


def _takes_positions(cls: type) -> bool:
    """Whether ``cls.forward`` receives ``position_ids`` or the rotary ``position_embeddings`` made of them."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    return "position_embeddings" in params or "position_ids" in params


def _candidates(base, handed: list) -> list[tuple[str, torch.nn.Module]]:
    """The (name, module) of ``base``'s modules that may call an attention interface, asked by ``_observed_layers``:
    an integer ``layer_idx`` (by which the hook knows a call's layer), a ``config`` (which names the implementation a
    call looks up) and a forward taking ``attention_mask`` (what it hands the interface; not an MoE gate's), neither
    one of the recurrent layers ``handed`` on nor inside or around one."""
    inside = {id(d) for m in handed for d in m.modules()}
    return [
        (n, m)
        for n, m in base.named_modules()
        if isinstance(getattr(m, "layer_idx", None), int)
        and hasattr(m, "config")
        and "attention_mask" in forward_params(type(m))
        and not any(id(d) in inside for d in m.modules())
    ]


def _observed_layers(base, lists: list[str], candidates: set[int], handed: set[int]) -> tuple[dict, str | None]:
    """({id(candidate): its ``backbone_probe.AttentionCalls``}, None), or ({}, why the backbone does not run each
    decoder layer of its module lists ``lists`` once handing it its keyword arguments, nor each layer the modules
    that call the attention interface and its ``handed`` recurrent layers, or a layer could not be run). Observed
    by running the backbone on stand-in layers, then each layer holding ``candidates`` (ids of modules that may call
    the attention interface) or ``handed`` recurrent layers on its twin (``backbone_probe``), never read from
    source: a layer run several times per forward (recurrent loops) would record one K/V per layer in a prompt
    pass, and grpo_mem's context travels in the keyword arguments."""
    from .backbone_probe import PROBE_TOKEN, attention_calls, layer_calls

    name = type(base).__name__
    width = getattr(base.config, "hidden_size", None)
    width = width if isinstance(width, int) else base.get_input_embeddings().embedding_dim
    calls, error = layer_calls(base, lists, width)
    if error is not None:
        return {}, f"{name}'s forward could not be run on stand-in layers to observe how it calls them ({error})"
    ran = [c for c in calls.values() if c]
    if any(len(c) > 1 for c in ran):
        return {}, f"{name} runs its layers several times per forward (recurrent loops over layers)"
    if not ran or any(c[0].get(attn_hook.CTX_KWARG) != PROBE_TOKEN for c in ran):
        return {}, f"{name} does not pass its keyword arguments on to its layers"
    observed = {}
    for layer in (layer for n in lists for layer in getattr(base, n)):
        attention = [m for m in layer.modules() if id(m) in candidates and m is not layer]
        recurrent = [c for c in layer.children() if id(c) in handed]
        if not calls[id(layer)] or not (attention or recurrent) or (handed and _relayed(layer)):
            continue
        run, error = attention_calls(layer, attention, calls[id(layer)][0], width)
        if error is not None:
            return {}, f"{type(layer).__name__} could not be run on its twin to observe its attention ({error})"
        got = [r.handed for r in run.attention if r.interface] + [run.children.get(id(c)) for c in recurrent]
        if any(g is None or g.get(attn_hook.CTX_KWARG) != PROBE_TOKEN for g in got):
            return {}, f"{type(layer).__name__} does not pass its keyword arguments on to its attention"
        observed.update({id(m): r for m, r in zip(attention, run.attention, strict=True)})
    return observed, None


_POSITION_MODULE = re.compile(r"(^|\.)(wpe|embed_positions|position_embeddings|pos_emb\w*|positional_embedding\w*)$")
_CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.ConvTranspose1d)


def _relayed(layer) -> bool:
    from .handed import relayed_layer  # a Jamba Mamba layer, whose context ``mamba_state`` relays

    return relayed_layer(layer)


def _layers_cause(base, config, handed: list) -> tuple[str | None, list]:
    """(why the backbone's token mixing is not "every layer attends through the interface, by ``layer_idx``", the
    attention modules, each of which called the interface): the cause None where it is.

    Which modules call transformers' attention interface is observed (``_observed_layers``), not read from source.
    ``config``: the text config, which says what each attention module must hand the attention interface
    (``mechanisms.keywords``); ``handed``: the recurrent layers whose states are handed on (``_handed_layers``); an
    MLP or MoE block (its ``block_type``, Nemotron-H) mixes no tokens.
    """
    handed_ids = {id(m) for m in handed}
    within = tuple(n + "." for n, m in base.named_modules() if id(m) in handed_ids)
    candidates = _candidates(base, handed)
    reach = [n for n, _ in candidates] + [w[:-1] for w in within]
    lists = [
        n
        for n, m in base.named_children()
        if isinstance(m, torch.nn.ModuleList) and any(a.startswith(f"{n}.") for a in reach)
    ]
    depth = {f"{n}.{i}" for n in lists for i in range(len(getattr(base, n)))}
    inner = [(n, m) for n, m in candidates if any(n.startswith(f"{d}.") for d in depth)]
    if not candidates and not handed:
        return _no_interface_cause(base), []
    if not inner and any(_takes_state(m) for m in handed):  # a Mamba-1 backbone: its blocks relay the context
        from .mamba_state import backbone_cause

        return backbone_cause(base, handed, _no_interface_cause(base)), []
    for name, module in base.named_modules():
        if isinstance(module, _CONVOLUTIONS) and not name.startswith(within):
            return f"a convolution ({name}) outside the recurrent layers grpo_mem hands on", []
    outside = [(n, m) for n, m in candidates if n not in depth and not any(n.startswith(f"{d}.") for d in depth)]
    if outside:
        n, m = outside[0]
        return f"{type(m).__name__} ({n}, layer_idx {m.layer_idx}) sits outside the layer lists its backbone runs", []
    if not lists:
        return f"{type(base).__name__} holds its token-mixing layers in no module list of its own", []
    observed, cause = _observed_layers(base, lists, {id(m) for _, m in inner}, handed_ids)
    if cause is not None:
        return cause, []
    attention = [(n, m) for n, m in inner if observed.get(id(m)) is not None and observed[id(m)].interface]
    if not attention and not handed:
        return _no_interface_cause(base), []
    indices = [m.layer_idx for _, m in attention]
    if len(set(indices)) != len(indices):
        return "several attention modules share one layer_idx (a block shared between layers)", []
    calling = {id(m) for _, m in attention} | handed_ids
    for name in lists:
        for i, layer in enumerate(getattr(base, name)):
            if getattr(layer, "block_type", None) in ("mlp", "moe"):
                continue
            if not any(id(m) in calling for m in layer.modules()):
                return f"layer {i} ({type(layer).__name__}) mixes tokens without attention", []
    causes = (_attention_module_cause(m, config, bool(handed), observed[id(m)]) for _, m in attention)
    return next((c for c in causes if c is not None), None), [m for _, m in attention]


def _no_interface_cause(base) -> str:
    """The cause of a backbone whose attention does not go through transformers' attention interface, naming up to
    two of its classes with "Attention" in their name."""
    names = sorted({type(m).__name__ for m in base.modules() if "Attention" in type(m).__name__})
    named = ", ".join(names[:2]) or "no attention module"
    return f"attention is not computed through transformers' attention interface ({named})"


def _takes_state(module) -> bool:
    from .mamba_state import takes_state

    return takes_state(module)


def _attention_module_cause(module, config, beside_recurrent: bool, seen) -> str | None:
    """Why one attention ``module`` is out of reach (``beside_recurrent``: its backbone has handed layers; ``seen``:
    its ``backbone_probe.AttentionCalls`` in one run of its layer), or None: each
    keyword mechanism of ``mechanisms.TABLE`` the text ``config`` or the module asks for (a sliding window, logit
    softcapping, sinks) must reach the attention interface as its keyword."""
    from .backbone_probe import PROBE_TOKEN

    cls = attn_hook.own_class(module)
    if seen.own_registry:
        return f"{cls.__name__} dispatches through its own attention registry, not transformers'"
    calls = seen.interface
    if len(calls) > 1:
        return f"{cls.__name__} calls the attention interface more than once per layer (differential attention)"
    if not all(c.get(attn_hook.CTX_KWARG) == PROBE_TOKEN for c in calls):
        return f"{cls.__name__} does not pass its keyword arguments on to the attention interface"
    if not _takes_positions(cls) and not beside_recurrent:  # NoPE beside recurrent layers (Kimi's MLA, Jamba's)
        return f"{type(module).__name__} takes no position_ids or rotary position_embeddings"
    if "attention_scaling" in inspect.signature(cls.forward).parameters:  # Beam's (1 + position / 2048) ** 0.1
        return f"{cls.__name__} scales queries by the absolute position (attention_scaling from position_ids)"
    for mechanism in mechanisms.keywords():
        keyword = mechanism.keyword
        if mechanism.asks(config, module) and not all(keyword in c for c in calls):
            return f"{mechanism.name} applied outside the attention interface ({cls.__name__} passes no {keyword}=)"
    return None


_HANDED_LAYER_TYPES = ("linear_attention", "conv", "hybrid")  # "hybrid": Falcon-H1's attention beside Mamba-2


def _handed_layers(config, base) -> tuple[list, str | None]:
    """``handed.handed_layers(base)`` where ``layer_types`` name such layers, else ([], None), nothing imported."""
    if not set(_HANDED_LAYER_TYPES) & set(getattr(config, "layer_types", None) or ()):
        return [], None
    from .handed import handed_layers

    return handed_layers(base, config.hidden_size if isinstance(getattr(config, "hidden_size", None), int) else None)


def _layer_types_cause(config, handed: list) -> str | None:
    """Why the config's layer types are out of reach, or None.

    Sliding-window layers are served by the hook from what each module passes the attention interface (checked in
    ``_attention_module_cause``); ``linear_attention`` layers when the backbone has Gated DeltaNet layers whose states
    are handed on (``handed``, each checked in ``_layers_cause``); chunked and other layer types are not.
    """
    layer_types = set(getattr(config, "layer_types", None) or [])
    other = layer_types - {"full_attention", "sliding_attention"}
    if handed:  # every such layer is one of ``handed`` or a convolution outside them (``_layers_cause``); a "hybrid"
        # layer (Falcon-H1) runs attention and a Mamba-2 mixer side by side
        other -= set(_HANDED_LAYER_TYPES)
    other -= {"mlp", "moe"}  # blocks without token mixing (Nemotron-H), each checked in ``_layers_cause``
    if other:
        return f"layer types {sorted(other)} (chunked, linear-attention or other non-attention layers)"
    return None


def _positions_cause(config, base) -> str | None:
    """Why the model's positions are not RoPE (or none) over ``position_ids`` independent of the sequence length."""
    try:
        inputs = base.get_input_embeddings()
    except NotImplementedError:
        return "the backbone exposes no input embeddings"
    for name, module in base.named_modules():
        if module is not inputs and _POSITION_MODULE.search(name) and "Rotary" not in type(module).__name__:
            return f"absolute position embeddings ({name}): the prompt-once passes place positions differently"
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False):
        return "ALiBi position biases"
    rope = getattr(config, "rope_parameters", None) or {}
    ropes = [rope] if "rope_type" in rope or not all(isinstance(v, dict) for v in rope.values()) else rope.values()
    for r in ropes:
        rope_type = r.get("rope_type", "default") if isinstance(r, dict) else "default"
        if rope_type not in STATIC_ROPE_TYPES:
            return f"RoPE type {rope_type!r} depends on the sequence length"
    return None


# what the base model of a vision-language model must offer (``grpo_mem.model.multimodal`` calls these), and what its
# forward may hand its language model: embeddings with the image features merged in, positions, the mask (or the
# per-layer-type masks its forward built from the token types), and features added to the hidden states of the image
# tokens themselves (Qwen3-VL's deepstack), which the forward computes from the same call's image features: a prompt
# pass holds all of its prompts' image tokens
_VISION_METHODS = ("get_image_features",)
_MULTI_AXIS_METHODS = ("get_placeholder_mask", "compute_3d_position_ids")  # called by grpo_mem for M-RoPE models
_VISION_FORWARD_PARAMS = frozenset({"input_ids", "position_ids", "attention_mask", "mm_encoder_outputs"})
_LANGUAGE_MODEL_ARGS = frozenset(
    {
        "input_ids",
        "position_ids",
        "attention_mask",
        "past_key_values",
        "cache",
        "inputs_embeds",
        "use_cache",
        "return_dict",
        "visual_pos_masks",
        "deepstack_visual_embeds",
        attn_hook.CTX_KWARG,
    }
)


def _special_tokens(config) -> set[int]:
    """The token ids a config (and its text config) names (``*_token_id``, ``*_token_index``: image, video, ...)."""
    fields = {**config.to_dict(), **config.get_text_config().to_dict()}
    found = set()
    for key, value in fields.items():
        if key.endswith(("token_id", "token_index", "token_ids")):
            found.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    return found


def vision_language_cause(causal_lm) -> str | None:
    """Why the vision-language model ``causal_lm`` (a multi-config transformers model) cannot score image prompts on
    the prompt-once path, or None; its language model is then checked as a text model (``architecture_cause``).

    In: a base model with ``get_image_features`` and a language model (``language_model``/``text_model``), whose
    forward takes ``input_ids``, ``position_ids``, ``attention_mask`` and precomputed image features
    (``mm_encoder_outputs``: it merges features into the embeddings), calls its language model once, handing it its
    keyword arguments (grpo_mem's context among them), the ``position_ids`` it was given, and otherwise only merged
    embeddings, the mask and per-image-token additions (``_LANGUAGE_MODEL_ARGS``). Multi-axis positions come from the
    model's own ``compute_3d_position_ids`` (with ``get_placeholder_mask``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL). What the
    forward hands on is observed on a text prompt (``backbone_probe.language_model_calls``: its twin, the language
    model a recording stand-in), not read from its source. Out, named: models without that interface, computing
    positions of their own in place of those given or, given none, other than ``0 … T-1`` (PaliGemma's 1-based),
    or handing the language model anything else.
    """
    from .backbone_probe import ARGS, GIVEN, PROBE_TOKEN, language_model_calls

    base = causal_lm.base_model
    missing = [n for n in _VISION_METHODS if not callable(getattr(base, n, None))]
    name, language_model = language_model_of(base)
    if language_model is None:
        missing.append("language_model")
    if callable(getattr(base, "compute_3d_position_ids", None)):
        missing += [n for n in _MULTI_AXIS_METHODS if not callable(getattr(base, n, None))]
    if missing:
        return f"vision-language model without {', '.join(missing)} (the interface grpo_mem drives)"
    absent = sorted(_VISION_FORWARD_PARAMS - forward_params(attn_hook.own_class(base)))
    if absent:
        return f"vision-language model whose forward takes no {', '.join(absent)}"
    text = causal_lm.config.get_text_config()
    tokens = _special_tokens(causal_lm.config)
    calls, defaults, error = language_model_calls(base, name, text.hidden_size, text.vocab_size, tokens)
    if error is not None:
        return (
            f"vision-language model whose forward could not be run on its twin to observe its language model ({error})"
        )
    if len(calls) != 1:
        return f"vision-language model calling its language model {len(calls)} times per forward"
    handed = calls[0]
    if handed.get(attn_hook.CTX_KWARG) != PROBE_TOKEN:
        return "vision-language model not passing its keyword arguments on to its language model"
    extra = sorted(set(handed) - _LANGUAGE_MODEL_ARGS - {ARGS, GIVEN}) + (
        ["positional arguments"] if handed[ARGS] else []
    )
    if extra:
        return f"vision-language model handing its language model more than merged embeddings ({', '.join(extra)})"
    if not handed[GIVEN] or not _counted_from_zero(defaults[0].get("position_ids") if defaults else None):
        return "vision-language model computing its own positions in its forward"
    return None


def _counted_from_zero(positions) -> bool:
    """Whether ``positions`` a forward handed its language model when given none are none or ``0 … T-1`` on every
    axis and row (what the passes' own positions continue; PaliGemma's are 1-based)."""
    if not isinstance(positions, torch.Tensor) or positions.device.type == "meta":
        return positions is None
    rows = positions.reshape(-1, positions.shape[-1])
    return torch.equal(rows, torch.arange(positions.shape[-1]).expand_as(rows))


def architecture_cause(causal_lm) -> str | None:
    """Why ``causal_lm`` (an unwrapped transformers causal LM), as built, cannot take the prompt-once path, or None.

    In: a decoder-only stack whose every layer attends through transformers' attention interface with an integer
    ``layer_idx`` or is a recurrent layer whose states grpo_mem hands on (``handed``: Gated DeltaNet, short
    convolutions, Mamba-1 and Mamba-2 mixers) or an MLP/MoE block, causal attention (full or sliding-window per
    layer, with or without sinks and score softcapping, each handed to the attention interface as a keyword), RoPE
    (or no positions) from ``position_ids`` independent of the sequence length, and logits made by one linear layer
    on the last hidden state (plus the logit scale and softcap the completion head applies). Everything else is
    named: remote code, encoder-decoder models, encoders run as decoders (``is_decoder``), other
    recurrent/state-space/linear-attention, chunked-attention and convolution layers, absolute or ALiBi positions,
    other LM heads.
    """
    return _architecture(causal_lm)[0]


def _architecture(causal_lm) -> tuple[str | None, list]:
    """(``architecture_cause``, the modules observed to call the attention interface: none where a cause came before
    the observation)."""
    config = causal_lm.config
    cls = attn_hook.own_class(causal_lm)
    if not cls.__module__.startswith("transformers."):
        return f"remote code ({cls.__module__}.{cls.__name__})", []
    base = causal_lm.base_model
    if config.get_text_config() is not config:
        cause = vision_language_cause(causal_lm)
        if cause is not None:
            return cause, []
        config, base = config.get_text_config(), language_model_of(base)[1]
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder model", []
    if hasattr(config, "is_decoder"):
        return "an encoder run as a decoder (is_decoder, BERT-style)", []
    if base is causal_lm:
        return "the causal LM is its own base model (no backbone returning last_hidden_state)", []
    handed, cause = _handed_layers(config, base)
    cause = cause or _layer_types_cause(config, handed) or _positions_cause(config, base)
    if cause is not None:
        return cause, []
    cause, attention = _layers_cause(base, config, handed)
    return cause or head_cause(causal_lm), attention


def _reentrant_checkpointing(model) -> bool:
    """Whether a checkpointed layer of ``model`` would run reentrant checkpointing (which drops kwarg gradients)."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            func = module._gradient_checkpointing_func
            if not isinstance(func, functools.partial) or func.keywords.get("use_reentrant", True) is not False:
                return True
    return False


# dropout modules (TRL's ``disable_dropout=True`` sets the ``p`` of every ``nn.Dropout`` to 0, PEFT's ``lora_dropout``
# included), and probabilities a module keeps as attributes of its own for functional dropout, attention dropout or
# layer drop (``nn.functional.dropout(x, p=self.residual_dropout, training=self.training)``; TRL leaves those alone),
# and MoE router jitter (Mixtral's ``self.jitter_noise``: a random factor per token in training, drawn per row by stock)
_DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)
_DROP_NAME = re.compile(r"drop|jitter")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def dropout_cause(causal_lm) -> str | None:
    """Why dropout makes the prompt-once path differ from stock for ``causal_lm`` in its current mode, or None.

    Stock forwards every row's prompt and draws a dropout mask per row; a prompt forwarded once for its group draws
    one mask that every completion of the group shares: the same expectation over masks, other draws, other numbers.
    So any dropout active in a module in training mode falls back: a dropout module with ``p > 0`` (``nn.Dropout``
    and its variants, any ``*Dropout`` class with a ``p``; PEFT's ``lora_dropout``), or a positive number a module
    keeps as an attribute of its own named with "drop" or "jitter" (functional residual or hidden dropout, attention
    dropout, layer drop, MoE router jitter: set from the config when built, read by its forward), or the config's
    ``attention_dropout``. Read from the modules' attributes, not their forward's text: an attribute a forward
    leaves unread falls back too (DBRX's ``emb_pdrop``, where positive). The cause names the module and the value.
    """
    if causal_lm.training and getattr(causal_lm.config, "attention_dropout", 0.0):
        return "attention dropout is active"
    for name, module in causal_lm.named_modules():
        if not module.training:
            continue
        cls = type(module)
        if isinstance(module, _DROPOUT_MODULES) or cls.__name__.endswith("Dropout"):
            p = getattr(module, "p", None)
            if _positive(p):
                return (
                    f"dropout is active in training ({name}: {cls.__name__}(p={p:g})); stock draws a mask per "
                    f"row, a prompt forwarded once would share one across its group (TRL's disable_dropout=True "
                    f"sets nn.Dropout p to 0)"
                )
            continue
        for attr, value in vars(module).items():
            if _DROP_NAME.search(attr) and _positive(value):
                return (
                    f"dropout or noise is active in training ({name or cls.__name__}: {cls.__name__}.{attr} = "
                    f"{value:g}); stock draws it per row, a prompt forwarded once would share one draw across its "
                    f"group (TRL's disable_dropout leaves it)"
                )
    return None


def unsupported_cause(causal_lm, call: mechanisms.Call = mechanisms.CALL) -> str | None:
    """Why the prompt-once path cannot be exact for ``causal_lm`` (an unwrapped transformers causal LM) in a call
    bringing ``call`` (a ``mechanisms.Call``; default: nothing beside the model), or None: ``architecture_cause``,
    then what depends on its current state (attention implementation, reentrant checkpointing), then the admission
    answer of each mechanism of ``mechanisms.TABLE`` the model or the call brings (active dropout:
    ``dropout_cause``; the MoE router loss: ``router.router_loss_cause``)."""
    cause, attention = _architecture(causal_lm)
    if cause is not None:
        return cause
    inner = attn_hook.inner_implementation(causal_lm)
    if inner not in SUPPORTED_ATTENTION:
        return f"attention implementation {inner!r}"
    if inner == "eager":
        for module in attention:
            if attn_hook.module_eager(module) is None:
                return f"eager attention of {type(module).__name__} is not its modeling file's eager_attention_forward"
    if _reentrant_checkpointing(causal_lm):
        return "reentrant gradient checkpointing drops gradients of tensors passed as kwargs"
    causes = (
        mechanisms.resolve(m.cause)(causal_lm) for m in mechanisms.TABLE if m.cause and m.present(causal_lm, call)
    )
    return next((c for c in causes if c is not None), None)

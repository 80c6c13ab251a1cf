"""Gated DeltaNet (Qwen3.5, Qwen3-Next) layers on the prompt-once path: each node's recurrent and convolution state at
its last real token, handed to the rows that continue it; log-probs, entropies and gradients against TRL 1.16's own
computation, fp32."""

import warnings

import pytest
import torch
from helpers import (
    VOCAB,
    CountPasses,
    assert_close,
    assert_weights_close,
    check_against_stock,
    check_window_against_stock,
    make_batch,
    random_tokens,
    tiny_model,
    train_recorded,
)
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

import grpo_mem
from grpo_mem.model import attention_hook as attn_hook
from grpo_mem.model.linear_attention import LinearContext, hands_off_state, install
from grpo_mem.model.support import unsupported_cause

SYSTEM, SHOTS_A, SHOTS_B = random_tokens(40, 1), random_tokens(11, 2), random_tokens(2, 3)
# own parts of 1 and 2 tokens are shorter than the convolution's K − 1 = 3: their continuations convolve with tokens of
# the node above (and, after a 2-token block, of the system prompt), crossing two node boundaries
TREES = {
    "system": [SYSTEM + random_tokens(5, 10), SYSTEM + random_tokens(9, 11), SYSTEM + random_tokens(1, 12), SYSTEM],
    "three_levels": [
        SYSTEM + SHOTS_A + random_tokens(4, 20),
        SYSTEM + SHOTS_A + random_tokens(1, 21),
        SYSTEM + SHOTS_B + random_tokens(2, 22),
        SYSTEM + SHOTS_B + random_tokens(6, 23),
    ],
}
PASSES = {"system": [[40], [1, 5, 9]], "three_levels": [[40], [2, 11], [1, 2, 4, 6]]}


def qwen3_next(seed=0):
    """A tiny random Qwen3-Next: Gated DeltaNet, full attention, Gated DeltaNet; MoE MLPs."""
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=12,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=1,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        max_position_embeddings=256,
    )
    return Qwen3NextForCausalLM(config).float()


def _model(arch, checkpointing):
    model = tiny_model("qwen3_5", layers=3) if arch == "qwen3_5" else qwen3_next()
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def assert_grads_near(ours: dict, ref: dict, rel=1e-4):
    """Every parameter's gradient within ``rel`` of its own scale, that scale floored at 1e-3 of the largest gradient:
    a decay parameter's gradient (``A_log``, ``dt_bias``) is a small sum of large cancelling terms, whose fp32 rounding
    stock TRL's own computation shows against an fp64 truth (≈1e-4 of the sum)."""
    assert ours.keys() == ref.keys(), sorted(set(ours) ^ set(ref))
    top = max(float(r.abs().max()) for r in ref.values())
    for name, r in ref.items():
        scale = max(float(r.abs().max()), 1e-3 * top)
        err = float((ours[name] - r).abs().max())
        assert err <= rel * scale, f"{name}: max |diff| {err:.3e} > {rel} x {scale:.3e}"


# ----------------------------------------------------------------------------------------------------------------------
# support and the recorded states
# ----------------------------------------------------------------------------------------------------------------------


def test_gated_deltanet_models_are_supported_by_capability():
    for model in (tiny_model("qwen3_5", layers=3), qwen3_next()):
        assert unsupported_cause(model) is None
        linear = [m for m in model.modules() if hands_off_state(m)]
        assert [m.layer_idx for m in linear] == [0, 2]


def test_layer_wrappers_are_removed_by_restore_and_contexts_are_checked():
    model = tiny_model("qwen3_5", layers=3)
    ids, mask, C, _ = make_batch([4, 6], 2, 3)
    grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    layers = [m for m in model.modules() if hands_off_state(m)]
    assert all("forward" in m.__dict__ for m in layers)  # wrapped while taken over
    grpo_mem.restore(model)
    assert not any("forward" in m.__dict__ or "_grpo_mem_linear_forward" in m.__dict__ for m in layers)
    with pytest.raises(ValueError, match=r"lengths must name 2 rows, got 3"):
        LinearContext(batch=2, lengths=[1, 2, 3])
    with pytest.raises(ValueError, match=r"reader rows must lie in \[0, 2\), got \[0, 2\]"):
        LinearContext(batch=2, lengths=None, sources=[({}, torch.tensor([0, 2]), torch.tensor([0, 1]))])


ROWS = [random_tokens(n, 40 + n) for n in (9, 1, 5, 2)]


def root_pass_states(model, install_layers=install) -> dict:
    """Per layer, the (conv, recurrent) states a root pass of ``model`` (eval, no grad) over ``ROWS``, right-padded
    with junk, records at each row's last real token; ``install_layers`` wraps the layers."""
    S = max(map(len, ROWS))
    ids = torch.tensor([r + [7] * (S - len(r)) for r in ROWS])  # junk padding
    mask = torch.tensor([[1] * len(r) + [0] * (S - len(r)) for r in ROWS])
    impl = attn_hook.take_over(model)
    install_layers(model)
    try:
        ctx = attn_hook.PromptCapture(linear=LinearContext(batch=len(ROWS), lengths=list(map(len, ROWS)), capture={}))
        with torch.no_grad():
            model.base_model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=torch.arange(S).expand(len(ROWS), -1),
                use_cache=False,
                grpo_mem_ctx=attn_hook.context_token(ctx),
            )
    finally:
        attn_hook.hand_back(model, impl)
    return ctx.linear.capture


def test_node_states_are_the_models_own_states_at_each_rows_last_token():
    """A root pass over right-padded rows of 1 to 9 tokens records, per linear layer and row, the model's own cache
    states after the row's last real token: padding neither decays the recurrent state nor enters the convolution's."""
    model = tiny_model("qwen3_5", layers=3).eval()
    capture, rows = root_pass_states(model), ROWS
    assert sorted(capture) == [0, 2]
    for b, row in enumerate(rows):
        with torch.no_grad():
            cache = model(input_ids=torch.tensor([row]), use_cache=True).past_key_values
        for layer, (conv, recurrent) in capture.items():
            K = model.model.layers[layer].linear_attn.conv_kernel_size
            own_conv = cache.layers[layer].conv_states[0][..., -(K - 1) :]  # the cache keeps the last K inputs
            assert_close(conv[b : b + 1], own_conv, 1e-6, f"conv state, layer {layer}, row {b}")
            assert_close(recurrent[b : b + 1], cache.layers[layer].recurrent_states[0], 1e-6, f"state {layer} {b}")


# ----------------------------------------------------------------------------------------------------------------------
# exactness against stock TRL
# ----------------------------------------------------------------------------------------------------------------------


def _check(model, ids, mask, C, sharing, monkeypatch=None):
    """Stock TRL's numbers and ours (a one-micro-batch window; tree nodes from 2 shared tokens) agree."""
    count = CountPasses(monkeypatch) if monkeypatch is not None else None
    check_against_stock(model, ids, mask, C, sharing, assert_grads=assert_grads_near)
    return count


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_group_sharing_matches_stock_trl(arch, checkpointing):
    """Left-padded prompts of 2 to 9 tokens (junk in the padding), 3 completions each, shuffled: every completion
    starts from its prompt's states, and the prompt's gradient comes back through them."""
    model = _model(arch, checkpointing)
    ids, mask, C, _ = make_batch([5, 9, 2, 7], 3, 6, shuffle=True, junk_in_padding=True)
    _check(model, ids, mask, C, "group")


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_tree_sharing_matches_stock_trl(monkeypatch, checkpointing, tree):
    """A shared system prompt forwarded once; its states start every node below it, whose own states (nodes of
    different lengths in one pass, some shorter than the convolution) start the nodes and completions below them."""
    model = _model("qwen3_5", checkpointing)
    ids, mask, C, _ = make_batch(None, 3, 6, prompts=TREES[tree], shuffle=True, junk_in_padding=True)
    count = _check(model, ids, mask, C, "tree", monkeypatch)
    assert count.passes == PASSES[tree]


def hybrid_model(model_type: str, kinds: list[str], checkpointing: bool = False, **sizes):
    """A tiny random ``model_type`` of three layers ``kinds`` (two of them recurrent, whose states are handed on),
    hidden 48, 4 heads, in train mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
    ids = dict(max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = AutoConfig.for_model(model_type, layer_types=kinds, **common, **ids, **sizes)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    assert sum(hands_off_state(m) for m in model.modules()) == 2
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


@pytest.mark.parametrize("arch", ["lfm2", "lfm3"])
@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_short_convolutions_match_stock_trl(arch, sharing):
    """LFM2/LFM3 short convolutions (kernel K = 3, two tokens of state): a node's last K − 1 convolution
    inputs start the rows that continue it; in the three-level tree own parts of 1 and 2 tokens convolve across two
    node boundaries. Gradient checkpointing on for LFM3."""
    kinds = ["conv", "full_attention", "conv"]
    sizes = dict(block_ff_dim=96, num_key_value_heads=2, conv_L_cache=3)
    model = hybrid_model(arch, kinds, checkpointing=arch == "lfm3", **sizes)
    assert unsupported_cause(model) is None
    prompts = TREES["three_levels"] if sharing == "tree" else None
    ids, mask, C, _ = make_batch(prompts or [5, 9, 2, 7], 3, 6, prompts=prompts, shuffle=True, junk_in_padding=True)
    _check(model, ids, mask, C, sharing)


def test_a_short_convolution_with_an_input_bias_is_refused_by_name():
    """LFM2 with ``conv_bias=True``: its input projection's bias reaches the convolution at left padding, so stock's
    log-probs of a prompt depend on how much padding precedes it (shown here: 0 vs 2 padding tokens); the layer is
    refused by name rather than served with other numbers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "lfm2", layer_types=["conv", "full_attention"], vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, conv_bias=True,
        block_ff_dim=96, pad_token_id=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.model.layers[0].conv.in_proj.bias.normal_()  # transformers initialises it to zero
    tokens = torch.tensor([[5, 9, 11, 13]])
    with torch.no_grad():
        bare = model(tokens, attention_mask=torch.ones_like(tokens)).logits[0]
        padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), tokens], 1)
        mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
        behind_padding = model(padded, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits[0]
    assert float((behind_padding[2:] - bare).abs().max()) > 1e-3  # stock's own numbers move with the padding
    assert unsupported_cause(model) == (
        "Lfm2ShortConv (layer 0) has an input projection bias (in_proj.bias): stock feeds it into the convolution at "
        "each left-padding position, so its prompts' first tokens depend on the batch's padding"
    )


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_kimi_delta_attention_matches_stock_trl(sharing):
    """Kimi Linear: KDA layers hand on their convolution and recurrent states like Gated DeltaNet; in the
    three-level tree a 1-token node runs KDA's single-token path, which updates the convolution state it read in
    place (that copy is the node's final state). Its NoPE attention is admitted (no positions declared). Checkpointing
    on in the tree case."""
    kinds = ["linear_attention", "full_attention", "linear_attention"]  # KDA, MLA without RoPE, KDA
    sizes = dict(linear_num_heads=2, linear_head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    model = hybrid_model(
        "kimi_linear", kinds, sharing == "tree", moe_intermediate_size=48, num_key_value_heads=4, **sizes
    )
    assert unsupported_cause(model) is None
    prompts = TREES["three_levels"] if sharing == "tree" else None
    ids, mask, C, _ = make_batch(prompts or [5, 9, 1, 7], 3, 6, prompts=prompts, shuffle=True, junk_in_padding=True)
    _check(model, ids, mask, C, sharing)


def check_window(monkeypatch, model, prompt_sets, C) -> list[list[int]]:
    """One window of micro-batches (2 completions per prompt of ``prompt_sets``, one list per micro-batch): log-probs
    and entropies of each micro-batch within 1e-5 of stock TRL's, the window's gradient within 1e-4 of stock's summed
    over its micro-batches, every kept pass released; returns the passes' node lengths."""
    batches = [
        make_batch(None, 2, C, prompts=p, seed=i, shuffle=True, junk_in_padding=True)[:2]
        for i, p in enumerate(prompt_sets)
    ]
    count = CountPasses(monkeypatch)
    check_window_against_stock(model, batches, C, assert_grads=assert_grads_near)
    return count.passes


def test_window_carries_states_across_micro_batches(monkeypatch):
    """Micro-batches of one optimizer step share the system prompt and split groups (gradient checkpointing on):
    each node is forwarded once per window and its states are read by later micro-batches through the store; the
    window's gradient equals stock TRL's summed over its micro-batches."""
    fam = TREES["three_levels"]
    prompt_sets = [[fam[0], fam[2]], [fam[0], fam[1]], [fam[3], fam[1]], [fam[2]]]
    passes = check_window(monkeypatch, _model("qwen3_5", True), prompt_sets, 5)
    assert sorted(t for p in passes for t in p) == sorted([40, 11, 2, 4, 1, 2, 6])


# ----------------------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------------------

SYSTEM_TEXT = "Read the question twice, keep the answer short and plain, then stop: "  # a token a character, >= 64


def test_patched_training_on_qwen3_5_matches_stock(tmp_path, monkeypatch):
    """Three GRPO steps on a tiny Qwen3.5 (Gated DeltaNet, full attention), gradient accumulation 2, each step's 2
    groups of 4 shuffled over its 2 micro-batches, a shared system prompt: the system prompt is forwarded once per
    step (tree sharing), and the weights after training equal stock TRL's within 1e-5."""
    from helpers import PROMPTS

    args = dict(
        max_steps=3,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        optim="sgd",
        arch="qwen3_5",
        prompts=[SYSTEM_TEXT + p for p in PROMPTS],
    )
    stock, stock_rec = train_recorded(tmp_path / "stock", "grpo", patch=False, **args)
    count = CountPasses(monkeypatch)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        ours, ours_rec = train_recorded(tmp_path / "ours", "grpo", patch=True, group_shuffle=True, **args)
    assert ours.state.global_step == stock.state.global_step == 3
    assert sum(p.count(len(SYSTEM_TEXT)) for p in count.passes) == 3, count.passes
    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_near(g_ours, g_stock, 1e-4)
    assert_weights_close(ours.model, stock.model, 1e-5)


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_all_linear_attention_configuration(sharing):
    """A Qwen3.5 configuration whose every layer is Gated DeltaNet (no attention module at all): admitted beside its
    handed layers, the prompt's states alone carry it to the completions."""
    model = tiny_model("qwen3_5", layers=1)
    assert model.config.layer_types == ["linear_attention"] and unsupported_cause(model) is None
    prompts = TREES["system"] if sharing == "tree" else None
    ids, mask, C, _ = make_batch(prompts or [5, 9, 2, 7], 2, 4, prompts=prompts, shuffle=True, junk_in_padding=True)
    _check(model, ids, mask, C, sharing)


@pytest.mark.parametrize("where", ["forward", "state function"])
def test_a_layer_a_hub_kernel_took_over_is_refused_by_name(where):
    """``from_pretrained(use_kernels=True)`` (transformers 5.25's default where the ``kernels`` package is installed)
    lets ``kernels.kernelize`` replace a layer's forward, or from 5.25 a function it hands its cache to
    (``causal_conv1d_forward`` in the layer's ``_kernel_funcs``), and leaves the kernel's repository in that module's
    ``_kernel_repo``: such a layer handles the cache itself, so it is refused by name (load with ``use_kernels=False``
    or ``USE_HUB_KERNELS=0``). Marked here as kernelize marks it; no kernel is downloaded."""
    model = qwen3_next()
    owner = layer = model.model.layers[0].linear_attn
    if where == "state function":
        owner = torch.nn.Module()  # what 5.25's ``use_kernelized_func`` keeps per function, kernelized
        layer.__dict__.setdefault("_kernel_funcs", {})["causal_conv1d_forward"] = owner
    owner.__dict__["_kernel_repo"] = "kernels-community/causal-conv1d"
    name = "forward" if where == "forward" else "causal_conv1d_forward"
    cause = unsupported_cause(model)
    assert (
        cause is not None
        and (
            f"Qwen3NextGatedDeltaNet's {name} is a Hub kernel (kernels-community/causal-conv1d, from use_kernels) that "
            "handles the cache itself: load the model with use_kernels=False or USE_HUB_KERNELS=0"
        )
        in cause
    ), cause
    assert unsupported_cause(qwen3_next()) is None  # the same model, its layers its own


def test_recurrent_modules_sharing_a_layer_index_are_refused_by_name():
    """Inkling keeps four short convolutions per layer (keys, values, attention and MLP outputs), told apart by the
    ``state_idx`` they hand the cache; grpo_mem keeps one module's states per layer index, so such a model falls back
    naming it (before the behavioural probe runs them)."""
    from helpers import default_config
    from transformers import AutoModelForCausalLM

    from grpo_mem.model.tiny_config import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(default_config("inkling_text")))
    assert unsupported_cause(model) == (
        "4 recurrent modules of layer 0 (InklingShortConvolution) keep states of their own under one layer index; "
        "grpo_mem hands on one module's states per layer"
    )

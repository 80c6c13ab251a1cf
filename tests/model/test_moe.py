"""The MoE router (load-balancing) loss on the prompt-once path: against the model's own full-sequence forward for
each family, in group and tree sharing, with groups split over the micro-batches of a window, and against stock TRL
through GRPOTrainer."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import transformers

import helpers
from helpers import VOCAB, assert_close, assert_grads_close, make_batch, train_recorded
from grpo_mem.model import router
from grpo_mem.model.plan import WindowPlan
from grpo_mem.model.sharing import SharingSession

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attention_dropout=0.0,
    pad_token_id=0,
    eos_token_id=3,
    bos_token_id=1,
)
MOE = dict(num_experts_per_tok=2)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, **MOE, **COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        num_experts=4, moe_intermediate_size=16, head_dim=8, **MOE, **COMMON
    ),
    "olmoe": lambda: transformers.OlmoeConfig(num_experts=4, **MOE, **COMMON),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, **MOE, **COMMON
    ),
    # sliding windows (8 tokens, shorter than the rows), attention sinks, router bias
    "gpt_oss": lambda: transformers.GptOssConfig(num_local_experts=4, head_dim=8, sliding_window=8, **MOE, **COMMON),
    # served by the stock path today (linear attention): router math checked alone
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        **MOE,
        **COMMON,
    ),
}
PROMPT_ONCE = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss", "qwen3_5_moe"]  # gpt-oss: window 8, sinks,
# router bias; Qwen3.5-MoE: Gated DeltaNet layers
SYSTEM = [5, 9, 17, 33, 41, 8, 12]


def moe_model(family: str = "qwen3_moe", *, seed: int = 0):
    """A random 2-layer, 4-expert, top-2 MoE causal LM of ``family``, fp32, in train mode."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).train()


def full_forward(model, ids, mask, C):
    """The model's own forward over the full rows: (B, C) log-probs (0 where masked) and its ``aux_loss``."""
    out = type(model).forward(model, input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    logps = torch.log_softmax(out.logits[:, -C - 1 : -1].float(), -1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    return logps.masked_fill(mask[:, -C:] == 0, 0.0), out.aux_loss


def grads(model, loss=None, *, retain_graph=False):
    """Backward of ``loss`` (if given); returns every parameter's gradient and zeroes them."""
    if loss is not None:
        loss.backward(retain_graph=retain_graph)
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def system_prompt_batch(G=2, C=5, seed=0):
    """Three prompts sharing a 7-token system prompt (own parts of 2-4 tokens), G completions each, shuffled."""
    prompts = [SYSTEM + [60, 61], SYSTEM + [70, 71, 72, 73], SYSTEM + [80, 81, 82]]
    return make_batch(None, G, C, seed=seed, shuffle=True, prompts=prompts)


@pytest.mark.parametrize("sharing", ["group", "tree"])
@pytest.mark.parametrize("family", PROMPT_ONCE)
def test_router_loss_and_gradients_match_full_forward(family, sharing):
    """Groups scattered over one micro-batch, left padding (prompts of 3, 5, 7 tokens): the prompt-once path's aux
    loss, its gradient alone, and the log-probs equal the model's own full-sequence forward."""
    model = moe_model(family)
    ids, mask, C, _ = make_batch([5, 7, 3], G=3, C=6, shuffle=True)
    ref_logps, ref_aux = full_forward(model, ids, mask, C)
    ref_grads = grads(model, ref_aux)
    session = SharingSession(sharing)
    with session.recording() as decisions:
        logps, _, aux = session.score(model, ids, mask, C, compute_aux_loss=True)
    assert [d.path for d in decisions] == [sharing], decisions
    assert_close(aux.detach(), ref_aux.detach(), 1e-6, "aux loss")
    assert_close(logps.detach(), ref_logps.detach(), 1e-5, "log-probs")
    assert_grads_close(grads(model, aux), ref_grads, 1e-4)


def test_one_completion_token():
    """C = 1: log-probs need no completion pass, but stock's router loss counts the completion token's router logits
    (the completion pass runs for them)."""
    model = moe_model("mixtral")
    ids, mask, C, _ = make_batch([5, 7, 3], G=2, C=1, shuffle=True)
    ref_logps, ref_aux = full_forward(model, ids, mask, C)
    ref_grads = grads(model, ref_aux)
    logps, _, aux = SharingSession("group").score(model, ids, mask, C, compute_aux_loss=True)
    assert_close(aux.detach(), ref_aux.detach(), 1e-6, "aux loss")
    assert_close(logps.detach(), ref_logps.detach(), 1e-5, "log-probs")
    assert_grads_close(grads(model, aux), ref_grads, 1e-4)


def test_tree_shared_system_prompt():
    """A system prompt forwarded once for three prompts (a trie node of its own): aux loss and gradient of a
    combined objective as the full forward's."""
    model = moe_model("olmoe")
    ids, mask, C, _ = system_prompt_batch(G=3)
    P = ids.shape[1] - C
    plan = WindowPlan.build("tree", [ids[:, :P]], [mask[:, :P]], min_shared_tokens=4)
    assert any(len(node.tokens) == len(SYSTEM) and len(node.prompts) == 3 for node in plan.trie.nodes)
    w = torch.randn(ids.shape[0], C, generator=torch.Generator().manual_seed(1))
    ref_logps, ref_aux = full_forward(model, ids, mask, C)
    ref_grads = grads(model, (ref_logps * w).sum() + 10 * ref_aux)
    session = SharingSession("tree", min_shared_tokens=4)
    with session.recording() as decisions:
        logps, _, aux = session.score(model, ids, mask, C, compute_aux_loss=True)
    assert decisions[0].path == "tree" and decisions[0].backbone_tokens < decisions[0].stock_tokens
    assert_close(aux.detach(), ref_aux.detach(), 1e-6, "aux loss")
    assert_grads_close(grads(model, (logps * w).sum() + 10 * aux), ref_grads, 1e-4)


@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_groups_split_over_micro_batches(sharing):
    """Groups spread over the three micro-batches of a window (prompt passes kept and read by later micro-batches):
    every micro-batch's aux loss is its own rows' (as TRL computes it per micro-batch), and the window's summed
    gradient equals the full forward's, micro-batch by micro-batch."""
    model = moe_model("qwen3_moe")
    ids, mask, C, _ = system_prompt_batch(G=3, C=4)
    P = ids.shape[1] - C
    parts = [slice(0, 3), slice(3, 6), slice(6, 9)]
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(3, C, generator=g) for _ in parts]
    ref_aux = []
    for rows, w in zip(parts, weights):
        ref_logps, aux = full_forward(model, ids[rows], mask[rows], C)
        ((ref_logps * w).sum() + 10 * aux).backward()
        ref_aux.append(aux.detach())
    ref_total = grads(model)
    session = SharingSession(sharing, min_shared_tokens=4)
    session.begin_window([ids[r, :P] for r in parts], [mask[r, :P] for r in parts])
    for rows, w, expected in zip(parts, weights, ref_aux):
        with session.recording() as decisions:
            logps, _, aux = session.score(model, ids[rows], mask[rows], C, compute_aux_loss=True)
        assert [d.path for d in decisions] == [sharing], decisions
        assert_close(aux.detach(), expected, 1e-6, "micro-batch aux loss")
        ((logps * w).sum() + 10 * aux).backward()
    assert session.window.pending == 0
    session.close_window()
    assert_grads_close(grads(model), ref_total, 1e-4)


@pytest.mark.parametrize("C", [1, 4])
def test_lockstep_schedule_keeps_the_router_loss(monkeypatch, C):
    """Ranks in lockstep (FSDP, DeepSpeed) run the completion pass even at C = 1 and align pass schedules: with the
    decision's collective stood in for one rank, each micro-batch's aux loss and the window's gradient are the full
    forward's."""
    from types import SimpleNamespace

    from grpo_mem.model import sharing

    # two ranks up (the session asks ``lockstep`` only then), in lockstep
    monkeypatch.setattr(
        sharing,
        "dist",
        SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 2),
    )
    monkeypatch.setattr(sharing, "lockstep", lambda model: True)
    monkeypatch.setattr(sharing, "agree", lambda cause, keys, image_passes: (cause, set(keys)))
    model = moe_model("olmoe")
    ids, mask, C, _ = make_batch([5, 7], G=2, C=C, shuffle=True, seed=3)
    P = ids.shape[1] - C
    parts = [slice(0, 2), slice(2, 4)]
    ref_aux = []
    for rows in parts:
        ref_logps, aux = full_forward(model, ids[rows], mask[rows], C)
        (ref_logps.sum() + 10 * aux).backward()
        ref_aux.append(aux.detach())
    ref_total = grads(model)
    session = SharingSession("group")
    session.begin_window([ids[r, :P] for r in parts], [mask[r, :P] for r in parts])
    for rows, expected in zip(parts, ref_aux):
        with session.recording() as decisions:
            logps, _, aux = session.score(model, ids[rows], mask[rows], C, compute_aux_loss=True)
        assert [d.path for d in decisions] == ["group"], decisions
        assert_close(aux.detach(), expected, 1e-6, "micro-batch aux loss")
        (logps.sum() + 10 * aux).backward()
    session.close_window()
    assert_grads_close(grads(model), ref_total, 1e-4)


def test_unrecognised_router_loss_falls_back_by_name(monkeypatch):
    """A modeling module whose load_balancing_loss_func is not Mixtral's: a named cause, and the stock path returns
    the model's own aux loss; a model without one is named too."""
    model = moe_model("qwen3_moe")
    module = sys.modules[type(model).__module__]
    own = module.load_balancing_loss_func
    monkeypatch.setattr(module, "load_balancing_loss_func", lambda *args: 2 * own(*args))
    cause = router.router_loss_cause(model)
    assert cause is not None and "modeling_qwen3_moe.load_balancing_loss_func" in cause
    ids, mask, C, _ = make_batch([5, 7], G=2, C=4)
    _, ref_aux = full_forward(model, ids, mask, C)
    session = SharingSession("group")
    with pytest.warns(UserWarning, match="not the router loss grpo_mem reproduces"), session.recording() as decisions:
        _, _, aux = session.score(model, ids, mask, C, compute_aux_loss=True)
    assert decisions[0].path == "stock" and decisions[0].cause == cause
    assert_close(aux.detach(), ref_aux.detach(), 0.0, "aux loss")
    assert "defines no load_balancing_loss_func" in router.router_loss_cause(helpers.tiny_model("llama"))


def test_modules_whose_router_loss_is_recognised():
    """Recognised by its numbers, not its code: the families tested here (Mixtral's loss), and NLLB-MoE's, whose code
    differs from Mixtral's by a line but not its math; Doge's and Switch Transformers' own losses are not, nor a
    Mixtral loss scaled or given another signature."""
    names = {name: f"transformers.models.{name}.modeling_{name}" for name in [*CONFIGS, "nllb_moe", "doge"]}
    names["switch_transformers"] = "transformers.models.switch_transformers.modeling_switch_transformers"
    recognised = {
        n for n, m in names.items() if router.reproduces_loss(importlib.import_module(m).load_balancing_loss_func)
    }
    assert recognised == {*CONFIGS, "nllb_moe"}, sorted(recognised)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral

    assert not router.reproduces_loss(lambda logits, E, k, mask: 2 * mixtral(logits, E, k, mask))
    assert not router.reproduces_loss(lambda logits, E, k: mixtral(logits, E, k))  # no attention mask taken


def test_load_balancing_loss_rejects_mismatched_weights():
    z = (torch.randn(6, 4),)
    shape = router.RouterLossShape(4, 2)
    with pytest.raises(ValueError, match="weights of 5 tokens"):
        router.load_balancing_loss([router.RouterTerm(z, torch.ones(5))], shape)
    with pytest.raises(ValueError, match="at least one term"):
        router.load_balancing_loss([], shape)


def test_grpo_training_with_router_loss_matches_stock(tmp_path, monkeypatch):
    """Qwen3-MoE through GRPOTrainer, 3 steps of 2 accumulated micro-batches of 2 rows (groups of 4 split over
    them), router loss coefficient 1: gradients within 1e-4, weights within 1e-5 of stock TRL and the same logged
    aux_loss, on the prompt-once path."""
    monkeypatch.setattr(helpers, "tiny_model", lambda arch, seed=0: moe_model(arch, seed=seed))
    args = dict(
        arch="qwen3_moe",
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        router_aux_loss_coef=1.0,
        optim="sgd",
        learning_rate=0.5,
    )
    stock, stock_rec = train_recorded(tmp_path / "stock", "grpo", patch=False, **args)
    ours, ours_rec = train_recorded(tmp_path / "ours", "grpo", patch=True, **args)
    assert ours.aux_loss_enabled and ours.state.global_step == 3
    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_close(g_ours, g_stock, 1e-4)
    stock_params = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_params[name].detach(), 1e-5, name)
    logged = [h for h in ours.state.log_history if "aux_loss" in h]
    stock_logged = [h for h in stock.state.log_history if "aux_loss" in h]
    assert len(logged) == len(stock_logged) == 3
    for h, s in zip(logged, stock_logged):
        assert h["aux_loss"] == pytest.approx(s["aux_loss"], rel=1e-6, abs=1e-7)
        assert h["grpo_mem/path/stock"] == 0.0


def test_verify_compares_the_router_loss_gradient(tmp_path, monkeypatch):
    """``grpo_mem.verify`` on a MoE trainer that asks for the router loss: the loss joins the compared gradients, so
    the prompt-once path passes, and a router loss off by 1 % fails on the gradient."""
    import grpo_mem
    from helpers import make_trainer

    monkeypatch.setattr(helpers, "tiny_model", lambda arch, seed=0: moe_model(arch, seed=seed))
    trainer, _ = make_trainer(
        arch="qwen3_moe",
        output_dir=tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        router_aux_loss_coef=1.0,
    )
    assert trainer.aux_loss_enabled
    report = grpo_mem.verify(trainer, print_report=False)
    assert report.passed and all(m.path == "prompt-once" for m in report.micro_batches), str(report)
    loss = router.load_balancing_loss
    monkeypatch.setattr(router, "load_balancing_loss", lambda terms, shape: 1.01 * loss(terms, shape))
    report = grpo_mem.verify(trainer, print_report=False)
    assert not report.passed and report.max_logp_diff <= 1e-5, str(report)

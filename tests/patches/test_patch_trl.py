"""patch_trl against stock TRL (1.16; 1.10-1.15 through tests/compat/run.sh): losses, gradients, whole training runs,
shuffling, and the patch mechanics. Log-probs are compared where the completion mask is 1 (TRL before 1.15 returns
non-zero values at masked positions, grpo_mem and TRL 1.15+ zeros; the loss never reads them)."""

import inspect
import re
import warnings

import pytest
import torch
from helpers import (
    GradientRecorder,
    assert_close,
    assert_grads_close,
    assert_weights_close,
    make_batch,
    make_trainer,
    train_recorded,
)

import grpo_mem
from grpo_mem.patches.checks import LOGPS_METHOD, PREPARE_METHOD
from grpo_mem.patches.trl import group_shuffle


def _generation_batch(trainer, seed=0):
    torch.manual_seed(seed)
    trainer.model.train()
    return next(iter(trainer.get_train_dataloader()))


def _loss_and_grads(trainer, inputs):
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by Trainer.train
    # under the mixed precision accelerate's prepared forward has in training: TRL < 1.15 relies on it (its method
    # enters no autocast itself), 1.15+ also enters accelerator.autocast() inside the method
    with trainer.accelerator.autocast():
        loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


# every loss type of TRL 1.16 at its own importance-sampling level (GSPO: grpo at the sequence level); the four
# classic ones with and without a reference model, the others with one
LOSSES = [(t, "token", beta) for t in ("grpo", "dapo", "dr_grpo", "bnpo") for beta in (0.0, 0.04)] + [
    ("cispo", "token", 0.04),
    ("sapo", "token", 0.04),
    ("vespo", "token", 0.04),
    ("luspo", "sequence", 0.04),
    ("grpo", "sequence", 0.04),
]


@pytest.mark.parametrize("loss_type,level,beta", LOSSES, ids=[f"{t}-{lv}-{b}" for t, lv, b in LOSSES])
def test_compute_loss_matches_stock(tmp_path, loss_type, level, beta):
    trainer, _ = make_trainer(
        output_dir=tmp_path,
        loss_type=loss_type,
        beta=beta,
        per_device_train_batch_size=8,
        steps_per_generation=1,
        num_iterations=2,
        importance_sampling_level=level,
    )
    inputs = trainer._prepare_inputs(_generation_batch(trainer))  # stock inputs: old and reference log-probs
    assert inputs["old_per_token_logps"] is not None and (beta == 0) == (inputs.get("ref_per_token_logps") is None)
    stock_loss, stock_grads = _loss_and_grads(trainer, inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].shape[1]
    with torch.no_grad():  # the no-grad callers: old log-probs (policy) and the separate reference model
        stock_old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, batch_size=4)
        stock_ref = (
            trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, C, batch_size=4)[0]
            if beta
            else None
        )
    with grpo_mem.patch_trl(trainer), warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        loss, grads = _loss_and_grads(trainer, inputs)
        with torch.no_grad():
            old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, batch_size=4)
            if beta:
                ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, C, batch_size=4)
                assert_close(ref, stock_ref, 1e-5, "reference log-probs", mask=mask[:, -C:])
    assert_close(old, stock_old, 1e-5, "old log-probs", mask=mask[:, -C:])
    # the loss moves with the log-probs it is made of: within 1e-6 plus twice their largest difference (on TRL 1.15,
    # whose fused head runs under Triton's interpreter on CPU, VESPO's loss differed by 1.06e-6 where the log-probs
    # differed by 9.5e-7)
    logp_diff = float((old - stock_old)[mask[:, -C:].bool()].abs().max())
    assert_close(loss, stock_loss, 1e-6 + 2 * logp_diff, "loss")
    assert_grads_close(grads, stock_grads)


def test_bf16_autocast_loss_path_error_within_stock_error(tmp_path):
    """TRL ``bf16=True`` (accelerate's bf16 autocast on CPU): on one batch, the patched loss path's gradient error
    against the fp32 computation stays within stock TRL's bf16 error (relative L2 norm per parameter, tol 1e-2),
    and its loss within stock's loss error + 1e-2."""
    from contextlib import nullcontext

    trainer, _ = make_trainer(
        output_dir=tmp_path, bf16=True, per_device_train_batch_size=8, steps_per_generation=1, beta=0.0
    )
    assert trainer.accelerator.mixed_precision == "bf16"
    inputs = trainer._prepare_inputs(_generation_batch(trainer))
    stock_loss, stock_grads = _loss_and_grads(trainer, inputs)
    with grpo_mem.patch_trl(trainer), warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        loss, grads = _loss_and_grads(trainer, inputs)
    autocast = trainer.accelerator.autocast
    trainer.accelerator.autocast = nullcontext  # the fp32 truth: same batch, same old log-probs
    try:
        truth_loss, truth_grads = _loss_and_grads(trainer, inputs)
    finally:
        trainer.accelerator.autocast = autocast
    assert any((stock_grads[n] - g).abs().max() > 0 for n, g in truth_grads.items()), "autocast was not applied"
    assert abs(loss - truth_loss) <= abs(stock_loss - truth_loss) + 1e-2
    for name, g in truth_grads.items():
        scale = g.norm().clamp_min(1e-30)
        rel_stock, rel_ours = (stock_grads[name] - g).norm() / scale, (grads[name] - g).norm() / scale
        assert rel_ours <= rel_stock + 1e-2, f"{name}: relative gradient error {rel_ours:.4f} vs stock {rel_stock:.4f}"


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_two_step_training_matches_stock(tmp_path, kind):
    args = dict(
        max_steps=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        beta=0.04,
        optim="sgd",
    )
    # SGD: weights differ by lr x gradient difference; Adam's first step is ~lr x sign(grad), which turns rounding
    # noise in near-zero gradient entries into lr-sized weight differences. Gradients are compared at every step.
    stock, stock_rec = train_recorded(tmp_path / "stock", kind, patch=False, **args)
    ours, ours_rec = train_recorded(tmp_path / "ours", kind, patch=True, **args)
    assert ours.state.global_step == stock.state.global_step == 2
    assert ours_rec.lrs == stock_rec.lrs and len(ours_rec.lrs) == 2
    assert [h.get("epoch") for h in ours.state.log_history] == [h.get("epoch") for h in stock.state.log_history]
    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_close(g_ours, g_stock, 1e-4)
    stock_params = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_params[name].detach(), 1e-5, name)


# objectives that depend on which rows share a micro-batch or an optimizer step, groups of 4 split over micro-batches
# (completions of up to 24 tokens end at different lengths, so per-micro-batch token counts differ)
ORDER_SENSITIVE = {
    "bnpo-micro-batches-of-3": dict(
        loss_type="bnpo", per_device_train_batch_size=3, gradient_accumulation_steps=4, max_completion_length=24
    ),
    "entropy-mask": dict(top_entropy_quantile=0.5, per_device_train_batch_size=2, gradient_accumulation_steps=4),
    "entropy-bonus": dict(
        entropy_coef=0.1, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_completion_length=24
    ),
    "steps-per-generation-2": dict(steps_per_generation=2, gradient_accumulation_steps=1, max_steps=2),
}


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("case", ORDER_SENSITIVE)
def test_default_order_trains_like_stock(tmp_path, case):
    """``patch_trl``'s defaults keep stock TRL's row order: BNPO's per-micro-batch token normalisation, the
    per-micro-batch entropy quantile (``top_entropy_quantile``), the entropy bonus and rows split over optimizer steps
    (``steps_per_generation`` > accumulation) give stock's losses, gradients and weights, prompts still forwarded once
    per optimizer step. ``group_shuffle=True`` changes the entropy-masked objective."""
    args = {"max_steps": 1, "optim": "sgd", **ORDER_SENSITIVE[case]}
    stock, stock_rec = train_recorded(tmp_path / "stock", "grpo", patch=False, **args)
    ours, ours_rec = train_recorded(tmp_path / "ours", "grpo", patch=True, **args)
    assert _losses(ours) == pytest.approx(_losses(stock), abs=1e-6) and len(_losses(stock)) == args["max_steps"]
    assert all(h["grpo_mem/path/stock"] < 1 for h in ours.state.log_history if "grpo_mem/path/stock" in h)
    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_close(g_ours, g_stock, 1e-4)
    assert_weights_close(ours.model, stock.model, 1e-5)
    if case == "entropy-mask":
        grouped, _ = train_recorded(tmp_path / "grouped", "grpo", patch=True, group_shuffle=True, **args)
        assert abs(_losses(grouped)[0] - _losses(stock)[0]) > 1e-2


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_group_shuffle_keeps_rows_and_step_gradient(tmp_path, loss_type):
    """``group_shuffle=True``: whole groups per micro-batch; for these losses (normalised per sequence, by a constant
    or by the whole window's tokens) the optimizer step's gradient equals stock's row-shuffled one."""
    args = dict(max_steps=1, gradient_accumulation_steps=2, loss_type=loss_type)
    seen = []
    stock, stock_rec = train_recorded(tmp_path / "stock", "grpo", patch=False, **args)
    ours, ours_rec = train_recorded(tmp_path / "ours", "grpo", patch=True, group_shuffle=True, **args)
    for batch in ours._buffered_inputs:
        seen.append(batch)
        prompts = batch["prompt_ids"].masked_fill(batch["prompt_mask"] == 0, -1)
        assert (prompts == prompts[0]).all(), "a micro-batch of 4 = G rows must hold one whole group"
    rows = lambda bs: sorted(  # noqa: E731
        torch.cat([b["prompt_ids"], b["completion_ids"]], 1)[i].tolist()
        for b in bs
        for i in range(len(b["prompt_ids"]))
    )
    assert rows(seen) == rows(stock._buffered_inputs)
    assert_grads_close(ours_rec.grads[0], stock_rec.grads[0], 1e-4)


def test_group_shuffle_splits_only_when_needed():
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2]] * 3 + [[3, 4]] * 3 + [[5, 6]] * 3)
    batch = {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "text": list(range(9)), "n": torch.tensor(9)}
    out = group_shuffle(batch)
    assert sorted(out["text"]) == list(range(9)) and out["n"] is batch["n"]
    assert torch.equal(out["prompt_ids"], ids[torch.tensor(out["text"])])
    for start in range(0, 9, 3):  # each micro-batch of 3 holds one whole group
        assert len({tuple(r) for r in out["prompt_ids"][start : start + 3].tolist()}) == 1


def test_patch_is_idempotent_and_reverts_exactly():
    from trl import GRPOTrainer, RLOOTrainer

    before = {c: {n: c.__dict__[n] for n in (LOGPS_METHOD, PREPARE_METHOD)} for c in (GRPOTrainer, RLOOTrainer)}
    handle = grpo_mem.patch_trl()
    assert grpo_mem.patch_trl() is handle and handle.active
    for cls in (GRPOTrainer, RLOOTrainer):
        assert cls.__dict__[LOGPS_METHOD] is not before[cls][LOGPS_METHOD]
    handle.revert()
    handle.revert()
    for cls in (GRPOTrainer, RLOOTrainer):
        for name, fn in before[cls].items():
            assert cls.__dict__[name] is fn
    with grpo_mem.patch_trl(GRPOTrainer) as h:
        assert h.active and GRPOTrainer.__dict__[LOGPS_METHOD] is not before[GRPOTrainer][LOGPS_METHOD]
    assert GRPOTrainer.__dict__[LOGPS_METHOD] is before[GRPOTrainer][LOGPS_METHOD]


def test_patching_again_with_other_options_repatches(tmp_path):
    """patch_trl again on the same trainer with other options re-patches it (the same handle, the new options, a
    session in the new mode: the next micro-batch takes the group path, its log-probs still stock TRL's)."""
    trainer, handle = make_trainer(patch=True, output_dir=tmp_path, sharing="tree", group_shuffle=True)
    ids, mask, C, _ = make_batch([4, 6], 2, 3)
    with torch.no_grad():
        with handle.session(trainer).recording() as trees:
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
        assert [d.path for d in trees] == ["tree"]
        assert grpo_mem.patch_trl(trainer, sharing="group", group_shuffle=False) is handle
        assert (handle.sharing, handle.group_shuffle, handle.active) == ("group", False, True)
        assert trainer not in handle.sessions  # the tree session is gone
        with handle.session(trainer).recording() as groups:
            ours, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
        assert handle.sessions[trainer].mode == "group" and [d.path for d in groups] == ["group"]
        handle.revert()
        stock, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    assert_close(ours * mask[:, -C:], stock * mask[:, -C:], 1e-5)


def test_other_options_are_refused_where_they_cannot_apply():
    """Mid-step (a sharing window open) and on an instance of a patched class, other options raise ValueError
    naming both values; the same options return the active handle."""
    from trl import GRPOTrainer

    ids, mask, _, _ = make_batch([4, 6], 2, 3)
    with grpo_mem.patch_trl(GRPOTrainer, sharing="tree", group_shuffle=True) as handle:
        instance = object.__new__(GRPOTrainer)  # no __init__: patch_trl only reads the class's methods here
        assert grpo_mem.patch_trl(instance, sharing="tree", group_shuffle=True) is handle
        match = r"covered by the patch of GRPOTrainer.*sharing='tree', got sharing='group'"
        with pytest.raises(ValueError, match=match):
            grpo_mem.patch_trl(instance, sharing="group", group_shuffle=True)
        session = handle.session(instance)
        session.begin_window([ids[:, :6]], [mask[:, :6]])
        with pytest.raises(ValueError, match=r"group_shuffle=True, got group_shuffle=False.*window is open"):
            grpo_mem.patch_trl(GRPOTrainer, sharing="tree", group_shuffle=False)
        assert (handle.sharing, handle.group_shuffle) == ("tree", True) and handle.sessions[instance] is session
        session.close_window()
        assert grpo_mem.patch_trl(GRPOTrainer, sharing="group", group_shuffle=True) is handle
        assert handle.sharing == "group" and not handle.sessions


def test_instance_patch_touches_only_the_instance(tmp_path):
    """Patching one trainer leaves the class alone; after the model was scored through grpo_mem (its forward and
    attention implementation taken over), revert gives the model both back."""
    from trl import GRPOTrainer

    from grpo_mem.model.forward import installed

    trainer, handle = make_trainer(patch=True, output_dir=tmp_path)
    impl = trainer.model.config._attn_implementation
    forward_before = trainer.model.__dict__.get("forward")
    assert LOGPS_METHOD in trainer.__dict__ and "__grpo_mem_patch__" not in dir(GRPOTrainer.__dict__[LOGPS_METHOD])
    ids, mask, C, _ = make_batch([4, 6], 2, 3)
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    assert installed(trainer.model) and trainer.model.config._attn_implementation == f"grpo_mem_{impl}"
    handle.revert()
    assert LOGPS_METHOD not in trainer.__dict__ and PREPARE_METHOD not in trainer.__dict__
    assert not installed(trainer.model) and trainer.model.__dict__.get("forward") is forward_before
    assert trainer.model.config._attn_implementation == impl


def test_old_or_known_bad_trl_is_refused(monkeypatch):
    import trl
    from trl import GRPOTrainer

    from grpo_mem.patches import checks as patch_module

    original = GRPOTrainer.__dict__[LOGPS_METHOD]
    monkeypatch.setattr(trl, "__version__", "1.9.2")
    with pytest.raises(RuntimeError, match=r"needs TRL >= 1\.10 .* found trl 1\.9\.2"):
        grpo_mem.patch_trl()
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    monkeypatch.setattr(patch_module, "KNOWN_BAD_TRL", {(1, 16): "its wrapper cannot be patched exactly"})
    with pytest.raises(RuntimeError, match=r"does not patch trl 1\.16\.0: its wrapper cannot be patched exactly"):
        grpo_mem.patch_trl()
    assert GRPOTrainer.__dict__[LOGPS_METHOD] is original


def test_newer_trl_is_judged_by_signatures_not_by_number(monkeypatch):
    import trl
    from trl import GRPOTrainer

    monkeypatch.setattr(trl, "__version__", "1.17.0.dev0")
    with grpo_mem.patch_trl(GRPOTrainer) as handle:
        assert handle.active
    assert not getattr(GRPOTrainer.__dict__[LOGPS_METHOD], "__grpo_mem_patch__", False)


def test_trl_1_14_dispatcher_is_checked_through_its_target():
    """TRL 1.14.x: the method is ``(self, model, *args, batch_size=None, compute_aux_loss=False, **kwargs)`` and
    dispatches to ``_full_logits_logps``, whose signature is 1.16's: accepted; a changed target is refused."""
    from trl import GRPOTrainer

    from grpo_mem.patches.checks import LOGPS_PARAMS, check_signature

    # the method with 1.16's signature: 1.14's own target there, else the method itself
    stock = inspect.unwrap(GRPOTrainer.__dict__.get("_full_logits_logps", GRPOTrainer.__dict__[LOGPS_METHOD]))

    class Dispatching(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, *args, batch_size=None, compute_aux_loss=False, **kw):
            return self._full_logits_logps(model, *args, batch_size=batch_size, compute_aux_loss=compute_aux_loss, **kw)

        _full_logits_logps = stock

    check_signature(Dispatching, LOGPS_METHOD, LOGPS_PARAMS)

    class ChangedTarget(Dispatching):
        def _full_logits_logps(self, model, input_ids, attention_mask, logits_to_keep, extra=None):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="_full_logits_logps .*grpo_mem was written against"):
        check_signature(ChangedTarget, LOGPS_METHOD, LOGPS_PARAMS)


def test_changed_signature_is_refused():
    from trl import GRPOTrainer

    class Changed(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, extra=None):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="grpo_mem was written against"):
        grpo_mem.patch_trl(Changed)
    assert "_prepare_inputs" not in Changed.__dict__
    assert inspect.signature(Changed._get_per_token_logps_and_entropies).parameters.get("extra") is not None


def test_async_grpo_trainer_is_refused_by_name(monkeypatch):
    """TRL's AsyncGRPOTrainer scores through packed prefix tries of its own, not the method the patch replaces:
    ``patch_trl`` on it (or a subclass) names it and why, and changes nothing."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    module = pytest.importorskip("trl.experimental.async_grpo.async_grpo_trainer")

    class Mine(module.AsyncGRPOTrainer):
        pass

    for target in (module.AsyncGRPOTrainer, Mine):
        before = dict(vars(target))
        with pytest.raises(
            TypeError, match=rf"does not patch TRL.s AsyncGRPOTrainer \({target.__name__}\).*prefix tries"
        ):
            grpo_mem.patch_trl(target)
        assert dict(vars(target)) == before


def test_micro_batch_without_repeated_prompt_falls_back_once(tmp_path):
    trainer, handle = make_trainer(patch=False, output_dir=tmp_path, per_device_train_batch_size=4)
    inputs = trainer._prepare_inputs(_generation_batch(trainer))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    ids[:, 0], mask[:, 0] = torch.arange(4, 8), 1  # four different prompts
    C = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        stock, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
        with grpo_mem.patch_trl(trainer):
            from grpo_mem.model import fallback
            from grpo_mem.model.sharing import UNSHARED

            fallback._warned.discard(UNSHARED)
            with pytest.warns(UserWarning, match="no repeated prompt") as record:
                ours, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
                trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    assert sum("no repeated prompt" in str(w.message) for w in record) == 1
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("per_device", [1, 2, 4])
def test_group_spread_over_micro_batches_forwards_prompt_once(tmp_path, per_device):
    """G=8 completions over 8/per_device micro-batches of one optimizer step: one prompt pass with gradients, and
    the step's gradient equals stock TRL's (whose micro-batches each forward the full sequences)."""
    args = dict(
        max_steps=1,
        num_generations=8,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=8 // per_device,
        loss_type="dapo",
        beta=0.04,
    )
    stock, stock_rec = train_recorded(tmp_path / "stock", "grpo", patch=False, **args)

    trainer, handle = make_trainer("grpo", patch=True, output_dir=tmp_path / "ours", **args)
    record, widths = GradientRecorder(), []
    trainer.add_callback(record)
    embed = trainer.model.get_input_embeddings()
    hook = embed.register_forward_hook(
        lambda m, i, o: widths.append(i[0].shape) if torch.is_grad_enabled() and m.training else None
    )
    try:
        trainer.train()
        session = handle.sessions[trainer]
        assert (
            session.window is None or session.window.pending == 0
        ) and not session.in_window  # nothing left pending after the window
    finally:
        hook.remove()
        handle.revert()
    assert not any(k.startswith("_grpo_mem") for k in trainer.__dict__)  # the patch's state lives on its handle
    P = trainer._buffered_inputs[0]["prompt_ids"].shape[1]
    prompt_passes = [w for w in widths if w[1] == P]
    assert prompt_passes == [torch.Size([1, P])], widths
    # the step's logged saving: one prompt pass plus every micro-batch's completion pass, against B x (P + C) each
    C = trainer._buffered_inputs[0]["completion_ids"].shape[1]
    n = 8 // per_device
    logged = next(h for h in trainer.state.log_history if "grpo_mem/token_ratio" in h)
    assert logged["grpo_mem/backbone_tokens"] == pytest.approx((P + 8 * (C - 1)) / n)
    assert logged["grpo_mem/stock_tokens"] == pytest.approx(per_device * (P + C))
    assert logged["grpo_mem/path/tree"] == 1.0 and logged["grpo_mem/path/stock"] == 0.0
    assert_grads_close(record.grads[0], stock_rec.grads[0], 1e-4)


def _lora(p):
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=p,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
    )


# (model and trainer arguments, the dropout the fallback names or None: the prompt-once path serves it)
DROPOUT = {
    "lora-dropout": (dict(peft_config=lambda: _lora(0.1)), r"lora_dropout\.default: Dropout\(p=0\.1\)"),
    "phi3-resid-pdrop": (dict(arch="phi3", model_args=dict(resid_pdrop=0.1)), r"resid_attn_dropout: Dropout\(p=0\.1\)"),
    # functional dropout with a probability the module keeps: TRL's disable_dropout leaves it, stock still drops
    "starcoder2-residual-dropout-disabled": (
        dict(arch="starcoder2", model_args=dict(residual_dropout=0.1), disable_dropout=True),
        r"Starcoder2Attention\.residual_dropout = 0\.1",
    ),
    "lora-dropout-disabled": (dict(peft_config=lambda: _lora(0.1), disable_dropout=True), None),
    "phi3-resid-pdrop-disabled": (dict(arch="phi3", model_args=dict(resid_pdrop=0.1), disable_dropout=True), None),
}


@pytest.mark.parametrize("case", DROPOUT)
def test_active_dropout_falls_back_by_name_with_stock_numbers(tmp_path, case):
    """Dropout with p > 0 in training (LoRA's lora_dropout, Phi-3's residual nn.Dropout, Starcoder2's functional
    residual dropout): every micro-batch falls back naming it, and training equals stock TRL under the same seed
    bit for bit (the same dropout draws). With TRL's disable_dropout=True (nn.Dropout p set to 0) the prompt-once
    path is taken and matches stock."""
    from grpo_mem.model.fallback import recording_fallbacks

    options, cause = DROPOUT[case]
    args = dict(max_steps=1, gradient_accumulation_steps=2, optim="sgd")
    args.update({k: v() if callable(v) else v for k, v in options.items()})
    stock, stock_rec = train_recorded(tmp_path / "stock", "grpo", patch=False, **args)
    with recording_fallbacks() as causes:
        ours, ours_rec = train_recorded(tmp_path / "ours", "grpo", patch=True, **args)
    paths = [h["grpo_mem/path/stock"] for h in ours.state.log_history if "grpo_mem/path/stock" in h]
    assert _losses(ours) == pytest.approx(_losses(stock), abs=0 if cause else 1e-6)
    if cause is not None:
        assert causes and all(re.search(cause, c) for c in causes), causes
        assert paths == [1.0]
        for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
            assert all(torch.equal(g_ours[n], g) for n, g in g_stock.items())
        assert_weights_close(ours.model, stock.model, 0.0)
    else:
        assert not causes and paths == [0.0]
        for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
            assert_grads_close(g_ours, g_stock, 1e-4)
        assert_weights_close(ours.model, stock.model, 1e-5)

"""grpo_mem.verify: passes where grpo_mem matches stock TRL, fails loudly where it does not, leaves no trace."""

import inspect

import pytest
import torch
from helpers import make_batch, make_trainer, smollm2_shaped, tiny_model

import grpo_mem
from grpo_mem.model import support
from grpo_mem.model import window as window_module
from grpo_mem.model.sharing import UNSHARED
from grpo_mem.patches.checks import LOGPS_METHOD
from grpo_mem.patches.verify import VerificationError, _stock_method


def _batch(prompt_lens=(5, 9, 7), G=3, C=6, **kw):
    ids, mask, C, _ = make_batch(list(prompt_lens), G, C, shuffle=True, **kw)
    P = ids.shape[1] - C
    return dict(prompt_ids=ids[:, :P], prompt_mask=mask[:, :P], completion_ids=ids[:, P:], completion_mask=mask[:, P:])


def _state(model):
    return {
        "grads": [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()],
        "modes": [(m, m.training) for m in model.modules()],
        "rng": torch.random.get_rng_state(),
        "dict": dict(model.__dict__),
        "attn": model.config._attn_implementation,
    }


def _assert_restored(model, before):
    for p, grad, value in before["grads"]:
        assert p.grad is grad, "a parameter's .grad was replaced"
        assert grad is None or torch.equal(grad, value), "a pre-existing .grad was modified"
    assert [(m, m.training) for m in model.modules()] == before["modes"]
    assert torch.equal(torch.random.get_rng_state(), before["rng"])
    assert model.__dict__.keys() == before["dict"].keys()
    assert all(model.__dict__[k] is v for k, v in before["dict"].items() if k == "forward")
    assert model.config._attn_implementation == before["attn"]


def _seed_state(model):
    """Some parameters with a .grad, some without; one submodule in eval mode."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn_like(p) if i % 2 == 0 else None
    model.train()
    model.model.layers[0].eval()


def test_trainer_passes_and_leaves_no_trace(tmp_path):
    """The trainer's own generation batch, 4 micro-batches of 2 in windows of 2 (groups of 4 split over two
    micro-batches, so prompt passes are shared through the session)."""
    trainer, _ = make_trainer(output_dir=tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                              steps_per_generation=4)  # fmt: skip
    model = trainer.model
    _seed_state(model)
    before = _state(model)
    metrics = {k: dict(v) for k, v in trainer._metrics.items()}
    warned = set(support._warned)
    report = grpo_mem.verify(trainer, print_report=False)
    assert report.passed, str(report)
    assert report.precision == "fp32" and report.rows == 8 and len(report.micro_batches) == 4
    assert all(m.path == "prompt-once" for m in report.micro_batches), str(report)
    assert any("shared with micro-batch" in m.why for m in report.micro_batches), str(report)
    assert report.max_logp_diff <= 1e-5 and report.grad_rel_diff <= 1e-4
    _assert_restored(model, before)
    assert {k: dict(v) for k, v in trainer._metrics.items()} == metrics
    assert support._warned == warned
    assert LOGPS_METHOD not in trainer.__dict__
    assert "PASSED" in str(report) and "max |Δ log-prob|" in str(report)


def test_already_patched_trainer_compares_against_true_stock(tmp_path):
    from trl import GRPOTrainer

    with grpo_mem.patch_trl(GRPOTrainer) as handle:
        trainer, _ = make_trainer(output_dir=tmp_path, per_device_train_batch_size=4)
        patched = GRPOTrainer.__dict__[LOGPS_METHOD]
        assert _stock_method(trainer) is inspect.unwrap(patched.__wrapped_original__)
        report = grpo_mem.verify(trainer, print_report=False)
        assert report.passed, str(report)
        assert handle.active and GRPOTrainer.__dict__[LOGPS_METHOD] is patched
        assert grpo_mem.patch_trl(GRPOTrainer) is handle


def test_broken_path_fails_loudly(monkeypatch):
    """One log-prob of grpo_mem's head perturbed by 1e-3: the report fails, and raise_on_mismatch raises with the
    numbers; the model is restored either way."""
    model = tiny_model()
    batch = _batch()
    head = window_module.completion_head

    def perturbed(*args, **kwargs):
        logps, entropy = head(*args, **kwargs)
        bump = torch.zeros_like(logps)
        bump[0, 0] = 1e-3  # completion token 1 of row 0: always unmasked
        return logps + bump, entropy

    monkeypatch.setattr(window_module, "completion_head", perturbed)  # the prompt-once path's head
    _seed_state(model)
    before = _state(model)
    report = grpo_mem.verify(model, batch, print_report=False)
    assert not report.passed and abs(report.max_logp_diff - 1e-3) < 1e-5
    assert any(f.startswith("log-prob:") for f in report.failures), report.failures
    with pytest.raises(VerificationError, match=r"FAILED(.|\n)*log-prob: (9\.99\d|1\.00\d)e-0[34] > 1e-05") as info:
        grpo_mem.verify(model, batch, raise_on_mismatch=True, print_report=False)
    assert isinstance(info.value, AssertionError) and info.value.report.failures
    _assert_restored(model, before)


def test_fallback_is_reported_with_its_cause():
    """Micro-batches of one row whose prompts appear nowhere else: stock fallback, cause named; the warning is
    still issued later in training."""
    model = tiny_model()
    batch = _batch((5, 8), G=1, C=4)
    support._warned.discard(UNSHARED)
    report = grpo_mem.verify(model, batch, micro_batch_size=1, print_report=False)
    assert report.passed, str(report)
    assert [m.path for m in report.micro_batches] == ["stock fallback"] * 2
    assert report.micro_batches[0].why == UNSHARED
    assert UNSHARED not in support._warned


def test_bad_batches_are_refused():
    model = tiny_model()
    batch = _batch()
    with pytest.raises(ValueError, match=r"needs a batch"):
        grpo_mem.verify(model)
    with pytest.raises(ValueError, match=r"lacks \['completion_mask'\]"):
        grpo_mem.verify(model, {k: v for k, v in batch.items() if k != "completion_mask"})
    with pytest.raises(ValueError, match=r"batch\['prompt_ids'\] has shape \(9, 9\) but batch\['prompt_mask'\]"):
        grpo_mem.verify(model, {**batch, "prompt_mask": batch["prompt_mask"][:, 1:]})
    with pytest.raises(ValueError, match=r"9 prompt rows but 8 completion rows"):
        grpo_mem.verify(model, {**batch, "completion_ids": batch["completion_ids"][:8],
                                "completion_mask": batch["completion_mask"][:8]})  # fmt: skip
    with pytest.raises(ValueError, match="2-D"):
        grpo_mem.verify(model, {**batch, "prompt_ids": batch["prompt_ids"][0]})
    right_padded = {**batch, "prompt_mask": batch["prompt_mask"].flip(1), "prompt_ids": batch["prompt_ids"].flip(1)}
    with pytest.raises(ValueError, match="left-padded"):
        grpo_mem.verify(model, right_padded)


def test_smollm2_shape_bf16_autocast():
    """The main job's model shape (SmolLM2-135M, 2 layers, random weights) under bf16 autocast: judged against
    stock TRL in fp32 (grpo_mem's error within stock's own)."""
    model = smollm2_shaped()
    batch = _batch((12, 20), G=2, C=8, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = grpo_mem.verify(model, batch, print_report=False)
    assert report.precision == "bfloat16 autocast" and report.grad_vs_fp32["stock"] > 0, str(report)
    assert report.passed, str(report)
    assert next(model.parameters()).dtype == torch.float32  # cast back after the fp32 run

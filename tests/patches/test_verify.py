"""grpo_mem.verify: passes where grpo_mem matches stock TRL, fails loudly where it does not, leaves no trace."""

import contextlib
import inspect
import types

import pytest
import torch
from helpers import make_batch, make_trainer, smollm2_shaped, tiny_model

import grpo_mem
from grpo_mem.model import fallback
from grpo_mem.model import window as window_module
from grpo_mem.model.sharing import UNSHARED
from grpo_mem.patches import verify_inputs
from grpo_mem.patches.checks import LOGPS_METHOD
from grpo_mem.patches.verify_criteria import VerificationError
from grpo_mem.patches.verify_inputs import Scorer, lay_out, stock_method
from grpo_mem.patches.verify_runs import score, trl_head_tile


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
    trainer, _ = make_trainer(
        output_dir=tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=4
    )
    model = trainer.model
    _seed_state(model)
    before = _state(model)
    metrics = {k: dict(v) for k, v in trainer._metrics.items()}
    warned = set(fallback._warned)
    report = grpo_mem.verify(trainer, print_report=False)
    assert report.passed, str(report)
    assert report.precision == "fp32" and report.rows == 8 and len(report.micro_batches) == 4
    assert all(m.path == "prompt-once" for m in report.micro_batches), str(report)
    assert any("shared with micro-batch" in m.why for m in report.micro_batches), str(report)
    assert report.max_logp_diff <= 1e-5 and report.grad_rel_diff <= 1e-4
    _assert_restored(model, before)
    assert {k: dict(v) for k, v in trainer._metrics.items()} == metrics
    assert fallback._warned == warned
    assert LOGPS_METHOD not in trainer.__dict__
    assert "PASSED" in str(report) and "max |Δ log-prob|" in str(report)
    # what grpo_mem's kernels ran on (CPU: ATen's attention, the C++ head where the extension is built)
    head = "cpp" if grpo_mem.ops.HAS_EXT else "torch"
    assert f"kernel backend: attention cpu, head {head} (auto)" in str(report), str(report)


def test_already_patched_trainer_compares_against_true_stock(tmp_path):
    from trl import GRPOTrainer

    with grpo_mem.patch_trl(GRPOTrainer) as handle:
        trainer, _ = make_trainer(output_dir=tmp_path, per_device_train_batch_size=4)
        patched = GRPOTrainer.__dict__[LOGPS_METHOD]
        assert stock_method(trainer) is inspect.unwrap(patched.__wrapped_original__)
        report = grpo_mem.verify(trainer, print_report=False)
        assert report.passed, str(report)
        assert handle.active and GRPOTrainer.__dict__[LOGPS_METHOD] is patched
        assert grpo_mem.patch_trl(GRPOTrainer) is handle


def _perturb_head(monkeypatch, bump_of):
    """grpo_mem's completion head (the prompt-once path) returns ``bump_of(logps)`` added to its log-probs."""
    head = window_module.completion_head

    def perturbed(*args, **kwargs):
        logps, entropy = head(*args, **kwargs)
        return logps + bump_of(logps), entropy

    monkeypatch.setattr(window_module, "completion_head", perturbed)


def _noise(logps, seed, size):
    """+-size at every position, signs drawn from ``seed``: a stand-in for fp32 rounding of that size."""
    signs = torch.randint(0, 2, logps.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return size * signs.to(logps.dtype)


def test_broken_path_fails_loudly(monkeypatch):
    """One log-prob of grpo_mem's head perturbed by 1e-3: beyond the direct bound, and against the fp64 truth far
    beyond stock's own error, so the report fails and raise_on_mismatch raises with the numbers; the model is
    restored either way."""
    model = tiny_model()
    batch = _batch()

    def bump(logps):
        out = torch.zeros_like(logps)
        out[0, 0] = 1e-3  # completion token 1 of row 0: always unmasked
        return out

    _perturb_head(monkeypatch, bump)
    _seed_state(model)
    before = _state(model)
    report = grpo_mem.verify(model, batch, print_report=False)
    assert not report.passed and abs(report.max_logp_diff - 1e-3) < 1e-5
    assert report.truth == "fp64" and report.exceeded == ["log-prob"], str(report)
    stats = report.logp_vs_truth
    assert stats["stock"]["max"] < 1e-6 and abs(stats["grpo_mem"]["max"] - 1e-3) < 1e-5, str(report)
    assert report.grad_vs_truth is None  # gradients within their direct bound: the truth ran forward only
    assert [f.split(":")[0] for f in report.failures] == ["log-prob vs fp64"], report.failures
    with pytest.raises(
        VerificationError,
        match=r"FAILED(.|\n)*ours (1\.000e-03|9\.99\de-04)(.|\n)*log-prob vs fp64: rms error 0\.00017",
    ):
        grpo_mem.verify(model, batch, raise_on_mismatch=True, print_report=False)
    _assert_restored(model, before)
    assert next(model.parameters()).dtype == torch.float32  # cast back after the fp64 run


def test_fp32_is_judged_against_stocks_own_error(monkeypatch):
    """Both fp32 paths off the fp64 truth by +-3e-5 (independent signs, like a real model's rounding, SmolLM2-135M:
    3e-5): |grpo_mem - stock| reaches 6e-5, beyond the direct 1e-5, yet grpo_mem is as exact as stock and passes.
    The same 3e-5 on grpo_mem alone, where stock is exact to 1e-6, fails."""
    model = tiny_model()
    batch = _batch()
    own_method = stock_method

    def noisy_stock(owner):
        fn = own_method(owner)

        def method(self, *args, **kwargs):
            logps, entropies, aux = fn(self, *args, **kwargs)
            if logps.dtype == torch.float32:  # the fp64 truth stays exact
                logps = logps + _noise(logps, 1, 3e-5)
            return logps, entropies, aux

        return method

    _perturb_head(monkeypatch, lambda logps: _noise(logps, 2, 3e-5))
    alone = grpo_mem.verify(model, batch, print_report=False)
    monkeypatch.setattr(verify_inputs, "stock_method", noisy_stock)
    both = grpo_mem.verify(model, batch, print_report=False)
    assert 5.9e-5 < both.max_logp_diff < 6.1e-5 and both.exceeded == ["log-prob"], str(both)
    assert both.passed and both.truth == "fp64", str(both)
    assert 2.9e-5 < both.logp_vs_truth["stock"]["max"] < 3.1e-5
    assert 2.9e-5 < alone.max_logp_diff < 3.1e-5 and alone.logp_vs_truth["stock"]["max"] < 1e-6, str(alone)
    assert not alone.passed and [f.split(":")[0] for f in alone.failures] == ["log-prob vs fp64"], str(alone)
    # judged again against the fp32-storage floor: far below 3e-5 on this 2-layer model, so it still fails
    assert alone.floor and alone.logp_vs_truth["fp32 floor"]["max"] < 1e-6, str(alone)


def test_gradient_beyond_its_bound_is_judged_with_fp64_gradients(monkeypatch):
    """grpo_mem's log-prob gradients scaled by 1.01 (values unchanged): the direct gradient bound is exceeded, the
    fp64 truth runs with gradients, and grpo_mem's relative gradient error (1e-2) fails against stock's (< 1e-6)."""
    model = tiny_model()
    _perturb_head(monkeypatch, lambda logps: 0.01 * (logps - logps.detach()))
    report = grpo_mem.verify(model, _batch(), print_report=False)
    assert report.max_logp_diff < 1e-5 and report.exceeded == ["gradient"], str(report)
    assert report.truth == "fp64" and report.grad_vs_truth["stock"] < 1e-6, str(report)
    assert 5e-3 < report.grad_vs_truth["grpo_mem"] < 2e-2, str(report)
    assert not report.passed and [f.split(":")[0] for f in report.failures] == ["gradient vs fp64"], str(report)


def test_progress_bar_counts_every_scored_call(capsys):
    """The progress bar (stderr) names each run and counts every call it scores: grpo_mem's 2 micro-batches (9 rows
    in micro-batches of 6) and stock TRL's row chunks of each; ``progress=False`` prints nothing there."""
    model = tiny_model()
    report = grpo_mem.verify(model, _batch(), micro_batch_size=6, print_report=False)
    err = capsys.readouterr().err
    assert report.passed and "grpo_mem.verify: grpo_mem" in err and "grpo_mem.verify: stock TRL" in err
    rows = report.row_chunks["stock"]
    calls = 2 + -(-6 // rows) + -(-3 // rows)
    assert f"{calls}/{calls}" in err, (rows, err[-300:])
    grpo_mem.verify(model, _batch(), micro_batch_size=6, print_report=False, progress=False)
    assert capsys.readouterr().err == ""


def test_fallback_is_reported_with_its_cause():
    """Micro-batches of one row whose prompts appear nowhere else: stock fallback, cause named; the warning is
    still issued later in training."""
    model = tiny_model()
    batch = _batch((5, 8), G=1, C=4)
    fallback._warned.discard(UNSHARED)
    report = grpo_mem.verify(model, batch, micro_batch_size=1, print_report=False)
    assert report.passed, str(report)
    assert [m.path for m in report.micro_batches] == ["stock fallback"] * 2
    assert report.micro_batches[0].why == UNSHARED
    assert report.backend == "no grpo_mem kernel ran (auto)"  # the run-time confirmation's tiny copy is not counted
    assert UNSHARED not in fallback._warned


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
        grpo_mem.verify(
            model,
            {**batch, "completion_ids": batch["completion_ids"][:8], "completion_mask": batch["completion_mask"][:8]},
        )
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
    assert report.precision == "bfloat16 autocast" and report.truth == "fp32", str(report)
    assert report.grad_vs_truth["stock"] > 0 and report.exceeded == [], str(report)
    assert report.passed, str(report)
    assert next(model.parameters()).dtype == torch.float32  # cast back after the fp32 run


def _patched_step_peak(model, batch, micro):
    """Peak tensor bytes of the patched training step verify checks: the patched method over the micro-batches of one
    gradient-accumulation window (prompt passes shared through its session), each followed by the loss's backward."""
    import trl

    from grpo_mem.bench.measure import TensorMemoryTracker
    from grpo_mem.patches.trl import patched_method

    self_obj = Scorer(model, 1.0)
    fn, handle = patched_method(stock_method(trl.GRPOTrainer))
    session = handle.session(self_obj)
    P, C, B = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1], batch["prompt_ids"].shape[0]
    slices = [(lo, min(lo + micro, B)) for lo in range(0, B, micro)]
    model.zero_grad(set_to_none=True)
    with TensorMemoryTracker() as tracker:
        # the step's input layout, as TRL's _compute_loss concatenates it
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        session.begin_window([ids[lo:hi, :P] for lo, hi in slices], [mask[lo:hi, :P] for lo, hi in slices])
        for lo, hi in slices:
            logps, ent, _ = fn(self_obj, model, ids[lo:hi], mask[lo:hi], C, batch_size=hi - lo, compute_entropy=True)
            m = batch["completion_mask"][lo:hi].float()
            (-(m * logps.float()).sum() - 0.1 * (m * ent.float()).sum()).backward()
        session.close_window()
        del logps, ent
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def test_peak_memory_within_the_patched_step():
    """bf16 weights, a 4096-token vocabulary, a 240-token system prompt shared by 2 prompts x 4 completions of 4
    tokens, micro-batches of 4: verify's peak tensor memory (stock and the fp32 truth in one-row chunks with their
    decoder layers checkpointed, stock's TRL head in vocabulary tiles as wide as the hidden size, the truth widened
    per module and only in the embedding rows used, gradients sketched) is within 6 % of the patched step's. Measured:
    3,758,360 B against the step's 3,566,742 B (1.054x), set by the fp32 truth's one-row run (3.76 MB; stock's peaks at
    3.71 MB): on this tiny model one row's activations weigh as much as the parameters, and since the last decoder
    layer runs a prompt only as far as its K/V (``model/last_layer.py``) the step itself peaks below one such row
    (before it, the step's 3,966,312 B set verify's peak, 196 B above it). On the bench shape of
    ``benchmarks/verify_memory.py`` the one-row runs are far below the step, and verify's peak stays within it.
    Stock TRL's method over one whole micro-batch (what verify ran before) takes more than 2x the step (59x with TRL
    1.16's fused head at its own tile, 2.4x with TRL 1.13's logits). Not so for a
    101-token vocabulary, where one row's activations outweigh the parameters: there the fp32 truth's one 254-token row
    peaks at 2.82 MB vs the step's 2.02 MB (without its 33 KB input concatenation)."""
    from grpo_mem.bench.measure import TensorMemoryTracker

    model = tiny_model(layers=2, dtype=torch.bfloat16, hidden_size=64, intermediate_size=128, vocab_size=4096)
    system = torch.randint(4, 101, (240,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = _batch((250, 246), G=4, C=4, prompts=[system + [5] * 10, system + [6] * 6])
    step = _patched_step_peak(model, batch, 4)
    with TensorMemoryTracker() as tracker:
        report = grpo_mem.verify(model, batch, micro_batch_size=4, print_report=False)
    assert report.passed and report.truth == "fp32" and report.truth_mode == "per module", str(report)
    assert report.row_chunks == {"stock": 1, "fp32 truth": 1}, report.row_chunks
    assert tracker.peak_bytes <= 1.06 * step, (tracker.peak_bytes, step)
    # the old way: stock TRL's method over one whole micro-batch of 4 rows, with its backward
    with TensorMemoryTracker() as whole:
        setup = lay_out(model, batch, 4, 1.0, 0)
        score(setup.stock_fn, setup, 0.1, chunks=[(0, 4)])
    assert whole.peak_bytes > 2 * step, (whole.peak_bytes, step)


def test_trl_head_tile_changes_only_summation_order():
    """Stock's calls use TRL's own fused head with a narrower vocabulary tile (``trl_head_tile``): TRL's kernel folds
    each tile into online log-sum-exp statistics, so the log-probs, entropies and gradients differ from TRL's 32768-
    column tile only by the order of fp32 sums. fp32, a 40000-token vocabulary (two tiles of TRL's, 313 of 128 columns
    here), 2 rows of 64 tokens: measured max |difference| 1.9e-06 in log-probs (values about -10.6), 1.9e-06 in
    entropies (about 10.6), 3.4e-07 relative in the gradient (2 ulps of fp32 at those values); bounded here at
    1e-5 / 1e-5 / 1e-5. The tile is restored after."""
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this TRL release has no fused LM head (TRL 1.15 added it); trl_head_tile changes nothing there")
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model(vocab_size=40000, hidden_size=32, intermediate_size=64)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.randint(3, 40000, (2, 64), generator=torch.Generator().manual_seed(0))
    setup = types.SimpleNamespace(ids=ids, model=model)

    def run(narrow):
        model.zero_grad(set_to_none=True)
        ctx = trl_head_tile(setup) if narrow else contextlib.nullcontext()
        with ctx:
            if narrow:
                assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == 128  # the hidden size (32), at least 128
            out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        return out.log_probs.detach(), out.entropy.detach(), grad

    wide, narrow = run(False), run(True)
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == 32768
    assert (wide[0] - narrow[0]).abs().max() <= 1e-5
    assert (wide[1] - narrow[1]).abs().max() <= 1e-5
    assert (wide[2] - narrow[2]).norm() <= 1e-5 * wide[2].norm()

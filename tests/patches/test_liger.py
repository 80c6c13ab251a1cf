"""``use_liger_kernel=True`` with the patch, against stock TRL with the same flag.

TRL 1.10-1.13 compute the policy's loss with Liger's fused linear GRPO loss, fed by ``_get_last_hidden_state``; the
patch serves those hidden states from the prompt-once path (run here by ``bash tests/compat/run.sh 1.13.0``). TRL
1.14+ keep their log-prob method under the flag (the patched one) and only swap Liger's layer kernels into the model,
which the prompt-once path calls as the stock forward does. Liger's RMSNorm and SwiGLU kernels fail on CPU, under
``TRITON_INTERPRET=1`` too; its RoPE kernel runs under the interpreter, so one test runs it in a fresh process.
"""

import importlib.util
from collections import Counter

import pytest
import torch
import trl
from helpers import (
    PROMPTS,
    SYSTEM_PROMPT,
    assert_close,
    assert_grads_close,
    grads_of,
    make_batch,
    make_trainer,
    needs_interpreter,
    stock_logps,
    tiny_model,
)
from transformers import TrainerCallback

import grpo_mem
from grpo_mem.model import fallback, packed
from grpo_mem.model.sharing import SharingSession

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
needs_liger = pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (the test extra has it)")
LIGER_LOSS = hasattr(trl.GRPOTrainer, "compute_liger_loss")  # TRL 1.10-1.13
KERNELS_OFF = dict(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=False)
SYSTEM_TEXT = SYSTEM_PROMPT
# GA 2 micro-batches of 3 rows, groups of 2: each step holds 3 prompts, the middle one split over both micro-batches
ARGS = dict(
    max_steps=3,
    gradient_accumulation_steps=2,
    per_device_train_batch_size=3,
    num_generations=2,
    optim="sgd",
    beta=0.04,
    use_liger_kernel=True,
    prompts=[SYSTEM_TEXT + p for p in PROMPTS],
)
# logged values that are not results of the computation
UNTIMED = ("runtime", "per_second", "step_time")


class BackboneRecorder(TrainerCallback):
    """Per optimizer step: the rows (padding id 0 dropped) and token count of every embedding call made with
    gradients in training (the backbone passes of the loss), and the step's prompts. A packed call of the prompt-once
    path embeds one (1, T) sequence of blocks; its rows are its blocks' rows (``packed._Call.add``)."""

    def __init__(self, trainer):
        self.trainer, self.steps = trainer, []
        self._rows, self._tokens, self._blocks = [], 0, []
        self.hook = trainer.model.get_input_embeddings().register_forward_hook(self._record)
        self._add = packed._Call.add

        def add(call, ids, positions, ctx):
            self._blocks.append(ids)
            return self._add(call, ids, positions, ctx)

        packed._Call.add = add

    def remove(self):
        self.hook.remove()
        packed._Call.add = self._add

    def _record(self, module, args, out):
        ids, blocks, self._blocks = args[0], self._blocks, []
        if torch.is_grad_enabled() and module.training:
            # a packed call's blocks are the last ones added (blocks of calls this hook does not see precede them)
            rows, tokens = [], 0
            while blocks and tokens < ids.numel():
                rows[:0], tokens = list(blocks[-1]), tokens + blocks.pop().numel()
            rows = rows if ids.shape[0] == 1 and tokens == ids.numel() else ids
            self._rows += [tuple(r[r != 0].tolist()) for r in rows]
            self._tokens += ids.numel()

    def on_step_end(self, args, state, control, **kwargs):
        prompts = {
            tuple(ids[mask.bool()].tolist())
            for batch in self.trainer._buffered_inputs
            for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])
        }
        self.steps.append((self._rows, self._tokens, prompts))
        self._rows, self._tokens = [], 0


def _train(tmp_path, *, patch, sharing="tree", **args):
    """Train ``ARGS`` (stock's row order: TRL 1.10's Liger loss normalises by each micro-batch's tokens, so a group
    shuffle would change its objective; 1.13 passes it the generation batch's count)."""
    trainer, handle = make_trainer(
        patch=patch, sharing=sharing, group_shuffle=False, output_dir=tmp_path, **{**ARGS, **args}
    )
    recorder = BackboneRecorder(trainer)
    trainer.add_callback(recorder)
    try:
        trainer.train()
    finally:
        recorder.remove()
        if handle is not None:
            handle.revert()
    return trainer, recorder.steps


def _assert_same_training(ours, stock, steps=ARGS["max_steps"]):
    """Same steps, every logged value of stock's within 1e-5 (relative above 1), weights within 1e-5."""
    assert ours.state.global_step == stock.state.global_step == steps
    for mine, theirs in zip(ours.state.log_history, stock.state.log_history, strict=True):
        for key, value in theirs.items():
            if any(word in key for word in UNTIMED):
                continue
            assert key in mine, f"step {theirs.get('step')}: {key} not logged"
            assert abs(mine[key] - value) <= 1e-5 * max(1.0, abs(value)), f"{key}: ours {mine[key]!r} stock {value!r}"
    stock_params = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_params[name].detach(), 1e-5, name)


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
    """Stock TRL's three steps with ``use_liger_kernel=True`` (layer kernels off), shared by both sharing modes."""
    return _train(tmp_path_factory.mktemp("stock"), patch=False, liger_kernel_config=KERNELS_OFF)


@needs_liger
@pytest.mark.parametrize("sharing", ["group", "tree"])
def test_liger_training_matches_stock_and_forwards_prompts_once(tmp_path, stock_run, sharing):
    """Three steps with ``use_liger_kernel=True`` (layer kernels off): on TRL 1.10-1.13 Liger's fused GRPO loss is fed
    the prompt-once hidden states; on 1.14+ the patched log-prob method scores. Losses, logged metrics and weights
    equal stock TRL's with the same flag; each step forwards every prompt (group) or the shared system prompt (tree)
    once, and the backbone runs the tokens the logged decision counts."""
    stock, stock_steps = stock_run
    fallback._warned.clear()
    with pytest.warns() as caught:
        ours, our_steps = _train(tmp_path / "ours", patch=True, sharing=sharing, liger_kernel_config=KERNELS_OFF)
    assert not [str(w.message) for w in caught if "grpo_mem" in str(w.message)]  # no fallback, no unserved Liger path
    _assert_same_training(ours, stock)

    n = ARGS["gradient_accumulation_steps"]
    logged = [h for h in ours.state.log_history if "grpo_mem/token_ratio" in h]
    system = tuple(ours.processing_class(SYSTEM_TEXT)["input_ids"])
    assert len(system) == len(SYSTEM_TEXT) and len(logged) == len(our_steps) == ARGS["max_steps"]
    for (rows, tokens, prompts), (_, stock_tokens, _), log in zip(our_steps, stock_steps, logged, strict=True):
        assert log[f"grpo_mem/path/{sharing}"] == 1.0 and log["grpo_mem/path/stock"] == 0.0
        assert tokens == round(log["grpo_mem/backbone_tokens"] * n) < stock_tokens
        assert stock_tokens == round(log["grpo_mem/stock_tokens"] * n)
        whole = Counter(r for r in rows if r in prompts)
        if sharing == "group":
            assert whole == Counter(prompts), "every prompt of the step forwarded once, whole"
        else:
            assert not whole and rows.count(system) == 1, "the system prompt forwarded once, no prompt whole"


@needs_liger
def test_unserved_liger_loss_warns_once(tmp_path):
    """A trainer whose Liger loss reads hidden states through a method the patch does not know: one warning names it,
    and nothing of it is replaced."""

    class Changed(trl.GRPOTrainer):
        def compute_liger_loss(self, unwrapped_model, inputs):
            raise AssertionError("not called here")

        def _get_last_hidden_state(self, unwrapped_model, input_ids):
            raise AssertionError("not called here")

    Changed.__module__ = trl.GRPOTrainer.__module__  # where the patch finds the shuffle it swaps
    trainer, _ = make_trainer(output_dir=tmp_path, use_liger_kernel=True, liger_kernel_config=KERNELS_OFF)
    trainer.__class__ = Changed
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by Trainer.train
    batch = next(iter(trainer.get_train_dataloader()))
    fallback._warned.clear()
    with grpo_mem.patch_trl(trainer) as handle, pytest.warns(UserWarning, match="use_liger_kernel=True") as caught:
        assert "_get_last_hidden_state" not in trainer.__dict__
        assert "_get_last_hidden_state" in handle.unserved_liger(trainer)
        trainer._prepare_inputs(batch)
        trainer._prepare_inputs(batch)
    assert sum("use_liger_kernel=True" in str(w.message) for w in caught) == 1


@needs_interpreter
@needs_liger
def test_liger_rope_kernel_in_the_prompt_once_path(monkeypatch):
    """Liger's Triton RoPE kernel swapped into a Llama (as ``liger_kernel_config={"rope": True}`` does), run by Triton's
    interpreter: tree sharing calls it at its own positions (a shared node, each prompt's own part, the completions)
    and its log-probs, entropies and gradients equal TRL's own method on the same model. Small shapes: the
    interpreter runs a program per row and position."""
    from liger_kernel.transformers import monkey_patch
    from transformers.models.llama import modeling_llama

    calls = Counter()
    kernel = monkey_patch.liger_rotary_pos_emb

    def counted(*args, **kwargs):
        calls["rope"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(monkey_patch, "liger_rotary_pos_emb", counted)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)  # undone after
    model = tiny_model("llama").train()
    monkey_patch.apply_liger_kernel_to_llama(model=model, **{**KERNELS_OFF, "rope": True})
    assert modeling_llama.apply_rotary_pos_emb is counted
    shared = list(range(10, 16))
    ids, mask, C, _ = make_batch(None, 2, 3, prompts=[shared + [20, 21], shared + [30, 31, 32]], shuffle=True)
    ref, ref_ent = stock_logps(model, ids, mask, C, compute_entropy=True)
    ref_grads = grads_of(model, ref, ref_ent)
    stock_calls = calls["rope"]
    session = SharingSession("tree", min_shared_tokens=4)
    session.score(model, ids, mask, C)  # the admission's first look runs each layer's attention on a twin (its RoPE)
    calls["rope"] = 0
    with session.recording() as decisions:
        ours, ours_ent = session.score(model, ids, mask, C, compute_entropy=True)
    # one call a layer: stock's one pass; ours one packed call of the shared node, the prompts' own parts and the
    # completions, each block at its own positions, its last layer in two steps (the nodes' K/V, then the rows' last
    # tokens and the completions: ``last_layer``)
    assert [d.path for d in decisions] == ["tree"] and (stock_calls, calls["rope"]) == (2, 3)
    assert_close(ours, ref, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_close(ours_ent, ref_ent, 1e-5, "entropies", mask=mask[:, -C:])
    assert_grads_close(grads_of(model, ours, ours_ent), ref_grads, 1e-4)

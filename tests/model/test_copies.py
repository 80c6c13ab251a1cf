"""Copies and saves of a model grpo_mem has scored are ordinary models (STYLE: "A copy of a patched object is an
ordinary object"): ``copy.deepcopy``, ``pickle``, ``torch.save``/``torch.load`` of the whole module and
``save_pretrained``/``from_pretrained`` give a module that computes with its own weights, names its own attention
implementation, and is scored by grpo_mem exactly as stock TRL scores it; ``restore`` of the original leaves it intact.

Before the fix a deep copy's forward was the original's closure: a backward through the copy's logits put gradients on
every parameter of the original and none of the copy's."""

import copy
import io
import pickle

import pytest
import torch
from helpers import assert_close, assert_grads_close, grads_of, make_batch, stock_logps, tiny_model
from transformers import AutoModelForCausalLM

import grpo_mem
from grpo_mem.model import attention_hook as attn_hook
from grpo_mem.model.forward import installed


def _torch_save(model, tmp_path):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _save_pretrained(model, tmp_path):
    model.save_pretrained(tmp_path / "saved")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "saved")


COPIES = {
    "deepcopy": lambda model, tmp_path: copy.deepcopy(model),
    "pickle": lambda model, tmp_path: pickle.loads(pickle.dumps(model)),
    "torch_save": _torch_save,
    "save_pretrained": _save_pretrained,
}


def _batch():
    return make_batch([5, 9], 2, 4, seed=3)


def _scored(arch):
    """A tiny model after a grpo_mem scoring call with its backward (attention taken over, forward installed; for
    qwen3_5 its linear-attention layers wrapped too), and the batch."""
    model = tiny_model(arch)
    ids, mask, C, _ = _batch()
    logps, _ = grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    logps.sum().backward()
    model.zero_grad(set_to_none=True)
    assert installed(model) and attn_hook.taken_over(model)
    assert model.config._attn_implementation == "grpo_mem_sdpa"
    return model, (ids, mask, C)


def _logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits


def _grpo_mem_state(model) -> list[str]:
    """The grpo_mem entries of every module's ``__dict__`` (a plain model has none), and ``forward`` where a module
    has one of its own."""
    return [
        f"{name}.{key}"
        for name, module in model.named_modules()
        for key in module.__dict__
        if "grpo_mem" in key or key == "forward"
    ]


# qwen3_5: its Gated DeltaNet layers carry forwards of their own (``linear_attention``), which the whole-module copies
# (deepcopy, pickle; torch.save pickles) carry; save_pretrained carries weights and config only
CASES = [(how, "llama") for how in COPIES] + [("deepcopy", "qwen3_5"), ("pickle", "qwen3_5")]


@pytest.mark.parametrize("how,arch", CASES, ids=[f"{how}-{arch}" for how, arch in CASES])
def test_copy_of_scored_model_is_an_ordinary_model(tmp_path, how, arch):
    """The copy: logits equal a never-scored model's with the same weights; its backward reaches its own parameters
    only; perturbing it changes its output and not the original's; ``restore(original)`` leaves it unchanged; grpo_mem on it equals stock TRL on it (log-probs, entropies, gradients) and leaves the original's
    gradients alone; ``restore(copy)`` leaves no grpo_mem state on it."""
    original, (ids, mask, C) = _scored(arch)
    plain = tiny_model(arch)
    plain.load_state_dict(original.state_dict())
    copied = COPIES[how](original, tmp_path)

    with torch.no_grad():
        want, before = _logits(plain, ids, mask), _logits(original, ids, mask)
    logits = _logits(copied, ids, mask)
    assert torch.equal(logits, want)
    logits.sum().backward()
    assert [n for n, p in original.named_parameters() if p.grad is not None] == []
    assert all(p.grad is not None for p in copied.parameters())
    copied.zero_grad(set_to_none=True)
    assert copied.config._attn_implementation == "sdpa" and not attn_hook.taken_over(copied)

    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(1.05)
        changed = _logits(copied, ids, mask)
        assert (changed - want).abs().max() > 1e-3
        assert torch.equal(_logits(original, ids, mask), before)

    grpo_mem.restore(original)
    with torch.no_grad():
        assert torch.equal(_logits(copied, ids, mask), changed)

    ours, ours_e = grpo_mem.shared_prompt_logprobs(copied, ids, mask, C, compute_entropy=True)
    assert attn_hook.taken_over(copied)
    ours_g = grads_of(copied, ours, ours_e)
    ref, ref_e = stock_logps(copied, ids, mask, C, compute_entropy=True)
    ref_g = grads_of(copied, ref, ref_e)
    keep = mask[:, -C:]
    assert_close(ours, ref, 1e-5, "log-probs", mask=keep)
    assert_close(ours_e, ref_e, 1e-5, "entropies", mask=keep)
    assert_grads_close(ours_g, ref_g)
    assert all(p.grad is None for p in original.parameters())

    grpo_mem.restore(copied)
    copied.__dict__.pop("_test_fused", None)  # stock_logps' marker of TRL's fused head
    assert [k for k in _grpo_mem_state(copied) if k != ".forward"] == []  # ".forward": TRL's fused head
    assert copied.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_outlives_the_hook(monkeypatch, tmp_path, how):
    """A copy of a model running an attention implementation no other model uses: once the original is restored
    (the hook unregistered, as in a process that only loads the copy) the copy computes what a never-scored model
    computes, and can be scored."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from grpo_mem.model import support

    AttentionInterface.register("copies_impl", attn_hook.ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register("copies_impl", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    monkeypatch.setattr(support, "SUPPORTED_ATTENTION", support.SUPPORTED_ATTENTION | {"copies_impl"})
    original, plain = tiny_model("llama"), tiny_model("llama")
    original.set_attn_implementation("copies_impl")
    ids, mask, C, _ = _batch()
    grpo_mem.shared_prompt_logprobs(original, ids, mask, C)
    assert original.config._attn_implementation == "grpo_mem_copies_impl"
    copied = COPIES[how](original, tmp_path)
    grpo_mem.restore(original)
    assert "grpo_mem_copies_impl" not in attn_hook.ALL_ATTENTION_FUNCTIONS
    assert copied.config._attn_implementation == "copies_impl"
    with torch.no_grad():
        assert torch.equal(_logits(copied, ids, mask), _logits(plain, ids, mask))
        ours, _ = grpo_mem.shared_prompt_logprobs(copied, ids, mask, C)
    grpo_mem.restore(copied)
    ref, _ = stock_logps(plain, ids, mask, C)
    assert_close(ours, ref, 1e-5, "log-probs", mask=mask[:, -C:])


def test_copy_of_copy_and_scored_copy(tmp_path):
    """A copy made while the copy itself runs grpo_mem (taken over, forward installed) is plain as well, and
    scoring it does not touch the copy it came from."""
    original, (ids, mask, C) = _scored("llama")
    first = copy.deepcopy(original)
    grpo_mem.shared_prompt_logprobs(first, ids, mask, C)
    second = pickle.loads(pickle.dumps(first))
    assert second.config._attn_implementation == "sdpa" and not attn_hook.taken_over(second)
    logps, _ = grpo_mem.shared_prompt_logprobs(second, ids, mask, C)
    logps.sum().backward()
    assert all(p.grad is not None for p in second.parameters())
    assert all(p.grad is None for p in (*original.parameters(), *first.parameters()))
    ref, _ = stock_logps(tiny_model("llama"), ids, mask, C)
    assert_close(logps, ref, 1e-5, "log-probs", mask=mask[:, -C:])


def test_deepcopy_of_scored_peft_model():
    """A LoRA-wrapped model scored through PEFT, then deep-copied: the copy's adapters get the copy's gradients, the
    original's get none, and grpo_mem on the copy equals stock TRL on it."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ids, mask, C, _ = _batch()
    grpo_mem.shared_prompt_logprobs(lora, ids, mask, C)
    copied = copy.deepcopy(lora)
    _logits(copied, ids, mask).sum().backward()
    trainable = [n for n, p in copied.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for n, p in copied.named_parameters() if n in trainable)
    assert all(p.grad is None for p in lora.parameters())
    copied.zero_grad(set_to_none=True)

    ours, ours_e = grpo_mem.shared_prompt_logprobs(copied, ids, mask, C, compute_entropy=True)
    ours_g = grads_of(copied, ours, ours_e)
    ref, ref_e = stock_logps(copied, ids, mask, C, compute_entropy=True)
    ref_g = grads_of(copied, ref, ref_e)
    assert_close(ours, ref, 1e-5, "log-probs", mask=mask[:, -C:])
    assert_grads_close(ours_g, ref_g)
    assert all(p.grad is None for p in lora.parameters())


def test_create_reference_model_does_not_follow_the_policy():
    """TRL's ``create_reference_model`` (a deep copy) of a policy grpo_mem has scored keeps the weights it was made
    with: after an SGD step on the policy its logits equal a never-scored model's with the pre-step weights."""
    from trl import create_reference_model

    policy, (ids, mask, C) = _scored("llama")
    plain = tiny_model("llama")
    ref = create_reference_model(policy)
    logps, _ = grpo_mem.shared_prompt_logprobs(policy, ids, mask, C)
    logps.sum().backward()
    torch.optim.SGD(policy.parameters(), lr=0.1).step()
    with torch.no_grad():
        assert torch.equal(_logits(ref, ids, mask), _logits(plain, ids, mask))
        assert (_logits(policy, ids, mask) - _logits(plain, ids, mask)).abs().max() > 1e-3


def test_patched_trainer_scores_a_reference_model_built_from_a_scored_policy(tmp_path):
    """beta > 0 with the policy passed as an instance grpo_mem has already scored: TRL 1.16 builds the reference
    model from the policy's path with the policy's ``attn_implementation``, the hook's name. The patched trainer's
    reference log-probs equal stock TRL's on a never-scored model with the reference's weights, with the policy
    moved away from them (before: the reference was not taken over, its completions ignored their prompts: 0.18
    off)."""
    from datasets import Dataset
    from helpers import PROMPTS, TRAINER_DEFAULTS, char_tokenizer, length_reward
    from trl import GRPOConfig, GRPOTrainer

    tiny_model("llama").save_pretrained(tmp_path / "model")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    ids, mask, C, _ = _batch()
    grpo_mem.shared_prompt_logprobs(policy, ids, mask, C)
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=length_reward,
        args=GRPOConfig(**dict(TRAINER_DEFAULTS, output_dir=str(tmp_path), beta=0.04)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=char_tokenizer(),
    )
    assert trainer.ref_model.config._attn_implementation == "grpo_mem_sdpa"  # the policy's, as TRL passes it on
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.05)
    with grpo_mem.patch_trl(trainer), torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, C)[0]
        assert attn_hook.taken_over(trainer.ref_model)
    ref, _ = stock_logps(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), ids, mask, C)
    assert_close(ours, ref, 1e-5, "reference log-probs", mask=mask[:, -C:])
    assert trainer.ref_model.config._attn_implementation == "sdpa"  # revert restored it

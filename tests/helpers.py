"""Tiny random models, GRPO-shaped batches and the stock TRL computation, shared by the tests."""

from __future__ import annotations

import inspect
import os
import sys
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    TrainerCallback,
)

VOCAB = 101
EOS = 3

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


# per model type, what the tiny model sets beyond the common sizes: head size from the hidden size, few experts
_TINY_EXTRA = {
    "gemma2": dict(head_dim=12, query_pre_attn_scalar=12),
    "gemma3_text": dict(head_dim=12, query_pre_attn_scalar=12),
    "gpt_oss": dict(head_dim=12, num_local_experts=4, num_experts_per_tok=2),
}


def tiny_model(arch: str = "llama", *, seed: int = 0, layers: int = 2, dtype=torch.float32, **overrides):
    """A random 2-layer model: Llama with tied embeddings, Qwen2 (untied, q/k/v bias), Qwen3.5 text (hybrid: Gated
    DeltaNet linear-attention layers, every third layer from the second one full attention), or any other model type
    of transformers at the same sizes (``AutoConfig.for_model(arch)``, its own defaults otherwise)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_dropout=0.0,
        pad_token_id=0,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    common.update(overrides)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
    elif arch == "qwen3_5":
        kinds = ["full_attention" if i % 3 == 1 else "linear_attention" for i in range(common["num_hidden_layers"])]
        model = Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                head_dim=12,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=12,
                linear_value_head_dim=12,
                linear_conv_kernel_dim=4,
                layer_types=kinds,
                **common,
            )
        )
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**_TINY_EXTRA.get(arch, {}), **common}))
    return model.to(dtype)


def smollm2_shaped(layers=2, embed_scale=1.0):
    """SmolLM2-135M's shapes (hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152, tied head) with
    ``layers`` layers and random weights, in train mode; ``embed_scale`` sharpens the next-token distributions."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=3,
        attention_dropout=0.0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embed_scale)
    return model.train()


class CountPasses:
    """Records the token count of every node pass of the prompt-once path (one sorted list per pass), whether it runs
    as a call of its own (``Window.text_pass``) or as a block of a packed call (``packed._node_block``)."""

    def __init__(self, monkeypatch):
        from grpo_mem.model import packed
        from grpo_mem.model import window as window_module

        self.passes = []
        original, block = window_module.Window.text_pass, packed._node_block

        def spy(window, mb, spec):
            self.passes.append(sorted(len(window.plan.trie.nodes[n].tokens) for n in spec.nodes))
            return original(window, mb, spec)

        def spy_block(window, mb, call, spec):
            self.passes.append(sorted(len(window.plan.trie.nodes[n].tokens) for n in spec.nodes))
            return block(window, mb, call, spec)

        monkeypatch.setattr(window_module.Window, "text_pass", spy)
        monkeypatch.setattr(packed, "_node_block", spy_block)


def make_batch(prompt_lens, G, C, *, seed=0, shuffle=False, group_sizes=None, junk_in_padding=False, prompts=None):
    """Left-padded prompts (one per entry of ``prompt_lens``), each repeated G times (or ``group_sizes[i]`` times),
    followed by right-padded completions of random lengths in [1, C], ending with EOS where shorter than C.
    ``prompts``: the prompts' token ids (lists), instead of random ones of lengths ``prompt_lens``.

    Returns input_ids (B, P+C), attention_mask (B, P+C), logits_to_keep=C, and the row -> prompt index.
    """
    g = torch.Generator().manual_seed(seed)
    junk = torch.Generator().manual_seed(seed + 1000)  # separate stream: junk leaves the real tokens unchanged
    if prompts is not None:
        prompt_lens = [len(p) for p in prompts]
    P = max(prompt_lens)
    sizes = group_sizes or [G] * len(prompt_lens)
    rows_ids, rows_mask, owner = [], [], []
    for i, (plen, n) in enumerate(zip(prompt_lens, sizes)):
        prompt = torch.randint(4, VOCAB, (plen,), generator=g) if prompts is None else torch.tensor(prompts[i])
        for _ in range(n):
            ids = torch.zeros(P + C, dtype=torch.long)
            mask = torch.zeros(P + C, dtype=torch.long)
            if junk_in_padding:
                ids[: P - plen] = torch.randint(4, VOCAB, (P - plen,), generator=junk)
            ids[P - plen : P] = prompt
            mask[P - plen : P] = 1
            clen = int(torch.randint(1, C + 1, (1,), generator=g))
            ids[P : P + clen] = torch.randint(4, VOCAB, (clen,), generator=g)
            if clen < C:
                ids[P + clen - 1] = EOS
                if junk_in_padding:
                    ids[P + clen :] = torch.randint(4, VOCAB, (C - clen,), generator=junk)
            mask[P : P + clen] = 1
            rows_ids.append(ids)
            rows_mask.append(mask)
            owner.append(i)
    ids, mask, owner = torch.stack(rows_ids), torch.stack(rows_mask), torch.tensor(owner)
    if shuffle:
        perm = torch.randperm(ids.shape[0], generator=g)
        ids, mask, owner = ids[perm], mask[perm], owner[perm]
    return ids, mask, C, owner


def stock_logps(
    model, input_ids, attention_mask, logits_to_keep, *, temperature=1.0, compute_entropy=False, batch_size=None
):
    """The installed TRL's own ``GRPOTrainer._get_per_token_logps_and_entropies`` on ``model``, given TRL's fused head
    where the release has one (1.15+; earlier releases compute the logits in the method itself).

    Zero where the completion mask is 0, with no gradient there: TRL 1.15+ returns that; earlier releases return the
    log-probs of whatever token sits at masked positions, which no TRL loss reads (parity is on unmasked positions).
    """
    from trl import GRPOTrainer

    from grpo_mem.model.distributed import unwrap_causal_lm

    base = unwrap_causal_lm(model)
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:  # TRL < 1.15
        add_fused_lm_head = None
    if add_fused_lm_head is not None and not getattr(base, "_test_fused", False):
        add_fused_lm_head(base, temperature=temperature, outputs=("log_probs", "entropy"))
        base._test_fused = True
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(autocast=nullcontext),
        temperature=temperature,
        # read by TRL < 1.15: entropies with gradient, and whether the model takes logits_to_keep
        _entropy_bonus_enabled=True,
        model_kwarg_keys=set(inspect.signature(base.forward).parameters),
        use_liger_kernel=False,
    )
    trainer._full_logits_logps = types.MethodType(
        inspect.unwrap(getattr(GRPOTrainer, "_full_logits_logps", lambda *a, **k: None)), trainer
    )  # TRL 1.14.x dispatches to it
    fn = inspect.unwrap(GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"])  # past the profiling decorator
    logps, ent, _ = fn(
        trainer,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=batch_size,
        compute_entropy=compute_entropy,
    )
    keep = attention_mask[:, -logits_to_keep:].bool()
    logps = logps.masked_fill(~keep, 0.0)
    ent = None if ent is None else ent.masked_fill(~keep, 0.0)
    return logps, ent


def stock_window(model, batches, C):
    """Stock TRL on each (input_ids, attention_mask) micro-batch of a window: per micro-batch (log-probs, entropies),
    and the gradients of ``grads_of`` (seeded by the row width) summed over the micro-batches."""
    ref, ref_grads = [], None
    for ids, mask in batches:
        logps, ent = stock_logps(model, ids, mask, C, compute_entropy=True)
        g = grads_of(model, logps, ent, seed=ids.shape[1])
        ref.append((logps, ent))
        ref_grads = g if ref_grads is None else {k: v + g[k] for k, v in ref_grads.items()}
    return ref, ref_grads


def begin_window(session, batches, C):
    """Plan ``session``'s window over ``batches`` ((input_ids, attention_mask) each; prompts: all but the last C
    columns)."""
    session.begin_window([ids[:, :-C] for ids, _ in batches], [mask[:, :-C] for _, mask in batches])


def weighted_backward(logps, entropies, seed=1):
    """Backward of a random weighting (seeded by ``seed``, drawn on the CPU, so equal on every device) of log-probs and
    entropies; gradients accumulate."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(logps.shape, generator=g).to(logps.device)
    loss = (logps * w).sum()
    if entropies is not None:
        loss = loss + (entropies * torch.randn(entropies.shape, generator=g).to(entropies.device)).sum()
    loss.backward()


def grads_of(model, logps, entropies, seed=1):
    """Backward of a random weighting of log-probs and entropies; returns {name: grad clone} and zeroes grads."""
    weighted_backward(logps, entropies, seed)
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(ours: dict, ref: dict, rel=1e-4):
    """Every parameter gradient within ``rel`` of its largest absolute value (worst parameter named on failure)."""
    assert ours.keys() == ref.keys(), sorted(set(ours) ^ set(ref))
    for name, r in ref.items():
        scale = r.abs().max().clamp_min(1e-12)
        err = (ours[name] - r).abs().max()
        assert err <= rel * scale, f"{name}: max |diff| {err:.3e} > {rel} x max |grad| {scale:.3e}"


def assert_close(ours, ref, atol, what="values", mask=None):
    """max |ours - ref| <= atol (NaN fails), over the positions where ``mask`` (same shape) is non-zero if given; on
    failure name the worst index and both values. The one comparison of the model and ops tests."""
    ours_d, ref_d = ours.double(), ref.double()
    err = (ours_d - ref_d).abs()
    if mask is not None:
        err = err.masked_fill(mask == 0, 0)
    err = torch.nan_to_num(err, nan=float("inf"))
    worst = int(err.argmax()) if err.numel() else 0
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    assert err.numel() == 0 or err.max() <= atol, (
        f"{what}: max |diff| {err.max():.3e} > {atol:.1e} at {idx}: ours {ours_d[idx]:.8g} ref {ref_d[idx]:.8g}"
    )


def assert_weights_close(ours_model, stock_model, atol):
    """Every parameter of ``ours_model`` within ``atol`` of the same-named one of ``stock_model``."""
    stock_params = dict(stock_model.named_parameters())
    for name, p in ours_model.named_parameters():
        assert_close(p.detach(), stock_params[name].detach(), atol, name)


def check_against_stock(model, ids, mask, C, sharing, assert_grads=assert_grads_close):
    """Stock TRL's log-probs and entropies (temperature 0.7) and their gradients against a one-micro-batch window of
    ``sharing`` (trie nodes from 2 shared tokens) that must not fall back: values within 1e-5, gradients by
    ``assert_grads`` (ours, ref)."""
    import warnings

    from grpo_mem.model.sharing import SharingSession

    ref, ref_e = stock_logps(model, ids, mask, C, temperature=0.7, compute_entropy=True)
    ref_g = grads_of(model, ref, ref_e)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="grpo_mem: falling back")
        session = SharingSession(sharing, min_shared_tokens=2)
        session.begin_window([ids[:, :-C]], [mask[:, :-C]])
        ours, ours_e = session.score(model, ids, mask, C, temperature=0.7, compute_entropy=True)
    assert_close(ours, ref, 1e-5, "log-probs")
    assert_close(ours_e, ref_e, 1e-5, "entropies")
    assert_grads(grads_of(model, ours, ours_e), ref_g)


def check_window_against_stock(model, batches, C, assert_grads=assert_grads_close):
    """The micro-batches ``batches`` ((input_ids, attention_mask) each) of one tree-sharing window (nodes from 2
    shared tokens) against stock TRL on each: log-probs and entropies within 1e-5, and the gradient of the window
    (``weighted_backward`` per micro-batch) against stock's summed, by ``assert_grads`` (ours, ref); every kept pass
    released by the window's end."""
    from grpo_mem.model.sharing import SharingSession

    ref, ref_grads = stock_window(model, batches, C)
    session = SharingSession(min_shared_tokens=2)
    begin_window(session, batches, C)
    for (ids, mask), (r, re) in zip(batches, ref):
        logps, ent = session.score(model, ids, mask, C, compute_entropy=True)
        assert_close(logps, r, 1e-5, "log-probs")
        assert_close(ent, re, 1e-5, "entropies")
        weighted_backward(logps, ent, seed=ids.shape[1])  # the weighting of stock_window's grads_of
    ours = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    session.close_window()  # raises if a kept pass was never released
    assert_grads(ours, ref_grads)


def char_tokenizer(extra_chars: str = "", special_tokens: tuple = (), eos: str = "</s>"):
    """A character-level fast tokenizer of at most VOCAB ids built in memory (no hub): ids 0-3 are pad/bos/unk/eos
    ``</s>``, then one id per character (``extra_chars`` after the default ones), then ``special_tokens`` (each one
    id, never split); ``eos``: the EOS token (``</s>`` or one of ``special_tokens``)."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_letters + string.digits + " .,:;!?+-*/=()'\"\n" + extra_chars)[: VOCAB - 4]
    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": EOS, **{c: i + 4 for i, c in enumerate(chars)}}
    vocab.update({t: len(vocab) + i for i, t in enumerate(special_tokens)})
    if len(vocab) > VOCAB:
        raise ValueError(f"{len(vocab)} tokens do not fit the tiny models' vocabulary of {VOCAB}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        unk_token="<unk>",
        eos_token=eos,
        padding_side="left",
        **({"additional_special_tokens": list(special_tokens)} if special_tokens else {}),
    )


MULTI_TURN_ARGS = dict(
    gradient_accumulation_steps=2, per_device_train_batch_size=4, num_generations=4, optim="sgd", beta=0.04
)
"""The trainer arguments of the multi-turn tests (``test_rollouts``, ``test_tools``): 2 micro-batches of 4 rows per
step, groups of 4, SGD, a KL term."""


def assert_trained_like_stock_on_the_tree_path(stock, stock_rec, ours, ours_rec, steps: int) -> None:
    """A patched training run ``ours`` equals stock's (``train_recorded`` pairs): ``steps`` steps each, every step's
    gradients within 1e-4, the final weights within 1e-5; and every step's micro-batches on the prompt-once path with
    tree sharing, the backbone forwarding under half of stock's tokens."""
    assert ours.state.global_step == stock.state.global_step == steps
    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_close(g_ours, g_stock, 1e-4)
    stock_params = dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        assert_close(p.detach(), stock_params[name].detach(), 1e-5, name)
    logged = [h for h in ours.state.log_history if "grpo_mem/token_ratio" in h]
    assert len(logged) == steps
    for log in logged:
        assert log["grpo_mem/path/tree"] == 1.0 and log["grpo_mem/path/stock"] == 0.0, log
        assert log["grpo_mem/token_ratio"] < 0.5, log


SYSTEM_PROMPT = "You are a careful assistant. Think it through first, then answer briefly: "
"""A 74-token system prompt (``char_tokenizer``: 1 token a character), longer than the default ``min_shared_tokens``."""

PROMPTS = ["1+2=", "What is 7-3?", "Say hi", "Count: 1 2 3", "Add 4 and 5:", "x", "Spell cat", "9*9="]


def length_reward(completions, **kwargs):
    """A deterministic reward with spread within a group: closeness of the completion length to 5 characters."""
    return [-abs(len(c) - 5) / 5.0 for c in completions]


TRAINER_DEFAULTS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    max_steps=2,
    learning_rate=1e-2,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    save_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
    bf16=False,
)
"""``make_trainer``'s GRPOConfig/RLOOConfig arguments unless the test gives its own."""


def _saved(model, output_dir) -> str:
    """Save ``model`` under ``output_dir`` and return the path (a path, so that TRL can load a separate reference
    model when beta > 0). No rank may read a directory another is still writing: with a process group already up
    (DeepSpeed), only rank 0 writes (transformers saves on rank 0 only), then all wait; without one (DDP/FSDP start
    theirs later), each rank writes its own copy."""
    if torch.distributed.is_initialized():
        model_dir = f"{output_dir}/model"
        model.save_pretrained(model_dir)
        torch.distributed.barrier()
    else:
        model_dir = f"{output_dir}/model{os.environ.get('RANK', '')}"
        model.save_pretrained(model_dir)
    return model_dir


def make_trainer(
    kind="grpo",
    *,
    seed=0,
    patch=False,
    group_shuffle=True,
    arch="llama",
    output_dir,
    prompts=PROMPTS,
    sharing="tree",
    model_args=None,
    peft_config=None,
    backend=None,
    trainer_kwargs=None,
    processing_class=None,
    reward_funcs=length_reward,
    **args,
):
    """A tiny GRPOTrainer/RLOOTrainer on CPU: a random ``tiny_model(arch, **model_args)`` (Llama with a tied head by
    default), character tokenizer, string prompts (default: the 8 of ``PROMPTS``), the trainer's PEFT adapter from
    ``peft_config`` if given, and the trainer's own arguments ``trainer_kwargs`` (``rollout_func=``, ...);
    ``processing_class``: the tokenizer instead of ``char_tokenizer()``; ``reward_funcs``: TRL's argument.
    ``group_shuffle=None`` patches with ``patch_trl``'s default; ``backend`` is passed to ``patch_trl`` when given."""
    from datasets import Dataset
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    import grpo_mem

    set_seed(seed)
    model = tiny_model(arch, seed=seed, **(model_args or {}))
    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    defaults = dict(TRAINER_DEFAULTS, output_dir=str(output_dir), seed=seed)
    defaults.update(args)
    model_dir = _saved(model, output_dir)
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=reward_funcs,
        args=config_cls(**defaults),
        train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
        processing_class=processing_class if processing_class is not None else char_tokenizer(),
        **({} if peft_config is None else {"peft_config": peft_config}),
        **(trainer_kwargs or {}),
    )
    options = dict(sharing=sharing) if group_shuffle is None else dict(sharing=sharing, group_shuffle=group_shuffle)
    if backend is not None:
        options["backend"] = backend
    handle = grpo_mem.patch_trl(trainer, **options) if patch else None
    return trainer, handle


class GradientRecorder(TrainerCallback):
    """Every optimizer step's gradients (before the step) and learning rate (after it)."""

    def __init__(self):
        self.grads, self.lrs = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def train_recorded(tmp_path, kind, patch, group_shuffle=None, **args):
    """Train a ``make_trainer`` trainer (patched if ``patch``, ``group_shuffle=None``: with ``patch_trl``'s default;
    reverted afterwards); returns it and its ``GradientRecorder``."""
    trainer, handle = make_trainer(kind, patch=patch, group_shuffle=group_shuffle, output_dir=tmp_path, **args)
    record = GradientRecorder()
    trainer.add_callback(record)
    try:
        trainer.train()
    finally:
        if handle is not None:
            handle.revert()
    return trainer, record


_INTERPRETER_DRIVER = """
import json, sys, pytest

class Count:
    def __init__(self):
        self.n = {"passed": 0, "failed": 0, "skipped": 0}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.n[report.outcome] += 1

out = {}
for path, select in json.loads(sys.argv[1]):
    count = Count()
    code = pytest.main([path, "-q", "-x", "-p", "no:cacheprovider", "-k", select], plugins=[count])
    out[path] = [int(code), count.n]
print("RESULTS " + json.dumps(out))
"""


def run_under_interpreter(runs: list[tuple[str, str]]) -> None:
    """Run, for each ``(test_file, select)`` of ``runs``, the tests of ``test_file`` matching ``-k select``, all in one
    fresh ``TRITON_INTERPRET=1`` process (Triton fixes interpreter mode at its first import; one process pays the
    imports once), and assert that each selection ran and passed: some passed, none skipped, failed or in error (a
    skip there means the interpreter did not run what the main process skips)."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    runs = [(os.path.abspath(path), select) for path, select in runs]
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_DRIVER, json.dumps(runs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, report
    results = json.loads(lines[-1][len("RESULTS ") :])
    for path, _ in runs:
        code, n = results[path]
        assert code == 0 and n["passed"] > 0 and n["failed"] == n["skipped"] == 0, (path, code, n, report)


# ----------------------------------------------------------------------------------------------------------------------
# ops tests: attention inputs, Triton interpreter, recorded launches, host synchronisation
# ----------------------------------------------------------------------------------------------------------------------


def _entry_masks(U, S, spec, g):
    """(U, S) bool: ("right", lens) real keys first, ("left", lens) real keys last, ("junk", p) each key real with
    probability p (padding anywhere), except in the last entry, which has no real key."""
    kind, arg = spec
    pos = torch.arange(S)[None, :]
    if kind == "right":
        return pos < torch.tensor(arg)[:, None]
    if kind == "left":
        return pos >= S - torch.tensor(arg)[:, None]
    mask = torch.rand(U, S, generator=g) < arg
    mask[-1] = False
    return mask


def attention_inputs(B, Hq, Hkv, C, d, regions, clens=None, dtype=torch.float32, seed=0):
    """Random inputs of multi-region attention (shared-prefix attention: one region). ``regions``: list of
    ``(U, S, index, mask spec)`` (see _entry_masks); padded key positions hold random junk. Drawn in fp64, then cast.
    Returns (tensors {q, k, v, rk0, rv0, ...}, [(index, mask)] per region, key_mask or None, grad_out)."""
    g = torch.Generator().manual_seed(seed)
    t = {n: torch.randn(B, H, C, d, generator=g, dtype=torch.float64) for n, H in (("q", Hq), ("k", Hkv), ("v", Hkv))}
    meta = []
    for i, (U, S, index, spec) in enumerate(regions):
        t[f"rk{i}"] = torch.randn(U, Hkv, S, d, generator=g, dtype=torch.float64)
        t[f"rv{i}"] = torch.randn(U, Hkv, S, d, generator=g, dtype=torch.float64)
        meta.append((torch.tensor(index, dtype=torch.int64), _entry_masks(U, S, spec, g)))
    t = {n: x.to(dtype) for n, x in t.items()}
    key_mask = None if clens is None else torch.arange(C)[None, :] < torch.tensor(clens)[:, None]
    grad_out = torch.randn(B, Hq, C, d, generator=g, dtype=torch.float64).to(dtype)
    return t, meta, key_mask, grad_out


# Triton's interpreter works only if TRITON_INTERPRET=1 was set before triton's first import, which cannot be arranged
# inside a shared pytest process (and would turn every other module's @triton.jit kernels into interpreted ones). The
# tests marked `needs_interpreter` are therefore rerun in a fresh TRITON_INTERPRET=1 process by run_under_interpreter
# (each Triton test module has one test that does it); in such a process they run directly.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="run in a fresh TRITON_INTERPRET=1 process by its module's run_under_interpreter test"
)


class FakeKernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` calls ``on_launch(name, grid, args,
    kwargs)`` and runs nothing."""

    def __init__(self, name, on_launch):
        self.name, self.on_launch = name, on_launch

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.on_launch(self.name, grid, args, kwargs)


def recording_launch_device(active):
    """A stand-in for ``grpo_mem.ops._device.launch_device``: ``enter(tensor)`` is a context manager, and ``active``
    (a list) holds the devices of the contexts entered and not yet left."""

    @contextmanager
    def enter(tensor):
        active.append(tensor.device)
        try:
            yield
        finally:
            active.pop()

    return enter


class LaunchRecorder:
    """Replaces the kernels of ``grpo_mem.ops.attention_triton`` by FakeKernels and the ``launch_device`` of their
    launchers by a recording one: ``launches`` lists each launch's (kernel name, grid, devices of the launch_device
    contexts active then)."""

    def __init__(self, monkeypatch):
        from grpo_mem.ops import attention_triton as kernels
        from grpo_mem.ops import attention_triton_launch as launch

        self.active, self.launches = [], []
        monkeypatch.setattr(launch, "launch_device", recording_launch_device(self.active))
        record = lambda name, grid, args, kwargs: self.launches.append((name, tuple(grid), list(self.active)))  # noqa: E731
        monkeypatch.setattr(kernels, "KERNELS", {n: FakeKernel(n, record) for n in kernels.KERNELS})


# aten ops that wait for the device on CUDA (they read a value back, or size their output from data)
_SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "equal",
    "allclose",
    "nonzero",
    "masked_select",
    "bincount",
    "unique_dim",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim_consecutive",
    "histc",
}
_ALLOC_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class OpNames(TorchDispatchMode):
    """Records the name of every aten op dispatched inside it (``names``), in order."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class HostSyncsAndCopies(TorchDispatchMode):
    """Records, outside Triton's interpreter machinery, every aten op that synchronises with the device on CUDA
    (``syncs``) and every op other than an allocation whose output holds ``big`` elements or more (``copies``: a copy
    or temporary the size of an input)."""

    def __init__(self, big):
        super().__init__()
        self.big, self.syncs, self.copies = big, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        while frame is not None:  # the interpreter copies kernel arguments to "host" and back: not the launcher's ops
            if "triton/runtime/interpreter" in frame.f_code.co_filename:
                return out
            frame = frame.f_back
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS or (
            name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and func._overloadname == "Tensor"
        ):
            self.syncs.append(name)
        if name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            self.syncs.append("index with a bool mask")
        if name not in _ALLOC_OPS:
            inputs = {
                a.untyped_storage().data_ptr()
                for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)
            }
            for o in out if isinstance(out, (tuple, list)) else (out,):
                fresh = isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs  # not a view
                if fresh and o.numel() >= self.big:
                    self.copies.append((name, tuple(o.shape)))
        return out


def random_tokens(n: int, seed: int) -> list[int]:
    """``n`` random token ids in [4, VOCAB) (clear of the special ids), from ``seed``."""
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_fp32_against_truth(res: dict, truth: dict) -> None:
    """An op's fp32 results against its fp64 truth (dicts of tensors; ``"out"`` and gradients): values <= 1e-5
    absolute, each gradient <= 1e-4 x max|its truth|."""
    assert_close(res["out"], truth["out"], 1e-5, "out")
    for n in truth:
        if n != "out":
            assert_close(res[n], truth[n], 1e-4 * max(truth[n].abs().max().item(), 1e-6), n)


# The architecture sweep's check (tests/model/test_architectures.py; test_confirm runs it on the types it names): a
# tiny random model of a causal LM type through both sharing modes, against stock TRL or the model's own forward.
SWEEP_TEMPERATURE = 0.7
# three prompts of 5-7 tokens sharing a 4-token prefix (left padding, and a trie node in tree mode), 2 completions
# each of up to 4 tokens
SWEEP_PROMPTS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 20], [5, 6, 7, 8, 30, 31, 32]]
SWEEP_MIN_SHARED_TOKENS = 3
SWEEP_MAX_PARAMS = 16_000_000


class NotBuilt(Exception):
    """The type cannot be built and run tiny here (the message says why)."""


# what the released checkpoints' configs set that transformers' default config of the type leaves unset, so that the
# default config builds or runs no model: DBRX's attention reads ``attn_config.rope_theta`` and clamps to
# ``clip_qkv`` (dbrx-instruct: 500000 and 8), dots.llm1
# has no expert counts by default (dots.llm1.inst: 128 routed, 2 shared, 6 per token), LFM2-MoE no ``layer_types``
# (LFM2-8B-A1B: short-convolution layers with attention every few layers)
RELEASED = {
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "kv_n_heads": 8, "clip_qkv": 8.0}},
    "dots1": {"n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6},
    "lfm2_moe": {"layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(32)]},
}


def default_config(model_type: str):
    """transformers' default config of ``model_type`` (``AutoConfig.for_model``) with what ``RELEASED`` adds."""
    return AutoConfig.for_model(model_type, **RELEASED.get(model_type, {}))


def build_tiny(model_type: str):
    """A tiny random fp32 ``AutoModelForCausalLM`` of ``model_type``, built offline from its default config
    (``default_config``) at the runtime confirmation's tiny sizes (``grpo_mem.model.tiny_config.tiny_config``).

    Raises:
        NotBuilt: the config or model cannot be built at tiny sizes, or is still over ``SWEEP_MAX_PARAMS`` parameters.
    """
    from grpo_mem.model import tiny_config

    def build(config):
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if n > SWEEP_MAX_PARAMS:
            raise NotBuilt(f"{n / 1e6:.0f} M parameters at the tiny sizes (sub-configs keep their full sizes)")
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).float()

    try:  # as the runtime's confirmation builds its tiny copy
        return tiny_config.build_tiny(default_config(model_type), build)
    except NotBuilt:
        raise
    except Exception as e:  # any failure of transformers' own config or model code at these sizes
        raise NotBuilt(f"{type(e).__name__}: {' '.join(str(e).split())[:160]}") from e


@dataclass
class ArchitectureRow:
    """One type's outcome: ``status`` "prompt-once", "fallback" or "not built"; ``cause`` the fallback's cause or why
    the type was not built; ``model_class`` the causal LM class built."""

    model_type: str
    status: str
    cause: str = ""
    model_class: str = ""


def _own_forward_logps(model, ids, mask, C):
    """The model's own forward: (B, C) fp32 log-probs and entropies of the completion tokens, zero where masked."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -C - 1 : -1].float() / SWEEP_TEMPERATURE
    logsm = logits.log_softmax(-1)
    keep = mask[:, -C:].bool()
    logps = logsm.gather(-1, ids[:, -C:, None])[..., 0].masked_fill(~keep, 0.0)
    entropy = -(logsm.exp() * logsm).sum(-1).masked_fill(~keep, 0.0)
    return logps, entropy


def _grpo_mem_logps(model, ids, mask, C, sharing):
    """grpo_mem's scores and the fallback causes recorded while computing them, the run-time confirmation on (its
    verdict is the one ``check_architecture`` asked for, kept per process)."""
    import grpo_mem
    from grpo_mem.model.sharing import SharingSession
    from grpo_mem.model.fallback import isolated_fallbacks

    with isolated_fallbacks() as causes:
        if sharing == "group":
            logps, entropy = grpo_mem.shared_prompt_logprobs(
                model, ids, mask, C, temperature=SWEEP_TEMPERATURE, compute_entropy=True, sharing="group", confirm=True
            )
        else:  # a window of one micro-batch whose trie has the 4-token prefix as a node of its own
            session = SharingSession("tree", min_shared_tokens=SWEEP_MIN_SHARED_TOKENS, confirm=True)
            session.begin_window([ids[:, :-C]], [mask[:, :-C]])
            logps, entropy = session.score(model, ids, mask, C, temperature=SWEEP_TEMPERATURE, compute_entropy=True)
    return logps, entropy, causes


def _assert_masked_close(what, ours, ref, keep, atol=1e-5):
    err = ((ours - ref).abs() * keep).max()
    assert err <= atol, f"{what}: max |diff| {err:.3e} > {atol}"


def _assert_grads_close_per_parameter(what, ours, ref, rel=1e-4):
    """Every parameter's gradient within ``rel`` of its own scale, elementwise (max |diff| against its max) and as a
    vector (``confirm.grad_difference``: norm of the difference against its norm, floored at 1e-3 of the global
    norm); a parameter whose exact gradient is zero (e.g. a key bias, which softmax ignores) is measured against
    1e-3 of the largest gradient instead of its rounding noise."""
    from grpo_mem.model.confirm import grad_difference

    assert ours.keys() == ref.keys(), f"{what}: gradients of different parameters {sorted(set(ours) ^ set(ref))[:4]}"
    difference = grad_difference(ours, ref, rel)
    assert difference is None, f"{what}: {difference}"
    top = max(float(r.abs().max()) for r in ref.values())
    for name, r in ref.items():
        scale = max(float(r.abs().max()), 1e-3 * top, 1e-30)
        err = float((ours[name] - r).abs().max())
        assert err <= rel * scale, f"{what}: {name} max |diff| {err:.3e} > {rel} x {scale:.3e}"


class _CauseFailed(Exception):
    """``unsupported_cause`` itself raised: a grpo_mem failure, never taken for one of the reference."""


def _unsupported_cause(model):
    from grpo_mem.model.support import unsupported_cause

    try:
        return unsupported_cause(model)
    except Exception as e:
        raise _CauseFailed(f"unsupported_cause raised {type(e).__name__}: {e}") from e


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """The run-time confirmation on (the suite's default is off: tests/conftest.py) and its verdicts forgotten around
    each test of a module that imports this fixture (autouse there)."""
    from grpo_mem.model import confirm

    monkeypatch.setenv(confirm.ENV, "1")
    confirm.forget()
    yield
    confirm.forget()


def _admitted_unbuilt(model_type: str) -> str | None:
    """Why ``model_type``, not built or not run tiny, is a sweep failure (None where it is not): the capability rule
    admits its model built from the default config (``default_config``, on the meta device), so a user's model of the
    type would reach the confirmation, which could not build or score its tiny copy either (the same
    ``tiny_config``) and would refuse the model as "not confirmed"."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(default_config(model_type))
    except Exception:  # no model of the type can be built at all: nothing reaches the confirmation
        return None
    cause = _unsupported_cause(model)
    return None if cause is not None else "admitted by the capability rule, but its tiny copy cannot be built"


def check_architecture(model_type: str) -> ArchitectureRow:
    """Build ``model_type`` tiny and check both sharing modes against the right reference (see the module docstring).

    Raises:
        AssertionError: a wrong number, an unexpected path or cause, a crash of grpo_mem where the reference runs, or
            a type the capability rule admits that cannot be built or run tiny (``_admitted_unbuilt``).
    """
    import grpo_mem
    from grpo_mem.model.confirm import SHIFTED, confirmation

    try:
        model = build_tiny(model_type)
        model.train()
        if model.supports_gradient_checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        ids, mask, C, _ = make_batch(None, 2, 4, prompts=SWEEP_PROMPTS, shuffle=True, junk_in_padding=True)
        keep = mask[:, -C:].float()
        own, own_e = _own_forward_logps(model, ids, mask, C)
        cause = _unsupported_cause(model)
        if cause is None:  # the runtime's confirmation, on a copy built from the config, agrees, or refuses by what
            # the rule leaves to numbers (hidden states that move with every position: ``confirm.shift_cause``)
            cause = confirmation(model).cause
            assert cause is None or SHIFTED in cause, f"{model_type}: {cause}"
        if cause is None:  # stock TRL is the reference (and agrees with the model's own forward)
            ref, ref_e = stock_logps(model, ids, mask, C, temperature=SWEEP_TEMPERATURE, compute_entropy=True)
            _assert_masked_close(f"{model_type} stock TRL vs own forward", ref.detach(), own.detach(), keep)
        else:
            ref, ref_e = own, own_e
        ref_g = grads_of(model, ref, ref_e)
    except NotBuilt as e:
        admitted_cause = _admitted_unbuilt(model_type)
        assert admitted_cause is None, f"{model_type}: {admitted_cause} ({e})"
        return ArchitectureRow(model_type, "not built", str(e))
    except (AssertionError, _CauseFailed):
        raise
    except Exception as e:  # the reference itself fails at these sizes: nothing to compare with
        message = f"its own forward or backward fails tiny: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
        admitted_cause = _admitted_unbuilt(model_type)
        assert admitted_cause is None, f"{model_type}: {admitted_cause} ({message})"
        return ArchitectureRow(model_type, "not built", message)
    for sharing in ("group", "tree"):
        logps, entropy, causes = _grpo_mem_logps(model, ids, mask, C, sharing)
        assert causes == ([] if cause is None else [cause]), f"{model_type} {sharing}: fallbacks {causes}"
        what = f"{model_type} {sharing}"
        _assert_masked_close(f"{what} log-probs", logps, ref, keep)
        _assert_masked_close(f"{what} entropies", entropy, ref_e, keep)
        _assert_grads_close_per_parameter(what, grads_of(model, logps, entropy), ref_g)
    grpo_mem.restore(model)
    status = "prompt-once" if cause is None else "fallback"
    return ArchitectureRow(model_type, status, cause or "", type(model).__name__)

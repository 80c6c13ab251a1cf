"""``use_vllm=True`` with the patch, against stock TRL, through a stand-in for vLLM's engine at TRL's interface.

vLLM is not installed (and is not needed): TRL 1.16's own ``VLLMGeneration`` is kept, its ``__init__`` (which starts
vLLM) is skipped, and what it talks to is replaced by ``Engine``: in ``colocate`` mode the ``vllm.LLM`` object
(``generate`` returning request outputs with per-token sampling logprobs, ``load_weights`` through
``llm_engine.model_executor.driver_worker.model_runner.model``, ``reset_prefix_cache``) and ``SamplingParams``; in
``server`` mode the ``VLLMClient`` (``generate`` returning the server's JSON payload, ``update_named_params``,
``reset_prefix_cache``). TRL's generation, weight-sync and importance-sampling code runs unchanged. The engine holds
its own copy of the model built from the config, fed only by TRL's weight sync; its completions are random tokens
(the same in both runs) and its logprobs are that copy's log-softmax at the sampling temperature, perturbed by a
fixed noise (as vLLM's bf16 sampler differs from the trainer), so that the importance-sampling ratios spread.

What is compared (2 optimizer steps, SGD): every logged value (loss, rewards, the IS ratio's min/mean/max and the
sampling log-prob differences TRL logs), each step's gradients, the final weights, and every weight sync's names,
dtypes, shapes and values. With the correction on, the policy's old log-probs (the IS ratio's numerator) come
through grpo_mem's prompt-once path."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
from helpers import EOS, VOCAB, GradientRecorder, assert_close, assert_grads_close, assert_weights_close, make_trainer

from grpo_mem.model.sharing import SharingSession

NOISE = 0.2  # standard deviation of the engine's logprob perturbation (nats per token)


class Engine:
    """A stand-in for vLLM's engine: its own model copy (weights only from TRL's sync), random completions, logprobs
    of that copy at the sampling temperature plus a fixed noise."""

    def __init__(self, policy, seed=0):
        with torch.random.fork_rng(devices=[]):
            self.model = type(policy)(policy.config).float().eval()
        self.generator = torch.Generator().manual_seed(seed)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.syncs: list[list[tuple[str, torch.Tensor]]] = []  # per sync: (name, tensor) in the order received
        self.sampling: list[dict] = []  # the sampling parameters of each generate call

    def receive(self, name, tensor):
        if not self.syncs or self.syncs[-1] is None:
            self.syncs.append([])
        self.syncs[-1].append((name, tensor.detach().clone()))
        with torch.no_grad():
            dict(self.model.named_parameters())[name].copy_(tensor)

    def end_sync(self):
        self.syncs.append(None)  # the next receive starts a new sync

    def complete(self, prompt, n, temperature, max_tokens):
        """``n`` completions of ``prompt`` (token ids): (token ids, per-token sampling logprobs) each."""
        out = []
        for _ in range(n):
            length = int(torch.randint(1, max_tokens + 1, (1,), generator=self.generator))
            tokens = torch.randint(4, VOCAB, (length,), generator=self.generator)
            if length < max_tokens:
                tokens[-1] = EOS
            noise = NOISE * torch.randn(length, generator=self.generator, dtype=torch.float64)
            ids = torch.tensor(list(prompt) + tokens.tolist())[None]
            with torch.no_grad():
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
            logps = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1) + noise
            out.append((tokens.tolist(), logps.tolist()))
        return out


class Client:
    """``VLLMClient`` of ``vllm_mode="server"``: the calls TRL 1.16's ``VLLMGeneration`` makes."""

    def __init__(self, engine):
        self.engine = engine

    def update_named_params(self, metadata, params):
        for name, tensor in params:
            self.engine.receive(name, tensor)
        self.engine.end_sync()

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, features=None, **sampling):
        assert features is None
        self.engine.sampling.append(sampling)
        ids, lps = [], []
        for prompt in prompts:
            for tokens, logps in self.engine.complete(
                prompt, sampling["n"], sampling["temperature"], sampling["max_tokens"]
            ):
                ids.append(tokens)
                lps.append([[lp] for lp in logps])
        return {"prompt_ids": [list(p) for p in prompts], "completion_ids": ids, "logprobs": lps}


class LLM:
    """``vllm.LLM`` of ``vllm_mode="colocate"``: the calls TRL 1.16's ``VLLMGeneration`` makes."""

    def __init__(self, engine):
        self.engine = engine
        runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self._load))
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
        )

    def _load(self, weights):
        for name, tensor in weights:
            self.engine.receive(name, tensor)

    def reset_prefix_cache(self):
        self.engine.end_sync()  # TRL resets the cache once after loading every parameter

    def generate(self, prompts, sampling_params, use_tqdm=False):
        sampling = sampling_params.kwargs
        self.engine.sampling.append(sampling)
        outputs = []
        for row in prompts:
            prompt = row["prompt_token_ids"]
            completions = self.engine.complete(prompt, sampling["n"], sampling["temperature"], sampling["max_tokens"])
            outputs.append(
                types.SimpleNamespace(
                    prompt_token_ids=list(prompt),
                    outputs=[
                        types.SimpleNamespace(
                            token_ids=tokens,
                            logprobs=[{t: types.SimpleNamespace(rank=1, logprob=lp)} for t, lp in zip(tokens, logps)],
                        )
                        for tokens, logps in completions
                    ],
                )
            )
        return outputs


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _use_engine(trainer, mode, engine):
    """Give ``trainer`` (built with ``use_vllm=False``) TRL's ``VLLMGeneration`` in ``mode`` talking to ``engine``,
    as ``GRPOTrainer.__init__`` builds it with ``use_vllm=True`` (minus starting vLLM)."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.__dict__.update(
        model=trainer.model,
        accelerator=trainer.accelerator,
        _dist=DistributedBackend(trainer.accelerator),
        processing_class=trainer.processing_class,
        mode=mode,
        structured_outputs_regex=None,
        tensor_parallel_size=1,
        enable_sleep_mode=False,
        _llm_weights_sleeping=False,
        repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k,
        min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length,
        logprobs=0,
        generation_kwargs={},
        _weight_metadata=None,
    )
    if mode == "server":
        generation.vllm_client = Client(engine)
    else:
        generation.llm = LLM(engine)
    trainer.use_vllm = True
    trainer.vllm_mode = mode
    trainer.vllm_generation = generation
    trainer._last_loaded_step = -1


# mode, importance-sampling correction, its mode; the two modes differ only in TRL's plumbing to the engine (one
# request per group and a broadcast, or one per row), which the correction's cases cover both of
CASES = {
    "colocate-is-sequence_mask": ("colocate", True, "sequence_mask"),
    "server-is-token_truncate": ("server", True, "token_truncate"),
    "server-no-is": ("server", False, "sequence_mask"),
}


def _run(tmp_path, mode, correction, is_mode, patch, monkeypatch):
    """Train 2 steps with the engine; returns (trainer, gradient recorder, engine, no-grad decision paths)."""
    import trl.generation.vllm_generation as vllm_generation

    monkeypatch.setattr(vllm_generation, "SamplingParams", SamplingParams, raising=False)
    trainer, handle = make_trainer(
        output_dir=tmp_path,
        patch=patch,
        group_shuffle=None,
        max_steps=2,
        optim="sgd",
        beta=0.04,
        vllm_importance_sampling_correction=correction,
        vllm_importance_sampling_mode=is_mode,
        vllm_importance_sampling_clip_min=0.5,
    )
    engine = Engine(trainer.model)
    _use_engine(trainer, mode, engine)
    record = GradientRecorder()
    trainer.add_callback(record)
    paths = []
    decide = SharingSession.decide

    def spy(session, *args, **kwargs):
        decision = decide(session, *args, **kwargs)
        if not torch.is_grad_enabled():
            paths.append(decision.path)
        return decision

    monkeypatch.setattr(SharingSession, "decide", spy)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="grpo_mem: falling back")
            trainer.train()
    finally:
        monkeypatch.setattr(SharingSession, "decide", decide)
        if handle is not None:
            handle.revert()
    return trainer, record, engine, paths


_NOT_COMPARED = ("time", "per_second", "total_flos", "train_loss")  # timings; train_loss is the mean of "loss"


@pytest.mark.parametrize("case", CASES)
def test_vllm_generation_patched_equals_stock(tmp_path, case, monkeypatch):
    mode, correction, is_mode = CASES[case]
    stock, stock_rec, stock_engine, _ = _run(tmp_path / "stock", mode, correction, is_mode, False, monkeypatch)
    ours, ours_rec, ours_engine, no_grad_paths = _run(tmp_path / "ours", mode, correction, is_mode, True, monkeypatch)

    # TRL asked the engine for the same completions at the trainer's temperature, and logged the same values
    assert ours_engine.sampling == stock_engine.sampling and len(stock_engine.sampling) == 2
    assert stock_engine.sampling[0]["temperature"] == stock.temperature
    logged = lambda t: [h for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert len(logged(stock)) == len(logged(ours)) == 2
    is_keys = [f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")]
    for s, o in zip(logged(stock), logged(ours), strict=True):
        assert all((k in s) == correction for k in is_keys), sorted(s)
        assert all(k in o for k in s)
        for key, value in s.items():
            if isinstance(value, float) and not any(x in key for x in _NOT_COMPARED):
                assert math.isclose(o[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, o[key], value)
        assert o["grpo_mem/path/stock"] < 1  # the training micro-batches took the prompt-once path
    if correction:  # the ratios spread (the test would not see a wrong numerator otherwise)
        assert any(s["sampling/importance_sampling_ratio/max"] > 1.05 for s in logged(stock))
        assert any(s["sampling/importance_sampling_ratio/min"] < 0.95 for s in logged(stock))
        # the old log-probs, the ratio's numerator, came through grpo_mem's prompt-once path
        assert no_grad_paths and all(p != "stock" for p in no_grad_paths)

    for g_ours, g_stock in zip(ours_rec.grads, stock_rec.grads, strict=True):
        assert_grads_close(g_ours, g_stock, 1e-4)
    assert len(ours_rec.grads) == 2
    assert_weights_close(ours.model, stock.model, 1e-5)

    # weight sync: the same tensors under the same names, every parameter of the model once per sync
    syncs = lambda e: [s for s in e.syncs if s is not None]  # noqa: E731
    assert len(syncs(stock_engine)) == len(syncs(ours_engine)) == 2  # before each optimizer step's generation
    names = [n for n, _ in stock.model.named_parameters()]
    for sync_ours, sync_stock in zip(syncs(ours_engine), syncs(stock_engine), strict=True):
        assert [n for n, _ in sync_ours] == [n for n, _ in sync_stock] == names
        for (name, t_ours), (_, t_stock) in zip(sync_ours, sync_stock):
            assert t_ours.dtype == t_stock.dtype and t_ours.shape == t_stock.shape, name
            assert_close(t_ours, t_stock, 1e-5, name)
    for (name, t_ours), (_, t_stock) in zip(syncs(ours_engine)[0], syncs(stock_engine)[0]):
        assert torch.equal(t_ours, t_stock), name  # before any step: bit-identical
    assert names == ours_engine.names or set(names) <= set(ours_engine.names)

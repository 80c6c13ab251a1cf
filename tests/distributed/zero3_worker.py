"""One rank of the 2-process DeepSpeed ZeRO-3 checks with unbalanced ranks, launched by test_distributed.py.

Usage: zero3_worker.py OUT_JSON. A tiny Qwen2 (untied LM head, every parameter partitioned) runs under a ZeRO-3
engine on CPU/gloo. Each case gives the two ranks different micro-batches, chosen so that on its own each rank would
take a different path through the model:

- ``fallback``: rank 0's prompts are all distinct (the stock path would be taken), rank 1's repeat;
- ``no_tokens``: rank 0 scores zero completion tokens;
- ``C1``: rank 0's completions are one token wide (no completion pass needed), rank 1's are wider, with a different
  number of unique prompts.

For every case the patched TRL ``_get_per_token_logps_and_entropies`` (policy call: gradients, entropies) runs, then
stock TRL's on the same engine and batch. Rank 0 writes the worst log-prob/entropy error and the worst relative
gradient error (full gradients, averaged over ranks by ZeRO) per case, and how often the head weight was gathered.
A rank whose collectives differ from the other's hangs; the test's timeout catches it.
"""

import inspect
import json
import os
import sys
import types
from contextlib import nullcontext

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


CASES = {
    "fallback": [dict(prompt_lens=[5, 7, 4, 6], G=1, C=5), dict(prompt_lens=[6, 3], G=2, C=5)],
    "no_tokens": [dict(prompt_lens=[5, 8], G=2, C=4, no_tokens=True), dict(prompt_lens=[6], G=4, C=6)],
    "C1": [dict(prompt_lens=[5, 8, 3], G=2, C=1), dict(prompt_lens=[6], G=3, C=7)],
}


class _Trainer:  # what the patched method reads of a trainer
    accelerator = types.SimpleNamespace(autocast=nullcontext)
    temperature = 1.0
    args = types.SimpleNamespace(cast_lm_head_to_fp32=False)


def _engine():
    """A tiny Qwen2 with TRL's fused head under a ZeRO-3 engine (every parameter partitioned), over gloo."""
    import deepspeed
    import deepspeed.ops
    from helpers import tiny_model
    from trl.trainer.utils import add_fused_lm_head

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_model("qwen2", seed=0)
    model.train()
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    return engine


def _count_gathers() -> list:
    """Count the head-weight gathers grpo_mem's head makes itself (``[count]``, updated in place)."""
    from grpo_mem.model import head

    gathers = [0]
    gather = head._gather_zero3

    def counted(*params):
        ctx = gather(*params)
        gathers[0] += not isinstance(ctx, nullcontext)
        return ctx

    head._gather_zero3 = counted
    return gathers


def _run_cases(engine, rank: int) -> dict:
    """Patched and stock TRL scoring on this rank's micro-batch of every case: worst errors of ours against stock."""
    from deepspeed.utils import safe_get_full_grad
    from helpers import make_batch
    from trl import GRPOTrainer

    import grpo_mem

    trainer = _Trainer()
    stock = inspect.unwrap(GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"])
    handle = grpo_mem.patch_trl(GRPOTrainer, group_shuffle=False)
    ours = GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"]
    results = {}
    for name, per_rank in CASES.items():
        cfg = dict(per_rank[rank])
        no_tokens = cfg.pop("no_tokens", False)
        ids, mask, C, _ = make_batch(cfg.pop("prompt_lens"), cfg.pop("G"), cfg.pop("C"), seed=rank, **cfg)
        if no_tokens:
            mask[:, -C:] = 0
        w = torch.randn(ids.shape[0], C, generator=torch.Generator().manual_seed(rank))
        runs = []
        for fn in (ours, stock):
            logps, ent, _ = fn(trainer, engine, ids, mask, C, batch_size=ids.shape[0], compute_entropy=True)
            engine.backward((logps * w).sum() + ent.sum())
            grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
            engine.optimizer.zero_grad()
            runs.append((logps.detach(), ent.detach(), grads))
        (lp, en, g), (lp_ref, en_ref, g_ref) = runs
        results[name] = {
            "logps": float((lp - lp_ref).abs().max()),
            "entropy": float((en - en_ref).abs().max()),
            "grads_rel": max(float((g[n] - r).abs().max() / r.abs().max().clamp_min(1e-12)) for n, r in g_ref.items()),
        }
    handle.revert()
    return results


def _head_check(engine, gathers: list) -> dict:
    """The head read outside any module call, parameters partitioned.

    Inside the forward (the cases) DeepSpeed gathers the weight on access and registers it with the running module
    for the backward; outside, without gradients, ``completion_head`` gathers it itself (a collective both ranks
    enter), and with gradients it refuses.
    """
    import deepspeed

    from grpo_mem.model import head
    from grpo_mem.model.forward import ScoreOptions

    head_weight = engine.module.get_output_embeddings().weight
    status_before = str(head_weight.ds_status)
    with deepspeed.zero.GatheredParameters([head_weight]):
        w_full = head_weight.detach().clone()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 4, w_full.shape[1], generator=g)
    ids = torch.randint(0, w_full.shape[0], (3, 4), generator=g)
    mask = torch.ones(3, 4, dtype=torch.long)
    ref = torch.log_softmax(hidden @ w_full.T, -1).gather(-1, ids[..., None]).squeeze(-1)
    before = gathers[0]
    with torch.no_grad():
        logps, _ = head.completion_head(engine.module, hidden, ids, mask, ScoreOptions(4))
    try:
        head.completion_head(engine.module, hidden.requires_grad_(True), ids, mask, ScoreOptions(4))
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {
        "status_before": status_before,
        "gathers": gathers[0] - before,
        "logps": float((logps - ref).abs().max()),
        "refused_with_grad": refused,
    }


def main(out: str) -> None:
    engine = _engine()
    rank = torch.distributed.get_rank()
    gathers = _count_gathers()
    results = _run_cases(engine, rank)
    before = gathers[0]
    head_check = _head_check(engine, gathers)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {"cases": results, "head_gathers": before, "head": head_check})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world_size": len(gathered), "ranks": gathered}, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    from launch import end_worker

    main(sys.argv[1])
    end_worker()

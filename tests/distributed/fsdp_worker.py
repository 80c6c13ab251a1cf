"""One rank of the 2-process FSDP2 checks of the direct API, launched by test_distributed.py through
torch.distributed.run.

Usage: fsdp_worker.py OUT_JSON. For each (reshard_after_forward, gradient checkpointing) setting, a tiny Llama is
sharded with ``fully_shard`` per decoder layer and then at the root, as accelerate's ``fsdp_version: 2`` does, and
``shared_prompt_logprobs`` runs on this rank's own batch:

- whole: every group in one micro-batch; on rank 0 the prompts share a 64-token prefix, a trie node that no row ends
  in, so its pass's output gets no gradient and only its K/V are read (inside its layers); rank 1's prompts share
  nothing (its pass schedule differs: a stand-in pass at depth 1);
- split: a window of three micro-batches through a ``SharingSession``: a group of 4 spread over the first two (its
  prompt pass kept), and a group of 2 in the first and in the third; on rank 0 those two prompts share the 64-token
  prefix, a kept trie node no row ends in (rank 1 runs a stand-in for it). Kept passes are backpropagated inside a
  later micro-batch's backward, after FSDP resharded their layers.

Truth is stock TRL on an unsharded copy of the same model: per-rank log-probs, and gradients averaged over the ranks
(FSDP2 reduce-scatters the mean). Rank 0 writes the worst errors of every setting.
"""

import json
import sys

import torch
import torch.distributed as dist
from helpers import VOCAB, make_batch, stock_logps, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import grpo_mem
from grpo_mem.model.sharing import SharingSession


def _weights(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _full_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def _mean_over_ranks(grads: dict) -> dict:
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def _model(checkpointing: bool):
    model = tiny_model("llama", seed=0)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def _rel_err(ours: dict, ref: dict) -> float:
    assert ours.keys() == ref.keys(), sorted(set(ours) ^ set(ref))
    return max(float((ours[n] - r).abs().max() / r.abs().max().clamp_min(1e-12)) for n, r in ref.items())


def check(reshard: bool, checkpointing: bool, mesh, rank: int) -> dict:
    # this rank's own batch: whole groups, then a window of three micro-batches (a group of 4 split over two)
    g = torch.Generator().manual_seed(30 + rank)
    system = torch.randint(4, VOCAB, (64,), generator=g).tolist() if rank == 0 else []
    prompts = [system + torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (5 + rank, 8, 3)]
    ids, mask, C, _ = make_batch(None, 3, 6, seed=10 + rank, shuffle=True, prompts=prompts)
    split_prompts = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (7 - rank,)]
    split_prompts += [system + torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (4, 6)]
    split_ids, split_mask, _, _ = make_batch(None, 0, C, seed=20 + rank, group_sizes=[4, 2, 2], prompts=split_prompts)
    w, w_split = _weights(ids[:, -C:].shape, 1), _weights(split_ids[:, -C:].shape, 2)

    ref_model = _model(checkpointing)
    ref, _ = stock_logps(ref_model, ids, mask, C)
    (ref * w).sum().backward()
    ref_grads = _mean_over_ranks(_full_grads(ref_model))
    ref_split, _ = stock_logps(ref_model, split_ids, split_mask, C)
    (ref_split * w_split).sum().backward()
    ref_split_grads = _mean_over_ranks(_full_grads(ref_model))

    model = _model(checkpointing)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    assert all(isinstance(p, DTensor) for p in model.parameters())

    ours, _ = grpo_mem.shared_prompt_logprobs(model, ids, mask, C)
    (ours * w).sum().backward()
    grads = _full_grads(model)

    session = SharingSession()
    micro_batches = ([0, 1, 4, 5], [2, 3], [6, 7])
    P = split_ids.shape[1] - C
    session.begin_window([split_ids[r, :P] for r in micro_batches], [split_mask[r, :P] for r in micro_batches])
    parts, kept = [], []
    for rows in micro_batches:
        lp, _ = session.score(model, split_ids[rows], split_mask[rows], C)
        (lp * w_split[rows]).sum().backward()
        parts.append(lp.detach())
        kept.append(session.window.pending)
    store_left = session.window.pending
    session.close_window()
    split_grads = _full_grads(model)
    order = torch.tensor(sum(micro_batches, []))
    return {
        "reshard_after_forward": reshard,
        "checkpointing": checkpointing,
        "logps": float((ours.detach() - ref.detach()).abs().max()),
        "grads_rel": _rel_err(grads, ref_grads),
        "split_logps": float((torch.cat(parts) - ref_split[order]).abs().max()),
        "split_grads_rel": _rel_err(split_grads, ref_split_grads),
        "store_left": store_left,
        "kept": kept,
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = [check(r, c, mesh, rank) for r, c in ((True, False), (True, True), (False, True))]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "ranks": gathered}, f)
    dist.barrier()  # no rank tears its process group down while the other still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    from launch import end_worker

    main(sys.argv[1])
    end_worker()

"""Worker of the sequence-parallel scoring tests (2 ranks, gloo): every pass split along the sequence over the ranks,
against stock TRL's scoring on one process.

Usage: ``sp_worker.py ARCH SHARING [checkpointing] [causal] [contiguous] [gather] [mqa] [odd-heads] [one-group]
[+ ARCH SHARING [flags] ...]`` (cases separated by ``+``, run one after another in the same processes) on 2
ranks (one SP group) or 4 (two SP groups of 2, data parallel over them, each with its own window; ``one-group``: one SP
group of 4) (``tests/distributed/test_sequence_parallel.py`` launches it). Passes are split zigzag (the default), or in
contiguous shards with ``contiguous``; attention exchanges K/V over heads (the default), or all-gathers them with
``gather``. ``mqa``: one K/V head (repeated to the group size by the head exchange); ``odd-heads``: 3 query heads, 1 K/V
head (not divisible by 2: the layers all-gather). Every rank builds
the same tiny model and the same window of micro-batches (a long shared system prompt of odd length, groups split over
micro-batches), scores it with ``SharingSession(sequence_parallel=world)``, computes the same loss from the gathered
log-probs and entropies, and backpropagates. Asserted on every rank: the log-probs and entropies equal stock TRL's on
the whole sequence (one process, computed here too), the parameter gradients summed over the ranks equal stock's, and
every recorded pass's K/V hold the elements the exchange keeps on a rank (``check_recorded``: 1/size of the pass's
under the head exchange). Then the ranks are given different micro-batches: both raise the named cause, neither hangs.
"""

import math
import sys

import torch
import torch.distributed as dist
from helpers import (
    assert_close,
    assert_grads_close,
    make_batch,
    random_tokens,
    stock_window,
    tiny_model,
    weighted_backward,
)
from launch import end_worker

from grpo_mem import SharingSession
from grpo_mem.model.sequence_parallel import SP_CAUSES, SequenceParallel
from grpo_mem.model.store import PassTable

ARCHS = {
    "llama": {},
    "mistral": {"sliding_window": 24},  # a window shorter than the prompts: the earlier shard's keys fall out of it
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 24},  # sinks, windows, MoE
    "gemma2": {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0, "query_pre_attn_scalar": 12},
    # multi-head latent attention: value heads of 16 against query/key heads of 24 (16 without RoPE + 8 with)
    "deepseek_v3": {
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
}


def window_batches(C: int, dp: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three micro-batches: prompts sharing a system prompt of 71 tokens (tree sharing makes it one node; 60 on data-
    parallel rank ``dp`` 1), one prompt's group split over the first two micro-batches, prompt widths odd and even."""
    system = random_tokens(71 - 11 * dp, seed=5 + dp)
    prompts = [system + random_tokens(n, seed=10 + n + dp) for n in (9, 14, 5, 22)]
    ids, mask, _, _ = make_batch(None, 3, C, prompts=prompts, seed=3 + dp)  # 12 rows, groups of 3
    cuts = [(0, 5), (5, 8), (8, 12)]  # the first group straddles micro-batches 0 and 1
    return [(ids[a:b], mask[a:b]) for a, b in cuts]


def assert_refused(model, ids, mask, C, sharing, sp, case, **options) -> None:
    """Scoring ``ids``/``mask`` with sequence parallelism over ``sp`` raises ValueError naming
    ``SP_CAUSES[case]``."""
    session = SharingSession(sharing, sequence_parallel=sp, confirm=False)
    try:
        session.score(model, ids, mask, C, **options)
    except ValueError as exc:
        assert SP_CAUSES[case] in str(exc), exc
    else:
        raise AssertionError(f"not refused under sequence parallelism: {case}")


HEADS = {"mqa": {"num_key_value_heads": 1}, "odd-heads": {"num_attention_heads": 3, "num_key_value_heads": 1}}
"""Head counts of the GQA cases, by flag (hidden 48: head_dim 12, and 16 with 3 heads)."""


def record_kv(recorded: list) -> None:
    """Append (mask shape, {layer: (K shape, V shape)}) of every pass the window registers to ``recorded``."""
    register = PassTable.register

    def spy(self, p, states):
        recorded.append((tuple(p.mask.shape), {i: (k.shape, v.shape) for i, (k, v) in states.kv.items()}))
        return register(self, p, states)

    PassTable.register = spy


def check_recorded(recorded: list, config, sp: SequenceParallel) -> None:
    """Each rank's recorded K/V of a pass of n rows padded to S tokens: (n, h, S, ·) per layer, with h = Hkv' / size
    (Hkv' = lcm(Hkv, size)) under the head exchange when size divides the query heads, else Hkv (all-gathered):
    under the head exchange, size times the elements equal the pass's K/V at its Hkv' heads."""
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    split = sp.exchange == "heads" and H % sp.size == 0
    h = math.lcm(Hkv, sp.size) // sp.size if split else Hkv
    assert recorded, "no pass recorded"
    for (n, S), kv in recorded:
        assert len(kv) == config.num_hidden_layers, kv.keys()
        for k_shape, v_shape in kv.values():
            assert tuple(k_shape[:3]) == tuple(v_shape[:3]) == (n, h, S), (k_shape, v_shape, (n, h, S))
            if split:
                whole = n * math.lcm(Hkv, sp.size) * S * (k_shape[3] + v_shape[3])
                assert sp.size * (math.prod(k_shape) + math.prod(v_shape)) == whole


def sp_group(one_group: bool) -> tuple[object, int]:
    """(this rank's SP group, its data-parallel index): the whole world on 2 ranks or with ``one_group``; on 4, SP
    groups {0, 1} and {2, 3}, data-parallel over the two."""
    if dist.get_world_size() == 2 or one_group:
        return dist.group.WORLD, 0
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    return groups[dist.get_rank() // 2], dist.get_rank() // 2


def main(*args: str) -> None:
    """Run every case of ``args`` (``ARCH SHARING [flags]``, cases separated by ``+``) in these processes."""
    dist.init_process_group("gloo")
    cases = " ".join(args).split("+")
    recorded = []
    record_kv(recorded)
    for case in cases:
        arch, sharing, *flags = case.split()
        recorded.clear()
        run_case(arch, sharing, flags, recorded)
        print(f"rank {dist.get_rank()}: {case.strip()} passed", flush=True)
    dist.barrier()
    end_worker()


def run_case(arch: str, sharing: str, flags: list[str], recorded: list) -> None:
    """One case (``main``'s ``ARCH SHARING [flags]``) on the initialised process group; ``recorded``: the passes
    ``record_kv`` sees, emptied before the case."""
    from grpo_mem.ops import attention_cpu

    rank = dist.get_rank()
    group, dp = sp_group("one-group" in flags)
    split = "contiguous" if "contiguous" in flags else "zigzag"
    sp = SequenceParallel.of(group, split=split, exchange="gather" if "gather" in flags else "heads")
    torch.manual_seed(0)
    C = 9
    batches = window_batches(C, dp)
    shape = dict(ARCHS[arch], **{k: v for f in flags for k, v in HEADS.get(f, {}).items()})
    stock = tiny_model(arch, **shape)
    ref, ref_grads = stock_window(stock, batches, C)

    model = tiny_model(arch, **shape)
    limit = attention_cpu.MASK_BYTES_LIMIT
    if "causal" in flags:  # the cpu backend's own region without a mask tensor, as it runs on long shards
        attention_cpu.MASK_BYTES_LIMIT = -1
    if "checkpointing" in flags:  # TRL's default: layers re-run in backward, and with them the hook's all-gathers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    session = SharingSession(sharing, sequence_parallel=sp, confirm=False)
    assert session.sp.split == split
    session.begin_window([ids[:, :-C] for ids, _ in batches], [mask[:, :-C] for _, mask in batches])
    for (ids, mask), (ref_logps, ref_ent) in zip(batches, ref):
        logps, ent = session.score(model, ids, mask, C, compute_entropy=True)
        keep = mask[:, -C:]
        assert_close(logps, ref_logps, 1e-5, f"{arch}/{sharing} log-probs, rank {rank}", keep)
        assert_close(ent, ref_ent, 1e-5, f"{arch}/{sharing} entropies, rank {rank}", keep)
        weighted_backward(logps, ent, seed=ids.shape[1])  # the same loss on every rank, as TRL computes it
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g, group=group)  # what DeepSpeed does under sequence parallelism: the sum over the group
    assert_grads_close(grads, ref_grads, rel=1e-5)
    check_recorded(recorded, model.config, sp)
    model.zero_grad(set_to_none=True)
    attention_cpu.MASK_BYTES_LIMIT = limit

    ids, mask = batches[rank % len(batches)]  # each rank another micro-batch: refused on both, no hang
    assert_refused(model, ids, mask, C, sharing, sp, "differ")
    if arch == "llama":  # what the path refuses under sequence parallelism, by its named cause
        ids, mask = batches[0]
        assert_refused(model, ids, mask, C, sharing, sp, "router", compute_aux_loss=True)
        assert_refused(tiny_model("qwen3_5"), ids, mask, C, sharing, sp, "linear")


if __name__ == "__main__":
    main(*sys.argv[1:])

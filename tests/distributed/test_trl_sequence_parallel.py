"""Sequence parallelism through TRL (``ParallelismConfig(sp_size=2, sp_backend="deepspeed")``, or
``ParallelismConfig(cp_size=2)`` with FSDP2, after ``grpo_mem.patch_trl(sequence_parallel=True)``), 2 CPU processes over
gloo: the two ranks of the SP group act as one data-parallel rank.
Prompts share a 74-token system prompt (a trie node split over the ranks); TRL's row shuffle splits groups over
micro-batches.

Against stock TRL on one process with the same configuration without SP: on every rank and every micro-batch, the
inputs TRL's loss receives (prompt and completion ids and masks, the token count) equal bit for bit, advantages and
old and reference log-probs (scored by grpo_mem with every pass split over the two ranks) within 1e-6; grad norms
within 1e-5 relative and the weights after 3 optimizer steps within 1e-5.
"""

import json

import pytest
from launch import launch

FLOAT_KEYS = ("advantages", "old_per_token_logps", "ref_per_token_logps")


def _run(tmp_path, kind, stage, mode, nproc=None, options="") -> dict:
    """Run trl_sp_worker.py (``options``: its ``OPTIONS`` names, comma-separated) and return what rank 0 wrote."""
    out = tmp_path / f"{kind}-{stage}-{mode}-{nproc}.json"
    launch("trl_sp_worker.py", kind, stage, mode, out, options, nproc=nproc or (2 if mode == "sp" else 1))
    return json.loads(out.read_text())


def _assert_same_weights(ours: dict, stock: dict) -> None:
    for name, ref_w in stock.items():
        err = max(abs(a - b) for a, b in zip(ours[name], ref_w, strict=True))
        assert err <= 1e-5, f"{name}: weights differ by {err:.3e} after 3 steps"


def _max_diff(a, b) -> float:
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return abs(a - b)


def _assert_same_records(ours: list, ref: list) -> None:
    assert len(ours) == len(ref) == 6  # 3 optimizer steps of 2 micro-batches
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert sorted(a) == sorted(b), (step, sorted(a), sorted(b))
        for key in a:
            if key in FLOAT_KEYS:
                assert _max_diff(a[key], b[key]) <= 1e-6, (step, key, _max_diff(a[key], b[key]))
            else:
                assert a[key] == b[key], (step, key)


CASES = [("grpo", "zero2"), ("grpo", "zero3"), ("rloo", "zero2")]


@pytest.mark.slow
@pytest.mark.parametrize("kind,stage", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_sp_group_sees_the_one_process_batch(tmp_path, kind, stage):
    """Per micro-batch: the two SP ranks' inputs are equal and equal the one-process run's, over 2 generation
    batches (the second one generated after an optimizer step: the gradient, summed by ZeRO-2 / averaged by ZeRO-3
    over the SP group, is the one-process gradient); DeepSpeed's Ulysses attention override is undone and its
    dataloader adapter skipped; the batch arithmetic and the seeds are the data-parallel run's; ``revert()`` brings
    TRL's refusal back; generation and the reward functions ran once per SP group (under ZeRO-3 the other rank joins
    each generation step with a one-token stand-in row, and the generations end early)."""
    pytest.importorskip("deepspeed")
    options = "early_stop" if stage == "zero3" else ""  # the leader's generation ends before max_completion_length
    ref = _run(tmp_path, kind, stage, "ref", options=options)
    sp = _run(tmp_path, kind, stage, "sp", options=options)
    assert ref["world_size"] == 1 and sp["world_size"] == 2
    (r,) = ref["ranks"]
    if kind == "grpo":  # steps_per_generation 4 > accumulation 2, beta > 0
        assert "old_per_token_logps" in r["records"][0] and "ref_per_token_logps" in r["records"][0]
    assert [s["sp_group"] for s in sp["ranks"]] == [[0, 2], [1, 2]]
    expected = {"sum": "zero2", "mean": "zero3"}
    for s in sp["ranks"]:
        _assert_same_records(s["records"], r["records"])
        for key in ("generation_batch_size", "steps_per_generation", "global_step", "seed_after_init"):
            assert s[key] == r[key], (key, s[key], r[key])
        for a, b in zip(s["grad_norms"], r["grad_norms"], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (s["grad_norms"], r["grad_norms"])
        assert expected[s["gradient_reduction"]] == stage
        assert s["attention"]["core_impl"] == "sdpa" and s["attention"]["core"], s["attention"]
        assert s["decisions"]["grpo_mem/path/tree"] > 0 and s["decisions"]["grpo_mem/path/stock"] == 0, s["decisions"]
        assert not s["attention"]["ulysses"], s["attention"]
        assert s["adapter_skipped"] and s["adapter_restored"]
        assert "does not support sequence-dim parallelism" in s["refused_after_revert"], s["refused_after_revert"]
        assert s["verified"] is (True if stage == "zero2" else None)  # grpo_mem.verify(trainer) before train()
    _assert_same_weights(sp["ranks"][0]["weights"], r["weights"])
    _assert_generated_once_per_group(sp["ranks"], stage, [r], ends_early=bool(options))


def _assert_generated_once_per_group(ranks: list, stage: str, refs: list, ends_early: bool = False) -> None:
    """Generation and the reward functions ran once per SP group: on each group's leader, the reward functions as often
    as on the stock rank of the group's index (``refs[d]``) and the model's ``generate`` on the rows stock's rank
    generated, call by call. Below ZeRO-3 the other ranks never call ``generate``. Under ZeRO-3 and FSDP2, whose
    generation forwards are parameter collectives of every rank, each other rank joins every call with ONE row of one
    token (a stand-in finished after its first token), every rank with ``synced_gpus``, and every rank runs as many
    forwards per call as the stock run's longest rank: the lockstep adds no step, and the stand-in keeps none going
    (``ends_early``: some generation ended before ``max_completion_length``, 6 tokens)."""
    sharded = stage in ("zero3", "fsdp2")
    ref_calls = [r["counts"]["generate"] for r in refs]
    longest = [max(c["forwards"] for c in calls) for calls in zip(*ref_calls, strict=True)]
    assert (min(longest) < 6) is ends_early, longest
    for rank, s in enumerate(ranks):
        ref, calls = refs[rank // 2]["counts"], s["counts"]["generate"]
        leader = rank % 2 == 0
        assert s["counts"]["rewards"] == (ref["rewards"] if leader else 0), (rank, s["counts"], ref)
        if leader:
            rows = [(c["rows"], c["width"]) for c in ref["generate"]]
            assert [(c["rows"], c["width"]) for c in calls] == rows, (rank, calls, ref["generate"])
        else:
            assert [(c["rows"], c["width"]) for c in calls] == ([(1, 1)] * len(longest) if sharded else []), calls
        if sharded:
            assert [c["forwards"] for c in calls] == longest, (rank, calls, ref_calls)
            assert all(c["synced"] is True for c in calls), calls
    assert all(len(calls) > 0 and r["counts"]["rewards"] > 0 for calls, r in zip(ref_calls, refs)), refs


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero3", "fsdp2"])
def test_sp_groups_with_data_parallelism_match_stock(tmp_path, stage):
    """4 processes: two SP groups of 2, data parallel over them (their tries differ: the ranks run in lockstep with
    stand-in passes while each group splits its passes), under ZeRO-3 (``sp_size=2, dp_replicate_size=2``) or FSDP2
    (``cp_size=2, dp_shard_size=2``: FSDP2 shards over all four ranks, accelerate's dataloader over dp_shard only),
    against stock TRL on 2 processes without SP: SP group d's two ranks see, micro-batch by micro-batch, what stock's
    rank d sees; grad norms and weights agree."""
    if stage == "zero3":
        pytest.importorskip("deepspeed")
    # ZeRO-3: each generation forward gathers per module, and the groups' generations end early at different steps;
    # not under FSDP2: stock TRL generates there without synced_gpus, so its ranks must take the same step count
    options = "early_stop,per_module_gather" if stage == "zero3" else ""
    ref = _run(tmp_path, "grpo", stage, "ref", nproc=2, options=options)
    sp = _run(tmp_path, "grpo", stage, "sp", nproc=4, options=options)
    assert ref["world_size"] == 2 and sp["world_size"] == 4
    assert [s["sp_group"] for s in sp["ranks"]] == [[0, 2], [1, 2], [0, 2], [1, 2]]
    for rank, s in enumerate(sp["ranks"]):
        r = ref["ranks"][rank // 2]
        _assert_same_records(s["records"], r["records"])
        for a, b in zip(s["grad_norms"], r["grad_norms"], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (s["grad_norms"], r["grad_norms"])
        assert s["decisions"]["grpo_mem/path/stock"] == 0, s["decisions"]
    assert ref["ranks"][0]["records"][0]["prompt_ids"] != ref["ranks"][1]["records"][0]["prompt_ids"]
    _assert_generated_once_per_group(sp["ranks"], stage, ref["ranks"], ends_early=bool(options))
    _assert_same_weights(sp["ranks"][0]["weights"], ref["ranks"][0]["weights"])


@pytest.mark.slow
def test_fsdp2_context_parallel_trains_like_one_process(tmp_path):
    """``ParallelismConfig(cp_size=2)`` with FSDP2 (each decoder layer sharded) on 2 processes: the ``cp`` ranks of
    accelerate's device mesh are one SP group of grpo_mem's sequence-sharded layout, one data-parallel rank. Against
    stock TRL on one process without FSDP: every micro-batch's loss inputs, the batch arithmetic and seeds, grad
    norms within 1e-5 relative and the weights after 3 optimizer steps within 1e-5 (FSDP2 averages the gradient
    over the cp ranks: each rank's share is scaled by 2). accelerate's context-parallel preparation is skipped (no
    mask-dropping pre-hook on any ``self_attn``), the leader alone generates the batch while the other rank joins each
    step's unshard with a one-token stand-in row (generations ending early), the reward function runs on the leader
    alone, and ``revert()`` brings TRL's refusal back."""
    ref = _run(tmp_path, "grpo", "fsdp2", "ref", options="early_stop")
    cp = _run(tmp_path, "grpo", "fsdp2", "sp", options="early_stop")
    (r,) = ref["ranks"]
    assert [s["sp_group"] for s in cp["ranks"]] == [[0, 2], [1, 2]]
    for s in cp["ranks"]:
        assert s["distributed_type"] == "DistributedType.FSDP" and s["sharded"], s["distributed_type"]
        _assert_same_records(s["records"], r["records"])
        for key in ("generation_batch_size", "steps_per_generation", "global_step", "seed_after_init"):
            assert s[key] == r[key], (key, s[key], r[key])
        for a, b in zip(s["grad_norms"], r["grad_norms"], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (s["grad_norms"], r["grad_norms"])
        assert s["gradient_reduction"] == "mean"
        assert s["decisions"]["grpo_mem/path/tree"] > 0 and s["decisions"]["grpo_mem/path/stock"] == 0, s["decisions"]
        assert s["adapter_skipped"] and s["adapter_restored"] and s["mask_hooks"] == 0, s
        assert "does not support sequence-dim parallelism" in s["refused_after_revert"], s["refused_after_revert"]
        assert s["verified"] is True  # grpo_mem.verify(trainer) before train(): each rank on its own
    _assert_generated_once_per_group(cp["ranks"], "fsdp2", [r], ends_early=True)
    _assert_same_weights(cp["ranks"][0]["weights"], r["weights"])

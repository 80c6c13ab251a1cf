"""2-process (gloo, CPU) runs: patched and stock TRL end with the same weights and the same accounting under DDP,
FSDP2 and DeepSpeed ZeRO-2/3, and the prompt-once path under FSDP2 matches an unsharded model.

Each run is a ``torch.distributed.run`` of a worker script with a timeout, so a hang (ranks issuing different
collectives) fails the test instead of stalling the suite.
"""

import json

import pytest
from launch import TIMEOUT, launch

from grpo_mem.model.distributed import IMAGE_PASSES_DIFFER


def _assert_same_training(ours: dict, stock: dict, stack: str) -> None:
    assert stock["world_size"] == ours["world_size"] == 2
    expected = {"ddp": "MULTI_CPU", "fsdp2": "FSDP", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}[stack]
    assert ours["distributed_type"] == stock["distributed_type"] == f"DistributedType.{expected}"
    assert ours["grpo_mem_used"] and not stock["grpo_mem_used"]
    if stack == "fsdp2":  # each decoder layer sharded on its own, as users' configs do
        assert ours["wrapped_layers"] == stock["wrapped_layers"] == [2, 2], ours["wrapped_layers"]
    assert ours["global_step"] == stock["global_step"] == 3
    assert ours["lrs"] == stock["lrs"] and len(ours["lrs"]) == 3
    assert ours["epochs"] == stock["epochs"]
    for a, b in zip(ours["grad_norms"], stock["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (ours["grad_norms"], stock["grad_norms"])
    for name, ref in stock["weights"].items():
        err = max(abs(a - b) for a, b in zip(ours["weights"][name], ref, strict=True))
        assert err <= 1e-5, f"{name}: max |diff| {err:.3e}"


def _split(ours: dict, stack: str) -> None:
    """3 optimizer steps, gradient accumulation 2, each rank's half of a group of 8 split over two micro-batches."""
    if stack in ("fsdp2", "zero3"):
        assert ours["sharded"], "parameters were not sharded"
    assert ours["prompts_kept"] > 0, "no group was split over micro-batches"


def _uneven(ours: dict, stack: str) -> None:
    """Groups of 4 over micro-batches of 3: rank 0 holds a whole group and half of another, rank 1 the other half
    and a whole group, so the ranks' micro-batches split their groups differently. Without lockstep this hung."""
    assert ours["passes_differ"] > 0, "the ranks never planned different pass structures"
    assert sum(ours["stand_ins"]) > 0


def _tree(ours: dict, stack: str) -> None:
    """Sharded ranks share their own tries (a system prompt, few-shot blocks) although the tries differ in depth and
    width between ranks: every rank makes the same backbone calls (stand-in passes where it has fewer), no hang,
    the system prompt forwarded once per optimizer step on each rank. Qwen3.5 (Gated DeltaNet hybrid): its stand-in
    passes and kept passes carry linear-attention states too. FSDP2 runs the window in one micro-batch ("tree1"):
    the system prompt's pass is then not kept, and its output gets no gradient (its K/V are read inside its layers),
    which crashed FSDP2's per-layer backward before ``store.touch``."""
    assert ours["sharded"], "parameters were not sharded"
    assert ours["passes_differ"] > 0 and sum(ours["stand_ins"]) > 0, "the ranks' tries never differed"
    assert ours["system_passes"] == [[1, 1, 1], [1, 1, 1]], ours["system_passes"]


CHECKS = {"split": _split, "uneven": _uneven, "tree": _tree, "tree1": _tree}
# stack -> (kind, scenario, arch) of the cases its one launch trains, each stock then patched. Not Qwen3.5 under
# FSDP2: accelerate's auto-wrap looks for Qwen3_5ForCausalLM's _no_split_modules, whose vision block the text model
# lacks.
CASES = {
    "ddp": [("grpo", "split", "llama"), ("rloo", "split", "llama")],
    "fsdp2": [
        ("grpo", "split", "llama"),
        ("rloo", "split", "llama"),
        ("grpo", "uneven", "llama"),
        ("grpo", "tree1", "llama"),
    ],
    "zero2": [("grpo", "split", "llama"), ("rloo", "uneven", "llama")],
    "zero3": [
        ("grpo", "split", "llama"),
        ("grpo", "uneven", "llama"),
        ("grpo", "tree", "llama"),
        ("grpo", "tree", "qwen3_5"),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("stack", list(CASES))
def test_two_process_training_matches_stock(tmp_path, stack):
    """Each case of ``CASES[stack]`` (``dist_worker.py``: its scenarios), patched against stock trained in the same
    launch: the same accounting, grad norms within 1e-5 and final weights within 1e-5 after 3 optimizer steps, and the
    scenario's own checks (``_split``, ``_uneven``, ``_tree``). One launch per stack: a launch's imports cost each
    rank several CPU seconds."""
    if stack.startswith("zero"):
        pytest.importorskip("deepspeed")
    launch("dist_worker.py", stack, tmp_path, *(":".join(case) for case in CASES[stack]), timeout=2 * TIMEOUT)
    for kind, scenario, arch in CASES[stack]:
        stock, ours = (
            json.loads((tmp_path / f"{kind}-{scenario}-{arch}-{run}.json").read_text()) for run in ("stock", "patch")
        )
        try:
            _assert_same_training(ours, stock, stack)
            CHECKS[scenario](ours, stack)
        except AssertionError as e:
            raise AssertionError(f"{kind} {scenario} {arch} under {stack}: {e}") from e


@pytest.mark.slow
def test_zero3_unbalanced_micro_batches(tmp_path):
    """ZeRO-3 (untied head, every parameter partitioned), ranks given different micro-batches: one rank's prompts all
    distinct (stock path on its own), one scoring no completion token, one with one-token completions. Patched vs
    stock on the same engine: log-probs and entropies within 1e-5, full gradients within 1e-4 relative, no hang,
    the head weight gathered at most once per call. The head read outside a forward on partitioned parameters:
    gathered and exact without gradients, refused with them."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "zero3.json"
    launch("zero3_worker.py", out)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    for rank, r in enumerate(result["ranks"]):
        assert sorted(r["cases"]) == ["C1", "fallback", "no_tokens"]
        for name, c in r["cases"].items():
            assert c["logps"] <= 1e-5 and c["entropy"] <= 1e-5, (rank, name, c)
            assert c["grads_rel"] <= 1e-4, (rank, name, c)
        assert r["head_gathers"] <= len(r["cases"])
        head = r[
            "head"
        ]  # read outside the forward: partitioned; one gather context per call, exact; refused with grads
        assert head["status_before"] == "ZeroParamStatus.NOT_AVAILABLE" and head["gathers"] == 2, head
        assert head["logps"] <= 1e-5 and "outside the model's forward" in head["refused_with_grad"], head


def test_fsdp2_prompt_once_matches_unsharded(tmp_path):
    """The direct API on a fully_shard-ed model (per layer + root; reshard_after_forward True/False; gradient
    checkpointing on/off), whole groups (on rank 0 under a shared prefix no row ends in) and a window of three
    micro-batches (a group split over two, a kept prefix node on rank 0): log-probs against stock TRL on an
    unsharded copy within 1e-5, gradients (mean over ranks) within 1e-4 relative. Before ``store.touch`` this run
    did not finish (rank 0's prefix pass, read only through its K/V, had its top layer backpropagated after FSDP
    resharded it)."""
    out = tmp_path / "fsdp.json"
    launch("fsdp_worker.py", out)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    for rank, checks in enumerate(result["ranks"]):
        assert len(checks) == 3
        for c in checks:
            where = f"rank {rank}, reshard_after_forward={c['reshard_after_forward']}, ckpt={c['checkpointing']}"
            assert c["logps"] <= 1e-5 and c["split_logps"] <= 1e-5, where
            assert c["grads_rel"] <= 1e-4 and c["split_grads_rel"] <= 1e-4, where
            assert c["store_left"] == 0, where
            assert c["kept"] == [2, 1, 0], where  # the split group's pass, and rank 0's prefix (rank 1's stand-in)


def _train_images(out, stack, sharing, *rows) -> tuple[dict, dict]:
    """(stock's result, the patched result) of ``vlm_dist_worker``: both trained in one launch, stock first, except
    under ZeRO-3 (a second image-model trainer of a process does not train as the first did, stock's own included:
    grad norms 0.99 instead of 1.12 at the first step), one launch each."""
    if stack == "zero3":
        for run in ("stock", "patch"):
            launch("vlm_dist_worker.py", stack, sharing, run, out, *rows)
    else:
        launch("vlm_dist_worker.py", stack, sharing, "stock,patch", out, *rows)
    return tuple(json.loads(out.with_name(f"{out.name}-{run}.json").read_text()) for run in ("stock", "patch"))


# (stack, sharing mode): one patched run each against its stock run, both modes across the stacks (both modes of
# this run are checked in one process by tests/vlm/test_vlm.py)
IMAGE_RUNS = [("ddp", "group"), ("fsdp2", "tree"), ("zero3", "tree")]


@pytest.mark.slow
@pytest.mark.parametrize("stack, sharing", IMAGE_RUNS)
def test_image_prompts_train_like_stock(tmp_path, stack, sharing):
    """2 processes (gloo), 3 GRPOTrainer steps on the tiny Qwen2.5-VL of ``tests/vlm/test_vlm.py`` with images of three
    sizes, under DDP, FSDP2 (every parameter a DTensor, vision tower included) and ZeRO-3 (every parameter
    partitioned), patched in one sharing mode against stock: every rank's training micro-batches take the path of
    the sharing mode with no fallback, and the grad norms and final weights, vision tower included, are stock's
    within 1e-5. Under ZeRO-3 a window's vision tower gets its first gradient of the optimizer step in
    its second backward (the kept image prompt pass's release); before ``clear_zero3_grads_before_first_backward``
    it was added to the previous step's (weights 7e-4 off after 3 steps)."""
    if stack == "zero3":
        pytest.importorskip("deepspeed")
    stock, ours = _train_images(tmp_path / f"vlm-{stack}-{sharing}", stack, sharing)
    expected = {"ddp": "MULTI_CPU", "fsdp2": "FSDP", "zero3": "DEEPSPEED"}[stack]
    assert stock["path"] == [] and stock["fallbacks"] == [[], []]
    assert any(name.startswith("model.visual.") for name in stock["weights"])
    assert stock["world_size"] == ours["world_size"] == 2
    assert ours["distributed_type"] == stock["distributed_type"] == f"DistributedType.{expected}"
    assert ours["sharded"] == stock["sharded"] == (stack != "ddp")
    assert ours["global_step"] == stock["global_step"] == 3
    assert ours["fallbacks"] == [[], []] and ours["path"] == [1.0, 1.0, 1.0], (sharing, ours["path"])
    for a, b in zip(ours["grad_norms"], stock["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (sharing, ours["grad_norms"], stock["grad_norms"])
    for name, ref in stock["weights"].items():
        err = max(abs(a - b) for a, b in zip(ours["weights"][name], ref, strict=True))
        assert err <= 1e-5, f"{sharing}, {name}: max |diff| {err:.3e}"


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["fsdp2"])
def test_image_prompts_on_ranks_whose_passes_differ(tmp_path, stack):
    """3 rows per micro-batch (groups of 4): each rank holds a group and half of another, so in some micro-batches one
    rank forwards an image prompt pass where the other has a stand-in pass, which would skip the vision tower's
    collectives (before ``IMAGE_PASSES_DIFFER``, FSDP2 aborted: "Received data size doesn't match expected size").
    Those micro-batches fall back on both ranks, named; the others take the tree path; the weights are stock's."""
    if stack == "zero3":
        pytest.importorskip("deepspeed")
    stock, ours = _train_images(tmp_path / f"vlm-{stack}-uneven", stack, "tree", 3)
    assert ours["global_step"] == stock["global_step"] == 3 and ours["sharded"] and stock["path"] == []
    assert ours["fallbacks"][0] == ours["fallbacks"][1] and ours["fallbacks"][0], ours["fallbacks"]
    assert set(ours["fallbacks"][0]) == {IMAGE_PASSES_DIFFER}
    assert 0 < min(ours["path"]) and max(ours["path"]) == 1.0, ours["path"]  # the tree path in the other micro-batches
    for a, b in zip(ours["grad_norms"], stock["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (ours["grad_norms"], stock["grad_norms"])
    for name, ref in stock["weights"].items():
        err = max(abs(a - b) for a, b in zip(ours["weights"][name], ref, strict=True))
        assert err <= 1e-5, f"{name}: max |diff| {err:.3e}"

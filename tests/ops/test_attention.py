"""Shared-prefix attention against naive full-sequence attention with the prompt K/V materialised per row."""

import os

import pytest
import torch
from helpers import (
    FakeKernel,
    HostSyncsAndCopies,
    LaunchRecorder,
    assert_close,
    attention_inputs,
    check_fp32_against_truth,
    needs_interpreter,
)
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_mem.ops.attention import (
    MultiRegionAttentionFunction,
    MultiRegionAttentionParams,
    shared_prefix_attention,
    shared_prefix_attention_ref,
)

GRAD_NAMES = ("q", "k", "v", "prefix_k", "prefix_v")


def make_inputs(B, Hq, Hkv, C, P, d, prefix_index, prompt_lens, completion_lens=None, dtype=torch.float32, seed=0):
    """``attention_inputs`` with one region, named as shared_prefix_attention's arguments: prompt u is left-padded to P
    with ``prompt_lens[u]`` real keys (padding holds random junk). Returns (tensors {q, k, v, prefix_k, prefix_v},
    prefix_index, prefix_mask, key_mask, grad_out)."""
    region = (len(prompt_lens), P, prefix_index, ("left", prompt_lens))
    t, ((pi, pm),), km, go = attention_inputs(B, Hq, Hkv, C, d, [region], completion_lens, dtype, seed)
    t["prefix_k"], t["prefix_v"] = t.pop("rk0"), t.pop("rv0")
    return t, pi, pm, km, go


def run(fn, tensors, prefix_index, prefix_mask, key_mask, grad_out, dtype=None, **kw):
    """Output and gradients of ``fn`` (inputs cast to ``dtype`` if given), as a dict of detached tensors."""
    leaves = {n: x.detach().to(dtype or x.dtype).requires_grad_(True) for n, x in tensors.items()}
    out = fn(*(leaves[n] for n in GRAD_NAMES), prefix_index, prefix_mask, key_mask, **kw)
    grads = torch.autograd.grad(out, [leaves[n] for n in GRAD_NAMES], grad_out.to(out.dtype))
    res = {"out": out.detach()}
    res.update({"d" + n: gr for n, gr in zip(GRAD_NAMES, grads)})
    return res


def torch_path(q, k, v, prefix_k, prefix_v, prefix_index, prefix_mask, key_mask, *, scale, chunk_elems=1 << 20):
    """The torch backend with a chosen chunk size: the autograd Function with the one region."""
    params = MultiRegionAttentionParams(scale=scale, backend="torch", chunk_elems=chunk_elems)
    return MultiRegionAttentionFunction.apply(q, k, v, key_mask, params, prefix_k, prefix_v, prefix_index, prefix_mask)


# (B, Hq, Hkv, C, P, d, prefix_index, prompt_lens, completion_lens)
CASES = {
    # unsorted rows, unequal groups (4, 2, 1), mixed left padding, GQA 4, head dim 64
    "mixed_gqa4_d64": (7, 8, 2, 9, 13, 64, [2, 0, 2, 1, 2, 0, 2], [13, 5, 9], [9, 3, 9, 7, 1, 9, 6]),
    # G = 1: every row its own prompt, no GQA
    "g1_mha": (3, 4, 4, 6, 10, 64, [1, 2, 0], [4, 10, 7], None),
    # C = 1: a single completion token per row
    "c1": (5, 4, 1, 1, 12, 64, [0, 1, 1, 0, 1], [12, 3], None),
    # GQA 8, head dim 128
    "gqa8_d128": (4, 8, 1, 5, 11, 128, [1, 0, 0, 1], [6, 11], [5, 2, 5, 4]),
    # one prompt shared by every row (the benchmark shape, scaled down)
    "one_prompt": (6, 6, 2, 8, 17, 64, [0] * 6, [15], [8, 8, 5, 8, 2, 8]),
}


def cpu_path(*args, scale):
    return shared_prefix_attention(*args, scale=scale, backend="cpu")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["torch", "torch_chunk300", "cpu", "cpu_causal"])
def test_torch_path_matches_reference(case, path, monkeypatch):
    """``cpu_causal``: the cpu backend's own region without a mask tensor (``is_causal`` plus one call per row for
    its padding queries), which it takes for masks above ``MASK_BYTES_LIMIT`` (forced here at these small sizes)."""
    B, Hq, Hkv, C, P, d, idx, plens, clens = CASES[case]
    if path == "cpu_causal":
        from grpo_mem.ops import attention_cpu

        monkeypatch.setattr(attention_cpu, "MASK_BYTES_LIMIT", -1)
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens)
    scale = d**-0.5
    truth = run(shared_prefix_attention_ref, t, pi, pm, km, go, dtype=torch.float64, scale=scale)
    naive32 = run(shared_prefix_attention_ref, t, pi, pm, km, go, scale=scale)
    check_fp32_against_truth(naive32, truth)  # the reference itself is exact in fp32
    if path.startswith("cpu"):
        res = run(cpu_path, t, pi, pm, km, go, scale=scale)
    else:
        res = run(torch_path, t, pi, pm, km, go, scale=scale, chunk_elems=300 if path == "torch_chunk300" else 1 << 20)
    check_fp32_against_truth(res, truth)
    # padding positions get exactly zero gradient
    dpk, dpv = res["dprefix_k"].transpose(1, 2), res["dprefix_v"].transpose(1, 2)  # (U, P, Hkv, d)
    assert (dpk[~pm] == 0).all() and (dpv[~pm] == 0).all()
    if km is not None:
        dk, dv = res["dk"].transpose(1, 2), res["dv"].transpose(1, 2)  # (B, C, Hkv, d)
        assert (dk[~km] == 0).all() and (dv[~km] == 0).all()


def test_public_api_fp64_is_exact():
    B, Hq, Hkv, C, P, d, idx, plens, clens = CASES["mixed_gqa4_d64"]
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens, dtype=torch.float64)
    truth = run(shared_prefix_attention_ref, t, pi, pm, km, go, scale=0.11)
    res = run(shared_prefix_attention, t, pi, pm, km, go, scale=0.11)
    for n in truth:
        assert_close(res[n], truth[n], 1e-12, n)


def test_prompt_gradient_is_sum_over_group():
    """dprefix_k of a prompt equals the sum of the per-row materialised-copy gradients (what stock TRL accumulates)."""
    B, Hq, Hkv, C, P, d = 5, 4, 2, 6, 9, 64
    idx = [1, 0, 1, 1, 0]
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, [9, 4], None, dtype=torch.float64)
    res = run(shared_prefix_attention, t, pi, pm, km, go, scale=0.125)
    for u in range(2):
        total = torch.zeros(Hkv, P, d, dtype=torch.float64)
        for b in (i for i, x in enumerate(idx) if x == u):
            one = {n: x[b : b + 1] if n in ("q", "k", "v") else x[u : u + 1] for n, x in t.items()}
            r = run(
                shared_prefix_attention_ref,
                one,
                torch.zeros(1, dtype=torch.int64),
                pm[u : u + 1],
                None,
                go[b : b + 1],
                scale=0.125,
            )
            total += r["dprefix_k"][0]
        assert_close(res["dprefix_k"][u], total, 1e-12, f"dprefix_k[{u}]")


@pytest.mark.parametrize("fn", [shared_prefix_attention, shared_prefix_attention_ref])
def test_no_leakage_between_completions(fn):
    B, Hq, Hkv, C, P, d, idx, plens, clens = CASES["mixed_gqa4_d64"]
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens)
    base = fn(*(t[n] for n in GRAD_NAMES), pi, pm, km, scale=0.1)
    j = 2  # shares prompt 2 with rows 0, 4, 6
    pert = dict(t)
    for n in ("q", "k", "v"):
        pert[n] = t[n].clone()
        pert[n][j] += 3.0
    out = fn(*(pert[n] for n in GRAD_NAMES), pi, pm, km, scale=0.1)
    others = [i for i in range(B) if i != j]
    assert torch.equal(out[others], base[others])
    assert not torch.allclose(out[j], base[j])
    # a prompt's padding and another prompt's keys never leak either
    pert = dict(t)
    pert["prefix_k"] = t["prefix_k"].clone()
    pert["prefix_k"][1] += 5.0  # only row 3 uses prompt 1
    pert["prefix_k"][0][:, ~pm[0]] += 5.0  # prompt 0 padding
    out = fn(*(pert[n] for n in GRAD_NAMES), pi, pm, km, scale=0.1)
    others = [i for i in range(B) if i != 3]
    assert torch.equal(out[others], base[others])
    assert not torch.allclose(out[3], base[3])


def test_rows_without_visible_keys_give_zero():
    """A fully padded prompt plus a padded first completion key: query 0 sees nothing → 0, finite gradients."""
    B, Hq, Hkv, C, P, d = 3, 4, 2, 4, 6, 64
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, [0, 1, 0], [0, 6], [4, 4, 4])
    km[0, 0] = False
    km[2, :2] = False
    truth = run(shared_prefix_attention_ref, t, pi, pm, km, go, dtype=torch.float64, scale=0.125)
    res = run(shared_prefix_attention, t, pi, pm, km, go, scale=0.125)
    assert (res["out"][0, :, 0] == 0).all() and (res["out"][2, :, :2] == 0).all()
    check_fp32_against_truth(res, truth)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_does_not_materialise_prompt_copies(backend):
    """No intermediate as large as prefix_k[prefix_index] (B·Hkv·P·d) in forward or backward."""
    B, Hq, Hkv, C, P, d = 16, 8, 2, 4, 64, 16
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, [0] * B, [50], None)
    per_row_copy = B * Hkv * P * d  # 32768 elements

    class MaxNumel(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    MaxNumel.largest = max(MaxNumel.largest, o.numel())
            return out

    leaves = [t[n].clone().requires_grad_(True) for n in GRAD_NAMES]
    with MaxNumel():
        if backend == "cpu":
            out = cpu_path(*leaves, pi, pm, km, scale=0.25)
        else:
            out = torch_path(*leaves, pi, pm, km, scale=0.25, chunk_elems=4096)
        out.backward(go)
    assert MaxNumel.largest < per_row_copy / 2, MaxNumel.largest
    with MaxNumel():  # the check itself sees the reference's copies
        MaxNumel.largest = 0
        shared_prefix_attention_ref(*leaves, pi, pm, km, scale=0.25)
    assert MaxNumel.largest >= per_row_copy


def test_saves_only_inputs_output_and_lse():
    B, Hq, Hkv, C, P, d, idx, plens, clens = CASES["mixed_gqa4_d64"]
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens)
    leaves = [t[n].clone().requires_grad_(True) for n in GRAD_NAMES]
    out = shared_prefix_attention(*leaves, pi, pm, km, scale=0.1)
    saved = out.grad_fn.saved_tensors
    inputs_bytes = sum(x.numel() * x.element_size() for x in leaves + [pi, pm, km])
    saved_bytes = sum(x.numel() * x.element_size() for x in saved if x is not None)
    assert saved_bytes == inputs_bytes + out.numel() * 4 + B * Hq * C * 4


def test_bad_input_raises():
    B, Hq, Hkv, C, P, d, idx, plens, clens = CASES["mixed_gqa4_d64"]
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens)
    args = [t[n] for n in GRAD_NAMES]
    with pytest.raises(ValueError, match="Hq=8.*Hkv=3"):
        k3 = torch.randn(B, 3, C, d)
        shared_prefix_attention(
            args[0], k3, k3, torch.randn(3, 3, P, d), torch.randn(3, 3, P, d), pi, pm, km, scale=0.1
        )
    with pytest.raises(ValueError, match="got 3"):
        shared_prefix_attention(*args, torch.tensor([0, 1, 2, 3, 0, 1, 2]), pm, km, scale=0.1)
    with pytest.raises(ValueError, match="got -1"):
        shared_prefix_attention(*args, torch.tensor([0, 1, 2, -1, 0, 1, 2]), pm, km, scale=0.1)
    with pytest.raises(ValueError, match=r"k must have shape"):
        shared_prefix_attention(args[0], args[1][:, :, :-1], args[2], *args[3:], pi, pm, km, scale=0.1)
    with pytest.raises(ValueError, match=r"prefix_mask must have shape"):
        shared_prefix_attention(*args, pi, pm[:, 1:], km, scale=0.1)
    with pytest.raises(TypeError, match="int64"):
        shared_prefix_attention(*args, pi.int(), pm, km, scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        shared_prefix_attention(*args, pi, pm, km, scale=-1.0)
    with pytest.raises(ValueError, match="backend"):
        shared_prefix_attention(*args, pi, pm, km, scale=0.1, backend="cuda")
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError, match="triton"):
            shared_prefix_attention(*args, pi, pm, km, scale=0.1, backend="triton")


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (TRITON_INTERPRET=1 runs them on CPU tensors)
# ----------------------------------------------------------------------------------------------------------------------

# Small shapes: the interpreter runs every program in numpy. fp32 tiles are 16 keys wide, so P=40 with 20+ padding
# positions skips a whole tile and crosses tile edges; C=19 crosses query-block edges.
TRITON_CASES = {
    "mixed_gqa4_d64": (5, 4, 1, 19, 40, 64, [1, 0, 1, 2, 1], [38, 13, 17], [19, 4, 19, 11, 1]),
    "g1_mha_d128": (2, 2, 2, 6, 20, 128, [1, 0], [20, 5], None),
    "c1_gqa8": (3, 8, 1, 1, 24, 64, [0, 0, 0], [9], None),
    # head dims 80 and 96 run as two head-dim tiles (64 + 16, 64 + 32)
    "gqa2_d80": (3, 4, 2, 7, 20, 80, [1, 0, 1], [20, 5], [7, 3, 6]),
    "gqa2_d96": (3, 4, 2, 7, 20, 96, [1, 0, 1], [20, 5], [7, 3, 6]),
}


def triton_path(*args, scale):
    return shared_prefix_attention(*args, scale=scale, backend="triton")


@pytest.mark.parametrize("case", list(TRITON_CASES))
@needs_interpreter
def test_triton_fp32_matches_torch_path(case):
    B, Hq, Hkv, C, P, d, idx, plens, clens = TRITON_CASES[case]
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens, seed=1)
    ref = run(torch_path, t, pi, pm, km, go, scale=d**-0.5)
    res = run(triton_path, t, pi, pm, km, go, scale=d**-0.5)
    assert_close(res["out"], ref["out"], 1e-5, "out")
    for n in GRAD_NAMES:
        want = ref["d" + n]
        assert_close(res["d" + n], want, 1e-5 * max(want.abs().max().item(), 1.0), "d" + n)


@needs_interpreter
def test_triton_rows_without_visible_keys():
    B, Hq, Hkv, C, P, d = 3, 2, 1, 4, 20, 64
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, [0, 1, 0], [0, 20], [4, 4, 4])
    km[0, 0] = False
    km[2, :2] = False
    ref = run(torch_path, t, pi, pm, km, go, scale=0.125)
    res = run(triton_path, t, pi, pm, km, go, scale=0.125)
    assert (res["out"][0, :, 0] == 0).all() and (res["out"][2, :, :2] == 0).all()
    for n in ref:
        assert_close(res[n], ref[n], 1e-5, n)


@pytest.mark.parametrize("case", ["mixed_gqa4_d64", "g1_mha_d128", "gqa2_d96"])
@needs_interpreter
def test_triton_bf16_error_within_twice_naive(case):
    """bf16 kernel error against an fp32 truth ≤ 2 × the naive bf16 reference's error (max over each tensor)."""
    B, Hq, Hkv, C, P, d, idx, plens, clens = TRITON_CASES[case]
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens, dtype=torch.bfloat16, seed=2)
    truth = run(shared_prefix_attention_ref, t, pi, pm, km, go, dtype=torch.float32, scale=d**-0.5)
    naive = run(shared_prefix_attention_ref, t, pi, pm, km, go, scale=d**-0.5)
    res = run(triton_path, t, pi, pm, km, go, scale=d**-0.5)
    for n in truth:
        assert res[n].dtype == torch.bfloat16
        err = (res[n].float() - truth[n]).abs().max().item()
        naive_err = (naive[n].float() - truth[n]).abs().max().item()
        assert err <= 2 * naive_err + 1e-6, f"{n}: triton bf16 error {err:.3e} > 2 × naive bf16 error {naive_err:.3e}"


@pytest.mark.parametrize("d", [64, 96])
@needs_interpreter
def test_triton_prompt_gradient_is_deterministic(d):
    """Prompt dK/dV are reduced without atomics in a fixed order: two runs agree bit for bit (with the work split over
    24 programs whose fp32 partial sums are added in order), with one head-dim tile (d=64) and with two (d=96)."""
    from grpo_mem.ops.attention_triton_launch import region_dkdv_grid

    B, Hq, Hkv, C, P, _, idx, plens, clens = TRITON_CASES["c1_gqa8"]  # 3 rows × 8 query heads share one prompt
    assert region_dkdv_grid(B, 1, Hkv, Hq // Hkv, C, P, d, torch.float32, 132)[2] == 24
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens, seed=3)
    a = run(triton_path, t, pi, pm, km, go, scale=0.125)
    b = run(triton_path, t, pi, pm, km, go, scale=0.125)
    assert torch.equal(a["dprefix_k"], b["dprefix_k"]) and torch.equal(a["dprefix_v"], b["dprefix_v"])


def _transformers_layout(B, Hq, Hkv, C, P, d, U, dtype, seed=0):
    """Leaves in transformers' layout: q/k/v are (B, C, H, d) projections seen as (B, H, C, d) through ``transpose``,
    the prompt K/V likewise (U, P, Hkv, d) transposed, and the output gradient too (what ``out.transpose(1, 2)
    .contiguous()`` sends back). Returns (leaves, views, grad_out view)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (B, C, Hq, d),
        "k": (B, C, Hkv, d),
        "v": (B, C, Hkv, d),
        "prefix_k": (U, P, Hkv, d),
        "prefix_v": (U, P, Hkv, d),
    }
    leaves = {n: torch.randn(*sh, generator=g).to(dtype).requires_grad_(True) for n, sh in shapes.items()}
    views = {n: x.transpose(1, 2) for n, x in leaves.items()}
    return leaves, views, torch.randn(B, C, Hq, d, generator=g).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_interpreter
def test_triton_layer_call_has_no_host_sync_and_no_copies(monkeypatch, dtype):
    """One attention call (forward + backward) on transformers' transposed q/k/v/prompt K/V: no host synchronisation
    (.item(), int(tensor), bincount, ...), no copy of an input and no input-sized temporary (the old D = rowsum(dO ∘ O)
    built two fp32 (B, Hq, C, d) tensors). Python-level reads (tolist, numpy) are patched to count as well. Results
    equal the torch path's in fp32."""
    B, Hq, Hkv, C, P, d, U = 4, 4, 2, 8, 16, 32, 2
    leaves, views, go = _transformers_layout(B, Hq, Hkv, C, P, d, U, dtype)
    pi = torch.tensor([1, 0, 1, 1])
    pm = torch.arange(P)[None, :] >= torch.tensor([[3], [0]])
    km = torch.arange(C)[None, :] < torch.tensor([[8], [5], [8], [2]])
    py_reads = []
    for meth in ("tolist", "numpy", "__array__"):
        orig = getattr(torch.Tensor, meth)
        monkeypatch.setattr(
            torch.Tensor, meth, lambda self, *a, _o=orig, _m=meth, **k: (py_reads.append(_m), _o(self, *a, **k))[1]
        )
    big = min(x.numel() for x in views.values()) // 4  # the (B, Hq, C) LSE and the masks stay below
    with HostSyncsAndCopies(big) as mode:
        out = triton_path(*(views[n] for n in GRAD_NAMES), pi, pm, km, scale=d**-0.5)
        grads = torch.autograd.grad(out, [leaves[n] for n in GRAD_NAMES], go)
    assert mode.syncs == [] and py_reads == [], (mode.syncs, py_reads)
    assert mode.copies == [], mode.copies
    assert out.transpose(1, 2).is_contiguous()  # the model glue's out.transpose(1, 2).contiguous() copies nothing
    if dtype == torch.float32:
        t = {n: x.detach() for n, x in views.items()}
        ref = run(torch_path, t, pi, pm, km, go.detach(), scale=d**-0.5)
        assert_close(out.detach(), ref["out"], 1e-5, "out")
        for n, gr in zip(GRAD_NAMES, grads):
            want = ref["d" + n]
            assert_close(gr.transpose(1, 2), want, 1e-5 * max(want.abs().max().item(), 1.0), "d" + n)


@needs_interpreter
def test_triton_batch_offsets_past_int32():
    """Batch and prompt strides of 2**30 + 64 elements: row 2's and prompt 2's data start past 2**31 elements, where an
    int32 ``b * stride`` wraps. The tensors are views into one sparse anonymous mapping (8 GiB of address space, a few
    pages touched); results must equal the torch path on compact copies."""
    import mmap

    B, Hq, Hkv, C, P, d = 3, 2, 1, 5, 8, 16  # three rows, three prompts
    SB = 2**30 + 64
    buf = mmap.mmap(-1, (2 * SB + 2048) * 4)
    base = torch.frombuffer(buf, dtype=torch.float32)
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, [2, 0, 1], [8, 3, 6], [5, 2, 4], seed=4)
    offsets = {"q": 0, "k": 256, "v": 512, "prefix_k": 768, "prefix_v": 1024}
    far = {}
    for n, x in t.items():
        inner = (x.shape[2] * d, d, 1)
        far[n] = torch.as_strided(base, x.shape, (SB, *inner), offsets[n])
        far[n].copy_(x)
    assert far["q"][2].data_ptr() - base.data_ptr() >= 2**31 * 4
    ref = run(torch_path, t, pi, pm, km, go, scale=0.25)
    res = run(triton_path, far, pi, pm, km, go, scale=0.25)
    assert_close(res["out"], ref["out"], 1e-5, "out")
    for n in GRAD_NAMES:
        want = ref["d" + n]
        assert_close(res["d" + n], want, 1e-5 * max(want.abs().max().item(), 1.0), "d" + n)
    del far, base
    buf.close()


# ----------------------------------------------------------------------------------------------------------------------
# GPU-path defects caught without a GPU: launches stubbed out, so these run in the main process
# ----------------------------------------------------------------------------------------------------------------------


def _run_triton_launchers(t, pi, pm, km, go, scale=0.125):
    """Call the Triton forward and backward launchers directly (no backend check), as the autograd node does."""
    from grpo_mem.ops.attention import BACKENDS

    fwd, bwd = BACKENDS["triton"]
    params = MultiRegionAttentionParams(scale=scale, backend="triton")
    regions = [(t["prefix_k"], t["prefix_v"], pi, pm)]
    out, lse = fwd(t["q"], t["k"], t["v"], regions, km, params)
    return bwd(go, t["q"], t["k"], t["v"], regions, km, out, lse, params)


def test_launch_device_helper():
    """CUDA tensors get ``torch.cuda.device(their device)`` (made without touching CUDA); others a null context."""
    import types
    from contextlib import nullcontext

    from grpo_mem.ops._device import launch_device

    ctx = launch_device(types.SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1
    assert isinstance(launch_device(torch.zeros(1)), nullcontext)
    assert isinstance(launch_device(torch.zeros(1, device="meta")), nullcontext)


def test_every_kernel_launch_enters_the_tensor_device(monkeypatch):
    """device_map over several GPUs: Triton launches on the current device, so each launch must run inside
    ``launch_device`` of the op's tensors (here recorded; a GPU is not needed to see which context was active)."""
    rec = LaunchRecorder(monkeypatch)
    B, Hq, Hkv, C, P, d, idx, plens, clens = CASES["mixed_gqa4_d64"]
    t, pi, pm, km, go = make_inputs(B, Hq, Hkv, C, P, d, idx, plens, clens)
    _run_triton_launchers(t, pi, pm, km, go)
    assert {name for name, _, _ in rec.launches} >= {"fwd", "bwd_dq", "bwd_dkdv_own", "bwd_dkdv_region"}
    for name, grid, active in rec.launches:
        assert active == [t["q"].device], f"{name} launched under {active}, not launch_device(q)"


# (name, B, U, Hq, Hkv, C, P, d): one group of G completions per prompt unless U > 1
REALISTIC = [
    ("qwen2.5-1.5b", 8, 1, 12, 2, 2048, 512, 128),  # 16 programs before the split
    ("qwen2.5-1.5b-4prompts", 16, 4, 12, 2, 1024, 256, 128),
    ("llama-3-8b-long-prompt", 16, 1, 32, 8, 256, 5000, 128),
    ("gemma-2-2b", 8, 1, 8, 4, 1024, 512, 256),
    ("smollm2-135m", 8, 1, 9, 3, 256, 128, 64),
]


@pytest.mark.parametrize("name, B, U, Hq, Hkv, C, P, d", REALISTIC, ids=[r[0] for r in REALISTIC])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_region_dkdv_grid_fills_an_h100(name, B, U, Hq, Hkv, C, P, d, dtype):
    """The prompt dK/dV launch has at least 2 programs per SM of a 132-SM H100, and its fp32 partial buffers stay
    within the documented bound."""
    from grpo_mem.ops.attention_triton_launch import region_dkdv_grid
    from grpo_mem.ops.attention_triton_tiles import block_config

    grid = region_dkdv_grid(B, U, Hkv, Hq // Hkv, C, P, d, dtype, sm_count=132)
    programs = grid[0] * grid[1] * grid[2]
    assert programs >= 2 * 132, (grid, programs)
    if grid[2] > 1:
        block_n = block_config("bwd_dkdv_region", d, dtype)["BLOCK_N"]
        assert grid[2] * U * Hkv * P * d <= 2 * (2 * 132) * block_n * d


def test_region_dkdv_launch_is_split_and_reduced(monkeypatch):
    """The launcher uses that grid: for the Qwen2.5-1.5B shape (meta tensors, kernels stubbed) the prompt dK/dV kernel
    runs on >= 264 programs and the reduction follows it."""
    rec = LaunchRecorder(monkeypatch)
    _run_triton_launchers(*_meta_inputs(*REALISTIC[0][1:]))
    names = [name for name, _, _ in rec.launches]
    assert names == ["fwd", "bwd_delta", "bwd_dq", "bwd_dkdv_own", "bwd_dkdv_region", "bwd_region_reduce"]
    grid = rec.launches[4][1]
    assert grid[0] * grid[1] * grid[2] >= 2 * 132, grid


def _meta_inputs(B, U, Hq, Hkv, C, P, d, dtype=torch.bfloat16):
    """Inputs of ``_run_triton_launchers`` as meta tensors (no memory): q/k/v and the gradient in transformers'
    transposed layout, one region of U prompts of P keys."""
    meta = dict(device="meta", dtype=dtype)
    t = {
        "q": torch.empty(B, C, Hq, d, **meta).transpose(1, 2),
        "k": torch.empty(B, C, Hkv, d, **meta).transpose(1, 2),
        "v": torch.empty(B, C, Hkv, d, **meta).transpose(1, 2),
        "prefix_k": torch.empty(U, P, Hkv, d, **meta).transpose(1, 2),
        "prefix_v": torch.empty(U, P, Hkv, d, **meta).transpose(1, 2),
    }
    pi = torch.zeros(B, dtype=torch.int64, device="meta")
    pm = torch.empty(U, P, dtype=torch.bool, device="meta")
    km = torch.empty(B, C, dtype=torch.bool, device="meta")
    go = torch.empty(B, C, Hq, d, **meta).transpose(1, 2)
    return t, pi, pm, km, go


@pytest.mark.parametrize("capability, block_n", [((8, 0), 32), ((8, 6), 16), ((8, 9), 16), ((9, 0), 32), (None, 32)])
def test_tiles_follow_the_device_capability(monkeypatch, capability, block_n):
    """The launchers take the tiles of the GPU the tensors are on (its compute capability, read at launch): bwd_dq in
    bf16 at d=256 needs 102400 B of shared memory with its 64×32 tiles, over the 101376 B a block gets on sm_86/sm_89
    (A10G, L4, L40S: Triton raises OutOfResources there), so it runs 64×16 tiles there (83968 B) and keeps 64×32 on
    sm_80/sm_90 and under the interpreter (capability None). The other kernels keep their tiles; every launch carries
    the tiles, warps and stages of block_config for that capability."""
    from grpo_mem.ops import attention_triton as kernels
    from grpo_mem.ops import attention_triton_launch as launch
    from grpo_mem.ops.attention_triton_tiles import block_config

    launches = {}
    record = lambda name, grid, args, kwargs: launches.setdefault(name, kwargs)  # noqa: E731
    monkeypatch.setattr(kernels, "KERNELS", {n: FakeKernel(n, record) for n in kernels.KERNELS})
    seen = []
    monkeypatch.setattr(launch, "_capability", lambda device: seen.append(device) or capability)
    _run_triton_launchers(*_meta_inputs(8, 1, 8, 4, 64, 48, 256))
    assert seen and all(dev.type == "meta" for dev in seen)
    assert launches["bwd_dq"]["BLOCK_N"] == block_n and launches["bwd_dq"]["BLOCK_M"] == 64
    for name, kwargs in launches.items():
        cfg = block_config(name, 256, torch.bfloat16, capability=capability)
        assert (kwargs["num_warps"], kwargs["num_stages"]) == (cfg["num_warps"], cfg["num_stages"]), name
        if "BLOCK_N" in kwargs and name != "bwd_delta":
            assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"]) == (cfg["BLOCK_M"], cfg["BLOCK_N"]), name
        if name != "bwd_dq":
            assert cfg == block_config(name, 256, torch.bfloat16), f"{name} changed its tiles on {capability}"


def test_tiles_follow_the_triton_release(monkeypatch):
    """Triton releases before 3.9 (the GPU image's 3.6.0) spilled with some sm_8x tiles that 3.9 builds without
    spilling: block_config takes other tiles for them there (sm_80, sm_86, sm_89 only; sm_90 and the interpreter keep
    theirs)."""
    from grpo_mem.ops import attention_triton_tiles as tiles

    for old in (False, True):
        monkeypatch.setattr(tiles, "_OLD_TRITON", old)
        sm80 = tiles.block_config("bwd_dkdv_own", 64, capability=(8, 0))
        assert (sm80["BLOCK_M"], sm80["BLOCK_N"]) == ((32, 32) if old else (32, 64))
        assert tiles.block_config("bwd_dq", 96, torch.float32, capability=(8, 6))["num_warps"] == (4 if old else 8)
        for capability in ((9, 0), None):
            assert tiles.block_config("bwd_dkdv_own", 64, capability=capability)["BLOCK_N"] == 64


def test_capability_of_a_tensor_device():
    """CUDA devices report their compute capability; the interpreter's and meta tensors get None (the default tiles)."""
    from grpo_mem.ops.attention_triton_launch import _capability

    assert _capability(torch.device("cpu")) is None and _capability(torch.device("meta")) is None


@pytest.mark.parametrize(
    "B, U, Hq, Hkv, what",
    [
        (16384, 1, 4, 4, "16384·4 = 65536"),  # forward: B·Hkv on grid axis y
        (8192, 1, 8, 1, "8192·8 = 65536"),  # backward only: the delta kernel's B·Hq
        (2, 65536, 2, 1, "65536·1 = 65536"),  # backward only: the region dK/dV kernel's U·Hkv
    ],
)
def test_grid_rows_over_cuda_limit_are_refused(monkeypatch, B, U, Hq, Hkv, what):
    """The kernels put (batch entry, head) pairs on grid axis y, where CUDA allows 65535 programs: more raise a
    ValueError naming the sizes before any launch (a bare "invalid argument" from the driver otherwise); 65535 pass."""
    rec = LaunchRecorder(monkeypatch)
    t, pi, pm, km, go = _meta_inputs(B, U, Hq, Hkv, 1, 16, 16)
    with pytest.raises(ValueError, match=rf"{what} rows, over CUDA's grid limit of 65535 on axis y"):
        _run_triton_launchers(t, pi, pm, km, go)
    assert B * Hkv > 65535 or {name for name, _, _ in rec.launches} == {"fwd"}
    rec.launches.clear()
    t, pi, pm, km, go = _meta_inputs(65535 // Hq, min(U, 65535), Hq, Hkv, 1, 16, 16)
    _run_triton_launchers(t, pi, pm, km, go)
    assert max(grid[i] for _, grid, _ in rec.launches for i in (1, 2) if i < len(grid)) <= 65535
    assert {"fwd", "bwd_delta", "bwd_dq", "bwd_dkdv_own", "bwd_dkdv_region"} <= {n for n, _, _ in rec.launches}

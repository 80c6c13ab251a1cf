"""The CUDA library-kernel backends without a GPU: their device-agnostic mechanisms on CPU against the fp64 truth,
their CUDA calls on meta tensors, and the measured table ``auto`` reads on CUDA.

- ``sdpa`` (``grpo_mem.ops.attention_sdpa``): the mechanism (a region packed into varlen sequences, unpacked, merged
  by log-sum-exp; each call's backward given the merged output and log-sum-exp) on ATen's CPU flash kernels plugged
  in as a ``FusedKernels`` set with FlashAttention-2's conventions: rows and keys outside every sequence hold NaN, a
  sequence without keys gives LSE +inf, a fully masked row holds NaN. Criteria: fp32 within 1e-5 (outputs) and
  1e-4 x max|truth| (gradients) of the fp64 truth; bf16 within 2x the naive bf16 reference's error
  (tests/ops/test_multi_region_attention.py's).
- its CUDA kernel set (``CUDA_KERNELS``) on meta tensors: ATen's meta kernels return what the CUDA kernels return
  (FlashAttention varlen LSE (Hq, T), dense (B, H, L); memory-efficient (B, H, L padded to 32)), so every argument
  list and layout of the CUDA-only lines runs here; meta tensors cannot be read back, so the run also shows that the
  mechanism makes no host read.
- ``cublas`` (``grpo_mem.ops.logprobs_cublas``): the chunk loop with the torch backend's tile functions against the
  fp64 truth (Cut Cross-Entropy's bound, as tests/ops/test_logprobs.py); its Triton kernels run under the
  interpreter in test_logprobs.py, its CUDA GEMMs in test_triton_cuda.py (the GPU check's kernels phase).
- ``_op_times``: shape classes, reading the table, ``resolve``'s measured order on (stand-in) CUDA tensors; the
  writer ``grpo_mem.bench.op_times`` with CPU backends.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import attention_inputs, check_fp32_against_truth
from test_logprobs import TOL, assert_bound, make_inputs
from test_multi_region_attention import (
    CASES,
    _check_zero_grads,
    _only_region_keys_inputs,
    check_bf16_against_truth,
    run,
)

from grpo_mem.ops import _backends, _op_times, attention, attention_sdpa, logprobs_cublas, multi_region_attention_ref
from grpo_mem.ops.attention import MultiRegionAttentionFunction, MultiRegionAttentionParams
from grpo_mem.ops.logprobs import LinearLogprobsFunction, _targets, linear_logprobs_ref
from grpo_mem.ops.logprobs_cpp import LogprobParams
from grpo_mem.ops.logprobs_torch import _fold_tile_torch, _grad_tile_torch

ATEN = torch.ops.aten
NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------------------------------------------------------------
# sdpa: the mechanism on ATen's CPU flash kernels with FlashAttention-2's conventions
# ----------------------------------------------------------------------------------------------------------------------


def _sequences(cu_q, cu_k, max_q, max_k):
    """(q0, q1, k0, k1) of each varlen sequence; checks the offsets as FlashAttention takes them."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape and cu_q.is_contiguous()
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for i in range(len(qs) - 1):
        assert 0 <= qs[i + 1] - qs[i] <= max_q and 0 <= ks[i + 1] - ks[i] <= max_k, (qs, ks, max_q, max_k)
        yield qs[i], qs[i + 1], ks[i], ks[i + 1]


def _bhld(x):
    """(T, H, d) -> (1, H, T, d)."""
    return x.transpose(0, 1)[None]


def _cpu_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    out = torch.full_like(q, NAN)
    lse = torch.full((q.shape[1], q.shape[0]), NAN)
    for q0, q1, k0, k1 in _sequences(cu_q, cu_k, max_q, max_k):
        if q1 == q0:
            continue
        if k1 == k0:  # FlashAttention-2: zero output, LSE +inf
            out[q0:q1], lse[:, q0:q1] = 0, INF
            continue
        o, l = ATEN._scaled_dot_product_flash_attention_for_cpu(
            _bhld(q[q0:q1]), _bhld(k[k0:k1]), _bhld(v[k0:k1]), 0.0, False, scale=scale
        )
        out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1), l[0].float()
    return out, lse


def _cpu_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale):
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and torch.isfinite(lse).all()
    dq, dk, dv = torch.full_like(q, NAN), torch.full_like(k, NAN), torch.full_like(v, NAN)
    for q0, q1, k0, k1 in _sequences(cu_q, cu_k, max_q, max_k):
        if q1 == q0:  # FlashAttention-2 writes zeros for keys no query reads
            dk[k0:k1], dv[k0:k1] = 0, 0
            continue
        if k1 == k0:
            dq[q0:q1] = 0
            continue
        g = ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            *(_bhld(x[q0:q1]) for x in (dout, q)),
            *(_bhld(x[k0:k1]) for x in (k, v)),
            _bhld(out[q0:q1]),
            lse[None, :, q0:q1].contiguous(),
            0.0,
            False,
            scale=scale,
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (x[0].transpose(0, 1) for x in g)
    return dq, dk, dv


def _cpu_causal_fwd(q, k, v, scale):
    o, lse = ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return o, lse.float()


def _cpu_causal_bwd(dout, q, k, v, out, lse, scale):
    return ATEN._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, True, scale=scale)


def _cpu_masked_fwd(q, k, v, bias, scale):
    assert bias.dtype == q.dtype and bias.shape == (q.shape[0], 1, q.shape[2], k.shape[2])
    o, lse = ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    empty = torch.isinf(bias).all(-1)  # (B, 1, L): rows that see no key hold any values: NaN here
    return o.masked_fill(empty[..., None], NAN), lse.float().masked_fill(empty, NAN)


def _cpu_masked_bwd(dout, q, k, v, out, lse, bias, scale):
    assert torch.isfinite(lse).all()
    return ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
    )


CPU_FLASH = attention_sdpa.FusedKernels(
    _cpu_varlen_fwd, _cpu_varlen_bwd, _cpu_causal_fwd, _cpu_causal_bwd, _cpu_masked_fwd, _cpu_masked_bwd
)
"""ATen's CPU flash kernels with FlashAttention-2's conventions (see the module docstring)."""


@pytest.fixture
def sdpa_on_cpu(monkeypatch):
    """``multi_region_attention`` through its autograd Function with the sdpa backend's mechanism on ``CPU_FLASH``."""

    def fwd(q, k, v, regions, key_mask, params, positions=None):
        return attention_sdpa.fused_fwd(CPU_FLASH, q, k, v, regions, key_mask, params.scale)

    def bwd(dout, q, k, v, regions, key_mask, out, lse, params, positions=None):
        return attention_sdpa.fused_bwd(CPU_FLASH, dout, q, k, v, regions, key_mask, out, lse, params.scale)

    monkeypatch.setitem(attention.BACKENDS, "sdpa", (fwd, bwd))

    def call(q, k, v, regions, key_mask, *, scale, sinks=None):
        params = MultiRegionAttentionParams(scale=scale, backend="sdpa", has_sinks=sinks is not None)
        tensors = [x for r in regions for x in r] + ([sinks] if sinks is not None else [])
        return MultiRegionAttentionFunction.apply(q, k, v, key_mask, params, *tensors)

    return call


def _case(case, dtype=torch.float32, seed=0, no_key_mask=False):
    if case == "only_region_keys":
        t, meta, km, go = _only_region_keys_inputs(dtype, seed + 5)
        return t, meta, km, go, 64
    B, Hq, Hkv, C, d, regions, clens = CASES[case]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens, dtype=dtype, seed=seed)
    return t, meta, None if no_key_mask else km, go, d


SDPA_CASES = [(c, False) for c in [*CASES, "only_region_keys"]] + [(c, True) for c in ("r1_gqa4", "r3_mixed")]


@pytest.mark.parametrize("case,no_key_mask", SDPA_CASES, ids=[f"{c}{'-causal' if n else ''}" for c, n in SDPA_CASES])
def test_sdpa_mechanism_fp32_matches_truth(sdpa_on_cpu, case, no_key_mask):
    """fp32 outputs and every gradient within the fp32 bounds; padded keys, unread entries and masked own keys get
    exactly 0; with ``key_mask=None`` the own region is the dense causal call."""
    t, meta, km, go, d = _case(case, no_key_mask=no_key_mask)
    truth = run(multi_region_attention_ref, t, meta, km, go, dtype=torch.float64, scale=d**-0.5)
    res = run(sdpa_on_cpu, t, meta, km, go, scale=d**-0.5)
    check_fp32_against_truth(res, truth)
    _check_zero_grads(res, meta, km)


@pytest.mark.parametrize("case,no_key_mask", [("r1_gqa4", False), ("r3_mixed", False), ("r3_mixed", True)])
def test_sdpa_mechanism_bf16_within_twice_naive(sdpa_on_cpu, case, no_key_mask):
    t, meta, km, go, d = _case(case, torch.bfloat16, seed=2, no_key_mask=no_key_mask)
    truth = run(multi_region_attention_ref, t, meta, km, go, dtype=torch.float32, scale=d**-0.5)
    naive = run(multi_region_attention_ref, t, meta, km, go, scale=d**-0.5)
    check_bf16_against_truth(run(sdpa_on_cpu, t, meta, km, go, scale=d**-0.5), truth, naive)


def test_sdpa_mechanism_with_sinks(sdpa_on_cpu):
    """Sinks merge into the mechanism's output and LSE like any backend's (``attention._add_sinks``): the output and
    every gradient, the sinks' included, within the fp32 bounds."""
    t, meta, km, go, d = _case("r3_mixed")
    sinks = torch.randn(t["q"].shape[1], generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def result(fn, dtype):
        leaves = {n: x.detach().to(dtype).requires_grad_() for n, x in [*t.items(), ("sinks", sinks)]}
        regions = [(leaves[f"rk{i}"], leaves[f"rv{i}"], idx, mask) for i, (idx, mask) in enumerate(meta)]
        out = fn(leaves["q"], leaves["k"], leaves["v"], regions, km, scale=d**-0.5, sinks=leaves["sinks"])
        grads = torch.autograd.grad(out, list(leaves.values()), go.to(dtype))
        return {"out": out.detach(), **{"d" + n: g for n, g in zip(leaves, grads)}}

    check_fp32_against_truth(result(sdpa_on_cpu, torch.float32), result(multi_region_attention_ref, torch.float64))


def test_region_plan_packs_every_entry_in_one_sequence():
    """Rows sorted by entry (rows reading nothing last), real keys first in entry order, offsets per entry, validity
    and the keys that get gradients; an entry without real keys and one nobody reads."""
    index = torch.tensor([2, -1, 0, 2, 0, 3])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [0, 0, 0]], dtype=torch.bool)
    plan = attention_sdpa.region_plan(index, mask, C=2)
    assert plan.rows.tolist() == [2, 4, 0, 3, 5, 1]
    assert plan.cu_q.tolist() == [0, 4, 4, 8, 10] and plan.cu_q.dtype == torch.int32
    assert plan.cu_k.tolist() == [0, 2, 5, 7, 7] and plan.cu_k.dtype == torch.int32
    real = list(zip(plan.key_u.tolist(), plan.key_s.tolist()))[:7]
    assert real == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 1), (2, 2)]
    assert plan.valid.tolist() == [True, False, True, True, True, False]
    assert plan.keep.tolist() == [[1, 1, 0], [0, 0, 0], [0, 1, 1], [0, 0, 0]]
    assert (plan.max_q, plan.max_k) == (12, 3)


# ----------------------------------------------------------------------------------------------------------------------
# sdpa: the CUDA kernel set on meta tensors (the CUDA-only lines' argument lists and layouts)
# ----------------------------------------------------------------------------------------------------------------------


def _meta_inputs(dtype=torch.bfloat16, B=3, Hq=8, Hkv=2, C=5, d=64, regions=((2, 7), (3, 4))):
    q = torch.empty(B, Hq, C, d, device="meta", dtype=dtype)
    k, v = (torch.empty(B, Hkv, C, d, device="meta", dtype=dtype) for _ in range(2))
    regs = [
        (
            torch.empty(U, Hkv, S, d, device="meta", dtype=dtype),
            torch.empty(U, Hkv, S, d, device="meta", dtype=dtype),
            torch.empty(B, device="meta", dtype=torch.int64),
            torch.empty(U, S, device="meta", dtype=torch.bool),
        )
        for U, S in regions
    ]
    return q, k, v, regs, torch.empty(B, C, device="meta", dtype=torch.bool)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "masked"])
def test_cuda_kernel_set_runs_on_meta_tensors(padded):
    """fused_fwd / fused_bwd with ``CUDA_KERNELS`` on meta tensors: ATen's meta kernels of
    ``_flash_attention_forward/_backward`` (varlen), ``_scaled_dot_product_flash_attention(_backward)`` (dense causal)
    and ``_scaled_dot_product_efficient_attention(_backward)`` (bias) take the arguments as written and return the
    shapes the mechanism expects; nothing is read back (meta tensors have no values)."""
    q, k, v, regions, key_mask = _meta_inputs()
    km = key_mask if padded else None
    out, lse = attention_sdpa.fused_fwd(attention_sdpa.CUDA_KERNELS, q, k, v, regions, km, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    dq, dk, dv, dregions = attention_sdpa.fused_bwd(
        attention_sdpa.CUDA_KERNELS, torch.empty_like(q), q, k, v, regions, km, out, lse, 0.125
    )
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for (rk, rv, _, _), (drk, drv) in zip(regions, dregions):
        assert drk.shape == rk.shape and drv.shape == rv.shape and drk.dtype == rk.dtype


def test_cuda_kernels_return_flash_and_efficient_layouts():
    """Each CUDA kernel's output layout on meta tensors: varlen LSE (Hq, T); dense LSE (B, H, L); the efficient
    kernel's LSE padded to 32 queries and cut back; its bias rows 16-element aligned and expanded over heads."""
    K = attention_sdpa.CUDA_KERNELS
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(10, 8, 64, **meta), torch.empty(14, 2, 64, **meta)
    cu = torch.empty(4, device="meta", dtype=torch.int32)
    out, lse = K.varlen_fwd(q, k, k, cu, cu, 10, 7, 0.1)
    assert out.shape == q.shape and lse.shape == (8, 10) and lse.dtype == torch.float32
    assert [g.shape for g in K.varlen_bwd(q, q, k, k, out, lse, cu, cu, 10, 7, 0.1)] == [q.shape, k.shape, k.shape]
    q, k = torch.empty(2, 8, 5, 64, **meta), torch.empty(2, 2, 5, 64, **meta)
    out, lse = K.causal_fwd(q, k, k, 0.1)
    assert out.shape == q.shape and lse.shape == (2, 8, 5)
    assert [g.shape for g in K.causal_bwd(q, q, k, k, out, lse, 0.1)] == [q.shape, k.shape, k.shape]
    q, k = torch.empty(2, 2, 40, 64, **meta), torch.empty(2, 2, 5, 64, **meta)
    bias = torch.empty(2, 1, 40, 5, **meta)
    out, lse = K.masked_fwd(q, k, k, bias, 0.1)
    assert out.shape == q.shape and lse.shape == (2, 2, 40)
    assert [g.shape for g in K.masked_bwd(q, q, k, k, out, lse, bias, 0.1)] == [q.shape, k.shape, k.shape]
    aligned = attention_sdpa._aligned_bias(torch.zeros(2, 1, 3, 5), 4)
    assert aligned.shape == (2, 4, 3, 5) and aligned.stride() == (48, 0, 16, 1)
    assert attention_sdpa._bmhk(torch.zeros(2, 3, 4, 5)).transpose(1, 2).is_contiguous()


def test_sdpa_refuses_features_it_lacks():
    q, k, v, regions, key_mask = _meta_inputs()
    for kw in (dict(softcap=30.0), dict(sliding_window=4)):
        params = MultiRegionAttentionParams(scale=0.1, backend="sdpa", **kw)
        with pytest.raises(ValueError, match="sdpa backend computes neither"):
            attention_sdpa.multi_region_attention_fwd(q, k, v, regions, key_mask, params)


# ----------------------------------------------------------------------------------------------------------------------
# cublas: the chunk loop with the torch backend's tile functions
# ----------------------------------------------------------------------------------------------------------------------


def _torch_stats(a, target, v0, p, m, s, sz, zy):
    m.fill_(-INF), s.zero_(), sz.zero_(), zy.zero_()
    _fold_tile_torch(a, target, v0, m, s, sz, zy, p, p.return_entropy)


def _torch_grad(a, target, v0, lse, ent, g_lp, g_ent, logp, p, out):
    out.copy_(_grad_tile_torch(a.clone(), target, v0, lse, ent, g_lp, g_ent, p))


TORCH_TILES = logprobs_cublas.HeadKernels(logprobs_cublas.gemm_f32, _torch_stats, _torch_grad)


@pytest.fixture
def cublas_on_cpu(monkeypatch):
    """``linear_logprobs`` through its autograd Function with the cublas chunk loop on ``TORCH_TILES`` (chunks of 97
    columns: every boundary of the test vocabulary crossed)."""

    def fwd(hidden, weight, bias, target, p):
        return logprobs_cublas.chunked_fwd(TORCH_TILES, hidden, weight, bias, target, p, 97)

    def bwd(hidden, weight, bias, target, lse, ent, g_lp, g_ent, p, need_dh, need_dw, need_db, logp):
        grads = (lse, ent, g_lp, g_ent, logp)
        return logprobs_cublas.chunked_bwd(
            TORCH_TILES, hidden, weight, bias, target, grads, p, (need_dh, need_dw, need_db), 97
        )

    from grpo_mem.ops import logprobs

    monkeypatch.setitem(logprobs.LINEAR_BACKENDS, "cublas", (fwd, bwd))

    def call(hidden, weight, index, *, bias=None, return_entropy=True, temperature=1.0, logit_scale=1.0, softcap=None):
        params = LogprobParams(temperature, logit_scale, softcap, return_entropy, "cublas")
        return LinearLogprobsFunction.apply(hidden, weight, bias, _targets(index, weight.shape[0], -100), params)

    return call


HEAD_CASES = {
    "plain": ({}, {}),
    "softcap-scale": (dict(softcap=4.0, logit_scale=1.5, temperature=0.7), {}),
    "bias-ignored": (dict(temperature=0.9), dict(bias=True, ignore_every=5)),
    "confident": ({}, dict(confident=20)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(HEAD_CASES))
def test_cublas_chunk_loop_matches_truth(cublas_on_cpu, case, dtype):
    """log-probs, entropies and every gradient within |naive - truth| + tol of the fp64 truth (N=61, H=33, V=403:
    five chunks of 97 columns and a remainder)."""
    kw, spec = HEAD_CASES[case]
    tensors, index = make_inputs(61, 33, 403, dtype, **spec)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = (torch.randn(61, generator=g, dtype=torch.float64) for _ in range(2))

    def go(fn, xs):
        leaves = [None if x is None else x.detach().clone().requires_grad_() for x in xs]
        hidden, weight, bias = leaves
        logp, ent = fn(hidden, weight, index, bias=bias, return_entropy=True, **kw)
        loss = (logp.double() * g_lp).sum() + (ent.double() * g_ent).sum()
        return [logp, ent, *torch.autograd.grad(loss, [x for x in leaves if x is not None])]

    truth = go(linear_logprobs_ref, [None if x is None else x.double() for x in tensors])
    naive = go(linear_logprobs_ref, tensors)
    ours = go(cublas_on_cpu, tensors)
    for name, o, n, t in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), ours, naive, truth):
        assert o.dtype == (torch.float32 if name in ("logp", "entropy") else dtype), name
        tol = TOL[dtype] * (1.0 if name in ("logp", "entropy") else max(1.0, t.abs().max().item()))
        assert_bound(f"cublas/{case}/{name}", o, n, t, tol)


def test_vocab_chunk_stays_within_the_memory_budget():
    """On CUDA: the widest multiple of 128 columns whose fp32 logits fit CHUNK_BYTES, at least MIN_CHUNK, at most V;
    CPU tensors (the interpreter) take INTERPRET_CHUNK."""
    cuda = torch.device("cuda")
    for n_tok in (1, 2048, 32768, 10**6):
        chunk = logprobs_cublas.vocab_chunk(n_tok, 151936, cuda)
        assert chunk % 128 == 0 and logprobs_cublas.MIN_CHUNK <= chunk <= 151936
        assert 4 * n_tok * chunk <= logprobs_cublas.CHUNK_BYTES or chunk == logprobs_cublas.MIN_CHUNK
    assert logprobs_cublas.vocab_chunk(2048, 151936, cuda) == 65536
    assert logprobs_cublas.vocab_chunk(4, 300, cuda) == 300
    assert logprobs_cublas.vocab_chunk(4, 300, torch.device("cpu")) == logprobs_cublas.INTERPRET_CHUNK


def test_gemm_f32_on_meta_takes_cublas_out_dtype():
    """The CUDA branch's ``torch.mm(..., out_dtype=fp32)`` of bf16 operands, by its schema (``aten::mm.dtype``)."""
    a = torch.empty(3, 4, device="meta", dtype=torch.bfloat16)
    b = torch.empty(4, 5, device="meta", dtype=torch.bfloat16)
    assert torch.mm(a, b, out_dtype=torch.float32).dtype == torch.float32
    exact = torch.tensor([[1.0 + 2**-7]], dtype=torch.bfloat16)  # its square is not a bf16 value
    assert logprobs_cublas.gemm_f32(exact, exact).item() == (1.0 + 2**-7) ** 2


# ----------------------------------------------------------------------------------------------------------------------
# the measured table: shape classes, reading, resolve's order on CUDA; the writer on CPU
# ----------------------------------------------------------------------------------------------------------------------


def test_shape_classes_round_sizes_to_powers_of_two():
    cls = _op_times.shape_class
    assert cls("multi_region_attention", torch.bfloat16, (128, 2048, 2048)) == "bfloat16 d=128 q=2048 k=2048"
    assert cls("multi_region_attention", torch.float16, (64, 3000, 0)) == "float16 d=64 q=4096 k=0"
    assert cls("linear_logprobs", torch.bfloat16, (2048, 2048, 151936)) == "bfloat16 n=2048 h=2048 v=262144"
    with pytest.raises(ValueError, match="op must be one of"):
        cls("selective_log_softmax", torch.float32, (1, 2, 3))
    with pytest.raises(ValueError, match=r"shape must be \(n, h, v\)"):
        cls("linear_logprobs", torch.float32, (1, 2))


GPU = "cuda (NVIDIA H100 80GB HBM3)"


def _write_table(path, rows):
    """A table in the benchmarks' long format from (op, backend, shape class, device, p50, mode, metric) tuples."""
    from grpo_mem.bench.results import CSV_COLUMNS, write_csv

    write_csv(
        [
            dict.fromkeys(CSV_COLUMNS, "")
            | dict(op=op, provider=be, mode=mode, metric=met, x_name="shape class", x_value=cls, device=dev, p50=t)
            for op, be, cls, dev, t, mode, met in rows
        ],
        str(path),
    )


def _fake_cuda(dtype, shape):
    """A stand-in for a CUDA tensor: what ``resolve`` reads of one (device, dtype, shape)."""
    return SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=shape)


@pytest.fixture
def fake_gpu(monkeypatch):
    """This process as one H100 for ``_backends`` and ``_op_times`` (FlashAttention available, sm_90); the table
    reset after the test."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_op_times, "device_key", lambda device: GPU)
    monkeypatch.setattr(_backends, "preferred", lambda: ("auto", "default"))
    yield
    _op_times.reset()


def test_table_reader_keeps_full_wall_times_and_the_latest_row(tmp_path):
    path = tmp_path / "op_times.csv"
    cls = "bfloat16 d=128 q=2048 k=2048"
    _write_table(
        path,
        [
            ("multi_region_attention", "sdpa", cls, GPU, 0.004, "full", "wall_time"),
            ("multi_region_attention", "triton", cls, GPU, 0.003, "full", "wall_time"),
            ("multi_region_attention", "triton", cls, GPU, 0.005, "full", "wall_time"),  # a later run replaces
            ("multi_region_attention", "torch", cls, GPU, 0.001, "fwd", "wall_time"),  # forward only: not read
            ("multi_region_attention", "torch", cls, GPU, 0.001, "full", "peak_tensor"),
            ("multi_region_attention", "cpu", cls, GPU, math.nan, "full", "wall_time"),  # skipped: no time
        ],
    )
    assert _op_times.load(str(path)) == {(GPU, "multi_region_attention", cls): {"sdpa": 0.004, "triton": 0.005}}
    assert _op_times.load(str(tmp_path / "absent.csv")) == {}
    (tmp_path / "bad.csv").write_text("op,backend\n")
    with pytest.raises(ValueError, match="lacks the columns"):
        _op_times.load(str(tmp_path / "bad.csv"))


def test_committed_table_is_valid_and_has_no_invented_rows():
    """The table shipped in the package reads (a header at least); every row it holds names a CUDA device."""
    times = _op_times.load(_op_times.TABLE_PATH)
    assert all(device.startswith("cuda (") for device, _, _ in times), sorted(times)
    with open(_op_times.TABLE_PATH) as f:
        assert f.readline().startswith("op,provider,mode,metric,unit,x_name,x_value,p50")


def test_auto_on_cuda_follows_measured_times_else_triton(fake_gpu, tmp_path):
    att = ("multi_region_attention", (128, 4 * 512, 2048))
    head = ("linear_logprobs", (2048, 2048, 151936))
    resolve = lambda op_shape, dtype, needs=frozenset(), d=128: _backends.resolve(  # noqa: E731
        op_shape[0], "auto", _fake_cuda(dtype, (4, 16, 512, d)), needs, op_shape[1]
    )
    _op_times.reset({})  # nothing measured: Triton, the kernels a GPU run has checked
    assert resolve(att, torch.bfloat16) == "triton" and resolve(head, torch.bfloat16) == "triton"
    assert resolve(att, torch.float32) == "triton"  # FlashAttention takes fp16/bf16 only
    assert (
        resolve(att, torch.bfloat16, {"softcap"}) == "triton"
        and resolve(att, torch.bfloat16, {"sliding_window"}) == "triton"
    )
    assert resolve(att, torch.bfloat16, d=100) == "triton" and resolve(att, torch.bfloat16, d=512) == "triton"
    path = tmp_path / "op_times.csv"
    _write_table(
        path,
        [
            (att[0], "sdpa", "bfloat16 d=128 q=2048 k=2048", GPU, 0.004, "full", "wall_time"),
            (att[0], "triton", "bfloat16 d=128 q=2048 k=2048", GPU, 0.003, "full", "wall_time"),
            (head[0], "triton", "bfloat16 n=2048 h=2048 v=262144", GPU, 0.002, "full", "wall_time"),
            (head[0], "cublas", "bfloat16 n=2048 h=2048 v=262144", GPU, 0.001, "full", "wall_time"),
            (head[0], "triton", "bfloat16 n=2048 h=2048 v=262144", "cuda (NVIDIA A10G)", 0.0001, "full", "wall_time"),
        ],
    )
    _op_times.reset(_op_times.load(str(path)))
    assert resolve(att, torch.bfloat16) == "triton" and resolve(head, torch.bfloat16) == "cublas"
    assert resolve(("multi_region_attention", (128, 4 * 512, 16384)), torch.bfloat16) == "triton"  # another class
    assert resolve(att, torch.float16) == "triton"  # another dtype
    # measured faster where it runs: sdpa for bf16 at this class
    _write_table(path, [(att[0], "sdpa", "bfloat16 d=128 q=2048 k=2048", GPU, 0.002, "full", "wall_time")])
    _op_times.reset(_op_times.load(str(path)))
    assert resolve(att, torch.bfloat16) == "sdpa" and resolve(att, torch.bfloat16, {"softcap"}) == "triton"
    assert _backends.resolve(att[0], "sdpa", _fake_cuda(torch.bfloat16, (4, 16, 512, 128))) == "sdpa"  # by name


def test_table_is_read_once_and_never_on_cpu(monkeypatch):
    reads = []
    monkeypatch.setattr(_op_times, "load", lambda path=_op_times.TABLE_PATH: reads.append(path) or {})
    _op_times.reset()
    try:
        t = torch.zeros(2, 3, 4, 8)
        _backends.resolve("multi_region_attention", "auto", t, shape=(8, 6, 0))
        assert reads == []  # a CPU call never reads it
        _op_times.timings(), _op_times.timings()
        assert reads == [_op_times.TABLE_PATH]
    finally:
        _op_times.reset()


def test_writer_measures_cpu_backends_into_a_readable_table(tmp_path):
    """``grpo_mem.bench.op_times``: each op on each named backend at a toy shape (forward + backward, CPU timer) into
    the long-format table, which ``_op_times.load`` reads back under the shape classes ``resolve`` uses."""
    from grpo_mem.bench import op_times

    shapes = [op_times.AttentionShape(B=2, Hq=4, Hkv=2, C=8, d=16, S=24), op_times.HeadShape(N=16, H=24, V=200)]
    rows = []
    for shape in shapes:
        for backend in ("torch", "cpu" if isinstance(shape, op_times.AttentionShape) else "cpp"):
            rows += op_times.measure(shape, backend, torch.float32, "cpu", repeats=2, warmup=1)
    path = tmp_path / "op_times.csv"
    op_times.write_csv(rows, str(path))
    times = _op_times.load(str(path))
    assert {(op, cls) for _, op, cls in times} == {
        ("multi_region_attention", "float32 d=16 q=16 k=32"),
        ("linear_logprobs", "float32 n=16 h=24 v=256"),
    }
    for by_backend in times.values():
        assert len(by_backend) == 2 and all(t > 0 for t in by_backend.values())

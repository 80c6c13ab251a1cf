"""Multi-region attention against naive attention over every row's materialised keys (multi_region_attention_ref)."""

import pytest
import torch
from helpers import (
    HostSyncsAndCopies,
    LaunchRecorder,
    OpNames,
    assert_close,
    attention_inputs,
    check_fp32_against_truth,
    needs_interpreter,
)
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_mem.ops import multi_region_attention, multi_region_attention_ref, shared_prefix_attention
from grpo_mem.ops.attention import MultiRegionAttentionFunction, MultiRegionAttentionParams


def run(fn, tensors, meta, key_mask, grad_out, dtype=None, **kw):
    """Output and gradients (keys out, dq, dk, dv, drk0, drv0, ...) of ``fn(q, k, v, regions, key_mask, **kw)``,
    inputs cast to ``dtype`` if given."""
    leaves = {n: x.detach().to(dtype or x.dtype).requires_grad_(True) for n, x in tensors.items()}
    regions = [(leaves[f"rk{i}"], leaves[f"rv{i}"], idx, mask) for i, (idx, mask) in enumerate(meta)]
    out = fn(leaves["q"], leaves["k"], leaves["v"], regions, key_mask, **kw)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype))
    res = {"out": out.detach()}
    res.update({"d" + n: gr for n, gr in zip(leaves, grads)})
    return res


def check_bf16_against_truth(res, truth, naive):
    """bf16 error against an fp32 truth ≤ 2 × the naive bf16 reference's error (max over each tensor)."""
    for n in truth:
        assert res[n].dtype == torch.bfloat16
        err = (res[n].float() - truth[n]).abs().max().item()
        naive_err = (naive[n].float() - truth[n]).abs().max().item()
        assert err <= 2 * naive_err + 1e-6, f"{n}: bf16 error {err:.3e} > 2 × naive bf16 error {naive_err:.3e}"


# (B, Hq, Hkv, C, d, regions, completion lens); regions as (U, S, index, mask spec)
CASES = {
    # no shared region: plain causal attention with right-padded own keys, GQA 2
    "r0_gqa2": (3, 4, 2, 7, 64, [], [7, 3, 5]),
    # one region, rows unsorted, one row reading nothing, left-padded entries, GQA 4
    "r1_gqa4": (5, 4, 1, 6, 64, [(3, 11, [2, -1, 0, 2, 0], ("left", [11, 4, 7]))], [6, 2, 6, 4, 1]),
    # three regions of different lengths: right padding, a region no row reads, junk masks (padding anywhere, an
    # entry with no real key), rows reading one, two or three regions
    "r3_mixed": (
        6,
        8,
        2,
        5,
        64,
        [
            (2, 13, [0, 1, 0, -1, 1, -1], ("right", [13, 6])),
            (3, 5, [-1] * 6, ("right", [5, 2, 3])),
            (4, 20, [3, 0, -1, 2, 3, 1], ("junk", 0.5)),
        ],
        [5, 5, 3, 1, 5, 2],
    ),
    # no GQA, head dim 128, every row in every region
    "r2_mha_d128": (2, 2, 2, 4, 128, [(1, 9, [0, 0], ("right", [7])), (2, 3, [1, 0], ("right", [3, 1]))], None),
}


def _only_region_keys_inputs(dtype=torch.float32, seed=5):
    """Row 0 sees no own key at queries 0, 1 (its region 0 keys only); row 1 has no real own key at all (region 1
    keys only); row 2 reads no region and its own key 0 is padding, so its query 0 sees nothing."""
    t, meta, km, go = attention_inputs(
        3,
        4,
        2,
        4,
        64,
        [(1, 6, [0, -1, -1], ("right", [6])), (2, 5, [-1, 1, -1], ("right", [5, 4]))],
        [4, 4, 4],
        dtype,
        seed,
    )
    km[0, :2] = False
    km[1] = False
    km[2, 0] = False
    return t, meta, km, go


def torch_path(q, k, v, regions, key_mask, *, scale, chunk_elems=1 << 20):
    params = MultiRegionAttentionParams(scale=scale, backend="torch", chunk_elems=chunk_elems)
    return MultiRegionAttentionFunction.apply(q, k, v, key_mask, params, *(x for r in regions for x in r))


def backend_path(backend):
    if backend == "torch_chunk300":
        return lambda *a, scale: torch_path(*a, scale=scale, chunk_elems=300)
    return lambda *a, scale: multi_region_attention(*a, scale=scale, backend=backend)


def _check_zero_grads(res, meta, km):
    """Padded keys, entries no row reads and rows' masked own keys get exactly zero gradient."""
    for i, (idx, mask) in enumerate(meta):
        read = torch.zeros(mask.shape[0], dtype=torch.bool)
        read[idx[idx >= 0]] = True
        for n in (f"drk{i}", f"drv{i}"):
            g = res[n].transpose(1, 2)  # (U, S, Hkv, d)
            assert (g[~mask] == 0).all() and (g[~read] == 0).all(), n
    if km is not None:
        for n in ("dk", "dv"):
            assert (res[n].transpose(1, 2)[~km] == 0).all(), n


@pytest.mark.parametrize("case", list(CASES) + ["only_region_keys"])
@pytest.mark.parametrize("backend", ["torch", "torch_chunk300", "cpu"])
def test_matches_reference_fp32(case, backend):
    if case == "only_region_keys":
        t, meta, km, go = _only_region_keys_inputs()
        d = 64
    else:
        B, Hq, Hkv, C, d, regions, clens = CASES[case]
        t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens)
    scale = d**-0.5
    truth = run(multi_region_attention_ref, t, meta, km, go, dtype=torch.float64, scale=scale)
    res = run(backend_path(backend), t, meta, km, go, scale=scale)
    check_fp32_against_truth(res, truth)
    _check_zero_grads(res, meta, km)
    if case == "only_region_keys":
        assert (res["out"][2, :, 0] == 0).all() and (res["dq"][2, :, 0] == 0).all()
        assert (res["out"][0, :, :2] != 0).all() and (res["out"][1] != 0).all()


@pytest.mark.parametrize("case", ["r1_gqa4", "r3_mixed"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bf16_error_within_twice_naive(case, backend):
    B, Hq, Hkv, C, d, regions, clens = CASES[case]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens, dtype=torch.bfloat16, seed=2)
    truth = run(multi_region_attention_ref, t, meta, km, go, dtype=torch.float32, scale=d**-0.5)
    naive = run(multi_region_attention_ref, t, meta, km, go, scale=d**-0.5)
    check_bf16_against_truth(run(backend_path(backend), t, meta, km, go, scale=d**-0.5), truth, naive)


def test_fp64_is_exact():
    B, Hq, Hkv, C, d, regions, clens = CASES["r3_mixed"]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens, dtype=torch.float64)
    truth = run(multi_region_attention_ref, t, meta, km, go, scale=0.11)
    for backend in ("torch", "cpu"):
        res = run(backend_path(backend), t, meta, km, go, scale=0.11)
        for n in truth:
            assert_close(res[n], truth[n], 1e-12, f"{backend} {n}")


def _shared_prefix_as_multi(q, k, v, regions, key_mask, *, scale, backend):
    ((pk, pv, pi, pm),) = regions
    return shared_prefix_attention(q, k, v, pk, pv, pi, pm, key_mask, scale=scale, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_one_region_equals_shared_prefix_attention(backend):
    """One region read by every row: multi_region_attention runs exactly the aten ops of shared_prefix_attention,
    forward and backward (so it costs the same, with the same host reads), and gives the same bits."""

    t, meta, km, go = attention_inputs(
        5, 4, 2, 6, 64, [(3, 11, [2, 1, 0, 2, 0], ("left", [11, 4, 7]))], [6, 2, 6, 4, 1]
    )
    from grpo_mem.ops import attention, attention_cpu

    def fresh():  # what one call keeps for the next on the same tensors (index checks, masks) forgotten
        attention._CHECKED.clear()
        attention_cpu._MEMO.clear()

    fresh()
    with OpNames() as ops_a:
        a = run(backend_path(backend), t, meta, km, go, scale=0.125)
    fresh()
    with OpNames() as ops_b:
        b = run(_shared_prefix_as_multi, t, meta, km, go, scale=0.125, backend=backend)
    assert ops_a.names == ops_b.names
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_backend_table_names_real_functions():
    """Every backend of every op in ``_backends.TABLE`` (the one table ``resolve`` reads) has a forward and a backward
    that exist (the lazily imported Triton launchers included), and each op's ``BACKENDS`` view is that table."""
    import importlib

    from grpo_mem.ops import attention, logprobs
    from grpo_mem.ops._backends import TABLE

    views = {
        "multi_region_attention": attention.BACKENDS,
        "linear_logprobs": logprobs.LINEAR_BACKENDS,
        "selective_log_softmax": logprobs.SLS_BACKENDS,
    }
    assert set(TABLE) == set(views)
    for op, entries in TABLE.items():
        assert [e.name for e in entries] == list(views[op]), op
        assert entries[-1].name == "torch" and entries[-1].dtypes is None, op  # auto always finds one
        for entry in entries:
            for fn in (entry.forward, entry.backward):
                module, name = getattr(fn, "target", (None, None))
                if module is not None:
                    fn = getattr(importlib.import_module(f"grpo_mem.ops.{module}"), name)
                assert callable(fn) and fn.__name__.startswith(op), (op, entry.name, fn)


def test_cpu_backend_hands_softcap_to_torch():
    """The cpu backend lacks soft-capping (a capability of the table): ``resolve`` gives a soft-capped call to the
    torch backend, asked for by name or by ``auto``; sliding-window calls stay on cpu; an unknown feature is refused."""
    from grpo_mem.ops._backends import resolve

    q = torch.zeros(1, 2, 3, 4)
    op = "multi_region_attention"
    assert resolve(op, "auto", q) == "cpu" and resolve(op, "cpu", q, {"sliding_window"}) == "cpu"
    assert (
        resolve(op, "auto", q, {"softcap"}) == "torch"
        and resolve(op, "cpu", q, {"softcap", "sliding_window"}) == "torch"
    )
    assert resolve(op, "torch", q, {"softcap"}) == "torch"
    with pytest.raises(ValueError, match=r"subset of \['sliding_window', 'softcap'\], got \['window'\]"):
        resolve(op, "auto", q, {"window"})  # the feature's old name


def test_no_region_is_causal_attention():
    """regions=[]: F.scaled_dot_product_attention with the causal-and-padding mask (GQA repeated by hand)."""
    B, Hq, Hkv, C, d, _, clens = CASES["r0_gqa2"]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, [], clens, dtype=torch.float64)
    out = multi_region_attention(t["q"], t["k"], t["v"], [], km, scale=0.2, backend="torch")
    mask = torch.ones(C, C, dtype=torch.bool).tril() & km[:, None, None, :]
    rep = Hq // Hkv
    want = torch.nn.functional.scaled_dot_product_attention(
        t["q"], t["k"].repeat_interleave(rep, 1), t["v"].repeat_interleave(rep, 1), attn_mask=mask, scale=0.2
    )
    assert_close(out, want, 1e-12, "out")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_does_not_materialise_region_copies(backend):
    """No intermediate as large as one region's K gathered per row (B·Hkv·S·d) in forward or backward."""
    B, Hq, Hkv, C, d = 16, 8, 2, 4, 16
    regions = [(1, 64, [0] * B, ("right", [50])), (2, 64, [0, 1] * (B // 2), ("right", [64, 30]))]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions)
    per_row_copy = B * Hkv * 64 * d

    class MaxNumel(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    MaxNumel.largest = max(MaxNumel.largest, o.numel())
            return out

    fn = (
        (lambda *a, scale: torch_path(*a, scale=scale, chunk_elems=4096))
        if backend == "torch"
        else backend_path(backend)
    )
    with MaxNumel():
        run(fn, t, meta, km, go, scale=0.25)
    assert MaxNumel.largest < per_row_copy / 2, MaxNumel.largest
    with MaxNumel():  # the check itself sees the reference's copies
        MaxNumel.largest = 0
        run(multi_region_attention_ref, t, meta, km, go, scale=0.25)
    assert MaxNumel.largest >= per_row_copy


def test_saves_only_inputs_output_and_lse():
    B, Hq, Hkv, C, d, regions, clens = CASES["r3_mixed"]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens)
    leaves = {n: x.clone().requires_grad_(True) for n, x in t.items()}
    regs = [(leaves[f"rk{i}"], leaves[f"rv{i}"], idx, m) for i, (idx, m) in enumerate(meta)]
    out = multi_region_attention(leaves["q"], leaves["k"], leaves["v"], regs, km, scale=0.1)
    inputs = list(leaves.values()) + [x for idx_m in meta for x in idx_m] + [km]
    saved_bytes = sum(x.numel() * x.element_size() for x in out.grad_fn.saved_tensors if x is not None)
    assert saved_bytes == sum(x.numel() * x.element_size() for x in inputs) + out.numel() * 4 + B * Hq * C * 4


def test_bad_input_raises():
    B, Hq, Hkv, C, d, regions, clens = CASES["r3_mixed"]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens)
    q, k, v = t["q"], t["k"], t["v"]
    good = [(t[f"rk{i}"], t[f"rv{i}"], idx, m) for i, (idx, m) in enumerate(meta)]

    def call(regs, key_mask=km, **kw):
        return multi_region_attention(q, k, v, regs, key_mask, **{"scale": 0.1, **kw})

    def swap(i, j, value):
        regs = [list(r) for r in good]
        regs[i][j] = value
        return [tuple(r) for r in regs]

    with pytest.raises(TypeError, match="regions must be a list or tuple"):
        call(good[0])
    with pytest.raises(TypeError, match=r"regions\[1\] must be a 4-tuple.*length 3"):
        call([good[0], good[1][:3]])
    with pytest.raises(ValueError, match=r"regions\[2\].index values must lie in \[-1, U=4\), got 4"):
        call(swap(2, 2, torch.tensor([0, 1, 2, 3, 4, 0])))
    with pytest.raises(ValueError, match=r"regions\[0\].index values must lie in \[-1, U=2\), got -2"):
        call(swap(0, 2, torch.tensor([0, 1, 0, -2, 1, -1])))
    with pytest.raises(TypeError, match=r"regions\[0\].index must be int64, got torch.int32"):
        call(swap(0, 2, meta[0][0].int()))
    with pytest.raises(ValueError, match=r"regions\[1\].index must have shape \(B=6,\), got \(5,\)"):
        call(swap(1, 2, meta[1][0][:5]))
    with pytest.raises(ValueError, match=r"regions\[1\].mask must have shape \(U=3, S=5\), got \(3, 4\)"):
        call(swap(1, 3, meta[1][1][:, :4]))
    with pytest.raises(TypeError, match=r"regions\[1\].mask must be a bool tensor, got torch.int64"):
        call(swap(1, 3, meta[1][1].long()))
    with pytest.raises(
        ValueError,
        match=r"regions\[2\].region_k must have shape \(U, Hkv=2, S, d=64\), got "
        r"\(4, 1, 20, 64\)",
    ):
        call(swap(2, 0, t["rk2"][:, :1]))
    with pytest.raises(ValueError, match=r"regions\[2\].region_v shape .* must equal"):
        call(swap(2, 1, t["rv2"][:, :, :3]))
    with pytest.raises(TypeError, match=r"regions\[0\].region_v dtype torch.float64 differs from q dtype"):
        call(swap(0, 1, t["rv0"].double()))
    with pytest.raises(ValueError, match=r"regions\[0\].region_k is on meta but q is on cpu"):
        call(swap(0, 0, t["rk0"].to("meta")))
    with pytest.raises(ValueError, match=r"regions\[0\].region_k holds U=0 entries"):
        call([(t["rk0"][:0], t["rv0"][:0], meta[0][0], meta[0][1][:0])] + good[1:])
    with pytest.raises(ValueError, match=r"key_mask must have shape \(B=6, C=5\)"):
        call(good, key_mask=km[:, 1:])
    with pytest.raises(ValueError, match="Hq=8.*Hkv=3"):
        multi_region_attention(q, k[:, :1].expand(B, 3, C, d), v[:, :1].expand(B, 3, C, d), [], None, scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        call(good, scale=0.0)
    with pytest.raises(ValueError, match="backend"):
        call(good, backend="cuda")


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (TRITON_INTERPRET=1 runs them on CPU tensors; see tests/ops/test_attention.py)
# ----------------------------------------------------------------------------------------------------------------------

# Small shapes: the interpreter runs every program in numpy. fp32 key tiles are 16 wide: S=20 with 16 left-padding
# keys, or 13 right-padding keys, skips a whole tile; junk masks cross tile edges.
TRITON_CASES = {
    "r0_gqa2": (3, 4, 2, 7, 32, [], [7, 3, 5]),
    "r1_gqa4": (4, 4, 1, 6, 32, [(3, 20, [2, -1, 0, 2], ("left", [20, 4, 7]))], [6, 2, 6, 1]),
    "r3_mixed": (
        4,
        4,
        2,
        5,
        32,
        [
            (2, 20, [0, 1, -1, 1], ("right", [20, 7])),
            (2, 5, [-1] * 4, ("right", [5, 2])),
            (3, 18, [2, -1, 0, 1], ("junk", 0.5)),
        ],
        [5, 3, 5, 1],
    ),
    "r2_mha_d64": (2, 2, 2, 4, 64, [(1, 9, [0, 0], ("right", [7])), (2, 3, [1, 0], ("right", [3, 1]))], None),
}


@pytest.mark.parametrize("case", list(TRITON_CASES) + ["only_region_keys"])
@needs_interpreter
def test_triton_fp32_matches_reference(case):
    """Against the fp64 reference; forward and backward never synchronise with the host (.item(), bincount, ...) and
    copy no input (with two regions or more, the fp32 running output and dQ are allocations)."""
    if case == "only_region_keys":
        t, meta, km, go = _only_region_keys_inputs(seed=1)
        d = 64
    else:
        B, Hq, Hkv, C, d, regions, clens = TRITON_CASES[case]
        t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens, seed=1)
    truth = run(multi_region_attention_ref, t, meta, km, go, dtype=torch.float64, scale=d**-0.5)
    q = t["q"]
    with HostSyncsAndCopies(q.numel()) as mode:
        res = run(backend_path("triton"), t, meta, km, go, scale=d**-0.5)
    assert mode.syncs == [], mode.syncs
    assert mode.copies == [], mode.copies
    check_fp32_against_truth(res, truth)
    _check_zero_grads(res, meta, km)
    if case == "only_region_keys":
        assert (res["out"][2, :, 0] == 0).all() and (res["dq"][2, :, 0] == 0).all()


@needs_interpreter
def test_triton_bf16_error_within_twice_naive():
    B, Hq, Hkv, C, d, regions, clens = TRITON_CASES["r3_mixed"]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens, dtype=torch.bfloat16, seed=2)
    truth = run(multi_region_attention_ref, t, meta, km, go, dtype=torch.float32, scale=d**-0.5)
    naive = run(multi_region_attention_ref, t, meta, km, go, scale=d**-0.5)
    check_bf16_against_truth(run(backend_path("triton"), t, meta, km, go, scale=d**-0.5), truth, naive)


@needs_interpreter
def test_triton_one_region_equals_shared_prefix_attention_and_is_deterministic():
    """One region is shared_prefix_attention bit for bit, and region dK/dV (reduced without atomics, here over a
    split of the work into several programs) agree bit for bit between two runs."""
    from grpo_mem.ops.attention_triton_launch import region_dkdv_grid

    t, meta, km, go = attention_inputs(2, 4, 1, 1, 32, [(1, 24, [0, 0], ("left", [9]))], None, seed=3)
    assert region_dkdv_grid(2, 1, 1, 4, 1, 24, 32, torch.float32, 132)[2] > 1
    a = run(backend_path("triton"), t, meta, km, go, scale=0.125)
    b = run(_shared_prefix_as_multi, t, meta, km, go, scale=0.125, backend="triton")
    for n in a:
        assert torch.equal(a[n], b[n]), n


@needs_interpreter
def test_triton_region_read_through_a_strided_view():
    """Sequence parallelism hands the kernels the earlier shards' K/V as a slice of the all-gathered (B, Hkv, size·L,
    d) tensor (``model.sequence_parallel``): read in place with its strides, the output and gradients (into the whole
    gathered tensor) equal the fp64 reference's."""
    g = torch.Generator().manual_seed(4)
    B, Hq, Hkv, C, d, L = 3, 4, 2, 5, 32, 6
    leaves = {
        "q": torch.randn(B, Hq, C, d, generator=g),
        "k": torch.randn(B, Hkv, C, d, generator=g),
        "v": torch.randn(B, Hkv, C, d, generator=g),
        "k_all": torch.randn(B, Hkv, 2 * L, d, generator=g),
        "v_all": torch.randn(B, Hkv, 2 * L, d, generator=g),
    }
    mask = torch.ones(B, 2 * L, dtype=torch.bool)
    mask[1, 4:] = False
    key_mask = torch.ones(B, C, dtype=torch.bool)
    key_mask[2, 3:] = False
    weights = torch.randn(B, Hq, C, d, generator=g)

    def result(fn, dtype, **kw):
        x = {n: t.to(dtype).requires_grad_(True) for n, t in leaves.items()}
        region = (x["k_all"][:, :, :L], x["v_all"][:, :, :L], torch.arange(B), mask[:, :L])
        out = fn(x["q"], x["k"], x["v"], [region], key_mask, scale=d**-0.5, **kw)
        grads = torch.autograd.grad((out * weights.to(dtype)).sum(), list(x.values()))
        return {"out": out.detach(), **{"d" + n: gr for n, gr in zip(x, grads)}}

    truth = result(multi_region_attention_ref, torch.float64)
    check_fp32_against_truth(result(multi_region_attention, torch.float32, backend="triton"), truth)


# ----------------------------------------------------------------------------------------------------------------------
# Triton launches, recorded without running (meta tensors): what a region costs
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_regions", [0, 1, 3])
def test_triton_launches_per_region(monkeypatch, n_regions):
    """One forward and one dQ launch per region (one without regions); with one region exactly the shared-prefix
    launches; per region one dK/dV launch (and its in-order reduction when split). A row with index −1 runs no key
    tile of that region: its programs find an empty span (checked under the interpreter by the cases above)."""
    from grpo_mem.ops.attention import BACKENDS

    fwd, bwd = BACKENDS["triton"]
    params = MultiRegionAttentionParams(scale=0.1, backend="triton")
    rec = LaunchRecorder(monkeypatch)
    B, Hq, Hkv, C, S, d = 8, 12, 2, 1024, 256, 128
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(B, C, Hq, d, **meta).transpose(1, 2)
    k, v = (torch.empty(B, C, Hkv, d, **meta).transpose(1, 2) for _ in "kv")
    regions = [
        (
            torch.empty(2, S, Hkv, d, **meta).transpose(1, 2),
            torch.empty(2, S, Hkv, d, **meta).transpose(1, 2),
            torch.zeros(B, dtype=torch.int64, device="meta"),
            torch.empty(2, S, dtype=torch.bool, device="meta"),
        )
        for _ in range(n_regions)
    ]
    km = torch.empty(B, C, dtype=torch.bool, device="meta")
    out, lse = fwd(q, k, v, regions, km, params)
    bwd(out, q, k, v, regions, km, out, lse, params)
    names = [name for name, _, _ in rec.launches]
    region_bwd = ["bwd_dkdv_region", "bwd_region_reduce"] * n_regions
    assert (
        names
        == ["fwd"] * max(1, n_regions) + ["bwd_delta"] + ["bwd_dq"] * max(1, n_regions) + ["bwd_dkdv_own"] + region_bwd
    ), names


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_out_map_returns_and_keeps_the_moved_output(backend):
    """``out_map=(to, back)`` (here the heads reversed, twice: its own inverse): the op returns ``to`` of the plain
    output, keeps that tensor (no second copy of the output), and its gradients equal the plain op's under the
    moved output gradient."""
    B, Hq, Hkv, C, d, regions, clens = CASES["r3_mixed"]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens)
    calls = []

    def flip(ts):
        calls.append(len(ts))
        return [x.flip(1) for x in ts]

    plain = run(backend_path(backend), t, meta, km, go, scale=0.3)
    moved = run(multi_region_attention, t, meta, km, go.flip(1), scale=0.3, backend=backend, out_map=(flip, flip))
    assert calls == [1, 2]  # forward: the output; backward: the kept output and its gradient, one call
    assert_close(moved["out"], plain["out"].flip(1), 1e-6, "out")
    for n in plain:
        if n != "out":
            assert_close(moved[n], plain[n], 1e-6, n)
    q = t["q"].clone().requires_grad_(True)
    out = multi_region_attention(q, t["k"], t["v"], [], km, scale=0.3, backend=backend, out_map=(flip, flip))
    assert any(s.data_ptr() == out.data_ptr() for s in out.grad_fn.saved_tensors if s is not None)
    with pytest.raises(TypeError, match="out_map must be None or a pair of callables"):
        multi_region_attention(q, t["k"], t["v"], [], km, scale=0.3, out_map=flip)


def test_cpu_backend_derives_masks_once_per_unchanged_tensors():
    """The cpu backend keeps what it derives from a call's key mask, indices and region masks (its additive masks,
    entry groups, key spans) while those tensors live unchanged: the next call on them (a model's next layer) runs
    fewer ops for the same bits, and an in-place change of the key mask (a new version) builds them again, giving
    what a never-seen copy gives."""
    from grpo_mem.ops import attention_cpu

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    t, meta, km, go = attention_inputs(*CASES["r1_gqa4"][:5], CASES["r1_gqa4"][5], CASES["r1_gqa4"][6])
    counts, results = [], []
    for _ in range(2):
        Count.n = 0
        with Count():
            results.append(run(multi_region_attention, t, meta, km, go, scale=0.125, backend="cpu"))
        counts.append(Count.n)
    assert counts[1] < counts[0] - 20, counts
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])
    km[0, 1:] = False  # row 0 keeps only its first key: the kept masks no longer hold
    changed = run(multi_region_attention, t, meta, km, go, scale=0.125, backend="cpu")
    attention_cpu._MEMO.clear()
    fresh = run(multi_region_attention, t, meta, km.clone(), go, scale=0.125, backend="cpu")
    assert all(torch.equal(changed[n], fresh[n]) for n in fresh)
    assert not torch.equal(changed["out"], results[0]["out"])

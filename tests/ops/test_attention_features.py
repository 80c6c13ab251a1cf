"""Sliding windows, attention sinks and score soft-capping in multi_region_attention, against the fp64 reference
(multi_region_attention_ref) on every backend."""

import math

import pytest
import torch
from helpers import assert_close, attention_inputs, needs_interpreter

from grpo_mem.ops import multi_region_attention, multi_region_attention_ref
from grpo_mem.ops.attention import MultiRegionAttentionFunction, MultiRegionAttentionParams


def positions_of(meta, B, C):
    """Absolute positions as stock TRL numbers a tree's row (``arange`` over the padded row): region r's keys follow
    those of regions 0 … r−1, the completion follows every region. Returns (q_positions (B, C), [(U_r, S_r)])."""
    pos, start = [], 0
    for _, mask in meta:
        U, S = mask.shape
        pos.append((start + torch.arange(S)).expand(U, S).contiguous())
        start += S
    return (start + torch.arange(C)).expand(B, C).contiguous(), pos


def run(fn, tensors, meta, key_mask, grad_out, features, dtype=None, positions=None, **kw):
    """Output and gradients ({"out", "dq", "dk", "dv", "drk0", "drv0", ..., "dsinks"}) of
    ``fn(q, k, v, regions, key_mask, **features, **kw)``, with ``features`` a dict of the new keyword arguments
    (sinks given as a leaf tensor in q's dtype), inputs cast to ``dtype`` if given; regions carry positions with a
    window (``positions`` = (q_positions, [region positions]), or those of :func:`positions_of`)."""
    leaves = {n: x.detach().to(dtype or x.dtype).requires_grad_(True) for n, x in tensors.items()}
    feats = dict(features)
    if feats.get("sinks") is not None:
        leaves["sinks"] = feats["sinks"].detach().to(leaves["q"].dtype).requires_grad_(True)
        feats["sinks"] = leaves["sinks"]
    regions = [(leaves[f"rk{i}"], leaves[f"rv{i}"], idx, mask) for i, (idx, mask) in enumerate(meta)]
    if feats.get("sliding_window") is not None:
        q_pos, k_pos = positions or positions_of(meta, *leaves["q"].shape[::2])
        feats["q_positions"] = q_pos
        regions = [r + (p,) for r, p in zip(regions, k_pos)]
    out = fn(leaves["q"], leaves["k"], leaves["v"], regions, key_mask, **feats, **kw)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype))
    return {"out": out.detach(), **{"d" + n: g for n, g in zip(leaves, grads)}}


def check_fp32(res, truth):
    """Values ≤ 1e-5 absolute, gradients ≤ 1e-4 × max|truth gradient| (the criterion of the other attention tests)."""
    assert set(res) == set(truth)
    assert_close(res["out"], truth["out"], 1e-5, "out")
    for n in truth:
        if n != "out":
            assert_close(res[n], truth[n], 1e-4 * max(truth[n].abs().max().item(), 1e-6), n)


def chunked_torch(
    q, k, v, regions, key_mask, *, scale, sliding_window=None, sinks=None, softcap=None, q_positions=None
):
    """The torch backend with 300-element score chunks (rows split along C), through the autograd Function."""
    params = MultiRegionAttentionParams(
        scale=scale,
        backend="torch",
        chunk_elems=300,
        sliding_window=sliding_window,
        softcap=softcap,
        has_sinks=sinks is not None,
    )
    tensors = [x for r in regions for x in r[:4]] + ([sinks] if sinks is not None else [])
    if sliding_window is not None:
        tensors += [q_positions] + [r[4] for r in regions]
    return MultiRegionAttentionFunction.apply(q, k, v, key_mask, params, *tensors)


def backend_fn(backend):
    if backend == "torch_chunk300":
        return chunked_torch
    return lambda *a, **kw: multi_region_attention(*a, backend=backend, **kw)


# (B, Hq, Hkv, C, d, regions as (U, S, index, mask spec), completion lens). Positions: region 0 from 0, region 1 after
# it, the completion after both (positions_of).
SHAPES = {
    # one prompt region of 13 keys (left-padded entries, a row reading nothing), C = 7, GQA 4
    "r1_gqa4": (5, 4, 1, 7, 64, [(3, 13, [2, -1, 0, 2, 1], ("left", [13, 4, 9]))], [7, 2, 7, 5, 1]),
    # two tree regions of unaligned lengths, junk-padded second region, GQA 2, a row reading only region 1
    "r2_tree": (
        4,
        4,
        2,
        5,
        32,
        [(2, 11, [0, 1, 0, -1], ("right", [11, 6])), (3, 9, [1, 2, 0, 1], ("junk", 0.6))],
        [5, 3, 5, 4],
    ),
}
FEATURES = {
    # window shorter than a region and than region + completion: completions cross the window edge
    "window6": dict(sliding_window=6),
    # window shorter than the completion itself (own keys leave the window too)
    "window3": dict(sliding_window=3),
    "softcap": dict(softcap=0.7),  # small cap: most scores in tanh's curved part
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)),
    "softcap_sinks": dict(softcap=0.9, sinks=torch.tensor([-0.5, 1.0, 0.3, 2.5], dtype=torch.float64)),
    "all": dict(sliding_window=8, softcap=1.3, sinks=torch.tensor([1.5, -0.3, 0.2, -2.0], dtype=torch.float64)),
}


def _case(shape, dtype=torch.float32, seed=0):
    B, Hq, Hkv, C, d, regions, clens = SHAPES[shape]
    t, meta, km, go = attention_inputs(B, Hq, Hkv, C, d, regions, clens, dtype, seed)
    return t, meta, km, go, d**-0.5


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", ["torch", "torch_chunk300", "cpu"])
def test_matches_fp64_reference(backend, shape, feature):
    t, meta, km, go, scale = _case(shape)
    feats = FEATURES[feature]
    truth = run(multi_region_attention_ref, t, meta, km, go, feats, dtype=torch.float64, scale=scale)
    check_fp32(run(backend_fn(backend), t, meta, km, go, feats, scale=scale), truth)


def test_features_change_the_result():
    """Each feature moves the output by far more than the tolerance (the cases above test something), and a window
    longer than every row equals no window at all."""
    t, meta, km, go, scale = _case("r2_tree", torch.float64)
    plain = run(multi_region_attention_ref, t, meta, km, go, {}, scale=scale)
    for name, feats in FEATURES.items():
        res = run(multi_region_attention_ref, t, meta, km, go, feats, scale=scale)
        assert (res["out"] - plain["out"]).abs().max() > 1e-2, name
    wide = run(multi_region_attention, t, meta, km, go, {"sliding_window": 1000}, scale=scale, backend="torch")
    for n in plain:
        assert_close(wide[n], plain[n], 1e-12, n)


@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("triton", marks=needs_interpreter)])
def test_bf16_sinks_and_softcap_within_twice_naive(backend):
    """bf16 error against an fp32 truth ≤ 2 × the naive bf16 reference's error (torch and cpu backends). The (Hq,) sink
    gradient, a sum over every query row rounded once to bf16, may also be off by one bf16 ulp of its largest value
    (2^-7 relative): with 4 values the naive error can be luckily small."""
    t, meta, km, go, scale = _case("r1_gqa4", torch.bfloat16, seed=2)
    feats = FEATURES["all"]
    truth = run(multi_region_attention_ref, t, meta, km, go, feats, dtype=torch.float32, scale=scale)
    naive = run(multi_region_attention_ref, t, meta, km, go, feats, scale=scale)
    res = run(multi_region_attention, t, meta, km, go, feats, scale=scale, backend=backend)
    for n in truth:
        assert res[n].dtype == torch.bfloat16
        err, naive_err = ((x[n].float() - truth[n]).abs().max().item() for x in (res, naive))
        bound = 2 * naive_err + 1e-6
        if n == "dsinks":
            bound = max(bound, 2**-7 * truth[n].abs().max().item())
        assert err <= bound, f"{n}: bf16 error {err:.3e} > {bound:.3e} (naive bf16 error {naive_err:.3e})"


def test_sink_gradient_by_finite_differences():
    """∂L/∂s_h = −Σ P_sink·D against a central difference of the fp64 forward."""
    t, meta, km, go, scale = _case("r1_gqa4", torch.float64)
    sinks = torch.tensor([0.3, -0.7, 1.1, 0.0], dtype=torch.float64)
    res = run(multi_region_attention, t, meta, km, go, {"sinks": sinks}, scale=scale, backend="torch")
    regions = [(t[f"rk{i}"], t[f"rv{i}"], idx, mask) for i, (idx, mask) in enumerate(meta)]
    for h in range(4):
        e = torch.zeros(4, dtype=torch.float64)
        e[h] = 1e-6
        f = [
            (
                multi_region_attention(
                    t["q"], t["k"], t["v"], regions, km, scale=scale, backend="torch", sinks=sinks + sgn * e
                )
                * go
            ).sum()
            for sgn in (1, -1)
        ]
        assert math.isclose(res["dsinks"][h].item(), ((f[0] - f[1]) / 2e-6).item(), rel_tol=1e-6, abs_tol=1e-9)


def _skipped_region_inputs():
    """Two regions; with a window of 4 the completion (positions 20 … 25) sees nothing of region 0 (positions 0 … 9),
    whose K/V are NaN: read, they would poison every output (0 · NaN)."""
    t, meta, km, go = attention_inputs(
        3, 4, 2, 6, 32, [(2, 10, [0, 1, 0], ("right", [10, 7])), (3, 10, [2, 0, 1], ("left", [10, 3, 8]))], [6, 4, 6]
    )
    return t, meta, km, go


@pytest.mark.parametrize("softcap", [None, 2.0])  # (the cpu backend runs the torch math with a soft-cap)
@pytest.mark.parametrize("backend", ["torch", "torch_chunk300", "cpu", pytest.param("triton", marks=needs_interpreter)])
def test_region_outside_every_window_is_not_read(backend, softcap):
    t, meta, km, go = _skipped_region_inputs()
    feats = {"sliding_window": 4, "softcap": softcap}
    finite = run(multi_region_attention_ref, t, meta, km, go, feats, dtype=torch.float64, scale=0.2)
    t["rk0"] = torch.full_like(t["rk0"], float("nan"))
    t["rv0"] = torch.full_like(t["rv0"], float("nan"))
    res = run(backend_fn(backend), t, meta, km, go, feats, scale=0.2)
    assert (res["drk0"] == 0).all() and (res["drv0"] == 0).all()
    check_fp32(res, finite)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sliding_window=0), "sliding_window must be >= 1, got 0"),
        (dict(sliding_window=-3), "sliding_window must be >= 1, got -3"),
        (dict(softcap=0.0), "softcap must be a finite positive float, got 0.0"),
        (dict(softcap=-1.5), "softcap must be a finite positive float, got -1.5"),
        (dict(softcap=float("inf")), "softcap must be a finite positive float, got inf"),
        (dict(sinks=torch.zeros(3)), r"sinks must have shape \(Hq=4,\), got \(3,\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), "sinks must be a floating tensor .*, got torch.int64"),
        (dict(sinks=torch.zeros(1, 4)), r"sinks must have shape \(Hq=4,\), got \(1, 4\)"),
        (dict(sliding_window=4), "sliding_window needs q_positions"),
        (dict(sliding_window=4, q_positions=torch.zeros(5, 7, dtype=torch.int64)), "regions\\[0\\]'s key positions"),
        (dict(sliding_window=4, q_positions=torch.zeros(5, 6, dtype=torch.int64)), r"q_positions must have shape"),
    ],
)
@pytest.mark.parametrize("fn", [multi_region_attention, multi_region_attention_ref])
def test_bad_values_raise(fn, kwargs, message):
    t, meta, km, go, scale = _case("r1_gqa4")
    regions = [(t["rk0"], t["rv0"], *meta[0])]
    with pytest.raises(ValueError, match=message):
        fn(t["q"], t["k"], t["v"], regions, km, scale=scale, **kwargs)


def test_bad_types_and_region_positions_raise():
    t, meta, km, go, scale = _case("r1_gqa4")
    q_pos, (pos,) = positions_of(meta, 5, 7)
    base = (t["q"], t["k"], t["v"])
    with pytest.raises(TypeError, match="sliding_window must be a Python int"):
        multi_region_attention(*base, [], km, scale=scale, sliding_window=4.0, q_positions=q_pos)
    with pytest.raises(TypeError, match="softcap must be a Python float"):
        multi_region_attention(*base, [], km, scale=scale, softcap=torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"regions\[0\].positions must be an int64 tensor"):
        multi_region_attention(
            *base, [(t["rk0"], t["rv0"], *meta[0], pos.int())], km, scale=scale, sliding_window=4, q_positions=q_pos
        )
    with pytest.raises(ValueError, match=r"regions\[0\].positions must have shape \(U=3, S=13\)"):
        multi_region_attention(
            *base, [(t["rk0"], t["rv0"], *meta[0], pos[:, :5])], km, scale=scale, sliding_window=4, q_positions=q_pos
        )


def test_positions_without_window_change_nothing():
    """5-tuple regions and q_positions without a window: the same bits as the 4-tuple call."""
    t, meta, km, go, scale = _case("r2_tree")
    q_pos, k_pos = positions_of(meta, 4, 5)
    regions = [(t[f"rk{i}"], t[f"rv{i}"], *m) for i, m in enumerate(meta)]
    a = multi_region_attention(t["q"], t["k"], t["v"], regions, km, scale=scale, backend="cpu")
    b = multi_region_attention(
        t["q"],
        t["k"],
        t["v"],
        [r + (p,) for r, p in zip(regions, k_pos)],
        km,
        scale=scale,
        backend="cpu",
        q_positions=q_pos,
    )
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------------------
# Triton, under the interpreter (rerun in a fresh TRITON_INTERPRET=1 process)
# ----------------------------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_triton_matches_fp64_reference(shape, feature):
    t, meta, km, go, scale = _case(shape)
    feats = FEATURES[feature]
    truth = run(multi_region_attention_ref, t, meta, km, go, feats, dtype=torch.float64, scale=scale)
    check_fp32(run(backend_fn("triton"), t, meta, km, go, feats, scale=scale), truth)


@needs_interpreter
def test_triton_window_runs_in_the_kernels(monkeypatch):
    """A window on the triton backend never reaches the torch backend's math (it used to fall back to it)."""
    from grpo_mem.ops import attention

    def refuse(*a, **kw):
        raise AssertionError("the torch backend ran")

    monkeypatch.setitem(attention.BACKENDS, "torch", (refuse, refuse))
    t, meta, km, go, scale = _case("r2_tree")
    truth = run(multi_region_attention_ref, t, meta, km, go, FEATURES["all"], dtype=torch.float64, scale=scale)
    check_fp32(run(backend_fn("triton"), t, meta, km, go, FEATURES["all"], scale=scale), truth)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=needs_interpreter)])
def test_window_skips_keys_out_of_reach(backend):
    """A 200-key prompt, window 10, completions at positions 200 … 206: no query reaches keys below 191, so the
    Triton forward, dQ and dK/dV kernels skip every key tile below 128 (64 = the largest BLOCK_N), and the cpu backend
    hands ATen only the keys in reach. Those keys are NaN: loaded and masked, they would poison the results (0 · NaN);
    skipped, the results equal the finite reference and their gradients are exactly 0."""
    t, meta, km, go = attention_inputs(3, 4, 2, 7, 32, [(2, 200, [0, 1, 0], ("left", [200, 150]))], [7, 5, 6])
    feats = {"sliding_window": 10, "sinks": torch.tensor([0.2, -0.4, 1.0, 0.0], dtype=torch.float64)}
    finite = run(multi_region_attention_ref, t, meta, km, go, feats, dtype=torch.float64, scale=0.3)
    t["rk0"][:, :, :128] = float("nan")
    t["rv0"][:, :, :128] = float("nan")
    res = run(backend_fn(backend), t, meta, km, go, feats, scale=0.3)
    assert (res["drk0"][:, :, :128] == 0).all() and (res["drv0"][:, :, :128] == 0).all()
    check_fp32(res, finite)


@pytest.mark.parametrize("window", [1, 5, 40])
@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=needs_interpreter)])
def test_window_on_large_unordered_positions(backend, window):
    """Positions past 2**33 (int64 throughout; the kernels compare them in int32 relative to a block's first query)
    and in no particular order along the keys (a shuffled region, completions whose positions step back): the window
    test is the reference's on every pair."""
    t, meta, km, go, scale = _case("r2_tree")
    g = torch.Generator().manual_seed(5)
    base = 2**33 + 7
    q_pos = base + 20 + torch.randint(0, 12, (4, 5), generator=g)
    k_pos = [
        base + torch.randperm(2 * 11, generator=g)[:11].expand(2, 11).contiguous(),
        base + 3 + torch.randint(0, 25, (3, 9), generator=g),
    ]
    feats = {"sliding_window": window, "softcap": 1.1 if backend == "triton" else None}
    truth = run(
        multi_region_attention_ref, t, meta, km, go, feats, dtype=torch.float64, positions=(q_pos, k_pos), scale=scale
    )
    check_fp32(run(backend_fn(backend), t, meta, km, go, feats, positions=(q_pos, k_pos), scale=scale), truth)

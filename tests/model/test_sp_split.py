"""How a sequence-parallel layout cuts a pass (``grpo_mem.model.sequence_parallel``), on one process: every rank's
shard, the gathered K/V's sequence order, the regions each rank's query rows read, and the attention they compute,
simulated rank by rank from the whole pass (no process group: ``Shards.earlier`` is given the K/V an all-gather
returns). The 2-process runs (``tests/distributed/test_sequence_parallel.py``) check the same against stock TRL."""

import pytest
import torch

from grpo_mem.model.sequence_heads import head_split
from grpo_mem.model.sequence_parallel import SPLITS, SequenceParallel, Shards
from grpo_mem.ops.attention import multi_region_attention_ref


def ranks(size: int, split: str) -> list[SequenceParallel]:
    return [SequenceParallel(None, r, size, split=split) for r in range(size)]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("T", [1, 7, 16, 29])
def test_shards_cover_the_pass_once_and_gather_in_sequence_order(split, size, T):
    group = ranks(size, split)
    L = group[0].shard(T)
    x = torch.arange(1, T + 1)[None, :]
    padded = group[0].padded(x, L)
    shards = [sp.local(x, L) for sp in group]
    # the all-gather's arrangement (``_GatherKV``): the ranks' shards cut by ``slices`` give the pass in order
    assert torch.equal(torch.cat([shards[r][:, a:b] for r, a, b in group[0].slices(L)], 1), padded)
    assert torch.equal(group[0].to_sequence(torch.cat(shards, 1)), padded)
    for sp, shard in zip(group, shards):
        assert torch.equal(shard[0], padded[0, sp.indices(L)])
        owner, slot = sp.locate(torch.arange(size * L), L)
        mine = owner == sp.rank
        assert torch.equal(shard[0, slot[mine]], padded[0, mine])


def visible_pairs(sp: SequenceParallel, T: int) -> int:
    """Query-key pairs rank ``sp`` scores in a pass of T tokens without padding: each folded row's causal own keys
    plus the regions it reads."""
    L = sp.shard(T)
    shards = Shards(sp, torch.ones(1, sp.size * L, dtype=torch.bool), torch.arange(sp.size * L)[None])
    k_all = torch.zeros(1, 1, sp.size * L, 1)
    piece = L // sp.pieces
    pairs = sp.pieces * piece * (piece + 1) // 2
    for k, _, index, _, _ in shards.earlier(k_all, k_all):
        pairs += int((index >= 0).sum()) * piece * k.shape[2]
    return pairs


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_attention_work(size):
    T = 2 * size * 16
    zigzag = [visible_pairs(sp, T) for sp in ranks(size, "zigzag")]
    assert len(set(zigzag)) == 1 and zigzag[0] * size == T * (T + 1) // 2  # the causal pairs, split evenly
    contiguous = [visible_pairs(sp, T) for sp in ranks(size, "contiguous")]
    assert sum(contiguous) == T * (T + 1) // 2 and contiguous == sorted(contiguous) and contiguous[-1] > contiguous[0]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    "size,T,window", [(1, 9, None), (2, 13, None), (2, 16, 5), (3, 17, None), (4, 23, 7), (4, 3, None)]
)
def test_each_rank_computes_its_tokens_of_causal_attention(split, size, T, window):
    """Rank by rank, its folded query rows against the regions ``Shards.earlier`` gives and their own keys equal
    causal attention over the whole pass (fp64, right padding, GQA, a sliding window) at the rank's tokens."""
    g = torch.Generator().manual_seed(T)
    n, Hq, Hkv, d = 3, 4, 2, 8
    # laid out (n, T, H, d) in memory, as a model's projections give them (``Shards.fold`` is then a view)
    q, k, v = (torch.randn(n, T, h, d, generator=g, dtype=torch.float64).transpose(1, 2) for h in (Hq, Hkv, Hkv))
    lengths = torch.tensor([T, T - 1, max(1, T // 2)])
    mask = torch.arange(T)[None] < lengths[:, None]
    positions = 5 + torch.arange(T)[None].expand(n, T)
    features = dict(sliding_window=window, q_positions=positions) if window else {}
    truth = multi_region_attention_ref(q, k, v, [], mask, scale=d**-0.5, **features)
    for sp in ranks(size, split):
        L = sp.shard(T)

        def seq(t, fill=0):  # (n, H, T, d) -> padded along the sequence, (n, H, size·L, d)
            return sp.padded(t.transpose(1, 2), L, fill).transpose(1, 2)

        def local(t):
            return sp.local(t.transpose(1, 2), L).transpose(1, 2)

        full_positions = positions[:, :1] + torch.arange(sp.size * L)
        shards = Shards(sp, sp.padded(mask, L, False), full_positions)
        regions = shards.earlier(seq(k), seq(v))
        ql, kl, vl = (shards.fold(local(t)) for t in (q, k, v))
        key_mask = shards.fold_rows(sp.local(mask, L, False))
        q_pos = shards.fold_rows(sp.local(full_positions, L))
        features = dict(sliding_window=window, q_positions=q_pos) if window else {}
        out = shards.unfold(multi_region_attention_ref(ql, kl, vl, regions, key_mask, scale=d**-0.5, **features))
        real = sp.local(mask, L, False)  # (n, L): this rank's real tokens
        expected = local(seq(truth)).transpose(1, 2)
        torch.testing.assert_close(out[real], expected[real], rtol=1e-12, atol=1e-12)


def test_split_is_checked():
    with pytest.raises(ValueError, match="split must be one of"):
        SequenceParallel(None, 0, 2, split="ring")


HEAD_SPLITS = [(4, 2, 2, 1), (4, 1, 2, 2), (4, 2, 4, 2), (8, 2, 4, 2), (12, 3, 4, 4), (6, 3, 2, 2)]
"""(query heads, K/V heads, group size, K/V head repeat) of layers the head exchange splits."""


@pytest.mark.parametrize("H,Hkv,size,repeat", HEAD_SPLITS + [(3, 1, 2, None), (6, 2, 4, None)])
def test_head_split_repeats_kv_heads_to_a_multiple_of_the_group(H, Hkv, size, repeat):
    """``head_split``: K/V heads repeated to lcm(Hkv, size), None where size does not divide the query heads; rank
    by rank, attention of its query-head slice over its slice of the repeated K/V heads equals those heads of the
    whole GQA attention (fp64)."""
    split = head_split(SequenceParallel(None, 0, size), H, Hkv)
    assert (split and split.repeat) == repeat
    if split is None:
        return
    g = torch.Generator().manual_seed(H * 10 + Hkv)
    n, T, d = 2, 9, 4
    q = torch.randn(n, H, T, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, Hkv, T, d, generator=g, dtype=torch.float64) for _ in range(2))
    truth = multi_region_attention_ref(q, k, v, [], None, scale=0.5)
    kr, vr = (t.repeat_interleave(repeat, 1) for t in (k, v))
    h, hkv = H // size, kr.shape[1] // size
    for r in range(size):
        out = multi_region_attention_ref(
            q[:, r * h : (r + 1) * h],
            kr[:, r * hkv : (r + 1) * hkv],
            vr[:, r * hkv : (r + 1) * hkv],
            [],
            None,
            scale=0.5,
        )
        torch.testing.assert_close(out, truth[:, r * h : (r + 1) * h], rtol=1e-12, atol=1e-12)


def test_head_split_checks_the_head_counts():
    with pytest.raises(ValueError, match="multiple of K/V heads, got 4 and 3"):
        head_split(SequenceParallel(None, 0, 2), 4, 3)


def test_exchange_is_checked():
    with pytest.raises(ValueError, match="exchange must be one of"):
        SequenceParallel(None, 0, 2, exchange="ring")

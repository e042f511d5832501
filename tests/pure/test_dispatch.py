"""Dispatch layout and row movement pairs against naive Python, plus float64 gradcheck."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fn.pure.dispatch import (
    combine_sum_bwd,
    combine_sum_fwd,
    gather_sum_bwd,
    gather_sum_fwd,
    layout,
    permute_bwd,
    permute_fwd,
    unpermute_bwd,
    unpermute_fwd,
    weighted_combine_bwd,
    weighted_combine_fwd,
    weighted_gather_sum_bwd,
    weighted_gather_sum_fwd,
)
from moe_fn.testing import assert_all_close_to_ref, assert_close_to_ref


class _Pair(torch.autograd.Function):
    """Autograd over one pure pair: forward = fwd, backward = bwd (for gradcheck)."""

    @staticmethod
    def forward(ctx, fwd, bwd, static, n_diff, *args):
        out, res = fwd(*args, **static)
        ctx.res, ctx.bwd, ctx.n_diff, ctx.n_args = res, bwd, n_diff, len(args)
        return out

    @staticmethod
    def backward(ctx, d_out):
        grads = ctx.bwd(ctx.res, d_out)
        grads = grads if isinstance(grads, tuple) else (grads,)
        assert len(grads) == ctx.n_diff
        return (None,) * 4 + grads + (None,) * (ctx.n_args - ctx.n_diff)


def _apply(fwd, bwd, static, n_diff, *args):
    return _Pair.apply(fwd, bwd, static, n_diff, *args)


@st.composite
def routes(draw, max_tokens=12, max_k=4, max_experts=8):
    """``topk_idx (T, k)`` over E experts; the drawn experts may leave some with no rows."""
    t = draw(st.integers(0, max_tokens))
    k = draw(st.integers(1, max_k))
    e = draw(st.integers(1, max_experts))
    # Bias towards few distinct experts so empty experts are common.
    used = draw(st.lists(st.integers(0, e - 1), min_size=1, max_size=e, unique=True))
    flat = draw(st.lists(st.sampled_from(used), min_size=t * k, max_size=t * k))
    return torch.tensor(flat, dtype=torch.int64).reshape(t, k), e


def naive_layout(topk_idx, e):
    flat = topk_idx.reshape(-1).tolist()
    counts = [flat.count(x) for x in range(e)]
    offs, acc = [], 0
    for c in counts:
        acc += c
        offs.append(acc)
    perm = sorted(range(len(flat)), key=lambda r: (flat[r], r))
    inv = [0] * len(flat)
    for i, r in enumerate(perm):
        inv[r] = i
    return counts, offs, perm, inv


# ----------------------------------------------------------------------------- layout


@settings(max_examples=150, deadline=None)
@given(route=routes(), idx32=st.booleans())
def test_layout_against_naive(route, idx32):
    topk_idx, e = route
    if idx32:
        topk_idx = topk_idx.to(torch.int32)
    counts, offs, perm, inv = layout(topk_idx, e)
    assert counts.dtype == torch.int64 and offs.dtype == torch.int32
    assert perm.dtype == torch.int64 and inv.dtype == torch.int64
    n_counts, n_offs, n_perm, n_inv = naive_layout(topk_idx, e)
    assert counts.tolist() == n_counts
    assert offs.tolist() == n_offs
    assert perm.tolist() == n_perm
    assert inv.tolist() == n_inv
    n = topk_idx.numel()
    assert torch.equal(perm[inv], torch.arange(n)) and torch.equal(inv[perm], torch.arange(n))
    flat = topk_idx.reshape(-1).long()
    # Sorted by expert; stable: within one expert the flattened rows ascend.
    sorted_e = flat[perm]
    assert bool((sorted_e[1:] >= sorted_e[:-1]).all())
    same = sorted_e[1:] == sorted_e[:-1]
    assert bool((perm[1:][same] > perm[:-1][same]).all())
    # Segment e of the sorted rows holds exactly expert e.
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), offs.long()[:-1]])
    for x in range(e):
        assert bool((sorted_e[starts[x]:offs[x]] == x).all())
    assert int(offs[-1]) == n


@settings(max_examples=100, deadline=None)
@given(route=routes(), h=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_permute_unpermute_against_naive(route, h, seed):
    topk_idx, e = route
    t, k = topk_idx.shape
    _, _, perm, inv = layout(topk_idx, e)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed))
    rows, _ = permute_fwd(x, perm, k)
    naive = torch.stack([x[p // k] for p in perm.tolist()]) if t else x.new_zeros(0, h)
    assert torch.equal(rows, naive)
    # Round trip: back in (token, k) order each token appears k times.
    rows_tk, _ = unpermute_fwd(rows, inv)
    assert torch.equal(rows_tk, x.repeat_interleave(k, dim=0))
    # Backward of permute: each token receives the sum of its k rows' gradients.
    _, res = permute_fwd(x, perm, k)
    d_rows = torch.randn(t * k, h, generator=torch.Generator().manual_seed(seed + 1))
    d_x = permute_bwd(res, d_rows)
    # The naive sum in float32 (plain) and float64 (oracle): another summation order.
    ref, ref64 = torch.zeros(t, h), torch.zeros(t, h, dtype=torch.float64)
    for i, p in enumerate(perm.tolist()):
        ref[p // k] += d_rows[i]
        ref64[p // k] += d_rows[i].double()
    assert_close_to_ref(d_x, ref, ref64)
    # Backward of unpermute: a gather by perm.
    _, ures = unpermute_fwd(rows, inv)
    d_tk = torch.randn(t * k, h, generator=torch.Generator().manual_seed(seed + 2))
    assert torch.equal(unpermute_bwd(ures, d_tk), d_tk[perm])


# ----------------------------------------------------------------------------- combine


@settings(max_examples=60, deadline=None)
@given(t=st.integers(0, 6), k=st.integers(1, 4), h=st.integers(1, 5),
       seed=st.integers(0, 2**31 - 1))
def test_weighted_combine_against_loops(t, k, h, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(t * k, h, generator=gen, dtype=torch.float64)
    w = torch.rand(t, k, generator=gen, dtype=torch.float64)
    out, res = weighted_combine_fwd(rows, w, k)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            ref[i] += rows[i * k + j] * w[i, j]
    torch.testing.assert_close(out, ref)
    d_out = torch.randn(t, h, generator=gen, dtype=torch.float64)
    d_rows, d_w = weighted_combine_bwd(res, d_out)
    ref_rows = torch.zeros_like(rows)
    ref_w = torch.zeros_like(w)
    for i in range(t):
        for j in range(k):
            ref_rows[i * k + j] = d_out[i] * w[i, j]
            ref_w[i, j] = (d_out[i] * rows[i * k + j]).sum()
    torch.testing.assert_close(d_rows, ref_rows)
    torch.testing.assert_close(d_w, ref_w)
    assert weighted_combine_bwd(res, d_out, needs=(False, True))[0] is None
    assert weighted_combine_bwd(res, d_out, needs=(True, False))[1] is None
    s, sres = combine_sum_fwd(rows, k)
    torch.testing.assert_close(s, rows.reshape(t, k, h).sum(1))
    torch.testing.assert_close(combine_sum_bwd(sres, d_out), d_out.repeat_interleave(k, dim=0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_half_accumulates_in_fp32(dtype):
    gen = torch.Generator().manual_seed(0)
    t, k, h = 16, 8, 32
    rows = torch.randn(t * k, h, generator=gen).to(dtype)
    w = torch.rand(t, k, generator=gen)
    out, res = weighted_combine_fwd(rows, w, k)
    assert out.dtype == dtype
    ref = (rows.float().reshape(t, k, h) * w[:, :, None]).sum(1).to(dtype)
    assert torch.equal(out, ref)  # one fp32 sum, cast once
    d_rows, d_w = weighted_combine_bwd(res, torch.ones(t, h, dtype=dtype))
    assert d_rows.dtype == dtype and d_w.dtype == torch.float32
    s, _ = combine_sum_fwd(rows, k)
    assert torch.equal(s, rows.float().reshape(t, k, h).sum(1).to(dtype))
    x = torch.randn(t, h, generator=gen).to(dtype)
    _, _, perm, _ = layout(torch.randint(0, 4, (t, k), generator=gen), 4)
    _, pres = permute_fwd(x, perm, k)
    d_x = permute_bwd(pres, rows)
    assert d_x.dtype == dtype
    inv = torch.argsort(perm)
    assert torch.equal(d_x, rows[inv].float().reshape(t, k, h).sum(1).to(dtype))


# ----------------------------------------------------------------------------- gradcheck


def _f64(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)


def test_gradcheck_all_pairs():
    gen = torch.Generator().manual_seed(3)
    t, k, e, h = 5, 3, 6, 4
    topk_idx = torch.randint(0, e - 2, (t, k), generator=gen)  # experts 4, 5 stay empty
    _, _, perm, inv = layout(topk_idx, e)
    x = _f64(t, h, gen=gen)
    assert torch.autograd.gradcheck(
        lambda x: _apply(permute_fwd, permute_bwd, {"top_k": k}, 1, x, perm), (x,))
    rows = _f64(t * k, h, gen=gen)
    assert torch.autograd.gradcheck(
        lambda r: _apply(unpermute_fwd, unpermute_bwd, {}, 1, r, inv), (rows,))
    w = _f64(t, k, gen=gen)
    assert torch.autograd.gradcheck(
        lambda r, w: _apply(weighted_combine_fwd, weighted_combine_bwd, {"top_k": k}, 2, r, w),
        (rows, w))
    assert torch.autograd.gradcheck(
        lambda r: _apply(combine_sum_fwd, combine_sum_bwd, {"top_k": k}, 1, r), (rows,))
    # The whole path against autograd of the naive composition.
    out = _apply(weighted_combine_fwd, weighted_combine_bwd, {"top_k": k}, 2,
                 _apply(unpermute_fwd, unpermute_bwd, {}, 1,
                        _apply(permute_fwd, permute_bwd, {"top_k": k}, 1, x, perm) * 2.0,
                        inv), w)
    naive = (x.repeat_interleave(k, 0).reshape(t, k, h) * 2.0 * w[:, :, None]).sum(1)
    torch.testing.assert_close(out, naive)
    d = torch.randn(t, h, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(out, (x, w), d),
                               torch.autograd.grad(naive, (x, w), d))


def test_zero_stride_grads():
    t, k, h = 4, 2, 3
    rows = torch.randn(t * k, h)
    w = torch.rand(t, k)
    _, res = weighted_combine_fwd(rows, w, k)
    d = torch.ones(1, 1).expand(t, h)
    a = weighted_combine_bwd(res, d)
    b = weighted_combine_bwd(res, d.contiguous())
    # d_w sums products whose layout may follow d's strides: the rule, not the bits.
    _, res64 = weighted_combine_fwd(rows.double(), w.double(), k)
    assert_all_close_to_ref(a, b, weighted_combine_bwd(res64, d.double()), ("d_rows", "d_w"))
    # A copy of d, and a gather into a fresh tensor before the sum: the same bits.
    _, sres = combine_sum_fwd(rows, k)
    assert torch.equal(combine_sum_bwd(sres, d), combine_sum_bwd(sres, d.contiguous()))
    _, _, perm, inv = layout(torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1]]), 2)
    _, pres = permute_fwd(torch.randn(t, h), perm, k)
    dr = torch.ones(1, 1).expand(t * k, h)
    assert torch.equal(permute_bwd(pres, dr), permute_bwd(pres, dr.contiguous()))


# ----------------------------------------------------------------------------- errors


def test_bad_args_raise():
    with pytest.raises(ValueError, match="topk_idx"):
        layout(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match="topk_idx"):
        layout(torch.tensor([[-1, 0]]), 4)
    with pytest.raises(ValueError, match="num_experts"):
        layout(torch.tensor([[0, 1]]), 0)
    with pytest.raises(TypeError, match="topk_idx"):
        layout(torch.tensor([[0.0, 1.0]]), 2)
    with pytest.raises(ValueError, match="top_k"):
        permute_fwd(torch.zeros(2, 3), torch.arange(2), 0)
    with pytest.raises(ValueError, match="perm"):
        permute_fwd(torch.zeros(2, 3), torch.arange(3), 2)
    with pytest.raises(ValueError, match="inv_perm"):
        unpermute_fwd(torch.zeros(4, 3), torch.arange(3))
    with pytest.raises(ValueError, match="weights"):
        weighted_combine_fwd(torch.zeros(4, 3), torch.zeros(2, 3), 2)
    with pytest.raises(ValueError, match="rows_tk"):
        weighted_combine_fwd(torch.zeros(5, 3), torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="rows_tk"):
        combine_sum_fwd(torch.zeros(5, 3), 2)
    with pytest.raises(ValueError, match="top_k"):
        combine_sum_fwd(torch.zeros(4, 3), True)


def test_empty():
    counts, offs, perm, inv = layout(torch.zeros(0, 2, dtype=torch.int64), 3)
    assert counts.tolist() == [0, 0, 0] and offs.tolist() == [0, 0, 0]
    assert perm.numel() == 0 and inv.numel() == 0
    rows, res = permute_fwd(torch.zeros(0, 4), perm, 2)
    assert rows.shape == (0, 4) and permute_bwd(res, rows).shape == (0, 4)
    out, res = weighted_combine_fwd(torch.zeros(0, 4), torch.zeros(0, 2), 2)
    assert out.shape == (0, 4)


def test_compile_fullgraph_route_and_move():
    """Router and dispatch pairs (residuals included) trace under fullgraph compile."""
    from moe_fn.pure.router import router_bwd, router_fwd

    def f(logits, bias, x, d_w):
        (idx, w), rres = router_fwd(logits, bias, top_k=2, score_func="sigmoid",
                                    norm_topk_prob=True, n_group=2, topk_group=1,
                                    routed_scaling_factor=2.0)
        d_logits = router_bwd(rres, d_w)
        counts, offs, perm, inv = layout(idx, logits.shape[1])
        rows, pres = permute_fwd(x, perm, 2)
        rows_tk, ures = unpermute_fwd(rows, inv)
        out, cres = weighted_combine_fwd(rows_tk, w, 2)
        d_rows, _ = weighted_combine_bwd(cres, torch.ones_like(out))
        d_x = permute_bwd(pres, unpermute_bwd(ures, d_rows))
        return out, d_logits, d_x, counts, offs

    gen = torch.Generator().manual_seed(0)
    # A cotangent of the weights other than ones: normalised weights sum to a constant, so
    # ones would make d_logits zero up to rounding noise.
    args = (torch.randn(6, 8, generator=gen), torch.randn(8, generator=gen),
            torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen))
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    want, want64 = f(*args), f(*(a.double() for a in args))
    # The same route (counts, offsets) exactly; the floats within twice eager float32's error
    # of float64 (the compiled graph may order the sums otherwise).
    assert torch.equal(got[3], want[3]) and torch.equal(got[4], want[4])
    assert torch.equal(want[3], want64[3])
    assert_all_close_to_ref(got[:3], want[:3], want64[:3], ("out", "d_logits", "d_x"))


def test_peer_gather_pairs_match_a_naive_loop():
    from moe_fn.pure.dispatch import peer_gather, peer_partial_sum, slot_sum
    g = torch.Generator().manual_seed(7)
    peers = (torch.randn(4, 3, generator=g, dtype=torch.float64),
             torch.zeros(0, 3, dtype=torch.float64),  # a rank that exposed nothing
             torch.randn(6, 3, generator=g, dtype=torch.float64))
    src_rank = torch.tensor([2, 0, 2, 0, 2, 0])
    src_idx = torch.tensor([11, 7, 0, 1, 5, 3])
    out = peer_gather(peers, src_rank, src_idx, row_div=2)
    for i in range(6):
        assert torch.equal(out[i], peers[int(src_rank[i])][int(src_idx[i]) // 2])
    vals = (torch.arange(4.0), torch.zeros(0), torch.arange(10.0, 16.0))
    v = peer_gather(vals, src_rank, src_idx // 2)
    assert v.tolist() == [float(vals[int(s)][int(j) // 2]) for s, j in zip(src_rank, src_idx)]
    # Per-token partials over slot groups (k = 3; group 1 has no slot), then their sum
    # over the ranks that hold each token's rows.
    rows = torch.randn(5, 3, generator=g, dtype=torch.float64)
    w = torch.rand(5, generator=g, dtype=torch.float64)
    slots = torch.tensor([4, -1, 0, -1, -1, -1, 2, 3, 1], dtype=torch.int32)
    part = slot_sum(rows, slots, 3, w)
    assert torch.equal(part[1], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(part[0], w[4] * rows[4] + w[0] * rows[0])
    torch.testing.assert_close(part[2], w[2] * rows[2] + w[3] * rows[3] + w[1] * rows[1])
    half = slot_sum(rows.to(torch.bfloat16), slots, 3)
    assert half.dtype == torch.float32  # accumulated and kept in float32
    peers = (torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g))
    home_rank = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.int32)  # 2 tokens, k = 3
    out = peer_partial_sum(peers, home_rank, 1, 3, 3, torch.float64)  # rank 1 of 3 tokens max
    torch.testing.assert_close(out[0], peers[0][3].double() + peers[1][3].double())
    torch.testing.assert_close(out[1], peers[1][4].double())


def test_masked_gather_sum_leaves_absent_slots_out_even_beside_inf():
    """Absent slots (-1) read row 0 as a stand-in; an inf there must not turn the other
    tokens' sums into NaN (inf * 0)."""
    from moe_fn.pure.dispatch import masked_gather_sum

    rows = torch.tensor([[float("inf")], [1.0], [2.0]])
    table = torch.tensor([[0, -1], [1, 2], [-1, 2]])
    assert torch.equal(masked_gather_sum(rows, table), torch.tensor([[float("inf")], [3.0],
                                                                      [2.0]]))
    w = torch.tensor([0.5, 2.0, 3.0])
    assert torch.equal(masked_gather_sum(rows, table, w),
                       torch.tensor([[float("inf")], [8.0], [6.0]]))


@settings(max_examples=60, deadline=None)
@given(route=routes(), h=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_fused_combines_equal_the_pairs_composed(route, h, seed):
    """The exchanges' fused forms (unpermute and the sum over k in one step) against the
    pairs they fuse, forward and backward, float64: ``gather_sum`` is ``combine_sum`` after
    ``unpermute``; ``weighted_gather_sum`` is ``weighted_combine`` after ``unpermute``."""
    topk_idx, e = route
    t, k = topk_idx.shape
    _, _, perm, inv = layout(topk_idx, e)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(t * k, h, generator=g, dtype=torch.float64)  # in sorted order
    w = torch.rand(t, k, generator=g, dtype=torch.float64)
    d_out = torch.randn(t, h, generator=g, dtype=torch.float64)
    rows_tk, ures = unpermute_fwd(rows, inv)

    s_pairs, sres = combine_sum_fwd(rows_tk, k)
    s_fused, fres = gather_sum_fwd(rows, inv, k)
    torch.testing.assert_close(s_fused, s_pairs, rtol=1e-12, atol=1e-12)
    (d_fused,) = gather_sum_bwd(fres, d_out)
    torch.testing.assert_close(d_fused, unpermute_bwd(ures, combine_sum_bwd(sres, d_out)),
                               rtol=1e-12, atol=1e-12)

    o_pairs, wres = weighted_combine_fwd(rows_tk, w, k)
    o_fused, _ = weighted_gather_sum_fwd(rows, inv, w.reshape(-1), k)
    torch.testing.assert_close(o_fused, o_pairs, rtol=1e-12, atol=1e-12)
    d_tk, d_w = weighted_combine_bwd(wres, d_out)
    # The fused backward is indexed by position (here: sorted order, whose rows are perm).
    d_rows_fused, d_w_fused = weighted_gather_sum_bwd(d_out, rows, perm, w.reshape(-1), k)
    torch.testing.assert_close(d_rows_fused, unpermute_bwd(ures, d_tk), rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(d_w_fused, d_w.reshape(-1), rtol=1e-12, atol=1e-12)

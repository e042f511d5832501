"""The peer-memory pull kernels against plain indexing, with the "peers" as separate
tensors of one process (on the GPU where there is one, else in the Triton interpreter),
and the plain fallbacks of ``moe_fn.comm.peer_memory`` against a naive loop."""

from __future__ import annotations

import pytest
import torch

from moe_fn.comm.peer_memory import PeerView, pull_partials, pull_rows, write_slot_sums
from moe_fn.kernels.peer import (
    launch_pull_partials,
    launch_pull_rows,
    launch_pull_token_rows,
    launch_slot_sum,
)
from moe_fn.pure.dispatch import peer_partial_sum, slot_sum
from moe_fn.testing import assert_close_to_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _peers(ep, n, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = tuple(torch.randn(n, width, generator=g).to(dtype).to(DEV) for _ in range(ep))
    vals = tuple(torch.randn(n, generator=g).to(DEV) for _ in range(ep))
    return rows, vals


def _index(ep, n_out, n_src, seed):
    g = torch.Generator().manual_seed(seed + 1)
    src_rank = torch.randint(0, ep, (n_out,), generator=g, dtype=torch.int32).to(DEV)
    src_idx = torch.randint(0, n_src, (n_out,), generator=g).to(DEV)
    return src_rank, src_idx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width,row_div", [(64, 1), (40, 3), (2100, 2)])
def test_pull_rows_reads_every_peer(dtype, width, row_div):
    ep, n_src = 3, 12
    rows, vals = _peers(ep, n_src, width, dtype, 0)
    src_rank, src_idx = _index(ep, 21, n_src * row_div, 0)
    vals = tuple(torch.cat([v] * row_div) for v in vals)  # values indexed before the divide
    out, vout = launch_pull_rows(rows, vals, 1, src_rank, src_idx, row_div=row_div,
                                 num_programs=2)
    for i in range(21):
        s, j = int(src_rank[i]), int(src_idx[i])
        assert torch.equal(out[i], rows[s][j // row_div])
        assert torch.equal(vout[i], vals[s][j])
    only_vals = launch_pull_rows(None, vals, 0, src_rank, src_idx, num_programs=3)
    assert only_vals[0] is None and torch.equal(only_vals[1], vout)
    only_rows = launch_pull_rows(rows, None, 2, src_rank, src_idx, row_div=row_div,
                                 num_programs=1)
    assert only_rows[1] is None and torch.equal(only_rows[0], out)


def _naive_slot_sum(y, slots, k, w=None, dtype=None):
    """Group g's sum of ``[w[s] *] y[s]`` over its slots ``s = slots[g*k + j] >= 0``, in
    ``dtype`` (default y's), row by row: the oracle and the plain arm of ``slot_sum``."""
    dtype = dtype or y.dtype
    out = torch.zeros(slots.numel() // k, y.shape[1], dtype=dtype, device=y.device)
    for g in range(out.shape[0]):
        for s in slots[g * k:(g + 1) * k].tolist():
            if s >= 0:
                row = y[s].to(dtype)
                out[g] += row if w is None else w[s].to(dtype) * row
    return out


def _naive_partial_sum(peers, home_rank, rank, max_tokens, k, dtype):
    """Token t's row: ``peers[o][rank * max_tokens + t]`` summed over the distinct ranks o
    among ``home_rank[t*k:(t+1)*k]`` in rank order, in the peers' dtype, then cast."""
    n_tok = home_rank.numel() // k
    out = torch.zeros(n_tok, peers[0].shape[1], dtype=peers[0].dtype, device=peers[0].device)
    for t in range(n_tok):
        for o in sorted(set(home_rank[t * k:(t + 1) * k].tolist())):
            out[t] += peers[o][rank * max_tokens + t]
    return out.to(dtype)


def _token_slots(ep, n_tok, k, seed, fill=0.6):
    """Slots of a random expert-major layout: each (rank, token, j) row lands at a distinct
    output position, or nowhere (-1)."""
    g = torch.Generator().manual_seed(seed)
    used = torch.rand(ep * n_tok * k, generator=g) < fill
    slots = torch.full((ep * n_tok * k,), -1, dtype=torch.int32)
    slots[used] = torch.randperm(int(used.sum()), generator=g).to(torch.int32)
    return slots.to(DEV), int(used.sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width,k", [(64, 4), (40, 3), (2100, 2), (16, 1)])
@pytest.mark.parametrize("with_values", [False, True])
def test_pull_token_rows_writes_each_tokens_row_to_all_its_rows(dtype, width, k,
                                                              with_values):
    ep, n_tok = 3, 5
    rows, vals = _peers(ep, n_tok, width, dtype, 7)
    vals = tuple(torch.cat([v] * k) for v in vals)  # values per (token, k) row
    slots, n = _token_slots(ep, n_tok, k, width + k)
    # The same moves as a row-by-row pull of (rank, flat index) per output row.
    where = torch.nonzero(slots >= 0).flatten()
    order = slots[where].long()
    src_rank = torch.empty(n, dtype=torch.int32, device=DEV)
    src_idx = torch.empty(n, dtype=torch.int64, device=DEV)
    src_rank[order] = (where // (n_tok * k)).to(torch.int32)
    src_idx[order] = where % (n_tok * k)
    want, want_v = launch_pull_rows(rows, vals, 1, src_rank, src_idx, row_div=k, num_programs=2)
    for i in range(n):
        assert torch.equal(want[i], rows[int(src_rank[i])][int(src_idx[i]) // k])
    for progs, segs in ((1, 1), (2, 4), (64, 8)):
        out, vout = launch_pull_token_rows(rows, vals if with_values else None, 1, slots, n,
                                           k, num_programs=progs, tokens_per_program=segs)
        assert torch.equal(out, want), (progs, segs)
        assert (vout is None) if not with_values else torch.equal(vout, want_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_slot_sums_then_partials_sum_each_tokens_rows_in_float32(dtype, weighted):
    ep, n_tok, k, width = 3, 5, 3, 48
    g = torch.Generator().manual_seed(11)
    partials, ref64 = [], []
    for o in range(ep):  # each rank sums the rows it computed, per (source, token)
        slots, n = _token_slots(ep, n_tok, k, 20 + o)
        y = torch.randn(n, width, generator=g).to(dtype).to(DEV)
        w = torch.rand(n, generator=g).to(DEV) if weighted else None
        out = torch.full((ep * n_tok, width), float("nan"), device=DEV)
        launch_slot_sum(y, slots, k, out, w, num_programs=2, tokens_per_program=2)
        pure = slot_sum(y, slots, k, w)
        # Plain: the naive sum in float32 (slot_sum's accumulation for every dtype here).
        plain = _naive_slot_sum(y, slots, k, w, torch.float32)
        want64 = _naive_slot_sum(y, slots, k, w, torch.float64)
        used = (slots.view(-1, k) >= 0).any(1)
        assert torch.isnan(out[~used]).all()  # groups without a row are left alone
        assert_close_to_ref(out[used], plain[used], want64[used])
        assert_close_to_ref(pure[used], plain[used], want64[used])
        partials.append(out.nan_to_num(0.0))
        ref64.append(want64)
    # Rank 1's tokens: each summed over the ranks computing any of its rows.
    home_rank = torch.randint(0, ep, (4 * k,), generator=g, dtype=torch.int32).to(DEV)
    vals = tuple(torch.randn(7, generator=g).to(DEV) for _ in range(ep))
    vpos = torch.randint(0, 7, (4 * k,), generator=g).to(DEV)
    for progs, tok in ((1, 1), (3, 2), (64, 8)):
        out, vout = launch_pull_partials(tuple(partials), vals, 1, home_rank, vpos, k, n_tok,
                                         dtype, num_programs=progs, tokens_per_program=tok)
        plain = _naive_partial_sum(tuple(partials), home_rank, 1, n_tok, k, dtype)
        exact = _naive_partial_sum(tuple(p.double() for p in partials), home_rank, 1, n_tok,
                                   k, torch.float64)
        # (float32 sums in the same order; the rounding to bfloat16 may differ: the
        # interpreter truncates.)
        assert_close_to_ref(out, plain, exact, f"{progs} {tok}")
        pure = peer_partial_sum(tuple(partials), home_rank, 1, n_tok, k, dtype)
        assert_close_to_ref(pure, plain, exact, f"pure {progs} {tok}")
        for i in range(4 * k):
            assert torch.equal(vout[i], vals[int(home_rank[i])][int(vpos[i])])
    want64 = torch.stack([sum(ref64[o][n_tok + t] for o in set(home_rank[t * k:(t + 1) * k]
                                                                   .tolist())) for t in range(4)])
    assert_close_to_ref(out, _naive_partial_sum(tuple(r.to(dtype) for r in ref64), home_rank,
                                                1, n_tok, k, dtype), want64)


def test_fallbacks_agree_with_the_kernels():
    # The plain path (CPU tensors without Triton, float64 anywhere) against the kernels.
    ep, n_src, width, k, t = 3, 9, 24, 2, 8
    rows, vals = _peers(ep, n_src, width, torch.float32, 2)
    src_rank, src_idx = _index(ep, t * k, n_src, 2)
    view = PeerView(1, tuple(r.double() for r in rows), vals)
    out, vout = pull_rows(view, src_rank, src_idx)
    kout, kvout = launch_pull_rows(rows, vals, 1, src_rank, src_idx, num_programs=4)
    torch.testing.assert_close(out, kout.double(), rtol=0, atol=0)
    assert torch.equal(vout, kvout)
    home_rank, vpos = src_rank[:2 * k], src_idx[:2 * k]  # 2 tokens of at most 3 per rank
    part_view = PeerView(1, tuple(r.double() for r in rows), vals)
    p, pv = pull_partials(part_view, home_rank, vpos, 3, k, torch.float64)
    kp, kpv = launch_pull_partials(rows, vals, 1, home_rank, vpos, k, 3, torch.float32,
                                   num_programs=4)
    # float32 sums in the kernel: the rule against the float64 fallback, with the pure
    # function in float32 as plain PyTorch.
    plain = _naive_partial_sum(rows, home_rank, 1, 3, k, torch.float32)
    exact = _naive_partial_sum(tuple(r.double() for r in rows), home_rank, 1, 3, k,
                               torch.float64)
    assert_close_to_ref(kp.cpu(), plain.cpu(), exact.cpu(), "pull_partials")
    torch.testing.assert_close(p, exact, rtol=0, atol=0)  # same sums in the same order
    assert torch.equal(pv, kpv)
    slots = torch.tensor([3, -1, 0, 5, 1, -1], dtype=torch.int32, device=DEV)
    out = write_slot_sums(torch.zeros(3, width, dtype=torch.float64, device=DEV),
                          rows[0].double(), slots, 2)
    kout = launch_slot_sum(rows[0], slots, 2, torch.zeros(3, width, device=DEV), num_programs=2)
    plain = _naive_slot_sum(rows[0], slots, 2)
    exact = _naive_slot_sum(rows[0], slots, 2, dtype=torch.float64)
    assert_close_to_ref(kout.cpu(), plain.cpu(), exact.cpu(), "slot_sum")
    assert_close_to_ref(out.cpu(), plain.double().cpu(), exact.cpu(), "write_slot_sums")


def test_peers_off_the_vector_width_are_read_row_by_row_not_misread():
    # 17 floats apart: the kernels' 16-byte hint would be false, so it is lowered.
    base = torch.randn(2 * 16 + 1, 16, device=DEV)
    rows = (base[:16], base.view(-1)[17:17 + 256].view(16, 16))
    src_rank, src_idx = _index(2, 9, 16, 3)
    out, _ = launch_pull_rows(rows, None, 0, src_rank, src_idx, num_programs=2)
    for i in range(9):
        assert torch.equal(out[i], rows[int(src_rank[i])][int(src_idx[i])])


def test_bad_arguments_are_refused():
    rows, vals = _peers(2, 6, 8, torch.float32, 5)
    src_rank, src_idx = _index(2, 6, 6, 5)
    with pytest.raises(ValueError, match="contiguous tensors of one dtype"):
        launch_pull_rows((rows[0], rows[1].t().contiguous().t()), None, 0, src_rank, src_idx,
                         num_programs=1)
    with pytest.raises(ValueError, match="contiguous tensors of one dtype"):
        launch_pull_rows((rows[0], rows[1].double()), None, 0, src_rank, src_idx,
                         num_programs=1)
    with pytest.raises(ValueError, match="one entry per row"):
        launch_pull_rows(rows, None, 0, src_rank[:3], src_idx, num_programs=1)
    with pytest.raises(ValueError, match="top_k"):
        launch_pull_partials(rows, None, 0, src_rank[:5], None, 2, 3, torch.float32,
                             num_programs=1)
    with pytest.raises(ValueError, match="values need values_pos"):
        launch_pull_partials(rows, vals, 0, src_rank[:4], None, 2, 3, torch.float32,
                             num_programs=1)
    slots, n = _token_slots(2, 6, 2, 5)
    with pytest.raises(ValueError, match="token_slots must hold top_k"):
        launch_pull_token_rows(rows, None, 0, slots[:-1], n, 2, num_programs=1)
    with pytest.raises(ValueError, match="values must hold top_k"):
        launch_pull_token_rows(rows, vals, 0, slots, n, 2, num_programs=1)
    with pytest.raises(ValueError, match="one row per group"):
        launch_slot_sum(rows[0], slots, 2, torch.zeros(5, 8, device=DEV), num_programs=1)
    with pytest.raises(ValueError, match="contiguous columns"):
        launch_slot_sum(rows[0], slots, 2, torch.zeros(8, 12, device=DEV).t(), num_programs=1)


@pytest.mark.parametrize("width", [0, 5])
def test_empty_and_odd_shapes(width):
    rows, vals = _peers(2, 4, width, torch.bfloat16, 6)
    src_rank, src_idx = _index(2, 6, 4, 6)
    out, vout = launch_pull_rows(rows, vals, 1, src_rank, src_idx, num_programs=2)
    for i in range(6):
        assert torch.equal(out[i], rows[int(src_rank[i])][int(src_idx[i])])
        assert torch.equal(vout[i], vals[int(src_rank[i])][int(src_idx[i])])
    empty = src_idx[:0]
    out, vout = launch_pull_rows(rows, vals, 1, src_rank[:0], empty, num_programs=2)
    assert out.shape == (0, width) and vout.shape == (0,)
    # top_k = 1, and rows and partials whose row strides break the vector width.
    y = torch.randn(6, width + 3, device=DEV).to(torch.bfloat16)[:, :width]
    slots = torch.tensor([4, -1, 0, 5, 1, 2, -1, 3], dtype=torch.int32, device=DEV)
    part = torch.zeros(8, width + 1, device=DEV)[:, :width]
    launch_slot_sum(y, slots, 1, part, num_programs=3)
    for g in range(8):
        i = int(slots[g])
        assert torch.equal(part[g], y[i].float() if i >= 0 else torch.zeros(width, device=DEV))

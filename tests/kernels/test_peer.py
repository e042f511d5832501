"""The peer-memory pull kernels against plain indexing, with the "peers" as separate
tensors of one process (on the GPU where there is one, else in the Triton interpreter),
and the plain fallbacks of ``moe_fn.comm.peer_memory`` against a naive loop."""

from __future__ import annotations

import pytest
import torch

from moe_fn.comm.peer_memory import PeerView, pull_gather_sum, pull_rows
from moe_fn.kernels.peer import launch_pull_gather_sum, launch_pull_rows, launch_pull_token_rows
from moe_fn.pure.dispatch import gather_sum_fwd, weighted_gather_sum_fwd
from tests.kernels.tolerance import assert_close_to_ref

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_pull_gather_sum_sums_each_tokens_rows_in_float32(dtype, weighted):
    ep, n_src, width, k, t = 2, 10, 48, 3, 7
    rows, vals = _peers(ep, n_src, width, dtype, 1)
    src_rank, src_pos = _index(ep, t * k, n_src, 1)
    w = torch.rand(t * k, device=DEV) if weighted else None
    out, vout = launch_pull_gather_sum(rows, vals, 0, src_rank, src_pos, k, w, num_programs=2)
    gathered = torch.stack([rows[int(s)][int(p)] for s, p in zip(src_rank, src_pos)])
    ref64 = torch.zeros(t, width, dtype=torch.float64, device=DEV)
    for i in range(t * k):
        ref64[i // k] += gathered[i].double() * (w[i].double() if weighted else 1.0)
        assert torch.equal(vout[i], vals[int(src_rank[i])][int(src_pos[i])])
    order = torch.arange(t * k, device=DEV)
    pure = (weighted_gather_sum_fwd(gathered, order, w, k) if weighted
            else gather_sum_fwd(gathered, order, k))[0]
    assert_close_to_ref(out, pure, ref64)


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
    w = torch.rand(t * k, device=DEV)
    s, sv = pull_gather_sum(view, src_rank, src_idx, k, w)
    ks, ksv = launch_pull_gather_sum(rows, vals, 1, src_rank, src_idx, k, w, num_programs=4)
    torch.testing.assert_close(s, ks.double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(sv, ksv)


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
        launch_pull_gather_sum(rows, None, 0, src_rank[:5], src_idx[:5], 2, num_programs=1)
    slots, n = _token_slots(2, 6, 2, 5)
    with pytest.raises(ValueError, match="token_slots must hold top_k"):
        launch_pull_token_rows(rows, None, 0, slots[:-1], n, 2, num_programs=1)
    with pytest.raises(ValueError, match="values must hold top_k"):
        launch_pull_token_rows(rows, vals, 0, slots, n, 2, num_programs=1)
    with pytest.raises(ValueError, match="local rows must be"):
        launch_pull_gather_sum(rows, None, 0, src_rank[:0], src_idx[:0], 2,
                               local=torch.zeros(3, 7, device=DEV), num_programs=1)


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
    # top_k = 1 and a local tensor whose row stride breaks the vector width.
    local = torch.randn(4, width + 3, device=DEV).to(torch.bfloat16)[:, :width]
    s, v = launch_pull_gather_sum(rows, vals, 0, src_rank, src_idx, 1, local=local,
                                  num_programs=3)
    for i in range(6):
        want = local[int(src_idx[i])] if int(src_rank[i]) == 0 else rows[1][int(src_idx[i])]
        assert torch.equal(s[i], want)
        assert torch.equal(v[i], vals[int(src_rank[i])][int(src_idx[i])])


def test_pull_gather_sum_reads_own_rows_in_place_and_values_at_their_own_positions():
    ep, n_src, width, k, t = 3, 10, 32, 2, 6
    rows, vals = _peers(ep, n_src, width, torch.float32, 4)
    # This rank's rows were never exposed: they come from a row-strided local tensor.
    local = torch.randn(n_src, width + 8, device=DEV)[:, :width]
    src_rank, src_pos = _index(ep, t * k, n_src, 4)
    vpos = torch.randint(0, n_src, (t * k,), generator=torch.Generator().manual_seed(9)).to(DEV)
    for launch_fn in ("kernel", "fallback"):
        if launch_fn == "kernel":
            out, vout = launch_pull_gather_sum(rows, vals, 1, src_rank, src_pos, k,
                                               local=local, values_pos=vpos, num_programs=3)
        else:
            out, vout = pull_gather_sum(PeerView(1, rows, vals), src_rank, src_pos, k,
                                        local=local, values_pos=vpos)
        want = torch.zeros(t, width, device=DEV)
        for i in range(t * k):
            s, p = int(src_rank[i]), int(src_pos[i])
            want[i // k] += local[p] if s == 1 else rows[s][p]
            assert torch.equal(vout[i], vals[s][int(vpos[i])]), launch_fn
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6, msg=launch_fn)

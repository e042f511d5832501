"""The fused-combine gather-sum: pure pair against a naive oracle, kernel against the pure
pair under the Triton interpreter, and the custom op's checks."""

from __future__ import annotations

import pytest
import torch

from moe_fn.kernels import gather_row_weight_bwd as kernel_gather_row_weight_bwd
from moe_fn.kernels import gather_sum as gs
from moe_fn.kernels import gather_sum_fwd as kernel_gather_sum
from moe_fn.kernels import gather_sum_own as kernel_gather_sum_own
from moe_fn.kernels import masked_gather_sum as kernel_masked_gather_sum
from moe_fn.kernels import weighted_gather_sum_bwd as kernel_weighted_bwd
from moe_fn.kernels import weighted_gather_sum_fwd as kernel_weighted_fwd
from moe_fn.pure.dispatch import (
    gather_sum_bwd,
    gather_sum_fwd,
    masked_gather_sum,
    weighted_gather_sum_bwd,
    weighted_gather_sum_fwd,
)
from moe_fn.pure.row_weight import RowWeightRes, row_weight_bwd
from moe_fn.testing import assert_all_close_to_ref, assert_close_to_ref

# The kernel runs on the GPU where there is one, else in the Triton interpreter (conftest).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def naive(rows, index, k):
    t = index.numel() // k
    out = torch.zeros(t, rows.shape[1], dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            out[i] += rows[int(index[i * k + j])].double()
    return out


def _case(t, k, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(t * k, h, generator=g).to(dtype)
    index = torch.randperm(t * k, generator=g)
    return rows, index


class _GatherSumPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index, top_k):
        out, ctx.res = gather_sum_fwd(rows, index, top_k)
        return out

    @staticmethod
    def backward(ctx, d_out):
        return gather_sum_bwd(ctx.res, d_out)[0], None, None


def test_pure_pair_matches_naive_and_gradcheck():
    rows, index = _case(5, 3, 7, torch.float64)
    out, res = gather_sum_fwd(rows, index, 3)
    torch.testing.assert_close(out, naive(rows, index, 3))
    r = rows.clone().requires_grad_()
    # gradcheck of the pair itself (its backward, not autograd of the forward's torch ops).
    torch.autograd.gradcheck(lambda x: _GatherSumPair.apply(x, index, 3), (r,))
    d = torch.randn_like(out)
    (d_rows,) = gather_sum_bwd(res, d)
    r2 = rows.clone().requires_grad_()
    naive_out = torch.stack([r2[index[i * 3:(i + 1) * 3]].sum(0) for i in range(5)])
    naive_out.backward(d)
    torch.testing.assert_close(d_rows, r2.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,h", [(6, 2, 33), (4, 8, 70), (0, 2, 16), (3, 1, 1)])
def test_kernel_matches_pure(dtype, t, k, h):
    rows, index = _case(t, k, h, dtype, seed=t + h)
    got = gs.launch_gather_sum(rows.to(DEV), index.to(DEV), k).cpu()
    ref64 = naive(rows, index, k) if t else torch.zeros(0, h, dtype=torch.float64)
    pure, _ = gather_sum_fwd(rows, index, k)
    assert got.shape == (t, h) and got.dtype == dtype
    assert_close_to_ref(got, pure, ref64)


def test_kernel_reads_strided_rows():
    rows, index = _case(4, 2, 64, torch.float32)
    wide = torch.zeros(8, 128)
    wide[:, :64] = rows
    view = wide[:, :64]  # row stride 128
    assert_close_to_ref(gs.launch_gather_sum(view.to(DEV), index.to(DEV), 2).cpu(),
                        gather_sum_fwd(rows, index, 2)[0], naive(rows, index, 2))


def test_op_wrapper_and_opcheck():
    rows, index = _case(4, 2, 16, torch.float32)
    out, res = kernel_gather_sum(rows, index, 2)
    assert torch.equal(out, gather_sum_fwd(rows, index, 2)[0])  # CPU: the pure pair
    torch.library.opcheck(torch.ops.moe_fn.gather_sum.default, (rows, index, 2))
    with pytest.raises(ValueError, match="multiple of top_k"):
        torch.ops.moe_fn.gather_sum(rows, index[:7], 2)


# ----------------------------------------------------------------------------- weighted


def _weighted_case(t, k, h, dtype, seed=0):
    rows, index = _case(t, k, h, dtype, seed)
    w = torch.rand(t * k, generator=torch.Generator().manual_seed(seed + 1))
    return rows, index, w


def naive_weighted(rows, index, w, k):
    """float64 autograd of per-token loops: the oracle for both directions."""
    t = index.numel() // k
    return torch.stack([sum(w[i * k + j] * rows[int(index[i * k + j])] for j in range(k))
                        for i in range(t)])


def _bwd64(d, rows, pos_to_row, w, k):
    """The pure backward in float64: the oracle for the kernel's (split) backward."""
    return weighted_gather_sum_bwd(d.double(), rows.double(), pos_to_row, w.double(), k)


def test_weighted_pure_pair_matches_autograd_oracle():
    rows, index, w = _weighted_case(5, 3, 7, torch.float64)
    out, _ = weighted_gather_sum_fwd(rows, index, w, 3)
    r, wr = rows.clone().requires_grad_(), w.clone().double().requires_grad_()
    ref = naive_weighted(r, index, wr, 3)
    torch.testing.assert_close(out, ref.detach())
    d = torch.randn_like(out)
    ref.backward(d)
    pos_to_row = torch.empty_like(index).scatter_(0, index, torch.arange(index.numel()))
    d_rows, d_w = weighted_gather_sum_bwd(d, rows, pos_to_row, w.double(), 3)
    torch.testing.assert_close(d_rows, r.grad)
    torch.testing.assert_close(d_w, wr.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,h", [(6, 2, 33), (4, 8, 70), (3, 1, 1), (0, 2, 16)])
def test_weighted_kernels_match_pure(dtype, t, k, h):
    rows, index, w = _weighted_case(t, k, h, dtype, seed=t + h)
    got = gs.launch_gather_sum(rows.to(DEV), index.to(DEV), k, w.to(DEV)).cpu()
    pure, _ = weighted_gather_sum_fwd(rows, index, w, k)
    r64 = rows.double().requires_grad_()
    w64 = w.double().requires_grad_()
    ref = naive_weighted(r64, index, w64, k) if t else torch.zeros(0, h, dtype=torch.float64)
    assert got.shape == (t, h) and got.dtype == dtype
    assert_close_to_ref(got, pure, ref.detach())
    if not t:
        return
    d = torch.randn(t, h).to(dtype)
    ref.backward(d.double())
    pos_to_row = torch.empty_like(index).scatter_(0, index, torch.arange(index.numel()))
    p_rows, p_w = weighted_gather_sum_bwd(d, rows, pos_to_row, w, k)
    for split in (t * k, 1, 0):
        lo, hi, d_w = gs.launch_weighted_gather_sum_bwd(
            d.to(DEV), rows.to(DEV), pos_to_row.to(DEV), w.to(DEV), k, split=split)
        got_rows = torch.cat([lo, hi]).cpu()
        assert lo.shape[0] == split
        assert_close_to_ref(got_rows, p_rows, r64.grad)
        assert_close_to_ref(d_w.cpu(), p_w, w64.grad)


def test_weighted_bwd_writes_into_the_given_tail():
    rows, index, w = _weighted_case(4, 2, 16, torch.float32)
    d = torch.randn(4, 16)
    pos_to_row = torch.empty_like(index).scatter_(0, index, torch.arange(8))
    tail = torch.zeros(10, 16)
    lo, hi, _ = gs.launch_weighted_gather_sum_bwd(d.to(DEV), rows.to(DEV), pos_to_row.to(DEV),
                                                  w.to(DEV), 2, split=3,
                                                  hi_out=tail[5:].to(DEV))
    full, _ = weighted_gather_sum_bwd(d, rows, pos_to_row, w, 2)
    assert_close_to_ref(torch.cat([lo, hi]).cpu(), full, _bwd64(d, rows, pos_to_row, w, 2)[0])
    if DEV == "cpu":
        assert hi.data_ptr() == tail[5:].data_ptr()
        assert not tail[:5].any()


def test_weighted_bwd_writes_the_head_where_it_is_given():
    """``lo_out``: the rows before ``split`` written into a given (row-strided) view, as
    into a transport's send region; wrong shapes refused."""
    rows, index, w = _weighted_case(4, 2, 16, torch.float32)
    d = torch.randn(4, 16)
    pos_to_row = torch.empty_like(index).scatter_(0, index, torch.arange(8))
    full, full_w = weighted_gather_sum_bwd(d, rows, pos_to_row, w, 2)
    full64, full_w64 = _bwd64(d, rows, pos_to_row, w, 2)
    region = torch.full((6, 20), -1.0, device=DEV)  # wider rows: a strided view
    head = region[1:4, :16]
    lo, hi, d_w = gs.launch_weighted_gather_sum_bwd(d.to(DEV), rows.to(DEV),
                                                    pos_to_row.to(DEV), w.to(DEV), 2,
                                                    split=3, lo_out=head)
    assert lo is head
    assert_close_to_ref(region[1:4, :16].cpu(), full[:3], full64[:3], "lo")
    assert_close_to_ref(hi.cpu(), full[3:], full64[3:], "hi")
    assert_close_to_ref(d_w.cpu(), full_w, full_w64, "d_w")
    assert bool((region[0] == -1).all() and (region[4:] == -1).all()
                and (region[:, 16:] == -1).all())  # nothing written around it
    # The wrapper's pure path (CPU) writes it too.
    out = torch.zeros(3, 16)
    lo2, _, _ = kernel_weighted_bwd(d, rows, pos_to_row, w, 2, split=3, lo_out=out)
    assert lo2 is out and torch.equal(out, full[:3])
    for bad in (torch.zeros(2, 16), torch.zeros(3, 8), torch.zeros(3, 16).t().contiguous().t(),
                torch.zeros(3, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match="lo_out"):
            gs.launch_weighted_gather_sum_bwd(d, rows, pos_to_row, w, 2, split=3, lo_out=bad)
    # No rows before the split: any empty view will do, whatever its strides.
    empty = torch.zeros(16, 4, device=DEV).t()[:0]
    lo, hi, _ = gs.launch_weighted_gather_sum_bwd(d.to(DEV), rows.to(DEV), pos_to_row.to(DEV),
                                                  w.to(DEV), 2, split=0, lo_out=empty)
    assert lo is empty
    assert_close_to_ref(hi.cpu(), full, full64, "hi (split 0)")


def test_weighted_op_and_wrappers_on_cpu():
    rows, index, w = _weighted_case(4, 2, 16, torch.float32)
    out, _ = kernel_weighted_fwd(rows, index, w, 2)
    assert torch.equal(out, weighted_gather_sum_fwd(rows, index, w, 2)[0])  # CPU: pure
    torch.library.opcheck(torch.ops.moe_fn.weighted_gather_sum.default, (rows, index, w, 2))
    with pytest.raises(ValueError, match="one entry per routed row"):
        torch.ops.moe_fn.weighted_gather_sum(rows, index, w[:7], 2)
    d = torch.randn(4, 16)
    pos_to_row = torch.empty_like(index).scatter_(0, index, torch.arange(8))
    lo, hi, d_w = kernel_weighted_bwd(d, rows, pos_to_row, w, 2, split=5)
    full, full_w = weighted_gather_sum_bwd(d, rows, pos_to_row, w, 2)
    assert torch.equal(torch.cat([lo, hi]), full) and torch.equal(d_w, full_w)  # CPU: pure


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,t,h", [(7, 3, 33), (5, 5, 1), (0, 2, 8)])
def test_gather_row_weight_bwd_kernel_matches_pure(dtype, n, t, h):
    g = torch.Generator().manual_seed(n + h)
    src = torch.randn(t, h, generator=g).to(dtype)
    index = torch.randint(0, t, (n,), generator=g)  # repeats: one token feeds k rows
    rows = torch.randn(n, h, generator=g).to(dtype)
    w = torch.rand(n, generator=g)
    got_rows, got_w = gs.launch_gather_row_weight_bwd(src.to(DEV), index.to(DEV),
                                                      rows.to(DEV), w.to(DEV))
    p_rows, p_w = row_weight_bwd(RowWeightRes(rows, w), src.index_select(0, index))
    # float64 autograd of the naive product: d/d(rows*w) of <gathered d, rows*w>.
    r64, w64 = rows.double().requires_grad_(), w.double().requires_grad_()
    (r64 * w64[:, None]).backward(src.double().index_select(0, index))
    assert_close_to_ref(got_rows.cpu(), p_rows, r64.grad)
    assert_close_to_ref(got_w.cpu(), p_w, w64.grad)
    wrapped = kernel_gather_row_weight_bwd(src, index, rows, w)  # CPU: the pure pair
    assert torch.equal(wrapped[0], p_rows) and torch.equal(wrapped[1], p_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_src", [0, 3])
def test_gather_row_weight_bwd_reads_own_rows_where_they_are(dtype, n_src):
    """Entries from len(src) on read ``own[own_tokens[j - len(src)]]``: the same results as
    with those rows gathered behind ``src``, on the kernel and the CPU wrapper."""
    g = torch.Generator().manual_seed(n_src)
    src = torch.randn(n_src, 24, generator=g).to(dtype)
    own = torch.randn(6, 24, generator=g).to(dtype)
    own_tokens = torch.tensor([5, 0, 2, 2])
    index = torch.randint(0, n_src + 4, (9,), generator=g)
    rows = torch.randn(9, 24, generator=g).to(dtype)
    w = torch.rand(9, generator=g)
    joined = torch.cat([src, own.index_select(0, own_tokens)])
    want = row_weight_bwd(RowWeightRes(rows, w), joined.index_select(0, index))
    want64 = row_weight_bwd(RowWeightRes(rows.double(), w.double()),
                            joined.double().index_select(0, index))
    got = gs.launch_gather_row_weight_bwd(src.to(DEV), index.to(DEV), rows.to(DEV), w.to(DEV),
                                          own=own.to(DEV), own_tokens=own_tokens.to(DEV))
    assert_all_close_to_ref([g.cpu() for g in got], want, want64, ("d_rows", "d_w"))
    wrapped = kernel_gather_row_weight_bwd(src, index, rows, w, own=own, own_tokens=own_tokens)
    assert_all_close_to_ref(wrapped, want, want64, ("d_rows", "d_w"))
    for fn in (gs.launch_gather_row_weight_bwd, kernel_gather_row_weight_bwd):
        with pytest.raises(ValueError, match="own and own_tokens go together"):
            fn(src, index, rows, w, own=own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n_src,n_own", [(5, 4), (0, 6), (6, 0)])
@pytest.mark.parametrize("own_layout", ["contiguous", "odd_stride", "transposed"])
@pytest.mark.parametrize("with_values", [False, True])
def test_gather_sum_reads_own_rows_where_they_are(dtype, weighted, n_src, n_own, own_layout,
                                                  with_values):
    """Entries from len(rows) on read ``own[own_index[j - len(rows)]]``: against a float64
    loop, on the kernel (row-strided arrivals, as unpacked from a packed buffer; own rows
    contiguous, at an odd row stride, or column-strided) and the CPU wrapper (the pure
    twin). With values, each entry's value (a float32 routing-weight gradient: the packed
    bytes behind an arrival, or the own row's from its own array) is gathered bit for bit
    in the same pass."""
    from moe_fn.comm.packing import new_packed, pack_rows, value_bytes

    k = 2
    g = torch.Generator().manual_seed(3 * n_src + n_own)
    wide = torch.randn(n_src, 40, generator=g).to(dtype)
    rows = wide[:, :24]  # row stride 40: the row part of packed rows
    vals = own_vals = v_out = None
    if with_values:  # the arrivals packed with their values, as from the collective
        in_vals = torch.randn(n_src, 1, generator=g)
        packed = pack_rows(rows, torch.arange(n_src), in_vals, None,
                           new_packed(rows, n_src, in_vals))
        rows, vals = packed[:, :24], value_bytes(packed, in_vals)
        own_vals = torch.randn(9, 1, generator=g)
    own = torch.randn(9, 27, generator=g).to(dtype)
    own = {"contiguous": own[:, :24].contiguous(), "odd_stride": own[:, :24],
           "transposed": own[:, :24].t().contiguous().t()}[own_layout]
    own_index = torch.randperm(9, generator=g)[:n_own]
    index = torch.randperm(n_src + n_own, generator=g)
    index = index[:index.numel() // k * k]
    w = torch.rand(index.numel(), generator=g) if weighted else None
    want = torch.zeros(index.numel() // k, 24, dtype=torch.float64)
    plain = torch.zeros(index.numel() // k, 24, dtype=dtype)  # the same loop in dtype
    for e, j in enumerate(index.tolist()):
        row = rows[j] if j < n_src else own[own_index[j - n_src]]
        want[e // k] += row.double() * (1.0 if w is None else float(w[e]))
        plain[e // k] += row * (1.0 if w is None else float(w[e]))
    if with_values:
        want_v = torch.tensor([[float(in_vals[j]) if j < n_src
                                else float(own_vals[own_index[j - n_src]])]
                               for j in index.tolist()]).reshape(-1, 1)
        v_out = torch.full((index.numel(), 1), 9.0)
        own_vals = own_vals if n_own else None
    own = own if n_own or not with_values else None  # (no own rows: one source)
    own_index = own_index if own is not None else None
    dev = [t if t is None else t.to(DEV) for t in (rows, index, w, own, own_index, vals,
                                                    own_vals)]
    got_v = None if v_out is None else v_out.clone().to(DEV)  # (on CPU .to is no copy)
    got = gs.launch_gather_sum(*dev[:2], k, dev[2], own=dev[3], own_index=dev[4],
                               values=dev[5], own_values=dev[6], values_out=got_v)
    pure_v = None if v_out is None else v_out.clone()
    pure = (kernel_gather_sum_own(rows, index, k, w, own=own, own_index=own_index,
                                  values=vals, own_values=own_vals, values_out=pure_v)
            if own is not None or with_values else gs.launch_gather_sum(rows, index, k, w))
    assert_close_to_ref(got.cpu(), pure, want)
    assert_close_to_ref(pure, plain, want)
    if with_values:
        assert torch.equal(got_v.cpu(), want_v) and torch.equal(pure_v, want_v)


def test_gather_sum_own_refuses_values_that_do_not_fit():
    rows, own = torch.randn(4, 8), torch.randn(5, 8)
    index, own_index = torch.arange(6), torch.tensor([0, 3])
    v, ov, vo = torch.zeros(4, 1), torch.zeros(5, 1), torch.zeros(6, 1)
    kw = dict(own=own, own_index=own_index)
    for fn in (gs.launch_gather_sum, kernel_gather_sum_own):
        # Refused, not ignored, without values (the kernel checked only with them).
        with pytest.raises(ValueError, match="values and values_out go together"):
            fn(rows, index, 2, **kw, values_out=vo)
        with pytest.raises(ValueError, match="values and values_out go together"):
            fn(rows, index, 2, **kw, own_values=ov)
        with pytest.raises(ValueError, match="values and values_out go together"):
            fn(rows, index, 2, values=v, own_values=ov, **kw)
        with pytest.raises(ValueError, match="own_values go with own"):
            fn(rows, index, 2, values=v, values_out=vo, **kw)
        with pytest.raises(ValueError, match="as many bytes a row"):
            fn(rows, index, 2, values=v, own_values=torch.zeros(5, 2), values_out=vo, **kw)
        with pytest.raises(ValueError, match="a row per row of the rows"):
            fn(rows, index, 2, values=torch.zeros(3, 1), own_values=ov, values_out=vo, **kw)
        with pytest.raises(ValueError, match="a row per index entry"):
            fn(rows, index, 2, values=v, own_values=ov, values_out=torch.zeros(5, 1), **kw)


def test_gather_sum_gathers_values_of_zero_width_rows():
    """Rows of no columns still have values to gather (the kernel returned before)."""
    rows, index = torch.zeros(4, 0), torch.tensor([3, 0, 2, 1])
    vals = torch.arange(4.0).reshape(4, 1)
    got, want = torch.full((4, 1), 7.0).to(DEV), vals[index]
    gs.launch_gather_sum(rows.to(DEV), index.to(DEV), 2, values=vals.to(DEV), values_out=got)
    pure = torch.full((4, 1), 7.0)
    kernel_gather_sum_own(rows, index, 2, own=None, own_index=None, values=vals,
                          values_out=pure)
    assert torch.equal(got.cpu(), want) and torch.equal(pure, want)


def test_gather_sum_own_rejects_what_does_not_match():
    rows, own = torch.randn(4, 8), torch.randn(5, 8)
    index, own_index = torch.arange(6), torch.tensor([0, 3])
    for fn in (gs.launch_gather_sum, kernel_gather_sum_own):
        with pytest.raises(ValueError, match="own rows"):
            fn(rows, index, 2, own=own.double(), own_index=own_index)
        with pytest.raises(ValueError, match="own rows"):
            fn(rows, index, 2, own=own[:, :4], own_index=own_index)
        with pytest.raises(ValueError, match="weights must have one entry"):
            fn(rows, index, 2, torch.rand(5), own=own, own_index=own_index)
        with pytest.raises(ValueError, match="multiple of top_k"):
            fn(rows, index, 4, own=own, own_index=own_index)
    with pytest.raises(ValueError, match="own and own_index go together"):
        gs.launch_gather_sum(rows, index, 2, own=own)
    for fn in (gs.launch_gather_sum, kernel_gather_sum_own):
        with pytest.raises(ValueError, match="own and own_index go together"):
            fn(rows, index, 2, own=None, own_index=own_index)
        with pytest.raises(TypeError, match="own_index must have dtype"):
            fn(rows, index, 2, own=own, own_index=own_index.float())


# ----------------------------------------------------------------------------- masked


def naive_masked(rows, table, weights=None):
    out = torch.zeros(table.shape[0], rows.shape[1], dtype=torch.float64)
    for r in range(table.shape[0]):
        for j in range(table.shape[1]):
            i = int(table[r, j])
            if i >= 0:
                out[r] += rows[i].double() * (1.0 if weights is None else float(weights[i]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n,r,k,h", [(9, 5, 3, 33), (4, 6, 2, 1), (0, 3, 2, 8), (5, 0, 2, 8)])
def test_masked_gather_sum_kernel_matches_pure_and_naive(dtype, weighted, n, r, k, h):
    g = torch.Generator().manual_seed(n + r + h)
    rows = torch.randn(n, h, generator=g).to(dtype)
    table = torch.randint(-1, max(n, 1), (r, k), generator=g) if n else torch.full((r, k), -1)
    w = torch.rand(n, generator=g) if weighted else None
    got = gs.launch_masked_gather_sum(rows.to(DEV), table.to(DEV),
                                      None if w is None else w.to(DEV)).cpu()
    pure = masked_gather_sum(rows, table, w)
    assert got.shape == (r, h) and pure.shape == (r, h)
    assert_close_to_ref(got, pure, naive_masked(rows, table, w))
    assert torch.equal(kernel_masked_gather_sum(rows, table, w), pure)  # CPU: pure


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_reads_and_writes_row_strided_views(dtype):
    """gather_rows between the row parts of wider (packed) rows, as the exchanges use it."""
    from moe_fn.kernels import gather_rows
    from moe_fn.kernels.gather_sum import launch_gather_sum

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 45, generator=g).to(dtype).to(DEV)
    src = wide[:, :37]  # row stride 45, columns contiguous
    index = torch.tensor([8, 0, 3, 3, 5, 1, 7], device=DEV)
    want = src.cpu().index_select(0, index.cpu())
    dst_wide = torch.full((7, 50), 7.0, dtype=dtype, device=DEV)
    got = launch_gather_sum(src, index, 1, out=dst_wide[:, 2:39])
    assert got.data_ptr() == dst_wide[:, 2:39].data_ptr()
    assert torch.equal(dst_wide[:, 2:39].cpu(), want)
    assert (dst_wide[:, :2] == 7).all() and (dst_wide[:, 39:] == 7).all()  # untouched
    assert torch.equal(gather_rows(src, index).cpu(), want)
    with pytest.raises(ValueError, match="out must be"):
        launch_gather_sum(src, index, 1, out=dst_wide[:, :36])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_masked_gather_sum_ignores_the_weight_of_a_row_no_token_uses(bad):
    """An absent slot (-1) stands in a zero row with a zero weight: a non-finite weight of
    a row no token gathers (row 0 here) reaches no output, as in the pure twin."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(3, 12, generator=g).to(DEV)
    table = torch.tensor([[1, -1], [2, 1], [-1, 2]], device=DEV)
    w = torch.tensor([bad, 1.5, -0.5], device=DEV)
    got = gs.launch_masked_gather_sum(rows, table, w).cpu()
    assert torch.isfinite(got).all(), got
    assert_close_to_ref(got, masked_gather_sum(rows.cpu(), table.cpu(), w.cpu()),
                        naive_masked(rows.cpu(), table.cpu(), w.cpu()))


def test_masked_gather_sum_writes_into_a_row_strided_view():
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(6, 19, generator=g).to(DEV)
    table = torch.tensor([[0, -1], [5, 2], [-1, -1]], device=DEV)
    wide = torch.full((3, 24), 3.0, device=DEV)
    kernel_masked_gather_sum(rows, table, out=wide[:, :19])
    want = masked_gather_sum(rows.cpu(), table.cpu())
    assert_close_to_ref(wide[:, :19].cpu(), want, naive_masked(rows.cpu(), table.cpu()))
    assert (wide[:, 19:] == 3).all()


@pytest.mark.parametrize("rows_dtype,values_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float64),
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("with_rows", [True, False])
@pytest.mark.parametrize("with_index", [True, False])
def test_pack_rows_kernel_matches_the_gather_and_byte_copy(rows_dtype, values_dtype,
                                                           with_rows, with_index):
    """The one-pass packing writes exactly what a gather and a byte copy write (NaN and
    -0.0 values bit for bit), and nothing outside each row's row part and value bytes."""
    from moe_fn.comm.packing import _slots
    from moe_fn.kernels import pack_rows

    g = torch.Generator().manual_seed(5)
    h = 24  # with 8 bf16 slots a row is 32 elements: the kernel's 16-byte vector path
    rows = torch.randn(9, h, generator=g).to(rows_dtype)
    values = torch.randn(11 if with_index else 6, 2, generator=g).to(values_dtype)
    values[0, 0] = float("nan")
    values[1, 1] = -0.0
    index = torch.tensor([4, 0, 8, 8, 2, 7])
    v_index = torch.tensor([10, 1, 0, 5, 5, 3]) if with_index else None
    width = h + _slots(rows, values)
    tail = h * rows.element_size()
    want = torch.full((6, width), 5.0, dtype=rows_dtype)
    pack_rows(rows if with_rows else None, index, values, v_index, want, tail)  # CPU path
    for per, block in ((4, 1024), (1, 8), (8, 16)):  # row tails, column steps and masks
        got = torch.full((6, width), 5.0, dtype=rows_dtype, device=DEV)
        gs.launch_pack_rows(rows.to(DEV) if with_rows else None, index.to(DEV),
                            values.to(DEV), None if v_index is None else v_index.to(DEV), got,
                            tail, rows_per_program=per, block_c=block)
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    if with_rows:
        assert torch.equal(want[:, :h], rows[index])
    else:
        assert (want[:, :h] == 5).all()
    vb = values.shape[1] * values.element_size()
    picked = values if v_index is None else values[v_index]
    assert torch.equal(want.view(torch.uint8)[:, tail:tail + vb], picked.view(torch.uint8))


def test_pack_rows_kernel_rejects_what_does_not_fit():
    rows = torch.randn(3, 8, device=DEV)
    out = torch.empty(2, 12, device=DEV)
    values = torch.randn(2, 3, device=DEV)
    with pytest.raises(ValueError, match="do not fit"):
        gs.launch_pack_rows(rows, torch.tensor([0, 1], device=DEV), values, None, out, 40)
    with pytest.raises(ValueError, match="whole packed rows"):
        gs.launch_pack_rows(rows, torch.tensor([0, 1], device=DEV), values, None,
                            torch.empty(2, 24, device=DEV)[:, :12], 32)


@pytest.mark.parametrize("width", [40, 36, 37])
def test_kernels_read_and_write_rows_at_every_stride_alignment(width):
    """Row strides in units of the widest vector they allow (8, 4 and 1 bf16 elements):
    the gather, the masked gather-sum and both weighting backwards stay exact."""
    g = torch.Generator().manual_seed(6)
    h = 24
    wide = torch.randn(10, width, generator=g).to(torch.bfloat16).to(DEV)
    src = wide[:, :h]
    index = torch.tensor([9, 0, 3, 3, 5, 1, 7, 2], device=DEV)
    for per, block in ((4, 1024), (2, 16), (8, 8)):
        dst = torch.zeros(8, width, dtype=torch.bfloat16, device=DEV)
        gs.launch_gather_rows(src, index[:7], dst[:7, :h], rows_per_program=per,
                              block_c=block)
        assert torch.equal(dst[:7, :h].cpu(), src.cpu()[index[:7].cpu()])
        assert (dst[7] == 0).all() and (dst[:, h:] == 0).all()
    gs.launch_gather_sum(src, index, 1, out=dst[:, :h])
    assert torch.equal(dst[:, :h].cpu(), src.cpu()[index.cpu()])
    table = torch.tensor([[0, -1], [5, 2], [-1, 9]], device=DEV)
    w = torch.rand(10, generator=g).to(DEV)
    got = gs.launch_masked_gather_sum(src, table, w, out=dst[:3, :h])
    assert_close_to_ref(got.cpu(), masked_gather_sum(src.cpu(), table.cpu(), w.cpu()),
                        naive_masked(src.cpu(), table.cpu(), w.cpu()), "masked_gather_sum")
    rw = torch.rand(8, generator=g).to(DEV)
    d_rows, d_w = gs.launch_gather_row_weight_bwd(src, index, dst[:, :h], rw)
    rows_in, d_in = dst[:, :h].cpu(), src.cpu()[index.cpu()]
    plain = row_weight_bwd(RowWeightRes(rows_in, rw.cpu()), d_in)
    ref64 = row_weight_bwd(RowWeightRes(rows_in.double(), rw.cpu().double()), d_in.double())
    assert_all_close_to_ref([d_rows.cpu(), d_w.cpu()], plain, ref64, ("d_rows", "d_w"))


def test_gather_rows_with_mixed_strides_and_a_strided_index():
    """Source and output rows of different strides (vector widths 8 and 4), and an index
    that is a column of a 2-D tensor (not contiguous)."""
    g = torch.Generator().manual_seed(7)
    src = torch.randn(12, 40, generator=g).to(torch.bfloat16).to(DEV)[:, :24]
    pairs = torch.tensor([[11, 5], [0, 5], [7, 5], [7, 5], [3, 5]], device=DEV)
    index = pairs[:, 0]
    assert not index.is_contiguous()
    out = torch.zeros(5, 36, dtype=torch.bfloat16, device=DEV)
    gs.launch_gather_rows(src, index, out[:, :24])
    assert torch.equal(out[:, :24].cpu(), src.cpu()[index.cpu()])
    packed = torch.zeros(5, 32, dtype=torch.bfloat16, device=DEV)
    values = torch.arange(12.0, device=DEV)[:, None]
    gs.launch_pack_rows(src, index, values, index, packed, 48)
    assert torch.equal(packed[:, :24].cpu(), src.cpu()[index.cpu()])
    got_values = packed.cpu().view(torch.uint8)[:, 48:52].contiguous().view(torch.float32)
    assert torch.equal(got_values[:, 0], index.cpu().float())


def test_pack_rows_kernel_rejects_rows_that_would_overwrite_the_values():
    out = torch.empty(2, 16, dtype=torch.bfloat16, device=DEV)
    values = torch.randn(2, 1, device=DEV)
    index = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="end before the values"):
        gs.launch_pack_rows(torch.randn(2, 12, device=DEV).bfloat16(), index, values, None,
                            out, 16)
    with pytest.raises(ValueError, match="out's dtype"):
        gs.launch_pack_rows(torch.randn(2, 8, device=DEV), index, values, None, out, 16)


def _copy_rows_oracle(src, index, out, out_index):
    want = out.clone()
    n = (out_index if out_index is not None else index).numel()
    for i in range(n):
        d = i if out_index is None else int(out_index[i])
        want[d] = src[i if index is None else int(index[i])]
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_index,with_out_index", [(True, True), (False, True),
                                                       (True, False)])
@pytest.mark.parametrize("num_programs", [None, 1, 3])
@pytest.mark.parametrize("n", [0, 7, 29])
def test_copy_rows_kernel_and_wrapper_match_a_loop(dtype, with_index, with_out_index,
                                                   num_programs, n):
    """Rows gathered and scattered in one pass; a capped grid (29 rows are 8 blocks of 4,
    unevenly over 3 programs) still copies every row, and rows no index names stay as
    they were."""
    from moe_fn.kernels import copy_rows

    g = torch.Generator().manual_seed(n)
    wide = torch.randn(31, 41, generator=g).to(dtype)
    src = wide[:, :33]  # a row-strided view
    index = torch.randperm(31, generator=g)[:n] if with_index else None
    out_index = torch.randperm(40, generator=g)[:n] if with_out_index else None
    out = torch.full((40, 33), 5.0, dtype=dtype)
    want = _copy_rows_oracle(src, index, out, out_index)
    dev = [None if t is None else t.to(DEV) for t in (index, out_index)]
    got = gs.launch_copy_rows(src.to(DEV), dev[0], out.clone().to(DEV), dev[1],
                              num_programs=num_programs)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(copy_rows(src, index, out.clone(), out_index), want)  # CPU wrapper


def test_copy_rows_reads_a_column_strided_source():
    g = torch.Generator().manual_seed(1)
    src = torch.randn(6, 5, generator=g).t()  # (5, 6), columns strided
    index, out_index = torch.tensor([4, 0, 2]), torch.tensor([1, 3, 0])
    out = torch.zeros(4, 6)
    want = _copy_rows_oracle(src, index, out, out_index)
    got = gs.launch_copy_rows(src.to(DEV), index.to(DEV), out.to(DEV), out_index.to(DEV))
    assert torch.equal(got.cpu(), want)


def _copy_values_oracle(values, values_index, values_out, out_index):
    """The values' bytes copied entry by entry."""
    want = values_out.clone()
    raw, dst = values.contiguous().view(torch.uint8), want.view(torch.uint8)
    for i in range(out_index.numel()):
        dst[int(out_index[i])] = raw[i if values_index is None else int(values_index[i])]
    return want


@pytest.mark.parametrize("source", ["typed", "packed"])
@pytest.mark.parametrize("num_programs", [None, 2])
@pytest.mark.parametrize("n", [0, 9, 29])
def test_copy_rows_carries_values_to_the_rows_places(source, num_programs, n):
    """Values (a routing weight a row) land where their rows do, bit for bit, from a typed
    array through their own index (the own rows' weights) or from the raw bytes behind
    packed rows (the arrivals'); rows no index names keep their values."""
    from moe_fn.comm.packing import new_packed, pack_rows, value_bytes
    from moe_fn.kernels import copy_rows

    g = torch.Generator().manual_seed(n + 100)
    src = torch.randn(31, 33, generator=g).bfloat16()
    weights = torch.randn(50, 1, generator=g)
    out_index = torch.randperm(40, generator=g)[:n]
    out = torch.zeros(40, 33, dtype=torch.bfloat16)
    values_out = torch.full((40, 1), 7.0)
    if source == "typed":
        index = torch.randperm(31, generator=g)[:n]
        values, values_index = weights, torch.randperm(50, generator=g)[:n]
    else:  # rows packed with their weights, as they arrive from a collective
        index = None
        packed = pack_rows(src, torch.arange(31), weights[:31], None,
                           new_packed(src, 31, weights))
        src = packed[:, :33]
        values, values_index = value_bytes(packed, weights), None
    want_rows = _copy_rows_oracle(src, index, out, out_index)
    want_vals = _copy_values_oracle(values, values_index, values_out, out_index)
    dev = [None if t is None else t.to(DEV)
           for t in (src, index, out.clone(), out_index, values, values_index)]
    got_vals = values_out.clone().to(DEV)  # (on CPU .to is no copy)
    got = gs.launch_copy_rows(*dev[:4], values=dev[4], values_index=dev[5],
                              values_out=got_vals, num_programs=num_programs)
    assert torch.equal(got_vals.cpu(), want_vals)
    assert torch.equal(got.cpu(), want_rows)
    pure_vals = values_out.clone()  # the CPU wrapper: the pure function
    pure = copy_rows(src, index, out.clone(), out_index, values=values,
                     values_index=values_index, values_out=pure_vals)
    assert torch.equal(pure_vals, want_vals) and torch.equal(pure, want_rows)


@pytest.mark.parametrize("launcher", ["kernel", "wrapper"])
def test_copy_rows_refuses_values_that_do_not_fit(launcher):
    from moe_fn.kernels import copy_rows

    fn = gs.launch_copy_rows if launcher == "kernel" else copy_rows
    src, out, idx = torch.zeros(4, 8), torch.zeros(6, 8), torch.arange(2)
    v, vo = torch.zeros(4, 1), torch.zeros(6, 1)
    with pytest.raises(ValueError, match="values and values_out go together"):
        fn(src, idx, out, idx, values=v)
    with pytest.raises(ValueError, match="values_index without values"):
        fn(src, idx, out, values_index=idx)
    with pytest.raises(ValueError, match="as many bytes a row"):
        fn(src, idx, out, idx, values=v, values_out=torch.zeros(6, 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="3 entries in values_index for 2"):
        fn(src, idx, out, idx, values=v, values_index=torch.arange(3), values_out=vo)
    with pytest.raises(ValueError, match="5 values to copy from 4"):
        fn(torch.zeros(6, 8), None, torch.zeros(6, 8), torch.arange(5), values=v,
           values_out=vo)
    with pytest.raises(ValueError, match="values_out must have contiguous columns"):
        fn(src, idx, out, idx, values=torch.zeros(4, 2), values_out=torch.zeros(2, 6).t())
    with pytest.raises(TypeError, match="values_index must have dtype"):
        fn(src, idx, out, idx, values=v, values_index=idx.float(), values_out=vo)


@pytest.mark.parametrize("launcher", ["kernel", "wrapper"])
def test_copy_rows_rejects_what_does_not_match(launcher):
    from moe_fn.kernels import copy_rows

    fn = gs.launch_copy_rows if launcher == "kernel" else copy_rows
    src, out = torch.zeros(4, 8), torch.zeros(6, 8)
    with pytest.raises(ValueError, match="needs index, out_index or both"):
        fn(src, None, out)
    with pytest.raises(ValueError, match="3 entries in index for 2 rows"):
        fn(src, torch.arange(3), out, torch.arange(2))
    with pytest.raises(ValueError, match="5 rows to copy from 4"):
        fn(src, None, out, torch.arange(5))
    with pytest.raises(ValueError, match="must take src's rows"):
        fn(src, torch.arange(2), torch.zeros(6, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must take src's rows"):
        fn(src, torch.arange(2), torch.zeros(6, 9))
    if launcher == "kernel":
        with pytest.raises(ValueError, match="columns must be contiguous"):
            fn(src, torch.arange(2), torch.zeros(8, 6).t())


@pytest.mark.parametrize("fused", [True, False])
def test_weighted_bwd_scatters_the_tail_at_hi_index(fused):
    """Rows from ``split`` on land at ``hi_out[hi_index]``; the other rows of ``hi_out``
    stay as they were."""
    rows, index, w = _weighted_case(4, 2, 16, torch.float32)
    d = torch.randn(4, 16)
    pos_to_row = torch.empty_like(index).scatter_(0, index, torch.arange(8))
    hi_index = torch.tensor([6, 0, 3, 9, 2])
    hi_out = torch.full((10, 16), 3.0)
    full, full_w = weighted_gather_sum_bwd(d, rows, pos_to_row, w, 2)
    want = hi_out.clone()
    want[hi_index] = full[3:]
    full64, full_w64 = _bwd64(d, rows, pos_to_row, w, 2)
    want64 = hi_out.double()
    want64[hi_index] = full64[3:]
    if fused:
        lo, hi, d_w = gs.launch_weighted_gather_sum_bwd(
            d.to(DEV), rows.to(DEV), pos_to_row.to(DEV), w.to(DEV), 2, split=3,
            hi_out=hi_out.to(DEV), hi_index=hi_index.to(DEV))
    else:
        lo, hi, d_w = kernel_weighted_bwd(d, rows, pos_to_row, w, 2, split=3, hi_out=hi_out,
                                          hi_index=hi_index)
    if fused:  # the kernel: another summation order
        assert_all_close_to_ref([lo.cpu(), hi.cpu(), d_w.cpu()], [full[:3], want, full_w],
                                [full64[:3], want64, full_w64], ("lo", "hi", "d_w"))
    else:  # the CPU wrapper: the pure pair
        assert torch.equal(lo, full[:3]) and torch.equal(hi, want) and torch.equal(d_w, full_w)
    fn = gs.launch_weighted_gather_sum_bwd if fused else kernel_weighted_bwd
    with pytest.raises(ValueError, match="hi_index needs hi_out"):
        fn(d, rows, pos_to_row, w, 2, split=3, hi_index=hi_index)
    with pytest.raises(ValueError, match="one entry per row from 3 on"):
        fn(d, rows, pos_to_row, w, 2, split=3, hi_out=hi_out, hi_index=hi_index[:4])
    with pytest.raises(ValueError, match="hi_out must hold the 5 rows from 3 on, got 10"):
        fn(d, rows, pos_to_row, w, 2, split=3, hi_out=hi_out)

"""Grouped linear against autograd of a naive per-expert loop."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fn.pure import grouped
from moe_fn.pure.grouped import (
    grouped_linear_bwd,
    grouped_linear_dw,
    grouped_linear_dx,
    grouped_linear_fwd,
    grouped_mm_ok,
)
from moe_fn.testing import assert_all_close_to_ref, assert_close_to_ref


def make_offs(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def naive_grouped(x, w, counts):
    outs, start = [], 0
    for e, c in enumerate(counts):
        outs.append(torch.matmul(x[start:start + c], w[e].t()))
        start += c
    return torch.cat(outs, dim=0)


def check_against_oracle(counts, din, dout, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, e = sum(counts), len(counts)
    x = torch.randn(n, din, generator=gen).to(dtype)
    w = torch.randn(e, dout, din, generator=gen).to(dtype)
    dy = torch.randn(n, dout, generator=gen).to(dtype)
    offs = make_offs(counts)

    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    yr = naive_grouped(xr, wr, counts)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())

    y, res = grouped_linear_fwd(x, w, offs)
    dx, dw = grouped_linear_bwd(res, dy)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    assert dw.shape == w.shape
    if dtype == torch.float64:
        torch.testing.assert_close((y, dx, dw), (yr.detach(), dxr, dwr))
    else:  # the rule, with autograd of the same loop in dtype as plain PyTorch
        xp, wp = x.clone().requires_grad_(), w.clone().requires_grad_()
        yp = naive_grouped(xp, wp, counts)
        dxp, dwp = torch.autograd.grad(yp, (xp, wp), dy)
        assert_all_close_to_ref((y, dx, dw), (yp.detach(), dxp, dwp), (yr.detach(), dxr, dwr),
                                ("y", "dx", "dw"))
    for i, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(dw[i]) == 0


@pytest.mark.parametrize("dtype,din,dout", [
    (torch.float64, 8, 12),  # float64: per-expert loop
    (torch.float32, 5, 7),  # unaligned widths: per-expert loop
    (torch.float32, 8, 12),  # aligned: torch._grouped_mm
])
def test_matches_naive_with_empty_experts(dtype, din, dout):
    check_against_oracle([3, 0, 5, 0, 1], din, dout, dtype)


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 7), min_size=1, max_size=5),
    din=st.sampled_from([3, 4, 8]),
    dout=st.sampled_from([1, 4, 6, 16]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
def test_hypothesis_counts(counts, din, dout, dtype):
    check_against_oracle(counts, din, dout, dtype)


def test_aligned_path_uses_grouped_mm(monkeypatch):
    calls = []
    real = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    counts = [2, 0, 6]
    x, w, dy = torch.randn(8, 8), torch.randn(3, 4, 8), torch.randn(8, 4)
    _, res = grouped_linear_fwd(x, w, make_offs(counts))
    grouped_linear_bwd(res, dy)
    assert len(calls) == 3  # fwd, dx, dw all grouped
    calls.clear()
    _, res = grouped_linear_fwd(x.double(), w.double(), make_offs(counts))
    grouped_linear_bwd(res, dy.double())
    assert calls == []


def test_bf16_grouped_mm_matches_loop():
    counts = [5, 0, 11]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 16, generator=gen).bfloat16()
    w = torch.randn(3, 8, 16, generator=gen).bfloat16()
    dy = torch.randn(16, 8, generator=gen).bfloat16()
    offs = make_offs(counts)
    assert grouped_mm_ok(x, w.transpose(-2, -1)) and grouped_mm_ok(dy, w)
    assert grouped_mm_ok(dy.t(), x)
    y, res = grouped_linear_fwd(x, w, offs)
    dx, dw = grouped_linear_bwd(res, dy)
    ref = naive_grouped(x.double(), w.double(), counts)
    plain = naive_grouped(x, w, counts).double()  # plain bf16 PyTorch
    step = 2**-8 * ref.abs().max()
    assert (y.double() - ref).abs().max() <= 2 * (plain - ref).abs().max() + step
    dxr = naive_grouped(dy.double(), w.double().transpose(1, 2), counts)
    assert (dx.double() - dxr).abs().max() <= 2**-7 * dxr.abs().max()
    assert dw.dtype == torch.bfloat16 and torch.count_nonzero(dw[1]) == 0


def test_zero_stride_and_noncontiguous_grads():
    counts = [4, 0, 4]
    offs = make_offs(counts)
    x, w = torch.randn(8, 8), torch.randn(3, 4, 8)
    dy = torch.ones(1, 1).expand(8, 4)  # what y.sum().backward() sends
    dx = grouped_linear_dx(dy, w, offs)
    dw = grouped_linear_dw(x, dy, offs)
    d64, w64, x64 = dy.double(), w.double(), x.double()
    # Against float64, within twice the error of plain float32 matmuls of the same rows.
    assert_close_to_ref(dx, naive_grouped(dy.contiguous(), w.transpose(1, 2), counts),
                        naive_grouped(d64, w64.transpose(1, 2), counts), "dx")
    assert_close_to_ref(dw[0], dy[:4].t() @ x[:4], d64[:4].t() @ x64[:4], "dw[0]")
    dy_t = torch.randn(4, 8).t()  # non-contiguous
    assert_close_to_ref(grouped_linear_dx(dy_t, w, offs),
                        naive_grouped(dy_t, w.transpose(1, 2), counts),
                        naive_grouped(dy_t.double(), w64.transpose(1, 2), counts), "dx (dy_t)")


def test_no_rows():
    offs = torch.zeros(3, dtype=torch.int32)
    for dtype in (torch.float32, torch.float64):
        x, w = torch.randn(0, 8, dtype=dtype), torch.randn(3, 4, 8, dtype=dtype)
        y, res = grouped_linear_fwd(x, w, offs)
        dx, dw = grouped_linear_bwd(res, torch.randn(0, 4, dtype=dtype))
        assert y.shape == (0, 4) and dx.shape == (0, 8)
        assert dw.shape == (3, 4, 8) and torch.count_nonzero(dw) == 0


def test_dw_is_callable_on_its_own_and_needs():
    counts = [3, 5]
    x, w, dy = torch.randn(8, 8), torch.randn(2, 4, 8), torch.randn(8, 4)
    _, res = grouped_linear_fwd(x, w, make_offs(counts))
    dx, dw = grouped_linear_bwd(res, dy, needs=(True, False))
    assert dw is None
    later = grouped_linear_dw(res.x, dy, res.offs)
    assert_close_to_ref(later[1], dy[3:].t() @ x[3:], dy[3:].double().t() @ x[3:].double())
    assert grouped_linear_bwd(res, dy, needs=(False, True))[0] is None


def test_predicate_never_accepts_what_grouped_mm_refuses():
    """grouped_mm_ok may be conservative (it also asks for a 16-byte aligned start, which
    CUDA checks) but must never send the op something it rejects."""
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([1, 1, 3], dtype=torch.int32)
    for dtype in grouped.GROUPED_MM_DTYPES:
        for din in (1, 2, 3, 4, 8, 12):
            for dout in (1, 2, 4, 6, 8):
                x = torch.randn(3, din, generator=gen).to(dtype)
                packed = torch.randn(3, 2 * dout, din, generator=gen).to(dtype)
                dy = torch.randn(3, dout, generator=gen).to(dtype)
                for a, b in [(x, packed[:, :dout].transpose(-2, -1)),
                             (x, packed[:, 1::2].transpose(-2, -1)),
                             (dy, packed[:, dout:]), (dy.t(), x)]:
                    if grouped_mm_ok(a, b):
                        torch._grouped_mm(a, b, offs=offs)


def test_zero_empty_groups_clears_exactly_the_experts_without_rows():
    from moe_fn.pure.grouped import zero_empty_groups
    dw = torch.randn(4, 3, 2)
    offs = torch.tensor([2, 2, 5, 5], dtype=torch.int32)  # experts 1 and 3 own no rows
    out = zero_empty_groups(dw, offs)
    assert torch.equal(out[[0, 2]], dw[[0, 2]])
    assert not out[[1, 3]].any()

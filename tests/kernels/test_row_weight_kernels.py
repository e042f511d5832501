"""Triton row-weighting kernels against the pure pair, on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moe_fn.kernels import row_weight as K
from moe_fn.kernels.activation import interpreting
from moe_fn.pure import row_weight as P
from moe_fn.testing import assert_close_to_ref

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _interp_required():
    if not interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 before triton is imported")


def _inputs(n, h, dtype, w_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=gen) * 2).to(dtype)
    w = (torch.rand(n, generator=gen) + 0.1).to(w_dtype or dtype)
    d = torch.randn(n, h, generator=gen).to(dtype)
    return x, w, d


def _check(x, w, d, needs=(True, True)):
    out = K.launch_row_weight_fwd(x, w)
    outp, res = P.row_weight_fwd(x, w)
    out64, res64 = P.row_weight_fwd(x.double(), w.double())
    assert_close_to_ref(out, outp, out64, "out")
    got = K.launch_row_weight_bwd(x, w, d, needs)
    pure = P.row_weight_bwd(res, d, needs=needs)
    ref = P.row_weight_bwd(res64, d.double(), needs=needs)
    for name, a, b, c in zip(("d_rows", "d_weights"), got, pure, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close_to_ref(a, b, c, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [1, 5, 33, 70])
def test_row_weight(dtype, h):
    _check(*_inputs(19, h, dtype))


def test_mixed_weight_dtype():
    _check(*_inputs(11, 40, torch.bfloat16, torch.float32, seed=1))


def test_non_contiguous():
    x, w, d = _inputs(17, 9, torch.bfloat16, seed=2)
    x_t = x.t().contiguous().t()
    w_nc = torch.stack([w, w], dim=1)[:, 0]
    big = torch.zeros(17, 20, dtype=d.dtype)
    big[:, 2:11] = d
    _check(x_t, w_nc, big[:, 2:11])


def test_zero_stride_grad():
    x, w, _ = _inputs(13, 7, torch.float32, seed=3)
    _check(x, w, torch.ones(1, 1).expand(13, 7))


@pytest.mark.parametrize("needs", [(True, False), (False, True), (False, False)])
def test_needs(needs):
    _check(*_inputs(9, 6, torch.float16, seed=4), needs=needs)


@pytest.mark.parametrize("n,h", [(0, 8), (4, 0), (0, 0)])
def test_empty(n, h):
    x, w, d = _inputs(n, h, torch.bfloat16)
    _check(x, w, d)
    _, dw = K.launch_row_weight_bwd(x, w, d)
    assert dw.shape == (n,) and bool((dw == 0).all())

"""The pure twins of the fused FP8 activation kernels: the packed activation pair's results,
quantised row by row (``moe_fn.pure.fp8``)."""

import pytest
import torch

from moe_fn.pure import activations as pa
from moe_fn.pure import fp8 as pf


def _inputs(n=7, i=5, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gu = (torch.randn(n, 2 * i, generator=gen) * 3).to(dtype)
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    dh = torch.randn(n, i, generator=gen).to(dtype)
    return gu, w, dh


def _same(a: pf.Fp8Rows, b: pf.Fp8Rows):
    assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
    assert torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("act", pa.ACTIVATIONS)
@pytest.mark.parametrize("layout", pa.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twins_quantise_the_activation_pair(act, layout, dtype):
    act_id, alpha, limit = pa.resolve_activation(act)
    kw = dict(act_id=act_id, alpha=alpha, limit=limit, layout_id=pa.resolve_layout(layout))
    gu, w, dh = _inputs(dtype=dtype)
    rows, res = pf.swiglu_packed_fwd_fp8(gu, w, **kw)
    h, pres = pa.swiglu_packed_fwd(gu, w, **kw)
    assert res.gate_up is gu and res.weights is w and res[2:] == pres[2:]
    assert rows.q.shape == h.shape and rows.q.dtype == pf.FP8_DTYPE
    _same(rows, pf.quantize_rows(h))
    # The rows are h to e4m3's precision: |q * s - h| <= half an e4m3 step of |h|'s binade
    # (relative 2**-4), or the subnormal grid's half step s * 2**-10.
    err = (pf.dequantize_rows(rows, torch.float32) - h.float()).abs()
    assert bool((err <= torch.maximum(h.float().abs() * 2.0 ** -4,
                                      rows.scale[:, None] * 2.0 ** -10)).all())
    dgu, drows, dw = pf.swiglu_packed_bwd_fp8(res, dh)
    pdgu, pdw = pa.swiglu_packed_bwd(pres, dh)
    assert torch.equal(dgu, pdgu) and torch.equal(dw, pdw)
    _same(drows, pf.quantize_rows(pdgu))
    assert pf.swiglu_packed_bwd_fp8(res, dh, needs=(True, False))[2] is None


def test_twins_refuse_what_they_cannot_do():
    gu, w, dh = _inputs()
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        pf.swiglu_packed_fwd_fp8(gu.double(), None, act_id=0, alpha=0.0, limit=0.0,
                                 layout_id=0)
    _, res = pf.swiglu_packed_fwd_fp8(gu, w, act_id=0, alpha=0.0, limit=0.0, layout_id=0)
    with pytest.raises(ValueError, match="d_weights alone"):
        pf.swiglu_packed_bwd_fp8(res, dh, needs=(False, True))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        pf.swiglu_packed_bwd_fp8(res._replace(gate_up=gu.double()), dh.double())

"""The ``moe_fn::*`` custom ops: schemas and fakes (opcheck), torch.compile, and the
wrappers' pure-compatible signatures, including the Triton branch run under the interpreter."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import moe_fn.kernels as ops
from moe_fn.kernels import _registry
from moe_fn.pure import activations as pa
from moe_fn.pure import fp8 as pf
from moe_fn.pure import row_weight as pr
from moe_fn.testing import assert_close_to_ref
from tests.kernels.forcing import force_triton

OPS = torch.ops.moe_fn
OAI = pa.resolve_activation("swiglu_oai")


def _t(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=gen) * 2).to(dtype)


def _samples():
    n, i = 6, 5
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        g, u, dh = _t(n, i, dtype=dtype), _t(n, i, dtype=dtype, seed=1), _t(n, i, dtype=dtype)
        gu = _t(n, 2 * i, dtype=dtype, seed=2)
        w = _t(n, dtype=dtype, seed=3).abs()
        for act in pa.ACTIVATIONS:
            act_id, alpha, limit = pa.resolve_activation(act)
            yield OPS.swiglu_fwd.default, (g, u, w, act_id, alpha, limit)
            yield OPS.swiglu_bwd.default, (g, u, w, dh, act_id, alpha, limit, True, True, True)
            for layout_id in (0, 1):
                yield OPS.swiglu_packed_fwd.default, (gu, None, act_id, alpha, limit, layout_id)
                yield OPS.swiglu_packed_bwd.default, (gu, w, dh, act_id, alpha, limit, layout_id,
                                                      True, True)
        yield OPS.swiglu_fwd.default, (g, u, None, *OAI)
        yield OPS.swiglu_bwd.default, (g, u, None, dh, *OAI, True, False, True)
        yield OPS.swiglu_packed_bwd.default, (gu, None, dh, *OAI, 1, False, True)
        yield OPS.row_weight_fwd.default, (g, w)
        yield OPS.row_weight_bwd.default, (g, w, dh, True, True)
        yield OPS.row_weight_bwd.default, (g, w, dh, False, True)
        yield OPS.row_weight_bwd.default, (g, w, dh, True, False)


@pytest.mark.parametrize("op,args", list(_samples()),
                         ids=lambda x: getattr(x, "__name__", None) if callable(x) else "")
def test_opcheck(op, args):
    opcheck(op, args)


def _fp8_samples():
    x, gu = _t(6, 32, dtype=torch.bfloat16), _t(5, 14, seed=1)
    w, dh = _t(5, seed=2).abs(), _t(5, 7, seed=3)
    idx = torch.tensor([4, 0, 0, 2])
    rows = pf.quantize_rows(x)
    packed = pf.quantize_rows_packed(x)
    yield OPS.quantize_rows.default, (x, None)
    yield OPS.quantize_rows.default, (gu, idx)
    yield OPS.quantize_rows_packed.default, (x, idx)
    yield OPS.quantize_rows_t.default, (x.reshape(2, 3, 32),)
    yield OPS.quantize_rows_t.default, (gu.reshape(5, 7, 2).transpose(1, 2),)
    view = pf.unpack_rows_fp8(packed, 32)
    yield OPS.dequantize_rows.default, (rows.q.view(torch.uint8), rows.scale, torch.bfloat16)
    yield OPS.dequantize_rows.default, (view.q.view(torch.uint8), view.scale, torch.float32)
    yield OPS.swiglu_packed_fwd_fp8.default, (gu, w, *OAI, 1)
    yield OPS.swiglu_packed_fwd_fp8.default, (gu.bfloat16(), None, 0, 0.0, 0.0, 0)
    yield OPS.swiglu_packed_bwd_fp8.default, (gu, w, dh, *OAI, 0, True)
    yield OPS.swiglu_packed_bwd_fp8.default, (gu, None, dh, 3, 0.0, 0.0, 1, True)


@pytest.mark.parametrize("op,args", list(_fp8_samples()),
                         ids=lambda x: getattr(x, "__name__", None) if callable(x) else "")
def test_opcheck_fp8(op, args):
    opcheck(op, args)


def test_compile_fullgraph_fp8():
    x, gu, w, dh = _t(6, 16), _t(6, 10, seed=1), _t(6, seed=2).abs(), _t(6, 5, seed=3)
    idx = torch.tensor([1, 4, 4])

    def step(x, idx, gu, w, dh):
        rows = ops.quantize_rows(x, idx)
        packed = ops.quantize_rows_packed(x)
        back = ops.dequantize_rows(rows, torch.bfloat16)
        hq, res = ops.swiglu_packed_fwd_fp8(gu, w, act_id=OAI[0], alpha=OAI[1], limit=OAI[2],
                                            layout_id=1)
        dgu, dq, dw = ops.swiglu_packed_bwd_fp8(res, dh)
        return (*rows, packed, back, *hq, dgu, *dq, dw)

    eager = step(x, idx, gu, w, dh)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, idx, gu, w, dh)
    for a, b in zip(eager, compiled, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == pf.FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == pf.FP8_DTYPE else b)


def test_opcheck_empty():
    g = torch.empty(0, 4)
    w = torch.empty(0)
    opcheck(OPS.swiglu_packed_bwd.default, (torch.empty(0, 8), w, g, *OAI, 0, True, True))
    opcheck(OPS.row_weight_bwd.default, (g, w, g, True, True))


def test_compile_fullgraph():
    gu, w, dh = _t(7, 10), _t(7).abs(), _t(7, 5)
    x = _t(7, 3)

    def step(gu, w, dh, x):
        h, res = ops.swiglu_packed_fwd(gu, w, act_id=OAI[0], alpha=OAI[1], limit=OAI[2],
                                       layout_id=1)
        dgu, dw = ops.swiglu_packed_bwd(res, dh)
        h2, res2 = ops.swiglu_fwd(gu[:, :5], gu[:, 5:], None, act_id=0, alpha=0.0, limit=0.0)
        dg, du, dw2 = ops.swiglu_bwd(res2, dh, needs=(True, False, True))
        y, rres = ops.row_weight_fwd(x, w)
        dx, dww = ops.row_weight_bwd(rres, y)
        return h, dgu, dw, h2, dg, du, dw2, y, dx, dww

    eager = step(gu, w, dh, x)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(gu, w, dh, x)
    assert compiled[5] is None and compiled[6] is None
    for a, b in zip(eager, compiled):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _compare_wrappers(exact):
    """The kernels wrappers against the pure pairs: same structure, same values (the same
    bits on the pure path; the tolerance rule against the pure pairs in float64 for the
    float32 kernels)."""
    n, i = 9, 7
    g, u, dh = _t(n, i), _t(n, i, seed=1), torch.ones(1, 1).expand(n, i)
    gu, w, x = _t(n, 2 * i, seed=2), _t(n, seed=3).abs(), _t(n, 4, seed=4)
    g64, u64, dh64, gu64, w64, x64 = (t.double() for t in (g, u, dh, gu, w, x))

    def same(a, b, ref):
        assert type(a) is type(b)
        if isinstance(a, tuple):
            assert len(a) == len(b) == len(ref)
            for p, q, r in zip(a, b, ref):
                same(p, q, r)
        elif isinstance(a, torch.Tensor):
            if exact:
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            else:
                assert_close_to_ref(a, b, ref)
        elif isinstance(a, float):
            assert a == b == ref
        else:
            assert a == b

    for weights, weights64 in ((None, None), (w, w64)):
        for needs in ((True, True, True), (False, True, False), (True, False, True)):
            kw = dict(act_id=OAI[0], alpha=OAI[1], limit=OAI[2])
            hk, rk = ops.swiglu_fwd(g, u, weights, **kw)
            hp, rp = pa.swiglu_fwd(g, u, weights, **kw)
            h64, r64 = pa.swiglu_fwd(g64, u64, weights64, **kw)
            same((hk, rk), (hp, rp), (h64, r64))
            same(ops.swiglu_bwd(rk, dh, needs=needs), pa.swiglu_bwd(rp, dh, needs=needs),
                 pa.swiglu_bwd(r64, dh64, needs=needs))
            for layout_id in (0, 1):
                hk, rk = ops.swiglu_packed_fwd(gu, weights, **kw, layout_id=layout_id)
                hp, rp = pa.swiglu_packed_fwd(gu, weights, **kw, layout_id=layout_id)
                h64, r64 = pa.swiglu_packed_fwd(gu64, weights64, **kw, layout_id=layout_id)
                same((hk, rk), (hp, rp), (h64, r64))
                same(ops.swiglu_packed_bwd(rk, dh, needs=needs[1:]),
                     pa.swiglu_packed_bwd(rp, dh, needs=needs[1:]),
                     pa.swiglu_packed_bwd(r64, dh64, needs=needs[1:]))
    for needs in ((True, True), (False, True), (True, False)):
        ok, rk = ops.row_weight_fwd(x, w)
        op_, rp = pr.row_weight_fwd(x, w)
        o64, r64 = pr.row_weight_fwd(x64, w64)
        same((ok, rk), (op_, rp), (o64, r64))
        same(ops.row_weight_bwd(rk, x, needs=needs), pr.row_weight_bwd(rp, x, needs=needs),
             pr.row_weight_bwd(r64, x64, needs=needs))


def test_wrappers_pure_path():
    _compare_wrappers(exact=True)


def test_wrappers_triton_path(monkeypatch):
    """The ops' Triton branch (normally CUDA only), forced on CPU under the interpreter."""
    calls = force_triton(monkeypatch, _registry)
    _compare_wrappers(exact=False)
    assert calls


def test_wrapper_signatures_match_pure():
    import inspect

    for name in ("swiglu_fwd", "swiglu_bwd", "swiglu_packed_fwd", "swiglu_packed_bwd",
                 "row_weight_fwd", "row_weight_bwd"):
        mod = pr if name.startswith("row") else pa
        assert inspect.signature(getattr(ops, name)) == inspect.signature(getattr(mod, name)), name
    for name in ("quantize_rows", "quantize_rows_packed", "dequantize_rows",
                 "swiglu_packed_fwd_fp8", "swiglu_packed_bwd_fp8"):
        assert inspect.signature(getattr(ops, name)) == inspect.signature(getattr(pf, name)), name
        assert name in ops.__all__, name


def test_fp8_wrappers_triton_path(monkeypatch):
    """The FP8 ops' Triton branch (normally CUDA only), forced on CPU under the
    interpreter: the pure functions' bits, and for the activations quantize_rows of the
    bf16 ops' results through the same branch."""
    calls = force_triton(monkeypatch, _registry)
    x, idx = _t(7, 32, dtype=torch.bfloat16), torch.tensor([6, 1, 1])
    rows = ops.quantize_rows(x, idx)
    want = pf.quantize_rows(x, idx)
    assert torch.equal(rows.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(rows.scale, want.scale)
    assert torch.equal(ops.quantize_rows_packed(x, idx), pf.quantize_rows_packed(x, idx))
    assert torch.equal(ops.dequantize_rows(want, torch.float32),
                       pf.dequantize_rows(want, torch.float32))
    gu, w, dh = _t(9, 14, seed=1), _t(9, seed=2).abs(), _t(9, 7, seed=3)
    for layout_id in (0, 1):
        kw = dict(act_id=OAI[0], alpha=OAI[1], limit=OAI[2], layout_id=layout_id)
        h, res = ops.swiglu_packed_fwd(gu, w, **kw)
        hq, res8 = ops.swiglu_packed_fwd_fp8(gu, w, **kw)
        assert torch.equal(hq.q.view(torch.uint8), pf.quantize_rows(h).q.view(torch.uint8))
        assert torch.equal(hq.scale, pf.quantize_rows(h).scale)
        dgu, dw = ops.swiglu_packed_bwd(res, dh)
        dgu8, dq, dw8 = ops.swiglu_packed_bwd_fp8(res8, dh)
        assert torch.equal(dgu8, dgu) and torch.equal(dw8, dw)
        assert torch.equal(dq.q.view(torch.uint8), pf.quantize_rows(dgu).q.view(torch.uint8))
    assert calls


def test_ops_reject_bad_shapes():
    g = _t(4, 3)
    with pytest.raises(ValueError, match="incoming gradient"):
        OPS.swiglu_bwd(g, g, None, _t(4, 2), 0, 0.0, 0.0, True, True, True)
    with pytest.raises(ValueError, match="even"):
        OPS.swiglu_packed_fwd(g, None, 0, 0.0, 0.0, 0)

"""Triton activation kernels against their pure pairs, on the CPU under TRITON_INTERPRET=1.

Tolerance from the data: the kernel's error against a float64 computation may be at most
twice the error of the pure same-precision computation plus one step of the dtype.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moe_fn.kernels import activation as K
from moe_fn.pure import activations as P
from moe_fn.testing import assert_close_to_ref, reference_activation

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTS = P.ACTIVATIONS
LIMIT = 2.0  # small, so both sides of the clamps are hit often


def _interp_required():
    if not K.interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 before triton is imported")


def _consts(act):
    act_id, alpha, limit = P.resolve_activation(act, limit=LIMIT if "clamped" in act or
                                                "oai" in act else None)
    return act_id, alpha, limit


def _inputs(n, i, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, i, generator=gen) * 3
    u = torch.randn(n, i, generator=gen) * 3
    if n and i:  # exact ties at the clamp limits
        g[0, 0], u[0, 0] = LIMIT, LIMIT
        if i > 1:
            g[0, 1], u[0, 1] = -LIMIT, -LIMIT
    w = torch.rand(n, generator=gen) + 0.25
    dh = torch.randn(n, i, generator=gen)
    return g.to(dtype), u.to(dtype), w.to(dtype), dh.to(dtype)


def _d(t):
    return None if t is None else t.double()


def _make_packed(g, u, layout_id, form):
    """A packed tensor holding (g, u); ``form`` in contiguous / rowslice / transposed."""
    packed = P.join_packed(g, u, layout_id)
    n, two_i = packed.shape
    if form == "rowslice":  # row stride larger than 2I
        big = torch.zeros(n, two_i + 7, dtype=packed.dtype)
        big[:, 3:3 + two_i] = packed
        packed = big[:, 3:3 + two_i]
    elif form == "transposed":  # column stride != 1
        packed = packed.t().contiguous().t()
    return packed


def _check_separate(g, u, w, dh, act, needs=(True, True, True)):
    act_id, alpha, limit = _consts(act)
    h = K.launch_swiglu_fwd(g, u, w, act_id, alpha, limit)
    hp, res = P.swiglu_fwd(g, u, w, act_id=act_id, alpha=alpha, limit=limit)
    h64, res64 = P.swiglu_fwd(_d(g), _d(u), _d(w), act_id=act_id, alpha=alpha, limit=limit)
    assert_close_to_ref(h, hp, h64, "h")
    got = K.launch_swiglu_bwd(g, u, w, dh, act_id, alpha, limit, needs)
    pure = P.swiglu_bwd(res, dh, needs=needs)
    ref = P.swiglu_bwd(res64, _d(dh), needs=needs)
    for name, a, b, c in zip(("d_gate", "d_up", "d_weights"), got, pure, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close_to_ref(a, b, c, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("with_w", [False, True])
def test_separate(dtype, act, with_w):
    _interp_required()
    g, u, w, dh = _inputs(19, 33, dtype)
    _check_separate(g, u, w if with_w else None, dh, act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", P.LAYOUTS)
@pytest.mark.parametrize("with_w", [False, True])
def test_packed(dtype, act, layout, with_w):
    _interp_required()
    g, u, w, dh = _inputs(21, 37, dtype, seed=1)
    _check_packed(g, u, w if with_w else None, dh, act, layout, "contiguous")


def _check_packed(g, u, w, dh, act, layout, form, needs=(True, True)):
    act_id, alpha, limit = _consts(act)
    layout_id = P.resolve_layout(layout)
    gu = _make_packed(g, u, layout_id, form)
    h = K.launch_swiglu_packed_fwd(gu, w, act_id, alpha, limit, layout_id)
    hp, res = P.swiglu_packed_fwd(gu, w, act_id=act_id, alpha=alpha, limit=limit,
                                  layout_id=layout_id)
    h64, res64 = P.swiglu_packed_fwd(_d(gu), _d(w), act_id=act_id, alpha=alpha, limit=limit,
                                     layout_id=layout_id)
    assert_close_to_ref(h, hp, h64, "h")
    got = K.launch_swiglu_packed_bwd(gu, w, dh, act_id, alpha, limit, layout_id, needs)
    pure = P.swiglu_packed_bwd(res, dh, needs=needs)
    ref = P.swiglu_packed_bwd(res64, _d(dh), needs=needs)
    for name, a, b, c in zip(("d_gate_up", "d_weights"), got, pure, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close_to_ref(a, b, c, name)


@pytest.mark.parametrize("layout", P.LAYOUTS)
@pytest.mark.parametrize("form", ["rowslice", "transposed"])
@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai"])
def test_packed_non_contiguous(layout, form, act):
    _interp_required()
    g, u, w, dh = _inputs(17, 5, torch.bfloat16, seed=2)
    _check_packed(g, u, w[::1], dh.t().contiguous().t(), act, layout, form)


@pytest.mark.parametrize("i", [1, 5, 33, 70])
def test_odd_widths(i):
    _interp_required()
    g, u, w, dh = _inputs(18, i, torch.float32, seed=3)
    _check_separate(g, u, w, dh, "swiglu_clamped")
    _check_packed(g, u, w, dh, "geglu_tanh", "interleaved", "contiguous")
    _check_packed(g, u, w, dh, "swiglu_oai", "halves", "contiguous")


def test_separate_non_contiguous():
    _interp_required()
    g, u, w, dh = _inputs(23, 9, torch.float16, seed=4)
    g_nc = torch.zeros(23, 40, dtype=g.dtype)[:, 1:37:4]
    g_nc.copy_(g)
    u_t = u.t().contiguous().t()
    w_nc = torch.stack([w, w], dim=1)[:, 1]
    assert not g_nc.is_contiguous() and not u_t.is_contiguous() and w_nc.stride(0) == 2
    _check_separate(g_nc, u_t, w_nc, dh.t().contiguous().t(), "swiglu_oai")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_stride_dh(dtype):
    _interp_required()
    g, u, w, _ = _inputs(13, 7, dtype, seed=5)
    dh = torch.ones(1, 1, dtype=dtype).expand(13, 7)
    _check_separate(g, u, w, dh, "swiglu")
    _check_packed(g, u, w, dh, "swiglu_clamped", "halves", "contiguous")
    _check_packed(g, u, w, dh, "swiglu", "interleaved", "contiguous")


def test_mixed_weight_dtype():
    _interp_required()
    g, u, _, dh = _inputs(12, 9, torch.bfloat16, seed=6)
    w = torch.rand(12, dtype=torch.float32) + 0.5
    _check_separate(g, u, w, dh, "swiglu")
    _check_packed(g, u, w, dh, "swiglu_oai", "interleaved", "contiguous")


@pytest.mark.parametrize("needs", [(False, True, False), (True, False, True),
                                   (False, False, True)])
def test_needs_separate(needs):
    _interp_required()
    g, u, w, dh = _inputs(9, 6, torch.float32, seed=7)
    _check_separate(g, u, w, dh, "swiglu_oai", needs)


@pytest.mark.parametrize("needs", [(False, True), (True, False)])
@pytest.mark.parametrize("layout", P.LAYOUTS)
def test_needs_packed(needs, layout):
    _interp_required()
    g, u, w, dh = _inputs(9, 6, torch.float32, seed=8)
    _check_packed(g, u, w, dh, "swiglu", layout, "contiguous", needs)


@pytest.mark.parametrize("n,i", [(0, 8), (5, 0), (0, 0)])
def test_empty(n, i):
    _interp_required()
    g, u, w, dh = _inputs(n, i, torch.bfloat16)
    _check_separate(g, u, w, dh, "swiglu")
    _check_separate(g, u, None, dh, "swiglu")
    for layout in P.LAYOUTS:
        _check_packed(g, u, w, dh, "swiglu_oai", layout, "contiguous")
    _, _, dw = K.launch_swiglu_bwd(g, u, w, dh, 0, 0.0, 0.0)
    assert dw.shape == (n,) and bool((dw == 0).all())


@pytest.mark.parametrize("alpha", [3.0e38, -3.0e38])
def test_oai_gate_gradient_where_alpha_times_gate_overflows(alpha):
    """alpha * g past float32's range: the sigmoid is flat there, so the gate gradient is
    finite and equals float64's (not inf * 0 = NaN), kernel and pure alike."""
    _interp_required()
    act_id, alpha, limit = P.resolve_activation("swiglu_oai", alpha=alpha)
    g = torch.tensor([[-2.0, -1e-39, 0.0, 0.5, 2.0, 9.0]])
    u = torch.ones_like(g)
    dh = torch.ones_like(g)
    g64 = g.double().requires_grad_()
    want, = torch.autograd.grad(reference_activation(g64, u.double(), "swiglu_oai", alpha=alpha,
                                                     limit=limit).sum(), g64)
    pure = P.act_value_and_grads(g, u, act_id, alpha, limit, grads=True)[1]
    kern = K.launch_swiglu_bwd(g, u, None, dh, act_id, alpha, limit)[0]
    for got in (pure, kern):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_rejects_float64():
    g = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        K.launch_swiglu_fwd(g, g, None, 0, 0.0, 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", P.LAYOUTS)
def test_cuda_ops_match_pure(layout):
    from moe_fn import kernels as ops

    torch.manual_seed(0)
    gu = (torch.randn(257, 2 * 200, device="cuda") * 3).bfloat16()
    w = torch.rand(257, device="cuda").bfloat16()
    dh = torch.randn(257, 200, device="cuda").bfloat16()
    lid = P.resolve_layout(layout)
    act_id, alpha, limit = P.resolve_activation("swiglu_oai")
    h, res = ops.swiglu_packed_fwd(gu, w, act_id=act_id, alpha=alpha, limit=limit, layout_id=lid)
    hp, resp = P.swiglu_packed_fwd(gu, w, act_id=act_id, alpha=alpha, limit=limit, layout_id=lid)
    h64, res64 = P.swiglu_packed_fwd(gu.double(), w.double(), act_id=act_id, alpha=alpha,
                                     limit=limit, layout_id=lid)
    assert_close_to_ref(h, hp, h64, "h")
    for a, b, c in zip(ops.swiglu_packed_bwd(res, dh), P.swiglu_packed_bwd(resp, dh),
                       P.swiglu_packed_bwd(res64, dh.double())):
        assert_close_to_ref(a, b, c)

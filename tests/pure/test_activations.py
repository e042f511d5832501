"""The activation pairs against autograd of a naive oracle written from the formulas."""

import pytest
import torch

from moe_fn.pure.activations import (
    ACTIVATIONS,
    LAYOUTS,
    resolve_activation,
    resolve_layout,
    swiglu_bwd,
    swiglu_fwd,
    swiglu_packed_bwd,
    swiglu_packed_fwd,
)
from moe_fn.testing import reference_activation

ALPHA, LIMIT = 1.5, 0.75  # a small limit so the clamps are exercised by randn inputs


def resolved(name):
    alpha = ALPHA if name == "swiglu_oai" else None
    limit = LIMIT if name in ("swiglu_clamped", "swiglu_oai") else None
    return resolve_activation(name, alpha, limit)


def inputs(n=9, i=6, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, i, generator=gen, dtype=dtype) * 1.5
    u = torch.randn(n, i, generator=gen, dtype=dtype) * 1.5
    # Ties at the clamp limit: clamp's gradient passes on the closed interval.
    g[0, :3] = LIMIT
    u[1, :2] = LIMIT
    u[2, :2] = -LIMIT
    w = torch.rand(n, generator=gen, dtype=dtype) + 0.1
    dh = torch.randn(n, i, generator=gen, dtype=dtype)
    return g, u, w, dh


def oracle_grads(g, u, w, dh, name):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    wt = None if w is None else w.clone().requires_grad_()
    h = reference_activation(g, u, name, alpha=ALPHA, limit=LIMIT)
    if wt is not None:
        h = h * wt[:, None]
    leaves = [g, u] + ([wt] if wt is not None else [])
    grads = torch.autograd.grad(h, leaves, dh)
    return h.detach(), grads


@pytest.mark.parametrize("with_w", [False, True])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_swiglu_pair_matches_oracle(name, with_w):
    g, u, w, dh = inputs()
    w = w if with_w else None
    act_id, alpha, limit = resolved(name)
    h, res = swiglu_fwd(g, u, w, act_id=act_id, alpha=alpha, limit=limit)
    dg, du, dw = swiglu_bwd(res, dh)
    h_ref, grads = oracle_grads(g, u, w, dh, name)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(dg, grads[0])
    torch.testing.assert_close(du, grads[1])
    if with_w:
        torch.testing.assert_close(dw, grads[2])
    else:
        assert dw is None


@pytest.mark.parametrize("with_w", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_swiglu_packed_pair_matches_oracle(name, layout, with_w):
    g, u, w, dh = inputs(seed=1)
    w = w if with_w else None
    # Pack by hand from the layout's definition, not with the module's helper.
    if layout == "halves":
        gu = torch.cat([g, u], dim=1)
    else:
        gu = torch.empty(g.shape[0], 2 * g.shape[1], dtype=g.dtype)
        gu[:, 0::2], gu[:, 1::2] = g, u
    act_id, alpha, limit = resolved(name)
    h, res = swiglu_packed_fwd(gu, w, act_id=act_id, alpha=alpha, limit=limit,
                               layout_id=resolve_layout(layout))
    dgu, dw = swiglu_packed_bwd(res, dh)
    h_ref, grads = oracle_grads(g, u, w, dh, name)
    torch.testing.assert_close(h, h_ref)
    if layout == "halves":
        dg, du = dgu[:, : g.shape[1]], dgu[:, g.shape[1]:]
    else:
        dg, du = dgu[:, 0::2], dgu[:, 1::2]
    torch.testing.assert_close(dg, grads[0])
    torch.testing.assert_close(du, grads[1])
    if with_w:
        torch.testing.assert_close(dw, grads[2])
    else:
        assert dw is None


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_swiglu_pair_needs_and_low_precision(name):
    g, u, w, dh = inputs(seed=2)
    act_id, alpha, limit = resolved(name)
    _, res = swiglu_fwd(g, u, w, act_id=act_id, alpha=alpha, limit=limit)
    assert swiglu_bwd(res, dh, needs=(False, True, False))[0::2] == (None, None)
    # bf16 inputs: math in float32, so the error is one rounding of the output.
    hb, _ = swiglu_fwd(g.bfloat16(), u.bfloat16(), w.bfloat16(), act_id=act_id, alpha=alpha,
                       limit=limit)
    gb, ub, wb = (t.bfloat16().double() for t in (g, u, w))
    ref = reference_activation(gb, ub, name, alpha=ALPHA, limit=LIMIT) * wb[:, None]
    assert hb.dtype == torch.bfloat16
    assert (hb.double() - ref).abs().max() <= 2**-8 * ref.abs().max() + 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_swiglu_backward_low_precision(name, dtype):
    """Half inputs: the backward's math runs in float32, so every gradient element is within
    one rounding of float64 autograd of the naive formula on the same (rounded) inputs
    (math in the half type misses this by up to 4x)."""
    g, u, w, dh = (t.to(dtype) for t in inputs(n=64, i=48, seed=3))
    act_id, alpha, limit = resolved(name)
    _, res = swiglu_fwd(g, u, w, act_id=act_id, alpha=alpha, limit=limit)
    got = swiglu_bwd(res, dh)
    _, want = oracle_grads(g.double(), u.double(), w.double(), dh.double(), name)
    half_ulp = torch.finfo(dtype).eps / 2
    for a, b, what in zip(got, want, ("d_gate", "d_up", "d_weights")):
        assert a.dtype == dtype, what
        err = (a.double() - b).abs()
        bound = half_ulp * b.abs() + 1e-6 * b.abs().max()
        if what == "d_weights":  # a sum over I products, rounded once at the end
            bound = half_ulp * b.abs() + 1e-6 * b.abs().max() * g.shape[1]
        assert bool((err <= bound).all()), (what, float((err - bound).max()))

"""The expert MLP pairs against autograd of a naive float64 per-expert oracle."""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fn.pure import activations as pure_act
from moe_fn.pure.activations import ACTIVATIONS, LAYOUTS, resolve_activation, resolve_layout
from moe_fn.pure.experts import experts_bwd, experts_bwd_input, experts_bwd_weight, experts_fwd
from moe_fn.pure.gate_up import (
    gate_up_fused_bwd,
    gate_up_fused_fwd,
    gate_up_separate_bwd,
    gate_up_separate_fwd,
)
from moe_fn.testing import assert_all_close_to_ref, assert_close_to_ref, reference_experts

ALPHA, LIMIT = 1.5, 1.0


def naive_experts(x, gup, down, counts, w, name, layout):
    return reference_experts(x, gup, down, counts, activation=name, layout=layout,
                             alpha=ALPHA, limit=LIMIT, weights=w)


def statics(name, layout):
    alpha = ALPHA if name == "swiglu_oai" else None
    limit = LIMIT if name in ("swiglu_clamped", "swiglu_oai") else None
    act_id, alpha, limit = resolve_activation(name, alpha, limit)
    return dict(act_id=act_id, alpha=alpha, limit=limit, layout_id=resolve_layout(layout))


def make(counts, h, i, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, e = sum(counts), len(counts)
    x = torch.randn(n, h, generator=gen)
    gup = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    down = torch.randn(e, h, i, generator=gen) / i**0.5
    w = torch.rand(n, generator=gen) + 0.1
    dy = torch.randn(n, h, generator=gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return [t.to(dtype) for t in (x, gup, down, w, dy)] + [offs]


def oracle(x, gup, down, w, dy, counts, name, layout, dtype=torch.float64):
    """Autograd of the naive loop in ``dtype``: float64 is the oracle, the inputs' own
    precision is plain PyTorch for the tolerance rule."""
    leaves = [t.to(dtype).clone().requires_grad_() for t in (x, gup, down)]
    wr = None if w is None else w.to(dtype).clone().requires_grad_()
    y = naive_experts(*leaves, counts, wr, name, layout)
    grads = torch.autograd.grad(y, leaves + ([wr] if wr is not None else []), dy.to(dtype))
    return y.detach(), grads


def run_pair(x, gup, down, offs, w, dy, name, layout, fused):
    y, res = experts_fwd(x, gup, down, offs, w, fused=fused, **statics(name, layout))
    out = experts_bwd(res, dy)
    assert out[4:] == (None, None)  # no biases, no bias gradients
    return (y,) + out[:4]


@pytest.mark.parametrize("with_w", [False, True])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_experts_pair_matches_oracle(name, layout, fused, with_w):
    counts = [3, 0, 4, 2]
    x, gup, down, w, dy, offs = make(counts, 5, 3)
    w = w if with_w else None
    y, dx, dgup, ddown, dw = run_pair(x, gup, down, offs, w, dy, name, layout, fused)
    yr, grads = oracle(x, gup, down, w, dy, counts, name, layout)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(dx, grads[0])
    torch.testing.assert_close(dgup, grads[1])
    torch.testing.assert_close(ddown, grads[2])
    assert torch.count_nonzero(dgup[1]) == 0 and torch.count_nonzero(ddown[1]) == 0
    if with_w:
        torch.testing.assert_close(dw, grads[3])
    else:
        assert dw is None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fused", [True, False])
def test_grouped_mm_path_float32(layout, fused):
    """Aligned float32 widths go through torch._grouped_mm, views of halves included."""
    counts = [5, 0, 3]
    x, gup, down, w, dy, offs = make(counts, 8, 8, dtype=torch.float32)
    out = run_pair(x, gup, down, offs, w, dy, "swiglu_oai", layout, fused)
    yr, grads = oracle(x, gup, down, w, dy, counts, "swiglu_oai", layout)
    yp, gp = oracle(x, gup, down, w, dy, counts, "swiglu_oai", layout, dtype=torch.float32)
    assert_all_close_to_ref(out, (yp,) + gp, (yr,) + grads, ("y", "dx", "dgup", "ddown", "dw"))


@settings(max_examples=15, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=4),
       fused=st.booleans(), layout=st.sampled_from(LAYOUTS),
       name=st.sampled_from(ACTIVATIONS))
def test_hypothesis_counts(counts, fused, layout, name):
    x, gup, down, w, dy, offs = make(counts, 3, 2, seed=len(counts))
    out = run_pair(x, gup, down, offs, w, dy, name, layout, fused)
    yr, grads = oracle(x, gup, down, w, dy, counts, name, layout)
    for got, ref in zip(out, (yr,) + grads):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gate_up_fused_and_separate_pairs_agree_with_oracle(layout):
    counts = [2, 0, 3]
    x, gup, down, w, dy, offs = make(counts, 4, 3)
    lid = resolve_layout(layout)
    gu, res_f = gate_up_fused_fwd(x, gup, offs, layout_id=lid)
    (g, u), res_s = gate_up_separate_fwd(x, gup, offs, layout_id=lid)
    ga, ua = (gu[:, :3], gu[:, 3:]) if layout == "halves" else (gu[:, 0::2], gu[:, 1::2])
    # Oracle: per-expert loop over the rows of the weight named by the layout.
    xr, wr = x.clone().requires_grad_(), gup.clone().requires_grad_()
    sel = (slice(0, 3), slice(3, 6)) if layout == "halves" else (slice(0, None, 2),
                                                                 slice(1, None, 2))
    gr = torch.cat([xr[s:e] @ wr[k, sel[0]].t() for k, (s, e) in enumerate([(0, 2), (2, 2),
                                                                          (2, 5)])])
    ur = torch.cat([xr[s:e] @ wr[k, sel[1]].t() for k, (s, e) in enumerate([(0, 2), (2, 2),
                                                                          (2, 5)])])
    torch.testing.assert_close(g, gr.detach())
    torch.testing.assert_close(u, ur.detach())
    torch.testing.assert_close(ga, gr.detach())
    torch.testing.assert_close(ua, ur.detach())
    dg, du = torch.randn_like(g), torch.randn_like(u)
    dxr, dwr = torch.autograd.grad((gr, ur), (xr, wr), (dg, du))
    dgu = torch.cat([dg, du], 1) if layout == "halves" else torch.stack([dg, du], 2).flatten(1)
    for dx, dW in (gate_up_fused_bwd(res_f, dgu), gate_up_separate_bwd(res_s, dg, du)):
        torch.testing.assert_close(dx, dxr)
        torch.testing.assert_close(dW, dwr)


def test_split_backward_composes_and_defers():
    counts = [4, 0, 4]
    x, gup, down, w, dy, offs = make(counts, 8, 8, dtype=torch.float32)
    for fused in (True, False):
        _, res = experts_fwd(x, gup, down, offs, w, fused=fused, **statics("swiglu", "halves"))
        dx, dw, work = experts_bwd_input(res, dy.t().contiguous().t())
        assert work.dy.is_contiguous()
        d_gup, d_down, d_gub, d_db = experts_bwd_weight(work)  # later, on its own
        assert d_gub is None and d_db is None
        # experts_bwd is these two calls on the same (contiguous) dy: the same bits.
        full = experts_bwd(res, dy)
        torch.testing.assert_close((dx, d_gup, d_down, dw, None, None), full, rtol=0, atol=0)
        none = experts_bwd(res, dy, needs=(False, False, True, False, True, True))
        assert none[0] is None and none[1] is None and none[3] is None
        assert torch.equal(none[2], d_down)


def test_act_impl_is_used():
    calls = []

    def wrap(fn):
        def inner(*a, **k):
            calls.append(fn.__name__)
            return fn(*a, **k)
        return inner

    impl = types.SimpleNamespace(**{n: wrap(getattr(pure_act, n)) for n in (
        "swiglu_fwd", "swiglu_bwd", "swiglu_packed_fwd", "swiglu_packed_bwd")})
    x, gup, down, w, dy, offs = make([2, 3], 4, 2)
    for fused in (True, False):
        _, res = experts_fwd(x, gup, down, offs, w, fused=fused, act_impl=impl,
                             **statics("swiglu", "halves"))
        experts_bwd(res, dy)
    assert calls == ["swiglu_packed_fwd", "swiglu_packed_bwd", "swiglu_fwd", "swiglu_bwd"]


def _max_err(a, ref):
    return (a.double() - ref).abs().max().item()


def test_fused_vs_separate_float32_tight():
    counts = [6, 0, 10]
    x, gup, down, w, dy, offs = make(counts, 16, 16, dtype=torch.float32)
    names = ("y", "dx", "dgup", "ddown", "dw")
    for layout in LAYOUTS:
        # Two float32 summation orders: each within twice plain float32's error of float64.
        ref = oracle(x, gup, down, w, dy, counts, "swiglu_oai", layout)
        plain = oracle(x, gup, down, w, dy, counts, "swiglu_oai", layout, dtype=torch.float32)
        ref, plain = (ref[0],) + ref[1], (plain[0],) + plain[1]
        for fused in (True, False):
            got = run_pair(x, gup, down, offs, w, dy, "swiglu_oai", layout, fused)
            assert_all_close_to_ref(got, plain, ref, names)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_vs_separate_bf16_error_rule(layout):
    """Error of each path vs float64 <= 2 x (plain bf16 PyTorch vs float64) + one bf16 step."""
    counts = [9, 0, 23]
    x, gup, down, w, dy, offs = make(counts, 32, 16, dtype=torch.bfloat16, seed=5)
    name = "swiglu"
    yr, grads = oracle(x, gup, down, w, dy, counts, name, layout)
    # Plain bf16 PyTorch: the same naive loop run in bf16 with autograd.
    leaves = [t.clone().requires_grad_() for t in (x, gup, down, w)]
    yp = naive_experts(*leaves[:3], counts, leaves[3], name, layout)
    gp = torch.autograd.grad(yp, leaves, dy)
    refs, plains = (yr,) + grads, (yp.detach(),) + gp
    for fused in (True, False):
        out = run_pair(x, gup, down, offs, w, dy, name, layout, fused)
        for got, ref, plain in zip(out, refs, plains):
            assert got.dtype == torch.bfloat16
            bound = 2 * _max_err(plain, ref) + 2**-8 * ref.abs().max().item()
            assert _max_err(got, ref) <= bound


# ---- expert biases (GPT-OSS) -------------------------------------------------------------


def naive_experts_biased(x, gup, down, gub, db, counts, w, name, layout):
    return reference_experts(x, gup, down, counts, activation=name, layout=layout,
                             alpha=ALPHA, limit=LIMIT, weights=w, gate_up_bias=gub,
                             down_bias=db)


def make_biases(e, h, i, dtype=torch.float64, seed=3):
    gen = torch.Generator().manual_seed(seed)
    gub, db = torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen)
    return gub.to(dtype), db.to(dtype)


@pytest.mark.parametrize("with_w", [False, True])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_pair_with_biases_matches_oracle(layout, fused, with_w):
    counts = [3, 0, 4, 2]
    x, gup, down, w, dy, offs = make(counts, 5, 3)
    gub, db = make_biases(4, 5, 3)
    w = w if with_w else None
    kw = statics("swiglu_oai", layout)
    y, res = experts_fwd(x, gup, down, offs, w, gub, db, fused=fused, **kw)
    dx, dgup, ddown, dw, dgub, ddb = experts_bwd(res, dy)
    leaves = [t.clone().requires_grad_() for t in (x, gup, down, gub, db)]
    wr = None if w is None else w.clone().requires_grad_()
    yr = naive_experts_biased(*leaves, counts, wr, "swiglu_oai", layout)
    want = torch.autograd.grad(yr, leaves + ([wr] if with_w else []), dy)
    torch.testing.assert_close(y, yr.detach())
    for got, ref in zip((dx, dgup, ddown, dgub, ddb) + ((dw,) if with_w else ()), want):
        torch.testing.assert_close(got, ref)
    assert not dgub[1].any() and not ddb[1].any()  # the empty expert
    # Only the biases wanted, and one bias alone.
    only = experts_bwd(res, dy, needs=(False, False, False, False, True, False))
    assert only[:4] == (None,) * 4 and only[5] is None
    torch.testing.assert_close(only[4], dgub)
    _, res1 = experts_fwd(x, gup, down, offs, w, None, db, fused=fused, **kw)
    assert experts_bwd(res1, dy)[4] is None


def test_bias_gradients_are_deferred_with_the_weight_gradients():
    """experts_bwd_input does no bias work; experts_bwd_weight returns the bias sums."""
    counts = [4, 0, 4]
    x, gup, down, w, dy, offs = make(counts, 8, 8, dtype=torch.float32)
    gub, db = make_biases(3, 8, 8, dtype=torch.float32)
    for fused in (True, False):
        _, res = experts_fwd(x, gup, down, offs, None, gub, db, fused=fused,
                             **statics("swiglu", "interleaved"))
        dx, _, work = experts_bwd_input(res, dy)
        assert work.has_gate_up_bias and work.has_down_bias
        d_gup, d_down, d_gub, d_db = experts_bwd_weight(work)
        full = experts_bwd(res, dy)
        torch.testing.assert_close((dx, d_gup, d_down, None, d_gub, d_db), full, rtol=0, atol=0)
        # Another float32 summation order than plain PyTorch's row sums: the rule.
        segments = (slice(0, 4), slice(0, 0), slice(4, 8))
        assert_close_to_ref(d_db, torch.stack([dy[r].sum(0) for r in segments]),
                            torch.stack([dy[r].double().sum(0) for r in segments]), "d_db")
        weights_only = experts_bwd_weight(work, needs=(True, True, False, False))
        assert weights_only[2:] == (None, None)


def test_bias_gradients_bfloat16_accumulate_in_float32():
    counts = [40, 0, 24]
    x, gup, down, w, dy, offs = make(counts, 16, 8, dtype=torch.bfloat16, seed=2)
    gub, db = make_biases(3, 16, 8, dtype=torch.bfloat16)
    _, res = experts_fwd(x, gup, down, offs, None, gub, db, fused=True,
                         **statics("swiglu", "halves"))
    *_, d_gub, d_db = experts_bwd(res, dy)
    assert d_gub.dtype == d_db.dtype == torch.bfloat16
    # Accumulated in float32 and rounded once: within half a bf16 step of the exact sum, plus
    # float32's summation error (any order); a bf16 accumulation misses this.
    segments = (slice(0, 40), slice(0, 0), slice(40, 64))
    exact = torch.stack([dy[r].double().sum(0) for r in segments])
    abs_sum = torch.stack([dy[r].double().abs().sum(0) for r in segments])
    f32_slop = 40 * torch.finfo(torch.float32).eps * abs_sum
    err = (d_db.double() - exact).abs()
    assert bool((err <= torch.finfo(torch.bfloat16).eps / 2 * exact.abs() + f32_slop).all())

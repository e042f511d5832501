"""The fused router kernel against the pure ``router_fwd`` (the contract), under the Triton
interpreter on CPU: indices exactly equal (ties, NaN, inf included), values within rounding;
and the ``moe_fn.kernels.router_fwd`` wrapper's dispatch and checks."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import moe_fn.kernels as K
from moe_fn.kernels.router import launch_router_fwd, launch_router_linear_fwd, linear_supported
from moe_fn.pure import router as pure_router
from moe_fn.pure.router import NORM_EPS, SCORE_FUNCS, SCORE_ID, router_fwd
from moe_fn.testing import assert_close_to_ref, error_bound
from tests.kernels.forcing import force_triton

# The kernel runs on the GPU where there is one, else in the Triton interpreter (conftest).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


def _logits(t, e, dtype=torch.float32, seed=0):
    """Random rows, then rows of exact ties, NaN, inf and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, e, generator=g) * 3
    x[0] = 0.0                                                   # all tied
    x[1] = torch.randint(-2, 3, (e,), generator=g).float()       # many ties
    x[2, ::2] = 1.5                                              # tied maximum
    x[3, e // 2] = NAN                                           # NaN sorts first
    x[4, 1] = INF
    if t > 5:
        x[5, :] = -INF
        x[5, e - 1] = 0.0
    if t > 6:
        x[6] = 0.0
        x[6, ::3] = -0.0                                         # -0.0 ties +0.0
    if t > 7:
        x[7, ::2] = NAN                                          # NaN ties NaN,
        x[7, 1::4] = -NAN                                        # sign and payload aside
        x[7, 3::8] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)
    if t > 8:
        x[8] = -200.0  # sigmoid scores all 0 in float32: renormalising needs NORM_EPS
    return x.to(dtype)


def _run_both(x, bias, *, top_k, score_func, norm, scale, n_group=1, topk_group=1,
              group_score="top2_sum"):
    with warnings.catch_warnings():
        # numpy (the interpreter) warns on the NaN/inf rows; torch does not.
        warnings.simplefilter("ignore", RuntimeWarning)
        got = launch_router_fwd(x.to(DEV), None if bias is None else bias.to(DEV),
                                top_k=top_k, score_id=SCORE_ID[score_func], norm=norm,
                                scale=scale, n_group=n_group, topk_group=topk_group,
                                top2_sum=group_score == "top2_sum")
    (idx, w), res = router_fwd(x, bias, top_k=top_k, score_func=score_func,
                               norm_topk_prob=norm, routed_scaling_factor=scale,
                               n_group=n_group, topk_group=topk_group, group_score=group_score)
    return [None if v is None else v.cpu() for v in got], (idx, w, res)


def _ref64(logits, res):
    """float64 scores, chosen scores and weights on the pure route. A chosen score that
    underflows to 0 in float32 (sigmoid(-200)) is 0 here too: the router documents float32
    scores, and renormalising those gives 0, not 1/k."""
    x64, idx = logits.cpu().double(), res.topk_idx
    score_func = SCORE_FUNCS[res.score_id]
    scores = torch.softmax(x64, dim=-1) if score_func == "softmax" else None
    if score_func == "softmax_topk":
        raw = torch.softmax(x64.gather(1, idx), dim=-1)
    else:
        raw = (scores if scores is not None else torch.sigmoid(x64)).gather(1, idx)
    w = torch.where(res.topk_raw == 0, 0.0, raw)
    if res.norm:
        w = w / (w.sum(dim=-1, keepdim=True) + NORM_EPS)
    return scores, raw, w * res.scale


def _assert_rule(got, plain, ref64, name):
    """NaN and infinities exactly where the pure router has them; the finite values by the
    tolerance rule (within twice the pure float32 error of float64)."""
    assert torch.equal(got.isnan(), plain.isnan()), name
    inf = plain.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], plain[inf]), name
    fin = plain.isfinite()
    assert_close_to_ref(got[fin], plain[fin], ref64[fin], name)


def _assert_matches(got, want, logits):
    g_idx, g_w, g_scores, g_raw = got
    idx, w, res = want
    assert g_idx.dtype == torch.int64 and g_w.dtype == g_raw.dtype == torch.float32
    assert torch.equal(g_idx, idx), (g_idx, idx)
    scores64, raw64, w64 = _ref64(logits, res)
    _assert_rule(g_raw, res.topk_raw, raw64, "topk_raw")
    _assert_rule(g_w, w, w64, "weights")
    if res.scores is None:
        assert g_scores is None
    else:
        _assert_rule(g_scores, res.scores, scores64, "scores")


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("e,top_k", [(6, 1), (6, 2), (6, 6), (60, 2), (60, 8), (64, 1),
                                     (16, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_pure(score_func, e, top_k, with_bias):
    x = _logits(13, e, seed=e + top_k)
    g = torch.Generator().manual_seed(1)
    # Quantised bias: ties in the biased choice too.
    bias = (torch.randint(-2, 3, (e,), generator=g) * 0.25) if with_bias else None
    for norm, scale in ((False, 1.0), (True, 2.5)):
        got, want = _run_both(x, bias, top_k=top_k, score_func=score_func, norm=norm,
                              scale=scale)
        _assert_matches(got, want, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
def test_kernel_half_logits(dtype, score_func):
    x = _logits(9, 60, dtype=dtype, seed=3)
    bias = torch.randn(60, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, want = _run_both(x, bias, top_k=4, score_func=score_func, norm=True, scale=1.5)
    _assert_matches(got, want, x)


def test_kernel_strided_logits_and_many_blocks():
    # Column stride 2 and a row stride of 2E; T spans several row blocks for E=256.
    wide = torch.randn(33, 2 * 256, generator=torch.Generator().manual_seed(4))
    x = wide[:, ::2]
    bias = torch.randn(256, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for score_func in SCORE_FUNCS:
        got, want = _run_both(x, bias, top_k=8, score_func=score_func, norm=True, scale=2.0)
        _assert_matches(got, want, x)


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("e,n_group,topk_group,top_k", [(64, 8, 3, 8), (16, 4, 2, 8),
                                                         (16, 4, 1, 1), (8, 2, 2, 8)])
def test_kernel_expert_groups_match_pure(group_score, score_func, e, n_group, topk_group,
                                         top_k):
    """DeepSeek-V2/V3 group-limited routing, ties, NaN and infinities included."""
    x = _logits(13, e, seed=e + n_group + topk_group)
    x[8] = 0.0
    x[8, : e // n_group] = 1.0  # group 0 wins outright; the rest tie
    x[9] = torch.arange(e) % 3 * 0.5  # every group ties on its score
    g = torch.Generator().manual_seed(6)
    bias = torch.randint(-2, 3, (e,), generator=g) * 0.25  # DeepSeek-V3's correction bias
    for b in (None, bias):
        got, want = _run_both(x, b, top_k=top_k, score_func=score_func, norm=True, scale=2.5,
                              n_group=n_group, topk_group=topk_group, group_score=group_score)
        _assert_matches(got, want, x)


def test_kernel_groups_need_a_power_of_two_expert_count():
    with pytest.raises(ValueError, match="power-of-two expert count"):
        launch_router_fwd(torch.zeros(2, 12, device=DEV), None, top_k=2, score_id=1,
                          norm=False, scale=1.0, n_group=3, topk_group=1)


def test_kernel_no_tokens():
    idx, w, scores, raw = launch_router_fwd(torch.zeros(0, 6, device=DEV), None, top_k=2,
                                            score_id=0, norm=False, scale=1.0)
    assert idx.shape == w.shape == raw.shape == (0, 2) and scores.shape == (0, 6)


def test_kernel_rejects_float64():
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        launch_router_fwd(torch.zeros(2, 4, dtype=torch.float64), None, top_k=1, score_id=0,
                          norm=False, scale=1.0)


def test_wrapper_cpu_is_pure():
    x = _logits(7, 8)
    bias = torch.randn(8)
    for kw in ({}, {"score_func": "sigmoid", "norm_topk_prob": True},
               {"n_group": 2, "topk_group": 1, "score_func": "sigmoid"}):
        (i1, w1), r1 = K.router_fwd(x, bias, top_k=2, routed_scaling_factor=2.0, **kw)
        (i2, w2), r2 = router_fwd(x, bias, top_k=2, routed_scaling_factor=2.0, **kw)
        assert torch.equal(i1, i2)
        for a, b in ((w1, w2), (r1.topk_raw, r2.topk_raw), (r1.scores, r2.scores)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert r1[3:] == r2[3:]


@pytest.mark.parametrize("args,kw", [
    ((torch.zeros(3, 4),), {"top_k": 5}),
    ((torch.zeros(3, 4),), {"top_k": 1, "score_func": "relu"}),
    ((torch.zeros(3, 4),), {"top_k": 1, "routed_scaling_factor": 0.0}),
    ((torch.zeros(3, 4), torch.zeros(5)), {"top_k": 1}),
    ((torch.zeros(3, 4, dtype=torch.int32),), {"top_k": 1}),
    ((torch.zeros(3, 4),), {"top_k": 1, "n_group": 3}),
    ((torch.zeros(3, 4),), {"top_k": 1, "n_group": 2, "topk_group": 3}),
    ((torch.zeros(3, 4),), {"top_k": 1, "topk_idx": torch.zeros(3, 2, dtype=torch.int64)}),
])
def test_wrapper_raises_like_pure(args, kw, monkeypatch):
    # On the CPU the wrapper's kernel branch is forced (under the interpreter), so that its
    # own checks, not the pure function's, are compared.
    if DEV == "cpu":
        force_triton(monkeypatch, K)
    args = tuple(a.to(DEV) for a in args)
    with pytest.raises((TypeError, ValueError)) as want:
        router_fwd(*args, **kw)
    with pytest.raises(want.type, match=re.escape(str(want.value))):
        K.router_fwd(*args, **kw)


def _wrapper_against_pure(x, bias, score_func, top_k, **kw):
    (i1, w1), r1 = K.router_fwd(x, bias, top_k=top_k, score_func=score_func,
                                norm_topk_prob=True, routed_scaling_factor=2.5, **kw)
    (i2, w2), r2 = router_fwd(x.cpu(), bias.cpu(), top_k=top_k, score_func=score_func,
                              norm_topk_prob=True, routed_scaling_factor=2.5, **kw)
    assert torch.equal(i1.cpu(), i2)
    _assert_matches([v if v is None else v.cpu() for v in (i1, w1, r1.scores, r1.topk_raw)],
                    (i2, w2, r2), x)
    assert r1[3:] == r2[3:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
def test_wrapper_cuda_runs_kernel(score_func):
    _wrapper_against_pure(_logits(1000, 128, seed=7).cuda(), torch.randn(128, device="cuda"),
                          score_func, 8)


@pytest.fixture
def kernel_branch(monkeypatch):
    """``K.router_fwd``'s kernel branch (normally CUDA only) taken on the CPU, under the
    interpreter; the dtypes it was asked about, to prove the branch ran."""
    if torch.cuda.is_available():
        pytest.skip("CPU only: on a GPU the branch runs as it is")
    return force_triton(monkeypatch, K)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("groups", [{}, {"n_group": 4, "topk_group": 2}])
def test_wrapper_kernel_branch_on_cpu(kernel_branch, score_func, groups):
    # The bias must reach the kernel: without it this input picks other experts.
    x, bias = _logits(24, 16, seed=7), torch.randn(16, generator=torch.Generator().manual_seed(3))
    _wrapper_against_pure(x, bias, score_func, 4, **groups)
    assert kernel_branch
    (unbiased, _), _ = router_fwd(x, None, top_k=4, score_func=score_func,
                                  norm_topk_prob=True, routed_scaling_factor=2.5, **groups)
    (biased, _), _ = K.router_fwd(x, bias, top_k=4, score_func=score_func,
                                  norm_topk_prob=True, routed_scaling_factor=2.5, **groups)
    assert not torch.equal(biased, unbiased)


# ---- the router linear fused in (kernels.router_linear_fwd) ---------------------------------
# Logits: float32 sums rounded once to 16 bits, against float64 sums rounded once: within one
# ulp of the 16-bit type (other summation order; the CPU interpreter also rounds toward zero).
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _linear_operands(t, h, e, dtype, seed, lin_bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w = torch.randn(e, h, generator=g) / h ** 0.5
    b = torch.randn(e, generator=g) if lin_bias else None
    x[1] = 0.0  # every logit equals the bias: ties through the linear too
    return [None if v is None else v.to(dtype).to(DEV) for v in (x, w, b)]


def _assert_logits(logits, x, w, b):
    x, w, b = (None if v is None else v.cpu() for v in (x, w, b))
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert logits.dtype == x.dtype and logits.shape == want.shape
    # Near zero the float32 sums' own error shows: the rule's bound for plain float32.
    plain32 = x.float() @ w.float().t() + (0 if b is None else b.float())
    torch.testing.assert_close(logits.cpu().double(), want, rtol=ULP[x.dtype],
                               atol=error_bound(plain32, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("t,h,e,top_k", [(13, 72, 60, 4), (70, 130, 16, 2), (5, 16, 128, 8)])
def test_linear_kernel_matches_linear_then_pure(dtype, score_func, t, h, e, top_k):
    """Logits as F.linear computes them (to rounding), and exactly the pure routing of those
    logits; rows span several programs, H several K-steps with a ragged last one."""
    x, w, b = _linear_operands(t, h, e, dtype, seed=t + e)
    corr = torch.randint(-2, 3, (e,), generator=torch.Generator().manual_seed(3)) * 0.25
    for lin_b, bias in ((b, None), (None, corr.to(DEV))):
        for norm, scale in ((False, 1.0), (True, 2.5)):
            logits, idx, wt, scores, raw = launch_router_linear_fwd(
                x, w, lin_b, bias, top_k=top_k, score_id=SCORE_ID[score_func], norm=norm,
                scale=scale)
            _assert_logits(logits, x, w, lin_b)
            (i2, w2), r2 = router_fwd(logits.cpu(), None if bias is None else bias.cpu(),
                                      top_k=top_k, score_func=score_func, norm_topk_prob=norm,
                                      routed_scaling_factor=scale)
            _assert_matches([v.cpu() if v is not None else None for v in (idx, wt, scores, raw)],
                            (i2, w2, r2), logits)


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
def test_linear_kernel_expert_groups(group_score):
    x, w, b = _linear_operands(21, 48, 64, torch.bfloat16, seed=9)
    logits, idx, wt, scores, raw = launch_router_linear_fwd(
        x, w, b, None, top_k=6, score_id=SCORE_ID["sigmoid"], norm=True, scale=2.5,
        n_group=8, topk_group=3, top2_sum=group_score == "top2_sum")
    (i2, w2), r2 = router_fwd(logits.cpu(), None, top_k=6, score_func="sigmoid",
                              norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8,
                              topk_group=3, group_score=group_score)
    _assert_matches([v.cpu() if v is not None else None for v in (idx, wt, scores, raw)],
                    (i2, w2, r2), logits)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
def test_linear_kernel_replays_a_route(score_func):
    """With a recorded route the kernel recomputes the same logits and weights those experts
    (here not the ones it would choose), as the pure replay does."""
    t, e, k = 19, 32, 3
    x, w, b = _linear_operands(t, 40, e, torch.bfloat16, seed=5)
    g = torch.Generator().manual_seed(8)
    route = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEV)
    first = launch_router_linear_fwd(x, w, b, None, top_k=k, score_id=SCORE_ID[score_func],
                                     norm=True, scale=1.5)
    logits, idx, wt, scores, raw = launch_router_linear_fwd(
        x, w, b, None, top_k=k, score_id=SCORE_ID[score_func], norm=True, scale=1.5,
        topk_idx=route)
    assert torch.equal(logits, first[0]) and torch.equal(idx, route)
    (i2, w2), r2 = router_fwd(logits.cpu(), None, top_k=k, score_func=score_func,
                              norm_topk_prob=True, routed_scaling_factor=1.5,
                              topk_idx=route.cpu())
    _assert_matches([v.cpu() if v is not None else None for v in (idx, wt, scores, raw)],
                    (i2, w2, r2), logits)


def test_linear_supported_conditions():
    x, w, b = _linear_operands(4, 32, 16, torch.bfloat16, seed=1)
    assert linear_supported(x, w, b, 1)
    assert linear_supported(x, w, None, 2)
    assert not linear_supported(x.float(), w.float(), None, 1)  # 16-bit floats only
    assert not linear_supported(x, w.half(), None, 1)          # one dtype
    assert not linear_supported(x[:, ::2], w[:, ::2], None, 1)  # unit column stride
    assert not linear_supported(x, w, b[:8], 1)                 # one bias entry per expert
    x8, w8, _ = _linear_operands(4, 32, 8, torch.bfloat16, seed=1)
    assert not linear_supported(x8, w8, None, 1)                # dot tiles need E >= 16
    x12, w12, _ = _linear_operands(4, 32, 24, torch.bfloat16, seed=1)
    assert not linear_supported(x12, w12, None, 3)              # groups: power of two E
    big = torch.zeros(256, 32, dtype=torch.bfloat16, device=DEV)
    assert linear_supported(x, big[:128], None, 1)
    assert not linear_supported(x, big, None, 1)                # the layer's path: E <= 128


@pytest.mark.parametrize("t,h,e,top_k", [(0, 32, 16, 2), (3, 8, 16, 16), (21, 40, 256, 8),
                                         (9, 24, 512, 6)])
def test_linear_kernel_edges(t, h, e, top_k):
    """No tokens, H below one dot step, top_k = E, and expert counts past the layer's
    (whose weight tiles the launcher narrows), with both biases and a row-strided input."""
    x, w, b = _linear_operands(max(t, 2), h, e, torch.bfloat16, seed=e + h)
    x = torch.cat([x, x], dim=1)[:t, :h] if t else x[:0]  # row stride 2h, unit column stride
    corr = (torch.randint(-2, 3, (e,), generator=torch.Generator().manual_seed(2)) * 0.25)
    logits, idx, wt, scores, raw = launch_router_linear_fwd(
        x, w, b, corr.to(DEV), top_k=top_k, score_id=SCORE_ID["softmax"], norm=True, scale=1.5)
    assert logits.shape == (t, e) and idx.shape == (t, top_k)
    _assert_logits(logits, x, w, b)
    (i2, w2), r2 = router_fwd(logits.cpu(), corr, top_k=top_k, norm_topk_prob=True,
                              routed_scaling_factor=1.5)
    _assert_matches([v.cpu() for v in (idx, wt, scores, raw)], (i2, w2, r2), logits)


def test_linear_kernel_groups_with_correction_bias():
    x, w, b = _linear_operands(17, 48, 64, torch.float16, seed=4)
    corr = torch.randint(-2, 3, (64,), generator=torch.Generator().manual_seed(7)) * 0.25
    logits, idx, wt, scores, raw = launch_router_linear_fwd(
        x, w, None, corr.to(DEV), top_k=8, score_id=SCORE_ID["sigmoid"], norm=True,
        scale=2.5, n_group=8, topk_group=4)
    (i2, w2), r2 = router_fwd(logits.cpu(), corr, top_k=8, score_func="sigmoid",
                              norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8,
                              topk_group=4)
    _assert_matches([v.cpu() if v is not None else None for v in (idx, wt, scores, raw)],
                    (i2, w2, r2), logits)


def test_linear_wrapper_falls_back_to_the_pure_pair():
    """Where the fused kernel does not run (the CPU here, or a float32 router anywhere),
    ``kernels.router_linear_fwd`` is ``F.linear`` then ``kernels.router_fwd``: on the CPU
    exactly the pure pair's forward."""
    x, w, b = (v.cpu().float() for v in _linear_operands(9, 24, 16, torch.bfloat16, seed=2))
    assert not K.router_linear_supported(x, w, b, 1)
    got = K.router_linear_fwd(x, w, b, top_k=3, score_func="sigmoid", norm_topk_prob=True)
    want = pure_router.router_linear_fwd(x, w, b, top_k=3, score_func="sigmoid",
                                         norm_topk_prob=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0])
    assert torch.equal(got[1][1], want[1][1]) and got[2].has_lin_bias and want[2].has_lin_bias

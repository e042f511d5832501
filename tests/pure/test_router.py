"""Router pair: against a per-token Python oracle, against HF's own router modules, and
float64 gradcheck of the backward through the weights."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fn.pure.router import (
    router_bwd,
    router_fwd,
    router_linear_bwd,
    router_linear_fwd,
    router_validate,
)
from moe_fn.testing import assert_close_to_ref, reference_route

# ----------------------------------------------------------------------------- oracle


def _resolution(dtype, logits, bias, score_func):
    """Per row: how close two choice values may be and still be ordered either way by a
    ``dtype`` router. Twice a bound on the rounding of a choice value, in steps of ``dtype``:
    the scores' (a softmax's sum over E, the exponentials' argument spread; a sigmoid's
    positive argument; the logits' own size for softmax_topk), the bias add, a group sum."""
    if not logits.numel():
        return logits.new_zeros(logits.shape[0])
    if score_func == "softmax":
        spread = (logits.amax(-1, keepdim=True) - logits).amax(-1)
    elif score_func == "sigmoid":
        spread = logits.clamp(min=0).amax(-1)
    else:
        spread = logits.abs().amax(-1)
    b = 0.0 if bias is None else float(bias.abs().max())
    return torch.finfo(dtype).eps * (logits.shape[1] + 8 + 2 * spread) * (1 + b)


def check_against_reference(idx, w, logits, bias, cfg, *, all_decided=False):
    """The router's choice equals moe_fn.testing.reference_route's (float64, a Python sort
    per token) on every row its margin decides at the logits' precision; its weights equal
    the reference's weights of the experts it chose on every row. ``all_decided``: no row
    may be a near-tie (fixed inputs whose every choice is decided)."""
    lg = logits.double()
    b = None if bias is None else bias.double()
    ref = reference_route(lg, score_correction_bias=b, **cfg)
    near = ref.margin <= _resolution(logits.dtype, lg, b, cfg.get("score_func", "softmax"))
    if all_decided:
        assert not near.any(), ref.margin[near]
    torch.testing.assert_close(idx[~near], ref.topk_idx[~near], rtol=0, atol=0)
    own = reference_route(lg, topk_idx=idx, score_correction_bias=b, **cfg)
    if w.dtype == torch.float64:  # the reference's own precision: torch's float64 bounds
        torch.testing.assert_close(w, own.topk_weight)
        return ref
    # Plain: the same naive code in the weights' precision.
    plain = reference_route(logits.to(w.dtype), topk_idx=idx, score_correction_bias=(
        None if bias is None else bias.to(w.dtype)), **cfg)
    assert_close_to_ref(w, plain.topk_weight, own.topk_weight, "weights")
    return ref


class _RouterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, cfg):
        (_, w), res = router_fwd(logits, bias, **cfg)
        ctx.res = res
        return w

    @staticmethod
    def backward(ctx, d_w):
        return router_bwd(ctx.res, d_w), None, None


MODES = [
    dict(score_func="softmax", norm_topk_prob=False),
    dict(score_func="softmax", norm_topk_prob=True),
    dict(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    dict(score_func="sigmoid", norm_topk_prob=False),
    dict(score_func="softmax_topk", norm_topk_prob=False),
    dict(score_func="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
         group_score="top2_sum", routed_scaling_factor=2.5),
    dict(score_func="softmax", norm_topk_prob=False, n_group=4, topk_group=2,
         group_score="max", routed_scaling_factor=16.0),
    dict(score_func="softmax", norm_topk_prob=True, n_group=2, topk_group=1,
         group_score="top2_sum"),
]


def _mode_id(m):
    parts = [m["score_func"], "norm" if m["norm_topk_prob"] else "raw"]
    if m.get("n_group", 1) > 1:
        parts.append(f"g{m['n_group']}k{m['topk_group']}{m['group_score']}")
    if "routed_scaling_factor" in m:
        parts.append(f"x{m['routed_scaling_factor']}")
    return "-".join(parts)


def _separated_logits(t, e, gen, dtype=torch.float64):
    """Rows of distinct values spaced >= 0.3 apart: a 1e-6 perturbation flips no choice."""
    base = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).to(dtype)
    return base * 0.45 - 2.0 + 0.1 * torch.rand(t, e, generator=gen, dtype=dtype)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("with_bias", [False, True])
def test_router_matches_oracle(mode, with_bias):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 16, generator=gen)
    # Sigmoid scores that underflow to 0 in float32: renormalising divides by 0 + NORM_EPS.
    logits[5] = -200.0
    bias = 0.1 * torch.randn(16, generator=gen) if with_bias else None
    cfg = dict(top_k=4, **mode)
    (idx, w), _ = router_fwd(logits, bias, **cfg)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    check_against_reference(idx, w, logits, bias, cfg, all_decided=True)


@settings(max_examples=120, deadline=None)
@given(
    n_group=st.integers(1, 4), per_group=st.integers(1, 5), data=st.data(),
    score_func=st.sampled_from(["softmax", "sigmoid", "softmax_topk"]),
    norm=st.booleans(), group_score=st.sampled_from(["top2_sum", "max"]),
    ties=st.booleans(), with_bias=st.booleans(), scale=st.sampled_from([1.0, 2.5]),
    seed=st.integers(0, 2**31 - 1), t=st.integers(0, 6),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_router_oracle_hypothesis(n_group, per_group, data, score_func, norm, group_score,
                                  ties, with_bias, scale, seed, t, dtype):
    """Every mode, with and without ties (logits and bias from a 3-value set), float32 and
    float64 logits."""
    if group_score == "top2_sum" and n_group > 1 and per_group < 2:
        per_group = 2
    e = n_group * per_group
    topk_group = data.draw(st.integers(1, n_group))
    top_k = data.draw(st.integers(1, topk_group * per_group if n_group > 1 else e))
    gen = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(0, 3, (t, e), generator=gen).float()
        bias = 0.25 * torch.randint(0, 3, (e,), generator=gen).float() if with_bias else None
    else:
        logits = torch.randn(t, e, generator=gen)
        bias = 0.1 * torch.randn(e, generator=gen) if with_bias else None
    logits = logits.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    cfg = dict(top_k=top_k, score_func=score_func, norm_topk_prob=norm, n_group=n_group,
               topk_group=topk_group, group_score=group_score, routed_scaling_factor=scale)
    (idx, w), _ = router_fwd(logits, bias, **cfg)
    check_against_reference(idx, w, logits, bias, cfg)


def test_tie_rule_lower_index_wins():
    logits = torch.zeros(3, 8)
    (idx, w), _ = router_fwd(logits, top_k=3, score_func="sigmoid")
    assert idx.tolist() == [[0, 1, 2]] * 3
    # Ties among groups too: all groups equal -> groups 0 and 1 are kept.
    (idx, _), _ = router_fwd(logits, top_k=3, score_func="sigmoid", n_group=4, topk_group=2)
    assert idx.tolist() == [[0, 1, 2]] * 3
    # Order is by descending choice score (bias included), ties by ascending index.
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    (idx, w), _ = router_fwd(logits, bias, top_k=3, score_func="sigmoid")
    assert idx.tolist() == [[2, 1, 3]]
    _assert_sigmoid(w, [[0.0, 1.0, 1.0]])


def _assert_sigmoid(w, chosen_logits):
    """Unnormalised sigmoid weights: within twice plain float32 sigmoid's error of float64
    (a sigmoid over other row lengths may take another vector path)."""
    x = torch.tensor(chosen_logits, dtype=torch.float64)
    assert_close_to_ref(w, torch.sigmoid(x.float()), torch.sigmoid(x), "weights")


def test_torch_topk_tie_behaviour_is_not_a_rule():
    """Documents why the router sorts stably instead of calling torch.topk: on CPU topk
    returns an implementation-defined member of a tie. If this starts failing, torch.topk
    changed its tie behaviour; the router's rule (lower index wins) is unaffected."""
    idx = torch.topk(torch.zeros(1, 8), 1).indices
    assert idx.item() != 0


def test_bias_moves_choice_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    (idx, w), _ = router_fwd(logits, bias, top_k=2, score_func="sigmoid")
    assert idx.tolist() == [[3, 0]]
    _assert_sigmoid(w, [[-1.0, 2.0]])


def test_dtypes_and_empty():
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    (idx, w), res = router_fwd(logits, top_k=2, score_func="softmax", norm_topk_prob=True)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64
    d = router_bwd(res, torch.ones_like(w))
    assert d.dtype == torch.bfloat16 and d.shape == logits.shape
    (idx, w), res = router_fwd(torch.randn(0, 8), top_k=2, score_func="sigmoid",
                               n_group=2, topk_group=1)
    assert idx.shape == (0, 2) and w.shape == (0, 2)
    assert router_bwd(res, torch.zeros(0, 2)).shape == (0, 8)


# ----------------------------------------------------------------------------- HF parity


def _hf_router(module_name, cls_name, **cfg):
    mod = pytest.importorskip(f"transformers.models.{module_name}.modeling_{module_name}")
    config = types.SimpleNamespace(**cfg)
    r = getattr(mod, cls_name)(config)
    with torch.no_grad():
        r.weight.copy_(torch.eye(cfg["hidden_size"]))
    return r


def _sort_by_idx(idx, *ws):
    order = idx.argsort(dim=-1)
    return (idx.gather(1, order), *(w.gather(1, order) for w in ws))


def _hf_logits(t, e, seed):
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed))


def _check_hf(hf_out, logits, cfg, bias=None, *, ordered):
    """Ours (``router_fwd(logits, bias, **cfg)``) against HF's router: the same experts, and
    weights within twice the error of HF's own float32 weights of the float64 reference's
    weights of those experts."""
    hf_logits, hf_w, hf_idx = hf_out
    torch.testing.assert_close(hf_logits.float(), logits, rtol=0, atol=0)  # W = I exactly
    (idx, w), _ = router_fwd(logits, bias, **cfg)
    ref_w = reference_route(logits.double(), topk_idx=idx, score_correction_bias=(
        None if bias is None else bias.double()), **cfg).topk_weight
    if not ordered:
        idx, w, ref_w = _sort_by_idx(idx, w, ref_w)
        hf_idx, hf_w = _sort_by_idx(hf_idx, hf_w)
    torch.testing.assert_close(idx, hf_idx, rtol=0, atol=0)
    assert_close_to_ref(w, hf_w.float(), ref_w, "weights")


@pytest.mark.parametrize("norm", [False, True])
def test_hf_qwen3_moe(norm):
    e = 16
    r = _hf_router("qwen3_moe", "Qwen3MoeTopKRouter", num_experts_per_tok=4, num_experts=e,
                   norm_topk_prob=norm, hidden_size=e)
    logits = _hf_logits(50, e, 0)
    cfg = dict(top_k=4, score_func="softmax", norm_topk_prob=norm)
    # Qwen3 sorts its top-k (torch.topk sorted=True): same order as ours when tie-free.
    _check_hf(r(logits), logits, cfg, ordered=True)


def test_hf_mixtral():
    e = 8
    r = _hf_router("mixtral", "MixtralTopKRouter", num_experts_per_tok=2, num_local_experts=e,
                   hidden_size=e)
    logits = _hf_logits(50, e, 1)
    cfg = dict(top_k=2, score_func="softmax", norm_topk_prob=True)
    _check_hf(r(logits), logits, cfg, ordered=True)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("norm", [False, True])
def test_hf_deepseek_v3_and_glm4_moe(n_group, topk_group, norm):
    e = 32
    cfg = dict(num_experts_per_tok=6, num_local_experts=e, n_routed_experts=e, hidden_size=e,
               routed_scaling_factor=2.5, n_group=n_group, topk_group=topk_group,
               norm_topk_prob=norm)
    logits = _hf_logits(64, e, 2)
    bias = 0.05 * torch.randn(e, generator=torch.Generator().manual_seed(3))
    ours = dict(top_k=6, score_func="sigmoid", norm_topk_prob=norm,
                n_group=n_group, topk_group=topk_group, group_score="top2_sum",
                routed_scaling_factor=2.5)
    for mod, cls in (("deepseek_v3", "DeepseekV3TopkRouter"), ("glm4_moe", "Glm4MoeTopkRouter")):
        r = _hf_router(mod, cls, **cfg)
        r.e_score_correction_bias.copy_(bias)
        _check_hf(r(logits), logits, ours, bias, ordered=False)


@pytest.mark.parametrize("method,n_group,topk_group", [("greedy", 1, 1),
                                                       ("group_limited_greedy", 4, 2)])
def test_hf_deepseek_v2(method, n_group, topk_group):
    e = 16
    r = _hf_router("deepseek_v2", "DeepseekV2TopkRouter", num_experts_per_tok=3, num_experts=e,
                   hidden_size=e, routed_scaling_factor=16.0, topk_method=method,
                   n_group=n_group, topk_group=topk_group)
    logits = _hf_logits(64, e, 4)
    cfg = dict(top_k=3, score_func="softmax", norm_topk_prob=False,
                         n_group=n_group, topk_group=topk_group, group_score="max",
                         routed_scaling_factor=16.0)
    _check_hf(r(logits), logits, cfg, ordered=False)


def test_hf_minimax_m2():
    e = 16
    r = _hf_router("minimax_m2", "MiniMaxM2TopKRouter", num_experts_per_tok=4,
                   num_local_experts=e, hidden_size=e)
    logits = _hf_logits(64, e, 5)
    bias = 0.1 * torch.randn(e, generator=torch.Generator().manual_seed(6))
    cfg = dict(top_k=4, score_func="sigmoid", norm_topk_prob=True)
    _check_hf(r(logits, bias), logits, cfg, bias, ordered=False)


def test_hf_gpt_oss():
    e = 32
    r = _hf_router("gpt_oss", "GptOssTopKRouter", num_experts_per_tok=4, num_local_experts=e,
                   hidden_size=e)
    with torch.no_grad():
        r.bias.zero_()
    logits = _hf_logits(64, e, 7)
    cfg = dict(top_k=4, score_func="softmax_topk")
    _check_hf(r(logits), logits, cfg, ordered=True)


def test_hf_ties_agree_on_weights():
    """With ties HF (torch.topk) may pick another member of a tie than we do; without a bias
    the tied members have equal scores, so the weight multisets still agree."""
    e = 16
    r = _hf_router("qwen3_moe", "Qwen3MoeTopKRouter", num_experts_per_tok=4, num_experts=e,
                   norm_topk_prob=True, hidden_size=e)
    logits = torch.randint(0, 3, (40, e), generator=torch.Generator().manual_seed(8)).float()
    (_, w), _ = router_fwd(logits, top_k=4, score_func="softmax", norm_topk_prob=True)
    _, hf_w, _ = r(logits)
    _, hf64_w, _ = copy.deepcopy(r).double()(logits.double())
    assert_close_to_ref(w.sort(dim=-1).values, hf_w.float().sort(dim=-1).values,
                        hf64_w.sort(dim=-1).values, "sorted weights")


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
@pytest.mark.parametrize("with_bias", [False, True])
def test_router_gradcheck(mode, with_bias):
    gen = torch.Generator().manual_seed(11)
    logits = _separated_logits(6, 16, gen).requires_grad_()
    bias = 0.05 * torch.randn(16, generator=gen, dtype=torch.float64) if with_bias else None
    cfg = dict(top_k=4, **mode)
    assert torch.autograd.gradcheck(lambda x: _RouterFn.apply(x, bias, cfg), (logits,))
    # And against autograd of the reference's weights on its route.
    d_w = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    ref = reference_route(logits, score_correction_bias=bias, **cfg).topk_weight
    (g_ref,) = torch.autograd.grad(ref, logits, d_w)
    (_, w), res = router_fwd(logits.detach(), bias, **cfg)
    torch.testing.assert_close(w, ref.detach())
    torch.testing.assert_close(router_bwd(res, d_w), g_ref)


@pytest.mark.parametrize("uses", ["weights", "logits", "both"])
@pytest.mark.parametrize("with_lin_bias", [False, True])
def test_router_linear_pair_against_autograd(uses, with_lin_bias):
    """The router linear's pure pair: the backward equals float64 autograd of the naive
    linear and weights (the oracle's route) for gradients through the routing weights, the
    logits (an auxiliary loss), or both."""
    gen = torch.Generator().manual_seed(5)
    t, h, e, k = 7, 12, 16, 4
    x = torch.randn(t, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(e, h, generator=gen, dtype=torch.float64, requires_grad=True)
    lin_b = (torch.randn(e, generator=gen, dtype=torch.float64, requires_grad=True)
             if with_lin_bias else None)
    d_w = torch.randn(t, k, generator=gen, dtype=torch.float64) if uses != "logits" else None
    d_l = torch.randn(t, e, generator=gen, dtype=torch.float64) if uses != "weights" else None
    cfg = dict(top_k=k, score_func="softmax", norm_topk_prob=True, routed_scaling_factor=2.0)
    logits, (idx, w), res = router_linear_fwd(x.detach(), weight.detach(),
                                              None if lin_b is None else lin_b.detach(), **cfg)
    naive_logits = x @ weight.t() + (0 if lin_b is None else lin_b)
    ref_idx, ref_w, _ = reference_route(naive_logits, **cfg)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(logits, naive_logits.detach())
    loss = sum((a * b).sum() for a, b in ((ref_w, d_w), (naive_logits, d_l)) if b is not None)
    leaves = [x, weight] + ([lin_b] if lin_b is not None else [])
    want = torch.autograd.grad(loss, leaves)
    got = router_linear_bwd(res, d_l, d_w)
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref)
    assert (got[2] is None) == (lin_b is None)
    assert router_linear_bwd(res, d_l, d_w, needs=(False, True, False))[0::2] == (None, None)


def test_router_bwd_noncontiguous_grad():
    logits = _separated_logits(4, 8, torch.Generator().manual_seed(0), torch.float32)
    (_, w), res = router_fwd(logits, top_k=2, score_func="softmax", norm_topk_prob=True)
    d = torch.ones(1, 1).expand(4, 2)
    torch.testing.assert_close(router_bwd(res, d), router_bwd(res, d.contiguous()))


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,name", [
    (dict(top_k=9), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2, n_group=3), "n_group"),
    (dict(top_k=2, n_group=2, topk_group=3), "topk_group"),
    (dict(top_k=5, n_group=4, topk_group=2), "top_k"),
    (dict(top_k=2, score_func="relu"), "score_func"),
    (dict(top_k=2, n_group=2, topk_group=1, group_score="mean"), "group_score"),
    (dict(top_k=1, n_group=8, topk_group=2, group_score="top2_sum"), "group_score"),
    (dict(top_k=2, routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (dict(top_k=2, routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(top_k=2, norm_topk_prob=1), "norm_topk_prob"),
    (dict(top_k=2.0), "top_k"),
])
def test_router_validate_rejects(kwargs, name):
    with pytest.raises(ValueError, match=name):
        router_validate(8, **kwargs)
    with pytest.raises(ValueError, match=name):
        router_fwd(torch.zeros(2, 8), **kwargs)


def test_router_validate_accepts_group_max_of_one():
    router_validate(8, top_k=2, n_group=8, topk_group=2, group_score="max")
    router_validate(8, top_k=8)


def test_router_bad_tensors():
    with pytest.raises(ValueError, match="logits"):
        router_fwd(torch.zeros(8), top_k=1)
    with pytest.raises(ValueError, match="bias"):
        router_fwd(torch.zeros(2, 8), torch.zeros(7), top_k=1)
    with pytest.raises(TypeError, match="logits"):
        router_fwd(torch.zeros(2, 8, dtype=torch.int64), top_k=1)

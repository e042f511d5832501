"""moe_fn.testing: the reference against hand-computed values, gradcheck_layer against
layers known to be wrong, and what the strategies draw."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from moe_fn import MoEConfig, MoELayer
from moe_fn.testing import (
    MoEParams,
    gradcheck_layer,
    load_params,
    random_params,
    reference_activation,
    reference_experts,
    reference_moe,
    reference_route,
    split_gate_up,
)
from moe_fn.testing.strategies import moe_cases, moe_configs, tokens_per_rank


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_route_softmax_by_hand():
    logits = _t([2.0, 1.0, 0.0, -1.0])
    e = [math.exp(v) for v in (2.0, 1.0, 0.0, -1.0)]
    p = [v / sum(e) for v in e]
    r = reference_route(logits, top_k=2, norm_topk_prob=True, routed_scaling_factor=2.0)
    assert r.topk_idx.tolist() == [[0, 1]]
    want = [2 * p[0] / (p[0] + p[1] + 1e-20), 2 * p[1] / (p[0] + p[1] + 1e-20)]
    torch.testing.assert_close(r.topk_weight, _t(want))
    assert r.margin.tolist() == pytest.approx([p[1] - p[2]])


def test_route_ties_groups_and_choice_bias():
    # Ties: the lower index first; exact ties decide nothing by a gap.
    r = reference_route(torch.zeros(1, 4, dtype=torch.float64), top_k=3, score_func="sigmoid")
    assert r.topk_idx.tolist() == [[0, 1, 2]] and r.margin.tolist() == [math.inf]
    # Groups of two: top2 sums (0.9+0.0, 0.5+0.5) keep group 1, though expert 0 is best.
    choice = _t([0.9, 0.0, 0.5, 0.5])
    r = reference_route(choice, top_k=2, score_func="softmax_topk", n_group=2, topk_group=1)
    assert r.topk_idx.tolist() == [[2, 3]]
    assert r.margin.tolist() == pytest.approx([0.1])  # 1.0 against 0.9 decides the group
    r = reference_route(choice, top_k=2, score_func="softmax_topk", n_group=2, topk_group=1,
                        group_score="max")
    assert r.topk_idx.tolist() == [[0, 1]]
    # The choice bias moves the choice, never the weights.
    logits = _t([2.0, 1.0, 0.0, -1.0])
    r = reference_route(logits, top_k=2, score_func="sigmoid",
                        score_correction_bias=_t([0.0, 0.0, 0.0, 10.0])[0])
    assert r.topk_idx.tolist() == [[3, 0]]
    torch.testing.assert_close(r.topk_weight, torch.sigmoid(_t([-1.0, 2.0])))
    # softmax_topk: the softmax of the chosen logits; a given route is replayed.
    r = reference_route(logits, top_k=2, score_func="softmax_topk", topk_idx=torch.tensor([[3, 1]]))
    assert r.margin is None
    torch.testing.assert_close(r.topk_weight, torch.softmax(_t([-1.0, 1.0]), -1))


@pytest.mark.parametrize("name", ["swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh"])
def test_activation_by_hand(name):
    g, u = 1.5, -2.5
    sig = 1 / (1 + math.exp(-g))
    want = {"swiglu": g * sig * u,
            "swiglu_clamped": min(g, 1.0) / (1 + math.exp(-min(g, 1.0))) * max(u, -1.0),
            "swiglu_oai": (max(u, -1.0) + 1) * 1.0 / (1 + math.exp(-2.0)),
            "geglu_tanh": 0.5 * g * (1 + math.tanh(math.sqrt(2 / math.pi)
                                                   * (g + 0.044715 * g ** 3))) * u}[name]
    got = reference_activation(_t([g]), _t([u]), name, alpha=2.0, limit=1.0)
    assert got.item() == pytest.approx(want, rel=1e-12)
    # The defaults: alpha 1.702, limit 7.
    big = reference_activation(_t([9.0]), _t([9.0]), "swiglu_oai")
    assert big.item() == pytest.approx(8 * 7 / (1 + math.exp(-1.702 * 7)), rel=1e-12)


def test_experts_by_hand_and_layouts():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    gup = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)
    down = torch.randn(2, 3, 2, generator=gen, dtype=torch.float64)
    gub = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    db = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    w = torch.rand(5, generator=gen, dtype=torch.float64)
    counts = [0, 5]  # the first expert has no rows
    for layout, (gi, ui) in (("halves", ([0, 1], [2, 3])), ("interleaved", ([0, 2], [1, 3]))):
        y = reference_experts(x, gup, down, counts, activation="swiglu", layout=layout,
                              weights=w, gate_up_bias=gub, down_bias=db)
        g = x @ gup[1, gi].t() + gub[1, gi]
        u = x @ gup[1, ui].t() + gub[1, ui]
        want = (torch.nn.functional.silu(g) * u * w[:, None]) @ down[1].t() + db[1]
        torch.testing.assert_close(y, want)
        gg, uu = split_gate_up(torch.cat([g, u], 1) if layout == "halves" else
                               torch.stack([g, u], -1).flatten(1), layout)
        assert torch.equal(gg, g) and torch.equal(uu, u)
    with pytest.raises(ValueError, match="counts sum to 4"):
        reference_experts(x, gup, down, [1, 3])


@pytest.mark.parametrize("score_apply", ["post", "pre", "activation"])
def test_moe_is_the_loop_over_chosen_experts(score_apply):
    """The dense reference equals a per-token loop over the chosen experts."""
    cfg = MoEConfig(hidden_size=4, intermediate_size=3, num_experts=5, top_k=2,
                    score_apply=score_apply, activation="swiglu_oai", activation_limit=0.5,
                    gate_up_layout="interleaved", router_bias=True,
                    expert_bias=score_apply == "post")
    p = random_params(cfg, generator=torch.Generator().manual_seed(3))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out, logits, route = reference_moe(x, p, cfg)
    torch.testing.assert_close(logits, x @ p.router_weight.t() + p.router_bias)
    for t in range(6):
        want = torch.zeros(4, dtype=torch.float64)
        for e, w in zip(route.topk_idx[t].tolist(), route.topk_weight[t]):
            row = x[t:t + 1] * (w if score_apply == "pre" else 1)
            y = reference_experts(row, p.gate_up_proj[e:e + 1], p.down_proj[e:e + 1], [1],
                                  activation="swiglu_oai", layout="interleaved", limit=0.5,
                                  weights=w[None] if score_apply == "activation" else None,
                                  gate_up_bias=_sl(p.gate_up_proj_bias, e),
                                  down_bias=_sl(p.down_proj_bias, e))
            want += (w if score_apply == "post" else 1) * y[0]
        torch.testing.assert_close(out[t], want)


def _sl(t, e):
    return None if t is None else t[e:e + 1]


class _SquaredWeights(MoELayer):
    """A wrong layer: routing weights squared after the experts (the reference path's
    weighting pass; impl='fused' weighs inside the combine)."""

    def _weight_rows(self, rows, row_w):
        return rows * (row_w * row_w).to(rows.dtype)[:, None]


class _FrozenRouting(MoELayer):
    """A wrong layer whose output is right but whose routing weights pass no gradient."""

    def route(self, x2, replay_idx=None):
        logits, idx, w = super().route(x2, replay_idx)
        return logits, idx, w.detach()


@pytest.mark.parametrize("cls,name", [(_SquaredWeights, "out"),
                                      (_FrozenRouting, "^grad x")])
def test_gradcheck_layer_catches_wrong_layers(cls, name):
    cfg = MoEConfig(hidden_size=6, intermediate_size=4, num_experts=4, top_k=2,
                    impl="reference")
    layer = cls(cfg, dtype=torch.float64)
    load_params(layer, random_params(cfg, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(AssertionError, match=name):
        gradcheck_layer(layer)


def test_gradcheck_layer_leaves_the_layer_alone_and_refuses_ep():
    cfg = MoEConfig(hidden_size=6, intermediate_size=4, num_experts=4, top_k=2)
    layer = MoELayer(cfg)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    errors = gradcheck_layer(layer, tokens=5)
    assert {"out", "logits", "grad x", "grad router_weight"} <= set(errors)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    assert layer.router.weight.grad is None and layer.router.weight.dtype == torch.float32
    with pytest.raises(TypeError, match="MoEConfig or MoELayer"):
        gradcheck_layer(object())


def test_gradcheck_layer_finite_differences_and_checkpoint():
    cfg = MoEConfig(hidden_size=4, intermediate_size=2, num_experts=4, top_k=2,
                    expert_bias=True, skip_recompute_combine=True)
    gradcheck_layer(cfg, tokens=3, finite_differences=True)
    gradcheck_layer(cfg, tokens=5, checkpoint=True)


@settings(max_examples=60, deadline=None)
@given(moe_configs())
def test_drawn_configs_are_valid_and_varied(cfg):
    assert isinstance(cfg, MoEConfig)
    assert cfg.top_k <= cfg.num_experts and cfg.num_experts % cfg.n_group == 0


def test_strategies_reach_the_corners():
    assert find(tokens_per_rank(4), lambda c: 0 in c and sum(c) > 0)
    assert find(tokens_per_rank(2), lambda c: sum(c) == 0) == [0, 0]
    for pred in (lambda c: c.n_group > 1 and c.score_correction_bias,
                 lambda c: c.expert_bias and c.gate_up_layout == "interleaved",
                 lambda c: c.score_apply == "activation" and c.activation == "swiglu_oai",
                 lambda c: c.score_func == "softmax_topk" and c.router_bias):
        find(moe_configs(), pred)
    case = find(moe_cases(), lambda c: len(c.empty_experts) >= 2 and c.x.shape[0] > 0)
    assert isinstance(case.params, MoEParams)
    find(moe_cases(), lambda c: c.x.shape[0] == 0)


@settings(max_examples=30, deadline=None)
@given(moe_cases(tokens=st.integers(1, 6)))
def test_steered_experts_are_never_chosen(case):
    route = reference_moe(case.x, case.params, case.config).route
    assert not set(route.topk_idx.flatten().tolist()) & case.empty_experts

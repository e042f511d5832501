"""MoELayer property tests: drawn configs and cases (moe_fn.testing.strategies) against the
dense float64 reference, on one rank and over gloo with ranks that hold no tokens."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_fn import MoELayer
from moe_fn.testing import gradcheck_layer, load_params, reference_moe
from moe_fn.testing.strategies import moe_cases, moe_configs, tokens_per_rank
from tests.dist_utils import run_distributed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_cases())
def test_layer_matches_the_reference_on_drawn_cases(case):
    layer = MoELayer(case.config, dtype=torch.float64)
    load_params(layer, case.params)
    gradcheck_layer(layer, case.x, d_out=case.d_out)
    # Experts no token chose get zero weight gradients (and the layer's own backward runs).
    out = layer(case.x)
    (out * case.d_out).sum().backward()
    for e in case.empty_experts:
        assert not layer.experts.gate_up_proj.grad[e].any()
        assert not layer.experts.down_proj.grad[e].any()


def _ep_body(rank, world, cases):
    for counts, case in cases:
        cfg = attrs.evolve(case.config, comm_backend="all_to_all", ep_size=world)
        layer = MoELayer(cfg, dtype=torch.float64)
        load_params(layer, case.params)
        start = sum(counts[:rank])
        rows = slice(start, start + counts[rank])
        x = case.x[rows].clone().requires_grad_()
        out = layer(x)
        (out * case.d_out[rows]).sum().backward()

        x_all = case.x.clone().requires_grad_()
        leaves = [None if t is None else t.clone().requires_grad_(name != "score_correction_bias")
                  for name, t in zip(case.params._fields, case.params)]
        ref = reference_moe(x_all, type(case.params)(*leaves), case.config)
        (ref.out * case.d_out).sum().backward()
        torch.testing.assert_close(out, ref.out[rows].detach())
        torch.testing.assert_close(x.grad, x_all.grad[rows])
        e_loc = cfg.num_local_experts
        mine = slice(rank * e_loc, (rank + 1) * e_loc)
        router = layer.router.weight.grad.clone()
        dist.all_reduce(router)
        torch.testing.assert_close(router, leaves[0].grad)
        torch.testing.assert_close(layer.experts.gate_up_proj.grad, leaves[1].grad[mine])
        torch.testing.assert_close(layer.experts.down_proj.grad, leaves[2].grad[mine])


@st.composite
def _ep_cases(draw, world):
    counts = draw(tokens_per_rank(world, max_tokens=5))
    configs = moe_configs().filter(lambda c: c.num_experts % world == 0)
    return counts, draw(moe_cases(configs, tokens=st.just(sum(counts))))


@pytest.mark.multiproc
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ep_cases(2), min_size=6, max_size=6))
def test_expert_parallel_matches_the_reference_on_drawn_cases(cases):
    """Six drawn cases per process group (spawning dominates): drawn configs over two
    ranks, either of which may hold no tokens."""
    run_distributed(_ep_body, 2, cases)

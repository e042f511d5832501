"""impl="fused" gives the reference's results, on one rank and over gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_fn import MoEConfig, MoELayer
from moe_fn.testing import MoEParams, assert_jointly_close_to_ref, reference_moe
from tests.dist_utils import run_distributed
from tests.ep_cases import reference_run


def _params():
    """Every expert's parameters (float32 values, held in float64)."""
    g = torch.Generator().manual_seed(0)
    return MoEParams(router_weight=torch.randn(4, 16, generator=g).double(),
                     gate_up_proj=torch.randn(4, 16, 16, generator=g).double(),
                     down_proj=torch.randn(4, 16, 8, generator=g).double())


def _x(rank):
    return torch.randn(9 + rank, 16, generator=torch.Generator().manual_seed(rank))


def _cfg(impl="reference", world=1):
    backend = dict(comm_backend="all_to_all", ep_size=world) if world > 1 else {}
    return MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2,
                     impl=impl, **backend)


def _run(impl, world=1, rank=0):
    """Rank ``rank``'s float32 layer on its tokens, the loss ``out.sum()``: its output and
    input gradient, then its router's gradient summed over the ranks, and its experts'."""
    cfg = _cfg(impl, world)
    layer = MoELayer(cfg)
    p = _params()
    el = cfg.num_local_experts
    with torch.no_grad():
        layer.router.weight.copy_(p.router_weight)
        layer.experts.gate_up_proj.copy_(p.gate_up_proj[rank * el:][:el])
        layer.experts.down_proj.copy_(p.down_proj[rank * el:][:el])
    x = _x(rank).requires_grad_()
    out = layer(x)
    out.backward(torch.ones_like(out))
    router = layer.router.weight.grad
    if world > 1:
        dist.all_reduce(router)
    return [out.detach(), x.grad, router, layer.experts.gate_up_proj.grad,
            layer.experts.down_proj.grad]


def _oracle(world=1, rank=0):
    """The naive reference MoE (``moe_fn.testing.reference_moe``) over every rank's tokens
    and every expert, sliced as ``_run``'s results: in float32 on the float64 route (plain
    PyTorch) and in float64 (the oracle)."""
    p, cfg = _params(), _cfg()
    xs = [_x(r).double() for r in range(world)]
    x_all = torch.cat(xs)
    route = reference_moe(x_all, p, cfg).route
    start = sum(x.shape[0] for x in xs[:rank])
    rows = slice(start, start + xs[rank].shape[0])
    el = 4 // world
    experts = slice(rank * el, (rank + 1) * el)
    got = []
    for dtype in (torch.float32, torch.float64):
        r, _ = reference_run(x_all, p, cfg, torch.ones_like(x_all), dtype,
                             topk_idx=route.topk_idx)
        got.append([r["out"][rows], r["x"][rows], r["router.weight"],
                    r["experts.gate_up_proj"][experts], r["experts.down_proj"][experts]])
    return got


def test_fused_combine_matches_the_reference_single_rank(monkeypatch):
    """The same numbers, and the fused path is the one that ran: the routing weights enter
    the fused sum at home (one weighted gather-sum per forward) and the dispatch's backward
    sums each token's row gradients in the unweighted one; the reference uses neither."""
    import moe_fn.kernels as kernels

    calls = []
    for name in ("weighted_gather_sum_fwd", "gather_sum_fwd"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    reference = _run("reference")
    assert calls == []
    fused = _run("fused")
    assert calls == ["weighted_gather_sum_fwd", "gather_sum_fwd"], calls
    _assert_same_numbers(fused, reference, *_oracle())


NAMES = ["out", "x", "router.weight", "experts.gate_up_proj", "experts.down_proj"]


def _assert_same_numbers(fused, reference, plain, oracle):
    """Both combines' outputs and gradients (taken as one) within twice the error of the
    naive float32 reference against its float64 twin: another summation order each."""
    assert_jointly_close_to_ref(fused, plain, oracle, NAMES)
    assert_jointly_close_to_ref(reference, plain, oracle, NAMES)


def _body(rank, world):
    _assert_same_numbers(_run("fused", world, rank), _run("reference", world, rank),
                         *_oracle(world, rank))
    assert dist.get_world_size() == world


@pytest.mark.multiproc
def test_fused_combine_matches_the_reference_expert_parallel():
    run_distributed(_body, 2)

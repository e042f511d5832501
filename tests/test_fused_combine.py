"""impl="fused" gives the reference's results, on one rank and over gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_fn import MoEConfig, MoELayer
from moe_fn.testing import assert_jointly_close_to_ref
from tests.dist_utils import run_distributed


def _run(impl, world=1, rank=0, dtype=torch.float32):
    backend = dict(comm_backend="all_to_all", ep_size=world) if world > 1 else {}
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2,
                    impl=impl, **backend)
    layer = MoELayer(cfg, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    el = cfg.num_local_experts
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(4, 16, generator=g))
        layer.experts.gate_up_proj.copy_(torch.randn(4, 16, 16, generator=g)[rank * el:][:el])
        layer.experts.down_proj.copy_(torch.randn(4, 16, 8, generator=g)[rank * el:][:el])
    x = torch.randn(9 + rank, 16, generator=torch.Generator().manual_seed(rank)).to(dtype)
    x.requires_grad_()
    out = layer(x)
    out.backward(torch.ones_like(out))
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


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
    _assert_same_numbers(fused, reference, _run("reference", dtype=torch.float64))


def _assert_same_numbers(fused, reference, reference64):
    """Another summation order than the reference combine's: the layer's outputs and
    gradients within twice the reference float32 error of float64 (taken as one)."""
    assert_jointly_close_to_ref(fused, reference, reference64)


def _body(rank, world):
    _assert_same_numbers(_run("fused", world, rank), _run("reference", world, rank),
                         _run("reference", world, rank, torch.float64))
    assert dist.get_world_size() == world


@pytest.mark.multiproc
def test_fused_combine_matches_the_reference_expert_parallel():
    run_distributed(_body, 2)

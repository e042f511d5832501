"""The row all_to_all's moves through their Triton kernels (the interpreter on the CPU):
every row placed straight at its expert-major position, the own rows while the others are
in flight, must give the pure moves' results, output and every gradient, over gloo."""

from __future__ import annotations

import pytest
import torch

from moe_fn import MoEConfig, MoELayer
from moe_fn.kernels.activation import interpreting
from tests.dist_utils import run_distributed

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _run(rank, world, combine_impl, skew, calls):
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2,
                    combine_impl=combine_impl, comm_backend="all_to_all", ep_size=world)
    layer = MoELayer(cfg)
    el = cfg.num_local_experts
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = torch.randn(4, 16, generator=g)
        if skew:  # every token to rank 0's experts: rank 1 keeps and receives no row
            w[el:] -= 100.0
        layer.router.weight.copy_(w)
        layer.experts.gate_up_proj.copy_(torch.randn(4, 16, 16, generator=g)[rank * el:][:el])
        layer.experts.down_proj.copy_(torch.randn(4, 16, 8, generator=g)[rank * el:][:el])
    x = torch.randn(9 + rank, 16, generator=torch.Generator().manual_seed(rank)) + 0.5
    x.requires_grad_()
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank)))
    assert layer.exchange.counters["dispatch"] == 1 and layer.exchange.counters["combine"] == 1
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _body(rank, world, combine_impl, skew):
    import moe_fn.kernels as kernels
    from moe_fn.kernels import gather_sum

    want = _run(rank, world, combine_impl, skew, None)
    calls = []
    real_copy, real_bwd = gather_sum.launch_copy_rows, gather_sum.launch_weighted_gather_sum_bwd

    def copy_rows(*a, **kw):
        calls.append("copy_rows")
        return real_copy(*a, **kw)

    def weighted_bwd(*a, **kw):
        calls.append("weighted_bwd" if kw.get("hi_index") is None else "weighted_bwd_scatter")
        return real_bwd(*a, **kw)
    gather_sum.launch_copy_rows, gather_sum.launch_weighted_gather_sum_bwd = (copy_rows,
                                                                             weighted_bwd)
    kernels.use_triton = lambda t: t.dtype in KERNEL_DTYPES
    got = _run(rank, world, combine_impl, skew, calls)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if combine_impl == "fused":
        # The dispatch places own rows and arrivals; the weighted combine's backward writes
        # the own rows' gradients in place and places the arrivals.
        assert calls == ["copy_rows", "copy_rows", "weighted_bwd_scatter", "copy_rows"], calls
    else:
        # The routing weights travel packed with the dispatch (its gather path); the
        # combine's backward, a dispatch of the output gradient, places its rows directly.
        assert calls == ["copy_rows", "copy_rows"], calls


@pytest.mark.multiproc
@pytest.mark.parametrize("combine_impl", ["fused", "eager"])
@pytest.mark.parametrize("skew", [False, True])
def test_row_moves_through_kernels_match_the_pure_moves(combine_impl, skew):
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    run_distributed(_body, 2, combine_impl, skew)

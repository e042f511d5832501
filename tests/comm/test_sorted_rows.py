"""The row all_to_all's moves through their Triton kernels (the interpreter on the CPU):
every row placed straight at its expert-major position, the own rows while the others are
in flight. Each rank's float32 output and gradients must match one float64 layer holding
every expert and every rank's tokens, over gloo."""

from __future__ import annotations

import pytest
import torch

from moe_fn.kernels.activation import interpreting
from moe_fn.testing import assert_jointly_close_to_ref
from tests.dist_utils import run_distributed
from tests.ep_cases import EP_CASES, ep_case, gathered_params, rank_results, reference_run

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOKENS = {2: [6, 4], 3: [5, 0, 7]}  # world 3: a rank without tokens of its own


def _body(rank, world, tokens):
    import moe_fn.functional
    import moe_fn.kernels as kernels
    from moe_fn.kernels import gather_sum

    calls = []
    real_copy, real_bwd = gather_sum.launch_copy_rows, gather_sum.launch_weighted_gather_sum_bwd

    def copy_rows(*a, **kw):
        calls.append("copy_rows" if kw.get("values") is None else "copy_rows_values")
        return real_copy(*a, **kw)

    def weighted_bwd(*a, **kw):
        calls.append("weighted_bwd" if kw.get("hi_index") is None else "weighted_bwd_scatter")
        return real_bwd(*a, **kw)
    real_rw = gather_sum.launch_gather_row_weight_bwd

    def row_weight_bwd(*a, **kw):
        calls.append("row_weight_bwd" if kw.get("own") is None else "row_weight_bwd_own")
        return real_rw(*a, **kw)
    real_sum = gather_sum.launch_gather_sum

    def gather_sum_(*a, **kw):
        calls.append(("sum" if kw.get("own") is None else "sum_own")
                     + ("" if kw.get("values") is None else "_values"))
        return real_sum(*a, **kw)
    real_row_weight = moe_fn.functional.row_weight

    def row_weight(rows, *a, **kw):  # fused row weighting (its own kernel)
        if rows.dtype != torch.float64:  # the EP layer's, not the float64 reference's
            calls.append("row_weight")
        return real_row_weight(rows, *a, **kw)
    moe_fn.functional.row_weight = row_weight
    gather_sum.launch_gather_sum = gather_sum_
    gather_sum.launch_copy_rows = copy_rows
    gather_sum.launch_weighted_gather_sum_bwd = weighted_bwd
    gather_sum.launch_gather_row_weight_bwd = row_weight_bwd
    kernels.use_triton = lambda t: t.dtype in KERNEL_DTYPES
    # Plain routing, fused weighting, top-k = E/ep, and the route steered off expert 0 and
    # off the last rank (which then keeps and receives no row).
    cases = [EP_CASES[0], EP_CASES[1], EP_CASES[3], EP_CASES[4]]
    for impl in ("reference", "fused"):
        for n, kw in enumerate(cases):
            kw = dict(kw, num_experts=4 * world)  # divisible by the world
            if kw["top_k"] == "E/ep":
                kw["top_k"] = kw["num_experts"] // world
            calls.clear()
            ep_case(rank, world, kw, tokens, 99 + n, dict(impl=impl),
                    dtype=torch.float32, before_ep=calls.clear)
            # (ep_case ends with a forward without grad mode.)
            if impl == "fused" and kw.get("score_apply", "post") == "post":
                # The dispatch places own rows and arrivals; the weighted combine, whose
                # backward needs the rows, buffers them (its sum is the op, not counted
                # here); that backward writes the own rows' gradients in place and places
                # the arrivals; the dispatch's backward sums own row gradients where they
                # are. Without grad mode the combine reads the own rows in place too.
                assert calls == ["copy_rows", "copy_rows", "weighted_bwd_scatter",
                                 "copy_rows", "sum_own",
                                 "copy_rows", "copy_rows", "sum_own"], calls
            elif impl == "fused":
                # The unweighted combine's backward needs no rows: in place either way. The
                # routing weights ride in the dispatch's row copies; their gradients come
                # home packed behind the row gradients (the own ones where they are) and
                # the dispatch backward's sum gathers them with the rows.
                assert calls == ["copy_rows_values", "copy_rows_values", "sum_own",
                                 "copy_rows", "copy_rows", "sum_own_values",
                                 "copy_rows_values", "copy_rows_values", "sum_own"], calls
            else:
                # The dispatch places own rows and arrivals with their routing weights (the
                # expert side applies them, in torch ops, and the reference combine sums
                # unweighted); so does the combine's backward, a dispatch of the output
                # gradient, without weights. The reference sums are torch ops.
                moves = ["copy_rows_values"] * 2
                assert calls == [*moves, "copy_rows", "copy_rows", *moves], calls



@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_row_moves_through_kernels_match_one_float64_layer(world):
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    run_distributed(_body, world, TOKENS[world])


def _skip_body(rank, world):
    """The recompute skip's backward (the combine's backward fused into the weighting's,
    own rows' gradients read where they are) and the same layer run unchecked, both
    against the reference MoE holding every expert and every rank's tokens."""
    import torch.distributed as dist

    import moe_fn
    import moe_fn.kernels as kernels
    from moe_fn import MoEConfig, MoELayer
    from moe_fn.kernels import gather_sum

    calls = []
    real_rw = gather_sum.launch_gather_row_weight_bwd

    def row_weight_bwd(*a, **kw):
        calls.append("own" if kw.get("own") is not None else "plain")
        return real_rw(*a, **kw)
    gather_sum.launch_gather_row_weight_bwd = row_weight_bwd
    kernels.use_triton = lambda t: t.dtype in KERNEL_DTYPES
    inputs = []
    for r in range(world):
        g = torch.Generator().manual_seed(10 + r)
        x = torch.randn(7 + 2 * r, 16, generator=g)
        inputs.append((x, torch.randn(x.shape, generator=g)))
    got = []
    for skip in (True, False):
        cfg = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=3,
                        comm_backend="all_to_all", ep_size=world,
                        skip_recompute_combine=skip)
        torch.manual_seed(3)  # the same weights in both layers
        layer = MoELayer(cfg)
        x, dy = inputs[rank][0].clone().requires_grad_(), inputs[rank][1]
        if skip:
            moe_fn.checkpoint(lambda h, lay=layer: h + lay(h), x).backward(dy)
            assert layer.exchange.counters["combine_skipped"] == 1
        else:
            (x + layer(x)).backward(dy)
        dist.all_reduce(layer.router.weight.grad)
        got.append({"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    assert calls[0] == "own", calls
    # Plain: the reference in float32; the oracle: in float64. Each layer's float32
    # gradients within twice plain's error, taken as one.
    params = gathered_params(layer)
    full = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=3)
    x_all, dy_all = (torch.cat(t) for t in zip(*inputs))
    start = sum(len(x) for x, _ in inputs[:rank])
    rows = slice(start, start + len(inputs[rank][0]))
    e_local = cfg.num_local_experts
    mine = slice(rank * e_local, (rank + 1) * e_local)
    want = []
    for dtype in (torch.float32, torch.float64):
        results = rank_results(reference_run(x_all, params, full, dy_all, dtype)[0], rows, mine)
        results["x"] = results["x"] + dy_all[rows].to(dtype)  # the residual's
        want.append(results)
    names = list(got[0])
    for g in got:
        assert_jointly_close_to_ref([g[n] for n in names], [want[0][n] for n in names],
                                    [want[1][n] for n in names], names)


@pytest.mark.multiproc
def test_recompute_skip_backward_through_kernels_matches_the_unchecked_layer():
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    run_distributed(_skip_body, 2)


def _expanded_weight_grad_body(rank, world, through_kernels):
    """A routing-weight gradient expanded from one value (stride 0, as autograd hands a
    sum's gradient back) travels home like a materialised one."""
    import moe_fn.kernels as kernels
    from moe_fn.comm.resources import ResourceRegistry
    from moe_fn.comm.sorted_rows import AllToAllExchange
    from moe_fn.layer import make_route_plan

    kernels.use_triton = lambda t: through_kernels and t.dtype in KERNEL_DTYPES
    idx = torch.tensor([[0, 2], [1, 3], [2, 0]]) if rank == 0 else torch.tensor(
        [[2, 0], [3, 1], [1, 2]])
    ex = AllToAllExchange(num_experts=4, resources=ResourceRegistry(), fused_sums=True)
    handle = ex.layout(make_route_plan(idx, 4))
    g = torch.Generator().manual_seed(rank)
    rows, row_w, _ = ex.dispatch(torch.randn(3, 8, generator=g), torch.rand(3, 2, generator=g),
                                 handle)
    d_rows = torch.randn(rows.shape, generator=g)
    d_w = torch.full((), 0.5).expand(row_w.shape[0])
    dx, dw = ex.dispatch_backward(handle, d_rows, d_w).wait()
    want_dx, want_dw = ex.dispatch_backward(handle, d_rows, d_w.contiguous()).wait()
    assert torch.equal(dw, torch.full((3, 2), 0.5)) and torch.equal(want_dw, dw)
    assert torch.equal(dx, want_dx)


@pytest.mark.multiproc
@pytest.mark.parametrize("through_kernels", [False, True], ids=["pure", "kernels"])
def test_an_expanded_weight_gradient_goes_home(through_kernels):
    if through_kernels and not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    run_distributed(_expanded_weight_grad_body, 2, through_kernels)

"""The copy-engine transport moves the collective row all_to_all's rows: every move must
equal the collective's bit for bit (over gloo its pulls read the gathering stand-in of
peer memory, so the offsets into each peer's rows are what is checked)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

H = 5


def _route(g, tokens, k, allowed):
    rows = [torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:k]]
            for _ in range(tokens)]
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.long)


def _moves(ex, x, w, idx, rank, seed):
    """Every move of the exchange on one route, as a list of tensors."""
    from moe_fn.layer import make_route_plan

    e = ex.num_experts
    h = ex.layout(make_route_plan(idx, e))
    rows, row_w, h = ex.dispatch_fwd(x, w, h)
    cached, _, _ = ex.dispatch_fwd(x, None, h, cached=True)
    g = torch.Generator().manual_seed(seed + rank)
    er = torch.randn(rows.shape[0], H, generator=g, dtype=torch.float64)
    ew = torch.rand(rows.shape[0], generator=g, dtype=torch.float64)
    dx, dw = ex.dispatch_bwd(h, er, ew)
    dx_async, dw_async = ex.dispatch_bwd(h, er, ew, async_op=True).wait()
    out_w, src = ex.combine_weighted_fwd(er, w, h, keep=True)
    return [rows, row_w, cached, ex.combine_fwd(er, h)[0], dx, dw, dx_async, dw_async,
            ex.dispatch_bwd(h, er, None)[0], ex.combine_bwd(h, x),
            *ex.combine_bwd_weighted_rows(h, x, er, ew, fused=True), out_w,
            ex.combine_weighted_fwd(er, w, h, keep=False)[0],
            *ex.combine_weighted_bwd(h, x, w, src)]


def _body(rank, world):
    from moe_fn.comm.copy_engine import CopyEngineRowsExchange
    from moe_fn.comm.sorted_rows import AllToAllExchange

    el = 2
    e = el * world
    for n, (name, k) in enumerate([("random", 2), ("random", el + 1), ("no_tokens", 1),
                                   ("all_to_rank_0", 2), ("own_experts_only", 1)]):
        g = torch.Generator().manual_seed(100 + n)  # every rank draws every rank's route
        tokens = (torch.randint(1, 7, (world,), generator=g)).tolist()
        if name == "no_tokens":
            tokens[0] = tokens[-1] = 0
        routes = []
        for r in range(world):
            allowed = {"all_to_rank_0": list(range(el)),
                       "own_experts_only": list(range(r * el, (r + 1) * el))}.get(
                name, list(range(e)))
            routes.append(_route(g, tokens[r], k, allowed))
        gx = torch.Generator().manual_seed(10 * n + rank)
        x = torch.randn(tokens[rank], H, generator=gx, dtype=torch.float64)
        w = torch.rand(tokens[rank], k, generator=gx, dtype=torch.float64)
        for fused in (False, True):
            want = _moves(AllToAllExchange(num_experts=e, fused_combine=fused), x, w,
                          routes[rank], rank, 1000 * n)
            # Pulled whole, and in three parts whatever their size (parts straddle peers).
            for parts in (1, 3):
                ce = CopyEngineRowsExchange(num_experts=e, fused_combine=fused)
                ce.pull_parts, ce.min_part_bytes = parts, 0
                got = _moves(ce, x, w, routes[rank], rank, 1000 * n)
                for i, (a, b) in enumerate(zip(want, got)):
                    assert torch.equal(a, b), (name, k, fused, parts, i)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_moves_equal_the_collective(world):
    run_distributed(_body, world)


def test_landing_joins_every_pull_even_when_a_placement_raises():
    """The next move overwrites the half these pulls read: whatever happens while the parts
    are placed, the pulls are joined before the move returns."""
    from moe_fn.comm.base import Pending
    from moe_fn.comm.copy_engine import CopyEngineRowsExchange

    joined = []
    work = Pending(lambda: joined.append(True))
    work.parts = [(0, 2, None), (2, 4, None)]
    ex = CopyEngineRowsExchange.__new__(CopyEngineRowsExchange)

    def place_all():
        for lo, _ in ex._landed(torch.zeros(4, 1), work):
            if lo == 2:
                raise RuntimeError("placement failed")
    with pytest.raises(RuntimeError, match="placement failed"):
        place_all()
    assert joined == [True]
    done = Pending(lambda: joined.append("all"))
    done.parts = [(0, 4, None)]
    assert list(ex._landed(torch.zeros(4, 1), done)) == [(0, 4)] and joined[-1] == "all"

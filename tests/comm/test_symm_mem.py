"""The symm_mem exchange's layout against a brute-force oracle, and its moves against
plain loops, over gloo (the gathering stand-in): ranks without tokens, experts without
rows, top_k = 1, tokens routed twice to one expert."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_fn.autograd.routing import row_weighting_backward
from moe_fn.comm.base import Gathered
from moe_fn.comm.resources import ResourceRegistry
from moe_fn.comm.symm_mem import SymmMemExchange
from moe_fn.layer import make_route_plan
from tests.dist_utils import run_distributed

H = 5


def _routes(world, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 7, (world,), generator=g).tolist()
    if seed % 2:
        tokens[seed % world] = 0  # a rank with no tokens
    allowed = torch.randperm(e, generator=g)[:max(k, e // 2)]  # experts left without rows
    return [allowed[torch.randint(0, len(allowed), (t, k), generator=g)] for t in tokens]


def _check(rank, world, e, k, seed):
    routes = _routes(world, e, k, seed)
    ex = SymmMemExchange(num_experts=e, resources=ResourceRegistry())
    h = ex.layout(make_route_plan(routes[rank], e))
    el = e // world
    # Each owner's expert-major rows: by local expert, then source rank, then the
    # source's (token, k) rows in stable expert-sorted order.
    major = {}
    for o in range(world):
        major[o] = [(s, i) for x in range(o * el, (o + 1) * el) for s in range(world)
                    for i in torch.sort(routes[s].flatten(), stable=True).indices.tolist()
                    if int(routes[s].flatten()[i]) == x]
    mine = major[rank]
    assert h.num_rows == len(mine)
    assert h.src_rank.tolist() == [s for s, _ in mine]
    assert h.src_flat.tolist() == [i for _, i in mine]
    flat = routes[rank].flatten()
    for i in range(flat.numel()):
        o = int(flat[i]) // el
        assert (int(h.home_rank[i]), int(h.home_pos[i])) == (o, major[o].index((rank, i)))
    # Each row's slot by (source, token, j): every row once, nothing else.
    slots = h.token_slots
    assert slots.numel() == world * h.max_tokens * k
    want_slots = torch.full_like(slots, -1)
    for p, (s, i) in enumerate(mine):
        want_slots[s * h.max_tokens * k + i] = p
    assert torch.equal(slots, want_slots)
    ends = torch.tensor([sum(1 for s, i in mine if int(routes[s].flatten()[i]) == x)
                         for x in range(rank * el, (rank + 1) * el)]).cumsum(0)
    assert h.local_offs.tolist() == ends.tolist()
    assert (h.max_tokens, h.max_rows) == (max(len(r) for r in routes),
                                          max(len(m) for m in major.values()))

    # The moves against plain loops over every rank's tensors.
    gen = [torch.Generator().manual_seed(100 * seed + s) for s in range(world)]
    xs = [torch.randn(len(routes[s]), H, generator=gen[s], dtype=torch.float64)
          for s in range(world)]
    ws = [torch.rand(len(routes[s]), k, generator=gen[s], dtype=torch.float64)
          for s in range(world)]
    rows, row_w, _ = ex.dispatch(xs[rank], ws[rank], h)
    assert torch.equal(rows, torch.stack([xs[s][i // k] for s, i in mine]) if mine
                       else torch.empty(0, H, dtype=torch.float64))
    assert row_w.tolist() == [float(ws[s].flatten()[i]) for s, i in mine]
    y = rows * 2 + 1
    ys = [None] * world
    dist.all_gather_object(ys, y)

    def row_of(i):
        o = int(flat[i]) // el
        return ys[o][major[o].index((rank, i))]
    want = torch.zeros(len(routes[rank]), H, dtype=torch.float64)
    want_w = torch.zeros_like(want)
    for i in range(flat.numel()):
        want[i // k] += row_of(i)
        want_w[i // k] += row_of(i) * ws[rank].flatten()[i]
    torch.testing.assert_close(ex.combine(y, h)[0], want)
    # Routing weights folded into the expert side's sums: each row weighted by the weight
    # the dispatch delivered with it.
    torch.testing.assert_close(ex.combine(y, h, weights=row_w)[0], want_w)
    d_out = torch.randn(len(routes[rank]), H, dtype=torch.float64, generator=gen[rank])
    d_outs = [None] * world
    dist.all_gather_object(d_outs, d_out)
    for fused in (False, True):
        d = (ex.combine_backward_gathered(h, d_out) if fused
             else Gathered(ex.combine_backward(h, d_out)[0]))
        d_rows, d_rw = row_weighting_backward(d, y, row_w, fused=fused)
        for p, (s, i) in enumerate(mine):
            torch.testing.assert_close(d_rows[p], ws[s].flatten()[i] * d_outs[s][i // k])
            torch.testing.assert_close(d_rw[p], (d_outs[s][i // k] * y[p]).sum())
    dx, d_w2 = ex.dispatch_backward(h, y, row_w * 3).wait()
    torch.testing.assert_close(dx, want)
    assert d_w2.flatten().tolist() == [3 * float(ws[rank].flatten()[i]) for i in
                                       range(flat.numel())]
    torch.testing.assert_close(ex.combine_backward(h, d_out)[0],
                               torch.stack([d_outs[s][i // k] for s, i in mine]) if mine
                               else torch.empty(0, H, dtype=torch.float64))


CASES = {2: [(4, 1), (8, 2), (6, 3), (8, 4)], 4: [(8, 1), (8, 2), (4, 3)]}


def _body(rank, world):
    for seed, (e, k) in enumerate(CASES[world]):
        _check(rank, world, e, k, seed)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_layout_and_moves_match_a_brute_force_oracle(world):
    run_distributed(_body, world)


def _placement_body(rank, world):
    from moe_fn import MoEConfig, MoELayer
    for impl, symm_want, collective_want in [("fused", (False, True), (True, False)),
                                             ("reference", (False, False), (False, False))]:
        cfg = dict(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
                   comm_backend="all_to_all", ep_size=world, impl=impl)
        # symm_mem sums on the expert side, with the float32 weights the dispatch delivers:
        # the fused path folds them into those sums; all_to_all weights at home.
        symm = MoELayer(MoEConfig(**dict(cfg, comm_backend="symm_mem")))
        assert symm._weight_placement() == symm_want, impl
        collective = MoELayer(MoEConfig(**cfg))
        assert collective._weight_placement() == collective_want, impl


@pytest.mark.multiproc
def test_symm_mem_folds_the_routing_weights_for_the_fused_combine():
    run_distributed(_placement_body, 2)

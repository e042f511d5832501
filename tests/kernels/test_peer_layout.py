"""The symm_mem and row all_to_all layouts' Triton kernels against the pure index math, bit
for bit, for every rank of random routes (on the GPU where there is one, else in the Triton
interpreter): ranks without tokens, experts without rows, top_k 1, a token routed twice to
one expert, E not a power of two. The pure math itself is checked against a brute-force
oracle by tests/comm/test_symm_mem.py (symm_mem) and below (row all_to_all)."""

from __future__ import annotations

import pytest
import torch

from moe_fn.kernels.peer_layout import (
    launch_peer_home_side,
    launch_peer_receiver_side,
    launch_rows_home_side,
    launch_rows_receiver_side,
)
from moe_fn.layer import make_route_plan
from moe_fn.pure.peer_layout import (
    peer_home_side,
    peer_receiver_side,
    rows_home_side,
    rows_receiver_side,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _plans(ep, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 9, (ep,), generator=g).tolist()
    tokens[seed % ep] = 0 if seed % 3 == 0 else tokens[seed % ep]  # a rank without tokens
    allowed = torch.randperm(e, generator=g)[:max(k, (2 * e) // 3)]  # experts without rows
    return [make_route_plan(allowed[torch.randint(0, len(allowed), (t, k), generator=g)]
                            .to(DEV), e) for t in tokens]


def _assert_same(want, got, fields, rank):
    """Each field (a name, or an index into a tuple) equal in dtype and bit for bit."""
    for f in fields:
        a, b = (want[f], got[f]) if isinstance(f, int) else (getattr(want, f), getattr(got, f))
        assert a.dtype == b.dtype and torch.equal(a, b), (f, rank, a, b)


@pytest.mark.parametrize("ep,e,k", [(1, 4, 2), (2, 8, 3), (2, 6, 1), (3, 12, 4), (4, 8, 8),
                                    (2, 128, 8), (4, 60, 6), (8, 64, 8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernels_match_the_pure_layout_on_every_rank(ep, e, k, seed):
    plans = _plans(ep, e, k, seed)
    c = torch.stack([p.counts for p in plans])
    el = e // ep
    for rank, plan in enumerate(plans):
        args = (c, plan.offs, plan.counts, plan.topk_idx, plan.inv_perm, rank, k)
        want = peer_home_side(*args)
        got = launch_peer_home_side(*args)
        _assert_same(want, got, ("sizes", "home_rank", "home_pos", "local_offs"), rank)
        # What the index all_to_all delivers: each source's sorted rows for this rank's
        # experts, in source order.
        recv_flat = torch.cat([p.perm[int(p.offs[rank * el] - p.counts[rank * el]):
                                      int(p.offs[(rank + 1) * el - 1])] for p in plans])
        max_tokens = int(want.sizes[2 * ep])
        want_r = peer_receiver_side(c, recv_flat, rank, k, max_tokens)
        got_r = launch_peer_receiver_side(c, recv_flat, rank, k, max_tokens, got.tables)
        _assert_same(want_r, got_r, ("src_rank", "src_flat", "token_slots"), rank)


def _rows_oracle(plans, rank, el):
    """The row all_to_all's layout by brute force: lists of (source, flattened row) keys."""
    mine = range(rank * el, (rank + 1) * el)
    me = plans[rank]
    sorted_rows = me.perm.tolist()
    experts = me.topk_idx.flatten().tolist()
    sent = [f for f in sorted_rows if experts[f] not in mine]
    own = [f for f in sorted_rows if experts[f] in mine]
    buffer_flat = sent + own  # what leaves, in sorted order, then what stays
    # Arrival: each source's sorted rows for my experts, sources in order; own rows go to
    # the receive buffer's tail.
    arrival = [(s, f) for s, p in enumerate(plans)
               for f in p.perm.tolist() if int(p.topk_idx.flatten()[f]) in mine]
    buffer = [key for key in arrival if key[0] != rank] + [key for key in arrival
                                                           if key[0] == rank]
    # Expert-major: by local expert, then source, then the source's sorted order.
    expert_major = sorted(arrival, key=lambda key: (int(plans[key[0]].topk_idx.flatten()[
        key[1]]), key[0]))
    return buffer_flat, buffer, expert_major


@pytest.mark.parametrize("ep,e,k", [(1, 4, 2), (2, 8, 3), (2, 6, 1), (3, 12, 4), (4, 8, 8),
                                    (2, 128, 8), (4, 60, 6)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_all_to_all_layout_kernels_match_pure_and_oracle(ep, e, k, seed):
    plans = _plans(ep, e, k, seed)
    c = torch.stack([p.counts for p in plans])
    el = e // ep
    for rank, plan in enumerate(plans):
        args = (c, plan.offs, plan.counts, plan.perm, plan.token_of_sorted, rank, k)
        want = rows_home_side(*args)
        got = launch_rows_home_side(*args)
        _assert_same(want, got, ("sizes", "local_offs", "home_order", "buffer_tokens",
                                 "buffer_flat"), rank)
        sizes = want.sizes.tolist()
        recv, send = sizes[:ep], sizes[ep:2 * ep]
        n = sum(recv)
        want_r = rows_receiver_side(c, n, rank, sum(recv[:rank]), send[rank])
        got_r = launch_rows_receiver_side(c, n, rank, sum(recv[:rank]), send[rank], got.tables)
        _assert_same(want_r, got_r, (0, 1), rank)
        buffer_flat, buffer, expert_major = _rows_oracle(plans, rank, el)
        assert want.buffer_flat.tolist() == buffer_flat
        assert want.buffer_tokens.tolist() == [f // k for f in buffer_flat]
        assert all(buffer_flat[q] == f for f, q in enumerate(want.home_order.tolist()))
        expert_src, dst = want_r
        assert [buffer[q] for q in expert_src.tolist()] == expert_major
        assert [expert_major[p] for p in dst.tolist()] == buffer

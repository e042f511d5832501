"""The index math of the ``symm_mem`` transport's layout (``moe_fn.comm.peer_rows``), in two
halves around its one host sync; ``moe_fn.kernels.peer_layout`` computes the same in three
Triton launches (this index math is dozens of small torch ops, each tens of microseconds of
host time, while the GPU waits for the host after the sync).

``c (ep, E)``: every rank's per-expert row counts (the gathered ``plan.counts``); rank ``o``
owns experts ``[o*el, (o+1)*el)``. Each owner's expert-major rows are ordered by local
expert, then source rank, then the source's stable expert-sorted order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PeerHomeSide(NamedTuple):
    """What the layout knows before its host sync. ``sizes`` (2*ep + 3,) int64: rows this
    rank receives from each source, rows it sends to each owner, then the most tokens,
    expert rows and rows for other ranks' tokens of any rank. Then, for each of this rank's
    flattened (token, k) rows, ``home_rank`` (int32), ``home_pos`` (its expert-major
    position at that rank) and ``home_cpos`` (its position among the rows that rank
    exposes: its rows for other ranks' tokens, in order; ``home_pos`` on this rank); and
    ``local_offs`` (el,) int32, row ends per local expert. ``tables``: what the kernels
    pass to the receiving half (None from the pure function)."""

    sizes: torch.Tensor
    home_rank: torch.Tensor
    home_pos: torch.Tensor
    home_cpos: torch.Tensor
    local_offs: torch.Tensor
    tables: torch.Tensor | None = None


class PeerReceiverSide(NamedTuple):
    """For each expert-major row this rank computes: ``src_rank`` (int32) and ``src_flat``
    (int64), its source rank and flattened (token, k) index there; ``remote_rows``: the
    expert-major positions of rows from other ranks, in order; ``token_slots``
    ``(ep * max_tokens * k,)`` int32: at ``(s * max_tokens + t) * k + j`` the position of
    row (t, j) of rank s, or -1 where this rank does not compute it (one token's rows
    side by side, so a pull can read each token once)."""

    src_rank: torch.Tensor
    src_flat: torch.Tensor
    remote_rows: torch.Tensor
    token_slots: torch.Tensor


def peer_home_side(c, offs, counts, topk_idx, inv_perm, rank: int, top_k: int) -> PeerHomeSide:
    """The half before the host sync, from ``c`` and this rank's route (``plan.offs``,
    ``plan.counts``, ``plan.topk_idx``, ``plan.inv_perm``)."""
    ep, e = c.shape
    el = e // ep
    me = rank
    by_rank = c.reshape(ep, ep, el)  # [source, owner, local expert]
    recv = by_rank[:, me]
    rows_of = by_rank.sum((0, 2))  # expert rows each rank computes
    ranks = torch.arange(ep, device=c.device)
    own_of = by_rank[ranks, ranks].sum(1)  # of which from the rank's own tokens
    sizes = torch.cat([recv.sum(1), by_rank[me].sum(1), (c.sum(1) // top_k).max()[None],
                       rows_of.max()[None], (rows_of - own_of).max()[None]])
    # Row (t, j) at sorted position p of expert e lands on e's owner at (start of block
    # (e, this rank) there) + (p - start of e in this rank's order).
    tot = c.sum(0).reshape(ep, el)
    exp_start = (torch.cumsum(tot, 1) - tot).flatten()
    base = exp_start + c[:me].sum(0) - (offs.long() - counts)
    experts = topk_idx.flatten()
    # An owner exposes only the rows other ranks need, in its expert-major order without
    # the blocks of its own tokens. Rows before block (e, this rank) there that are the
    # owner's own: its rows of the owner's earlier experts, and of e itself if the owner
    # comes first. (This rank reads its own rows in place: nothing to subtract there.)
    e_all = torch.arange(e, device=c.device)
    own = c[e_all // el, e_all].reshape(ep, el)
    own_before = torch.where(ranks[:, None] == me, 0,
                             torch.cumsum(own, 1) - own + own * (ranks[:, None] < me)).flatten()
    pos = torch.stack([base, base - own_before]).index_select(1, experts) + inv_perm
    return PeerHomeSide(sizes, (experts // el).to(torch.int32), pos[0], pos[1],
                        torch.cumsum(tot[me], 0).to(torch.int32))


def peer_receiver_side(c, recv_flat, rank: int, top_k: int, max_tokens: int,
                       num_remote: int) -> PeerReceiverSide:
    """The half after it: ``recv_flat`` holds, in (source, local expert) order, each row's
    flattened (token, k) index at its source (the sources' sorted rows for this rank's
    experts, as the index all_to_all delivers them); ``max_tokens`` and ``num_remote``
    (rows from other ranks) are the host ints the sync delivered."""
    ep, e = c.shape
    el = e // ep
    recv = c[:, rank * el:(rank + 1) * el]  # (ep, el) rows from each source per local expert
    n = recv_flat.numel()
    dev = c.device
    src_start = torch.cumsum(recv.flatten(), 0) - recv.flatten()
    by_expert = recv.t().flatten()  # block (x, s) in expert-major order
    dst_start = torch.cumsum(by_expert, 0) - by_expert
    block = torch.repeat_interleave(torch.arange(ep * el, device=dev), by_expert,
                                    output_size=n)
    x, s = block // ep, block % ep
    within = torch.arange(n, device=dev) - dst_start[block]
    src_flat = recv_flat.index_select(0, src_start[s * el + x] + within)
    # Expert-major positions of the rows from other ranks, in order (a stable sort: no
    # host sync).
    remote_rows = torch.sort((s == rank).to(torch.int8), stable=True).indices[:num_remote]
    slots = torch.full((ep * max_tokens * top_k,), -1, dtype=torch.int32, device=dev)
    slots[s * (max_tokens * top_k) + src_flat] = torch.arange(n, dtype=torch.int32, device=dev)
    return PeerReceiverSide(s.to(torch.int32), src_flat, remote_rows, slots)

"""The index math of the exchanges' layouts that start from every rank's per-expert counts:
the ``symm_mem`` exchange (``moe_fn.comm.symm_mem``) and the collective row all_to_all
(``moe_fn.comm.sorted_rows``), each in two halves around its one host sync;
``moe_fn.kernels.peer_layout`` computes the same in three Triton launches (this index math
is dozens of small torch ops, each tens of microseconds of host time, while the GPU waits
for the host after the sync).

``c (ep, E)``: every rank's per-expert row counts (the gathered ``plan.counts``); rank ``o``
owns experts ``[o*el, (o+1)*el)``. Each owner's expert-major rows are ordered by local
expert, then source rank, then the source's stable expert-sorted order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def expert_major_sources(recv_counts: torch.Tensor, num_rows: int):
    """``(position in (source, expert) order, source rank)`` of each of the ``num_rows``
    expert-major rows a rank receives, given ``recv_counts (ep, E_local)``: rows from each
    source for each local expert (arriving by source, then expert)."""
    ep, e_local = recv_counts.shape
    dev = recv_counts.device
    src_start = torch.cumsum(recv_counts.flatten(), 0) - recv_counts.flatten()
    by_expert = recv_counts.t().flatten()  # block (e, s) in expert-major order
    dst_start = torch.cumsum(by_expert, 0) - by_expert
    block = torch.repeat_interleave(torch.arange(ep * e_local, device=dev), by_expert,
                                    output_size=num_rows)
    e, s = block // ep, block % ep
    within = torch.arange(num_rows, device=dev) - dst_start[block]
    return src_start[s * e_local + e] + within, s


class PeerHomeSide(NamedTuple):
    """What the layout knows before its host sync. ``sizes`` (2*ep + 2,) int64: rows this
    rank receives from each source, rows it sends to each owner, then the most tokens and
    the most expert rows of any rank. Then, for each of this rank's flattened (token, k)
    rows, ``home_rank`` (int32), the rank computing it, and ``home_pos``, its expert-major
    position there; and ``local_offs`` (el,) int32, row ends per local expert. ``tables``:
    what the kernels pass to the receiving half (None from the pure function)."""

    sizes: torch.Tensor
    home_rank: torch.Tensor
    home_pos: torch.Tensor
    local_offs: torch.Tensor
    tables: torch.Tensor | None = None


class PeerReceiverSide(NamedTuple):
    """For each expert-major row this rank computes: ``src_rank`` (int32) and ``src_flat``
    (int64), its source rank and flattened (token, k) index there; ``token_slots``
    ``(ep * max_tokens * k,)`` int32: at ``(s * max_tokens + t) * k + j`` the position of
    row (t, j) of rank s, or -1 where this rank does not compute it (one token's rows
    side by side, so a pull can read each token once)."""

    src_rank: torch.Tensor
    src_flat: torch.Tensor
    token_slots: torch.Tensor


def peer_home_side(c, offs, counts, topk_idx, inv_perm, rank: int, top_k: int) -> PeerHomeSide:
    """The half before the host sync, from ``c`` and this rank's route (``plan.offs``,
    ``plan.counts``, ``plan.topk_idx``, ``plan.inv_perm``)."""
    ep, e = c.shape
    el = e // ep
    me = rank
    sizes, local_offs = _sizes(c, me, top_k)
    # Row (t, j) at sorted position p of expert e lands on e's owner at (start of block
    # (e, this rank) there) + (p - start of e in this rank's order).
    tot = c.sum(0).reshape(ep, el)
    exp_start = (torch.cumsum(tot, 1) - tot).flatten()
    base = exp_start + c[:me].sum(0) - (offs.long() - counts)
    experts = topk_idx.flatten()
    return PeerHomeSide(sizes, (experts // el).to(torch.int32),
                        base.index_select(0, experts) + inv_perm, local_offs)


def _sizes(c, me: int, top_k: int):
    """``(sizes, local_offs)`` as ``PeerHomeSide`` holds them."""
    ep, e = c.shape
    el = e // ep
    by_rank = c.reshape(ep, ep, el)  # [source, owner, local expert]
    sizes = torch.cat([by_rank[:, me].sum(1), by_rank[me].sum(1),
                       (c.sum(1) // top_k).max()[None], by_rank.sum((0, 2)).max()[None]])
    return sizes, torch.cumsum(by_rank[:, me].sum(0), 0).to(torch.int32)


def peer_receiver_side(c, recv_flat, rank: int, top_k: int, max_tokens: int
                       ) -> PeerReceiverSide:
    """The half after it: ``recv_flat`` holds, in (source, local expert) order, each row's
    flattened (token, k) index at its source (the sources' sorted rows for this rank's
    experts, as the index all_to_all delivers them); ``max_tokens`` is the host int the
    sync delivered."""
    ep, e = c.shape
    el = e // ep
    recv = c[:, rank * el:(rank + 1) * el]  # (ep, el) rows from each source per local expert
    n = recv_flat.numel()
    dev = c.device
    where, s = expert_major_sources(recv, n)
    src_flat = recv_flat.index_select(0, where)
    slots = torch.full((ep * max_tokens * top_k,), -1, dtype=torch.int32, device=dev)
    slots[s * (max_tokens * top_k) + src_flat] = torch.arange(n, dtype=torch.int32, device=dev)
    return PeerReceiverSide(s.to(torch.int32), src_flat, slots)


# ---- the collective row all_to_all (moe_fn.comm.sorted_rows) ---------------------------------
# It sends this rank's sorted rows for other owners in sorted order (its own slice [a, b)
# stays), and receives in (source, local expert) order into [rows from other sources; its
# own rows].


class RowsHomeSide(NamedTuple):
    """The row all_to_all's layout before its host sync: ``sizes`` and ``local_offs`` as
    ``PeerHomeSide``'s; for the T*k sorted rows in home-buffer order (rows sent, in sorted
    order, then this rank's own), ``buffer_tokens`` their tokens and ``buffer_flat`` their
    flattened (token, k) indices; ``home_order`` (T*k,): each flattened row's position in
    that order. ``tables``: what the kernels pass to the receiving half (None from the pure
    function)."""

    sizes: torch.Tensor
    local_offs: torch.Tensor
    home_order: torch.Tensor
    buffer_tokens: torch.Tensor
    buffer_flat: torch.Tensor
    tables: torch.Tensor | None = None


def own_slice_ends(rank: int, num_local: int) -> tuple[int, int]:
    """The ``offs`` entries that end the rows before this rank's own experts (-1: none)
    and its own experts' rows, in its sorted order."""
    return rank * num_local - 1, (rank + 1) * num_local - 1


def own_slice(offs, rank: int, num_local: int):
    """``(a, b)``: the bounds of this rank's own experts' rows in its sorted order, as
    0-dim device tensors (read on the host they would sync)."""
    before, end = own_slice_ends(rank, num_local)
    a = offs[before] if before >= 0 else offs.new_zeros(())
    return a.long(), offs[end].long()


def buffer_position(p, a, own, n):
    """Position ``p`` of an order of ``n`` rows where ``[a, a + own)`` moves to the tail."""
    return torch.where(p < a, p, torch.where(p >= a + own, p - own, n - own + p - a))


def rows_home_side(c, offs, counts, perm, token_of_sorted, rank: int, top_k: int
                   ) -> RowsHomeSide:
    """The half before the host sync, from ``c`` and this rank's route (``plan.offs``,
    ``plan.counts``, ``plan.perm``, ``plan.token_of_sorted``; ``counts`` only feeds the
    kernels' tables launch, which the ``symm_mem`` layout shares)."""
    ep, e = c.shape
    sizes, local_offs = _sizes(c, rank, top_k)
    a, b = own_slice(offs, rank, e // ep)
    n = perm.numel()
    q = buffer_position(torch.arange(n, device=perm.device), a, b - a, n)
    buffer_tokens = torch.empty_like(token_of_sorted)
    buffer_tokens[q] = token_of_sorted
    buffer_flat = torch.empty_like(perm)
    buffer_flat[q] = perm
    home_order = torch.empty_like(perm)
    home_order[perm] = q
    return RowsHomeSide(sizes, local_offs, home_order, buffer_tokens, buffer_flat)


def rows_receiver_side(c, num_rows: int, rank: int, recv_start: int, own_rows: int):
    """The half after it: ``(expert_src, dst)``, both (num_rows,) int64. ``expert_src[p]``:
    the receive-buffer position of expert-major row p; ``dst``: its inverse (the
    expert-major position of each buffer row). ``recv_start`` / ``own_rows``: where this
    rank's own rows would arrive in (source, expert) order and how many, host ints from the
    sync."""
    ep, e = c.shape
    el = e // ep
    arrival, _ = expert_major_sources(c[:, rank * el:(rank + 1) * el], num_rows)
    expert_src = buffer_position(arrival, recv_start, own_rows, num_rows)
    dst = torch.empty_like(expert_src)
    dst[expert_src] = torch.arange(num_rows, device=c.device)
    return expert_src, dst

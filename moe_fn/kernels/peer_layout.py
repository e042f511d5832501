"""The layout index math of the ``symm_mem`` exchange and of the collective row all_to_all
in three Triton launches each: the same outputs as ``moe_fn.pure.peer_layout`` (bit for
bit), which takes dozens of small torch ops. After the layout's host sync the GPU waits
for the host, so its host time is the layout's cost: on the H200 hosts the torch versions
took ~2.8 ms (``symm_mem``) and ~0.85 ms (row all_to_all) of host time after the sync.

``_tables_kernel`` (one program) turns the gathered counts ``c (ep, E)`` into the sizes
and per-expert tables of both halves. Before the sync, ``_home_rows_kernel`` maps this
rank's (token, k) rows to their places at their owners (``symm_mem``) and
``_rows_home_kernel`` puts the sorted rows in send order (row all_to_all); after it,
``_recv_rows_kernel`` / ``_rows_recv_kernel`` map the received rows to expert-major rows,
scattering the outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pure.peer_layout import PeerHomeSide, PeerReceiverSide, RowsHomeSide, own_slice_ends
from ._launch import cdiv, launch, next_pow2

_BLOCK = 512
# Table rows in the int64 scratch, each E long: by expert e = o*el + x (owner-major) the
# home side's base; by block b = s*el + x (source-major) the received blocks' starts and
# ends in arrival order and their starts in expert-major order.
# (constexpr: the only globals a Triton kernel compiled for the GPU may read.)
_BASE, _RSTART, _REND, _DST = (tl.constexpr(i) for i in range(4))
_TABLES = 4


@triton.jit
def _tables_kernel(c_ptr, offs_ptr, counts_ptr, sizes_ptr, tab_ptr, loffs_ptr, me, ep, el, k,
                   EP: tl.constexpr, EL: tl.constexpr):
    e_n = ep * el
    s3 = tl.arange(0, EP)[:, None, None]
    o3 = tl.arange(0, EP)[None, :, None]
    x3 = tl.arange(0, EL)[None, None, :]
    m3 = (s3 < ep) & (o3 < ep) & (x3 < el)
    c = tl.load(c_ptr + s3 * e_n + o3 * el + x3, mask=m3, other=0).to(tl.int64)  # [s, o, x]
    r = tl.arange(0, EP)
    mr = r < ep
    # sizes: rows from each source for my experts, rows to each owner, then the maxima.
    recv = tl.sum(tl.where(o3 == me, c, 0), axis=1)  # [s, x]
    tl.store(sizes_ptr + r, tl.sum(recv, axis=1), mask=mr)
    tl.store(sizes_ptr + ep + r, tl.sum(tl.sum(tl.where(s3 == me, c, 0), axis=0), axis=1),
             mask=mr)
    tl.store(sizes_ptr + 2 * ep, tl.max(tl.sum(tl.sum(c, axis=2), axis=1) // k))
    tl.store(sizes_ptr + 2 * ep + 1, tl.max(tl.sum(tl.sum(c, axis=2), axis=0)))
    # Home side, by expert (o, x).
    o2 = tl.arange(0, EP)[:, None]
    x2 = tl.arange(0, EL)[None, :]
    m2 = (o2 < ep) & (x2 < el)
    e2 = o2 * el + x2
    tot = tl.sum(c, axis=0)  # [o, x]
    before_me = tl.sum(tl.where(s3 < me, c, 0), axis=0)
    start = (tl.load(offs_ptr + e2, mask=m2, other=0).to(tl.int64)
             - tl.load(counts_ptr + e2, mask=m2, other=0).to(tl.int64))
    tl.store(tab_ptr + _BASE * e_n + e2, tl.cumsum(tot, axis=1) - tot + before_me - start,
             mask=m2)
    x1 = tl.arange(0, EL)
    tl.store(loffs_ptr + x1, tl.sum(tl.where(o2 == me, tl.cumsum(tot, axis=1), 0),
                                    axis=0).to(tl.int32), mask=x1 < el)
    # Receiver side, by block (s, x) of arrival order (recv is [s, x]).
    s2 = o2  # the same index range, read as sources
    b2 = s2 * el + x2
    row_tot = tl.sum(recv, axis=1)
    rend = (tl.cumsum(row_tot, axis=0) - row_tot)[:, None] + tl.cumsum(recv, axis=1)
    tl.store(tab_ptr + _REND * e_n + b2, rend, mask=m2)
    tl.store(tab_ptr + _RSTART * e_n + b2, rend - recv, mask=m2)
    col_tot = tl.sum(recv, axis=0)  # [x]
    dst = (tl.cumsum(col_tot, axis=0) - col_tot)[None, :] + tl.cumsum(recv, axis=0) - recv
    tl.store(tab_ptr + _DST * e_n + b2, dst, mask=m2)


@triton.jit
def _home_rows_kernel(idx_ptr, inv_ptr, tab_ptr, rank_ptr, pos_ptr, n, el, e_n,
                      BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    e = tl.load(idx_ptr + i, mask=m, other=0).to(tl.int64)
    p = tl.load(tab_ptr + _BASE * e_n + e, mask=m, other=0) + tl.load(inv_ptr + i, mask=m,
                                                                      other=0).to(tl.int64)
    tl.store(rank_ptr + i, (e // el).to(tl.int32), mask=m)
    tl.store(pos_ptr + i, p, mask=m)


@triton.jit
def _arrival_to_expert_major(tab_ptr, i, m, e_n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """``(b, p)`` for rows ``i`` of (source, local expert) arrival order: the arrival block
    ``b = s*el + x`` and the expert-major position ``p``."""
    # The first b whose end exceeds i (empty blocks end where the previous one does, so
    # they are never chosen).
    lo = tl.zeros((BLOCK,), dtype=tl.int64)
    hi = tl.zeros((BLOCK,), dtype=tl.int64) + e_n
    for _ in tl.static_range(STEPS):
        open_ = m & (lo < hi)
        mid = (lo + hi) // 2
        right = tl.load(tab_ptr + _REND * e_n + mid, mask=open_, other=0) <= i
        lo = tl.where(open_ & right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    p = (tl.load(tab_ptr + _DST * e_n + lo, mask=m, other=0)
         + i - tl.load(tab_ptr + _RSTART * e_n + lo, mask=m, other=0))
    return lo, p


@triton.jit
def _recv_rows_kernel(flat_ptr, tab_ptr, srank_ptr, sflat_ptr, slots_ptr, n, el, e_n,
                      slot_stride, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    b, p = _arrival_to_expert_major(tab_ptr, i, m, e_n, BLOCK, STEPS)
    s = b // el
    f = tl.load(flat_ptr + i, mask=m, other=0).to(tl.int64)
    tl.store(srank_ptr + p, s.to(tl.int32), mask=m)
    tl.store(sflat_ptr + p, f, mask=m)
    tl.store(slots_ptr + s * slot_stride + f, p.to(tl.int32), mask=m)


@triton.jit
def _buffer_position(p, a, own, n):
    return tl.where(p < a, p, tl.where(p >= a + own, p - own, n - own + p - a))


@triton.jit
def _rows_home_kernel(offs_ptr, perm_ptr, tok_ptr, home_ptr, btok_ptr, bflat_ptr, n, a_idx,
                      b_idx, BLOCK: tl.constexpr):
    a = tl.load(offs_ptr + a_idx, mask=a_idx >= 0, other=0).to(tl.int64)
    b = tl.load(offs_ptr + b_idx).to(tl.int64)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = p < n
    q = _buffer_position(p, a, b - a, n)
    f = tl.load(perm_ptr + p, mask=m, other=0)
    tl.store(btok_ptr + q, tl.load(tok_ptr + p, mask=m, other=0), mask=m)
    tl.store(bflat_ptr + q, f, mask=m)
    tl.store(home_ptr + f, q, mask=m)


@triton.jit
def _rows_recv_kernel(tab_ptr, src_ptr, dst_ptr, n, e_n, recv_start, own,
                      BLOCK: tl.constexpr, STEPS: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = i < n
    _, p = _arrival_to_expert_major(tab_ptr, i, m, e_n, BLOCK, STEPS)
    q = _buffer_position(i, recv_start, own, n)
    tl.store(src_ptr + p, q, mask=m)
    tl.store(dst_ptr + q, p, mask=m)


def _launch_tables(c, offs, counts, rank: int, top_k: int):
    """``(sizes, tables, local_offs)`` from the gathered counts, in one launch."""
    ep, e = c.shape
    dev = c.device
    sizes = torch.empty(2 * ep + 2, dtype=torch.int64, device=dev)
    tables = torch.empty(_TABLES * e, dtype=torch.int64, device=dev)
    local_offs = torch.empty(e // ep, dtype=torch.int32, device=dev)
    launch(_tables_kernel, (1,), c.contiguous(), offs, counts, sizes, tables, local_offs, rank,
           ep, e // ep, top_k, EP=next_pow2(ep), EL=next_pow2(e // ep))
    return sizes, tables, local_offs


def launch_peer_home_side(c, offs, counts, topk_idx, inv_perm, rank: int,
                          top_k: int) -> PeerHomeSide:
    """``moe_fn.pure.peer_layout.peer_home_side`` in two launches."""
    ep, e = c.shape
    el = e // ep
    dev = c.device
    sizes, tables, local_offs = _launch_tables(c, offs, counts, rank, top_k)
    n = topk_idx.numel()
    home_rank = torch.empty(n, dtype=torch.int32, device=dev)
    home_pos = torch.empty(n, dtype=torch.int64, device=dev)
    if n:
        launch(_home_rows_kernel, (cdiv(n, _BLOCK),), topk_idx.contiguous(),
               inv_perm.contiguous(), tables, home_rank, home_pos, n, el, e, BLOCK=_BLOCK)
    return PeerHomeSide(sizes, home_rank, home_pos, local_offs, tables)


def launch_peer_receiver_side(c, recv_flat, rank: int, top_k: int, max_tokens: int,
                              tables) -> PeerReceiverSide:
    """``moe_fn.pure.peer_layout.peer_receiver_side`` in one launch, with the ``tables``
    ``launch_peer_home_side`` returned."""
    ep, e = c.shape
    dev = c.device
    n = recv_flat.numel()
    src_rank = torch.empty(n, dtype=torch.int32, device=dev)
    src_flat = torch.empty(n, dtype=torch.int64, device=dev)
    slots = torch.full((ep * max_tokens * top_k,), -1, dtype=torch.int32, device=dev)
    if n:
        launch(_recv_rows_kernel, (cdiv(n, _BLOCK),), recv_flat.contiguous(), tables, src_rank,
               src_flat, slots, n, e // ep, e, max_tokens * top_k, BLOCK=_BLOCK,
               STEPS=max(e, 1).bit_length())
    return PeerReceiverSide(src_rank, src_flat, slots)


def launch_rows_home_side(c, offs, counts, perm, token_of_sorted, rank: int,
                          top_k: int) -> RowsHomeSide:
    """``moe_fn.pure.peer_layout.rows_home_side`` in two launches."""
    el = c.shape[1] // c.shape[0]
    sizes, tables, local_offs = _launch_tables(c, offs, counts, rank, top_k)
    n = perm.numel()
    home_order, buffer_flat = torch.empty_like(perm), torch.empty_like(perm)
    buffer_tokens = torch.empty_like(token_of_sorted)
    if n:
        launch(_rows_home_kernel, (cdiv(n, _BLOCK),), offs, perm.contiguous(),
               token_of_sorted.contiguous(), home_order, buffer_tokens, buffer_flat, n,
               *own_slice_ends(rank, el), BLOCK=_BLOCK)
    return RowsHomeSide(sizes, local_offs, home_order, buffer_tokens, buffer_flat, tables)


def launch_rows_receiver_side(c, num_rows: int, rank: int, recv_start: int, own_rows: int,
                              tables):
    """``moe_fn.pure.peer_layout.rows_receiver_side`` in one launch, with the ``tables``
    ``launch_rows_home_side`` returned."""
    e = c.shape[1]
    expert_src = torch.empty(num_rows, dtype=torch.int64, device=c.device)
    dst = torch.empty_like(expert_src)
    if num_rows:
        launch(_rows_recv_kernel, (cdiv(num_rows, _BLOCK),), tables, expert_src, dst,
               num_rows, e, recv_start, own_rows, BLOCK=_BLOCK, STEPS=max(e, 1).bit_length())
    return expert_src, dst

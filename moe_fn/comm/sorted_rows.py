"""Exchanges over expert-sorted (token, k) rows: ``local`` (one rank) and ``all_to_all``.

The home rank sorts its T*k rows by global expert (``RoutePlan.perm``); the rows for rank
d are then contiguous, so one ``all_to_all_single`` with split sizes moves them. A rank's
rows for its own experts never enter the collective: they are copied into place while the
remote rows are in flight. The receiver places every row at its expert-major position
(``local_offs``). Combine runs the same moves backwards and sums each token's k rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels
from ..pure.dispatch import (
    gather_sum_fwd,
    split_rows,
    weighted_gather_sum_bwd,
    weighted_gather_sum_fwd,
)
from ..records import RoutePlan, SortedRowsHandle
from .base import (
    AllToAllTransport,
    Exchange,
    Pending,
    new_packed,
    pack_rows,
    packs_float32,
    unpack_rows,
)


def _expert_major_order(recv_counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """For each expert-major position, the position of that row in (source, expert) order.

    ``recv_counts``: (ep, E_local) rows from each source for each local expert.
    """
    ep, e_local = recv_counts.shape
    dev = recv_counts.device
    src_start = torch.cumsum(recv_counts.flatten(), 0) - recv_counts.flatten()
    by_expert = recv_counts.t().flatten()  # block (e, s) in expert-major order
    dst_start = torch.cumsum(by_expert, 0) - by_expert
    block = torch.repeat_interleave(torch.arange(ep * e_local, device=dev), by_expert,
                                    output_size=num_rows)
    e, s = block // ep, block % ep
    within = torch.arange(num_rows, device=dev) - dst_start[block]
    return src_start[s * e_local + e] + within


def _without(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """``t`` without the slice ``[a, b)``."""
    return torch.cat([t[:a], t[b:]])


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


class SortedRowsExchange(Exchange):
    """The moves shared by the local and all-to-all exchanges; ``_exchange`` is transport.

    ``fused_combine`` (``combine_impl="fused"``) sums each token's k returning rows with the
    one-pass gather-sum kernel instead of a gather and a reduction.
    """

    fused_combine = False
    home_weighting = True

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False, out=None):
        raise NotImplementedError

    def _layout_counts(self, plan: RoutePlan):
        raise NotImplementedError

    def layout(self, plan: RoutePlan) -> SortedRowsHandle:
        self.counters["layout"] += 1
        return self._layout_counts(plan)

    # ---- the two moves ---------------------------------------------------------------------
    def _to_experts(self, token_rows, h: SortedRowsHandle, *, async_op=False):
        """Token rows ``(T, D)`` -> expert rows ``(N, D)``; returns ``finish() -> rows``."""
        finish = self._to_experts_unordered(token_rows, h, async_op=async_op)

        def rows():
            src, index = finish()
            return src.index_select(0, index)
        return rows

    def _to_experts_unordered(self, token_rows, h: SortedRowsHandle, *, async_op=False):
        """The moves of ``_to_experts`` without its last gather: ``finish() -> (src,
        index)`` with expert row i at ``src[index[i]]``, for a consumer that gathers
        itself."""
        if h.self_dst is None:  # one rank: sorted order is expert order
            return lambda: (token_rows, h.self_tokens)
        # [received rows; own rows], then one gather into expert order.
        return self._move(token_rows, h.remote_tokens, h.self_tokens, h.send_splits,
                          h.recv_splits, h.num_rows, h.expert_src, async_op)

    def _to_home(self, expert_rows, h: SortedRowsHandle, *, async_op=False):
        """Expert rows ``(N, D)`` back home; returns ``finish() -> (src, order)`` where
        ``src[order]`` are the home rank's rows in (token, k) order, ``(T*k, D)``."""
        if h.self_dst is None:
            return lambda: (expert_rows, h.plan.inv_perm)
        # [remote rows as they return; own rows]: one later gather puts them in (t, k) order.
        return self._move(expert_rows, h.recv_dst, h.self_dst, h.recv_splits, h.send_splits,
                          h.home_order.numel(), h.home_order, async_op)

    def _move(self, rows, send_index, own_index, send_splits, recv_splits, num_rows, order,
              async_op):
        """Either direction's move: ``rows[send_index]`` go out, what arrives fills the
        front of a ``num_rows`` buffer and ``rows[own_index]`` its tail (copied while the
        remote rows are in flight); ``finish() -> (buffer, order)``."""
        n_in = sum(recv_splits)
        buf = rows.new_empty((num_rows, *rows.shape[1:]))
        _, work = self._exchange(rows.index_select(0, send_index), send_splits, recv_splits,
                                 async_op=async_op, out=buf[:n_in])
        torch.index_select(rows, 0, own_index, out=buf[n_in:])

        def finish():
            if work is not None:
                work.wait()
            return buf, order
        return finish

    def _move_packed(self, rows, weights, index, w_index, send_splits, recv_splits, num_rows,
                     order, async_op):
        """``_move`` of rows together with one weight per row, in one collective instead of
        two (``pack_rows``). ``index`` / ``w_index``: ``(send, own)`` row / weight
        positions. ``finish() -> (row part, a row-strided view; weights (num_rows,);
        order)``."""
        w = weights.reshape(-1, 1)
        n_in = sum(recv_splits)
        buf = new_packed(rows, num_rows, 1)
        send = pack_rows(rows, index[0], w, w_index[0], new_packed(rows, index[0].numel(), 1))
        _, work = self._exchange(send, send_splits, recv_splits, async_op=async_op,
                                 out=buf[:n_in])
        pack_rows(rows, index[1], w, w_index[1], buf[n_in:])  # own rows, meanwhile

        def finish():
            if work is not None:
                work.wait()
            src, w_src = unpack_rows(buf, 1, weights.dtype)
            return src, w_src.reshape(-1), order
        return finish

    def _sum_home(self, src, order, plan) -> torch.Tensor:
        """Each token's k rows ``src[order]`` summed (float32 accumulation), with no atomics:
        the fused gather-sum kernel, or its pure twin (a gather and a reduction)."""
        impl = kernels.gather_sum_fwd if self.fused_combine else gather_sum_fwd
        return impl(src, order, plan.top_k)[0]

    # ---- dispatch: token rows -> expert rows -----------------------------------------------
    def dispatch_fwd(self, x, weights, handle: SortedRowsHandle, *, cached: bool = False):
        # The layout already is the handle: split sizes fix everything the dispatch needs.
        self.counters["cached_dispatch" if cached else "dispatch"] += 1
        if weights is not None and handle.self_dst is not None and packs_float32(x):
            # The routing weights ride in the rows' collective.
            flat = handle.flat
            src, w, order = self._move_packed(
                x, weights.reshape(-1), (handle.remote_tokens, handle.self_tokens),
                (flat.remote_tokens, flat.self_tokens), handle.send_splits,
                handle.recv_splits, handle.num_rows, handle.expert_src, True)()
            return kernels.gather_rows(src, order), w.index_select(0, order), handle
        finish_w = None
        if weights is not None:
            # (T, k) weights ride as (T*k, 1) "rows" indexed by flattened (token, k) row.
            finish_w = self._to_experts(weights.reshape(-1, 1), _flat_rows(handle),
                                        async_op=True)
        rows = self._to_experts(x, handle, async_op=True)()
        row_weights = None if finish_w is None else finish_w().reshape(-1)
        return rows, row_weights, handle

    def dispatch_bwd(self, handle: SortedRowsHandle, d_rows, d_row_weights, *,
                     async_op: bool = False):
        """Row gradients back home; dx sums each token's k rows, d_weights is (T, k)."""
        self.counters["dispatch_backward"] += 1
        plan = handle.plan
        if d_row_weights is not None and handle.self_dst is not None and packs_float32(d_rows):
            # The weight gradients ride in the row gradients' collective.
            idx = (handle.recv_dst, handle.self_dst)
            finish_packed = self._move_packed(
                d_rows, d_row_weights.reshape(-1), idx, idx, handle.recv_splits,
                handle.send_splits, handle.home_order.numel(), handle.home_order, async_op)

            def finish_together():
                src, w, order = finish_packed()
                d_w = w.index_select(0, order).reshape(plan.num_tokens, plan.top_k)
                return self._sum_home(src, order, plan), d_w
            pending = Pending(finish_together)
            return pending if async_op else pending.wait()
        finish_rows = self._to_home(d_rows, handle, async_op=async_op)
        finish_w = None
        if d_row_weights is not None:
            finish_w = self._to_home(d_row_weights.reshape(-1, 1), handle, async_op=async_op)

        def finish():
            dx = self._sum_home(*finish_rows(), plan)
            d_w = None
            if finish_w is not None:
                src, order = finish_w()
                d_w = src.index_select(0, order).reshape(plan.num_tokens, plan.top_k)
            return dx, d_w

        pending = Pending(finish)
        return pending if async_op else pending.wait()

    # ---- combine: expert rows -> token rows, summed over k ---------------------------------
    def combine_fwd(self, rows, handle: SortedRowsHandle):
        self.counters["combine"] += 1
        src, order = self._to_home(rows, handle, async_op=True)()
        return self._sum_home(src, order, handle.plan), handle

    # d_rows[i] = d_out[token of row i]: a cached dispatch of the output gradient.
    def combine_bwd(self, handle: SortedRowsHandle, d_out):
        self.counters["combine_backward"] += 1
        return self._to_experts(d_out, handle, async_op=True)()

    def combine_bwd_weighted_rows(self, handle: SortedRowsHandle, d_out, rows, row_weights, *,
                                  fused: bool):
        """As ``Exchange.combine_bwd_weighted_rows``, with the combine backward's last gather
        fused into the weighting's backward when ``fused``."""
        if not fused:
            return super().combine_bwd_weighted_rows(handle, d_out, rows, row_weights,
                                                     fused=False)
        self.counters["combine_backward"] += 1
        src, index = self._to_experts_unordered(d_out, handle, async_op=True)()
        return kernels.gather_row_weight_bwd(src, index, rows, row_weights)

    # ---- combine with the routing weights applied at home ----------------------------------
    def combine_weighted_fwd(self, rows, weights, handle: SortedRowsHandle):
        """``out[t] = sum_j w[t, j] * row(t, j)``; returns ``(out, src)``, ``src`` being the
        returned rows in home-buffer order (the backward's ``d_weights`` needs them)."""
        self.counters["combine"] += 1
        src, order = self._to_home(rows, handle, async_op=True)()
        impl = kernels.weighted_gather_sum_fwd if self.fused_combine else weighted_gather_sum_fwd
        return impl(src, order, weights.reshape(-1), handle.plan.top_k)[0], src

    def combine_weighted_bwd(self, handle: SortedRowsHandle, d_out, weights, src):
        """``(d_rows (N, H) in expert order, d_weights (T, k))``: each returning row's
        gradient is its token's output gradient times its weight, built in one pass at home
        and sent as a cached dispatch sends token rows."""
        self.counters["combine_backward"] += 1
        plan = handle.plan
        k = plan.top_k
        w = weights.reshape(-1)
        if handle.self_dst is None:  # one rank: home-buffer order is expert order
            d_rows, _, d_w = self._weighted_bwd(d_out, src, plan.perm, w, k)
            return d_rows, d_w.reshape(plan.num_tokens, k)
        flat = handle.flat
        pos_to_row = torch.cat([flat.remote_tokens, flat.self_tokens])
        n_recv = sum(handle.recv_splits)
        buf = src.new_empty((handle.num_rows, src.shape[1]))
        # The own rows' gradients land straight in the receive buffer's tail.
        send, _, d_w = self._weighted_bwd(d_out, src, pos_to_row, w, k,
                                          split=flat.remote_tokens.numel(),
                                          hi_out=buf[n_recv:])
        _, work = self._exchange(send, handle.send_splits, handle.recv_splits,
                                 async_op=True, out=buf[:n_recv])
        if work is not None:
            work.wait()
        return buf.index_select(0, handle.expert_src), d_w.reshape(plan.num_tokens, k)

    def _weighted_bwd(self, d_out, src, pos_to_row, w, k, *, split=None, hi_out=None):
        if self.fused_combine:
            return kernels.weighted_gather_sum_bwd(d_out, src, pos_to_row, w, k, split=split,
                                                   hi_out=hi_out)
        d_rows, d_w = weighted_gather_sum_bwd(d_out, src, pos_to_row, w, k)
        return (*split_rows(d_rows, split, hi_out), d_w)


def _flat_rows(h: SortedRowsHandle) -> SortedRowsHandle:
    """The handle's moves re-indexed for (T*k, ...) inputs with one row per (token, k)."""
    return h.flat


class LocalExchange(SortedRowsExchange):
    """One rank: rows stay where they are."""

    backend = "local"

    def __init__(self, *, num_experts: int, fused_combine: bool = False):
        super().__init__(num_experts=num_experts, ep_size=1, rank=0, group=None)
        self.fused_combine = fused_combine

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False, out=None):
        raise AssertionError("the local exchange moves nothing between ranks")

    def _layout_counts(self, plan):
        n = plan.perm.numel()
        offs = plan.offs
        return _make_handle(plan, send_splits=(0,), recv_splits=(0,), remote_tokens=None,
                            expert_src=None,
                            self_tokens=plan.token_of_sorted, self_flat=plan.perm,
                            self_dst=None, recv_dst=None, home_order=None, local_offs=offs,
                            num_rows=n)


def _make_handle(plan, *, self_tokens, self_flat, remote_tokens, remote_flat=None, **kw):
    flat = SortedRowsHandle(plan=plan, self_tokens=self_flat, remote_tokens=remote_flat,
                            flat=None, **kw)
    return SortedRowsHandle(plan=plan, self_tokens=self_tokens, remote_tokens=remote_tokens,
                            flat=flat, **kw)


class AllToAllExchange(AllToAllTransport, SortedRowsExchange):
    """One row per (token, expert) over ``all_to_all_single`` with split sizes."""

    def __init__(self, *, num_experts: int, group=None, fused_combine: bool = False):
        self.fused_combine = fused_combine
        ep, rank = self._group_size_and_rank(group)
        super().__init__(num_experts=num_experts, ep_size=ep, rank=rank, group=group)

    def _layout_counts(self, plan):
        ep, e_local, r = self.ep_size, self.num_local_experts, self.rank
        send_counts = plan.counts.reshape(ep, e_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        # One host sync for both split vectors: the row all-to-all needs them as ints.
        splits = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = list(splits[:ep]), list(splits[ep:])
        n = sum(recv_splits)
        dev = plan.perm.device
        # Home side: own slice [a, b) of the sorted rows stays; the rest is sent.
        a = sum(send_splits[:r])
        b = a + send_splits[r]
        sorted_pos = plan.inv_perm  # flattened (t, j) -> sorted position
        n_remote_home = plan.perm.numel() - (b - a)
        home_order = torch.where(sorted_pos < a, sorted_pos,
                                 torch.where(sorted_pos >= b, sorted_pos - (b - a),
                                             n_remote_home + sorted_pos - a))
        # Expert side: where each received row (and each own row) sits in expert order.
        dst_of_src = _inverse(_expert_major_order(recv_counts, n))
        sa = sum(recv_splits[:r])
        sb = sa + recv_splits[r]
        own_rows = send_splits[r]
        send_splits[r] = recv_splits[r] = 0
        n_recv = n - own_rows
        # Slices with host-known bounds, not boolean masks: a mask index would sync again.
        recv_dst = _without(dst_of_src, sa, sb)
        expert_src = torch.empty(n, dtype=torch.int64, device=dev)
        expert_src[recv_dst] = torch.arange(n_recv, device=dev)
        expert_src[dst_of_src[sa:sa + own_rows]] = n_recv + torch.arange(own_rows, device=dev)
        return _make_handle(
            plan, send_splits=tuple(send_splits), recv_splits=tuple(recv_splits),
            expert_src=expert_src,
            remote_tokens=_without(plan.token_of_sorted, a, b),
            remote_flat=_without(plan.perm, a, b),
            self_tokens=plan.token_of_sorted[a:b], self_flat=plan.perm[a:b],
            self_dst=dst_of_src[sa:sa + own_rows], recv_dst=recv_dst,
            home_order=home_order, local_offs=torch.cumsum(recv_counts.sum(0), 0).to(
                torch.int32), num_rows=n)

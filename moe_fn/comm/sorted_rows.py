"""Exchanges over expert-sorted (token, k) rows: ``local`` (one rank) and ``all_to_all``.

The home rank sorts its T*k rows by global expert (``RoutePlan.perm``); the rows for rank
d are then contiguous, so one ``all_to_all_single`` with split sizes moves them. A rank's
rows for its own experts never enter the collective: they are copied into place while the
remote rows are in flight. Towards the experts every row is copied straight to its
expert-major position (``local_offs``), the own ones on part of the GPU so that the
collective's kernel starts at once, the arriving ones when they arrive: one pass over each
row besides the sender's gather. Combine runs the moves backwards and sums each token's k
rows at home (``Summation.HOME``); where nothing keeps the returned rows for a backward (the
fused sums of the unweighted combine and of the dispatch's backward, and the weighted
combine without grad mode), the sum reads the own rows where the experts left them instead
of a copy.
"""

from __future__ import annotations

from typing import NamedTuple

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
    Exchange,
    Gathered,
    Pending,
    Summation,
    check_cached_tokens,
    check_combine_weights,
    joined,
    side_stream_after,
)
from .carveout import sm_count
from .collectives import gather_counts, group_and_size
from .packing import new_packed, pack_rows, unpack_rows, value_bytes


class HomeRows(NamedTuple):
    """Rows back at their home rank: ``rows[order]`` in (token, k) order, where positions
    from ``len(rows)`` on, given ``own``, are ``own[own_index[p - len(rows)]]`` (the rank's
    own rows read where the experts left them); ``weights (T*k,)`` in (token, k) order.
    Given ``values`` (the arrivals' weights, as bytes behind their rows) and ``own_values``
    (the own rows' weights, where they are), ``weights`` is filled by the sum over the rows
    (``SortedRowsExchange._sum_home``), which gathers them in the same pass."""

    rows: torch.Tensor
    order: torch.Tensor
    weights: torch.Tensor | None
    own: torch.Tensor | None = None
    own_index: torch.Tensor | None = None
    values: torch.Tensor | None = None
    own_values: torch.Tensor | None = None


class SortedRowsExchange(Exchange):
    """The moves shared by the local and all-to-all exchanges; ``_exchange`` is transport.

    ``fused_sums`` (``impl="fused"``) sums each token's k returning rows with the one-pass
    gather-sum kernels instead of their pure twins (a gather and a reduction).
    ``combine_on_side_stream``: where an asynchronous dispatch backward (the overlap) runs
    on CUDA (see ``dispatch_backward``).
    """

    summation = Summation.HOME
    combine_on_side_stream = True
    encodes_rows = True

    def __init__(self, *, fused_sums: bool, **kw):
        super().__init__(**kw)
        self.fused_sums = fused_sums

    def _exchange(self, send, send_splits, recv_splits, *, async_op=False, room=0):
        """Rows ``send`` sent by ``send_splits`` and received by ``recv_splits`` into a new
        buffer as wide, with ``room`` more rows behind them which the caller fills:
        ``(buffer, work)``, ``work`` None or what to wait on."""
        raise NotImplementedError

    def _layout_counts(self, plan: RoutePlan, stamp=None, agree=None):
        raise NotImplementedError

    def layout(self, plan: RoutePlan, *, stamp=None, agree=None) -> SortedRowsHandle:
        self.counters["layout"] += 1
        return self._layout_counts(plan, stamp, agree)

    # ---- the two moves ---------------------------------------------------------------------
    # Towards the experts (``_to_experts``) and home (``_to_home``). Both take optional
    # ``weights``, one value per moved row (routing weights, their gradients), which travel
    # packed behind the rows in the same collective (``pack_rows``) and come back in the
    # rows' order.
    def _to_experts(self, token_rows, h: SortedRowsHandle, weights=None, encode=None):
        """Token rows ``(T, D)`` -> ``(expert rows (N, D), their weights (N,) or None)``,
        given ``weights (T*k,)`` packed into the same collective: own rows copied straight
        to their expert-major places while the remote rows are in flight, the remote rows
        to theirs once arrived (no buffer of all rows gathered a second time)."""
        if h.self_dst is None:  # one rank: sorted order is expert order
            rows = (kernels.gather_rows(token_rows, h.self_tokens) if encode is None
                    else encode(token_rows, h.self_tokens))
            return rows, (None if weights is None
                          else weights.index_select(0, h.flat.self_tokens))
        if encode is not None:
            # Each token encoded once at home; its rows then move as they are.
            token_rows = encode(token_rows, None)
        w = None if weights is None else weights.reshape(-1, 1)
        send = _send_gather(token_rows, h.remote_tokens, w, h.flat.remote_tokens)
        buf, work = self._exchange(send, h.send_splits, h.recv_splits, async_op=True)
        # Allocated once the transfer is queued: from an idle GPU it starts sooner.
        out = token_rows.new_empty((h.num_rows, *token_rows.shape[1:]))
        # The weights ride in the rows' copies: each lands where its row does.
        w_out = None if weights is None else weights.new_empty((h.num_rows, 1))
        kernels.copy_rows(token_rows, h.self_tokens, out, h.self_dst,
                          num_programs=_beside_collective(out),
                          **({} if weights is None else
                             {"values": w, "values_index": h.flat.self_tokens,
                              "values_out": w_out}))
        if work is not None:
            work.wait()
        if weights is None:
            kernels.copy_rows(buf, None, out, h.recv_dst)
            return out, None
        kernels.copy_rows(buf[:, :token_rows.shape[1]], None, out, h.recv_dst,
                          values=value_bytes(buf, w), values_out=w_out)
        return out, w_out.reshape(-1)

    def _to_home(self, expert_rows, h: SortedRowsHandle, *, async_op=False, weights=None,
                 own_in_place=False):
        """Expert rows ``(N, D)`` back home; returns ``finish() -> HomeRows``, the home
        rank's rows in (token, k) order and (given ``weights (N,)``) their weights. With
        ``own_in_place`` (and more than one rank) the own rows are not copied: the sum
        reads them where they are (``kernels.gather_sum_own``)."""
        if h.self_dst is None:
            w = None if weights is None else weights.index_select(0, h.plan.inv_perm)
            return lambda: HomeRows(expert_rows, h.plan.inv_perm, w)
        # [remote rows as they return; own rows, copied while those are in flight, or read
        # in place]: one later gather puts them in (t, k) order.
        n_in = sum(h.send_splits)
        n_buf = n_in if own_in_place else h.home_order.numel()
        w = None if weights is None else weights.reshape(-1, 1)
        send = _send_gather(expert_rows, h.recv_dst, w, h.recv_dst)
        buf, work = self._exchange(send, h.recv_splits, h.send_splits, async_op=async_op,
                                   room=n_buf - n_in)
        own = (expert_rows, h.self_dst) if own_in_place else ()
        if not own_in_place and weights is None:
            torch.index_select(expert_rows, 0, h.self_dst, out=buf[n_in:])
        elif not own_in_place:
            pack_rows(expert_rows, h.self_dst, w, h.self_dst, buf[n_in:])

        def finish():
            if work is not None:
                work.wait()
            if weights is None:
                return HomeRows(buf, h.home_order, None, *own)
            if own_in_place:
                # The sum gathers each entry's weight where it gathers its row: the
                # arrivals' from the bytes behind them, the own rows' where they are.
                return HomeRows(buf[:, :expert_rows.shape[1]], h.home_order,
                                weights.new_empty(h.home_order.numel()), *own,
                                values=value_bytes(buf, w), own_values=w)
            src, w_src = unpack_rows(buf, w, h.home_order)
            return HomeRows(src, h.home_order, w_src.reshape(-1))
        return finish

    def _sum_home(self, home: HomeRows, plan, weights=None) -> torch.Tensor:
        """Each token's k rows summed, weighted by ``weights (T*k,)`` when given (float32
        accumulation), with no atomics: the fused gather-sum kernel, or its pure twin (a
        gather and a reduction)."""
        k = plan.top_k
        if home.own is not None:
            return kernels.gather_sum_own(
                home.rows, home.order, k, weights, own=home.own, own_index=home.own_index,
                values=home.values, own_values=home.own_values,
                values_out=None if home.values is None else home.weights.view(-1, 1))
        if weights is None:
            impl = kernels.gather_sum_fwd if self.fused_sums else gather_sum_fwd
            return impl(home.rows, home.order, k)[0]
        impl = kernels.weighted_gather_sum_fwd if self.fused_sums else weighted_gather_sum_fwd
        return impl(home.rows, home.order, weights, k)[0]

    # ---- dispatch: token rows -> expert rows -----------------------------------------------
    def dispatch(self, x, weights, handle: SortedRowsHandle, *, cached: bool = False,
                 encode=None):
        if cached:
            check_cached_tokens(x, handle)
        # The layout already is the handle: split sizes fix everything the dispatch needs.
        self.counters["cached_dispatch" if cached else "dispatch"] += 1
        rows, row_weights = self._to_experts(x, handle,
                                             None if weights is None else weights.reshape(-1),
                                             encode)
        return rows, row_weights, handle

    def dispatch_backward(self, handle: SortedRowsHandle, d_rows, d_row_weights, *,
                          async_op: bool = False) -> Pending:
        """Row gradients back home; dx sums each token's k rows, d_weights is (T, k).

        With ``async_op`` on CUDA and ``combine_on_side_stream`` the whole move (gathers,
        transfer, per-token sums) runs on a side stream, so only the SMs the caller leaves
        free (the GEMMs' carveout) serve it. Otherwise the gathers before the transfer run
        at once on the caller's stream with the whole GPU, the transfer asynchronously
        (NCCL's own stream) beside what the caller runs next, and the sums after it in
        ``wait()``."""
        if async_op and d_rows.is_cuda and self.combine_on_side_stream:
            main, side = side_stream_after(self.resources_on(d_rows.device), d_rows,
                                           d_row_weights)
            with torch.cuda.stream(side):
                dx, d_w = self._home_sums(handle, d_rows, d_row_weights, async_op=False).wait()
            return joined(main, side, dx, d_w)
        return self._home_sums(handle, d_rows, d_row_weights, async_op=async_op)

    def _home_sums(self, handle, d_rows, d_row_weights, *, async_op):
        self.counters["dispatch_backward"] += 1
        plan = handle.plan
        # The row gradients are not kept: the sum may read the own ones in place.
        finish_home = self._to_home(d_rows, handle, async_op=async_op, weights=d_row_weights,
                                    own_in_place=self.fused_sums)

        def finish():
            home = finish_home()
            d_w = home.weights
            if d_w is not None:
                d_w = d_w.reshape(plan.num_tokens, plan.top_k)
            return self._sum_home(home, plan), d_w

        pending = Pending(finish)
        if not async_op:
            pending.wait()
        return pending

    # ---- combine: expert rows -> token rows, summed over k at home -------------------------
    def combine(self, rows, handle: SortedRowsHandle, *, weights=None, keep: bool = True):
        """``out[t] = sum_j row(t, j)``, or with ``weights (T, k)`` ``sum_j w[t, j] *
        row(t, j)`` (float32 accumulation): ``(out, saved)``. Unweighted, the backward needs
        no rows (a cached dispatch) and the sum reads own rows in place. Weighted, ``saved``
        is the returned rows in home-buffer order, which the backward's ``d_weights`` needs;
        with ``keep=False`` (no backward will run) it is None and the fused sum reads the
        own rows in place: buffering them costs a copy, reading them in place would make a
        backward keep all of ``rows``."""
        self.counters["combine"] += 1
        if weights is None:
            home = self._to_home(rows, handle, async_op=True, own_in_place=self.fused_sums)()
            return self._sum_home(home, handle.plan), None
        check_combine_weights(self, weights, rows, handle)
        home = self._to_home(rows, handle, async_op=True,
                             own_in_place=self.fused_sums and not keep)()
        out = self._sum_home(home, handle.plan, weights.reshape(-1))
        return out, (home.rows if keep else None)

    def combine_backward(self, handle: SortedRowsHandle, d_out, *, weights=None, saved=None):
        """Unweighted: ``d_rows[i] = d_out[token of row i]``, a cached dispatch of the output
        gradient. Weighted: ``(d_rows (N, H) in expert order, d_weights (T, k))``, each
        returning row's gradient its token's output gradient times its weight, built in one
        pass at home and sent as a cached dispatch sends token rows."""
        self.counters["combine_backward"] += 1
        if weights is None:
            return self._to_experts(d_out, handle)[0], None
        if saved is None:
            raise RuntimeError("the weighted combine's backward needs the rows its forward "
                               "kept (combine(..., keep=True))")
        src = saved
        plan = handle.plan
        k = plan.top_k
        w = weights.reshape(-1)
        if handle.self_dst is None:  # one rank: home-buffer order is expert order
            d_rows, _, d_w = self._weighted_bwd(d_out, src, plan.perm, w, k)
            return d_rows, d_w.reshape(plan.num_tokens, k)
        flat = handle.flat
        pos_to_row = torch.cat([flat.remote_tokens, flat.self_tokens])
        d_rows = src.new_empty((handle.num_rows, src.shape[1]))
        split = flat.remote_tokens.numel()
        # One pass: the remote rows' gradients into the rows to send, the own rows' straight
        # at their expert-major places.
        send = src.new_empty((split, src.shape[1]))
        d_w = self._weighted_bwd(d_out, src, pos_to_row, w, k, split=split, hi_out=d_rows,
                                 hi_index=handle.self_dst, lo_out=send)[2]
        buf, work = self._exchange(send, handle.send_splits, handle.recv_splits,
                                   async_op=True)
        if work is not None:
            work.wait()
        kernels.copy_rows(buf, None, d_rows, handle.recv_dst)
        return d_rows, d_w.reshape(plan.num_tokens, k)

    def combine_backward_gathered(self, handle: SortedRowsHandle, d_out) -> Gathered:
        """The unweighted combine's backward up to its last gather: the arrivals as they
        landed and the own rows' gradients read from ``d_out`` where they are (nothing is
        copied), indexed by ``expert_src``."""
        self.counters["combine_backward"] += 1
        h = handle
        if h.self_dst is None:  # one rank: sorted order is expert order
            return Gathered(d_out, h.self_tokens)
        buf, work = self._exchange(_send_gather(d_out, h.remote_tokens), h.send_splits,
                                   h.recv_splits, async_op=True)
        if work is not None:
            work.wait()
        return Gathered(buf, h.expert_src, own=d_out, own_index=h.self_tokens)

    def _weighted_bwd(self, d_out, src, pos_to_row, w, k, *, split=None, hi_out=None,
                      hi_index=None, lo_out=None):
        if self.fused_sums:
            return kernels.weighted_gather_sum_bwd(d_out, src, pos_to_row, w, k, split=split,
                                                   hi_out=hi_out, hi_index=hi_index,
                                                   lo_out=lo_out)
        d_rows, d_w = weighted_gather_sum_bwd(d_out, src, pos_to_row, w, k)
        return (*split_rows(d_rows, split, hi_out, hi_index, lo_out), d_w)


def _send_gather(rows, index, values=None, values_index=None) -> torch.Tensor:
    """``rows[index]``, packed with ``values[values_index]`` when given: the rows to send."""
    if values is None:
        return torch.index_select(rows, 0, index)
    return pack_rows(rows, index, values, values_index,
                     new_packed(rows, index.numel(), values))


def _beside_collective(t: torch.Tensor) -> int | None:
    """Programs for a copy queued beside a collective: half the GPU's SMs, so that the
    collective's kernel finds free SMs when it starts (over every SM the dispatch took ~3%
    longer, over 16 programs the copy outlasted the transfer; bench/RESULTS.md). None (no
    cap) off CUDA."""
    return sm_count(t.device) // 2 if t.is_cuda else None


class LocalExchange(SortedRowsExchange):
    """One rank: rows stay where they are."""

    backend = "local"

    def __init__(self, *, num_experts: int, resources, fused_sums: bool = True):
        super().__init__(num_experts=num_experts, ep_size=1, rank=0, group=None,
                         resources=resources, fused_sums=fused_sums)

    def _exchange(self, send, send_splits, recv_splits, *, async_op=False, room=0):
        raise AssertionError("the local exchange moves nothing between ranks")

    def _layout_counts(self, plan, stamp=None, agree=None):
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


class AllToAllExchange(SortedRowsExchange):
    """One row per (token, expert) over ``all_to_all_single`` with split sizes (NCCL on GPUs,
    gloo on CPUs; across hosts)."""

    backend = "all_to_all"

    def __init__(self, *, num_experts: int, resources, group=None, fused_sums: bool = True):
        group, ep, rank = group_and_size(group, self.backend)
        super().__init__(num_experts=num_experts, ep_size=ep, rank=rank, group=group,
                         resources=resources, fused_sums=fused_sums)

    def _exchange(self, send, send_splits, recv_splits, *, async_op=False, room=0):
        n = sum(recv_splits)
        send = send.contiguous()
        buf = send.new_empty((n + room, *send.shape[1:]))
        work = dist.all_to_all_single(buf[:n], send, list(recv_splits), list(send_splits),
                                      group=self.group, async_op=async_op)
        return buf, work

    def _layout_counts(self, plan, stamp=None, agree=None):
        ep, r = self.ep_size, self.rank
        # Before the one host sync: every rank's counts (one small collective) and, from
        # them, the sizes, this rank's send order and its home-buffer order, in two launches
        # on CUDA. After the sync the GPU waits for the host, so the index math there is one
        # launch (as torch ops it was ~0.85 ms of host time on the H200 hosts).
        c = gather_counts(plan, ep, self.group, stamp)
        if stamp is not None:
            c, stamps = c
        home = kernels.rows_home_side(c, plan.offs, plan.counts, plan.perm,
                                      plan.token_of_sorted, r, plan.top_k)
        sizes = home.sizes[:2 * ep].tolist()
        if agree is not None:
            agree(stamps.tolist())  # the GPU is synced already: a read, not another wait
        recv_splits, send_splits = sizes[:ep], sizes[ep:2 * ep]
        own = send_splits[r]
        recv_start = sum(recv_splits[:r])
        n = sum(recv_splits)
        n_send = plan.perm.numel() - own
        n_recv = n - own
        send_splits[r] = recv_splits[r] = 0
        expert_src, dst = kernels.rows_receiver_side(c, n, r, recv_start, own, home.tables)
        return _make_handle(
            plan, send_splits=tuple(send_splits), recv_splits=tuple(recv_splits),
            expert_src=expert_src,
            remote_tokens=home.buffer_tokens[:n_send], remote_flat=home.buffer_flat[:n_send],
            self_tokens=home.buffer_tokens[n_send:], self_flat=home.buffer_flat[n_send:],
            self_dst=dst[n_recv:], recv_dst=dst[:n_recv], home_order=home.home_order,
            local_offs=home.local_offs, num_rows=n)

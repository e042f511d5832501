"""Exchanges over expert-sorted (token, k) rows: ``local`` (one rank) and ``all_to_all``.

The home rank sorts its T*k rows by global expert (``RoutePlan.perm``); the rows for rank
d are then contiguous, so one ``all_to_all_single`` with split sizes moves them. The
receiver regroups them from (source rank, expert) order to expert order. Combine runs the
same moves backwards and sums each token's k rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..records import RoutePlan, SortedRowsHandle
from .base import Exchange, Pending


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, index)


def _sum_over_k(sorted_rows: torch.Tensor, plan) -> torch.Tensor:
    """out[t] = sum_j sorted_rows[inv_perm[t*k + j]]: each token's k expert-sorted rows.

    A gather and a sum over k (accumulated in float32 for half types): no atomics, so the
    result is the same on every run and device."""
    t, k, h = plan.num_tokens, plan.top_k, sorted_rows.shape[-1]
    tk = _gather_rows(sorted_rows, plan.inv_perm).reshape(t, k, h)
    acc = torch.float64 if tk.dtype == torch.float64 else torch.float32
    return tk.sum(dim=1, dtype=acc).to(sorted_rows.dtype)


def _expert_major_order(recv_counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Index that turns rows received in (source, expert) order into (expert, source) order.

    ``recv_counts``: (ep, E_local) rows from each source for each local expert.
    """
    ep, e_local = recv_counts.shape
    dev = recv_counts.device
    src_start = (torch.cumsum(recv_counts.flatten(), 0) - recv_counts.flatten())
    by_expert = recv_counts.t().flatten()  # block (e, s) in expert-major order
    dst_start = torch.cumsum(by_expert, 0) - by_expert
    block = torch.repeat_interleave(torch.arange(ep * e_local, device=dev), by_expert,
                                    output_size=num_rows)
    e, s = block // ep, block % ep
    within = torch.arange(num_rows, device=dev) - dst_start[block]
    return src_start[s * e_local + e] + within


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


class SortedRowsExchange(Exchange):
    """Shared moves of the local and all-to-all exchanges; ``_exchange`` is the transport."""

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False):
        raise NotImplementedError

    def _layout_counts(self, plan: RoutePlan):
        raise NotImplementedError

    def layout(self, plan: RoutePlan) -> SortedRowsHandle:
        self.counters["layout"] += 1
        return self._layout_counts(plan)

    # ---- dispatch: token rows -> expert rows ----------------------------------------------
    def _to_experts(self, sorted_rows, handle, *, async_op=False):
        recv, work = self._exchange(sorted_rows, handle.send_splits, handle.recv_splits,
                                    async_op=async_op)

        def finish():
            return recv if handle.local_order is None else _gather_rows(recv, handle.local_order)
        return finish, work

    def _to_home(self, expert_rows, handle, *, async_op=False):
        src_major = (expert_rows if handle.local_inv is None
                     else _gather_rows(expert_rows, handle.local_inv))
        return self._exchange(src_major, handle.recv_splits, handle.send_splits,
                              async_op=async_op)

    def dispatch_fwd(self, x, weights, handle: SortedRowsHandle, *, cached: bool = False):
        # The layout already is the handle: split sizes fix everything the dispatch needs.
        plan = handle.plan
        self.counters["cached_dispatch" if cached else "dispatch"] += 1
        finish_rows, _ = self._to_experts(_gather_rows(x, plan.token_of_sorted), handle)
        rows = finish_rows()
        row_weights = None
        if weights is not None:
            finish_w, _ = self._to_experts(weights.reshape(-1, 1)[plan.perm], handle)
            row_weights = finish_w().reshape(-1)
        return rows, row_weights, handle

    def dispatch_bwd(self, handle: SortedRowsHandle, d_rows, d_row_weights, *,
                     async_op: bool = False):
        """Row gradients back home; dx sums each token's k rows, d_weights is (T, k)."""
        self.counters["dispatch_backward"] += 1
        plan = handle.plan
        home, work = self._to_home(d_rows, handle, async_op=async_op)
        home_w = work_w = None
        if d_row_weights is not None:
            home_w, work_w = self._to_home(d_row_weights.reshape(-1, 1), handle,
                                           async_op=async_op)

        def finish():
            for w in (work, work_w):
                if w is not None:
                    w.wait()
            dx = _sum_over_k(home, plan)
            d_w = None
            if home_w is not None:
                d_w = home_w.reshape(-1)[plan.inv_perm].reshape(plan.num_tokens, plan.top_k)
            return dx, d_w

        pending = Pending(finish)
        return pending if async_op else pending.wait()

    # ---- combine: expert rows -> token rows, summed over k ---------------------------------
    def combine_fwd(self, rows, handle: SortedRowsHandle):
        self.counters["combine"] += 1
        plan = handle.plan
        home, _ = self._to_home(rows, handle)
        return _sum_over_k(home, plan), handle

    # d_rows[i] = d_out[token of row i]: a cached dispatch of the output gradient.
    def combine_bwd(self, handle: SortedRowsHandle, d_out):
        self.counters["combine_backward"] += 1
        finish, _ = self._to_experts(_gather_rows(d_out, handle.plan.token_of_sorted), handle)
        return finish()


class LocalExchange(SortedRowsExchange):
    """One rank: rows stay where they are."""

    backend = "local"

    def __init__(self, *, num_experts: int):
        super().__init__(num_experts=num_experts, ep_size=1, rank=0, group=None)

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False):
        return rows, None

    def _layout_counts(self, plan):
        n = plan.perm.numel()
        offs = torch.cumsum(plan.counts, 0).to(torch.int32)
        return SortedRowsHandle(plan=plan, send_splits=(n,), recv_splits=(n,), local_order=None,
                                local_inv=None, local_offs=offs, num_rows=n)


class AllToAllExchange(SortedRowsExchange):
    """``torch.distributed.all_to_all_single`` with split sizes (NCCL on GPUs, gloo on CPUs)."""

    backend = "all_to_all"

    def __init__(self, *, num_experts: int, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("comm_backend='all_to_all' needs torch.distributed initialised "
                               "(dist.init_process_group) before the layer is built")
        ep = dist.get_world_size(group)
        super().__init__(num_experts=num_experts, ep_size=ep, rank=dist.get_rank(group),
                         group=group)

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False):
        rows = rows.contiguous()
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        work = dist.all_to_all_single(out, rows, list(recv_splits), list(send_splits),
                                      group=self.group, async_op=async_op)
        return out, work

    def _layout_counts(self, plan):
        ep, e_local = self.ep_size, self.num_local_experts
        send_counts = plan.counts.reshape(ep, e_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        # One host sync for both split vectors: the row all-to-all needs them as ints.
        splits = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = tuple(splits[:ep]), tuple(splits[ep:])
        n = sum(recv_splits)
        order = _expert_major_order(recv_counts, n)
        offs = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)
        return SortedRowsHandle(plan=plan, send_splits=send_splits, recv_splits=recv_splits,
                                local_order=order, local_inv=_inverse(order), local_offs=offs,
                                num_rows=n)

"""The token-once ``all_to_all`` exchange (``all_to_all_dedup=True``).

Each token crosses to a rank once, however many of its k experts that rank owns, as
DeepEP does, instead of once per (token, expert) row: at EP2 with top-8 of 128 experts
that is about a quarter of the bytes. The receiver expands tokens into expert rows; the
combine sums each received token's rows on the expert side before sending one partial
per (token, rank) home, where the partials are summed. Routing weights therefore act on
the expert side. Transport: ``torch.distributed.all_to_all_single`` (gloo or NCCL).
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from .. import kernels
from ..records import RoutePlan, TokenExchangeHandle
from .base import (
    AllToAllTransport,
    Pending,
    check_cached_tokens,
    expand_received,
    new_packed,
    pack_rows,
    unpack_rows,
)
from .tokens import TokenRowsExchange


class TokenAllToAllExchange(AllToAllTransport, TokenRowsExchange):
    def __init__(self, *, num_experts: int, group=None):
        ep, rank = self._group_size_and_rank(group)
        super().__init__(num_experts=num_experts, ep_size=ep, rank=rank, group=group)

    # ---- layout: one counts exchange, one host sync, the received tokens' expert ids ------
    def layout(self, plan: RoutePlan) -> TokenExchangeHandle:
        self.counters["layout"] += 1
        ep, e_local = self.ep_size, self.num_local_experts
        idx = plan.topk_idx
        t = idx.shape[0]
        dev = idx.device
        dest = torch.div(idx, e_local, rounding_mode="floor")
        in_rank = torch.zeros(t, ep, dtype=torch.bool, device=dev).scatter_(1, dest, True)
        # Per destination: tokens sent, then rows for each of its experts.
        counts = torch.cat([in_rank.sum(0)[:, None], plan.counts.reshape(ep, e_local)], 1)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        # The one host sync: split sizes and the row total are needed as ints.
        host = torch.cat([counts[:, 0], recv_counts[:, 0], recv_counts[:, 1:].sum()[None]])
        host = host.tolist()
        send_splits, recv_splits, num_rows = host[:ep], host[ep:2 * ep], host[2 * ep]
        n_send = sum(send_splits)
        # Sent positions, grouped by rank, tokens ascending within a rank (a stable sort
        # of the (rank, token) flags, True first, bounded by the host-known count).
        flags = in_rank.t().reshape(-1)
        order = torch.sort((~flags).to(torch.int8), stable=True)[1][:n_send]
        pos = torch.full((ep * t,), -1, dtype=torch.int64, device=dev)
        pos[order] = torch.arange(n_send, device=dev)
        home_table = pos.reshape(ep, t).t().contiguous()
        send_tokens = order % t if t else order
        # The receivers learn which of their experts each received token chose.
        recv_idx, _ = self._exchange(idx.index_select(0, send_tokens), send_splits,
                                     recv_splits)
        local = recv_idx - self.rank * e_local
        local = torch.where((local >= 0) & (local < e_local), local, -1)
        token_of_row, slot_of_row, row_of_slot = expand_received(local, e_local, num_rows)
        local_counts = recv_counts[:, 1:].sum(0)
        return TokenExchangeHandle(
            plan=plan, send_tokens=send_tokens, send_splits=tuple(send_splits),
            recv_splits=tuple(recv_splits), home_table=home_table,
            owner_pos=home_table.gather(1, dest), token_of_row=token_of_row,
            slot_of_row=slot_of_row, row_of_slot=row_of_slot,
            local_offs=torch.cumsum(local_counts, 0).to(torch.int32), num_rows=num_rows,
            num_recv_tokens=sum(recv_splits))

    # Both transports take optional per-row ``values`` ((rows, C): routing weights, their
    # gradients), which travel packed behind the rows in the same collective.
    def _to_receivers(self, token_rows, h: TokenExchangeHandle, *, values=None,
                      async_op=False):
        """Home tokens to the ranks that own their experts: ``finish() -> (received rows,
        received values or None)``."""
        st = h.send_tokens
        send = (token_rows.index_select(0, st) if values is None else
                pack_rows(token_rows, st, values, st, new_packed(token_rows, st.numel(), values)))
        out, work = self._exchange(send, h.send_splits, h.recv_splits, async_op=async_op)
        return self._finish(out, work, values)

    def _to_home(self, partials, h: TokenExchangeHandle, *, values=None, async_op=False):
        """Per received-token partials (packed with ``values`` when given) back home:
        ``finish() -> (partials summed per home token over ranks, returned values)``."""
        back, work = self._exchange(partials, h.recv_splits, h.send_splits, async_op=async_op)
        finish_back = self._finish(back, work, values)

        def finish():
            rows, back_values = finish_back()
            return kernels.masked_gather_sum(rows, h.home_table), back_values
        return finish

    @staticmethod
    def _finish(out, work, values):
        def finish():
            if work is not None:
                work.wait()
            return (out, None) if values is None else unpack_rows(out, values)
        return finish

    # ---- dispatch -----------------------------------------------------------------------
    def dispatch_fwd(self, x, weights, handle: TokenExchangeHandle, *, cached: bool = False):
        if cached:
            check_cached_tokens(x, handle)
        self.counters["cached_dispatch" if cached else "dispatch"] += 1
        # A replayed route's weights have the values the first dispatch delivered (as with
        # DeepEP's cached dispatch): only the tokens travel again.
        reuse_w = cached and weights is not None and handle.row_weights is not None
        send_w = None if weights is None or reuse_w else weights.detach()
        recv, recv_w = self._to_receivers(x, handle, values=send_w)()
        if recv.shape[0] != handle.num_recv_tokens:
            raise RuntimeError(f"received {recv.shape[0]} tokens but the handle expects "
                               f"{handle.num_recv_tokens}")
        rows = kernels.gather_rows(recv, handle.token_of_row)
        row_w = None
        if reuse_w:
            row_w = handle.row_weights.clone()  # a new output tensor for this autograd node
        elif recv_w is not None:
            row_w = recv_w[handle.token_of_row, handle.slot_of_row]
            handle = attrs.evolve(handle, row_weights=row_w.detach())
        return rows, row_w, handle

    def dispatch_bwd(self, handle: TokenExchangeHandle, d_rows, d_row_weights, *,
                     async_op: bool = False):
        """Row gradients summed per received token, sent home, summed over ranks; the
        routing-weight gradients ride along as a (received token, k) table."""
        self.counters["dispatch_backward"] += 1
        table = handle.row_of_slot
        d_recv_w = None
        if d_row_weights is None:
            partials = kernels.masked_gather_sum(d_rows, table)
        else:
            d_recv_w = self._per_slot(d_row_weights, table)
            partials = new_packed(d_rows, table.shape[0], d_recv_w)
            kernels.masked_gather_sum(d_rows, table, out=partials[:, :d_rows.shape[1]])
            pack_rows(None, None, d_recv_w, None, partials)
        finish_home = self._to_home(partials, handle, values=d_recv_w, async_op=async_op)

        def finish():
            dx, back_w = finish_home()
            return dx, (None if back_w is None else self._home_weight_grads(handle, back_w))

        pending = Pending(finish)
        return pending if async_op else pending.wait()

    @staticmethod
    def _home_weight_grads(handle: TokenExchangeHandle, back_w):
        """(T, k) weight gradients: each (token, j) comes back from the rank owning expert j."""
        plan = handle.plan
        if plan.num_tokens == 0:
            return back_w.new_zeros((0, plan.top_k))
        return back_w[handle.owner_pos, torch.arange(plan.top_k, device=back_w.device)]

    # ---- the combine's transports (the combine itself: TokenRowsExchange) ----------------
    def _partials_home(self, partials, handle: TokenExchangeHandle):
        return self._to_home(partials, handle, async_op=True)()[0]

    def _tokens_to_experts(self, d_out, handle: TokenExchangeHandle):
        return self._to_receivers(d_out, handle, async_op=True)()[0]

"""The row-by-row ``all_to_all`` exchange over peer memory (``all_to_all_transport=
"symm_mem"``): every move is one pull that reads each row from the rank holding it and
writes it where it belongs.

Over ``all_to_all_single`` a move costs three passes over the rows (the sender's gather
into destination order, the collective's copies, the receiver's gather into expert
order). Here the sender only publishes what it has (``expose``: its token rows, or its
expert rows, as they are) and the receiver pulls (``moe_fn.comm.peer_memory``): the
dispatch writes expert-major rows directly, the combine sums each token's k rows as it
reads them. The layout gathers every rank's per-expert counts (one small collective and
one host sync, as the all_to_all's layout exchanges its counts) and sends each rank the
flattened (token, k) indices of the rows it will pull, in one small all_to_all of ints.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import kernels
from ..pure.row_weight import RowWeightRes
from ..records import PeerRowsHandle, RoutePlan
from .base import AllToAllTransport, Exchange, Pending
from .peer_memory import peer_memory, pull_gather_sum, pull_rows

# torch 2.13 renamed all_gather_into_tensor (and deprecates the old name); 2.11 lacks it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class PeerRowsExchange(AllToAllTransport, Exchange):
    """One row per (token, expert), moved by pulls from peer memory (see the module)."""

    home_weighting = True
    # Moves of token rows to the experts read each token once per rank, however many of
    # its rows this rank computes (False: once per row, the plain pull; benchmarks compare).
    read_tokens_once = True

    def __init__(self, *, num_experts: int, group=None, num_sms: int | None = None):
        ep, rank = self._group_size_and_rank(group)
        super().__init__(num_experts=num_experts, ep_size=ep, rank=rank, group=group)
        self.num_sms = num_sms
        # Programs of the pull kernels (None: their defaults, the whole GPU); the
        # overlapped backward combine runs on ``num_sms`` (``start_dispatch_bwd``).
        self.num_programs: int | None = None
        self._memory = {}

    def _expose(self, rows, values, max_rows: int, max_values: int, index=None):
        ref = rows if rows is not None else values
        mem = self._memory.get(ref.device)
        if mem is None:
            mem = self._memory[ref.device] = peer_memory(self.group, ref.device)
        return mem.expose(rows, values, max_rows, max_values, index)

    # ---- layout ------------------------------------------------------------------------
    def layout(self, plan: RoutePlan) -> PeerRowsHandle:
        self.counters["layout"] += 1
        ep, me, k = self.ep_size, self.rank, plan.top_k
        c = plan.counts.new_empty(ep * self.num_experts)
        _all_gather(c, plan.counts.contiguous(), group=self.group)
        c = c.view(ep, -1)  # (ep, E): rows each rank sends to each expert
        home = kernels.peer_home_side(c, plan.offs, plan.counts, plan.topk_idx, plan.inv_perm,
                                      me, k)
        # One host sync: the index exchange's split sizes and the exposed sizes.
        sizes = home.sizes.tolist()
        recv_splits, send_splits = sizes[:ep], sizes[ep:2 * ep]
        max_tokens, max_rows, max_remote_rows = sizes[2 * ep:]
        n = sum(recv_splits)
        # Each received row's flattened (token, k) index at its source, in (source, expert)
        # order: the sources' sorted rows for this rank's experts, as an all_to_all of ints.
        recv_flat = plan.perm.new_empty(n)
        dist.all_to_all_single(recv_flat, plan.perm, recv_splits, send_splits,
                               group=self.group)
        rec = kernels.peer_receiver_side(c, recv_flat, me, k, max_tokens, n - recv_splits[me],
                                         home.tables)
        return PeerRowsHandle(
            plan=plan, src_rank=rec.src_rank, src_flat=rec.src_flat,
            token_slots=rec.token_slots, remote_rows=rec.remote_rows, home_rank=home.home_rank,
            home_pos=home.home_pos, home_cpos=home.home_cpos, local_offs=home.local_offs,
            num_rows=n, max_tokens=max_tokens, max_rows=max_rows,
            max_remote_rows=max_remote_rows)

    # ---- token rows -> expert rows -------------------------------------------------------
    def _to_experts(self, token_rows, values, h: PeerRowsHandle):
        k = h.plan.top_k
        view = self._expose(token_rows, values, h.max_tokens, h.max_tokens * k)
        return pull_rows(view, h.src_rank, h.src_flat, row_div=k,
                         rows=token_rows is not None, num_programs=self.num_programs,
                         token_slots=h.token_slots if self.read_tokens_once else None)

    # ---- expert rows -> home, summed over k ----------------------------------------------
    def _to_home(self, rows, values, h: PeerRowsHandle, weights=None):
        # Only rows other ranks need are exposed; this rank's own are read in place.
        view = self._expose(rows, values, h.max_remote_rows, h.max_rows, index=h.remote_rows)
        return pull_gather_sum(view, h.home_rank, h.home_cpos, h.plan.top_k, weights,
                               local=rows, values_pos=h.home_pos,
                               num_programs=self.num_programs)

    def dispatch_fwd(self, x, weights, handle: PeerRowsHandle, *, cached: bool = False):
        self.counters["cached_dispatch" if cached else "dispatch"] += 1
        rows, row_w = self._to_experts(x, None if weights is None else weights.reshape(-1),
                                       handle)
        return rows, row_w, handle

    def dispatch_bwd(self, handle: PeerRowsHandle, d_rows, d_row_weights, *,
                     async_op: bool = False):
        self.counters["dispatch_backward"] += 1
        dx, d_w = self._to_home(d_rows, d_row_weights, handle)
        if d_w is not None:
            d_w = d_w.reshape(handle.plan.num_tokens, handle.plan.top_k)
        # The pulls are queued on the stream already: nothing is left to wait for.
        return Pending(lambda: (dx, d_w)) if async_op else (dx, d_w)

    def start_dispatch_bwd(self, handle, d_rows, d_row_weights) -> Pending:
        """As ``Exchange.start_dispatch_bwd``, with the pulls on ``num_sms`` programs: the
        SMs the weight-gradient GEMMs leave free."""
        saved, self.num_programs = self.num_programs, self.num_sms
        try:
            return super().start_dispatch_bwd(handle, d_rows, d_row_weights)
        finally:
            self.num_programs = saved

    def combine_fwd(self, rows, handle: PeerRowsHandle):
        self.counters["combine"] += 1
        return self._to_home(rows, None, handle)[0], handle

    def combine_bwd(self, handle: PeerRowsHandle, d_out):
        self.counters["combine_backward"] += 1
        return self._to_experts(d_out, None, handle)[0]

    def combine_weighted_fwd(self, rows, weights, handle: PeerRowsHandle):
        """``out[t] = sum_j w[t, j] * row(t, j)``, weighted as it is pulled home; returns
        ``(out, rows)``: the backward computes each row's weight gradient where it is."""
        self.counters["combine"] += 1
        return self._to_home(rows, None, handle, weights.reshape(-1))[0], rows

    def combine_weighted_bwd(self, handle: PeerRowsHandle, d_out, weights, rows):
        """``d_rows[i] = w(i) * d_out[token(i)]`` and ``d_w(i) = <d_out[token(i)], rows[i]>``
        on the expert side (the output gradient and the weights pulled there together),
        then the (T, k) weight gradients pulled home."""
        self.counters["combine_backward"] += 1
        plan = handle.plan
        d, w_rows = self._to_experts(d_out, weights.reshape(-1), handle)
        d_rows, d_w_rows = kernels.row_weight_bwd(RowWeightRes(rows, w_rows), d)
        view = self._expose(None, d_w_rows, 0, handle.max_rows)
        _, d_w = pull_rows(view, handle.home_rank, handle.home_pos, rows=False,
                           num_programs=self.num_programs)
        return d_rows, d_w.reshape(plan.num_tokens, plan.top_k)
